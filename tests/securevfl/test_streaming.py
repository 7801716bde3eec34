"""Streaming a role's table from a row cache on disk ([data] stream = true, or "auto" above
256 MiB): a small file forced to stream trains to the metrics of the same file held in memory,
the cache lives in the role's own run directory (mode 0700) and goes with the table or the
process, reading it keeps little of it resident, and a bad row in a later chunk is named by its
row, its column and the fix."""

from __future__ import annotations

import gc
import io
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import parse_config
from securevfl.data import table as tables
from securevfl.data.columns import row_ids
from securevfl.data.rowstore import DiskRows, MemoryRows
from securevfl.errors import DataError
from tests.securevfl.conftest import permissive_policy

REPO = Path(__file__).resolve().parents[2]
CHUNK = 2048  # bytes of text per chunk: the small files below span many chunks
NETWORK = {
    "heartbeat_interval": 0.2,
    "peer_timeout": 5.0,
    "round_timeout": 30.0,
    "startup_timeout": 30.0,
}


def write_table(path: Path, n: int = 360, seed: int = 0, *, gaps: bool = True) -> None:
    """String ids, categorical columns with `?` cells, a yes/no column, numbers, a text label;
    with `gaps`, every 13th row lacks party web's block (its cells empty)."""
    rng = np.random.default_rng(seed)
    jobs = np.array(["admin", "cook", "pilot", "nurse"])
    lines = ["customer,job,city,score,member,income,visits,device,outcome"]
    for i in range(n):
        job = jobs[rng.integers(4)]
        city = rng.choice(["north", "south", "?"])
        score, income, visits = rng.normal(size=3)
        member = rng.choice(["yes", "no"])
        device = rng.choice(["ios", "android", "web"])
        signal = score + income + (member == "yes") + 0.5 * visits + (job == "pilot")
        y = "churn" if signal > 0.8 else "stay"
        web = ("", "") if gaps and i % 13 == 7 else (f"{visits:.4f}", device)
        lines.append(
            f"cust-{i:05d},{job},{city},{score:.4f},{member},{income:.4f},{web[0]},{web[1]},{y}"
        )
    path.write_text("\n".join(lines) + "\n")


def config(directory: Path, *, stream: bool | str, method: str = "laser", **run):
    raw = {
        "run": {
            "method": method,
            "aggregation": "mask",
            "seed": 0,
            "shared_init": True,  # streamed and in-memory runs compared: one initial model
            "transport": "inproc",
            **run,
        },
        "data": {
            "path": "data.csv",
            "id": "customer",
            "label": "outcome",
            "positive": "churn",
            "test_fraction": 0.25,
            "stream": stream,
        },
        "parties": {
            "crm": {"columns": ["job", "city"]},
            "bank": {
                "columns": ["score", "member", "income"],
                "types": {"income": "numeric", "member": "boolean"},
            },
            "web": {"columns": ["visits", "device"]},
        },
        "train": {"epochs": 3, "batch_size": 32, "lr": 0.05},
        "model": {"hidden": [8], "width": 4},
        "network": NETWORK,
    }
    return parse_config(permissive_policy(raw), source=directory / "config.toml")


