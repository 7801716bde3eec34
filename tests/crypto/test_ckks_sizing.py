"""CKKS parameters sized to the values (choose_params), their security level, the decryption
error bound and DecryptionRelease checked empirically per parameter set, and the prepared
encryptions of zero."""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto.ckks import (
    DEFAULT_CKKS_PARAMS,
    MAX_COEFF_MODULUS_BITS,
    MAX_PREPARED_ZEROS,
    CkksError,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    DecryptionRelease,
    choose_params,
    describe_params,
    error_bound,
    security_level,
)

# (precision_bits, magnitude, terms): what methods ask of a sum
REQUESTS = [(11, 2.0**10, 4), (16, 2.0**10, 4), (20, 2.0**10, 4), (11, 2.0**20, 8), (2, 4.0, 2)]


@pytest.mark.parametrize(("precision", "magnitude", "terms"), REQUESTS)
@pytest.mark.parametrize("security", [128, 192, 256])
def test_chosen_params_keep_their_promises(precision, magnitude, terms, security) -> None:
    sizing = choose_params(
        precision_bits=precision, magnitude=magnitude, terms=terms, security_bits=security
    )
    params = sizing.params
    params.validate()
    assert sizing.security_bits >= security == security  # meets the requested row
    assert (
        sum(params.coeff_mod_bit_sizes)
        <= MAX_COEFF_MODULUS_BITS[security][params.poly_modulus_degree]
    )
    assert 2.0**sizing.flood_bits * error_bound(params, terms=terms) <= 2.0**-precision
    assert sizing.precision_bits >= precision
    assert 2.0**params.magnitude_bits >= terms * magnitude
    assert not params.special_prime  # sums never key-switch: every prime holds data
    assert sizing.bytes_per_value == 16 * len(params.coeff_mod_bit_sizes)


def test_the_smallest_degree_is_chosen() -> None:
    # The engine's typical sum: 4 parties, |x| <= 1024, 11 bits after the point once flooded
    # (what the design's defaults give) fits degree 2048 with one 48-bit data prime, in the
    # coefficient encoding
    sizing = choose_params(precision_bits=11, magnitude=2.0**10, terms=4)
    assert sizing.params == CkksParams(
        poly_modulus_degree=2048, coeff_mod_bit_sizes=(48,), scale_bits=33, special_prime=False
    )
    assert sizing.params.encoding == "coefficients" and sizing.security_bits == 128
    # the precision needs exactly a 33-bit scale there, the sum 12 bits and the margins 3
    assert error_bound(CkksParams(2048, (47,), 32, special_prime=False), terms=4) * 2**10 > 2**-11
    assert error_bound(CkksParams(2048, (48,), 33, special_prime=False), terms=4) * 2**10 <= 2**-11
    assert sum(sizing.params.coeff_mod_bit_sizes) == 33 + 12 + 3
    small = choose_params(precision_bits=0, magnitude=2.0, terms=2)
    assert small.params.poly_modulus_degree == 1024
    # min_degree: the same request at 4096 or more, one prime and a higher security level
    wide = choose_params(precision_bits=11, magnitude=2.0**10, terms=4, min_degree=4096)
    assert wide.params.poly_modulus_degree == 4096 and wide.security_bits == 256


def test_the_slot_encoding_is_chosen_where_one_prime_cannot_hold_the_sum() -> None:
    # 20 bits after the point for sums up to 2^40: one prime would need 42 + 43 + 3 bits
    sizing = choose_params(precision_bits=20, magnitude=2.0**40, terms=4, min_degree=4096)
    params = sizing.params
    assert params.encoding == "slots" and params.data_primes > 1
    # sized by the slots' (larger) noise: more scale than the coefficients would have needed
    assert 2.0**10 * error_bound(params, terms=4) <= 2.0**-20
    holder, public = _keys(params)
    xs = [np.full(10, 2.0**40 / 4 * 0.99), np.full(10, -3.0), np.full(10, 1.5), np.zeros(10)]
    out = holder.decrypt_sum(public.add([public.encrypt(x) for x in xs]), shape=(10,))
    np.testing.assert_allclose(out, np.sum(xs, axis=0), atol=1e-4)


