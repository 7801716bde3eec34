"""Checkpoints (`securevfl.roles.checkpoint`): written atomically and durably, a role killed at
any instant leaves the previous checkpoint or the new one, and a file that is not a whole
checkpoint this version wrote (truncated, garbage, a pickle that would run code) is refused
with a `CheckpointError` naming it, never loaded half-way."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from securevfl.errors import CheckpointError
from securevfl.roles.checkpoint import (
    KEEP,
    checkpoint_dir,
    epochs,
    latest_epoch,
    load_checkpoint,
    save_checkpoint,
)


def _state(epoch: int) -> dict:
    return {"epoch": epoch, "method": {"w": torch.full((3, 2), float(epoch))}}


def test_saved_checkpoints_round_trip_and_only_the_newest_are_kept(tmp_path):
    for e in range(5):
        save_checkpoint(tmp_path, "alpha", e, _state(e))
    assert epochs(tmp_path, "alpha") == list(range(5 - KEEP, 5))
    assert latest_epoch(tmp_path, "alpha") == 4
    assert torch.equal(
        load_checkpoint(tmp_path, "alpha", 4)["method"]["w"], torch.full((3, 2), 4.0)
    )
    assert latest_epoch(tmp_path, "nobody") is None


def test_a_missing_epoch_is_refused_listing_what_there_is(tmp_path):
    save_checkpoint(tmp_path, "alpha", 3, _state(3))
    with pytest.raises(CheckpointError, match=r"no checkpoint for epoch 1 .*\[3\]"):
        load_checkpoint(tmp_path, "alpha", 1)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "garbage", "empty", "code", "not a dict"],
)
def test_a_damaged_or_hostile_file_is_refused_naming_it(tmp_path, damage):
    path = save_checkpoint(tmp_path, "alpha", 0, _state(0))
    data = path.read_bytes()
    ran = tmp_path / "ran"
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "code":  # a pickle that runs a command when loaded without weights_only

        class Exploit:
            def __reduce__(self):
                return (os.system, (f"touch {ran}",))

        torch.save({"method": Exploit()}, path)
    else:
        torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match=str(path.name)):
        load_checkpoint(tmp_path, "alpha", 0)
    assert not ran.exists()


def test_a_save_that_dies_before_its_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, "alpha", 0, _state(0))

    def dies(obj, fh, *args, **kwargs):
        fh.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # as if killed mid-write

    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, "alpha", 1, _state(1))
    monkeypatch.undo()
    assert epochs(tmp_path, "alpha") == [0]  # the torn file is not a checkpoint
    assert load_checkpoint(tmp_path, "alpha", 0)["epoch"] == 0
    save_checkpoint(tmp_path, "alpha", 1, _state(1))  # the next save clears the leftover
    assert not [p for p in checkpoint_dir(tmp_path, "alpha").iterdir() if "partial" in p.name]
    assert load_checkpoint(tmp_path, "alpha", 1)["epoch"] == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_role_killed_while_saving_leaves_whole_checkpoints_only(tmp_path):
    """SIGKILL a child that saves checkpoints in a loop, at once: whatever epoch it reached,
    every checkpoint file on disk loads."""
    big = {"method": {"w": torch.randn(256, 256)}}
    for delay in (0.01, 0.05, 0.2):
        run_dir = tmp_path / str(delay)
        pid = os.fork()
        if pid == 0:
            try:
                for e in range(10_000):
                    save_checkpoint(run_dir, "alpha", e, {**big, "epoch": e})
            finally:
                os._exit(0)
        import time

        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for e in epochs(run_dir, "alpha"):
            assert load_checkpoint(run_dir, "alpha", e)["epoch"] == e
