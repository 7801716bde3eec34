"""Envelopes: one msgpack header frame followed by one raw frame per tensor.

The header is a msgpack map with exactly these fields::

    {"version": 1, "kind": str, "sender": str, "session": str, "round": int, "seq": int,
     "meta": {str: plain data}, "tensors": [{"name": str, "dtype": str, "shape": [int, ...]}]}

Tensor frames hold the C-order, little-endian bytes of each array, in descriptor order.
Nothing on the wire is ever unpickled: the header is msgpack without extension types and
tensors are rebuilt with ``np.frombuffer`` from a dtype allowlist.

The decoder is total: for any input whatsoever, :func:`unpack` either returns a valid
:class:`Envelope` or raises :class:`EnvelopeError`; every limit is checked on the whole
message (frames, bytes, header size, tensors, rank, dimensions) before anything is decoded,
allocated or copied. Peer-supplied values in error reasons are quoted and cut, so a reason
can go into a log line as it is.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from transport.errors import one_line, quote

PROTOCOL_VERSION = 1
ALLOWED_DTYPES = frozenset(
    {"float32", "float64", "int32", "int64", "uint64", "uint32", "uint8", "bool"}
)

HEADER_FIELDS = frozenset(
    {"version", "kind", "sender", "session", "round", "seq", "meta", "tensors"}
)
DESCRIPTOR_FIELDS = frozenset({"name", "dtype", "shape"})
# looked up on every tensor of every message (a dtype's .name is computed in Python each time)
_DTYPE_NAMES = {np.dtype(name): name for name in ALLOWED_DTYPES}
_WIRE_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
MAX_NAME_CHARS = 255
MAX_META_DEPTH = 32
_MAX_UINT64 = 2**64 - 1
_MAX_INT64 = 2**63 - 1
# bounds on Limits themselves: NumPy 1.x arrays have at most 32 dimensions, and sizes must
# stay far from numpy's intp overflow whatever the shape
_NUMPY_MAX_NDIM = 32
_LIMIT_CEILINGS = {
    "max_message_bytes": 2**40,
    "max_header_bytes": 2**40,
    "max_tensors": 2**16,
    "max_ndim": _NUMPY_MAX_NDIM,
    "max_pending_messages": 2**20,
    "max_pending_bytes": 2**44,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EnvelopeError(ValueError):
    """An envelope is malformed or breaks a limit; ``reason`` is a sentence saying what.

    The reason is one printable ASCII line of bounded length (see ``errors.one_line``), so it
    can be logged as it is even when it quotes what a peer sent.
    """

    def __init__(self, reason: str) -> None:
        self.reason = one_line(str(reason))
        super().__init__(self.reason)


@dataclass
class Envelope:
    """One message: a kind, its sender, the session and round it belongs to, tensors, meta.

    ``meta`` holds plain data only (str, int, float, bool, None, bytes, lists/tuples and
    dicts with str keys); tuples arrive as lists. ``seq`` is set by the sending socket
    wrapper and strictly increases per socket; receivers reject replays with it.
    """

    kind: str
    sender: str
    session: str = ""
    round: int = 0
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    seq: int = 0


@dataclass(frozen=True)
class Limits:
    """Receive limits, per message; a message beyond any of them is rejected, never half-read.

    ``max_message_bytes`` bounds the sum of all of a message's frames (header included),
    ``max_tensors`` its tensors and so its frames (``max_frames = max_tensors + 1``),
    ``max_ndim`` each tensor's rank, and every dimension and every shape's extent (its
    product with zero dimensions counted as 1) must fit in ``max_message_bytes`` too.
    ``max_pending_messages`` / ``max_pending_bytes`` bound what a hub keeps queued for
    :meth:`Hub.recv` from any one role (``None``: four times ``max_message_bytes``).
    Construction refuses values that are not positive ints or exceed what NumPy and libzmq
    can honour (e.g. ``max_ndim > 32``).
    """

    max_message_bytes: int = 512 * 2**20
    max_header_bytes: int = 1 * 2**20
    max_tensors: int = 256
    max_ndim: int = 8
    max_pending_messages: int = 1024
    max_pending_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, ceiling in _LIMIT_CEILINGS.items():
            value = getattr(self, name)
            if name == "max_pending_bytes" and value is None:
                continue
            if not _is_int(value) or not 1 <= value <= ceiling:
                raise ValueError(
                    f"Limits.{name} must be a positive int of at most {ceiling}, got {value!r}"
                )

    @property
    def max_frames(self) -> int:
        """Most frames one message may have: the header plus one per tensor."""
        return self.max_tensors + 1

    @property
    def pending_bytes_cap(self) -> int:
        """``max_pending_bytes``, or four times ``max_message_bytes`` when it is None."""
        if self.max_pending_bytes is None:
            return 4 * self.max_message_bytes
        return self.max_pending_bytes

    @property
    def hard_frame_cap(self) -> int:
        """Per-frame size at which libzmq itself drops the connection (``zmq.MAXMSGSIZE``).

        It sits above ``max_message_bytes`` so that an oversized message normally reaches
        the application check and is rejected with a logged reason; the cap only stops a
        peer from making the receiver buffer arbitrarily large frames.
        """
        return self.max_message_bytes + max(
            self.max_header_bytes, 2**20, self.max_message_bytes // 4
        )


DEFAULT_LIMITS = Limits()


def pack(env: Envelope, *, limits: Limits | None = None) -> list[bytes | memoryview]:
    """Encode ``env`` as ``[header, tensor bytes...]`` ready for ``send_multipart(copy=False)``.

    Tensor frames are zero-copy byte views of the arrays (non-contiguous or big-endian arrays
    are copied to C-order little-endian first), so an array must not be modified until the
    message has left. Refuses (``EnvelopeError``) tensors that are not NumPy arrays or whose
    dtype is not in ``ALLOWED_DTYPES``, meta that is not plain data, bad field types, and,
    when ``limits`` is given, a message the receiver would reject for its size, tensor count,
    rank or shape.
    """
    _check_str("kind", env.kind, nonempty=True)
    _check_str("sender", env.sender)
    _check_str("session", env.session)
    _check_uint("round", env.round, _MAX_INT64)
    _check_uint("seq", env.seq, _MAX_UINT64)
    if not isinstance(env.meta, dict):
        raise EnvelopeError(f"meta must be a dict, got {type(env.meta).__name__}")
    _check_plain(env.meta, "meta", 0)
    if not isinstance(env.tensors, dict):
        raise EnvelopeError(
            f"tensors must be a dict of name -> ndarray, got {type(env.tensors).__name__}"
        )

    descriptors = []
    buffers: list[bytes | memoryview] = []
    for name, array in env.tensors.items():
        _check_str("tensor name", name, nonempty=True)
        if not isinstance(array, np.ndarray):
            raise EnvelopeError(
                f"tensor {name!r} is a {type(array).__name__}, not a numpy.ndarray; "
                "convert it with numpy.asarray first"
            )
        dtype_name = _DTYPE_NAMES.get(array.dtype) or array.dtype.name
        if dtype_name not in ALLOWED_DTYPES:
            raise EnvelopeError(
                f"tensor {name!r} has dtype {array.dtype}, which is not allowed on the wire; "
                f"use one of {sorted(ALLOWED_DTYPES)}"
            )
        wire = np.ascontiguousarray(array, dtype=_wire_dtype(dtype_name))
        descriptors.append({"name": name, "dtype": dtype_name, "shape": list(array.shape)})
        buffers.append(memoryview(wire.reshape(-1).view(np.uint8)))

    header_map = {
        "version": PROTOCOL_VERSION,
        "kind": env.kind,
        "sender": env.sender,
        "session": env.session,
        "round": env.round,
        "seq": env.seq,
        "meta": env.meta,
        "tensors": descriptors,
    }
    try:
        header = msgpack.packb(header_map, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EnvelopeError(f"the header cannot be encoded as msgpack: {exc}") from exc

    if limits is not None:
        total = len(header) + sum(len(b) for b in buffers)
        if len(header) > limits.max_header_bytes:
            raise EnvelopeError(
                f"the header is {len(header)} bytes, above the limit of {limits.max_header_bytes}; "
                "move large meta values into tensors"
            )
        if len(buffers) > limits.max_tensors:
            raise EnvelopeError(
                f"the message has {len(buffers)} tensors, above the limit of {limits.max_tensors}"
            )
        if total > limits.max_message_bytes:
            raise EnvelopeError(
                f"the message is {total} bytes, above the limit of {limits.max_message_bytes}; "
                "send it in smaller batches"
            )
        for descriptor in descriptors:  # what the receiver's _check_descriptor will refuse
            itemsize = _wire_dtype(descriptor["dtype"]).itemsize
            _check_shape(descriptor["name"], descriptor["shape"], itemsize, limits)
    return [header, *buffers]


def unpack(
    frames: Sequence[Any],
    *,
    kinds: Collection[str],
    limits: Limits = DEFAULT_LIMITS,
    session: str | None = None,
) -> Envelope:
    """Decode and validate frames made by :func:`pack` (bytes, memoryviews or ``zmq.Frame``).

    Promises that the returned envelope has: a header with exactly the expected fields and
    types, ``version == PROTOCOL_VERSION``, ``kind`` in ``kinds``, ``session`` equal to
    ``session`` when that is given, non-negative int ``round`` and ``seq``, plain-data meta,
    and one frame per tensor descriptor whose length is ``prod(shape) * itemsize`` for an
    allowed dtype, unique names, ``ndim <= limits.max_ndim``, every dimension and the
    shape's extent within ``limits.max_message_bytes``, total size within limits.
    Tensors are read-only ``np.frombuffer`` views of the frames (no copy).

    Refuses anything else with ``EnvelopeError`` whose ``reason`` names the problem, and
    never raises anything else for any ``frames`` (only a ``kinds`` that is one str, a
    programming error, raises ``TypeError``). The frame count and total size are checked
    before any frame is read, the header size before it is decoded, and every descriptor
    before any tensor is built.
    """
    if isinstance(kinds, str):
        raise TypeError("kinds must be a collection of kind names, not one str")
    if isinstance(frames, bytes | bytearray | memoryview) or not isinstance(frames, Sequence):
        raise EnvelopeError("frames must be a sequence of byte frames (header first)")
    if len(frames) == 0:
        raise EnvelopeError("the message has no frames; a header frame is required")
    if len(frames) > limits.max_frames:
        raise EnvelopeError(
            f"the message has {len(frames) - 1} tensor frames, above the limit of "
            f"{limits.max_tensors}"
        )
    try:
        views = [_byte_view(f) for f in frames]
    except (TypeError, ValueError, BufferError) as exc:
        raise EnvelopeError(f"a frame is not a byte buffer: {quote(str(exc))}") from exc
    total = sum(v.nbytes for v in views)
    if total > limits.max_message_bytes:
        raise EnvelopeError(
            f"the message is {total} bytes, above the limit of {limits.max_message_bytes}"
        )
    header_view = views[0]
    if header_view.nbytes > limits.max_header_bytes:
        raise EnvelopeError(
            f"the header frame is {header_view.nbytes} bytes, above the limit of "
            f"{limits.max_header_bytes}"
        )

    header = _decode_header(header_view)
    kind = header["kind"]
    if kind not in kinds:
        raise EnvelopeError(
            f"message kind {quote(kind)} is not one of the expected kinds {sorted(kinds)}"
        )
    if session is not None and header["session"] != session:
        raise EnvelopeError(
            f"message belongs to session {quote(header['session'])}, not the current session "
            f"{quote(session)}"
        )

    descriptors = header["tensors"]
    if len(descriptors) > limits.max_tensors:
        raise EnvelopeError(
            f"the header describes {len(descriptors)} tensors, above the limit of "
            f"{limits.max_tensors}"
        )
    if len(descriptors) != len(views) - 1:
        raise EnvelopeError(
            f"the header describes {len(descriptors)} tensors but {len(views) - 1} tensor "
            "frames arrived"
        )
    # every descriptor is checked before any tensor is built
    checked = [_check_descriptor(d, i, limits) for i, d in enumerate(descriptors)]
    tensors: dict[str, np.ndarray] = {}
    for (name, dtype_name, shape), view in zip(checked, views[1:], strict=True):
        if name in tensors:
            raise EnvelopeError(f"tensor name {quote(name)} appears twice")
        dtype = _wire_dtype(dtype_name)
        expected = math.prod(shape) * dtype.itemsize
        if expected != view.nbytes:
            raise EnvelopeError(
                f"tensor {quote(name)} ({dtype_name}, shape {tuple(shape)}) needs {expected} "
                f"bytes but its frame has {view.nbytes}"
            )
        # numpy would keep a non-canonical bool byte (e.g. 0x02) and compare it oddly
        if dtype_name == "bool" and view.nbytes and int(np.frombuffer(view, np.uint8).max()) > 1:
            raise EnvelopeError(f"bool tensor {quote(name)} holds bytes other than 0 and 1")
        try:
            array = np.frombuffer(view, dtype=dtype).reshape(shape)
        except (ValueError, TypeError) as exc:  # unreachable after the checks above; kept total
            raise EnvelopeError(
                f"tensor {quote(name)} cannot be rebuilt: {quote(str(exc))}"
            ) from exc
        array.flags.writeable = False
        tensors[name] = array

    return Envelope(
        kind=kind,
        sender=header["sender"],
        session=header["session"],
        round=header["round"],
        tensors=tensors,
        meta=header["meta"],
        seq=header["seq"],
    )


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Total size in bytes of a list of frames (bytes, memoryviews, arrays or ``zmq.Frame``)."""
    return sum(_byte_view(f).nbytes for f in frames)


