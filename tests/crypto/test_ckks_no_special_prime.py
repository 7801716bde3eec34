"""Chains without a special prime (what `choose_params` picks): ciphertexts made directly at the
data level, keys built through SEAL's API (TenSEAL refuses such chains), the kind of a chain
explicit in `CkksParams` and in the public context, and refusals of a tampered kind."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest

from crypto.ckks import (
    _META,
    _TAG_META,
    WIRE_RAW,
    WIRE_SEAL,
    CkksError,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    _pack_public,
    _unpack_public,
    choose_params,
    describe_params,
    security_level,
)

TWO = CkksParams(4096, (34, 34), 41, special_prime=False)  # a Credit run at the default bound
ONE = CkksParams(4096, (57,), 41, special_prime=False)  # a Credit run with ckks.magnitude 1024
OLD = CkksParams(4096, (34, 33, 20), 40)  # SEAL's layout: (34, 33) data, 20-bit special prime


@pytest.fixture(scope="module", params=[TWO, ONE], ids=["34-34", "57"])
def keys(request) -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=request.param)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes())


def test_choose_params_picks_no_special_prime_and_says_so() -> None:
    # one data prime holds either sum in the coefficient encoding, whose noise needs a 34-bit
    # scale where the slots needed 41 (TWO and ONE below were the slot encoding's choices)
    picked = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params
    assert picked == CkksParams(4096, (60,), 34, special_prime=False)
    picked = choose_params(precision_bits=12, magnitude=1024.0, terms=5, min_degree=4096).params
    assert picked == CkksParams(4096, (50,), 34, special_prime=False)
    assert picked.encoding == "coefficients" and TWO.encoding == "slots"
    sizing = describe_params(TWO, terms=5)
    assert sizing.as_dict()["special_prime"] is False
    assert sizing.bytes_per_value == 32  # two data primes, 16 bytes each per value
    assert describe_params(OLD, terms=5).bytes_per_value == 32  # the special prime is not sent


def test_the_kind_of_chain_decides_the_data_primes() -> None:
    assert (TWO.data_primes, TWO.data_bit_sizes, TWO.data_bits) == (2, (34, 34), 68)
    assert (OLD.data_primes, OLD.data_bit_sizes, OLD.data_bits) == (2, (34, 33), 67)
    assert ONE.magnitude_bits == 57 - 1 - 41 - 2
    same_chain = CkksParams(4096, (34, 34), 30, special_prime=True)
    assert same_chain.data_bit_sizes == (34,) and same_chain.magnitude_bits == 34 - 1 - 30 - 2
    assert TWO.max_chunk_bytes == OLD.max_chunk_bytes  # two data primes either way
    # security is checked on the whole chain: dropping the special prime only shrinks it
    assert security_level(TWO) == 192 and security_level(OLD) == 128


@pytest.mark.parametrize(
    ("kwargs", "detail"),
    [
        ({"coeff_mod_bit_sizes": ()}, "at least one prime"),
        ({"coeff_mod_bit_sizes": (60, 50)}, "exceeds 109"),  # 110 bits: beyond 128-bit security
        ({"coeff_mod_bit_sizes": (41,)}, "no room"),
        ({"special_prime": "no"}, "special_prime must be a bool"),
    ],
)
def test_data_only_chains_are_still_validated(kwargs: dict, detail: str) -> None:
    params = CkksParams(**{"poly_modulus_degree": 4096, "scale_bits": 41, **kwargs})
    if "special_prime" not in kwargs:
        params = CkksParams(**{**params.__dict__, "special_prime": False})
    with pytest.raises(ValueError, match=detail):
        params.validate()
    with pytest.raises(ValueError, match=detail):
        CkksKeyHolder(params=params)


def test_fresh_ciphertexts_are_made_at_the_data_level_without_a_special_prime(keys) -> None:
    holder, public = keys
    params = public.params
    assert public.params == holder.params and not params.special_prime
    setup = public._codec._setup
    zero = public._codec._fresh_zero(public._encryptor)  # SEAL's (one prime: see _ZeroMaker)
    # every prime of the chain carries data; SEAL encrypted at that level (no division)
    assert zero.coeff_modulus_size() == len(params.coeff_mod_bit_sizes)
    assert list(zero.parms_id()) == list(setup.enc.key_parms_id())
    assert list(zero.parms_id()) == list(setup.seal.first_parms_id())
    # SEAL refuses to add or decrypt at a context's key level: a second context whose first
    # level is the data primes (one spare prime above them, never used) evaluates them
    assert setup.seal is not setup.enc
    assert (
        len(setup.seal.key_context_data().parms().coeff_modulus()) == zero.coeff_modulus_size() + 1
    )


def test_with_a_special_prime_fresh_ciphertexts_drop_it() -> None:
    holder = CkksKeyHolder(params=OLD)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    zero = public._codec.zero(public._encryptor)
    assert zero.coeff_modulus_size() == 2  # (34, 33): the special prime divided away
    x = np.linspace(-5, 5, 9)
    np.testing.assert_allclose(holder.decrypt_sum(public.encrypt(x), shape=(9,)), x, atol=1e-6)


@pytest.mark.parametrize("wire", [WIRE_RAW, WIRE_SEAL])
def test_sums_decrypt_in_both_wire_formats_with_prepared_and_fresh_zeros(keys, wire) -> None:
    holder, public = keys
    writer = CkksPublic(context_bytes=holder.public_context_bytes(), wire=wire)
    assert writer.wire_format == wire
    rng = np.random.default_rng(11)
    n = 2 * public.slots + 13
    xs = [rng.uniform(-1000, 1000, n) for _ in range(3)]
    writer.prepare_zeros(n)  # the first contribution through prepared zeros, the rest fresh
    total = public.add([writer.encrypt(x) for x in xs])
    out = holder.decrypt_sum(total, shape=(n,))
    np.testing.assert_allclose(out, np.sum(xs, axis=0), atol=1e-4)


def test_the_public_context_says_which_kind_of_chain(keys) -> None:
    holder, public = keys
    sections = _unpack_public(holder.public_context_bytes())
    assert _META.unpack(sections[_TAG_META]) == (41, 0)
    assert len(holder.public_context_bytes()) < 100_000  # parameters and one public key


@pytest.mark.parametrize(
    ("params", "detail"), [(TWO, "no room"), (ONE, "at least two primes")], ids=["34-34", "57"]
)
def test_a_chain_claimed_to_have_a_special_prime_is_refused_when_it_cannot(params, detail) -> None:
    # the flag flipped on the way: (34, 34) would become one 34-bit data prime, too small for
    # the 41-bit scale; (57,) would have no data prime left
    sections = _unpack_public(CkksKeyHolder(params=params).public_context_bytes())
    sections[_TAG_META] = _META.pack(41, 1)
    with pytest.raises(CkksError, match=detail):
        CkksPublic(context_bytes=_pack_public(list(sections.items())))


def test_keys_are_made_without_any_named_file(monkeypatch) -> None:
    # the secret key restricted to the data primes goes to SEAL through an anonymous memfd
    def refuse(*args, **kwargs):
        raise AssertionError("a named temporary file or directory was created")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    holder = CkksKeyHolder(params=TWO)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    x = np.arange(6.0)
    np.testing.assert_allclose(holder.decrypt_sum(public.encrypt(x), shape=(6,)), x, atol=1e-6)


def test_each_key_holder_has_its_own_secret(keys) -> None:
    holder, public = keys
    other = CkksKeyHolder(params=public.params)
    x = np.full(8, 3.0)
    mine = public.encrypt(x)
    # the other key holder parses the chunk (same parameters) but decrypts garbage
    garbage = other.decrypt_sum(mine, shape=(8,))
    assert np.max(np.abs(garbage - x)) > 1e3
    np.testing.assert_allclose(holder.decrypt_sum(mine, shape=(8,)), x, atol=1e-6)
