"""pack/unpack without sockets: round trips and every validation rule."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tests.transport.transport_testkit import DROP, header
from transport import (
    ALLOWED_DTYPES,
    PROTOCOL_VERSION,
    Envelope,
    EnvelopeError,
    Limits,
    pack,
    unpack,
)
from transport.envelope import frames_nbytes

KINDS = {"contribution"}
X = np.arange(4, dtype=np.float64).tobytes()


def wire(frames: list) -> list[bytes]:
    """What the other side receives: plain bytes, no shared memory with the sender."""
    return [bytes(f) for f in frames]


def assert_bit_exact(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == b.tobytes()


def test_round_trip_keeps_every_field_and_tensor_bit_exact():
    tensors = {
        "f32": np.array([[1.5, -0.0], [np.inf, np.nan]], dtype=np.float32),
        "f64": np.frombuffer(bytes(range(16)), dtype=np.float64),  # odd NaN payloads included
        "i32": np.array([-(2**31), 2**31 - 1], dtype=np.int32),
        "i64": np.array([[-(2**63)], [2**63 - 1]], dtype=np.int64),
        "u64": np.array([0, 2**64 - 1], dtype=np.uint64),
        "u8": np.arange(256, dtype=np.uint8).reshape(4, 4, 16),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 7), dtype=np.int64),
    }
    meta = {"step": "forward", "lr": 0.1, "n": -3, "ok": True, "none": None, "raw": b"\x00\xff"}
    meta["nested"] = {"ids": [1, 2, 3], "deep": [{"a": [None]}]}
    env = Envelope(
        kind="contribution",
        sender="party1",
        session="s",
        round=7,
        tensors=tensors,
        meta=meta,
        seq=9,
    )
    out = unpack(wire(pack(env)), kinds=KINDS, session="s")
    assert (out.kind, out.sender, out.session, out.round, out.seq) == (
        "contribution",
        "party1",
        "s",
        7,
        9,
    )
    assert out.meta == meta
    assert list(out.tensors) == list(tensors)
    for name, array in tensors.items():
        assert_bit_exact(array, out.tensors[name])


def test_non_contiguous_and_big_endian_arrays_arrive_as_native_c_order():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    tensors = {"strided": base[:, ::2], "transposed": base.T, "big": base.astype(">i8")}
    out = unpack(
        wire(pack(Envelope(kind="contribution", sender="a", tensors=tensors))), kinds=KINDS
    )
    for name, array in tensors.items():
        np.testing.assert_array_equal(out.tensors[name], array)
        assert out.tensors[name].dtype.byteorder in ("=", "<", "|")


def test_pack_is_zero_copy_for_contiguous_arrays():
    array = np.arange(1000, dtype=np.float64)
    frames = pack(Envelope(kind="contribution", sender="a", tensors={"x": array}))
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float64), array)
    assert frames_nbytes(frames) == len(frames[0]) + array.nbytes


def test_unpacked_tensors_are_read_only_views():
    out = unpack([header(), X], kinds=KINDS)
    assert not out.tensors["x"].flags.writeable


def test_tuples_in_meta_arrive_as_lists():
    env = Envelope(kind="contribution", sender="a", meta={"shape": (2, 3)})
    assert unpack(wire(pack(env)), kinds=KINDS).meta == {"shape": [2, 3]}


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (Envelope(kind="k", sender="a", tensors={"x": np.zeros(2, np.complex64)}), "not allowed"),
        (Envelope(kind="k", sender="a", tensors={"x": np.array(["a"], object)}), "not allowed"),
        (Envelope(kind="k", sender="a", tensors={"x": [1.0, 2.0]}), "not a numpy.ndarray"),
        (Envelope(kind="k", sender="a", meta={"x": np.float32(1)}), "is a float32"),
        (Envelope(kind="k", sender="a", meta={"x": np.int64(1)}), "convert NumPy scalars"),
        (Envelope(kind="k", sender="a", meta={1: "int key"}), "keys must be str"),
        (Envelope(kind="k", sender="a", meta={"big": 2**70}), "cannot be encoded"),
        (Envelope(kind="", sender="a"), "kind must not be empty"),
        (Envelope(kind="k", sender="a", round=-1), "round must be between"),
        (Envelope(kind="k", sender="a", seq=True), "seq must be an int"),
    ],
)
def test_pack_refuses_what_the_wire_cannot_carry(env, reason):
    with pytest.raises(EnvelopeError, match=reason):
        pack(env)


def test_pack_with_limits_refuses_a_message_the_receiver_would_reject():
    env = Envelope(kind="k", sender="a", tensors={"x": np.zeros(1000)})
    with pytest.raises(EnvelopeError, match="above the limit"):
        pack(env, limits=Limits(max_message_bytes=4000))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "no frames"),
        ([b"\xc1not msgpack"], "not valid msgpack"),
        ([msgpack.packb([1, 2])], "must be a msgpack map"),
        ([header() + b"\x00"], "not valid msgpack"),  # trailing bytes
        ([header(version=DROP), X], "no 'version' field"),
        ([header(version=2), X], "protocol version 2 is not supported"),
        ([header(version="1"), X], "protocol version '1' is not supported"),
        ([header(seq=DROP), X], r"missing field\(s\) \['seq'\]"),
        ([header(extra=1), X], r"unexpected field\(s\) \['extra'\]"),
        ([header(kind=3), X], "kind must be a str"),
        ([header(kind="evil"), X], "kind 'evil' is not one of"),
        ([header(round="3"), X], "round must be an int"),
        ([header(round=True), X], "round must be an int"),
        ([header(seq=-1), X], "seq must be between"),
        ([header(sender=None), X], "sender must be a str"),
        ([header(meta=[1]), X], "meta must be a map"),
        ([header(tensors={}), X], "tensors must be a list"),
        ([header(), X[:-1]], "needs 32 bytes but its frame has 31"),
        ([header(), X, b"extra"], "describes 1 tensors but 2 tensor frames"),
        ([header()], "describes 1 tensors but 0 tensor frames"),
        ([header(tensors=[{"name": "x", "dtype": "complex128", "shape": [2]}]), X], "allowlist"),
        ([header(tensors=[{"name": "x", "dtype": "O", "shape": [4]}]), X], "allowlist"),
        ([header(tensors=[{"name": "x", "dtype": "float64", "shape": [-4]}]), X], "non-negative"),
        ([header(tensors=[{"name": "x", "dtype": "float64", "shape": [2.0, 2]}]), X], "ints"),
        ([header(tensors=[{"name": "x", "dtype": "float64", "shape": 4}]), X], "list of ints"),
        ([header(tensors=[{"name": "x", "dtype": "float64"}]), X], "exactly the fields"),
        ([header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1] * 9}]), b"\x00"], "9 dim"),
        ([header(tensors=[{"name": "x", "dtype": "uint8", "shape": [0, 2**62]}]), b""], "exceeds"),
        (
            [header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1]}] * 2), b"\x00", b"\x01"],
            "appears twice",
        ),
        ([header(tensors=[{"name": "b", "dtype": "bool", "shape": [2]}]), b"\x01\x02"], "0 and 1"),
        ([msgpack.packb(msgpack.ExtType(1, b"x"))], "extension type 1"),
        ([header(meta={"when": msgpack.Timestamp(1)}), X], "is a Timestamp"),
    ],
)
def test_unpack_rejects_with_a_reason(frames, reason):
    with pytest.raises(EnvelopeError, match=reason) as info:
        unpack(frames, kinds=KINDS)
    assert info.value.reason == str(info.value)


def test_unpack_enforces_session_when_given():
    frames = [header(session="old"), X]
    assert unpack(frames, kinds=KINDS).session == "old"
    with pytest.raises(EnvelopeError, match="session 'old', not the current session 'new'"):
        unpack(frames, kinds=KINDS, session="new")


def test_unpack_enforces_size_limits():
    limits = Limits(max_header_bytes=50, max_tensors=1)
    with pytest.raises(EnvelopeError, match="above the limit of 100"):
        unpack([header(), X, bytes(100)], kinds=KINDS, limits=Limits(max_message_bytes=100))
    with pytest.raises(EnvelopeError, match="header frame is .* above the limit of 50"):
        unpack([header(meta={"pad": "x" * 60}), X], kinds=KINDS, limits=limits)
    with pytest.raises(EnvelopeError, match="2 tensor frames, above the limit of 1"):
        unpack([header(), X, X], kinds=KINDS, limits=limits)


def test_unpack_refuses_a_single_string_as_kinds():
    with pytest.raises(TypeError):
        unpack([header(), X], kinds="contribution")


def test_protocol_version_is_one():
    assert PROTOCOL_VERSION == 1


# --------------------------------------------------------------------------- properties

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
arrays = st.sampled_from(sorted(ALLOWED_DTYPES)).flatmap(
    lambda dtype: hnp.arrays(dtype=np.dtype(dtype), shape=shapes)
)
names = st.text(min_size=1, max_size=12)
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    tensors=st.dictionaries(names, arrays, max_size=5),
    meta=st.dictionaries(st.text(max_size=8), plain, max_size=4),
    round_=st.integers(0, 2**63 - 1),
    seq=st.integers(0, 2**64 - 1),
)
def test_any_allowed_envelope_round_trips_bit_exact(tensors, meta, round_, seq):
    env = Envelope(
        kind="contribution", sender="p", round=round_, tensors=tensors, meta=meta, seq=seq
    )
    out = unpack(wire(pack(env)), kinds=KINDS)
    assert (out.round, out.seq, list(out.tensors)) == (round_, seq, list(tensors))
    assert msgpack.packb(out.meta) == msgpack.packb(meta)  # NaN-safe equality
    for name, array in tensors.items():
        assert_bit_exact(array, out.tensors[name])


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=4))
def test_garbage_frames_only_ever_raise_envelope_error(frames):
    try:
        unpack(frames, kinds=KINDS)
    except EnvelopeError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    fields=st.dictionaries(
        st.sampled_from(
            ["version", "kind", "sender", "session", "round", "seq", "meta", "tensors"]
        ),
        plain,
    ),
    tail=st.lists(st.binary(max_size=16), max_size=3),
)
def test_garbage_headers_only_ever_raise_envelope_error(fields, tail):
    try:
        unpack([msgpack.packb({"version": 1, **fields}), *tail], kinds=KINDS)
    except EnvelopeError:
        pass
