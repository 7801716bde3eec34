"""`bench/cold_cache.py`: every arm, warm and cold, every part timed, and the JSON it
writes carries the command and the ratios it reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cold_cache  # noqa: E402


def test_it_times_every_arm_warm_and_cold_and_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    argv = ["--rows", "2000", "--batches", "6", "--warmup", "1", "--trash-mb", "1"]
    assert cold_cache.main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python bench/cold_cache.py --rows 2000")
    result = report["result"]
    assert set(result) == {"torch_adam", "lean_adam", "lean_adam_run_backward"}
    for states in result.values():
        for state in ("warm", "cold"):
            assert states[state]["forward_ms"] > 0 and states[state]["backward_step_ms"] > 0
        ratio = states["cold"]["backward_step_ms"] / states["warm"]["backward_step_ms"]
        assert abs(states["cold_over_warm_backward_step"] - ratio) < 0.01
