"""LASER-VFL's Local and Ensemble baselines (paper §5, App. D): one model per party on its block
alone; Local scores each present block's model, Ensemble lets them vote.

Every sum they need is over one party, which is that party's representation: secure modes refuse
them unless `[run] min_group = 1` (an explicit, ledgered opt-in).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import ActiveContext, MethodSpec
from securevfl.methods.blocks.active import BlockActive
from securevfl.methods.blocks.batches import chunks
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.nets import task_loss
from securevfl.methods.blocks.options import CLASSIFICATION, BlockOptions, check_block_options
from securevfl.methods.blocks.party import BLOCK_OPERATIONS


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
        for chunk in chunks(ids) if allowed else []:
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
        rng = self.pattern_rng(0x707E, present, len(ids))  # a streamed evaluation: by pattern
        top = votes == votes.max(axis=1, keepdims=True)
        noise = rng.random(votes.shape)
        joint = np.where(top, noise, -1.0).argmax(axis=1)
        return Prediction({"joint": joint}, fallback=fallback)


def check_single_party_sums(cfg: Any, opts: BlockOptions) -> None:
    check_block_options(cfg, opts)
    if cfg.aggregation != "plain" and cfg.min_group > 1:
        raise ConfigError(
            "[run] aggregation",
            f"method {cfg.method!r} trains each party's model on its block alone, so every sum "
            f"it needs is over one party, which {cfg.aggregation!r} refuses (a sum over one "
            'party is that party\'s representation); use aggregation = "plain", or set '
            "[run] min_group = 1 to accept unprotected sums explicitly",
        )


SPECS = [
    MethodSpec(
        name=name,
        active=active,
        party="securevfl.methods.blocks.party:BlockParty",
        operations=BLOCK_OPERATIONS,
        options=BlockOptions,
        tasks=CLASSIFICATION,
        dp_sgd=("parties",),
        encodings=("onehot", "embedding"),
        description=description,
        checks=(check_single_party_sums,),
        example=partial(examples.classification, method=name, p_missing=0.2),
    )
    for name, active, description in (
        ("local", LocalActive, "one model per party on its own block (needs single-party sums)"),
        ("ensemble", EnsembleActive, "local models, majority vote of the present parties"),
    )
]
