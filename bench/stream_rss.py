"""Peak memory of multi-gigabyte tables: a synthetic CSV (string ids, numeric columns with empty
cells, categorical columns with `?` cells, a yes/no column, a text label) of a given size, then,
each step in a child process of its own, its peak resident memory (`wait4`'s ru_maxrss, and
/proc samples split into anonymous and file-backed memory) and wall time:

* ``split``: `securevfl split` of the table into one file per role (active: the label; party
  ``a``: 12 numeric, 4 categorical and the yes/no column; party ``b``: 4 numeric, 2 categorical);
* ``baseline``: the floor, a child that imports the modules the other steps use and exits;
* ``party``: one party whose own file is the whole table (it holds 22 of the 23 feature
  columns; a second party holds the last one): loading it, fitting its encoding and its scaler
  on the training rows (4 sorted positions in 5; their ids spooled to a file, as a party would
  receive them), and one epoch of batches in a shuffled order (each batch's ids looked up, its
  rows read, one-hot encoded and scaled to float32, as the party's method does);
* ``active``: the active party (the label and 4 numeric and 2 categorical columns of its own):
  loading its file, the train/test split, its encoding fit, the set-up (which rows each party
  holds: party ``a`` lacks every 7th sorted row, ``b`` every 11th, so some rows are held by
  nobody; their answers spooled to files first, as received; the rows nobody holds dropped from
  the training and test ids) and one epoch of batches in the shuffled order of
  `methods.blocks.nets.batches` (each batch's labels, own rows and presence read).

* ``--federation 0.25,2``: a real `securevfl run` (one process per role over ZeroMQ/CURVE,
  split-NN, mask aggregation, every role streamed, 1 epoch) on a table of each size, each
  role's peak resident set read from /proc/PID/status (VmHWM) until it exits: the claim that
  peak memory does not grow with the file, end to end (set-up sent a part at a time,
  `securevfl.roles.setup_rows`).

Streaming (the default for files over 256 MiB) at the full size, and streaming against holding
the table in memory at a smaller size. Writes bench/results/stream_rss.json; the CSV and every
output are deleted afterwards.

    python bench/stream_rss.py --gb 5 --small-gb 0.5
    python bench/stream_rss.py --gb 0 --small-gb 0 --federation 0.25,2 --federation-batch 4096
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

NUMERIC = [f"x{j:02d}" for j in range(16)]
CATEGORICAL = [f"k{j}" for j in range(6)]
LEVELS = [4, 8, 12, 20, 3, 6]
PARTY_A = NUMERIC[:12] + CATEGORICAL[:4] + ["member"]
PARTY_B = NUMERIC[12:] + CATEGORICAL[4:]
BLOCK_ROWS = 250_000


# ---------------------------------------------------------------------------------------------
# the synthetic table


def generate(path: Path, target_bytes: int, *, seed: int = 0) -> int:
    """Write a CSV of about `target_bytes`; returns its row count."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(seed)
    levels = [pa.array([f"level_{c}_{j:02d}" for j in range(m)]) for c, m in enumerate(LEVELS)]
    rows = 0
    with path.open("wb") as fh:
        first = True
        while fh.tell() < target_bytes:
            n = BLOCK_ROWS
            ids = pc.binary_join_element_wise(
                "cust-", pa.array(np.arange(rows, rows + n)).cast(pa.string()), ""
            )
            x = rng.normal(size=(n, len(NUMERIC))).round(4)
            cols = {"customer": ids}
            for j, c in enumerate(NUMERIC):
                text = pa.array(x[:, j]).cast(pa.string())
                cols[c] = pc.if_else(pa.array(rng.random(n) < 0.02), "", text)
            for j, c in enumerate(CATEGORICAL):
                text = levels[j].take(pa.array(rng.integers(LEVELS[j], size=n)))
                cols[c] = pc.if_else(pa.array(rng.random(n) < 0.01), "?", text)
            cols["member"] = pa.array(np.where(rng.random(n) < 0.5, "yes", "no"))
            score = x[:, 0] + x[:, 1] - x[:, 2]
            cols["outcome"] = pa.array(np.where(score > 0.5, "churn", "stay"))
            pcsv.write_csv(
                pa.table(cols),
                fh,
                pcsv.WriteOptions(include_header=first, quoting_style="none"),
            )
            first = False
            rows += n
    return rows


