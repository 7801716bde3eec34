"""CurveZMQ keys, the federation allowlist and the ZAP authenticator that enforces it."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from transport.errors import TransportError, quote

Z85_KEY_LENGTH = 40
ROLE_NAME_MAX = 200
# a refused key retries on every reconnect; say it loudly once per key per window, then quietly
_REFUSAL_LOG_WINDOW_S = 60.0


def _as_key(value: Any, what: str) -> bytes:
    if isinstance(value, str):
        value = value.encode("ascii", "replace")
    if not isinstance(value, bytes) or len(value) != Z85_KEY_LENGTH:
        raise ValueError(f"{what} must be a {Z85_KEY_LENGTH}-character z85 CURVE key")
    try:
        z85.decode(value)
    except (ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{what} is not valid z85: {exc}") from exc
    return value


def key_fingerprint(public: bytes | str) -> str:
    """A short, stable name for a CURVE public key: ``SHA256:`` and 16 hex digits.

    Both sides print it (the hub when it refuses a key, the peer when it is refused), so an
    operator can match the two logs. A value that is not a z85 key gets ``SHA256:?``.
    """
    if isinstance(public, str):
        public = public.encode("ascii", "replace")
    try:
        raw = z85.decode(public) if len(public) == Z85_KEY_LENGTH else public
    except (ValueError, KeyError, IndexError, TypeError):
        return "SHA256:?"
    if len(raw) != 32:
        return "SHA256:?"
    return "SHA256:" + hashlib.sha256(raw).hexdigest()[:16]


def check_role_name(name: Any) -> str:
    """Return ``name`` if it can name a role on the wire; refuse it with ``ValueError`` otherwise.

    A role name is 1 to 200 printable ASCII characters without ``/`` (reserved for the
    heartbeat socket's routing id ``name + "/hb"``) or whitespace.
    """
    if not isinstance(name, str) or not 1 <= len(name) <= ROLE_NAME_MAX:
        raise ValueError(f"role name {name!r} must be a str of 1 to {ROLE_NAME_MAX} characters")
    if (
        not name.isascii()
        or not name.isprintable()
        or "/" in name
        or any(c.isspace() for c in name)
    ):
        raise ValueError(
            f"role name {name!r} must be printable ASCII without '/' or whitespace "
            "(e.g. 'party1', 'active', 'aggregator')"
        )
    return name


@dataclass(frozen=True)
class CurveKeyPair:
    """A CurveZMQ long-term key pair, both halves z85-encoded (40 ASCII bytes).

    The secret never appears in ``repr``. Construction refuses keys that are not z85 or
    whose public half does not belong to the secret half.
    """

    public: bytes
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        public = _as_key(self.public, "CURVE public key")
        secret = _as_key(self.secret, "CURVE secret key")
        if zmq.curve_public(secret) != public:
            raise ValueError("the CURVE public key does not match the secret key")
        object.__setattr__(self, "public", public)
        object.__setattr__(self, "secret", secret)

    @classmethod
    def generate(cls) -> CurveKeyPair:
        """A fresh key pair from libzmq's CSPRNG (``zmq.curve_keypair``)."""
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    def to_json(self) -> dict[str, str]:
        """``{"public": z85, "secret": z85}`` as ASCII strings (keep the secret file private)."""
        return {"public": self.public.decode("ascii"), "secret": self.secret.decode("ascii")}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CurveKeyPair:
        """Inverse of :meth:`to_json`; refuses a mapping without both z85 halves."""
        if not isinstance(data, Mapping) or not {"public", "secret"} <= set(data):
            raise ValueError(
                "a CURVE key pair needs the fields 'public' and 'secret' (z85 strings)"
            )
        return cls(public=data["public"], secret=data["secret"])


class Allowlist(Mapping[str, bytes]):
    """The federation's roles: role name -> CURVE public key (z85), with reverse lookup.

    Refuses invalid role names, keys that are not z85, and one key listed under two names
    (the key is what authenticates a role, so a shared key would make roles indistinguishable).
    """

    def __init__(self, publics: Mapping[str, bytes | str]) -> None:
        by_name: dict[str, bytes] = {}
        by_key: dict[bytes, str] = {}
        for name, public in publics.items():
            check_role_name(name)
            key = _as_key(public, f"public key of {name!r}")
            if key in by_key:
                raise ValueError(
                    f"roles {by_key[key]!r} and {name!r} have the same CURVE public key; "
                    "every role needs its own key pair (run `securevfl keys`)"
                )
            by_name[name] = key
            by_key[key] = name
        self._by_name = by_name
        self._by_key = by_key

    def name_of(self, public: bytes | str) -> str | None:
        """The role whose z85 public key is ``public``, or None if it is not allowlisted."""
        if isinstance(public, str):
            public = public.encode("ascii", "replace")
        return self._by_key.get(public)

    def __getitem__(self, name: str) -> bytes:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"Allowlist({sorted(self._by_name)})"

    def to_json(self) -> dict[str, str]:
        """``{role: z85 public key}`` as ASCII strings."""
        return {name: key.decode("ascii") for name, key in self._by_name.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, str]) -> Allowlist:
        """Inverse of :meth:`to_json`."""
        return cls(dict(data))


