"""The decryption error of CKKS sums, measured over many draws, against its model and
`error_bound`, for chains without a special prime (what `choose_params` picks) and with one;
and the precision of released values (DecryptionRelease) for the chains a Credit run picks.

The model (see `crypto.ckks.error_bound`): a value's error has standard deviation
``N * sigma * sqrt(2 * terms / 3) / scale`` and a Laplace-sum tail ``(1 + k) exp(-2k)`` beyond
``k`` of them; the bound is ~15.3 of them. A Gaussian tail would be far thinner (beyond 4
standard deviations: 6e-5 against the model's 1.7e-3), which is what made a "6 sigma" bound
too tight once the special prime no longer divides the fresh noise.
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

# what a Credit run with 4 parties picks: the default bound 2^20, and ckks.magnitude = 1024
CREDIT_DEFAULT = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params
CREDIT_1024 = choose_params(precision_bits=12, magnitude=1024.0, terms=5).params


def _model_std(params: CkksParams, terms: int) -> float:
    sigma = math.sqrt(21 / 2)  # SEAL's centered binomial noise
    n = params.poly_modulus_degree
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
    [(CREDIT_DEFAULT, 5), (CREDIT_DEFAULT, 1), (CREDIT_1024, 5)],
    ids=["34-34-terms5", "34-34-terms1", "57-terms5"],
)
def test_the_error_follows_the_model_and_stays_below_the_bound(params, terms) -> None:
    assert not params.special_prime
    errors = _errors(params, terms=terms, sums=40)  # 163,840 values
    std = _model_std(params, terms)
    assert np.std(errors) == pytest.approx(std, rel=0.03)
    assert abs(np.mean(errors)) < 0.02 * std
    # the tail is the model's (Laplace sum), not a Gaussian's: beyond 4 standard deviations
    beyond = np.mean(np.abs(errors) > 4 * std)
    assert 0.7 * 5 * math.exp(-8) < beyond < 1.3 * 5 * math.exp(-8)
    # the bound holds with margin: 0.8 of it is 12 standard deviations, exceeded by one of
    # these values with probability ~5e-5
    bound = error_bound(params, terms=terms)
    assert bound == pytest.approx(15.26 * std, rel=0.01)
    assert float(np.max(np.abs(errors))) < 0.8 * bound


def test_a_special_prime_only_makes_the_error_smaller() -> None:
    # the chain choose_params picked before: SEAL divides the fresh noise by the 20-bit prime
    params = CkksParams(4096, (34, 33, 20), 40)
    errors = _errors(params, terms=5, sums=6)
    assert np.std(errors) < 0.1 * _model_std(params, 5)
    assert float(np.max(np.abs(errors))) < error_bound(params, terms=5) / 10


@pytest.mark.parametrize("params", [CREDIT_DEFAULT, CREDIT_1024], ids=["34-34", "57"])
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
