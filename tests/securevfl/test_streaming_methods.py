"""Every method family on a table streamed from disk ([data] stream = true) trains to the
metrics of the same table held in memory, while no streamed table is read whole: a spy on the
tables' reads (rows, labels, `values`) and on the active party's presence look-ups sees nothing
wider than a batch or an evaluation chunk of the test rows. Block sizes are made small (the
epoch order's blocks, the presence chunks), so that each path's loops are taken and a read of
the training rows stands out. Where a method holds every row by its maths (FALSE-VFL's stage 2
sample bank, TabVFL's host and latent evaluation, VFEM's EM), the run says so in its log."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest

from securevfl import inproc
from securevfl.config import parse_config
from securevfl.data import rowarrays, rowstore
from securevfl.data import table as tables
from securevfl.methods import method_spec
from securevfl.methods.blocks import batches as block_batches
from securevfl.methods.blocks.active import BlockActive
from securevfl.methods.false_vfl import active as false_active
from securevfl.methods.false_vfl.active import FalseVFLActiveMethod
from securevfl.methods.tabvfl import schedule as tabvfl_schedule
from securevfl.roles.active_round import ActiveRound
from tests.securevfl.conftest import permissive_policy
from tests.securevfl.fixed_seeds import fixed_seeds
from tests.securevfl.test_streaming_active import small_blocks  # noqa: F401 (a fixture)

BATCH = 16
CHUNK = 16  # rows of an evaluation / presence chunk
BLOCK = 32  # entries of a per-row array on disk read at a time (the roles' filters)


@pytest.fixture
def reads(monkeypatch):
    """The widest read of a streamed table's rows and labels, of the active party's presence
    (when its table is streamed), and the calls to `values` on a streamed table."""
    seen = {"rows": [], "labels": [], "presence": [], "values": 0}
    rows, labels = tables.PartyTable.rows, tables.ActiveTable.label_rows
    values, presence = tables.PartyTable.values, ActiveRound.presence

    def spy_rows(self, ids):
        if self.streamed:
            seen["rows"].append(len(ids))
        return rows(self, ids)

    def spy_labels(self, ids):
        if self.streamed:
            seen["labels"].append(len(ids))
        return labels(self, ids)

    def spy_values(self):
        if self.streamed:
            seen["values"] += 1
        return values.fget(self)

    def spy_presence(self, ids):
        if self.method.table.streamed:
            seen["presence"].append(len(ids))
        return presence(self, ids)

    def spying(method):  # the methods' own presence look-ups (which may chunk their reads)
        def spy(self, ctx, ids):
            if self.table.streamed:
                seen["presence"].append(len(ids))
            return method(self, ctx, ids)

        return spy

    monkeypatch.setattr(tables.PartyTable, "rows", spy_rows)
    monkeypatch.setattr(tables.ActiveTable, "label_rows", spy_labels)
    monkeypatch.setattr(tables.PartyTable, "values", property(spy_values))
    monkeypatch.setattr(ActiveRound, "presence", spy_presence)
    monkeypatch.setattr(BlockActive, "presence_matrix", spying(BlockActive.presence_matrix))
    groups = spying(FalseVFLActiveMethod._groups)
    monkeypatch.setattr(FalseVFLActiveMethod, "_groups", groups)
    monkeypatch.setattr(block_batches, "EVAL_BATCH", CHUNK)
    # the prediction chunks, in memory and streamed alike
    monkeypatch.setattr(block_batches.chunks, "__defaults__", (CHUNK,))
    monkeypatch.setattr(false_active, "EVAL_ROWS", CHUNK)
    monkeypatch.setattr(tabvfl_schedule, "CHUNK", CHUNK)
    monkeypatch.setattr(rowarrays, "BLOCK", BLOCK)
    monkeypatch.setattr(rowstore, "SCAN_ROWS", 32)
    return seen


def _config(directory: Path, name: str, *, stream: bool, edit=None):
    directory.mkdir(parents=True, exist_ok=True)
    raw = fixed_seeds(method_spec(name).example(directory))  # two runs compared
    raw["data"]["stream"] = stream
    raw.setdefault("run", {})["transport"] = "inproc"
    raw.setdefault("train", {})["batch_size"] = BATCH
    if edit is not None:
        edit(raw)
    return parse_config(permissive_policy(raw), source=directory / "config.toml")


def run_both(tmp_path: Path, name: str, seen: dict, edit=None) -> tuple[dict, dict]:
    """(metrics in memory, metrics streamed) of method `name`'s example; the spy `seen` holds
    the streamed run's reads."""
    out = {}
    for stream in (False, True):
        directory = tmp_path / f"{name}-{stream}"
        cfg = _config(directory, name, stream=stream, edit=edit)
        for key in ("rows", "labels", "presence"):
            seen[key].clear()
        seen["values"] = 0
        code, metrics = inproc.run_federation(cfg, out=directory / "run", stdout=io.StringIO())
        assert code == 0, (directory / "run" / "logs" / "active.log").read_text()[-3000:]
        out[stream] = metrics
    return out[False], out[True]


