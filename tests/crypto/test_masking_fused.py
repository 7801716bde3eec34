"""The fused masking path against the unfused version-1 algorithm (crypto.reference), bit for bit.

Covers: the fixed-point fast path (rounding ties, clipping, integer inputs, the generic path for
huge bounds), chunk boundaries, threads, prepared masks, multi-tensor calls (one keystream per
pair split by offsets) and their domain separation, and refusals that must leave nothing behind.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from crypto import (
    FixedPointEncoder,
    FixedPointOverflow,
    MaskedSumAggregator,
    MaskedSumParty,
    MaskingKeyPair,
    SumDidNotCancel,
    decode_sum,
    keystream_uint64,
    mask_key,
    stream_nonce,
)
from crypto.masking import MASK_CHUNK_WORDS, MAX_PREPARED, MaskCallDomain, MaskDomain
from crypto.prg import Keystream
from crypto.reference import reference_encode, reference_mask

ROSTER = ("alice", "bob", "carol", "dave", "erin", "frank")
C = MASK_CHUNK_WORDS


def keypair(name: str) -> MaskingKeyPair:
    private = hashlib.sha256(b"test-fused-key/" + name.encode()).digest()
    public = X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()
    return MaskingKeyPair(private=private, public=public)


KEYS = {name: keypair(name) for name in ROSTER}
PUBLICS = {name: pair.public for name, pair in KEYS.items()}


def party(
    name: str,
    encoder: FixedPointEncoder | None = None,
    *,
    session: bytes = b"fused",
    threads: int = 1,
) -> MaskedSumParty:
    return MaskedSumParty(
        name=name,
        keypair=KEYS[name],
        peer_publics=PUBLICS,
        session=session,
        encoder=encoder or FixedPointEncoder(),
        threads=threads,
    )


def reference(p: MaskedSumParty, x: np.ndarray, *, round: int, group, tensor: str) -> np.ndarray:
    pair_keys = {peer: p._pair_key(peer) for peer in group if peer != p.name}
    domain = MaskDomain(session=p.session, round=round, group=tuple(group), tensor=tensor)
    return reference_mask(x, encoder=p.encoder, name=p.name, pair_keys=pair_keys, domain=domain)


def reference_call(
    p: MaskedSumParty, xs: dict[str, np.ndarray], *, round: int, group
) -> dict[str, np.ndarray]:
    """The multi-tensor scheme written plainly: encode each tensor, concatenate in name order,
    add/subtract each pair's keystream of the call domain over the whole concatenation."""
    names = sorted(xs)
    domain = MaskCallDomain(
        session=p.session,
        round=round,
        group=tuple(group),
        tensors=tuple((name, xs[name].size) for name in names),
    )
    flat = np.concatenate(
        [reference_encode(p.encoder, xs[name]).reshape(-1) for name in names]
    ).astype(np.uint64)
    for peer in domain.group:
        if peer == p.name:
            continue
        key = mask_key(p._pair_key(peer))
        stream = keystream_uint64(key, flat.size, nonce=stream_nonce(domain.encode()))
        flat = flat + stream if p.name < peer else flat - stream
    offsets = [0, *itertools.accumulate(xs[name].size for name in names)]
    return {
        name: flat[offsets[i] : offsets[i + 1]].reshape(xs[name].shape)
        for i, name in enumerate(names)
    }


ENCODERS = [
    FixedPointEncoder(),
    FixedPointEncoder(frac_bits=16, bound=1000.0),
    FixedPointEncoder(frac_bits=30, bound=3.5, on_overflow="clip"),
    FixedPointEncoder(frac_bits=0, bound=2.0**40),
    # 2**(10 + 45) ulps: beyond the one-addition fast path, the generic path encodes
    FixedPointEncoder(frac_bits=10, bound=2.0**45, on_overflow="clip"),
]


def floats_of(dtype, limit: float) -> st.SearchStrategy[float]:
    """Finite floats of ``dtype`` within about ``limit`` (rounded to the dtype), with the
    dtype's values next to ``limit`` and to the bounds of ENCODERS drawn often."""
    bits = np.finfo(dtype).bits
    edge = float(np.asarray(limit).astype(dtype))
    near = [float(np.asarray(e.bound).astype(dtype)) for e in ENCODERS if e.bound <= limit]
    near += [float(np.nextafter(np.asarray(v, dtype), np.asarray(np.inf, dtype))) for v in near]
    near = [v for v in near if abs(v) <= edge]
    return st.one_of(
        st.floats(-edge, edge, width=bits, allow_nan=False),
        st.sampled_from(near + [-v for v in near]) if near else st.nothing(),
    )


