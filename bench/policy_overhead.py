"""The cost of the parties' self-protection (call authentication, declared-operation and policy
checks, the differencing check), measured side by side in one run: the same mask federation on
the Credit split, one epoch each, with the guard as shipped and with the guard replaced by a
no-op (here only: the product has no switch to turn it off), interleaved over repeats.

Runs on the direct path (every role's round stages in one process, the same code the roles
run), so the ratio is the guard's share of the round work itself, without transport time that
would dilute it. The real multi-process runs report each role's guard time in metrics.json
(`roles.<party>.guard_seconds`, `roles.active.auth_seconds`); `bench/overhead.py` prints them.

    python bench/policy_overhead.py --data ../shared/data/credit_default.csv --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DEFAULT_DATA = REPO.parent / "shared" / "data" / "credit_default.csv"


def credit_config(data: Path, method: str, work: Path):
    from securevfl.config import parse_config

    raw = {
        "run": {"method": method, "aggregation": "mask", "seed": 0},
        "data": {"path": str(data.resolve()), "task": "binary", "test_fraction": 0.2},
        "parties": {
            f"p{i + 1}": {"columns": [f"X{j}" for j in range(5 * i + 1, 5 * i + 6)]}
            for i in range(4)
        },
        "train": {"epochs": 1, "batch_size": 256, "lr": 1e-3},
        "model": {"hidden": [64], "width": 16},
    }
    if method == "laser":
        raw["missing"] = {"train": {"kind": "mcar", "p": 0.5}}
    return parse_config(raw, source=work / "config.toml")


def one_epoch(data: Path, method: str, work: Path, *, guarded: bool) -> float:
    from securevfl.direct import DirectFederation
    from securevfl.roles import guard

    saved = (guard.CallGuard.authenticate, guard.CallGuard.check, guard.CallGuard.after)
    if not guarded:
        guard.CallGuard.authenticate = lambda self, *a, **k: None
        guard.CallGuard.check = lambda self, *a, **k: None
        guard.CallGuard.after = lambda self, *a, **k: None
    try:
        fed = DirectFederation(
            credit_config(data, method, work), run_dir=work / "run", record=False
        )
        started = time.perf_counter()
        fed.fit()
        return time.perf_counter() - started
    finally:
        guard.CallGuard.authenticate, guard.CallGuard.check, guard.CallGuard.after = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default="splitnn,laser")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "policy_overhead.json")
    args = ap.parse_args()
    if not args.data.exists():
        raise SystemExit(f"{args.data} not found; pass --data PATH/credit_default.csv")
    results = {}
    for method in args.methods.split(","):
        times: dict[str, list[float]] = {"guarded": [], "unguarded": []}
        for rep in range(args.repeats):
            for mode in ("guarded", "unguarded") if rep % 2 == 0 else ("unguarded", "guarded"):
                with tempfile.TemporaryDirectory() as tmp:
                    t = one_epoch(args.data, method, Path(tmp), guarded=mode == "guarded")
                times[mode].append(t)
                print(f"{method} {mode}: {t:.3f} s", flush=True)
        ratio = statistics.median(times["guarded"]) / statistics.median(times["unguarded"])
        results[method] = {**times, "ratio": ratio}
        print(f"{method}: guarded / unguarded epoch = {ratio:.3f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
