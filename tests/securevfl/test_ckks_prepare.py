"""A CKKS party gets the zeros of its next call made before that call: in ``idle`` mode (the
default) when its loop calls `CkksParty.idle` after the send, on a worker thread (``thread``),
or by a nice-19 helper process (``process``). The next call uses them (each once), sums still
decrypt to the released precision, zeros left by lengths that do not recur stay bounded, and the
mode comes from $SECUREVFL_CKKS_ZEROS."""

from __future__ import annotations

import time

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder, DecryptionRelease, choose_params
from securevfl import secure_sum
from securevfl.secure_sum import CkksActive, CkksAggregator, CkksParty, SumSession


def _roles(zeros: str | None = "idle"):
    params = choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
    holder = CkksKeyHolder(params=params)
    ctx = holder.public_context_bytes()
    parties = {
        n: CkksParty(SumSession(name=n, session=b"s" * 16, ckks_public_context=ctx), zeros=zeros)
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


def _wait(party: CkksParty) -> None:
    """What the party's loop does between its send and the next call."""
    party.idle()
    party._join()


@pytest.mark.parametrize("zeros", ["idle", "thread"])
def test_prepared_zeros_are_used_by_the_next_call_and_sums_stay_exact(zeros):
    parties, agg, active = _roles(zeros)
    rng = np.random.default_rng(0)
    slots = parties["a"].public.slots
    for rnd in range(3):
        xs = {n: rng.normal(size=(slots + 5,)) for n in parties}
        got = _sum(parties, agg, active, xs, rnd)
        np.testing.assert_allclose(got, xs["a"] + xs["b"], atol=2e-3)
        party = parties["a"]
        _wait(party)
        # two chunks (a full one and a 5-value one) ready for the next call of this length
        assert party.public.ready_zeros == 2
    xs = {n: rng.normal(size=(slots + 5,)) for n in parties}
    parties["a"].protect(xs["a"], round=9, group=["a", "b"], key="h")
    # the call consumed the two prepared zeros; the wait prepares two more for the next one
    assert parties["a"].public.ready_zeros == 0 or zeros == "thread"
    _wait(parties["a"])
    assert parties["a"].public.ready_zeros == 2


def test_idle_makes_as_many_zeros_as_the_calls_since_the_last_wait_used():
    parties, _, _ = _roles()
    party = parties["a"]
    slots = party.public.slots
    party.idle()  # nothing used yet: nothing made
    assert party.public.ready_zeros == 0
    party.protect(np.ones(slots), round=0, group=["a", "b"], key="h")
    party.protect(np.ones(2 * slots), round=0, group=["a", "b"], key="g")
    assert party.public.ready_zeros == 0  # nothing is made within a call
    party.idle()
    assert party.public.ready_zeros == 3
    party.idle()  # no call since: nothing more
    assert party.public.ready_zeros == 3
    party.protect(np.ones(5), round=1, group=["a", "b"], key="h")
    party.idle()  # one used, one made: rounds of 3 chunks were among the last 4
    assert party.public.ready_zeros == 3
    for rnd in range(2, 6):
        party.protect(np.ones(5), round=rnd, group=["a", "b"], key="h")
        party.idle()
    # the 3-chunk round has left the last 4 waits: one zero is kept ready, as one call uses
    assert party.public.ready_zeros == 1


def test_fresh_mode_prepares_nothing():
    parties, _, _ = _roles("fresh")
    party = parties["a"]
    party.protect(np.ones(10), round=0, group=["a", "b"], key="h")
    party.idle()
    assert party.public.ready_zeros == 0 and party._ahead is None


def test_zeros_left_by_lengths_that_do_not_recur_stay_bounded():
    for zeros in ("idle", "thread"):
        parties, _, _ = _roles(zeros)
        party = parties["a"]
        for i, n in enumerate(range(1, 40)):
            party.protect(np.ones(n), round=i, group=["a", "b"], key="h")
            party.idle()
        party._join()
        assert party.public.ready_zeros <= 5


def test_idle_keeps_at_most_the_cap(monkeypatch):
    monkeypatch.setattr(secure_sum, "_MAX_IDLE_ZEROS", 2)
    parties, _, _ = _roles()
    party = parties["a"]
    party.protect(np.ones(5 * party.public.slots), round=0, group=["a", "b"], key="h")
    party.idle()
    assert party.public.ready_zeros == 2


def test_the_mode_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("SECUREVFL_CKKS_ZEROS", raising=False)
    assert secure_sum._zero_mode() == "idle"
    for mode in ("thread", "process", "idle", "fresh", "helper"):
        monkeypatch.setenv("SECUREVFL_CKKS_ZEROS", mode)
        assert secure_sum._zero_mode() == mode
    monkeypatch.setenv("SECUREVFL_CKKS_ZEROS", "eager")
    with pytest.raises(ValueError, match="SECUREVFL_CKKS_ZEROS='eager'.*unset it"):
        secure_sum._zero_mode()
    monkeypatch.setenv("SECUREVFL_CKKS_ZEROS", "process")
    ctx = CkksKeyHolder(
        params=choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
    ).public_context_bytes()
    session = SumSession(name="a", session=b"s" * 16, ckks_public_context=ctx)
    assert CkksParty(session).zeros == "process"
    with pytest.raises(ValueError, match="zeros='later'"):
        CkksParty(session, zeros="later")


def _c1(public, chunk: bytes) -> bytes:
    """The second polynomial of a raw chunk (every prime's part): the encryption of zero's own,
    untouched by the plaintext added to it, so it names the zero a chunk used."""
    n = public.params.poly_modulus_degree
    widths = [(b + 7) // 8 for b in public.params.data_bit_sizes]
    offset, parts = 4 + 4 + 32, []
    for w in widths:
        parts.append(chunk[offset + n * w : offset + 2 * n * w])
        offset += 2 * n * w
    return b"".join(parts)


def test_a_zero_made_while_idle_is_sent_once_and_never_again():
    """Over rounds of calls and waits (the same values every call, so a reused zero would send
    the same c1 twice), every chunk's c1 is new, and every zero made (while idle, or afresh in
    the first call) is used by exactly one chunk."""
    parties, _, _ = _roles()
    party = parties["a"]
    public = party.public
    assert public.wire_format == "raw"
    slots = public.slots
    made: list[bytes] = []
    zero = public._codec.zero

    def recording_zero(encryptor):
        ct = zero(encryptor)
        made.append(_c1(public, public._codec.dump(ct, slots)))
        return ct

    public._codec.zero = recording_zero
    x = np.linspace(-3.0, 3.0, 2 * slots + 7)  # three chunks a call
    sent: list[bytes] = []
    for rnd in range(6):
        arrays = party.protect(x, round=rnd, group=["a", "b"], key="h")
        sent += [_c1(public, arrays[f"h/{i}"].tobytes()) for i in range(3)]
        party.idle()
    # the first call's 3 afresh, 5 rounds' worth made while idle, the last round's 3 ready
    assert len(made) == 7 * 3
    assert public.ready_zeros == 3
    assert len(set(sent)) == len(sent) == 18  # no c1 sent twice
    used = [c for c in sent if c in set(made)]
    assert len(used) == 18 and len(set(used)) == 18  # each used zero exactly once
    ready = {_c1(public, public._codec.dump(z, slots)) for z in public._zeros}
    assert set(made) - set(used) == ready


def test_process_mode_takes_zeros_from_the_helper_and_sums_stay_exact(monkeypatch):
    _normal_priority_helper(monkeypatch)
    parties, agg, active = _roles("process")
    try:
        for party in parties.values():
            assert party.zeros == "process" and party.source is None  # no helper in process
            party.protect(np.ones(3), round=0, group=["a", "b"], key="h")  # encrypted afresh
            party.idle()  # a party's loop waits between calls: now a helper makes the zeros
            assert party.source is not None and party.source.alive
        rng = np.random.default_rng(1)
        deadline = time.monotonic() + 120
        while parties["a"].source.taken < 2 and time.monotonic() < deadline:
            xs = {n: rng.normal(size=(7,)) for n in parties}
            got = _sum(parties, agg, active, xs, 0)
            np.testing.assert_allclose(got, xs["a"] + xs["b"], atol=2e-3)
            for party in parties.values():
                party.idle()  # makes nothing in process mode
                assert party.public.ready_zeros == 0
            time.sleep(0.05)
        assert parties["a"].source.taken >= 2  # calls used the helper's zeros
    finally:
        for party in parties.values():
            party.close()
    assert not parties["a"].source.alive


def _no_helper(monkeypatch) -> None:
    """No helper process can be started here."""
    import crypto.ckks_zeros

    def refuse(*args, **kwargs):
        raise crypto.ckks_zeros.CkksError("no helper here")

    monkeypatch.setattr(crypto.ckks_zeros, "ZeroSource", refuse)


def test_process_mode_falls_back_to_a_worker_thread_without_a_helper(monkeypatch):
    _no_helper(monkeypatch)
    parties, _, _ = _roles("process")
    party = parties["a"]
    party.idle()
    assert party.zeros == "thread" and party.source is None
    party.protect(np.ones(5), round=0, group=["a", "b"], key="h")
    party._join()
    assert party.public.ready_zeros == 1


def test_idle_mode_waits_only_as_long_as_configured(monkeypatch):
    """The default idle mode makes its zeros at once after the send (no delay); a configured
    delay ($SECUREVFL_CKKS_PREP_DELAY) is slept first."""
    assert secure_sum.CKKS_IDLE_DELAY_S == 0.0
    slept: list[float] = []
    monkeypatch.setattr(secure_sum.time, "sleep", slept.append)
    parties, _, _ = _roles()
    party = parties["a"]
    party.protect(np.ones(5), round=0, group=["a", "b"], key="h")
    party.idle()
    assert slept == [] and party.public.ready_zeros == 1
    monkeypatch.setattr(secure_sum, "CKKS_IDLE_DELAY_S", 0.25)
    party.protect(np.ones(5), round=1, group=["a", "b"], key="h")
    party.idle()
    assert slept == [0.25] and party.public.ready_zeros == 1


def test_a_contribution_a_sum_could_not_decrypt_is_refused_by_its_party():
    """Sized for values up to 2^10 from 3 contributors: values up to 2^magnitude_bits / group
    size pass (and sum correctly even when every contributor is at that limit); a larger one
    stops the run with the value, the limit and the fix, before anything is encrypted,
    because CKKS would decrypt such a sum to wrong numbers rather than fail."""
    parties, agg, active = _roles()
    limit = 2.0 ** parties["a"].public.params.magnitude_bits / 2
    assert limit >= 2.0**10
    xs = {"a": np.full(7, limit), "b": np.full(7, limit * 0.999)}
    got = _sum(parties, agg, active, xs, 0)
    np.testing.assert_allclose(got, xs["a"] + xs["b"], atol=2e-3)
    with pytest.raises(ValueError, match=r"'h' is 2050, beyond 2048.*\[secure\] ckks\.magnitude"):
        parties["a"].protect(np.array([1.0, -limit * 1.001]), round=1, group=["a", "b"], key="h")
    assert parties["a"]._used == 1  # the refused call encrypted nothing


def test_the_session_names_the_default_mode_and_the_environment_overrides_it(monkeypatch):
    """A party in a process of its own asks for ``helper`` through its SumSession; in-process
    parties ask for nothing and get ``idle``; $SECUREVFL_CKKS_ZEROS wins over both."""
    ctx = CkksKeyHolder(
        params=choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
    ).public_context_bytes()

    def session(zeros):
        return SumSession(name="a", session=b"s" * 16, ckks_public_context=ctx, ckks_zeros=zeros)

    monkeypatch.delenv("SECUREVFL_CKKS_ZEROS", raising=False)
    assert CkksParty(session(None)).zeros == "idle"
    assert CkksParty(session(secure_sum.PROCESS_ZERO_MODE)).zeros == "helper"
    monkeypatch.setenv("SECUREVFL_CKKS_ZEROS", "fresh")
    assert CkksParty(session("helper")).zeros == "fresh"


def _normal_priority_helper(monkeypatch):
    import functools

    import crypto.ckks_zeros

    # at normal priority: the test does not wait for idle CPU (the priority has its own test)
    helper = functools.partial(crypto.ckks_zeros.ZeroSource, nice=0, idle_policy=False)
    monkeypatch.setattr(crypto.ckks_zeros, "ZeroSource", helper)


def test_helper_mode_takes_the_helpers_zeros_first_makes_the_rest_and_uses_each_once(
    monkeypatch,
):
    """``helper``: each wait moves what the helper's pipe holds into the ready zeros and makes
    only the rest itself; over rounds every chunk's c1 is new (no zero used twice, whichever
    made it), sums stay exact, and the party's statistics count the helper's zeros."""
    _normal_priority_helper(monkeypatch)
    parties, agg, active = _roles("helper")
    party = parties["a"]
    public = party.public
    slots = public.slots
    made_here = 0
    zero = public._codec.zero

    def counting_zero(encryptor):
        nonlocal made_here
        made_here += 1
        return zero(encryptor)

    public._codec.zero = counting_zero
    try:
        assert party.source is None  # started by the first wait
        party.idle()
        assert party.source is not None and party.source.alive
        rng = np.random.default_rng(2)
        deadline = time.monotonic() + 120
        rnd = 0
        while party.source.taken < 4 and time.monotonic() < deadline:
            xs = {n: rng.normal(size=(2 * slots,)) for n in parties}  # two chunks a call
            before = public.ready_zeros
            assert before in (0, 2)
            accepted = {
                n: agg.accept(
                    parties[n].protect(xs[n], round=rnd, group=["a", "b"], key="h"),
                    key="h",
                    sender=n,
                )
                for n in ("a", "b")
            }
            combined = agg.combine_accepted(accepted, group=["a", "b"], key="h")
            got = active.reveal(combined, group=["a", "b"], key="h", shape=(2 * slots,))
            np.testing.assert_allclose(got, xs["a"] + xs["b"], atol=2e-3)
            taken, made = party.source.taken, made_here
            for p in parties.values():
                p.idle()
            # the wait topped the ready zeros up to the two a call uses: the helper's first
            assert public.ready_zeros == 2
            assert (party.source.taken - taken) + (made_here - made) == 2
            rnd += 1
            time.sleep(0.05)
        assert party.source.taken >= 4  # calls used the helper's zeros
        stats = party.stats()
        assert stats == {"ckks_zeros": "helper", "ckks_zeros_from_helper": party.source.taken}
    finally:
        for p in parties.values():
            p.close()
    assert not party.source.alive


def test_every_chunk_in_helper_mode_carries_a_new_zero(monkeypatch):
    """Whether a chunk's zero came from the helper's pipe or from the party's own wait, no c1
    is sent twice (the same values every call, so a reused zero would repeat its c1)."""
    _normal_priority_helper(monkeypatch)
    parties, _, _ = _roles("helper")
    party = parties["a"]
    public = party.public
    slots = public.slots
    x = np.linspace(-3.0, 3.0, 2 * slots + 7)  # three chunks a call
    sent: list[bytes] = []
    try:
        party.idle()
        deadline = time.monotonic() + 120
        rnd = 0
        while (party.source.taken < 3 or rnd < 6) and time.monotonic() < deadline:
            arrays = party.protect(x, round=rnd, group=["a", "b"], key="h")
            sent += [_c1(public, arrays[f"h/{i}"].tobytes()) for i in range(3)]
            party.idle()
            rnd += 1
            time.sleep(0.05)
        assert party.source.taken >= 3
        assert len(set(sent)) == len(sent) == 3 * rnd
    finally:
        party.close()


def test_helper_mode_falls_back_to_the_partys_own_wait_without_a_helper(monkeypatch):
    _no_helper(monkeypatch)
    parties, _, _ = _roles("helper")
    party = parties["a"]
    party.protect(np.ones(5), round=0, group=["a", "b"], key="h")
    party.idle()
    assert party.zeros == "idle" and party.source is None
    assert party.public.ready_zeros == 1  # made by the wait itself
    assert party.stats() == {"ckks_zeros": "idle", "ckks_zeros_from_helper": 0}


def test_a_helper_started_early_is_the_one_the_party_attaches(monkeypatch):
    """`start_zero_helper` starts the helper before the context is known (only where the mode
    uses one); the party's first wait gives it the context instead of starting another."""
    monkeypatch.delenv("SECUREVFL_CKKS_ZEROS", raising=False)
    assert secure_sum.start_zero_helper(None) is None  # idle: no helper
    assert secure_sum.start_zero_helper("idle") is None
    helper = secure_sum.start_zero_helper("helper")
    try:
        assert helper is not None and helper.alive and not helper.attached
        ctx = CkksKeyHolder(
            params=choose_params(precision_bits=12, magnitude=2.0**10, terms=3).params
        ).public_context_bytes()
        party = CkksParty(
            SumSession(
                name="a",
                session=b"s" * 16,
                ckks_public_context=ctx,
                ckks_zeros="helper",
                ckks_zero_helper=helper,
            )
        )
        party.idle()
        assert party.source is helper and helper.attached
        party.close()
        assert not helper.alive
    finally:
        helper.close()
    monkeypatch.setenv("SECUREVFL_CKKS_ZEROS", "fresh")  # the environment overrides
    assert secure_sum.start_zero_helper("helper") is None


def test_the_key_holder_draws_the_next_releases_noise_while_it_waits_and_uses_it_once(
    monkeypatch,
):
    # `waiting` (called before the active party blocks on a result) draws the flooding noise of
    # a reveal the size of the last one; that reveal takes it, and it is never used again
    import crypto.ckks as ckks

    parties, agg, active = _roles()
    rng = np.random.default_rng(3)
    xs = {n: rng.normal(size=(300,)) for n in parties}
    active.waiting()  # nothing revealed yet: no size to draw for
    assert active._normals is None
    first = _sum(parties, agg, active, xs, 0)
    drawn: list[np.ndarray] = []
    real = ckks.csprng_normal

    def recording(shape):
        drawn.append(real(shape))
        return drawn[-1]

    monkeypatch.setattr(ckks, "csprng_normal", recording)
    active.waiting()
    assert len(drawn) == 1 and drawn[0].shape == (300,) and active._normals is drawn[0]
    active.waiting()  # already drawn: not drawn twice
    assert len(drawn) == 1
    second = _sum(parties, agg, active, xs, 1)
    assert active._normals is None and len(drawn) == 1  # the reveal used the one drawn ahead
    std = active.s.ckks_release.flood_std(active.key_holder.params, terms=2)
    grid = 2.0**-12
    exact = xs["a"] + xs["b"]
    # the release is exactly the sum plus std * those normals, rounded (the CKKS error aside)
    assert np.max(np.abs(second - (exact + std * drawn[0]))) < 1e-3 + grid
    assert np.max(np.abs(first - exact)) < 2e-3 and not np.array_equal(first, second)
    # a reveal of another size draws its own noise; the one made ahead goes unused, dropped
    active.waiting()
    other = {n: rng.normal(size=(7,)) for n in parties}
    np.testing.assert_allclose(
        _sum(parties, agg, active, other, 2), other["a"] + other["b"], atol=2e-3
    )
    assert len(drawn) == 3 and active._normals is None
