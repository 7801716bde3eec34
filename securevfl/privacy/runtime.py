"""Privacy at run time: what the roles and the methods call to apply DP, account for it in the
ledger, and stop before a budget is exceeded.

One `RolePrivacy` per role and run holds:

- the role's `RolePlan` (`plan_role`): delta, and each configured mechanism with its sigma
  (calibrated from ``target_epsilon`` before training where one was configured), validated
  against the role's ``max_epsilon`` (a budget that cannot pay for one step is a config error);
- the run's `PrivacyLedger` (``RUN_DIR/ledger.jsonl``) and the role's budgets.

Every charge (`RolePrivacy.charge`) checks the budget of its (role, mechanism) *before* it
writes the ledger event, and the event is written (fsynced) *before* the release leaves the
process; `BudgetExceeded` stops the role, and through the aggregator the whole federation.

Accounting, as DESIGN.md section 3 asks:

- label DP and embedding DP (releases to other parties, who know every batch's rows) are
  accounted without amplification: sample rate 1 and one step per use of a row. `RowReleases`
  counts the uses of each row and charges one event each time the most-used row's count grows
  (so a row released once per epoch costs one step per epoch);
- DP-SGD is charged one step per optimizer step at sample rate ``batch_size / N``
  (amplification by subsampling), which holds against observers of the trained model who do not
  know the batch schedule; see docs/privacy.md.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from securevfl.config import ConfigError, DPConfig, RunConfig
from securevfl.data.rowarrays import _map_of
from securevfl.privacy.accounting import calibrate_noise, default_delta, epsilon
from securevfl.privacy.budget import BudgetExceeded, PrivacyBudget
from securevfl.privacy.ledger import LedgerEvent, PrivacyLedger
from securevfl.privacy.mechanisms import (
    DPSGD,
    EmbeddingDP,
    LabelGradientDP,
    Mechanism,
    NoiseSource,
    ReleaseMechanism,
)

__all__ = [
    "PrivateTraining",
    "ReceivedGradients",
    "RolePlan",
    "RolePrivacy",
    "RowReleases",
    "check_federation",
    "plan_role",
    "resolve_delta",
]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class RolePlan:
    """One role's privacy configuration, resolved for a training set of ``n_train`` rows.

    ``calibrated`` maps a mechanism name to the sigma calibrated from its ``target_epsilon``.
    """

    role: str
    n_train: int
    delta: float
    accountant: str
    max_epsilon: float | None
    max_epsilon_key: str
    label_dp: LabelGradientDP | None = None
    embedding_dp: EmbeddingDP | None = None
    dp_sgd: DPSGD | None = None
    dp_sgd_sample_rate: float = 1.0
    calibrated: tuple[tuple[str, float], ...] = ()

    @property
    def mechanisms(self) -> tuple[Mechanism, ...]:
        return tuple(m for m in (self.label_dp, self.embedding_dp, self.dp_sgd) if m is not None)


def hash_seed(*parts: object) -> int:
    """A 128-bit seed from the config's noise_seed and names (each role and mechanism its own)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:16], "little")


def resolve_delta(cfg: RunConfig, *, n_train: int) -> float:
    """``[privacy] delta``, or the default for ``n_train`` rows (`default_delta`).

    Refuses (`ConfigError` naming ``[privacy] delta``) a delta >= 1/N: such a delta allows a
    mechanism to publish one row outright.
    """
    if isinstance(n_train, bool) or not isinstance(n_train, int | np.integer) or n_train < 1:
        raise ConfigError("[data] path", f"there are no training rows (N = {n_train!r})")
    n_train = int(n_train)
    if cfg.delta is None:
        return default_delta(n_train)
    if cfg.delta >= 1.0 / n_train:
        raise ConfigError(
            "[privacy] delta",
            f"must be smaller than 1/N = {1.0 / n_train:.3g} for N = {n_train} training rows, "
            f"got {cfg.delta:g}: a delta of 1/N lets a mechanism publish one row outright; use "
            f"{default_delta(n_train):g} (the default) or smaller",
        )
    return float(cfg.delta)


def _sigma(
    dp: DPConfig, key: str, *, delta: float, accountant: str, sample_rate: float, steps: int
) -> tuple[float, bool]:
    if dp.noise_multiplier is not None:
        return float(dp.noise_multiplier), False
    try:
        sigma = calibrate_noise(
            target_epsilon=float(dp.target_epsilon),
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
        )
    except ValueError as exc:
        raise ConfigError(f"{key}.target_epsilon", str(exc)) from None
    return sigma, True


