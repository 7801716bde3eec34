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
    "MAX_STREAM_WORDS",
    "CounterStreams",
    "Keystream",
    "counter_blocks",
    "ctr_stream",
    "keystream_uint64",
    "mask_key",
    "random_uint64",
    "stream_nonce",
]

STREAM_KEY_BYTES = 16
STREAM_NONCE_BYTES = 12
# Keystream is produced in chunks that stay in L2 cache while they are consumed.
KEYSTREAM_CHUNK_WORDS = 1 << 15
# The largest piece one fill_words call takes: the size of the shared block of zeros.
MAX_FILL_WORDS = 1 << 16
_WORD_BYTES = 8
_AES_BLOCK_BYTES = 16
_WORDS_PER_BLOCK = _AES_BLOCK_BYTES // _WORD_BYTES
# Encrypting zeros yields the raw keystream; one shared read-only block of zeros is the input.
_ZERO_BLOCK = memoryview(bytes(MAX_FILL_WORDS * _WORD_BYTES))
ZERO_BYTES = _ZERO_BLOCK  # read-only zeros: the input whose CTR encryption is the keystream
# A counter block is the 12-byte nonce and a 32-bit big-endian block counter (as in GCM): one
# stream is at most 2**32 blocks, 2**33 words (64 GiB), which no call comes near.
MAX_STREAM_BLOCKS = 1 << 32
MAX_STREAM_WORDS = MAX_STREAM_BLOCKS * _WORDS_PER_BLOCK
# ECB's update_into wants room for one more block than it writes (it never writes there)
SLACK_WORDS = 2
MASK_KEY_INFO = b"securevfl/mask-key/v2"
STREAM_NONCE_PREFIX = b"securevfl/mask-nonce/v2"
# A counter block read as two native (little-endian) uint64 words: the first is nonce bytes
# 0..7, the second nonce bytes 8..11 in its low half and the big-endian counter in its high
# half. For counters that share their upper 16 bits, that high half is the byte-swapped
# upper part OR the byte-swapped lower 16 bits (disjoint bytes), so a piece of blocks is this
# template of the lower 16 bits XOR one constant: a contiguous read and one strided write
# instead of big-endian element writes (read-only; 512 KiB).
_TEMPLATE_BLOCKS = 1 << 16
_COUNTER_TEMPLATE = np.arange(_TEMPLATE_BLOCKS, dtype=np.uint32).byteswap().astype(np.uint64)
_COUNTER_TEMPLATE <<= np.uint64(32)
_COUNTER_TEMPLATE.flags.writeable = False


def mask_key(pair_key: bytes) -> bytes:
    """The 16-byte AES-128 key of a pair's masks: ``HMAC-SHA256(pair_key, MASK_KEY_INFO)[:16]``,
    one per pair and session (the pair key binds the session). Each mask under it is the
    keystream of its own nonce (:func:`stream_nonce`). Refuses a pair key that is not 32
    bytes."""
    if not isinstance(pair_key, bytes) or len(pair_key) != 32:
        raise ValueError("pair_key must be 32 bytes (the output of pair_key())")
    return hmac.digest(pair_key, MASK_KEY_INFO, "sha256")[:STREAM_KEY_BYTES]


def stream_nonce(domain: bytes) -> bytes:
    """The 12-byte CTR nonce of one mask: ``SHA-256(STREAM_NONCE_PREFIX || domain)[:12]``.

    Distinct domains give distinct nonces (a collision of 96 bits would take some 2**48
    domains under one pair key), so one pair's key serves every round, group and tensor with
    independent keystreams (domain separation). Refuses an empty domain."""
    if not isinstance(domain, bytes) or not domain:
        raise ValueError("domain must be non-empty bytes (use MaskDomain.encode())")
    return hashlib.sha256(STREAM_NONCE_PREFIX + domain).digest()[:STREAM_NONCE_BYTES]


def _check_nonce(nonce: bytes) -> None:
    if not isinstance(nonce, bytes) or len(nonce) != STREAM_NONCE_BYTES:
        raise ValueError(f"nonce must be {STREAM_NONCE_BYTES} bytes (use stream_nonce())")


class Keystream:
    """An AES-128-CTR keystream read sequentially as uint64 words.

    Word ``i`` of the stream is bytes ``[8i, 8i + 8)`` of AES-128-CTR under ``key`` from the
    counter block ``nonce || 0`` (a 32-bit big-endian block counter after the 12-byte
    ``nonce``; all zeros by default). ``start_word`` opens the stream at word ``start_word``
    (the counter is set to the block holding it), so disjoint ranges of one stream can be
    produced independently, e.g. by several threads. Successive fills continue the stream; a
    stream is at most :data:`MAX_STREAM_WORDS` words (the caller keeps within it). Refuses a
    key that is not 16 bytes, a nonce that is not 12, and a ``start_word`` outside the stream.
    """

    def __init__(self, key: bytes, *, start_word: int = 0, nonce: bytes = bytes(12)) -> None:
        if not isinstance(key, bytes) or len(key) != STREAM_KEY_BYTES:
            raise ValueError(f"keystream key must be {STREAM_KEY_BYTES} bytes (use mask_key())")
        _check_nonce(nonce)
        if isinstance(start_word, bool) or not isinstance(start_word, int) or start_word < 0:
            raise ValueError(f"start_word must be a non-negative int, got {start_word!r}")
        block, skip_words = divmod(start_word, _WORDS_PER_BLOCK)
        if block >= MAX_STREAM_BLOCKS:
            raise ValueError("start_word is beyond the 2**32 blocks of one stream")
        counter = nonce + block.to_bytes(4, "big")
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
    key: bytes,
    n: int,
    *,
    out: np.ndarray | None = None,
    start_word: int = 0,
    nonce: bytes = bytes(12),
) -> np.ndarray:
    """Return ``n`` uint64 words of the AES-128-CTR keystream of ``key`` and ``nonce``, from
    ``start_word`` (see :class:`Keystream`).

    With ``out`` (uint64, C-contiguous, exactly ``n`` elements) the words are written into it
    without any other allocation. Deterministic for a key and nonce; refuses negative ``n`` or
    ``start_word``, a mismatched ``out``, a key that is not 16 bytes and a nonce not 12.
    """
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if out is None:
        out = np.empty(int(n), dtype=np.uint64)
    elif out.size != n:
        raise ValueError(f"out has {out.size} elements, expected n={n}")
    return Keystream(key, start_word=start_word, nonce=nonce).fill(out)


