"""Throughput curve of the masked sum vs a plain float32 sum, as JSON, PNG and a table.

    python bench/masked_sum_curve.py --out bench/results/masked_sum.json

For K parties and n float32 values it measures, side by side and single-threaded:
- one party's ``mask()`` (encode + K-1 pairwise keystreams) in MB/s of float32 input;
- the plain sum of K arrays;
- the whole masked sum in one process (K masks + aggregator add + decode) and its ratio to
  the plain sum; and the critical path of a real deployment, where parties mask in parallel
  (one mask + add + decode).
Everything runs on one thread (NumPy element-wise ops and OpenSSL's AES are single-threaded).
Times are the best of several repeats (least disturbed by other load); medians are recorded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable

import cryptography
import numpy as np

from crypto import (
    FixedPointEncoder,
    MaskedSumAggregator,
    MaskedSumParty,
    MaskingKeyPair,
    decode_sum,
    keystream_uint64,
)

PARTY_COUNTS = (2, 4, 8, 16)
SIZES = (1_000, 10_000, 100_000, 1_000_000)
FLOOR_MB_PER_S = 300.0  # the floor for K=4, n=1e6


def time_call(call: Callable[[], object], *, min_total_s: float, min_repeats: int) -> dict:
    """Best and median seconds per call, repeating until ``min_total_s`` has passed."""
    call()  # warm-up: caches, lazy pair keys
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < min_repeats or time.perf_counter() - started < min_total_s:
        begin = time.perf_counter()
        call()
        samples.append(time.perf_counter() - begin)
    return {"best_s": min(samples), "median_s": statistics.median(samples), "repeats": len(samples)}


def measure(n: int, k: int, *, min_total_s: float) -> dict:
    rng = np.random.default_rng(n * 31 + k)
    arrays = [rng.standard_normal(n, dtype=np.float32) for _ in range(k)]
    names = [f"party{i:02d}" for i in range(k)]
    keypairs = {name: MaskingKeyPair.generate() for name in names}
    publics = {name: keypair.public for name, keypair in keypairs.items()}
    encoder = FixedPointEncoder()
    parties = [
        MaskedSumParty(
            name=name,
            keypair=keypairs[name],
            peer_publics=publics,
            session=b"curve",
            encoder=encoder,
        )
        for name in names
    ]
    rounds = itertools.count()  # a mask domain is single-use: every call takes a fresh round

    def plain_sum() -> np.ndarray:
        total = arrays[0].copy()
        for array in arrays[1:]:
            np.add(total, array, out=total)
        return total

    def one_mask() -> np.ndarray:
        return parties[0].mask(arrays[0], round=next(rounds), group=names, tensor="h")

    def all_masks() -> dict[str, np.ndarray]:
        round_ = next(rounds)
        return {
            party.name: party.mask(x, round=round_, group=names, tensor="h")
            for party, x in zip(parties, arrays, strict=True)
        }

    contributions = all_masks()

    def add_and_decode() -> np.ndarray:
        total = MaskedSumAggregator.add(contributions, group=names)
        return decode_sum(total, encoder=encoder, terms=k)

    decoded = add_and_decode()
    if not np.allclose(decoded, plain_sum(), atol=k * 2.0**-encoder.frac_bits + 1e-5):
        raise AssertionError(f"masked sum does not match the plain sum (n={n}, K={k})")

    repeats = 5
    plain = time_call(plain_sum, min_total_s=min_total_s, min_repeats=repeats)
    mask = time_call(one_mask, min_total_s=min_total_s, min_repeats=repeats)
    add = time_call(add_and_decode, min_total_s=min_total_s, min_repeats=repeats)
    masked_total_s = k * mask["best_s"] + add["best_s"]
    critical_path_s = mask["best_s"] + add["best_s"]
    input_mb = n * 4 / 1e6
    return {
        "parties": k,
        "n": n,
        "mask_per_party_s": mask["best_s"],
        "mask_per_party_median_s": mask["median_s"],
        "mask_mb_per_s": input_mb / mask["best_s"],
        "mask_mb_per_s_median": input_mb / mask["median_s"],
        "add_and_decode_s": add["best_s"],
        "plain_sum_s": plain["best_s"],
        "plain_sum_median_s": plain["median_s"],
        "masked_sum_s": masked_total_s,
        "ratio_masked_over_plain": masked_total_s / plain["best_s"],
        "masked_critical_path_s": critical_path_s,
        "ratio_critical_path_over_plain": critical_path_s / plain["best_s"],
    }


def keystream_gb_per_s() -> float:
    out = np.empty(1_000_000, dtype=np.uint64)
    timing = time_call(
        lambda: keystream_uint64(bytes(16), out.size, out=out), min_total_s=0.3, min_repeats=5
    )
    return out.nbytes / timing["best_s"] / 1e9


def plot(results: list[dict], png_path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for n in SIZES:
        rows = [row for row in results if row["n"] == n]
        axis.plot(
            [row["parties"] for row in rows],
            [row["mask_mb_per_s"] for row in rows],
            marker="o",
            label=f"n = {n:.0e} float32",
        )
    axis.axhline(FLOOR_MB_PER_S, color="grey", linestyle="--", label="floor (K=4, n=1e6)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(PARTY_COUNTS, [str(k) for k in PARTY_COUNTS])
    axis.set_yscale("log")
    axis.set_xlabel("parties in the group (K)")
    axis.set_ylabel("one party's mask() throughput (MB/s of float32 input)")
    axis.set_title("Pairwise masking throughput, single thread")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("bench/results/masked_sum.json")
    )
    parser.add_argument("--png", type=pathlib.Path, help="default: --out with .png suffix")
    parser.add_argument("--min-time", type=float, default=0.25, help="seconds per measurement")
    args = parser.parse_args(argv)
    png_path = args.png or args.out.with_suffix(".png")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png_path.parent.mkdir(parents=True, exist_ok=True)

    results = []
    print(f"{'K':>3} {'n':>9} {'mask MB/s':>10} {'plain ms':>9} {'masked ms':>10} {'ratio':>7}")
    for k, n in itertools.product(PARTY_COUNTS, SIZES):
        row = measure(n, k, min_total_s=args.min_time)
        results.append(row)
        print(
            f"{k:>3} {n:>9.0e} {row['mask_mb_per_s']:>10.0f} {row['plain_sum_s'] * 1e3:>9.3f} "
            f"{row['masked_sum_s'] * 1e3:>10.3f} {row['ratio_masked_over_plain']:>7.0f}",
            flush=True,
        )
    floor_row = next(row for row in results if row["parties"] == 4 and row["n"] == 1_000_000)
    report = {
        "meta": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cryptography": cryptography.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "threads": 1,
            "frac_bits": FixedPointEncoder().frac_bits,
            "timing": "best of repeats (medians recorded alongside)",
            "keystream_gb_per_s": keystream_gb_per_s(),
            "floor_mb_per_s": FLOOR_MB_PER_S,
            "floor_met": floor_row["mask_mb_per_s"] >= FLOOR_MB_PER_S,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, png_path)
    print(
        f"K=4, n=1e6: {floor_row['mask_mb_per_s']:.0f} MB/s per party "
        f"(floor {FLOOR_MB_PER_S:.0f}); keystream {report['meta']['keystream_gb_per_s']:.1f} GB/s"
    )
    print(f"wrote {args.out} and {png_path}")
    return 0 if report["meta"]["floor_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