# --- the fixed-point fast path -----------------------------------------------------------------


def test_encoders_cover_both_paths() -> None:
    assert [bool(e.shift) for e in ENCODERS] == [True, True, True, True, False]


@settings(max_examples=60, deadline=None)
@given(
    encoder=st.sampled_from(ENCODERS),
    dtype=st.sampled_from([np.float64, np.float32, np.float16, np.int64, np.int32, np.uint16]),
    data=st.data(),
)
def test_encode_is_bit_identical_to_the_reference(encoder, dtype, data) -> None:
    limit = min(encoder.bound * 1.5, 6e4 if dtype == np.float16 else 1e300)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        elements = st.integers(max(int(info.min), -int(limit)), min(int(info.max), int(limit)))
    else:
        elements = floats_of(dtype, limit)
    x = data.draw(hnp.arrays(dtype, hnp.array_shapes(min_dims=0, max_side=40), elements=elements))
    try:
        expected = reference_encode(encoder, x)
    except FixedPointOverflow:
        with pytest.raises(FixedPointOverflow):
            encoder.encode(x)
        return
    got = encoder.encode(x)
    assert got.dtype == np.uint64 and got.shape == x.shape
    assert got.tobytes() == expected.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    frac_bits=st.integers(0, 40),
    halves=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=50),
)
def test_rounding_ties_go_to_even_like_rint(frac_bits: int, halves: list[int]) -> None:
    # m / 2**(f + 1): every odd m is exactly halfway between two representable values
    x = np.array(halves, dtype=np.float64) / 2.0 ** (frac_bits + 1)
    bound = max(float(np.max(np.abs(x))), 1.0)
    encoder = FixedPointEncoder(frac_bits=frac_bits, bound=bound)
    assert encoder.encode(x).tobytes() == reference_encode(encoder, x).tobytes()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0**20 + 1])
def test_encode_refuses_like_the_reference(bad: float) -> None:
    encoder = FixedPointEncoder()
    x = np.zeros(3 * C)
    x[2 * C + 5] = bad
    with pytest.raises(FixedPointOverflow):
        reference_encode(encoder, x)
    with pytest.raises(FixedPointOverflow, match="NaN or inf" if bad != 2.0**20 + 1 else "bound"):
        encoder.encode(x)


# --- mask(): bit-identical on every path -------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    group=st.lists(st.sampled_from(ROSTER), min_size=2, max_size=6, unique=True),
    who=st.integers(0, 5),
    encoder=st.sampled_from(ENCODERS[:3] + ENCODERS[4:]),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9),
    round_=st.integers(0, 2**64 - 1),
    tensor=st.text(min_size=1, max_size=6),
    dtype=st.sampled_from([np.float64, np.float32]),
    data=st.data(),
)
def test_mask_is_bit_identical_to_the_reference(
    group, who, encoder, shape, round_, tensor, dtype, data
) -> None:
    name = group[who % len(group)]
    bound = encoder.bound * (1.2 if encoder.on_overflow == "clip" else 1.0)
    x = data.draw(hnp.arrays(dtype, shape, elements=floats_of(dtype, bound)))
    p = party(name, encoder)
    expected = reference(p, x, round=round_, group=group, tensor=tensor)
    got = p.mask(x, round=round_, group=group, tensor=tensor)
    assert got.dtype == np.uint64 and got.shape == x.shape
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("size", [C - 1, C, C + 1, 2 * C + 3, 5 * C + 1])
def test_chunk_boundaries_and_threads_are_bit_identical(size: int, threads: int) -> None:
    x = np.random.default_rng(size).uniform(-100, 100, size)
    group = ROSTER[:4]
    for name in ("alice", "dave"):  # first (adds only) and last (subtracts only) in order
        p = party(name, threads=threads)
        expected = reference(p, x, round=3, group=group, tensor="h")
        assert p.mask(x, round=3, group=group, tensor="h").tobytes() == expected.tobytes()
        p.close()


