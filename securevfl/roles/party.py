"""The passive-party role: answers the active party's calls with protected contributions."""

from __future__ import annotations

import hmac
import logging
import os
import secrets as pysecrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.config import RunConfig
from securevfl.methods import SumSpec, method_spec
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.privacy.runtime import ReceivedGradients, RolePrivacy, plan_role
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import load_checkpoint, save_checkpoint
from securevfl.roles.connection import RoleConnection
from securevfl.secure_sum import SumSession, backend, ckks_context_tag
from transport import Envelope


def parse_sums(meta: Mapping[str, Any]) -> list[SumSpec]:
    return [SumSpec(key=k, tensor=t, group=tuple(g)) for k, t, g in meta.get("sums", [])]


class PassiveParty:
    """One passive party's loop. `run()` returns when the active party says bye."""

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
    ) -> None:
        self.cfg = cfg
        self.name = name
        self.conn = conn
        self.run_dir = run_dir
        self.logger = logger
        self.method = method_spec(cfg.method).party(
            name=name, table=table, config=cfg, device=device
        )
        self.stage = None
        self.last_round = -1
        # opened before the handshake, so before any role of the run records anything
        self.ledger = PrivacyLedger(run_dir / LEDGER_FILENAME)
        self.privacy: RolePrivacy | None = None
        self.received: ReceivedGradients | None = None
        self._single_sums: set[tuple[str, str, int]] = set()

    def run(self) -> dict[str, Any]:
        session = self.conn.handshake()
        while True:
            env = self.conn.recv(timeout=self.cfg.round_timeout, waiting_for="the next call")
            if env.kind == P.ABORT:
                raise P.RunAborted(env.meta.get("reason", "aborted"), lost=env.meta.get("lost"))
            if env.kind == P.BYE:
                if self.received is not None:
                    self.received.save()
                stats = self.conn.stats()
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
                self.logger.warning("ignored unexpected %r message", env.kind)
                continue
            if env.round <= self.last_round:
                self.logger.warning(
                    "ignored call for round %d (already at %d)", env.round, self.last_round
                )
                continue
            self.last_round = env.round
            tensors, shapes = self._answer(env, session)
            self.conn.send(
                Envelope(
                    kind=P.CONTRIB,
                    sender=self.name,
                    round=env.round,
                    tensors=tensors,
                    meta={"shapes": shapes},
                )
            )

    def _check_context_tag(self, context: bytes, tags: Mapping[str, str], session: bytes) -> None:
        active = self.cfg.active_name
        expected = ckks_context_tag(
            context=context,
            my_keypair=self.conn.secrets.mask,
            me=self.name,
            peer=active,
            peer_public=self.conn.public.mask[active],
            session=session,
        )
        if not hmac.compare_digest(bytes.fromhex(str(tags.get(self.name, ""))), expected):
            raise P.RunAborted(
                "the CKKS public context failed authentication: it was not sent by the active "
                f"party {active!r} (the aggregator or the network altered it); refusing to encrypt"
            )

    def _setup_privacy(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        """Resolve this party's DP (N is known now) and give the method its `RolePrivacy`."""
        # N = the training rows this party holds: DP-SGD's sample rate B/N (and delta < 1/N)
        # must not count rows the party never trains on
        held = int(np.count_nonzero(self.method.table.has(np.asarray(inputs["train_ids"]))))
        # a party holding none of them trains nothing; its method says so, naming the party
        plan = plan_role(self.cfg, role=self.name, n_train=held or len(inputs["train_ids"]))
        self.privacy = RolePrivacy(plan=plan, ledger=self.ledger)
        self.privacy.set_rows(inputs["all_ids"])
        self.method.privacy = self.privacy
        if self.cfg.record_received:
            self.received = ReceivedGradients(self.run_dir / "received" / f"{self.name}.npz")
        if self.cfg.aggregation == "plain" and plan.embedding_dp is None:
            self.privacy.record_unprotected_once(
                what="representations sent to sums",
                reason="aggregation = plain: the aggregator and the active party see each "
                "contribution in the clear",
            )

    def _record_single_sum(self, op: str, spec: SumSpec) -> None:
        """A secure sum with one contributor is that contribution: say so in the ledger, once
        per sum and epoch (only when embedding DP does not protect it)."""
        if self.cfg.aggregation == "plain" or self.privacy.plan.embedding_dp is not None:
            return
        seen = (op, spec.key, self.privacy.epoch)
        if seen in self._single_sums:
            return
        self._single_sums.add(seen)
        self.privacy.ledger.record_unprotected(
            role=self.name,
            what=f"sum {spec.key!r} of {op!r} with this party alone",
            reason="[run] min_group = 1: a sum with a single contributor is that party's "
            "contribution, revealed to the active party",
            epoch=self.privacy.epoch,
        )

    def _answer(self, env: Envelope, session: bytes) -> tuple[dict[str, np.ndarray], dict]:
        op = env.meta["op"]
        args = env.meta.get("args", {})
        inputs = {k: v for k, v in env.tensors.items() if k != "ids"}
        if op == P.OP_SETUP:
            self._setup_privacy(args=args, inputs=inputs)
            self.method.setup(args=args, inputs=inputs)
            ckks = inputs.get("ckks_context")
            if ckks is not None:
                self._check_context_tag(ckks.tobytes(), args.get("ckks_tags", {}), session)
            self.stage = backend(self.cfg.aggregation).party(
                SumSession(
                    name=self.name,
                    session=session,
                    min_group=self.cfg.min_group,
                    frac_bits=self.cfg.frac_bits,
                    bound=self.cfg.bound,
                    mask_keypair=self.conn.secrets.mask,
                    mask_publics=self.conn.public.mask,
                    ckks_public_context=None if ckks is None else ckks.tobytes(),
                )
            )
            resume_epoch = int(args.get("resume_epoch", -1))
            if resume_epoch >= 0:
                self.method.load_state_dict(load_checkpoint(self.run_dir, self.name, resume_epoch))
                self.logger.info("resumed from the checkpoint of epoch %d", resume_epoch)
            self.privacy.epoch = resume_epoch + 1
            # which of the active party's rows this party holds (what a PSI would tell it)
            present = self.method.table.has(inputs["all_ids"])
            return {f"present@{self.name}": present}, {}
        if op == P.OP_CHECKPOINT:
            epoch = int(args["epoch"])
            save_checkpoint(self.run_dir, self.name, epoch, self.method.state_dict())
            self.privacy.epoch = epoch + 1
            if self.received is not None:
                self.received.save()
            return {}, {}
        if self.stage is None:
            raise RuntimeError(f"call {op!r} before setup")
        if self.received is not None and op == "backward":
            self.received.add(inputs, ids=env.tensors["ids"], epoch=self.privacy.epoch)
        out = self.method.handle(op, ids=env.tensors["ids"], args=args, inputs=inputs)
        tensors: dict[str, np.ndarray] = {}
        shapes: dict[str, list[int]] = {}
        specs = [spec for spec in parse_sums(env.meta) if self.name in spec.group]
        for spec in specs:
            if spec.tensor not in out:
                raise RuntimeError(
                    f"method {self.cfg.method!r} did not produce tensor {spec.tensor!r} for {op!r}"
                )
        # embedding DP: once per call (the call's tensors clipped jointly per row), before
        # masking or encryption; a noised tensor then feeds every sum it is part of for free
        contributions = {
            t: np.asarray(out[t], dtype=np.float64) for t in dict.fromkeys(s.tensor for s in specs)
        }
        released = self.privacy.release_contributions(contributions, ids=env.tensors["ids"])
        for spec in specs:
            value = released[spec.tensor]
            if len(spec.group) == 1:
                self._record_single_sum(op, spec)
            tensors.update(
                self.stage.protect(value, round=env.round, group=spec.group, key=spec.key)
            )
            shapes[spec.key] = list(value.shape)
        for name in env.meta.get("collect", []):
            tensors[f"{name}@{self.name}"] = np.asarray(out[name])
        return tensors, shapes


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
) -> int:
    from securevfl.data.table import load_party_table

    if table is None:
        table = load_party_table(data_path, cfg, name)
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
    try:
        conn.send(
            Envelope(
                kind=P.ERROR,
                sender=conn.name,
                session=conn.session_hex or "",
                meta={"reason": f"{type(exc).__name__}: {exc}", "role": conn.name},
            )
        )
    except Exception as send_exc:  # the run is failing anyway; the log keeps both
        conn.logger.warning("could not report the failure to the aggregator: %s", send_exc)
