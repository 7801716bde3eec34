"""Helpers for the transport tests (a unique module name, so it never clashes on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack

from transport import Envelope, Limits, pack

FAST = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
HUB_KINDS = frozenset({"contribution", "config"})
PEER_KINDS = frozenset({"sum", "gradient"})
ROLES = ("active", "party1", "party2", "mallory")
DROP = object()  # pass as a header field value to leave the field out
SMALL_LIMITS = Limits(max_message_bytes=64 * 1024)


def header(**overrides: Any) -> bytes:
    """A valid msgpack header (one float64 tensor "x" of shape [4]) with fields overridden."""
    fields: dict[str, Any] = {
        "version": 1,
        "kind": "contribution",
        "sender": "mallory",
        "session": "",
        "round": 0,
        "seq": 1,
        "meta": {},
        "tensors": [{"name": "x", "dtype": "float64", "shape": [4]}],
    }
    fields.update(overrides)
    return msgpack.packb({k: v for k, v in fields.items() if v is not DROP}, use_bin_type=True)


def good_frames(sender: str, seq: int, *, kind: str = "contribution", **fields: Any) -> list:
    return [bytes(f) for f in pack(Envelope(kind=kind, sender=sender, seq=seq, **fields))]


def wait_until(condition: Callable[[], bool], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
