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
    for module, cls, name, label in role_timings.TIMED:
        owner = getattr(importlib.import_module(module), cls)
        assert callable(getattr(owner, name)), label


def test_the_sitecustomize_times_calls_in_a_role_process_and_writes_them_by_role(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    spec = (("json", "JSONEncoder", "encode", "json.encode"),)
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
