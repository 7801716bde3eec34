"""The CKKS overhead benchmark's attribution helpers (`bench/ckks_overhead.py`): the per-role
stage measurement runs the real secure-sum stages and reveals the true sum, and the CPU split
separates per-epoch from one-off seconds. Timings are never asserted; only what is computed
from them and the correctness of the measured path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import ckks_overhead as C  # noqa: E402


def test_split_cpu_separates_per_epoch_from_one_off_seconds() -> None:
    short = {"aggregator": 2.0, "p1": 4.5}
    long = {"aggregator": 2.4, "p1": 5.3}
    split = C.split_cpu(short, long, epochs_short=1, epochs_long=3)
    assert split == {
        "aggregator": {"per_epoch": 0.2, "once": 1.8},
        "p1": {"per_epoch": 0.4, "once": 4.1},
    }


def test_split_cpu_refuses_mismatched_runs() -> None:
    with pytest.raises(ValueError, match="must exceed"):
        C.split_cpu({"p1": 1.0}, {"p1": 2.0}, epochs_short=2, epochs_long=2)
    with pytest.raises(ValueError, match="different roles"):
        C.split_cpu({"p1": 1.0}, {"p2": 2.0}, epochs_short=1, epochs_long=3)


@pytest.mark.parametrize("zeros", ["thread", "fresh"])
def test_per_batch_stages_measures_the_real_stages_and_reveals_the_sum(zeros: str) -> None:
    out = C.per_batch_stages(parties=2, values=512, rounds=2, zeros=zeros)
    # the parameters a run of 2 parties sizes from the default bound (2^20), at least 128-bit
    sized = C.choose_params(precision_bits=12, magnitude=2.0**20, terms=3)
    assert out["params"] == list(sized.params.coeff_mod_bit_sizes) and sized.security_bits >= 128
    assert out["zeros"] == zeros
    assert set(out["ms"]) == {
        "party: protect (main thread)",
        "aggregator: accept + combine",
        "active: reveal",
        "party: zero worker (the process CPU outside the main thread, per party)",
    }
    assert all(v >= -0.5 for v in out["ms"].values())  # a CPU clock's granularity, not a timing
    # the measured path is the real one: the revealed sum is the exact sum up to the flooding
    assert out["max_abs_error"] < 10 * out["flood_std"] + 2.0**-12
