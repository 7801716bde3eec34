"""FALSE-VFL against its baselines under the paper's missingness patterns (issue #13).

Not run in CI. Two data sets: scikit-learn's digits (1797 rows, 8 parties, party k holds pixel row
k of each 8x8 image, 500 test rows) and Credit (X1..X20 of the credit-default table in 4 parties
of 5 contiguous columns; a seeded subsample, `--credit-rows`, 20 % test). Labeled budget: 500
training rows keep their label, 100 of them fully aligned (`[missing] labeled/aligned`); the
other training rows are unlabeled and, like the labeled ones, masked by the training pattern.

Methods: FALSE-VFL-I (`false-vfl`, variant mar), FALSE-VFL-II (variant mnar), vanilla VFL
(`vanilla-vfl`: fully aligned labeled rows, zero-filled test blocks), LASER-VFL and PlugVFL
(labeled rows). Trained under MCAR 2, MCAR 5 and MNAR 7, tested under MCAR 0/2/5, MAR 1/2 and
MNAR 7/9, over seeds. The baselines run the whole method over the engine's round stages in one
thread (`securevfl.direct.DirectFederation`, plain aggregation, as `bench/laser_credit.py`).
FALSE-VFL (`--path reference`, the default) trains through its single-process reference
(`FalseVFLReference`: the same model code, every cross-party quantity through an in-memory sum)
on exactly the federation's rows, z-scores, labeled budget and presence; `--path federated` runs
it through `DirectFederation` too (the method's mixed batches, one encode and one decode per
step over every party, as the reference batches; before them, pattern-homogeneous batches, ~250
patterns on 8 parties, took 910 s of training for 40 + 20 epochs). Credit runs are keyed by
`--credit-rows`, the subsample size. Each (data set, method,
training pattern, seed) is trained once; each further test pattern is a fresh federation whose
test rows are drawn by that pattern (the training rows are the same: the split draws training
and test missingness separately), loaded with the trained state (or read by the reference) and
evaluated.

Results go to JSON as each run finishes; a rerun skips runs already there (resumable). Then a
markdown table (accuracy, mean +- std over seeds) and a PNG per data set. `--overhead` measures a
FALSE-VFL epoch on digits over real processes (`securevfl run`), mask beside plain.

    python bench/false_vfl.py --quick --datasets digits --seeds 0        # minutes
    python bench/false_vfl.py --datasets digits --train mcar5,mnar7,mcar2  # the digits table
    python bench/false_vfl.py --datasets credit --credit-rows 3000         # the Credit table
    python bench/false_vfl.py --datasets credit --credit-rows 0 --train mcar5  # whole Credit
                                                  # (30000 rows; false_vfl_rows30000.md, ...png)
    python bench/false_vfl.py --path federated --methods false1,false2     # FALSE-VFL, engine
    python bench/false_vfl.py --overhead                                   # mask vs plain epoch
    python bench/false_vfl.py --report-only
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import shutil
import subprocess
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

CREDIT = Path(os.environ.get("SECUREVFL_CREDIT", "/work/shared/data/credit_default.csv"))
OUT = REPO / "bench" / "results"
PATTERNS: dict[str, dict[str, Any]] = {
    "mcar0": {"kind": "mcar", "p": 0.0, "at_least_one": 1},
    "mcar2": {"kind": "mcar", "p": 0.2, "at_least_one": 1},
    "mcar5": {"kind": "mcar", "p": 0.5, "at_least_one": 1},
    "mar1": {"kind": "mar1"},
    "mar2": {"kind": "mar2"},
    "mnar7": {"kind": "mnar", "p": 0.7},
    "mnar9": {"kind": "mnar", "p": 0.9},
}
TRAIN = ("mcar2", "mcar5", "mnar7")
METHODS = ("false1", "false2", "vanilla", "laser", "plugvfl")
LABELS = {
    "false1": "FALSE-VFL-I",
    "false2": "FALSE-VFL-II",
    "vanilla": "Vanilla VFL",
    "laser": "LASER-VFL",
    "plugvfl": "PlugVFL",
}
DEFAULT_CREDIT_ROWS = 3000  # the main table's Credit subsample
DEFAULT_SEEDS = (0, 1, 2)  # the main table's seeds
ENGINE = {"false1": "false-vfl", "false2": "false-vfl", "vanilla": "vanilla-vfl"}
POLICY = {"aggregations": ["plain", "mask", "ckks"], "min_group": 2, "config_seeds": True}


def false_vfl_options(quick: bool) -> dict[str, Any]:
    """FALSE-VFL's `[method]` options of the benchmark: the `FAST` setting of
    `tests/securevfl/test_false_vfl_model.py` (tuned on digits, MCAR 5, seed 0; 1 to 4
    minutes of training through the reference on this loaded 2-core machine)."""
    return {
        # the engine path: one call per batch over every party (opt-in: each party then sees
        # the batch's ids and presence; fine here: the missingness is simulated on one table)
        "batching": "mixed",
        "d_h": 16,
        "d_z": 8,
        "hidden": [32],
        "mask_hidden": [32, 32],
        "disc_hidden": [64],
        "kappa": 5,
        "n_predict": 20,
        "stage1_epochs": 15 if quick else 60,
        "stage2_epochs": 5 if quick else 20,
        "stage1_batch": 128,
        "stage2_batch": 100,
        "stage1_lr": 3e-3,
        "stage2_lr": 3e-3,
        "weight_decay": 1e-4,
    }


def settings(method: str, quick: bool, dataset: str = "digits") -> dict[str, Any]:
    """The config sections of one method: FALSE-VFL's options; the block methods' [model] and
    [train] (MLP f_k d_k->64->64, heads 64->64->C, Adam 1e-3, weight decay 1e-4, batch 32;
    vanilla VFL 200 epochs on its ~100 aligned rows; LASER-VFL and PlugVFL 60 epochs on Credit,
    15 on digits, whose 500 labeled rows hold ~200 presence patterns of the 8 parties under
    MCAR 5 or MNAR 7, so an epoch of pattern-homogeneous batches is over 200 steps)."""
    if method in ("false1", "false2"):
        opts = false_vfl_options(quick)
        opts["variant"] = "mar" if method == "false1" else "mnar"
        return {"method": opts}
    few = 15 if dataset == "digits" else 60
    epochs = {"vanilla": 200, "laser": few, "plugvfl": few}[method]
    return {
        "model": {"hidden": [64], "width": 64, "head_hidden": [64]},
        "train": {
            "epochs": max(1, epochs // 5) if quick else epochs,
            "batch_size": 32,
            "lr": 1e-3,
            "weight_decay": 1e-4,
        },
    }


# --------------------------------------------------------------------------------------------
# data


def write_data(directory: Path, dataset: str, *, credit_rows: int) -> dict[str, Any]:
    """Write the data set's CSV into `directory`; returns its [data] and [parties] sections."""
    import numpy as np

    from securevfl.data.table import read_csv_columns, write_csv

    directory.mkdir(parents=True, exist_ok=True)
    if dataset == "digits":
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        cols = [f"P{i}" for i in range(64)]
        path = directory / "digits.csv"
        write_csv(
            path,
            id_column="ID",
            ids=np.arange(1, len(y) + 1),
            columns=cols,
            values=x.astype(float),
            label="Y",
            labels=y.astype(float),
        )
        parties = {f"row{k}": cols[8 * k : 8 * k + 8] for k in range(8)}
        data = {"path": str(path), "task": "multiclass", "test_fraction": 500 / len(y)}
    elif dataset == "credit":
        cols = [f"X{i}" for i in range(1, 21)]
        ids, values, labels = read_csv_columns(CREDIT, id_column="ID", columns=cols, label="Y")
        credit_rows = resolve_credit_rows(credit_rows, len(ids))
        keep = np.sort(np.random.default_rng(0).permutation(len(ids))[:credit_rows])
        path = directory / "credit.csv"
        write_csv(
            path,
            id_column="ID",
            ids=ids[keep],
            columns=cols,
            values=values[keep],
            label="Y",
            labels=labels[keep],
        )
        parties = {f"p{k}": cols[5 * k : 5 * k + 5] for k in range(4)}
        data = {"path": str(path), "task": "binary", "test_fraction": 0.2}
    else:
        raise ValueError(f"unknown data set {dataset!r}")
    return {"data": data, "parties": {p: {"columns": c} for p, c in parties.items()}}


