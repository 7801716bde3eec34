"""What the hub and the peer share: reserved kinds, argument checks, socket options."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, ClassVar, Self

import zmq

from transport.envelope import Envelope, Limits

HEARTBEAT_KIND = "heartbeat"
HELLO_KIND = "_hello"  # a peer's main socket announces itself so the hub can route to it
RESERVED_KINDS = frozenset({HEARTBEAT_KIND, HELLO_KIND})
HEARTBEAT_ROUTING_SUFFIX = "/hb"
LINGER_MS = 500  # close() drops what is still unsent after this; never hangs longer
_SCHEMES = ("tcp://", "ipc://", "inproc://")


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
