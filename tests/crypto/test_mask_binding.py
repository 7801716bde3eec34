"""`MaskedSumParty.bind`: a masked contribution bound to the call it answers. Members sent the
same call give the sum of their inputs; a member sent another call turns the sum into
uniformly random ring elements, so a modified active party cannot give the members of one sum
different calls and still read it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from crypto import FixedPointEncoder, MaskedSumAggregator, MaskedSumParty, MaskingKeyPair

SESSION = b"s" * 16


def parties(names):
    keys = {n: MaskingKeyPair.generate() for n in names}
    publics = {n: k.public for n, k in keys.items()}
    enc = FixedPointEncoder(frac_bits=20, bound=2.0**10)
    return enc, {
        n: MaskedSumParty(
            name=n, keypair=keys[n], peer_publics=publics, session=SESSION, encoder=enc
        )
        for n in names
    }


def call(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def contributions(maskers, values, calls, *, round=3, key="z"):
    group = tuple(maskers)
    out = {}
    for n, m in maskers.items():
        masked = m.mask(values[n], round=round, group=group, tensor=key)
        out[n] = m.bind(masked, round=round, group=group, tensor=key, call=calls[n])
    return group, out


@pytest.mark.parametrize("names", [("a", "b"), ("a", "b", "c"), ("p1", "p2", "p3", "p4", "p5")])
def test_members_sent_one_call_get_the_sum_of_their_inputs(names):
    enc, maskers = parties(names)
    rng = np.random.default_rng(0)
    values = {n: rng.normal(size=(8, 4)) for n in names}
    group, bound = contributions(maskers, values, dict.fromkeys(names, call("the call")))
    total = MaskedSumAggregator.add(bound, group=group)
    expected = sum(values.values())
    assert np.allclose(enc.decode(total, terms=len(names)), expected, atol=1e-5)


@pytest.mark.parametrize("names", [("a", "b"), ("a", "b", "c"), ("p1", "p2", "p3", "p4", "p5")])
def test_a_member_sent_another_call_makes_the_sum_random(names):
    enc, maskers = parties(names)
    rng = np.random.default_rng(1)
    values = {n: rng.normal(size=(64,)) for n in names}
    calls = dict.fromkeys(names, call("the call"))
    calls[names[-1]] = call("another call")  # the split view of one member
    group, bound = contributions(maskers, values, calls)
    total = MaskedSumAggregator.add(bound, group=group)
    with pytest.raises(ValueError):
        enc.decode(total, terms=len(names))  # nowhere near an encoded sum
    # the ring elements look uniform: the top bit is set about half the time
    top = (total >> np.uint64(63)).astype(np.int64)
    assert 16 <= int(top.sum()) <= 48
    honest = enc.encode(sum(values.values()))
    assert not np.any(total == honest)


def test_binding_changes_every_word_and_keeps_the_shape():
    _, maskers = parties(("a", "b", "c"))
    x = np.zeros((5, 3))
    masked = maskers["a"].mask(x, round=1, group=("a", "b", "c"), tensor="z")
    bound = maskers["a"].bind(masked, round=1, group=("a", "b", "c"), tensor="z", call=call("c"))
    assert bound.shape == masked.shape and bound.dtype == np.uint64
    assert not np.any(bound == masked)
    assert masked.flags.writeable  # its input is left as it was
    again = maskers["a"].bind(masked, round=1, group=("a", "b", "c"), tensor="z", call=call("c"))
    assert np.array_equal(bound, again)


def test_bind_refuses_what_is_not_a_call_digest_or_a_group_it_may_sum_in():
    _, maskers = parties(("a", "b"))
    masked = np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="32-byte"):
        maskers["a"].bind(masked, round=1, group=("a", "b"), tensor="z", call=b"short")
    with pytest.raises(ValueError, match="not in the group"):
        maskers["a"].bind(masked, round=1, group=("b", "c"), tensor="z", call=call("c"))


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 70_001])
def test_binding_in_place_gives_the_bits_of_binding_into_a_new_array(size):
    """`bind(..., in_place=True)` (what a party's sum stage uses on the array `mask` made for
    the call) adds the same streams into that array: bit for bit the new array of the
    default, for sizes within one chunk, across chunks and past one CTR context per pair."""
    _, maskers = parties(("a", "b", "c", "d"))
    group = tuple(maskers)
    x = np.random.default_rng(size).normal(size=size)
    for round_, m in enumerate(maskers.values()):
        masked = m.mask(x, round=round_, group=group, tensor="z")
        fresh = m.bind(masked, round=round_, group=group, tensor="z", call=call("c"))
        same = m.bind(masked, round=round_, group=group, tensor="z", call=call("c"), in_place=True)
        assert same is masked and np.array_equal(same, fresh)


def test_binding_in_place_refuses_an_array_it_may_not_write():
    _, maskers = parties(("a", "b"))
    masked = maskers["a"].mask(np.ones(4), round=1, group=("a", "b"), tensor="z")
    masked.flags.writeable = False
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        maskers["a"].bind(
            masked, round=1, group=("a", "b"), tensor="z", call=call("c"), in_place=True
        )
