"""What pipelining costs the model: test metrics of split-NN on Credit at pipeline depths d
against the unpipelined run (d = 0), after E epochs, over seeds.

`[network] pipeline_depth = d` keeps the forwards of the next d batches in flight while a
batch's gradient travels, so a party's representation is up to d updates stale (the price
of hiding a WAN's latency, see the README's "Pipelined batches"). This script measures that
price as training goes on: every run trains through the engine's own round stages in one
thread (`securevfl.direct.DirectFederation`, plain sums: a pipelined run is deterministic and
gives the same model over ZeroMQ, `tests/securevfl/test_pipeline.py`), so it measures the
model, not the machine.

    python bench/staleness.py [--depths 0,2,4,8] [--epochs 2,5,10] [--seeds 0,1,2]
                              [--parties 4] [--data CSV] [--out FILE.json]

Writes the JSON (every run's test metrics), a Markdown table and a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for path in (str(ROOT), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

import fedbench as F  # noqa: E402

METRIC = "roc_auc"


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def one_run(ds: Any, *, depth: int, epochs: int, seed: int, work: Path) -> dict[str, Any]:
    """Train split-NN on `ds` at `depth` for `epochs` with `seed`; its test metrics."""
    from securevfl.config import load_config
    from securevfl.direct import DirectFederation

    raw = F.config_raw(ds, aggregation="plain", epochs=epochs, seed=seed)
    raw["network"]["pipeline_depth"] = depth
    name = f"d{depth}_e{epochs}_s{seed}"
    cfg = load_config(F.write_toml(raw, work / f"{name}.toml"))
    started = time.perf_counter()
    metrics = DirectFederation(cfg, run_dir=work / name, record=False).run()
    return {
        "depth": depth,
        "epochs": epochs,
        "seed": seed,
        "seconds": round(time.perf_counter() - started, 2),
        "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)},
    }


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (depth, epochs): the metric's mean over seeds, and its mean difference to depth 0 of
    the same seed and epochs (paired)."""
    by = {(r["depth"], r["epochs"], r["seed"]): r["metrics"][METRIC] for r in runs}
    rows = []
    for depth, epochs in sorted({(r["depth"], r["epochs"]) for r in runs}):
        seeds = sorted(s for d, e, s in by if (d, e) == (depth, epochs))
        values = [by[(depth, epochs, s)] for s in seeds]
        paired = [
            by[(depth, epochs, s)] - by[(0, epochs, s)] for s in seeds if (0, epochs, s) in by
        ]
        rows.append(
            {
                "depth": depth,
                "epochs": epochs,
                "seeds": len(seeds),
                METRIC: statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "minus_depth0": statistics.fmean(paired) if paired else None,
                "paired_min": min(paired) if paired else None,
                "paired_max": max(paired) if paired else None,
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"| depth | epochs | seeds | test {METRIC} (mean) | range "
        "| minus depth 0, same seed (mean) | range |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["table"]:
        diff = row["minus_depth0"]
        shown = "-" if diff is None or row["depth"] == 0 else f"{diff:+.4f}"
        span = (
            "-"
            if diff is None or row["depth"] == 0
            else f"{row['paired_min']:+.4f} … {row['paired_max']:+.4f}"
        )
        lines.append(
            f"| {row['depth']} | {row['epochs']} | {row['seeds']} | {row[METRIC]:.4f} "
            f"| {row['min']:.4f} … {row['max']:.4f} | {shown} | {span} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for depth in sorted({r["depth"] for r in result["table"]}):
        rows = [r for r in result["table"] if r["depth"] == depth]
        ax.plot(
            [r["epochs"] for r in rows], [r[METRIC] for r in rows], marker="o", label=f"d={depth}"
        )
    ax.set_xlabel("epochs")
    ax.set_ylabel(f"test {METRIC} (mean over seeds)")
    ax.set_title("split-NN on Credit: pipeline depth against the model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="0,2,4,8")
    ap.add_argument("--epochs", default="2,5,10")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--parties", type=int, default=4)
    ap.add_argument("--data", type=Path, default=F.CREDIT)
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "staleness.json")
    args = ap.parse_args(argv)
    depths, epochs, seeds = ints(args.depths), ints(args.epochs), ints(args.seeds)
    if 0 not in depths:
        ap.error("--depths must include 0, the run every depth is compared with")
    ds = F.credit(args.data, parties=args.parties)
    runs = []
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        for seed in seeds:
            for e in epochs:
                for d in depths:
                    run = one_run(ds, depth=d, epochs=e, seed=seed, work=Path(tmp))
                    print(
                        f"seed={seed} epochs={e} depth={d} {METRIC}={run['metrics'][METRIC]:.4f}"
                        f" ({run['seconds']} s)",
                        flush=True,
                    )
                    runs.append(run)
    result = {
        "command": "python bench/staleness.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "data": str(args.data),
        "parties": args.parties,
        "model": "split-NN, hidden [64], width 16, Adam lr 1e-3, batch 256",
        "runs": runs,
    }
    result["table"] = table(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    plot(result, args.out.with_suffix(".png"))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
