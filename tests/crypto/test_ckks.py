"""Tests for the CKKS secure sum (crypto/ckks.py).

Accuracy tolerance used throughout: max |decrypted - plaintext sum| <= 1e-5 * max(max |sum|, 1).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tenseal as ts
import tenseal.sealapi as sealapi
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.ckks import (
    _META,
    _TAG_META,
    _TAG_PARMS,
    _TAG_PUBLIC_KEY,
    _TAG_SECRET_KEY,
    DEFAULT_CKKS_PARAMS,
    MAX_COEFF_MODULUS_BITS_128,
    CkksError,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    PackedCiphertexts,
    _pack_public,
    _seal_load,
    _seal_save,
    _unpack_public,
    context_fingerprint,
)

RTOL = 1e-5


@pytest.fixture(scope="module")
def key_holder() -> CkksKeyHolder:
    return CkksKeyHolder()


@pytest.fixture(scope="module")
def aggregator(key_holder: CkksKeyHolder) -> CkksPublic:
    return CkksPublic(context_bytes=key_holder.public_context_bytes())


@pytest.fixture(scope="module")
def party(key_holder: CkksKeyHolder) -> CkksPublic:
    return CkksPublic(context_bytes=key_holder.public_context_bytes())


@pytest.fixture(scope="module")
def one_chunk(party: CkksPublic) -> bytes:
    x = np.random.default_rng(0).normal(size=party.slots)
    return party.encrypt(x).chunks[0]


def assert_close_to_sum(decrypted: np.ndarray, contributions: list[np.ndarray]) -> None:
    expected = np.sum(contributions, axis=0)
    assert decrypted.dtype == np.float64
    assert decrypted.shape == expected.shape
    if expected.size:
        scale = max(float(np.max(np.abs(expected))), 1.0)
        assert float(np.max(np.abs(decrypted - expected))) <= RTOL * scale


def secure_sum(
    key_holder: CkksKeyHolder,
    party: CkksPublic,
    aggregator: CkksPublic,
    contributions: list[np.ndarray],
) -> np.ndarray:
    shape = contributions[0].shape
    # Frames as the transport carries them, rebuilt on the receiving side.
    sent = [
        PackedCiphertexts.from_frames(party.encrypt(x).to_frames(), length=x.size)
        for x in contributions
    ]
    total = aggregator.add(sent)
    received = PackedCiphertexts.from_frames(total.to_frames(), length=total.length)
    return key_holder.decrypt_sum(received, shape=shape)


# --- the public side cannot decrypt -------------------------------------------------------


def _sections(key_holder: CkksKeyHolder) -> dict[bytes, bytes]:
    return _unpack_public(key_holder.public_context_bytes())


def _blob(sections: dict[bytes, bytes]) -> bytes:
    return _pack_public(list(sections.items()))


def _keys(parms: object, *, sec: object = sealapi.SEC_LEVEL_TYPE.TC128) -> tuple[object, ...]:
    """A SEAL context for `parms` and a fresh key pair under it (what an attacker can build)."""
    context = sealapi.SEALContext(parms, True, sec)
    keygen = sealapi.KeyGenerator(context)
    public = sealapi.PublicKey()
    keygen.create_public_key(public)
    return context, keygen.secret_key(), public


def test_public_context_has_no_secret_galois_or_relin_keys(key_holder: CkksKeyHolder) -> None:
    sections = _sections(key_holder)
    assert set(sections) == {_TAG_META, _TAG_PARMS, _TAG_PUBLIC_KEY}  # nothing else travels
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    _seal_load(parms.load, sections[_TAG_PARMS])
    context = sealapi.SEALContext(parms, True, sealapi.SEC_LEVEL_TYPE.TC128)
    public = sealapi.PublicKey()
    _seal_load(lambda path: public.load(context, path), sections[_TAG_PUBLIC_KEY])
    assert public.parms_id() == context.key_parms_id()
    # no section is something SEAL loads as a secret, relinearisation or Galois key
    for data in sections.values():
        for kind in (sealapi.SecretKey, sealapi.RelinKeys, sealapi.GaloisKeys):
            key = kind()
            with pytest.raises(Exception):  # noqa: B017 - SEAL raises several types
                _seal_load(lambda path, key=key: key.load(context, path), data)


def test_public_context_size_excludes_galois_keys(key_holder: CkksKeyHolder) -> None:
    # Degree 8192: public key ~0.5 MB; relin keys add ~1.4 MB, Galois keys ~33 MB.
    assert len(key_holder.public_context_bytes()) < 1_000_000


def test_public_context_cannot_decrypt_a_ciphertext(
    key_holder: CkksKeyHolder, aggregator: CkksPublic, one_chunk: bytes
) -> None:
    assert aggregator.packed_from_frames([one_chunk]).length == aggregator.slots  # it parses...
    # ...but nothing the public side holds is a secret key to decrypt it with
    held = [aggregator, aggregator._codec, aggregator._codec._setup]
    values = [v for obj in held for v in vars(obj).values()]
    assert not any(isinstance(v, sealapi.SecretKey | sealapi.Decryptor) for v in values)
    assert any(isinstance(v, sealapi.PublicKey) for v in values)


def test_public_side_offers_no_decryption() -> None:
    assert not any("decrypt" in name for name in dir(CkksPublic))


def test_public_refuses_context_with_secret_key(key_holder: CkksKeyHolder) -> None:
    # the key holder's own public part, plus a secret key under the same parameters
    sections = _sections(key_holder)
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    _seal_load(parms.load, sections[_TAG_PARMS])
    _, secret, _ = _keys(parms)
    sections[_TAG_SECRET_KEY] = _seal_save(secret.save)
    with pytest.raises(CkksError, match="carries a secret key"):
        CkksPublic(context_bytes=_blob(sections))


def test_public_refuses_a_tenseal_context_with_secret_key() -> None:
    # the format of earlier versions: refused as a whole, secret key or not
    context = ts.context(
        ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60]
    )
    context.global_scale = 2.0**40
    with pytest.raises(CkksError, match="not a securevfl CKKS public context"):
        CkksPublic(context_bytes=context.serialize(save_secret_key=True))


def test_public_refuses_context_with_weak_scale(key_holder: CkksKeyHolder) -> None:
    sections = _sections(key_holder)
    sections[_TAG_META] = _META.pack(10, 1)
    with pytest.raises(CkksError, match="scale_bits"):
        CkksPublic(context_bytes=_blob(sections))


def _public_blob(parms, public) -> bytes:
    """A public context framed as the key holder frames it (scale 2^40, special prime) for
    parameters and a public key made outside `CkksKeyHolder`."""
    return _blob(
        {
            _TAG_META: _META.pack(40, 1),
            _TAG_PARMS: _seal_save(parms.save),
            _TAG_PUBLIC_KEY: _seal_save(public.save),
        }
    )


def test_public_refuses_parameters_below_128_bit_security() -> None:
    # 4 x 40 bits at degree 4096 (128-bit security allows 109): keys made without SEAL's check
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(4096)
    parms.set_coeff_modulus(sealapi.CoeffModulus.Create(4096, [40, 40, 40, 40]))
    _, _, public = _keys(parms, sec=sealapi.SEC_LEVEL_TYPE.NONE)
    blob = _public_blob(parms, public)
    with pytest.raises(CkksError, match="exceeds 109"):
        CkksPublic(context_bytes=blob)


def test_public_refuses_bfv_context() -> None:
    parms = sealapi.EncryptionParameters(sealapi.SCHEME_TYPE.BFV)
    parms.set_poly_modulus_degree(4096)
    parms.set_coeff_modulus(sealapi.CoeffModulus.BFVDefault(4096, sealapi.SEC_LEVEL_TYPE.TC128))
    parms.set_plain_modulus(sealapi.PlainModulus.Batching(4096, 20))
    _, _, public = _keys(parms)
    blob = _public_blob(parms, public)
    with pytest.raises(CkksError, match="BFV scheme; a CKKS context is required"):
        CkksPublic(context_bytes=blob)


def test_public_refuses_context_without_public_key(key_holder: CkksKeyHolder) -> None:
    sections = _sections(key_holder)
    del sections[_TAG_PUBLIC_KEY]
    with pytest.raises(CkksError, match="no public key"):
        CkksPublic(context_bytes=_blob(sections))


def test_public_refuses_a_public_key_of_other_parameters(key_holder: CkksKeyHolder) -> None:
    sections = _sections(key_holder)
    other = _sections(CkksKeyHolder(params=CkksParams(4096, (34, 34), 41, special_prime=False)))
    sections[_TAG_PUBLIC_KEY] = other[_TAG_PUBLIC_KEY]
    with pytest.raises(CkksError, match="public key could not be parsed"):
        CkksPublic(context_bytes=_blob(sections))


@pytest.mark.parametrize(
    ("edit", "detail"),
    [
        (lambda s: {**s, b"GKEY": b"x"}, "unknown sections"),
        (lambda s: {**s, _TAG_META: b"\x28"}, "META has 1 bytes"),
        (lambda s: {**s, _TAG_META: _META.pack(40, 7)}, "special_prime flag 7"),
        (lambda s: {k: v for k, v in s.items() if k != _TAG_PARMS}, "no encryption parameters"),
        (lambda s: {**s, _TAG_PARMS: s[_TAG_PARMS][:-3]}, "could not be parsed"),
    ],
)
def test_public_refuses_malformed_sections(key_holder: CkksKeyHolder, edit, detail: str) -> None:
    with pytest.raises(CkksError, match=detail):
        CkksPublic(context_bytes=_blob(edit(_sections(key_holder))))


def test_public_refuses_a_repeated_section(key_holder: CkksKeyHolder) -> None:
    blob = key_holder.public_context_bytes()
    meta = _sections(key_holder)[_TAG_META]
    with pytest.raises(CkksError, match="repeats"):
        CkksPublic(context_bytes=blob + _pack_public([(_TAG_META, meta)])[8:])


def test_a_flipped_special_prime_flag_is_caught_by_fingerprint_and_key_holder(
    key_holder: CkksKeyHolder,
) -> None:
    # (60, 40, 40, 60) read as four data primes is a valid setup under the same public key, so
    # the public side accepts it; but its fingerprint differs (the federation authenticates
    # the context end to end) and the key holder refuses what it encrypts (another level)
    sections = _sections(key_holder)
    sections[_TAG_META] = _META.pack(40, 0)
    flipped = CkksPublic(context_bytes=_blob(sections))
    assert flipped.params.special_prime is False
    assert flipped.context_fingerprint != key_holder.context_fingerprint
    with pytest.raises(CkksError, match="ciphertext of these parameters|other parameters"):
        key_holder.decrypt_sum(flipped.encrypt(np.ones(3)), shape=(3,))


@pytest.mark.parametrize("data", [b"", b"garbage" * 10, "text"])
def test_public_refuses_garbage_context(data: object) -> None:
    with pytest.raises(CkksError):
        CkksPublic(context_bytes=data)  # type: ignore[arg-type]


def test_public_refuses_truncated_context(key_holder: CkksKeyHolder) -> None:
    data = key_holder.public_context_bytes()
    with pytest.raises(CkksError, match="could not be parsed"):
        CkksPublic(context_bytes=data[: len(data) // 2])


def test_fingerprints_agree(key_holder: CkksKeyHolder, party: CkksPublic) -> None:
    assert key_holder.context_fingerprint == party.context_fingerprint
    assert party.context_fingerprint == context_fingerprint(key_holder.public_context_bytes())
    assert party.params == key_holder.params == DEFAULT_CKKS_PARAMS


# --- the sum is right ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "n_parties"),
    [
        ((1,), 2),
        ((7, 3), 3),
        ((4096,), 2),
        ((4097,), 4),
        ((2, 4096), 5),
        ((3, 5000), 16),
        ((12345,), 8),
        ((0, 4), 2),
    ],
)
def test_decrypted_sum_equals_plaintext_sum(
    key_holder: CkksKeyHolder,
    party: CkksPublic,
    aggregator: CkksPublic,
    shape: tuple[int, ...],
    n_parties: int,
) -> None:
    rng = np.random.default_rng(math.prod(shape) + n_parties)
    contributions = [rng.normal(scale=10.0, size=shape) for _ in range(n_parties)]
    decrypted = secure_sum(key_holder, party, aggregator, contributions)
    assert_close_to_sum(decrypted, contributions)


@settings(max_examples=8, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    n_parties=st.integers(2, 16),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_decrypted_sum_property(
    key_holder: CkksKeyHolder,
    party: CkksPublic,
    aggregator: CkksPublic,
    shape: list[int],
    n_parties: int,
    magnitude: float,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    contributions = [
        rng.uniform(-magnitude, magnitude, size=tuple(shape)) for _ in range(n_parties)
    ]
    decrypted = secure_sum(key_holder, party, aggregator, contributions)
    assert_close_to_sum(decrypted, contributions)


def test_chunking_follows_slots(party: CkksPublic) -> None:
    packed = party.encrypt(np.ones(2 * party.slots + 1))
    assert party.slots == 8192  # two values per complex slot at degree 8192
    assert len(packed.chunks) == 3
    assert packed.length == 2 * party.slots + 1
    assert all(len(c) <= party.params.max_chunk_bytes for c in packed.chunks)


def test_add_of_one_contribution_is_that_contribution(
    key_holder: CkksKeyHolder, aggregator: CkksPublic
) -> None:
    x = np.linspace(-1.0, 1.0, 10)
    total = aggregator.add([aggregator.encrypt(x)])
    assert_close_to_sum(key_holder.decrypt_sum(total, shape=(10,)), [x])


def test_from_frames_accepts_bytes_like(key_holder: CkksKeyHolder, party: CkksPublic) -> None:
    x = np.arange(5.0)
    frames = party.encrypt(x).to_frames()
    packed = PackedCiphertexts.from_frames([memoryview(bytearray(f)) for f in frames], length=5)
    assert_close_to_sum(key_holder.decrypt_sum(packed, shape=(5,)), [x])


@pytest.mark.parametrize("length", [0, 1, 4096, 5000, 8192])
def test_aggregator_learns_length_from_frames(
    key_holder: CkksKeyHolder, party: CkksPublic, aggregator: CkksPublic, length: int
) -> None:
    xs = [np.full(length, float(k)) for k in range(1, 4)]
    received = [aggregator.packed_from_frames(party.encrypt(x).to_frames()) for x in xs]
    assert [p.length for p in received] == [length] * 3
    assert_close_to_sum(key_holder.decrypt_sum(aggregator.add(received), shape=(length,)), xs)


def test_aggregator_refuses_contributors_with_different_inferred_lengths(
    party: CkksPublic, aggregator: CkksPublic
) -> None:
    a = aggregator.packed_from_frames(party.encrypt(np.ones(5000)).to_frames())
    b = aggregator.packed_from_frames(party.encrypt(np.ones(4000)).to_frames())
    with pytest.raises(CkksError, match="contribution 1 carries 4000 values"):
        aggregator.add([a, b])


def test_aggregator_refuses_garbage_last_frame(aggregator: CkksPublic, one_chunk: bytes) -> None:
    with pytest.raises(CkksError, match="chunk 1 is not a valid CKKS ciphertext"):
        aggregator.packed_from_frames([one_chunk, b"garbage"])


# --- malformed, tampered, truncated input ----------------------------------------------------


def test_encrypt_refuses_non_finite(party: CkksPublic) -> None:
    with pytest.raises(CkksError, match="NaN or infinite"):
        party.encrypt(np.array([1.0, np.nan]))


def test_encrypt_refuses_values_too_large_for_scale(party: CkksPublic) -> None:
    with pytest.raises(CkksError, match="too large"):
        party.encrypt(np.array([1e30]))


@pytest.mark.parametrize("keep", [1, 10, 40, 1000, -1, -20])
def test_truncated_chunk_is_refused(aggregator: CkksPublic, one_chunk: bytes, keep: int) -> None:
    cut = one_chunk[:keep]
    packed = PackedCiphertexts(chunks=[cut], length=aggregator.slots)
    with pytest.raises(CkksError, match="not a valid CKKS ciphertext"):
        aggregator.add([packed, packed])


@pytest.mark.parametrize("size", [1, 16, 4096, 331_000])
def test_garbage_chunk_is_refused(aggregator: CkksPublic, one_chunk: bytes, size: int) -> None:
    garbage = np.random.default_rng(size).bytes(size)
    good = PackedCiphertexts(chunks=[one_chunk], length=aggregator.slots)
    bad = PackedCiphertexts(chunks=[garbage], length=aggregator.slots)
    with pytest.raises(CkksError, match="contribution 1 chunk 0 is not a valid CKKS ciphertext"):
        aggregator.add([good, bad])


def test_oversized_chunk_is_refused_before_parsing(aggregator: CkksPublic) -> None:
    huge = b"\0" * (aggregator.params.max_chunk_bytes + 1)
    with pytest.raises(CkksError, match="more than the"):
        aggregator.add([PackedCiphertexts(chunks=[huge], length=1)])


def test_empty_frame_is_refused() -> None:
    with pytest.raises(CkksError, match="empty"):
        PackedCiphertexts.from_frames([b""], length=1)


def test_non_bytes_frame_is_refused() -> None:
    with pytest.raises(CkksError, match="not bytes"):
        PackedCiphertexts.from_frames(["abc"], length=1)  # type: ignore[list-item]


# a chunk is a 4-byte value count, then SEAL's 16-byte header (magic, header size, version,
# compression mode, 2 reserved bytes SEAL ignores, total size) and the ciphertext
@pytest.mark.parametrize("position", [4, 5, 6, 7, 8, 9, 12, 13, 16, 20, 30])
def test_flipped_seal_header_byte_is_refused(
    aggregator: CkksPublic, one_chunk: bytes, position: int
) -> None:
    tampered = bytearray(one_chunk)
    tampered[position] ^= 0x01
    packed = PackedCiphertexts(chunks=[bytes(tampered)], length=aggregator.slots)
    with pytest.raises(CkksError):
        aggregator.add([packed])


@pytest.mark.parametrize(("position", "bit"), [(0, 0x01), (2, 0x10), (3, 0x80)])
def test_tampered_value_count_is_refused(
    aggregator: CkksPublic, one_chunk: bytes, position: int, bit: int
) -> None:
    # Bytes 0-3 are the little-endian value count (8192).
    tampered = bytearray(one_chunk)
    tampered[position] ^= bit
    packed = PackedCiphertexts(chunks=[bytes(tampered)], length=aggregator.slots)
    with pytest.raises(CkksError, match="values; 8192 were expected"):
        aggregator.add([packed])
    with pytest.raises(CkksError, match="values; 1 to 8192 were expected"):
        aggregator.packed_from_frames([bytes(tampered)])


def test_any_flipped_byte_raises_ckks_error_or_loads(
    key_holder: CkksKeyHolder, aggregator: CkksPublic, one_chunk: bytes
) -> None:
    # CKKS has no integrity: a flip in the coefficient data often loads and decrypts to
    # garbage. The promise is only that nothing but CkksError escapes (integrity comes from
    # CurveZMQ). Positions: the whole header, the tail, and a sample of the body.
    rng = np.random.default_rng(1)
    body = rng.choice(np.arange(40, len(one_chunk) - 12), size=40, replace=False)
    positions = [*range(40), *range(len(one_chunk) - 12, len(one_chunk)), *body.tolist()]
    outcomes = {"refused": 0, "loaded": 0}
    for position in positions:
        tampered = bytearray(one_chunk)
        tampered[position] ^= 1 << int(rng.integers(8))
        packed = PackedCiphertexts(chunks=[bytes(tampered)], length=aggregator.slots)
        try:
            key_holder.decrypt_sum(aggregator.add([packed]), shape=(aggregator.slots,))
        except CkksError:
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
    assert outcomes["refused"] > 0
    assert outcomes["loaded"] > 0  # documents the limit of what CKKS can detect


def test_chunk_from_other_parameters_is_refused(aggregator: CkksPublic) -> None:
    other = CkksKeyHolder(params=CkksParams(coeff_mod_bit_sizes=(60, 40, 60)))
    chunk = CkksPublic(context_bytes=other.public_context_bytes()).encrypt(np.ones(3)).chunks[0]
    with pytest.raises(CkksError, match="made with other parameters"):
        aggregator.add([PackedCiphertexts(chunks=[chunk], length=3)])


def test_mismatched_chunk_counts_are_refused(aggregator: CkksPublic) -> None:
    full = aggregator.encrypt(np.ones(10000))
    short = PackedCiphertexts(chunks=full.chunks[:1], length=10000)
    with pytest.raises(CkksError, match="contribution 1 has 1 chunks but 10000 values need 2"):
        aggregator.add([full, short])


def test_mismatched_lengths_are_refused(aggregator: CkksPublic) -> None:
    with pytest.raises(CkksError, match="contribution 1 carries 4 values"):
        aggregator.add([aggregator.encrypt(np.ones(3)), aggregator.encrypt(np.ones(4))])


def test_claimed_length_must_match_chunk_content(aggregator: CkksPublic) -> None:
    packed = aggregator.encrypt(np.ones(10))
    lying = PackedCiphertexts(chunks=packed.chunks, length=9)
    with pytest.raises(CkksError, match="carries 10 values; 9 were expected"):
        aggregator.add([lying])


def test_add_refuses_no_contributions(aggregator: CkksPublic) -> None:
    with pytest.raises(CkksError, match="at least one"):
        aggregator.add([])


def test_decrypt_refuses_wrong_shape(key_holder: CkksKeyHolder, party: CkksPublic) -> None:
    packed = party.encrypt(np.ones(6))
    with pytest.raises(CkksError, match=r"shape \(4,\) has 4 values"):
        key_holder.decrypt_sum(packed, shape=(4,))


def test_decrypt_refuses_wrong_chunk_count(key_holder: CkksKeyHolder, party: CkksPublic) -> None:
    packed = party.encrypt(np.ones(6))
    with pytest.raises(CkksError, match="chunks"):
        key_holder.decrypt_sum(PackedCiphertexts(chunks=packed.chunks * 2, length=6), shape=(6,))


def test_packed_refuses_negative_length() -> None:
    with pytest.raises(CkksError, match="length"):
        PackedCiphertexts(chunks=[], length=-1)


# --- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field", "detail"),
    [
        ({"poly_modulus_degree": 1000}, "poly_modulus_degree", "power of two"),
        ({"poly_modulus_degree": 65536}, "poly_modulus_degree", "power of two"),
        ({"poly_modulus_degree": 8192.0}, "poly_modulus_degree", "must be an int"),
        ({"poly_modulus_degree": 4096}, "coeff_mod_bit_sizes", "exceeds 109"),
        ({"coeff_mod_bit_sizes": (60, 60, 60, 60)}, "coeff_mod_bit_sizes", "exceeds 218"),
        ({"coeff_mod_bit_sizes": [60, 40, 40, 60]}, "coeff_mod_bit_sizes", "tuple"),
        ({"coeff_mod_bit_sizes": (60,)}, "coeff_mod_bit_sizes", "at least two"),
        ({"coeff_mod_bit_sizes": (61, 40, 60)}, "coeff_mod_bit_sizes[0]", "outside"),
        ({"coeff_mod_bit_sizes": (60, 10, 60)}, "coeff_mod_bit_sizes[1]", "outside"),
        ({"coeff_mod_bit_sizes": (41, 20), "scale_bits": 40}, "scale_bits", "no room"),
        ({"scale_bits": 10}, "scale_bits", "below 20"),
        ({"scale_bits": 40.0}, "scale_bits", "must be an int"),
        ({"coeff_mod_bit_sizes": (40, 60), "scale_bits": 40}, "scale_bits", "no room"),
    ],
)
def test_params_validation_names_the_field(kwargs: dict, field: str, detail: str) -> None:
    params = CkksParams(**kwargs)
    with pytest.raises(ValueError, match="^" + re.escape(field)):
        params.validate()
    with pytest.raises(ValueError, match=detail):
        params.validate()


def test_params_validation_accepts_primes_below_the_scale_when_the_modulus_holds_it() -> None:
    # sums never rescale: only the data modulus as a whole must hold scale + integer bits
    CkksParams(4096, (34, 33, 20), 40).validate()
    assert CkksParams(4096, (34, 33, 20), 40).magnitude_bits == 23
    with pytest.raises(ValueError, match="no room.*lower scale_bits"):
        CkksParams(4096, (22, 21, 20), 40).validate()


@pytest.mark.parametrize(
    "params",
    [
        CkksParams(),
        CkksParams(poly_modulus_degree=4096, coeff_mod_bit_sizes=(40, 20, 40), scale_bits=20),
        CkksParams(
            poly_modulus_degree=16384, coeff_mod_bit_sizes=(60, 50, 50, 50, 60), scale_bits=50
        ),
        CkksParams(poly_modulus_degree=8192, coeff_mod_bit_sizes=(60, 60), scale_bits=40),
    ],
)
def test_valid_params_pass(params: CkksParams) -> None:
    params.validate()
    assert params.slots == params.poly_modulus_degree  # two values per complex slot


def test_key_holder_refuses_weak_params() -> None:
    with pytest.raises(ValueError, match="coeff_mod_bit_sizes total 200 bits exceeds 109"):
        CkksKeyHolder(params=CkksParams(poly_modulus_degree=4096))


def _sizes_totalling(total: int) -> list[int]:
    sizes = [60] * (total // 60)
    rest = total - sum(sizes)
    if rest:  # keep every prime >= 30 bits so SEAL can find one
        sizes[-1] -= 30 - rest if rest < 30 else 0
        sizes.append(max(rest, 30))
    assert sum(sizes) == total
    return sizes


@pytest.mark.parametrize("degree", [4096, 8192, 16384])
def test_security_table_agrees_with_seal(degree: int) -> None:
    limit = MAX_COEFF_MODULUS_BITS_128[degree]
    ts.context(
        ts.SCHEME_TYPE.CKKS, poly_modulus_degree=degree, coeff_mod_bit_sizes=_sizes_totalling(limit)
    )
    with pytest.raises(ValueError):  # SEAL itself refuses one bit more at 128-bit security
        ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=degree,
            coeff_mod_bit_sizes=_sizes_totalling(limit + 1),
        )


def test_decryptions_that_leave_the_key_holder_are_flooded_and_rounded():
    """IND-CPA^D mitigation: the raw decryption error stays within `error_bound`, and a
    released decryption is the value plus Gaussian noise of 2^flood_bits times that bound,
    fresh each time (CSPRNG-seeded), on the 2^-precision_bits grid."""
    from crypto.ckks import DecryptionRelease, error_bound

    holder = CkksKeyHolder()
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=8192) for _ in range(4)]
    total = public.add([public.encrypt(x) for x in xs])
    exact = np.sum(xs, axis=0)
    raw = holder.decrypt_sum(total, shape=(8192,))
    bound = error_bound(holder.params, terms=4)
    assert np.max(np.abs(raw - exact)) < bound / 5  # the bound is conservative
    release = DecryptionRelease(precision_bits=20, flood_bits=10)
    a = holder.decrypt_sum(total, shape=(8192,), release=release, terms=4)
    b = holder.decrypt_sum(total, shape=(8192,), release=release, terms=4)
    assert np.array_equal(a * 2**20, np.round(a * 2**20))  # on the grid
    std = release.flood_std(holder.params, terms=4)
    assert std == pytest.approx(2**10 * bound)
    assert np.std(a - exact) == pytest.approx(std, rel=0.05)
    assert not np.array_equal(a, b)  # fresh noise: no two releases of a sum are equal
    with pytest.raises(ValueError, match="flood_bits"):
        DecryptionRelease(flood_bits=-1)
