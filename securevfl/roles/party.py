"""The passive-party role: answers the active party's calls with protected contributions
(`roles/rounds.py` `PartyRound`), over its connection to the aggregator."""

from __future__ import annotations

import logging
import os
import secrets as pysecrets
from pathlib import Path
from typing import Any

from securevfl import startup_gc
from securevfl.config import RunConfig
from securevfl.errors import BudgetExceeded, KeyMaterialError, PolicyRefusal, exit_code_for
from securevfl.methods import method_spec
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.roles import protocol as P
from securevfl.roles.connection import RoleConnection
from securevfl.roles.rounds import PartyRound, first_round
from securevfl.secure_sum import PROCESS_ZERO_MODE, start_zero_helper
from transport import Envelope
from transport.errors import quote


class PassiveParty:
    """One passive party's loop over its connection: every call answered by its `PartyRound`.
    `run()` returns when the active party says bye."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        table: Any,
        conn: RoleConnection,
        run_dir: Path,
        logger: logging.Logger,
        device: Any,
        device_time: Any = None,
        scoring: bool = False,
    ) -> None:
        self.cfg = cfg
        self.device_time = device_time  # a `DeviceClock` where the models run on a GPU
        self.scoring = scoring  # started to score rows (--score): the guard holds it to that
        self.name = name
        self.conn = conn
        self.run_dir = run_dir
        self.logger = logger
        self.method = method_spec(cfg.method).party_class()(
            name=name, table=table, config=cfg, device=device
        )
        self.last_round = -1
        # opened before the handshake, so before any role of the run records anything
        self.ledger = PrivacyLedger(run_dir / LEDGER_FILENAME)

    def run(self) -> dict[str, Any]:
        # a party in a process of its own gets a low-priority helper for its CKKS zeros, started
        # now so that it imports while the run sets up; threads of one process (transport
        # inproc) make them in their own waits
        in_process = self.conn.peer.endpoint.startswith("inproc://")
        zeros = None if in_process else PROCESS_ZERO_MODE
        helper = start_zero_helper(zeros) if self.cfg.aggregation == "ckks" else None
        try:
            return self._serve(zeros, helper)
        finally:
            if helper is not None:
                helper.close()

    def _serve(self, zeros: str | None, helper: Any) -> dict[str, Any]:
        session = self.conn.handshake()
        rounds = PartyRound(
            cfg=self.cfg,
            name=self.name,
            method=self.method,
            run_dir=self.run_dir,
            ledger=self.ledger,
            logger=self.logger,
            session=session,
            mask_keypair=self.conn.secrets.mask,
            mask_publics=self.conn.public.mask,
            ckks_zeros=zeros,
            ckks_zero_helper=helper,
            scoring=self.scoring,
        )
        rounds.device_time = self.device_time
        rounds.guard.check_run()  # this party's own policy accepts the run its config describes
        while True:
            # the next call comes after the current round closes at the aggregator, which may take
            # up to round_timeout when another party is slow: wait twice that (a dead aggregator
            # is noticed sooner, by its heartbeat)
            env = self.conn.recv(timeout=2 * self.cfg.round_timeout, waiting_for="the next call")
            if env.kind == P.BYE:
                if rounds.received is not None:
                    rounds.received.save()
                stats = {
                    **self.conn.stats(),
                    "guard_seconds": round(rounds.guard.seconds, 6),
                    **startup_gc.stats(),
                    **getattr(rounds.stage, "stats", dict)(),
                }
                self.conn.send(
                    Envelope(
                        kind=P.STATS,
                        sender=self.name,
                        round=env.round,
                        meta={"stats": {self.name: stats}},
                    )
                )
                return stats
            if env.kind != P.CALL:
                self.logger.warning("ignored unexpected %s message", quote(env.kind))
                continue
            # a replay, or a call from before a restart (a fused envelope: its first call)
            if first_round(env) <= self.last_round:
                self._refused(
                    env,
                    PolicyRefusal(
                        self.name,
                        "replay",
                        f"round {env.round} again (already at {self.last_round})",
                    ),
                    rounds,
                )
                continue
            try:
                reply = rounds.answer(env)
            except PolicyRefusal as exc:
                if exc.rule != "authentication":  # only the active party's rounds count
                    self.last_round = env.round
                self._refused(env, exc, rounds)
                continue
            self.last_round = env.round
            self.conn.send(reply)
            # sent; until the next call the sum stage may work ahead (CKKS: encryptions of zero)
            getattr(rounds.stage, "idle", lambda: None)()

    def _refused(self, env: Envelope, exc: PolicyRefusal, rounds: PartyRound) -> None:
        """Record a refusal (log, ledger); then stop, or tell the aggregator and keep serving."""
        self.logger.error("refused round %d: %s", env.round, exc)
        self.ledger.record_refusal(
            role=self.name, rule=exc.rule, detail=exc.detail, round=int(env.round)
        )
        if self.cfg.party(self.name).policy.on_refusal == "stop":
            raise exc
        self.conn.send(
            Envelope(
                kind=P.REFUSED,
                sender=self.name,
                session=self.conn.session_hex or "",
                round=env.round,
                meta={"rule": exc.rule, "reason": str(exc)},
            )
        )


def run_party(
    cfg: RunConfig,
    *,
    name: str,
    run_dir: Path,
    keys_dir: Path,
    data_path: Path,
    address: str,
    logger: logging.Logger,
    device: Any,
    table: Any = None,
    context: Any = None,
    scoring: bool = False,
    device_time: Any = None,
) -> int:
    from securevfl.data.table import load_party_table

    if table is None:
        encoding = saved_encoding(run_dir, name) if scoring else None
        # a large file streams into a row cache of this role's own in its run directory
        table = load_party_table(
            data_path, cfg, name, encoding=encoding, cache_dir=run_dir / "cache"
        )
    logger.info(
        "party %s (pid %d): %d rows, columns %s", name, os.getpid(), len(table), list(table.columns)
    )
    conn = RoleConnection.connect(
        cfg=cfg,
        name=name,
        keys_dir=keys_dir,
        address=address,
        logger=logger,
        nonce=pysecrets.token_hex(16),
        context=context,
    )
    try:
        PassiveParty(
            cfg=cfg,
            name=name,
            table=table,
            conn=conn,
            run_dir=run_dir,
            logger=logger,
            device=device,
            device_time=device_time,
            scoring=scoring,
        ).run()
        return P.EXIT_OK
    except P.RunAborted:
        raise
    except Exception as exc:
        report_failure(conn, exc)
        raise
    finally:
        conn.close()


def report_failure(conn: RoleConnection, exc: BaseException) -> None:
    """Tell the aggregator (and so everyone) that this role failed and why, best effort."""
    if isinstance(exc, KeyMaterialError):  # the hub refused this role's keys: it cannot hear us
        return
    try:
        conn.send(
            Envelope(
                kind=P.ERROR,
                sender=conn.name,
                session=conn.session_hex or "",
                meta={
                    "reason": f"{type(exc).__name__}: {exc}",
                    "role": conn.name,
                    "refused": isinstance(exc, PolicyRefusal),
                    "budget": isinstance(exc, BudgetExceeded),
                    "usage": exit_code_for(exc) == P.EXIT_USAGE,
                },
            )
        )
    except Exception as send_exc:  # the run is failing anyway; the log keeps both
        conn.logger.warning("could not report the failure to the aggregator: %s", send_exc)


def saved_encoding(run_dir: Path, role: str) -> dict | None:
    """The encoding of `role`'s text columns in its last checkpoint (a trained model)."""
    from securevfl.errors import CheckpointError
    from securevfl.roles.checkpoint import latest_epoch, load_checkpoint

    last = latest_epoch(run_dir, role)
    if last is None:
        raise CheckpointError(
            f"{run_dir} holds no checkpoint of {role!r}: train the model first (securevfl run)"
        )
    return load_checkpoint(run_dir, role, last).get("encoding")
