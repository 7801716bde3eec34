"""How many compute threads a role process uses (torch intra-op, BLAS, OpenMP), whichever
command starts it.

The BLAS and OpenMP libraries read their thread count once, from the environment, when NumPy or
torch is first imported; so `securevfl.cli.main` sets it before anything imports them, and each
role then tells torch too. The value comes from ``[run] threads``; without it, 1 when several
roles share this machine (`securevfl run`, `predict`, `demo`: more threads than cores would make
every role wait on the others), else half the cores, at most 4 (a role alone on its host; small
models gain little beyond that). The environment wins: ``OMP_NUM_THREADS`` set by the user is
the count (and fills the other variables), and no variable the user set is changed.

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