def test_mask_writes_into_out() -> None:
    p = party("bob")
    x = np.linspace(-5, 5, 600).reshape(20, 30)
    out = np.empty(600, dtype=np.uint64)
    got = p.mask(x, round=0, group=ROSTER[:3], tensor="h", out=out)
    assert got.shape == (20, 30) and np.shares_memory(got, out)
    assert got.tobytes() == reference(p, x, round=0, group=ROSTER[:3], tensor="h").tobytes()
    with pytest.raises(ValueError, match="C-contiguous uint64 array of 600"):
        p.mask(x, round=1, group=ROSTER[:3], tensor="h", out=np.empty(599, np.uint64))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_refused_input_leaves_no_masked_data_in_out(threads: int) -> None:
    p = party("bob", threads=threads)
    x = np.ones(3 * C)
    x[-1] = np.nan  # refused in the last chunk, after the first ones were masked
    out = np.full(3 * C, 7, dtype=np.uint64)
    with pytest.raises(FixedPointOverflow, match="NaN"):
        p.mask(x, round=0, group=ROSTER[:3], tensor="h", out=out)
    assert not out.any()
    x[-1] = 0.0  # the domain was not used up
    assert (
        p.mask(x, round=0, group=ROSTER[:3], tensor="h").tobytes()
        == reference(p, x, round=0, group=ROSTER[:3], tensor="h").tobytes()
    )


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="threads"):
        party("alice", threads=0)


# --- prepared masks ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["alice", "carol", "erin"])
def test_prepared_masks_give_the_same_bits(name: str) -> None:
    group = ("alice", "carol", "erin")
    x = np.random.default_rng(5).normal(size=(3, C + 11)).astype(np.float32)
    p = party(name)
    job = p.prepare(round=9, group=group, sizes={"h": x.size})
    job.result(timeout=60)
    got = p.mask(x, round=9, group=group, tensor="h")
    assert got.tobytes() == reference(p, x, round=9, group=group, tensor="h").tobytes()
    with pytest.raises(ValueError, match="reuse"):  # consuming prepared masks uses the domain
        p.mask(x, round=9, group=group, tensor="h")
    with pytest.raises(ValueError, match="reuse"):
        p.prepare(round=9, group=group, sizes={"h": x.size})
    p.close()


def test_masks_prepared_inline_are_ready_on_return_and_give_the_same_bits() -> None:
    group = ("alice", "carol", "erin")
    x = np.random.default_rng(6).normal(size=(2, C + 5))
    p = party("carol")
    job = p.prepare(round=4, group=group, sizes={"h": x.size}, inline=True)
    assert job.done() and p.pending == 1 and p._prefetch_pool is None  # no thread started
    got = p.mask(x, round=4, group=group, tensor="h")
    assert p.pending == 0
    assert got.tobytes() == reference(p, x, round=4, group=group, tensor="h").tobytes()
    with pytest.raises(ValueError, match="reuse"):
        p.prepare(round=4, group=group, sizes={"h": x.size}, inline=True)
    p.close()


def test_prepared_masks_for_another_size_or_round_are_ignored() -> None:
    group = ROSTER[:3]
    p = party("bob")
    p.prepare(round=1, group=group, sizes={"h": 10})
    p.prepare(round=2, group=group, sizes={"h": 10})
    x = np.arange(12.0)
    got = p.mask(x, round=1, group=group, tensor="h")  # size 12, prepared 10
    assert got.tobytes() == reference(p, x, round=1, group=group, tensor="h").tobytes()
    got = p.mask(x[:10], round=3, group=group, tensor="h")  # another round
    assert got.tobytes() == reference(p, x[:10], round=3, group=group, tensor="h").tobytes()
    got = p.mask(x[:10], round=2, group=group, tensor="h")
    assert got.tobytes() == reference(p, x[:10], round=2, group=group, tensor="h").tobytes()
    p.close()


@pytest.mark.parametrize("with_out", [False, True])
def test_a_refused_input_with_prepared_masks_leaves_a_correct_retry(with_out: bool) -> None:
    # Without `out` the prepared masks are the output buffer, consumed even by a refusal;
    # with `out` they are kept for the retry. Either way the retry gives the same bits.
    p = party("bob")
    group = ROSTER[:3]
    p.prepare(round=0, group=group, sizes={"h": 4}).result(timeout=60)
    out = np.empty(4, dtype=np.uint64) if with_out else None
    with pytest.raises(FixedPointOverflow):
        p.mask(np.array([0.0, np.inf, 1.0, 2.0]), round=0, group=group, tensor="h", out=out)
    assert len(p._prepared) == int(with_out)
    x = np.array([0.0, 3.0, 1.0, 2.0])
    assert (
        p.mask(x, round=0, group=group, tensor="h", out=out).tobytes()
        == reference(p, x, round=0, group=group, tensor="h").tobytes()
    )
    assert not p._prepared


