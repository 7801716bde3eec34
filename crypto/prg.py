"""Cryptographic keystreams for pairwise masks: AES-128-CTR from ``cryptography``.

Never NumPy's or Python's pseudo-random generators: they are not cryptographic.
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = ["KEYSTREAM_CHUNK_WORDS", "Keystream", "keystream_uint64", "stream_key"]

STREAM_KEY_BYTES = 16
# Keystream is produced in chunks that stay in L2 cache while they are consumed.
KEYSTREAM_CHUNK_WORDS = 1 << 15
_WORD_BYTES = 8
# Encrypting zeros yields the raw keystream; one shared read-only block of zeros is the input.
_ZERO_BLOCK = memoryview(bytes(KEYSTREAM_CHUNK_WORDS * _WORD_BYTES))
# Counter block 0: safe because every stream key is used for exactly one domain.
_INITIAL_COUNTER_BLOCK = bytes(16)


def stream_key(*, pair_key: bytes, domain: bytes) -> bytes:
    """Derive the 16-byte AES-128 key of one mask: ``HMAC-SHA256(pair_key, domain)[:16]``.

    Distinct domains give independent keys (domain separation), so one pair key serves every
    round, group and tensor. Refuses a pair key that is not 32 bytes and an empty domain.
    """
    if not isinstance(pair_key, bytes) or len(pair_key) != 32:
        raise ValueError("pair_key must be 32 bytes (the output of pair_key())")
    if not isinstance(domain, bytes) or not domain:
        raise ValueError("domain must be non-empty bytes (use MaskDomain.encode())")
    return hmac.new(pair_key, domain, hashlib.sha256).digest()[:STREAM_KEY_BYTES]


class Keystream:
    """An AES-128-CTR keystream read sequentially as uint64 words.

    Successive :meth:`fill` calls continue the stream, so a long mask can be produced chunk by
    chunk without holding it all in memory. Refuses a key that is not 16 bytes.
    """

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != STREAM_KEY_BYTES:
            raise ValueError(f"keystream key must be {STREAM_KEY_BYTES} bytes (use stream_key())")
        cipher = Cipher(algorithms.AES(key), modes.CTR(_INITIAL_COUNTER_BLOCK))
        self._encryptor = cipher.encryptor()

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Overwrite ``out`` (uint64, C-contiguous) with the next ``out.size`` words; return it."""
        if out.dtype != np.uint64 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint64 array, got dtype {out.dtype}")
        out_bytes = out.reshape(-1).view(np.uint8)
        block = len(_ZERO_BLOCK)
        for start in range(0, out_bytes.size, block):
            stop = min(start + block, out_bytes.size)
            source = _ZERO_BLOCK if stop - start == block else _ZERO_BLOCK[: stop - start]
            self._encryptor.update_into(source, out_bytes[start:stop])
        return out


def keystream_uint64(key: bytes, n: int, *, out: np.ndarray | None = None) -> np.ndarray:
    """Return the first ``n`` uint64 words of the AES-128-CTR keystream of ``key``.

    With ``out`` (uint64, C-contiguous, exactly ``n`` elements) the words are written into it
    without any other allocation. Deterministic for a key; refuses negative ``n``, a
    mismatched ``out`` and a key that is not 16 bytes.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if out is None:
        out = np.empty(int(n), dtype=np.uint64)
    elif out.size != n:
        raise ValueError(f"out has {out.size} elements, expected n={n}")
    return Keystream(key).fill(out)