def resolve_credit_rows(requested: int, available: int) -> int:
    """`--credit-rows` as a row count: 0 means the whole table (`available` rows); a count above
    the table's or below 0 is refused (ValueError naming the table's size)."""
    if requested == 0:
        return available
    if not 0 < requested <= available:
        raise ValueError(
            f"--credit-rows {requested}: give 1..{available} rows of {CREDIT.name}, or 0 for all "
            f"{available}"
        )
    return requested


def credit_table_rows() -> int:
    """Rows of the Credit table (its data lines), read without parsing the values."""
    with CREDIT.open("rb") as fh:
        return sum(1 for line in fh if line.strip()) - 1


def report_suffix(datasets: Sequence[str], credit_rows: int, seeds: Sequence[int]) -> str:
    """File-name suffix of a report whose setting differs from the main table's (Credit at a
    size other than the 3000-row subsample: `_rows30000`; seeds other than 0, 1, 2:
    `_seeds0-7`), so that its markdown and figures sit beside the main table's instead of
    replacing them."""
    suffix = ""
    if "credit" in datasets and credit_rows != DEFAULT_CREDIT_ROWS:
        suffix += f"_rows{credit_rows}"
    if list(seeds) != list(DEFAULT_SEEDS):
        ordered = sorted(seeds)
        contiguous = ordered == list(range(ordered[0], ordered[-1] + 1)) if ordered else False
        suffix += (
            f"_seeds{ordered[0]}-{ordered[-1]}"
            if contiguous and len(ordered) > 1
            else "_seeds" + "_".join(map(str, ordered))
        )
    return suffix


