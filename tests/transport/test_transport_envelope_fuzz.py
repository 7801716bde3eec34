"""The envelope decoder is total: any input gives an Envelope or an EnvelopeError, never
another exception, and whatever it accepts is valid. Property tests run in CI (a few
seconds); ``bench/fuzz_envelope.py`` runs the same mutations a million times by hand."""

from __future__ import annotations

import math
import random

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.transport.envelope_mutations import (
    EDGE_DIMS,
    EDGE_DTYPES,
    EDGE_INTS,
    HEADER_FIELDS,
    KINDS,
    mutate,
    seed_envelopes,
)
from tests.transport.transport_testkit import header
from transport import ALLOWED_DTYPES, Envelope, EnvelopeError, Limits, pack, unpack

SEEDS = seed_envelopes()
DEFAULT = Limits()
SMALL = Limits(max_message_bytes=4096, max_header_bytes=2048, max_tensors=4, max_ndim=3)
LIMITS = st.sampled_from([Limits(), SMALL, Limits(max_message_bytes=64, max_tensors=1)])


def fast(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


def decode(frames: list, limits: Limits = DEFAULT) -> Envelope | None:
    """unpack, with every accepted envelope checked; None when it was refused cleanly."""
    try:
        env = unpack(frames, kinds=KINDS, limits=limits)
    except EnvelopeError as exc:
        assert exc.reason.isascii() and exc.reason.isprintable(), exc.reason
        assert len(exc.reason) < 1100
        return None
    assert_valid(env, limits)
    return env


def assert_valid(env: Envelope, limits: Limits) -> None:
    """What unpack promises, checked independently, then re-encoded and decoded again."""
    assert env.kind in KINDS and isinstance(env.sender, str) and isinstance(env.session, str)
    assert 0 <= env.round < 2**63 and 0 <= env.seq < 2**64
    assert len(env.tensors) <= limits.max_tensors
    for name, array in env.tensors.items():
        assert isinstance(name, str) and name
        assert array.dtype.name in ALLOWED_DTYPES and array.ndim <= limits.max_ndim
        assert not array.flags.writeable
        extent = math.prod(max(d, 1) for d in array.shape) * array.dtype.itemsize
        assert extent <= limits.max_message_bytes
    again = unpack([bytes(f) for f in pack(env)], kinds=KINDS, limits=limits)
    assert msgpack.packb(again.meta) == msgpack.packb(env.meta)
    assert [(n, a.dtype, a.shape, a.tobytes()) for n, a in again.tensors.items()] == [
        (n, a.dtype, a.shape, a.tobytes()) for n, a in env.tensors.items()
    ]


# --------------------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    "shape",
    [
        [0, 2**29, 2**29, 2**29],  # the issue's crash: numpy's "array is too big"
        [2**20, 0, 2**20, 2**20, 2**20],
        [0, 2**29, 2**29],
        [2**29, 2**29, 0],
    ],
)
def test_zero_dimension_beside_huge_dimensions_is_an_envelope_error(shape):
    frames = [header(tensors=[{"name": "x", "dtype": "float64", "shape": shape}]), b""]
    with pytest.raises(EnvelopeError, match="zero dimensions count as 1"):
        unpack(frames, kinds={"contribution"})


def test_zero_size_tensors_of_reasonable_shape_still_round_trip():
    tensors = {"a": np.zeros((0, 1000), np.float64), "b": np.zeros((3, 0, 5), np.bool_)}
    env = unpack(
        [bytes(f) for f in pack(Envelope(kind="contribution", sender="p", tensors=tensors))],
        kinds=KINDS,
        limits=Limits(max_message_bytes=10_000),
    )
    assert {n: a.shape for n, a in env.tensors.items()} == {"a": (0, 1000), "b": (3, 0, 5)}


def test_limits_refuse_values_numpy_and_libzmq_cannot_honour():
    with pytest.raises(ValueError, match="max_ndim must be a positive int of at most 32"):
        Limits(max_ndim=33)
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_message_bytes=2**63)
    with pytest.raises(ValueError, match="max_pending_messages"):
        Limits(max_pending_messages=0)
    deep = np.zeros([1] * 32, np.uint8)
    env = Envelope(kind="contribution", sender="p", tensors={"deep": deep})
    assert unpack(pack(env), kinds=KINDS, limits=Limits(max_ndim=32)).tensors["deep"].ndim == 32


