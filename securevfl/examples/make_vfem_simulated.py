"""Write the simulated table of `vfem_simulated.toml` (and a copy of the config) into a folder.

python securevfl/examples/make_vfem_simulated.py DIR [--n 2000] [--seed 0]
(`securevfl example vfem-simulated --out DIR` does the same at the defaults.)
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from securevfl.data.synthetic_tables import write_vfem_simulated_csv

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    write_vfem_simulated_csv(args.dir / "vfem_simulated.csv", args.n, args.seed)
    shutil.copy(HERE / "vfem_simulated.toml", args.dir / "vfem_simulated.toml")
    print(f"wrote {args.dir / 'vfem_simulated.csv'} and {args.dir / 'vfem_simulated.toml'}")


if __name__ == "__main__":
    main()
