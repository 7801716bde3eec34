"""What a VFEM fit needs besides the iteration: its resolved options, the active party's view of
the parties (secure sums, per-party calls, broadcasts), the fit's rows, and the watch for an
oscillating iteration."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from securevfl.methods.base import ActiveContext, SumSpec


@dataclass(frozen=True)
class FitOptions:
    """The `[method]` options as a fit uses them (defaults that depend on the run resolved)."""

    intercept: bool
    eta: float | None  # None: from the spectrum
    max_iter: int
    tol_loss: float
    tol_beta: float
    se: bool
    sem_step: float
    level: float
    checkpoint_every: int
    init: str = "impute"

    @classmethod
    def from_config(cls, cfg: Any) -> FitOptions:
        o = cfg.options
        return cls(
            intercept=o.intercept,
            eta=None if o.eta == "auto" else float(o.eta),
            max_iter=o.max_iter,
            tol_loss=o.tol_loss,
            tol_beta=o.tol_beta,
            se=o.se == "sem",
            # CKKS sums carry ~1e-7 relative noise: a longer difference step keeps SEM accurate
            sem_step=o.sem_step
            if o.sem_step is not None
            else (1e-3 if cfg.aggregation == "ckks" else 1e-5),
            level=o.level,
            checkpoint_every=o.checkpoint_every,
            init=getattr(o, "init", "impute"),
        )


class Federation:
    """The active party's view of the parties in one fit: secure sums, per-party calls,
    broadcasts. With no passive party (a single-party fit of the active party's own block),
    every call is skipped."""

    def __init__(self, ctx: ActiveContext, parties: Sequence[str]) -> None:
        self.ctx = ctx
        self.parties = tuple(parties)

    def sums(
        self,
        op: str,
        *,
        ids: np.ndarray,
        names: Sequence[str],
        args: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Secure sums over every party of each tensor in `names` (empty dict if no party)."""
        if not self.parties:
            return {}
        specs = [SumSpec(key=n, tensor=n, group=self.parties) for n in names]
        got = self.ctx.call(op, ids=ids, args=dict(args or {}), sums=specs)
        return {n: np.asarray(got[n], dtype=np.float64) for n in names}

    def each(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Callable[[int, str], dict[str, np.ndarray]],
    ) -> None:
        """One call per party (inputs meant for that party only)."""
        for k, party in enumerate(self.parties):
            self.ctx.call(op, ids=ids, args=dict(args), inputs=inputs(k, party), to=[party])

    def broadcast(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        collect: Sequence[str] = (),
    ) -> dict[str, np.ndarray]:
        if not self.parties:
            return {}
        return self.ctx.call(
            op,
            ids=ids,
            args=dict(args or {}),
            inputs=dict(inputs or {}),
            to=list(self.parties),
            collect=list(collect),
        )


class OscillationTracker:
    """Watches the summed per-row predictor m^(t) (which the active party sees anyway) for the
    iteration oscillating: successive changes dm^(t) pointing in opposite directions means the
    dominant eigenvalue of the map's Jacobian is rho < 0, i.e. 1 - eta lambda_max = rho. After
    three such steps in a row, `update` returns lambda_max = (1 - rho) / eta."""

    def __init__(self) -> None:
        self.prev_m: np.ndarray | None = None
        self.prev_dm: np.ndarray | None = None
        self.count = 0

    def update(self, m: np.ndarray, eta: float) -> float | None:
        found = None
        if self.prev_m is not None:
            dm = m - self.prev_m
            if self.prev_dm is not None:
                denom = float(self.prev_dm @ self.prev_dm)
                # ignore changes at the level of fixed-point noise
                if denom > 1e-18 * len(m):
                    rho = float(dm @ self.prev_dm) / denom
                    self.count = self.count + 1 if rho < -0.3 else 0
                    if self.count >= 3:
                        found = (1.0 - rho) / eta
                        self.count = 0
                        dm = None
            self.prev_dm = dm
        self.prev_m = m
        return found


@dataclass
class Design:
    """One fit: its rows, which parties take part, and the missing rows of each party."""

    kind: str  # "blocks" | "impute" | "complete"
    ids: np.ndarray
    positions: np.ndarray  # into the prepared (training) rows
    parties: tuple[str, ...]
    missing: dict[str, np.ndarray]  # party -> bool per design row (blocks designs only)
    use_own: bool

    @property
    def model_x(self) -> bool:
        return self.kind == "blocks"
