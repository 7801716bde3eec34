"""TabVFL against its baselines (Rashad et al., SRDS 2024; notes shared/methods/tabvfl.md):
latent quality of TabVFL, TabVFL-LE, LT and CT on the synthetic cross-guest table and on UCI
Bank Marketing, the failure curves (cache vs zeros), and bytes per row per round.

Not run in CI. What runs where:

* TabVFL (plain) and TabVFL-LE (mask: every guest output on a secure sum) are the engine's
  methods, every role's round stage in one thread (`securevfl.direct`: the same DP, ledger,
  guards and secure sums as a deployment); LT and CT run in one process
  (`securevfl.methods.tabvfl.baselines`: CT is centralised by definition, LT's pretraining has
  no communication and its fine-tuning is one graph), on the same encoded and scaled columns,
  rows, split and schedule.
* Schedule (all four): 15 % test rows and 15 % of the rest held out for early stopping
  (Bank: 72/13/15; the paper 70/15/15; synthetic 70/30, 15 % of the 70 for validation), fit
  rows in one seeded order every epoch, batch 64, Adam lr 2e-2 (pytorch-tabnet's; the paper's 1e-3
  needs its 300 epochs of 35K rows), weight decay 1e-4, TabNet n_d 5, n_a 2, 4 steps,
  gamma 1.5; pretraining then fine-tuning, each at most 100 epochs, early stopping with
  patience 10 (best weights restored); seeds 42, 128, 256 (the authors').
* Latent quality: the latent of every row, re-split 70/30 stratified, five scikit-learn
  classifiers (logistic, tree, forest, MLP, calibrated linear SVM; the paper's sixth, XGBoost,
  is not installed), accuracy / weighted F1 / ROC-AUC averaged over them.
* Bank Marketing, two sections, each with its own rows and schedule (never averaged
  together): a stratified sample of 6000 rows (`--bank-rows`, drawn once with seed 0), at most
  25 + 25 epochs, patience 5, batch 128 (failures: 10 + 20 epochs); and all 45 211 rows
  (`--bank-rows 0`, latent quality only) with pytorch-tabnet's large-table default, batch 1024
  in ghost batches of 128 (an epoch costs about what the sample's did at batch 128), at most
  50 + 50 epochs, patience 10 (`--bank-full-epochs PRE FINE` raises the caps: such runs are
  their own runs and their own table section). The paper's batch 64 and 300 + 300 epochs on
  the full table did not fit the time available on a shared 2-core machine.
* Failures (the paper's experiment 3): TabVFL, two guests, batch 128, no early stopping,
  20 + 40 epochs (Bank: 10 + 20), each guest offline for a whole epoch with probability p from
  each phase's second epoch, the offline guest served from the cache or with zeros; the same
  failure draws for both fills.
* Bytes: the method's own count of the values that cross per training row and round, and the
  transport's counters (`roles.<guest>.bytes_sent`) of in-process runs (threads over ZeroMQ)
  one epoch apart, per fit row.

Results go to a JSON-lines file as each run finishes; a rerun skips the runs already there
(stop and resume at will). Then the markdown table and the PNG are written.

    python bench/tabvfl.py --quick                        # minutes: small sizes, one seed
    python bench/tabvfl.py --datasets synthetic --jobs 2  # the synthetic table, everything
    python bench/tabvfl.py --datasets bank --parts designs bytes --jobs 2
    python bench/tabvfl.py --datasets bank --parts designs --bank-rows 0 --designs tabvfl lt ct
    python bench/tabvfl.py --datasets bank --parts designs --bank-rows 0 --designs tabvfl lt ct \
        --bank-full-epochs 150 150
    python bench/tabvfl.py --datasets bank --parts failures --p-values 0.0 0.5 --jobs 2
    python bench/tabvfl.py --report-only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_BANK = Path(os.environ.get("SECUREVFL_BANK", "/work/shared/data/bank_marketing.csv"))
DEFAULT_OUT = REPO / "bench" / "results"
DESIGNS = ("tabvfl", "tabvfl-le", "lt", "ct")
LABELS = {"tabvfl": "TabVFL", "tabvfl-le": "TabVFL-LE", "lt": "LT", "ct": "CT"}
SEEDS = (42, 128, 256)
P_VALUES = (0.0, 0.2, 0.35, 0.5)
PARTS = ("designs", "failures", "bytes")
CLASSIFIERS = ("logistic", "tree", "forest", "mlp", "svm")

# run sizes: the full sweep and the quick check (minutes)
SIZES: dict[str, dict[str, Any]] = {
    "full": {
        "synthetic_rows": 5000,
        "synthetic_guests": 3,
        "pretrain_epochs": 100,
        "epochs": 100,
        "patience": 10,
        "classifiers": CLASSIFIERS,
        "failure_rows": 5000,
        "failure_epochs": (20, 40),
        "p_values": P_VALUES,
        # Bank Marketing on this shared 2-core machine: a stratified sample of the rows, at
        # most 25 + 25 epochs, patience 5, batch 128 (the paper: all 45 211 rows, batch 64,
        # up to 300 epochs per phase)
        "bank_rows": 6000,
        "bank_epochs": (25, 25),
        "bank_patience": 5,
        "bank_batch": 128,
        "bank_failure_epochs": (10, 20),
        # all 45 211 rows (`--bank-rows 0`, latent quality only): pytorch-tabnet's large-table
        # default batch 1024 in ghost batches of 128 (an epoch costs about what the sample's
        # did at batch 128), at most 50 + 50 epochs, patience 10 (the paper's)
        "bank_full": {"epochs": [50, 50], "patience": 10, "batch": 1024, "virtual_batch": 128},
    },
    "quick": {  # the test's sizes: no early stopping (XOR's fine-tuning starts on a plateau)
        "synthetic_rows": 2000,
        "synthetic_guests": 2,
        "pretrain_epochs": 3,
        "epochs": 20,
        "patience": 0,
        "classifiers": ("logistic", "tree"),
        "failure_rows": 2000,
        "failure_epochs": (3, 10),
        "p_values": (0.0, 0.5),
        "bank_rows": 2000,
        "bank_epochs": (3, 10),
        "bank_patience": 0,
        "bank_batch": 128,
        "bank_failure_epochs": (3, 10),
        "bank_full": {"epochs": [3, 10], "patience": 0, "batch": 1024, "virtual_batch": 128},
    },
}


# --------------------------------------------------------------------------------------------
# one run


def _raw(job: dict[str, Any], directory: Path, bank: Path) -> dict[str, Any]:
    from securevfl.methods.tabvfl.federations import bank_federation, synthetic_federation

    size = SIZES[job["size"]]
    method = job["design"] if job["design"] in ("tabvfl", "tabvfl-le") else "tabvfl"
    failure = job["part"] == "failures"
    failure_epochs = size["bank_failure_epochs" if job["dataset"] == "bank" else "failure_epochs"]
    options: dict[str, Any] = {
        "pretrain_epochs": failure_epochs[0] if failure else size["pretrain_epochs"],
        "patience": 0 if failure else size["patience"],
        "latent_classifiers": list(size["classifiers"]),
    }
    if failure:
        options.update(failure_p=job["p"], failure_fill=job["fill"])
    train = {
        "epochs": failure_epochs[1] if failure else size["epochs"],
        "batch_size": 128 if failure else 64,
    }
    kwargs = {"method": method, "seed": job["seed"], "train": train, "options": options}
    if job["design"] == "tabvfl-le":
        kwargs["aggregation"] = "mask"
    if job["dataset"] == "bank":
        kwargs["train"]["batch_size"] = size["bank_batch"]
        if not failure:
            options.update(
                pretrain_epochs=size["bank_epochs"][0],
                patience=size["bank_patience"],
            )
            kwargs["train"]["epochs"] = size["bank_epochs"][1]
        if "schedule" in job:  # the full table's own schedule (in the job: its own section)
            sched = job["schedule"]
            options.update(
                pretrain_epochs=sched["epochs"][0],
                patience=sched["patience"],
                virtual_batch_size=sched["virtual_batch"],
            )
            kwargs["train"].update(epochs=sched["epochs"][1], batch_size=sched["batch"])
        raw = bank_federation(bank_sample(bank, directory, job["rows"]), **kwargs)
        if failure:  # the paper's failure experiment has two guests
            from securevfl.methods.tabvfl.federations import BANK_GUESTS

            cols = [c for g in BANK_GUESTS for c in g]
            raw["parties"] = {"g0": {"columns": cols[:8]}, "g1": {"columns": cols[8:]}}
        return raw
    rows = size["failure_rows"] if failure else size["synthetic_rows"]
    guests = 2 if failure else size["synthetic_guests"]
    return synthetic_federation(directory, n_rows=rows, n_guests=guests, **kwargs)


def bank_sample(bank: Path, directory: Path, rows: int | None) -> Path:
    """Bank Marketing, or a stratified random sample of `rows` of its rows (the same sample for
    every seed and design: drawn with seed 0) written to `directory`."""
    if not rows:
        return bank
    import numpy as np

    lines = bank.read_text().splitlines()
    header, body = lines[0], lines[1:]
    if rows >= len(body):
        return bank
    label = [line.rsplit(",", 1)[1].strip().strip('"') for line in body]
    rng = np.random.default_rng(0)
    keep = []
    for level in sorted(set(label)):
        where = np.flatnonzero(np.asarray(label) == level)
        keep.append(rng.permutation(where)[: int(round(rows * len(where) / len(body)))])
    chosen = np.sort(np.concatenate(keep))
    out = Path(directory) / "bank_sample.csv"
    out.write_text("\n".join([header, *(body[i] for i in chosen)]) + "\n")
    return out


def run_job(job: dict[str, Any], bank: str) -> dict[str, Any]:
    """One run in a fresh temporary directory; returns its result (metrics, epochs, time)."""
    import torch

    torch.set_num_threads(1)
    from securevfl.config import parse_config

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tabvfl-bench-") as tmp:
        d = Path(tmp)
        raw = _raw(job, d, Path(bank))
        cfg = parse_config(raw, source=d / "config.toml")
        if job["part"] == "bytes":
            result = _bytes(raw, d)
        elif job["design"] in ("lt", "ct"):
            result = _baseline(job, cfg, d)
        else:
            from securevfl.direct import DirectFederation

            fed = DirectFederation(cfg, run_dir=d / "run", record=False)
            metrics = fed.run()
            result = {"metrics": metrics, **fed.method.summary()[cfg.method]}
    result["seconds"] = time.perf_counter() - started
    return result


def _baseline(job: dict[str, Any], cfg: Any, d: Path) -> dict[str, Any]:
    import numpy as np

    from securevfl.methods.tabvfl.baselines import LocalTabNets, central_tabnet, fit_early_stopping
    from securevfl.methods.tabvfl.evaluation import evaluate_latent
    from securevfl.methods.tabvfl.federations import party_blocks
    from securevfl.methods.tabvfl.party import tabnet_config

    pb = party_blocks(cfg, d / "run")
    tc = tabnet_config(cfg.options)
    dims = [b.shape[1] for b in pb.blocks]
    if job["design"] == "lt":
        model = LocalTabNets(dims, 2, tc, seed=cfg.seed)

        def rows(ids):
            return pb.rows(ids)
    else:
        model = central_tabnet(sum(dims), 2, tc, seed=cfg.seed)

        def rows(ids):
            return [np.concatenate(pb.rows(ids), axis=1)]

    history = fit_early_stopping(
        model,
        rows(pb.order),
        pb.labels(pb.order),
        rows(pb.valid),
        pb.labels(pb.valid),
        pretrain_epochs=cfg.options.pretrain_epochs,
        epochs=cfg.epochs,
        patience=cfg.options.patience,
        batch_size=cfg.batch_size,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        seed=cfg.seed,
    )
    every = np.concatenate([pb.test, pb.train])
    z = model.encode(rows(every))
    latent = evaluate_latent(
        z, pb.labels(every), seed=cfg.seed, classifiers=cfg.options.latent_classifiers
    )
    n_d = cfg.options.n_d
    return {
        "metrics": {f"latent_{k}": v for k, v in latent.items()},
        "epochs": {"pretrain": len(history["pretrain"]), "finetune": len(history["finetune"])},
        # 0-based, as the methods' own summary (`best_epoch`)
        "best_epoch": {k: v["epoch"] for k, v in history["best"].items()},
        "guest_dims": dims,
        # LT: each guest's local latent (m_k wide) up, its gradient down; CT: nothing crosses
        "scalars_per_row": {
            "finetune": {"guests_to_host": n_d, "host_to_guests": n_d}
            if job["design"] == "lt"
            else {"guests_to_host": 0, "host_to_guests": 0}
        },
    }


def _bytes(raw: dict[str, Any], d: Path) -> dict[str, Any]:
    """Transport bytes per fit row of one more epoch of each phase, per guest (in-process runs
    one epoch apart: the difference is that epoch's messages, headers included)."""
    import copy

    from securevfl.config import parse_config
    from securevfl.inproc import run_federation

    network = {"heartbeat_interval": 0.5, "peer_timeout": 30.0, "round_timeout": 120.0}
    runs = {}
    for name, (pre, ft) in {"base": (1, 1), "pre": (2, 1), "fine": (1, 2)}.items():
        r = copy.deepcopy(raw)
        r["network"] = network
        r["method"].update(pretrain_epochs=pre, patience=0, latent_classifiers=["logistic"])
        r["train"]["epochs"] = ft
        sub = d / name
        sub.mkdir()
        if not str(r["data"]["path"]).startswith("/"):
            (sub / r["data"]["path"]).write_bytes((d / r["data"]["path"]).read_bytes())
        code, metrics = run_federation(parse_config(r, source=sub / "config.toml"), out=sub / "run")
        if code != 0:
            raise RuntimeError(f"in-process run {name} failed with status {code}")
        runs[name] = metrics
    method = raw["run"]["method"]
    rows = runs["base"][method]["fit_rows"]
    guests = list(raw["parties"])
    out: dict[str, Any] = {
        "fit_rows": rows,
        "scalars_per_row": runs["base"][method]["scalars_per_row"],
    }
    for phase, run in (("pretrain", "pre"), ("finetune", "fine")):
        out[phase] = {
            g: {
                what: (runs[run]["roles"][g][what] - runs["base"]["roles"][g][what]) / rows
                for what in ("bytes_sent", "bytes_received")
            }
            for g in guests
        }
    out["guest_dims"] = runs["base"][method].get("guest_dims")
    return out


# --------------------------------------------------------------------------------------------
# the sweep


def jobs_for(
    datasets: Sequence[str],
    parts: Sequence[str],
    seeds: Sequence[int],
    size: str,
    bank_rows: int | None = None,
    p_values: Sequence[float] | None = None,
    designs: Sequence[str] = DESIGNS,
    bank_full_epochs: Sequence[int] | None = None,
):
    out = []
    for dataset in datasets:
        if "designs" in parts:
            for seed in seeds:
                for design in designs:
                    out.append(
                        {"part": "designs", "dataset": dataset, "design": design, "seed": seed}
                    )
        if "failures" in parts:
            for seed in seeds:
                for p in SIZES[size]["p_values"] if p_values is None else p_values:
                    for fill in ("cache", "zeros") if p > 0 else ("cache",):
                        out.append(
                            {
                                "part": "failures",
                                "dataset": dataset,
                                "design": "tabvfl",
                                "seed": seed,
                                "p": p,
                                "fill": fill,
                            }
                        )
        if "bytes" in parts:
            for design in ("tabvfl", "tabvfl-le"):
                out.append(
                    {"part": "bytes", "dataset": dataset, "design": design, "seed": seeds[0]}
                )
    for job in out:
        job["size"] = size
        if job["dataset"] == "bank":
            job["rows"] = SIZES[size]["bank_rows"] if bank_rows is None else bank_rows
            if job["rows"] == 0:
                if job["part"] != "designs":
                    raise SystemExit(
                        "--bank-rows 0 (the full table) runs the designs part only; the "
                        "failure and bytes parts run on the sample (leave --bank-rows out)"
                    )
                job["schedule"] = dict(SIZES[size]["bank_full"])
                if bank_full_epochs is not None:
                    job["schedule"]["epochs"] = [int(e) for e in bank_full_epochs]
    return out


def key_of(job: dict[str, Any]) -> str:
    return json.dumps(job, sort_keys=True)


def load_runs(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    runs = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            runs[key_of(entry["job"])] = entry
    return runs


def sweep(jobs: list[dict[str, Any]], path: Path, *, workers: int, bank: Path) -> None:
    done = load_runs(path)
    todo = [j for j in jobs if key_of(j) not in done]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs already in {path}; {len(todo)} to go")
    if not todo:
        return
    path.parent.mkdir(parents=True, exist_ok=True)

    def record(job: dict[str, Any], result: dict[str, Any]) -> None:
        with path.open("a") as fh:
            fh.write(json.dumps({"job": job, "result": result}) + "\n")
        m = result.get("metrics", {})
        shown = f"latent F1 {m['latent_f1']:.4f}" if "latent_f1" in m else "bytes"
        print(f"{key_of(job)}: {shown} ({result['seconds']:.0f} s)", flush=True)

    if workers <= 1:
        for job in todo:
            record(job, run_job(job, str(bank)))
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(run_job, job, str(bank)): job for job in todo}
        for future in as_completed(futures):
            record(futures[future], future.result())


# --------------------------------------------------------------------------------------------
# the report


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    import numpy as np

    a = np.asarray([v for v in values if v == v], dtype=float)
    if not len(a):
        return float("nan"), float("nan"), 0
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0, len(a)


def _cell(values: Sequence[float], scale: float = 1.0) -> str:
    m, s, n = _mean_std(values)
    if n == 0:
        return "–"
    return f"{m * scale:.4f} ± {s * scale:.4f}" if n > 1 else f"{m * scale:.4f}"


def _best_epochs(entry: dict[str, Any]) -> str:
    """A run's best validation epochs, 1-based ("48+8"; "–" where the run did not record them
    or had no early stopping): a best epoch at the cap means the phase was still improving."""
    best = entry["result"].get("best_epoch") or {}
    if not best:
        return "–"
    return "+".join(str(best[p] + 1) if p in best else "–" for p in ("pretrain", "finetune"))


def section(job: dict[str, Any]) -> str:
    """The table section a run belongs to: its data set, and for Bank Marketing which rows (the
    sample and the full table run different schedules: never averaged together)."""
    if job["dataset"] != "bank":
        return job["dataset"]
    if job.get("rows"):
        return f"bank, {job['rows']}-row sample"
    pre, fine = job.get("schedule", {}).get("epochs", ("?", "?"))
    return f"bank, all rows, ≤ {pre} + {fine} epochs"  # one section per schedule


def _bank_sections(runs: list[dict[str, Any]], size: str) -> list[str]:
    """One sentence per Bank Marketing section: its rows and its schedule."""
    b = SIZES[size]
    out = []
    split = "15 % test, 15 % of the rest for early stopping"
    bank = {section(e["job"]): e["job"] for e in runs if e["job"]["dataset"] == "bank"}
    for name, job in sorted(bank.items()):
        rows = job.get("rows")
        if not rows:
            sched = job["schedule"]
            out.append(
                f"`{name}`: all 45 211 rows ({split}), latent quality only, batch "
                f"{sched['batch']} in ghost batches of {sched['virtual_batch']} "
                "(pytorch-tabnet's default for large tables), at most "
                f"{sched['epochs'][0]} + {sched['epochs'][1]} epochs, patience "
                f"{sched['patience']} (the paper: batch 64, up to 300 epochs per phase)."
            )
        else:
            out.append(
                f"`{name}`: a stratified sample of {rows} of its 45 211 rows "
                f"(drawn once with seed 0: the same rows for every design and seed; {split}), "
                f"at most {b['bank_epochs'][0]} + {b['bank_epochs'][1]} epochs, patience "
                f"{b['bank_patience']}, batch {b['bank_batch']} (failures: "
                f"{b['bank_failure_epochs'][0]} + {b['bank_failure_epochs'][1]} epochs)."
            )
    return out


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def report(path: Path, out_md: Path, out_png: Path, size: str, command: str) -> str:
    runs = [e for e in load_runs(path).values() if e["job"]["size"] == size]
    lines = [
        f"# TabVFL: latent quality, failures, bytes ({size} sizes)",
        "",
        f"Generated by `{command}` from `{_shown(path)}` (bench/tabvfl.py's docstring "
        "gives the protocol). Means ± standard deviations over seeds; latent metrics are the "
        "paper's: downstream classifiers on the latents of every row, re-split 70/30, "
        f"averaged over {', '.join(SIZES[size]['classifiers'])}.",
        "",
    ]
    if any(e["job"]["dataset"] == "bank" for e in runs):
        b = SIZES[size]
        lines += ["Bank Marketing (each section with its own rows and schedule):", ""]
        lines += [f"* {text}" for text in _bank_sections(runs, size)]
        lines += [
            "",
            "Synthetic: the cross-guest XOR table, "
            f"{b['synthetic_rows']} rows over {b['synthetic_guests']} guests, at most "
            f"{b['pretrain_epochs']} + {b['epochs']} epochs, patience {b['patience']}, batch 64.",
            "",
        ]
    checks = []
    designs = [e for e in runs if e["job"]["part"] == "designs"]
    datasets = sorted({section(e["job"]) for e in designs})
    scores: dict[tuple[str, str], list[float]] = {}
    if designs:
        lines += [
            "## Latent quality",
            "",
            "| data | design | latent accuracy | latent weighted F1 | latent ROC-AUC | "
            "head weighted F1 (test) | epochs pre + fine | best epoch pre + fine | seconds | "
            "seeds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for dataset in datasets:
            for design in DESIGNS:
                es = [
                    e
                    for e in designs
                    if section(e["job"]) == dataset and e["job"]["design"] == design
                ]
                if not es:
                    continue
                get = lambda k, es=es: [e["result"]["metrics"].get(k, float("nan")) for e in es]  # noqa: E731
                scores[(dataset, design)] = get("latent_f1")
                epochs = [
                    f"{e['result']['epochs']['pretrain']}+{e['result']['epochs']['finetune']}"
                    for e in es
                ]
                lines.append(
                    f"| {dataset} | {LABELS[design]} | {_cell(get('latent_accuracy'))} | "
                    f"{_cell(get('latent_f1'))} | {_cell(get('latent_roc_auc'))} | "
                    f"{_cell(get('weighted_f1'))} | {', '.join(epochs)} | "
                    f"{', '.join(_best_epochs(e) for e in es)} | "
                    f"{_mean_std([e['result']['seconds'] for e in es])[0]:.0f} | {len(es)} |"
                )
        lines.append("")
        for dataset in datasets:
            tv, lt, ct = (
                _mean_std(scores.get((dataset, d), []))[0] for d in ("tabvfl", "lt", "ct")
            )
            if dataset == "synthetic":
                checks.append(
                    f"synthetic: TabVFL {tv:.4f} >= LT {lt:.4f} + 0.10: "
                    f"{'yes' if tv >= lt + 0.10 else 'NO'}"
                )
            elif lt == lt:  # both baselines ran in this section
                checks.append(
                    f"{dataset}: TabVFL {tv:.4f} >= LT {lt:.4f}: {'yes' if tv >= lt else 'NO'}; "
                    f"within 0.03 of CT {ct:.4f}: {'yes' if abs(tv - ct) <= 0.03 else 'NO'}"
                )
    failures = [e for e in runs if e["job"]["part"] == "failures"]
    curves: dict[tuple[str, str], dict[float, list[float]]] = {}
    if failures:
        lines += [
            "## Client failures (TabVFL, two guests, batch 128, no early stopping)",
            "",
            "| data | fill | " + " | ".join(f"p = {p}" for p in SIZES[size]["p_values"]) + " |",
            "|---|---|" + "---|" * len(SIZES[size]["p_values"]),
        ]
        for dataset in sorted({section(e["job"]) for e in failures}):
            for fill in ("cache", "zeros"):
                row = {}
                for p in SIZES[size]["p_values"]:
                    want = "cache" if p == 0 else fill  # p = 0: one run, no failure to fill
                    row[p] = [
                        e["result"]["metrics"]["latent_f1"]
                        for e in failures
                        if section(e["job"]) == dataset
                        and e["job"]["p"] == p
                        and e["job"]["fill"] == want
                    ]
                curves[(dataset, fill)] = row
                lines.append(
                    f"| {dataset} | {fill} | "
                    + " | ".join(_cell(row[p]) for p in SIZES[size]["p_values"])
                    + " |"
                )
            base = _mean_std(curves[(dataset, "cache")][0.0])[0]
            hi = max(SIZES[size]["p_values"])
            c, z = (_mean_std(curves[(dataset, f)][hi])[0] for f in ("cache", "zeros"))
            worst = {
                f: min(
                    _mean_std(curves[(dataset, f)][p])[0]
                    for p in SIZES[size]["p_values"]
                    if curves[(dataset, f)][p]
                )
                for f in ("cache", "zeros")
            }
            checks.append(
                f"{dataset}: at p = {hi} cache {c:.4f} > zeros {z:.4f}: "
                f"{'yes' if c > z else 'NO'}; largest drop from no failure {base:.4f}: cache "
                f"{100 * (worst['cache'] - base) / base:+.1f} %, zeros "
                f"{100 * (worst['zeros'] - base) / base:+.1f} %"
            )
        lines += ["", "Latent weighted F1 (paper's Fig. 6 metric).", ""]
    measured = [e for e in runs if e["job"]["part"] == "bytes"]
    if measured or designs:
        lines += [
            "## Bytes per training row per round",
            "",
            "Values (floats) per fit row per epoch counted by the method (all guests together; "
            "TabVFL-LE's values travel as 8-byte ring elements on mask, 4-byte floats on plain), "
            "and the transport's bytes per fit row of one more epoch, per guest (sent / "
            "received, headers and sample ids included).",
            "",
            "| data | design | phase | guests -> host | host -> guests | transport, per guest "
            "(sent / received bytes) |",
            "|---|---|---|---|---|---|",
        ]
        for dataset in datasets or sorted({section(e["job"]) for e in measured}):
            for design in DESIGNS:
                es = [
                    e
                    for e in designs
                    if section(e["job"]) == dataset and e["job"]["design"] == design
                ]
                ms = [  # the transport's counters were measured on the sample
                    e
                    for e in measured
                    if section(e["job"]) == dataset and e["job"]["design"] == design
                ]
                spr = (es or ms or [None])[0]
                if spr is None:
                    continue
                for phase in ("pretrain", "finetune"):
                    s = spr["result"].get("scalars_per_row", {}).get(phase)
                    if s is None:
                        continue
                    t = ""
                    if ms:
                        t = "; ".join(
                            f"{g} {v['bytes_sent']:.1f} / {v['bytes_received']:.1f}"
                            for g, v in ms[0]["result"][phase].items()
                        )
                    lines.append(
                        f"| {dataset} | {LABELS[design]} | {phase} | {s['guests_to_host']:.2f} | "
                        f"{s['host_to_guests']:.2f} | {t} |"
                    )
        lines.append("")
        for dataset in datasets:
            dims = next(
                (
                    e["result"].get("guest_dims")
                    for e in designs
                    if e["job"]["design"] == "tabvfl" and section(e["job"]) == dataset
                ),
                None,
            )
            if dims:
                lines.append(
                    f"{dataset}: TabVFL's guest widths d_k = {dims} (D = {sum(dims)}), n_d = 5: "
                    f"the split says 2D + n_d = {2 * sum(dims) + 5} values up in pretraining (h, "
                    f"masks, dL/dr) and D = {sum(dims)} in fine-tuning (plus one loss per guest "
                    "per batch)."
                )
    lines += ["", "## Checks (issue #14)", ""] + [f"* {c}" for c in checks] + [""]
    text = "\n".join(lines)
    out_md.write_text(text)
    _plot(scores, curves, out_png, size)
    return text


def _plot(scores, curves, out_png: Path, size: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({d for d, _ in scores})
    fail_sets = sorted({d for d, _ in curves})
    panels = len(datasets) + len(fail_sets)
    if not panels:
        return
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=False):
        names = [d for d in DESIGNS if (dataset, d) in scores]
        stats = [_mean_std(scores[(dataset, d)]) for d in names]
        ax.bar(
            [LABELS[n] for n in names],
            [s[0] for s in stats],
            yerr=[s[1] for s in stats],
            color=[f"C{DESIGNS.index(n)}" for n in names],  # one colour per design
        )
        lo = min(s[0] for s in stats)
        ax.set_ylim(max(0.0, lo - 0.1), 1.0)
        ax.set_title(f"{dataset}\nlatent weighted F1", fontsize=9)
    for ax, dataset in zip(axes[0][len(datasets) :], fail_sets, strict=False):
        for fill, color in (("cache", "C0"), ("zeros", "C3")):
            row = curves[(dataset, fill)]
            ps = sorted(p for p in row if row[p])
            stats = [_mean_std(row[p]) for p in ps]
            ax.errorbar(
                ps,
                [s[0] for s in stats],
                yerr=[s[1] for s in stats],
                label=fill,
                color=color,
                marker="o",
                capsize=3,
            )
        ax.set_xlabel("failure probability p")
        ax.set_title(f"{dataset}\nfailures (latent F1)", fontsize=9)
        ax.legend()
    fig.suptitle(f"TabVFL bench ({size})")
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one seed (minutes)")
    ap.add_argument("--datasets", nargs="+", choices=("synthetic", "bank"), default=None)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=None)
    ap.add_argument(
        "--designs",
        nargs="+",
        choices=DESIGNS,
        default=list(DESIGNS),
        help="designs of the designs part to run (default: all four)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="parallel processes (at most 2 here)")
    ap.add_argument("--bank", type=Path, default=DEFAULT_BANK)
    ap.add_argument(
        "--bank-rows",
        type=int,
        default=None,
        help="Bank Marketing rows to sample (0: all 45 211 rows, designs only, with the "
        "size's bank_full schedule; default: the size's sample)",
    )
    ap.add_argument(
        "--bank-full-epochs",
        nargs=2,
        type=int,
        metavar=("PRETRAIN", "FINETUNE"),
        default=None,
        help="most epochs per phase on the full table (--bank-rows 0); default: the size's "
        "bank_full schedule (50 50). A run with other caps is its own run and table section",
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--p-values",
        nargs="+",
        type=float,
        choices=P_VALUES,
        default=None,
        help="failure probabilities to run (default: the size's)",
    )
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args(argv)
    size = "quick" if args.quick else "full"
    seeds = args.seeds or ([SEEDS[0]] if args.quick else list(SEEDS))
    datasets = args.datasets or (["synthetic"] if args.quick else ["synthetic", "bank"])
    if "bank" in datasets and not args.bank.exists():
        raise SystemExit(f"no Bank Marketing table at {args.bank} (--bank or SECUREVFL_BANK)")
    stem = "tabvfl_quick" if args.quick else "tabvfl"
    runs = args.out / f"{stem}_runs.jsonl"
    if not args.report_only:
        jobs = jobs_for(
            datasets,
            args.parts,
            seeds,
            size,
            args.bank_rows,
            args.p_values,
            args.designs,
            args.bank_full_epochs,
        )
        sweep(jobs, runs, workers=args.jobs, bank=args.bank)
    command = "python bench/tabvfl.py" + (" --quick" if args.quick else "")
    print(report(runs, args.out / f"{stem}.md", args.out / f"{stem}.png", size, command))


if __name__ == "__main__":
    main()
