"""The unfused masked-sum algorithm, kept as the specification of the fast path.

This is the code of ``FixedPointEncoder.encode`` and ``MaskedSumParty.mask`` before they were
fused, unchanged in structure (the keystreams of version 2: one AES key per pair, a nonce per
domain): tests check the fused path against it bit for bit, and the
benchmarks measure it as the "before". Never on the hot path.
"""

from __future__ import annotations

import numpy as np

from crypto.fixedpoint import ENCODE_CHUNK_WORDS, FixedPointEncoder
from crypto.masking import MaskDomain
from crypto.prg import KEYSTREAM_CHUNK_WORDS, Keystream, mask_key, stream_nonce

__all__ = ["reference_encode", "reference_mask"]


def reference_encode(encoder: FixedPointEncoder, x: np.ndarray) -> np.ndarray:
    """``int64(rint(float64(x) * 2**frac_bits))`` as uint64 of ``x.shape``, chunk by chunk
    through a float64 scratch; clips or refuses (the encoder's :meth:`refusal`) like the
    encoder."""
    x = encoder.check_dtype(x)
    flat_in = x.reshape(-1)
    out = np.empty(flat_in.size, dtype=np.uint64)
    flat_out = out.view(np.int64)
    scratch = np.empty(min(ENCODE_CHUNK_WORDS, flat_in.size), dtype=np.float64)
    scale = 2.0**encoder.frac_bits
    for start in range(0, flat_in.size, ENCODE_CHUNK_WORDS):
        stop = min(start + ENCODE_CHUNK_WORDS, flat_in.size)
        chunk, buffer = flat_in[start:stop], scratch[: stop - start]
        # One fix to version 1: compare as float64 (NumPy rounded the bound to float16/32).
        lo, hi = float(chunk.min()), float(chunk.max())
        if not (lo >= -encoder.bound and hi <= encoder.bound):
            if encoder.on_overflow == "raise" or not (np.isfinite(lo) and np.isfinite(hi)):
                raise encoder.refusal(flat_in)
            np.clip(chunk, -encoder.bound, encoder.bound, out=buffer, dtype=np.float64)
            np.multiply(buffer, scale, out=buffer)
        else:
            np.multiply(chunk, scale, out=buffer, dtype=np.float64)
        np.rint(buffer, out=buffer)
        np.copyto(flat_out[start:stop], buffer, casting="unsafe")
    return out.reshape(x.shape)


def reference_mask(
    x: np.ndarray,
    *,
    encoder: FixedPointEncoder,
    name: str,
    pair_keys: dict[str, bytes],
    domain: MaskDomain,
) -> np.ndarray:
    """One party's masked contribution, unfused: encode, then for each other member v of
    ``domain.group`` add (``name < v``) or subtract the AES-128-CTR keystream of
    ``mask_key(pair_keys[v])`` from the nonce ``stream_nonce(domain.encode())``, chunk by
    chunk, with OpenSSL's own CTR mode. No refusals beyond the encoder's, no bookkeeping of
    used domains. (Version 1 keyed each mask by ``HMAC(pair key, domain)``, one AES key set-up
    per pair and round; version 2 keys each pair once and separates domains by the nonce.)"""
    masked = reference_encode(encoder, x)
    domain_bytes = domain.encode()
    streams = [
        (
            Keystream(mask_key(pair_keys[peer]), nonce=stream_nonce(domain_bytes)),
            np.add if name < peer else np.subtract,
        )
        for peer in domain.group
        if peer != name
    ]
    flat = masked.reshape(-1)
    keystream_buffer = np.empty(min(KEYSTREAM_CHUNK_WORDS, flat.size), dtype=np.uint64)
    for start in range(0, flat.size, KEYSTREAM_CHUNK_WORDS):
        chunk = flat[start : start + KEYSTREAM_CHUNK_WORDS]
        keystream = keystream_buffer[: chunk.size]
        for stream, combine in streams:
            stream.fill(keystream)
            combine(chunk, keystream, out=chunk)
    return masked