class AllowlistAuthenticator(ThreadAuthenticator):
    """A ZAP handler that admits exactly the allowlisted CURVE keys.

    The authenticated ZMQ ``User-Id`` of a connection is its role name, so a receiver reads
    ``frame.get("User-Id")`` to learn who really sent a message. Unknown keys are refused and
    logged at WARNING (once per key per minute; repeats at DEBUG) with the key, its
    :func:`key_fingerprint` and the client's address.

    It cannot log the role a refused client claims: a ZAP request carries only the domain,
    the client's IP address, the server's own routing id and the client's public key, and
    the client's routing id (where its role name is) arrives only after ZAP has answered.
    Instead the warning lists the allowlisted roles that have not connected yet (the hub
    keeps :attr:`connected` up to date), one of which is most likely the refused client.
    """

    def __init__(
        self, context: zmq.Context, allowlist: Allowlist, *, logger: logging.Logger
    ) -> None:
        super().__init__(context=context, log=logging.getLogger("transport.zap"))
        self.allowlist = allowlist
        self.logger = logger
        self.refused = 0
        # roles whose connection the hub has seen; replaced whole, so reading it is thread-safe
        self.connected: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._last_warned: dict[bytes, float] = {}
        self._address = "?"
        self.configure_curve_callback(domain="*", credentials_provider=self)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # remember the client's address for callback(), which pyzmq calls with the key only
        self._address = msg[3].decode("ascii", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials check for one connection; ``key`` is the client's z85 public key."""
        if self.allowlist.name_of(key) is not None:
            return True
        with self._lock:
            self.refused += 1
            now = time.monotonic()
            last = self._last_warned.get(key)
            loud = last is None or now - last >= _REFUSAL_LOG_WINDOW_S
            if loud:
                if len(self._last_warned) > 4096:  # many distinct keys: forget the oldest
                    self._last_warned.pop(next(iter(self._last_warned)))
                self._last_warned[key] = now
        absent = sorted(set(self.allowlist) - self.connected)
        self.logger.log(
            logging.WARNING if loud else logging.DEBUG,
            "refused a connection from %s: peer with CURVE key %s (%s) is not in the federation "
            "allowlist; the role it claims cannot be known before authentication (roles not "
            "connected yet: %s); add its key with `securevfl keys` or give that role this "
            "federation's keys directory",
            quote(self._address, 60),
            quote(key.decode("ascii", "replace"))[1:-1],
            key_fingerprint(key),
            absent or "none",
        )
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        # pyzmq passes the raw 32-byte key here (the callback gets it z85-encoded)
        name = self.allowlist.name_of(z85.encode(client_public_key))
        if name is None:  # unreachable: only called after callback() admitted the key
            raise TransportError("ZAP admitted a key that is not in the allowlist")
        return name


def start_authenticator(
    context: zmq.Context, allowlist: Allowlist, *, logger: logging.Logger
) -> AllowlistAuthenticator:
    """Start a ZAP authenticator thread on ``context`` that admits only ``allowlist`` keys.

    Start it before binding the CURVE server socket: without a ZAP handler libzmq admits any
    CURVE client. There can be only one per context (ZAP binds ``inproc://zeromq.zap.01``);
    a second raises ``TransportError``. Stop it with ``.stop()`` after closing the sockets.
    """
    auth = AllowlistAuthenticator(context, allowlist, logger=logger)
    try:
        auth.start()
    except zmq.ZMQError as exc:
        auth.stop()
        if exc.errno == zmq.EADDRINUSE:
            raise TransportError(
                "this zmq.Context already runs a ZAP authenticator (one hub per context); "
                "give each Hub its own context"
            ) from exc
        raise
    return auth
