"""Errors raised by the hub and peer sockets, and the quoting that keeps peer text out of logs.

Every message is a sentence that names what was awaited or who was lost and, where
there is one, the fix.
"""

from __future__ import annotations

from typing import Any

# what a peer-supplied value may occupy in an error message or a log line
QUOTE_LIMIT = 80
# what a whole error reason may occupy; a longer one is cut (it stays one line)
REASON_LIMIT = 1000


def quote(value: Any, limit: int = QUOTE_LIMIT) -> str:
    """A one-line, printable, bounded rendering of ``value`` for messages and logs.

    Promises: the result is at most about ``limit`` characters plus a short marker, holds no
    control, format or non-ASCII characters (each is escaped: ``\\n``, ``\\x1b``,
    ``\\u202e``...), and shows strings quoted the way ``repr`` does. Use it for every value
    that came from a peer (names, kinds, reasons, header fields) before it reaches a log.
    """
    try:
        text = ascii(value)
    except Exception:  # a hostile __repr__ must not break the error path
        text = f"<unprintable {type(value).__name__}>"
    if len(text) > limit:
        text = f"{text[:limit]}...({len(text) - limit} more characters)"
    return text


def one_line(text: str, limit: int = REASON_LIMIT) -> str:
    """``text`` with every non-printable or non-ASCII character escaped and cut to ``limit``.

    A last line of defence for sentences that may embed peer data: whatever slipped
    through unquoted still cannot forge a log line or drive a terminal.
    """
    if text.isascii() and text.isprintable() and len(text) <= limit:
        return text
    escaped = "".join(c if c.isascii() and c.isprintable() else ascii(c)[1:-1] for c in text)
    if len(escaped) > limit:
        escaped = f"{escaped[:limit]}...(cut)"
    return escaped


class TransportError(RuntimeError):
    """A message could not be sent or received."""


class ReceiveTimeout(TransportError):
    """A receive deadline passed; the message says what was awaited and for how long."""


class PeerLost(TransportError):
    """A role stopped sending messages and heartbeats for longer than ``peer_timeout``.

    ``peer`` is the role's name (e.g. ``"party2"`` or ``"aggregator"``).
    """

    def __init__(self, peer: str, *, silent_for: float, peer_timeout: float) -> None:
        self.peer = peer
        self.silent_for = silent_for
        self.peer_timeout = peer_timeout
        super().__init__(
            f"lost {peer}: nothing (not even a heartbeat) arrived from it for "
            f"{silent_for:.1f} s (peer_timeout is {peer_timeout:g} s); it has crashed, "
            f"hung or been disconnected; restart it and rerun with --resume"
        )


class KeyRefused(TransportError):
    """The hub's ZAP authenticator refused this peer's CURVE public key."""


class HandshakeFailed(KeyRefused):
    """The CURVE handshake with the hub failed again and again, without a ZAP verdict.

    The usual cause is a ``server_public`` that is not the hub's public key (keys from
    another run or another federation): the hub cannot decrypt the peer's first handshake
    command and drops the connection, and CurveZMQ gives the peer no reason (by design: an
    unauthenticated server must not reveal anything). Other causes: the address is not a
    securevfl hub, or the hub does not run CurveZMQ. A subclass of :class:`KeyRefused` so
    that callers which stop on a refused key stop on this too; its message names the cause.
    """
