"""Errors raised by the hub and peer sockets.

Every message is a sentence that names what was awaited or who was lost and, where
there is one, the fix.
"""

from __future__ import annotations


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