def test_pending_preparations_are_bounded_and_close_drops_them() -> None:
    p = party("alice")
    for round_ in range(MAX_PREPARED):
        p.prepare(round=round_, group=ROSTER[:2], sizes={"h": 5})
    p.prepare(round=0, group=ROSTER[:2], sizes={"h": 5})  # the same preparation: no new one
    with pytest.raises(ValueError, match="already pending"):
        p.prepare(round=MAX_PREPARED, group=ROSTER[:2], sizes={"h": 5})
    p.close()
    p.prepare(round=MAX_PREPARED, group=ROSTER[:2], sizes={"h": 5})
    p.close()


def test_prepare_refuses_what_mask_refuses() -> None:
    p = party("alice")
    with pytest.raises(ValueError, match="not in the group"):
        p.prepare(round=0, group=["bob", "carol"], sizes={"h": 3})
    with pytest.raises(ValueError, match="non-negative"):
        p.prepare(round=0, group=ROSTER[:2], sizes={"h": -1})
    with pytest.raises(ValueError, match="at least one"):
        p.prepare(round=0, group=ROSTER[:2], sizes={})


# --- several tensors in one call ---------------------------------------------------------------


def test_one_tensor_in_mask_many_is_mask() -> None:
    x = np.linspace(-1, 1, 77)
    a = party("carol").mask_many({"h": x}, round=4, group=ROSTER[:4])["h"]
    b = party("carol").mask(x, round=4, group=ROSTER[:4], tensor="h")
    assert a.tobytes() == b.tobytes()


@settings(max_examples=30, deadline=None)
@given(
    group=st.lists(st.sampled_from(ROSTER), min_size=2, max_size=5, unique=True),
    shapes=st.dictionaries(
        st.text(min_size=1, max_size=4),
        hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=7),
        min_size=2,
        max_size=5,
    ),
    round_=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_mask_many_is_the_call_scheme_and_its_sums_decode(group, shapes, round_, data) -> None:
    encoder = FixedPointEncoder(frac_bits=20, bound=100.0)
    elements = st.floats(-100, 100, allow_nan=False)
    inputs = {
        name: {
            t: data.draw(hnp.arrays(np.float64, s, elements=elements)) for t, s in shapes.items()
        }
        for name in group
    }
    contributions = {}
    for name in group:
        p = party(name, encoder)
        got = p.mask_many(inputs[name], round=round_, group=group)
        expected = reference_call(p, inputs[name], round=round_, group=group)
        assert set(got) == set(shapes)
        for tensor in shapes:
            assert got[tensor].shape == inputs[name][tensor].shape
            assert got[tensor].tobytes() == expected[tensor].tobytes()
        contributions[name] = got
    for tensor in shapes:
        total = MaskedSumAggregator.add(
            {n: c[tensor] for n, c in contributions.items()}, group=group
        )
        decoded = decode_sum(total, encoder=encoder, terms=len(group))
        # bit-identical to the sum of the encodings: masks cancel exactly
        exact = sum(reference_encode(encoder, inputs[n][tensor]).view(np.int64) for n in group)
        plain = np.sum([inputs[n][tensor] for n in group], axis=0)
        assert np.all(np.abs(decoded - plain) <= len(group) * 2.0**-20)
        if np.size(exact):
            assert np.array_equal(decoded * 2.0**20, exact.astype(np.float64))


@pytest.mark.parametrize("threads", [1, 2])
def test_mask_many_across_chunk_boundaries_and_prepared(threads: int) -> None:
    rng = np.random.default_rng(7)
    xs = {"a": rng.normal(size=C - 3), "b": np.zeros(0), "c": rng.normal(size=(2, C)), "d": 1.5}
    xs = {k: np.asarray(v) for k, v in xs.items()}
    sizes = {k: v.size for k, v in xs.items()}
    p = party("bob", threads=threads)
    expected = reference_call(p, xs, round=1, group=ROSTER[:3])
    got = p.mask_many(xs, round=1, group=ROSTER[:3])
    assert all(got[k].tobytes() == expected[k].tobytes() for k in xs)
    p.prepare(round=2, group=ROSTER[:3], sizes=sizes).result(timeout=60)
    got = p.mask_many(xs, round=2, group=ROSTER[:3])
    expected = reference_call(p, xs, round=2, group=ROSTER[:3])
    assert all(got[k].tobytes() == expected[k].tobytes() for k in xs)
    p.close()