def test_a_streamed_table_gives_the_encoded_rows_and_summaries_of_one_in_memory(tmp_path):
    write_table(tmp_path / "data.csv")
    kept = tables.split_federation(config(tmp_path, stream=False), tmp_path / "split")
    for role in ("crm", "bank", "web"):
        cfg = config(tmp_path, stream=False)
        memory = tables.load_party_table(kept[role], cfg, role, chunk_bytes=CHUNK)
        disk = tables.load_party_table(
            kept[role], cfg, role, stream=True, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK
        )
        assert isinstance(memory.rowstore, MemoryRows) and not memory.streamed
        assert isinstance(disk.rowstore, DiskRows) and disk.streamed
        assert np.array_equal(memory.ids, disk.ids)
        train = memory.ids[::2]
        memory.prepare(train)
        disk.prepare(train)
        assert memory.columns == disk.columns
        some = memory.ids[np.random.default_rng(1).permutation(len(memory.ids))[:50]]
        assert np.array_equal(memory.rows(some), disk.rows(some), equal_nan=True)
        assert np.array_equal(memory.values, disk.rows(disk.ids), equal_nan=True)
        want, got = memory.column_summary(train), disk.column_summary(train)
        for key in want:
            assert np.allclose(got[key], want[key], rtol=1e-13, atol=1e-15, equal_nan=True), key
        assert list(disk.texts(some)) == list(memory.texts(some))
    assert len(tables.load_party_table(kept["web"], cfg, "web").ids) < 360  # unheld rows dropped


def test_scaled_batches_equal_scaling_each_batch_and_follow_a_new_scaler(tmp_path, monkeypatch):
    from securevfl.methods.blocks.nets import ScaledBatches, Standardizer

    write_table(tmp_path / "data.csv")
    kept = tables.split_federation(config(tmp_path, stream=False), tmp_path / "split")
    cfg = config(tmp_path, stream=False)
    memory = tables.load_party_table(kept["bank"], cfg, "bank", chunk_bytes=CHUNK)
    disk = tables.load_party_table(
        kept["bank"], cfg, "bank", stream=True, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK
    )
    rng = np.random.default_rng(2)
    for table in (memory, disk):
        table.prepare(table.ids[::2])
        scaler = Standardizer().fit(table.rows(table.ids[::2]))
        batches = ScaledBatches(table, scaler)
        for _ in range(3):
            some = table.ids[rng.permutation(len(table.ids))[:40]]
            got = batches.rows(some)
            assert got.dtype == np.float32
            assert np.array_equal(got, scaler.transform(table.rows(some)))
        # a checkpoint's statistics loaded into the same scaler: the batches follow them
        scaler.load_state_dict({"mean": scaler.mean + 1.0, "std": scaler.std * 2.0})
        assert np.array_equal(batches.rows(some), scaler.transform(table.rows(some)))
    # in memory the whole table is scaled once per statistics, not once per batch
    calls = []
    real = Standardizer.transform
    monkeypatch.setattr(
        Standardizer, "transform", lambda self, v: calls.append(len(v)) or real(self, v)
    )
    scaler = Standardizer().fit(memory.rows(memory.ids))
    batches = ScaledBatches(memory, scaler)
    for _ in range(5):
        batches.rows(memory.ids[:10])
    assert calls == [len(memory.ids)]


def test_scaled_rows_keeps_one_scaled_table_per_owner_until_its_table_or_scaler_is_replaced(
    tmp_path, monkeypatch
):
    """`scaled_rows`, which every method's party (and the block active party, with its own
    scaler) reads its inputs through: a new set-up (another scaler or table object) is scaled
    afresh, the same one is not scaled again, and the values are the scaler's."""
    from types import SimpleNamespace

    from securevfl.methods.blocks.nets import Standardizer, scaled_rows

    write_table(tmp_path / "data.csv")
    cfg = config(tmp_path, stream=False)
    kept = tables.split_federation(cfg, tmp_path / "split")
    table = tables.load_party_table(kept["bank"], cfg, "bank", chunk_bytes=CHUNK)
    table.prepare(table.ids[::2])
    calls = []
    real = Standardizer.transform
    monkeypatch.setattr(
        Standardizer, "transform", lambda self, v: calls.append(len(v)) or real(self, v)
    )
    owner = SimpleNamespace(table=table, scaler=Standardizer().fit(table.rows(table.ids)))
    some = table.ids[:7]
    for _ in range(3):
        assert np.array_equal(scaled_rows(owner, some), real(owner.scaler, table.rows(some)))
    assert calls == [len(table.ids)]
    owner.scaler = Standardizer().fit(table.rows(table.ids[::3]))  # a new set-up
    assert np.array_equal(scaled_rows(owner, some), real(owner.scaler, table.rows(some)))
    other = Standardizer().fit(table.rows(table.ids[1::2]))  # the block active's own scaler
    assert np.array_equal(scaled_rows(owner, some, scaler=other), real(other, table.rows(some)))
    assert calls == [len(table.ids)] * 3
    # another table object (a new set-up, or the table scored after training): scaled afresh
    owner.table = tables.load_party_table(kept["bank"], cfg, "bank", chunk_bytes=CHUNK)
    owner.table.prepare(owner.table.ids[::2])
    assert np.array_equal(scaled_rows(owner, some), real(owner.scaler, owner.table.rows(some)))
    assert calls == [len(table.ids)] * 4


