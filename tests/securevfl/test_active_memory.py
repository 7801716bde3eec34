"""The active party's held-out evaluation of raw outputs (split-NN) and its scoring metrics hold
nothing per test row beyond the one score a row that an exact ROC-AUC needs: the labels are
read a chunk at a time with the outputs (`OutputScores`), never every test row's at once (a
streamed table's `label_rows` of 10^6 ids allocates some 300 bytes an id; a 5 GB federation's
1.2 M test rows peaked the active party 320 MB above a 0.25 GB one). `OutputScores` gives
`task_metrics` over every row at once, to float rounding."""

from __future__ import annotations

import copy
import io
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from securevfl import inproc
from securevfl.data import rowarrays
from securevfl.data import table as tables
from securevfl.methods.blocks import batches as block_batches
from securevfl.methods.blocks.evaluation import OutputScores
from securevfl.methods.splitnn import SplitNNActive
from securevfl.metrics import task_metrics
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv

CHUNK = 64  # rows of an evaluation chunk in the federation tests


def chunked(task, y, output, cuts):
    scores = OutputScores(task)
    for part in np.array_split(np.arange(len(y)), cuts):
        scores.add(y[part], output[part])
    return scores.metrics()


@pytest.mark.parametrize("task", ["binary", "multiclass", "regression"])
@pytest.mark.parametrize("cuts", [1, 7])
def test_output_scores_a_chunk_at_a_time_equal_task_metrics_of_every_row(task, cuts):
    rng = np.random.default_rng(3)
    n = 1000
    if task == "binary":
        y = (rng.random(n) < 0.3).astype(float)
        # float32 logits with many ties (rounded), as a head's outputs can be
        output = np.round(rng.normal(size=(n, 1)) + y[:, None], 1).astype(np.float32)
    elif task == "multiclass":
        y = rng.integers(0, 3, size=n).astype(float)  # class 3 never true
        output = rng.normal(size=(n, 4)).astype(np.float32)
    else:
        y = rng.normal(size=n) * 3 + 10
        output = (y + rng.normal(size=n))[:, None].astype(np.float32)
    want = task_metrics(task, y_true=y, output=output)
    got = chunked(task, y, output, cuts)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key


def test_output_scores_edge_cases_match_task_metrics():
    y = np.zeros(20)
    out = np.linspace(-1, 1, 20, dtype=np.float32)[:, None]
    assert chunked("binary", y, out, 3) == task_metrics("binary", y_true=y, output=out)
    assert "roc_auc" not in chunked("binary", y, out, 3)  # one class: no ROC-AUC
    flat = np.full(5, 2.0)
    for pred in (flat, flat + 1):  # constant labels: r2 1 if exact, else 0 (scikit-learn)
        want = task_metrics("regression", y_true=flat, output=pred[:, None])
        assert chunked("regression", flat, pred[:, None], 2) == want
    assert OutputScores("binary").metrics() == {} == task_metrics("binary", y_true=[], output=[])
    with pytest.raises(ValueError, match="NaN"):
        OutputScores("binary").add(np.array([0.0, np.nan]), np.zeros(2))
    with pytest.raises(ValueError, match="0 or 1"):
        OutputScores("binary").add(np.array([0.0, 2.0]), np.zeros(2))


# ------------------------------------------------------------- a streamed split-NN federation


def _streamed(tmp_path, n: int):
    """(config, streamed active table, its test ids) of a synthetic split-NN table of `n` rows,
    half of them test rows."""
    from securevfl.roles.active import split_table

    directory = tmp_path / f"n{n}"
    directory.mkdir()
    synthetic_csv(directory / "data.csv", n=n)
    raw = copy.deepcopy(BASE_RAW)
    raw["data"].update(stream=True, test_fraction=0.5)
    raw["train"].update(epochs=1, batch_size=256)
    cfg = make_config(raw, directory)
    table = tables.load_active_table(directory / "data.csv", cfg, cache_dir=directory / "cache")
    train_ids, test_ids = split_table(table, cfg)
    table.prepare(train_ids)
    return cfg, table, test_ids


