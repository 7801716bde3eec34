"""A user-space WAN emulator: a TCP proxy that adds one-way delay and caps bandwidth.

This kernel has no netem (`tc qdisc ... netem` fails), so the WAN benchmark puts this proxy
between the roles and the aggregator: the aggregator binds its real port, the roles connect to
the proxy's port (`--address`), and every byte in both directions goes through a link model:

    a chunk read at time t waits for the link (serialisation at `mbit` Mbit/s, first come first
    served) and is released to the other side at (end of its serialisation) + rtt/2.

Each direction of each connection is its own link (every organisation has its own line to the
aggregator), so a party -> aggregator -> active round trip costs two RTTs, as on a star network.
Chunks are timestamped when they arrive and released in arrival order: the delay is not added
per hop, and a burst is not delayed more than its serialisation says. The proxy only forwards
bytes, so it is transparent to CurveZMQ (the handshake and every frame pass unchanged).

    python bench/wanproxy.py --listen 127.0.0.1:6000 --target 127.0.0.1:5555 \\
        --rtt-ms 10 --mbit 100 [--max-seconds 3600] [--connect-wait 60]

In Python: `with WanProxy(target=("127.0.0.1", 5555), rtt_ms=10, mbit=100) as proxy:` then
connect to `proxy.port`; the proxy runs in a daemon thread and stops on exit of the block.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field

CHUNK = 64 * 1024


@dataclass
class Link:
    """One direction of one connection: a FIFO line of `mbit` Mbit/s (0: unlimited) followed by
    a propagation delay of `delay_s`."""

    delay_s: float
    mbit: float = 0.0
    free_at: float = 0.0  # when the line finishes serialising what it already holds
    bytes: int = 0
    chunks: int = 0

    def release_time(self, arrived: float, nbytes: int) -> float:
        """When a chunk of `nbytes` that arrived at `arrived` reaches the far side."""
        start = max(arrived, self.free_at)
        self.free_at = start + (nbytes * 8 / (self.mbit * 1e6) if self.mbit > 0 else 0.0)
        self.bytes += nbytes
        self.chunks += 1
        return self.free_at + self.delay_s


@dataclass
class ProxyStats:
    connections: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    max_lateness_s: float = 0.0  # how late a chunk left after its release time (scheduling)
    lateness_sum_s: float = 0.0  # over every forwarded chunk: the mean is the proxy's own delay
    chunks: int = 0
    links: list[Link] = field(default_factory=list)


class WanProxy:
    """A delaying, bandwidth-capped TCP proxy to `target`, listening on `listen` (port 0: any
    free port, read back from `.port`). `rtt_ms` is the added round-trip time (half each way);
    `mbit` the line rate per direction and connection (0: unlimited)."""

    def __init__(
        self,
        *,
        target: tuple[str, int],
        rtt_ms: float,
        mbit: float = 0.0,
        listen: tuple[str, int] = ("127.0.0.1", 0),
        connect_wait_s: float = 60.0,
    ) -> None:
        if rtt_ms < 0 or mbit < 0 or connect_wait_s < 0:
            raise ValueError(
                f"rtt_ms, mbit and connect_wait_s must be >= 0, got {rtt_ms}, {mbit} and "
                f"{connect_wait_s}"
            )
        self.target = target
        self.connect_wait_s = float(connect_wait_s)
        self.rtt_ms = float(rtt_ms)
        self.mbit = float(mbit)
        self.listen = listen
        self.port = 0
        self.stats = ProxyStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None

    # --- the link, per direction

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: Link,
        *,
        up: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: deque[tuple[float, bytes]] = deque()
        wake = asyncio.Event()
        done = False

        async def receive() -> None:
            nonlocal done
            try:
                while True:
                    data = await reader.read(CHUNK)
                    if not data:
                        break
                    queue.append((link.release_time(loop.time(), len(data)), data))
                    wake.set()
            except (ConnectionError, OSError):
                pass
            finally:
                done = True
                wake.set()

        async def send() -> None:
            try:
                while True:
                    if not queue:
                        if done:
                            break
                        wake.clear()
                        await wake.wait()
                        continue
                    release, data = queue[0]
                    wait = release - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    queue.popleft()
                    late = loop.time() - release
                    if late > self.stats.max_lateness_s:
                        self.stats.max_lateness_s = late
                    self.stats.lateness_sum_s += max(0.0, late)
                    self.stats.chunks += 1
                    if up:  # counted before the write: the far side may read it at once
                        self.stats.bytes_up += len(data)
                    else:
                        self.stats.bytes_down += len(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    if writer.can_write_eof():
                        writer.write_eof()

        await asyncio.gather(receive(), send())

    async def _handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        self.stats.connections += 1
        upstream = await self._connect_upstream()
        if upstream is None:
            client_writer.close()
            return
        target_reader, target_writer = upstream
        delay = self.rtt_ms / 2000.0
        up, down = Link(delay, self.mbit), Link(delay, self.mbit)
        self.stats.links += [up, down]
        try:
            await asyncio.gather(
                self._pump(client_reader, target_writer, up, up=True),
                self._pump(target_reader, client_writer, down, up=False),
            )
        except asyncio.CancelledError:  # the proxy is closing
            pass
        finally:
            for w in (client_writer, target_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _connect_upstream(
        self,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """The connection to the target. A target that is not listening yet (a role whose
        process still starts) is retried for `connect_wait_s`, the client's bytes held
        meanwhile, as a line to a host that is not up yet would: closing the client at once
        would look to a CurveZMQ client like a failed handshake (a wrong server key), not like
        a hub that is not there yet. None once the wait is over."""
        deadline = time.monotonic() + self.connect_wait_s
        pause = 0.01
        while True:
            try:
                return await asyncio.open_connection(*self.target)
            except OSError:
                if time.monotonic() + pause > deadline:
                    return None
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.25)

    # --- life cycle

    async def _serve(self) -> None:
        self._stopped = asyncio.Event()
        self._server = await asyncio.start_server(self._handle, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        async with self._server:
            await self._stopped.wait()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
        finally:
            with contextlib.suppress(Exception):
                tasks = asyncio.all_tasks(self._loop)
                for t in tasks:
                    t.cancel()
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.close()

    def start(self) -> WanProxy:
        """Serve in a daemon thread; returns once the port is bound."""
        self._thread = threading.Thread(target=self._run, name="wanproxy", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=10)
        if self._error is not None:
            raise RuntimeError(f"the WAN proxy could not start: {self._error}") from self._error
        if not self.port:
            raise RuntimeError("the WAN proxy did not bind within 10 s")
        return self

    def close(self) -> None:
        if self._loop is not None and self._stopped is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> WanProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"tcp://{self.listen[0]}:{self.port}"

    def summary(self) -> dict[str, float | int]:
        return {
            "rtt_ms": self.rtt_ms,
            "mbit": self.mbit,
            "connections": self.stats.connections,
            "bytes_up": self.stats.bytes_up,
            "bytes_down": self.stats.bytes_down,
            "max_lateness_ms": round(1000 * self.stats.max_lateness_s, 3),
            "mean_lateness_ms": round(
                1000 * self.stats.lateness_sum_s / max(1, self.stats.chunks), 3
            ),
            "chunks": self.stats.chunks,
        }


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on")
    ap.add_argument("--target", required=True, help="HOST:PORT to forward to")
    ap.add_argument("--rtt-ms", type=float, default=10.0, help="added round-trip time (ms)")
    ap.add_argument("--mbit", type=float, default=100.0, help="line rate, Mbit/s (0: no cap)")
    ap.add_argument(
        "--max-seconds", type=float, default=3600.0, help="stop by itself after this long"
    )
    ap.add_argument(
        "--connect-wait",
        type=float,
        default=60.0,
        help="hold a client this many seconds while the target does not listen yet",
    )
    args = ap.parse_args(argv)
    proxy = WanProxy(
        target=_host_port(args.target),
        rtt_ms=args.rtt_ms,
        mbit=args.mbit,
        listen=_host_port(args.listen),
        connect_wait_s=args.connect_wait,
    ).start()
    print(f"listening on {proxy.listen[0]}:{proxy.port} -> {args.target}", flush=True)
    try:
        deadline = time.monotonic() + args.max_seconds
        while time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.close()
        print(proxy.summary(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
