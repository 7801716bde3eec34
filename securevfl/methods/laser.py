"""LASER-VFL (Valdeira, Wang, Chi; ICLR 2025): one predictor per subset of present parties.

Every feature block k has a representation model f_k (at its party) and a head g_k (at the
active party, which holds the labels). Head k's predictor for a subset I of present blocks,
k in I, is ``g_k(mean_{i in I} f_i(x_i))``: 2K networks give K·2^(K-1) predictors. Training
samples, for every present block k and every size i, one subset of that size containing k and
weights its loss by ``a_i = C(K_o-1, i-1)/i``, an unbiased estimate of the loss over every
subset (Lemma 1). Batches are pattern-homogeneous (every row of a batch has the same present
blocks), so the secure sums of a batch have fixed groups. Inference (Algorithm 2): every present
block's head predicts from the mean over all present blocks.

On secure sums: the active party asks, in one call per batch, for the sum of the passive
parties' representations over each distinct sampled subset (one `SumSpec` each); the aggregator
never sees one party's representation. The count of present blocks needs no sum: the active party
learnt each row's presence at set-up. A subset with fewer than `min_group` passive members is
refused in secure modes, so LASER skips it before asking, counts it, and logs the count per
epoch (`skipped_tasks`). At test time a row whose present passive blocks are too few for a sum
gets a random class (`n_fallback`). The gradient sent back to party k is the sum over the sampled
subsets containing k of dL/dS_I; it differs per party, so each party gets its own call, and all of
them go through `release_gradients` together (one joint clip per row under label DP).

This module also holds the plumbing the baselines in `baselines.py` share with LASER: the block
party (`BlockParty`), the pattern-homogeneous (optionally class-balanced) batches, the training
and evaluation loops (`BlockActive`) and the `[method]` options.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from securevfl.config import ConfigError, MissingSpec, RunConfig
from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    PartyDropped,
    PartyMethod,
    SumSpec,
    UnknownOperation,
    register_method,
)
from securevfl.methods.nn import Standardizer, class_count, derived_seed, mlp, output_dim, task_loss
from securevfl.privacy.runtime import PrivateTraining, private_training

EVAL_BATCH = 4096
CLASSIFICATION = ("binary", "multiclass")

# --------------------------------------------------------------------------------------------
# Task sampling (pure functions: the part of the paper that Lemma 1 is about)


@dataclass(frozen=True)
class Task:
    """One loss term: head `head` predicts from the mean representation of `subset`."""

    head: str
    subset: tuple[str, ...]
    weight: float


def task_weights(k_o: int) -> np.ndarray:
    """``a_i = C(K_o - 1, i - 1) / i`` for i = 1..K_o (eq. 8): [1, 1.5, 1, 0.25] for K_o = 4."""
    if k_o < 1:
        raise ValueError(f"need at least one present block, got {k_o}")
    return np.array([math.comb(k_o - 1, i - 1) / i for i in range(1, k_o + 1)])


def sample_tasks(present: Sequence[str], rng: np.random.Generator) -> list[Task]:
    """For every present block k and size i = 1..K_o, one subset of size i containing k drawn
    uniformly, weighted by a_i. Subsets keep the order of `present`."""
    k_o = len(present)
    weights = task_weights(k_o)
    tasks = []
    for k in present:
        others = [b for b in present if b != k]
        for i in range(1, k_o + 1):
            chosen = (
                set(np.asarray(others)[rng.choice(len(others), size=i - 1, replace=False)])
                if i > 1
                else set()
            )
            subset = tuple(b for b in present if b == k or b in chosen)
            tasks.append(Task(head=k, subset=subset, weight=float(weights[i - 1])))
    return tasks


def exact_tasks(present: Sequence[str]) -> list[Task]:
    """Every (head k, subset I containing k) of the present blocks, weighted 1/|I| (eq. 5)."""
    tasks = []
    for size in range(1, len(present) + 1):
        for subset in combinations(present, size):
            tasks += [Task(head=k, subset=subset, weight=1.0 / size) for k in subset]
    return tasks


def draw_family(
    passive: Sequence[str], min_group: int, rng: np.random.Generator
) -> tuple[tuple[str, ...], ...]:
    """A random laminar family of subsets of `passive` (in its order) whose members all have at
    least `min_group` parties: the whole set, and (with probability 1 - 1/g_max) a random
    partition of it into g groups of near-equal size, g uniform in 2..g_max = len // min_group.
    Every 0/1 combination of the members' sums is a union of groups, so no linear combination of
    them is a sum over fewer than `min_group` parties. Empty if len(passive) < min_group."""
    n = len(passive)
    if n < min_group:
        return ()
    groups = int(rng.integers(1, n // min_group + 1))
    members = {tuple(passive)}
    if groups > 1:
        for chunk in np.array_split(rng.permutation(n), groups):
            members.add(tuple(passive[i] for i in sorted(chunk)))
    return tuple(sorted(members, key=lambda m: (-len(m), [passive.index(b) for b in m])))


def laser_objective(
    sums: Mapping[tuple[str, ...], torch.Tensor],
    tasks: Iterable[Task],
    heads: Mapping[str, nn.Module],
    y: torch.Tensor,
    task: str,
) -> torch.Tensor:
    """``sum_t weight_t * loss(g_head(S_subset / |subset|), y)`` with `sums` the representation
    sums of the subsets (each loss is a batch mean)."""
    total = torch.zeros((), device=y.device)
    for t in tasks:
        total = total + t.weight * task_loss(task, heads[t.head](sums[t.subset] / len(t.subset)), y)
    return total


# --------------------------------------------------------------------------------------------
# Options ([method] table) shared by LASER and the baselines

COMMON_OPTIONS = (
    "balanced",
    "two_logit_head",
    "lr_schedule",
    "lr_min_ratio",
    "momentum",
    "eval_test_missing",
    "scaling",
)


def _opt_bool(cfg: RunConfig, key: str) -> None:
    v = cfg.option(key)
    if v is not None and not isinstance(v, bool):
        raise ConfigError(f"[method] {key}", f"must be true or false, got {v!r}")


def _opt_number(cfg: RunConfig, key: str, lo: float, hi: float, *, hi_open: bool = False) -> None:
    v = cfg.option(key)
    if v is None:
        return
    ok = (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and lo <= v
        and (v < hi if hi_open else v <= hi)
    )
    if not ok:
        bound = f"< {hi}" if hi_open else f"<= {hi}"
        raise ConfigError(f"[method] {key}", f"must be a number >= {lo} and {bound}, got {v!r}")


def option_checks(
    method: str, *, extra_keys: Sequence[str] = (), check: Callable[[RunConfig], None] | None = None
) -> Callable[[RunConfig], None]:
    """A config check for `method`'s `[method]` options: the common ones plus `extra_keys`
    (validated by `check`); refuses unknown keys and bad values."""

    def run_checks(cfg: RunConfig) -> None:
        known = set(COMMON_OPTIONS) | set(extra_keys)
        for key, _ in cfg.method_options:
            if key not in known:
                raise ConfigError(
                    f"[method] {key}",
                    f"unknown option for method {method!r}; known: {sorted(known)}",
                )
        _opt_bool(cfg, "balanced")
        _opt_bool(cfg, "two_logit_head")
        if scaling_of(cfg) not in SCALINGS:
            raise ConfigError(
                "[method] scaling",
                f"unknown value {scaling_of(cfg)!r}; choose one of {', '.join(SCALINGS)}",
            )
        sched = cfg.option("lr_schedule", "constant")
        if sched not in ("constant", "cosine"):
            raise ConfigError(
                "[method] lr_schedule", f"unknown value {sched!r}; choose constant or cosine"
            )
        _opt_number(cfg, "lr_min_ratio", 0.0, 1.0)
        _opt_number(cfg, "momentum", 0.0, 1.0, hi_open=True)
        rates = cfg.option("eval_test_missing", [])
        if not isinstance(rates, list) or not all(
            isinstance(r, int | float) and not isinstance(r, bool) and 0 <= r < 1 for r in rates
        ):
            raise ConfigError(
                "[method] eval_test_missing",
                f"must be a list of missing rates in [0, 1), got {rates!r}",
            )
        if rates and differencing_matters(cfg):
            raise ConfigError(
                "[method] eval_test_missing",
                f"re-evaluating the test rows with other missing blocks sums the same rows over "
                f"different groups of parties, and the difference of two such sums is a sum over "
                f"fewer parties (one party's representation); {cfg.aggregation!r} with "
                f"min_group = {cfg.min_group} must not allow that. Use it with "
                'aggregation = "plain" (benchmarks), or set [missing] test instead',
            )
        if check is not None:
            check(cfg)

    return run_checks


def differencing_matters(cfg: RunConfig) -> bool:
    """Whether sums must not difference to fewer than `min_group` parties (secure modes)."""
    return cfg.aggregation != "plain" and cfg.min_group > 1


def lr_at(cfg: RunConfig, epoch: int) -> float:
    """The learning rate of `epoch`: constant, or cosine annealing to lr·lr_min_ratio stepped
    once per epoch (torch's CosineAnnealingLR with T_max = epochs)."""
    if cfg.option("lr_schedule", "constant") != "cosine":
        return cfg.lr
    low = cfg.lr * float(cfg.option("lr_min_ratio", 0.0))
    return low + (cfg.lr - low) * (1 + math.cos(math.pi * epoch / cfg.epochs)) / 2


def block_optimizer(params: Iterable[nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
    """Adam, or SGD with `[method] momentum` (default 0.9); `[train]` lr and weight decay."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(
        params,
        lr=cfg.lr,
        momentum=float(cfg.option("momentum", 0.9)),
        weight_decay=cfg.weight_decay,
    )


SCALINGS = ("zscore", "minmax", "none")


def scaling_of(cfg: RunConfig) -> str:
    """`[method] scaling`; by default z-scores, or none if `[data] standardize = false`."""
    return str(cfg.option("scaling", "zscore" if cfg.standardize else "none"))


def fit_scaler(values: np.ndarray, cfg: RunConfig) -> Standardizer:
    """The per-column scaling fitted on `values` (training rows): z-scores, min-max to [0, 1], or
    none. Empty cells become 0 after scaling."""
    scaler = Standardizer().fit(values)
    kind = scaling_of(cfg)
    if kind == "none":
        scaler.mean = np.zeros_like(scaler.mean)
        scaler.std = np.ones_like(scaler.std)
    elif kind == "minmax":
        with np.errstate(all="ignore"):
            low = np.nanmin(values, axis=0) if len(values) else np.zeros(values.shape[1])
            span = (np.nanmax(values, axis=0) if len(values) else np.ones(values.shape[1])) - low
        scaler.mean = np.nan_to_num(low)
        scaler.std = np.where(np.nan_to_num(span) > 1e-12, np.nan_to_num(span), 1.0)
    return scaler


def block_names(cfg: RunConfig) -> tuple[str, ...]:
    """The feature blocks: every passive party, then the active party if it holds columns."""
    return (*cfg.party_names, cfg.active_name) if cfg.active_columns else cfg.party_names


def subset_code(subset: Iterable[str], blocks: Sequence[str]) -> int:
    return sum(1 << blocks.index(b) for b in subset)


# --------------------------------------------------------------------------------------------
# Batches


def pattern_codes(present: np.ndarray) -> np.ndarray:
    """Bit code of each row's present blocks (bit j = block j)."""
    present = np.asarray(present, dtype=bool)
    return (present.astype(np.int64) << np.arange(present.shape[1])).sum(axis=1)


def pattern_batches(
    ids: np.ndarray,
    present: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    labels: np.ndarray | None = None,
    keys: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The epoch's batches as (ids, present-blocks row): every row of a batch has the same present
    blocks (and the same `keys` value, if given). Rows are shuffled, bucketed by pattern, cut into
    batches, and the batch order is shuffled; all reproducible from (seed, epoch). With `labels`,
    the epoch is a class-balanced draw of len(ids) rows with replacement (torch's
    WeightedRandomSampler, as the paper's Credit runs) before bucketing. Rows with no present
    block are left out."""
    rng = np.random.default_rng([seed, epoch, 0x1A5E])
    n = len(ids)
    if labels is not None and n:
        _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        w = 1.0 / counts[inverse]
        order = rng.choice(n, size=n, replace=True, p=w / w.sum())
    else:
        order = rng.permutation(n)
    codes = pattern_codes(present)[order]
    if keys is not None:  # bucket by (pattern, key): pattern in the low bits
        shifted = (np.asarray(keys)[order].astype(np.int64) + 1) << present.shape[1]
        codes = np.where(codes == 0, 0, codes + shifted)
    cut: list[np.ndarray] = []
    for code in np.unique(codes):
        if code == 0:
            continue
        rows = order[codes == code]
        cut += [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    return [(ids[cut[j]], present[cut[j][0]]) for j in rng.permutation(len(cut))]


# --------------------------------------------------------------------------------------------
# Passive party


class BlockParty(PartyMethod):
    """A passive party's representation models for the methods over missing blocks.

    ``forward`` (args: train, epoch, models = {party: [model names]}) returns each requested
    model's output on rows `ids`; ``backward`` (inputs: model name -> dL/d output) updates them.
    LASER has one model, ``rep`` = f_k."""

    method_name: ClassVar[str] = "laser"

    def model_names(self) -> list[str]:
        return ["rep"]

    def build_model(self, model: str) -> nn.Module:
        cfg = self.config
        return mlp(
            len(self.table.columns),
            cfg.hidden,
            cfg.width,
            seed=derived_seed(cfg.seed, self.method_name, model, self.name),
        )

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        train_ids = np.asarray(inputs["train_ids"])
        self.scaler = fit_scaler(self.table.rows(train_ids[self.table.has(train_ids)]), self.config)
        self._scaled = self.scaler.transform(self.table.values)
        self.models = nn.ModuleDict({m: self.build_model(m) for m in self.model_names()}).to(
            self.device
        )
        # DP-SGD ([parties.NAME] dp_sgd) when the role's privacy plan has it: one Opacus
        # optimizer per model (a batch may train only some of a party's models), each step
        # charged to the ledger; the active party's loss is a batch mean. Without it, one
        # optimizer (Adam and SGD are per parameter, so this is the same update).
        privacy = getattr(self, "privacy", None)
        self.trainings: dict[str, PrivateTraining] = {}
        self.optimizer: torch.optim.Optimizer | None = None
        self._epoch = 0  # of the last training forward: DP-SGD steps are charged to it
        if privacy is not None and privacy.plan.dp_sgd is not None:
            self.trainings = {
                m: private_training(
                    self,
                    self.models[m],
                    block_optimizer(self.models[m].parameters(), self.config),
                    expected_batch_size=self.config.batch_size,
                )
                for m in self.model_names()
            }
        else:
            self.optimizer = block_optimizer(self.models.parameters(), self.config)
        self._pending: tuple[np.ndarray, dict[str, torch.Tensor]] | None = None

    @property
    def private(self) -> bool:
        """Whether the models train with DP-SGD (one `PrivateTraining` per model)."""
        return bool(self.trainings)

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        if self.private:
            return [t.optimizer for t in self.trainings.values()]
        return [self.optimizer]

    def _inputs(self, ids: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self._scaled[self.table.positions(ids)]).to(self.device)

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "forward":
            wanted = dict(args.get("models") or {}).get(self.name, self.model_names())
            unknown = [m for m in wanted if m not in self.models]
            if unknown:
                raise ValueError(f"{self.method_name} party {self.name!r} has no models {unknown}")
            x = self._inputs(ids)
            train = bool(args.get("train", False))
            if train:
                self._epoch = int(args.get("epoch", 0))
                for optimizer in self._optimizers():
                    for group in optimizer.param_groups:
                        group["lr"] = lr_at(self.config, self._epoch)
                self.models.train()
                if self.private:  # through Opacus's GradSampleModule (per-sample gradients)
                    outs = {m: self.trainings[m].model(x) for m in wanted}
                else:
                    outs = {m: self.models[m](x) for m in wanted}
                self._pending = (np.array(ids, copy=True), outs)
            else:
                self.models.eval()
                with torch.no_grad():
                    outs = {m: self.models[m](x) for m in wanted}
            return {m: o.detach().cpu().numpy() for m, o in outs.items()}
        if op == "backward":
            if self._pending is None or not np.array_equal(self._pending[0], ids):
                raise RuntimeError("backward for rows that were not the last training forward")
            outs = self._pending[1]
            grads: dict[str, torch.Tensor] = {}
            for m, g in inputs.items():
                if m not in outs:
                    raise ValueError(f"gradient for {m!r}, which the last forward did not compute")
                grad = torch.tensor(np.asarray(g, dtype=np.float32), device=self.device)
                if grad.shape != outs[m].shape:
                    raise ValueError(
                        f"gradient shape {tuple(grad.shape)} != output "
                        f"{tuple(outs[m].shape)} of {m!r}"
                    )
                grads[m] = grad
            self._pending = None
            if self.private:  # each model clips, noises and charges its own step
                for m, grad in grads.items():
                    training = self.trainings[m]
                    training.zero_grad()
                    outs[m].backward(grad)
                    training.step(epoch=self._epoch)
            elif grads:
                self.optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward([outs[m] for m in grads], list(grads.values()))
                self.optimizer.step()
            return {}
        raise UnknownOperation(self.method_name, op)

    def state_dict(self) -> dict[str, Any]:
        return {
            "models": self.models.state_dict(),
            "optimizers": [o.state_dict() for o in self._optimizers()],
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.models.load_state_dict(state["models"])
        saved = state["optimizers"]
        if len(saved) != len(self._optimizers()):
            raise ValueError(
                f"the checkpoint has {len(saved)} optimizers, this run {len(self._optimizers())}: "
                "was [parties] dp_sgd changed? Resume with the run's own config"
            )
        for optimizer, sd in zip(self._optimizers(), saved, strict=True):
            optimizer.load_state_dict(sd)
        self.scaler.load_state_dict(state["scaler"])
        self._scaled = self.scaler.transform(self.table.values)


# --------------------------------------------------------------------------------------------
# Active party: the loops shared by LASER and the baselines


@dataclass
class Prediction:
    """Class predictions of a pattern's rows, per predictor (a head, or "joint"); `fallback`
    marks random classes given because no predictor was available (or allowed)."""

    classes: dict[str, np.ndarray]
    fallback: bool = False


class BlockActive(ActiveMethod):
    """Training and evaluation over pattern-homogeneous batches, for methods whose parties hold
    `BlockParty` models. Subclasses say which batches they train on (`trainable`), what one
    step does (`train_step`) and how a pattern's rows are predicted (`predict_rows`)."""

    method_name: ClassVar[str] = "laser"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config
        self.blocks = block_names(cfg)
        self.own_name = cfg.active_name if cfg.active_columns else None
        self.secure = cfg.aggregation != "plain"
        self.n_classes = class_count(cfg.task, self.table.labels)
        # a binary task with `two_logit_head`: heads Linear(d, 2) under softmax cross-entropy,
        # as the paper's code (one logit under BCE is the same function class; Adam moves the
        # two parameterisations at different speeds)
        two = cfg.task == "binary" and bool(cfg.option("two_logit_head", False))
        self.loss_task = "multiclass" if two else cfg.task
        self.out_dim = output_dim(self.loss_task, self.n_classes)
        self.dead: list[str] = []
        self.own: nn.ModuleDict | None = None
        self.own_scaler = Standardizer()
        self._own_scaled: np.ndarray | None = None
        if self.own_name is not None:
            self.own = nn.ModuleDict(
                {m: self.build_own_model(m) for m in self.own_model_names()}
            ).to(self.device)
        self.build_heads()
        params = list(self.heads.parameters())
        if self.own is not None:
            params += list(self.own.parameters())
        self.optimizer = block_optimizer(params, cfg)
        self.extra_tests: dict[str, dict[str, Any]] = {}
        self.skipped_tasks_total = 0

    # --- what subclasses provide

    def build_heads(self) -> None:
        cfg = self.config
        self.heads = nn.ModuleDict(
            {
                k: mlp(
                    cfg.width,
                    cfg.head_hidden,
                    self.out_dim,
                    seed=derived_seed(cfg.seed, self.method_name, "head", k),
                )
                for k in self.blocks
            }
        ).to(self.device)

    def own_model_names(self) -> list[str]:
        return ["rep"]

    def build_own_model(self, model: str) -> nn.Module:
        cfg = self.config
        return mlp(
            len(self.table.columns),
            cfg.hidden,
            cfg.width,
            seed=derived_seed(cfg.seed, self.method_name, model, cfg.active_name),
        )

    def tensor_of(self, subset: tuple[str, ...]) -> str:
        """The party model whose outputs are summed over `subset`."""
        return "rep"

    def trainable(self, present: tuple[str, ...]) -> bool:
        return True

    def batch_keys(self, ids: np.ndarray, present: np.ndarray) -> np.ndarray | None:
        """Rows with different keys never share a batch (besides differing patterns)."""
        return None

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        """One update on a batch whose rows all have blocks `present`; returns (loss or None if
        nothing was trained, number of loss terms skipped because their sum was refused). May
        raise `PartyDropped` before anything is updated."""
        raise NotImplementedError

    def update(
        self, ctx: ActiveContext, ids: np.ndarray, leaves: Any, loss: torch.Tensor, *, epoch: int
    ) -> None:
        """Backpropagate `loss`, send the parties their gradients (`send_gradients`: label DP,
        ledger), then step the active party's optimizer."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.send_gradients(ctx, ids, leaves, epoch=epoch)
        self.optimizer.step()

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction | None:
        """Predictions for rows that all have blocks `present`; None leaves them out of the
        metrics."""
        raise NotImplementedError

    # --- sums and gradients

    def sum_allowed(self, subset: Iterable[str]) -> bool:
        """Whether the sum over `subset` may be asked for: its passive members are at least
        `min_group` in secure modes (the active party's own block needs no sum)."""
        passive = [b for b in subset if b != self.own_name]
        return not passive or not self.secure or len(passive) >= self.config.min_group

    def _own_inputs(self, ids: np.ndarray) -> torch.Tensor:
        if self._own_scaled is None:
            self._own_scaled = self.own_scaler.transform(self.table.values)
        return torch.from_numpy(self._own_scaled[self.table.positions(ids)]).to(self.device)

    def forward_sums(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        subsets: Sequence[tuple[str, ...]],
        *,
        train: bool,
        epoch: int = 0,
    ) -> tuple[dict[tuple[str, ...], torch.Tensor], dict[tuple[str, ...], torch.Tensor]]:
        """The representation sum of each subset (its passive members' through one call with one
        secure sum per subset, plus the active party's own block). Returns (sums, leaves): the
        leaves are the decoded secure sums, whose gradients go back to the parties."""
        specs: list[SumSpec] = []
        models: dict[str, list[str]] = {}
        for i, sub in enumerate(subsets):
            passive = tuple(b for b in sub if b != self.own_name)
            if passive:
                tensor = self.tensor_of(sub)
                specs.append(SumSpec(key=f"S{i}", tensor=tensor, group=passive))
                for p in passive:
                    if tensor not in models.setdefault(p, []):
                        models[p].append(tensor)
        got = (
            ctx.call(
                "forward",
                ids=ids,
                args={"train": train, "epoch": epoch, "models": models},
                sums=specs,
            )
            if specs
            else {}
        )
        own_x = None
        sums: dict[tuple[str, ...], torch.Tensor] = {}
        leaves: dict[tuple[str, ...], torch.Tensor] = {}
        own_out: dict[str, torch.Tensor] = {}
        for i, sub in enumerate(subsets):
            total = None
            if f"S{i}" in got:
                leaf = torch.tensor(
                    np.asarray(got[f"S{i}"], dtype=np.float32),
                    device=self.device,
                    requires_grad=train,
                )
                leaves[sub] = leaf
                total = leaf
            if self.own_name in sub:
                assert self.own is not None
                tensor = self.tensor_of(sub)
                if tensor not in own_out:
                    if own_x is None:
                        own_x = self._own_inputs(ids)
                    own_out[tensor] = self.own[tensor](own_x)
                total = own_out[tensor] if total is None else total + own_out[tensor]
            sums[sub] = total
        return sums, leaves

    def send_gradients(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        leaves: Mapping[tuple[str, ...], torch.Tensor],
        *,
        epoch: int,
    ) -> None:
        """Send each passive party dL/d(its outputs): the sum over the subsets it contributed to
        of dL/dS_subset. Parties whose gradients are identical share one call; every distinct
        gradient passes through `release_gradients` together (per-sample, as DP clips rows)."""
        per_party: dict[str, dict[str, torch.Tensor]] = {}
        sources: dict[str, list[tuple[str, ...]]] = {}
        for sub, leaf in leaves.items():
            if leaf.grad is None:
                continue
            tensor = self.tensor_of(sub)
            for p in sub:
                if p == self.own_name:
                    continue
                grads = per_party.setdefault(p, {})
                grads[tensor] = leaf.grad if tensor not in grads else grads[tensor] + leaf.grad
                sources.setdefault(p, []).append(sub)
        groups: dict[tuple, list[str]] = {}
        for p in per_party:
            groups.setdefault(tuple(sources[p]), []).append(p)
        n = len(ids)
        flat = {}
        for members in groups.values():
            for tensor, g in per_party[members[0]].items():
                flat[f"{'+'.join(members)}/{tensor}"] = (g * n).cpu().numpy()
        released = ctx.release_gradients(flat, epoch=epoch, ids=ids)
        for members in groups.values():
            inputs = {
                t: np.asarray(released[f"{'+'.join(members)}/{t}"], dtype=np.float32) / n
                for t in per_party[members[0]]
            }
            alive = [p for p in members if p not in self.dead]
            while alive:
                try:
                    ctx.call("backward", ids=ids, inputs=inputs, to=alive)
                    break
                except PartyDropped as exc:  # the others' gradients still hold: forward was whole
                    self.lose(ctx, exc.party)
                    if exc.delivered:  # the survivors have applied it: sending again would
                        break  # apply it twice
                    alive = [p for p in alive if p not in self.dead]

    # --- presence and dropouts

    def lose(self, ctx: ActiveContext, party: str) -> None:
        if party not in self.dead:
            self.dead.append(party)
            ctx.log(
                f"{self.method_name}: party {party!r} was lost; its block is treated as "
                "missing from now on (training and test)"
            )

    def sync_dead(self, ctx: ActiveContext) -> None:
        for p in self.config.party_names:
            if p not in ctx.parties:
                self.lose(ctx, p)

    def presence_matrix(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        """Boolean [len(ids), len(blocks)]; lost parties' blocks count as missing."""
        pres = np.asarray(ctx.presence(ids), dtype=bool).copy()
        for p in self.dead:
            pres[:, self.config.party_names.index(p)] = False
        if self.own_name is not None:
            own = ~np.all(np.isnan(self.table.rows(ids)), axis=1)
            pres = np.concatenate([pres, own[:, None]], axis=1)
        return pres

    def present_of(self, pattern: np.ndarray) -> tuple[str, ...]:
        return tuple(
            b for b, on in zip(self.blocks, pattern, strict=True) if on and b not in self.dead
        )

    # --- training loop

    def set_lr(self, epoch: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.config, epoch)

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        cfg = self.config
        self.sync_dead(ctx)
        if ctx.start_epoch == 0 and self.own_name is not None:
            own_rows = self.table.rows(train_ids)
            self.own_scaler = fit_scaler(own_rows[~np.all(np.isnan(own_rows), axis=1)], cfg)
            self._own_scaled = None
        labels = self.table.label_rows(train_ids) if cfg.option("balanced", False) else None
        for epoch in range(ctx.start_epoch, cfg.epochs):
            started = time.perf_counter()
            self.set_lr(epoch)
            self.heads.train()
            if self.own is not None:
                self.own.train()
            rng = np.random.default_rng([cfg.seed, epoch, 0x7A5C])
            stats = {"loss": 0.0, "rows": 0, "steps": 0, "skipped_tasks": 0, "skipped_batches": 0}
            pres = self.presence_matrix(ctx, train_ids)
            batches = pattern_batches(
                train_ids,
                pres,
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                epoch=epoch,
                labels=labels,
                keys=self.batch_keys(train_ids, pres),
            )
            for ids, pattern in batches:
                self.train_batch(ctx, ids, pattern, epoch=epoch, rng=rng, stats=stats)
            self.skipped_tasks_total += stats["skipped_tasks"]
            if stats["skipped_tasks"] or stats["skipped_batches"]:
                ctx.log(
                    f"{self.method_name} epoch {epoch + 1}: skipped {stats['skipped_tasks']} "
                    f"loss terms whose secure sum would have fewer than min_group = "
                    f"{cfg.min_group} contributors, and {stats['skipped_batches']} batches "
                    "with nothing to train"
                )
            elapsed = time.perf_counter() - started
            epoch_stats = {
                "loss": stats["loss"] / max(stats["rows"], 1),
                "rows_per_s": stats["rows"] / max(elapsed, 1e-9),
                "steps": stats["steps"],
                "skipped_tasks": stats["skipped_tasks"],
                "skipped_batches": stats["skipped_batches"],
            }
            for _ in range(len(self.config.party_names) + 1):
                try:
                    ctx.epoch_done(epoch, stats=epoch_stats)
                    break
                except PartyDropped as exc:
                    self.lose(ctx, exc.party)

    def train_batch(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        pattern: np.ndarray,
        *,
        epoch: int,
        rng: np.random.Generator,
        stats: dict[str, Any],
    ) -> None:
        """One batch, redone with the survivors if a party drops during its forward."""
        while True:
            self.sync_dead(ctx)
            present = self.present_of(pattern)
            if not present or not self.trainable(present):
                stats["skipped_batches"] += 1
                return
            try:
                loss, skipped = self.train_step(ctx, ids, present, epoch=epoch, rng=rng)
            except PartyDropped as exc:
                self.lose(ctx, exc.party)
                continue
            stats["skipped_tasks"] += skipped
            if loss is None:
                stats["skipped_batches"] += 1
            else:
                stats["loss"] += loss * len(ids)
                stats["rows"] += len(ids)
                stats["steps"] += 1
            return

    def labels_tensor(self, ids: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(self.table.label_rows(ids), device=self.device)

    # --- evaluation

    def classes_of(self, output: torch.Tensor) -> np.ndarray:
        out = output.detach().cpu().numpy()
        if self.loss_task == "binary":
            return (out.reshape(-1) > 0).astype(np.int64)
        return out.argmax(axis=1).astype(np.int64)

    def random_classes(self, n: int, present: tuple[str, ...]) -> np.ndarray:
        rng = np.random.default_rng(
            [self.config.seed, 0xFA11, subset_code(present, self.blocks), n]
        )
        return rng.integers(0, self.n_classes, size=n)

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        """Test metrics: accuracy averaged over the predictors of each row (the paper's
        per-client average), F1 of the positive class (binary; macro F1 for multiclass)
        averaged over predictors. With `[method] eval_test_missing`, the same model is also
        evaluated with each extra MCAR test rate (drawn as the data split would); see
        `summary()`."""
        self.sync_dead(ctx)
        self.heads.eval()
        if self.own is not None:
            self.own.eval()
        pres = self.presence_matrix(ctx, ids)
        metrics = self.evaluate_presence(ctx, ids, pres)
        cfg = self.config
        for rate in cfg.option("eval_test_missing", []):
            from securevfl.data.missing import presence

            extra = presence(
                MissingSpec(kind="mcar", params=(("p", float(rate)),)),
                parties=cfg.party_names,
                n_rows=len(ids),
                seed=cfg.seed,
                split="test",
            )
            if self.own_name is not None:
                extra = np.concatenate([extra, np.ones((len(ids), 1), dtype=bool)], axis=1)
            self.extra_tests[f"p_test={float(rate):g}"] = self.evaluate_presence(
                ctx, ids, pres & extra
            )
        return metrics

    def evaluate_presence(
        self, ctx: ActiveContext, ids: np.ndarray, pres: np.ndarray
    ) -> dict[str, Any]:
        keep = pres.any(axis=1)
        ids, pres = ids[keep], pres[keep]
        y = self.table.label_rows(ids).astype(np.int64)
        codes = pattern_codes(pres)
        preds: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        n_fallback = n_excluded = 0
        with torch.no_grad():
            for code in np.unique(codes):
                rows = np.flatnonzero(codes == code)
                pattern = pres[rows[0]]
                while True:
                    self.sync_dead(ctx)
                    present = self.present_of(pattern)
                    if not present:
                        pred = Prediction(
                            {"joint": self.random_classes(len(rows), present)}, fallback=True
                        )
                        break
                    try:
                        pred = self.predict_rows(ctx, ids[rows], present)
                        break
                    except PartyDropped as exc:
                        self.lose(ctx, exc.party)
                if pred is None:
                    n_excluded += len(rows)
                    continue
                n_fallback += len(rows) if pred.fallback else 0
                for name, classes in pred.classes.items():
                    preds.setdefault(name, []).append((rows, classes))
        return self.metrics_from(y, preds, n_fallback=n_fallback, n_excluded=n_excluded)

    def metrics_from(
        self,
        y: np.ndarray,
        preds: Mapping[str, list[tuple[np.ndarray, np.ndarray]]],
        *,
        n_fallback: int,
        n_excluded: int,
    ) -> dict[str, Any]:
        from sklearn.metrics import f1_score

        correct = np.zeros(len(y))
        votes = np.zeros(len(y))
        f1s = {}
        binary = self.config.task == "binary"
        for name, parts in preds.items():
            rows = np.concatenate([r for r, _ in parts])
            classes = np.concatenate([c for _, c in parts])
            np.add.at(correct, rows, classes == y[rows])
            np.add.at(votes, rows, 1)
            f1s[name] = float(
                f1_score(y[rows], classes, zero_division=0, average="binary" if binary else "macro")
            )
        scored = votes > 0
        out: dict[str, Any] = {
            "accuracy": float(np.mean(correct[scored] / votes[scored])) if scored.any() else 0.0,
            "f1" if binary else "macro_f1": float(np.mean(list(f1s.values()))) if f1s else 0.0,
            "n_eval": int(scored.sum()),
            "n_fallback": int(n_fallback),
            "n_excluded": int(n_excluded),
        }
        if len(f1s) > 1:
            out["f1_per_predictor"] = f1s
        return out

    # --- state

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.extra_tests:
            out["extra_tests"] = self.extra_tests
        return out

    def state_dict(self) -> dict[str, Any]:
        state = {
            "heads": self.heads.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "dead": list(self.dead),
            "skipped_tasks_total": self.skipped_tasks_total,
        }
        if self.own is not None:
            state["own"] = self.own.state_dict()
            state["own_scaler"] = self.own_scaler.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.heads.load_state_dict(state["heads"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.dead = list(state.get("dead", []))
        self.skipped_tasks_total = int(state.get("skipped_tasks_total", 0))
        if self.own is not None:
            self.own.load_state_dict(state["own"])
            self.own_scaler.load_state_dict(state["own_scaler"])
            self._own_scaled = None


# --------------------------------------------------------------------------------------------
# LASER-VFL


class LaserActive(BlockActive):
    """The heads g_k of every block, the task sampling and the loss (Algorithm 1), and
    prediction for any subset of present blocks (Algorithm 2).

    Secure modes (`mask`, `ckks` with min_group >= 2) cannot use the paper's task sampling as
    is: sums over different subsets of the same rows difference to a party's representation
    (S_{1234} - S_{123} = f_4), within a step or, approximately, across epochs. So each training
    row gets, once, a fixed random family of subsets (`draw_family`) whose every member has at
    least `min_group` passive parties and whose differences are unions of members; the row is
    only ever summed over those members, and each present head trains on the members containing
    it (weight 1/|I|). The loss terms of the paper's objective that the family leaves out are
    counted as `skipped_tasks` in the epoch stats."""

    method_name = "laser"
    tolerates_dropout = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.exact = bool(self.config.option("exact_objective", False))
        self.use_families = bool(self.config.option("families", differencing_matters(self.config)))
        self.families: list[tuple[tuple[str, ...], ...]] = []
        self.family_of_row: dict[int, int] = {}

    def batch_keys(self, ids: np.ndarray, present: np.ndarray) -> np.ndarray | None:
        if not self.use_families:
            return None
        index = {f: i for i, f in enumerate(self.families)}
        keys = np.empty(len(ids), dtype=np.int64)
        for j, row in enumerate(ids.tolist()):
            if row not in self.family_of_row:
                passive = tuple(
                    b
                    for b, on in zip(self.blocks, present[j], strict=True)
                    if on and b != self.own_name
                )
                rng = np.random.default_rng([self.config.seed, 0xFA3, row])
                family = draw_family(passive, self.config.min_group, rng)
                if family not in index:
                    index[family] = len(self.families)
                    self.families.append(family)
                self.family_of_row[row] = index[family]
            keys[j] = self.family_of_row[row]
        return keys

    def family_tasks(self, row: int, present: tuple[str, ...]) -> list[Task]:
        """The loss terms of a row's family (lost parties removed) over blocks `present`."""
        members = []
        for member in self.families[self.family_of_row[row]]:
            alive = tuple(b for b in member if b in present)
            if len(alive) >= self.config.min_group and alive not in members:
                members.append(alive)
        subsets = list(members)
        if self.own_name in present:
            subsets += [(*m, self.own_name) for m in members] + [(self.own_name,)]
        return [Task(head=k, subset=sub, weight=1.0 / len(sub)) for sub in subsets for k in sub]

    def tasks_for(
        self, ids: np.ndarray, present: tuple[str, ...], rng: np.random.Generator
    ) -> tuple[list[Task], int]:
        """The batch's loss terms and how many terms of the paper's objective are left out."""
        if self.use_families:
            tasks = self.family_tasks(int(ids[0]), present)
            return tasks, len(exact_tasks(present)) - len(tasks)
        tasks = exact_tasks(present) if self.exact else sample_tasks(present, rng)
        usable = [t for t in tasks if self.sum_allowed(t.subset)]
        return usable, len(tasks) - len(usable)

    def train_step(
        self,
        ctx: ActiveContext,
        ids: np.ndarray,
        present: tuple[str, ...],
        *,
        epoch: int,
        rng: np.random.Generator,
    ) -> tuple[float | None, int]:
        tasks, skipped = self.tasks_for(ids, present, rng)
        if not tasks:
            return None, skipped
        subsets = list(dict.fromkeys(t.subset for t in tasks))
        sums, leaves = self.forward_sums(ctx, ids, subsets, train=True, epoch=epoch)
        loss = laser_objective(sums, tasks, self.heads, self.labels_tensor(ids), self.loss_task)
        self.update(ctx, ids, leaves, loss, epoch=epoch)
        return float(loss.detach()), skipped

    def predict_subset(
        self, ctx: ActiveContext, ids: np.ndarray, subset: Sequence[str]
    ) -> dict[str, torch.Tensor]:
        """Algorithm 2: every head k in `subset` predicts g_k(mean of the subset's
        representations) on rows `ids` (which must all hold every block of `subset`). Raises
        `securevfl.secure_sum.GroupTooSmall` (through the context) if the subset's sum is
        refused; check `sum_allowed` first. In secure modes, predicting the same rows from two
        different subsets reveals the sum over their difference: ask once per row."""
        subset = tuple(b for b in self.blocks if b in subset)
        self.heads.eval()
        if self.own is not None:
            self.own.eval()
        outs: dict[str, list[torch.Tensor]] = {k: [] for k in subset}
        with torch.no_grad():
            for start in range(0, len(ids), EVAL_BATCH):
                chunk = ids[start : start + EVAL_BATCH]
                sums, _ = self.forward_sums(ctx, chunk, [subset], train=False)
                z = sums[subset] / len(subset)
                for k in subset:
                    outs[k].append(self.heads[k](z))
        return {k: torch.cat(v) for k, v in outs.items()}

    def predict_rows(
        self, ctx: ActiveContext, ids: np.ndarray, present: tuple[str, ...]
    ) -> Prediction:
        if not self.sum_allowed(present):
            guess = self.random_classes(len(ids), present)
            return Prediction({k: guess for k in present}, fallback=True)
        logits = self.predict_subset(ctx, ids, present)
        return Prediction({k: self.classes_of(v) for k, v in logits.items()})

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out["skipped_tasks_total"] = self.skipped_tasks_total
        if self.use_families:
            sizes: dict[str, int] = {}
            for i in self.family_of_row.values():
                key = "+".join(str(len(m)) for m in self.families[i]) or "none"
                sizes[key] = sizes.get(key, 0) + 1
            out["row_families"] = sizes  # member sizes -> training rows
        return out


def _check_laser(cfg: RunConfig) -> None:
    _opt_bool(cfg, "exact_objective")
    _opt_bool(cfg, "families")
    if cfg.option("families") is False and differencing_matters(cfg):
        raise ConfigError(
            "[method] families",
            f"the paper's task sampling sums the same rows over subsets that differ by one "
            f"party, so {cfg.aggregation!r} with min_group = {cfg.min_group} needs the fixed "
            "families; remove the option, or set [run] min_group = 1 to accept unprotected sums",
        )


SPEC = register_method(
    MethodSpec(
        name="laser",
        active=LaserActive,
        party=BlockParty,
        tasks=CLASSIFICATION,
        dp_sgd=("parties",),
        description="LASER-VFL: a head per party over the mean of any subset of present parties",
        extra_checks=(
            option_checks("laser", extra_keys=("exact_objective", "families"), check=_check_laser),
        ),
    )
)