def test_mask_many_results_share_one_buffer_and_accept_out() -> None:
    xs = {"h": np.ones((4, 3)), "g": np.zeros(5)}
    out = np.empty(17, dtype=np.uint64)
    got = party("alice").mask_many(xs, round=0, group=ROSTER[:2], out=out)
    assert got["g"].shape == (5,) and got["h"].shape == (4, 3)
    assert np.shares_memory(got["g"], out) and np.shares_memory(got["h"], out)
    assert np.array_equal(out[:5], got["g"])  # "g" sorts first


def test_tensor_segments_are_separated() -> None:
    # The same values under two names of one call get unrelated masks, and the masks of a
    # tensor depend on the other tensors of the call (they are part of the key).
    x = np.zeros(64)
    p = party("alice")
    got = p.mask_many({"h": x, "g": x}, round=0, group=ROSTER[:2])
    assert got["h"].tobytes() != got["g"].tobytes()
    other = party("alice").mask_many({"h": x, "g": np.zeros(65)}, round=0, group=ROSTER[:2])
    assert other["h"].tobytes() != got["h"].tobytes()
    alone = party("alice").mask(x, round=0, group=ROSTER[:2], tensor="h")
    assert alone.tobytes() not in {got["h"].tobytes(), got["g"].tobytes()}


def test_masks_cancel_only_over_the_same_call() -> None:
    group = ROSTER[:3]
    encoder = FixedPointEncoder(frac_bits=20, bound=100.0)
    calls = {name: {"h": np.ones(8), "g": np.ones(3)} for name in group}
    calls["carol"] = {"h": np.ones(8), "g": np.ones(3), "extra": np.ones(1)}
    masked = {n: party(n, encoder).mask_many(xs, round=0, group=group) for n, xs in calls.items()}
    total = MaskedSumAggregator.add({n: m["h"] for n, m in masked.items()}, group=group)
    with pytest.raises(SumDidNotCancel):
        decode_sum(total, encoder=encoder, terms=3)


def test_mask_many_refusals_name_the_tensor_and_keep_the_domain() -> None:
    p = party("alice")
    xs = {"h": np.ones(5), "g": np.array([1.0, 2.0**21])}
    with pytest.raises(FixedPointOverflow, match="tensor 'g': max \\|value\\|"):
        p.mask_many(xs, round=0, group=ROSTER[:2])
    xs["g"] = np.ones(2)
    p.mask_many(xs, round=0, group=ROSTER[:2])
    with pytest.raises(ValueError, match="tensors \\['g', 'h'\\]: masking again"):
        p.mask_many(xs, round=0, group=ROSTER[:2])
    with pytest.raises(TypeError, match="real numbers"):
        p.mask_many({"h": np.array(["a"])}, round=1, group=ROSTER[:2])
    with pytest.raises(ValueError, match="at least one"):
        p.mask_many({}, round=1, group=ROSTER[:2])


def test_call_domain_encoding_is_unambiguous_and_sorted() -> None:
    def encoded(**fields) -> bytes:
        base = {"session": b"s", "round": 0, "group": ("a", "b"), "tensors": (("h", 3), ("g", 2))}
        return MaskCallDomain(**{**base, **fields}).encode()

    assert encoded().startswith(b"securevfl/mask-call/v1")
    assert encoded() == encoded(tensors=(("g", 2), ("h", 3)))
    assert encoded() != encoded(tensors=(("h", 2), ("g", 3)))
    assert encoded() != encoded(tensors=(("h", 3), ("g", 2), ("f", 0)))
    assert encoded(tensors=(("ab", 1), ("c", 1))) != encoded(tensors=(("a", 1), ("bc", 1)))
    single = MaskDomain(session=b"s", round=0, group=("a", "b"), tensor="h").encode()
    assert not single.startswith(b"securevfl/mask-call")
    with pytest.raises(ValueError, match="at least 2 tensors"):
        encoded(tensors=(("h", 3),))
    with pytest.raises(ValueError, match="more than once"):
        encoded(tensors=(("h", 3), ("h", 3)))
    with pytest.raises(ValueError, match="non-negative"):
        encoded(tensors=(("h", -3), ("g", 3)))
    with pytest.raises(ValueError, match="non-empty"):
        encoded(tensors=(("", 3), ("g", 3)))


