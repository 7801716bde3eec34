"""LASER-VFL (Valdeira, Wang, Chi; ICLR 2025): one predictor per subset of present parties.

Every feature block k has a representation model f_k (at its party) and a head g_k (at the
active party, which holds the labels). Head k's predictor for a subset I of present blocks,
k in I, is ``g_k(mean_{i in I} f_i(x_i))``: 2K networks give K·2^(K-1) predictors. Training
samples, for every present block k and every size i, one subset of that size containing k and
weights its loss by ``a_i = C(K_o-1, i-1)/i``, an unbiased estimate of the loss over every
subset (Lemma 1). Batches are pattern-homogeneous, so the secure sums of a batch have fixed
groups. Inference (Algorithm 2): every present block's head predicts from the mean over all
present blocks.

On secure sums: one call per batch asks for the sum of the passive parties' representations
over each distinct sampled subset; the count of present blocks needs no sum (the active party
learnt each row's presence at set-up). A subset with fewer than `min_group` passive members is
refused in secure modes, so LASER skips it before asking and counts it (`skipped_tasks`); a test
row whose present passive blocks are too few for a sum gets a random class (`n_fallback`).
The machinery (party models, batches, loops, gradients) is the block toolkit
(`securevfl.methods.blocks`); this module is the paper's part.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import combinations
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.lazy import torch
from securevfl.methods import examples
from securevfl.methods.base import REPRESENTATION_SECURE_DEFAULTS, ActiveContext, MethodSpec
from securevfl.methods.blocks.active import BlockActive
from securevfl.methods.blocks.batches import RowKeys, chunks
from securevfl.methods.blocks.evaluation import Prediction
from securevfl.methods.blocks.nets import task_loss
from securevfl.methods.blocks.options import (
    CLASSIFICATION,
    BlockOptions,
    check_block_options,
    differencing_matters,
)
from securevfl.methods.blocks.party import BLOCK_OPERATIONS
from securevfl.methods.options import option

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
    sums: Mapping[tuple[str, ...], Any],
    tasks: Iterable[Task],
    heads: Mapping[str, Any],
    y: Any,
    task: str,
) -> Any:
    """``sum_t weight_t * loss(g_head(S_subset / |subset|), y)`` with `sums` the representation
    sums of the subsets (each loss is a batch mean)."""
    total = torch.zeros((), device=y.device)
    for t in tasks:
        total = total + t.weight * task_loss(task, heads[t.head](sums[t.subset] / len(t.subset)), y)
    return total


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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        opts = self.config.options
        self.exact = opts.exact_objective
        self.use_families = (
            differencing_matters(self.config) if opts.families is None else opts.families
        )
        self.families: list[tuple[tuple[str, ...], ...]] = []
        # each row's family, drawn once: a dict in memory, a file of the row cache for a table
        # streamed from disk (4 bytes a row, not a dict entry)
        self.family_of_row: dict[int, int] | RowKeys = (
            RowKeys(self.table)
            if self.use_families and getattr(self.table, "streamed", False)
            else {}
        )

    def batch_keys(self, ids: np.ndarray, present: np.ndarray) -> np.ndarray | None:
        if not self.use_families:
            return None
        index = {f: i for i, f in enumerate(self.families)}
        if isinstance(self.family_of_row, RowKeys):  # the batch's keys read and written at once
            keys = self.family_of_row.get(ids)
            new = np.flatnonzero(keys < 0)
            for j in new.tolist():
                keys[j] = self._draw_family(int(ids[j]), present[j], index)
            self.family_of_row.put(ids[new], keys[new])
            return keys
        keys = np.empty(len(ids), dtype=np.int64)
        for j, row in enumerate(ids.tolist()):
            if row not in self.family_of_row:
                self.family_of_row[row] = self._draw_family(row, present[j], index)
            keys[j] = self.family_of_row[row]
        return keys

    def _draw_family(self, row: int, present: np.ndarray, index: dict) -> int:
        """The index (in `families`, added if new) of row `row`'s family, drawn from its present
        passive blocks."""
        passive = tuple(
            b for b, on in zip(self.blocks, present, strict=True) if on and b != self.own_name
        )
        rng = np.random.default_rng([self.config.seed, 0xFA3, row % 2**63])
        family = draw_family(passive, self.config.min_group, rng)
        if family not in index:
            index[family] = len(self.families)
            self.families.append(family)
        return index[family]

    def family_tasks(self, row: int, present: tuple[str, ...]) -> list[Task]:
        """The loss terms of a row's family (lost parties removed) over blocks `present`."""
        from securevfl.secure_sum import isolating_set

        members = []
        for member in self.families[self.family_of_row[row]]:
            alive = tuple(b for b in member if b in present)
            if len(alive) >= self.config.min_group and alive not in members:
                members.append(alive)
        family = tuple(frozenset(m) for m in members)
        if members and isolating_set(family, self.config.min_group) is not None:
            # a lost party broke the family's partition ({0,1,3} and {0,3} differ by 1):
            # keep only the largest member, which differences to nothing
            members = [max(members, key=len)]
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
    ) -> dict[str, Any]:
        """Algorithm 2: every head k in `subset` predicts g_k(mean of the subset's
        representations) on rows `ids` (which must all hold every block of `subset`). Raises
        `securevfl.secure_sum.GroupTooSmall` (through the context) if the subset's sum is
        refused; check `sum_allowed` first. In secure modes, predicting the same rows from two
        different subsets reveals the sum over their difference: ask once per row."""
        subset = tuple(b for b in self.blocks if b in subset)
        self.heads.eval()
        if self.own is not None:
            self.own.eval()
        outs: dict[str, list[Any]] = {k: [] for k in subset}
        with torch.no_grad():
            for chunk in chunks(ids):
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
            if isinstance(self.family_of_row, RowKeys):
                per_family = self.family_of_row.counts()
            else:
                per_family = {}
                for i in self.family_of_row.values():
                    per_family[i] = per_family.get(i, 0) + 1
            for i, rows in sorted(per_family.items()):
                key = "+".join(str(len(m)) for m in self.families[i]) or "none"
                sizes[key] = sizes.get(key, 0) + rows
            out["row_families"] = sizes  # member sizes -> training rows
        return out


