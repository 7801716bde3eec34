"""The decryption error of CKKS sums, measured over many draws, against its model and
`error_bound`, in both encodings, for chains without a special prime (what `choose_params`
picks) and with one; and the precision of released values (DecryptionRelease) for the chains a
Credit run picks.

The model (see `crypto.ckks.error_bound`). Slot encoding (several data primes): a value's
error has standard deviation ``N * sigma * sqrt(2 * terms / 3) / scale`` and a Laplace-sum tail
``(1 + k) exp(-2k)`` beyond ``k`` of them; the bound is ~15.3 of them. A Gaussian tail would be
far thinner (beyond 4 standard deviations: 6e-5 against the model's 1.7e-3), which is what made
a "6 sigma" bound too tight once the special prime no longer divides the fresh noise.
Coefficient encoding (one data prime): ``sigma * sqrt(terms * (4N/3 + 1)) / scale``, about
sqrt(N/2) times smaller, with a Gaussian tail; the bound is ~7.5 of them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from crypto.ckks import (
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    DecryptionRelease,
    choose_params,
    error_bound,
)

# the slot encoding: two data primes (what its sizing chose for a Credit run at the bound 2^20)
SLOTS = CkksParams(4096, (34, 34), 41, special_prime=False)
# what a Credit run with 4 parties picks now (securevfl's minimum degree 4096): one data prime,
# the coefficient encoding, for the representation sums (magnitude 4096) and at the bound 2^20
CREDIT = choose_params(precision_bits=12, magnitude=4096.0, terms=5, min_degree=4096).params
CREDIT_DEFAULT = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params


def _model_std(params: CkksParams, terms: int) -> float:
    sigma = math.sqrt(21 / 2)  # SEAL's centered binomial noise
    n = params.poly_modulus_degree
    if params.encoding == "coefficients":
        return sigma * math.sqrt(terms * (4 * n / 3 + 1)) / 2.0**params.scale_bits
    return n * sigma * math.sqrt(2 * terms / 3) / 2.0**params.scale_bits


def _errors(params: CkksParams, *, terms: int, sums: int) -> np.ndarray:
    """Decryption errors of `sums` sums of `terms` fresh ciphertexts (one full chunk each),
    half of the contributions through prepared encryptions of zero."""
    holder = CkksKeyHolder(params=params)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    rng = np.random.default_rng(params.scale_bits + terms)
    n = public.slots
    errors = []
    for s in range(sums):
        xs = [rng.uniform(-1.0, 1.0, n) for _ in range(terms)]
        if s % 2:
            public.prepare_zeros(n * terms)
        total = public.add([public.encrypt(x) for x in xs])
        errors.append(holder.decrypt_sum(total, shape=(n,)) - np.sum(xs, axis=0))
    return np.concatenate(errors)


@pytest.mark.parametrize(
    ("params", "terms"),
    [(SLOTS, 5), (SLOTS, 1), (CREDIT, 5), (CREDIT_DEFAULT, 1)],
    ids=["slots-terms5", "slots-terms1", "coefficients-52-terms5", "coefficients-60-terms1"],
)
def test_the_error_follows_the_model_and_stays_below_the_bound(params, terms) -> None:
    assert not params.special_prime
    errors = _errors(params, terms=terms, sums=40)  # 163,840 values
    std = _model_std(params, terms)
    assert np.std(errors) == pytest.approx(std, rel=0.03)
    assert abs(np.mean(errors)) < 0.02 * std
    beyond = np.mean(np.abs(errors) > 4 * std)
    bound = error_bound(params, terms=terms)
    if params.encoding == "slots":
        # the tail is the model's (Laplace sum), not a Gaussian's: beyond 4 standard deviations
        assert 0.7 * 5 * math.exp(-8) < beyond < 1.3 * 5 * math.exp(-8)
        assert bound == pytest.approx(15.26 * std, rel=0.01)
    else:
        # about a Gaussian's tail (6.3e-5 beyond 4 of them: ~10 of these values, 0.2 to 1.9
        # times that in 50 draws of keys), far below a Laplace sum's 1.7e-3
        assert beyond < 5 * 6.3e-5
        assert bound == pytest.approx(7.54 * std, rel=0.01)
    # the bound holds with margin: 0.8 of it is 12 (slots) or 6 (coefficients) standard
    # deviations, exceeded by one of these values with probability below 1e-4
    assert float(np.max(np.abs(errors))) < 0.8 * bound


def test_the_coefficient_encodings_error_is_about_sqrt_n_over_2_times_smaller() -> None:
    slots = CkksParams(4096, (52, 20), 34, special_prime=False)  # same scale, two primes
    ratio = _model_std(slots, 5) / _model_std(CREDIT, 5)
    assert CREDIT.scale_bits == slots.scale_bits and ratio == pytest.approx(math.sqrt(2048), 0.01)
    measured = np.std(_errors(slots, terms=5, sums=4)) / np.std(_errors(CREDIT, terms=5, sums=4))
    assert measured == pytest.approx(ratio, rel=0.1)


def test_a_special_prime_only_makes_the_error_smaller() -> None:
    # the chain choose_params picked before: SEAL divides the fresh noise by the 20-bit prime
    params = CkksParams(4096, (34, 33, 20), 40)
    errors = _errors(params, terms=5, sums=6)
    assert np.std(errors) < 0.1 * _model_std(params, 5)
    assert float(np.max(np.abs(errors))) < error_bound(params, terms=5) / 10


@pytest.mark.parametrize(
    "params", [CREDIT, CREDIT_DEFAULT, SLOTS], ids=["coefficients-52", "coefficients-60", "slots"]
)
def test_released_sums_meet_the_requested_precision(params) -> None:
    """What a Credit run asks: 12 bits after the point with 10 bits of flooding, 5 terms."""
    terms, n = 5, 2 * params.slots
    assert 2.0**10 * error_bound(params, terms=terms) <= 2.0**-12  # choose_params' promise
    holder = CkksKeyHolder(params=params)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    rng = np.random.default_rng(7)
    magnitude = 2.0**params.magnitude_bits / terms
    xs = [rng.uniform(-magnitude, magnitude, n) for _ in range(terms)]
    total = public.add([public.encrypt(x) for x in xs])
    release = DecryptionRelease(precision_bits=12, flood_bits=10)
    released = holder.decrypt_sum(total, shape=(n,), release=release, terms=terms)
    error = released - np.sum(xs, axis=0)
    # flooding of 2^10 bounds plus the rounding to 2^-12: within the requested 2^-12 std
    expected = math.hypot(release.flood_std(params, terms=terms), 2.0**-12 / math.sqrt(12))
    assert np.std(error) == pytest.approx(expected, rel=0.05)
    assert np.std(error) <= 2.0**-12 * math.hypot(1, 1 / math.sqrt(12)) * 1.05


def test_the_flooding_noise_is_standard_normal_and_fresh() -> None:
    from scipy import stats

    from crypto.ckks import csprng_normal

    z = csprng_normal((200_001,))  # an odd count: the pairs' leftover is dropped
    assert z.shape == (200_001,) and z.dtype == np.float64
    # a correct generator fails this with probability 1e-6
    assert stats.kstest(z, "norm").pvalue > 1e-6
    # the two normals of a pair are independent: the halves of a draw are uncorrelated
    pairs = csprng_normal((2, 100_000))
    assert abs(np.corrcoef(pairs[0], pairs[1])[0, 1]) < 0.02
    assert csprng_normal((0,)).size == 0 and csprng_normal((3, 4)).shape == (3, 4)
    assert not np.array_equal(csprng_normal((64,)), csprng_normal((64,)))
