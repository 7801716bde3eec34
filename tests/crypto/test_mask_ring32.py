"""Masked sums in Z_2^32: a contribution is its Z_2^64 masked value reduced mod 2^32, used only
where the sum cannot wrap 32 bits and an uncancelled sum is still caught
(`FixedPointEncoder.ring_dtype`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto import FixedPointEncoder, MaskedSumAggregator, SumDidNotCancel
from crypto.fixedpoint import NARROW_DETECTION_BITS, FixedPointOverflow
from tests.crypto.test_masking import looks_uniform, make_parties

# what split-NN and the block methods declare: |x| <= 4096, 16 bits after the point
NARROW = FixedPointEncoder(frac_bits=16, bound=4096.0)


def _narrow_parties(names):
    parties = make_parties(names)
    for party in parties.values():
        party.encoder = NARROW
    return parties


def test_the_ring_is_32_bits_only_where_the_sum_fits_and_a_broken_one_is_caught() -> None:
    assert NARROW.ring_dtype(terms=5, size=4096) == np.uint32
    assert NARROW.ring_dtype(terms=7, size=4096) == np.uint32
    # 8 * 2^28 = 2^31: the worst-case sum would wrap a signed 32-bit word
    assert NARROW.ring_dtype(terms=8, size=4096) == np.uint64
    # a uniform element passes the range check of 5 terms with probability 0.625: a sum needs
    # ceil(128 / -log2(0.625)) values before a broken one is caught but with 2^-128
    passing = (2 * 5 * 2**28 + 1) / 2**32
    least = math.ceil(NARROW_DETECTION_BITS / -math.log2(passing))
    assert NARROW.ring_dtype(terms=5, size=least) == np.uint32
    assert NARROW.ring_dtype(terms=5, size=least - 1) == np.uint64
    assert NARROW.ring_dtype(terms=5, size=1) == np.uint64
    # the default encoding (2^20 with 20 bits) never fits 32 bits
    assert FixedPointEncoder().ring_dtype(terms=2, size=10**6) == np.uint64


def test_narrowed_contributions_sum_to_the_plain_sum() -> None:
    group = ["alice", "bob", "carol", "dave", "erin"]
    parties = _narrow_parties(group)
    rng = np.random.default_rng(7)
    inputs = {name: rng.uniform(-4096, 4096, 4096) for name in group}
    contributions = {
        name: NARROW.narrow(parties[name].mask(x, round=3, group=group, tensor="rep"))
        for name, x in inputs.items()
    }
    assert all(c.dtype == np.uint32 and c.nbytes == 4 * 4096 for c in contributions.values())
    total = MaskedSumAggregator.add(contributions, group=group, ring=np.uint32)
    assert total.dtype == np.uint32
    decoded = NARROW.decode(total, terms=5)
    expected = np.sum(np.stack(list(inputs.values())), axis=0)
    assert np.max(np.abs(decoded - expected)) <= 5 * 2.0**-17
    # the same as the 64-bit sum of the same contributions, decoded
    wide = MaskedSumAggregator.add(
        {n: parties[n].mask(x, round=4, group=group, tensor="rep") for n, x in inputs.items()},
        group=group,
    )
    assert np.array_equal(NARROW.decode(wide, terms=5), decoded)


def test_a_narrowed_contribution_looks_uniform() -> None:
    group = ["alice", "bob", "carol"]
    parties = _narrow_parties(group)
    x = np.zeros(1 << 14)  # the most structured input there is
    narrowed = NARROW.narrow(parties["alice"].mask(x, round=0, group=group, tensor="h"))
    # two 32-bit words per 64-bit word of the statistics' bit-position test
    assert looks_uniform(narrowed.view(np.uint64))


def test_a_narrowed_sum_missing_a_contributor_does_not_decode() -> None:
    group = ["alice", "bob", "carol", "dave", "erin"]
    parties = _narrow_parties(group)
    contributions = {
        name: NARROW.narrow(parties[name].mask(np.ones(256), round=0, group=group, tensor="h"))
        for name in group
    }
    partial = np.zeros(256, dtype=np.uint32)
    for name in group[:4]:
        partial += contributions[name]
    with pytest.raises(SumDidNotCancel, match="did not cancel"):
        NARROW.decode(partial, terms=5)


def test_the_32_bit_ring_refuses_more_terms_than_it_can_sum_and_other_dtypes() -> None:
    with pytest.raises(FixedPointOverflow, match="exceed the 32-bit ring .at most 7 terms"):
        NARROW.decode(np.zeros(4, dtype=np.uint32), terms=8)
    with pytest.raises(TypeError, match="uint64 or uint32"):
        NARROW.decode(np.zeros(4, dtype=np.int32), terms=2)
    group = ["alice", "bob"]
    contributions = {n: np.zeros(4, dtype=np.uint32) for n in group}
    with pytest.raises(ValueError, match="from 'bob' is not a uint32"):
        MaskedSumAggregator.add(
            {**contributions, "bob": np.zeros(4, dtype=np.uint64)}, group=group, ring=np.uint32
        )
    with pytest.raises(ValueError, match="from 'alice' is not a uint64"):
        MaskedSumAggregator.add(contributions, group=group)
    with pytest.raises(ValueError, match="ring must be uint64 or uint32"):
        MaskedSumAggregator.add(contributions, group=group, ring=np.int32)


def test_narrowing_keeps_the_low_32_bits() -> None:
    words = np.array([0, 1, 2**32 - 1, 2**32, 2**64 - 1, 0x0123456789ABCDEF], dtype=np.uint64)
    assert NARROW.narrow(words).tolist() == [0, 1, 2**32 - 1, 0, 2**32 - 1, 0x89ABCDEF]
