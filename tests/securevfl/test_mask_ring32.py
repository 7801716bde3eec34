"""Representation sums of the masking backend travel in Z_2^32 (issue 17: half the bytes of
Z_2^64): split-NN and the block methods declare ``[secure] bound = 4096`` and ``frac_bits =
16``, so each party sends its masked value reduced mod 2^32, the aggregator adds in Z_2^32 and
the key holder decodes it; a contribution or sum in the other ring is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from crypto.keys import MaskingKeyPair
from securevfl.methods.base import REPRESENTATION_FRAC_BITS, REPRESENTATION_MAGNITUDE
from securevfl.secure_sum import (
    ContributionError,
    MaskActive,
    MaskAggregator,
    MaskParty,
    SumSession,
)
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv

NAMES = ("p1", "p2", "p3", "p4", "p5")
SESSION = b"r" * 16


def _sessions(**encoding) -> dict[str, SumSession]:
    keys = {n: MaskingKeyPair.generate() for n in NAMES}
    publics = {n: k.public for n, k in keys.items()}
    return {
        n: SumSession(
            name=n, session=SESSION, mask_keypair=keys[n], mask_publics=publics, **encoding
        )
        for n in NAMES
    }


REPRESENTATIONS = {"frac_bits": REPRESENTATION_FRAC_BITS, "bound": REPRESENTATION_MAGNITUDE}


def _round(sessions, values, *, call=b"c" * 32):
    parties = {n: MaskParty(s) for n, s in sessions.items()}
    sent = {
        n: p.protect(values[n], round=1, group=NAMES, key="S", call=call)["S"]
        for n, p in parties.items()
    }
    aggregator = MaskAggregator(sessions["p1"])
    accepted = {n: aggregator.accept({"S": a}, key="S", sender=n) for n, a in sent.items()}
    combined = aggregator.combine_accepted(accepted, group=NAMES, key="S")
    return sent, combined, MaskActive(sessions["p1"])


def test_a_representation_sum_travels_in_32_bits_and_decodes_to_the_plain_sum() -> None:
    rng = np.random.default_rng(3)
    values = {n: rng.uniform(-100, 100, (256, 16)).astype(np.float32) for n in NAMES}
    sent, combined, active = _round(_sessions(**REPRESENTATIONS), values)
    assert all(a.dtype == np.uint32 and a.nbytes == 4 * 4096 for a in sent.values())
    assert combined["S"].dtype == np.uint32
    out = active.reveal(combined, group=NAMES, key="S", shape=(256, 16))
    expected = np.sum([v.astype(np.float64) for v in values.values()], axis=0)
    assert np.max(np.abs(out - expected)) <= 5 * 2.0**-17


def test_the_default_encoding_stays_in_64_bits() -> None:
    values = {n: np.ones((256, 16)) for n in NAMES}
    sent, combined, active = _round(_sessions(), values)  # 2^20 with 20 bits: 40 bits a value
    assert all(a.dtype == np.uint64 for a in sent.values()) and combined["S"].dtype == np.uint64
    np.testing.assert_allclose(active.reveal(combined, group=NAMES, key="S", shape=(256, 16)), 5)


def test_a_contribution_or_a_sum_in_the_other_ring_is_refused() -> None:
    sessions = _sessions(**REPRESENTATIONS)
    values = {n: np.ones((256, 16)) for n in NAMES}
    sent, combined, active = _round(sessions, values)
    aggregator = MaskAggregator(sessions["p1"])
    accepted = {n: aggregator.accept({"S": a}, key="S", sender=n) for n, a in sent.items()}
    accepted["p3"] = aggregator.accept({"S": sent["p3"].astype(np.uint64)}, key="S", sender="p3")
    with pytest.raises(ContributionError, match="p3: masked contribution to 'S' is uint64; a sum"):
        aggregator.combine_accepted(accepted, group=NAMES, key="S")
    with pytest.raises(ContributionError, match="p2: .* is int32, not uint64 or uint32"):
        aggregator.accept({"S": sent["p2"].view(np.int32)}, key="S", sender="p2")
    # an aggregator widening the sum it forwards: the key holder refuses it, decodes nothing
    wide = {"S": combined["S"].astype(np.uint64)}
    with pytest.raises(ValueError, match="the masked sum is uint64; .* is uint32"):
        active.reveal(wide, group=NAMES, key="S", shape=(256, 16))


def test_representation_methods_declare_the_narrow_encoding_and_a_config_can_widen_it(
    tmp_path,
) -> None:
    raw = copy.deepcopy(BASE_RAW)
    synthetic_csv(tmp_path / "data.csv")
    cfg = make_config(raw, tmp_path)
    assert (cfg.frac_bits, cfg.bound) == (16, 4096.0)
    raw["secure"] = {"frac_bits": 20, "bound": 2.0**20}
    cfg = make_config(raw, tmp_path)
    assert (cfg.frac_bits, cfg.bound) == (20, 2.0**20)