def plan_role(cfg: RunConfig, *, role: str, n_train: int) -> RolePlan:
    """Resolve ``role``'s mechanisms for ``n_train`` training rows; raise `ConfigError`
    (naming the key) for delta >= 1/N, a target epsilon that cannot be reached, or a
    ``max_epsilon`` that cannot pay for a single step of one of the role's mechanisms.

    A ``target_epsilon`` is calibrated for the configured epochs: label DP and embedding DP
    for ``epochs`` uses of each row (sample rate 1), DP-SGD for ``epochs * ceil(N / batch)``
    steps at sample rate ``batch / N``.
    """
    delta = resolve_delta(cfg, n_train=n_train)
    accountant = cfg.accountant
    sample_rate = min(1.0, cfg.batch_size / n_train)
    sgd_steps = cfg.epochs * math.ceil(n_train / cfg.batch_size)
    if role == cfg.active_name:
        label, embedding, sgd = cfg.label_dp, None, cfg.head_dp_sgd
        keys = {"label_dp": "[privacy] label_dp", "dp_sgd": "[active] dp_sgd"}
        max_epsilon, max_key = cfg.active_max_epsilon, "[active] max_epsilon"
    else:
        party = cfg.party(role)
        label, embedding, sgd = None, party.embedding_dp, party.dp_sgd
        keys = {
            "embedding_dp": f"[parties.{role}] embedding_dp",
            "dp_sgd": f"[parties.{role}] dp_sgd",
        }
        max_epsilon, max_key = party.max_epsilon, f"[parties.{role}] max_epsilon"
    built: dict[str, Mechanism] = {}
    calibrated: list[tuple[str, float]] = []
    for name, dp, cls, q, steps in (
        ("label_dp", label, LabelGradientDP, 1.0, cfg.epochs),
        ("embedding_dp", embedding, EmbeddingDP, 1.0, cfg.epochs),
        ("dp_sgd", sgd, DPSGD, sample_rate, sgd_steps),
    ):
        if dp is None:
            continue
        sigma, was_calibrated = _sigma(
            dp, keys[name], delta=delta, accountant=accountant, sample_rate=q, steps=steps
        )
        if was_calibrated:
            calibrated.append((name, sigma))
        generator = None
        if cfg.noise_seed is not None and name != "dp_sgd":  # tests only: not private
            from securevfl.privacy.mechanisms import NoiseSource

            generator = NoiseSource(seed=hash_seed(cfg.noise_seed, role, name))
        built[name] = cls(noise_multiplier=sigma, clip=dp.clip, generator=generator)
        if max_epsilon is not None:
            _check_one_step(
                role,
                built[name],
                q=q if name == "dp_sgd" else 1.0,
                delta=delta,
                accountant=accountant,
                max_epsilon=max_epsilon,
                max_key=max_key,
                mechanism_key=keys[name],
            )
    return RolePlan(
        role=role,
        n_train=int(n_train),
        delta=delta,
        accountant=accountant,
        max_epsilon=max_epsilon,
        max_epsilon_key=max_key,
        label_dp=built.get("label_dp"),
        embedding_dp=built.get("embedding_dp"),
        dp_sgd=built.get("dp_sgd"),
        dp_sgd_sample_rate=sample_rate,
        calibrated=tuple(calibrated),
    )


def _check_one_step(
    role: str,
    mechanism: Mechanism,
    *,
    q: float,
    delta: float,
    accountant: str,
    max_epsilon: float,
    max_key: str,
    mechanism_key: str,
) -> None:
    budget = PrivacyBudget(
        role=role,
        mechanism=mechanism.name,
        max_epsilon=max_epsilon,
        delta=delta,
        accountant=accountant,
    )
    one = budget.epsilon_after(history_so_far=[], next_step=(mechanism.noise_multiplier, q, 1))
    if one > max_epsilon:
        raise ConfigError(
            max_key,
            f"max_epsilon = {max_epsilon:g} cannot pay for a single {mechanism.name} step: one "
            f"step at noise_multiplier {mechanism.noise_multiplier:.4g} (sample rate {q:.4g}) "
            f"already costs epsilon {one:.4g} at delta {delta:g}; raise max_epsilon or the noise "
            f"multiplier in {mechanism_key}",
        )


