"""Cryptographic keystreams for pairwise masks, and random words for noise: AES-128-CTR from
``cryptography``.

Never NumPy's or Python's pseudo-random generators: they are not cryptographic.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

__all__ = [
    "KEYSTREAM_CHUNK_WORDS",
    "MAX_FILL_WORDS",
    "Keystream",
    "keystream_uint64",
    "random_uint64",
    "stream_key",
]

STREAM_KEY_BYTES = 16
# Keystream is produced in chunks that stay in L2 cache while they are consumed.
KEYSTREAM_CHUNK_WORDS = 1 << 15
# The largest piece one fill_words call takes: the size of the shared block of zeros.
MAX_FILL_WORDS = 1 << 16
_WORD_BYTES = 8
_AES_BLOCK_BYTES = 16
_WORDS_PER_BLOCK = _AES_BLOCK_BYTES // _WORD_BYTES
# Encrypting zeros yields the raw keystream; one shared read-only block of zeros is the input.
_ZERO_BLOCK = memoryview(bytes(MAX_FILL_WORDS * _WORD_BYTES))
# CTR counter blocks are 128-bit big-endian integers; OpenSSL increments all 128 bits.
_COUNTER_LIMIT = 1 << 128


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

    Word ``i`` of the stream is bytes ``[8i, 8i + 8)`` of AES-128-CTR under ``key`` from
    counter block 0 (safe because every stream key is used for exactly one domain).
    ``start_word`` opens the stream at word ``start_word`` (the counter is set to the block
    holding it), so disjoint ranges of one stream can be produced independently, e.g. by
    several threads. Successive fills continue the stream. Refuses a key that is not 16 bytes
    and a negative ``start_word``.
    """

    def __init__(self, key: bytes, *, start_word: int = 0) -> None:
        if not isinstance(key, bytes) or len(key) != STREAM_KEY_BYTES:
            raise ValueError(f"keystream key must be {STREAM_KEY_BYTES} bytes (use stream_key())")
        if isinstance(start_word, bool) or not isinstance(start_word, int) or start_word < 0:
            raise ValueError(f"start_word must be a non-negative int, got {start_word!r}")
        block, skip_words = divmod(start_word, _WORDS_PER_BLOCK)
        if block >= _COUNTER_LIMIT:
            raise ValueError("start_word is beyond the 2**128 blocks of one AES-CTR stream")
        counter = block.to_bytes(_AES_BLOCK_BYTES, "big")
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
        # Bound once: the hot loop calls it per chunk without attribute lookups.
        self.update_into = self._encryptor.update_into
        if skip_words:
            self._encryptor.update(bytes(skip_words * _WORD_BYTES))

    def fill_words(self, out_bytes: np.ndarray) -> None:
        """Overwrite ``out_bytes`` (a uint8 view of at most :data:`MAX_FILL_WORDS` words) with
        the next keystream bytes. No checks: the fast path for callers that own the buffer."""
        self.update_into(_ZERO_BLOCK[: out_bytes.size], out_bytes)

    def fill(self, out: np.ndarray) -> np.ndarray:
        """Overwrite ``out`` (uint64, C-contiguous) with the next ``out.size`` words; return it."""
        if out.dtype != np.uint64 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous uint64 array, got dtype {out.dtype}")
        out_bytes = out.reshape(-1).view(np.uint8)
        block = len(_ZERO_BLOCK)
        for start in range(0, out_bytes.size, block):
            stop = min(start + block, out_bytes.size)
            source = _ZERO_BLOCK if stop - start == block else _ZERO_BLOCK[: stop - start]
            self.update_into(source, out_bytes[start:stop])
        return out


def keystream_uint64(
    key: bytes, n: int, *, out: np.ndarray | None = None, start_word: int = 0
) -> np.ndarray:
    """Return ``n`` uint64 words of the AES-128-CTR keystream of ``key``, from ``start_word``.

    With ``out`` (uint64, C-contiguous, exactly ``n`` elements) the words are written into it
    without any other allocation. Deterministic for a key; refuses negative ``n`` or
    ``start_word``, a mismatched ``out`` and a key that is not 16 bytes.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if out is None:
        out = np.empty(int(n), dtype=np.uint64)
    elif out.size != n:
        raise ValueError(f"out has {out.size} elements, expected n={n}")
    return Keystream(key, start_word=start_word).fill(out)


# --- random words for noise

# a generator's key is replaced after this many bytes (NIST SP 800-90A allows far more)
_RANDOM_REKEY_BYTES = 1 << 32


class _RandomWords:
    """Uniform random bytes: the AES-128-CTR keystream of a key and counter drawn from
    ``os.urandom`` (a CTR-DRBG without derivation function, in the manner of NIST SP 800-90A),
    rekeyed from ``os.urandom`` every 2**32 bytes and in a forked child, so a child never
    repeats its parent's words. About twenty times the speed of ``os.urandom`` itself for the
    few tens of KiB one batch of noise needs. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._encryptor = None
        self._left = 0

    def _rekey(self) -> None:
        key, counter = os.urandom(STREAM_KEY_BYTES), os.urandom(_AES_BLOCK_BYTES)
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor()
        self._pid = os.getpid()
        self._left = _RANDOM_REKEY_BYTES

    def fill(self, out_bytes: np.ndarray) -> None:
        """Overwrite ``out_bytes`` (a C-contiguous uint8 array) with fresh random bytes."""
        with self._lock:
            for start in range(0, out_bytes.size, len(_ZERO_BLOCK)):
                piece = out_bytes[start : start + len(_ZERO_BLOCK)]
                if self._pid != os.getpid() or self._left < piece.size:
                    self._rekey()
                self._encryptor.update_into(_ZERO_BLOCK[: piece.size], piece)
                self._left -= piece.size


_RANDOM = _RandomWords()
if hasattr(os, "register_at_fork"):  # the child rekeys at once, not only at its next draw
    os.register_at_fork(after_in_child=lambda: setattr(_RANDOM, "_pid", -1))


def random_uint64(n: int) -> np.ndarray:
    """``n`` uniformly random uint64 words from a cryptographic generator (AES-128-CTR keyed
    by ``os.urandom``, see ``_RandomWords``): for noise that must be unpredictable, such as
    the flooding of CKKS decryptions. Refuses a negative ``n``."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    out = np.empty(int(n), dtype=np.uint64)
    _RANDOM.fill(out.view(np.uint8))
    return out
