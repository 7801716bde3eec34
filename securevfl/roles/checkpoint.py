"""End-of-epoch checkpoints, one directory per role: RUN_DIR/checkpoints/<role>/epoch_NNNN.pt.

Saved atomically (write to a temporary file, then rename) and loaded with `weights_only=True`,
so a checkpoint file cannot run code when it is read."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from securevfl.errors import CheckpointError

KEEP = 2
_NAME = re.compile(r"epoch_(\d{4,})\.pt$")


def checkpoint_dir(run_dir: Path, role: str) -> Path:
    return Path(run_dir) / "checkpoints" / role


def save_checkpoint(run_dir: Path, role: str, epoch: int, state: Mapping[str, Any]) -> Path:
    d = checkpoint_dir(run_dir, role)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"epoch_{epoch:04d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(dict(state), tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    for old in sorted(epochs(run_dir, role))[:-KEEP]:
        (d / f"epoch_{old:04d}.pt").unlink(missing_ok=True)
    return path


def epochs(run_dir: Path, role: str) -> list[int]:
    d = checkpoint_dir(run_dir, role)
    if not d.exists():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def load_checkpoint(run_dir: Path, role: str, epoch: int) -> dict[str, Any]:
    path = checkpoint_dir(run_dir, role) / f"epoch_{epoch:04d}.pt"
    if not path.exists():
        have = epochs(run_dir, role)
        raise CheckpointError(
            f"role {role!r} has no checkpoint for epoch {epoch} in {path.parent} (it has {have}); "
            "resume needs every role's run directory from the same run"
        )
    return torch.load(path, weights_only=True)


def latest_epoch(run_dir: Path, role: str) -> int | None:
    found = epochs(run_dir, role)
    return found[-1] if found else None
