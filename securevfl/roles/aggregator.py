"""The aggregator role: the ZeroMQ hub. It forwards the active party's calls, adds the protected
contributions of exactly each sum's group, and forwards only sums. It holds no data, no labels
and (in ckks mode) only the public CKKS context.

It runs as its own process (`run_aggregator`) or, with [network] aggregator_in_active (plain and
mask only), as a thread of the active party's process (`colocated_aggregator`): the same loop,
its own sockets, the parties connecting to it as before and the active party over an in-process
socket, one network hop per round fewer."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from securevfl.config import RunConfig
from securevfl.keys import AGGREGATOR, load_public, load_secrets
from securevfl.roles import protocol as P
from securevfl.roles.rounds import AggregatorRound, Call, readmits_late, tolerates_dropout
from securevfl.secure_sum import ContributionError
from securevfl.threads import process_cpus
from transport import Allowlist, Envelope, Hub, PeerLost, ReceiveTimeout, TransportError
from transport.errors import one_line, quote

# a party that keeps its heartbeat but misses this many round deadlines in a row is dropped for
# the rest of the run even by a method that readmits late parties (it is hung, not slow)
LATE_ROUNDS_TO_DROP = 3


def own_stats(party: str, meta: Any) -> tuple[dict[str, Any], list[str]]:
    """What the aggregator takes from `party`'s STATS meta: its own entry only, only the fields
    that are plain JSON data within the bounds (`protocol.STATS_RULE`); and what it dropped, one
    problem each (peer text quoted). Another role's entry is always dropped: a party speaks
    only for itself."""
    stats = meta.get("stats") if isinstance(meta, dict) else None
    if type(stats) is not dict:
        return {}, [f"its stats are of type {type(stats).__name__}, not a mapping of role to stats"]
    problems = []
    others = [key for key in stats if key != party]
    if others:
        shown = ", ".join(quote(key, 40) for key in others[:3])
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        problems.append(f"entries for other roles ({shown}{more}): a party speaks for itself")
    kept, dropped = P.plain_stats_fields(stats.get(party))
    return kept, problems + dropped


def failure_of(env: Envelope) -> P.RunAborted:
    """The abort a role's ERROR report stands for (the reason is the peer's text: quoted on
    one line, so it cannot forge log lines)."""
    return P.RunAborted(
        f"{env.sender} failed: {one_line(str(env.meta.get('reason', 'no reason given')))}",
        lost=env.sender,
        refused=env.meta.get("refused") is True,
        budget=env.meta.get("budget") is True,
        usage=env.meta.get("usage") is True,
    )


@dataclass
class OpenRound:
    """A round in flight at the aggregator: its call, and the contributions accepted so far
    (sum key -> party -> contribution), which only this round's sums ever combine."""

    call: Call
    replies: dict[str, Envelope] = field(default_factory=dict)
    accepted: dict[str, dict[str, Any]] = field(default_factory=dict)

    def waiting(self) -> list[str]:
        return sorted(set(self.call.to) - set(self.replies))


