"""The WAN emulator of the benchmarks (`bench/wanproxy.py`): it delays by at least the configured
latency, keeps the byte stream intact and in order, and caps the line rate. Lower bounds only:
the machine may be slower than the model, never faster."""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from wanproxy import Link, WanProxy  # noqa: E402


def _echo_server() -> tuple[socket.socket, int]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(65536, n - len(buf)))
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def test_link_model_orders_and_serialises() -> None:
    link = Link(delay_s=0.005, mbit=8.0)  # 1 byte per microsecond
    first = link.release_time(0.0, 1000)  # 1 ms on the line, then 5 ms
    second = link.release_time(0.0, 1000)  # waits behind the first
    assert first == pytest.approx(0.006)
    assert second == pytest.approx(0.007)
    assert Link(delay_s=0.01).release_time(1.0, 10**6) == pytest.approx(1.01)  # no cap


def test_proxy_delays_by_at_least_the_rtt_and_forwards_bytes_intact() -> None:
    srv, port = _echo_server()
    payload = os.urandom(300_000)
    try:
        with WanProxy(target=("127.0.0.1", port), rtt_ms=40.0) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                started = time.perf_counter()
                c.sendall(b"ping")
                assert _recv_exactly(c, 4) == b"ping"
                rtt = time.perf_counter() - started
                sender = threading.Thread(target=c.sendall, args=(payload,))
                sender.start()
                echoed = _recv_exactly(c, len(payload))
                sender.join()
            summary = proxy.summary()
    finally:
        srv.close()
    # the echo crosses the proxy twice: client -> server and back, 20 ms each way
    assert rtt >= 0.040
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    assert summary["bytes_up"] == summary["bytes_down"] == 4 + len(payload)
    # its own scheduling delay is reported: a mean over every chunk, never above the worst
    assert summary["chunks"] >= 4
    assert 0.0 <= summary["mean_lateness_ms"] <= summary["max_lateness_ms"]


def test_proxy_caps_the_line_rate() -> None:
    srv, port = _echo_server()
    payload = os.urandom(500_000)  # 4 Mbit: at least 0.4 s at 10 Mbit/s each way
    try:
        with WanProxy(target=("127.0.0.1", port), rtt_ms=0.0, mbit=10.0) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=20) as c:
                started = time.perf_counter()
                sender = threading.Thread(target=c.sendall, args=(payload,))
                sender.start()
                echoed = _recv_exactly(c, len(payload))
                sender.join()
                elapsed = time.perf_counter() - started
    finally:
        srv.close()
    assert echoed == payload
    assert elapsed >= 0.4


def test_a_client_that_comes_before_the_target_is_held_until_it_listens() -> None:
    # a role started before the hub binds: the proxy holds it (as a line to a host that is not
    # up yet would) instead of closing it, which CurveZMQ would take for a failed handshake
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # a free port nobody listens on yet
    with WanProxy(target=("127.0.0.1", port), rtt_ms=0.0, connect_wait_s=10.0) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
            c.sendall(b"early")
            time.sleep(0.3)  # the proxy retries meanwhile
            srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind(("127.0.0.1", port))
            srv.listen()
            srv.settimeout(5.0)  # a proxy that gave up at once never connects: accept times out
            conn, _ = srv.accept()
            with conn, srv:
                assert _recv_exactly(conn, 5) == b"early"
                conn.sendall(b"late")
                assert _recv_exactly(c, 4) == b"late"


def test_a_target_that_never_listens_closes_the_client_after_the_wait() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with WanProxy(target=("127.0.0.1", port), rtt_ms=0.0, connect_wait_s=0.2) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as c:
            started = time.perf_counter()
            assert c.recv(1) == b""  # closed, not hung
            assert time.perf_counter() - started < 5.0