def check_federation(cfg: RunConfig, *, n_train: int) -> dict[str, RolePlan]:
    """`plan_role` for every role: run before any process starts, so that a bad privacy setting
    fails with exit status 2 and the key. Returns role -> plan."""
    return {role: plan_role(cfg, role=role, n_train=n_train) for role in cfg.role_names}


# ------------------------------------------------------------------------------- the role


class RolePrivacy:
    """One role's privacy state in a run: its plan, the run's ledger and its budgets.

    ``epoch`` is the epoch in progress, for charges whose caller does not know it (a passive
    party learns epochs from the active party's checkpoint calls).
    """

    def __init__(self, *, plan: RolePlan, ledger: PrivacyLedger) -> None:
        self.plan = plan
        self.role = plan.role
        self.ledger = ledger
        self.epoch = 0
        self._left: dict[str, tuple[tuple[float, float], int]] = {}
        self._rows: np.ndarray | None = None
        self._releases: dict[str, RowReleases] = {}
        self._unprotected = {
            (e["role"], e["what"])
            for e in ledger.events
            if isinstance(e, dict) and e["kind"] == "unprotected"
        }
        seeded = [
            m.name
            for m in plan.mechanisms
            if m.name != "dp_sgd" and m.generator is not None and not m.generator.private
        ]
        if seeded:
            self.record_unprotected_once(
                what=f"{', '.join(seeded)} noise",
                reason="[privacy] noise_seed: the noise is reproducible from the config, so it "
                "protects nothing against whoever has the config (for tests only)",
            )
        for name, sigma in plan.calibrated:
            logger.info(
                "%s: %s noise multiplier %.4g calibrated from its target epsilon",
                self.role,
                name,
                sigma,
            )

    @property
    def delta(self) -> float:
        return self.plan.delta

    @property
    def accountant(self) -> str:
        return self.plan.accountant

    def set_rows(self, ids: np.ndarray) -> None:
        """Every sample id this role may release a row of (for per-row use counts). A sorted
        id list in a file (a streamed table's, as a read-only map) is kept as is, not copied."""
        self._rows = sorted_unique(ids)

    def steps_spent(self, mechanism: str) -> int:
        """Steps of ``mechanism`` this role has in the ledger (earlier runs included)."""
        return sum(
            e.steps
            for e in self.ledger.events
            if isinstance(e, LedgerEvent) and e.role == self.role and e.mechanism == mechanism
        )

    def _budget(self, mechanism: str) -> PrivacyBudget:
        return PrivacyBudget(
            role=self.role,
            mechanism=mechanism,
            max_epsilon=float(self.plan.max_epsilon),
            delta=self.delta,
            accountant=self.accountant,
        )

    def charge(
        self,
        mechanism: Mechanism,
        *,
        steps: int = 1,
        sample_rate: float = 1.0,
        epoch: int | None = None,
        note: str = "",
    ) -> LedgerEvent:
        """Check the budget for ``steps`` more steps of ``mechanism``, then record them.

        Raises `BudgetExceeded` (nothing recorded) when they would take the role past its
        ``max_epsilon``: call this before the release leaves the process. ``epoch`` counts
        from 0 like the ledger; the exception's message counts from 1 like the progress lines.
        """
        epoch = self.epoch if epoch is None else epoch
        if self.plan.max_epsilon is not None:
            self._check(mechanism, steps=steps, sample_rate=sample_rate, epoch=epoch)
        return self.ledger.record_release(
            mechanism,
            role=self.role,
            delta=self.delta,
            steps=steps,
            epoch=epoch,
            sample_rate=sample_rate,
            note=note,
        )

    def _check(self, mechanism: Mechanism, *, steps: int, sample_rate: float, epoch: int) -> None:
        # how many more steps fit is computed once per (sigma, q) with O(log k) accountant
        # calls, not once per step: the history is the ledger's, so it is what the audit sees
        key = (mechanism.noise_multiplier, float(sample_rate))
        cached = self._left.get(mechanism.name)
        if cached is None or cached[0] != key or cached[1] < steps:
            budget = self._budget(mechanism.name)
            history = self.ledger.history(role=self.role, mechanism=mechanism.name)
            left = budget.steps_that_fit(
                noise_multiplier=key[0], sample_rate=key[1], history_so_far=history
            )
            if left < steps:
                reached = budget.epsilon_after(
                    history_so_far=history, next_step=(key[0], key[1], steps)
                )
                raise BudgetExceeded(
                    role=self.role,
                    mechanism=mechanism.name,
                    max_epsilon=budget.max_epsilon,
                    epsilon=reached,
                    delta=self.delta,
                    epoch=epoch + 1,
                )
            cached = (key, left)
        self._left[mechanism.name] = (key, cached[1] - steps)

    def record_unprotected_once(
        self, *, what: str, reason: str, role: str | None = None, epoch: int | None = None
    ) -> bool:
        """Record a release with no formal guarantee unless the ledger already has one for the
        same (role, what); returns whether it recorded."""
        role = role or self.role
        if (role, what) in self._unprotected:
            return False
        self.ledger.record_unprotected(
            role=role, what=what, reason=reason, epoch=self.epoch if epoch is None else epoch
        )
        self._unprotected.add((role, what))
        return True

    def _rows_of(self, mechanism: ReleaseMechanism) -> RowReleases:
        if mechanism.name not in self._releases:
            self._releases[mechanism.name] = RowReleases(self, mechanism, universe=self._rows)
        return self._releases[mechanism.name]

    def release_gradients(
        self, grads: Mapping[str, np.ndarray], *, ids: np.ndarray | None, epoch: int
    ) -> dict[str, np.ndarray]:
        """The active party's gradients as they may leave it: with label DP, every row clipped
        jointly over all of ``grads`` and noised (charged first); without it, unchanged, and
        the ledger says once that gradients went out with no formal guarantee."""
        if self.plan.label_dp is None:
            self.record_unprotected_once(
                what="gradients returned to the passive parties",
                reason="no [privacy] label_dp: the gradients carry label information "
                "(measure it with `securevfl audit RUN_DIR --attack`)",
                epoch=epoch,
            )
            return dict(grads)
        return self._rows_of(self.plan.label_dp).release(grads, ids=ids, epoch=epoch)

    def release_contributions(
        self, values: Mapping[str, np.ndarray], *, ids: np.ndarray, epoch: int | None = None
    ) -> dict[str, np.ndarray]:
        """A passive party's contributions of one call with embedding DP: each row clipped
        jointly over all of ``values`` and noised (charged first). Unchanged without it."""
        if self.plan.embedding_dp is None or not values:
            return dict(values)
        for name, v in values.items():
            if np.ndim(v) < 1 or np.shape(v)[0] != len(ids):
                raise ValueError(
                    f"embedding_dp clips rows, but contribution {name!r} has shape "
                    f"{tuple(np.shape(v))} for {len(ids)} rows: this method's contributions are "
                    f"not per-row, so remove embedding_dp from [parties.{self.role}]"
                )
        epoch = self.epoch if epoch is None else epoch
        return self._rows_of(self.plan.embedding_dp).release(values, ids=ids, epoch=epoch)

    def spent(self) -> dict[str, float]:
        """Epsilon this role has spent so far, per mechanism (at the run's delta)."""
        return {
            m.name: epsilon(
                history=self.ledger.history(role=self.role, mechanism=m.name),
                delta=self.delta,
                accountant=self.accountant,
            )
            for m in self.plan.mechanisms
        }


