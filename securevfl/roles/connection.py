"""A role's connection to the aggregator: CURVE keys, the session handshake, and receive errors
turned into `RunAborted` with the name of whoever was lost."""

from __future__ import annotations

import collections
import logging
import os
import socket
import string
import time
from pathlib import Path
from typing import Any

from securevfl.config import RunConfig
from securevfl.errors import KeyMaterialError
from securevfl.keys import (
    AGGREGATOR,
    FederationPublicKeys,
    RoleSecrets,
    check_pair,
    load_public,
    load_secrets,
)
from securevfl.roles import protocol as P
from securevfl.threads import process_cpus
from transport import (
    Envelope,
    HandshakeFailed,
    KeyRefused,
    Peer,
    PeerLost,
    ReceiveTimeout,
    TransportError,
)
from transport.errors import one_line, quote

_HEX_DIGITS = frozenset(string.hexdigits)


def welcome_problem(nonces: Any, session: Any) -> str | None:
    """What is malformed in a WELCOME's `nonces` (role name -> 32 hex digits, as each role's
    hello sent it) and `session` (a string), peer text quoted; None when nothing is."""
    if type(nonces) is not dict:
        return f"'nonces' is of type {type(nonces).__name__}, not a mapping of role to nonce"
    for role, nonce in nonces.items():
        if type(role) is not str:
            return f"'nonces' has the key {quote(role, 40)}, not a role name"
        if type(nonce) is not str or len(nonce) != 32 or not set(nonce) <= _HEX_DIGITS:
            return f"the nonce of role {quote(role, 40)} is {quote(nonce, 40)}, not 32 hex digits"
    if type(session) is not str:
        return f"'session' is of type {type(session).__name__}, not a session id string"
    return None


