"""The hub: the aggregator's ROUTER socket, which every other role connects to."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection

import zmq

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
from transport.errors import PeerLost, ReceiveTimeout, TransportError
from transport.sockets import (
    HEARTBEAT_KIND,
    HEARTBEAT_ROUTING_SUFFIX,
    LINGER_MS,
    RESERVED_KINDS,
    Endpoint,
    check_endpoint,
    check_kinds,
    check_timeout,
    check_timing,
    configure_socket,
    first_seq,
)


class Hub(Endpoint):
    """The aggregator's end: one CURVE-server ROUTER bound at ``bind`` that peers connect to.

    Who sent a message is what CURVE authenticated, never what the message says: the ZAP
    authenticator admits only allowlisted keys and sets each connection's ``User-Id`` to the
    role name; the hub then requires the peer's routing id (``name`` for its main socket,
    ``name/hb`` for its heartbeat socket) and the envelope's ``sender`` to equal that name.
    Every message is validated (kind, dtypes, sizes, session, strictly increasing ``seq`` per
    socket); one that fails is logged at WARNING with the sender and the reason, counted in
    ``rejected`` and dropped, and the hub keeps serving the others.

    While it waits in :meth:`recv` or :meth:`wait_for` (and on :meth:`send` and
    :meth:`keepalive`) the hub sends a heartbeat to every connected peer each
    ``heartbeat_interval``; call :meth:`keepalive` during local work longer than the peers'
    ``peer_timeout`` or they will report the hub lost.

    ``curve=False`` is accepted only for ``inproc://`` endpoints (an in-process channel with
    the same interface, for tests and sweeps): libzmq runs neither CURVE nor ZAP over inproc,
    so there the routing id is the identity and, when an ``allowlist`` is given, must be one
    of its names. ``inproc://`` needs the peers to share ``context``.

    Limitation: a peer's routing id is its name and a newer connection with the same routing
    id takes over (``ROUTER_HANDOVER``, so a restarted peer is not ignored). An allowlisted
    role that connects under another role's name is refused as soon as it sends and that
    route is dropped, but one that only listens could receive what is sent to that role;
    the threat model assumes roles follow the protocol.

    Attributes: ``endpoint`` (the bound address, with the real port for ``tcp://...:0``),
    ``session`` (settable; when set, application messages of another session are rejected),
    ``bytes_sent`` / ``bytes_received`` (envelope frame bytes of application messages sent /
    accepted; heartbeats, rejected messages and CURVE overhead are not counted) and
    ``rejected`` (messages dropped by validation).

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
    ) -> None:
        check_role_name(name)
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
        self.endpoint = bind

        self._wire_kinds = self.kinds | RESERVED_KINDS
        self._routes: dict[str, bytes] = {}  # role -> routing id of its main socket
        self._last_seen: dict[str, float] = {}  # roles whose liveness is tracked
        self._last_seq: dict[bytes, int] = {}  # routing id -> last accepted seq
        self._pending: deque[Envelope] = deque()
        self._seq = first_seq()
        self._next_heartbeat = time.monotonic()
        self._closed = False
        self._own_context = context is None
        self._context = context if context is not None else zmq.Context()
        self._auth: AllowlistAuthenticator | None = None
        self._socket: zmq.Socket | None = None
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
            socket.bind(bind)
            self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
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
        return self._pending.popleft()

    def send(self, to: str, env: Envelope) -> None:
        """Send ``env`` to the role ``to``; sets its ``sender``, ``seq`` and, if unset, ``session``.

        Refuses (``TransportError``) a role that has never connected or whose link is gone,
        and a send the peer's queue does not take within ``peer_timeout``; refuses
        (``EnvelopeError``) an envelope that breaks this hub's limits and (``ValueError``)
        one whose session differs from :attr:`session`. Tensors are sent zero-copy: do not
        modify them until the peer has received them.
        """
        sock = self._open_socket()
        rid = self._routes.get(to)
        if rid is None:
            raise TransportError(
                f"cannot send to {to!r}: it has not connected to {self.name} "
                f"(connected: {sorted(self._routes) or 'none'}); call wait_for([{to!r}]) first"
            )
        frames = pack(self._stamp(env), limits=self.limits)
        try:
            sock.send_multipart([rid, *frames], copy=False)
        except zmq.Again as exc:
            raise TransportError(
                f"{to} did not take a {env.kind!r} message within {self.peer_timeout:g} s: "
                "its receive queue is full; is it still calling recv()?"
            ) from exc
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise TransportError(
                    f"cannot send to {to!r}: its connection to {self.name} is gone; "
                    "restart it and rerun with --resume"
                ) from exc
            raise
        self.bytes_sent += frames_nbytes(frames)
        self._heartbeat_if_due()

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
        if self._socket is not None:
            self._socket.close(linger=int(linger * 1000))
        if self._auth is not None:
            self._auth.stop()
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

    def _serve(
        self, timeout: float, done: Callable[[], bool], describe_timeout: Callable[[], str]
    ) -> None:
        sock = self._open_socket()
        deadline = time.monotonic() + timeout
        while True:
            self._heartbeat_if_due()
            self._drain(done)
            if done():
                return
            now = time.monotonic()
            self._raise_if_lost(now)
            if now >= deadline:
                raise ReceiveTimeout(describe_timeout())
            losses = [seen + self.peer_timeout for seen in self._last_seen.values()]
            wake = min([deadline, self._next_heartbeat, *losses])
            sock.poll(timeout=max(0, math.ceil((wake - now) * 1000)))

    def _drain(self, done: Callable[[], bool]) -> None:
        sock = self._open_socket()
        while not done():
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.heartbeat_interval
        sock = self._open_socket()
        for name, rid in self._routes.items():
            if name not in self._last_seen:
                continue  # lost or forgotten: nobody to keep alive
            self._seq += 1
            beat = pack(Envelope(kind=HEARTBEAT_KIND, sender=self.name, seq=self._seq))
            try:
                sock.send_multipart([rid, *beat], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # gone or congested; loss detection is on the receive side
                self.logger.debug("heartbeat to %s not sent", name)

    def _raise_if_lost(self, now: float) -> None:
        for name, seen in sorted(self._last_seen.items(), key=lambda item: item[1]):
            silent = now - seen
            if silent > self.peer_timeout:
                del self._last_seen[name]  # report each loss once
                self.logger.warning("lost %s: silent for %.1f s", name, silent)
                raise PeerLost(name, silent_for=silent, peer_timeout=self.peer_timeout)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        body = frames[1:]
        who = _describe_routing_id(rid)
        try:
            if not body:
                raise EnvelopeError("the message has no frames after the routing id")
            name, from_heartbeat_socket = self._identify(rid, body[0])
            who = name
            env = unpack(body, kinds=self._wire_kinds, limits=self.limits)
            self._check(env, name=name, rid=rid, from_heartbeat_socket=from_heartbeat_socket)
        except EnvelopeError as exc:
            self.rejected += 1
            self.logger.warning("rejected a message from %s: %s", who, exc.reason)
            return
        self._last_seq[rid] = env.seq
        self._last_seen[name] = time.monotonic()
        if not from_heartbeat_socket:
            if name not in self._routes:
                self.logger.info("%s connected to %s", name, self.name)
            self._routes[name] = rid
        if env.kind in RESERVED_KINDS:
            return
        self.bytes_received += frames_nbytes(body)
        self._pending.append(env)

    def _identify(self, rid: bytes, frame: zmq.Frame) -> tuple[str, bool]:
        """The authenticated role behind a connection, and whether it is a heartbeat socket."""
        try:
            claimed = rid.decode("ascii")
        except UnicodeDecodeError:
            claimed = ""
        from_heartbeat_socket = claimed.endswith(HEARTBEAT_ROUTING_SUFFIX)
        if from_heartbeat_socket:
            claimed = claimed[: -len(HEARTBEAT_ROUTING_SUFFIX)]
        if not self.curve:  # inproc: the routing id is all there is
            if not claimed or (self.allowlist is not None and claimed not in self.allowlist):
                raise EnvelopeError(
                    f"routing id {_describe_routing_id(rid)} is not a role of this federation"
                )
            return claimed, from_heartbeat_socket
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            user = None
        if not user:
            raise EnvelopeError("the connection carries no CURVE-authenticated identity")
        if claimed != user:
            if self._routes.get(claimed) == rid:  # that route may now lead to the wrong role
                del self._routes[claimed]
            raise EnvelopeError(
                f"the connection authenticated as {user!r} uses routing id "
                f"{_describe_routing_id(rid)}; a role must connect under its own name "
                "(impersonation attempt)"
            )
        return user, from_heartbeat_socket

    def _check(self, env: Envelope, *, name: str, rid: bytes, from_heartbeat_socket: bool) -> None:
        if env.sender != name:
            raise EnvelopeError(
                f"the sender field says {env.sender!r} but the connection is authenticated as "
                f"{name!r} (impersonation attempt)"
            )
        if from_heartbeat_socket and env.kind != HEARTBEAT_KIND:
            raise EnvelopeError(f"the heartbeat socket sent a {env.kind!r} message")
        if env.kind in RESERVED_KINDS:
            if env.tensors or env.meta:
                raise EnvelopeError(f"a {env.kind!r} message must carry no tensors or meta")
        elif self.session is not None and env.session != self.session:
            raise EnvelopeError(
                f"message belongs to session {env.session!r}, not the current session "
                f"{self.session!r}"
            )
        last = self._last_seq.get(rid)
        if last is not None and env.seq <= last:
            raise EnvelopeError(
                f"{env.kind!r} message has seq {env.seq}, not above {last}, the last one accepted "
                "from this socket: a replayed or reordered message"
            )


def _describe_routing_id(rid: bytes) -> str:
    try:
        text = rid.decode("ascii")
    except UnicodeDecodeError:
        return f"0x{rid.hex()}"
    return repr(text) if text.isprintable() else f"0x{rid.hex()}"