class RowReleases:
    """Per-row use counts of one release mechanism (label DP or embedding DP) at one role.

    Such releases go to parties that know each batch's rows, so no amplification: the
    accountant composes, for the mechanism, as many full Gaussian steps as the most-used row
    has been released. A release that raises that maximum is charged (budget check, then the
    ledger event) before the noise is even drawn. After a resume every row is counted as used
    as often as the ledger says the most-used one was (conservative).

    A release without sample ids (a method that does not pass them) is counted as if it
    touched every row once per ``N`` rows it released in its epoch.
    """

    def __init__(
        self, privacy: RolePrivacy, mechanism: ReleaseMechanism, *, universe: np.ndarray | None
    ) -> None:
        self.privacy = privacy
        self.mechanism = mechanism
        self.base = privacy.steps_spent(mechanism.name)
        self.recorded = self.base
        self.ids = sorted_unique(universe) if universe is not None else np.empty(0, np.int64)
        # each row's uses in this run beyond `base`, in the narrowest unsigned type that holds
        # them (1 byte a row until some row is used 256 times), and the largest of them: a
        # release reads and writes only its own rows' entries
        self.uses = np.zeros(len(self.ids), dtype=np.uint8)
        self.most = 0
        self._anonymous_rows: dict[int, int] = {}
        self._anonymous_steps = 0
        self._looked_up = 0  # ids looked up in a mapped universe since its pages went back

    @property
    def counts(self) -> np.ndarray:
        """int64, each row's uses counted by the ledger (`base` plus this run's): built on
        request, for inspection."""
        return self.base + self.uses.astype(np.int64)

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        pos = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        if len(self.ids) == 0 or not np.array_equal(self.ids[pos], ids):
            raise ValueError(f"{self.mechanism.name}: release of rows this role was not told of")
        mapped = _map_of(self.ids)
        self._looked_up += len(ids)
        if mapped is not None and self._looked_up >= _RELEASE_LOOKUPS:
            mapped.madvise(mmap.MADV_DONTNEED)  # a read-only file map: its pages go back
            self._looked_up = 0
        return pos

    def release(
        self, values: Mapping[str, np.ndarray], *, ids: np.ndarray | None, epoch: int
    ) -> dict[str, np.ndarray]:
        """Charge the release if it raises the most-used row's count, then clip and noise."""
        rows = int(np.shape(next(iter(values.values())))[0])
        most = self.most
        anonymous = self._anonymous_steps
        if ids is None:
            seen = self._anonymous_rows.get(epoch, 0) + rows
            n = max(self.privacy.plan.n_train, 1)
            anonymous += math.ceil(seen / n) - math.ceil(self._anonymous_rows.get(epoch, 0) / n)
        else:
            at, times = np.unique(self._positions(ids), return_counts=True)
            used = self.uses[at].astype(np.int64) + times
            most = max(most, int(used.max(initial=0)))  # counts only grow: the max is local
        new_max = self.base + most + anonymous
        if new_max > self.recorded:
            self.privacy.charge(
                self.mechanism,
                steps=new_max - self.recorded,
                epoch=epoch,
                note="per-row uses, no amplification",
            )
            self.recorded = new_max
        if ids is not None:
            if most > np.iinfo(self.uses.dtype).max:  # a row used 256 (65536, ...) times
                self.uses = self.uses.astype(np.min_scalar_type(2 * most))
            self.uses[at] = used
        self.most = most
        self._anonymous_steps = anonymous
        if ids is None:
            self._anonymous_rows[epoch] = self._anonymous_rows.get(epoch, 0) + rows
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in values.items()}
        if isinstance(self.mechanism.generator, NoiseSource):
            self.mechanism.generator.at_epoch(epoch)  # seeded noise: resumable per epoch
        with torch.no_grad():
            noised = self.mechanism.apply(tensors)
        return {
            k: noised[k].numpy().astype(np.asarray(values[k]).dtype, copy=False) for k in values
        }