class Aggregator:
    def __init__(self, *, cfg: RunConfig, hub: Hub, logger: logging.Logger) -> None:
        self.cfg = cfg
        self.hub = hub
        self.logger = logger
        self.active = cfg.active_name
        self.parties = set(cfg.party_names)
        self.session: bytes | None = None
        self.rounds: AggregatorRound | None = None
        self.last_round = -1
        self.dead: set[str] = set()
        self.rejected = 0
        # methods such as LASER-VFL go on without a lost party; the others stop, resumable
        self.tolerates_dropout = tolerates_dropout(cfg)
        # methods such as TabVFL (its failure cache) also keep a party that missed a round's
        # deadline: it misses that round only; consecutive misses per party
        self.readmits_late = self.tolerates_dropout and readmits_late(cfg)
        self.missed: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self._handshake()
            if self.cfg.pipeline_depth > 0:
                return self._serve_pipelined()
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
                    self.logger.warning(
                        "dropped %s from %s outside a round", quote(env.kind), env.sender
                    )
                    continue
                if env.kind == P.BYE:
                    self._finish(env)
                    return P.EXIT_OK
                if env.kind == P.CALL:
                    self._round(env)
                else:
                    self.logger.warning(
                        "dropped unexpected %s from the active party", quote(env.kind)
                    )
        except P.RunAborted as exc:
            self.logger.error("%s", exc)
            self._broadcast_abort(
                str(exc), lost=exc.lost, refused=exc.refused, budget=exc.budget, usage=exc.usage
            )
            return exc.exit_code

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
                self.logger.warning(
                    "dropped %s from %s during the handshake", quote(env.kind), env.sender
                )
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
        self.rounds = AggregatorRound(cfg=self.cfg, session=self.session)
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
            raise failure_of(env)
        return env

    def _unreachable(self, party: str, exc: Exception) -> P.RunAborted:
        """Why a call cannot reach `party`: the error it reported before its link went, if
        that report is already here (a crash says why, then closes: the report arrives before
        the loss), else the lost link itself."""
        try:
            queued = self.hub.queued()
        except TransportError:
            queued = []
        for env in queued:
            if env.sender == party and env.kind == P.ERROR:
                return failure_of(env)
        return P.RunAborted(f"cannot reach {party!r}: {exc}", lost=party)

    def _broadcast_abort(
        self,
        reason: str,
        *,
        lost: str | None,
        refused: bool = False,
        budget: bool = False,
        usage: bool = False,
    ) -> None:
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
                        meta={
                            "reason": reason,
                            "lost": lost,
                            "refused": refused,
                            "budget": budget,
                            "usage": usage,
                        },
                    ),
                )
            except Exception as exc:  # best effort: the run is ending anyway
                self.logger.warning("could not tell %s about the abort: %s", role, exc)

    # -- one round ---------------------------------------------------------------------------

    def _newer(self, env: Envelope) -> bool:
        """Whether `env` is a call for a round after the last one seen (the active party's
        rounds only grow); an older one is dropped and logged."""
        if env.round <= self.last_round:
            self.logger.warning(
                "dropped call for round %d (already at %d)", env.round, self.last_round
            )
            return False
        self.last_round = env.round
        return True

    def _round(self, env: Envelope) -> None:
        if not self._newer(env):
            return
        call = self.rounds.open(env)
        gone = sorted(set(call.to) & self.dead)
        if gone:  # the active party has not yet heard of the loss: tell it, run nothing
            self._send(self.active, self.rounds.lost(call, gone, delivered=False))
            return
        failed = []
        for party, exc in self._relay(call.to, env).items():  # gone before its heartbeat expired
            lost = self._unreachable(party, exc)
            if not self._drop(lost):
                raise lost from None
            failed.append(party)
        if failed:  # the others got the call: they may have run it
            delivered = len(failed) < len(call.to)
            self._send(self.active, self.rounds.lost(call, failed, delivered=delivered))
            return
        replies: dict[str, Envelope] = {}
        accepted: dict[str, dict[str, Any]] = {spec.key: {} for spec in call.sums}
        while len(replies) < len(call.to):
            waiting = sorted(set(call.to) - set(replies))
            try:
                reply = self._recv(
                    timeout=self.cfg.round_timeout,
                    waiting_for=f"round {env.round} contributions from {waiting}",
                )
            except P.RunAborted as exc:
                if exc.lost is None and not exc.refused and self.tolerates_dropout:
                    # set-up is not a round a party can miss: it would hold nothing to run
                    readmit = self.readmits_late and call.op != P.OP_SETUP
                    hung = self._missed(waiting, env) if readmit else waiting
                    late = sorted(set(waiting) - set(hung))
                    # silent past the round deadline while its heartbeat goes on: lost to this
                    # run like a party whose heartbeat stopped (told so, then dropped), unless
                    # the method readmits it: then it misses this round only (still a member,
                    # called again next round; its reply to this round is dropped by round id)
                    lost = self._drop_late(hung, env, exc) if hung else []
                    self._send(self.active, self.rounds.lost(call, lost, delivered=True, late=late))
                    return
                if not self._drop(exc):
                    raise
                if exc.lost in call.to:
                    # the round cannot complete: discard the survivors' contributions (their
                    # masks were for this group) and let the active party re-run it
                    self._send(self.active, self.rounds.lost(call, [exc.lost], delivered=True))
                    return
                continue
            if reply.kind == P.REFUSED and reply.sender in waiting and reply.round == env.round:
                # the round cannot complete: tell the active party who refused and why
                reason = one_line(str(reply.meta.get("reason", "refused")))
                self.logger.error("round %d refused by %s: %s", env.round, reply.sender, reason)
                self._send(self.active, self.rounds.refused(call, {reply.sender: reason}))
                return
            if reply.kind != P.CONTRIB or reply.sender not in waiting or reply.round != env.round:
                self.logger.warning(
                    "dropped %s for round %d from %s during round %d",
                    quote(reply.kind),
                    reply.round,
                    reply.sender,
                    env.round,
                )
                continue
            if not self._take(call, reply, accepted, replies):
                continue
            self.missed.pop(reply.sender, None)  # in time again
        self._send(self.active, self.rounds.result(call, replies, accepted))

    def _take(
        self, call: Any, reply: Envelope, accepted: Any, replies: dict[str, Envelope]
    ) -> bool:
        """Validate `reply`'s contribution to `call` and record it in `accepted` (per sum key,
        per sender) and `replies`; a malformed one is rejected alone and logged (False)."""
        try:
            mine = self.rounds.accept(call, reply)
        except (ContributionError, ValueError) as exc:
            self.rejected += 1
            self.logger.warning(
                "rejected round %d contribution from %s: %s", reply.round, reply.sender, exc
            )
            return False
        for key, value in mine.items():
            accepted[key][reply.sender] = value
        replies[reply.sender] = reply
        return True

    # -- several rounds in flight ([network] pipeline_depth > 0) ------------------------------

    def _serve_pipelined(self) -> int:
        """The round loop with several rounds in flight: each call goes to its parties as it
        arrives, each contribution is routed to its round by round id, and a round's result
        goes to the active party when its group is complete. Calls are still checked one by
        one (`AggregatorRound.open`), rounds stay strictly increasing, and a round's sums only
        combine that round's contributions (its own masks). A lost, silent or failed role stops
        the run as in the one-round loop (a method that pipelines tolerates no dropout); a
        refusal ends its round (the active party stops when it reaches it)."""
        limit = self._in_flight_limit()
        open_rounds: dict[int, OpenRound] = {}
        while True:
            oldest = next(iter(open_rounds.values()), None)
            if oldest is None:
                timeout = self.cfg.round_timeout + self.cfg.peer_timeout
                waiting_for = f"a call from {self.active}"
            else:
                timeout = self.cfg.round_timeout
                waiting_for = f"round {oldest.call.round} contributions from {oldest.waiting()}"
            env = self._recv(timeout=timeout, waiting_for=waiting_for)
            if env.sender != self.active:
                self._route(env, open_rounds)
            elif env.kind == P.BYE:
                self._finish(env)
                return P.EXIT_OK
            elif env.kind == P.CALL:
                self._open(env, open_rounds, limit)
            else:
                self.logger.warning("dropped unexpected %s from the active party", quote(env.kind))

    def _in_flight_limit(self) -> int:
        """How many calls may be open at once: the d + 1 forwards in flight, each with the
        backward riding in its envelope or, when the pipeline drains, sent alone."""
        return 2 * (self.cfg.pipeline_depth + 1)

    def _open(self, env: Envelope, open_rounds: dict[int, OpenRound], limit: int) -> None:
        if not self._newer(env):
            return
        call = self.rounds.open(env)
        if len(open_rounds) >= limit:
            raise P.RunAborted(
                f"the active party sent round {env.round} with {len(open_rounds)} calls already "
                f"in flight; [network] pipeline_depth = {self.cfg.pipeline_depth} allows "
                f"{limit}; stopping (check the active party's config)"
            )
        for party, exc in self._relay(call.to, env).items():  # gone before its heartbeat expired
            raise self._unreachable(party, exc) from None
        open_rounds[env.round] = OpenRound(call=call, accepted={spec.key: {} for spec in call.sums})

    def _route(self, reply: Envelope, open_rounds: dict[int, OpenRound]) -> None:
        """A party's answer, to the round in flight it names (anything else is dropped)."""
        entry = open_rounds.get(reply.round)
        if entry is None or reply.sender not in entry.waiting():
            self.logger.warning(
                "dropped %s for round %d from %s (no such round in flight awaits it)",
                quote(reply.kind),
                reply.round,
                reply.sender,
            )
            return
        if reply.kind == P.REFUSED:
            # the round cannot complete: tell the active party who refused and why
            reason = one_line(str(reply.meta.get("reason", "refused")))
            self.logger.error("round %d refused by %s: %s", reply.round, reply.sender, reason)
            self._send_result(self.rounds.refused(entry.call, {reply.sender: reason}))
            # the active party stops when it reaches that round: the rounds in flight after it
            # end here, and every role stops with the refusal as its cause
            raise P.RunAborted(
                f"{entry.call.op} (round {reply.round}) was refused by a party's release policy: "
                f"{reply.sender}: {reason}; the calls in flight were dropped, nothing more is "
                "released",
                refused=True,
            )
        if reply.kind != P.CONTRIB:
            self.logger.warning(
                "dropped %s for round %d from %s", quote(reply.kind), reply.round, reply.sender
            )
            return
        if not self._take(entry.call, reply, entry.accepted, entry.replies):
            return
        if not entry.waiting():
            self._send_result(self.rounds.result(entry.call, entry.replies, entry.accepted))
            del open_rounds[reply.round]

    def _send_result(self, env: Envelope) -> None:
        try:
            self._send(self.active, env)
        except TransportError as exc:  # gone before its heartbeat expired
            raise P.RunAborted(f"cannot reach {self.active!r}: {exc}", lost=self.active) from None

    def _missed(self, late: list[str], env: Envelope) -> list[str]:
        """Count a missed deadline for each of `late`; returns those that missed
        LATE_ROUNDS_TO_DROP in a row (to drop), the others stay in the run."""
        hung = []
        for party in late:
            self.missed[party] = self.missed.get(party, 0) + 1
            if self.missed[party] >= LATE_ROUNDS_TO_DROP:
                hung.append(party)
                continue
            self.logger.warning(
                "%r did not answer round %d within [network] round_timeout (%g s): it misses "
                "this round and is called again in the next (%d of %d late rounds in a row "
                "before it is dropped)",
                party,
                env.round,
                self.cfg.round_timeout,
                self.missed[party],
                LATE_ROUNDS_TO_DROP,
            )
        return hung

    def _drop_late(self, late: list[str], env: Envelope, timeout: P.RunAborted) -> list[str]:
        """Drop the parties that missed round `env.round`'s deadline, each told by an ABORT
        that names it (it stops with "lost" rather than wait for calls that never come).
        Raises `timeout` when no party would be left."""
        if not set(self.parties - self.dead - set(late)):
            raise timeout
        for party in late:
            reason = (
                f"{party!r} did not answer round {env.round} within [network] round_timeout "
                f"({self.cfg.round_timeout:g} s); the run goes on without it"
            )
            try:
                self._reply(party, P.ABORT, env, meta={"reason": reason, "lost": party})
            except TransportError:
                pass  # already unreachable: dropped all the same
            self._drop(P.RunAborted(reason, lost=party))
        return late

    def _drop(self, exc: P.RunAborted) -> bool:
        """Record a lost passive party if the method can go on without it."""
        lost = exc.lost
        if exc.refused:  # a party that refused is not a lost party: the run stops
            return False
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

    def _send(self, to: str, env: Envelope) -> None:
        self.hub.send(to, env)

    def _relay(self, parties: Sequence[str], env: Envelope) -> dict[str, TransportError]:
        """The active party's call to each of `parties`, encoded once; those it could not
        reach, with why (the others got it)."""
        call = Envelope(
            kind=P.CALL,
            sender=AGGREGATOR,
            session=env.session,
            round=env.round,
            tensors=env.tensors,
            meta=env.meta,
        )
        return self.hub.send_each(parties, call)

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
            waiting = [p for p in alive if p not in stats]
            reply = self._recv(
                timeout=self.cfg.round_timeout, waiting_for=f"the stats of {waiting}"
            )
            if reply.kind == P.STATS and reply.sender in waiting:
                stats[reply.sender] = self._own_stats(reply)
        for party in sorted(self.dead):
            stats[party] = {"lost": True}
        stats[AGGREGATOR] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "cpus": process_cpus(),
            "bytes_sent": int(self.hub.bytes_sent),
            "bytes_received": int(self.hub.bytes_received),
            "rejected_messages": int(getattr(self.hub, "rejected", 0)) + self.rejected,
        }
        self._reply(self.active, P.STATS, env, meta={"stats": stats})
        time.sleep(0.2)  # let the last frames leave before the socket closes

    def _own_stats(self, reply: Envelope) -> dict[str, Any]:
        """The sender's own stats from its STATS reply (`own_stats`); what it dropped is
        logged, once."""
        kept, problems = own_stats(reply.sender, reply.meta)
        if problems:
            shown = "; ".join(problems[:4])
            more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
            self.logger.warning(
                "dropped from the stats %s sent: %s%s; %s (the run's metrics keep the rest)",
                reply.sender,
                one_line(shown),
                more,
                P.STATS_RULE,
            )
        return kept


