"""CKKS parameters of a run: sized to the sums by default (smallest degree and chain for the
released precision, the values' bound and the number of parties, at the security level asked
for), or fixed in the config, all three keys or none."""

from __future__ import annotations

import copy

import pytest

from crypto.ckks import describe_params, error_bound, security_level
from securevfl.config import ConfigError, parse_config
from securevfl.secure_sum import ckks_params

BASE = {
    "run": {"method": "splitnn", "aggregation": "ckks", "seed": 0},
    "data": {"path": "data.csv", "id": "ID", "label": "Y", "task": "binary"},
    "active": {"columns": []},
    "parties": {"a": {"columns": ["X1"]}, "b": {"columns": ["X2"]}, "c": {"columns": ["X3"]}},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.01},
}


def cfg(method: str = "false-vfl", **secure):
    """A config of `method` (default one that declares no magnitude for its sums, so that
    [secure] bound sizes them) with these [secure] keys."""
    raw = copy.deepcopy(BASE)
    raw["run"]["method"] = method
    ckks = secure.pop("ckks", None)
    raw["secure"] = dict(secure)
    if ckks is not None:
        raw["secure"]["ckks"] = ckks
    return parse_config(raw)


def test_default_parameters_are_sized_to_the_bound_precision_and_parties():
    c = cfg(bound=1024.0)
    params = ckks_params(c)
    terms = len(c.party_names) + 1
    sizing = describe_params(params, terms=terms, flood_bits=c.ckks.flood_bits)
    # released error (flooding dominates) within the configured precision
    assert 2.0**c.ckks.flood_bits * error_bound(params, terms=terms) <= 2.0**-c.ckks.precision_bits
    assert sizing.magnitude_bits >= 12  # sums of 4 values up to 2^10 fit
    assert security_level(params) >= 128
    # one data prime at degree 4096 and no special prime (sums never key-switch): a third of
    # the bytes of the old fixed 8192/(60,40,40,60)
    assert params.poly_modulus_degree == 4096 and len(params.coeff_mod_bit_sizes) == 1
    assert not params.special_prime and params.data_primes == 1


def test_a_larger_bound_or_security_level_buys_a_longer_chain_or_degree():
    small = ckks_params(cfg(bound=1024.0))
    wide = ckks_params(cfg(bound=2.0**20))
    wider = ckks_params(cfg(bound=2.0**30, frac_bits=16))
    strong = ckks_params(cfg(bound=1024.0, ckks={"security_bits": 256}))
    assert sum(wide.coeff_mod_bit_sizes) > sum(small.coeff_mod_bit_sizes)
    # one prime holds sums up to 2^20 (the coefficient encoding); beyond, two or more (slots)
    assert len(wide.coeff_mod_bit_sizes) == 1 and wide.encoding == "coefficients"
    assert len(wider.coeff_mod_bit_sizes) > 1 and wider.encoding == "slots"
    assert security_level(strong) >= 256
    # ckks.magnitude overrides the bound for CKKS only
    assert ckks_params(cfg(bound=2.0**20, ckks={"magnitude": 1024.0})) == small


def test_fixed_parameters_are_used_as_given():
    fixed = {"poly_modulus_degree": 8192, "coeff_mod_bit_sizes": [60, 40, 40, 60], "scale_bits": 40}
    params = ckks_params(cfg(ckks=fixed))
    assert params.poly_modulus_degree == 8192
    assert tuple(params.coeff_mod_bit_sizes) == (60, 40, 40, 60) and params.scale_bits == 40
    assert params.special_prime  # a fixed chain keeps SEAL's layout unless it says otherwise


def test_a_fixed_chain_can_declare_that_it_has_no_special_prime():
    sized = ckks_params(cfg(bound=2.0**30, frac_bits=16))  # sized: two data primes, no special
    fixed = {
        "poly_modulus_degree": sized.poly_modulus_degree,
        "coeff_mod_bit_sizes": list(sized.coeff_mod_bit_sizes),
        "scale_bits": sized.scale_bits,
    }
    data_only = ckks_params(cfg(ckks={**fixed, "special_prime": False}))
    assert data_only == sized and data_only.data_bit_sizes == sized.coeff_mod_bit_sizes
    # the same chain in SEAL's layout keeps one data prime: too small for that scale
    with pytest.raises(ConfigError, match="no room"):
        cfg(ckks=fixed)
    with_special = ckks_params(cfg(ckks={**fixed, "scale_bits": 30}))
    assert with_special.special_prime
    assert with_special.data_bit_sizes == sized.coeff_mod_bit_sizes[:1]


def test_the_special_prime_flag_is_refused_without_a_fixed_chain_or_when_not_a_bool():
    with pytest.raises(ConfigError, match="only applies to fixed parameters"):
        cfg(ckks={"special_prime": False})
    fixed = {"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": [57], "scale_bits": 41}
    with pytest.raises(ConfigError, match="true or false"):
        cfg(ckks={**fixed, "special_prime": "no"})
    with pytest.raises(ConfigError, match="at least two primes"):
        cfg(ckks=fixed)  # one prime and SEAL's layout: no data prime would be left


@pytest.mark.parametrize(
    ("ckks", "words"),
    [
        ({"poly_modulus_degree": 8192}, "need all of"),
        ({"security_bits": 100}, "128, 192 or 256"),
        ({"magnitude": -1.0}, "must be in"),
        ({"precision_bits": 40}, "no CKKS parameters"),
        (
            {"poly_modulus_degree": 2048, "coeff_mod_bit_sizes": [60, 60], "scale_bits": 40},
            "",
        ),
    ],
)
def test_impossible_or_partial_parameters_are_refused_at_load(ckks, words):
    with pytest.raises(ConfigError) as info:
        cfg(ckks=ckks)
    assert info.value.key.startswith("[secure] ckks")
    assert words in str(info.value)


@pytest.mark.parametrize("method", ["splitnn", "standard-vfl", "laser", "vanilla-vfl"])
def test_representation_methods_declare_the_magnitude_of_their_sums(method):
    """Split-NN and the block methods sum party representations: they declare a magnitude
    for them (REPRESENTATION_MAGNITUDE), which sizes CKKS where the config sets none, and which
    the config can override; methods that declare none are sized from [secure] bound."""
    from securevfl.methods.base import REPRESENTATION_MAGNITUDE

    declared = cfg(method, bound=2.0**20)
    assert declared.ckks.magnitude == REPRESENTATION_MAGNITUDE == 4096.0
    params = ckks_params(declared)
    assert params.poly_modulus_degree == 4096 and params.data_primes == 1  # one prime
    sizing = describe_params(params, terms=len(declared.party_names) + 1)
    assert 2.0**sizing.magnitude_bits >= REPRESENTATION_MAGNITUDE * sizing.terms
    assert cfg(method, ckks={"magnitude": 2.0**20}).ckks.magnitude == 2.0**20
    assert ckks_params(cfg(method, ckks={"magnitude": 2.0**20})) == ckks_params(cfg(bound=2.0**20))
    assert cfg(bound=2.0**20).ckks.magnitude is None  # false-vfl declares none
