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
    zero = public._codec.zero(public._encryptor)
    assert not zero.is_ntt_form()
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
    ct = seal._codec.zero(seal._encryptor)
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
