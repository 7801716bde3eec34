"""The pairwise-masked sum: cancellation, uniformity, domain separation, refusals."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

from crypto import (
    FixedPointEncoder,
    MaskDomain,
    MaskedSumAggregator,
    MaskedSumParty,
    MaskingKeyPair,
    MissingContributorError,
    SumDidNotCancel,
    decode_sum,
    keystream_uint64,
)

ROSTER = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
FRAC_BITS = 20
BOUND = 1000.0


def deterministic_keypair(name: str) -> MaskingKeyPair:
    """A fixed key per name, so the statistical tests are reproducible (never flaky)."""
    private = hashlib.sha256(b"test-masking-key/" + name.encode()).digest()
    public = X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()
    return MaskingKeyPair(private=private, public=public)


KEYS = {name: deterministic_keypair(name) for name in ROSTER}
PUBLICS = {name: keypair.public for name, keypair in KEYS.items()}


def make_encoder() -> FixedPointEncoder:
    return FixedPointEncoder(frac_bits=FRAC_BITS, bound=BOUND)


def make_parties(
    names: Sequence[str] = ROSTER, *, session: bytes = b"session-1"
) -> dict[str, MaskedSumParty]:
    encoder = make_encoder()
    return {
        name: MaskedSumParty(
            name=name, keypair=KEYS[name], peer_publics=PUBLICS, session=session, encoder=encoder
        )
        for name in names
    }


def masked_sum(
    parties: dict[str, MaskedSumParty],
    inputs: dict[str, np.ndarray],
    *,
    round: int = 0,
    tensor: str = "h",
) -> np.ndarray:
    group = list(inputs)
    contributions = {
        name: parties[name].mask(x, round=round, group=group, tensor=tensor)
        for name, x in inputs.items()
    }
    total = MaskedSumAggregator.add(contributions, group=group)
    return decode_sum(total, encoder=make_encoder(), terms=len(group))


# --- statistics that tell a uniform ring element from a structured one -----------------------


def byte_frequency_p_value(words: np.ndarray) -> float:
    """Chi-square test that all 256 byte values are equally frequent."""
    counts = np.bincount(words.view(np.uint8), minlength=256)
    expected = counts.sum() / 256
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(statistic, df=255))


def worst_bit_imbalance_z(words: np.ndarray) -> float:
    """The largest |z| over the 64 bit positions of the fraction of ones (0.5 if uniform)."""
    bits = np.unpackbits(words.view(np.uint8)).reshape(-1, 64)
    n = bits.shape[0]
    ones = bits.sum(axis=0, dtype=np.float64)
    return float(np.max(np.abs(ones - n / 2) / np.sqrt(n / 4)))


def looks_uniform(words: np.ndarray) -> bool:
    # 64 bit positions at |z| < 5 is a family-wise false-alarm rate near 4e-5.
    return byte_frequency_p_value(words) > 1e-4 and worst_bit_imbalance_z(words) < 5.0


# --- correctness -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    group=st.lists(st.sampled_from(ROSTER), min_size=2, max_size=8, unique=True),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    session=st.binary(min_size=1, max_size=16),
    round_=st.integers(min_value=0, max_value=2**64 - 1),
    tensor=st.text(min_size=1, max_size=8),
    data=st.data(),
)
def test_decoded_masked_sum_equals_the_plain_sum(
    group: list[str], shape: tuple[int, ...], session: bytes, round_: int, tensor: str, data
) -> None:
    elements = st.floats(-BOUND, BOUND, allow_nan=False)
    inputs = {name: data.draw(hnp.arrays(np.float64, shape, elements=elements)) for name in group}
    parties = make_parties(group, session=session)
    decoded = masked_sum(parties, inputs, round=round_, tensor=tensor)
    expected = np.sum(np.stack(list(inputs.values())), axis=0)
    assert decoded.shape == shape
    assert np.all(np.abs(decoded - expected) <= len(group) * 2.0**-FRAC_BITS)


def test_float32_inputs_sum_correctly_across_chunk_boundaries() -> None:
    rng = np.random.default_rng(1)
    inputs = {name: rng.uniform(-BOUND, BOUND, 70_001).astype(np.float32) for name in ROSTER[:4]}
    decoded = masked_sum(make_parties(ROSTER[:4]), inputs)
    expected = np.sum([x.astype(np.float64) for x in inputs.values()], axis=0)
    np.testing.assert_allclose(decoded, expected, atol=4 * 2.0**-FRAC_BITS, rtol=0)


def test_the_same_party_keys_cancel_over_every_group() -> None:
    parties = make_parties(ROSTER[:6])
    rng = np.random.default_rng(2)
    values = {name: rng.uniform(-BOUND, BOUND, 50) for name in ROSTER[:6]}
    groups = [ROSTER[:6], ROSTER[:2], ROSTER[1:4], ("alice", "frank"), ROSTER[2:6], ROSTER[:5]]
    for round_, group in enumerate(groups):
        # Same round for the first two groups: the group alone separates their masks.
        decoded = masked_sum(parties, {name: values[name] for name in group}, round=round_ // 2)
        expected = np.sum([values[name] for name in group], axis=0)
        np.testing.assert_allclose(decoded, expected, atol=len(group) * 2.0**-FRAC_BITS, rtol=0)


def test_masked_values_in_the_ring_wrap_without_warnings() -> None:
    with np.errstate(all="raise"):
        inputs = {name: np.full(1000, -BOUND) for name in ROSTER[:3]}
        np.testing.assert_array_equal(masked_sum(make_parties(ROSTER[:3]), inputs), -3 * BOUND)


# --- what the aggregator sees ------------------------------------------------------------------


def test_the_uniformity_statistics_discriminate() -> None:
    encoder = make_encoder()
    keystream = keystream_uint64(hashlib.sha256(b"ks").digest()[:16], 8192)
    assert looks_uniform(keystream)
    encoded_zeros = encoder.encode(np.zeros(8192))
    assert not looks_uniform(encoded_zeros)
    small = encoder.encode(np.random.default_rng(3).normal(scale=0.01, size=8192))
    assert not looks_uniform(small)
    low_16_bits_masked = small + (keystream & np.uint64(0xFFFF))
    assert not looks_uniform(low_16_bits_masked)
    all_but_top_bit_masked = small + (keystream >> np.uint64(1))
    assert not looks_uniform(all_but_top_bit_masked)


@pytest.mark.parametrize("sender", ["alice", "bob", "carol", "dave"])
def test_one_masked_contribution_looks_uniform(sender: str) -> None:
    parties = make_parties(ROSTER[:4])
    group = ROSTER[:4]
    zeros = parties[sender].mask(np.zeros(8192), round=0, group=group, tensor="zeros")
    assert looks_uniform(zeros)
    small = np.random.default_rng(4).normal(scale=0.01, size=8192)
    assert looks_uniform(parties[sender].mask(small, round=0, group=group, tensor="small"))


def test_a_two_party_contribution_is_masked_too() -> None:
    parties = make_parties(("alice", "bob"))
    for name in ("alice", "bob"):
        masked = parties[name].mask(np.zeros(8192), round=0, group=("alice", "bob"), tensor="t")
        assert looks_uniform(masked)


# --- domain separation -------------------------------------------------------------------------


def test_masks_are_deterministic_for_the_same_domain() -> None:
    x = np.linspace(-1, 1, 100)
    first = make_parties(ROSTER[:3])["alice"].mask(x, round=7, group=ROSTER[:3], tensor="h")
    again = make_parties(ROSTER[:3])["alice"].mask(x, round=7, group=ROSTER[:3], tensor="h")
    np.testing.assert_array_equal(first, again)


def test_masks_differ_across_rounds_groups_tensors_and_sessions() -> None:
    x = np.linspace(-1, 1, 100)
    alice = make_parties(("alice",))["alice"]
    base = {"round": 1, "group": ROSTER[:3], "tensor": "h"}
    variants = [
        base,
        {**base, "round": 2},
        {**base, "group": ROSTER[:4]},
        {**base, "group": ("alice", "bob")},
        {**base, "tensor": "h2"},
    ]
    outputs = [alice.mask(x, **variant).tobytes() for variant in variants]
    other_session = make_parties(("alice",), session=b"session-2")["alice"]
    outputs.append(other_session.mask(x, **base).tobytes())
    assert len(set(outputs)) == len(outputs)


def test_group_order_does_not_change_the_domain() -> None:
    x = np.ones(10)
    forward = make_parties(("alice",))["alice"].mask(
        x, round=0, group=["alice", "bob", "carol"], tensor="h"
    )
    shuffled = make_parties(("alice",))["alice"].mask(
        x, round=0, group=["carol", "alice", "bob"], tensor="h"
    )
    np.testing.assert_array_equal(forward, shuffled)


def test_masking_twice_under_one_domain_is_refused() -> None:
    alice = make_parties(("alice",))["alice"]
    alice.mask(np.zeros(4), round=0, group=("alice", "bob"), tensor="h")
    with pytest.raises(ValueError, match="reuse the keystream"):
        alice.mask(np.ones(4), round=0, group=("bob", "alice"), tensor="h")


def test_a_refused_input_does_not_use_up_its_domain() -> None:
    alice = make_parties(("alice",))["alice"]
    with pytest.raises(ValueError, match="NaN"):
        alice.mask(np.array([np.nan]), round=0, group=("alice", "bob"), tensor="h")
    alice.mask(np.zeros(1), round=0, group=("alice", "bob"), tensor="h")


def test_mask_domain_encoding_is_unambiguous() -> None:
    def encoded(**fields) -> bytes:
        base = {"session": b"s", "round": 0, "group": ("ab", "c"), "tensor": "t"}
        return MaskDomain(**{**base, **fields}).encode()

    assert encoded().startswith(b"securevfl/mask-domain/v1")
    assert encoded() != encoded(group=("a", "bc"))
    assert encoded() != encoded(group=("abc",))
    assert encoded() == encoded(group=("c", "ab"))
    assert encoded(session=b"s1", tensor="t") != encoded(session=b"s", tensor="1t")
    with pytest.raises(ValueError, match="round"):
        encoded(round=-1)
    with pytest.raises(ValueError, match="more than once"):
        encoded(group=("a", "a"))


# --- missing and unexpected contributors -------------------------------------------------------


def _contributions(group: Sequence[str]) -> dict[str, np.ndarray]:
    parties = make_parties(group)
    return {
        name: parties[name].mask(np.full(16, 1.5), round=0, group=group, tensor="h")
        for name in group
    }


def test_add_names_a_missing_contributor() -> None:
    group = ROSTER[:4]
    contributions = _contributions(group)
    del contributions["carol"]
    with pytest.raises(MissingContributorError, match="missing contributions from \\['carol'\\]"):
        MaskedSumAggregator.add(contributions, group=group)


def test_add_names_an_unexpected_contributor() -> None:
    contributions = _contributions(ROSTER[:4])
    with pytest.raises(MissingContributorError) as err:
        MaskedSumAggregator.add(contributions, group=ROSTER[:3])
    assert err.value.unexpected == ("dave",)
    assert err.value.missing == ()
    assert "'dave'" in str(err.value)


@pytest.mark.parametrize("terms", [3, 4])
def test_a_sum_that_bypasses_add_and_misses_someone_does_not_decode(terms: int) -> None:
    group = ROSTER[:4]
    contributions = _contributions(group)
    partial = np.zeros(16, dtype=np.uint64)
    for name in group[:3]:
        np.add(partial, contributions[name], out=partial)
    with pytest.raises(SumDidNotCancel, match="did not cancel"):
        decode_sum(partial, encoder=make_encoder(), terms=terms)


def test_add_refuses_wrong_dtypes_and_shapes_naming_the_sender() -> None:
    group = ROSTER[:3]
    contributions = _contributions(group)
    with pytest.raises(ValueError, match="from 'bob' is not a uint64"):
        MaskedSumAggregator.add(
            {**contributions, "bob": contributions["bob"].view(np.int64)}, group=group
        )
    with pytest.raises(ValueError, match="from 'carol' has shape \\(8,\\)"):
        MaskedSumAggregator.add({**contributions, "carol": contributions["carol"][:8]}, group=group)
    with pytest.raises(ValueError, match="more than once"):
        MaskedSumAggregator.add(contributions, group=[*group, "alice"])
    with pytest.raises(ValueError, match="at least 2"):
        MaskedSumAggregator.add({"alice": contributions["alice"]}, group=["alice"])


def test_add_does_not_modify_the_contributions() -> None:
    group = ROSTER[:3]
    contributions = _contributions(group)
    before = {name: c.copy() for name, c in contributions.items()}
    MaskedSumAggregator.add(contributions, group=group)
    for name in group:
        np.testing.assert_array_equal(contributions[name], before[name])


# --- party refusals ----------------------------------------------------------------------------


def test_party_refuses_groups_it_cannot_mask_for() -> None:
    alice = make_parties(("alice",))["alice"]
    x = np.zeros(3)
    with pytest.raises(ValueError, match="'alice' is not in the group"):
        alice.mask(x, round=0, group=["bob", "carol"], tensor="h")
    with pytest.raises(ValueError, match="no pinned masking public key .*'zed'"):
        alice.mask(x, round=0, group=["alice", "zed"], tensor="h")
    with pytest.raises(ValueError, match="more than once: \\['bob'\\]"):
        alice.mask(x, round=0, group=["alice", "bob", "bob"], tensor="h")
    with pytest.raises(ValueError, match="at least 2 contributors.*value itself"):
        alice.mask(x, round=0, group=["alice"], tensor="h")
    with pytest.raises(TypeError, match="not a single string"):
        alice.mask(x, round=0, group="alice", tensor="h")


def test_party_refuses_a_group_larger_than_the_ring_can_sum() -> None:
    tight = FixedPointEncoder(frac_bits=20, bound=2.0**41)  # max_terms == 3
    alice = MaskedSumParty(
        name="alice", keypair=KEYS["alice"], peer_publics=PUBLICS, session=b"s", encoder=tight
    )
    with pytest.raises(ValueError, match="exceed the 64-bit ring"):
        alice.mask(np.zeros(2), round=0, group=ROSTER[:4], tensor="h")


def test_party_refuses_a_pinned_self_key_that_is_not_its_own() -> None:
    with pytest.raises(ValueError, match="wrong key pair"):
        MaskedSumParty(
            name="alice",
            keypair=KEYS["bob"],
            peer_publics=PUBLICS,
            session=b"s",
            encoder=make_encoder(),
        )


def test_the_replay_guard_stays_bounded_over_many_rounds_and_refuses_rounds_it_forgot() -> None:
    """A long run masks one call per round for 10^4+ rounds: the guard keeps only the last
    REPLAY_WINDOW rounds (bounded memory), and a round older than that is refused outright,
    so forgetting it can never let a keystream be reused."""
    from crypto.masking import REPLAY_WINDOW

    alice = make_parties(["alice", "bob"])["alice"]
    x = np.zeros(2, dtype=np.float32)
    last = 3 * REPLAY_WINDOW + 5
    for r in range(last + 1):
        alice.mask(x, round=r, group=["alice", "bob"], tensor="h")
    kept = sum(len(v) for v in alice._used[b"session-1"].values())
    assert kept <= 2 * REPLAY_WINDOW  # bounded, not one digest per round of the run
    with pytest.raises(ValueError, match="reuse the keystream"):  # a recent round: remembered
        alice.mask(x, round=last - 1, group=["alice", "bob"], tensor="h")
    with pytest.raises(ValueError, match="tracks only the last"):  # a forgotten round: refused
        alice.mask(x, round=0, group=["alice", "bob"], tensor="h")
    # another tensor of a recent round is still fine (a different domain)
    alice.mask(x, round=last, group=["alice", "bob"], tensor="g")