def assert_same(memory: dict, streamed: dict, *, rel: float = 1e-6) -> None:
    assert streamed["n_train"] == memory["n_train"] and streamed["n_test"] == memory["n_test"]
    assert len(streamed["history"]) == len(memory["history"])
    for a, b in zip(memory["history"], streamed["history"], strict=True):
        for key, value in a.items():
            if key in ("rows_per_s", "seconds") or not isinstance(value, float):
                continue
            assert b[key] == pytest.approx(value, rel=rel, abs=1e-9), key
    assert streamed["test"].keys() == memory["test"].keys()
    for key, value in memory["test"].items():
        if isinstance(value, float) and math.isfinite(value):
            assert streamed["test"][key] == pytest.approx(value, rel=rel, abs=1e-9), key
        elif not isinstance(value, float):
            assert streamed["test"][key] == value, key


def assert_bounded(
    seen: dict, streamed: dict, *, widest: int, keys=("rows", "labels", "presence")
) -> None:
    """No streamed read wider than `widest` (a batch, a chunk or the test rows), which is below
    the training rows; `values` never asked for."""
    assert widest < streamed["n_train"]
    assert seen["values"] == 0
    for key in keys:
        assert max(seen[key], default=0) <= widest, (key, sorted(seen[key])[-5:])


def _active_block(raw: dict) -> None:
    """The active party holds a block (its own encoder, scaler and block presence): the last
    passive party's columns, where the example gives it none; two epochs."""
    parties = raw["parties"]
    if not raw["active"].get("columns"):
        raw["active"]["columns"] = parties.pop(sorted(parties)[-1])["columns"]
    raw["train"]["epochs"] = 2


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("laser", _active_block),
        ("plugvfl", None),
        ("combinatorial", None),
        ("local", lambda raw: raw["run"].update(aggregation="plain")),
        ("ensemble", lambda raw: raw["run"].update(aggregation="plain")),
        ("standard-vfl", None),
        ("vanilla-vfl", None),  # its prediction zero-fills missing blocks: a lazily read view
    ],
)
def test_block_methods_stream_to_the_metrics_in_memory(tmp_path, reads, name, edit):
    """Training and evaluation a batch or a chunk at a time: nothing as wide as the test rows."""
    memory, streamed = run_both(tmp_path, name, reads, edit)
    assert_same(memory, streamed)
    keys = ("rows", "labels", "presence")
    assert_bounded(reads, streamed, widest=max(BATCH, CHUNK, BLOCK), keys=keys)
    assert max(BATCH, CHUNK, BLOCK) < streamed["n_test"]
    if name == "laser":  # its own block read; test rows guessed chunk by chunk (one passive)
        assert reads["rows"] and streamed["test"]["n_fallback"] > CHUNK


