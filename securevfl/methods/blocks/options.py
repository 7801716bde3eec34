"""The `[method]` options every encoder + head method over missing blocks shares (LASER-VFL and
its baselines), the checks they need, and the training schedule they imply (learning rate,
optimizer, feature scaling)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.lazy import torch
from securevfl.methods.blocks.nets import Standardizer, make_optimizer
from securevfl.methods.options import option

if TYPE_CHECKING:
    from securevfl.config import RunConfig

SCALINGS = ("zscore", "minmax", "none")
CLASSIFICATION = ("binary", "multiclass")


@dataclass(frozen=True)
class BlockOptions:
    """Options shared by LASER-VFL and its baselines."""

    balanced: bool = option(
        False, "draw each epoch class-balanced with replacement (the paper's Credit runs)"
    )
    two_logit_head: bool = option(
        False, "binary task: two-logit heads under softmax cross-entropy (the paper's code)"
    )
    lr_schedule: str = option(
        "constant",
        "learning rate: constant, or cosine annealing per epoch",
        choices=("constant", "cosine"),
    )
    lr_min_ratio: float = option(
        0.0,
        "cosine schedule: the last learning rate as a fraction of [train] lr",
        minimum=0.0,
        maximum=1.0,
    )
    momentum: float = option(
        0.9,
        "SGD momentum ([train] optimizer = sgd)",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
    )
    eval_test_missing: tuple[float, ...] = option(
        (),
        "also evaluate with these extra MCAR test rates (plain aggregation only)",
        minimum=0.0,
        maximum=1.0,
        exclusive_maximum=True,
    )
    scaling: str | None = option(
        None,
        "feature scaling fitted on training rows: zscore, minmax or none (default zscore, "
        "or none if [data] standardize = false)",
        choices=SCALINGS,
    )


def differencing_matters(cfg: RunConfig) -> bool:
    """Whether sums must not difference to fewer than `min_group` parties (secure modes)."""
    return cfg.aggregation != "plain" and cfg.min_group > 1


def check_block_options(cfg: RunConfig, opts: BlockOptions) -> None:
    """Settings the block methods refuse: re-evaluating test rows over other groups of parties
    in secure modes (two sums of the same rows over different groups difference to a party)."""
    if opts.eval_test_missing and differencing_matters(cfg):
        raise ConfigError(
            "[method] eval_test_missing",
            f"re-evaluating the test rows with other missing blocks sums the same rows over "
            f"different groups of parties, and the difference of two such sums is a sum over "
            f"fewer parties (one party's representation); {cfg.aggregation!r} with "
            f"min_group = {cfg.min_group} must not allow that. Use it with "
            'aggregation = "plain" (benchmarks), or set [missing] test instead',
        )


def lr_at(cfg: RunConfig, epoch: int) -> float:
    """The learning rate of `epoch`: constant, or cosine annealing to lr·lr_min_ratio stepped
    once per epoch (torch's CosineAnnealingLR with T_max = epochs)."""
    opts = cfg.options
    if opts.lr_schedule != "cosine":
        return cfg.lr
    low = cfg.lr * float(opts.lr_min_ratio)
    return low + (cfg.lr - low) * (1 + math.cos(math.pi * epoch / cfg.epochs)) / 2


def block_optimizer(params: Iterable[Any], cfg: RunConfig) -> Any:
    """Adam, or SGD with `[method] momentum`; `[train]` lr and weight decay."""
    if cfg.optimizer == "adam":  # the one Adam every encoder + head method uses
        return make_optimizer(params, cfg)
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=float(cfg.options.momentum), weight_decay=cfg.weight_decay
    )


def scaling_of(cfg: RunConfig) -> str:
    """`[method] scaling`; by default z-scores, or none if `[data] standardize = false`."""
    chosen = cfg.options.scaling
    return chosen if chosen is not None else ("zscore" if cfg.standardize else "none")


def fit_scaler(values: np.ndarray | Mapping[str, np.ndarray], cfg: RunConfig) -> Standardizer:
    """The per-column scaling fitted on `values` (training rows): z-scores, min-max to [0, 1], or
    none. Empty cells become 0 after scaling. `values` may instead be the rows' column summary
    (`PartyTable.column_summary`: mean, std, min, max), for a table streamed from disk."""
    if isinstance(values, Mapping):
        scaler = Standardizer().fit_summary(values)
    else:
        scaler = Standardizer().fit(values)
    kind = scaling_of(cfg)
    if kind == "none":
        scaler.mean = np.zeros_like(scaler.mean)
        scaler.std = np.ones_like(scaler.std)
    elif kind == "minmax":
        with np.errstate(all="ignore"):
            if isinstance(values, Mapping):
                low, span = values["min"], values["max"] - values["min"]
            else:
                d = values.shape[1]
                low = np.nanmin(values, axis=0) if len(values) else np.zeros(d)
                span = (np.nanmax(values, axis=0) if len(values) else np.ones(d)) - low
        scaler.mean = np.nan_to_num(low)
        scaler.std = np.where(np.nan_to_num(span) > 1e-12, np.nan_to_num(span), 1.0)
    return scaler