@pytest.mark.parametrize(("precision", "magnitude", "terms"), [*REQUESTS, (12, 2.0**20, 5)])
def test_the_data_primes_hold_exactly_the_bits_a_sum_needs(precision, magnitude, terms) -> None:
    params = choose_params(precision_bits=precision, magnitude=magnitude, terms=terms).params
    data = params.data_bit_sizes
    assert data == params.coeff_mod_bit_sizes  # no special prime
    sum_bits = max(0, math.ceil(math.log2(terms * magnitude)))
    # each b-bit prime counts as b - 1 bits, plus 2 bits of margin: nothing more
    assert sum(data) == params.scale_bits + sum_bits + 2 + len(data)
    assert max(data) - min(data) <= 1  # split evenly, no prime sized to the scale
    assert (len(data) - 1) * 60 < sum(data)  # one prime fewer could not hold it


def test_a_chain_of_primes_below_the_scale_decrypts_the_largest_sums() -> None:
    # the slot encoding's choice for 4 parties + the active party, |x| <= 2^20, 12 bits: a
    # 68-bit data modulus in two primes, each below the 41-bit scale (no rescaling in a sum, so
    # none has to match it)
    params = CkksParams(4096, (34, 34), 41, special_prime=False)
    assert describe_params(params, terms=5).security_bits == 192
    holder, public = _keys(params)
    rng = np.random.default_rng(5)
    xs = [rng.uniform(-(2.0**20), 2.0**20, public.slots) for _ in range(5)]
    for x in xs:
        x[:3] = [2.0**20, -(2.0**20), 2.0**20 - 1]  # the extremes the sizing promises
    total = public.add([public.encrypt(x) for x in xs])
    raw = holder.decrypt_sum(total, shape=(public.slots,))
    assert np.max(np.abs(raw - np.sum(xs, axis=0))) <= error_bound(params, terms=5)
    # the serialisation compresses away the unused high bits of the 64-bit words
    raw_bytes = 2 * params.poly_modulus_degree * 2 * 8
    assert all(len(c) < 0.7 * raw_bytes for c in total.chunks)


def test_one_prime_now_holds_the_largest_sums_of_the_default_bound() -> None:
    # the same request: the coefficient encoding's smaller noise needs a 34-bit scale, so one
    # 60-bit prime holds it, and sums at the extremes decrypt within the bound
    sizing = choose_params(precision_bits=12, magnitude=2.0**20, terms=5)
    params = sizing.params
    assert params == CkksParams(4096, (60,), 34, special_prime=False)
    assert params.encoding == "coefficients" and sizing.security_bits == 192
    holder, public = _keys(params)
    rng = np.random.default_rng(6)
    xs = [rng.uniform(-(2.0**20), 2.0**20, public.slots) for _ in range(5)]
    for x in xs:
        x[:3] = [2.0**20, -(2.0**20), 2.0**20 - 1]
    raw = holder.decrypt_sum(public.add([public.encrypt(x) for x in xs]), shape=(public.slots,))
    assert np.max(np.abs(raw - np.sum(xs, axis=0))) <= error_bound(params, terms=5)


def test_impossible_requests_are_refused_with_reasons() -> None:
    with pytest.raises(ValueError, match="no CKKS parameters give 45 bits"):
        choose_params(precision_bits=45, magnitude=2.0**20, terms=4)
    with pytest.raises(ValueError, match="terms"):
        choose_params(precision_bits=10, magnitude=1.0, terms=0)
    with pytest.raises(ValueError, match="magnitude"):
        choose_params(precision_bits=10, magnitude=float("inf"), terms=2)
    with pytest.raises(ValueError, match="security_bits"):
        choose_params(precision_bits=10, magnitude=1.0, terms=2, security_bits=100)


def test_security_level_reads_the_standard_rows() -> None:
    assert security_level(DEFAULT_CKKS_PARAMS) == 128  # 200 bits at 8192: <= 218, > 152
    assert security_level(CkksParams(4096, (54, 20), 39)) == 192  # 74 <= 75
    assert security_level(CkksParams(8192, (55, 20), 40)) == 256  # 75 <= 118
    assert security_level(CkksParams(4096, (60, 40, 40, 60), 40)) == 0
    assert describe_params(DEFAULT_CKKS_PARAMS, terms=4).magnitude_bits == 95


# --- empirical: the error bound and the release, per chosen parameter set --------------------


def _keys(params: CkksParams) -> tuple[CkksKeyHolder, CkksPublic]:
    holder = CkksKeyHolder(params=params)
    return holder, CkksPublic(context_bytes=holder.public_context_bytes())


PARAM_SETS = [DEFAULT_CKKS_PARAMS, CkksParams(4096, (34, 34), 41, special_prime=False)] + [
    choose_params(precision_bits=p, magnitude=m, terms=k).params for p, m, k in REQUESTS
]


