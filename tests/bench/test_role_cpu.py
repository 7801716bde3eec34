"""`bench/role_cpu.py`'s summary of an arm: medians per role and of the total."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import role_cpu  # noqa: E402


def test_an_arms_summary_is_the_median_per_role_and_of_the_totals() -> None:
    runs = [
        {"cpu_seconds": {"active": 3.0, "p1": 2.0}},
        {"cpu_seconds": {"active": 5.0, "p1": 1.0}},
        {"cpu_seconds": {"active": 4.0, "p1": 4.0}},
    ]
    assert role_cpu.arm_summary(runs) == {
        "median_total_s": 6.0,  # totals 5, 6, 8
        "median_per_role_s": {"active": 4.0, "p1": 2.0},
    }
