"""Vanilla VFL, FALSE-VFL's baseline (paper Sec. 5): a split network trained on the fully aligned
labeled rows only, whose test rows are completed by zero-filling the missing blocks.

Each party's model is an MLP f_k followed by its block of the fusion head's first layer (a
bias-free linear layer), so the sum of the parties' outputs is the concatenation of the f_k fed
to the head (PlugVFL's construction, `securevfl.methods.plugvfl`). Inputs are z-scored on the
training rows, so a zero-filled block is the training mean.

Zero-filling on secure sums: at test time every party takes part in the sum of every row, with
f_k(0) for a row it lacks (``forward`` with ``fill``: only in prediction, never in training). The
sum is then over every party, but the parties holding the row are the only ones whose data it
carries; so in secure modes a test row with fewer than ``min_group`` present passive parties is
not predicted (a random class, counted as ``n_fallback``), as for the other block methods.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.lazy import torch
from securevfl.methods import examples
from securevfl.methods.base import (
    REPRESENTATION_SECURE_DEFAULTS,
    ActiveContext,
    MethodSpec,
    Operation,
    Release,
)
from securevfl.methods.blocks.active import JointHeadActive
from securevfl.methods.blocks.batches import chunks
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.nets import scaled_rows
from securevfl.methods.blocks.options import CLASSIFICATION, BlockOptions, check_block_options
from securevfl.methods.blocks.sums import SumPlan
from securevfl.methods.plugvfl import PlugVFLParty

OPERATIONS = (
    Operation(
        "forward",
        "the outputs of the requested models on rows `ids`; with `fill` (prediction only) "
        "f_k(0) on the rows this party lacks",
        releases=(
            Release(
                "rep*",
                why="a representation f_k(x_k) (or f_k(0)) per row: only inside a secure sum "
                "over the call's group",
            ),
        ),
    ),
    Operation(
        "backward",
        "dL/d(output) of the last training forward; the party steps its models",
        inputs=("rep*",),
        updates=True,
    ),
)


class VanillaVFLParty(PlugVFLParty):
    """f_k and its block of the head's first layer; zero-fills rows it lacks when asked to
    (prediction only)."""

    method_name = "vanilla-vfl"
    _fill = False

    def _inputs(self, ids: np.ndarray) -> Any:
        if not self._fill:
            return super()._inputs(ids)
        held = self.table.has(ids)
        x = np.zeros((len(ids), len(self.table.columns)), dtype=np.float32)
        x[held] = scaled_rows(self, ids[held])
        return torch.from_numpy(x).to(self.device)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        fill = op == "forward" and bool(args.get("fill", False))
        if fill and args.get("train", False):
            raise ValueError("vanilla-vfl zero-fills missing blocks in prediction only")
        self._fill = fill
        try:
            return super().handle(op, ids=np.asarray(ids, dtype=np.int64), args=args, inputs=inputs)
        finally:
            self._fill = False


class VanillaVFLActive(JointHeadActive):
    """Concatenation fusion and one head, trained on fully aligned labeled rows; prediction
    from every party with zero-filled missing blocks."""

    method_name = "vanilla-vfl"

    def fuse(self, total: Any, subset: tuple[str, ...]) -> Any:
        return total  # concatenation: each party's model ends in its block of the first layer

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        # only labeled rows have a target (a labeled budget leaves the others empty); a table
        # streamed from disk picks them a block at a time into a file of its row cache
        if getattr(self.table, "streamed", False):
            from securevfl.data.rowarrays import filter_ids

            arrays = self.table.rowstore.arrays()
            labeled = filter_ids(arrays, train_ids, self.table.labeled, "vanilla-labeled")
        else:
            labeled = train_ids[self.table.labeled(train_ids)]
        super().fit(ctx, train_ids=labeled)

    def trainable(self, present: tuple[str, ...]) -> bool:
        return len(present) == len(self.blocks)  # fully aligned rows only

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        if not self.sum_allowed(present):
            return Prediction({"joint": self.random_classes(len(ids), present)}, fallback=True)
        everyone = tuple(b for b in self.blocks if b not in self.dead)
        parts = []
        for chunk in chunks(ids):
            plan = SumPlan()
            plan.add(everyone, "rep")
            got = plan.call(ctx, "forward", ids=chunk, args={"train": False, "fill": True})
            total = torch.tensor(
                np.asarray(got[(everyone, "rep")], dtype=np.float32), device=self.device
            )
            parts.append(self.classes_of(self.heads["joint"](total)))
        return Prediction({"joint": np.concatenate(parts)})


def check_vanilla(cfg: Any, opts: BlockOptions) -> None:
    check_block_options(cfg, opts)
    if cfg.active_columns:
        raise ConfigError(
            "[active] columns",
            "vanilla-vfl zero-fills the blocks of passive parties only; give these columns to "
            "a passive party of their own",
        )


SPEC = MethodSpec(
    name="vanilla-vfl",
    active=VanillaVFLActive,
    party=VanillaVFLParty,
    operations=OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    options=BlockOptions,
    tasks=CLASSIFICATION,
    dp_sgd=("parties",),
    encodings=("onehot", "embedding"),
    description="split-NN on fully aligned labeled rows; missing test blocks zero-filled",
    checks=(check_vanilla,),
    example=partial(examples.classification, method="vanilla-vfl", p_missing=0.2),
)