# --- many streams of one key: CTR done by hand on a reusable AES context


def counter_blocks(nonce: bytes, first_block: int, count: int, out: np.ndarray) -> np.ndarray:
    """CTR's input for blocks ``first_block .. first_block + count - 1`` of the stream of
    ``nonce``: each 16-byte block is ``nonce || first_block + i`` (32-bit big-endian),
    written into ``out`` (a C-contiguous uint8 array of at least ``16 * count`` bytes); returns
    the uint8 view of those bytes. Encrypting them with AES-ECB under a key gives exactly the
    keystream :class:`Keystream` makes for that key and nonce. No checks beyond the stream's
    length: the fast path for callers that own the buffer."""
    if first_block + count > MAX_STREAM_BLOCKS:
        raise ValueError("the blocks run past the 2**32 blocks of one stream")
    if out.ctypes.data % 8 == 0:
        low, high = (int(w) for w in np.frombuffer(nonce + bytes(4), dtype=np.uint64))
        blocks64 = out[: _AES_BLOCK_BYTES * count].view(np.uint64).reshape(count, 2)
        blocks64[:, 0] = low  # nonce bytes 0..7
        done = 0
        while done < count:  # pieces that do not cross a multiple of _TEMPLATE_BLOCKS
            upper = (first_block + done) & ~(_TEMPLATE_BLOCKS - 1)
            at = first_block + done - upper
            n = min(count - done, _TEMPLATE_BLOCKS - at)
            swapped = int.from_bytes(upper.to_bytes(4, "big"), "little")
            np.bitwise_xor(
                _COUNTER_TEMPLATE[at : at + n],
                np.uint64(high | swapped << 32),
                out=blocks64[done : done + n, 1],
            )
            done += n
        return out[: _AES_BLOCK_BYTES * count]
    blocks = out[: _AES_BLOCK_BYTES * count].view(">u4").reshape(count, 4)
    blocks[:, :3] = np.frombuffer(nonce, dtype=">u4")
    blocks[:, 3] = np.arange(first_block, first_block + count, dtype=np.uint64)
    return out[: _AES_BLOCK_BYTES * count]


def ctr_stream(
    key: bytes, nonce: bytes, first_block: int
):  # -> Callable[[bytes-like, writable], int]
    """The ``update_into`` of a fresh AES-128-CTR context for ``key`` from block
    ``first_block`` of the stream of ``nonce``: call it as ``update_into(zeros, out)`` for the
    next ``len(zeros)`` keystream bytes (the bytes :func:`counter_blocks` under ECB give).
    Its set-up costs about what :func:`counter_blocks` takes for 4000 blocks, so it pays for
    long streams (a large call's), where the counter blocks of every chunk would cost more."""
    if first_block >= MAX_STREAM_BLOCKS:
        raise ValueError("the blocks run past the 2**32 blocks of one stream")
    counter = nonce + first_block.to_bytes(4, "big")
    return Cipher(algorithms.AES(key), modes.CTR(counter)).encryptor().update_into


class CounterStreams:
    """AES-128-CTR keystreams of a few keys under many nonces without a cipher object per
    stream: one AES-ECB context per key (and thread: a context serves one thread at a time)
    encrypts the counter blocks of :func:`counter_blocks`, i.e. computes CTR itself. Setting
    up an OpenSSL cipher costs about as much as encrypting 30 KiB, more with cold caches, and
    a masking party would otherwise pay it for every pair, every round. The contexts hold key
    schedules: drop the object (or :meth:`clear`) with the keys."""

    def __init__(self) -> None:
        self._local = threading.local()

    def encryptor(self, key: bytes):  # -> Callable[[bytes-like, writable], int]
        """The ``update_into`` of this thread's ECB context for ``key``: call it as
        ``update_into(blocks, out)`` with whole blocks and ``out`` at least
        ``len(blocks) + 15`` bytes long (OpenSSL's room for a partial block; the bytes past
        ``len(blocks)`` are left as they were)."""
        contexts = getattr(self._local, "contexts", None)
        if contexts is None:
            contexts = self._local.contexts = {}
        update_into = contexts.get(key)
        if update_into is None:
            if not isinstance(key, bytes) or len(key) != STREAM_KEY_BYTES:
                raise ValueError(f"keystream key must be {STREAM_KEY_BYTES} bytes")
            cipher = Cipher(algorithms.AES(key), modes.ECB())
            update_into = contexts[key] = cipher.encryptor().update_into
        return update_into

    def clear(self) -> None:
        """Drop this thread's contexts."""
        self._local.contexts = {}


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
