"""Fixed-seed metrics of every method and backend, recorded before the method layer was reshaped
(issue 11) and held since: a refactor of the method kit, the roles or the secure sums must not
change what a run computes.

Tolerances: plain and mask 1e-6 (mask is deterministic: the masks cancel exactly and fixed-point
rounding is a function of the values); ckks 2e-3 absolute (CKKS decryption is approximate and
its encryption noise is fresh in every run, and decrypted sums are rounded and noise-flooded
before use, so training follows a slightly different path).

Regenerate (only when a change of results is intended, and say why in the commit):

    python tests/securevfl/test_method_goldens.py --write
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.securevfl.conftest import permissive_policy

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))

GOLDENS = Path(__file__).with_name("goldens.json")
NETWORK = {
    "heartbeat_interval": 0.2,
    "peer_timeout": 5.0,
    "round_timeout": 60.0,
    "startup_timeout": 60.0,
}
BLOCK_METHODS = ("laser", "local", "ensemble", "standard-vfl", "combinatorial", "plugvfl")
REGRESSION_METHODS = ("vfem", "cc-ols", "impute-ols", "single-ols")


def _cases() -> list[tuple[str, str]]:
    cases = [("splitnn", agg) for agg in ("plain", "mask", "ckks")]
    cases += [(m, agg) for m in BLOCK_METHODS for agg in ("plain", "mask")]
    cases += [("laser", "ckks")]
    cases += [(m, agg) for m in REGRESSION_METHODS for agg in ("plain", "mask")]
    return cases


CASES = _cases()


def _classification_csv(path: Path, *, n: int = 480, blocks: int = 3, cols: int = 2) -> list:
    from securevfl.data.table import write_csv

    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, blocks * cols))
    w = rng.normal(size=blocks * cols)
    y = (x @ w + 0.5 * rng.normal(size=n) > 0).astype(float)
    names = [f"X{i + 1}" for i in range(blocks * cols)]
    write_csv(
        path, id_column="ID", ids=np.arange(1, n + 1), columns=names, values=x, label="Y", labels=y
    )
    return [names[b * cols : (b + 1) * cols] for b in range(blocks)]


def _regression_csv(path: Path, *, n: int = 400) -> list:
    from securevfl.data.table import write_csv

    rng = np.random.default_rng(11)
    dims = (2, 2, 2)
    x = rng.normal(size=(n, sum(dims)))
    y = 0.5 + x @ np.array([1.0, -0.5, 0.8, 0.3, -1.0, 0.6]) + rng.normal(size=n)
    start = 0
    for d, rate in zip(dims, (0.1, 0.2, 0.3), strict=True):
        x[rng.random(n) < rate, start : start + d] = np.nan
        start += d
    names = [f"X{i + 1}" for i in range(sum(dims))]
    write_csv(
        path, id_column="ID", ids=np.arange(1, n + 1), columns=names, values=x, label="Y", labels=y
    )
    return [names[0:2], names[2:4], names[4:6]]


def case_config(method: str, aggregation: str, directory: Path) -> dict[str, Any]:
    """The raw (TOML-shaped) config of one case; data written into `directory`."""
    raw: dict[str, Any] = {
        # goldens recorded from the run's seed: every party's initial model from it
        "run": {"method": method, "aggregation": aggregation, "seed": 3, "shared_init": True},
        "network": dict(NETWORK),
    }
    if method in REGRESSION_METHODS:
        groups = _regression_csv(directory / "data.csv")
        raw["data"] = {"path": "data.csv", "task": "regression", "test_fraction": 0.25}
        raw["active"] = {"columns": []}
        raw["parties"] = {f"r{i}": {"columns": g} for i, g in enumerate(groups)}
        raw["method"] = {"se": "sem"}
        if method == "single-ols":
            raw["method"]["party"] = "r0"
            raw["run"]["min_group"] = 1
        return raw
    groups = _classification_csv(directory / "data.csv")
    raw["data"] = {"path": "data.csv", "task": "binary", "test_fraction": 0.25}
    raw["train"] = {"epochs": 2, "batch_size": 32, "lr": 0.01}
    raw["model"] = {"hidden": [8], "width": 4}
    if method == "splitnn":
        raw["active"] = {"columns": []}
        raw["parties"] = {f"p{i}": {"columns": g} for i, g in enumerate(groups)}
        return raw
    # a block method: the active party holds the last block, rows are missing at random
    raw["active"] = {"columns": groups[-1]}
    raw["parties"] = {f"p{i}": {"columns": g} for i, g in enumerate(groups[:-1])}
    raw["parties"]["p2"] = {"columns": ["X7"]}
    raw["missing"] = {"train": {"kind": "mcar", "p": 0.3}, "test": {"kind": "mcar", "p": 0.3}}
    if method in ("local", "ensemble") and aggregation != "plain":
        raw["run"]["min_group"] = 1
    return raw


def _extend_data(directory: Path) -> None:
    """Block cases give party p2 one more column (X7)."""
    import csv

    path = directory / "data.csv"
    rows = list(csv.reader(path.open()))
    rng = np.random.default_rng(5)
    rows[0].insert(-1, "X7")
    for row in rows[1:]:
        row.insert(-1, repr(float(rng.normal())))
    with path.open("w", newline="") as fh:
        csv.writer(fh).writerows(rows)


def summarise(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a golden holds: the test metrics, each epoch's loss, and coefficient tables."""
    out: dict[str, Any] = {
        "test": {k: v for k, v in metrics["test"].items() if isinstance(v, int | float)},
        "loss": [h["loss"] for h in metrics.get("history", []) if "loss" in h],
    }
    if "coefficients" in metrics:
        out["estimate"] = [r["estimate"] for r in metrics["coefficients"]]
        out["se"] = [r["se"] for r in metrics["coefficients"]]
    return out


