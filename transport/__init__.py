"""ZeroMQ transport for securevfl: CurveZMQ-authenticated hub/peer sockets carrying envelopes.

An envelope is one msgpack header frame plus one raw frame per NumPy tensor; nothing is ever
pickled. The aggregator binds a :class:`Hub` (ROUTER); every other role connects a
:class:`Peer` (DEALER). Only NumPy, msgpack and pyzmq are used here: no ML, no crypto.
"""

from transport.curve import (
    Allowlist,
    AllowlistAuthenticator,
    CurveKeyPair,
    key_fingerprint,
    start_authenticator,
)
from transport.envelope import (
    ALLOWED_DTYPES,
    PROTOCOL_VERSION,
    Envelope,
    EnvelopeError,
    Limits,
    pack,
    unpack,
)
from transport.errors import HandshakeFailed, KeyRefused, PeerLost, ReceiveTimeout, TransportError
from transport.hub import Hub
from transport.peer import Peer
from transport.sockets import HEARTBEAT_KIND, HELLO_KIND, RESERVED_KINDS

__all__ = [
    "ALLOWED_DTYPES",
    "Allowlist",
    "AllowlistAuthenticator",
    "CurveKeyPair",
    "Envelope",
    "EnvelopeError",
    "HEARTBEAT_KIND",
    "HELLO_KIND",
    "HandshakeFailed",
    "Hub",
    "KeyRefused",
    "Limits",
    "PROTOCOL_VERSION",
    "Peer",
    "PeerLost",
    "RESERVED_KINDS",
    "ReceiveTimeout",
    "TransportError",
    "key_fingerprint",
    "pack",
    "start_authenticator",
    "unpack",
]
