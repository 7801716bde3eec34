"""Write the simulated table of `vfem_simulated.toml` (and a copy of the config) into a folder.

python securevfl/examples/make_vfem_simulated.py DIR [--n 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from securevfl.data.table import write_csv

HERE = Path(__file__).resolve().parent
DIMS = (3, 2, 2)
BETA = np.array([1.0, -0.5, 0.8, 1.0, 0.5, -1.0, 0.6])
MISSING = (0.2, 0.4, 0.6)


def simulated_table(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x with empty (NaN) cells where a party lacks the row, y)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for p in DIMS:
        cov = 0.5 ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))
        blocks.append(rng.multivariate_normal(np.zeros(p), cov, size=n))
    x = np.concatenate(blocks, axis=1)
    y = 0.5 + x @ BETA + rng.normal(size=n)
    start = 0
    for p, rate in zip(DIMS, MISSING, strict=True):
        x[rng.random(n) < rate, start : start + p] = np.nan
        start += p
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    x, y = simulated_table(args.n, args.seed)
    args.dir.mkdir(parents=True, exist_ok=True)
    write_csv(
        args.dir / "vfem_simulated.csv",
        id_column="ID",
        ids=np.arange(1, args.n + 1),
        columns=[f"X{i + 1}" for i in range(x.shape[1])],
        values=x,
        label="Y",
        labels=y,
    )
    shutil.copy(HERE / "vfem_simulated.toml", args.dir / "vfem_simulated.toml")
    print(f"wrote {args.dir / 'vfem_simulated.csv'} and {args.dir / 'vfem_simulated.toml'}")


if __name__ == "__main__":
    main()
