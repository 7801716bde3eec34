"""`bench/role_timings.py`: the functions it times still exist under the names it patches (a
rename would otherwise leave every arm silently untimed), its sitecustomize times the named
function in a role's process and writes one file per role, and its summary is the medians."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import role_timings  # noqa: E402


def test_every_timed_function_exists_under_the_name_the_bench_patches() -> None:
    for module, cls, name, label in role_timings.TIMED + role_timings.DETAIL:
        owner = getattr(importlib.import_module(module), cls)
        assert callable(getattr(owner, name)), label


def test_the_sitecustomize_times_calls_in_a_role_process_and_writes_them_by_role(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    spec = (
        ("json", "JSONEncoder", "encode", "json.encode"),
        ("json", "JSONEncoder", "no_such_function", "absent"),  # an older tree: left untimed
        ("json", "NoSuchClass", "encode", "absent too"),
        ("no_such_module_here", "Cls", "f", "absent three"),
    )
    (site / "sitecustomize.py").write_text(role_timings.SITECUSTOMIZE % (spec,))
    out = tmp_path / "timings"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "SECUREVFL_ROLE_TIMINGS": str(out)}
    code = "import json\nfor i in range(3): json.JSONEncoder().encode([i] * 1000)"
    subprocess.run([sys.executable, "-c", code, "--name", "p2"], env=env, check=True, timeout=60)
    written = json.loads((out / "p2.json").read_text())
    assert list(written) == ["json.encode"]
    samples = written["json.encode"]
    assert len(samples) == 3
    assert all(len(s) == 3 and s[0] > 0 and s[1] >= 0 and s[2] > 0 for s in samples)
    # without the variable nothing is patched and nothing written
    env.pop("SECUREVFL_ROLE_TIMINGS")
    subprocess.run([sys.executable, "-c", code, "--name", "p3"], env=env, check=True, timeout=60)
    assert not (out / "p3.json").exists()


def test_summary_is_the_median_wall_and_cpu_in_milliseconds() -> None:
    got = role_timings.summary([[0.001, 0.0005], [0.003, 0.002], [0.002, 0.001]])
    assert got == {"calls": 3, "wall_ms_median": 2.0, "cpu_ms_median": 1.0, "cpu_s_total": 0.0035}


def test_an_arms_table_takes_medians_over_the_roles_of_each_kind() -> None:
    def stats(ms: float) -> dict:
        return {"calls": 3, "wall_ms_median": ms, "cpu_ms_median": ms, "cpu_s_total": 0.0}

    runs = [
        {
            "epoch_seconds": [1.0, 3.0],
            "roles": {
                "p1": {"party.answer": stats(2.0), "mask.protect": stats(0.2)},
                "p2": {"party.answer": stats(4.0), "mask.protect": stats(0.4)},
                "aggregator": {"hub.recv": stats(0.3)},
                "active": {"active.post": stats(0.5)},
            },
        },
        {"epoch_seconds": [2.0], "roles": {"p1": {"party.answer": stats(3.0)}}},
    ]
    assert role_timings.arm_table(runs) == {
        "party_answer_cpu_ms_median": 3.0,
        "epoch_s_median": 2.0,
        "cpu_ms_median": {
            "active/active.post": 0.5,
            "aggregator/hub.recv": 0.3,
            "party/mask.protect": 0.3,
            "party/party.answer": 3.0,
        },
        "batch_ms_median": None,
    }
    runs[0]["batch_ms_median"] = {k: 1.0 for k in role_timings.PHASES}
    runs[1]["batch_ms_median"] = {k: 3.0 for k in role_timings.PHASES}
    runs.append({"epoch_seconds": [], "roles": {}, "batch_ms_median": None})
    assert role_timings.arm_table(runs)["batch_ms_median"] == {k: 2.0 for k in role_timings.PHASES}


def _timeline(batches: int, *, skip_answer_of: int | None = None) -> dict:
    """A run's samples (wall, CPU, start), in seconds, of `batches` batches 10 ms apart, each
    laid out as below (ms after the batch's post starts), and a set-up post 1 s before."""
    raw: dict = {
        "active": {"active.post": [], "active.settle": []},
        "aggregator": {"aggregator.accept": [], "aggregator.result": []},
        "p1": {"party.answer": [], "mask.idle": []},
        "p2": {"party.answer": [], "mask.idle": []},
    }
    ms = 1e-3
    raw["active"]["active.post"].append((0.2 * ms, 0.2 * ms, 0.0))  # set-up: left out
    for b in range(batches):
        t = 1.0 + b * 10 * ms
        raw["active"]["active.post"].append((0.5 * ms, 0.4 * ms, t))
        # p1 answers 1.0-3.0, p2 1.5-4.0 (CPU 1.8 and 2.2); each works ahead 0.1 ms of CPU
        if skip_answer_of != b:
            raw["p1"]["party.answer"].append((2.0 * ms, 1.8 * ms, t + 1.0 * ms))
        raw["p2"]["party.answer"].append((2.5 * ms, 2.2 * ms, t + 1.5 * ms))
        raw["p1"]["mask.idle"].append((0.1 * ms, 0.1 * ms, t + 3.1 * ms))
        raw["p2"]["mask.idle"].append((0.1 * ms, 0.1 * ms, t + 4.1 * ms))
        # the aggregator accepts at 3.2 and 4.6, returns its sum 4.7-4.9
        raw["aggregator"]["aggregator.accept"].append((0.01 * ms, 0.01 * ms, t + 3.2 * ms))
        raw["aggregator"]["aggregator.accept"].append((0.01 * ms, 0.01 * ms, t + 4.6 * ms))
        raw["aggregator"]["aggregator.result"].append((0.2 * ms, 0.2 * ms, t + 4.7 * ms))
        # the active party waits from 0.6 and has the sum at 5.5
        raw["active"]["active.settle"].append((4.9 * ms, 0.3 * ms, t + 0.6 * ms))
    raw["active"]["active.post"].append((0.5 * ms, 0.4 * ms, 1.0 + batches * 10 * ms))
    return raw


def test_batch_phases_split_each_batch_from_one_post_to_the_next() -> None:
    got = role_timings.batch_phases(_timeline(5))
    want = {
        "post": 0.5,
        "to_parties": 0.5,
        "parties": 3.0,
        "hop": 0.6,
        "aggregate": 0.3,
        "to_active": 0.6,
        "active": 4.5,
        "total": 10.0,
        "parties_cpu": 4.0,
        "ahead_cpu": 0.2,
    }
    assert got is not None and got.pop("batches") == 5
    assert set(got) == set(role_timings.PHASES)
    assert got == pytest.approx(want, abs=1e-6)
    assert sum(got[k] for k in role_timings.PHASES[:7]) == pytest.approx(got["total"])


def test_batch_phases_leave_out_batches_a_party_did_not_answer_and_say_none_without_any() -> None:
    got = role_timings.batch_phases(_timeline(5, skip_answer_of=2))
    assert got is not None and got["batches"] == 4
    assert role_timings.batch_phases(_timeline(1, skip_answer_of=0)) is None
    assert role_timings.batch_phases({"active": {}, "p1": {}}) is None