def test_laser_families_and_a_balanced_draw_stream_alike(tmp_path, reads):
    """Secure LASER (per-row families, kept in a file of the row cache) with the class-balanced
    epoch draw (with replacement, from a cumulative distribution in a file)."""

    def edit(raw):
        _active_block(raw)
        raw["run"].update(aggregation="mask", min_group=1)
        raw["method"] = {"balanced": True, "families": True}

    memory, streamed = run_both(tmp_path, "laser", reads, edit)
    assert_same(memory, streamed)
    assert streamed["row_families"] == memory["row_families"]
    assert sum(streamed["row_families"].values()) > 0
    assert_bounded(reads, streamed, widest=max(BATCH, CHUNK, BLOCK))


def test_balanced_draw_on_disk_equals_the_draw_in_memory(tmp_path, monkeypatch):
    """`pattern_batches`' class-balanced draw with replacement, made from files, block by
    block, gives the batches `pattern_batches` gives in memory."""

    class Table:
        streamed = True

        def __init__(self, labels):
            self.labels = labels
            self.rowstore = self
            self._arrays = rowarrays.RowArrays(tmp_path)

        def arrays(self):
            return self._arrays

        def label_rows(self, ids):
            return self.labels[ids]

    rng = np.random.default_rng(4)
    n = 3000
    labels = (rng.random(n) < 0.2).astype(float)
    ids = np.arange(n)
    present = rng.random((n, 3)) < 0.7
    table = Table(labels)
    for block in (64, 1 << 20):
        monkeypatch.setattr(rowarrays, "BLOCK", block)
        want = block_batches.pattern_batches(
            ids, present, batch_size=32, seed=3, epoch=2, labels=labels
        )
        got = list(
            block_batches.table_pattern_batches(
                table, ids, lambda b: present[b], batch_size=32, seed=3, epoch=2, balanced=True
            )
        )
        assert len(got) == len(want)
        for (a, pa), (b, pb) in zip(want, got, strict=True):
            assert np.array_equal(a, b) and np.array_equal(pa, pb)


@pytest.mark.parametrize("batching", ["pattern", "mixed"])
def test_false_vfl_stage_1_streams_to_the_metrics_in_memory(tmp_path, reads, batching):
    """Stage 1 and evaluation stream (stage 2's sample bank holds the labeled rows by design,
    so the bound is checked without it and the full run compared with it)."""

    def edit(raw, stage2=0):
        raw["method"].update(batching=batching, stage1_batch=BATCH, stage2_epochs=stage2)

    memory, streamed = run_both(tmp_path / "stage1", "false-vfl", reads, edit)
    assert_same(memory, streamed)
    assert_bounded(reads, streamed, widest=max(BATCH, CHUNK, BLOCK, streamed["n_test"]))
    memory, streamed = run_both(
        tmp_path / "both", "false-vfl", reads, lambda raw: edit(raw, stage2=1)
    )
    assert_same(memory, streamed)
    log = (tmp_path / "both" / "false-vfl-True" / "run" / "logs" / "active.log").read_text()
    assert "stage 2 holds the importance samples" in log


@pytest.mark.parametrize("name", ["tabvfl", "tabvfl-le"])
def test_tabvfl_guests_stream_their_columns(tmp_path, reads, name):
    """The guests fit their scaling a block at a time and read a batch at a time; the host
    keeps its order and latents (logged)."""
    memory, streamed = run_both(tmp_path, name, reads)
    assert_same(memory, streamed, rel=1e-5)
    assert reads["values"] == 0
    widest = max(BATCH, CHUNK, BLOCK, streamed["n_test"])
    assert reads["rows"] and max(reads["rows"]) <= widest < streamed["n_train"], reads["rows"]
    assert max(reads["presence"]) <= widest, reads["presence"]
    log = (tmp_path / f"{name}-True" / "run" / "logs" / "active.log").read_text()
    assert "the host holds its" in log


def test_vfem_on_a_streamed_table_says_it_holds_its_rows(tmp_path, reads):
    memory, streamed = run_both(tmp_path, "vfem", reads)
    assert_same(memory, streamed, rel=1e-9)
    assert reads["values"] == 0
    log = (tmp_path / "vfem-True" / "run" / "logs" / "active.log").read_text()
    assert "vfem: every role holds its block" in log