_RELEASE_LOOKUPS = 1 << 20  # ids looked up in a mapped universe before its pages go back


def sorted_unique(ids: Any) -> np.ndarray:
    """`np.unique(ids)` as int64; an int64 array over a map of a file (a streamed table's id
    list, or a view of one) that is already sorted and unique (checked a block at a time) is
    returned as is."""
    mapped = isinstance(ids, np.ndarray) and _map_of(ids) is not None
    if mapped and ids.dtype == np.int64 and ids.ndim == 1:
        from securevfl.data.rowarrays import id_slices

        last = None
        for _, block in id_slices(ids):
            if (last is not None and block[0] <= last) or not (block[1:] > block[:-1]).all():
                break
            last = block[-1] if len(block) else last
        else:
            return ids
    return np.unique(np.asarray(ids, dtype=np.int64))


# ------------------------------------------------------------------------------- DP-SGD


class PrivateTraining:
    """A model and its optimizer, trained with DP-SGD (Opacus) when the role's plan has
    ``dp_sgd``, plainly otherwise; the same calls either way.

    Use ``training.model`` for forward passes (with DP-SGD it is Opacus's GradSampleModule,
    which records per-sample gradients), ``training.module`` for state dicts, and
    ``training.step(epoch=...)`` instead of ``optimizer.step()``: with DP-SGD it first charges
    the step (budget check, ledger event at sample rate batch / N), then steps. Call backward
    once per step. ``loss_reduction`` says how the loss was reduced over the batch ("mean": the
    gradient rows a party receives carry 1/B).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        privacy: RolePrivacy | None,
        expected_batch_size: int,
        loss_reduction: str = "mean",
    ) -> None:
        self.privacy = privacy
        self.mechanism = privacy.plan.dp_sgd if privacy is not None else None
        self.module = model
        if self.mechanism is None:
            self.model, self.optimizer = model, optimizer
        else:
            self.model, self.optimizer = self.mechanism.wrap(
                model,
                optimizer,
                expected_batch_size=expected_batch_size,
                loss_reduction=loss_reduction,
            )
            self.module = self.model._module

    @property
    def private(self) -> bool:
        return self.mechanism is not None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, *, epoch: int | None = None) -> None:
        """Charge a DP-SGD step (raises `BudgetExceeded` before stepping), then step."""
        self.charge(epoch=epoch)
        self.apply()

    def charge(self, *, epoch: int | None = None) -> None:
        """The ledger half of `step`: charge one DP-SGD step (raises `BudgetExceeded`); the
        caller then applies it with `apply` before the weights are used again. Lets a role
        release what the step's gradients allow first and update while the others compute."""
        if self.mechanism is not None:
            self.privacy.charge(
                self.mechanism,
                steps=1,
                sample_rate=self.privacy.plan.dp_sgd_sample_rate,
                epoch=epoch,
                note="DP-SGD step; amplified for observers of the model only",
            )

    def apply(self) -> None:
        """The optimizer half of `step` (after `charge`)."""
        self.optimizer.step()


