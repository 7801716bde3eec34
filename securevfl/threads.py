"""How many compute threads a role process uses (torch intra-op, BLAS, OpenMP), whichever
command starts it.

The BLAS and OpenMP libraries read their thread count once, from the environment, when NumPy or
torch is first imported; so `securevfl.cli.main` sets it before anything imports them, and each
role then tells torch too. The value comes from ``[run] threads``; without it, 1 when several
roles share this machine (`securevfl run`, `predict`, `demo`: more threads than cores would make
every role wait on the others), else half the cores, at most 4 (a role alone on its host; small
models gain little beyond that). The environment wins: ``OMP_NUM_THREADS`` set by the user is
the count (and fills the other variables), and no variable the user set is changed.

Roles started together on one machine (`securevfl run`, `predict`, `demo`, the benchmarks) are
also each pinned to one core, round-robin over the cores the launcher may use (``[run]
pin_cores``, on by default): the launcher gives each role its index in ``SECUREVFL_CPU`` and the
role pins itself (`pin_from_env`) before it starts any thread, so its ZeroMQ I/O thread, its
heartbeat thread and its compute share that core. A message between two threads of one process
then wakes a thread on the same core instead of another one; on a small virtual machine each
such wake-up across cores is an interrupt between virtual CPUs, and a federation makes several
per batch (measured in the README's "Roles pinned to cores"). A role started by hand is pinned
only when ``SECUREVFL_CPU`` is set for it.

Nothing here imports NumPy or torch at module level.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

# the environment variables the thread pools of OpenMP, OpenBLAS, MKL, Accelerate, numexpr read
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)
MAX_DEFAULT_THREADS = 4
# the index of the core a role process pins itself to (among those it may use), set per role by
# whoever starts the roles of one machine
CPU_ENV = "SECUREVFL_CPU"


def default_threads(*, shared: bool, cores: int | None = None) -> int:
    """Threads of one role process when the config does not say: 1 when roles share the
    machine, else half the cores (at least 1, at most `MAX_DEFAULT_THREADS`)."""
    if shared:
        return 1
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_THREADS, cores // 2))


def set_thread_env(threads: int, env: MutableMapping[str, str] | None = None) -> int:
    """Set every thread variable the user has not set; returns the count the process uses:
    the user's ``OMP_NUM_THREADS`` when it is a positive integer (it then also fills the
    other variables), else `threads`."""
    env = os.environ if env is None else env
    chosen = thread_count(env, default=threads)
    for var in THREAD_VARS:
        env.setdefault(var, str(chosen))
    return chosen


def apply_torch_threads(threads: int) -> None:
    """Tell torch (already imported by a role) how many intra-op threads to use."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def configured_threads(config: Path | None, overrides: Mapping[str, Any] | None = None) -> Any:
    """``[run] threads`` read from the TOML file without validating the rest (and without
    importing NumPy): None when absent or unreadable; `load_config` reports any error later."""
    value: Any = None
    if config is not None:
        try:
            raw = tomllib.loads(Path(config).read_bytes().decode("utf-8-sig"))
            run = raw.get("run", {})
            value = run.get("threads") if isinstance(run, Mapping) else None
        except (OSError, ValueError):
            value = None
    if overrides and "run.threads" in overrides:
        value = overrides["run.threads"]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
        return None
    return value


def prepare_threads(
    config: Path | None, *, shared: bool, overrides: Mapping[str, Any] | None = None
) -> int:
    """Before NumPy or torch is imported: the role's thread count, set in the environment."""
    threads = configured_threads(config, overrides)
    return set_thread_env(threads if threads is not None else default_threads(shared=shared))


def thread_count(env: Mapping[str, str] | None = None, default: int = 1) -> int:
    """The thread count the environment says (``OMP_NUM_THREADS``), else `default`."""
    env = os.environ if env is None else env
    try:
        n = int(env.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return default
    return n if n >= 1 else default


def role_cpus(roles: list[str] | tuple[str, ...]) -> dict[str, int]:
    """Each role's core index, round-robin in the order given (the launcher's: the active
    party, the aggregator, then the parties, so that these two are on different cores)."""
    return {role: i for i, role in enumerate(roles)}


def pin_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """Pin this process to one core when ``SECUREVFL_CPU`` says which: its value modulo the
    cores this process may use, counted in order. Returns the core, or None when the variable
    is unset or empty, the system cannot or will not pin (no ``sched_setaffinity``, or it
    refuses) or only one core is usable. Raises ValueError, naming the variable and the fix,
    for a value that is not a non-negative integer. Call it before any thread starts: threads
    inherit the pinning."""
    env = os.environ if env is None else env
    text = env.get(CPU_ENV, "").strip()
    if not text:
        return None
    try:
        index = int(text)
    except ValueError:
        index = -1
    if index < 0:
        raise ValueError(
            f"{CPU_ENV}={text!r} is not a core index (a non-negative integer); unset it to "
            "leave the role's placement to the system"
        )
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    cpu = cpus[index % len(cpus)]
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:  # refused here (a container's policy): placement stays with the system
        return None
    return cpu


def process_cpus() -> list[int] | None:
    """The cores this process may run on (a role's statistics; None where the system does not
    say)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))
