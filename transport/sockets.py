"""What the hub and the peer share: reserved kinds, argument checks, socket options."""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import zmq

from transport.envelope import Envelope, Limits

HEARTBEAT_KIND = "heartbeat"
HELLO_KIND = "_hello"  # a peer's main socket announces itself so the hub can route to it
RESERVED_KINDS = frozenset({HEARTBEAT_KIND, HELLO_KIND})
HEARTBEAT_ROUTING_SUFFIX = "/hb"
ROUTING_TOKEN_BYTES = 16  # 128 bits: a routing id nobody else can guess
_TOKEN = re.compile(f"[0-9a-f]{{{2 * ROUTING_TOKEN_BYTES}}}")
LINGER_MS = 500  # close() drops what is still unsent after this; never hangs longer
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def readable(socket: zmq.Socket) -> bool:
    """Whether a message is waiting on `socket` (its ZMQ_EVENTS; no system call, no exception:
    a drain loop asks this instead of catching ``zmq.Again`` from a non-blocking receive, whose
    exception costs more than the check on every call of a busy round)."""
    return bool(socket.get(_EVENTS) & _POLLIN)


# plain ints: pyzmq's option and flag enums cost an Enum call per `&` (a drain loop asks this
# several times a message)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)


def send_frames(socket: zmq.Socket, frames: Sequence[Any], *, flags: int = 0) -> None:
    """``socket.send_multipart(frames, flags=flags, copy=False)`` without its per-frame Enum
    arithmetic (``SNDMORE | flags`` on pyzmq's flag enums costs microseconds a frame, on every
    message); the same frames, flags and errors."""
    last = len(frames) - 1
    send = socket.send
    for i, part in enumerate(frames):
        send(part, flags | _SNDMORE if i < last else flags, copy=False)


def is_inproc(endpoint: str) -> bool:
    return endpoint.startswith("inproc://")


def check_endpoint(endpoint: str, *, curve: bool, context: zmq.Context | None) -> None:
    """Refuse endpoints this transport cannot secure, with the reason and the fix."""
    if not isinstance(endpoint, str) or not endpoint.startswith(_SCHEMES):
        raise ValueError(
            f"endpoint {endpoint!r} must start with tcp://, ipc:// or inproc:// "
            "(e.g. tcp://127.0.0.1:5555)"
        )
    if is_inproc(endpoint):
        if curve:
            raise ValueError(
                f"endpoint {endpoint!r} is inproc://, where libzmq runs neither CURVE nor ZAP "
                "(messages would pass unauthenticated); pass curve=False for an in-process "
                "channel, or use tcp://127.0.0.1:0"
            )
        if context is None:
            raise ValueError(
                f"endpoint {endpoint!r} is inproc://, which only works inside one zmq.Context; "
                "pass the hub's context as context="
            )
    elif not curve:
        raise ValueError(
            f"curve=False is only allowed for inproc:// endpoints, not {endpoint!r}: "
            "every network connection must be CurveZMQ-encrypted and authenticated"
        )


def new_routing_id(name: str, *, heartbeat: bool = False) -> bytes:
    """A fresh routing id for one socket of role ``name``: ``name/<token>`` (main socket) or
    ``name/hb/<token>`` (heartbeat socket), the token 128 random bits in hex.

    Why a secret token: a ROUTER cannot stop a client from choosing its routing id, and with
    ``ROUTER_HANDOVER`` a second connection that presents an existing id takes the first
    one's place. Ids that only their owner knows (they travel inside the CurveZMQ-encrypted
    handshake and the hub never logs them) make that takeover impossible for anyone else.
    """
    middle = HEARTBEAT_ROUTING_SUFFIX if heartbeat else ""
    return f"{name}{middle}/{secrets.token_hex(ROUTING_TOKEN_BYTES)}".encode("ascii")


