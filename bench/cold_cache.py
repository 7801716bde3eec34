"""What a split-NN party's batch costs with its caches warm and with them cold, in one process.

In a federation on a small machine every role shares a core with others, so between two of its
batches the other roles' work evicts its code and data from the caches: a party's model work
then costs a multiple of what the same work costs in a loop (or in the centralised process,
which runs every encoder back to back). This measures that multiple on the party's own model
(a Linear-ReLU-Linear encoder on `--cols` columns, Adam): per batch, the CPU time (thread
time) of the forward (rows read by position, the encoder) and of the backward and the
optimiser's step, warm (right after an untimed batch of the same model) and cold (a read of
`--trash-mb` MB, more than the last-level cache, before each timed part). Arms: torch's Adam
and `Tensor.backward`; securevfl's LeanAdam (`securevfl.methods.blocks.lean_adam`) and
`Tensor.backward`; LeanAdam and `securevfl.methods.blocks.nets.run_backward` (what the roles
run); interleaved batch by batch so that the machine's load hits them alike.

    python bench/cold_cache.py [--batches 1500] [--trash-mb 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def measure(
    *,
    rows: int = 24_000,
    cols: int = 6,
    hidden: int = 64,
    width: int = 16,
    batch: int = 256,
    batches: int = 1500,
    warmup: int = 200,
    trash_mb: int = 64,
    seed: int = 0,
) -> dict:
    """Median CPU ms per batch of each part, by optimiser and cache state."""
    import torch

    from securevfl.methods.blocks.lean_adam import LeanAdam
    from securevfl.methods.blocks.nets import mlp, run_backward

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    table = rng.random((rows, cols), dtype=np.float32)
    trash = np.ones(max(trash_mb, 1) << 17)  # float64: trash_mb MB

    def evict() -> None:
        trash.sum()

    def tensor_backward(out, grad) -> None:
        out.backward(grad)

    arms = {}
    for name, make, backward in (
        ("torch_adam", torch.optim.Adam, tensor_backward),
        ("lean_adam", LeanAdam, tensor_backward),
        ("lean_adam_run_backward", LeanAdam, run_backward),  # what securevfl's roles run
    ):
        encoder = mlp(cols, [hidden], width, seed=seed)  # a split-NN party's encoder
        arms[name] = (encoder, make(encoder.parameters(), lr=1e-3), backward)

    def one(encoder, opt, backward, cold: bool) -> tuple[float, float]:
        ids = rng.integers(0, rows, batch)
        grad = torch.from_numpy(rng.standard_normal((batch, width), dtype=np.float32))
        if cold:
            evict()
        t0 = time.thread_time()
        out = encoder(torch.from_numpy(table[ids]))
        out.detach().numpy()
        t1 = time.thread_time()
        if cold:
            evict()
        t2 = time.thread_time()
        opt.zero_grad()
        backward(out, grad)
        opt.step()
        t3 = time.thread_time()
        return t1 - t0, t3 - t2

    samples = {(name, state): [] for name in arms for state in ("warm", "cold")}
    for i in range(warmup + batches):
        for state in ("warm", "cold"):
            for name, (encoder, opt, backward) in arms.items():
                if state == "warm":  # the batch before, untimed: its caches are this one's
                    one(encoder, opt, backward, cold=False)
                got = one(encoder, opt, backward, cold=state == "cold")
                if i >= warmup:
                    samples[(name, state)].append(got)
    result = {}
    for (name, state), got in samples.items():
        forward = statistics.median(s[0] for s in got) * 1e3
        backward = statistics.median(s[1] for s in got) * 1e3
        result.setdefault(name, {})[state] = {
            "forward_ms": round(forward, 4),
            "backward_step_ms": round(backward, 4),
        }
    for states in result.values():
        for part in ("forward_ms", "backward_step_ms"):
            states[f"cold_over_warm_{part[:-3]}"] = round(
                states["cold"][part] / states["warm"][part], 2
            )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=24_000)
    ap.add_argument("--cols", type=int, default=6)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--batches", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--trash-mb", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    sizes = ("rows", "cols", "batch", "batches", "warmup", "trash_mb")
    result = measure(**{name: getattr(args, name) for name in sizes})
    report = {
        "command": "python bench/cold_cache.py " + " ".join(argv or sys.argv[1:]),
        "machine": platform.processor() or platform.machine(),
        "result": result,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
