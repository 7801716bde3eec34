"""Encryptions of zero from a low-priority helper process (`crypto.ckks_zeros.ZeroSource`): each
is handed out once and sums with it decrypt; `take` never waits for the helper; the helper runs
at nice 19 under SCHED_IDLE, holds no secret, and stops by itself when its reader closes or
dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from crypto.ckks import CkksError, CkksKeyHolder, CkksPublic, choose_params
from crypto.ckks_zeros import ZERO_NICE, ZeroSource

PARAMS = choose_params(precision_bits=12, magnitude=2.0**20, terms=5).params  # (34, 34)


@pytest.fixture(scope="module")
def holder() -> CkksKeyHolder:
    return CkksKeyHolder(params=PARAMS)


def _c1(chunk: bytes) -> bytes:
    """A raw chunk's second polynomial: the encryption of zero's own (names the zero used)."""
    n = PARAMS.poly_modulus_degree
    widths = [(b + 7) // 8 for b in PARAMS.data_bit_sizes]
    offset, parts = 4 + 4 + 32, []
    for w in widths:
        parts.append(chunk[offset + n * w : offset + 2 * n * w])
        offset += 2 * n * w
    return b"".join(parts)


def _take(source: ZeroSource, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ct = source.take()
        if ct is not None:
            return ct
        time.sleep(0.01)
    raise AssertionError("the helper made no encryption of zero in time")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1].startswith("Z"):
                    return True  # exited, not yet reaped by its parent
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_the_helper_runs_at_the_lowest_priority(holder) -> None:
    ctx = holder.public_context_bytes()
    source = ZeroSource(CkksPublic(context_bytes=ctx), ctx)
    try:
        pid = source._proc.pid
        idle = getattr(os, "SCHED_IDLE", None)
        deadline = time.monotonic() + 60  # set first thing, before the helper imports SEAL

        def lowered() -> bool:
            return os.getpriority(os.PRIO_PROCESS, pid) == ZERO_NICE and (
                idle is None or os.sched_getscheduler(pid) == idle
            )

        while not lowered() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lowered()
    finally:
        source.close()


def test_zeros_from_the_helper_are_each_used_once_and_sums_decrypt(holder) -> None:
    ctx = holder.public_context_bytes()
    public = CkksPublic(context_bytes=ctx, wire="raw")
    source = ZeroSource(public, ctx, nice=0, idle_policy=False)  # not waiting for idle CPU
    try:
        assert source.alive
        taken = [_take(source), _take(source), _take(source)]
        assert source.taken == 3
        # the zeros go through encrypt like in-process ones: pushed back, then used once each
        public._zeros.extend(taken)
        zeros_c1 = [_c1(public._codec.dump(z, public.slots)) for z in taken]
        public.attach_zero_source(source)
        x = np.linspace(-50.0, 50.0, 3 * public.slots)  # three chunks, the same every call
        packed = public.encrypt(x)
        assert [_c1(c) for c in packed.chunks] == zeros_c1[::-1]  # popped from the end
        np.testing.assert_allclose(holder.decrypt_sum(packed, shape=x.shape), x, atol=1e-5)
        sent = [_c1(c) for c in packed.chunks]
        for _ in range(3):  # now straight from the helper, or fresh when none is ready
            more = public.encrypt(x)
            np.testing.assert_allclose(holder.decrypt_sum(more, shape=x.shape), x, atol=1e-5)
            sent += [_c1(c) for c in more.chunks]
        assert len(set(sent)) == len(sent) == 12  # no encryption of zero sent twice
    finally:
        public.attach_zero_source(None)
        source.close()
    assert source._proc.returncode in (0, -signal.SIGTERM)  # stopped and reaped
    assert not source.alive
    assert source.take() is None


def test_take_never_waits_for_the_helper(holder) -> None:
    ctx = holder.public_context_bytes()
    public = CkksPublic(context_bytes=ctx, wire="raw")
    source = ZeroSource(public, ctx, nice=0, idle_policy=False)
    try:
        _take(source)
        os.kill(source._proc.pid, signal.SIGSTOP)  # a starved helper: nothing more comes
        try:
            while source.take() is not None:  # what was already in the pipe
                pass
            started = time.monotonic()
            assert source.take() is None
            assert time.monotonic() - started < 1.0
            x = np.ones(10)  # encrypt falls back to a fresh encryption
            packed = public.encrypt(x)
            np.testing.assert_allclose(holder.decrypt_sum(packed, shape=(10,)), x, atol=1e-5)
        finally:
            os.kill(source._proc.pid, signal.SIGCONT)
    finally:
        source.close()


def test_the_helper_stops_when_its_reader_dies(holder, tmp_path) -> None:
    ctx_file = tmp_path / "ctx"
    ctx_file.write_bytes(holder.public_context_bytes())
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from crypto.ckks import CkksPublic
        from crypto.ckks_zeros import ZeroSource
        ctx = open({str(ctx_file)!r}, "rb").read()
        source = ZeroSource(CkksPublic(context_bytes=ctx), ctx, nice=0, idle_policy=False)
        while source.take() is None:
            time.sleep(0.01)
        print(source._proc.pid, flush=True)
        os._exit(0)  # no close, no finalizer: as if killed
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True
    )
    helper = int(out.stdout.split()[0])
    assert _gone(helper, timeout=60), "the helper outlived the process reading its zeros"


def test_a_context_that_cannot_write_raw_chunks_is_refused(holder) -> None:
    ctx = holder.public_context_bytes()
    public = CkksPublic(context_bytes=ctx, wire="seal")
    with pytest.raises(CkksError, match="raw wire format"):
        ZeroSource(public, ctx)


def test_a_helper_that_cannot_start_is_reported(holder, monkeypatch) -> None:
    ctx = holder.public_context_bytes()
    public = CkksPublic(context_bytes=ctx, wire="raw")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(CkksError, match="cannot start the zero-encryption helper"):
        ZeroSource(public, ctx)


def test_a_helper_started_before_its_context_makes_zeros_once_attached(holder) -> None:
    """A run starts the helper before the key holder's context arrives (it imports meanwhile):
    until `attach` nothing is taken; after, its zeros decrypt as any; a second context is
    refused."""
    source = ZeroSource(nice=0, idle_policy=False)
    try:
        assert source.alive and not source.attached
        time.sleep(0.2)
        assert source.take() is None  # no context yet: nothing made
        ctx = holder.public_context_bytes()
        public = CkksPublic(context_bytes=ctx, wire="raw")
        source.attach(public, ctx)
        assert source.attached
        public._zeros.append(_take(source))
        x = np.linspace(-5.0, 5.0, public.slots)
        packed = public.encrypt(x)
        np.testing.assert_allclose(holder.decrypt_sum(packed, shape=x.shape), x, atol=1e-5)
        with pytest.raises(CkksError, match="already has its context"):
            source.attach(public, ctx)
    finally:
        source.close()
    assert not source.alive


def test_an_unattached_helper_stops_when_closed_or_when_its_reader_dies(holder) -> None:
    source = ZeroSource(nice=0, idle_policy=False)
    source.close()
    assert not source.alive
    script = textwrap.dedent(
        """
        import os
        from crypto.ckks_zeros import ZeroSource
        source = ZeroSource(nice=0, idle_policy=False)
        print(source._proc.pid, flush=True)
        os._exit(0)  # never attached, never closed
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=180, check=True
    )
    assert _gone(int(out.stdout.split()[0]), timeout=60)
