"""A passive party's differencing guard (`securevfl.roles.guard.FamilyGuard`) over an evaluation:
many calls of fresh rows summed over the same group, as a held-out evaluation of n rows in calls
of `--chunk` rows asks of every party. Prints and writes the seconds each call count takes,
optionally for an older copy of the code side by side (`--tree DIR`, e.g. `git archive` of an
earlier commit), each in a fresh process.

    python bench/family_guard.py [--calls 100,300,1000] [--chunk 4096] [--tree DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
import numpy as np
from securevfl.roles.guard import FamilyGuard
calls, chunk = int(sys.argv[1]), int(sys.argv[2])
guard, group = FamilyGuard(min_group=2), [frozenset(("p1", "p2", "p3", "p4"))]
started = time.perf_counter()
for c in range(calls):
    assert guard.admit("rep", np.arange(c * chunk, (c + 1) * chunk), group) is None
print(json.dumps({"calls": calls, "rows": calls * chunk, "seconds": time.perf_counter() - started}))
"""


def measure(tree: Path, calls: int, chunk: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(calls), str(chunk)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="100,300,1000")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--tree", type=Path, default=None, help="an older copy of the code to compare")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    trees = {"this": REPO} | ({"other": args.tree.resolve()} if args.tree else {})
    rows = []
    for calls in (int(c) for c in args.calls.split(",")):
        for name, tree in trees.items():  # interleaved, so a load change hits both
            row = {"tree": name, **measure(tree, calls, args.chunk)}
            print(f"{name:6s} {calls:6d} calls of {args.chunk} rows: {row['seconds']:.3f} s")
            rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