@pytest.mark.parametrize("method", ["laser", "splitnn"])
def test_a_file_forced_to_stream_trains_to_the_metrics_of_the_same_file_in_memory(
    tmp_path, monkeypatch, method
):
    """[data] stream = true on a file of a few kB (read 2 kB at a time) against stream = false,
    same seed, through the roles of a mask-aggregated federation (in-process transport); a
    streamed role never reads more than a batch's rows at once (no whole-table scaler fit or
    epoch order in memory)."""
    from securevfl import inproc

    seen: list[tuple[str, bool]] = []
    widest: list[int] = []  # rows read at once from a streamed table
    original_rows = tables.PartyTable.rows

    def counting_rows(self, ids):
        if self.streamed:
            widest.append(len(ids))
        return original_rows(self, ids)

    monkeypatch.setattr(tables.PartyTable, "rows", counting_rows)

    def recording(load):
        def wrapped(path, cfg, *args, **kwargs):
            table = load(path, cfg, *args, chunk_bytes=CHUNK, **kwargs)
            seen.append((Path(path).stem, table.streamed))
            return table

        return wrapped

    monkeypatch.setattr(inproc, "load_party_table", recording(tables.load_party_table))
    monkeypatch.setattr(inproc, "load_active_table", recording(tables.load_active_table))
    results = {}
    for stream in (False, True):
        directory = tmp_path / f"stream-{stream}"
        directory.mkdir()
        write_table(directory / "data.csv", gaps=method != "splitnn")  # splitnn: complete rows
        seen.clear()
        cfg = config(directory, stream=stream, method=method)
        code, metrics = inproc.run_federation(cfg, out=directory / "run", stdout=io.StringIO())
        assert code == 0, (directory / "run" / "logs" / "active.log").read_text()[-3000:]
        assert sorted(seen) == sorted((r, stream) for r in ("active", "crm", "bank", "web"))
        results[stream] = metrics
    memory, streamed = results[False], results[True]
    assert streamed["n_train"] == memory["n_train"] and streamed["n_test"] == memory["n_test"]
    assert len(streamed["history"]) == len(memory["history"]) == 3
    for a, b in zip(memory["history"], streamed["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert streamed["test"].keys() == memory["test"].keys()
    for key, value in memory["test"].items():
        if isinstance(value, float):
            assert streamed["test"][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        else:
            assert streamed["test"][key] == value, key
    assert memory["test"]["accuracy"] > 0.8  # it learned
    # a training batch (32) or an evaluation chunk of the test rows, never the training set
    assert widest and max(widest) <= max(32, streamed["n_test"]) < streamed["n_train"], widest


def test_the_row_cache_is_in_the_roles_own_run_directory_and_leaves_with_the_table(
    tmp_path, monkeypatch
):
    """The party and active roles (as `securevfl party` / `securevfl active` run them) put the
    cache under RUN_DIR/cache, readable by the role's user only; it is removed with the table."""
    from securevfl.roles.active import run_active
    from securevfl.roles.party import run_party

    write_table(tmp_path / "data.csv")
    cfg = config(tmp_path, stream=True, transport="zmq")
    kept = tables.split_federation(cfg, tmp_path / "split")
    made: dict[str, object] = {}

    class Loaded(Exception):
        pass

    def capture(load, role):
        def wrapped(*args, **kwargs):
            made[role] = load(*args, **kwargs)
            raise Loaded  # stop before connecting: only where the table went matters here

        return wrapped

    monkeypatch.setattr(tables, "load_party_table", capture(tables.load_party_table, "bank"))
    monkeypatch.setattr(tables, "load_active_table", capture(tables.load_active_table, "active"))
    logger = logging.getLogger("test-streaming")
    common = {"keys_dir": tmp_path / "keys", "address": "tcp://127.0.0.1:9", "logger": logger}
    with pytest.raises(Loaded):
        run_party(
            cfg,
            name="bank",
            run_dir=tmp_path / "bank-run",
            data_path=kept["bank"],
            device=None,
            **common,
        )
    with pytest.raises(Loaded):
        run_active(
            cfg, run_dir=tmp_path / "active-run", data_path=kept["active"], device=None, **common
        )
    for role, run_dir in (("bank", "bank-run"), ("active", "active-run")):
        table = made.pop(role)
        assert table.streamed
        cache = table.rowstore.dir
        assert cache.parent == tmp_path / run_dir / "cache"
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
        assert {p.name for p in cache.iterdir()} >= {"numbers.f64", "codes.i32", "ids.txt"}
        del table
        gc.collect()
        assert not cache.exists()


def test_the_row_cache_goes_when_the_process_exits(tmp_path):
    write_table(tmp_path / "data.csv", n=50)
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from securevfl.config import parse_config
        from securevfl.data.table import load_party_table
        cfg = parse_config(
            {{"data": {{"path": "data.csv", "id": "customer", "label": "outcome",
                        "positive": "churn", "stream": True}},
              "parties": {{"bank": {{"columns": ["score", "member"]}},
                           "crm": {{"columns": ["job"]}}}}}},
            source=Path({str(tmp_path / "config.toml")!r}),
        )
        table = load_party_table(cfg.data_path, cfg, "bank", cache_dir=Path({str(tmp_path)!r}) / "cache")
        print(table.rowstore.dir)
        """  # noqa: E501
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode == 0, done.stderr
    cache = Path(done.stdout.strip().splitlines()[-1])
    assert cache.parent == tmp_path / "cache" and not cache.exists()


def _bad(path: Path, row: int, column: str, value: str) -> None:
    """Set one cell (row: the line number, the header being line 1)."""
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[row - 1].split(",")
    cells[header.index(column)] = value
    lines[row - 1] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    ("column", "value", "words"),
    [
        ("income", "lots", r"value 'lots' in column 'income' \(row 301\) is not a number"),
        ("income", "inf", r"value 'inf' in column 'income' \(row 301\) is not finite"),
        ("member", "perhaps", r"value 'perhaps' in boolean column 'member' \(row 301\)"),
        ("customer", "", r"row 301 has an empty identifier"),
        ("customer", "cust-00007", r"identifiers must be unique; repeated: \['cust-00007'"),
    ],
)
def test_a_bad_row_far_into_a_streamed_file_is_named(tmp_path, column, value, words):
    """Row 301 lies in a later chunk than the first: the message gives the file's own row."""
    write_table(tmp_path / "data.csv")
    cfg = config(tmp_path, stream=True)
    kept = tables.split_federation(cfg, tmp_path / "split")
    _bad(kept["bank"], 301, column, value)
    with pytest.raises(DataError, match=words) as caught:
        tables.load_party_table(
            kept["bank"], cfg, "bank", stream=True, cache_dir=tmp_path / "cache", chunk_bytes=CHUNK
        )
    assert "bank.csv" in str(caught.value)
    assert not list((tmp_path / "cache").iterdir())  # an abandoned cache is removed


def test_short_rows_and_a_non_utf8_byte_in_a_later_chunk(tmp_path):
    """A row with fewer fields than the header reads its missing cells as empty (as in memory);
    a byte that is not UTF-8 stops the load naming the file."""
    write_table(tmp_path / "data.csv")
    cfg = config(tmp_path, stream=True)
    kept = tables.split_federation(cfg, tmp_path / "split")
    path = kept["web"]
    lines = path.read_text().splitlines()
    lines[250] = lines[250].rsplit(",", 1)[0]  # the device cell left out
    path.write_text("\n".join(lines) + "\n")
    kw = {"chunk_bytes": CHUNK, "cache_dir": tmp_path / "cache"}
    disk = tables.load_party_table(path, cfg, "web", stream=True, **kw)
    memory = tables.load_party_table(path, cfg, "web", stream=False, **kw)
    assert np.array_equal(disk.ids, memory.ids)
    disk.prepare(disk.ids)
    memory.prepare(memory.ids)
    assert np.array_equal(disk.rows(disk.ids), memory.rows(memory.ids), equal_nan=True)
    short = row_ids([lines[250].split(",")[0]], where="test")
    device = [j for j, c in enumerate(disk.columns) if c.startswith("device=")]
    visits = disk.columns.index("visits")
    assert device and np.isnan(disk.rows(short)[0, device]).all()
    assert not np.isnan(disk.rows(short)[0, visits])
    raw = "\n".join(lines).encode()
    cut = raw.index(b"\n", len(raw) * 3 // 4)
    path.write_bytes(raw[:cut] + b"\n\xff\xfe,1.0,ios" + raw[cut:] + b"\n")
    with pytest.raises(DataError, match=r"web\.csv is not UTF-8"):
        tables.load_party_table(path, cfg, "web", stream=True, **kw)


def _cache_resident_bytes(directory: Path) -> int:
    """Resident bytes of this process's mappings of files under `directory` (/proc smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = len(head) >= 6 and head[5].startswith(str(directory))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc")
def test_reading_a_large_cache_keeps_little_of_it_resident(tmp_path, monkeypatch):
    """A 115 MB cache: batches of rows at random are read with pread (through a memory map each
    row would pull in the pages around it, about 115 MB for 64 rows on this kernel), and a scan
    in file order hands its mapped pages back every RELEASE_BYTES."""
    from securevfl.data import rowstore

    cap = 16 << 20
    monkeypatch.setattr(rowstore, "RELEASE_BYTES", cap)
    n = 800_000
    writer = rowstore.DiskRowsWriter(tmp_path, prefix="rows-t", n_numbers=15, n_codes=6)
    rng = np.random.default_rng(0)
    numbers = rng.normal(size=(n, 15))
    codes = rng.integers(0, 9, size=(n, 6)).astype(np.int32)
    for start in range(0, n, 100_000):
        part = slice(start, start + 100_000)
        writer.append(numbers[part], codes[part], None, ids=np.arange(n)[part])
    rows = writer.finish(texts=False, where="test", texts_at=list)
    size = n * (15 * 8 + 6 * 4)
    peak = 0
    for _ in range(30):
        pick = rng.integers(0, n, size=256)
        got_numbers, got_codes = rows.take(pick)
        assert np.array_equal(got_numbers, numbers[pick])
        assert np.array_equal(got_codes, codes[pick])
        peak = max(peak, _cache_resident_bytes(rows.dir))
    assert peak < 1 << 20, peak
    block = 1 << 16
    start = 0
    for got_numbers, _ in rows.scan_ids(np.arange(n), rows=block):
        assert np.array_equal(got_numbers, numbers[start : start + len(got_numbers)])
        start += len(got_numbers)
        peak = max(peak, _cache_resident_bytes(rows.dir))
    assert start == n
    assert peak < cap + block * (15 * 8 + 6 * 4) + (8 << 20) < size / 3, (peak, size)
    rows.close()
