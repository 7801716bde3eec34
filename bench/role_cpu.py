"""CPU seconds of every role of a whole real federation (from wait4: start-up, set-up, training
and exit), for one or more code trees side by side, interleaved: what a change to the roles'
start-up or per-call work costs in CPU, which the wall time of a short run on a shared
machine shows only through its noise.

    python bench/role_cpu.py --arm before=/path/to/older/checkout --arm after=. [--repeats 3]
        [--epochs 1] [--data credit_default.csv] [--parties 4] [--out FILE.json]

Each repeat runs every arm once on Credit (split-NN, plain, `fedbench.credit`); the JSON has
every run's CPU seconds per role and, per arm, the median per role and of the total.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fedbench as F  # noqa: E402


def arm_summary(runs: list[dict]) -> dict:
    """Median CPU seconds per role and of the total over an arm's runs."""
    roles = sorted({role for r in runs for role in r["cpu_seconds"]})
    return {
        "median_total_s": round(statistics.median(sum(r["cpu_seconds"].values()) for r in runs), 3),
        "median_per_role_s": {
            role: round(statistics.median(r["cpu_seconds"][role] for r in runs), 3)
            for role in roles
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME=TREE (. = here)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--data", type=Path, default=F.CREDIT)
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "role_cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    arms = [a.split("=", 1) for a in args.arm]
    ds = F.credit(args.data, parties=args.parties)
    prep = F.prepare(ds, args.work)
    runs = []
    for repeat in range(args.repeats):
        for name, tree in arms:
            raw = F.config_raw(ds, aggregation="plain", epochs=args.epochs)
            out = args.work / f"{name}-{repeat}"
            result = F.run_federation(prep, raw, out, pythonpath=None if tree == "." else tree)
            cpu = result.get("cpu_seconds") or {}
            print(f"rep={repeat} {name}: total CPU {sum(cpu.values()):.2f} s {cpu}", flush=True)
            runs.append({"arm": name, "repeat": repeat, "cpu_seconds": cpu, "ok": result.get("ok")})
    table = {name: arm_summary([r for r in runs if r["arm"] == name]) for name, _ in arms}
    for name, row in table.items():
        print(name, row)
    F.write_result(
        {
            "command": "python " + " ".join(sys.argv),
            "machine": F.cpu_model(),
            "table": table,
            "runs": runs,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
