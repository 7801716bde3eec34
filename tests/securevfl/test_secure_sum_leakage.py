"""What the aggregator receives: in `mask` mode it carries no usable information about a party's
representation (unlike `plain`). Captured from a real in-process federation run."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl import secure_sum
from securevfl.inproc import run_federation
from securevfl.methods.splitnn import SplitNNParty
from tests.securevfl.conftest import make_config

Z_BOUND = 6.0  # sigmas per statistic of the masked words (see the masked test)


def _capture(monkeypatch, aggregation: str, raw, d):
    raw["run"]["aggregation"] = aggregation
    raw["train"]["epochs"] = 3
    received: list[np.ndarray] = []  # what reached the aggregator from party "alpha"
    truth: list[np.ndarray] = []  # alpha's true representations, in the same order
    stage = {"plain": secure_sum.PlainAggregator, "mask": secure_sum.MaskAggregator}[aggregation]
    original_accept = stage.accept
    original_handle = SplitNNParty.handle

    def spy_accept(self, arrays, *, key, sender):
        if sender == "alpha":
            received.append(np.array(arrays[key]))
        return original_accept(self, arrays, key=key, sender=sender)

    def spy_handle(self, op, **kw):
        out = original_handle(self, op, **kw)
        if self.name == "alpha" and "rep" in out:
            truth.append(np.array(out["rep"], dtype=np.float64))
        return out

    monkeypatch.setattr(stage, "accept", spy_accept)
    monkeypatch.setattr(SplitNNParty, "handle", spy_handle)
    code, _ = run_federation(make_config(raw, d), out=d / f"run-{aggregation}")
    assert code == 0
    assert len(received) == len(truth) > 0
    return np.concatenate([r.reshape(-1) for r in received]), np.concatenate(
        [t.reshape(-1) for t in truth]
    )


# split-NN's representation sums: 16 bits after the point, in Z_2^32 (its declared encoding)
FRAC_BITS = 16


def _as_signed_fixed_point(v: np.ndarray) -> np.ndarray:
    """The best guess an aggregator can make: read ring elements as signed fixed point."""
    return v.view(np.int32).astype(np.float64) / 2.0**FRAC_BITS


def test_plain_aggregator_sees_the_representation(monkeypatch, small_federation):
    raw, d = small_federation
    seen, truth = _capture(monkeypatch, "plain", raw, d)
    assert np.corrcoef(seen, truth)[0, 1] > 0.999


def test_masked_contributions_carry_no_information(monkeypatch, small_federation):
    raw, d = small_federation
    seen, truth = _capture(monkeypatch, "mask", raw, d)
    assert seen.dtype == np.uint32  # the 32-bit ring of representation sums
    guess = _as_signed_fixed_point(seen)
    # masks are fresh random keys each run, so every statistic below is random: under
    # independence a sample correlation (or a bit frequency, in units of 0.5) has standard
    # deviation ~1/sqrt(n). The run checks 45 of them (2 correlations, 32 bit frequencies, 11
    # sign agreements): at Z_BOUND = 6 sigma each fails with probability 2.0e-9 (two-sided
    # normal tail), the run with at most 45 times that, 9e-8. The plain path above reaches
    # > 0.999 and the unmasked encoding's sign agreement > 0.99, both far past these bounds
    # (at most 6 / sqrt(1000) = 0.19).
    n = len(seen)
    assert n >= 1000
    corr_bound = Z_BOUND / np.sqrt(n)
    assert abs(np.corrcoef(guess, truth)[0, 1]) < corr_bound
    # rank correlation too (robust to the huge magnitudes)
    rank = lambda a: np.argsort(np.argsort(a))  # noqa: E731
    assert abs(np.corrcoef(rank(guess), rank(truth))[0, 1]) < corr_bound
    # every bit of the masked words is balanced, and high bits do not follow the sign bit
    tol = Z_BOUND * 0.5 / np.sqrt(len(seen))  # Z_BOUND sigma per bit
    assert np.all(np.abs(_bits(seen).mean(axis=0) - 0.5) < tol)
    assert np.all(np.abs(_sign_agreement(seen)[20:31] - 0.5) < tol)
    # the same statistic exposes the unmasked encoding: its high bits all copy the sign bit
    enc = np.round(truth * 2**FRAC_BITS).astype(np.int32).view(np.uint32)
    assert np.all(_sign_agreement(enc)[20:31] > 0.99)


def _bits(words: np.ndarray) -> np.ndarray:
    """[n, width] bits, most significant first."""
    width = 8 * words.dtype.itemsize
    return np.unpackbits(words.astype(f">u{width // 8}").view(np.uint8)).reshape(-1, width)


def _sign_agreement(words: np.ndarray) -> np.ndarray:
    b = _bits(words)
    return (b == b[:, :1]).mean(axis=0)[::-1]  # index i = bit i (0 = least significant)


def test_group_smaller_than_min_group_is_refused():
    from types import SimpleNamespace

    def cfg(aggregation, min_group=2):
        return SimpleNamespace(
            aggregation=aggregation, min_group=min_group, party_names=("a", "b", "c")
        )

    secure_sum.check_group(cfg("plain"), ["a"], key="S", what="test")  # plain: baseline
    for backend in ("mask", "ckks"):
        with pytest.raises(secure_sum.GroupTooSmall, match="min_group = 2") as info:
            secure_sum.check_group(cfg(backend), ["a"], key="S", what="method laser")
        assert "method laser" in str(info.value)
        # only passive parties count: the active party or the aggregator are no protection
        for extra in ("active", "aggregator"):
            assert not secure_sum.group_allowed(cfg(backend), ["a", extra])
        assert secure_sum.group_allowed(cfg(backend), ["a", "b"])
    secure_sum.check_group(cfg("mask", 1), ["a"], key="S", what="explicit opt-in")