def run_case(method: str, aggregation: str, directory: Path) -> dict[str, Any]:
    from securevfl.config import parse_config

    raw = case_config(method, aggregation, directory)
    if method in BLOCK_METHODS:
        _extend_data(directory)
    if aggregation == "ckks":  # real processes: ckks never runs with the key next to the sums
        from tests.securevfl.conftest import securevfl_cli, write_toml

        path = write_toml(raw, directory / "config.toml")
        done = securevfl_cli("run", str(path), "--out", str(directory / "run"), timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        metrics = json.loads((directory / "run" / "metrics.json").read_text())
        return summarise(metrics)
    from securevfl.inproc import run_federation

    raw["run"]["transport"] = "inproc"
    cfg = parse_config(permissive_policy(raw), source=directory / "config.toml")
    code, metrics = run_federation(cfg, out=directory / "run")
    assert code == 0 and metrics is not None, (directory / "run" / "logs").glob("*")
    return summarise(metrics)


def _close(a: Any, b: Any, tol: float, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _close(a[k], b[k], tol, f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, tol, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: {a} != {b}"
    else:
        scale = max(1.0, abs(float(b)))
        assert abs(float(a) - float(b)) <= tol * scale, f"{where}: {a} != golden {b}"


@pytest.mark.parametrize(("method", "aggregation"), CASES, ids=[f"{m}-{a}" for m, a in CASES])
def test_fixed_seed_metrics_equal_the_recorded_ones(method, aggregation, tmp_path):
    if aggregation == "ckks":
        pytest.importorskip("tenseal")
    goldens = json.loads(GOLDENS.read_text())
    got = run_case(method, aggregation, tmp_path)
    tol = 2e-3 if aggregation == "ckks" else 1e-6
    _close(got, goldens[f"{method}/{aggregation}"], tol, f"{method}/{aggregation}")


@pytest.mark.parametrize("method", sorted({m for m, a in CASES if a == "ckks"}))
def test_a_ckks_golden_is_its_masked_golden_within_the_ckks_tolerance(method):
    """A run over CKKS trains the model the masked sum trains (the same seed, up to CKKS's
    approximate sums): each ckks case's golden holds to the mask case's golden, so a ckks run
    that passes its own golden is within twice the ckks tolerance of the masked run."""
    goldens = json.loads(GOLDENS.read_text())
    _close(goldens[f"{method}/ckks"], goldens[f"{method}/mask"], 2e-3, f"{method}: ckks vs mask")


def main() -> None:
    if "--write" not in sys.argv:
        print(__doc__)
        return
    out = {}
    for method, aggregation in CASES:
        with tempfile.TemporaryDirectory() as d:
            out[f"{method}/{aggregation}"] = run_case(method, aggregation, Path(d))
            print(method, aggregation, out[f"{method}/{aggregation}"]["test"], flush=True)
    GOLDENS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDENS}")


if __name__ == "__main__":
    main()