ACTIVE = NUMERIC[:4] + CATEGORICAL[:2]  # the active party's own columns (step active)


def config(csv: Path, root: Path, *, stream: bool, whole_table_party: bool, active=False):
    from securevfl.config import parse_config

    parties = (
        {
            "all": {"columns": NUMERIC[:-1] + CATEGORICAL + ["member"]},
            "z": {"columns": NUMERIC[-1:]},
        }
        if whole_table_party
        else {"a": {"columns": PARTY_A}, "b": {"columns": PARTY_B}}
    )
    if active:
        parties = {
            "a": {"columns": NUMERIC[4:12] + CATEGORICAL[2:4] + ["member"]},
            "b": {"columns": NUMERIC[12:] + CATEGORICAL[4:]},
        }
    raw = {
        "run": {"method": "laser", "aggregation": "mask", "seed": 0},
        "data": {
            "path": str(csv),
            "id": "customer",
            "label": "outcome",
            "positive": "churn",
            "stream": stream,
        },
        "parties": parties,
        "train": {"batch_size": 256},
    }
    if active:
        raw["active"] = {"columns": ACTIVE}
    return parse_config(raw, source=root / "config.toml")


# ---------------------------------------------------------------------------------------------
# the measured steps (run in a child process each)


def step_split(csv: Path, root: Path, stream: bool) -> dict:
    from securevfl.data.table import split_federation

    cfg = config(csv, root, stream=stream, whole_table_party=False)
    t = time.perf_counter()
    files = split_federation(cfg, root / "split")
    return {
        "phases_s": {"split": time.perf_counter() - t},
        "outputs_bytes": {r: p.stat().st_size for r, p in files.items()},
    }