@dataclass(frozen=True)
class RoutingId:
    """What a routing id claims: a role ``name``, whether it is the ``heartbeat`` socket,
    and whether it carries an unguessable token (only those are routed to)."""

    name: str
    heartbeat: bool
    tokened: bool


def parse_routing_id(rid: bytes) -> RoutingId | None:
    """Read ``name``, ``name/hb``, ``name/<token>`` or ``name/hb/<token>``; None otherwise.

    The name is only a claim: the hub accepts it when it equals the connection's
    CURVE-authenticated User-Id. A hub sees the same few routing ids on every message: the
    answers for the last `_ROUTING_CACHE` of them are kept (an immutable answer per id).
    """
    if not isinstance(rid, bytes):
        return _parse_routing_id(rid)
    return _parse_routing_id_cached(rid)


def _parse_routing_id(rid: bytes) -> RoutingId | None:
    try:
        text = rid.decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = text.split("/")
    if not parts[0] or not (text.isprintable() and 1 <= len(parts) <= 3):
        return None
    tokened = len(parts) > 1 and _TOKEN.fullmatch(parts[-1]) is not None
    middle = parts[1 : len(parts) - 1] if tokened else parts[1:]
    if middle not in ([], [HEARTBEAT_ROUTING_SUFFIX[1:]]):
        return None
    return RoutingId(name=parts[0], heartbeat=bool(middle), tokened=tokened)


_ROUTING_CACHE = 256
_parse_routing_id_cached = functools.lru_cache(maxsize=_ROUTING_CACHE)(_parse_routing_id)


def forget_routing_ids() -> None:
    """Drop the parsed routing ids kept for speed (they hold the peers' secret tokens): a hub
    calls it when it closes, so no token outlives the hub that needed it."""
    _parse_routing_id_cached.cache_clear()


def describe_routing_id(rid: bytes) -> str:
    """A loggable rendering of a routing id: its token (a secret) replaced by ``<token>``."""
    parsed = parse_routing_id(rid)
    if parsed is None:
        return f"0x{rid[:64].hex()}" + ("..." if len(rid) > 64 else "")
    text = parsed.name + (HEARTBEAT_ROUTING_SUFFIX if parsed.heartbeat else "")
    if parsed.tokened:
        text += "/<token>"
    return repr(text)


@dataclass
class Received:
    """One message as :func:`recv_bounded` kept it.

    ``frames`` holds every frame of a message within the limits, or only its first
    ``prefix + 1`` frames (enough to tell who sent it) when ``overflow`` says which limit
    it broke. ``nframes`` / ``nbytes`` count the envelope frames (after ``prefix``) that
    arrived, kept or not.
    """

    frames: list[zmq.Frame]
    nframes: int
    nbytes: int
    overflow: str | None = None


def recv_bounded(socket: zmq.Socket, *, limits: Limits, prefix: int = 0) -> Received:
    """Receive one whole message without keeping more of it than ``limits`` allow.

    ``prefix`` frames (the ROUTER's routing id) come before the envelope and are not counted.
    Promises: the message is consumed to its last frame, so the next call starts at the next
    message; at most ``limits.max_frames`` envelope frames and ``limits.max_message_bytes``
    envelope bytes (plus the one frame that crosses the line, which ``zmq.MAXMSGSIZE``
    caps) are held at once; frames past a limit are released as they arrive (zero-copy
    frames: nothing is copied). Raises ``zmq.Again`` when no message is waiting.

    It cannot bound what libzmq itself holds: libzmq queues all frames of a multipart
    message before it hands over the first, and ``MAXMSGSIZE`` caps each frame, not their
    number (see ``Hub``'s docstring).
    """
    kept: list[zmq.Frame] = []
    nframes = nbytes = 0
    overflow = False
    index = 0
    frame = socket.recv(flags=zmq.NOBLOCK, copy=False)
    while True:
        if index < prefix:
            kept.append(frame)
        else:
            nframes += 1
            nbytes += len(frame)
            if not overflow and (nframes > limits.max_frames or nbytes > limits.max_message_bytes):
                overflow = True
                del kept[prefix + 1 :]  # keep only what identifies the sender
            if not overflow or index == prefix:
                kept.append(frame)
        if not frame.more:
            break
        # the rest of a multipart message is already queued: this never waits
        frame = socket.recv(flags=zmq.NOBLOCK, copy=False)
        index += 1
    reason = None
    if overflow and nframes > limits.max_frames:
        reason = (
            f"the message has {nframes - 1} tensor frames ({nbytes} bytes in all), above the "
            f"limit of {limits.max_tensors}; it was dropped without being decoded"
        )
    elif overflow:
        reason = (
            f"the message is {nbytes} bytes, above the limit of {limits.max_message_bytes}; "
            "it was dropped without being decoded"
        )
    return Received(frames=kept, nframes=nframes, nbytes=nbytes, overflow=reason)


