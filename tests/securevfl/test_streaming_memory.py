"""A streamed table keeps nothing per row in memory: its ids, each id's row and the active
party's labels are an index on disk (`securevfl.data.rowstore.DiskRows`), built by an external
merge sort, so the memory a load, an encoding fit, a scaler fit and a few batches allocate does
not grow with the rows of the file; the index answers exactly as the in-memory table does
(positions, membership, labels, refused repeated ids, the first empty label), and the cache's
files are readable by their owner only."""

from __future__ import annotations

import stat
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.data import rowstore
from securevfl.data import table as tables
from securevfl.errors import DataError

CHUNK = 8192  # bytes of text per chunk


@pytest.fixture
def small_runs(monkeypatch):
    """Runs, merge buffers, fence blocks and scans far smaller than the tables below, so that
    every path of the external sort and of the index is taken and constant costs stay small."""
    monkeypatch.setattr(rowstore, "RUN_ROWS", 4096)
    monkeypatch.setattr(rowstore, "MERGE_BYTES", 64 << 10)
    monkeypatch.setattr(rowstore, "FENCE", 64)
    monkeypatch.setattr(rowstore, "GATHER", 64)
    monkeypatch.setattr(rowstore, "ID_BLOCK", 2048)
    monkeypatch.setattr(rowstore, "SPANS", 8)
    monkeypatch.setattr(rowstore, "SCAN_ROWS", 1024)


