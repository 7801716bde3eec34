"""The hub: the aggregator's ROUTER socket, which every other role connects to."""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from transport.curve import (
    Allowlist,
    AllowlistAuthenticator,
    CurveKeyPair,
    check_role_name,
    start_authenticator,
)
from transport.envelope import (
    DEFAULT_LIMITS,
    Envelope,
    EnvelopeError,
    Limits,
    frames_nbytes,
    pack,
    unpack,
)
from transport.errors import PeerLost, ReceiveTimeout, TransportError, quote
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
    describe_routing_id,
    first_seq,
    forget_routing_ids,
    parse_routing_id,
    readable,
    recv_bounded,
    send_frames,
)

# the hub watches its own handshakes to name clients that hold the wrong hub key
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
# one warning per window: a misconfigured client retries its handshake every few seconds
_HANDSHAKE_LOG_WINDOW_S = 60.0
# replay state is kept per socket; bounded so that reconnect churn cannot grow it forever
_MAX_TRACKED_SOCKETS = 4096
# how often a busy hub reads its handshake events between polls (a waiting one at once)
MONITOR_EVERY_S = 0.1


class Hub(Endpoint):
    """The aggregator's end: one CURVE-server ROUTER bound at ``bind`` that peers connect to.

    Who sent a message is what CURVE authenticated, never what the message says: the ZAP
    authenticator admits only allowlisted keys and sets each connection's ``User-Id`` to the
    role name; the hub then requires the role named in the peer's routing id and the
    envelope's ``sender`` to equal that name. Every message is validated (per-message frame
    count and bytes while it is received, then kind, dtypes, shapes, session, strictly
    increasing ``seq`` per socket); one that fails is logged with the sender and the reason
    (peer text quoted, see ``errors.quote``), counted in ``rejected`` (exactly) and dropped,
    and the hub keeps serving the others. The log is rate-limited per sending role (see
    :class:`RejectionLog`): the first few at WARNING, then the rest at DEBUG with one WARNING
    a minute that counts them, so a flood of invalid messages cannot flood the log. Each role
    may have at most ``limits.max_pending_messages`` messages (``limits.pending_bytes_cap``
    bytes) waiting for :meth:`recv`; more are rejected the same way.

    Routing: a :class:`Peer` connects with routing ids ``name/<token>`` (main socket) and
    ``name/hb/<token>`` (heartbeat socket), the token 128 secret random bits. The hub sends
    to a role only over the main-socket routing id on which that role's CURVE key last said
    hello, and only if it carries a token. A ROUTER cannot refuse the id a client presents
    and, with ``ROUTER_HANDOVER`` (kept so that a reconnecting peer replaces its stale
    link), a second connection presenting an existing id takes it over; since no other
    role can know a token, no authenticated role can take over, receive or send on another
    role's connection. A client that connects under another role's name is refused as
    soon as it sends; one that uses a bare ``name`` (no token) may send but is never sent
    to. One connection per role is served: a hello on a new connection (a restarted peer)
    makes it the route, and the connection it replaced may no longer send. Tokens are
    never logged.

    Wrong keys: a client whose key is not allowlisted is refused by ZAP, which logs the key's
    fingerprint and address (see :class:`transport.AllowlistAuthenticator`); a client that
    holds another hub's public key fails the CURVE handshake before it can present its key,
    and the hub logs that (once a minute) from its socket monitor.

    While it waits in :meth:`recv` or :meth:`wait_for` (and on :meth:`send` and
    :meth:`keepalive`) the hub sends a heartbeat to every connected peer each
    ``heartbeat_interval``; call :meth:`keepalive` during local work longer than the peers'
    ``peer_timeout`` or they will report the hub lost.

    ``curve=False`` is accepted only for ``inproc://`` endpoints (an in-process channel with
    the same interface, for tests and sweeps): libzmq runs neither CURVE nor ZAP over inproc,
    so there the routing id is the identity and, when an ``allowlist`` is given, must be one
    of its names. ``inproc://`` needs the peers to share ``context``.

    ``local``: the one role that runs in this hub's own process (e.g. the active party when
    the aggregator is colocated with it). The hub binds a second ROUTER socket at a fresh
    ``inproc://`` endpoint (:attr:`local_endpoint`, reachable only through :attr:`context`,
    i.e. from this process) that serves that role alone: whatever arrives there is ``local``
    (its routing id must name it), and nothing else is. That role is never served over
    ``bind``: a connection there that authenticates as ``local`` (its key should not be in
    the allowlist at all) is refused, so no remote process can stand in for it. No network,
    CURVE or I/O thread lies between the two: a message is handed over in memory.

    Limitation: libzmq queues every frame of a multipart message before it delivers the
    first, and ``zmq.MAXMSGSIZE`` (``limits.hard_frame_cap``) caps each frame, not their
    number; the hub refuses an over-limit message frame by frame without keeping or
    decoding it, but an allowlisted peer that streams frames of one endless message can
    still grow libzmq's own buffer. Bound the process's memory (cgroup, ``ulimit -v``).

    Attributes: ``endpoint`` (the bound address, with the real port for ``tcp://...:0``),
    ``session`` (settable; when set, application messages of another session are rejected),
    ``bytes_sent`` / ``bytes_received`` (envelope frame bytes of application messages sent /
    accepted; heartbeats, rejected messages and CURVE overhead are not counted),
    ``rejected`` (messages dropped by validation) and ``handshake_failures`` (CURVE
    handshakes that failed before ZAP, e.g. a client holding another hub's key).

    Not thread-safe: use a hub from one thread.
    """

    word = "hub"

    def __init__(
        self,
        *,
        name: str = "aggregator",
        bind: str,
        keypair: CurveKeyPair | None = None,
        allowlist: Allowlist | None = None,
        kinds: Collection[str],
        limits: Limits = DEFAULT_LIMITS,
        heartbeat_interval: float = 1.0,
        peer_timeout: float = 10.0,
        logger: logging.Logger | None = None,
        context: zmq.Context | None = None,
        curve: bool = True,
        local: str | None = None,
    ) -> None:
        check_role_name(name)
        if local is not None:
            check_role_name(local)
            if local == name:
                raise ValueError(f"local={local!r} is the hub's own name")
        check_endpoint(bind, curve=curve, context=context)
        check_timing(heartbeat_interval, peer_timeout)
        if curve and (keypair is None or allowlist is None):
            raise ValueError("a CURVE hub needs keypair= (its own keys) and allowlist= (the peers)")
        self.name = name
        self.kinds = check_kinds(kinds)
        self.limits = limits
        self.heartbeat_interval = float(heartbeat_interval)
        self.peer_timeout = float(peer_timeout)
        self.logger = logger or logging.getLogger("transport.hub")
        self.allowlist = allowlist
        self.curve = curve
        self.session: str | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rejected = 0
        self._rejections = RejectionLog(self.logger)
        self.endpoint = bind
        self.local = local
        self.local_endpoint: str | None = None

        self._wire_kinds = self.kinds | RESERVED_KINDS
        self._routes: dict[str, bytes] = {}  # role -> routing id of its main socket
        self._last_seen: dict[str, float] = {}  # roles whose liveness is tracked
        self._last_seq: dict[bytes, int] = {}  # routing id -> last accepted seq (LRU order)
        self._pending: deque[tuple[Envelope, int]] = deque()  # (envelope, its frame bytes)
        self._pending_count: dict[str, int] = {}
        self._pending_bytes: dict[str, int] = {}
        self._warned_untokened: set[str] = set()
        self._last_handshake_warning = -math.inf
        self.handshake_failures = 0
        self._monitor_due = 0.0  # when `_process_monitor` next reads the events
        self._seq = first_seq()
        self._next_heartbeat = time.monotonic()
        self._closed = False
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._auth: AllowlistAuthenticator | None = None
        self._socket: zmq.Socket | None = None
        self._local_socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._poller = zmq.Poller()
        try:
            if curve:
                assert allowlist is not None and keypair is not None
                # before bind: a CURVE server without a ZAP handler admits any client
                self._auth = start_authenticator(self._context, allowlist, logger=self.logger)
            socket = self._context.socket(zmq.ROUTER)
            self._socket = socket
            configure_socket(
                socket,
                limits=limits,
                heartbeat_interval=heartbeat_interval,
                peer_timeout=peer_timeout,
            )
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unknown peer raises
            socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer replaces its old link
            if curve:
                socket.curve_server = True
                socket.curve_secretkey = keypair.secret
                socket.curve_publickey = keypair.public
                self._monitor = socket.get_monitor_socket(events=_MONITOR_EVENTS)
                self._poller.register(self._monitor, zmq.POLLIN)
            self._poller.register(socket, zmq.POLLIN)
            socket.bind(bind)
            self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
            if local is not None:
                self._local_socket = self._bind_local(local)
        except zmq.ZMQError as exc:
            self.close(linger=0)
            raise TransportError(
                f"the hub cannot bind {bind}: {exc.strerror}; pick a free port (or port 0) "
                "and an address of this host"
            ) from exc
        except BaseException:
            self.close(linger=0)
            raise
        self.logger.info("hub %s listening on %s (curve=%s)", name, self.endpoint, curve)

    # ------------------------------------------------------------------ public API

    def recv(self, *, timeout: float) -> Envelope:
        """Return the next valid application message from any peer.

        Invalid messages are logged, counted and dropped while waiting; heartbeats never
        reach the caller. Raises ``PeerLost(name)`` when a peer that has been seen sends
        nothing for ``peer_timeout`` (each loss is reported once, until the peer is heard
        again), and ``ReceiveTimeout`` when ``timeout`` seconds pass without a message.
        """
        check_timeout(timeout)
        self._serve(
            timeout,
            lambda: bool(self._pending),
            lambda: (
                f"no message arrived at {self.name} ({self.endpoint}) within {timeout:g} s; "
                f"connected peers: {sorted(self._routes) or 'none'}"
            ),
        )
        env, nbytes = self._pending.popleft()
        self._pending_count[env.sender] -= 1
        self._pending_bytes[env.sender] -= nbytes
        return env

    def send(self, to: str, env: Envelope) -> None:
        """Send ``env`` to the role ``to``; sets its ``sender``, ``seq`` and, if unset, ``session``.

        Refuses (``TransportError``) a role that has never connected or whose link is gone,
        and a send the peer's queue does not take within ``peer_timeout``; refuses
        (``EnvelopeError``) an envelope that breaks this hub's limits and (``ValueError``)
        one whose session differs from :attr:`session`. Tensors are sent zero-copy: do not
        modify them until the peer has received them.
        """
        sock, rid = self._route_to(to)
        frames = pack(self._stamp(env), limits=self.limits)
        self._send_frames(to, sock, rid, env.kind, frames, frames_nbytes(frames))
        self._heartbeat_if_due()

    def send_each(self, names: Sequence[str], env: Envelope) -> dict[str, TransportError]:
        """Send ``env`` to every role in ``names``, stamped and encoded once (one ``seq``: each
        peer still sees the hub's numbers strictly increase). Returns the roles it could not
        send to, each with the ``TransportError`` that `send` would have raised; every other
        role got the message. Refuses what `send` refuses for the envelope itself."""
        frames = pack(self._stamp(env), limits=self.limits)
        nbytes = frames_nbytes(frames)
        failed: dict[str, TransportError] = {}
        for to in names:
            try:
                sock, rid = self._route_to(to)
                self._send_frames(to, sock, rid, env.kind, frames, nbytes)
            except TransportError as exc:
                failed[to] = exc
        self._heartbeat_if_due()  # after: a beat between them would outnumber this seq
        return failed

    def _route_to(self, to: str) -> tuple[zmq.Socket, bytes]:
        sock = self._socket_of(to)
        rid = self._routes.get(to)
        if rid is None:
            raise TransportError(
                f"cannot send to {to!r}: it has not connected to {self.name} "
                f"(connected: {sorted(self._routes) or 'none'}); call wait_for([{to!r}]) first"
            )
        return sock, rid

    def _send_frames(
        self, to: str, sock: zmq.Socket, rid: bytes, kind: str, frames: list[Any], nbytes: int
    ) -> None:
        try:
            send_frames(sock, [rid, *frames])
        except zmq.Again as exc:
            raise TransportError(
                f"{to} did not take a {kind!r} message within {self.peer_timeout:g} s: "
                "its receive queue is full; is it still calling recv()?"
            ) from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise TransportError(
                    f"cannot send to {to!r}: its connection to {self.name} is gone; "
                    "restart it and rerun with --resume"
                ) from exc
            raise
        self.bytes_sent += nbytes

    @property
    def context(self) -> zmq.Context:
        """The ZeroMQ context of this hub's sockets (an ``inproc://`` peer must share it)."""
        return self._context

    def connected(self) -> set[str]:
        """Roles whose main socket has announced itself (each :class:`Peer` does on connect)."""
        return set(self._routes)

    def wait_for(self, names: Collection[str], *, timeout: float) -> None:
        """Block until every role in ``names`` has connected, so that :meth:`send` to it works.

        Application messages that arrive meanwhile are kept for :meth:`recv`. Raises
        ``ReceiveTimeout`` naming the absent roles, or ``PeerLost`` as :meth:`recv` does.
        """
        check_timeout(timeout)
        wanted = set(names)

        def absent() -> list[str]:
            return sorted(wanted - self._routes.keys())

        self._serve(
            timeout,
            lambda: not absent(),
            lambda: (
                f"{absent()} did not connect to {self.name} at {self.endpoint} within "
                f"{timeout:g} s; check that they run, that they use this hub's public key as "
                "server key, and that their keys are in the allowlist"
            ),
        )

    def keepalive(self) -> None:
        """Send due heartbeats and queue arrived messages, without blocking or raising PeerLost.

        Call it now and then during local work longer than the peers' ``peer_timeout``.
        """
        self._open_socket()
        self._heartbeat_if_due()
        self._drain(lambda: False)

    def queued(self) -> list[Envelope]:
        """The messages that have arrived and wait for :meth:`recv`, oldest first (a copy:
        :meth:`recv` still returns each of them). Reads what is waiting on the sockets first,
        as :meth:`keepalive` does: without blocking or raising PeerLost, due heartbeats sent."""
        self.keepalive()
        return [env for env, _ in self._pending]

    def forget(self, name: str) -> None:
        """Stop checking that ``name`` is alive (e.g. it finished and left) until it sends again."""
        self._last_seen.pop(name, None)

    def close(self, *, linger: float = LINGER_MS / 1000) -> None:
        """Close the socket and the authenticator; unsent messages are dropped after ``linger`` s.

        Idempotent; never blocks much longer than ``linger``.
        """
        if self._closed:
            return
        self._closed = True
        self._rejections.flush(final=True)
        if self._socket is not None:
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close(linger=0)
            self._socket.close(linger=int(linger * 1000))
        if self._local_socket is not None:
            self._local_socket.close(linger=int(linger * 1000))
        if self._auth is not None:
            self._auth.stop()
        forget_routing_ids()
        if self._own_context:
            self._context.term()

    def __repr__(self) -> str:
        return (
            f"Hub(name={self.name!r}, endpoint={self.endpoint!r}, connected={sorted(self._routes)})"
        )

    # ------------------------------------------------------------------ internals

    def _open_socket(self) -> zmq.Socket:
        if self._closed or self._socket is None:
            raise TransportError(f"hub {self.name} is closed")
        return self._socket

    def _socket_of(self, role: str) -> zmq.Socket:
        """The socket that serves ``role``: the local one for the local role, else ``bind``'s."""
        sock = self._open_socket()
        if role == self.local and self._local_socket is not None:
            return self._local_socket
        return sock

    def _bind_local(self, local: str) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        try:
            configure_socket(
                sock,
                limits=self.limits,
                heartbeat_interval=self.heartbeat_interval,
                peer_timeout=self.peer_timeout,
            )
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # a fresh name: only code of this process that is handed it can connect
            endpoint = f"inproc://{self.name}-local-{local}-{secrets.token_hex(8)}"
            sock.bind(endpoint)
        except BaseException:
            sock.close(linger=0)
            raise
        self._poller.register(sock, zmq.POLLIN)
        self.local_endpoint = endpoint
        return sock

    def _serve(
        self, timeout: float, done: Callable[[], bool], describe_timeout: Callable[[], str]
    ) -> None:
        self._open_socket()
        deadline = time.monotonic() + timeout
        monitor = False  # its events are read when due, or at once when they woke the poll
        while True:
            self._heartbeat_if_due()
            self._process_monitor(now=monitor)
            self._drain(done)
            if done():
                return
            now = time.monotonic()
            self._raise_if_lost(now)
            if now >= deadline:
                raise ReceiveTimeout(describe_timeout())
            wake = min(deadline, self._next_heartbeat)
            if self._last_seen:
                wake = min(wake, min(self._last_seen.values()) + self.peer_timeout)
            woke = self._poller.poll(timeout=max(0, math.ceil((wake - now) * 1000)))
            monitor = any(socket is self._monitor for socket, _ in woke)

    def _drain(self, done: Callable[[], bool]) -> None:
        sock = self._open_socket()
        local = self._local_socket
        busy = True
        while busy and not done():
            busy = False
            # the in-process role first: its calls start the rounds
            if local is not None and readable(local):
                try:
                    received = recv_bounded(local, limits=self.limits, prefix=1)
                except zmq.Again:
                    pass
                else:
                    self._handle(received, local=True)
                    busy = True
                    continue
            if not readable(sock):
                continue
            try:
                received = recv_bounded(sock, limits=self.limits, prefix=1)
            except zmq.Again:
                continue
            self._handle(received)
            busy = True

    def _process_monitor(self, *, now: bool = False) -> None:
        """Log failed handshakes; on the hot path at most every `MONITOR_EVERY_S` unless `now`
        (the poll woke on them)."""
        if self._monitor is None:
            return
        clock = time.monotonic()
        if not now and clock < self._monitor_due:
            return
        self._monitor_due = clock + MONITOR_EVERY_S
        while readable(self._monitor):
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(flags=zmq.NOBLOCK))
            except zmq.Again:
                return
            self.handshake_failures += 1
            now = time.monotonic()
            loud = now - self._last_handshake_warning >= _HANDSHAKE_LOG_WINDOW_S
            if loud:
                self._last_handshake_warning = now
            crypto = (
                event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                and event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
            )
            cause = (
                "its first CURVE command does not decrypt with this hub's key: it was given "
                "another hub's public key (keys from another run or federation?); give it "
                "this hub's public key"
                if crypto
                else "the client broke off or does not speak CurveZMQ; check that it is a "
                "securevfl role configured with this hub's public key"
            )
            self.logger.log(
                logging.WARNING if loud else logging.DEBUG,
                "a client connecting to %s failed the CURVE handshake (%d so far): %s; its "
                "role cannot be told, as CurveZMQ reveals nothing before the handshake",
                self.endpoint,
                self.handshake_failures,
                cause,
            )

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_interval
        self._rejections.flush()  # the counts of windows that ended (nothing if none)
        self._open_socket()
        for name, rid in self._routes.items():
            if name not in self._last_seen:
                continue  # lost or forgotten: nobody to keep alive
            self._seq += 1
            beat = pack(Envelope(kind=HEARTBEAT_KIND, sender=self.name, seq=self._seq))
            try:
                send_frames(self._socket_of(name), [rid, *beat], flags=NOBLOCK)
            except zmq.ZMQError:  # gone or congested; loss detection is on the receive side
                self.logger.debug("heartbeat to %s not sent", name)

    def _raise_if_lost(self, now: float) -> None:
        if not self._last_seen or now - min(self._last_seen.values()) <= self.peer_timeout:
            return  # nobody silent too long (the common case: no sort)
        for name, seen in sorted(self._last_seen.items(), key=lambda item: item[1]):
            silent = now - seen
            if silent > self.peer_timeout:
                del self._last_seen[name]  # report each loss once
                self.logger.warning("lost %s: silent for %.1f s", name, silent)
                raise PeerLost(name, silent_for=silent, peer_timeout=self.peer_timeout)

    def _handle(self, received: Received, *, local: bool = False) -> None:
        frames = received.frames
        rid = frames[0].bytes
        body = frames[1:]
        who = None  # named for the log only when refused (the routing id parsed once)
        try:
            if not body:
                raise EnvelopeError("the message has no frames after the routing id")
            name, from_heartbeat_socket, tokened = self._identify(rid, body[0], local=local)
            who = name
            if received.overflow is not None:
                raise EnvelopeError(received.overflow)
            env = unpack(body, kinds=self._wire_kinds, limits=self.limits)
            self._check(env, name=name, rid=rid, from_heartbeat_socket=from_heartbeat_socket)
            if not from_heartbeat_socket:
                self._check_current(name, rid, hello=env.kind == HELLO_KIND)
            nbytes = received.nbytes  # the envelope frames' bytes, counted as they arrived
            if env.kind not in RESERVED_KINDS:
                self._check_pending(name, nbytes)
        except EnvelopeError as exc:
            self.rejected += 1
            self._rejections.rejected(who, who or describe_routing_id(rid), exc.reason)
            return
        self._last_seq.pop(rid, None)  # re-insert: most recently used last
        self._last_seq[rid] = env.seq
        if len(self._last_seq) > _MAX_TRACKED_SOCKETS:
            del self._last_seq[next(iter(self._last_seq))]
        self._last_seen[name] = time.monotonic()
        if not from_heartbeat_socket:
            self._route(name, rid, tokened=tokened)
        if env.kind in RESERVED_KINDS:
            return
        self.bytes_received += nbytes
        self._pending.append((env, nbytes))
        self._pending_count[name] = self._pending_count.get(name, 0) + 1
        self._pending_bytes[name] = self._pending_bytes.get(name, 0) + nbytes

    def _check_pending(self, name: str, nbytes: int) -> None:
        count = self._pending_count.get(name, 0)
        queued = self._pending_bytes.get(name, 0)
        if (
            count + 1 > self.limits.max_pending_messages
            or queued + nbytes > self.limits.pending_bytes_cap
        ):
            raise EnvelopeError(
                f"{count} messages ({queued} bytes) from {name} already wait to be read, and "
                f"this one would pass the limits of {self.limits.max_pending_messages} "
                f"messages and {self.limits.pending_bytes_cap} bytes per role"
            )

    def _check_current(self, name: str, rid: bytes, *, hello: bool) -> None:
        """One live connection per role: a hello on a new connection makes it the role's
        route; anything else from a connection it replaced is refused, so two processes
        holding one role's key cannot both take part."""
        current = self._routes.get(name)
        if current is not None and current != rid and not hello:
            raise EnvelopeError(
                f"{name} sent on a connection that a newer one of {name} has replaced; only "
                "its newest connection (the last to say hello) is served: is a second "
                f"process running as {name}?"
            )

    def _route(self, name: str, rid: bytes, *, tokened: bool) -> None:
        """Send to ``name`` over ``rid`` from now on, if ``rid`` is one nobody else can take."""
        if not tokened:  # a bare name can be presented by anyone: never route to it
            if name not in self._warned_untokened:
                self._warned_untokened.add(name)
                self.logger.warning(
                    "%s connected with the guessable routing id %s; its messages are "
                    "accepted but nothing will be sent to it (connect with transport.Peer)",
                    name,
                    describe_routing_id(rid),
                )
            return
        previous = self._routes.get(name)
        if previous == rid:
            return
        self._routes[name] = rid
        if previous is None:
            self.logger.info("%s connected to %s", name, self.name)
        else:
            self.logger.info("%s reconnected to %s (new connection)", name, self.name)
        if self._auth is not None:
            self._auth.connected = frozenset(self._routes)

    def _identify(
        self, rid: bytes, frame: zmq.Frame, *, local: bool = False
    ) -> tuple[str, bool, bool]:
        """The authenticated role behind a connection, whether this is its heartbeat socket,
        and whether its routing id carries a token; refuses a routing id that claims another
        role than the connection's CURVE key (or, on the local socket, than the local role),
        or that has no role in it."""
        parsed = parse_routing_id(rid)
        if parsed is None:
            raise EnvelopeError(
                f"routing id {describe_routing_id(rid)} is not of the form <role>/<token>; "
                "connect with transport.Peer"
            )
        if local:  # only this process can reach the local socket, and it serves one role
            if parsed.name != self.local:
                raise EnvelopeError(
                    f"the in-process socket serves {quote(self.local or '')} only, not "
                    f"{quote(parsed.name)}"
                )
            return parsed.name, parsed.heartbeat, parsed.tokened
        if parsed.name == self.local:
            raise EnvelopeError(
                f"{quote(parsed.name)} runs in the hub's own process and is served there only, "
                f"never over {self.endpoint} (a remote process using its name or key)"
            )
        if not self.curve:  # inproc: the routing id is all there is
            if self.allowlist is not None and parsed.name not in self.allowlist:
                raise EnvelopeError(
                    f"{quote(parsed.name)} is not a role of this federation (routing id "
                    f"{describe_routing_id(rid)})"
                )
            return parsed.name, parsed.heartbeat, parsed.tokened
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            user = None
        if not user:
            raise EnvelopeError("the connection carries no CURVE-authenticated identity")
        if parsed.name != user:
            raise EnvelopeError(
                f"the connection authenticated as {quote(user)} uses routing id "
                f"{describe_routing_id(rid)}; a role must connect under its own name "
                "(impersonation attempt)"
            )
        return user, parsed.heartbeat, parsed.tokened

    def _check(self, env: Envelope, *, name: str, rid: bytes, from_heartbeat_socket: bool) -> None:
        if env.sender != name:
            raise EnvelopeError(
                f"the sender field says {quote(env.sender)} but the connection is authenticated "
                f"as {quote(name)} (impersonation attempt)"
            )
        if from_heartbeat_socket and env.kind != HEARTBEAT_KIND:
            raise EnvelopeError(f"the heartbeat socket sent a {quote(env.kind)} message")
        if env.kind in RESERVED_KINDS:
            if env.tensors or env.meta:
                raise EnvelopeError(f"a {quote(env.kind)} message must carry no tensors or meta")
        elif self.session is not None and env.session != self.session:
            raise EnvelopeError(
                f"message belongs to session {quote(env.session)}, not the current session "
                f"{quote(self.session)}"
            )
        last = self._last_seq.get(rid)
        if last is not None and env.seq <= last:
            raise EnvelopeError(
                f"{quote(env.kind)} message has seq {env.seq}, not above {last}, the last one "
                "accepted from this socket: a replayed or reordered message"
            )