def raw_config(
    job: dict[str, Any], test: str, *, aggregation: str = "plain", transport: str | None = None
) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "run": {
            "method": ENGINE.get(job["method"], job["method"]),
            "aggregation": aggregation,
            "seed": job["seed"],
            "min_group": 2,
            "shared_init": True,  # a benchmark: reproducible from its seed
        },
        **copy.deepcopy(job["sections"]),
        "active": {"columns": []},
        "missing": {
            "labeled": 500,
            "aligned": 100,
            "train": dict(PATTERNS[job["train"]]),
            "test": dict(PATTERNS[test]),
        },
        "policy": dict(POLICY),
        **settings(job["method"], job["quick"], job["dataset"]),
    }
    if transport:
        raw["run"]["transport"] = transport
    return raw


# --------------------------------------------------------------------------------------------
# one run


def run_key(job: dict[str, Any]) -> str:
    setting = "quick" if job["quick"] else "full"
    key = f"{job['dataset']}|{job['method']}|train={job['train']}|seed={job['seed']}|{setting}"
    if job["method"] in ("false1", "false2") and job.get("path", "federated") == "reference":
        key += "|reference"
    if job["dataset"] == "credit":  # the subsample size is part of the setting
        key += f"|rows={job['credit_rows']}"
    return key


