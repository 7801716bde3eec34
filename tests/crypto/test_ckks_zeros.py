"""Prepared encryptions of zero are each used once: a ciphertext's second polynomial (c1) is the
encryption of zero's own, untouched by the plaintext that encryption adds, so the chunks a
party sends show exactly which zero each one used. Read from the raw wire format."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder, CkksPublic, choose_params

PARAMS = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params  # (34, 34)


@pytest.fixture(scope="module")
def keys() -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=PARAMS)
    public = CkksPublic(context_bytes=holder.public_context_bytes(), wire="raw")
    assert public.wire_format == "raw"
    return holder, public


def _c1(chunk: bytes) -> bytes:
    """The second polynomial of a raw chunk, every prime's part."""
    n = PARAMS.poly_modulus_degree
    widths = [(b + 7) // 8 for b in PARAMS.data_bit_sizes]
    offset, parts = 4 + 4 + 32, []
    for w in widths:
        block = chunk[offset : offset + 2 * n * w]
        parts.append(block[n * w :])  # polynomial 0, then polynomial 1
        offset += 2 * n * w
    return b"".join(parts)


def test_each_prepared_zero_is_used_by_exactly_one_chunk(keys) -> None:
    holder, public = keys
    slots = public.slots
    n = 3 * slots  # three chunks a call
    zeros_c1: list[bytes] = []
    sent_c1: list[bytes] = []
    rng = np.random.default_rng(0)
    x = rng.uniform(-100, 100, n)
    for _ in range(4):
        public.prepare_zeros(n)
        assert public.prepared_zeros == 3
        zeros_c1 += [_c1(public._codec.dump(z, slots)) for z in public._zeros]
        packed = public.encrypt(x)  # the same values every call
        assert public.prepared_zeros == 0
        sent_c1 += [_c1(c) for c in packed.chunks]
        np.testing.assert_allclose(holder.decrypt_sum(packed, shape=(n,)), x, atol=1e-5)
    # every chunk carries the c1 of one prepared zero, and each zero's c1 appears exactly once
    assert Counter(sent_c1) == Counter(zeros_c1)
    assert len(set(sent_c1)) == len(sent_c1) == 12


def test_without_prepared_zeros_every_chunk_is_still_a_fresh_encryption(keys) -> None:
    _, public = keys
    assert public.prepared_zeros == 0
    x = np.ones(2 * public.slots)
    seen = [_c1(c) for _ in range(5) for c in public.encrypt(x).chunks]
    assert len(set(seen)) == len(seen) == 10


def test_a_refused_encryption_leaves_its_zeros_unused_and_never_sends_them(keys) -> None:
    _, public = keys
    public.prepare_zeros(2 * public.slots)
    ready = [_c1(public._codec.dump(z, public.slots)) for z in public._zeros]
    with pytest.raises(ValueError, match="too large"):
        public.encrypt(np.full(2 * public.slots, 2.0 ** (PARAMS.magnitude_bits + 1)))
    assert public.prepared_zeros == 2  # refused before any zero was taken
    sent = [_c1(c) for c in public.encrypt(np.ones(2 * public.slots)).chunks]
    assert sorted(sent) == sorted(ready)
    assert public.prepared_zeros == 0
