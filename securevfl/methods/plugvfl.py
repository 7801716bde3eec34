"""PlugVFL, LASER-VFL's baseline (paper §5, App. A.2): concatenation fusion with zeros for missing
blocks, which is a sum once the head's first (linear) layer is split into one block per party and
moved into that party: each party's model ends in a bias-free linear layer. The anchor block
(option `anchor`, default the last block) is PlugVFL's "active party": batches without it are
skipped and test rows without it are left out of the metrics, as in the paper's code. Optional
party-wise dropout (`p_drop`, plain aggregation only)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.lazy import nn, torch
from securevfl.methods import examples
from securevfl.methods.base import REPRESENTATION_SECURE_DEFAULTS, ActiveContext, MethodSpec
from securevfl.methods.blocks.active import JointHeadActive
from securevfl.methods.blocks.batches import block_names
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.nets import derived_seed, mlp, torch_generator
from securevfl.methods.blocks.options import (
    CLASSIFICATION,
    BlockOptions,
    check_block_options,
    differencing_matters,
)
from securevfl.methods.blocks.party import BLOCK_OPERATIONS, BlockParty
from securevfl.methods.options import option


class PlugVFLParty(BlockParty):
    """f_k followed by this party's block of the concatenation head's first layer."""

    method_name = "plugvfl"

    def build_model(self, model: str) -> Any:
        cfg = self.config
        seed = derived_seed(self.init_seed(), self.method_name, model, self.name)
        return _plug_model(self.input_width(), cfg, seed)


def _plug_model(in_dim: int, cfg: Any, seed: int) -> Any:
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
        opts = self.config.options
        self.anchor = opts.anchor if opts.anchor is not None else self.blocks[-1]
        self.p_drop = float(opts.p_drop)

    def fuse(self, total: Any, subset: tuple[str, ...]) -> Any:
        return total  # concatenation: each party's model ends in its block of the first layer

    def build_own_model(self, model: str) -> Any:
        cfg = self.config
        return _plug_model(
            self.input_width(),
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


@dataclass(frozen=True)
class PlugOptions(BlockOptions):
    p_drop: float = option(
        0.0,
        "party-wise dropout probability in training (plain aggregation only)",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
    )
    anchor: str | None = option(None, "the block required in training (default: the last block)")


def check_plug(cfg: Any, opts: PlugOptions) -> None:
    check_block_options(cfg, opts)
    if opts.p_drop and differencing_matters(cfg):
        raise ConfigError(
            "[method] p_drop",
            "party-wise dropout sums the same rows over different groups of parties in different "
            "epochs, whose difference approximates one party's contribution; "
            f"{cfg.aggregation!r} with min_group = {cfg.min_group} must not allow that. Use "
            "p_drop = 0 in secure modes",
        )
    if opts.anchor is not None and opts.anchor not in block_names(cfg):
        raise ConfigError(
            "[method] anchor",
            f"{opts.anchor!r} is not a block holder; choose one of {list(block_names(cfg))}",
        )


SPEC = MethodSpec(
    name="plugvfl",
    active=PlugVFLActive,
    party=PlugVFLParty,
    operations=BLOCK_OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    options=PlugOptions,
    tasks=CLASSIFICATION,
    dp_sgd=("parties",),
    encodings=("onehot", "embedding"),
    description="concatenation (zeros for missing blocks), anchor party required",
    checks=(check_plug,),
    example=partial(examples.classification, method="plugvfl", p_missing=0.2),
)
