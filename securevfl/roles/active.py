"""The active party's role: holds the labels, drives the method through secure sums, checkpoints
each epoch, and writes metrics.json."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets as pysecrets
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from securevfl import startup_gc
from securevfl.config import RunConfig
from securevfl.data.table import ActiveTable, stratified, train_test_split
from securevfl.keys import AGGREGATOR
from securevfl.methods import method_spec
from securevfl.privacy.audit import audit
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.privacy.run_audit import epsilon_summary, write_manifest
from securevfl.roles import protocol as P
from securevfl.roles.active_round import ActiveRound, train_and_evaluate
from securevfl.roles.aggregator import aggregator_link
from securevfl.roles.checkpoint import latest_epoch, load_checkpoint
from securevfl.roles.connection import RoleConnection
from securevfl.roles.party import report_failure
from transport import Envelope


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
        table = load_active_table(data_path, cfg, cache_dir=run_dir / "cache")
    spec = method_spec(cfg.method)
    train_ids, test_ids = split_table(table, cfg)
    table.prepare(train_ids)  # its own text columns, encoded on its training rows
    method = spec.active_class()(table=table, config=cfg, device=device)
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
    with (
        aggregator_link(
            cfg, keys_dir=keys_dir, address=address, run_dir=run_dir, context=context
        ) as (address, context),
        _active_session(
            cfg, keys_dir, address, logger, context, method, run_dir, start_epoch, out
        ) as (conn, ctx),
    ):
        # N is the training set the parties are told of at set-up: every role derives the same
        # delta from it (a bad delta or budget is a ConfigError: exit status 2)
        ctx.start(train_ids=train_ids, ledger=ledger)
        if cfg.presence_path is not None:
            ctx.shared = load_presence(cfg.presence_path, table, cfg.party_names)
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
        train_ids, test_ids, test = train_and_evaluate(ctx, train_ids=train_ids, test_ids=test_ids)
        stats_env = _bye(conn, ctx, cfg)
        roles = relayed_stats(stats_env.meta, roles=(*cfg.party_names, AGGREGATOR), logger=logger)
        roles[cfg.active_name] = {
            **conn.stats(),
            "auth_seconds": round(ctx.auth_seconds, 6),
            **startup_gc.stats(),
        }
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
        if shown:  # a method whose output is its report (VFEM's coefficients) has no test metrics
            print(f"test: {shown}", file=out, flush=True)
        logger.info("finished; test metrics %s", test)
        return P.EXIT_OK


def split_table(table: ActiveTable, cfg: RunConfig) -> tuple[np.ndarray, np.ndarray]:
    """The run's train/test split of the active party's rows (sorted ids): of a streamed table,
    the same split in files of its row cache (`securevfl.data.rowarrays.split_ids`)."""
    if table.streamed:
        from securevfl.data.rowarrays import split_ids

        return split_ids(
            table, test_fraction=cfg.test_fraction, seed=cfg.seed, stratify=stratified(cfg)
        )
    return train_test_split(
        table.ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=table.labels,
        stratify=stratified(cfg),
    )


@contextlib.contextmanager
def _active_session(
    cfg: RunConfig,
    keys_dir: Path,
    address: str,
    logger: logging.Logger,
    context: Any,
    method: Any,
    run_dir: Path,
    start_epoch: int,
    out: Any,
) -> Iterator[tuple[RoleConnection, ActiveRound]]:
    """Connect to the aggregator, join the session and build the active stage; a failure
    inside is reported to the aggregator (so every role stops with its cause), and the
    connection is closed on the way out."""
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
        ctx = ActiveRound(
            cfg=cfg,
            exchange=zmq_exchange(conn, cfg, logger),
            session=session,
            method=method,
            run_dir=run_dir,
            logger=logger,
            start_epoch=start_epoch,
            out=out,
            mask_keypair=conn.secrets.mask,
            mask_publics=conn.public.mask,
        )
        yield conn, ctx
    except P.RunAborted:
        raise
    except Exception as exc:
        report_failure(conn, exc)
        raise
    finally:
        conn.close()


def _bye(conn: RoleConnection, ctx: ActiveRound, cfg: RunConfig) -> Envelope:
    """End the session: BYE to the aggregator, then its final stats of every role."""
    ctx.round += 1
    conn.send(
        Envelope(
            kind=P.BYE, sender=cfg.active_name, session=conn.session_hex or "", round=ctx.round
        )
    )
    return conn.recv(timeout=cfg.round_timeout, waiting_for="the roles' final stats")


def relayed_stats(meta: Any, *, roles: Sequence[str], logger: logging.Logger) -> dict[str, Any]:
    """The roles' end-of-run stats as the aggregator relays them, kept for metrics.json only
    where they are plain JSON data within the bounds a party's own are held to
    (`protocol.plain_stats_fields`), and only for `roles` (the federation's parties and the
    aggregator): a modified aggregator cannot break the run's metrics.json with them. What is
    dropped is logged once, naming the role and the field."""
    stats = meta.get("stats") if isinstance(meta, dict) else None
    if type(stats) is not dict:
        if stats is not None:
            logger.warning("the aggregator's final stats are not a mapping; none are kept")
        return {}
    kept: dict[str, Any] = {}
    for role in roles:
        if role not in stats:
            continue
        kept[role], problems = P.plain_stats_fields(stats[role])
        if problems:
            logger.warning(
                "dropped from the stats the aggregator relayed for %s: %s (%s)",
                role,
                "; ".join(problems),
                P.STATS_RULE,
            )
    return kept


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


def zmq_exchange(conn: RoleConnection, cfg: RunConfig, logger: logging.Logger) -> Any:
    """Send call envelopes to the aggregator and receive the result of each round (several may
    be in flight: `RoundExchange`; what else arrives meanwhile is logged and dropped)."""
    from securevfl.roles.connection import RoundExchange

    return RoundExchange(conn, cfg, logger)


def run_active_scoring(
    cfg: RunConfig,
    *,
    run_dir: Path,
    keys_dir: Path,
    data_path: Path,
    predictions: Path,
    address: str,
    logger: logging.Logger,
    device: Any,
    context: Any = None,
    out: Any = sys.stdout,
) -> int:
    """A trained model (the last checkpoints in `run_dir`) scores the rows of `data_path`:
    writes `predictions` (id, output) and, when the file has labels, prints the metrics."""
    from securevfl.data.table import load_active_table
    from securevfl.errors import CheckpointError
    from securevfl.roles.active_round import score

    last = latest_epoch(run_dir, cfg.active_name)
    if last is None:
        raise CheckpointError(f"{run_dir} holds no trained model of {cfg.active_name!r}")
    saved = load_checkpoint(run_dir, cfg.active_name, last)
    table = load_active_table(data_path, cfg, encoding=saved.get("encoding"), scoring=True)
    table.use_encoding(saved.get("encoding"))
    method = method_spec(cfg.method).active_class()(table=table, config=cfg, device=device)
    method.load_state_dict(saved["method"])
    ledger = PrivacyLedger(run_dir / LEDGER_FILENAME)
    with (
        aggregator_link(
            cfg, keys_dir=keys_dir, address=address, run_dir=run_dir, context=context
        ) as (address, context),
        _active_session(
            cfg, keys_dir, address, logger, context, method, run_dir, last + 1, out
        ) as (conn, ctx),
    ):
        ctx.start(train_ids=table.ids, ledger=ledger)
        ids, outputs = score(ctx)
        write_predictions(predictions, table, ids, outputs)
        metrics = scored_metrics(cfg.task, table, ids, outputs)
        if metrics is not None:
            print("scored: " + "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=out)
        print(f"wrote {len(ids)} predictions to {predictions}", file=out, flush=True)
        _bye(conn, ctx, cfg)
        return P.EXIT_OK


def write_predictions(path: Path, table: Any, ids: np.ndarray, outputs: np.ndarray) -> Path:
    """id (as written in the data) and the model's output(s), one row each: one column `output`
    where a row has one value (a binary logit, a regression value, a voted class), else
    `output_0` .. `output_{C-1}` (a multiclass model's logits)."""
    import csv

    outputs = np.asarray(outputs)
    width = 1 if outputs.ndim == 1 else int(np.prod(outputs.shape[1:]))
    cols = ["output"] if width == 1 else [f"output_{j}" for j in range(width)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    outputs = outputs.reshape(len(ids), -1)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", *cols])
        for start in range(0, len(ids), SCORE_CHUNK):  # the ids' texts a chunk at a time
            block = ids[start : start + SCORE_CHUNK]
            rows = outputs[start : start + len(block)]
            for text, row in zip(table.texts(block), rows, strict=True):
                w.writerow([text, *(repr(float(v)) for v in row)])
    return path


SCORE_CHUNK = 4096  # rows whose id texts and labels are read at once when scoring


def scored_metrics(
    task: str, table: Any, ids: np.ndarray, outputs: np.ndarray
) -> dict[str, float] | None:
    """`prediction_metrics` of the scored rows when every one has a label (None otherwise),
    the labels read a chunk at a time: classes (the block methods) counted, raw outputs
    accumulated (`OutputScores`: for ROC-AUC, one score a row, no array of every label)."""
    from securevfl.methods.blocks.evaluation import OutputScores

    outputs = np.asarray(outputs)
    classes = outputs.dtype.kind in "iu"
    scores = None if classes else OutputScores(task)
    right = 0
    for start in range(0, len(ids), SCORE_CHUNK):
        labels = table.label_rows(ids[start : start + SCORE_CHUNK])
        if np.isnan(labels).any():
            return None
        if scores is not None:
            scores.add(labels, outputs[start : start + len(labels)])
        else:
            right += int((outputs[start : start + len(labels)] == labels).sum())
    if scores is not None:
        return scores.metrics()
    return {"accuracy": right / len(ids) if len(ids) else float("nan")}


def prediction_metrics(task: str, labels: np.ndarray, outputs: np.ndarray) -> dict[str, float]:
    """Held-out metrics of scored rows: from raw outputs, or accuracy of predicted classes."""
    from securevfl.metrics import task_metrics

    outputs = np.asarray(outputs)
    if outputs.dtype.kind in "iu":  # classes (the block methods)
        return {"accuracy": float(np.mean(outputs == labels))}
    return task_metrics(task, y_true=labels, output=outputs)


def load_presence(path: Path, table: Any, parties: Sequence[str]) -> dict[str, np.ndarray]:
    """`securevfl align`'s presence.csv: party -> bool over the active table's ids (a streamed
    table: read a part at a time into files of its row cache)."""
    import csv

    if getattr(table, "streamed", False):
        from securevfl.roles.setup_rows import load_presence_in_parts

        return load_presence_in_parts(path, table, parties)

    from securevfl.data.columns import row_ids
    from securevfl.errors import DataError

    with Path(path).open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    missing = [p for p in parties if rows and p not in rows[0]]
    if not rows or missing:
        raise DataError(f"{path}: no alignment for parties {missing or list(parties)}")
    ids = row_ids([r["id"] for r in rows], where=str(path))
    out = {p: np.zeros(len(table.ids), dtype=bool) for p in parties}
    known = table.has(ids)
    positions = table.positions(ids[known])
    for p in parties:
        flags = np.array([r[p] == "1" for r in rows], dtype=bool)[known]
        out[p][positions] = flags
    return out