def test_pack_with_limits_refuses_a_rank_or_extent_the_receiver_would_reject():
    env = Envelope(kind="k", sender="a", tensors={"x": np.zeros((1, 1, 1, 1), np.uint8)})
    with pytest.raises(EnvelopeError, match="4 dimensions, above the limit of 3"):
        pack(env, limits=Limits(max_ndim=3))
    empty = Envelope(kind="k", sender="a", tensors={"x": np.zeros((0, 5000), np.float64)})
    with pytest.raises(EnvelopeError, match="zero dimensions count as 1"):
        pack(empty, limits=Limits(max_message_bytes=6000))


def test_error_reasons_quote_and_bound_what_the_peer_sent():
    hostile = "\x1b[2J\nWARNING transport.hub: forged line \u202e"
    cases = [
        [header(version="v" * 100_000)],
        [header(kind=hostile)],
        [header(**{hostile * 50: 1, "x" * 5000: 2})],
        [header(tensors=[{"name": hostile, "dtype": hostile * 100, "shape": [1]}]), b"\x00"],
        [header(tensors=[{"name": "x", "dtype": "uint8", "shape": [hostile * 100]}]), b"\x00"],
        [header(meta={hostile: {"deep": [hostile] * 3, 1.5: 0}})],
    ]
    for frames in cases:
        with pytest.raises(EnvelopeError) as info:
            unpack(frames, kinds=KINDS)
        reason = info.value.reason
        assert reason.isascii() and reason.isprintable(), reason
        assert len(reason) < 1100, len(reason)
        assert str(info.value) == reason


# --------------------------------------------------------------------------- properties


@fast(400)
@given(frames=st.lists(st.binary(max_size=300), max_size=8), limits=LIMITS)
def test_arbitrary_frames_give_an_envelope_or_an_envelope_error(frames, limits):
    decode(frames, limits)


@fast(200)
@given(
    prefix=st.sampled_from([b"\x88", b"\x89", b"\x8f", b"\xde\x00\x08", b"\xdf\x00\x00\x00\x08"]),
    body=st.binary(max_size=400),
    tail=st.lists(st.binary(max_size=64), max_size=4),
)
def test_arbitrary_bytes_after_a_map_header_give_an_envelope_or_an_envelope_error(
    prefix, body, tail
):
    decode([prefix + body, *tail])


@fast(1500)
@given(seed=st.integers(0, len(SEEDS) - 1), rnd=st.randoms(use_true_random=False), limits=LIMITS)
def test_mutated_valid_envelopes_give_an_envelope_or_an_envelope_error(seed, rnd, limits):
    decode(mutate(rnd, SEEDS[seed]), limits)


dims = st.one_of(
    st.sampled_from(EDGE_DIMS),
    st.integers(min_value=0, max_value=8),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # what msgpack can carry
    st.sampled_from([1.0, "3", None, True, [2], {"d": 1}]),
)


@fast(600)
@given(
    shape=st.one_of(st.lists(dims, max_size=40), dims),
    dtype=st.one_of(st.sampled_from(EDGE_DTYPES), st.text(max_size=12), st.integers(-9, 9)),
    payload=st.one_of(st.just(b""), st.binary(max_size=64), st.sampled_from([bytes(8), bytes(48)])),
    limits=LIMITS,
)
@example(shape=[0, 2**29, 2**29, 2**29], dtype="float64", payload=b"", limits=Limits())
@example(shape=[0, 2**62], dtype="uint8", payload=b"", limits=Limits())
@example(shape=[1] * 33, dtype="uint8", payload=b"\x00", limits=Limits(max_ndim=32))
def test_edited_shapes_and_dtypes_give_an_envelope_or_an_envelope_error(
    shape, dtype, payload, limits
):
    frames = [header(tensors=[{"name": "x", "dtype": dtype, "shape": shape}]), payload]
    decode(frames, limits)


field_values = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.none(),
    st.booleans(),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-9, 9), max_size=2),
)


@fast(400)
@given(
    swaps=st.lists(
        st.tuples(st.sampled_from(HEADER_FIELDS), field_values),
        max_size=3,
    ),
    seed=st.integers(0, len(SEEDS) - 1),
    rnd=st.randoms(use_true_random=False),
)
def test_header_field_swaps_and_edits_give_an_envelope_or_an_envelope_error(swaps, seed, rnd):
    frames = SEEDS[seed]
    fields = msgpack.unpackb(frames[0], raw=False)
    names = sorted(fields)
    a, b = rnd.sample(names, 2)
    fields[a], fields[b] = fields[b], fields[a]
    for name, value in swaps:
        fields[name] = value
    decode([msgpack.packb(fields, use_bin_type=True), *frames[1:]])


