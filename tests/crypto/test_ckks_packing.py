"""Two real values per complex CKKS slot, the two chunk formats on the wire (value count, then the
raw coefficients or SEAL's own serialisation) and the scratch files only SEAL's format needs:
what a ciphertext costs and carries, and that nothing but ciphertexts touches the disk."""

from __future__ import annotations

import gc
import os
import stat
import struct

import numpy as np
import pytest

from crypto.ckks import (
    WIRE_ENV,
    CkksError,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    PackedCiphertexts,
)

# one data prime: the coefficient encoding (what the slot encoding's sizing chose for a Credit
# run with [secure] ckks.magnitude = 1024)
CREDIT_1024 = CkksParams(4096, (57,), 41, special_prime=False)


# two data primes: the slot encoding (what its sizing chose for a Credit run at the bound 2^20)
CREDIT_DEFAULT = CkksParams(4096, (34, 34), 41, special_prime=False)


@pytest.fixture(scope="module")
def keys() -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=CREDIT_1024)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes(), wire="seal")


def test_one_ciphertext_carries_as_many_values_as_the_degree(keys) -> None:
    holder, public = keys
    assert CREDIT_1024.encoding == "coefficients" and CREDIT_DEFAULT.encoding == "slots"
    n = CREDIT_1024.poly_modulus_degree
    assert public.slots == n  # one value per coefficient
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
    # 2 polynomials x 4096 coefficients of one 57-bit prime in 64-bit words: 64 KiB raw;
    # compressed to about 57 + 4 bits a word, i.e. under 4 float32s' bytes per value
    assert len(full) < 4 * 4 * public.slots  # < 16 bytes per value, 4x a float32


def test_scratch_files_hold_only_ciphertexts_in_a_private_directory(monkeypatch) -> None:
    holder = CkksKeyHolder(params=CREDIT_1024)
    public = CkksPublic(context_bytes=holder.public_context_bytes(), wire="seal")
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


# --- the raw format: coefficients copied out of SEAL's memory, no file, no compression -----------


@pytest.fixture(scope="module")
def default_keys() -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=CREDIT_DEFAULT)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes())


def _raw_layout(params: CkksParams) -> tuple[list[int], int]:
    """Bytes per coefficient of each data prime, and the raw chunk's total size."""
    widths = [(b + 7) // 8 for b in params.data_bit_sizes]
    return widths, 4 + 4 + 32 + 2 * params.poly_modulus_degree * sum(widths)


def test_raw_is_the_default_and_its_layout(default_keys) -> None:
    _, public = default_keys
    assert CREDIT_DEFAULT == CkksParams(4096, (34, 34), 41, special_prime=False)
    assert public.wire_format == "raw"
    chunk = public.encrypt(np.arange(5.0)).chunks[0]
    widths, size = _raw_layout(CREDIT_DEFAULT)
    assert widths == [5, 5]  # 34 bits in 5 bytes each
    assert struct.unpack_from("<I", chunk)[0] == 5
    assert chunk[4:8] == b"CKR1"
    assert len(chunk) == size == 81_960  # 20 bytes per value: as small as SEAL's zstd output
    seal = CkksPublic(context_bytes=default_keys[0].public_context_bytes(), wire="seal")
    assert len(chunk) <= 1.02 * len(seal.encrypt(np.arange(5.0)).chunks[0])


def test_raw_round_trip_is_byte_exact_and_sums_across_formats(default_keys) -> None:
    holder, public = default_keys
    seal = CkksPublic(context_bytes=holder.public_context_bytes(), wire="seal")
    rng = np.random.default_rng(3)
    n = 2 * public.slots + 11
    xs = [rng.uniform(-1000, 1000, n) for _ in range(3)]
    raw_packed = public.encrypt(xs[0])
    # loading a raw chunk and writing it again gives the same bytes: the coefficients travel
    # unchanged, every chunk (full or short) alike
    again = [
        public._codec.dump(*public._codec.load(c, expected_len=None, what="c"))
        for c in raw_packed.chunks
    ]
    assert again == raw_packed.chunks
    # raw and SEAL-format contributions add up, and the sum decrypts, whichever format carries it
    for aggregator in (public, seal):
        total = aggregator.add([raw_packed, seal.encrypt(xs[1]), public.encrypt(xs[2])])
        assert total.chunks[0][4:6] == (b"CK" if aggregator is public else b"\x5e\xa1")
        out = holder.decrypt_sum(total, shape=(n,))
        np.testing.assert_allclose(out, np.sum(xs, axis=0), atol=1e-5)


def test_raw_format_touches_no_file(default_keys, monkeypatch) -> None:
    holder, _ = default_keys
    public = CkksPublic(context_bytes=holder.public_context_bytes(), wire="raw")
    opened: list[str] = []
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: opened.append(str(path)) or real_open(path, *a, **k)
    )
    total = public.add([public.encrypt(np.ones(100)), public.encrypt(np.ones(100))])
    holder.decrypt_sum(total, shape=(100,))
    monkeypatch.undo()
    assert opened == []
    assert public._codec._scratch is None  # not even the scratch directory was made


