"""Valid seed envelopes and the mutations that fuzz the envelope decoder.

Shared by the property tests (driven by hypothesis's ``st.randoms()``, so failures shrink)
and by ``bench/fuzz_envelope.py`` (driven by a seeded ``random.Random`` or by atheris).
Every mutation takes a ``random.Random``-like object and returns new frames; none raises.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from transport import ALLOWED_DTYPES, Envelope, pack

Frames = list[bytes]
KINDS = frozenset({"contribution", "sum"})
HEADER_FIELDS = ("version", "kind", "sender", "session", "round", "seq", "meta", "tensors")

# values that sit on the edges msgpack, numpy and the decoder care about
EDGE_INTS = (
    0, 1, 2, 3, 7, 8, 255, 256, 2**15, 2**16, 2**29, 2**31 - 1, 2**31, 2**32, 2**40,
    2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**31), -(2**63),
)  # fmt: skip
EDGE_DIMS = (0, 1, 2, 3, 4, 2**20, 2**29, 2**31, 2**32, 2**62, 2**63 - 1, 2**64 - 1, -1)
EDGE_DTYPES = (
    *sorted(ALLOWED_DTYPES), "float16", "complex128", "object", "O", "<f8", ">i4", "V8", "S3",
    "U1", "datetime64", "", "float64 ", "Float64", "bool_", "int", "void",
)  # fmt: skip
EDGE_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC4, 0xCF, 0xD3, 0xD9, 0xDB, 0xDC, 0xDD,
              0xDE, 0xDF, 0xC7, 0xD4, 0xD6, 0x90, 0x80, 0xA0, 0x9F, 0x8F)  # fmt: skip


def seed_envelopes() -> list[Frames]:
    """A dozen valid envelopes (as received bytes) covering every dtype, rank 0 to 4,
    empty and zero-dimension tensors, nested meta and the integer extremes."""
    rng = np.random.default_rng(7)
    envs = [
        Envelope(kind="contribution", sender="party1", seq=1),
        Envelope(
            kind="contribution",
            sender="party1",
            session="s" * 16,
            round=3,
            seq=2**64 - 1,
            tensors={"x": np.arange(4, dtype=np.float64)},
        ),
        Envelope(
            kind="sum",
            sender="aggregator",
            round=2**63 - 1,
            tensors={
                dtype: rng.integers(0, 2, size=(2, 3)).astype(dtype)
                for dtype in sorted(ALLOWED_DTYPES)
            },
            meta={"n": 3, "lr": 0.5, "ids": [1, 2, 3], "blob": b"\x00\xff", "none": None},
        ),
        Envelope(
            kind="contribution",
            sender="active",
            tensors={
                "empty": np.zeros((0, 7), np.int64),
                "zero-mid": np.zeros((3, 0, 2), np.float32),
                "scalar": np.array(1.5),
            },
        ),
        Envelope(
            kind="contribution",
            sender="p",
            tensors={"r4": np.arange(120, dtype=np.uint8).reshape(2, 3, 4, 5)},
            meta={"deep": {"a": [{"b": [None, True, -(2**63)]}]}},
        ),
        Envelope(
            kind="sum",
            sender="aggregator",
            tensors={"b": np.array([True, False, True]), "u": np.array([2**64 - 1], np.uint64)},
        ),
        Envelope(kind="contribution", sender="", meta={"text": "é\u202e\x1b[31m", "k": ""}),
    ]
    return [[bytes(f) for f in pack(env)] for env in envs]


# ----------------------------------------------------------------------------- byte level


def _pick_frame(rng: random.Random, frames: Frames) -> int:
    # the header is where the parsing happens: mutate it more often than tensor frames
    return 0 if rng.random() < 0.6 or len(frames) == 1 else rng.randrange(len(frames))


def flip_bits(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    data = bytearray(out[i])
    for _ in range(rng.choice((1, 1, 2, 3, 8))):
        if data:
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
    out[i] = bytes(data)
    return out


def set_bytes(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    data = bytearray(out[i])
    for _ in range(rng.choice((1, 2, 4))):
        if data:
            data[rng.randrange(len(data))] = rng.choice(EDGE_BYTES + (rng.randrange(256),))
    out[i] = bytes(data)
    return out


def insert_bytes(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    data = out[i]
    pos = rng.randrange(len(data) + 1)
    chunk = bytes(rng.choice(EDGE_BYTES) for _ in range(rng.choice((1, 2, 5, 9, 17))))
    out[i] = data[:pos] + chunk + data[pos:]
    return out


def delete_bytes(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    data = out[i]
    if data:
        start = rng.randrange(len(data))
        out[i] = data[:start] + data[start + rng.choice((1, 1, 2, 4, 16)) :]
    return out


def truncate(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
    return out


def extend(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = _pick_frame(rng, out)
    out[i] = out[i] + bytes(rng.randrange(256) for _ in range(rng.choice((1, 3, 8, 64))))
    return out


# ----------------------------------------------------------------------------- frame level


def drop_frame(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    if out:
        del out[rng.randrange(len(out))]
    return out


def duplicate_frame(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    i = rng.randrange(len(out))
    out.insert(rng.randrange(len(out) + 1), out[i])
    return out


def swap_frames(rng: random.Random, frames: Frames) -> Frames:
    out = list(frames)
    if len(out) > 1:
        i, j = rng.sample(range(len(out)), 2)
        out[i], out[j] = out[j], out[i]
    return out


def add_frames(rng: random.Random, frames: Frames) -> Frames:
    extra = [
        bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 8, 32))))
        for _ in range(rng.choice((1, 2, 5, 300)))
    ]
    return [*frames, *extra]


# ----------------------------------------------------------------------------- header level


def _decoded(frames: Frames) -> dict[str, Any] | None:
    try:
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


def _encode(rng: random.Random, header: Any, frames: Frames) -> Frames:
    try:
        data = msgpack.packb(header, use_bin_type=rng.random() < 0.9)
    except Exception:  # e.g. an int above 2**64 - 1: keep the frames as they were
        return list(frames)
    return [data, *frames[1:]]


def edge_value(rng: random.Random, depth: int = 0) -> Any:
    """A value from the shapes that break decoders: wrong types, extremes, deep nesting."""
    choice = rng.randrange(14)
    if choice == 0:
        return rng.choice(EDGE_INTS)
    if choice == 1:
        return rng.choice((0.0, -0.0, float("nan"), float("inf"), 1e308, 2.0**63))
    if choice == 2:
        return rng.choice(("", "x", "contribution", "heartbeat", "\x00", "é" * 300, "\x1b[2J"))
    if choice == 3:
        return rng.choice((b"", b"\x00", b"\xff" * 40))
    if choice == 4:
        return rng.choice((None, True, False))
    if choice == 5:
        return [edge_value(rng, depth + 1) for _ in range(rng.randrange(4))] if depth < 3 else []
    if choice == 6:
        return (
            {str(rng.randrange(9)): edge_value(rng, depth + 1) for _ in range(rng.randrange(3))}
            if depth < 3
            else {}
        )
    if choice == 7:
        return msgpack.ExtType(rng.randrange(128), b"\x01" * rng.randrange(9))
    if choice == 8:
        return msgpack.Timestamp(rng.randrange(2**32), 0)
    if choice == 9:
        nested: Any = None
        for _ in range(rng.choice((31, 33, 100, 600))):
            nested = [nested]
        return nested
    if choice == 10:
        return {b"bytes-key": 1} if rng.random() < 0.5 else {1: "int key"}
    if choice == 11:
        return [rng.choice(EDGE_DIMS) for _ in range(rng.randrange(10))]
    if choice == 12:
        return rng.choice(EDGE_DTYPES)
    return {"name": "x", "dtype": rng.choice(EDGE_DTYPES), "shape": [rng.choice(EDGE_DIMS)]}


def swap_fields(rng: random.Random, frames: Frames) -> Frames:
    header = _decoded(frames)
    if header is None or len(header) < 2:
        return flip_bits(rng, frames)
    a, b = rng.sample(sorted(header, key=repr), 2)
    header[a], header[b] = header[b], header[a]
    return _encode(rng, header, frames)


def edit_field(rng: random.Random, frames: Frames) -> Frames:
    header = _decoded(frames)
    if header is None:
        return flip_bits(rng, frames)
    action = rng.randrange(4)
    field = rng.choice(HEADER_FIELDS)
    if action == 0:
        header.pop(field, None)
    elif action == 1:
        header[rng.choice((field, "extra", "x" * 300, "\n"))] = edge_value(rng)
    elif action == 2:
        header[field] = edge_value(rng)
    else:
        header = rng.choice(([header], [], "header", 1, None, {1: header}))
    return _encode(rng, header, frames)


def _descriptors(rng: random.Random, frames: Frames) -> tuple[dict[str, Any], list] | None:
    header = _decoded(frames)
    if header is None or not isinstance(header.get("tensors"), list) or not header["tensors"]:
        return None
    return header, header["tensors"]


def edit_shape(rng: random.Random, frames: Frames) -> Frames:
    found = _descriptors(rng, frames)
    if found is None:
        return edit_field(rng, frames)
    header, descriptors = found
    descriptor = rng.choice(descriptors)
    if not isinstance(descriptor, dict) or not isinstance(descriptor.get("shape"), list):
        return edit_field(rng, frames)
    shape = list(descriptor["shape"])
    action = rng.randrange(7)
    if action == 0 and shape:
        shape[rng.randrange(len(shape))] = rng.choice(EDGE_DIMS)
    elif action == 1:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice(EDGE_DIMS))
    elif action == 2 and shape:
        del shape[rng.randrange(len(shape))]
    elif action == 3:  # the crash: a zero dimension beside huge ones
        shape = [0, *(rng.choice((2**20, 2**29, 2**31, 2**40)) for _ in range(rng.randrange(1, 8)))]
        rng.shuffle(shape)
    elif action == 4:
        shape = [1] * rng.choice((8, 9, 32, 33, 65, 100))
    elif action == 5 and shape:
        shape[rng.randrange(len(shape))] = edge_value(rng)
    else:
        descriptor["shape"] = edge_value(rng)
        return _encode(rng, header, frames)
    descriptor["shape"] = shape
    return _encode(rng, header, frames)


def edit_dtype(rng: random.Random, frames: Frames) -> Frames:
    found = _descriptors(rng, frames)
    if found is None:
        return edit_field(rng, frames)
    header, descriptors = found
    descriptor = rng.choice(descriptors)
    if not isinstance(descriptor, dict):
        return edit_field(rng, frames)
    descriptor["dtype"] = rng.choice(EDGE_DTYPES) if rng.random() < 0.8 else edge_value(rng)
    return _encode(rng, header, frames)


def edit_descriptors(rng: random.Random, frames: Frames) -> Frames:
    found = _descriptors(rng, frames)
    if found is None:
        return edit_field(rng, frames)
    header, descriptors = found
    action = rng.randrange(6)
    i = rng.randrange(len(descriptors))
    if action == 0:
        descriptors.insert(i, descriptors[i])  # a duplicate name
    elif action == 1:
        del descriptors[i]
    elif action == 2 and len(descriptors) > 1:
        j = rng.randrange(len(descriptors))
        descriptors[i], descriptors[j] = descriptors[j], descriptors[i]
    elif action == 3 and isinstance(descriptors[i], dict):
        descriptors[i]["name"] = edge_value(rng) if rng.random() < 0.5 else "x" * 256
    elif action == 4 and isinstance(descriptors[i], dict):
        key = rng.choice(("name", "dtype", "shape", "extra"))
        if key in descriptors[i] and rng.random() < 0.5:
            del descriptors[i][key]
        else:
            descriptors[i][key] = edge_value(rng)
    else:
        descriptors[i] = edge_value(rng)
    return _encode(rng, header, frames)


MUTATIONS: tuple[Callable[[random.Random, Frames], Frames], ...] = (
    flip_bits,
    set_bytes,
    insert_bytes,
    delete_bytes,
    truncate,
    extend,
    drop_frame,
    duplicate_frame,
    swap_frames,
    add_frames,
    swap_fields,
    edit_field,
    edit_shape,
    edit_dtype,
    edit_descriptors,
)


def mutate(rng: random.Random, frames: Frames, *, max_steps: int = 3) -> Frames:
    """Apply 1 to ``max_steps`` random mutations to ``frames``; an empty result gets a frame."""
    out = list(frames)
    for _ in range(rng.randint(1, max_steps)):
        out = rng.choice(MUTATIONS)(rng, out) if out else [b""]
    return out
