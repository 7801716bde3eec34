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
    assert all(len(s) == 2 and s[0] > 0 and s[1] >= 0 for s in samples)
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
    }