def test_raw_coefficient_not_below_its_prime_is_refused(default_keys) -> None:
    _, public = default_keys
    chunk = bytearray(public.encrypt(np.ones(10)).chunks[0])
    chunk[40:45] = b"\xff" * 5  # the first coefficient of the first prime: 2**40 - 1 > q
    with pytest.raises(CkksError, match="not below its prime"):
        public.add([PackedCiphertexts(chunks=[bytes(chunk)], length=10)])


@pytest.mark.parametrize("cut", [1, 40, 1000])
def test_raw_chunk_of_the_wrong_length_is_refused(default_keys, cut: int) -> None:
    _, public = default_keys
    chunk = public.encrypt(np.ones(10)).chunks[0]
    for bad in (chunk[:-cut], chunk + b"\0" * cut):
        with pytest.raises(CkksError, match="not a valid CKKS ciphertext"):
            public.add([PackedCiphertexts(chunks=[bad], length=10)])


def test_raw_chunk_from_other_parameters_of_the_same_size_is_refused(default_keys) -> None:
    holder, public = default_keys
    # other primes (35 and 33 bits), the same degree and byte widths: only the parms_id differs
    other_params = CkksParams(4096, (35, 33, 20), 40)
    assert _raw_layout(other_params)[1] == _raw_layout(CREDIT_DEFAULT)[1]
    other = CkksPublic(context_bytes=CkksKeyHolder(params=other_params).public_context_bytes())
    chunk = other.encrypt(np.ones(10)).chunks[0]
    with pytest.raises(CkksError, match="made with other parameters"):
        public.add([PackedCiphertexts(chunks=[chunk], length=10)])
    with pytest.raises(CkksError, match="made with other parameters"):
        holder.decrypt_sum(PackedCiphertexts(chunks=[chunk], length=10), shape=(10,))


def test_wire_format_comes_from_the_environment_and_bad_names_are_refused(
    default_keys, monkeypatch
) -> None:
    holder, _ = default_keys
    context = holder.public_context_bytes()
    monkeypatch.setenv(WIRE_ENV, "seal")
    assert CkksPublic(context_bytes=context).wire_format == "seal"
    assert CkksPublic(context_bytes=context, wire="raw").wire_format == "raw"  # argument wins
    monkeypatch.setenv(WIRE_ENV, "zip")
    with pytest.raises(CkksError, match=r"unknown CKKS wire format 'zip'.*use 'raw' or 'seal'"):
        CkksPublic(context_bytes=context)


def test_slot_values_share_complex_slots_two_by_two(default_keys) -> None:
    holder, public = default_keys
    n = CREDIT_DEFAULT.poly_modulus_degree
    assert public.slots == n  # N/2 complex slots, a real value in each part
    x = np.random.default_rng(1).uniform(-1000, 1000, n)
    x[0::2] = np.abs(x[0::2])  # real parts >= 0, imaginary parts of any sign: no mix-up
    packed = public.encrypt(x)
    assert len(packed.chunks) == 1
    out = holder.decrypt_sum(public.add([packed, public.encrypt(-x / 2)]), shape=(n,))
    np.testing.assert_allclose(out, x / 2, atol=1e-6)


