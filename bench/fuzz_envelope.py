"""Long fuzz run of the envelope decoder (``transport.unpack``), by hand, not in CI.

    python bench/fuzz_envelope.py                       # 10^6 inputs, atheris if installed
    python bench/fuzz_envelope.py --engine random --jobs 2 --inputs 1000000
    python bench/fuzz_envelope.py --engine atheris --inputs 1000000

Each input is a list of frames decoded with two sets of limits (the defaults, and small
ones). The only acceptable outcomes are an ``Envelope`` or an ``EnvelopeError``; anything
else is a crash, counted by class with samples. Writes ``bench/results/fuzz_envelope.json``
(inputs, crashes, rejections, accepted, seconds, slowest decode after a warm-up) and exits
1 on a crash (the random engine; atheris leaves through libFuzzer, check ``crashes``).

Engines:
  * ``atheris`` (``pip install atheris``): coverage-guided libFuzzer over an encoding of
    frame lists, seeded with valid envelopes; half of its mutations are libFuzzer's own
    byte-level ones, half the structure-aware ones of ``tests/transport/envelope_mutations``
    (bit flips, truncations, header field swaps, shape/dtype/descriptor edits, frame
    drops/duplicates/additions). Instruments ``transport`` for coverage. The corpus it
    grows is left in a ``fuzz_envelope_corpus_*`` temporary directory (libFuzzer leaves
    with exit(), so nothing can remove it after the last run).
  * ``random``: the same structure-aware mutations driven by a seeded ``random.Random``,
    reproducible, split over ``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DEFAULT_OUT = REPO / "bench" / "results" / "fuzz_envelope.json"
SAMPLES_PER_CLASS = 5
PROGRESS_EVERY = 50_000
WARM_UP = 1000  # the first decodes pay for imports and caches: not counted as slowest


def encode_frames(frames: list[bytes]) -> bytes:
    """Frames as one byte string: each a 4-byte little-endian length, then its bytes."""
    return b"".join(len(f).to_bytes(4, "little") + bytes(f) for f in frames)


def decode_frames(data: bytes) -> list[bytes]:
    """Inverse of :func:`encode_frames`, total: any bytes give some list of frames (a length
    that runs past the end takes what is left), so byte-level mutations stay meaningful."""
    frames = []
    pos = 0
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "little")
        frames.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return frames


class Tally:
    """Outcome counts; crashes kept by class (exception type and first words) with samples."""

    def __init__(self) -> None:
        self.inputs = 0
        self.rejected = 0
        self.accepted = 0
        self.crashes = 0
        self.classes: dict[str, dict[str, Any]] = {}
        self.slowest_us = 0.0
        self.slowest_input = ""

    def run(self, frames: list[bytes], decoder: Callable[[list[bytes]], None]) -> None:
        from transport import EnvelopeError

        self.inputs += 1
        start = time.perf_counter()
        try:
            decoder(frames)
            self.accepted += 1
        except EnvelopeError:
            self.rejected += 1
        except Exception as exc:  # the thing we hunt: any other exception is a crash
            self.crashes += 1
            key = f"{type(exc).__name__}: {str(exc)[:80]}"
            entry = self.classes.setdefault(key, {"count": 0, "samples": []})
            entry["count"] += 1
            if len(entry["samples"]) < SAMPLES_PER_CLASS:
                entry["samples"].append(encode_frames(frames)[:4096].hex())
        elapsed = (time.perf_counter() - start) * 1e6
        if elapsed > self.slowest_us and self.inputs > WARM_UP:
            encoded = encode_frames(frames)
            if len(encoded) <= 65536:  # kept whole, so that it can be timed again
                self.slowest_us = elapsed
                self.slowest_input = encoded.hex()

    def merge(self, other: dict[str, Any]) -> None:
        for name in ("inputs", "rejected", "accepted", "crashes"):
            setattr(self, name, getattr(self, name) + other[name])
        for key, entry in other["classes"].items():
            mine = self.classes.setdefault(key, {"count": 0, "samples": []})
            mine["count"] += entry["count"]
            mine["samples"] = (mine["samples"] + entry["samples"])[:SAMPLES_PER_CLASS]
        if other["slowest_us"] > self.slowest_us:
            self.slowest_us = other["slowest_us"]
            self.slowest_input = other["slowest_input"]

    def retime_slowest(self, decoder: Callable[[list[bytes]], None]) -> float:
        """The slowest input's decode time, best of 5: a scheduler hiccup is not a slow input."""
        if not self.slowest_input:
            return 0.0
        frames = decode_frames(bytes.fromhex(self.slowest_input))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            try:
                decoder(frames)
            except Exception:  # outcomes were counted already; only the time matters here
                pass
            best = min(best, time.perf_counter() - start)
        return round(best * 1e6, 1)

    def as_dict(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "decodes_per_input": 2,  # see make_decoder: small limits, then the defaults
            "rejected": self.rejected,
            "accepted": self.accepted,
            "crashes": self.crashes,
            "classes": self.classes,
            "slowest_us": round(self.slowest_us, 1),
            "slowest_input": self.slowest_input,
        }


