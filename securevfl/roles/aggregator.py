"""The aggregator role: the ZeroMQ hub. It forwards the active party's calls, adds the protected
contributions of exactly each sum's group, and forwards only sums. It holds no data, no labels
and (in ckks mode) only the public CKKS context."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

import numpy as np

from securevfl.config import RunConfig
from securevfl.keys import AGGREGATOR, load_public, load_secrets
from securevfl.roles import protocol as P
from securevfl.roles.party import parse_sums
from securevfl.secure_sum import ContributionError, GroupTooSmall, SumSession, backend
from transport import Allowlist, Envelope, Hub, PeerLost, ReceiveTimeout


class Aggregator:
    def __init__(self, *, cfg: RunConfig, hub: Hub, logger: logging.Logger) -> None:
        self.cfg = cfg
        self.hub = hub
        self.logger = logger
        self.active = cfg.active_name
        self.parties = set(cfg.party_names)
        self.stage = None
        self.session: bytes | None = None
        self.last_round = -1
        self.dead: set[str] = set()
        self.rejected = 0
        from securevfl.methods import method_spec

        # methods such as LASER-VFL go on without a lost party; the others stop, resumable
        self.tolerates_dropout = bool(method_spec(cfg.method).active.tolerates_dropout)

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._handshake()
            while True:
                try:
                    env = self._recv(
                        timeout=self.cfg.round_timeout + self.cfg.peer_timeout,
                        waiting_for=f"a call from {self.active}",
                    )
                except P.RunAborted as exc:
                    if not self._drop(exc):
                        raise
                    continue
                if env.sender != self.active:
                    self.logger.warning("dropped %r from %s outside a round", env.kind, env.sender)
                    continue
                if env.kind == P.BYE:
                    self._finish(env)
                    return P.EXIT_OK
                if env.kind == P.CALL:
                    self._round(env)
                else:
                    self.logger.warning("dropped unexpected %r from the active party", env.kind)
        except P.RunAborted as exc:
            self.logger.error("%s", exc)
            self._broadcast_abort(str(exc), lost=exc.lost)
            return P.EXIT_PEER_LOST if exc.lost else P.EXIT_ERROR

    def _handshake(self) -> None:
        roles = [self.active, *sorted(self.parties)]
        nonces: dict[str, str] = {}
        deadline = time.monotonic() + self.cfg.startup_timeout
        while len(nonces) < len(roles):
            left = deadline - time.monotonic()
            if left <= 0:
                absent = sorted(set(roles) - set(nonces))
                raise P.RunAborted(
                    f"roles {absent} did not connect within {self.cfg.startup_timeout:.0f} s; "
                    "start them, check [network] aggregator and their keys",
                    lost=absent[0],
                )
            try:
                env = self.hub.recv(timeout=left)
            except ReceiveTimeout:
                continue
            except PeerLost as exc:
                raise P.RunAborted(
                    f"role {exc.peer} vanished during start-up", lost=exc.peer
                ) from None
            nonce = env.meta.get("nonce")
            if env.kind != P.HELLO or not isinstance(nonce, str) or len(nonce) != 32:
                self.logger.warning("dropped %r from %s during the handshake", env.kind, env.sender)
                continue
            try:
                bytes.fromhex(nonce)
            except ValueError:
                self.logger.warning("dropped a hello with a malformed nonce from %s", env.sender)
                continue
            nonces[env.sender] = nonce
            self.logger.info("%s joined (%d/%d)", env.sender, len(nonces), len(roles))
        session = P.session_id(nonces)
        self.session = bytes.fromhex(session)
        self.hub.session = session
        for role in roles:
            self.hub.send(
                role,
                Envelope(
                    kind=P.WELCOME,
                    sender=AGGREGATOR,
                    session=session,
                    meta={"session": session, "nonces": nonces},
                ),
            )
        self.logger.info("session %s started with %s", session, roles)

    def _recv(self, *, timeout: float, waiting_for: str) -> Envelope:
        try:
            env = self.hub.recv(timeout=timeout)
        except PeerLost as exc:
            raise P.RunAborted(
                f"lost {exc.peer!r} (no heartbeat for {self.cfg.peer_timeout:.0f} s) while "
                f"waiting for {waiting_for}; restart it and rerun with --resume",
                lost=exc.peer,
            ) from None
        except ReceiveTimeout:
            raise P.RunAborted(
                f"nothing arrived within {timeout:.0f} s while waiting for {waiting_for}"
            ) from None
        if env.kind == P.ERROR:
            raise P.RunAborted(
                f"{env.sender} failed: {env.meta.get('reason', 'no reason given')}",
                lost=env.sender,
            )
        return env

    def _broadcast_abort(self, reason: str, *, lost: str | None) -> None:
        for role in self.hub.connected():
            if role == lost:
                continue
            try:
                self.hub.send(
                    role,
                    Envelope(
                        kind=P.ABORT,
                        sender=AGGREGATOR,
                        session=self.hub.session or "",
                        meta={"reason": reason, "lost": lost},
                    ),
                )
            except Exception as exc:  # best effort: the run is ending anyway
                self.logger.warning("could not tell %s about the abort: %s", role, exc)

    # -- one round ---------------------------------------------------------------------------

    def _round(self, env: Envelope) -> None:
        if env.round <= self.last_round:
            self.logger.warning(
                "dropped call for round %d (already at %d)", env.round, self.last_round
            )
            return
        self.last_round = env.round
        to = list(env.meta.get("to", []))
        sums = parse_sums(env.meta)
        unknown = sorted(set(to) - self.parties)
        if unknown or len(set(to)) != len(to):
            raise P.RunAborted(f"call names unknown or repeated parties {unknown or to}")
        for spec in sums:
            outside = sorted(set(spec.group) - set(to))
            if outside:
                raise P.RunAborted(f"sum {spec.key!r} names parties {outside} not in the call")
            try:
                from securevfl.secure_sum import check_group

                check_group(
                    self.cfg.aggregation,
                    spec.group,
                    min_group=self.cfg.min_group,
                    key=spec.key,
                    what=f"aggregator, op {env.meta.get('op')!r}",
                )
            except GroupTooSmall as exc:
                raise P.RunAborted(str(exc)) from None
        gone = sorted(set(to) & self.dead)
        if gone:  # the active party has not yet heard of the loss: tell it, run nothing
            self._tell_lost(env, gone)
            return
        if env.meta.get("op") == P.OP_SETUP:
            ckks = env.tensors.get("ckks_context")
            self.stage = backend(self.cfg.aggregation).aggregator(
                SumSession(
                    name=AGGREGATOR,
                    session=self.session or b"",
                    min_group=self.cfg.min_group,
                    frac_bits=self.cfg.frac_bits,
                    bound=self.cfg.bound,
                    ckks_public_context=None if ckks is None else ckks.tobytes(),
                )
            )
        for party in to:
            self._reply(party, P.CALL, env, tensors=env.tensors, meta=env.meta)
        replies: dict[str, Envelope] = {}
        accepted: dict[str, dict[str, Any]] = {spec.key: {} for spec in sums}
        while len(replies) < len(to):
            waiting = sorted(set(to) - set(replies))
            try:
                reply = self._recv(
                    timeout=self.cfg.round_timeout,
                    waiting_for=f"round {env.round} contributions from {waiting}",
                )
            except P.RunAborted as exc:
                if not self._drop(exc):
                    raise
                if exc.lost in to:
                    # the round cannot complete: discard the survivors' contributions (their
                    # masks were for this group) and let the active party re-run it
                    self._tell_lost(env, [exc.lost], delivered=True)
                    return
                continue
            if reply.kind != P.CONTRIB or reply.sender not in waiting or reply.round != env.round:
                self.logger.warning(
                    "dropped %r for round %d from %s during round %d",
                    reply.kind,
                    reply.round,
                    reply.sender,
                    env.round,
                )
                continue
            try:
                mine = self._accept(reply, sums)
            except (ContributionError, ValueError) as exc:
                self.rejected += 1
                self.logger.warning(
                    "rejected round %d contribution from %s: %s", env.round, reply.sender, exc
                )
                continue
            for key, value in mine.items():
                accepted[key][reply.sender] = value
            replies[reply.sender] = reply
        tensors: dict[str, np.ndarray] = {}
        shapes: dict[str, Any] = {}
        for spec in sums:
            party_shapes = {
                tuple(replies[p].meta.get("shapes", {}).get(spec.key, ())) for p in spec.group
            }
            if len(party_shapes) != 1:
                raise P.RunAborted(
                    f"sum {spec.key!r}: parties sent different shapes {party_shapes}"
                )
            try:
                tensors.update(
                    self.stage.combine_accepted(accepted[spec.key], group=spec.group, key=spec.key)
                )
            except (ContributionError, ValueError) as exc:
                raise P.RunAborted(f"round {env.round}, sum {spec.key!r}: {exc}") from None
            shapes[spec.key] = list(party_shapes.pop())
        # tensors a party sends to the active party in the clear (named "name@party")
        for party, reply in replies.items():
            for k, v in reply.tensors.items():
                if "@" in k:
                    if k.rsplit("@", 1)[1] != party:
                        raise P.RunAborted(f"{party} sent {k!r}, which claims another sender")
                    tensors[k] = v
        self._reply(self.active, P.RESULT, env, tensors=tensors, meta={"shapes": shapes})

    def _accept(self, reply: Envelope, sums: list) -> dict[str, Any]:
        """Validate every array a party sent for this round before any of it is used."""
        mine = [s for s in sums if reply.sender in s.group]
        expected = {s.key for s in mine}
        for name in reply.tensors:
            base = name.split("/", 1)[0]
            if base not in expected and not name.endswith(f"@{reply.sender}"):
                raise ContributionError(f"unexpected tensor {name!r}")
        out = {}
        for spec in mine:
            arrays = {
                k: v
                for k, v in reply.tensors.items()
                if k == spec.key or k.startswith(spec.key + "/")
            }
            out[spec.key] = self.stage.accept(arrays, key=spec.key, sender=reply.sender)
        return out

    def _drop(self, exc: P.RunAborted) -> bool:
        """Record a lost passive party if the method can go on without it."""
        lost = exc.lost
        if not (self.tolerates_dropout and lost in self.parties and lost not in self.dead):
            return False
        self.dead.add(lost)
        self.hub.forget(lost)
        self.logger.warning(
            "lost party %r: %s; continuing without it (%s treats its block as missing from now on)",
            lost,
            exc,
            self.cfg.method,
        )
        if len(self.parties - self.dead) == 0:
            return False
        return True

    def _tell_lost(self, env: Envelope, lost: list[str], *, delivered: bool = False) -> None:
        """Tell the active party the round failed because `lost` are gone; `delivered`: the
        call had reached every recipient (the others have run it)."""
        self._reply(
            self.active, P.RESULT, env, meta={"lost": lost, "shapes": {}, "delivered": delivered}
        )

    def _reply(self, to: str, kind: str, env: Envelope, **fields: Any) -> None:
        """Send `kind` to `to` in the session and round of `env`."""
        self.hub.send(
            to,
            Envelope(kind=kind, sender=AGGREGATOR, session=env.session, round=env.round, **fields),
        )

    def _finish(self, env: Envelope) -> None:
        stats: dict[str, Any] = {}
        alive = sorted(self.parties - self.dead)
        for party in alive:
            self._reply(party, P.BYE, env)
        while len(stats) < len(alive):
            reply = self._recv(timeout=self.cfg.round_timeout, waiting_for="the parties' stats")
            if reply.kind == P.STATS and reply.sender in alive:
                stats.update(reply.meta.get("stats", {}))
        for party in sorted(self.dead):
            stats[party] = {"lost": True}
        stats[AGGREGATOR] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "bytes_sent": int(self.hub.bytes_sent),
            "bytes_received": int(self.hub.bytes_received),
            "rejected_messages": int(getattr(self.hub, "rejected", 0)) + self.rejected,
        }
        self._reply(self.active, P.STATS, env, meta={"stats": stats})
        time.sleep(0.2)  # let the last frames leave before the socket closes


def run_aggregator(
    cfg: RunConfig,
    *,
    keys_dir: Any,
    bind: str,
    logger: logging.Logger,
    context: Any = None,
    on_bound: Any = None,
) -> int:
    public = load_public(keys_dir)
    secrets = load_secrets(keys_dir, AGGREGATOR)
    allow = Allowlist({r: public.curve_public(r) for r in cfg.role_names})
    hub = Hub(
        name=AGGREGATOR,
        bind=bind,
        keypair=secrets.curve,
        allowlist=allow,
        kinds=P.KINDS,
        heartbeat_interval=cfg.heartbeat_interval,
        peer_timeout=cfg.peer_timeout,
        logger=logger,
        context=context,
        curve=not bind.startswith("inproc://"),
    )
    logger.info("aggregator (pid %d) listening on %s", os.getpid(), hub.endpoint)
    if on_bound is not None:
        on_bound(hub.endpoint)
    try:
        return Aggregator(cfg=cfg, hub=hub, logger=logger).run()
    finally:
        hub.close()
