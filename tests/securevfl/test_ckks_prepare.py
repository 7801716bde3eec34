"""A CKKS party encrypts the zeros of its next call while the current one is on the wire: the
next call of the same length uses them (each once), sums still decrypt to the released
precision, and zeros left by lengths that do not recur stay bounded."""

from __future__ import annotations

import numpy as np

from crypto.ckks import CkksKeyHolder, DecryptionRelease, choose_params
from securevfl.secure_sum import CkksActive, CkksAggregator, CkksParty, SumSession


def _roles():
    params = choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
    holder = CkksKeyHolder(params=params)
    ctx = holder.public_context_bytes()
    parties = {
        n: CkksParty(SumSession(name=n, session=b"s" * 16, ckks_public_context=ctx))
        for n in ("a", "b")
    }
    agg = CkksAggregator(SumSession(name="aggregator", session=b"s" * 16, ckks_public_context=ctx))
    release = DecryptionRelease(precision_bits=12, flood_bits=10)
    active = CkksActive(
        SumSession(name="active", session=b"s" * 16, ckks_release=release), key_holder=holder
    )
    return parties, agg, active


def _sum(parties, agg, active, xs, rnd):
    group = sorted(parties)
    accepted = {
        n: agg.accept(parties[n].protect(xs[n], round=rnd, group=group, key="h"), key="h", sender=n)
        for n in group
    }
    combined = agg.combine_accepted(accepted, group=group, key="h")
    return active.reveal(combined, group=group, key="h", shape=xs["a"].shape)


def test_prepared_zeros_are_used_by_the_next_call_and_sums_stay_exact():
    parties, agg, active = _roles()
    rng = np.random.default_rng(0)
    slots = parties["a"].public.slots
    for rnd in range(3):
        xs = {n: rng.normal(size=(slots + 5,)) for n in parties}
        got = _sum(parties, agg, active, xs, rnd)
        np.testing.assert_allclose(got, xs["a"] + xs["b"], atol=2e-3)
        party = parties["a"]
        party._join()
        # two chunks (a full one and a 5-value one) ready for the next call of this length
        assert party.public.ready_zeros == 2
    before = parties["a"].public.ready_zeros
    xs = {n: rng.normal(size=(slots + 5,)) for n in parties}
    parties["a"]._join()
    parties["a"].protect(xs["a"], round=9, group=["a", "b"], key="h")
    # the call consumed the two prepared zeros and prepared two more for the next one
    parties["a"]._join()
    assert before == 2 and parties["a"].public.ready_zeros == 2


def test_zeros_left_by_lengths_that_do_not_recur_stay_bounded():
    parties, _, _ = _roles()
    party = parties["a"]
    for i, n in enumerate(range(1, 40)):
        party.protect(np.ones(n), round=i, group=["a", "b"], key="h")
    party._join()
    assert party.public.ready_zeros <= 5