def step_party(csv: Path, root: Path, stream: bool) -> dict:
    import numpy as np

    from securevfl.data.table import load_party_table
    from securevfl.methods.blocks.nets import Standardizer

    cfg = config(csv, root, stream=stream, whole_table_party=True)
    phases = {}
    t = time.perf_counter()
    table = load_party_table(csv, cfg, "all", cache_dir=root / "cache")
    phases["load"] = time.perf_counter() - t
    # the training rows, as a party receives them: a list of ids (every sorted position but
    # each fifth), spooled to a file and read through a read-only map, so that the bench itself
    # holds no array with one entry per row
    n = len(table)
    train_path = root / "train.ids"
    with train_path.open("wb") as fh:
        for start, block in _id_blocks(table):
            block[np.arange(start, start + len(block)) % 5 != 0].tofile(fh)
    n_train = n - (n + 4) // 5
    train = np.memmap(train_path, dtype=np.int64, mode="r") if n_train else np.empty(0, np.int64)
    t = time.perf_counter()
    table.prepare(train)
    phases["fit_encoding"] = time.perf_counter() - t
    t = time.perf_counter()
    scaler = Standardizer()
    if table.streamed:
        summary = table.column_summary(train)
        scaler.mean = np.nan_to_num(summary["mean"])
        scaler.std = np.where(np.nan_to_num(summary["std"]) > 1e-12, summary["std"], 1.0)
    else:
        scaler.fit(table.rows(train))
    phases["fit_scaler"] = time.perf_counter() - t
    t = time.perf_counter()
    # one epoch in a shuffled order: train index i -> (a * i + c) mod n_train (a bijection),
    # the k-th training id being the one at sorted position 5 (k // 4) + k % 4 + 1
    a = 2_654_435_761
    while math.gcd(a, max(n_train, 1)) != 1:
        a += 2
    checksum = 0.0
    for i in range(0, n_train, cfg.batch_size):
        k = (a * np.arange(i, min(i + cfg.batch_size, n_train)) + 12345) % n_train
        ids = _ids_at(table, 5 * (k // 4) + k % 4 + 1)
        checksum += float(scaler.transform(table.rows(ids))[0, 0])
    phases["epoch"] = time.perf_counter() - t
    return {
        "phases_s": phases,
        "rows_held": n,
        "train_rows": n_train,
        "encoded_columns": len(table.columns),
        "streamed": table.streamed,
        "batches": -(-n_train // cfg.batch_size),
        "checksum": checksum,
    }


def step_active(csv: Path, root: Path, stream: bool) -> dict:
    import logging
    from types import SimpleNamespace

    import numpy as np

    from securevfl.data.rowarrays import shuffled_batches
    from securevfl.data.table import load_active_table
    from securevfl.methods.blocks.nets import batches
    from securevfl.roles.active import split_table
    from securevfl.roles.active_round import ActiveRound

    cfg = config(csv, root, stream=stream, whole_table_party=False, active=True)
    phases, hwm = {}, {"imports": _vmhwm_mb()}  # hwm: the peak so far, after each phase
    t = time.perf_counter()
    table = load_active_table(csv, cfg, cache_dir=root / "cache")
    phases["load"] = time.perf_counter() - t
    hwm["load"] = _vmhwm_mb()
    t = time.perf_counter()
    train, test = split_table(table, cfg)
    phases["split"] = time.perf_counter() - t
    hwm["split"] = _vmhwm_mb()
    t = time.perf_counter()
    table.prepare(train)
    phases["fit_encoding"] = time.perf_counter() - t
    hwm["fit_encoding"] = _vmhwm_mb()
    # the parties' answers to set-up, as received (spooled to files, so that the bench itself
    # holds no array with one entry per row): a lacks every 7th sorted row, b every 11th
    n = len(table)
    held = {}
    for p, (every, at) in {"a": (7, 3), "b": (11, 5)}.items():
        path = root / f"held-{p}.bool"
        with path.open("wb") as fh:
            for start in range(0, n, 1 << 20):
                (np.arange(start, min(n, start + (1 << 20))) % every != at).tofile(fh)
        held[p] = np.memmap(path, dtype=bool, mode="r") if n else np.zeros(0, bool)
    t = time.perf_counter()
    ctx = ActiveRound(
        cfg=cfg,
        exchange=None,
        session=bytes(16),
        method=SimpleNamespace(table=table),
        run_dir=root,
        logger=logging.getLogger("bench"),
    )
    ctx.set_presence(held)
    unheld = ctx.unheld_rows()
    train, test = ctx.held_rows(train), ctx.held_rows(test)
    phases["setup"] = time.perf_counter() - t
    hwm["setup"] = _vmhwm_mb()
    t = time.perf_counter()
    if table.streamed:
        order = shuffled_batches(
            train, cfg.batch_size, seed=cfg.seed, epoch=0, arrays=table.rowstore.arrays()
        )
    else:
        order = iter(batches(train, cfg.batch_size, seed=cfg.seed, epoch=0))
    checksum, count = 0.0, 0
    for ids in order:
        labels, rows, present = table.label_rows(ids), table.rows(ids), ctx.presence(ids)
        checksum += float(np.nansum(labels) + np.nansum(rows[:, 0]) + present.sum())
        count += 1
    phases["epoch"] = time.perf_counter() - t
    hwm["epoch"] = _vmhwm_mb()
    return {
        "phases_s": phases,
        "vmhwm_after_mb": hwm,
        "rows_held": n,
        "rows_held_by_nobody": unheld,
        "train_rows": int(len(train)),
        "test_rows": int(len(test)),
        "encoded_columns": len(table.columns),
        "streamed": table.streamed,
        "batches": count,
        "checksum": checksum,
    }


FED_ACTIVE = NUMERIC[:4] + CATEGORICAL[:2]
FED_PARTIES = {
    "a": NUMERIC[4:12] + CATEGORICAL[2:4] + ["member"],
    "b": NUMERIC[12:] + CATEGORICAL[4:],
}


def federation_toml(csv: Path, *, batch: int, test_fraction: float) -> str:
    """A split-NN, mask-aggregated federation of the synthetic table, every role streamed."""
    q = lambda cols: "[" + ", ".join(f'"{c}"' for c in cols) + "]"  # noqa: E731
    parties = "".join(f"\n[parties.{p}]\ncolumns = {q(c)}\n" for p, c in FED_PARTIES.items())
    return f"""[run]
method = "splitnn"
aggregation = "mask"
seed = 0

[data]
path = "{csv}"
id = "customer"
label = "outcome"
positive = "churn"
test_fraction = {test_fraction}
stream = true

[active]
columns = {q(FED_ACTIVE)}
{parties}
[train]
epochs = 1
batch_size = {batch}

[model]
hidden = [16]
width = 4

[network]
heartbeat_interval = 1.0
peer_timeout = 600.0
round_timeout = 1800.0
startup_timeout = 3600.0
"""


def _role_of(pid: int) -> str | None:
    """The role a `securevfl` role process runs (from its command line)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in argv]
    if "securevfl" not in args:
        return None
    rest = args[args.index("securevfl") + 1 :]
    if not rest:
        return None
    if rest[0] == "party" and "--name" in rest:
        return f"party {rest[rest.index('--name') + 1]}"
    return rest[0] if rest[0] in ("active", "aggregator") else None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            out.append(c)
            todo.append(c)
    return out


def _status_kb(pid: int, keys: tuple[str, ...]) -> dict[str, int]:
    found = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                found[key] = int(value.split()[0])
    except (OSError, ValueError):
        pass
    return found


def _mapped_files(pid: int, most: int = 6) -> dict[str, float]:
    """The files mapped into `pid` holding the most resident pages (MB, from /proc/PID/smaps;
    a path's last two parts)."""
    rss: dict[str, int] = {}
    name = None
    try:
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                name = "/".join(Path(head[5]).parts[-2:]) if len(head) >= 6 else None
            elif name and line.startswith("Rss:"):
                rss[name] = rss.get(name, 0) + int(head[1])
    except (OSError, ValueError, IndexError):
        return {}
    top = sorted(rss.items(), key=lambda kv: -kv[1])[:most]
    return {k: round(v / 1024, 1) for k, v in top}


def measure_federation(
    csv: Path, root: Path, *, batch: int, test_fraction: float, timeout: float
) -> dict:
    """`securevfl run` of the federation (real processes, every role streamed), each role's
    peak resident set: /proc/PID/status VmHWM, read every 0.5 s until the role exits (the last
    reading is its peak over its life), and the largest RssAnon / RssFile seen."""
    config = root / "federation.toml"
    config.write_text(federation_toml(csv, batch=batch, test_fraction=test_fraction))
    run_dir = root / "run"
    cmd = ["nice", "-n", "10", sys.executable, "-m", "securevfl", "run", str(config)]
    cmd += ["--out", str(run_dir)]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    peaks: dict[str, dict[str, int]] = {}
    top_files: dict[str, dict[str, float]] = {}
    keys = ("VmHWM", "RssAnon", "RssFile")
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            break
        for pid in _descendants(proc.pid):
            role = _role_of(pid)
            if role is None:
                continue
            now = _status_kb(pid, keys)
            seen = peaks.setdefault(role, dict.fromkeys(keys, 0))
            if now.get("RssFile", 0) > seen["RssFile"]:  # where the file-backed pages are
                top_files[role] = _mapped_files(pid)
            for k, v in now.items():
                seen[k] = max(seen[k], v)
        time.sleep(0.5)
    proc.wait()
    reader.join(timeout=5)
    seconds = time.perf_counter() - t
    text = b"".join(lines).decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"securevfl run failed ({proc.returncode}):\n{text[-3000:]}")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return {
        "step": "federation",
        "mode": "stream",
        "command": " ".join(cmd[3:]),
        "batch_size": batch,
        "test_fraction": test_fraction,
        "seconds": round(seconds, 1),
        "peak_rss_mb": {r: round(v["VmHWM"] / 1024, 1) for r, v in sorted(peaks.items())},
        "sampled_peak_anon_mb": {
            r: round(v["RssAnon"] / 1024, 1) for r, v in sorted(peaks.items())
        },
        "sampled_peak_file_mb": {
            r: round(v["RssFile"] / 1024, 1) for r, v in sorted(peaks.items())
        },
        "mapped_files_at_file_peak_mb": top_files,
        "n_train": metrics.get("n_train"),
        "n_test": metrics.get("n_test"),
        "rounds": metrics.get("rounds"),
        "epoch_seconds": [round(h, 1) for h in metrics.get("epoch_seconds", [])],
        "test": {k: v for k, v in metrics.get("test", {}).items() if isinstance(v, float)},
        "output_tail": text[-600:],
    }


def run_federation_sizes(
    sizes: list[float], work: Path, *, batch: int, test_fraction: float, timeout: float
) -> list[dict]:
    """The federation at each size in turn (each CSV generated, run, deleted)."""
    runs = []
    for gb in sizes:
        csv = work / f"federation_{gb:g}gb.csv"
        t = time.perf_counter()
        rows = generate(csv, int(gb * 1e9))
        size = csv.stat().st_size
        print(
            f"generated {csv.name}: {size / 1e9:.2f} GB, {rows} rows "
            f"({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
        root = work / f"federation-{gb:g}"
        root.mkdir()
        try:
            r = measure_federation(
                csv, root, batch=batch, test_fraction=test_fraction, timeout=timeout
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
            csv.unlink(missing_ok=True)
        r.update(file_bytes=size, rows=rows)
        print(json.dumps(r), flush=True)
        runs.append(r)
    return runs


def _id_blocks(table, rows: int = 1 << 20):
    """(start, sorted ids) of the table, `rows` at a time (a streamed one reads its index)."""
    if table.streamed:
        start = 0
        for block in table.rowstore.id_blocks(rows):
            yield start, block
            start += len(block)
    else:
        for start in range(0, len(table.ids), rows):
            yield start, table.ids[start : start + rows]


def _ids_at(table, positions):
    """The sorted ids at `positions` (a streamed table reads them from its index)."""
    return table.rowstore.ids_at(positions) if table.streamed else table.ids[positions]


def step_baseline(csv: Path, root: Path, stream: bool) -> dict:
    """The floor: the modules the other steps import (Python, NumPy, pyarrow, torch), no data."""
    import securevfl.data.table  # noqa: F401
    import securevfl.methods.blocks.nets  # noqa: F401

    return {"phases_s": {}}


STEPS = {
    "split": step_split,
    "party": step_party,
    "active": step_active,
    "baseline": step_baseline,
}
STEPS_ALL = ("split", "party")


# ---------------------------------------------------------------------------------------------
# the parent: one child per step, its peak memory


def measure(step: str, csv: Path, root: Path, *, stream: bool, timeout: float) -> dict:
    """Run `step` in a child; its peak RSS (ru_maxrss) and sampled anon/file-backed peaks."""
    out = root / f"{step}.json"
    cmd = [sys.executable, __file__, "--child", step, "--csv", str(csv), "--root", str(root)]
    cmd += ["--stream" if stream else "--no-stream", "--result", str(out)]
    t = time.perf_counter()
    child = subprocess.Popen(cmd)
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    done = threading.Event()

    def sample() -> None:
        status = Path(f"/proc/{child.pid}/status")
        while not done.is_set():
            try:
                for line in status.read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(value.split()[0]))
            except (OSError, ValueError):
                pass
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            child.kill()
            pid, status, usage = os.wait4(child.pid, 0)
            break
        time.sleep(0.2)
    done.set()
    sampler.join()
    seconds = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"step {step} failed (status {status}) after {seconds:.0f} s")
    result = json.loads(out.read_text())
    return {
        "step": step,
        "mode": "stream" if stream else "memory",
        "seconds": round(seconds, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "sampled_peak_rss_mb": round(peaks["VmRSS"] / 1024, 1),
        "sampled_peak_anon_mb": round(peaks["RssAnon"] / 1024, 1),
        "sampled_peak_file_mb": round(peaks["RssFile"] / 1024, 1),
        **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in result.items()},
    }


def run_size(
    gb: float, modes: list[bool], work: Path, timeout: float, steps: tuple[str, ...] = STEPS_ALL
) -> list[dict]:
    csv = work / f"table_{gb:g}gb.csv"
    t = time.perf_counter()
    rows = generate(csv, int(gb * 1e9))
    size = csv.stat().st_size
    print(
        f"generated {csv.name}: {size / 1e9:.2f} GB, {rows} rows ({time.perf_counter() - t:.0f} s)"
    )
    runs = []
    try:
        for stream in modes:
            for step in steps:
                root = work / f"{step}-{gb:g}-{stream}"
                root.mkdir()
                try:
                    r = measure(step, csv, root, stream=stream, timeout=timeout)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                r.update(
                    file_bytes=size,
                    rows=rows,
                    mb_per_s=round(size / 1e6 / r["seconds"], 1),
                    rows_per_s=round(rows / r["seconds"]),
                    bytes_rss_per_row=round(r["peak_rss_mb"] * 2**20 / rows, 1),
                )
                print(json.dumps(r), flush=True)
                runs.append(r)
    finally:
        csv.unlink(missing_ok=True)
    return runs


def _vmhwm_mb() -> float | None:
    """This process's peak resident set since its exec (/proc VmHWM; Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=5.0, help="size of the streamed table (GB)")
    ap.add_argument(
        "--small-gb", type=float, default=0.5, help="size for streaming vs in memory (GB)"
    )
    ap.add_argument(
        "--steps",
        default="split,party",
        help="steps measured at the full size (comma-separated; the small size runs both)",
    )
    ap.add_argument(
        "--small-steps",
        default="split,party",
        help="steps measured at the small size, streamed and in memory (comma-separated)",
    )
    ap.add_argument(
        "--federation",
        default="",
        help="also run `securevfl run` (split-NN, every role streamed, 1 epoch) on tables of "
        "these sizes in GB (comma-separated, e.g. 0.25,2) and record each role's peak RSS",
    )
    ap.add_argument("--federation-batch", type=int, default=4096)
    ap.add_argument("--federation-test-fraction", type=float, default=0.05)
    ap.add_argument("--workdir", type=Path, default=None, help="(default: a temporary dir)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per step")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "stream_rss.json")
    ap.add_argument("--child", choices=sorted(STEPS), help=argparse.SUPPRESS)
    ap.add_argument("--csv", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = STEPS[args.child](args.csv, args.root, bool(args.stream))
        result["child_vmhwm_mb"] = _vmhwm_mb()
        args.result.write_text(json.dumps(result))
        return
    work = Path(tempfile.mkdtemp(prefix="stream-rss-", dir=args.workdir))
    try:
        (work / "baseline").mkdir()
        floor = measure("baseline", work / "none.csv", work / "baseline", stream=True, timeout=600)
        print(json.dumps(floor), flush=True)
        runs = [floor]
        if args.small_gb > 0:
            small = tuple(x.strip() for x in args.small_steps.split(",") if x.strip())
            runs += run_size(args.small_gb, [True, False], work, args.timeout, small)
        if args.gb > 0:
            steps = tuple(x.strip() for x in args.steps.split(",") if x.strip())
            unknown = sorted(set(steps) - set(STEPS))
            if unknown or not steps:
                raise SystemExit(f"--steps: choose among {sorted(STEPS)}, got {args.steps!r}")
            runs += run_size(args.gb, [True], work, args.timeout, steps)
        if args.federation:
            sizes = [float(x) for x in args.federation.split(",") if x.strip()]
            runs += run_federation_sizes(
                sizes,
                work,
                batch=args.federation_batch,
                test_fraction=args.federation_test_fraction,
                timeout=args.timeout,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import pyarrow

    report = {
        "command": "python bench/stream_rss.py " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(),
            "pyarrow": pyarrow.__version__,
            "load_average_at_end": os.getloadavg(),
        },
        "notes": (
            "peak_rss_mb: the child's ru_maxrss (resident set, anonymous and file-backed; it "
            "counts the pages the child shares with the parent between fork and exec, so it is "
            "never below the parent's resident set at the fork); child_vmhwm_mb: the child's "
            "own peak since exec (/proc VmHWM); "
            "step baseline: a child that only imports the modules the steps use (the floor); "
            "sampled_*: /proc/PID/status every 0.2 s. A streamed party reads each batch's rows "
            "from its row cache with pread, and scans (encoding and scaler fits) through memory "
            "maps whose pages are handed back to the kernel every 64 MiB, so the cache stays in "
            "the page cache, not in the process. Its id index (sorted ids, each one's row) is "
            "on disk too, built by an external merge sort while loading; memory keeps every "
            "256th sorted id and, during a scan, one bit per row."
        ),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