def test_a_binding_whose_layout_fails_the_probe_falls_back_to_seal(
    default_keys, monkeypatch
) -> None:
    holder, public = default_keys
    raw_chunk = public.encrypt(np.ones(3)).chunks[0]
    monkeypatch.setattr("crypto.ckks._CoefficientAccess.probe", classmethod(lambda *a, **k: None))
    fallback = CkksPublic(context_bytes=holder.public_context_bytes(), wire="raw")
    assert fallback.wire_format == "seal"
    packed = fallback.encrypt(np.ones(3))
    assert packed.chunks[0][4:6] == b"\x5e\xa1"
    with pytest.raises(CkksError, match="SECUREVFL_CKKS_WIRE=seal"):
        fallback.add([PackedCiphertexts(chunks=[raw_chunk], length=3)])


def test_the_probe_accepts_seal_objects_only_where_every_field_matches(default_keys) -> None:
    from crypto.ckks import _CoefficientAccess

    _, public = default_keys
    codec = public._codec
    ct = codec.zero(public._encryptor)
    access = _CoefficientAccess.probe(ct, degree=4096, primes=2)
    assert access is not None
    dyn = ct.dyn_array()
    flat = access.view(ct).reshape(-1)
    assert [int(flat[i]) for i in (0, 5000, 16383)] == [dyn.at(i) for i in (0, 5000, 16383)]
    # a wrong expectation (degree or prime count) is a failed probe, never a wrong view
    assert _CoefficientAccess.probe(ct, degree=8192, primes=2) is None
    assert _CoefficientAccess.probe(ct, degree=4096, primes=3) is None
    with pytest.raises(RuntimeError, match="layout"):
        _CoefficientAccess(degree=4096, primes=3).view(ct)


def test_raw_chunk_with_an_all_zero_second_polynomial_is_refused(default_keys) -> None:
    # c1 = 0 would make c0 the plaintext itself: SEAL calls that transparent
    _, public = default_keys
    chunk = bytearray(public.encrypt(np.ones(10)).chunks[0])
    n, offset = CREDIT_DEFAULT.poly_modulus_degree, 40
    for width in _raw_layout(CREDIT_DEFAULT)[0]:
        chunk[offset + n * width : offset + 2 * n * width] = bytes(n * width)
        offset += 2 * n * width
    with pytest.raises(CkksError, match="transparent"):
        public.add([PackedCiphertexts(chunks=[bytes(chunk)], length=10)])


def test_raw_sums_add_coefficients_exactly_as_seal_does(default_keys) -> None:
    """The aggregator adds raw chunks as coefficients modulo each prime, without SEAL: the
    bytes are those of SEAL's own addition (the coefficients are uniform below their primes,
    so most additions wrap), through `add` and through the per-contribution path."""
    holder, public = default_keys
    rng = np.random.default_rng(8)
    n = public.slots + 77
    xs = [rng.uniform(-500, 500, n) for _ in range(4)]
    packed = [public.encrypt(x) for x in xs]
    codec = public._codec
    expected = []
    for i in range(len(packed[0].chunks)):
        cts = [codec.load(p.chunks[i], expected_len=None, what="c")[0] for p in packed]
        for ct in cts[1:]:
            codec.evaluator.add_inplace(cts[0], ct)
        expected.append(codec.dump(cts[0], len(xs[0][i * public.slots : (i + 1) * public.slots])))
    assert public.add(packed).chunks == expected
    loaded = [public.load_contribution(p.to_frames()) for p in packed]
    assert all(isinstance(item, np.ndarray) for c in loaded for item, _ in c)
    total = public.add_loaded(loaded)
    assert total.chunks == expected
    out = holder.decrypt_sum(total, shape=(n,))
    np.testing.assert_allclose(out, np.sum(xs, axis=0), atol=1e-5)
