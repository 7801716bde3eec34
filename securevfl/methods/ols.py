"""Comparators for VFEM, on the same data and the same secure-sum machinery: complete-case OLS
(`cc-ols`), mean-imputation OLS (`impute-ols`) and the single-party fit (`single-ols`).

Each is least squares solved by the federated gradient iteration of `securevfl.methods.vfem`
with no covariate model (every design row is complete), so the estimates are the OLS estimates
and SEM on that linear map gives exactly s^2 (X'X)^{-1} with s^2 = RSS / (n - p): classical
standard errors, t-based p-values and intervals. What each reveals is in `docs/vfem.md`.

* cc-ols: the rows every party (and the active party's own block, if any) holds.
* impute-ols: every training row; a party fills the rows it lacks with its own available-case
  mean (the paper's "Impute").
* single-ols: one role's block on the rows it holds (`[method] party`, default the active
  party when it holds columns; the paper's "Single"). A passive party alone is a sum over one
  contributor, so secure aggregation refuses it unless `[run] min_group = 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import ActiveContext, MethodSpec
from securevfl.methods.options import option
from securevfl.methods.vfem import (
    OPERATIONS,
    SECURE_DEFAULTS,
    VFEM_CLEAR,
    RegressionOptions,
    check_regression,
)
from securevfl.methods.vfem.active import BlockRegressionActive
from securevfl.methods.vfem.block import VfemInputError


class _OlsActive(BlockRegressionActive):
    ols = True

    def _enough(self, ids: np.ndarray, parties: tuple[str, ...], own: bool, what: str) -> None:
        p = (
            (1 if self.opts.intercept else 0)
            + (len(self.table.columns) if own else 0)
            + sum(len(self.config.party(q).columns) for q in parties)
        )
        if len(ids) < p + 2:
            raise VfemInputError(
                f"{self.method_label}: only {len(ids)} {what} for {p} coefficients; OLS needs "
                "more rows than coefficients"
            )


class CompleteCaseActive(_OlsActive):
    method_label = "cc-ols"

    def designs(self, ctx: ActiveContext, train_ids: np.ndarray) -> list:
        parties, own = tuple(ctx.parties), bool(self.table.columns)
        rows = self._complete_rows(ctx, train_ids)
        self._enough(rows, parties, own, "training rows are complete at every party")
        return [("complete", rows, parties, own)]


class MeanImputationActive(_OlsActive):
    method_label = "impute-ols"

    def designs(self, ctx: ActiveContext, train_ids: np.ndarray) -> list:
        parties, own = tuple(ctx.parties), bool(self.table.columns)
        self._enough(train_ids, parties, own, "training rows")
        return [("impute", train_ids, parties, own)]


class SinglePartyActive(_OlsActive):
    method_label = "single-ols"

    def participants(self, ctx: ActiveContext) -> tuple[tuple[str, ...], bool]:
        party = single_party(self.config)
        return ((), True) if party == self.config.active_name else ((party,), False)

    def designs(self, ctx: ActiveContext, train_ids: np.ndarray) -> list:
        party = single_party(self.config)
        if party == self.config.active_name:
            # complete cases of the active party's own block: rows with every cell present
            rows = train_ids[~np.isnan(self.table.rows(train_ids)).any(axis=1)]
            self._enough(rows, (), True, f"training rows held by {party!r}")
            return [("complete", rows, (), True)]
        held = ctx.presence(train_ids)[:, self.config.party_names.index(party)]
        rows = train_ids[held]
        self._enough(rows, (party,), False, f"training rows held by {party!r}")
        return [("complete", rows, (party,), False)]


@dataclass(frozen=True)
class SingleOptions(RegressionOptions):
    party: str | None = option(None, "the role whose block is fitted (default: the active party)")


def single_party(cfg: Any) -> str:
    """The role whose block single-ols fits: `[method] party`, default the active party."""
    party = cfg.options.party
    return cfg.active_name if party is None else str(party)


def check_single(cfg: Any, opts: SingleOptions) -> None:
    check_regression(cfg, opts)
    party = single_party(cfg)
    if party == cfg.active_name:
        if not cfg.active_columns:
            raise ConfigError(
                "[method] party",
                f"the active party {party!r} holds no columns; name the passive party to fit "
                f"(one of {', '.join(cfg.party_names)})",
            )
        return
    if party not in cfg.party_names:
        raise ConfigError(
            "[method] party",
            f"unknown role {party!r}; choose {cfg.active_name!r} or one of "
            f"{', '.join(cfg.party_names)}",
        )
    if cfg.aggregation != "plain" and cfg.min_group > 1:
        raise ConfigError(
            "[method] party",
            f"a single-party fit of the passive party {party!r} sends its per-row predictor "
            "to the active party (a sum over one contributor), which secure aggregation refuses; "
            "fit the active party's own block instead, or accept the release explicitly with "
            '[run] min_group = 1 (or aggregation = "plain")',
        )


def ols_example(directory: Any, *, method: str) -> dict[str, Any]:
    raw = examples.regression(directory, method=method, p_missing=0.2, clear_releases=VFEM_CLEAR)
    if method == "single-ols":
        raw["run"]["min_group"] = 1
        raw["policy"]["min_group"] = 1
        raw["method"] = {"party": "r0"}
    return raw


SPECS = [
    MethodSpec(
        name=name,
        active=active,
        party="securevfl.methods.vfem.party:BlockRegressionParty",
        operations=OPERATIONS,
        options=options,
        tasks=("regression",),
        description=description,
        checks=(check,),
        secure_defaults=SECURE_DEFAULTS,
        example=partial(ols_example, method=name),
    )
    for name, active, options, check, description in (
        (
            "cc-ols",
            CompleteCaseActive,
            RegressionOptions,
            check_regression,
            "complete-case OLS over the parties (a VFEM comparator)",
        ),
        (
            "impute-ols",
            MeanImputationActive,
            RegressionOptions,
            check_regression,
            "mean-imputation OLS over the parties (a VFEM comparator)",
        ),
        (
            "single-ols",
            SinglePartyActive,
            SingleOptions,
            check_single,
            "OLS on one role's block (a VFEM comparator)",
        ),
    )
]
