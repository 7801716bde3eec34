"""Wall time of a whole short `securevfl run` (process start-up, set-up, training, exit) for one
or more code trees, interleaved, so that what a federation pays besides its epochs is compared
side by side in one run.

    python bench/run_wall.py --arm old=/path/to/older/checkout --arm new=. --repeats 5

Each repeat runs every arm once, in turn, on the same synthetic table (3 parties, 400 rows,
batch 16, mask; the tests' federation). The roles are started by that tree's own `securevfl
run` (`fedbench.role_environment`: the tree's code, one BLAS thread per role). Writes JSON with
every repeat and, per arm, the median and the range, and whether every arm gave the same test
metrics.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedbench import role_environment  # noqa: E402
from report import machine  # noqa: E402


def federation(directory: Path, *, epochs: int) -> Path:
    """The tests' 3-party synthetic federation (`conftest.BASE_RAW`, its table) as a config."""
    from securevfl.config import dump_toml
    from tests.securevfl.conftest import BASE_RAW, permissive_policy, synthetic_csv

    synthetic_csv(directory / "data.csv", n=400)
    raw = copy.deepcopy(BASE_RAW)
    raw["train"].update({"epochs": epochs, "batch_size": 16})
    path = directory / "config.toml"
    path.write_text(dump_toml(permissive_policy(raw)))
    return path


def one_run(tree: str, config: Path, out: Path) -> dict:
    env, cwd = role_environment(None if tree == "." else tree)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "securevfl", "run", str(config), "--out", str(out)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}: {done.stderr[-2000:]}")
    return {"wall_s": round(wall, 3), "metrics": json.loads((out / "metrics.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True, help="NAME=TREE (. = here)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/run_wall.json")
    args = parser.parse_args()
    arms = dict(a.split("=", 1) for a in args.arm)
    with tempfile.TemporaryDirectory() as work:
        config = federation(Path(work), epochs=args.epochs)
        runs: dict[str, list[float]] = {name: [] for name in arms}
        tests: dict[str, dict] = {}
        for r in range(args.repeats):
            for name, tree in arms.items():
                result = one_run(tree, config, Path(work) / f"run-{name}-{r}")
                runs[name].append(result["wall_s"])
                tests[name] = result["metrics"]["test"]
                print(f"repeat {r} {name}: {result['wall_s']:.2f} s", flush=True)
    summary = {
        name: {"median_s": statistics.median(w), "min_s": min(w), "max_s": max(w)}
        for name, w in runs.items()
    }
    same = len({json.dumps(t, sort_keys=True) for t in tests.values()}) == 1
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {**machine(), "python": platform.python_version()},
        "epochs": args.epochs,
        "arms": arms,
        "wall_s": runs,
        "summary": summary,
        "same_test_metrics": same,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name}: median {s['median_s']:.2f} s (range {s['min_s']:.2f}-{s['max_s']:.2f})")
    print(f"same test metrics in every arm: {same}; wrote {args.out}")


if __name__ == "__main__":
    main()
