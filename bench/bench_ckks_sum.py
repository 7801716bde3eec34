"""Benchmarks of the CKKS secure sum: encrypt (per party), add (aggregator), decrypt (key holder).

n values per party in {1e3, 1e4, 1e5}; K parties in {2, 4, 8} for the aggregator's add (encrypt
is per party and decrypt is of one summed ciphertext, so neither depends on K). Each benchmark
runs for the design's default parameters and for the set ``choose_params`` picks for 4 parties,
|x| <= 1024 and 11 bits after the point once flooded (the defaults' released precision); the
per-set comparison with security and precision is ``bench/ckks_params.py``.

Run the benchmarks::

    .venv/bin/pytest bench/bench_ckks_sum.py --benchmark-columns=min,mean,max,rounds

Or print the one-off measurements (chunk size, per-chunk timings)::

    .venv/bin/python bench/bench_ckks_sum.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from crypto.ckks import (
    DEFAULT_CKKS_PARAMS,
    CkksKeyHolder,
    CkksPublic,
    PackedCiphertexts,
    choose_params,
)

SIZES = [1_000, 10_000, 100_000]
PARTIES = [2, 4, 8]
ROUNDS = 5
PARAM_SETS = {
    "default": DEFAULT_CKKS_PARAMS,
    "chosen": choose_params(precision_bits=11, magnitude=2.0**10, terms=4).params,
    # what a Credit run with 4 parties chooses by default ([secure] bound 2^20, 12 bits)
    "credit": choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params,
}


@pytest.fixture(scope="module", params=sorted(PARAM_SETS))
def key_holder(request) -> CkksKeyHolder:
    return CkksKeyHolder(params=PARAM_SETS[request.param])


@pytest.fixture(scope="module")
def public(key_holder: CkksKeyHolder) -> CkksPublic:
    return CkksPublic(context_bytes=key_holder.public_context_bytes())


def _contributions(public: CkksPublic, n: int, k: int) -> list[PackedCiphertexts]:
    rng = np.random.default_rng(n + k)
    return [public.encrypt(rng.normal(size=n)) for _ in range(k)]


@pytest.mark.parametrize("n", SIZES)
def test_encrypt_per_party(benchmark, public: CkksPublic, n: int) -> None:
    x = np.random.default_rng(n).normal(size=n)
    packed = benchmark.pedantic(public.encrypt, args=(x,), rounds=ROUNDS, iterations=1)
    benchmark.extra_info["chunks"] = len(packed.chunks)
    benchmark.extra_info["bytes"] = sum(len(c) for c in packed.chunks)


@pytest.mark.parametrize("n", SIZES)
def test_encrypt_with_prepared_zeros(benchmark, public: CkksPublic, n: int) -> None:
    # The critical path once encryptions of zero were prepared while waiting on the network.
    x = np.random.default_rng(n).normal(size=n)
    benchmark.pedantic(
        public.encrypt, args=(x,), setup=lambda: public.prepare_zeros(n), rounds=ROUNDS
    )


@pytest.mark.parametrize("k", PARTIES)
@pytest.mark.parametrize("n", SIZES)
def test_add_aggregator(benchmark, public: CkksPublic, n: int, k: int) -> None:
    contributions = _contributions(public, n, k)
    benchmark.pedantic(public.add, args=(contributions,), rounds=ROUNDS, iterations=1)
    benchmark.extra_info["bytes_in"] = sum(len(c) for p in contributions for c in p.chunks)


@pytest.mark.parametrize("n", SIZES)
def test_decrypt_key_holder(
    benchmark, key_holder: CkksKeyHolder, public: CkksPublic, n: int
) -> None:
    # A sum is one ciphertext per chunk whatever K was, so decryption depends on n only.
    total = public.add(_contributions(public, n, 2))
    out = benchmark.pedantic(
        key_holder.decrypt_sum, args=(total,), kwargs={"shape": (n,)}, rounds=ROUNDS, iterations=1
    )
    assert out.shape == (n,)


def _best_of(fn: Callable[[], object], repeats: int = 20) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Print the one-off figures (best of 20, wall clock): one full chunk at the design's default
    parameters, then one Credit split-NN batch (256 rows x width 16 = 4096 values, 4 parties
    and the active party's sizing) at the parameters a run chooses by default and with
    ``[secure] ckks.magnitude = 1024``."""
    key_holder = CkksKeyHolder()
    public = CkksPublic(context_bytes=key_holder.public_context_bytes())
    x = np.random.default_rng(0).normal(size=public.slots)
    a, b = public.encrypt(x), public.encrypt(x)
    total = public.add([a, b])
    print(f"params: {public.params}")
    print(f"public context: {len(key_holder.public_context_bytes())} bytes")
    print(f"bytes per ciphertext chunk ({public.slots} values): {len(a.chunks[0])}")
    print(f"encrypt {public.slots} values: {_best_of(lambda: public.encrypt(x)) * 1e3:.2f} ms")
    print(
        "add two chunks (load, add, serialize): "
        f"{_best_of(lambda: public.add([a, b])) * 1e3:.2f} ms"
    )
    print(
        f"decrypt one chunk (load, check, decrypt): "
        f"{_best_of(lambda: key_holder.decrypt_sum(total, shape=(public.slots,))) * 1e3:.2f} ms"
    )
    for label, magnitude in (("default bound 2^20", 2.0**20), ("ckks.magnitude 1024", 1024.0)):
        _credit_batch(label, magnitude)


def _credit_batch(label: str, magnitude: float) -> None:
    """One Credit split-NN batch: 4 parties encrypt 256 x 16 values, the aggregator adds."""
    params = choose_params(precision_bits=12, magnitude=magnitude, terms=5).params
    holder = CkksKeyHolder(params=params)
    party = CkksPublic(context_bytes=holder.public_context_bytes())
    batch = np.random.default_rng(1).normal(size=256 * 16)
    packs = [party.encrypt(batch) for _ in range(4)]
    total = party.add(packs)

    def prepared_encrypt() -> None:
        party.prepare_zeros(batch.size)
        party.encrypt(batch)

    sent = sum(len(c) for c in packs[0].chunks)
    encrypt = _best_of(lambda: party.encrypt(batch))
    prepared = _best_of(prepared_encrypt)
    add = _best_of(lambda: party.add(packs))
    decrypt = _best_of(lambda: holder.decrypt_sum(total, shape=(256, 16)))
    print(
        f"Credit batch, {label}: {params}, {sent} bytes per party "
        f"({sent / (4 * batch.size):.2f}x float32); encrypt {encrypt * 1e3:.2f} ms, "
        f"prepare zeros + encrypt {prepared * 1e3:.2f} ms, add 4 {add * 1e3:.2f} ms, "
        f"decrypt {decrypt * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