def write_table(path: Path, n: int, *, seed: int = 0, empty_label_at: int | None = None) -> None:
    """String ids (hashed: their sorted order is not the file's), 4 numbers with empty cells,
    a categorical column, a text label; every 7th row lacks party p's cells."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).round(4)
    towns = np.array(["north", "south", "east", "?"])[rng.integers(0, 4, n)]
    lines = ["customer,a,b,c,town,outcome"]
    for i in range(n):
        cells = ["" if (i % 7 == 3 or rng.random() < 0.03) else str(v) for v in x[i, :3]]
        town = "" if i % 7 == 3 else towns[i]
        label = "" if i == empty_label_at else ("yes" if x[i, 3] > 0 else "no")
        lines.append(f"c-{(i * 7919) % (10 * n)}-{i},{','.join(cells)},{town},{label}")
    path.write_text("\n".join(lines) + "\n")


def config(directory: Path, *, stream: bool):
    raw = {
        "data": {
            "path": "data.csv",
            "id": "customer",
            "label": "outcome",
            "positive": "yes",
            "stream": stream,
        },
        "parties": {"p": {"columns": ["a", "b", "town"]}, "q": {"columns": ["c"]}},
    }
    return parse_config(raw, source=directory / "config.toml")


def _load(directory: Path, n: int, *, stream: bool = True, active: bool = False):
    path = directory / f"data-{n}.csv"
    if not path.exists():
        write_table(path, n)
    cfg = config(directory, stream=stream)
    kw = {"stream": stream, "cache_dir": directory / "cache", "chunk_bytes": CHUNK}
    if active:
        return tables.load_active_table(path, cfg, **kw)
    return tables.load_party_table(path, cfg, "p", **kw)


def _allocated_peak(directory: Path, n: int) -> int:
    """Peak bytes allocated (NumPy's and Python's, tracemalloc) to load a streamed table of `n`
    rows, fit its encoding and scaler on the training ids and read 40 batches of 64 rows. The
    training ids are a list made before (as a party receives them), not counted."""
    path = directory / f"data-{n}.csv"
    write_table(path, n)
    cfg = config(directory, stream=True)
    kw = {"stream": True, "cache_dir": directory / "cache", "chunk_bytes": CHUNK}
    first = tables.load_party_table(path, cfg, "p", **kw)
    train = np.array(first.ids[::3], dtype=np.int64)
    batches = np.random.default_rng(0).choice(train, size=(40, 64))
    del first
    tracemalloc.start()
    try:
        table = tables.load_party_table(path, cfg, "p", **kw)
        table.prepare(train)
        table.column_summary(train)
        for ids in batches:
            table.rows(ids)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    table.rowstore.close()
    return peak


def test_what_a_streamed_table_allocates_does_not_grow_with_its_rows(tmp_path, small_runs):
    """A per-row array held anywhere on the way (the ids, their order, the labels: 4 or 8 bytes
    a row) would add 240 to 480 kB between the N- and 4N-row tables."""
    n = 20_000
    small = _allocated_peak(tmp_path, n)
    large = _allocated_peak(tmp_path, 4 * n)
    assert large < 1.25 * small, (small, large)  # measured: 370 and 352 kB


def test_a_streamed_tables_arrays_are_maps_of_its_cache_or_small(tmp_path, small_runs):
    """Every array the table and its store hold is either a read-only map of a cache file or
    no larger than the fence (8 bytes per `FENCE` rows); the party's and the active party's."""
    n = 40_000
    for active in (False, True):
        table = _load(tmp_path, n, active=active)
        assert table.streamed and 0.8 * n < len(table) <= n
        assert isinstance(table.ids.base, np.memmap) and not table.ids.flags.writeable
        if active:
            assert isinstance(table.labels, np.memmap) and not table.labels.flags.writeable
        held = {**vars(table), **vars(table.rowstore)}
        for name, value in held.items():
            if not isinstance(value, np.ndarray):
                continue
            mapped = rowstore._read_only_map(value) is not None or isinstance(
                _root(value), (rowstore.mmap.mmap, memoryview)
            )
            # the fence: one id per FENCE rows (8 bytes per 256 rows outside this test)
            assert mapped or value.nbytes <= 8 * (len(table) // rowstore.FENCE + 1), name
        table.rowstore.close()


def _root(array: np.ndarray) -> object:
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def test_the_disk_index_answers_as_the_table_in_memory(tmp_path, small_runs):
    """Positions, membership, rows, identifiers as written and labels, over many runs and
    fence blocks, for held ids, ids the party lacks and ids no row has."""
    n = 12_000
    for active in (False, True):
        memory = _load(tmp_path, n, stream=False, active=active)
        disk = _load(tmp_path, n, stream=True, active=active)
        assert np.array_equal(np.asarray(disk.ids), memory.ids)
        rng = np.random.default_rng(3)
        strangers = rng.integers(-(2**62), 2**62, size=300)
        asked = np.concatenate([rng.permutation(memory.ids)[:2000], strangers, memory.ids[:5]])
        assert np.array_equal(disk.has(asked), memory.has(asked))
        held = asked[memory.has(asked)]
        assert np.array_equal(disk.positions(held), memory.positions(held))
        memory.prepare(memory.ids[::2])
        disk.prepare(memory.ids[::2])
        assert np.array_equal(disk.rows(held), memory.rows(held), equal_nan=True)
        assert list(disk.texts(held[:50])) == list(memory.texts(held[:50]))
        with pytest.raises(DataError, match=r"300 requested sample ids are not in this table"):
            disk.positions(asked)
        with pytest.raises(DataError, match=r"300 requested sample ids are not in this table"):
            next(disk.row_blocks(asked))
        if active:
            assert np.array_equal(np.asarray(disk.labels), memory.labels, equal_nan=True)
            assert np.array_equal(disk.label_rows(held), memory.label_rows(held), equal_nan=True)
        disk.rowstore.close()


def test_repeated_ids_and_an_empty_label_are_refused_as_in_memory(tmp_path, small_runs):
    """The same message, naming the same first five rows (in file order) of repeated ids spread
    over many runs, and the same line of the first empty label; the cache is removed."""
    n = 6000
    write_table(tmp_path / "seed.csv", n)
    rows = (tmp_path / "seed.csv").read_text().splitlines()
    for i in (4500, 5990, 1200, 3300, 5000, 2222, 100):  # 7 rows repeat an earlier row's id
        source = rows[1 + (i * 13) % 1000].split(",")[0]
        cells = rows[1 + i].split(",")
        rows[1 + i] = ",".join([source, *cells[1:]])
    path = tmp_path / "data.csv"
    path.write_text("\n".join(rows) + "\n")
    messages = {}
    for stream in (False, True):
        with pytest.raises(DataError, match="identifiers must be unique") as caught:
            tables.load_party_table(
                path,
                config(tmp_path, stream=stream),
                "p",
                stream=stream,
                cache_dir=tmp_path / "cache",
                chunk_bytes=CHUNK,
            )
        messages[stream] = str(caught.value)
    assert messages[True] == messages[False]
    assert not list((tmp_path / "cache").iterdir())
    write_table(path, n, empty_label_at=4321)
    for stream in (False, True):
        with pytest.raises(DataError, match=r"data\.csv:4323: the label 'outcome' is empty"):
            tables.load_active_table(
                path,
                config(tmp_path, stream=stream),
                stream=stream,
                cache_dir=tmp_path / "cache",
                chunk_bytes=CHUNK,
            )
    assert not list((tmp_path / "cache").iterdir())


def test_the_cache_files_are_the_owners_alone_and_go_with_the_table(tmp_path, small_runs):
    table = _load(tmp_path, 3000, active=True)
    cache = table.rowstore.dir
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    names = {p.name for p in cache.iterdir()}
    assert names >= {"numbers.f64", "codes.i32", "sorted.ids", "sorted.rows", "sorted.labels"}
    assert "runs.bin" not in names  # the sort's runs are gone once the index is built
    for p in cache.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    table.rowstore.close()
    assert not cache.exists()