def private_training(
    owner: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    expected_batch_size: int,
    loss_reduction: str = "mean",
) -> PrivateTraining:
    """`PrivateTraining` with the `RolePrivacy` the role gave ``owner`` (a method, or the
    active party's context) as its ``privacy`` attribute; plain training when there is none."""
    return PrivateTraining(
        model,
        optimizer,
        privacy=getattr(owner, "privacy", None),
        expected_batch_size=expected_batch_size,
        loss_reduction=loss_reduction,
    )


# ------------------------------------------------------------------------------- received


class ReceivedGradients:
    """What a passive party received in ``backward`` calls, kept (only with ``[privacy]
    record_received = true``) for the label-inference audit: per tensor name, the sample id,
    the epoch and the batch size of every row, and the row itself.

    Stored with `numpy.savez` (plain arrays; read back with allow_pickle=False) at
    ``RUN_DIR/received/<party>.npz``; keys
    ``names`` (the tensor names) and ``t<i>_ids``, ``t<i>_epoch``, ``t<i>_batch``,
    ``t<i>_grads`` for the i-th name.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._parts: dict[str, list[tuple[np.ndarray, ...]]] = {}
        if self.path.exists():  # a resumed run keeps what the first part received
            for name, block in self.load(self.path).items():
                self._parts[name] = [(block["ids"], block["epoch"], block["batch"], block["grads"])]

    def add(self, tensors: Mapping[str, np.ndarray], *, ids: np.ndarray, epoch: int) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        for name, value in tensors.items():
            v = np.asarray(value)
            if v.ndim < 1 or v.shape[0] != n or not np.issubdtype(v.dtype, np.floating):
                continue
            self._parts.setdefault(name, []).append(
                (
                    ids,
                    np.full(n, epoch, dtype=np.int64),
                    np.full(n, n, dtype=np.int64),
                    v.reshape(n, -1).astype(np.float32),
                )
            )

    def save(self) -> Path | None:
        if not self._parts:
            return None
        arrays: dict[str, np.ndarray] = {"names": np.array(sorted(self._parts), dtype=str)}
        for i, name in enumerate(sorted(self._parts)):
            for j, field in enumerate(("ids", "epoch", "batch", "grads")):
                arrays[f"t{i}_{field}"] = np.concatenate([p[j] for p in self._parts[name]])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, self.path)
        return self.path

    @staticmethod
    def load(path: Path) -> dict[str, dict[str, np.ndarray]]:
        """name -> {"ids", "epoch", "batch", "grads"}; refuses pickled content."""
        with np.load(path, allow_pickle=False) as data:
            names = [str(n) for n in data["names"]]
            return {
                name: {f: data[f"t{i}_{f}"] for f in ("ids", "epoch", "batch", "grads")}
                for i, name in enumerate(names)
            }