# ----------------------------------------------------------------------------- helpers


def _wire_dtype(name: str) -> np.dtype:
    """The little-endian dtype of an allowed dtype name (every caller checked it is allowed)."""
    return _WIRE_DTYPES[name]


def _byte_view(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)  # zmq.Frame exposes its bytes as .buffer
    view = memoryview(buffer)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def _check_str(what: str, value: Any, *, nonempty: bool = False) -> None:
    if not isinstance(value, str):
        raise EnvelopeError(f"{what} must be a str, got {type(value).__name__}")
    if nonempty and not value:
        raise EnvelopeError(f"{what} must not be empty")
    if len(value) > MAX_NAME_CHARS:
        raise EnvelopeError(f"{what} is {len(value)} characters, above {MAX_NAME_CHARS}")


def _check_uint(what: str, value: Any, maximum: int) -> None:
    if not _is_int(value):
        raise EnvelopeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0 or value > maximum:
        raise EnvelopeError(f"{what} must be between 0 and {maximum}, got {quote(value)}")


def _check_plain(value: Any, where: str, depth: int) -> None:
    """Refuse meta that is not plain data, naming where. The check runs on every message, so
    the common case (it is plain) takes `_is_plain`, which builds no path strings; only a
    refusal walks again with them (`_refuse_unplain`)."""
    if not _is_plain(value, depth):
        _refuse_unplain(value, where, depth)


