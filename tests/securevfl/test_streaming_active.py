"""The active party of a streamed table keeps its per-row arrays on disk: the train/test split,
which rows each party holds, the rows some party holds, the labeled rows, an epoch's shuffled
order (`securevfl.data.rowarrays`, files of the table's row cache). Each equals what the same
table held in memory gives, and the memory the active party's path allocates (load, split,
encoding fit, set-up, a labeled budget, 40 batches) does not grow with the rows."""

from __future__ import annotations

import logging
import stat
import tracemalloc
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.data import rowarrays, rowstore
from securevfl.data import table as tables
from securevfl.methods.blocks.nets import batches
from securevfl.roles.active import split_table
from securevfl.roles.active_round import ActiveRound
from tests.securevfl.test_streaming_memory import write_table

CHUNK = 8192  # bytes of text per chunk
PARTIES = ("p", "q")


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks far smaller than the tables below: every path of the block loops is taken and
    constant costs stay small."""
    monkeypatch.setattr(rowstore, "RUN_ROWS", 4096)
    monkeypatch.setattr(rowstore, "MERGE_BYTES", 64 << 10)
    monkeypatch.setattr(rowstore, "FENCE", 64)
    monkeypatch.setattr(rowstore, "GATHER", 64)
    monkeypatch.setattr(rowstore, "ID_BLOCK", 2048)
    monkeypatch.setattr(rowstore, "SPANS", 8)
    monkeypatch.setattr(rowstore, "SCAN_ROWS", 1024)
    monkeypatch.setattr(rowarrays, "BLOCK", 2048)


def config(directory: Path, *, stream: bool, stratify: bool = True, test_fraction=0.25):
    raw = {
        "data": {
            "path": "data.csv",
            "id": "customer",
            "label": "outcome",
            "positive": "yes",
            "stream": stream,
            "test_fraction": test_fraction,
        },
        "active": {"columns": ["a", "town"]},
        "parties": {"p": {"columns": ["b"]}, "q": {"columns": ["c"]}},
    }
    cfg = parse_config(raw, source=directory / "config.toml")
    # a labeled budget: the split is not stratified (the labels it reads are emptied)
    return cfg if stratify else replace(cfg, labeled=100)


def load(directory: Path, n: int, cfg) -> tables.ActiveTable:
    path = directory / f"data-{n}.csv"
    if not path.exists():
        write_table(path, n)
    return tables.load_active_table(
        path,
        cfg,
        stream=cfg.stream,
        cache_dir=directory / "cache",
        chunk_bytes=CHUNK,
    )


def active_round(cfg, table) -> ActiveRound:
    """The active party's stage over `table` (no exchange: the calls tested make none)."""

    def exchange(env):
        raise AssertionError("no call expected")

    return ActiveRound(
        cfg=cfg,
        exchange=exchange,
        session=bytes(16),
        method=SimpleNamespace(table=table),
        run_dir=Path("."),
        logger=logging.getLogger("test"),
    )


def held_flags(n: int) -> dict[str, np.ndarray]:
    """Which sorted rows each party holds: some rows held by nobody."""
    k = np.arange(n)
    return {"p": k % 7 != 3, "q": (k % 5 != 1) & (k % 3 != 0)}


@pytest.mark.parametrize(("stratify", "test_fraction"), [(True, 0.25), (False, 0.25), (True, 0.0)])
def test_a_streamed_active_party_splits_filters_and_shuffles_as_in_memory(
    tmp_path, small_blocks, stratify, test_fraction
):
    n = 9000
    kw = {"stratify": stratify, "test_fraction": test_fraction}
    memory = load(tmp_path, n, config(tmp_path, stream=False, **kw))
    cfg = config(tmp_path, stream=True, **kw)
    disk = load(tmp_path, n, cfg)
    assert disk.streamed and not memory.streamed
    want, got = split_table(memory, cfg), split_table(disk, cfg)
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(a, np.asarray(b))
    assert len(got[1]) == round(test_fraction * n) or stratify  # stratified: per class
    memory.prepare(want[0])
    disk.prepare(got[0])
    flags = held_flags(n)
    ctx_m, ctx_d = active_round(cfg, memory), active_round(cfg, disk)
    ctx_m.set_presence(flags)
    ctx_d.set_presence(flags)
    assert ctx_d.unheld_rows() == ctx_m.unheld_rows() > 0
    some = np.random.default_rng(2).permutation(memory.ids)[:777]
    assert np.array_equal(ctx_d.presence(some), ctx_m.presence(some))
    for a, b in zip(want, got, strict=True):
        assert np.array_equal(np.asarray(ctx_d.held_rows(b)), ctx_m.held_rows(a))
    train = ctx_d.held_rows(got[0])
    assert isinstance(train, np.memmap) and not train.flags.writeable
    order = list(
        rowarrays.shuffled_batches(train, 64, seed=5, epoch=3, arrays=disk.rowstore.arrays())
    )
    expected = batches(ctx_m.held_rows(want[0]), 64, seed=5, epoch=3)
    assert len(order) == len(expected)
    for a, b in zip(expected, order, strict=True):
        assert np.array_equal(a, b)
        assert np.array_equal(disk.label_rows(b), memory.label_rows(a), equal_nan=True)
        assert np.array_equal(disk.rows(b), memory.rows(a), equal_nan=True)
    disk.rowstore.close()


