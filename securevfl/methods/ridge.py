"""Ridge regression on secure sums: the worked example of `docs/adding-a-method.md`.

Model: y = b + sum_k z_k' beta_k, where z_k are party k's columns standardised on the training
rows it holds (0 on rows it lacks), fitted by full-batch gradient descent on
(1/2n) sum_i (m_i + b - y_i)^2 + (alpha/2) sum_k ||beta_k||^2, with m_i = sum_k z_ik' beta_k.

Each step is two calls. ``predict``: every party returns z_k beta_k per row, only inside the
secure sum over all parties, so the active party sees m = sum_k z_k beta_k and never one party's
part. The active party forms the residuals and returns dL/dm (a batch-mean gradient) through
`ctx.return_gradients` (label DP when configured); ``step``: each party updates its beta_k.
Coefficients never leave the parties; the active party keeps the intercept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    Operation,
    PartyMethod,
    Release,
    SumSpec,
    UnknownOperation,
)
from securevfl.methods.options import option
from securevfl.metrics import task_metrics


@dataclass(frozen=True)
class RidgeOptions:
    alpha: float = option(0.01, "L2 penalty on the coefficients", minimum=0.0)
    iterations: int = option(300, "gradient steps", minimum=1, maximum=10**6)
    step: float = option(0.5, "step size", minimum=0.0, maximum=2.0, exclusive_minimum=True)


OPERATIONS = (
    Operation(
        "predict",
        "this party's partial predictor z_k beta_k on rows `ids`",
        releases=(Release("m", why="z_k beta_k per row: only inside the sum over all parties"),),
    ),
    Operation(
        "step",
        "one gradient step on beta_k from dL/dm on the training rows",
        inputs=("grad",),
        updates=True,
    ),
)


class RidgeParty(PartyMethod):
    """A passive party's coefficients beta_k over its standardised columns."""

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        train = np.asarray(inputs["train_ids"])
        rows = self.table.rows(train[self.table.has(train)])
        self.mean = np.nanmean(rows, axis=0) if len(rows) else np.zeros(len(self.table.columns))
        sd = np.nanstd(rows, axis=0) if len(rows) else np.ones(len(self.table.columns))
        self.sd = np.where(sd > 1e-12, sd, 1.0)
        self.beta = np.zeros(len(self.table.columns))

    def _z(self, ids: np.ndarray) -> np.ndarray:
        z = np.zeros((len(ids), len(self.table.columns)))
        held = self.table.has(ids)
        if held.any():
            z[held] = np.nan_to_num((self.table.rows(ids[held]) - self.mean) / self.sd)
        return z

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "predict":
            return {"m": self._z(ids) @ self.beta}
        if op == "step":
            opts = self.config.options
            grad = np.asarray(inputs["grad"], dtype=np.float64)
            self.beta = self.beta - opts.step * (self._z(ids).T @ grad + opts.alpha * self.beta)
            return {}
        raise UnknownOperation("ridge", op)

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta.tolist(), "mean": self.mean.tolist(), "sd": self.sd.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta, self.mean, self.sd = (np.asarray(state[k]) for k in ("beta", "mean", "sd"))

    def version_state(self) -> dict[str, Any]:
        # what `predict` releases is z beta_k, z = (x - mean) / sd with mean and sd fitted at
        # set-up on the rows the active party names: the party's differencing rule keys its
        # sums by all three, so a step that leaves beta_k keeps them, and a set-up on other
        # rows (another standardisation of the same beta_k) does not
        beta = getattr(self, "beta", None)
        return {} if beta is None else {"beta": beta, "mean": self.mean, "sd": self.sd}


class RidgeActive(ActiveMethod):
    """The intercept, the residuals and the schedule."""

    progress_unit = "iteration"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.intercept = 0.0
        self.done = 0

    @property
    def progress_total(self) -> int:
        return self.config.options.iterations

    def _predict(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        group = tuple(ctx.parties)
        got = ctx.call("predict", ids=ids, sums=[SumSpec(key="m", tensor="m", group=group)])
        return got["m"] + self.intercept

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        opts = self.config.options
        y = self.table.label_rows(train_ids)
        if self.done == 0:
            self.intercept = float(np.mean(y))
        for t in range(self.done, opts.iterations):
            residual = self._predict(ctx, train_ids) - y
            # dL/dm of the batch-mean loss; the context scales rows for label DP and back
            grad = residual / len(train_ids)
            ctx.return_gradients(
                {tuple(ctx.parties): {"grad": grad}}, ids=train_ids, epoch=t, op="step"
            )
            self.intercept -= opts.step * float(np.mean(residual))
            self.done = t + 1
            if self.done % 50 == 0 or self.done == opts.iterations:
                ctx.epoch_done(t, stats={"loss": float(np.mean(residual**2)) / 2})

    def predict(self, ctx: ActiveContext, *, ids: np.ndarray) -> np.ndarray:
        return self._predict(ctx, ids)

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        return task_metrics(
            "regression", y_true=self.table.label_rows(ids), output=self._predict(ctx, ids)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"intercept": self.intercept, "done": self.done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.intercept, self.done = float(state["intercept"]), int(state["done"])


def check_ridge(cfg: Any, opts: RidgeOptions) -> None:
    if cfg.active_columns:
        raise ConfigError(
            "[active] columns",
            "ridge (the worked example) fits the passive parties' columns only; remove them",
        )


SPEC = MethodSpec(
    name="ridge",
    active=RidgeActive,
    party=RidgeParty,
    operations=OPERATIONS,
    options=RidgeOptions,
    tasks=("regression",),
    description="ridge regression by gradient descent on secure sums (the worked example)",
    checks=(check_ridge,),
    example=partial(examples.regression, method="ridge"),
)