def run_aggregator(
    cfg: RunConfig,
    *,
    keys_dir: Any,
    bind: str,
    logger: logging.Logger,
    context: Any = None,
    on_bound: Any = None,
) -> int:
    if cfg.aggregator_in_active:
        from securevfl.config import ConfigError

        raise ConfigError(
            "[network] aggregator_in_active",
            "this config runs the aggregator inside the active party's process; do not start it "
            "as its own role (or set aggregator_in_active = false to run it separately)",
        )
    hub = aggregator_hub(cfg, keys_dir, bind, logger, context, cfg.role_names)
    logger.info("aggregator (pid %d) listening on %s", os.getpid(), hub.endpoint)
    if on_bound is not None:
        on_bound(hub.endpoint)
    try:
        return Aggregator(cfg=cfg, hub=hub, logger=logger).run()
    finally:
        hub.close()


def aggregator_hub(
    cfg: RunConfig,
    keys_dir: Any,
    bind: str,
    logger: logging.Logger,
    context: Any,
    roles: Sequence[str],
    *,
    local: str | None = None,
) -> Hub:
    """The aggregator's hub at `bind`: CURVE with the aggregator's key over TCP (none on an
    inproc:// address), accepting `roles` by their public keys; `local`, a role served on an
    in-process socket only (the colocated active party)."""
    public = load_public(keys_dir)
    secrets = load_secrets(keys_dir, AGGREGATOR)
    hub = Hub(
        name=AGGREGATOR,
        bind=bind,
        keypair=secrets.curve,
        allowlist=Allowlist({r: public.curve_public(r) for r in roles}),
        kinds=P.KINDS,
        heartbeat_interval=cfg.heartbeat_interval,
        peer_timeout=cfg.peer_timeout,
        logger=logger,
        context=context,
        curve=not bind.startswith("inproc://"),
        local=local,
    )
    P.announce_endpoint(hub.endpoint)
    return hub


