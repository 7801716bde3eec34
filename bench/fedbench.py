"""The benchmark harness: real multi-process federations (the commands `securevfl run` starts,
one OS process per role, ZeroMQ with CURVE), optionally behind the WAN emulator, with per-role
peak RSS and CPU time; and the centralised single-process epoch of the same model.

Used by `bench/report.py` (`securevfl bench`); not a product module. Each data set is split and
keyed once (`prepare`), then every run (mode, batch size, network) reuses the split files and
keys, so a run costs its roles' start-up and training only.

    python bench/fedbench.py centralised CONFIG.toml SOURCE_DIR   # one centralised run (JSON)
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

from wanproxy import WanProxy  # noqa: E402

CREDIT = REPO.parent / "shared" / "data" / "credit_default.csv"


# --- data sets


@dataclass(frozen=True)
class Dataset:
    """A table and how its columns are held: {party: columns}; labels at the active party."""

    name: str
    path: Path
    parties: Mapping[str, Sequence[str]]
    rows: int
    id: str = "ID"
    label: str = "Y"


def credit(path: Path = CREDIT, *, parties: int = 4) -> Dataset:
    """Credit (X1..X20) in `parties` contiguous blocks (4: the LASER-VFL split, 5 columns each)."""
    cols = [f"X{i}" for i in range(1, 21)]
    blocks = np.array_split(np.arange(20), parties)
    return Dataset(
        name=f"credit-{parties}p",
        path=Path(path),
        parties={f"p{k + 1}": [cols[i] for i in b] for k, b in enumerate(blocks)},
        rows=30000,
    )


def synthetic(work: Path, *, rows: int, parties: int, cols: int = 5, seed: int = 0) -> Dataset:
    """A learnable binary table of `rows` rows, `cols` standard-normal columns per party; the
    label is a noisy logistic function of every column (so every party matters)."""
    path = Path(work) / f"synthetic-{rows}x{parties}p.csv"
    names = {f"p{k + 1}": [f"p{k + 1}x{j + 1}" for j in range(cols)] for k in range(parties)}
    if not path.exists():
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((rows, parties * cols), dtype=np.float32)
        w = rng.standard_normal(parties * cols).astype(np.float32) / np.sqrt(parties * cols)
        y = (x @ w + 0.5 * rng.standard_normal(rows, dtype=np.float32) > 0.5).astype(np.int8)
        header = ",".join(["ID", *[c for cs in names.values() for c in cs], "Y"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            fh.write(header + "\n")
            step = 100_000  # savetxt per block keeps memory flat at 10^6 rows
            for s in range(0, rows, step):
                e = min(rows, s + step)
                block = np.column_stack(
                    [np.arange(s + 1, e + 1, dtype=np.float64), x[s:e].astype(np.float64), y[s:e]]
                )
                np.savetxt(
                    fh, block, fmt=["%d"] + ["%.5f"] * (parties * cols) + ["%d"], delimiter=","
                )
        os.replace(tmp, path)
    return Dataset(name=f"synthetic-{rows}x{parties}p", path=path, parties=names, rows=rows)


# --- configs


def config_raw(
    ds: Dataset,
    *,
    aggregation: str,
    epochs: int,
    batch_size: int = 256,
    seed: int = 0,
    device: str = "cpu",
    test_fraction: float = 0.2,
) -> dict[str, Any]:
    """Split-NN (hidden [64], width 16, Adam 1e-3) on `ds`, the parties accepting every mode (a
    benchmark of plain against the secure modes)."""
    return {
        # shared_init: the parties' initial encoders from [run] seed, as the centralised
        # reference builds them (`encoder_of`), so both train the same model
        "run": {
            "method": "splitnn",
            "aggregation": aggregation,
            "seed": seed,
            "device": device,
            "shared_init": True,
        },
        "data": {
            "path": str(Path(ds.path).resolve()),
            "id": ds.id,
            "label": ds.label,
            "task": "binary",
            "test_fraction": test_fraction,
        },
        "active": {"columns": []},
        "policy": {"aggregations": ["plain", "mask", "ckks"], "config_seeds": True},
        "parties": {name: {"columns": list(cols)} for name, cols in ds.parties.items()},
        "train": {"epochs": epochs, "batch_size": batch_size, "lr": 0.001},
        "model": {"hidden": [64], "width": 16},
        # a loaded 2-core machine starts 18 torch processes slowly; the deadlines are generous
        "network": {
            "heartbeat_interval": 1.0,
            "peer_timeout": 60.0,
            "round_timeout": 600.0,
            "startup_timeout": 600.0,
        },
    }


def write_toml(raw: Mapping[str, Any], path: Path) -> Path:
    from securevfl.config import dump_toml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_toml(raw))
    return path


@dataclass(frozen=True)
class Prepared:
    """A data set split into one file per role, and the federation's keys: shared by runs."""

    dataset: Dataset
    source: Path  # split files: source/data/<role>.csv
    keys: Path
    files: Mapping[str, Path]
    seconds: float


