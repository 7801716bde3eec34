"""Private set intersection by commutative blinding (ECDH-PSI) on the prime-order subgroup of
edwards25519, with libsodium through PyNaCl.

Each side maps its identifiers to points whose discrete logarithm nobody knows
(`hash_to_group`: SHA-512 of a domain tag and the identifier, then libsodium's Elligator 2
`crypto_core_ed25519_from_uniform`, which lands in the prime-order subgroup), blinds them with
its secret scalar, and the other side blinds them again. Because a·(b·H(x)) = b·(a·H(x)), the
doubly blinded sets can be compared, while a singly blinded point reveals nothing about an
identifier to anyone without the scalar (decisional Diffie-Hellman). Never H(x)·G: with a known
logarithm, the other side could strip the blinding and test guessed identifiers offline.

Protocol between the label holder A (identifiers X) and a party B (identifiers Y), the messages
shuffled so that positions carry nothing:

1. A -> B: a·H(x) for x in X, shuffled;
2. B -> A: b·(a·H(x)) in the order received, and b·H(y) for y in Y, shuffled;
3. A: a·(b·H(y)); the intersection is where the two doubly blinded lists meet; A -> B the
   positions of B's list that matched, so B learns the intersection too.

Each side learns the intersection and the size of the other's set, and nothing else about the
other's identifiers. Points are 32 bytes each on the wire. NumPy is used only to carry bytes.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from nacl import bindings as sodium

POINT_BYTES = 32
DOMAIN = b"securevfl/psi/v1"
# the libsodium calls release the GIL (cffi): blind in a few threads
THREADS = max(1, min(4, os.cpu_count() or 1))


class PsiError(ValueError):
    """A peer sent something that is not a list of valid group elements."""


def new_secret() -> bytes:
    """A uniform secret scalar mod the group order, from the OS CSPRNG."""
    while True:
        scalar = sodium.crypto_core_ed25519_scalar_reduce(os.urandom(64))
        if any(scalar):
            return scalar


def hash_to_group(identifier: str) -> bytes:
    """The point of the prime-order subgroup an identifier maps to (unknown logarithm)."""
    digest = hashlib.sha512(DOMAIN + identifier.encode("utf-8")).digest()
    return sodium.crypto_core_ed25519_from_uniform(digest[:32])


def _blind_one(args: tuple[bytes, bytes]) -> bytes:
    scalar, point = args
    return sodium.crypto_scalarmult_ed25519_noclamp(scalar, point)


def blind(scalar: bytes, points: Sequence[bytes]) -> list[bytes]:
    """scalar·P for every point (order kept). Refuses a point that is not a valid element of
    the prime-order subgroup (PsiError): a peer cannot slip in a small-order point."""
    for p in points:
        if len(p) != POINT_BYTES or not sodium.crypto_core_ed25519_is_valid_point(p):
            raise PsiError("a point is not a valid element of the prime-order subgroup")
    if len(points) < 256 or THREADS == 1:
        return [_blind_one((scalar, p)) for p in points]
    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(_blind_one, ((scalar, p) for p in points), chunksize=1024))


def blind_identifiers(scalar: bytes, identifiers: Sequence[str]) -> list[bytes]:
    """scalar·H(x) for every identifier (order kept)."""
    return blind(scalar, [hash_to_group(x) for x in identifiers])


def shuffle(n: int) -> np.ndarray:
    """A uniformly random permutation of range(n) from the OS CSPRNG (Fisher-Yates)."""
    order = np.arange(n)
    if n < 2:
        return order
    draws = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    for i in range(n - 1, 0, -1):
        # modulo bias below 2^-40 for n < 2^24
        j = int(draws[i] % np.uint64(i + 1))
        order[i], order[j] = order[j], order[i]
    return order


def to_array(points: Sequence[bytes]) -> np.ndarray:
    """Points as one uint8 array [n, 32] (one frame on the wire)."""
    if not points:
        return np.empty((0, POINT_BYTES), dtype=np.uint8)
    return np.frombuffer(b"".join(points), dtype=np.uint8).reshape(len(points), POINT_BYTES)


def from_array(array: np.ndarray, *, limit: int) -> list[bytes]:
    """Points back from a uint8 [n, 32] array; refuses another shape or more than `limit`."""
    a = np.asarray(array)
    if a.dtype != np.uint8 or a.ndim != 2 or a.shape[1] != POINT_BYTES:
        raise PsiError(f"expected points as uint8 [n, {POINT_BYTES}], got {a.dtype} {a.shape}")
    if a.shape[0] > limit:
        raise PsiError(f"{a.shape[0]} points, more than the {limit} allowed")
    return [bytes(row) for row in a]
