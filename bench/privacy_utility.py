"""Privacy-utility of label DP on the Credit split: test F1 and label-inference AUC against the
label-DP epsilon.

Split-NN on "default of credit card clients" (X1..X20 held by four passive parties of five
columns, the labels at the active party), plain aggregation (the fast in-process path: the
secure sum does not change what the passive parties receive), label DP with sigma calibrated
for each target epsilon before training (`[privacy] label_dp = { target_epsilon, clip }`),
epsilon = inf meaning no label DP. Every passive party records the gradients it receives, and
`securevfl audit --attack` scores the norm and direction attacks against the true labels.

    python bench/privacy_utility.py --data ../shared/data/credit_default.csv \\
        --out bench/results/privacy_utility.json [--seeds 0 1 2] [--eps 0.5 1 2 4 8 inf] \\
        [--epochs 10]

Writes the JSON (one record per run, and per-epsilon means and standard deviations) and a PNG
of F1 and attack AUC against epsilon next to it. Not part of CI (minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_DATA = REPO.parent / "shared" / "data" / "credit_default.csv"


def credit_config(
    *, data: Path, seed: int, epochs: int, eps: float, clip: float, batch_size: int, lr: float
) -> dict:
    raw = {
        # shared_init: a benchmark, reproducible from its seed
        "run": {"method": "splitnn", "aggregation": "plain", "seed": seed, "shared_init": True},
        # the label-DP sweep runs plain (what the parties receive does not depend on it)
        "policy": {"aggregations": ["plain"], "config_seeds": True},
        "data": {
            "path": str(data.resolve()),
            "id": "ID",
            "label": "Y",
            "task": "binary",
            "test_fraction": 0.2,
        },
        "active": {"columns": []},
        "parties": {
            f"p{k + 1}": {"columns": [f"X{5 * k + j + 1}" for j in range(5)]} for k in range(4)
        },
        "train": {"epochs": epochs, "batch_size": batch_size, "lr": lr},
        "model": {"hidden": [64], "width": 16},
        "network": {
            "heartbeat_interval": 1.0,
            "peer_timeout": 60.0,
            "round_timeout": 600.0,
            "startup_timeout": 120.0,
        },
        "privacy": {"record_received": True},
    }
    if math.isfinite(eps):
        raw["privacy"]["label_dp"] = {"target_epsilon": eps, "clip": clip}
    return raw


def run_one(
    *,
    data: Path,
    seed: int,
    epochs: int,
    eps: float,
    clip: float,
    batch_size: int,
    lr: float,
    work: Path,
) -> dict:
    from securevfl.config import parse_config
    from securevfl.inproc import run_federation
    from securevfl.privacy.run_audit import audit_run

    raw = credit_config(
        data=data, seed=seed, epochs=epochs, eps=eps, clip=clip, batch_size=batch_size, lr=lr
    )
    run_dir = work / f"eps{eps}-seed{seed}"
    cfg = parse_config(raw, source=run_dir / "config.toml")
    started = time.perf_counter()
    code, metrics = run_federation(cfg, out=run_dir)
    if code != 0 or metrics is None:
        raise SystemExit(
            f"run eps={eps} seed={seed} failed with status {code}; see {run_dir / 'logs'}"
        )
    report = audit_run(run_dir, attack=True)
    leak = list(report.leakage.values())
    label_rows = [r for r in report.rows if r.mechanism == "label_dp"]
    return {
        "eps_target": eps if math.isfinite(eps) else None,
        "seed": seed,
        "epsilon_ledger": label_rows[0].epsilon if label_rows else None,
        "delta": label_rows[0].delta if label_rows else None,
        "noise_multiplier": label_rows[0].noise_multipliers[0] if label_rows else None,
        "f1": metrics["test"]["f1"],
        "roc_auc": metrics["test"]["roc_auc"],
        "accuracy": metrics["test"]["accuracy"],
        # every passive party receives the same dL/dS in split-NN: the mean is over parties
        "attack_norm_auc": statistics.fmean(m.norm_auc for m in leak),
        "attack_direction_auc": statistics.fmean(m.direction_auc for m in leak),
        "attack_rows": leak[0].rows,
        "seconds": time.perf_counter() - started,
    }


def summarise(records: list[dict]) -> list[dict]:
    out = []
    for eps in dict.fromkeys(r["eps_target"] for r in records):
        rs = [r for r in records if r["eps_target"] == eps]
        row = {"eps_target": eps, "runs": len(rs)}
        for key in ("f1", "roc_auc", "attack_norm_auc", "attack_direction_auc"):
            values = [r[key] for r in rs]
            row[key] = statistics.fmean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        row["attack_best_auc"] = statistics.fmean(
            max(r["attack_norm_auc"], r["attack_direction_auc"]) for r in rs
        )
        out.append(row)
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [s for s in summary if s["eps_target"] is not None]
    none = [s for s in summary if s["eps_target"] is None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, keys, title in (
        (axes[0], [("f1", "test F1 (positive class)")], "Utility"),
        (
            axes[1],
            [("attack_norm_auc", "norm attack"), ("attack_direction_auc", "direction attack")],
            "Label inference (ROC-AUC)",
        ),
    ):
        for key, label in keys:
            xs = [s["eps_target"] for s in finite]
            ax.errorbar(
                xs,
                [s[key] for s in finite],
                yerr=[s[f"{key}_std"] for s in finite],
                marker="o",
                capsize=3,
                label=label,
            )
            if none:
                ax.axhline(
                    none[0][key],
                    linestyle="--",
                    linewidth=1,
                    color=ax.lines[-1].get_color(),
                    label=f"{label}, no DP",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("label-DP epsilon (target; ledger epsilon is <= it)")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    axes[1].axhline(0.5, color="grey", linewidth=0.8)
    fig.suptitle("Split-NN on Credit (4 parties x 5 columns), label DP on returned gradients")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "privacy_utility.json"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--eps",
        type=float,
        nargs="+",
        default=[0.5, 1, 2, 4, 8, math.inf],
        help="label-DP target epsilons; inf = no label DP",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--clip", type=float, default=0.5, help="label-DP clip C")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--work", type=Path, help="keep the run directories here")
    args = parser.parse_args(argv)
    if not args.data.exists():
        parser.error(f"no data at {args.data}; pass --data PATH/credit_default.csv")

    records = []
    with tempfile.TemporaryDirectory(prefix="privacy-utility-") as tmp:
        work = args.work or Path(tmp)
        total = len(args.eps) * len(args.seeds)
        for eps in args.eps:
            for seed in args.seeds:
                r = run_one(
                    data=args.data,
                    seed=seed,
                    epochs=args.epochs,
                    eps=eps,
                    clip=args.clip,
                    batch_size=args.batch_size,
                    lr=args.lr,
                    work=work,
                )
                records.append(r)
                print(
                    f"[{len(records)}/{total}] eps {eps:g} seed {seed}: F1 {r['f1']:.3f}  "
                    f"attack AUC norm {r['attack_norm_auc']:.3f} direction "
                    f"{r['attack_direction_auc']:.3f}  sigma {r['noise_multiplier']}  "
                    f"({r['seconds']:.0f} s)",
                    flush=True,
                )
    summary = summarise(records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "setup": {
                    "data": str(args.data),
                    "method": "splitnn",
                    "aggregation": "plain",
                    "parties": "4 x 5 columns (X1..X20)",
                    "epochs": args.epochs,
                    "batch_size": args.batch_size,
                    "lr": args.lr,
                    "label_dp_clip": args.clip,
                    "seeds": args.seeds,
                },
                "summary": summary,
                "runs": records,
            },
            indent=2,
        )
        + "\n"
    )
    plot(summary, args.out.with_suffix(".png"))
    print(f"\n{'epsilon':>8}  {'F1':>13}  {'norm AUC':>13}  {'direction AUC':>13}")
    for s in summary:
        eps = "inf" if s["eps_target"] is None else f"{s['eps_target']:g}"
        print(
            f"{eps:>8}  {s['f1']:.3f} +- {s['f1_std']:.3f}  "
            f"{s['attack_norm_auc']:.3f} +- {s['attack_norm_auc_std']:.3f}  "
            f"{s['attack_direction_auc']:.3f} +- {s['attack_direction_auc_std']:.3f}"
        )
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
