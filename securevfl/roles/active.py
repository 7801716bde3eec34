"""The active party's role: holds the labels, drives the method through secure sums, checkpoints
each epoch, and writes metrics.json."""

from __future__ import annotations

import json
import logging
import os
import secrets as pysecrets
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.config import RunConfig
from securevfl.data.table import ActiveTable, train_test_split
from securevfl.methods import PartyDropped, SumSpec, call_recipients, method_spec
from securevfl.privacy.audit import audit
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.privacy.run_audit import epsilon_summary, write_manifest
from securevfl.privacy.runtime import RolePrivacy, plan_role
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import latest_epoch, load_checkpoint, save_checkpoint
from securevfl.roles.connection import RoleConnection
from securevfl.roles.party import report_failure
from securevfl.secure_sum import SumSession, backend, ckks_context_tag
from transport import Envelope


class FederationContext:
    """`ActiveContext` over a connection to the aggregator."""

    # the active party's DP, ledger and budgets (set by `run_active` once N is known)
    privacy: RolePrivacy | None = None

    def __init__(
        self,
        *,
        cfg: RunConfig,
        conn: RoleConnection,
        session: bytes,
        run_dir: Path,
        method: Any,
        logger: logging.Logger,
        start_epoch: int,
        out: Any = sys.stdout,
    ) -> None:
        self.config = cfg
        self.conn = conn
        self.run_dir = run_dir
        self.method = method
        self.logger = logger
        self.start_epoch = start_epoch
        self.out = out
        self.round = 0
        self._parties = tuple(cfg.party_names)
        self.key_holder = None
        ckks_context = None
        if cfg.aggregation == "ckks":
            from crypto.ckks import CkksKeyHolder, CkksParams

            self.key_holder = CkksKeyHolder(
                params=CkksParams(
                    poly_modulus_degree=cfg.ckks.poly_modulus_degree,
                    coeff_mod_bit_sizes=cfg.ckks.coeff_mod_bit_sizes,
                    scale_bits=cfg.ckks.scale_bits,
                )
            )
            ckks_context = self.key_holder.public_context_bytes()
        self.ckks_context = ckks_context
        sum_session = SumSession(
            name=cfg.active_name,
            session=session,
            min_group=cfg.min_group,
            frac_bits=cfg.frac_bits,
            bound=cfg.bound,
        )
        stage_cls = backend(cfg.aggregation).active
        if cfg.aggregation == "ckks":
            self.stage = stage_cls(sum_session, key_holder=self.key_holder)
        else:
            self.stage = stage_cls(sum_session)
        self.lost: list[str] = []
        self.epoch_seconds: list[float] = []
        self.history: list[dict[str, float]] = []
        self._epoch_started = time.perf_counter()

    @property
    def parties(self) -> tuple[str, ...]:
        return self._parties

    def log(self, message: str) -> None:
        self.logger.info("%s", message)

    def call(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        sums: Sequence[SumSpec] = (),
        to: Sequence[str] | None = None,
        collect: Sequence[str] = (),
    ) -> dict[str, np.ndarray]:
        to = call_recipients(self.config, op, sums, to, self._parties)
        self.round += 1
        tensors = {"ids": np.asarray(ids, dtype=np.int64), **dict(inputs or {})}
        self.conn.send(
            Envelope(
                kind=P.CALL,
                sender=self.config.active_name,
                session=self.conn.session_hex or "",
                round=self.round,
                tensors=tensors,
                meta={
                    "op": op,
                    "args": dict(args or {}),
                    "to": list(to),
                    "sums": [[s.key, s.tensor, list(s.group)] for s in sums],
                    "collect": list(collect),
                },
            )
        )
        while True:
            env = self.conn.recv(
                timeout=self.config.round_timeout + self.config.peer_timeout,
                waiting_for=f"the result of round {self.round} ({op})",
            )
            if env.kind == P.RESULT and env.round == self.round:
                break
            self.logger.warning(
                "dropped %r for round %d while waiting for round %d",
                env.kind,
                env.round,
                self.round,
            )
        lost = [p for p in env.meta.get("lost", []) if p in self._parties]
        if env.meta.get("lost"):
            self._parties = tuple(p for p in self._parties if p not in lost)
            self.lost.extend(lost)
            self.logger.warning(
                "party %s was lost during round %d (%s); continuing with %s",
                lost,
                self.round,
                op,
                list(self._parties),
            )
            print(
                f"party {', '.join(lost)} lost; continuing with {', '.join(self._parties)}",
                file=self.out,
                flush=True,
            )
            raise PartyDropped(
                lost[0] if lost else str(env.meta["lost"][0]),
                delivered=bool(env.meta.get("delivered", False)),
            )
        shapes = env.meta.get("shapes", {})
        out = {}
        for spec in sums:
            arrays = {
                k: v
                for k, v in env.tensors.items()
                if k == spec.key or k.startswith(spec.key + "/")
            }
            out[spec.key] = self.stage.reveal(
                arrays, group=spec.group, key=spec.key, shape=tuple(shapes[spec.key])
            )
        for name in collect:
            for party in to:
                out[f"{name}@{party}"] = env.tensors[f"{name}@{party}"]
        return out

    def presence(self, ids: np.ndarray) -> np.ndarray:
        return self._presence[self.method.table.positions(ids)]

    def set_presence(self, held: Mapping[str, np.ndarray]) -> None:
        n = len(self.method.table.ids)
        for party, flags in held.items():
            if flags.dtype != np.bool_ or flags.shape != (n,):
                raise P.RunAborted(
                    f"{party} answered set-up with a malformed row-presence vector "
                    f"({flags.dtype}, shape {flags.shape}; expected bool of shape ({n},))",
                    lost=party,
                )
        self._presence = np.stack(
            [np.asarray(held[p], dtype=bool) for p in self.config.party_names], axis=1
        )

    def release_gradients(
        self, grads: Mapping[str, np.ndarray], *, epoch: int, ids: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """Label DP on per-sample gradient rows about to leave: each row clipped jointly over
        every entry of ``grads`` and noised, after the budget check and the ledger event.
        ``ids`` (the rows' sample ids) makes the per-row use count exact; without them every
        N rows released in an epoch count as one use of every row."""
        arrays = {k: np.asarray(v, dtype=np.float32) for k, v in grads.items()}
        if self.privacy is None or not arrays:
            return arrays
        return self.privacy.release_gradients(arrays, ids=ids, epoch=epoch)

    def epoch_done(self, epoch: int, *, stats: Mapping[str, float]) -> None:
        self.epoch_seconds.append(time.perf_counter() - self._epoch_started)
        self.history.append({"epoch": epoch, **{k: float(v) for k, v in stats.items()}})
        # commit point: every party has saved epoch `epoch` before the active party does
        self.call(
            P.OP_CHECKPOINT,
            ids=np.empty(0, dtype=np.int64),
            args={"epoch": epoch},
            to=self._parties,
        )
        save_checkpoint(
            self.run_dir,
            self.config.active_name,
            epoch,
            {
                "method": self.method.state_dict(),
                "epoch_seconds": list(self.epoch_seconds),
                "history": [dict(h) for h in self.history],
                "round": self.round,
            },
        )
        parts = "  ".join(f"{k} {v:.4g}" for k, v in stats.items())
        total = self.method.progress_total  # ActiveMethod: epochs, or None (EM iterations)
        step = f"{self.method.progress_unit} {epoch + 1}" + (f"/{total}" if total else "")
        line = f"{step}  {parts}  ({self.epoch_seconds[-1]:.2f} s)"
        if self.privacy is not None and self.privacy.plan.mechanisms:
            spent = ", ".join(f"{m} {e:.3g}" for m, e in self.privacy.spent().items())
            line += f"  epsilon spent: {spent} (delta {self.privacy.delta:g})"
        print(line, file=self.out, flush=True)
        self.logger.info("%s", line)
        self._epoch_started = time.perf_counter()


def run_active(
    cfg: RunConfig,
    *,
    run_dir: Path,
    keys_dir: Path,
    data_path: Path,
    address: str,
    logger: logging.Logger,
    device: Any,
    resume: bool = False,
    table: ActiveTable | None = None,
    context: Any = None,
    out: Any = sys.stdout,
) -> int:
    from securevfl.data.table import load_active_table

    started = time.perf_counter()
    if table is None:
        table = load_active_table(data_path, cfg)
    spec = method_spec(cfg.method)
    method = spec.active(table=table, config=cfg, device=device)
    train_ids, test_ids = train_test_split(
        table.ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=table.labels,
        stratify=cfg.task != "regression",
    )
    start_epoch = 0
    saved: dict[str, Any] | None = None
    if resume:
        last = latest_epoch(run_dir, cfg.active_name)
        if last is None:
            logger.warning("--resume: no checkpoint yet, starting from epoch 1")
        else:
            saved = load_checkpoint(run_dir, cfg.active_name, last)
            method.load_state_dict(saved["method"])
            start_epoch = last + 1
            print(f"resuming after epoch {last + 1}", file=out, flush=True)
    # opened before the handshake, so before any role of the run records anything
    ledger = PrivacyLedger(run_dir / LEDGER_FILENAME)
    conn = RoleConnection.connect(
        cfg=cfg,
        name=cfg.active_name,
        keys_dir=keys_dir,
        address=address,
        logger=logger,
        nonce=pysecrets.token_hex(16),
        context=context,
    )
    try:
        session = conn.handshake()
        ctx = FederationContext(
            cfg=cfg,
            conn=conn,
            session=session,
            run_dir=run_dir,
            method=method,
            logger=logger,
            start_epoch=start_epoch,
            out=out,
        )
        # N is the training set the parties are told of at set-up: every role derives the same
        # delta from it (a bad delta or budget is a ConfigError: exit status 2)
        ctx.privacy = RolePrivacy(
            plan=plan_role(cfg, role=cfg.active_name, n_train=len(train_ids)), ledger=ledger
        )
        ctx.privacy.set_rows(table.ids)
        method.privacy = ctx.privacy
        write_manifest(
            run_dir,
            active=cfg.active_name,
            id_column=cfg.id_column,
            label=cfg.label,
            task=cfg.task,
            delta=ctx.privacy.delta,
            accountant=cfg.accountant,
            n_train=int(len(train_ids)),
            parties=list(cfg.party_names),
        )
        if saved is not None:
            ctx.epoch_seconds = list(saved.get("epoch_seconds", []))
            ctx.history = list(saved.get("history", []))
        setup_inputs: dict[str, np.ndarray] = {"train_ids": train_ids, "all_ids": table.ids}
        setup_args: dict[str, Any] = {"resume_epoch": start_epoch - 1}
        if ctx.ckks_context is not None:
            setup_inputs["ckks_context"] = np.frombuffer(ctx.ckks_context, dtype=np.uint8)
            setup_args["ckks_tags"] = {
                p: ckks_context_tag(
                    context=ctx.ckks_context,
                    my_keypair=conn.secrets.mask,
                    me=cfg.active_name,
                    peer=p,
                    peer_public=conn.public.mask[p],
                    session=session,
                ).hex()
                for p in ctx.parties
            }
        held = ctx.call(
            P.OP_SETUP,
            ids=np.empty(0, dtype=np.int64),
            args=setup_args,
            inputs=setup_inputs,
            to=ctx.parties,
            collect=["present"],
        )
        ctx.set_presence({p: held[f"present@{p}"] for p in ctx.parties})
        anyone = ctx.presence(table.ids).any(axis=1)
        if not anyone.all():
            logger.info(
                "%d rows are held by no passive party and are dropped", int((~anyone).sum())
            )
            train_ids = train_ids[ctx.presence(train_ids).any(axis=1)]
            test_ids = test_ids[ctx.presence(test_ids).any(axis=1)]
        ctx._epoch_started = time.perf_counter()
        method.fit(ctx, train_ids=train_ids)
        test = method.evaluate(ctx, ids=test_ids) if len(test_ids) else {}
        ctx.round += 1
        conn.send(
            Envelope(
                kind=P.BYE, sender=cfg.active_name, session=conn.session_hex or "", round=ctx.round
            )
        )
        stats_env = conn.recv(timeout=cfg.round_timeout, waiting_for="the roles' final stats")
        roles = dict(stats_env.meta.get("stats", {}))
        roles[cfg.active_name] = conn.stats()
        metrics = {
            "method": cfg.method,
            "aggregation": cfg.aggregation,
            "seed": cfg.seed,
            "task": cfg.task,
            "n_train": int(len(train_ids)),
            "n_test": int(len(test_ids)),
            "test": test,
            "history": ctx.history,
            "epoch_seconds": ctx.epoch_seconds,
            "wall_seconds": time.perf_counter() - started,
            "rounds": ctx.round,
            "lost_parties": ctx.lost,
            "roles": roles,
            "privacy": epsilon_summary(audit(run_dir / LEDGER_FILENAME, accountant=cfg.accountant)),
            **method.summary(),
        }
        write_metrics(run_dir, metrics)
        method.report(run_dir, out)
        shown = "  ".join(f"{k} {v:.4f}" for k, v in test.items() if isinstance(v, float))
        print(f"test: {shown}", file=out, flush=True)
        logger.info("finished; test metrics %s", test)
        return P.EXIT_OK
    except P.RunAborted:
        raise
    except Exception as exc:
        report_failure(conn, exc)
        raise
    finally:
        conn.close()


def write_metrics(run_dir: Path, metrics: Mapping[str, Any]) -> Path:
    path = Path(run_dir) / "metrics.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(metrics, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