@fast(200)
@given(
    n_descriptors=st.integers(0, 12),
    n_frames=st.integers(0, 300),
    frame_size=st.sampled_from([0, 1, 8, 100]),
    limits=LIMITS,
)
def test_multi_frame_messages_give_an_envelope_or_an_envelope_error(
    n_descriptors, n_frames, frame_size, limits
):
    descriptors = [
        {"name": f"t{i}", "dtype": "uint8", "shape": [frame_size]} for i in range(n_descriptors)
    ]
    frames = [header(tensors=descriptors), *(bytes(frame_size) for _ in range(n_frames))]
    env = decode(frames, limits)
    accepted = n_descriptors == n_frames and n_frames <= limits.max_tensors
    accepted = accepted and len(frames[0]) <= limits.max_header_bytes
    accepted = accepted and sum(map(len, frames)) <= limits.max_message_bytes
    assert (env is not None) == accepted


arrays = st.sampled_from(sorted(ALLOWED_DTYPES)).flatmap(
    lambda dtype: hnp.arrays(
        dtype=np.dtype(dtype),
        shape=hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4),
    )
)


@fast(150)
@given(
    tensors=st.dictionaries(st.text(min_size=1, max_size=8), arrays, max_size=4),
    meta=st.dictionaries(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1), max_size=3),
)
def test_a_valid_envelope_round_trips_and_what_pack_allows_unpack_accepts(tensors, meta):
    env = Envelope(kind="contribution", sender="p", round=1, seq=2, tensors=tensors, meta=meta)
    frames = [bytes(f) for f in pack(env)]
    # the tightest limits this envelope meets: pack and unpack must agree on them
    ndim = max([a.ndim for a in tensors.values()] + [1])
    extents = [math.prod(max(d, 1) for d in a.shape) * a.itemsize for a in tensors.values()]
    limits = Limits(
        max_message_bytes=max([sum(map(len, frames)), 1, *extents]),
        max_header_bytes=len(frames[0]),
        max_tensors=max(len(tensors), 1),
        max_ndim=ndim,
    )
    pack(env, limits=limits)
    out = decode(frames, limits)
    assert out is not None
    assert (out.round, out.seq, out.meta) == (1, 2, meta)
    for name, array in tensors.items():
        assert out.tensors[name].dtype == array.dtype and out.tensors[name].shape == array.shape
        assert out.tensors[name].tobytes() == np.ascontiguousarray(array).tobytes()


def test_the_mutations_reach_the_issues_crash_class():
    """The fuzz corpus is not toothless: it produces zero-beside-huge shapes that decode
    as far as the shape check (the input class behind the reported ValueError)."""
    rng = random.Random(4)
    hits = 0
    for _ in range(3000):
        frames = mutate(rng, SEEDS[3], max_steps=1)
        try:
            unpack(frames, kinds=KINDS)
        except EnvelopeError as exc:
            hits += "zero dimensions count as 1" in exc.reason
    assert hits > 0


_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.binary(max_size=3),
    # what meta must refuse: NumPy scalars, sets, objects
    st.sampled_from([np.float32(1.0), np.int64(2), frozenset({1}), object(), {1, 2}]),
)
_META_LIKE = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=2), st.integers(0, 3)), inner, max_size=3),
    ),
    max_leaves=12,
)


@fast(400)
@given(value=_META_LIKE, depth=st.one_of(st.integers(0, 12), st.integers(28, 34)))
@example(value=[None], depth=32)  # items one level past the limit
@example(value={"a": 1}, depth=32)
@example(value=[], depth=32)
@example(value={"a": [1]}, depth=31)
def test_the_fast_plain_check_agrees_with_the_one_that_names_the_place(value, depth) -> None:
    """Meta is checked on every message by a walk that builds no path strings; only a refusal
    walks again to name the place. Both must accept exactly the same values (any nesting,
    NumPy scalars, sets, non-str keys, depth at and beyond the limit of 32)."""
    from transport import envelope as E

    try:
        E._refuse_unplain(value, "meta", depth)
        refused = None
    except EnvelopeError as exc:
        refused = exc
    assert E._is_plain(value, depth) == (refused is None)
    if refused is not None:
        with pytest.raises(EnvelopeError) as again:
            E._check_plain(value, "meta", depth)
        assert str(again.value) == str(refused)  # the same message, naming the same place
