"""Overhead of secure aggregation, measured side by side in one run: split-NN on the Credit split
(X1..X20 in four parties of five columns), batch 256, representation width 16, with `plain`,
`mask` and `ckks`, each a real multi-process federation over loopback ZeroMQ with CURVE.

    python bench/overhead.py --data ../shared/data/credit_default.csv \
        --out bench/results/overhead.json

Writes the JSON (epoch seconds, bytes per role, ratios to plain) and a PNG bar chart next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "credit_default.csv"

CONFIG = """
[run]
method = "splitnn"
aggregation = "{aggregation}"
seed = {seed}

[data]
path = "{data}"
id = "ID"
label = "Y"
task = "binary"
test_fraction = 0.2

[active]
columns = []

[policy]                   # a benchmark of plain against the secure modes: the parties accept all
aggregations = ["plain", "mask", "ckks"]

[parties.p1]
columns = ["X1", "X2", "X3", "X4", "X5"]
[parties.p2]
columns = ["X6", "X7", "X8", "X9", "X10"]
[parties.p3]
columns = ["X11", "X12", "X13", "X14", "X15"]
[parties.p4]
columns = ["X16", "X17", "X18", "X19", "X20"]

[train]
epochs = {epochs}
batch_size = 256
lr = 0.001

[model]
hidden = [64]
width = 16

[network]
heartbeat_interval = 1.0
peer_timeout = 30.0
round_timeout = 300.0
"""


def run_one(
    aggregation: str, *, data: Path, epochs: int, seed: int, work: Path, sets: list[str] = ()
) -> dict:
    d = work / aggregation
    d.mkdir(parents=True, exist_ok=True)
    config = d / "config.toml"
    config.write_text(
        CONFIG.format(aggregation=aggregation, seed=seed, data=data.resolve(), epochs=epochs)
    )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "securevfl", "run", str(config), "--out", str(d / "run")]
        + [a for kv in sets for a in ("--set", kv)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{aggregation} run failed:\n{done.stderr[-3000:]}")
    metrics = json.loads((d / "run" / "metrics.json").read_text())
    return {
        "aggregation": aggregation,
        "epoch_seconds": metrics["epoch_seconds"],
        "median_epoch_seconds": statistics.median(metrics["epoch_seconds"]),
        "wall_seconds": time.perf_counter() - started,
        "test": metrics["test"],
        "bytes": {
            r: {"sent": v["bytes_sent"], "received": v["bytes_received"]}
            for r, v in metrics["roles"].items()
        },
        "party_bytes_sent_per_epoch": metrics["roles"]["p1"]["bytes_sent"] / epochs,
        # the release policy's cost: the active party tagging calls, each party checking them
        "training_seconds": sum(metrics["epoch_seconds"]),
        "auth_seconds": metrics["roles"]["active"].get("auth_seconds", 0.0),
        "guard_seconds": {
            r: v.get("guard_seconds", 0.0) for r, v in metrics["roles"].items() if r.startswith("p")
        },
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(
        names,
        [results["runs"][n]["median_epoch_seconds"] for n in names],
        color=["#888", "#2a7", "#27c"],
    )
    axes[0].set_ylabel("median epoch time (s)")
    axes[0].set_title("split-NN, Credit, 4 parties, batch 256")
    axes[1].bar(
        names,
        [results["runs"][n]["party_bytes_sent_per_epoch"] / 2**20 for n in names],
        color=["#888", "#2a7", "#27c"],
    )
    axes[1].set_ylabel("MiB sent per party per epoch")
    axes[1].set_yscale("log")
    for ax in axes:
        for i, n in enumerate(names):
            if n != "plain":
                ax.annotate(
                    f"{results['ratios'][n]['epoch_time' if ax is axes[0] else 'bytes']:.1f}x",
                    (i, 0),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "overhead.json")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aggregations", default="plain,mask,ckks")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="interleaved repetitions (plain, mask, ckks, plain, ...) against drift",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="config override for every run, e.g. secure.bound=1024 (declared value bound)",
    )
    args = ap.parse_args()
    if not args.data.exists():
        raise SystemExit(f"{args.data} not found; pass --data PATH/credit_default.csv")
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for aggregation in args.aggregations.split(","):
                print(f"running {aggregation} (repeat {rep + 1}/{args.repeats}) ...", flush=True)
                r = run_one(
                    aggregation,
                    data=args.data,
                    epochs=args.epochs,
                    seed=args.seed,
                    work=Path(tmp) / f"rep{rep}",
                    sets=args.set,
                )
                print(
                    f"  median epoch {r['median_epoch_seconds']:.2f} s, "
                    f"{r['party_bytes_sent_per_epoch'] / 2**20:.2f} MiB/party/epoch, "
                    f"test {r['test']}",
                    flush=True,
                )
                if aggregation in runs:  # pool the epochs of every repeat
                    runs[aggregation]["epoch_seconds"] += r["epoch_seconds"]
                    runs[aggregation]["median_epoch_seconds"] = statistics.median(
                        runs[aggregation]["epoch_seconds"]
                    )
                else:
                    runs[aggregation] = r
    base = runs["plain"]
    ratios = {
        n: {
            "epoch_time": r["median_epoch_seconds"] / base["median_epoch_seconds"],
            "bytes": r["party_bytes_sent_per_epoch"] / base["party_bytes_sent_per_epoch"],
        }
        for n, r in runs.items()
    }
    guard = {
        n: {
            "active_auth_share": r["auth_seconds"] / r["training_seconds"],
            "party_guard_share_max": max(r["guard_seconds"].values()) / r["training_seconds"],
            # on 2 cores the roles share the CPU: the conservative total
            "total_share": (r["auth_seconds"] + sum(r["guard_seconds"].values()))
            / r["training_seconds"],
        }
        for n, r in runs.items()
    }
    results = {
        "benchmark": "split-NN Credit 4x5 columns, batch 256, width 16",
        "policy_overhead": guard,
        "epochs": args.epochs,
        "overrides": args.set,
        "command": " ".join(["python", "bench/overhead.py", *sys.argv[1:]]),
        "load_average": list(__import__("os").getloadavg()),
        "runs": runs,
        "ratios": ratios,
        "reference": {"FATE hetero-NN Paillier vs plain (published)": 143.0},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(
        "ratios to plain:", {n: {k: round(v, 2) for k, v in r.items()} for n, r in ratios.items()}
    )
    print(
        "call authentication and policy checks, share of training time:",
        {n: {k: f"{100 * v:.2f} %" for k, v in g.items()} for n, g in guard.items()},
    )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
