"""LASER-VFL as real OS processes over ZeroMQ with CURVE: a passive party killed with SIGKILL
mid-training is treated as missing from then on and the run finishes. (LASER-VFL over CKKS
trains as over the masked sum: `test_method_goldens.py`, case laser-ckks.)"""

from __future__ import annotations

import json
import os

import pytest

from tests.securevfl.conftest import kill_role_after_epoch, write_toml
from tests.securevfl.test_laser import block_csv

pytestmark = pytest.mark.multiprocess

NETWORK = {
    "heartbeat_interval": 0.2,
    "peer_timeout": 3.0,
    "round_timeout": 60.0,
    "startup_timeout": 60.0,
}


def laser_raw(directory, *, aggregation: str, epochs: int, n: int = 400) -> dict:
    groups = block_csv(directory / "data.csv", n=n, blocks=4)
    return {
        "run": {"method": "laser", "aggregation": aggregation, "seed": 0},
        "data": {"path": "data.csv", "task": "binary", "test_fraction": 0.25},
        "active": {"columns": []},
        "parties": {f"p{i}": {"columns": g} for i, g in enumerate(groups)},
        "train": {"epochs": epochs, "batch_size": 32, "lr": 0.01},
        "model": {"hidden": [16], "width": 8},
        "missing": {"train": {"kind": "mcar", "p": 0.2}, "test": {"kind": "mcar", "p": 0.2}},
        "network": dict(NETWORK),
    }


def test_sigkilled_party_is_treated_as_missing_and_laser_finishes(tmp_path):
    raw = laser_raw(tmp_path, aggregation="mask", epochs=6)
    config = write_toml(raw, tmp_path / "config.toml")
    run_dir = tmp_path / "run"
    code, _, stderr, pids, _ = kill_role_after_epoch(config, run_dir, "p2")
    assert code == 0, stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["lost_parties"] == ["p2"]
    assert len(metrics["history"]) == raw["train"]["epochs"]
    # the test rows held only by p2 cannot be scored; the others are predicted without p2
    assert 0.9 * metrics["n_test"] <= metrics["test"]["n_eval"] < metrics["n_test"]
    assert metrics["test"]["accuracy"] > 0.6
    aggregator_log = (run_dir / "logs" / "aggregator.log").read_text()
    assert "lost party 'p2'" in aggregator_log and "continuing without it" in aggregator_log
    active_log = (run_dir / "logs" / "active.log").read_text()
    assert "p2" in active_log and "missing from now on" in active_log
    # every surviving role exited on its own, with status 0
    for role in ("aggregator", "active", "p0", "p1", "p3"):
        with pytest.raises(ProcessLookupError):
            os.kill(pids[role], 0)
