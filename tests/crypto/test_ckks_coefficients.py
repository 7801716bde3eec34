"""The coefficient encoding of CKKS sums (one data prime): values are the coefficients of the
plaintext polynomial, ciphertexts stay in coefficient form from the encryption of zero to the
key holder, no encoder runs, and a chunk of the other encoding is refused."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal.sealapi as sealapi

from crypto.ckks import (
    CkksError,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    PackedCiphertexts,
    choose_params,
    error_bound,
)

# what a Credit run picks for its representation sums (4 parties + the active party)
CREDIT = choose_params(precision_bits=12, magnitude=4096.0, terms=5, min_degree=4096).params


@pytest.fixture(scope="module")
def keys() -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=CREDIT)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes())


def test_credits_sums_use_one_prime_and_the_coefficient_form(keys) -> None:
    holder, public = keys
    assert CREDIT == CkksParams(4096, (52,), 34, special_prime=False)
    assert CREDIT.encoding == "coefficients" and public.params == CREDIT
    zero = public._codec.zero(public._encryptor)  # made as coefficients (`_ZeroMaker`)
    assert isinstance(zero, np.ndarray) and zero.shape == (2, 1, 4096)
    assert int(zero.max()) < public._codec._moduli[0]
    chunk = public.encrypt(np.arange(5.0)).chunks[0]
    assert chunk[4:8] == b"CKC1"
    assert len(chunk) == 4 + 4 + 32 + 2 * 4096 * 7  # 52 bits in 7 bytes: 14 bytes per value
    np.testing.assert_allclose(
        holder.decrypt_sum(public.add([PackedCiphertexts([chunk], 5)]), shape=(5,)),
        np.arange(5.0),
        atol=error_bound(CREDIT, terms=1),
    )


def test_no_encoder_runs_in_the_coefficient_encoding(keys, monkeypatch) -> None:
    holder, public = keys

    def refuse(*args, **kwargs):
        raise AssertionError("SEAL's CKKS encoder was called")

    for codec in (public._codec, holder._codec):
        monkeypatch.setattr(codec, "encode", refuse)
        monkeypatch.setattr(codec, "decode", refuse)
    x = np.linspace(-4000, 4000, 4096)
    public.prepare_zeros(4096)  # one through a prepared zero, one fresh
    total = public.add([public.encrypt(x), public.encrypt(-x / 4)])
    out = holder.decrypt_sum(total, shape=(4096,))
    assert np.max(np.abs(out - 0.75 * x)) <= error_bound(CREDIT, terms=2)


def test_the_largest_sums_decrypt_at_both_signs(keys) -> None:
    holder, public = keys
    terms = 5
    limit = 2.0**CREDIT.magnitude_bits / terms
    x = np.array([limit * 0.999, -limit * 0.999, 0.0, 2.0**-20, -(2.0**-20)])
    total = public.add([public.encrypt(x) for _ in range(terms)])
    out = holder.decrypt_sum(total, shape=(5,))
    assert np.max(np.abs(out - terms * x)) <= error_bound(CREDIT, terms=terms)


def test_raw_sums_add_coefficients_exactly_as_seal_does(keys) -> None:
    holder, public = keys
    rng = np.random.default_rng(2)
    xs = [rng.uniform(-800, 800, 4096 + 9) for _ in range(4)]
    packed = [public.encrypt(x) for x in xs]
    codec = public._codec
    expected = []
    for i, size in enumerate((4096, 9)):
        cts = [codec.load(p.chunks[i], expected_len=None, what="c")[0] for p in packed]
        assert not any(ct.is_ntt_form() for ct in cts)
        for ct in cts[1:]:
            codec.evaluator.add_inplace(cts[0], ct)
        expected.append(codec.dump(cts[0], size))
    total = public.add_loaded([public.load_contribution(p.to_frames()) for p in packed])
    assert total.chunks == expected
    out = holder.decrypt_sum(total, shape=(4096 + 9,))
    assert np.max(np.abs(out - np.sum(xs, axis=0))) <= error_bound(CREDIT, terms=4)


def test_a_chunk_of_the_other_encoding_is_refused(keys) -> None:
    holder, public = keys
    chunk = bytearray(public.encrypt(np.ones(4)).chunks[0])
    chunk[4:8] = b"CKR1"  # claims the slot encoding (NTT form) in a coefficient context
    bad = PackedCiphertexts([bytes(chunk)], 4)
    with pytest.raises(CkksError, match="in the slots encoding; this context's sums are in the"):
        public.add([bad])
    with pytest.raises(CkksError, match="coefficients encoding"):
        holder.decrypt_sum(bad, shape=(4,))
    # and the other way round: a coefficient chunk in a slot context
    slots_holder = CkksKeyHolder(params=CkksParams(4096, (34, 34), 41, special_prime=False))
    slots = CkksPublic(context_bytes=slots_holder.public_context_bytes())
    chunk = bytearray(slots.encrypt(np.ones(4)).chunks[0])
    chunk[4:8] = b"CKC1"
    with pytest.raises(CkksError, match="coefficients encoding; this context's sums are in the"):
        slots.add([PackedCiphertexts([bytes(chunk)], 4)])


def test_a_seal_format_chunk_in_ntt_form_is_refused_in_a_coefficient_context(keys) -> None:
    holder, public = keys
    seal = CkksPublic(context_bytes=holder.public_context_bytes(), wire="seal")
    ct = seal._codec.ciphertext_of(seal._codec.zero(seal._encryptor))
    seal._codec.evaluator.transform_to_ntt_inplace(ct)  # the form of the slot encoding
    chunk = seal._codec.dump(ct, 3)
    assert chunk[4:6] == b"\x5e\xa1"
    with pytest.raises(CkksError, match="NTT form"):
        public.add([PackedCiphertexts([chunk], 3)])
    # SEAL-format chunks in the right form sum and decrypt like raw ones
    x = np.array([1.5, -2.0, 3.25])
    total = public.add([seal.encrypt(x), public.encrypt(x)])
    np.testing.assert_allclose(holder.decrypt_sum(total, shape=(3,)), 2 * x, atol=1e-6)


def test_a_binding_whose_layout_fails_the_probe_cannot_use_the_coefficient_encoding(
    keys, monkeypatch
) -> None:
    holder, _ = keys
    monkeypatch.setattr("crypto.ckks._CoefficientAccess.probe", classmethod(lambda *a, **k: None))
    with pytest.raises(CkksError, match="coefficient encoding.*two or more data primes"):
        CkksPublic(context_bytes=holder.public_context_bytes())


def test_the_key_holders_decryption_leaves_the_carrier_as_it_was(keys) -> None:
    # the plaintext leaves NTT form as the first polynomial of a kept ciphertext whose first
    # polynomial is zero: decryptions never change it, so one never leaks into the next
    holder, public = keys
    codec = holder._codec
    holder.decrypt_sum(public.encrypt(np.full(6, 7.0)), shape=(6,))
    carrier = codec._carrier()
    before = codec._access.view(carrier).copy()
    assert not before[0].any() and before[1].any() and carrier.is_ntt_form()
    for value in (1.0, -3.0):
        out = holder.decrypt_sum(public.encrypt(np.full(6, value)), shape=(6,))
        np.testing.assert_allclose(out, value, atol=1e-6)
    assert np.array_equal(codec._access.view(carrier), before)
    assert isinstance(carrier, sealapi.Ciphertext)


def _seal_decryption(holder: CkksKeyHolder, packed: PackedCiphertexts) -> np.ndarray:
    """The sum decrypted chunk by chunk through SEAL's Decryptor (the path before the key
    holder decrypted raw sums itself)."""
    codec = holder._codec
    cts = codec.load_all(packed, what="sum")
    counts = [min(codec.slots, packed.length - i * codec.slots) for i in range(len(cts))]
    return np.concatenate(
        [codec.decrypt_values(ct, holder._decryptor, n) for ct, n in zip(cts, counts, strict=True)]
    )


@pytest.mark.parametrize("length", [1, 9, 4096, 4096 + 9, 16 * 4096 + 1])
def test_raw_sums_decrypt_bit_for_bit_as_seals_decryptor_does(keys, monkeypatch, length) -> None:
    # only the second polynomials go through NTT form, up to 16 in one SEAL ciphertext: the
    # same residues c0 + c1 * s mod q, so the same floats (17 chunks: two SEAL ciphertexts)
    holder, public = keys
    rng = np.random.default_rng(length)
    xs = [rng.uniform(-800, 800, length) for _ in range(3)]
    total = public.add([public.encrypt(x) for x in xs])
    expected = _seal_decryption(holder, total)
    with monkeypatch.context() as m:  # the raw path loads no SEAL ciphertext at all
        m.setattr(holder._codec, "load_all", lambda *a, **k: pytest.fail("loaded ciphertexts"))
        out = holder.decrypt_sum(total, shape=(length,))
    assert out.dtype == np.float64 and np.array_equal(out, expected)
    assert np.max(np.abs(out - np.sum(xs, axis=0))) <= error_bound(CREDIT, terms=3)


def test_a_sum_in_seals_format_is_decrypted_through_seals_decryptor(keys, monkeypatch) -> None:
    holder, _ = keys
    seal = CkksPublic(context_bytes=holder.public_context_bytes(), wire="seal")
    x = np.linspace(-100, 100, 4096 + 3)
    packed = seal.encrypt(x)
    assert packed.chunks[0][4:6] == b"\x5e\xa1"
    monkeypatch.setattr(
        holder._codec, "decrypt_coefficients", lambda *a, **k: pytest.fail("raw path taken")
    )
    out = holder.decrypt_sum(packed, shape=(x.size,))
    assert np.max(np.abs(out - x)) <= error_bound(CREDIT, terms=1)


def test_the_raw_decryption_refuses_a_sum_the_checks_of_a_load_refuse(keys) -> None:
    holder, public = keys
    chunk = public.encrypt(np.ones(4)).chunks[0]
    q = public._codec._moduli[0]
    body = 4 + 4 + 32  # count, magic, parms_id; then 7 bytes a coefficient
    above = bytearray(chunk)
    above[body : body + 7] = (q + 1).to_bytes(7, "little")  # a coefficient not below q
    transparent = bytearray(chunk)
    transparent[body + 4096 * 7 :] = bytes(4096 * 7)  # the second polynomial zero
    for bad, why in ((above, "not below its prime"), (transparent, "transparent")):
        with pytest.raises(CkksError, match=why):
            holder.decrypt_sum(PackedCiphertexts([bytes(bad)], 4), shape=(4,))
    with pytest.raises(CkksError, match="carries 4 values; 3 were expected"):
        holder.decrypt_sum(PackedCiphertexts([chunk], 3), shape=(3,))


# --- the encryptions of zero made here (`_ZeroMaker`) ------------------------------------------


def _words_from(monkeypatch, fill) -> None:
    """Make `crypto.ckks.random_uint64` return `fill(n)` (uint64 words) instead of randomness."""
    import crypto.ckks as ckks

    monkeypatch.setattr(ckks, "random_uint64", lambda n: fill(int(n)).astype(np.uint64))


def test_zeros_are_made_here_with_the_noise_of_seals_own(keys) -> None:
    # the same distribution as SEAL's encrypt_zero: the decryptions' noise has the same spread
    holder, public = keys
    codec = public._codec
    assert codec._zero_maker() is not None
    scale = 2.0**CREDIT.scale_bits
    ours, seals = [], []
    for _ in range(20):
        ours.append(
            codec.decrypt_values(codec.ciphertext_of(codec.zero(None)), holder._decryptor, 4096)
        )
        theirs = codec._fresh_zero(public._encryptor)
        codec.evaluator.transform_from_ntt_inplace(theirs)
        seals.append(codec.decrypt_values(theirs, holder._decryptor, 4096))
    ours_std, seals_std = np.std(ours) * scale, np.std(seals) * scale
    # sqrt(2 N (2/3) 21/2) = 239 for N = 4096: -u e_pk + e0 + e1 s
    assert 225 < seals_std < 255 and abs(ours_std / seals_std - 1) < 0.03
    assert abs(np.mean(ours) * scale) < 5  # 81920 values: the mean's std is about 0.8
    a, b = codec.zero(None), codec.zero(None)
    assert not np.array_equal(a, b)  # fresh randomness every time


def test_a_zero_with_u_one_is_the_public_key_plus_the_errors(keys, monkeypatch) -> None:
    # exact ring arithmetic: bytes that make u = 1 give pk + e, u = -1 give e - pk (u = 0 would
    # be a transparent ciphertext, which SEAL refuses to transform; 3^-4096 at random)
    from crypto.ckks import _ternary_words

    _, public = keys
    codec = public._codec
    q, n = codec._moduli[0], 4096
    errors = np.zeros(2 * n, dtype=np.uint64)  # the first 2n words: e0 then e1
    errors[:3] = [(1 << 21) - 1, ((1 << 21) - 1) << 21, 0b101 | (1 << 21)]  # +21, -21, +1
    expected_errors = np.zeros((2, n), dtype=object)
    expected_errors[0, :3] = [21, q - 21, 1]
    pk = sealapi.Ciphertext(codec.seal)  # the public key out of NTT form
    codec.evaluator.negate(codec._template, pk)
    codec._access.view(pk)[...] = codec._access.view(codec._setup.public_key.data())
    codec.evaluator.transform_from_ntt_inplace(pk)
    key = codec._access.view(pk)[:, 0, :].astype(object)
    for byte, expected in ((2, (key + expected_errors) % q), (0, (q - key + expected_errors) % q)):
        ternary = np.full(8 * _ternary_words(n), 1, dtype=np.uint8)  # b mod 3 - 1 = 0
        ternary[0] = byte  # u = +-1, the constant polynomial
        ternary = ternary.view(np.uint64)
        _words_from(monkeypatch, lambda k, t=ternary: np.concatenate([errors, t])[:k])
        zero = codec._zero_maker().make(codec._blank())  # 2 -> u = 1, 0 -> u = -1
        assert (zero[:, 0, :].astype(object) == expected).all()


def test_ternary_coefficients_are_uniform_and_reject_byte_255() -> None:
    from crypto.ckks import ternary_residues

    q = (1 << 51) + 1
    got = ternary_residues(np.array([255, 0, 1, 2, 255, 3, 4, 5], dtype=np.uint8), 6, q)
    assert got.tolist() == [q - 1, 0, 1, q - 1, 0, 1]
    rng = np.random.default_rng(0)
    values = ternary_residues(rng.integers(0, 256, 400_000, dtype=np.uint8), 300_000, q)
    counts = [int(np.sum(values == v)) for v in (q - 1, 0, 1)]
    assert sum(counts) == 300_000
    chi2 = sum((c - 100_000) ** 2 / 100_000 for c in counts)
    assert chi2 < 20  # 2 degrees of freedom: p < 5e-5 by chance
    # too few bytes below 255: more are drawn from the CSPRNG, never a shorter result
    assert ternary_residues(np.full(10, 255, dtype=np.uint8), 50, q).size == 50


def test_errors_are_seals_centered_binomial_added_mod_q() -> None:
    from crypto.ckks import add_cbd_errors

    q = (1 << 51) + 1
    coefficients = np.array([0, q - 1, 5, q - 3], dtype=np.uint64)
    words = np.array(
        [(1 << 21) - 1, (1 << 21) - 1, ((1 << 21) - 1) << 21, 0b11 << 21], dtype=np.uint64
    )
    add_cbd_errors(coefficients, words, q)
    assert coefficients.tolist() == [21, 20, (5 - 21) % q, (q - 3 - 2) % q]
    rng = np.random.default_rng(1)
    many = np.zeros(200_000, dtype=np.uint64)
    words = rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64, endpoint=True)
    add_cbd_errors(many, words, q)
    signed = np.where(many > q // 2, many.astype(np.float64) - q, many.astype(np.float64))
    assert signed.min() >= -21 and signed.max() <= 21
    assert abs(signed.var() - 10.5) < 0.2 and abs(signed.mean()) < 0.05
