"""A peer: any non-aggregator role's DEALER connection to the hub."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Collection

import zmq
from zmq.utils.monitor import parse_monitor_message

from transport.curve import CurveKeyPair, check_role_name, key_fingerprint
from transport.envelope import (
    DEFAULT_LIMITS,
    Envelope,
    EnvelopeError,
    Limits,
    frames_nbytes,
    pack,
    unpack,
)
from transport.errors import (
    HandshakeFailed,
    KeyRefused,
    PeerLost,
    ReceiveTimeout,
    TransportError,
    quote,
)
from transport.sockets import (
    HEARTBEAT_KIND,
    HELLO_KIND,
    LINGER_MS,
    NOBLOCK,
    RESERVED_KINDS,
    Endpoint,
    Received,
    RejectionLog,
    check_endpoint,
    check_kinds,
    check_timeout,
    check_timing,
    configure_socket,
    first_seq,
    is_inproc,
    new_routing_id,
    readable,
    recv_bounded,
    send_frames,
)

_MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)
# handshakes that fail in a row, with no ZAP verdict and no success, before we give up: a
# hub restart costs at most one; a wrong server key fails every one (~0.7 s for three)
HANDSHAKE_FAILURES_BEFORE_GIVING_UP = 3
# how often a busy peer reads its handshake events between polls (a waiting one at once)
MONITOR_EVERY_S = 0.1


class Peer(Endpoint):
    """A role's connection to the hub: a CURVE-client DEALER plus a heartbeat thread.

    The main socket (routing id ``name/<token>``) carries application messages and announces
    itself with a ``hello`` on every (re)connection; a daemon thread with its own DEALER
    (routing id ``name/hb/<token>``) sends a heartbeat every ``heartbeat_interval`` so the hub
    knows this role is alive even while it computes. Each token is 128 fresh random bits,
    so no other role can take over these connections at the hub (see :class:`Hub`). Incoming
    messages are validated like the hub's (per-message frame count and bytes while they
    arrive; ``sender`` must be the hub's name, kind, dtypes, sizes, session, strictly
    increasing ``seq``); invalid ones are counted in ``rejected`` (exactly) and dropped, and
    logged as the hub logs its rejections (:class:`transport.sockets.RejectionLog`: the first few
    at WARNING, then the rest at DEBUG with one WARNING a minute that counts them).
    Heartbeats from the hub are consumed silently.

    Refusals surface within a second, on the next :meth:`send` or :meth:`recv`: a key that
    the hub's ZAP handler refuses raises ``KeyRefused`` at once; a handshake that fails
    ``HANDSHAKE_FAILURES_BEFORE_GIVING_UP`` times in a row without any verdict raises
    ``HandshakeFailed`` (a ``KeyRefused``) whose message names the likely cause, a
    ``server_public`` that is not the hub's key. CurveZMQ gives the client no reason in that
    case (the server cannot decrypt the client's first command, so it drops the connection
    without a word), so the cause is inferred, not reported by the hub. After either, the
    peer stops reconnecting and every later call raises the same error.

    ``curve=False`` is accepted only for ``inproc://`` endpoints, where libzmq runs no CURVE
    (see :class:`transport.Hub`); ``inproc://`` needs the hub's ``context``.

    Attributes: ``session`` (settable, as on the hub), ``bytes_sent`` / ``bytes_received``
    (envelope frame bytes of application messages; heartbeats and hellos not counted) and
    ``rejected``.

    Not thread-safe: use a peer from one thread (the heartbeat thread has its own socket).
    """

    word = "peer"

    def __init__(
        self,
        *,
        name: str,
        connect: str,
        keypair: CurveKeyPair | None = None,
        server_public: bytes | None = None,
        kinds: Collection[str],
        limits: Limits = DEFAULT_LIMITS,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 10.0,
        logger: logging.Logger | None = None,
        context: zmq.Context | None = None,
        hub_name: str = "aggregator",
        curve: bool = True,
    ) -> None:
        check_role_name(name)
        check_role_name(hub_name)
        check_endpoint(connect, curve=curve, context=context)
        check_timing(heartbeat_interval, peer_timeout)
        if curve and (keypair is None or server_public is None):
            raise ValueError(
                "a CURVE peer needs keypair= (its own keys) and server_public= (the hub's key)"
            )
        self.name = name
        self.hub_name = hub_name
        self.endpoint = connect
        self.kinds = check_kinds(kinds)
        self.limits = limits
        self.heartbeat_interval = float(heartbeat_interval)
        self.peer_timeout = float(peer_timeout)
        self.logger = logger or logging.getLogger("transport.peer")
        self.curve = curve
        self.session: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rejected = 0
        self._rejections = RejectionLog(self.logger)

        self._keypair = keypair
        self._server_public = server_public
        self._wire_kinds = self.kinds | {HEARTBEAT_KIND}
        self._seq = first_seq()
        self._last_seq: int | None = None
        self._last_heard: float | None = None  # None until the hub has been heard once
        self._refused: TransportError | None = None
        self._failed_in_a_row = 0
        self._handshakes = 0
        self._monitor_due = 0.0  # when `_process_monitor` next reads the events
        self._closed = False
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None
        try:
            socket = self._new_socket(new_routing_id(name))
            self._socket = socket
            if not is_inproc(connect):  # inproc has no handshake to watch
                self._monitor = socket.get_monitor_socket(events=_MONITOR_EVENTS)
            self._poller = zmq.Poller()  # what `recv` waits on: the socket and its monitor
            self._poller.register(socket, zmq.POLLIN)
            if self._monitor is not None:
                self._poller.register(self._monitor, zmq.POLLIN)
            socket.connect(connect)
            self._send_hello()
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeat_loop, name=f"{name}-heartbeat", daemon=True
            )
            self._heartbeat_thread.start()
        except zmq.ZMQError as exc:
            self.close(linger=0)
            raise TransportError(
                f"{name} cannot connect to {connect}: {exc.strerror}; check the aggregator's "
                "address (e.g. tcp://10.0.0.5:5555)"
            ) from exc
        except BaseException:
            self.close(linger=0)
            raise

    # ------------------------------------------------------------------ public API

    def send(self, env: Envelope) -> None:
        """Send ``env`` to the hub; sets its ``sender`` (this role), ``seq``, empty ``session``.

        Refuses (``EnvelopeError``) an envelope beyond this peer's limits, (``ValueError``)
        one whose session differs from :attr:`session`, and (``TransportError``) a send the
        hub does not take within ``peer_timeout``. Tensors are sent zero-copy: do not modify
        them until the hub has received them.
        """
        sock = self._open_socket()
        self._process_monitor()
        frames = pack(self._stamp(env), limits=self.limits)
        try:
            send_frames(sock, frames)
        except zmq.Again as exc:
            raise TransportError(
                f"{self.hub_name} at {self.endpoint} did not take a {env.kind!r} message within "
                f"{self.peer_timeout:g} s; is it running and reading?"
            ) from exc
        self.bytes_sent += frames_nbytes(frames)

    def waiting(self) -> bool:
        """Whether something from the hub is waiting to be received (perhaps only a heartbeat,
        which `recv` skips): one socket option read, no system call."""
        return not self._closed and self._socket is not None and readable(self._socket)

    def recv(self, *, timeout: float) -> Envelope:
        """Return the next valid application message from the hub.

        Raises ``PeerLost(hub_name)`` when the hub, once heard, sends nothing (not even a
        heartbeat) for ``peer_timeout``; ``KeyRefused`` when the hub refused this peer's
        CURVE key; ``ReceiveTimeout`` when ``timeout`` seconds pass without a message.
        """
        check_timeout(timeout)
        sock = self._open_socket()
        poller = self._poller
        deadline = time.monotonic() + timeout
        due = False  # the monitor is read when due, or at once when it woke the poll
        while True:
            self._process_monitor(now=due)
            while readable(sock):
                try:
                    received = recv_bounded(sock, limits=self.limits)
                except zmq.Again:
                    break
                env = self._handle(received)
                if env is not None:
                    return env
            now = time.monotonic()
            wake = deadline
            if self._last_heard is not None:
                silent = now - self._last_heard
                if silent > self.peer_timeout:
                    raise PeerLost(self.hub_name, silent_for=silent, peer_timeout=self.peer_timeout)
                wake = min(wake, self._last_heard + self.peer_timeout)
            self._rejections.flush()  # the counts of windows that ended (nothing if none)
            if now >= deadline:
                heard = (
                    ""
                    if self._last_heard is not None
                    else f"; {self.hub_name} has not answered yet"
                )
                raise ReceiveTimeout(
                    f"{self.name} received no message from {self.hub_name} ({self.endpoint}) "
                    f"within {timeout:g} s{heard}"
                )
            woke = poller.poll(timeout=max(0, math.ceil((wake - now) * 1000)))
            due = any(socket is self._monitor for socket, _ in woke)

    def close(self, *, linger: float = LINGER_MS / 1000) -> None:
        """Stop the heartbeat thread, close the sockets; unsent messages go after ``linger`` s.

        Idempotent; never blocks much longer than ``linger`` (plus one heartbeat send).
        """
        if self._closed:
            return
        self._closed = True
        self._rejections.flush(final=True)
        self._stop.set()
        thread = self._heartbeat_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 2 * self.heartbeat_interval))
        if self._socket is not None:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close(linger=0)
            self._socket.close(linger=int(linger * 1000))
        if self._own_context and (thread is None or not thread.is_alive()):
            self._context.term()

    def __repr__(self) -> str:
        return f"Peer(name={self.name!r}, endpoint={self.endpoint!r})"

    # ------------------------------------------------------------------ internals

    def _new_socket(self, routing_id: bytes) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        try:
            configure_socket(
                sock,
                limits=self.limits,
                heartbeat_interval=self.heartbeat_interval,
                peer_timeout=self.peer_timeout,
            )
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            if self.curve:
                assert self._keypair is not None and self._server_public is not None
                sock.curve_serverkey = self._server_public
                sock.curve_publickey = self._keypair.public
                sock.curve_secretkey = self._keypair.secret
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def _open_socket(self) -> zmq.Socket:
        if self._closed or self._socket is None:
            raise TransportError(f"peer {self.name} is closed")
        if self._refused is not None:
            raise self._refused
        return self._socket

    def _send_hello(self) -> None:
        assert self._socket is not None
        self._seq += 1
        hello = pack(Envelope(kind=HELLO_KIND, sender=self.name, seq=self._seq))
        try:
            send_frames(self._socket, hello, flags=NOBLOCK)
        except zmq.Again:
            self.logger.debug("hello to %s not queued (send queue full)", self.hub_name)

    def _process_monitor(self, *, now: bool = False) -> None:
        """Read the handshake events (a refusal is raised); on the hot path at most every
        `MONITOR_EVERY_S` unless `now` (the poll woke on them): they only matter while the
        link comes up, and each read is a socket-option call on every message."""
        if self._monitor is None:
            return
        if self._refused is not None:
            raise self._refused
        clock = time.monotonic()
        if not now and clock < self._monitor_due:
            return
        self._monitor_due = clock + MONITOR_EVERY_S
        while readable(self._monitor):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                break
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshakes += 1
                self._failed_in_a_row = 0
                if self._handshakes > 1:  # the first link got the hello queued in __init__
                    self._send_hello()  # a reconnected or restarted hub must learn our route
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = self._key_refused(int(event["value"]))
            else:
                self._failed_in_a_row += 1
                self.logger.log(
                    logging.WARNING if self._failed_in_a_row == 1 else logging.DEBUG,
                    "the CURVE handshake with %s at %s failed (%d in a row); check that "
                    "server_public is the hub's public key and that both sides run CurveZMQ",
                    self.hub_name,
                    self.endpoint,
                    self._failed_in_a_row,
                )
                if self._failed_in_a_row >= HANDSHAKE_FAILURES_BEFORE_GIVING_UP:
                    self._refused = self._handshake_failed()
            if self._refused is not None:
                self._give_up()
                break
        if self._refused is not None:
            raise self._refused

    def _give_up(self) -> None:
        """Stop retrying a hub that refused us: every retry would be refused again."""
        self._stop.set()  # the heartbeat thread leaves its loop and closes its socket
        assert self._socket is not None
        try:
            self._socket.disconnect(self.endpoint)
        except zmq.ZMQError:  # already disconnected
            pass

    def _own_key(self) -> str:
        if self._keypair is None:
            return "(none)"
        public = self._keypair.public
        return f"{public.decode('ascii')} ({key_fingerprint(public)})"

    def _key_refused(self, status: int = 400) -> KeyRefused:
        why = "" if status == 400 else f" (ZAP status {status})"
        return KeyRefused(
            f"{self.hub_name} at {self.endpoint} refused {self.name}'s CURVE key "
            f"{self._own_key()}{why}; add it to the federation allowlist with `securevfl keys` "
            "or check the keys directory"
        )

    def _handshake_failed(self) -> HandshakeFailed:
        server = self._server_public.decode("ascii", "replace") if self._server_public else "?"
        return HandshakeFailed(
            f"{self.name} could not complete a CURVE handshake with {self.hub_name} at "
            f"{self.endpoint} ({self._failed_in_a_row} attempts in a row failed without an "
            f"answer): most likely the hub's public key given to {self.name} "
            f"({server}, {key_fingerprint(server)}) is not the key of the hub running there "
            "(keys from another run or federation?); use the public.json of the federation "
            "that hub serves, and check that the address is that hub's"
        )

    def _handle(self, received: Received) -> Envelope | None:
        try:
            if received.overflow is not None:
                raise EnvelopeError(received.overflow)
            env = unpack(received.frames, kinds=self._wire_kinds, limits=self.limits)
            if env.sender != self.hub_name:
                raise EnvelopeError(
                    f"the sender field says {quote(env.sender)} but this socket only talks to "
                    f"{quote(self.hub_name)}"
                )
            if env.kind == HEARTBEAT_KIND:
                if env.tensors or env.meta:
                    raise EnvelopeError("a heartbeat must carry no tensors or meta")
            elif self.session is not None and env.session != self.session:
                raise EnvelopeError(
                    f"message belongs to session {quote(env.session)}, not the current session "
                    f"{quote(self.session)}"
                )
            if self._last_seq is not None and env.seq <= self._last_seq:
                raise EnvelopeError(
                    f"{quote(env.kind)} message has seq {env.seq}, not above {self._last_seq}, "
                    "the last one accepted: a replayed or reordered message"
                )
        except EnvelopeError as exc:
            self.rejected += 1
            self._rejections.rejected(self.hub_name, self.hub_name, exc.reason)
            return None
        self._last_seq = env.seq
        self._last_heard = time.monotonic()
        if env.kind in RESERVED_KINDS:
            return None
        self.bytes_received += received.nbytes  # counted as the frames arrived
        return env

    def _heartbeat_loop(self) -> None:
        try:
            sock = self._new_socket(new_routing_id(self.name, heartbeat=True))
        except Exception:
            self.logger.exception("%s cannot open its heartbeat socket", self.name)
            return
        try:
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no backlog of stale beats while disconnected
            sock.connect(self.endpoint)
            seq = first_seq()
            while not self._stop.is_set():
                seq += 1
                beat = pack(Envelope(kind=HEARTBEAT_KIND, sender=self.name, seq=seq))
                try:
                    send_frames(sock, beat, flags=NOBLOCK)
                except zmq.ZMQError:
                    pass  # not connected (yet): nothing to keep alive
                self._stop.wait(self.heartbeat_interval)
        except Exception:
            self.logger.exception("%s heartbeat thread failed", self.name)
        finally:
            sock.close(linger=0)
