"""Benchmarks: plain float32 sum of K arrays vs the pairwise-masked sum.

Run explicitly (not part of the test suite): ``pytest bench/bench_masked_sum.py``.
The masked path is the whole protocol in one process: every party encodes and masks, the
aggregator adds, the receiver decodes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from crypto import (
    FixedPointEncoder,
    MaskedSumAggregator,
    MaskedSumParty,
    MaskingKeyPair,
    decode_sum,
)

SIZES = [1_000, 10_000, 100_000, 1_000_000]
PARTY_COUNTS = [2, 4, 8, 16]


def _inputs(n: int, k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(n + k)
    return [rng.standard_normal(n, dtype=np.float32) for _ in range(k)]


def plain_sum(arrays: list[np.ndarray]) -> np.ndarray:
    total = arrays[0].copy()
    for array in arrays[1:]:
        np.add(total, array, out=total)
    return total


@pytest.mark.parametrize("k", PARTY_COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_plain_float32_sum(benchmark, n: int, k: int) -> None:
    arrays = _inputs(n, k)
    benchmark.group = f"n={n:.0e} K={k}"
    benchmark.extra_info.update(n=n, parties=k, path="plain")
    total = benchmark(plain_sum, arrays)
    assert total.shape == (n,)


@pytest.mark.parametrize("k", PARTY_COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_masked_sum(benchmark, n: int, k: int) -> None:
    arrays = _inputs(n, k)
    names = [f"party{i:02d}" for i in range(k)]
    keypairs = {name: MaskingKeyPair.generate() for name in names}
    publics = {name: keypair.public for name, keypair in keypairs.items()}
    encoder = FixedPointEncoder()
    parties = [
        MaskedSumParty(
            name=name,
            keypair=keypairs[name],
            peer_publics=publics,
            session=b"bench",
            encoder=encoder,
        )
        for name in names
    ]
    rounds = itertools.count()  # every call is a fresh round: a domain is single-use

    def masked_sum() -> np.ndarray:
        round_ = next(rounds)
        contributions = {
            party.name: party.mask(x, round=round_, group=names, tensor="h")
            for party, x in zip(parties, arrays, strict=True)
        }
        total = MaskedSumAggregator.add(contributions, group=names)
        return decode_sum(total, encoder=encoder, terms=k)

    benchmark.group = f"n={n:.0e} K={k}"
    benchmark.extra_info.update(n=n, parties=k, path="masked")
    decoded = benchmark(masked_sum)
    np.testing.assert_allclose(decoded, plain_sum(arrays), atol=1e-3)