@pytest.mark.parametrize("task", ["binary", "multiclass"])
def test_scores_accumulated_by_chunk_give_the_metrics_of_every_row_at_once(task):
    """Accuracy over each row's predictors and F1 per predictor (binary; macro over the classes
    seen), from confusion counts accumulated a chunk and a pattern at a time."""
    from types import SimpleNamespace

    from securevfl.methods.blocks.evaluation import BlockEvaluation, _Scores

    rng = np.random.default_rng(7)
    n_classes = 2 if task == "binary" else 4
    y = rng.integers(0, n_classes - (task != "binary"), size=500)  # a class never true
    patterns = {"a": [0, 1], "b": [1, 2]}  # predictor names per pattern
    rows_of = np.array_split(rng.permutation(500), 2)
    preds, total = {}, _Scores(n_classes)
    for names, rows in zip(patterns.values(), rows_of, strict=True):
        classes = {f"p{k}": rng.integers(0, n_classes, size=len(rows)) for k in names}
        for name, c in classes.items():
            preds.setdefault(name, []).append((rows, c))
        part = _Scores(n_classes)
        for cut in np.array_split(np.arange(len(rows)), 3):
            part.add(y[rows[cut]], {k: c[cut] for k, c in classes.items()})
        total.merge(part)
    owner = SimpleNamespace(config=SimpleNamespace(task=task))
    want = BlockEvaluation.metrics_from(owner, y, preds, n_fallback=3, n_excluded=2)
    got = total.metrics(binary=task == "binary", n_fallback=3, n_excluded=2)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, dict):
            assert got[key] == pytest.approx(value, rel=1e-12)
        else:
            assert got[key] == pytest.approx(value, rel=1e-12), key


def _epoch_peak(directory: Path, n: int, *, balanced: bool) -> int:
    """Peak bytes allocated (tracemalloc) by an epoch's pattern batches over a streamed table of
    `n` rows (every row's code, the order, the patterns' rows and the batch order in files),
    with per-row keys kept in a file of the row cache (`RowKeys`, as LASER's families), until
    40 batches are out. The training ids are a file made before, as the active party has them."""
    import tracemalloc

    from tests.securevfl.test_streaming_active import config as active_config
    from tests.securevfl.test_streaming_active import load as load_active

    cfg = active_config(directory, stream=True)
    table = load_active(directory, n, cfg)
    ids = rowarrays.filled(table.rowstore.arrays(), "ids", np.int64, table.rowstore.id_blocks())

    def presence(rows):
        return np.stack([rows % 3 != 0, rows % 5 != 1, rows % 7 != 2], axis=1)

    tracemalloc.start()
    try:
        families = block_batches.RowKeys(table)

        def keys(rows, pres):
            known = families.get(rows)
            new = known < 0
            known[new] = rows[new] % 2
            families.put(rows[new], known[new])
            return known

        order = block_batches.table_pattern_batches(
            table, ids, presence, batch_size=64, seed=1, epoch=0, balanced=balanced, keys=keys
        )
        for _, (rows, pattern) in zip(range(40), order, strict=False):
            assert len(rows) and pattern.any()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table.rowstore.close()
    return peak


@pytest.mark.usefixtures("small_blocks")  # the row cache's blocks made small
@pytest.mark.parametrize("balanced", [False, True])
def test_an_epochs_pattern_batches_allocate_nothing_per_row(tmp_path, monkeypatch, balanced):
    """A per-row array in memory (codes, the order, a pattern's rows: 4 to 8 bytes a row)
    would add 240 to 480 kB between the N- and 4N-row tables (measured: ~350 kB for 20k, 80k
    and 320k rows; built in memory: 1.4 MB at 20k, 5.4 MB at 80k)."""
    monkeypatch.setattr(block_batches, "EVAL_BATCH", 1024)
    n = 20_000
    _epoch_peak(tmp_path, 2000, balanced=balanced)  # first-use allocations out of the way
    small = _epoch_peak(tmp_path, n, balanced=balanced)
    large = _epoch_peak(tmp_path, 4 * n, balanced=balanced)
    assert large < 1.25 * small, (small, large)