def prepare(ds: Dataset, work: Path) -> Prepared:
    from securevfl.config import load_config
    from securevfl.data.table import split_federation
    from securevfl.keys import generate_keys

    started = time.perf_counter()
    root = Path(work) / ds.name
    cfg_path = write_toml(config_raw(ds, aggregation="plain", epochs=1), root / "split.toml")
    cfg = load_config(cfg_path)
    files = split_federation(cfg, root / "source")
    keys = root / "keys"
    generate_keys(cfg.role_names, keys, overwrite=True)
    return Prepared(ds, root / "source", keys, files, time.perf_counter() - started)


# --- one federation


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def role_environment(
    pythonpath: str | None = None, extra: Mapping[str, str] | None = None
) -> tuple[dict[str, str], Path]:
    """The environment and working directory of a benchmark's role processes: one BLAS/OpenMP
    thread each (as `securevfl run`: many processes, 2 cores), and securevfl imported from
    `pythonpath` (an older copy of the code) or else from this tree. The working directory is
    that tree, because `python -m` puts the working directory ahead of PYTHONPATH on the import
    path: started from another checkout, the roles would import that checkout's code instead.
    `extra`: variables set for the roles only (e.g. a SECUREVFL_ switch an arm compares)."""
    tree = Path(pythonpath).resolve() if pythonpath is not None else REPO
    env = dict(os.environ, OMP_NUM_THREADS="1", **dict(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tree), env.get("PYTHONPATH")]))
    return env, tree


