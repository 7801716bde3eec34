"""What a role's work on a GPU costs: time and memory, per role, written next to its run.

Where a role's models run on ``cuda`` (``[run] device``), `DeviceClock` records
- **spans**: CUDA events recorded on the current stream before and after each passive-party
  operation (`PartyRound` times `method.handle`), so per op the GPU-timeline milliseconds from
  the first launch to the last kernel of the call (CPU-side launch gaps included), and the
  number of calls;
- **kernel time** (with ``SECUREVFL_GPU_PROFILE=1``, which the benchmark sets): the sum of the
  kernels' own device time over the role's whole run, from PyTorch's profiler (CUPTI) — the
  GPU's busy time, for every role that runs models (the active party's head too); off by
  default because the profiler keeps an event per kernel for the whole run;
- **memory**: the peak bytes PyTorch's allocator held and reserved on the device.
At the role's end it writes ``RUN_DIR/device/ROLE.json``. On ``cpu`` nothing is recorded and
nothing is written. The aggregator runs no models and is never clocked.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

PROFILE_ENV = "SECUREVFL_GPU_PROFILE"


def device_clock(device: torch.device, *, role: str, run_dir: Path) -> DeviceClock | None:
    """The clock of a role whose models run on `device`; None on a CPU."""
    flag = os.environ.get(PROFILE_ENV, "").strip()
    if flag not in ("", "0", "1"):
        from securevfl.errors import ConfigError

        raise ConfigError(PROFILE_ENV, f"is {flag!r}; set 1 (profile kernels), 0 or leave it unset")
    if torch.device(device).type != "cuda":
        return None
    return DeviceClock(torch.device(device), role=role, run_dir=run_dir, profile=flag == "1")


class DeviceClock:
    """Spans, kernel time and peak memory of one role on one CUDA device (module docstring).
    Use as a context manager around the role's run: the profiler (if asked for) starts on
    entry; on exit the summary is written to ``run_dir/device/ROLE.json``."""

    def __init__(self, device: torch.device, *, role: str, run_dir: Path, profile: bool) -> None:
        self.device = device
        self.role = role
        self.path = Path(run_dir) / "device" / f"{role}.json"
        self.profile = profile
        self.span_ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.wall_s: dict[str, float] = defaultdict(float)
        self._profiler: Any = None

    @contextmanager
    def span(self, op: str) -> Iterator[None]:
        """Time one operation's device work on the current stream (it waits for its kernels:
        the caller copies the results to the host right after anyway)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        try:
            yield
        finally:
            end.record()
            end.synchronize()
            self.span_ms[op] += start.elapsed_time(end)
            self.calls[op] += 1
            self.wall_s[op] += time.perf_counter() - began

    def __enter__(self) -> DeviceClock:
        torch.cuda.reset_peak_memory_stats(self.device)
        if self.profile:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CUDA])
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        kernel: dict[str, Any] = {}
        if self._profiler is not None:
            torch.cuda.synchronize(self.device)
            self._profiler.__exit__(None, None, None)
            kernel = kernel_time(self._profiler)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.summary(kernel), indent=1) + "\n")

    def summary(self, kernel: dict[str, Any] | None = None) -> dict[str, Any]:
        mib = 2.0**20
        return {
            "role": self.role,
            "device": torch.cuda.get_device_name(self.device),
            "span_ms_by_op": {op: round(ms, 3) for op, ms in self.span_ms.items()},
            "wall_ms_by_op": {op: round(s * 1e3, 3) for op, s in self.wall_s.items()},
            "calls_by_op": dict(self.calls),
            "peak_allocated_mib": torch.cuda.max_memory_allocated(self.device) / mib,
            "peak_reserved_mib": torch.cuda.max_memory_reserved(self.device) / mib,
            **(kernel or {}),
        }


def kernel_time(prof: Any) -> dict[str, Any]:
    """Total device time of the kernels a finished profiler saw, and how many ran."""
    total_us = 0.0
    count = 0
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:  # older PyTorch
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us:
            total_us += float(us)
            count += int(event.count)
    return {"kernel_ms": round(total_us / 1e3, 3), "kernels": count}
