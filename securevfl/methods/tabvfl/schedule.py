"""The host's schedule shared by tabvfl and tabvfl-le: the validation carve, fixed batch
positions, the two phases with early stopping and best-epoch restore, and the evaluation (the
head's test metrics and the paper's latent evaluation).

The training rows are split (stratified, `valid_fraction`) into fit and validation rows; the fit
rows are put in one random order (seeded) and visited in that same order every epoch (the paper
disables shuffling), in fixed batch positions. Epochs count on across the two phases (one
checkpoint per epoch, resumable at any epoch). A phase ends after its most epochs, or
`patience` epochs without a lower validation reconstruction loss (pretraining) or a higher
validation weighted F1 (fine-tuning); with `restore_best` every party then returns to the
phase's best epoch.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from securevfl.lazy import torch
from securevfl.methods.base import ActiveContext, ActiveMethod, PartyDropped
from securevfl.methods.blocks.batches import count_incomplete
from securevfl.methods.blocks.nets import table_class_count
from securevfl.methods.tabvfl.evaluation import evaluate_latent
from securevfl.methods.tabvfl.party import tabnet_config
from securevfl.metrics import task_metrics

CHUNK = 4096  # rows per call when validating or encoding (eval mode: rows are independent)
PHASES = ("pretrain", "finetune")
NO_ROWS = np.empty(0, dtype=np.int64)


def carve_validation(
    ids: np.ndarray, labels: np.ndarray, *, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows in their fixed random order, validation rows sorted): a stratified share
    `fraction` of each class held out; deterministic for a seed. ``fraction = 0``: no
    validation rows."""
    rng = np.random.default_rng([seed, 0x7AB0])
    ids, labels = np.asarray(ids, dtype=np.int64), np.asarray(labels)
    valid = [
        rng.permutation(ids[labels == c])[: int(round(fraction * np.sum(labels == c)))]
        for c in np.unique(labels)
    ]
    held = np.sort(np.concatenate(valid)) if valid else NO_ROWS
    fit = ids[~np.isin(ids, held)]
    return rng.permutation(fit), held


