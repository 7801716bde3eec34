"""Combinatorial, LASER-VFL's baseline (paper §5): an independent predictor (its own copies of
f_k and its own head) for every nonempty subset of blocks; a batch trains every subset of its
present blocks, a test row uses the model of its exact present set. Subsets with fewer than
`min_group` passive parties are skipped in secure modes (their rows get a random class)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from itertools import combinations
from typing import Any

import numpy as np

from securevfl.lazy import nn
from securevfl.methods import examples
from securevfl.methods.base import REPRESENTATION_SECURE_DEFAULTS, ActiveContext, MethodSpec
from securevfl.methods.blocks.active import BlockActive
from securevfl.methods.blocks.batches import block_names, subset_code
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.nets import derived_seed, mlp, task_loss
from securevfl.methods.blocks.options import CLASSIFICATION, BlockOptions, check_block_options
from securevfl.methods.blocks.party import BLOCK_OPERATIONS, BlockParty


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

    def head_of(self, subset: tuple[str, ...]) -> Any:
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
        head = self.head_of(present)
        return self.predict_with(ctx, ids, present, lambda total: head(total / len(present)))


SPEC = MethodSpec(
    name="combinatorial",
    active=CombinatorialActive,
    party=CombinatorialParty,
    operations=BLOCK_OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    options=BlockOptions,
    tasks=CLASSIFICATION,
    dp_sgd=("parties",),
    encodings=("onehot", "embedding"),
    description="an independent model for every subset of parties",
    checks=(check_block_options,),
    example=partial(examples.classification, method="combinatorial", p_missing=0.2),
)
