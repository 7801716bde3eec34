"""Encryptions of zero made by a helper process at the lowest CPU priority.

A CKKS contribution is an encryption of zero plus the encoded values (see ``crypto.ckks``). The
public-key encryption of zero is most of a party's CKKS work (about 0.35 ms of CPU per 4096
values at the Credit defaults, made by ``crypto.ckks._ZeroMaker``; 0.7 ms by SEAL's own
``encrypt_zero``, 0.9 ms when the chain had a special prime) and SEAL holds the
GIL while it runs, so a thread of the party cannot make it without taking the GIL from the
party's own work, and at the same CPU priority it competes with the federation's critical path
(the aggregator and the key holder) for the cores.

:class:`ZeroSource` starts a child Python process that loads only the public context and writes
fresh encryptions of zero, in the ``raw`` chunk format, into a pipe whose other end only the
party holds. Before it imports anything heavy the child lowers itself to nice 19 and the
SCHED_IDLE policy (Linux: any other task that wakes preempts it at once, where a nice-19 task
may run on to the next scheduler tick). The pipe is the pool: when it is full (about 1 MiB) the
child blocks in ``write`` and uses no CPU. So the zeros are made from CPU time nothing else
wants, ahead of need, and the party reads one per chunk without waiting
(:meth:`ZeroSource.take` returns None when none is ready, and the caller encrypts afresh). Each
record is read from the pipe once and consumed once; a zero is never handed out twice. Every
record is loaded with the checks of any received chunk (length, parameter id, coefficients
below their primes, not transparent).

The child stops by itself when the party's end of the pipe closes, also when the party dies
(its next write fails with EPIPE); :meth:`ZeroSource.close` closes the pipe, stops the child
with SIGTERM (starved on a busy machine it may take a while to notice) and reaps it.

This module uses NumPy, TenSEAL and the standard library only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import subprocess
import sys
import threading
from typing import Any

from crypto.ckks import WIRE_RAW, CkksError, CkksPublic

__all__ = ["ZERO_NICE", "ZeroSource"]

#: The helper's nice value: it gets CPU that processes at the default priority leave idle.
ZERO_NICE = 19
# the pool: a pipe of this many bytes (the system's default maximum for unprivileged users)
_PIPE_BYTES = 1 << 20
_LEN = struct.Struct("<Q")
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class ZeroSource:
    """Fresh encryptions of zero under `public`'s context, made by a low-priority child process.

    :meth:`take` is non-blocking: a loaded ciphertext when a whole record is in the pipe, else
    None. Raises :class:`CkksError` at construction when ``public`` does not write the raw
    format (the records are raw chunks) or the child cannot be started.
    """

    def __init__(
        self,
        public: CkksPublic | None = None,
        context_bytes: bytes | None = None,
        *,
        nice: int = ZERO_NICE,
        idle_policy: bool = True,
    ) -> None:
        """Start the helper at `nice` (and under SCHED_IDLE with `idle_policy`, where the
        system has it); both are set before the helper imports anything. With `public` and
        `context_bytes` the helper gets its context now; without, :meth:`attach` gives it later
        (the helper imports meanwhile, e.g. while a run sets up) and :meth:`take` returns None
        until then."""
        if public is not None:
            _check_raw(public)
            if context_bytes is None:
                raise CkksError("a zero helper given a public context needs its bytes too.")
        self._public: CkksPublic | None = None
        self._record = 0
        self._buf = bytearray()
        self._taken = 0
        self._lock = threading.Lock()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(int(nice)), str(int(bool(idle_policy)))],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            )
        except OSError as exc:
            raise CkksError(f"cannot start the zero-encryption helper: {exc}.") from exc
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._fd = self._proc.stdout.fileno()
        try:
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:
            pass  # the default pipe size: a pool of about one zero
        os.set_blocking(self._fd, False)
        if public is not None and context_bytes is not None:
            self.attach(public, context_bytes)

    def attach(self, public: CkksPublic, context_bytes: bytes) -> None:
        """Give the helper the public context it encrypts under (`context_bytes`, what
        `public` was loaded from), once. Refuses (:class:`CkksError`) a second context and one
        that does not write the raw format."""
        _check_raw(public)
        with self._lock:
            if self._public is not None:
                raise CkksError("this zero helper already has its context; start another one.")
            self._public = public
            self._record = 4 + public._codec._raw_body_bytes  # a raw chunk: count, body
        # the helper reads the context once it has imported SEAL: do not wait for that here
        threading.Thread(
            target=_hand_over,
            args=(self._proc.stdin, _LEN.pack(len(context_bytes)) + bytes(context_bytes)),
            name="ckks-zeros-context",
            daemon=True,
        ).start()

    @property
    def attached(self) -> bool:
        """Whether the helper has its context (:meth:`attach`)."""
        return self._public is not None

    @property
    def record_bytes(self) -> int:
        """Bytes of one encryption of zero in the pipe (a raw chunk of ``slots`` values)."""
        return self._record

    @property
    def taken(self) -> int:
        """How many zeros :meth:`take` has handed out."""
        return self._taken

    @property
    def alive(self) -> bool:
        """Whether the helper process is still running."""
        return self._proc.poll() is None

    def take(self) -> Any | None:
        """One fresh encryption of zero, as its checked (2, primes, degree) coefficients, if a
        whole one is waiting in the pipe, else None (never blocks). Each is handed out once.
        Raises :class:`CkksError` if a record fails the checks of a received chunk."""
        with self._lock:
            public = self._public
            if self._fd < 0 or public is None:
                return None
            while len(self._buf) < self._record:
                try:
                    data = os.read(self._fd, self._record - len(self._buf))
                except BlockingIOError:
                    return None
                except OSError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    raise
                if not data:  # the helper has gone: no more zeros from it
                    self._close_fd()
                    return None
                self._buf += data
            record = bytes(self._buf)
            self._buf.clear()
        # its checked coefficients (a raw chunk: the helper writes only those), which the
        # party adds its values to and sends without a SEAL ciphertext in between
        loaded = public._codec.load_coefficients(
            record, expected_len=public.slots, what="an encryption of zero from the helper"
        )
        if loaded is None:
            raise CkksError("the zero helper wrote a chunk that is not in the raw format.")
        self._taken += 1
        return loaded[0]

    def _close_fd(self) -> None:
        if self._fd >= 0:
            self._fd = -1
            assert self._proc.stdout is not None
            self._proc.stdout.close()

    def close(self, timeout: float = 5.0) -> None:
        """Close the pipe and stop the helper (SIGTERM: at nice 19 on a busy machine it may not
        get the CPU to notice the closed pipe soon), then reap it."""
        with self._lock:
            self._close_fd()
            self._buf.clear()
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _check_raw(public: CkksPublic) -> None:
    if public.wire_format != WIRE_RAW:
        raise CkksError(
            "a zero source needs the raw wire format, which this SEAL binding cannot write; "
            "encrypt zeros in process instead."
        )


def _hand_over(stream: Any, data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except OSError:
        pass  # the helper is gone: take() finds its pipe closed and returns None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# The helper's command. It lowers its priority before it imports anything heavy (the crypto
# package, NumPy, SEAL): nice, then SCHED_IDLE (a task under it is preempted at once by any
# other task that wakes, where a nice-19 task may run on to the next scheduler tick); what the
# system refuses is skipped. argv: nice, 1 for SCHED_IDLE.
_LAUNCH = """
import os, sys
nice, idle = int(sys.argv[1]), sys.argv[2] == "1"
try:
    os.nice(max(0, nice - os.nice(0)))
except OSError:
    pass
if idle and hasattr(os, "SCHED_IDLE"):
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        pass
from crypto.ckks_zeros import _main
sys.exit(_main())
"""


def _main() -> int:
    """The helper: read the public context from stdin, then write fresh encryptions of zero to
    stdout until the reader goes away."""
    stdin = sys.stdin.buffer
    (size,) = _LEN.unpack(stdin.read(_LEN.size))
    context = stdin.read(size)
    public = CkksPublic(context_bytes=context, wire=WIRE_RAW)
    if public.wire_format != WIRE_RAW:
        return 3
    codec, encryptor, slots = public._codec, public._encryptor, public.slots
    out = sys.stdout.fileno()
    try:
        while True:
            _write_all(out, codec.dump(codec.zero(encryptor), slots))
    except BrokenPipeError:
        return 0
    except OSError as exc:
        return 0 if exc.errno == errno.EPIPE else 1
