"""End-of-epoch checkpoints, one directory per role: RUN_DIR/checkpoints/<role>/epoch_NNNN.pt.

Saved atomically and durably — written to a temporary file, fsynced, renamed over the final
name, then the directory fsynced — so a role killed at any instant leaves either the previous
checkpoint set or the new one, never a torn file. Loaded with `weights_only=True`, so a
checkpoint file cannot run code when it is read; an unreadable one is a `CheckpointError`
naming the file."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from securevfl.errors import CheckpointError

KEEP = 2
_NAME = re.compile(r"epoch_(\d{4,})\.pt$")
# a save interrupted before its rename leaves one of these; the next save removes it
_PARTIAL = re.compile(r"epoch_(\d{4,})\.pt\.partial$")


def checkpoint_dir(run_dir: Path, role: str) -> Path:
    return Path(run_dir) / "checkpoints" / role


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory; the rename still happened
        pass
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, role: str, epoch: int, state: Mapping[str, Any]) -> Path:
    """Write `role`'s checkpoint of `epoch` (temporary file, fsync, rename, fsync of the
    directory), then drop all but the newest `KEEP`. Returns its path."""
    d = checkpoint_dir(run_dir, role)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"epoch_{epoch:04d}.pt"
    tmp = d / f"{path.name}.partial"
    import torch  # here, not at import: the launcher lists checkpoints without loading torch

    with open(tmp, "wb") as fh:
        torch.save(dict(state), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(d)
    for old in sorted(epochs(run_dir, role))[:-KEEP]:
        (d / f"epoch_{old:04d}.pt").unlink(missing_ok=True)
    for p in d.iterdir():
        if _PARTIAL.match(p.name):
            p.unlink(missing_ok=True)
    return path


def epochs(run_dir: Path, role: str) -> list[int]:
    d = checkpoint_dir(run_dir, role)
    if not d.exists():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _NAME.match(p.name)))


def load_checkpoint(run_dir: Path, role: str, epoch: int) -> dict[str, Any]:
    """`role`'s checkpoint of `epoch`. Raises `CheckpointError` (naming the file) when it is
    missing or cannot be read."""
    path = checkpoint_dir(run_dir, role) / f"epoch_{epoch:04d}.pt"
    if not path.exists():
        have = epochs(run_dir, role)
        raise CheckpointError(
            f"role {role!r} has no checkpoint for epoch {epoch} in {path.parent} (it has {have}); "
            "resume needs every role's run directory from the same run"
        )
    import torch

    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:  # truncated, or not a tensors-only file: never load it half-way
        raise CheckpointError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); it is not a checkpoint this "
            "version wrote whole. Remove it to resume from the one before"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a checkpoint (a {type(state).__name__})")
    return state


def latest_epoch(run_dir: Path, role: str) -> int | None:
    found = epochs(run_dir, role)
    return found[-1] if found else None