def run_federation(
    prep: Prepared,
    raw: Mapping[str, Any],
    out: Path,
    *,
    rtt_ms: float | None = None,
    mbit: float = 0.0,
    timeout: float = 1800.0,
    pythonpath: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One training run: the roles `securevfl run` would start (same commands), the aggregator
    binding its real port and, with `rtt_ms`, every other role connecting through a `WanProxy`
    (rtt_ms added per round trip, `mbit` per direction and connection). With [network]
    aggregator_in_active there is no aggregator process: the active party's process binds the
    real port (its own aggregator thread) and the parties connect through the proxy, if any.
    `pythonpath`: the roles import securevfl from there (e.g. an older copy of the code, to
    compare it side by side); `env`: environment variables of the roles. Returns metrics.json's
    epoch times, test metrics and bytes, each role's peak RSS and CPU seconds (from wait4), the
    proxy's counters and the load average.
    Every process it starts is gone when it returns."""
    from securevfl.config import load_config
    from securevfl.launcher import cpu_env, free_port, pinned_cores, role_commands

    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = write_toml(raw, out / "config.toml")
    cfg = load_config(cfg_path)
    port = free_port()
    real = f"tcp://127.0.0.1:{port}"
    proxy = None
    if rtt_ms is not None:
        proxy = WanProxy(target=("127.0.0.1", port), rtt_ms=rtt_ms, mbit=mbit).start()
    address = proxy.address if proxy is not None else real
    cmds = role_commands(
        cfg_path,
        cfg,
        out=out,
        keys=Path(prep.keys).resolve(),  # the roles run in the code's tree (role_environment)
        address=address,
        resume=False,
        data={role: Path(path).resolve() for role, path in prep.files.items()},
    )
    if "aggregator" in cmds:
        agg = list(cmds["aggregator"])
        agg[agg.index("--bind") + 1] = real  # the proxy (if any) forwards to the real port
        cmds["aggregator"] = agg
    elif proxy is not None:  # the active party's own aggregator thread binds the real port
        cmds[cfg.active_name] += ["--set", f"network.bind={json.dumps(real)}"]
    for role, cmd in cmds.items():  # one directory per role, as on separate hosts
        cmd[cmd.index("--out") + 1] = str(out / role)
    env, cwd = role_environment(pythonpath, env)
    cpus = pinned_cores(cfg, cmds)  # as `securevfl run` pins them ([run] pin_cores)
    load_before = loadavg()
    started = time.perf_counter()
    procs: dict[str, subprocess.Popen] = {}
    reaped: dict[str, tuple[int, Any]] = {}
    log = (out / "roles.out").open("w")
    try:
        for role, cmd in cmds.items():
            procs[role] = subprocess.Popen(
                cmd,
                env=cpu_env(env, cpus.get(role)),
                cwd=cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            if role == "aggregator" or (role == cfg.active_name and "aggregator" not in cmds):
                time.sleep(0.1)  # let it bind before the others connect (they retry anyway)
        killed = supervise(procs, reaped, timeout=timeout)
    finally:
        log.close()
        if proxy is not None:
            proxy.close()
    wall = time.perf_counter() - started
    codes = {r: c for r, (c, _) in reaped.items()}
    killed = bool(killed)
    result: dict[str, Any] = {
        "aggregation": cfg.aggregation,
        "parties": len(cfg.party_names),
        "batch_size": cfg.batch_size,
        "epochs": cfg.epochs,
        "rows": prep.dataset.rows,
        "dataset": prep.dataset.name,
        "rtt_ms": rtt_ms,
        "mbit": mbit if rtt_ms is not None else None,
        # one exchange per batch when the method fuses backward(t) with forward(t+1)
        "fuse_rounds": bool(cfg.fuse_rounds),
        # forwards in flight beyond the awaited one ([network] pipeline_depth; 0: none)
        "pipeline_depth": int(cfg.pipeline_depth),
        "aggregator_in_active": bool(cfg.aggregator_in_active),
        "processes": len(procs),
        "exit_codes": codes,
        "ok": all(c == 0 for c in codes.values()) and not killed,
        "terminated": killed,
        "wall_seconds": round(wall, 3),
        "load_before": load_before,
        "load_after": loadavg(),
        "peak_rss_mib": {r: round(u.ru_maxrss / 1024, 1) for r, (_, u) in reaped.items()},
        "cpu_seconds": {r: round(u.ru_utime + u.ru_stime, 3) for r, (_, u) in reaped.items()},
        "pids": {r: p.pid for r, p in procs.items()},
        "proxy": proxy.summary() if proxy is not None else None,
    }
    metrics_path = out / cfg.active_name / "metrics.json"
    if not metrics_path.exists():
        tail = (out / "roles.out").read_text()[-2000:]
        result["error"] = f"no metrics.json; exit codes {codes}; output tail:\n{tail}"
        return result
    m = json.loads(metrics_path.read_text())
    party = cfg.party_names[0]
    roles = m.get("roles", {})
    result.update(
        {
            "epoch_seconds": [round(x, 4) for x in m["epoch_seconds"]],
            "median_epoch_seconds": float(np.median(m["epoch_seconds"])),
            "n_train": m.get("n_train"),
            "rounds": m.get("rounds"),
            "test": m.get("test"),
            "bytes_sent": {r: int(v.get("bytes_sent", 0)) for r, v in roles.items()},
            "bytes_received": {r: int(v.get("bytes_received", 0)) for r, v in roles.items()},
            # the whole run (set-up + training + test) divided by the epochs, as overhead.py
            "party_bytes_sent_per_epoch": roles.get(party, {}).get("bytes_sent", 0) / cfg.epochs,
            "total_bytes_sent": int(sum(v.get("bytes_sent", 0) for v in roles.values())),
        }
    )
    return result


def supervise(
    procs: Mapping[str, subprocess.Popen],
    reaped: dict[str, tuple[int, Any]],
    *,
    timeout: float,
    grace: float = 20.0,
) -> bool:
    """Reap every role with wait4 (its peak RSS and CPU time). If any role fails (a benchmark
    run is all or nothing), the others get `grace` seconds to stop on their own; after that, or
    after `timeout`, what is left of these processes is terminated (then killed). Returns
    whether any had to be."""
    deadline = time.monotonic() + timeout
    signals = [signal.SIGTERM, signal.SIGKILL]
    terminated = False
    while len(reaped) < len(procs):
        for role, p in procs.items():
            if role in reaped:
                continue
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                reaped[role] = (p.returncode, usage)
                if p.returncode != 0:
                    deadline = min(deadline, time.monotonic() + grace)
        if len(reaped) < len(procs) and time.monotonic() > deadline and signals:
            sig = signals.pop(0)
            for role, p in procs.items():
                if role not in reaped:  # not reaped yet: the pid is still this process's
                    p.send_signal(sig)
            terminated = True
            deadline = time.monotonic() + 5.0
        time.sleep(0.05)
    return terminated


# --- the centralised reference


def active_split(cfg: Any, files: Mapping[str, Path]) -> tuple[Any, Any, Any, Any]:
    """What the active party of the benchmark model holds: its table, the train and test ids
    (the active role's own split, `roles.active.split_table`) and the head (seeded as the roles
    seed it)."""
    from securevfl.data.table import load_active_table
    from securevfl.methods.blocks.nets import class_count, derived_seed, mlp, output_dim
    from securevfl.roles.active import split_table

    active = load_active_table(Path(files[cfg.active_name]), cfg)
    train_ids, test_ids = split_table(active, cfg)
    n_classes = class_count(cfg.task, active.labels)
    head = mlp(
        cfg.width,
        cfg.head_hidden,
        output_dim(cfg.task, n_classes),
        seed=derived_seed(cfg.seed, "head"),
    )
    return active, train_ids, test_ids, head


def encoder_of(cfg: Any, table: Any, party: str) -> Any:
    """A party's encoder of the benchmark model, seeded as the roles seed it (`[run]
    shared_init = true` in `config_raw`)."""
    from securevfl.methods.blocks.nets import derived_seed, mlp

    return mlp(
        len(table.columns), cfg.hidden, cfg.width, seed=derived_seed(cfg.seed, "encoder", party)
    )


def dataset_for(work: Path, *, rows: int, parties: int, data: Path | None) -> Dataset:
    """The benchmarks' table: synthetic `rows` (kept under `work/tables`), or Credit at `data`."""
    if data is None:
        return synthetic(Path(work) / "tables", rows=rows, parties=parties)
    return credit(data, parties=parties)


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none): results taken on two
    hosts must not be compared as if from one, and a VM may move between hosts."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def size_arguments(ap: Any, *, parties: str, epochs: int, repeats: int, work: str) -> None:
    """The options a federation benchmark shares (and `result_of` records): --rows, --parties,
    --epochs, --repeats, --batch, --data, --work, --out."""
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--parties", default=parties)
    ap.add_argument("--epochs", type=int, default=epochs)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument(
        "--data", type=Path, default=None, help="Credit's CSV instead of synthetic rows (--rows)"
    )
    ap.add_argument("--work", type=Path, default=Path(work))
    ap.add_argument("--out", type=Path, default=None)


def result_of(
    script: str, argv: Sequence[str], args: Any, started: float, **fields: Any
) -> dict[str, Any]:
    """A benchmark's JSON: the command, the machine, the run's sizes and `fields` (its arms,
    table, runs...), with the seconds since `started`."""
    return {
        "command": "python " + " ".join([f"bench/{script}", *argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "platform": platform.platform(),
        },
        "rows": args.rows,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "batch_size": args.batch,
        "seconds": round(time.time() - started, 1),
        **fields,
    }


def write_result(result: Mapping[str, Any], out: Path | None) -> None:
    """Print a benchmark's table and write its whole result as JSON to `out` (if given)."""
    print(json.dumps(result["table"], indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")


def centralised(cfg_path: Path, files: Mapping[str, Path], *, threads: int = 1) -> dict[str, Any]:
    """The same split-NN (one encoder per column block, their sum, the head, Adam) trained in one
    process without roles, on the same files, rows, batches and seeds. Returns epoch seconds and
    the test metrics (the federated run's should match to float tolerance)."""
    import torch

    from securevfl.config import load_config
    from securevfl.data.table import load_party_table
    from securevfl.methods.blocks.nets import (
        Standardizer,
        batches,
        make_optimizer,
        task_loss,
    )
    from securevfl.metrics import task_metrics

    torch.set_num_threads(threads)
    cfg = load_config(cfg_path)
    active, train_ids, test_ids, head = active_split(cfg, files)
    parties = {p: load_party_table(Path(files[p]), cfg, p) for p in cfg.party_names}
    scalers = {p: Standardizer().fit(t.rows(train_ids)) for p, t in parties.items()}
    encoders = {p: encoder_of(cfg, t, p) for p, t in parties.items()}
    # one optimiser per model, as the roles have (Adam is per parameter: the same updates)
    opts = [make_optimizer(e.parameters(), cfg) for e in encoders.values()]
    opts.append(make_optimizer(head.parameters(), cfg))
    # each role reads its rows by id per batch (positions + scaling): the same work here
    epoch_seconds, epoch_cpu = [], []
    for epoch in range(cfg.epochs):
        started, cpu_started = time.perf_counter(), time.process_time()
        for ids in batches(train_ids, cfg.batch_size, seed=cfg.seed, epoch=epoch):
            s = sum(
                encoders[p](torch.from_numpy(scalers[p].transform(parties[p].rows(ids))))
                for p in cfg.party_names
            )
            out = head(s)
            y = torch.as_tensor(active.label_rows(ids))
            loss = task_loss(cfg.task, out, y)
            for o in opts:
                o.zero_grad()
            loss.backward()
            for o in opts:
                o.step()
        epoch_seconds.append(time.perf_counter() - started)
        epoch_cpu.append(time.process_time() - cpu_started)
    with torch.no_grad():
        s = sum(
            encoders[p](torch.from_numpy(scalers[p].transform(parties[p].rows(test_ids))))
            for p in cfg.party_names
        )
        test = task_metrics(cfg.task, y_true=active.label_rows(test_ids), output=head(s).numpy())
    return {
        "epoch_seconds": [round(x, 4) for x in epoch_seconds],
        "median_epoch_seconds": float(np.median(epoch_seconds)),
        # this process's CPU time per epoch: on a loaded machine its wall time also counts waits
        "epoch_cpu_seconds": [round(x, 4) for x in epoch_cpu],
        "threads": threads,
        "test": test,
    }


def run_centralised(prep: Prepared, raw: Mapping[str, Any], out: Path) -> dict[str, Any]:
    """`centralised` in a fresh process (its own peak RSS, no harness state, one thread)."""
    out = Path(out)
    cfg_path = write_toml(raw, out / "centralised.toml")
    files = out / "centralised-files.json"
    files.write_text(json.dumps({r: str(p) for r, p in prep.files.items()}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = loadavg()
    p = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "centralised", str(cfg_path), str(files)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = p.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        p.kill()
        stdout, stderr = p.communicate()
    if p.returncode != 0 or not stdout.strip():
        return {"ok": False, "error": stderr[-2000:]}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["ok"] = True
    result["peak_rss_mib"] = result.pop("self_peak_rss_mib", None)
    result["load_before"] = load_before
    return result


def _main(argv: Sequence[str]) -> int:
    if len(argv) == 3 and argv[0] == "centralised":
        import resource

        files = {r: Path(p) for r, p in json.loads(Path(argv[2]).read_text()).items()}
        result = centralised(Path(argv[1]), files)
        result["self_peak_rss_mib"] = round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
        )
        print(json.dumps(result))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
