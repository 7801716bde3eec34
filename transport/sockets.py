"""What the hub and the peer share: reserved kinds, argument checks, socket options."""

from __future__ import annotations

import functools
import logging
import math
import re
import secrets
import time
from collections.abc import Callable, Collection, Sequence
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


# rejected messages: the first few per sender at WARNING, then one count per window (an
# allowlisted peer can send thousands of tiny invalid messages a second)
REJECT_LOG_WINDOW_S = 60.0
REJECT_LOG_BURST = 5
# senders tracked one by one; any more share one count (names are peer text on inproc)
_REJECT_LOG_MAX_SENDERS = 256


class _Rejections:
    """One sender's rejections in the current log window."""

    __slots__ = ("window_end", "warned", "suppressed", "since", "last")

    def __init__(self) -> None:
        self.window_end = -math.inf
        self.warned = 0
        self.suppressed = 0
        self.since = 0.0
        self.last = ""


class RejectionLog:
    """The log of rejected messages, rate-limited per sender: the first ``burst`` rejections of
    a sender in a window of ``window_s`` seconds are logged at WARNING with their reason, the
    rest at DEBUG; once the window is over, one WARNING says how many were rejected since and
    the last reason (at the sender's next rejection or at :meth:`flush`, which the hub and the
    peer call while they wait, and with ``final=True`` when they close). While a sender keeps
    being rejected it gets that one line per window; after a window with no rejection beyond
    its burst it gets its burst again. Nothing is done for accepted messages; a rejection
    costs a dict look-up and one log call. At most ``_REJECT_LOG_MAX_SENDERS`` senders are
    tracked one by one; any more share one count."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        window_s: float | None = None,
        burst: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.window_s = REJECT_LOG_WINDOW_S if window_s is None else float(window_s)
        self.burst = REJECT_LOG_BURST if burst is None else int(burst)
        self._clock = clock
        self._senders: dict[str | None, _Rejections] = {}
        self._suppressed = 0  # rejections at DEBUG not yet summed up in a WARNING, all senders

    def rejected(self, sender: str | None, who: str, reason: str) -> None:
        """Log one rejected message from ``sender`` (the authenticated role, None when none
        could be told), described in the line as ``who``, refused for ``reason``."""
        known = sender in self._senders or len(self._senders) < _REJECT_LOG_MAX_SENDERS
        key = sender if known else None
        state = self._senders.get(key)
        if state is None:
            state = self._senders[key] = _Rejections()
        now = self._clock()
        if now >= state.window_end:
            self._next_window(key, state, now)
        if state.warned < self.burst:
            state.warned += 1
            if state.warned < self.burst:
                self.logger.warning("rejected a message from %s: %s", who, reason)
            else:
                self.logger.warning(
                    "rejected a message from %s: %s (more rejections from %s are logged at "
                    "DEBUG, with a count every %.0f s)",
                    who,
                    reason,
                    self._name(key),
                    self.window_s,
                )
            return
        if not state.suppressed:
            state.since = now
        state.suppressed += 1
        state.last = reason
        self._suppressed += 1
        self.logger.debug("rejected a message from %s: %s", who, reason)

    def flush(self, *, final: bool = False) -> None:
        """Say how many rejections were logged at DEBUG for each sender whose window is over
        (every sender if ``final``). Costs nothing while there are none."""
        if not self._suppressed:
            return
        now = self._clock()
        for key, state in self._senders.items():
            if not state.suppressed:
                continue
            if final:
                self._summarize(key, state, now)
            elif now >= state.window_end:
                self._next_window(key, state, now)

    def _next_window(self, key: str | None, state: _Rejections, now: float) -> None:
        # a sender still rejected beyond its burst gets its count and stays quiet; one that
        # was not gets its burst again
        state.warned = self.burst if state.suppressed else 0
        self._summarize(key, state, now)
        state.window_end = now + self.window_s

    def _summarize(self, key: str | None, state: _Rejections, now: float) -> None:
        if not state.suppressed:
            return
        self.logger.warning(
            "rejected %d more message%s from %s in the last %.0f s (logged at DEBUG); the "
            "last one: %s",
            state.suppressed,
            "" if state.suppressed == 1 else "s",
            self._name(key),
            max(now - state.since, 0.0),
            state.last,
        )
        self._suppressed -= state.suppressed
        state.suppressed = 0

    @staticmethod
    def _name(key: str | None) -> str:
        return "unidentified senders" if key is None else key
