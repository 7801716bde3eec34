"""Long-term X25519 masking keys and the pairwise key agreement behind the masks.

A party's masking key pair is separate from its CurveZMQ key; its public half is pinned in the
federation config, so the hub cannot substitute it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

__all__ = ["MaskingKeyPair", "PAIR_KEY_INFO", "length_prefixed", "pair_key"]

X25519_KEY_BYTES = 32
PAIR_KEY_BYTES = 32
PAIR_KEY_INFO = b"securevfl/mask-pair/v1"


def length_prefixed(field_bytes: bytes) -> bytes:
    """Encode one field as a 4-byte big-endian length followed by its bytes (unambiguous)."""
    return len(field_bytes).to_bytes(4, "big") + field_bytes


def _public_of(private: bytes) -> bytes:
    public_key = X25519PrivateKey.from_private_bytes(private).public_key()
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _require_key_bytes(value: Any, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != X25519_KEY_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise ValueError(f"{what} must be {X25519_KEY_BYTES} raw bytes (X25519), got {got}")
    return value


@dataclass(frozen=True)
class MaskingKeyPair:
    """A party's long-term X25519 key pair for pairwise masks (raw 32-byte keys).

    Refuses keys of the wrong length and a public key that does not belong to the private key.
    The private key is left out of ``repr``.
    """

    private: bytes = field(repr=False)
    public: bytes

    def __post_init__(self) -> None:
        _require_key_bytes(self.private, "private")
        _require_key_bytes(self.public, "public")
        if _public_of(self.private) != self.public:
            raise ValueError("public key does not match the private key of this masking key pair")

    @classmethod
    def generate(cls) -> MaskingKeyPair:
        """Make a fresh key pair from the operating system's CSPRNG (via ``cryptography``)."""
        private_key = X25519PrivateKey.generate()
        private = private_key.private_bytes_raw()
        return cls(private=private, public=_public_of(private))

    def to_json(self) -> dict[str, str]:
        """Return ``{"private": hex, "public": hex}``; the result holds the secret key."""
        return {"private": self.private.hex(), "public": self.public.hex()}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> MaskingKeyPair:
        """Inverse of :meth:`to_json`; refuses missing fields, bad hex and mismatched halves."""
        try:
            private, public = bytes.fromhex(d["private"]), bytes.fromhex(d["public"])
        except KeyError as missing:
            raise ValueError(f"masking key pair JSON lacks the field {missing}") from None
        except (TypeError, ValueError) as bad:
            raise ValueError(f"masking key pair JSON holds a non-hex key: {bad}") from None
        return cls(private=private, public=public)


def pair_key(*, my_private: bytes, peer_public: bytes, session: bytes, me: str, peer: str) -> bytes:
    """Derive the 32-byte key shared by parties ``me`` and ``peer`` for one session.

    ``HKDF-SHA256(X25519(my_private, peer_public), salt=session, info=PAIR_KEY_INFO +
    length-prefixed sorted (me, peer))``. Symmetric: both parties derive the same key; distinct
    sessions give unrelated keys. Refuses ``me == peer``, empty names or session, keys that are
    not 32 bytes, and a peer public key of low order (all-zero shared secret).
    """
    _require_key_bytes(my_private, "my_private")
    _require_key_bytes(peer_public, "peer_public")
    if not isinstance(session, bytes) or not session:
        raise ValueError("session must be non-empty bytes (the federation's session id)")
    for name in (me, peer):
        if not isinstance(name, str) or not name:
            raise ValueError(f"party names must be non-empty strings, got {name!r}")
    if me == peer:
        raise ValueError(f"a party cannot derive a pair key with itself ({me!r})")
    try:
        shared = X25519PrivateKey.from_private_bytes(my_private).exchange(
            X25519PublicKey.from_public_bytes(peer_public)
        )
    except ValueError as low_order:
        raise ValueError(
            f"the public key pinned for {peer!r} is a low-order point (X25519 shared secret is "
            "all zeros): it would give a mask every observer can compute; pin a real key"
        ) from low_order
    first, second = sorted((me, peer))
    info = PAIR_KEY_INFO + length_prefixed(first.encode()) + length_prefixed(second.encode())
    hkdf = HKDF(algorithm=hashes.SHA256(), length=PAIR_KEY_BYTES, salt=session, info=info)
    return hkdf.derive(shared)