def make_decoder() -> Callable[[list[bytes]], None]:
    """unpack under the default limits and under small ones (different rejection paths)."""
    from tests.transport.envelope_mutations import KINDS
    from transport import EnvelopeError, Limits, unpack

    small = Limits(max_message_bytes=4096, max_header_bytes=2048, max_tensors=4, max_ndim=3)

    def decode(frames: list[bytes]) -> None:
        try:
            unpack(frames, kinds=KINDS, limits=small)
        except EnvelopeError:
            pass
        unpack(frames, kinds=KINDS)

    return decode


# ----------------------------------------------------------------------------- random engine


def random_worker(job: tuple[int, int]) -> dict[str, Any]:
    """Run ``count`` structure-aware mutations from ``seed``; return the tally as a dict."""
    seed, count = job
    from tests.transport.envelope_mutations import mutate, seed_envelopes

    seeds = seed_envelopes()
    decoder = make_decoder()
    rng = random.Random(seed)
    tally = Tally()
    for _ in range(count):
        tally.run(mutate(rng, rng.choice(seeds)), decoder)
    return tally.as_dict()


def run_random(inputs: int, seed: int, jobs: int) -> Tally:
    shares = [inputs // jobs + (1 if i < inputs % jobs else 0) for i in range(jobs)]
    work = [(seed * 1000 + i, n) for i, n in enumerate(shares) if n]
    tally = Tally()
    if jobs == 1:
        results = [random_worker(work[0])]
    else:
        with multiprocessing.get_context("spawn").Pool(len(work)) as pool:
            results = pool.map(random_worker, work)
    for result in results:
        tally.merge(result)
    return tally


# ----------------------------------------------------------------------------- atheris engine


def run_atheris(inputs: int, seed: int, out: Path, report: Callable[[Tally, bool], None]) -> None:
    """Hand control to libFuzzer for ``inputs`` runs; the report is written from inside the
    target (libFuzzer leaves with exit(), past Python's atexit) every PROGRESS_EVERY inputs
    and on the last one."""
    import atheris

    with atheris.instrument_imports(include=["transport"]):
        import transport.envelope  # noqa: F401  (instrumented for coverage)
    from tests.transport.envelope_mutations import mutate, seed_envelopes

    seeds = seed_envelopes()
    decoder = make_decoder()
    tally = Tally()

    def test_one_input(data: bytes) -> None:
        tally.run(decode_frames(data), decoder)
        if tally.inputs % PROGRESS_EVERY == 0 or tally.inputs >= inputs:
            report(tally, tally.inputs >= inputs)

    def custom_mutator(data: bytes, max_size: int, mutation_seed: int) -> bytes:
        rng = random.Random(mutation_seed)
        if rng.random() < 0.5:
            return atheris.Mutate(data, max_size)
        frames = decode_frames(data) if data else rng.choice(seeds)
        mutated = encode_frames(mutate(rng, frames))
        return mutated if len(mutated) <= max_size else atheris.Mutate(data, max_size)

    corpus = Path(tempfile.mkdtemp(prefix="fuzz_envelope_corpus_"))
    for i, frames in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(encode_frames(frames))
    argv = [
        sys.argv[0],
        f"-runs={inputs}",
        f"-seed={seed}",
        "-max_len=65536",
        "-print_final_stats=1",
        str(corpus),
    ]
    atheris.Setup(argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


# ----------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", type=int, default=1_000_000, help="inputs to try (10^6)")
    ap.add_argument("--engine", choices=("auto", "atheris", "random"), default="auto")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1, help="processes (random engine only)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.inputs < 1 or args.jobs < 1:
        ap.error("--inputs and --jobs must be at least 1")

    engine = args.engine
    if engine == "auto":
        try:
            import atheris  # noqa: F401
        except ImportError:
            engine = "random"
        else:
            engine = "atheris"
    command = "python bench/fuzz_envelope.py " + " ".join(sys.argv[1:])
    started = time.perf_counter()

    def report(tally: Tally, final: bool) -> None:
        import msgpack
        import numpy
        import zmq

        seconds = time.perf_counter() - started
        result = {
            "target": "transport.envelope.unpack",
            "engine": engine,
            "command": command.strip(),
            "finished": final,
            "seed": args.seed,
            "jobs": args.jobs if engine == "random" else 1,
            "seconds": round(seconds, 1),
            "inputs_per_second": round(tally.inputs / max(seconds, 1e-9)),
            **tally.as_dict(),
            "slowest_retimed_us": tally.retime_slowest(make_decoder()) if final else None,
            "environment": {
                "python": platform.python_version(),
                "numpy": numpy.__version__,
                "msgpack": ".".join(map(str, msgpack.version)),
                "pyzmq": zmq.pyzmq_version(),
                "machine": platform.machine(),
            },
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        if final:
            print(
                f"{engine}: {tally.inputs} inputs, {tally.crashes} crashes, {tally.rejected} "
                f"rejected, {tally.accepted} accepted in {seconds:.1f} s -> {args.out}",
                flush=True,
            )

    if engine == "atheris":
        run_atheris(args.inputs, args.seed, args.out, report)  # exits through libFuzzer
        return 0
    tally = run_random(args.inputs, args.seed, args.jobs)
    report(tally, True)
    return 1 if tally.crashes else 0


if __name__ == "__main__":
    sys.exit(main())