# --- keystream offsets -------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 1, 2, 7, C - 1, C, 3 * C + 5])
def test_a_keystream_opened_at_an_offset_is_that_slice_of_the_stream(start: int) -> None:
    key = hashlib.sha256(b"offset").digest()[:16]
    full = keystream_uint64(key, start + 100)
    assert np.array_equal(keystream_uint64(key, 100, start_word=start), full[start:])
    stream = Keystream(key, start_word=start)
    first, second = np.empty(30, np.uint64), np.empty(70, np.uint64)
    stream.fill(first), stream.fill(second)
    assert np.array_equal(np.concatenate([first, second]), full[start:])
    with pytest.raises(ValueError, match="start_word"):
        Keystream(key, start_word=-1)


def test_forgotten_preparations_leave_their_domains_usable() -> None:
    # A party guessed the sizes of a call wrong: forgetting the guesses frees the slots (no
    # MAX_PREPARED refusal later) and the domains can still be masked under, bit for bit.
    group = ROSTER[:3]
    p = party("carol")
    for r in range(MAX_PREPARED):
        p.prepare(round=r, group=group, sizes={"h": 8})
    with pytest.raises(ValueError, match="pending"):
        p.prepare(round=MAX_PREPARED, group=group, sizes={"h": 8})
    assert p.forget_prepared() == MAX_PREPARED
    assert p.forget_prepared() == 0
    p.prepare(round=MAX_PREPARED, group=group, sizes={"h": 8})
    x = np.arange(8.0)
    got = p.mask(x, round=0, group=group, tensor="h")
    assert got.tobytes() == reference(p, x, round=0, group=group, tensor="h").tobytes()
    p.close()


def test_mask_prepared_takes_inline_masks_only_and_gives_the_same_bits() -> None:
    """`mask_prepared`, a party's common call (one tensor, masks made inline ahead): the bits of
    `mask` (the reference's), the domain used up after it; None, with nothing used up, where no
    such masks wait (none made, another size, made on the worker thread) or the encoder refuses
    the input, so that `mask` does the call or says why not."""
    p = party("carol")
    group = ROSTER[:4]
    x = np.linspace(-3.0, 3.0, 12, dtype=np.float32).reshape(3, 4)
    assert p.mask_prepared(x, round=1, group=group, tensor="h") is None  # none made
    p.prepare(round=1, group=group, sizes={"h": 11}, inline=True)
    assert p.mask_prepared(x, round=1, group=group, tensor="h") is None  # another size
    p.prepare(round=2, group=group, sizes={"h": 12}, inline=True)
    bad = x.copy()
    bad[0, 0] = np.nan
    assert p.mask_prepared(bad, round=2, group=group, tensor="h") is None  # refused: kept
    got = p.mask_prepared(x, round=2, group=group, tensor="h")
    assert got.shape == (3, 4) and got.dtype == np.uint64
    assert got.tobytes() == reference(p, x, round=2, group=group, tensor="h").tobytes()
    with pytest.raises(ValueError, match="already masked"):
        p.mask(x, round=2, group=group, tensor="h")
    p.prepare(round=3, group=group, sizes={"h": 12}).result(timeout=60)  # on the worker
    assert p.mask_prepared(x, round=3, group=group, tensor="h") is None
    assert (
        p.mask(x, round=3, group=group, tensor="h").tobytes()
        == reference(p, x, round=3, group=group, tensor="h").tobytes()
    )
    p.close()


@pytest.mark.parametrize("sizes", [{"h": 12}, {"h": 12, "g": 5}])
def test_the_same_sums_in_another_round_get_the_domain_made_afresh(sizes) -> None:
    """A call of the sums already resolved in another round takes its domain from the kept
    template (only the round spliced in): the same domain, encoding, digest and nonce as a
    domain made and checked afresh, for rounds up to 2**64 - 1; the masks are the reference's;
    a round out of range is still refused."""
    p = party("bob")
    group = ("dave", "alice", "bob")  # unsorted: the domain keeps it sorted
    fresh = party("bob")
    for round in (0, 1, 7, 255, 256, 2**32, 2**63, 2**64 - 1, 3):
        got = p._resolve(round, group, sizes)
        fresh._templates.clear()  # made and checked afresh
        want = fresh._resolve(round, group, sizes)
        assert type(got[0]) is type(want[0]) and got[0] == want[0]
        assert got[0].encode() == want[0].encode() == got[1] == want[1]
        assert got[2:] == want[2:]
    assert len(p._templates) == 1
    x = np.linspace(-2.0, 2.0, 12)
    for round in (10, 11, 12):
        masked = p.mask(x, round=round, group=group, tensor="h")
        assert masked.tobytes() == reference(p, x, round=round, group=group, tensor="h").tobytes()
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match="round must be in"):
            p._resolve(bad, group, sizes)
