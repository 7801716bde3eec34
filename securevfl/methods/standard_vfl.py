"""Standard VFL, LASER-VFL's baseline (paper §5): split-NN with mean fusion and one head,
trained on complete rows only; a test row missing a block gets a random class."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from securevfl.methods import examples
from securevfl.methods.base import REPRESENTATION_SECURE_DEFAULTS, ActiveContext, MethodSpec
from securevfl.methods.blocks.active import JointHeadActive
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.options import CLASSIFICATION, BlockOptions, check_block_options
from securevfl.methods.blocks.party import BLOCK_OPERATIONS


class StandardVFLActive(JointHeadActive):
    """Split-NN with mean fusion and one head, trained on complete rows only; a test row missing
    a block gets a random class."""

    method_name = "standard-vfl"

    def fuse(self, total: Any, subset: tuple[str, ...]) -> Any:
        return total / len(subset)  # mean fusion

    def complete(self, present: tuple[str, ...]) -> bool:
        return len(present) == len(self.blocks)

    def trainable(self, present: tuple[str, ...]) -> bool:
        return self.complete(present)

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        if not self.complete(present) or not self.sum_allowed(present):
            return Prediction({"joint": self.random_classes(len(ids), present)}, fallback=True)
        return self.joint_prediction(ctx, ids, present)


SPEC = MethodSpec(
    name="standard-vfl",
    active=StandardVFLActive,
    party="securevfl.methods.blocks.party:BlockParty",
    operations=BLOCK_OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    options=BlockOptions,
    tasks=CLASSIFICATION,
    dp_sgd=("parties",),
    encodings=("onehot", "embedding"),
    description="split-NN on complete rows only; random class if a block is missing",
    checks=(check_block_options,),
    example=partial(examples.classification, method="standard-vfl", p_missing=0.2),
)