@dataclass(frozen=True)
class LaserOptions(BlockOptions):
    exact_objective: bool = option(
        False, "train the full objective over every (head, subset) instead of sampling tasks"
    )
    families: bool | None = option(
        None,
        "fixed per-row families of groups of >= min_group parties (default: on in secure modes, "
        "where the paper's sampling would difference sums to one party)",
    )


def check_laser(cfg: Any, opts: LaserOptions) -> None:
    check_block_options(cfg, opts)
    if opts.families is False and differencing_matters(cfg):
        raise ConfigError(
            "[method] families",
            f"the paper's task sampling sums the same rows over subsets that differ by one "
            f"party, so {cfg.aggregation!r} with min_group = {cfg.min_group} needs the fixed "
            "families; remove the option, or set [run] min_group = 1 to accept unprotected sums",
        )


SPEC = MethodSpec(
    name="laser",
    active=LaserActive,
    party="securevfl.methods.blocks.party:BlockParty",
    operations=BLOCK_OPERATIONS,
    secure_defaults=REPRESENTATION_SECURE_DEFAULTS,  # CKKS sized to representations
    options=LaserOptions,
    tasks=CLASSIFICATION,
    dp_sgd=("parties",),
    encodings=("onehot", "embedding"),
    tolerates_dropout=True,
    description="LASER-VFL: a head per party over the mean of any subset of present parties",
    checks=(check_laser,),
    example=partial(examples.classification, method="laser", active_block=True, p_missing=0.2),
)