def test_a_labeled_budget_keeps_the_same_rows_streamed(tmp_path, small_blocks):
    """`train_and_evaluate`'s labeled-rows filter: `table.labeled`, block by block."""
    n = 5000
    path = tmp_path / f"data-{n}.csv"
    write_table(path, n)
    lines = path.read_text().splitlines()
    for i in range(1, len(lines), 4):  # every 4th row's label emptied
        lines[i] = lines[i].rsplit(",", 1)[0] + ","
    path.write_text("\n".join(lines) + "\n")
    cfg = config(tmp_path, stream=True, stratify=False)  # [missing] labeled set
    memory = tables.load_active_table(path, cfg, stream=False)
    disk = load(tmp_path, n, cfg)
    ids = np.asarray(memory.ids[::2])
    got = rowarrays.filter_ids(disk.rowstore.arrays(), ids, disk.labeled, "labeled")
    assert np.array_equal(np.asarray(got), ids[memory.labeled(ids)])
    assert 0 < len(got) < len(ids)
    disk.rowstore.close()


def test_the_arrays_are_the_owners_alone_and_go_with_the_table(tmp_path, small_blocks):
    cfg = config(tmp_path, stream=True)
    table = load(tmp_path, 3000, cfg)
    train, test = split_table(table, cfg)
    ctx = active_round(cfg, table)
    ctx.set_presence(held_flags(len(table)))
    held = ctx.held_rows(train)
    arrays = table.rowstore.arrays().dir
    assert arrays.parent == table.rowstore.dir
    assert stat.S_IMODE(arrays.stat().st_mode) == 0o700
    files = list(arrays.iterdir())
    assert len(files) >= 4  # train, test, presence, held rows
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    for array in (train, test, held):
        assert Path(array.filename).parent == arrays
    del held, array  # a map no longer used: its file goes with it
    assert len(list(arrays.iterdir())) == len(files) - 1
    table.rowstore.close()
    assert not arrays.exists()


def _active_peak(directory: Path, n: int) -> int:
    """Peak bytes allocated (tracemalloc) by the active party's path over a streamed table of
    `n` rows: load, split, encoding fit, set-up (which rows each party holds, rows nobody holds
    dropped), the labeled rows, and 40 batches of an epoch's shuffled order (labels, own rows,
    presence). The parties' answers are files made before (as received), not counted."""
    cfg = config(directory, stream=True)
    write_table(directory / f"data-{n}.csv", n)
    first = load(directory, n, cfg)
    held = {}
    for p, flags in held_flags(len(first)).items():
        flags.tofile(directory / f"held-{p}-{n}")
        held[p] = np.memmap(directory / f"held-{p}-{n}", dtype=bool, mode="r")
    first.rowstore.close()
    del first
    tracemalloc.start()
    try:
        table = load(directory, n, cfg)
        train, test = split_table(table, cfg)
        table.prepare(train)
        ctx = active_round(cfg, table)
        ctx.set_presence(held)
        assert ctx.unheld_rows() > 0
        train, test = ctx.held_rows(train), ctx.held_rows(test)
        train = rowarrays.filter_ids(table.rowstore.arrays(), train, table.labeled, "labeled")
        order = rowarrays.shuffled_batches(
            train, 64, seed=0, epoch=0, arrays=table.rowstore.arrays()
        )
        for _, ids in zip(range(40), order, strict=False):
            table.label_rows(ids)
            table.rows(ids)
            ctx.presence(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table.rowstore.close()
    return peak


def test_what_the_active_partys_path_allocates_does_not_grow_with_its_rows(tmp_path, small_blocks):
    """A per-row array kept anywhere on the way (the split's mask or permutation, the
    presence matrix, a filtered id list: 1 to 8 bytes a row) adds 60 to 480 kB between the
    N- and 4N-row tables (the rows some party holds kept in memory: 921 and 3101 kB; as is:
    426 and 405 kB)."""
    n = 20_000
    _active_peak(tmp_path, 2000)  # first-use allocations (imports, caches) out of the way
    small = _active_peak(tmp_path, n)
    large = _active_peak(tmp_path, 4 * n)
    assert large < 1.25 * small, (small, large)


def test_held_ids_of_a_streamed_table_are_filtered_a_block_at_a_time_into_a_file(
    tmp_path, small_blocks, monkeypatch
):
    """A party's set-up keeps the training rows it holds (`PartyTable.held_ids`): for a streamed
    table a file of its row cache, filled a block at a time, equal to the in-memory filter."""
    cfg = config(tmp_path, stream=True)
    streamed = load(tmp_path, 9000, cfg)
    memory = load(tmp_path, 9000, replace(cfg, stream=False))
    rng = np.random.default_rng(3)
    asked = np.concatenate([rng.choice(streamed.ids, 5000, replace=False), [10**12, -5]])
    widths: list[int] = []
    has = tables.PartyTable.has

    def spy(self, ids):
        widths.append(len(ids))
        return has(self, ids)

    monkeypatch.setattr(tables.PartyTable, "has", spy)
    held = streamed.held_ids(asked)
    assert isinstance(held, np.memmap)  # a file of the row cache, not an array in memory
    assert max(widths) <= rowarrays.BLOCK < len(asked)
    widths.clear()
    np.testing.assert_array_equal(held, memory.held_ids(asked))
    np.testing.assert_array_equal(memory.held_ids(asked), asked[: len(asked) - 2])
