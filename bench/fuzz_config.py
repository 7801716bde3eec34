"""Config fuzzing: N mutated documents (half byte-level mutations of a valid TOML file, half
structural: a random value of a random type at a random key of the parsed document, or a
`--set` override), each parsed; anything but a valid config or a `ConfigError` is a crash.
Writes the counts and the first crashes to JSON.

    python bench/fuzz_config.py --n 100000 --out bench/results/fuzz_config.json
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(10 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, -1, 1, 2**63, -(2**70), 10**400 if False else 2**100, 7])
    if kind == 3:
        return rng.choice([float("nan"), float("inf"), -0.0, 1e308, 0.5, -3.2])
    if kind == 4:
        return "".join(chr(rng.randrange(0, 0x250)) for _ in range(rng.randrange(0, 8)))
    if kind == 5:
        return rng.choice(["plain", "mask", "ckks", "laser", "vfem", "", "\x00", "a.csv", "*"])
    if kind == 6:
        return rng.choice(["X1", "X2", "ID", "Y", "columns"])
    if kind in (7, 8):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    return {
        random_value(rng, 2)
        if rng.random() < 0.2
        else rng.choice(["columns", "p", "kind", "clip", "noise_multiplier", "x"]): random_value(
            rng, depth + 1
        )
        for _ in range(rng.randrange(0, 4))
        if True
    }


def keys_of(raw, prefix=()):
    for k, v in raw.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from keys_of(v, (*prefix, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz_config.json")
    args = ap.parse_args()
    from securevfl.config import load_config, parse_config
    from securevfl.errors import ConfigError
    from tests.securevfl.conftest import BASE_RAW, permissive_policy, write_toml

    rng = random.Random(args.seed)
    base = permissive_policy(copy.deepcopy(BASE_RAW))
    keys = list(keys_of(base)) + [("policy",), ("extra",), ("parties", "zeta"), ("method", "x")]
    counts = {"valid": 0, "config_error": 0, "crash": 0}
    crashes: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_toml(copy.deepcopy(base), Path(tmp) / "config.toml")
        text = path.read_bytes()
        fuzzed = Path(tmp) / "fuzzed.toml"
        for i in range(args.n):
            try:
                mode = i % 3
                if mode == 0:  # bytes
                    data = bytearray(text)
                    for _ in range(rng.randrange(1, 4)):
                        pos = rng.randrange(len(data))
                        op = rng.randrange(3)
                        if op == 0:
                            data[pos] ^= 1 << rng.randrange(8)
                        elif op == 1:
                            del data[pos : pos + rng.randrange(1, 20)]
                        else:
                            data[pos:pos] = bytes(
                                rng.randrange(256) for _ in range(rng.randrange(1, 6))
                            )
                    fuzzed.write_bytes(bytes(data))
                    load_config(fuzzed)
                elif mode == 1:  # structure
                    raw = copy.deepcopy(base)
                    where = rng.choice(keys)
                    node = raw
                    for k in where[:-1]:
                        if not isinstance(node.get(k), dict):
                            node[k] = {}
                        node = node[k]
                    node[where[-1]] = random_value(rng)
                    parse_config(raw, source=Path(tmp) / "config.toml")
                else:  # --set
                    where = rng.choice(keys)
                    dotted = (
                        ".".join(map(str, where[:2]))
                        if rng.random() < 0.8
                        else str(random_value(rng))
                    )
                    load_config(path, overrides={dotted: random_value(rng)})
                counts["valid"] += 1
            except ConfigError:
                counts["config_error"] += 1
            except Exception as exc:  # a crash: anything but a clean refusal
                counts["crash"] += 1
                if len(crashes) < 20:
                    crashes.append(
                        {
                            "i": i,
                            "mode": mode,
                            "error": repr(exc),
                            "where": traceback.format_exc().splitlines()[-3],
                        }
                    )
            if (i + 1) % 10_000 == 0:
                print(f"{i + 1} inputs: {counts}", flush=True)
    result = {
        "inputs": args.n,
        **counts,
        "seconds": round(time.perf_counter() - started, 1),
        "crashes": crashes,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "crashes"}))
    for c in crashes[:10]:
        print(c)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