class RoleConnection:
    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        peer: Peer,
        secrets: RoleSecrets,
        public: FederationPublicKeys,
        logger: logging.Logger,
        nonce: str,
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.peer = peer
        self.secrets = secrets
        self.public = public
        self.logger = logger
        self.nonce = nonce
        self.session_hex: str | None = None
        # messages taken early, at a send (see `_stop_if_stopped`), in the order they came
        self._early: collections.deque[Envelope] = collections.deque()

    @classmethod
    def connect(
        cls,
        *,
        cfg: RunConfig,
        name: str,
        keys_dir: Path,
        address: str,
        logger: logging.Logger,
        nonce: str,
        context: Any = None,
    ) -> RoleConnection:
        public = load_public(keys_dir)
        secrets = load_secrets(keys_dir, name)
        check_pair(public, secrets, keys_dir)
        peer = Peer(
            name=name,
            connect=address,
            keypair=secrets.curve,
            server_public=public.curve_public(AGGREGATOR),
            kinds=P.KINDS,
            heartbeat_interval=cfg.heartbeat_interval,
            peer_timeout=cfg.peer_timeout,
            logger=logger,
            context=context,
            # inproc:// (threads of one process, the experiment fast path) has no CURVE in libzmq
            curve=not address.startswith("inproc://"),
        )
        logger.info("connecting to the aggregator at %s", address)
        return cls(
            cfg=cfg,
            name=name,
            peer=peer,
            secrets=secrets,
            public=public,
            logger=logger,
            nonce=nonce,
        )

    def handshake(self) -> bytes:
        """Say hello with a fresh nonce; return the session id agreed from everyone's nonces."""
        self.send(Envelope(kind=P.HELLO, sender=self.name, meta={"nonce": self.nonce}))
        env = self.recv(timeout=self.cfg.startup_timeout, waiting_for="the federation to assemble")
        if env.kind != P.WELCOME:
            raise P.RunAborted(f"expected a welcome from the aggregator, got {env.kind!r}")
        nonces = env.meta.get("nonces", {})
        session = env.meta.get("session")
        malformed = welcome_problem(nonces, session)
        if malformed is not None:
            raise P.RunAborted(
                f"the aggregator's welcome is malformed: {malformed}; refusing the session "
                "(check that the aggregator runs an unmodified securevfl of this version)"
            )
        if nonces.get(self.name) != self.nonce or P.session_id(nonces) != session:
            raise P.RunAborted(
                "the aggregator's session id does not include this role's fresh nonce; "
                "refusing a possibly replayed session"
            )
        self.session_hex = session
        self.peer.session = session
        self.logger.info("joined session %s with roles %s", session, sorted(nonces))
        return bytes.fromhex(session)

    def recv(self, *, timeout: float, waiting_for: str) -> Envelope:
        env = self._early.popleft() if self._early else self._receive(timeout, waiting_for)
        if env.kind in (P.ABORT, P.ERROR):
            raise self._stopped(env)
        return env

    def _receive(self, timeout: float, waiting_for: str) -> Envelope:
        try:
            return self.peer.recv(timeout=timeout)
        except PeerLost as exc:
            raise P.RunAborted(
                f"lost the aggregator ({exc}); restart the federation with --resume",
                lost=AGGREGATOR,
            ) from None
        except HandshakeFailed as exc:
            raise self._wrong_hub(exc) from None
        except KeyRefused as exc:
            raise self._refused(exc) from None
        except ReceiveTimeout:
            raise P.RunAborted(
                f"nothing arrived within {timeout:.0f} s while waiting for {waiting_for}; "
                "check that every role is running and reachable, or raise [network] timeouts"
            ) from None

    def _stop_if_stopped(self) -> None:
        """Before a send: a stop that reached this role while it computed (the aggregator's
        ABORT, a role's ERROR) ends it now. The aggregator closes its socket right after such
        a stop, and a send into a hub that is gone waits `peer_timeout` for it before failing;
        a busy party learned why the run ended only then. Anything else that arrived early (a
        pipelined call, a result) is kept, in order, for `recv`."""
        while self.peer.waiting():
            try:
                env = self.peer.recv(timeout=0)
            except ReceiveTimeout:  # only heartbeats were waiting
                return
            except TransportError:  # a lost or refusing hub: the send says so, as before
                return
            if env.kind in (P.ABORT, P.ERROR):
                raise self._stopped(env)
            self._early.append(env)

    def _stopped(self, env: Envelope) -> P.RunAborted:
        """The stop an ABORT or ERROR message announces. Its fields come from a peer: the
        reason is escaped and bounded, a lost role must be a role of this federation."""
        meta = env.meta
        lost = meta.get("lost") if env.kind == P.ABORT else meta.get("role")
        if lost is not None and lost not in (AGGREGATOR, *self.cfg.role_names):
            lost = AGGREGATOR  # a name no role has: blame the sender
        default = f"the run was aborted ({lost} lost)" if lost else "a role failed"
        reason = meta.get("reason")
        return P.RunAborted(
            one_line(reason) if isinstance(reason, str) else default,
            lost=lost,
            refused=meta.get("refused") is True,
            budget=meta.get("budget") is True,
            usage=meta.get("usage") is True,
        )

    def send(self, env: Envelope) -> None:
        env.sender = self.name
        self._stop_if_stopped()
        try:
            self.peer.send(env)
        except HandshakeFailed as exc:
            raise self._wrong_hub(exc) from None
        except KeyRefused as exc:
            raise self._refused(exc) from None
        except TransportError as exc:
            raise self._send_failed(exc) from None

    def _send_failed(self, exc: Exception) -> P.RunAborted | KeyMaterialError:
        """The aggregator did not take a message: usually it stopped the run a moment earlier
        (a budget stop, a refusal, a lost role) and its ABORT is already waiting here. End with
        that stop's cause when it is; otherwise the aggregator is lost."""
        deadline = time.monotonic() + 2.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                env = self.peer.recv(timeout=left)
            except HandshakeFailed as refused:  # the send failed because the key was refused
                return self._wrong_hub(refused)
            except KeyRefused as refused:
                return self._refused(refused)
            except TransportError:
                break
            if env.kind in (P.ABORT, P.ERROR):
                return self._stopped(env)
        return P.RunAborted(
            f"lost the aggregator ({one_line(str(exc))}); restart the federation with --resume",
            lost=AGGREGATOR,
        )

    # a refused or mismatched key is bad input (exit status 2), said at once, not after a timeout
    def _wrong_hub(self, exc: Exception) -> KeyMaterialError:
        return KeyMaterialError(str(exc))  # the transport names the key, its fingerprint, the fix

    def _refused(self, exc: Exception) -> KeyMaterialError:
        return KeyMaterialError(
            f"the aggregator refused the CURVE key of {self.name!r} ({exc}): it is not in the "
            "federation's allowlist; use this role's key from the federation's keys "
            "directory (`securevfl keys`), or ask the operator to add it"
        )

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cpus": process_cpus(),
            "bytes_sent": int(self.peer.bytes_sent),
            "bytes_received": int(self.peer.bytes_received),
        }

    def close(self) -> None:
        self.peer.close()


class RoundExchange:
    """The active party's exchange over its connection: `send` a call envelope, `receive` the
    result of a round sent before. Several rounds may be in flight ([network] pipeline_depth):
    a result that arrives for another round in flight is kept until it is asked for; anything
    else is logged and dropped. Calling it sends and waits in one step."""

    def __init__(self, conn: RoleConnection, cfg: RunConfig, logger: logging.Logger) -> None:
        self.conn = conn
        self.cfg = cfg
        self.logger = logger
        self._sent: set[int] = set()
        self._results: dict[int, Envelope] = {}

    def __call__(self, env: Envelope) -> Envelope:
        self.send(env)
        return self.receive(env.round, f"round {env.round} ({env.meta.get('op')})")

    def send(self, env: Envelope) -> None:
        self.conn.send(env)
        self._sent.add(env.round)

    def receive(self, round: int, what: str) -> Envelope:
        """The result of `round` (sent before); raises `RunAborted` as the connection does."""
        if round not in self._sent:
            raise ValueError(f"no call of round {round} is in flight")
        while round not in self._results:
            reply = self.conn.recv(
                timeout=self.cfg.round_timeout + self.cfg.peer_timeout,
                waiting_for=f"the result of {what}",
            )
            if (
                reply.kind == P.RESULT
                and reply.round in self._sent
                and reply.round not in self._results
            ):
                self._results[reply.round] = reply
                continue
            self.logger.warning(
                "dropped %r for round %d while waiting for round %d", reply.kind, reply.round, round
            )
        self._sent.discard(round)
        return self._results.pop(round)
