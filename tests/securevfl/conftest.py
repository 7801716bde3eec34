"""Shared fixtures: small federations on synthetic or embedded data."""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import dump_toml, parse_config
from securevfl.data.table import write_csv

REPO = Path(__file__).resolve().parents[2]


def synthetic_csv(path: Path, *, n: int = 400, n_cols: int = 6, seed: int = 0) -> list[str]:
    """A learnable binary table: Y depends on every column, so every party matters."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, n_cols))
    w = rng.normal(size=n_cols)
    y = (x @ w + 0.3 * rng.normal(size=n) > 0).astype(float)
    cols = [f"X{i + 1}" for i in range(n_cols)]
    write_csv(
        path, id_column="ID", ids=np.arange(1, n + 1), columns=cols, values=x, label="Y", labels=y
    )
    return cols


BASE_RAW = {
    "run": {"method": "splitnn", "aggregation": "mask", "seed": 0},
    "data": {"path": "data.csv", "id": "ID", "label": "Y", "task": "binary", "test_fraction": 0.25},
    "active": {"columns": []},
    "parties": {
        "alpha": {"columns": ["X1", "X2"]},
        "beta": {"columns": ["X3", "X4"]},
        "gamma": {"columns": ["X5", "X6"]},
    },
    "train": {"epochs": 3, "batch_size": 64, "lr": 0.01},
    "model": {"hidden": [16], "width": 4},
    "network": {
        "heartbeat_interval": 0.2,
        "peer_timeout": 3.0,
        "round_timeout": 30.0,
        "startup_timeout": 30.0,
    },
}


@pytest.fixture
def one_torch_thread():
    """Tiny ops (TabNet blocks, FALSE-VFL's small nets): torch's intra-op threads only add
    contention on a shared 2-core machine (measured ~7 s on one thread against ~120 s on two,
    under load); the thread count is restored afterwards. Files of such tests use it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def small_federation(tmp_path):
    """(raw config dict, directory) for a 3-party synthetic federation; edit then parse."""
    synthetic_csv(tmp_path / "data.csv")
    return copy.deepcopy(BASE_RAW), tmp_path


def permissive_policy(raw: dict) -> dict:
    """Give every party the release policy that accepts what `raw` asks for (its aggregation,
    min_group, the method's clear releases and seeds in the config), for tests of other
    features; tests of the
    policy itself build their own. Returns `raw`, changed in place."""
    from securevfl.methods import method_spec

    run = raw.get("run", {})
    policy = raw.setdefault("policy", {})
    aggregation = run.get("aggregation", "mask")
    accepted = policy.setdefault("aggregations", ["mask", "ckks"])
    if aggregation not in accepted:
        accepted.append(aggregation)
    if run.get("min_group", 2) < policy.get("min_group", 2):
        policy["min_group"] = run["min_group"]
    seeded = (
        run.get("shared_init")
        or raw.get("privacy", {}).get("noise_seed") is not None
        or raw.get("method", {}).get("guest_seed") is not None
    )
    if seeded:  # a test's reproducible draws (`fixed_seeds`), which a party must accept
        policy["config_seeds"] = True
    try:
        spec = method_spec(run.get("method", "splitnn"))
    except KeyError:  # an unknown method: config validation says so
        return raw
    clear = [
        f"{op.name}.{r.tensor}" for op in spec.operations for r in op.releases if r.to == "clear"
    ]
    if clear:
        policy["clear_releases"] = sorted(set(policy.get("clear_releases", [])) | set(clear))
    return raw


def make_config(raw: dict, directory: Path):
    return parse_config(permissive_policy(raw), source=directory / "config.toml")


def write_toml(raw: dict, path: Path, *, strict: bool = False) -> Path:
    """`raw` as a TOML file; unless `strict`, with the permissive policy (see above)."""
    if not strict:
        permissive_policy(raw)
    path.write_text(dump_toml(raw))
    return path


def securevfl_cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "securevfl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **kwargs,
    )


@contextlib.contextmanager
def run_until_epoch(
    config: Path, run_dir: Path, *, epoch: int = 2, deadline: float = 180, group: bool = False
):
    """`securevfl run CONFIG` as a real process, handed over as (process, the roles' pids) once
    the active party's checkpoint of epoch `epoch - 1` is on disk; `group`: in a process group
    of its own, with SIGINT handled as by default (as a terminal's foreground job: a suite
    started as a background job of a shell without job control inherits SIGINT ignored, and
    so would every process it starts). Always reaped."""
    import json
    import signal
    import time

    def foreground() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "securevfl", "run", str(config), "--out", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=group,
        preexec_fn=foreground if group else None,
    )
    try:
        until = time.monotonic() + deadline
        marker = run_dir / "checkpoints" / "active" / f"epoch_{epoch - 1:04d}.pt"
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < until, f"training never reached epoch {epoch}"
            time.sleep(0.05)
        yield proc, json.loads((run_dir / "pids.json").read_text())
    finally:
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.communicate()


def kill_role_after_epoch(
    config: Path,
    run_dir: Path,
    role: str,
    *,
    epoch: int = 2,
    deadline: float = 180,
    timeout: float = 240,
):
    """`securevfl run CONFIG` as a real process; once the active party's checkpoint of epoch
    `epoch - 1` is on disk, SIGKILL `role`. Returns (returncode, stdout, stderr, pids, seconds
    from the kill to the end of the run); the run is always reaped."""
    import signal
    import time

    with run_until_epoch(config, run_dir, epoch=epoch, deadline=deadline) as (proc, pids):
        killed_at = time.monotonic()
        os.kill(pids[role], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr, pids, time.monotonic() - killed_at