def federation(raw: dict[str, Any], work: Path, name: str):
    from securevfl.config import parse_config
    from securevfl.direct import DirectFederation

    cfg = parse_config(raw, source=work / f"{name}.toml")
    return DirectFederation(cfg, run_dir=work / name, record=False)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train once, test under every pattern of `job["tests"]`; returns the JSON entry."""
    try:
        return _run_job(job)
    except Exception as exc:  # picklable across the process pool
        raise RuntimeError(f"{run_key(job)}: {type(exc).__name__}: {exc}") from None


def _run_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from securevfl.methods import method_spec

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="false-vfl-"))
    try:
        tests = list(job["tests"])
        started = time.perf_counter()
        if job.get("path", "federated") == "reference" and job["method"] in ("false1", "false2"):
            return _run_reference(job, work, started)
        fed = federation(raw_config(job, tests[0]), work, "train")
        train_ids = fed.train_ids
        if not method_spec(fed.config.method).uses_unlabeled:  # as a real run does
            train_ids = train_ids[fed.active_table.labeled(train_ids)]
        fed.method.fit(fed, train_ids=train_ids)
        train_seconds = time.perf_counter() - started
        states = {p: copy.deepcopy(m.state_dict()) for p, m in fed.party_methods.items()}
        active = copy.deepcopy(fed.method.state_dict())
        results = {tests[0]: fed.method.evaluate(fed, ids=fed.test_ids)}
        for test in tests[1:]:
            other = federation(raw_config(job, test), work, test)
            for p, m in other.party_methods.items():
                m.load_state_dict(copy.deepcopy(states[p]))
            other.method.load_state_dict(copy.deepcopy(active))
            results[test] = other.method.evaluate(other, ids=other.test_ids)
        return {
            "dataset": job["dataset"],
            "method": job["method"],
            "train": job["train"],
            "seed": job["seed"],
            "quick": job["quick"],
            "accuracy": {t: 100 * m["accuracy"] for t, m in results.items()},
            "test": results,
            "n_train": int(len(train_ids)),
            **(
                {"path": "federated", "batching": fed.config.options.batching}
                if job["method"] in ("false1", "false2")
                else {}
            ),
            "history_tail": fed.history[-3:],
            "train_seconds": train_seconds,
            "wall_seconds": time.perf_counter() - started,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def party_blocks(fed, ids):
    """(xs, present) of `ids` as the federation's parties hold them: per party its z-scored
    block [n, d_k] (the scaling its `setup` fitted; 0 on rows it lacks, which the model never
    reads) and the presence [n, K] the active party learnt at set-up."""
    import numpy as np
    import torch

    from securevfl.methods.blocks.nets import scaled_rows

    xs = []
    for name in fed.config.party_names:
        method = fed.party_methods[name]
        held = method.table.has(ids)
        block = np.zeros((len(ids), len(method.table.columns)), dtype=np.float32)
        block[held] = scaled_rows(method, ids[held])
        xs.append(torch.from_numpy(block))
    return xs, torch.as_tensor(np.asarray(fed.presence(ids), dtype=bool))


def _run_reference(job: dict[str, Any], work: Path, started: float) -> dict[str, Any]:
    """FALSE-VFL through its single-process reference (`FalseVFLReference`: the same model code,
    every cross-party quantity through an in-memory sum) on exactly the rows, z-scores, labeled
    budget and presence of the federation the other methods run on: the federation is built
    (split, missingness, parties' set-up) but the model is trained by the reference, on mixed
    batches of `stage1_batch` rows instead of pattern-homogeneous ones (much cheaper on 8
    parties, whose ~250 presence patterns make each federated epoch ~500 calls)."""
    import numpy as np
    import torch

    from securevfl.methods.blocks.nets import class_count, derived_seed
    from securevfl.methods.false_vfl.model import config_from_options
    from securevfl.methods.false_vfl.reference import FalseVFLReference, TrainSchedule
    from securevfl.metrics import task_metrics

    tests = list(job["tests"])
    fed = federation(raw_config(job, tests[0]), work, "train")
    opts = fed.config.options
    train_ids = fed.train_ids
    xs, present = party_blocks(fed, train_ids)
    table = fed.active_table
    labeled = torch.as_tensor(table.labeled(train_ids))
    y = torch.as_tensor(table.label_rows(train_ids))
    y = torch.nan_to_num(y, nan=0.0).long()  # unlabeled rows: never read (stage 2 = labeled)
    n_classes = class_count(fed.config.task, table.labels)
    ref = FalseVFLReference(
        [x.shape[1] for x in xs],
        n_classes,
        config_from_options(opts),
        seed=derived_seed(fed.config.seed, "false-vfl"),
    )
    schedule = TrainSchedule(
        stage1_epochs=opts.stage1_epochs,
        stage1_lr=opts.stage1_lr,
        stage1_batch=opts.stage1_batch,
        stage2_epochs=opts.stage2_epochs,
        stage2_lr=opts.stage2_lr,
        stage2_batch=opts.stage2_batch,
        weight_decay=opts.weight_decay,
    )
    history = ref.fit(xs, present, labeled, y, schedule)
    train_seconds = time.perf_counter() - started
    results = {}
    for i, test in enumerate(tests):
        other = fed if i == 0 else federation(raw_config(job, test), work, test)
        xt, pt = party_blocks(other, other.test_ids)
        with torch.no_grad():
            proba = ref.predict_proba(xt, pt).double().numpy()
        log_p = np.log(np.clip(proba, 1e-12, 1.0))
        output = log_p[:, 1] - log_p[:, 0] if fed.config.task == "binary" else log_p
        metrics = task_metrics(
            fed.config.task, y_true=other.active_table.label_rows(other.test_ids), output=output
        )
        metrics.update(n_eval=len(other.test_ids), n_fallback=0)
        results[test] = metrics
    return {
        "dataset": job["dataset"],
        "method": job["method"],
        "train": job["train"],
        "seed": job["seed"],
        "quick": job["quick"],
        "path": "reference",
        "accuracy": {t: 100 * m["accuracy"] for t, m in results.items()},
        "test": results,
        "n_train": int(len(train_ids)),
        "history_tail": {k: v[-3:] for k, v in history.items()},
        "train_seconds": train_seconds,
        "wall_seconds": time.perf_counter() - started,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# --------------------------------------------------------------------------------------------
# results, table and figure


def load_results(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def save_results(path: Path, results: dict[str, Any]) -> None:
    """Write atomically, keeping runs another process added to the file meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    results["runs"] = {**load_results(path)["runs"], **results["runs"]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def cell(values: Sequence[float]) -> str:
    import numpy as np

    if not values:
        return "—"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"  # population std over seeds


def collect(
    results,
    dataset,
    method,
    train,
    test,
    quick,
    seeds,
    path="reference",
    *,
    credit_rows: int = 0,
    metric: str = "accuracy",
) -> list[float]:
    """The runs' `metric` (%) at one cell, one value per seed found."""
    out = []
    for seed in seeds:
        job = {"dataset": dataset, "method": method, "train": train, "seed": seed, "quick": quick}
        job.update(path=path, credit_rows=credit_rows)
        entry = results["runs"].get(run_key(job))
        if entry is None or test not in entry["accuracy"]:
            continue
        if metric == "accuracy":
            out.append(entry["accuracy"][test])
        else:
            out.append(100 * entry["test"][test][metric])
    return out


def report(
    results, out_dir: Path, *, datasets, methods, trains, tests, quick, seeds, path, credit_rows
) -> str:
    """The markdown tables (and one PNG per data set) of what `results` holds: accuracy, and on
    Credit (binary, 78 % of rows in the majority class) also F1 of the positive class."""
    tag = ("_quick" if quick else "") + ("_federated" if path == "federated" else "")
    suffix = report_suffix(datasets, credit_rows, seeds)
    lines = [
        f"# FALSE-VFL benchmark ({'quick' if quick else 'full'} setting)",
        "",
        "Accuracy (%) on the test rows, mean ± std over seeds "
        f"{', '.join(map(str, seeds))}; labeled budget 500 of which 100 fully aligned; "
        "plain aggregation. Baselines: every role's round stages in one thread "
        "(`DirectFederation`); FALSE-VFL: "
        + (
            "its single-process reference (the same model code, in-memory sums) on the "
            "federation's rows, z-scores and presence"
            if path == "reference"
            else "`DirectFederation` too"
        )
        + ". Rows: method; columns: test pattern. Produced by `python bench/false_vfl.py"
        + f" --datasets {','.join(datasets)} --train {','.join(trains)}"
        + f" --seeds {','.join(map(str, seeds))}"
        + (" --quick" if quick else "")
        + ("" if path == "reference" else " --path federated")
        + (f" --credit-rows {credit_rows}" if "credit" in datasets else "")
        + "`."
        + (
            (
                f" Credit: a seeded subsample of {credit_rows} rows"
                if credit_rows != credit_table_rows()
                else f" Credit: the whole table, {credit_rows} rows"
            )
            + " (20 % test); 77.9 % of the full table's rows are in the majority class (no "
            "default), so its F1 table (of the positive class, %) follows the accuracy one."
            if "credit" in datasets
            else ""
        ),
        "",
    ]
    for dataset in datasets:
        metrics = ("accuracy", "f1") if dataset == "credit" else ("accuracy",)
        for train in trains:
            for metric in metrics:
                what = "" if metric == "accuracy" else f", {metric.upper()}"
                lines += [f"## {dataset}, trained under {train}{what}", ""]
                lines.append("| method | " + " | ".join(tests) + " |")
                lines.append("|---|" + "---|" * len(tests))
                for method in methods:
                    row = [
                        cell(
                            collect(
                                results,
                                dataset,
                                method,
                                train,
                                t,
                                quick,
                                seeds,
                                path,
                                credit_rows=credit_rows,
                                metric=metric,
                            )
                        )
                        for t in tests
                    ]
                    lines.append(f"| {LABELS[method]} | " + " | ".join(row) + " |")
                lines.append("")
        png = out_dir / f"false_vfl_{dataset}{tag}{suffix}.png"
        drawn = plot(
            results,
            png,
            dataset=dataset,
            methods=methods,
            trains=trains,
            tests=tests,
            quick=quick,
            seeds=seeds,
            path=path,
            credit_rows=credit_rows,
        )
        if drawn:
            lines += [f"![{dataset}]({png.name})", ""]
    if path == "federated":
        lines += agreement(
            results,
            datasets=datasets,
            trains=trains,
            tests=tests,
            quick=quick,
            seeds=seeds,
            credit_rows=credit_rows,
        )
    lines += [
        "PlugVFL scores only the test rows holding its anchor block (the last party), as in "
        "the LASER-VFL authors' code; LASER-VFL's accuracy is averaged over the predictors of a "
        "row. Runs, seconds and every metric: `false_vfl.json`.",
        "",
    ]
    return "\n".join(lines)


def agreement(results, *, datasets, trains, tests, quick, seeds, credit_rows) -> list[str]:
    """Markdown: FALSE-VFL's accuracy through the engine beside its reference's, run by run
    (same seed, rows, presence and schedule; the engine and the reference draw different
    batches and noise, so they agree up to training noise, not exactly)."""
    lines = [
        "## FALSE-VFL: engine (`--path federated`) beside reference (`--path reference`)",
        "",
        "Accuracy (%) engine / reference at three test patterns, and the mean of |engine − "
        "reference| over all test patterns, per run with both.",
        "",
        "| data set | trained | method | seed | mcar0 | mcar5 | mnar7 | mean abs. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    diffs = []
    for dataset in datasets:
        for train in trains:
            for method in ("false1", "false2"):
                for seed in seeds:
                    job = {"dataset": dataset, "method": method, "train": train, "seed": seed}
                    job.update(quick=quick, credit_rows=credit_rows)
                    fed = results["runs"].get(run_key({**job, "path": "federated"}))
                    ref = results["runs"].get(run_key({**job, "path": "reference"}))
                    if fed is None or ref is None:
                        continue
                    both = [t for t in tests if t in fed["accuracy"] and t in ref["accuracy"]]
                    d = [abs(fed["accuracy"][t] - ref["accuracy"][t]) for t in both]
                    diffs += d
                    shown = [
                        f"{fed['accuracy'][t]:.1f} / {ref['accuracy'][t]:.1f}" if t in both else "—"
                        for t in ("mcar0", "mcar5", "mnar7")
                    ]
                    lines.append(
                        f"| {dataset} | {train} | {LABELS[method]} | {seed} | "
                        + " | ".join(shown)
                        + f" | {sum(d) / max(len(d), 1):.1f} |"
                    )
    if diffs:
        lines += [
            "",
            f"Mean |engine − reference| over every cell: {sum(diffs) / len(diffs):.2f} points.",
            "",
        ]
    return lines


def plot(
    results, png: Path, *, dataset, methods, trains, tests, quick, seeds, path, credit_rows
) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(trains), figsize=(4.5 * len(trains), 3.6), squeeze=False)
    drawn = False
    for ax, train in zip(axes[0], trains, strict=True):
        for method in methods:
            vals = [
                collect(
                    results, dataset, method, train, t, quick, seeds, path, credit_rows=credit_rows
                )
                for t in tests
            ]
            if not any(vals):
                continue
            mean = [np.mean(v) if v else np.nan for v in vals]
            std = [np.std(v) if v else np.nan for v in vals]
            ax.errorbar(
                range(len(tests)), mean, yerr=std, marker="o", capsize=2, label=LABELS[method]
            )
            drawn = True
        ax.set_xticks(range(len(tests)), tests, rotation=45)
        ax.set_title(f"{dataset}, trained {train}")
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return False
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------
# overhead: one FALSE-VFL epoch over real processes, mask beside plain


def overhead(out_dir: Path, *, reps: int, epochs: int) -> dict[str, Any]:
    """`securevfl run` of FALSE-VFL-I on digits (MCAR 5) with plain and mask, alternating, each
    `epochs` stage-1 epochs; returns the per-epoch seconds of each and their ratio."""
    import numpy as np

    from securevfl.config import dump_toml

    work = Path(tempfile.mkdtemp(prefix="false-vfl-overhead-"))
    try:
        job = {
            "dataset": "digits",
            "method": "false1",
            "train": "mcar5",
            "seed": 0,
            "quick": True,
            "sections": write_data(work / "data", "digits", credit_rows=0),
        }
        seconds: dict[str, list[float]] = {"plain": [], "mask": []}
        for rep in range(reps):
            for aggregation in ("plain", "mask"):
                raw = raw_config(job, "mcar5", aggregation=aggregation)
                raw["method"].update(stage1_epochs=epochs, stage2_epochs=0)
                # the same rows under both: plain would also sum the ~3 % single-party rows
                # that mask (min_group 2) skips
                raw["run"]["min_group"] = raw["policy"]["min_group"] = 1
                raw["network"] = {"round_timeout": 300.0, "startup_timeout": 300.0}
                config = work / f"{aggregation}{rep}.toml"
                config.write_text(dump_toml(raw))
                run_dir = work / f"{aggregation}{rep}"
                env = dict(os.environ, OMP_NUM_THREADS="1")
                done = subprocess.run(
                    [sys.executable, "-m", "securevfl", "run", str(config), "--out", str(run_dir)],
                    capture_output=True,
                    text=True,
                    env=env,
                    cwd=REPO,
                    timeout=3600,
                )
                if done.returncode != 0:
                    raise RuntimeError(f"{aggregation} run failed:\n{done.stderr[-3000:]}")
                metrics = json.loads((run_dir / "metrics.json").read_text())
                seconds[aggregation] += list(metrics["epoch_seconds"][:epochs])
                print(f"{aggregation} rep {rep}: {metrics['epoch_seconds']}", flush=True)
        plain, mask = float(np.median(seconds["plain"])), float(np.median(seconds["mask"]))
        return {
            "what": "FALSE-VFL-I stage-1 epoch on digits (8 parties, MCAR 5, 1297 training rows, "
            "stage1_batch 128, kappa 5, min_group 1), `securevfl run` over real processes "
            "(ZeroMQ, CURVE), plain and mask alternating in one invocation; median seconds per "
            "epoch",
            "epoch_seconds": seconds,
            "plain_median": plain,
            "mask_median": mask,
            "ratio": mask / plain,
            "cpus": os.cpu_count(),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="digits,credit")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--train", default=",".join(TRAIN), help="training patterns")
    ap.add_argument("--tests", default=",".join(PATTERNS), help="test patterns")
    ap.add_argument(
        "--seeds",
        default=",".join(map(str, DEFAULT_SEEDS)),
        help="other seeds than 0,1,2 report to false_vfl*_seeds<...>.md/png",
    )
    ap.add_argument("--quick", action="store_true", help="fewer epochs (see `settings`)")
    ap.add_argument(
        "--path",
        choices=("reference", "federated"),
        default="reference",
        help="how FALSE-VFL trains: its single-process reference on the federation's rows "
        "(default; minutes) or the engine's round stages (`DirectFederation`; 2-4x slower)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="parallel processes (at most 2 here)")
    ap.add_argument(
        "--credit-rows",
        type=int,
        default=DEFAULT_CREDIT_ROWS,
        help="Credit subsample size; 0 = the whole table (30000 rows). A size other than 3000 "
        "reports to false_vfl*_rows<rows>.md/png",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--overhead", action="store_true", help="mask vs plain epoch, processes")
    ap.add_argument("--overhead-reps", type=int, default=2)
    ap.add_argument("--overhead-epochs", type=int, default=2)
    args = ap.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    datasets, methods, trains, tests = (
        split(a) for a in (args.datasets, args.methods, args.train, args.tests)
    )
    seeds = [int(s) for s in split(args.seeds)]
    for name, given, known in (("method", methods, METHODS), ("pattern", trains + tests, PATTERNS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            ap.error(f"unknown {name}(s) {unknown}; known: {list(known)}")
    if "credit" in datasets:
        try:  # 0 = every row; the runs' keys and the reports name the count
            args.credit_rows = resolve_credit_rows(args.credit_rows, credit_table_rows())
        except (ValueError, OSError) as exc:
            ap.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    path = args.out / f"false_vfl{tag}.json"
    if args.overhead:
        result = overhead(args.out, reps=args.overhead_reps, epochs=args.overhead_epochs)
        (args.out / "false_vfl_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
        print(
            f"plain {result['plain_median']:.2f} s/epoch, mask {result['mask_median']:.2f} "
            f"s/epoch, ratio {result['ratio']:.2f}"
        )
        return 0
    results = load_results(path)
    if not args.report_only:
        data_dir = Path(tempfile.mkdtemp(prefix="false-vfl-data-"))
        sections = {d: write_data(data_dir / d, d, credit_rows=args.credit_rows) for d in datasets}
        jobs = []
        for dataset in datasets:  # seed-major: a partial sweep covers every cell once first
            for seed in seeds:
                for train in trains:
                    for method in methods:
                        job = {
                            "dataset": dataset,
                            "method": method,
                            "train": train,
                            "seed": seed,
                            "quick": args.quick,
                            "path": args.path,
                            "credit_rows": args.credit_rows,
                            "tests": tests,
                            "sections": sections[dataset],
                        }
                        have = results["runs"].get(run_key(job), {}).get("accuracy", {})
                        if not set(tests) <= set(have):
                            jobs.append(job)
        print(f"{len(jobs)} runs to do ({len(results['runs'])} in {path.name})", flush=True)
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=ctx) as pool:
            futures = {pool.submit(run_job, job): job for job in jobs}
            for future in as_completed(futures):
                job = futures[future]
                try:
                    entry = future.result()
                except RuntimeError as exc:
                    print(f"FAILED {exc}", flush=True)
                    continue
                old = results["runs"].get(run_key(job), {})
                entry["accuracy"] = {**old.get("accuracy", {}), **entry["accuracy"]}
                entry["test"] = {**old.get("test", {}), **entry["test"]}
                results["runs"][run_key(job)] = entry
                save_results(path, results)
                acc = "  ".join(f"{t} {a:.1f}" for t, a in entry["accuracy"].items())
                print(f"{run_key(job)}  ({entry['train_seconds']:.0f} s)  {acc}", flush=True)
        shutil.rmtree(data_dir, ignore_errors=True)
    text = report(
        results,
        args.out,
        datasets=datasets,
        methods=methods,
        trains=trains,
        tests=tests,
        quick=args.quick,
        seeds=seeds,
        path=args.path,
        credit_rows=args.credit_rows,
    )
    federated = "_federated" if args.path == "federated" else ""
    suffix = report_suffix(datasets, args.credit_rows, seeds)
    (args.out / f"false_vfl{tag}{federated}{suffix}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