def _evaluation_peak(tmp_path, n: int) -> tuple[int, int, dict]:
    """(test rows, the tracemalloc peak of `SplitNNActive.evaluate` over them, its metrics),
    the parties' sums answered by a stand-in context (only the active party's allocations)."""
    import torch

    cfg, table, test_ids = _streamed(tmp_path, n)
    method = SplitNNActive(table=table, config=cfg, device=torch.device("cpu"))
    rng = np.random.default_rng(n)

    def call(op, *, ids, args, sums):
        assert op == "forward" and not args["train"]
        return {"S": rng.normal(size=(len(ids), cfg.width)).astype(np.float32)}

    ctx = SimpleNamespace(parties=cfg.party_names, call=call)
    tracemalloc.start()
    try:
        metrics = method.evaluate(ctx, ids=test_ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    table.rowstore.close()
    return len(test_ids), peak, metrics


def test_split_nn_evaluation_holds_one_score_a_test_row_not_every_label(tmp_path, monkeypatch):
    """The peak the evaluation allocates grows by at most ~a score a test row (a float32, kept
    for ROC-AUC, and its copy while sorted) plus noise. The evaluation that read every test
    row's label at once, then `task_metrics`, grew by some 400 bytes a test row."""
    monkeypatch.setattr(block_batches, "EVAL_BATCH", CHUNK)
    small_n, small_peak, _ = _evaluation_peak(tmp_path, 2000)
    large_n, large_peak, metrics = _evaluation_peak(tmp_path, 20000)
    assert large_n - small_n > 8000 and {"accuracy", "f1", "roc_auc"} <= metrics.keys()
    per_row = (large_peak - small_peak) / (large_n - small_n)
    assert per_row < 40, f"{per_row:.0f} bytes a test row"


def test_a_streamed_split_nn_federation_reads_test_labels_a_chunk_at_a_time(tmp_path, monkeypatch):
    """End to end (in-process roles, every table streamed): the evaluation's label reads are
    each at most a chunk, cover every test row once, and give ROC-AUC."""
    monkeypatch.setattr(block_batches, "EVAL_BATCH", CHUNK)
    reads: list[int] = []
    evaluating = [False]
    evaluate, label_rows = SplitNNActive.evaluate, tables.ActiveTable.label_rows

    def spy_labels(self, ids):
        if self.streamed and evaluating[0]:
            reads.append(len(ids))
        return label_rows(self, ids)

    def spy_evaluate(self, ctx, *, ids):
        evaluating[0] = True
        try:
            return evaluate(self, ctx, ids=ids)
        finally:
            evaluating[0] = False

    monkeypatch.setattr(tables.ActiveTable, "label_rows", spy_labels)
    monkeypatch.setattr(SplitNNActive, "evaluate", spy_evaluate)
    directory = tmp_path / "fed"
    directory.mkdir()
    synthetic_csv(directory / "data.csv", n=1200)
    raw = copy.deepcopy(BASE_RAW)
    raw["data"].update(stream=True, test_fraction=0.5)
    raw["train"].update(epochs=1, batch_size=256)
    cfg = make_config(raw, directory)
    code, metrics = inproc.run_federation(cfg, out=directory / "run", stdout=io.StringIO())
    assert code == 0, (directory / "run" / "logs" / "active.log").read_text()[-3000:]
    assert {"accuracy", "f1", "roc_auc"} <= metrics["test"].keys()
    assert metrics["n_test"] > CHUNK and max(reads) <= CHUNK
    assert sum(reads) == metrics["n_test"]


def _filter_peak(tmp_path, n: int) -> tuple[int, int, list[int]]:
    """(training rows, the tracemalloc peak of filtering them to the labeled ones, the widths
    `labeled` was asked about) on a streamed table of `n` rows."""
    cfg, table, _ = _streamed(tmp_path, n)
    from securevfl.roles.active import split_table

    train_ids, _ = split_table(table, cfg)
    widths: list[int] = []

    def labeled(ids):
        widths.append(len(ids))
        return table.labeled(ids)

    tracemalloc.start()
    try:
        kept = rowarrays.filter_ids(table.rowstore.arrays(), train_ids, labeled, "labeled")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(kept, np.asarray(train_ids)[table.labeled(train_ids)])
    table.rowstore.close()
    return len(train_ids), peak, widths


def test_filtering_ids_looks_them_up_a_bounded_block_at_a_time(tmp_path, monkeypatch):
    """`filter_ids` (the active party's labeled and held rows, a party's held ids) asks its
    look-up about at most `FILTER_ROWS` ids at once: a look-up in a streamed id index costs some
    300 bytes an id, so a block of a million ids cost 300 MB (the active party's highest phase
    on a streamed table). Its peak does not grow with the rows filtered."""
    monkeypatch.setattr(rowarrays, "FILTER_ROWS", 256)
    small_n, small_peak, small_widths = _filter_peak(tmp_path, 2000)
    large_n, large_peak, large_widths = _filter_peak(tmp_path, 20000)
    assert max(small_widths + large_widths) == 256 and sum(large_widths) == large_n
    per_row = (large_peak - small_peak) / (large_n - small_n)
    assert per_row < 5, f"{per_row:.0f} bytes a row"
