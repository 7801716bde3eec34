"""Private set intersection cost: `securevfl align` between the label holder and one party with
N identifiers each and half of them shared, the two roles as separate processes over loopback
CurveZMQ. Writes the intersection size, seconds and bytes to JSON.

    python bench/psi.py --n 1000000 --out bench/results/psi.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "psi.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        half = args.n // 2
        with (d / "a.csv").open("w") as fh:
            fh.write("id,y\n")
            fh.writelines(f"c{i},1\n" for i in range(half))
            fh.writelines(f"a{i},0\n" for i in range(args.n - half))
        with (d / "b.csv").open("w") as fh:
            fh.write("id,v\n")
            fh.writelines(f"b{i},1\n" for i in range(args.n - half))
            fh.writelines(f"c{i},0\n" for i in range(half))
        (d / "config.toml").write_text(
            '[run]\nmin_group = 1\n[data]\npath = "a.csv"\nid = "id"\nlabel = "y"\n'
            '[parties.bank]\ncolumns = ["v"]\n[policy]\nmin_group = 1\n'
        )
        from securevfl.keys import generate_keys
        from securevfl.launcher import free_port

        generate_keys(["active", "bank"], d / "keys")
        address = f"tcp://127.0.0.1:{free_port()}"
        base = [
            sys.executable,
            "-m",
            "securevfl",
            "align",
            "--config",
            str(d / "config.toml"),
            "--out",
            str(d / "out"),
            "--keys",
            str(d / "keys"),
            "--bind",
            address,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        load_before = os.getloadavg()
        started = time.perf_counter()
        procs = [
            subprocess.Popen([*base, "--role", "active", "--data", str(d / "a.csv")], env=env),
            subprocess.Popen([*base, "--role", "bank", "--data", str(d / "b.csv")], env=env),
        ]
        codes = [p.wait() for p in procs]
        wall = time.perf_counter() - started
        if any(codes):
            raise SystemExit(f"alignment failed: exit statuses {codes}")
        summary = json.loads((d / "out" / "aligned" / "summary.json").read_text())
    bank = summary["parties"]["bank"]
    result = {
        "ids_per_side": args.n,
        "intersection": bank["intersection"],
        "seconds_protocol": bank["seconds"],
        "seconds_wall": round(wall, 2),
        "bytes": bank["bytes_sent"] + bank["bytes_received"],
        "bytes_per_id": round((bank["bytes_sent"] + bank["bytes_received"]) / (2 * args.n), 1),
        "command": "python bench/psi.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "notes": (
            "two processes (label holder, party) over loopback CurveZMQ; seconds_protocol: the "
            "label holder's time for the PSI with the party, every bucket; seconds_wall: both "
            "processes from start to exit (reading the ids, writing the aligned files); bytes: "
            "application frames both ways (CURVE and heartbeats not counted)"
        ),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