@pytest.mark.parametrize(
    "params",
    PARAM_SETS,
    ids=lambda p: (
        f"{p.poly_modulus_degree}-{'-'.join(map(str, p.coeff_mod_bit_sizes))}-s{p.scale_bits}"
    ),
)
def test_error_bound_and_release_hold_for_each_parameter_set(params: CkksParams) -> None:
    terms = 4
    holder, public = _keys(params)
    magnitude = min(2.0**params.magnitude_bits / terms, 2.0**10)
    rng = np.random.default_rng(params.poly_modulus_degree + params.scale_bits)
    n = 2 * public.slots + 17
    xs = [rng.uniform(-magnitude, magnitude, n) for _ in range(terms)]
    xs[0][:5] = magnitude  # the largest sum the parameters promise
    xs[1][:5] = xs[2][:5] = xs[3][:5] = magnitude
    public.prepare_zeros(n)  # half the contributions through prepared zeros
    total = public.add(
        [public.encrypt(x) for x in xs[:2]]
        + [CkksPublic(context_bytes=holder.public_context_bytes()).encrypt(x) for x in xs[2:]]
    )
    exact = np.sum(xs, axis=0)
    raw = holder.decrypt_sum(total, shape=(n,))
    bound = error_bound(params, terms=terms)
    worst = float(np.max(np.abs(raw - exact)))
    # with a special prime the fresh noise is divided far below the bound; without one the
    # bound is ~15 standard deviations of a Laplace-tailed error (slots) or ~7.5 of a
    # Gaussian one (coefficients; test_ckks_noise.py): the largest of these ~10^4 errors stays
    # below 0.8 of it except with probability ~10^-5
    assert worst <= bound / (4 if params.special_prime else 1.25), (worst, bound)
    release = DecryptionRelease(precision_bits=20, flood_bits=10)
    released = holder.decrypt_sum(total, shape=(n,), release=release, terms=terms)
    # flood noise plus the rounding to the 2**-20 grid (uniform: variance grid**2 / 12)
    std = math.hypot(release.flood_std(params, terms=terms), 2.0**-20 / math.sqrt(12))
    assert np.std(released - exact) == pytest.approx(std, rel=0.05)
    assert np.array_equal(released * 2**20, np.round(released * 2**20))


# --- prepared encryptions of zero --------------------------------------------------------------


@pytest.fixture(scope="module")
def small_keys() -> tuple[CkksKeyHolder, CkksPublic]:
    return _keys(choose_params(precision_bits=11, magnitude=2.0**10, terms=4).params)


def test_prepared_zeros_are_used_once_and_decrypt(small_keys) -> None:
    holder, public = small_keys
    n = 2 * public.slots + 5  # two full chunks, one of 5
    public.prepare_zeros(n)
    assert public.prepared_zeros == 3
    x = np.linspace(-100, 100, n)
    first = public.encrypt(x)
    assert public.prepared_zeros == 0
    np.testing.assert_allclose(holder.decrypt_sum(first, shape=(n,)), x, atol=1e-5)
    public.prepare_zeros(n)
    second = public.encrypt(x)
    # fresh randomness per encryption: the same values never give the same bytes
    assert not set(first.chunks) & set(second.chunks)
    public.prepare_zeros(5)
    assert public.prepared_zeros == 1
    short = public.encrypt(np.arange(7.0))  # any encryption of zero serves any chunk
    assert public.prepared_zeros == 0
    np.testing.assert_allclose(holder.decrypt_sum(short, shape=(7,)), np.arange(7.0), atol=1e-5)
    public.encrypt(np.ones(5))  # none ready: encrypted afresh
    assert public.prepared_zeros == 0


def test_prepare_zeros_refusals(small_keys) -> None:
    _, public = small_keys
    with pytest.raises(CkksError, match="non-negative"):
        public.prepare_zeros(-1)
    with pytest.raises(CkksError, match="limit"):
        public.prepare_zeros((MAX_PREPARED_ZEROS + 1) * public.slots)
    assert public.prepared_zeros == 0


def test_encrypt_refuses_values_beyond_the_capacity(small_keys) -> None:
    _, public = small_keys
    limit = 2.0**public.params.magnitude_bits
    public.encrypt(np.array([limit * 0.99]))
    public.prepare_zeros(1)
    with pytest.raises(CkksError, match="too large"):
        public.encrypt(np.array([limit]))
    assert public.prepared_zeros == 1  # refused before any zero was used
    public.encrypt(np.array([0.5]))
    assert math.isfinite(limit)
