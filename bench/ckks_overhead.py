"""CKKS against plain on Credit (split-NN, 4 parties x 5 columns, batch 256, width 16), side by side
in one run: plain, ckks with the parameters a run sizes from the default value bound
([secure] bound = 2^20) and ckks with ``[secure] ckks.magnitude`` declared (default 1024),
interleaved per repeat, each a real multi-process federation over loopback ZeroMQ + CURVE
(`bench/fedbench.py`). Records per run: epoch times, bytes sent per party per epoch, CPU
seconds per role (wait4), the CKKS parameters each run chose and their security level, and the
ratios to plain (epoch median and bytes), with the load average before each run.

    nice -n 5 python bench/ckks_overhead.py --epochs 2 --repeats 2 \\
        --out bench/results/ckks_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fedbench as F  # noqa: E402

from crypto.ckks import choose_params, security_level  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def variants(magnitude: float) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (aggregation, extra [secure] keys)."""
    return {
        "plain": ("plain", {}),
        "ckks": ("ckks", {}),
        f"ckks-m{magnitude:g}": ("ckks", {"ckks.magnitude": magnitude}),
    }


def chosen(secure: dict[str, Any], parties: int) -> dict[str, Any]:
    """The CKKS parameters a run with these [secure] keys sizes (as securevfl.secure_sum)."""
    magnitude = secure.get("ckks.magnitude", 2.0**20)
    sizing = choose_params(precision_bits=12, magnitude=magnitude, terms=parties + 1)
    return {**sizing.as_dict(), "security_bits_by_table": security_level(sizing.params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=F.CREDIT)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ckks_overhead.json")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--magnitude", type=float, default=1024.0)
    args = ap.parse_args()
    ds = F.credit(args.data, parties=4)
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ckks-overhead-") as tmp:
        prep = F.prepare(ds, Path(tmp))
        for rep in range(args.repeats):
            for label, (aggregation, secure) in variants(args.magnitude).items():
                raw = F.config_raw(ds, aggregation=aggregation, epochs=args.epochs)
                if secure:
                    raw["secure"] = dict(secure)
                print(f"{label} (repeat {rep + 1}/{args.repeats}) ...", flush=True)
                r = F.run_federation(prep, raw, Path(tmp) / f"r{rep}-{label}")
                if not r.get("ok"):
                    raise SystemExit(f"{label} failed: {r.get('error', r.get('exit_codes'))}")
                r["cpu_seconds_all_roles"] = round(sum(r["cpu_seconds"].values()), 2)
                if aggregation == "ckks":
                    r["ckks_params"] = chosen(secure, len(ds.parties))
                print(
                    f"  epochs {r['epoch_seconds']} s, "
                    f"{r['party_bytes_sent_per_epoch'] / 2**20:.2f} MiB/party/epoch, "
                    f"CPU {r['cpu_seconds_all_roles']} s (all roles), load {r['load_before']}",
                    flush=True,
                )
                runs.setdefault(label, []).append(r)
    summary: dict[str, Any] = {}
    for label, rs in runs.items():
        epochs = [e for r in rs for e in r["epoch_seconds"]]
        summary[label] = {
            "median_epoch_seconds": statistics.median(epochs),
            "epochs_pooled": len(epochs),
            "party_bytes_sent_per_epoch": statistics.median(
                r["party_bytes_sent_per_epoch"] for r in rs
            ),
            "cpu_seconds_all_roles": statistics.median(r["cpu_seconds_all_roles"] for r in rs),
            "test": rs[0]["test"],
        }
    base = summary["plain"]
    for s in summary.values():
        s["epoch_ratio"] = s["median_epoch_seconds"] / base["median_epoch_seconds"]
        s["bytes_ratio"] = s["party_bytes_sent_per_epoch"] / base["party_bytes_sent_per_epoch"]
        s["extra_cpu_seconds_per_epoch"] = (
            s["cpu_seconds_all_roles"] - base["cpu_seconds_all_roles"]
        ) / args.epochs
    result = {
        "benchmark": "split-NN Credit 4x5 columns, batch 256, width 16; plain vs ckks",
        "command": "python " + " ".join(["bench/ckks_overhead.py", *sys.argv[1:]]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "epochs": args.epochs,
        "repeats": args.repeats,
        "floors": {"epoch_ratio": 1.5, "bytes_ratio": 10.0},
        "summary": summary,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for label, s in summary.items():
        print(
            f"{label:>12}: epoch {s['median_epoch_seconds']:.2f} s ({s['epoch_ratio']:.2f}x), "
            f"{s['party_bytes_sent_per_epoch'] / 2**20:.2f} MiB/party/epoch "
            f"({s['bytes_ratio']:.2f}x), +{s['extra_cpu_seconds_per_epoch']:.2f} CPU s/epoch"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