def fixed_batches(order: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """Consecutive batches of `order`; a last batch of one row is dropped (batch norm cannot
    train on one row)."""
    out = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [b for b in out if len(b) >= 2]


def chunks(ids: np.ndarray) -> list[np.ndarray]:
    return [ids[i : i + CHUNK] for i in range(0, len(ids), CHUNK)]


class Schedule(ActiveMethod):
    """Phases, early stopping, validation and evaluation, shared by tabvfl and tabvfl-le.
    Subclasses provide the epochs, the validation scores and inference."""

    name = "tabvfl"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opts = self.config.options
        self.cfg = tabnet_config(self.opts)
        self.n_classes = max(2, table_class_count(self.config.task, self.table))
        self.phase = "pretrain" if self.opts.pretrain_epochs > 0 else "finetune"
        self.phase_epoch = 0
        self.best_score: float | None = None
        self.bad = 0
        self.best_host: dict[str, Any] | None = None
        self.tally: dict[str, Any] = {"epochs": {p: 0 for p in PHASES}, "best_epoch": {}}
        self.scalars = {p: {"up": 0, "down": 0, "rows": 0} for p in PHASES}
        self.order = self.valid_ids = NO_ROWS

    def _t(self, a: np.ndarray, *, grad: bool = False) -> Any:
        """A received array as a float32 tensor on the host's device."""
        return as_tensor(a, grad=grad, device=self.device)

    # ---- what subclasses provide

    def _train_epoch(self, ctx: ActiveContext, epoch: int) -> dict[str, float]:
        raise NotImplementedError

    def _valid_loss(self, ctx: ActiveContext) -> float:
        raise NotImplementedError

    def _infer(self, ctx: ActiveContext, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(logits, latent) of rows `ids`, eval mode."""
        raise NotImplementedError

    def _host_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_host(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError

    # ---- the schedule

    @property
    def progress_total(self) -> int:
        return self.opts.pretrain_epochs + self.config.epochs

    def _limit(self) -> int:
        return self.opts.pretrain_epochs if self.phase == "pretrain" else self.config.epochs

    def _prepare(self, ctx: ActiveContext, train_ids: np.ndarray) -> None:
        from securevfl.errors import DataError

        incomplete = count_incomplete(ctx, self.table, train_ids)
        if incomplete:  # bad input (every role ends 2), not an internal error
            raise DataError(
                f"{self.name} needs every training row at every guest, but {incomplete} rows "
                "are missing at some guest; give the label holder only the rows every guest "
                "holds (after `securevfl align`: those with a 1 in every column of "
                'presence.csv), or use a method that serves missing rows ("laser", "false-vfl")'
            )
        if getattr(self.table, "streamed", False):
            ctx.log(
                f"{self.name}: the host holds its {len(train_ids)} training rows' order and "
                "labels in memory (the validation carve and the fixed batches), and at "
                "evaluation the latent of every training and test row (the paper's latent "
                "evaluation trains classifiers on all of them); the guests stream their "
                "columns a batch at a time"
            )
        labels = self.table.label_rows(train_ids)
        fraction = self.opts.valid_fraction if self.opts.patience > 0 else 0.0
        self.order, self.valid_ids = carve_validation(
            train_ids, labels, fraction=fraction, seed=self.config.seed
        )
        self.train_rows = np.sort(np.asarray(train_ids, dtype=np.int64))
        self.batches = fixed_batches(self.order, self.config.batch_size)
        if not self.batches:
            raise DataError(
                f"{self.name}: fewer than 2 training rows to fit on; give it more rows (or a "
                "smaller [data] test_fraction)"
            )

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        self._prepare(ctx, train_ids)
        epoch = ctx.start_epoch
        while self.phase != "done":
            if self.phase_epoch >= self._limit():
                self._end_phase(ctx)
                continue
            started = time.perf_counter()
            stats = self._train_epoch(ctx, epoch)
            self.phase_epoch += 1
            self.tally["epochs"][self.phase] += 1
            stop = False
            if self.opts.patience > 0 and len(self.valid_ids):
                stop = self._early_stopping(ctx, stats)
            elapsed = time.perf_counter() - started
            stats["phase"] = float(PHASES.index(self.phase))
            stats["rows_per_s"] = len(self.order) / max(elapsed, 1e-9)
            if stop or self.phase_epoch >= self._limit():
                self._end_phase(ctx)
            for _ in range(len(self.config.party_names) + 1):
                try:
                    ctx.epoch_done(epoch, stats=stats)
                    break
                except PartyDropped:  # lost while checkpointing: the others commit again
                    continue
            epoch += 1

    def _early_stopping(self, ctx: ActiveContext, stats: dict[str, float]) -> bool:
        if self.phase == "pretrain":
            score = self._valid_loss(ctx)
            stats["valid_loss"] = score
            better = self.best_score is None or score < self.best_score
        else:
            logits, _ = self._infer(ctx, self.valid_ids)
            score = weighted_f1(self.table.label_rows(self.valid_ids), logits)
            stats["valid_f1"] = score
            better = self.best_score is None or score > self.best_score
        if better:
            self.best_score, self.bad = score, 0
            self.tally["best_epoch"][self.phase] = self.phase_epoch - 1
            if self.opts.restore_best:
                self.best_host = copy.deepcopy(self._host_state())
                self._call_all(ctx, "keep_best")
            return False
        self.bad += 1
        return self.bad >= self.opts.patience

    def _end_phase(self, ctx: ActiveContext) -> None:
        if self.best_host is not None:
            self._load_host(self.best_host)
            self._call_all(ctx, "restore_best")
        self.best_score, self.bad, self.best_host = None, 0, None
        self.phase = "finetune" if self.phase == "pretrain" else "done"
        self.phase_epoch = 0

    def _call_all(self, ctx: ActiveContext, op: str) -> None:
        while ctx.parties:
            try:
                ctx.call(op, ids=NO_ROWS, to=list(ctx.parties))
                return
            except PartyDropped as exc:
                if exc.delivered:
                    return

    # ---- evaluation

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        """The head's metrics on rows `ids` (task metrics and weighted F1), and the paper's
        latent evaluation (`latent_*`): the latents of every training and held-out row,
        re-split 70/30, the downstream classifiers' accuracy, weighted F1 and ROC-AUC."""
        ids = np.asarray(ids, dtype=np.int64)
        rest = getattr(self, "train_rows", NO_ROWS)
        every = np.concatenate([ids, rest[~np.isin(rest, ids)]])
        logits, z = self._infer(ctx, every)
        y = self.table.label_rows(every).astype(np.int64)
        head = logits[: len(ids)]
        output = head[:, 1] - head[:, 0] if self.config.task == "binary" else head
        out: dict[str, Any] = dict(
            task_metrics(self.config.task, y_true=y[: len(ids)], output=output)
        )
        if len(ids):
            out["weighted_f1"] = weighted_f1(y[: len(ids)], head)
        latent = evaluate_latent(
            z, y, seed=self.config.seed, classifiers=self.opts.latent_classifiers
        )
        out.update({f"latent_{k}": v for k, v in latent.items()})
        return out

    def summary(self) -> dict[str, Any]:
        per_row = {
            p: {
                "guests_to_host": s["up"] / s["rows"],
                "host_to_guests": s["down"] / s["rows"],
            }
            for p, s in self.scalars.items()
            if s["rows"]
        }
        return {
            self.name: {
                **self.tally,
                "fit_rows": int(len(self.order)),
                "valid_rows": int(len(self.valid_ids)),
                "scalars_per_row": per_row,
            }
        }

    def _count(self, phase: str, *, up: int = 0, down: int = 0, rows: int = 0) -> None:
        s = self.scalars[phase]
        s["up"], s["down"], s["rows"] = s["up"] + up, s["down"] + down, s["rows"] + rows

    # ---- checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "phase_epoch": self.phase_epoch,
            "best_score": self.best_score,
            "bad": self.bad,
            "best_host": self.best_host,
            "report": copy.deepcopy(self.tally),
            "scalars": copy.deepcopy(self.scalars),
            "host": self._host_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.phase, self.phase_epoch = str(state["phase"]), int(state["phase_epoch"])
        self.best_score, self.bad = state["best_score"], int(state["bad"])
        self.best_host = state["best_host"]
        self.tally = copy.deepcopy(dict(state["report"]))
        self.scalars = copy.deepcopy(dict(state["scalars"]))
        self._load_host(state["host"])


def weighted_f1(y: np.ndarray, logits: np.ndarray) -> float:
    from sklearn.metrics import f1_score

    pred = np.asarray(logits).argmax(axis=1)
    return float(
        f1_score(np.asarray(y).astype(np.int64), pred, average="weighted", zero_division=0)
    )


def as_tensor(a: np.ndarray, *, grad: bool = False, device: Any = None) -> Any:
    return torch.tensor(np.asarray(a, dtype=np.float32), device=device, requires_grad=grad)