def check_kinds(kinds: Collection[str]) -> frozenset[str]:
    if isinstance(kinds, str) or not all(isinstance(k, str) and k for k in kinds):
        raise ValueError(f"kinds must be a collection of non-empty str, got {kinds!r}")
    reserved = RESERVED_KINDS.intersection(kinds)
    if reserved:
        raise ValueError(f"kinds {sorted(reserved)} are reserved for the transport itself")
    return frozenset(kinds)


def check_timing(heartbeat_interval: float, peer_timeout: float) -> None:
    if not heartbeat_interval > 0:
        raise ValueError(f"heartbeat_interval must be positive, got {heartbeat_interval!r}")
    if not peer_timeout >= 2 * heartbeat_interval:
        raise ValueError(
            f"peer_timeout ({peer_timeout!r} s) must be at least twice heartbeat_interval "
            f"({heartbeat_interval!r} s), or one late heartbeat would count as a lost peer"
        )


def check_timeout(timeout: float) -> None:
    if not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")


def first_seq() -> int:
    """Start sequence numbers at the wall clock in microseconds.

    A restarted process then continues above the numbers its previous run used, so the
    receiver's replay check (strictly increasing ``seq`` per socket) does not refuse it.
    """
    return time.time_ns() // 1000


def configure_socket(
    socket: zmq.Socket,
    *,
    limits: Limits,
    heartbeat_interval: float,
    peer_timeout: float,
) -> None:
    """Options every hub and peer socket gets: linger, size cap, send timeout, ZMTP pings."""
    socket.setsockopt(zmq.LINGER, LINGER_MS)
    # second line of defence: libzmq drops a connection that sends a bigger frame
    socket.setsockopt(zmq.MAXMSGSIZE, limits.hard_frame_cap)
    socket.setsockopt(zmq.SNDTIMEO, max(1, int(peer_timeout * 1000)))
    # ZMTP-level pings let libzmq drop dead connections, which frees a restarted peer's identity
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat_interval * 1000)))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(peer_timeout * 1000)))
    # TTL travels in deciseconds on the wire: a multiple of 100 ms, at most 6553.5 s
    socket.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_500, max(100, int(peer_timeout * 10) * 100)))


class Endpoint:
    """What `Hub` and `Peer` share: stamping outgoing envelopes (sender, session, sequence
    number) and the context-manager protocol. Subclasses set `name`, `session`, `_seq` and
    define `close()`."""

    word: ClassVar[str] = "endpoint"  # "hub" or "peer", for messages
    name: str
    session: str | None
    _seq: int

    def close(self, *, linger: float = LINGER_MS / 1000) -> None:
        raise NotImplementedError

    def _stamp(self, env: Envelope) -> Envelope:
        if self.session is not None:
            if not env.session:
                env.session = self.session
            elif env.session != self.session:
                raise ValueError(
                    f"envelope session {env.session!r} differs from the {self.word}'s session "
                    f"{self.session!r}"
                )
        env.sender = self.name
        self._seq += 1
        env.seq = self._seq
        return env

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
