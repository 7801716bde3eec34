"""Baselines for missing blocks (LASER-VFL paper, §5 and App. D): local, standard-vfl, ensemble,
combinatorial, plugvfl.

They share LASER's plumbing (`securevfl.methods.laser`): the same representation models at the
parties, pattern-homogeneous batches, the `[method]` options and the metrics (accuracy averaged
over a row's predictors; F1 averaged over predictors). What each needs from the secure sum:

* ``local`` and ``ensemble`` train one model per party on its block alone: every sum is over one
  party, which the secure modes refuse (config validation says so unless `min_group = 1`).
* ``standard-vfl`` sums every block's representation (mean fusion, one head) and trains on
  complete rows only; a row missing a block gets a random class at test time, as in the paper.
* ``combinatorial`` has an independent model per subset of blocks (its own copies of f_k and its
  own head); a batch trains every subset of its present blocks, a test row uses the model of its
  exact present set. Subsets with fewer than `min_group` passive parties are skipped in secure
  modes (their rows get a random class at test time).
* ``plugvfl`` concatenates representations with zeros for missing blocks, which is a sum once the
  head's first (linear) layer is split into one block per party and moved into that party (App.
  A.2): each party's model ends in a bias-free linear layer. The last block is the "active party"
  of PlugVFL (option ``anchor``): batches without it are skipped, and test rows without it are
  left out of the metrics, as in the paper's code. Optional party-wise dropout (``p_drop``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations
from typing import Any

import numpy as np
import torch
from torch import nn

from securevfl.config import ConfigError, RunConfig
from securevfl.methods.base import ActiveContext, MethodSpec, register_method
from securevfl.methods.laser import (
    CLASSIFICATION,
    EVAL_BATCH,
    BlockActive,
    BlockParty,
    Prediction,
    _opt_number,
    block_names,
    differencing_matters,
    option_checks,
    subset_code,
)
from securevfl.methods.nn import derived_seed, mlp, task_loss, torch_generator


def _batched(ids: np.ndarray) -> list[np.ndarray]:
    return [ids[i : i + EVAL_BATCH] for i in range(0, len(ids), EVAL_BATCH)]


def _single_party_sums(method: str):
    def check(cfg: RunConfig) -> None:
        if cfg.aggregation != "plain" and cfg.min_group > 1:
            raise ConfigError(
                "[run] aggregation",
                f"method {method!r} trains each party's model on its block alone, so every sum "
                f"it needs is over one party, which {cfg.aggregation!r} refuses (a sum over one "
                'party is that party\'s representation); use aggregation = "plain", or set '
                "[run] min_group = 1 to accept unprotected sums explicitly",
            )

    return check


# --------------------------------------------------------------------------------------------
# Local and Ensemble


class LocalActive(BlockActive):
    """One head per block over that block's representation alone; each present block's model
    predicts (accuracy and F1 averaged over them)."""

    method_name = "local"

    def trainable(self, present: tuple[str, ...]) -> bool:
        return any(self.sum_allowed((k,)) for k in present)

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        subsets = [(k,) for k in present if self.sum_allowed((k,))]
        if not subsets:
            return None, len(present)
        sums, leaves = self.forward_sums(ctx, ids, subsets, train=True, epoch=epoch)
        y = self.labels_tensor(ids)
        loss = sum(task_loss(self.loss_task, self.heads[s[0]](sums[s]), y) for s in subsets)
        self.update(ctx, ids, leaves, loss, epoch=epoch)
        return float(loss.detach()), len(present) - len(subsets)

    def local_classes(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> tuple[dict[str, np.ndarray], bool]:
        allowed = [(k,) for k in present if self.sum_allowed((k,))]
        classes: dict[str, list[np.ndarray]] = {s[0]: [] for s in allowed}
        for chunk in _batched(ids) if allowed else []:
            sums, _ = self.forward_sums(ctx, chunk, allowed, train=False)
            for s in allowed:
                classes[s[0]].append(self.classes_of(self.heads[s[0]](sums[s])))
        out = {k: np.concatenate(v) for k, v in classes.items()}
        fallback = len(allowed) < len(present)
        for k in present:
            if k not in out:
                out[k] = self.random_classes(len(ids), (k,))
        return out, fallback

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        classes, fallback = self.local_classes(ctx, ids, present)
        return Prediction(classes, fallback=fallback)


class EnsembleActive(LocalActive):
    """Local models; at test time the present blocks' models vote (ties broken at random)."""

    method_name = "ensemble"

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        classes, fallback = self.local_classes(ctx, ids, present)
        votes = np.zeros((len(ids), self.n_classes))
        for c in classes.values():
            votes[np.arange(len(ids)), c] += 1
        rng = np.random.default_rng(
            [self.config.seed, 0x707E, subset_code(present, self.blocks), len(ids)]
        )
        top = votes == votes.max(axis=1, keepdims=True)
        noise = rng.random(votes.shape)
        joint = np.where(top, noise, -1.0).argmax(axis=1)
        return Prediction({"joint": joint}, fallback=fallback)


