"""Latency hiding under an emulated WAN: the masked split-NN epoch on Credit (4 parties, batch
256) with message batching per round (`[network] fuse_rounds = true`: a batch's backward rides in
the envelope of the next batch's forward) at each pipeline depth asked (`--depths`: `[network]
pipeline_depth`, the forwards of the next d batches in flight while a batch's sum is awaited)
against the unfused protocol (`false`: a forward and a separate backward round trip per batch),
side by side in one invocation, on loopback and behind `bench/wanproxy.py` (RTT added per round
trip, 100 Mbit/s per direction and connection).

Every run is a real federation (`bench/fedbench.py`: one OS process per role, ZeroMQ with CURVE
over TCP); fused and unfused runs of one network point follow each other, so they see the same
machine load. Writes JSON (every run, and per point and protocol the median epoch, its ratios
to the same protocol's loopback epoch and to the fused depth-0 epoch, and the test ROC-AUC).

    nice -n 5 python bench/latency.py [--quick] [--rtts loopback,0,10,50] [--epochs 2]
        [--depths 0,4,8,16] [--no-unfused] [--mbit 100] [--out bench/results/latency.json]
        [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fedbench  # noqa: E402


def _rtt(text: str) -> float | None:
    return None if text == "loopback" else float(text)


def _net(rtt: float | None) -> str:
    return "loopback" if rtt is None else f"{rtt:g}ms"


def variants(depths: list[int], *, unfused: bool) -> list[tuple[bool, int]]:
    """(fuse_rounds, pipeline_depth) of each protocol compared: fused at every depth, and the
    unfused protocol (depth 0) when asked."""
    out = [(True, d) for d in depths]
    return out + [(False, 0)] if unfused else out


def _name(fused: bool, depth: int) -> str:
    return f"depth {depth}" if fused else "unfused"


def run(
    *,
    rtts: list[float | None],
    epochs: int,
    mbit: float,
    work: Path,
    batch_size: int = 256,
    parties: int = 4,
    repeats: int = 1,
    depths: tuple[int, ...] = (0,),
    unfused: bool = True,
    log: Any = print,
) -> dict[str, Any]:
    ds = fedbench.credit(parties=parties)
    if not ds.path.exists():
        raise SystemExit(f"{ds.path} not found: the Credit table is needed (see bench/report.py)")
    prep = fedbench.prepare(ds, work)
    runs = []
    order = [(rep, rtt) for rep in range(repeats) for rtt in rtts]
    protocols = variants(list(depths), unfused=unfused)
    for i, (rep, rtt) in enumerate(order):
        # the protocols of one point back to back, the order reversed every other point
        for fused, depth in protocols if i % 2 == 0 else protocols[::-1]:
            raw = fedbench.config_raw(ds, aggregation="mask", epochs=epochs, batch_size=batch_size)
            raw["network"]["fuse_rounds"] = fused
            raw["network"]["pipeline_depth"] = depth
            name = _name(fused, depth)
            label = f"mask {_net(rtt)} {name} (repeat {rep + 1})"
            log(f"{time.strftime('%H:%M:%S')} {label} ...")
            r = fedbench.run_federation(
                prep,
                raw,
                work / "runs" / f"r{rep}-{_net(rtt)}-{name.replace(' ', '')}",
                rtt_ms=rtt,
                mbit=mbit,
            )
            r["fuse_rounds"] = fused
            r["pipeline_depth"] = depth
            r["protocol"] = name
            r["network"] = _net(rtt)
            r["repeat"] = rep
            runs.append(r)
            if not r.get("ok"):
                log(f"  FAILED: {r.get('error', r.get('exit_codes'))}")
            else:
                log(
                    f"  epochs {r['epoch_seconds']} s (median {r['median_epoch_seconds']:.2f}), "
                    f"test {r.get('test')}, load {r['load_before']} -> {r['load_after']}"
                )
    return {"runs": runs, "points": points(runs)}


def points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per network point and protocol (``unfused``, ``depth d``: fused with pipeline_depth d):
    the median epoch (over every epoch of every repeat), its ratio to the same protocol's
    loopback epoch, to the fused depth-0 epoch on loopback and to the fused depth-0 epoch at
    the same point, and the test ROC-AUC."""
    import numpy as np

    epochs: dict[tuple[str, str], list[float]] = {}
    auc: dict[tuple[str, str], Any] = {}
    for r in runs:
        name = r.get("protocol") or _name(r["fuse_rounds"], r.get("pipeline_depth", 0))
        if r.get("ok"):
            epochs.setdefault((r["network"], name), []).extend(r["epoch_seconds"])
            auc[r["network"], name] = (r.get("test") or {}).get("roc_auc")
    med = {k: float(np.median(v)) for k, v in epochs.items()}
    out = []
    for net in dict.fromkeys(r["network"] for r in runs):
        for name in dict.fromkeys(
            r.get("protocol") or _name(r["fuse_rounds"], r.get("pipeline_depth", 0)) for r in runs
        ):
            row: dict[str, Any] = {"network": net, "protocol": name}
            if (net, name) not in med:
                row["epoch_s"] = None
                out.append(row)
                continue
            e = med[net, name]
            row["epoch_s"] = round(e, 3)
            row["epochs_measured"] = len(epochs[net, name])
            if ("loopback", name) in med:
                row["vs_own_loopback"] = round(e / med["loopback", name], 3)
            if ("loopback", "depth 0") in med:
                row["vs_depth0_loopback"] = round(e / med["loopback", "depth 0"], 3)
            if (net, "depth 0") in med:
                row["vs_depth0_here"] = round(e / med[net, "depth 0"], 3)
            row["test_auc"] = auc[net, name]
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch, loopback and 10 ms only")
    ap.add_argument("--rtts", default="loopback,0,10,50", help="network points (ms or loopback)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="every point this many times")
    ap.add_argument("--mbit", type=float, default=100.0)
    ap.add_argument(
        "--depths",
        default="0",
        help="fused protocols to compare: [network] pipeline_depth values, e.g. 0,4,8,16",
    )
    ap.add_argument(
        "--no-unfused", action="store_true", help="leave out the unfused protocol (fuse_rounds off)"
    )
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "latency.json")
    ap.add_argument("--work", type=Path, default=Path("/tmp/securevfl-latency"))
    args = ap.parse_args(argv)
    rtts = [_rtt(x) for x in ("loopback,10" if args.quick else args.rtts).split(",")]
    epochs = 1 if args.quick else args.epochs
    started = time.time()
    repeats = 1 if args.quick else args.repeats
    depths = tuple(int(d) for d in args.depths.split(","))
    result = run(
        rtts=rtts,
        epochs=epochs,
        mbit=args.mbit,
        work=args.work,
        repeats=repeats,
        depths=depths,
        unfused=not args.no_unfused,
    )
    result.update(
        {
            "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "setup": {
                "dataset": "credit (30000 rows, X1..X20 in 4 blocks of 5)",
                "method": "splitnn",
                "aggregation": "mask",
                "batch_size": 256,
                "epochs": epochs,
                "mbit": args.mbit,
                "repeats": repeats,
                "pipeline_depths": list(depths),
                "unfused": not args.no_unfused,
                "median_of": f"{epochs} epoch(s) x {repeats} run(s) per point",
            },
            "machine": {
                "cpus": __import__("os").cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "minutes": round((time.time() - started) / 60, 1),
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    for row in result["points"]:
        print(json.dumps(row))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