_SCALARS = frozenset({type(None), bool, int, float, str, bytes})  # exactly these: no call


def _is_plain(value: Any, depth: int) -> bool:
    """Whether `_refuse_unplain` would accept `value` (the same rules, no messages). Scalars
    of exactly the plain types (all that msgpack decodes to) are taken inline, without a call
    each; anything else, subclasses included, goes the general way."""
    if depth > MAX_META_DEPTH:
        return False
    kind = type(value)
    if kind in _SCALARS:
        return True
    if kind is dict or kind is list:
        if depth == MAX_META_DEPTH and value:
            return False  # its items would sit deeper than allowed
        items = value.values() if kind is dict else value
        if kind is dict:
            for key in value:
                if type(key) is not str and not isinstance(key, str):
                    return False
        for item in items:
            if type(item) not in _SCALARS and not _is_plain(item, depth + 1):
                return False
        return True
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return True
    if isinstance(value, list | tuple):
        for item in value:
            if not _is_plain(item, depth + 1):
                return False
        return True
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not _is_plain(item, depth + 1):
                return False
        return True
    return False


def _refuse_unplain(value: Any, where: str, depth: int) -> None:
    if depth > MAX_META_DEPTH:
        raise EnvelopeError(f"{where} is nested deeper than {MAX_META_DEPTH} levels")
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _refuse_unplain(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise EnvelopeError(
                    f"{where} has a key of type {type(key).__name__}; keys must be str"
                )
            _refuse_unplain(item, f"{where}[{quote(key, 40)}]", depth + 1)
        return
    raise EnvelopeError(
        f"{where} is a {type(value).__name__}; meta holds only str, int, float, bool, None, "
        "bytes, lists and dicts (send arrays as tensors, convert NumPy scalars with int()/float())"
    )


def _decode_header(view: memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            timestamp=0,
        )
    except EnvelopeError:
        raise
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise EnvelopeError(
            f"the header frame is not valid msgpack: {type(exc).__name__}: {quote(str(exc))}"
        ) from exc
    if not isinstance(header, dict):
        raise EnvelopeError(f"the header must be a msgpack map, got {type(header).__name__}")
    if "version" not in header:
        raise EnvelopeError("the header has no 'version' field")
    version = header["version"]
    if not _is_int(version) or version != PROTOCOL_VERSION:
        raise EnvelopeError(
            f"protocol version {quote(version)} is not supported (this side speaks version "
            f"{PROTOCOL_VERSION}); run the same securevfl version on every role"
        )
    if header.keys() != HEADER_FIELDS:  # only a wrong header builds sets to say how
        keys = set(header)
        missing = HEADER_FIELDS - keys
        if missing:
            raise EnvelopeError(f"the header is missing field(s) {sorted(missing)}")
        shown = sorted(quote(k, 40) for k in keys - HEADER_FIELDS)
        listed = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
        raise EnvelopeError(f"the header has unexpected field(s) [{listed}]")
    _check_str("kind", header["kind"], nonempty=True)
    _check_str("sender", header["sender"])
    _check_str("session", header["session"])
    _check_uint("round", header["round"], _MAX_INT64)
    _check_uint("seq", header["seq"], _MAX_UINT64)
    if not isinstance(header["meta"], dict):
        raise EnvelopeError(f"meta must be a map, got {type(header['meta']).__name__}")
    _check_plain(header["meta"], "meta", 0)
    if not isinstance(header["tensors"], list):
        raise EnvelopeError(
            f"tensors must be a list of descriptors, got {type(header['tensors']).__name__}"
        )
    return header


def _refuse_ext(code: int, data: bytes) -> Any:
    raise EnvelopeError(f"the header uses msgpack extension type {code}, which is not allowed")


def _check_descriptor(descriptor: Any, index: int, limits: Limits) -> tuple[str, str, list[int]]:
    if not isinstance(descriptor, dict) or set(descriptor) != DESCRIPTOR_FIELDS:
        raise EnvelopeError(
            f"tensor descriptor #{index} must be a map with exactly the fields "
            f"{sorted(DESCRIPTOR_FIELDS)}"
        )
    name, dtype_name, shape = descriptor["name"], descriptor["dtype"], descriptor["shape"]
    _check_str(f"tensor descriptor #{index} name", name, nonempty=True)
    if not isinstance(dtype_name, str) or dtype_name not in ALLOWED_DTYPES:
        raise EnvelopeError(
            f"tensor {quote(name)} has dtype {quote(dtype_name)}, which is not in the allowlist "
            f"{sorted(ALLOWED_DTYPES)}"
        )
    if not isinstance(shape, list):
        raise EnvelopeError(f"tensor {quote(name)} shape must be a list of ints")
    _check_shape(name, shape, _wire_dtype(dtype_name).itemsize, limits)
    return name, dtype_name, shape


def _check_shape(name: str, shape: list[Any], itemsize: int, limits: Limits) -> None:
    """Refuse a rank above the limit, a dimension that is not a non-negative int, and a
    shape whose extent (zero dimensions counted as 1) exceeds the message limit.

    The extent rule is what keeps NumPy safe: ``reshape`` checks the product of the
    non-zero dimensions against intp even when the array is empty, so ``[0, 2**29, 2**29,
    2**29]`` would make it raise a bare ValueError.
    """
    if len(shape) > limits.max_ndim:
        raise EnvelopeError(
            f"tensor {quote(name)} has {len(shape)} dimensions, above the limit of "
            f"{limits.max_ndim}"
        )
    extent = 1
    for dim in shape:
        if not _is_int(dim) or dim < 0:
            raise EnvelopeError(
                f"tensor {quote(name)} shape {quote(shape)} must hold non-negative ints"
            )
        if dim > limits.max_message_bytes:
            raise EnvelopeError(
                f"tensor {quote(name)} dimension {dim} exceeds the message limit of "
                f"{limits.max_message_bytes}"
            )
        extent *= max(dim, 1)  # stays small: each factor is at most max_message_bytes
    if extent * itemsize > limits.max_message_bytes:
        raise EnvelopeError(
            f"tensor {quote(name)} shape {tuple(shape)} spans {extent * itemsize} bytes when its "
            f"zero dimensions count as 1, which exceeds the message limit of "
            f"{limits.max_message_bytes}"
        )