# --------------------------------------------------------------------------------------------
# Standard VFL


class JointHeadActive(BlockActive):
    """One head over the fusion of the present blocks (`fuse`), for the methods with a single
    joint predictor (Standard VFL, PlugVFL)."""

    def build_heads(self) -> None:
        cfg = self.config
        self.heads = nn.ModuleDict(
            {
                "joint": mlp(
                    cfg.width,
                    cfg.head_hidden,
                    self.out_dim,
                    seed=derived_seed(cfg.seed, self.method_name, "head"),
                )
            }
        ).to(self.device)

    def fuse(self, total: torch.Tensor, subset: tuple[str, ...]) -> torch.Tensor:
        """The head's input from the sum over `subset`."""
        raise NotImplementedError

    def joint_step(
        self, ctx: ActiveContext, ids: np.ndarray, subset: tuple[str, ...], *, epoch: int
    ) -> float:
        """One update of the head and the parties in `subset` on rows `ids`; returns the loss."""
        sums, leaves = self.forward_sums(ctx, ids, [subset], train=True, epoch=epoch)
        out = self.heads["joint"](self.fuse(sums[subset], subset))
        loss = task_loss(self.loss_task, out, self.labels_tensor(ids))
        self.update(ctx, ids, leaves, loss, epoch=epoch)
        return float(loss.detach())

    def joint_prediction(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        parts = []
        for chunk in _batched(ids):
            sums, _ = self.forward_sums(ctx, chunk, [present], train=False)
            parts.append(self.classes_of(self.heads["joint"](self.fuse(sums[present], present))))
        return Prediction({"joint": np.concatenate(parts)})


class StandardVFLActive(JointHeadActive):
    """Split-NN with mean fusion and one head, trained on complete rows only; a test row missing
    a block gets a random class."""

    method_name = "standard-vfl"

    def fuse(self, total: torch.Tensor, subset: tuple[str, ...]) -> torch.Tensor:
        return total / len(subset)  # mean fusion

    def complete(self, present: tuple[str, ...]) -> bool:
        return len(present) == len(self.blocks)

    def trainable(self, present: tuple[str, ...]) -> bool:
        return self.complete(present)

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        if not self.sum_allowed(present):
            return None, 1
        return self.joint_step(ctx, ids, present, epoch=epoch), 0

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        if not self.complete(present) or not self.sum_allowed(present):
            return Prediction({"joint": self.random_classes(len(ids), present)}, fallback=True)
        return self.joint_prediction(ctx, ids, present)


# --------------------------------------------------------------------------------------------
# Combinatorial


def _nonempty_subsets(blocks: Sequence[str]) -> list[tuple[str, ...]]:
    return [s for size in range(1, len(blocks) + 1) for s in combinations(blocks, size)]


class CombinatorialParty(BlockParty):
    """One representation model per subset of blocks that contains this party."""

    method_name = "combinatorial"

    def model_names(self) -> list[str]:
        blocks = block_names(self.config)
        return [
            f"rep_{subset_code(s, blocks)}" for s in _nonempty_subsets(blocks) if self.name in s
        ]


class CombinatorialActive(BlockActive):
    """An independent predictor (own f_k copies, own head) per nonempty subset of blocks."""

    method_name = "combinatorial"

    def build_heads(self) -> None:
        cfg = self.config
        self.heads = nn.ModuleDict(
            {
                str(subset_code(s, self.blocks)): mlp(
                    cfg.width,
                    cfg.head_hidden,
                    self.out_dim,
                    seed=derived_seed(
                        cfg.seed, self.method_name, "head", subset_code(s, self.blocks)
                    ),
                )
                for s in _nonempty_subsets(self.blocks)
            }
        ).to(self.device)

    def own_model_names(self) -> list[str]:
        return [
            f"rep_{subset_code(s, self.blocks)}"
            for s in _nonempty_subsets(self.blocks)
            if self.own_name in s
        ]

    def tensor_of(self, subset: tuple[str, ...]) -> str:
        return f"rep_{subset_code(subset, self.blocks)}"

    def head_of(self, subset: tuple[str, ...]) -> nn.Module:
        return self.heads[str(subset_code(subset, self.blocks))]

    def trainable(self, present: tuple[str, ...]) -> bool:
        return any(self.sum_allowed(s) for s in _nonempty_subsets(present))

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        every = _nonempty_subsets(present)
        subsets = [s for s in every if self.sum_allowed(s)]
        if not subsets:
            return None, len(every)
        sums, leaves = self.forward_sums(ctx, ids, subsets, train=True, epoch=epoch)
        y = self.labels_tensor(ids)
        loss = sum(task_loss(self.loss_task, self.head_of(s)(sums[s] / len(s)), y) for s in subsets)
        self.update(ctx, ids, leaves, loss, epoch=epoch)
        return float(loss.detach()), len(every) - len(subsets)

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        if not self.sum_allowed(present):
            return Prediction({"joint": self.random_classes(len(ids), present)}, fallback=True)
        parts = []
        for chunk in _batched(ids):
            sums, _ = self.forward_sums(ctx, chunk, [present], train=False)
            parts.append(self.classes_of(self.head_of(present)(sums[present] / len(present))))
        return Prediction({"joint": np.concatenate(parts)})


# --------------------------------------------------------------------------------------------
# PlugVFL


class PlugVFLParty(BlockParty):
    """f_k followed by this party's block of the concatenation head's first layer."""

    method_name = "plugvfl"

    def build_model(self, model: str) -> nn.Module:
        cfg = self.config
        seed = derived_seed(cfg.seed, self.method_name, model, self.name)
        return _plug_model(len(self.table.columns), cfg, seed)


def _plug_model(in_dim: int, cfg: RunConfig, seed: int) -> nn.Module:
    linear = nn.Linear(cfg.width, cfg.width, bias=False)
    bound = 1.0 / math.sqrt(cfg.width)  # torch's default init for a Linear layer
    with torch.no_grad():
        linear.weight.uniform_(-bound, bound, generator=torch_generator(seed, "plug"))
    return nn.Sequential(mlp(in_dim, cfg.hidden, cfg.width, seed=seed), linear)


class PlugVFLActive(JointHeadActive):
    """Concatenation fusion (zeros for missing blocks) and one head; the anchor block is
    required in training and for a test row to be scored."""

    method_name = "plugvfl"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.anchor = self.config.option("anchor", self.blocks[-1])
        self.p_drop = float(self.config.option("p_drop", 0.0))

    def fuse(self, total: torch.Tensor, subset: tuple[str, ...]) -> torch.Tensor:
        return total  # concatenation: each party's model ends in its block of the first layer

    def build_own_model(self, model: str) -> nn.Module:
        cfg = self.config
        return _plug_model(
            len(self.table.columns),
            cfg,
            derived_seed(cfg.seed, self.method_name, model, cfg.active_name),
        )

    def trainable(self, present: tuple[str, ...]) -> bool:
        return self.anchor in present

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        kept = tuple(b for b in present if b == self.anchor or rng.random() >= self.p_drop)
        if not self.sum_allowed(kept):
            return None, 1
        return self.joint_step(ctx, ids, kept, epoch=epoch), 0

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction | None:
        if self.anchor not in present:
            return None
        if not self.sum_allowed(present):
            return Prediction({"joint": self.random_classes(len(ids), present)}, fallback=True)
        return self.joint_prediction(ctx, ids, present)


def _check_plug(cfg: RunConfig) -> None:
    _opt_number(cfg, "p_drop", 0.0, 1.0, hi_open=True)
    if cfg.option("p_drop", 0.0) and differencing_matters(cfg):
        raise ConfigError(
            "[method] p_drop",
            "party-wise dropout sums the same rows over different groups of parties in different "
            "epochs, whose difference approximates one party's contribution; "
            f"{cfg.aggregation!r} with min_group = {cfg.min_group} must not allow that. Use "
            "p_drop = 0 in secure modes",
        )
    anchor = cfg.option("anchor")
    if anchor is not None and anchor not in block_names(cfg):
        raise ConfigError(
            "[method] anchor",
            f"{anchor!r} is not a block holder; choose one of {list(block_names(cfg))}",
        )


def _block_method(name: str, active: type, party: type, description: str, *checks) -> None:
    """Register a baseline: classification only, DP-SGD on the party models."""
    register_method(
        MethodSpec(
            name=name,
            active=active,
            party=party,
            tasks=CLASSIFICATION,
            dp_sgd=("parties",),
            description=description,
            extra_checks=checks,
        )
    )


_block_method(
    "local",
    LocalActive,
    BlockParty,
    "one model per party on its own block (needs single-party sums)",
    option_checks("local"),
    _single_party_sums("local"),
)
_block_method(
    "ensemble",
    EnsembleActive,
    BlockParty,
    "local models, majority vote of the present parties",
    option_checks("ensemble"),
    _single_party_sums("ensemble"),
)
_block_method(
    "standard-vfl",
    StandardVFLActive,
    BlockParty,
    "split-NN on complete rows only; random class if a block is missing",
    option_checks("standard-vfl"),
)
_block_method(
    "combinatorial",
    CombinatorialActive,
    CombinatorialParty,
    "an independent model for every subset of parties",
    option_checks("combinatorial"),
)
_block_method(
    "plugvfl",
    PlugVFLActive,
    PlugVFLParty,
    "concatenation (zeros for missing blocks), anchor party required",
    option_checks("plugvfl", extra_keys=("p_drop", "anchor"), check=_check_plug),
)
