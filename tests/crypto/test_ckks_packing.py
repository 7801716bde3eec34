"""Two real values per complex CKKS slot, the chunk format on the wire (value count + SEAL's own
ciphertext serialisation) and the scratch files SEAL's binding needs: what a ciphertext costs
and carries, and that nothing but ciphertexts touches the disk."""

from __future__ import annotations

import gc
import os
import stat
import struct

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder, CkksParams, CkksPublic, choose_params

# what a Credit run with 4 parties and [secure] ckks.magnitude = 1024 chooses (12 bits)
CREDIT_1024 = choose_params(precision_bits=12, magnitude=1024.0, terms=5).params


@pytest.fixture(scope="module")
def keys() -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=CREDIT_1024)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes())


def test_one_ciphertext_carries_as_many_values_as_the_degree(keys) -> None:
    holder, public = keys
    assert CREDIT_1024 == CkksParams(4096, (56, 20), 40)
    n = CREDIT_1024.poly_modulus_degree
    assert public.slots == n  # N/2 complex slots, a real value in each part
    rng = np.random.default_rng(0)
    x = rng.uniform(-1000, 1000, n)
    x[0::2] = np.abs(x[0::2])  # real parts >= 0, imaginary parts of any sign: no mix-up
    packed = public.encrypt(x)
    assert len(packed.chunks) == 1
    out = holder.decrypt_sum(public.add([packed, public.encrypt(-x / 2)]), shape=(n,))
    np.testing.assert_allclose(out, x / 2, atol=1e-6)


def test_a_chunk_is_a_value_count_then_a_compressed_seal_ciphertext(keys) -> None:
    _, public = keys
    chunk = public.encrypt(np.arange(5.0)).chunks[0]
    assert struct.unpack_from("<I", chunk)[0] == 5
    assert chunk[4:6] == b"\x5e\xa1"  # SEAL's serialisation magic 0xA15E, little-endian
    assert chunk[9] == 2  # SEAL's compression mode: zstd
    full = public.encrypt(np.zeros(public.slots)).chunks[0]
    # 2 polynomials x 4096 coefficients of one 56-bit prime in 64-bit words: 64 KiB raw;
    # compressed to about 56 + 4 bits a word, i.e. under 4 float32s' bytes per value
    assert len(full) < 4 * 4 * public.slots  # < 16 bytes per value, 4x a float32


def test_scratch_files_hold_only_ciphertexts_in_a_private_directory(monkeypatch) -> None:
    holder = CkksKeyHolder(params=CREDIT_1024)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    seen: list[bytes] = []  # every scratch file's first bytes, at the moment SEAL wrote it
    real_open = open

    def spying_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "securevfl-ckks-" in str(path) and "r" in mode:
            seen.append(f.read(2))
            f.seek(0)
        return f

    monkeypatch.setattr("builtins.open", spying_open)
    packed = public.encrypt(np.ones(10))
    holder.decrypt_sum(public.add([packed]), shape=(10,))
    monkeypatch.undo()
    assert seen and all(head == b"\x5e\xa1" for head in seen)  # SEAL ciphertexts, no key
    dirs = [holder._codec._scratch, public._codec._scratch]
    for d in dirs:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert os.listdir(d) == []  # each file is removed right after its save or load
    del holder, public
    gc.collect()
    assert not any(os.path.exists(d) for d in dirs)
