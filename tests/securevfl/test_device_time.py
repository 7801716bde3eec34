"""A role's GPU time and memory (`securevfl/device_time.py`): nothing on a CPU; on a GPU every
model role writes RUN_DIR/device/ROLE.json with per-op spans (parties), kernel time (with
SECUREVFL_GPU_PROFILE=1) and peak memory, and the model is the one the CPU trains.

The cuda tests run only where torch sees a GPU (never in CI; run them on a GPU machine with
`pytest tests/securevfl/test_device_time.py`)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from securevfl.config import ConfigError
from securevfl.device_time import DeviceClock, device_clock
from tests.securevfl.conftest import BASE_RAW, securevfl_cli, synthetic_csv, write_toml
from tests.securevfl.fixed_seeds import fixed_seeds

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU torch can see")
PARTIES = ("alpha", "beta", "gamma")


def test_no_clock_and_no_file_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("SECUREVFL_GPU_PROFILE", raising=False)
    assert device_clock(torch.device("cpu"), role="alpha", run_dir=tmp_path) is None
    monkeypatch.setenv("SECUREVFL_GPU_PROFILE", "on")
    with pytest.raises(ConfigError, match="SECUREVFL_GPU_PROFILE.*set 1"):
        device_clock(torch.device("cpu"), role="alpha", run_dir=tmp_path)


@cuda
def test_spans_kernels_and_memory_of_known_work(tmp_path, monkeypatch):
    monkeypatch.setenv("SECUREVFL_GPU_PROFILE", "1")
    clock = device_clock(torch.device("cuda"), role="alpha", run_dir=tmp_path)
    assert isinstance(clock, DeviceClock)
    with clock:
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(3):
            with clock.span("forward"):
                b = a @ a
        b.cpu()
    got = json.loads((tmp_path / "device" / "alpha.json").read_text())
    assert got["calls_by_op"] == {"forward": 3}
    assert got["span_ms_by_op"]["forward"] > 0
    assert got["kernel_ms"] > 0 and got["kernels"] >= 3
    assert got["peak_allocated_mib"] >= 2 * 2048 * 2048 * 4 / 2**20 - 1e-6
    assert got["peak_reserved_mib"] >= got["peak_allocated_mib"]


@cuda
def test_a_cuda_federation_records_each_role_and_matches_the_cpu(tmp_path, monkeypatch):
    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # cpu and cuda compared: one initial model
    raw["train"].update({"epochs": 1, "batch_size": 64})
    synthetic_csv(tmp_path / "data.csv", n=300)
    metrics = {}
    for device in ("cpu", "cuda"):
        raw["run"]["device"] = device
        if device == "cuda":
            monkeypatch.setenv("SECUREVFL_GPU_PROFILE", "1")
        path = write_toml(copy.deepcopy(raw), tmp_path / f"{device}.toml")
        done = securevfl_cli(
            "run",
            str(path),
            "--out",
            str(tmp_path / device),
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        metrics[device] = json.loads((tmp_path / device / "metrics.json").read_text())
    for k, v in metrics["cpu"]["test"].items():
        assert metrics["cuda"]["test"][k] == pytest.approx(v, abs=1e-4), k
    assert not (tmp_path / "cpu" / "device").exists()
    for role in ("active", *PARTIES):
        got = json.loads((tmp_path / "cuda" / "device" / f"{role}.json").read_text())
        assert got["kernel_ms"] > 0 and got["peak_allocated_mib"] > 0, role
        if role != "active":
            assert got["calls_by_op"].get("forward", 0) > 0, (role, got)
    assert not (tmp_path / "cuda" / "device" / "aggregator.json").exists()
