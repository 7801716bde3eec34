"""CKKS parameter sets for sums: security, precision, bytes per value and throughput, as JSON.

    python bench/ckks_params.py [--out bench/results/ckks_params.json] [--n 100000] [--quick]

For the design's default parameters and for the sets :func:`crypto.ckks.choose_params` picks
for a few (precision, magnitude, K) requests, it prints and records:

- the security level (the highest row of the HE standard the set meets) and the modelled
  precision of a released sum (bits after the point, flooding with flood_bits = 10 included)
  and of the raw decryption, and the largest sum the set holds;
- measured: the worst raw decryption error and the released error's standard deviation for a
  sum of K = 4 contributions of n values, and the serialized ciphertext bytes per value;
- throughput in values per second: encrypt (fresh, as before), encrypt with encryptions of
  zero prepared off the critical path (and the preparation itself), the aggregator's add of K
  contributions (load, check, add, serialize), decrypt (raw) and decrypt with the release;
- whether TenSEAL releases the GIL: a pure-Python counter thread's progress beside encryption
  and decryption, relative to its progress beside time.sleep (releases) and beside a
  GIL-holding Python loop.

Timings are medians over repeats (2 cores shared with other jobs), best alongside, in wall-clock
and in CPU time of the measuring thread (TenSEAL is single-threaded; CPU time is not inflated by
other jobs' processes). The printed table shows CPU-time throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import tenseal as ts

from crypto.ckks import (
    DEFAULT_CKKS_PARAMS,
    CkksKeyHolder,
    CkksParams,
    CkksPublic,
    DecryptionRelease,
    choose_params,
    describe_params,
    error_bound,
)

TERMS = 4
FLOOD_BITS = 10
# (precision_bits of the released sum, magnitude per contribution, terms, security bits)
REQUESTS = [
    (11, 2.0**10, TERMS, 128),
    (16, 2.0**10, TERMS, 128),
    (20, 2.0**10, TERMS, 128),
    (11, 2.0**20, TERMS, 128),
    (11, 2.0**10, TERMS, 256),
    # the Credit benchmark's sums: 4 parties + the active party, [secure] ckks defaults
    (12, 2.0**20, TERMS + 1, 128),  # magnitude = [secure] bound (default 2^20)
    (12, 2.0**10, TERMS + 1, 128),  # [secure] ckks.magnitude = 1024
]


def timed(call: Callable[[], object], repeats: int) -> dict[str, float]:
    """Median and best wall-clock and CPU (this thread) seconds of ``call``, after a warm-up."""
    call()
    wall, cpu = [], []
    for _ in range(repeats):
        begin_cpu, begin = time.thread_time(), time.perf_counter()
        call()
        wall.append(time.perf_counter() - begin)
        cpu.append(time.thread_time() - begin_cpu)
    return {
        "median_s": statistics.median(wall),
        "best_s": min(wall),
        "cpu_median_s": statistics.median(cpu),
        "cpu_best_s": min(cpu),
    }


def counter_progress(work: Callable[[], object], seconds: float = 0.6) -> float:
    """Iterations per second of a pure-Python counter thread while ``work`` runs in a loop."""
    stop = threading.Event()
    counts: list[int] = []

    def count() -> None:
        c = 0
        while not stop.is_set():
            c += 1
        counts.append(c)

    thread = threading.Thread(target=count)
    thread.start()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work()
    stop.set()
    thread.join()
    return counts[0] / seconds


def gil_probe(public: CkksPublic, holder: CkksKeyHolder) -> dict[str, float | bool]:
    """Counter progress beside each operation, as a fraction of its progress beside sleep."""
    x = np.random.default_rng(0).normal(size=public.slots)
    packed = public.encrypt(x)

    def python_loop() -> None:
        total = 0
        for i in range(20_000):
            total += i

    reference = counter_progress(lambda: time.sleep(0.001))
    result: dict[str, float | bool] = {
        "python_loop": counter_progress(python_loop) / reference,
        "encrypt": counter_progress(lambda: public.encrypt(x)) / reference,
        "decrypt": counter_progress(lambda: holder.decrypt_sum(packed, shape=(x.size,)))
        / reference,
        "add": counter_progress(lambda: public.add([packed, packed])) / reference,
    }
    # Releasing the GIL would leave the counter near its pace beside sleep (given a free core),
    # holding it leaves it near its pace beside a Python loop (about half).
    result["releases_gil"] = bool(
        min(result["encrypt"], result["decrypt"]) > (1 + result["python_loop"]) / 2
    )
    return result


def measure(params: CkksParams, *, n: int, repeats: int, label: str) -> dict:
    holder = CkksKeyHolder(params=params)
    public = CkksPublic(context_bytes=holder.public_context_bytes())
    sizing = describe_params(params, terms=TERMS, flood_bits=FLOOD_BITS)
    magnitude = min(2.0**params.magnitude_bits / TERMS, 2.0**10)
    rng = np.random.default_rng(n)
    xs = [rng.uniform(-magnitude, magnitude, n) for _ in range(TERMS)]
    contributions = [public.encrypt(x) for x in xs]
    total = public.add(contributions)
    exact = np.sum(xs, axis=0)
    raw = holder.decrypt_sum(total, shape=(n,))
    release = DecryptionRelease(precision_bits=20, flood_bits=FLOOD_BITS)
    released = holder.decrypt_sum(total, shape=(n,), release=release, terms=TERMS)
    chunk_bytes = sum(len(c) for c in contributions[0].chunks)
    x = xs[0]

    def prepared_encrypt() -> None:
        public.prepare_zeros(n)
        begin_cpu, begin = time.thread_time(), time.perf_counter()
        public.encrypt(x)
        prepared_wall.append(time.perf_counter() - begin)
        prepared_cpu.append(time.thread_time() - begin_cpu)

    prepared_wall: list[float] = []
    prepared_cpu: list[float] = []
    timings = {
        "encrypt": timed(lambda: public.encrypt(x), repeats),
        "prepare_zeros": timed(
            lambda: (public.prepare_zeros(n), public._zeros.clear()),
            repeats,
        ),
        "add": timed(lambda: public.add(contributions), repeats),
        "decrypt": timed(lambda: holder.decrypt_sum(total, shape=(n,)), repeats),
        "decrypt_release": timed(
            lambda: holder.decrypt_sum(total, shape=(n,), release=release, terms=TERMS), repeats
        ),
    }
    timed(prepared_encrypt, repeats)
    timings["encrypt_prepared"] = {
        "median_s": statistics.median(prepared_wall[1:]),
        "best_s": min(prepared_wall[1:]),
        "cpu_median_s": statistics.median(prepared_cpu[1:]),
        "cpu_best_s": min(prepared_cpu[1:]),
    }
    row = {
        "label": label,
        **sizing.as_dict(),
        "n": n,
        "chunks": len(contributions[0].chunks),
        "measured_bytes_per_value": chunk_bytes / n,
        "public_context_bytes": len(holder.public_context_bytes()),
        "error_bound": error_bound(params, terms=TERMS),
        "measured_worst_raw_error": float(np.max(np.abs(raw - exact))),
        "flood_std": release.flood_std(params, terms=TERMS),
        "measured_released_error_std": float(np.std(released - exact)),
        "values_per_s": {name: n / t["median_s"] for name, t in timings.items()},
        "values_per_s_cpu": {name: n / t["cpu_median_s"] for name, t in timings.items()},
        "timings": timings,
    }
    row["gil"] = gil_probe(public, holder)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("bench/results/ckks_params.json")
    )
    parser.add_argument("--n", type=int, default=100_000, help="values per contribution")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="n = 20000, 3 repeats")
    args = parser.parse_args(argv)
    n, repeats = (20_000, 3) if args.quick else (args.n, args.repeats)

    candidates: list[tuple[str, CkksParams, dict]] = [("default", DEFAULT_CKKS_PARAMS, {})]
    for precision, magnitude, terms, security in REQUESTS:
        sizing = choose_params(
            precision_bits=precision,
            magnitude=magnitude,
            terms=terms,
            flood_bits=FLOOD_BITS,
            security_bits=security,
        )
        request = {
            "precision_bits": precision,
            "magnitude": magnitude,
            "terms": terms,
            "security_bits": security,
        }
        label = f"p{precision}-m2^{int(np.log2(magnitude))}-K{terms}-s{security}"
        candidates.append((label, sizing.params, request))

    rows = []
    header = (
        f"{'set':<22} {'N':>6} {'primes':<14} {'sec':>4} {'prec':>5} {'B/val':>6} "
        f"{'enc/s':>9} {'enc0/s':>9} {'add4/s':>9} {'dec/s':>9} {'err/bound':>9}"
    )
    print(header)
    for label, params, request in candidates:
        row = measure(params, n=n, repeats=repeats, label=label)
        row["request"] = request
        rows.append(row)
        v = row["values_per_s_cpu"]
        print(
            f"{label:<22} {params.poly_modulus_degree:>6} "
            f"{','.join(map(str, params.coeff_mod_bit_sizes)):<14} {row['security_bits']:>4} "
            f"{row['precision_bits']:>5.1f} {row['measured_bytes_per_value']:>6.1f} "
            f"{v['encrypt']:>9.0f} {v['encrypt_prepared']:>9.0f} {v['add']:>9.0f} "
            f"{v['decrypt']:>9.0f} {row['measured_worst_raw_error'] / row['error_bound']:>9.3f}",
            flush=True,
        )
    report = {
        "meta": {
            "python": platform.python_version(),
            "tenseal": ts.__version__,
            "numpy": np.__version__,
            "cpu_count": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(),
            "terms": TERMS,
            "flood_bits": FLOOD_BITS,
            "n": n,
            "timing": f"medians of {repeats} repeats (best alongside), wall and CPU time",
            "command": "python " + " ".join(sys.argv),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "sets": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    gil = rows[0]["gil"]
    print(
        f"GIL: counter beside encrypt {gil['encrypt']:.2f}, decrypt {gil['decrypt']:.2f}, "
        f"Python loop {gil['python_loop']:.2f} of its pace beside sleep -> releases the GIL: "
        f"{gil['releases_gil']}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