@dataclass
class Colocated:
    """The aggregator thread of the active party's process: where the active party connects
    (`endpoint`, an inproc:// socket of `context`) and, once the thread ended, its exit
    status (`code`)."""

    endpoint: str
    context: Any
    thread: threading.Thread | None = None
    code: int | None = None


@contextlib.contextmanager
def colocated_aggregator(
    cfg: RunConfig,
    *,
    keys_dir: Any,
    bind: str,
    run_dir: Path,
    context: Any = None,
) -> Iterator[Colocated]:
    """[network] aggregator_in_active: the aggregator as a thread of the active party's process,
    with its own hub bound at `bind` (CURVE over TCP for the parties; inproc:// without CURVE
    when the whole federation runs in one process) and an in-process socket for the active
    party, which connects to `Colocated.endpoint` in `Colocated.context`. The hub serves the
    active party there only: its key is left out of the hub's allowlist, so no other process
    can join as the active party.

    What it changes for privacy: the active party's process sees what the aggregator sees, the
    protected contributions one by one. With mask these are uniformly random ring elements
    (the pairwise masks are keyed between passive parties only, and groups hold passive parties
    only), so it learns the sums and nothing more, as the design allows; with plain it sees the
    representations it already sees. Refused with ckks (the aggregator would sit next to the
    secret key); config validation refuses that earlier, this is the last line. Every party
    learns of the colocation from its own config and from the active party's authenticated
    set-up (`securevfl.roles.guard.run_terms`), and its policy may refuse it
    (`[policy] aggregator_in_active = false`).

    On the way out it waits (a few seconds at most) for the aggregator thread to end: after
    the active party's bye it ends with the final stats; after a failure the active party
    reported (or an abort it received) it ends too."""
    import zmq

    from securevfl.errors import exit_code_for

    if cfg.aggregation == "ckks":
        raise P.RunAborted(
            "refusing to run the aggregator in the active party's process with ckks: the "
            "aggregator sees every ciphertext and the active party holds the secret key; set "
            "[network] aggregator_in_active = false"
        )
    logger = P.role_logger(AGGREGATOR, Path(run_dir))
    own_context = context is None
    ctx = zmq.Context() if own_context else context
    # the passive parties only: the active party is served in-process and nowhere else
    hub = aggregator_hub(cfg, keys_dir, bind, logger, ctx, cfg.party_names, local=cfg.active_name)
    assert hub.local_endpoint is not None
    logger.info(
        "aggregator (in %s's process, pid %d) listening on %s; %s connects in-process",
        cfg.active_name,
        os.getpid(),
        hub.endpoint,
        cfg.active_name,
    )
    link = Colocated(endpoint=hub.local_endpoint, context=ctx)

    def body() -> None:
        try:
            link.code = Aggregator(cfg=cfg, hub=hub, logger=logger).run()
        except Exception as exc:  # the active party learns of it as a lost aggregator
            logger.exception("failed: %s", exc)
            link.code = exit_code_for(exc)
        finally:
            hub.close()

    link.thread = threading.Thread(target=body, name="securevfl-aggregator", daemon=True)
    link.thread.start()
    try:
        yield link
    finally:
        link.thread.join(timeout=10.0)
        if link.thread.is_alive():
            logger.warning("the aggregator thread did not stop within 10 s of the active party")
        elif link.code not in (None, P.EXIT_OK):
            logger.warning("the aggregator thread stopped with exit status %s", link.code)
        if own_context and not link.thread.is_alive():
            ctx.term()


@contextlib.contextmanager
def aggregator_link(
    cfg: RunConfig, *, keys_dir: Any, address: str, run_dir: Path, context: Any = None
) -> Iterator[tuple[str, Any]]:
    """Where the active party connects, as (address, zmq context): `address` and `context`
    unchanged, or with [network] aggregator_in_active, its own aggregator thread
    (`colocated_aggregator`, bound at [network] bind, else at `address`; at `address` itself
    when it is inproc://, a whole federation in one process)."""
    if not cfg.aggregator_in_active:
        yield address, context
        return
    bind = address if address.startswith("inproc://") else (cfg.bind_address or address)
    with colocated_aggregator(
        cfg, keys_dir=keys_dir, bind=bind, run_dir=run_dir, context=context
    ) as link:
        yield link.endpoint, link.context
