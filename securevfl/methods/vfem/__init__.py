"""VFEM: federated EM for linear regression with missing blocks (Tang, Wang, Feng, Li;
implementation notes `shared/methods/vfem.md`), with SEM standard errors.

Model: y = beta_0 + sum_k x^k' beta_k + eps, each party's block x^k ~ N(mu_k, Sigma_k),
independent across parties, missing as a whole on the rows a party lacks (MAR). The estimates
are the maximum-likelihood estimates of that model (the fixed point of the VFEM map equals the
maximiser of the observed-data likelihood); the standard errors come from the SEM method
applied to the map actually iterated (notes §5.1).

Where things live: each passive party keeps its rows, its standardisation constants and its
beta_k, mu_k, Sigma_k; the active party keeps y, sigma^2, the intercept and its own block (if
it holds columns). Per iteration (notes §3.2, with one secure-sum round):

1. E-step round (one call, every party): secure sums over the parties of the per-row partial
   predictors (x_i^k' beta_k, or mu_k' beta_k on a missing row), of the per-row missing-block
   variance terms (beta_k' Sigma_k beta_k on a missing row), and of two scalars (the
   covariate log-likelihood, max |delta beta_k|).
2. The active party forms tau_i, the pseudo-complete residuals e_i and the next sigma^2.
3. M-step (one call per party): party k receives e (every row), 1/tau_i on the rows it lacks
   only, and sigma^2; it updates beta_k by a gradient step and mu_k, Sigma_k in closed form.

`docs/vfem.md` says what each role learns. `securevfl.methods.ols` registers the comparators
(complete-case, mean-imputation and single-party OLS), which run on the same machinery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

from securevfl.errors import ConfigError
from securevfl.methods import examples
from securevfl.methods.base import MethodSpec, Operation, Release
from securevfl.methods.options import option

INITS = ("cc", "impute", "zero")
MIN_FRAC_BITS = 32
SUGGESTED_FRAC_BITS = 40
SUGGESTED_BOUND = 2.0**18
# the [secure] defaults of the regression methods when the config leaves them out
SECURE_DEFAULTS = (("frac_bits", SUGGESTED_FRAC_BITS), ("bound", SUGGESTED_BOUND))


@dataclass(frozen=True)
class RegressionOptions:
    """The `[method]` options of vfem and the OLS comparators."""

    intercept: bool = option(True, "fit an intercept (the active party keeps it)")
    eta: Any = option("auto", 'gradient step size, or "auto" (from the blocks\' spectra)')
    max_iter: int = option(5000, "most iterations of the map", minimum=1, maximum=10**9)
    tol_loss: float = option(
        1e-10,
        "stop when the loss changes by less",
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
    )
    tol_beta: float = option(
        1e-8, "... and no coefficient by more", minimum=0.0, maximum=1.0, exclusive_minimum=True
    )
    se: str = option(
        "sem", "standard errors: sem (the SEM method) or none", choices=("sem", "none")
    )
    sem_step: float | None = option(
        None,
        "SEM difference step (default 1e-5; 1e-3 with ckks, whose sums carry ~1e-7 noise)",
        minimum=0.0,
        maximum=1.0,
        exclusive_minimum=True,
    )
    level: float = option(
        0.95,
        "confidence level of the intervals",
        minimum=0.0,
        maximum=0.999999,
        exclusive_minimum=True,
    )
    checkpoint_every: int = option(100, "iterations between checkpoints", minimum=1, maximum=10**9)


@dataclass(frozen=True)
class VfemOptions(RegressionOptions):
    init: str = option(
        "impute",
        "start: complete-case OLS (cc), mean-imputation OLS (impute) or zero",
        choices=INITS,
    )


def check_regression(cfg: Any, opts: RegressionOptions) -> None:
    """A valid step size, a fixed-point format precise enough for the estimates (mask), and no
    DP mechanism the method cannot apply (refused rather than ignored)."""
    if cfg.label_dp is not None:
        raise ConfigError(
            "[privacy] label_dp",
            f"{cfg.method!r} sends every party the residuals e_i (label information) to fit by "
            "EM, and has no label-DP variant; remove the key (docs/vfem.md says what each "
            "party learns)",
        )
    for party in cfg.parties:
        if party.embedding_dp is not None:
            raise ConfigError(
                f"[parties.{party.name}] embedding_dp",
                f"{cfg.method!r} sums statistics that are not per row (log-likelihoods, Gram "
                "matrices), which embedding DP cannot clip; remove the key",
            )
    if opts.eta != "auto":
        ok = isinstance(opts.eta, int | float) and not isinstance(opts.eta, bool)
        if not ok or not (0 < opts.eta <= 100) or not math.isfinite(opts.eta):
            raise ConfigError(
                "[method] eta", f'must be "auto" or a number in (0, 100], got {opts.eta!r}'
            )
    if cfg.aggregation == "mask" and cfg.frac_bits < MIN_FRAC_BITS:
        raise ConfigError(
            "[secure] frac_bits",
            f"method {cfg.method!r} iterates to a fixed point and needs at least "
            f"{MIN_FRAC_BITS} fractional bits for estimates accurate to 1e-6 (got "
            f"{cfg.frac_bits}); set [secure] frac_bits = {SUGGESTED_FRAC_BITS} and bound = "
            f"{SUGGESTED_BOUND:.0f} (2^18: the method standardises internally, so values stay "
            "small; log2(bound) + frac_bits must stay <= 58)",
        )


def _summed(*names: str, why: str) -> tuple[Release, ...]:
    return tuple(Release(n, why=why, per_row=False) for n in names)


OPERATIONS = (
    Operation("prepare", "standardise this party's block on the training rows `ids`"),
    Operation(
        "design",
        "select a fit's rows; returns three scalars of the block's covariance for the step size",
        releases=(
            Release(
                "spectrum",
                to="clear",
                why="[lambda_min, lambda_max] of the block's covariance and ||mu||^2: the step "
                "size needs the largest curvature of every block",
                per_row=False,
            ),
        ),
    ),
    Operation(
        "estep",
        "per-row partial predictors and missing-block variances, the covariate log-likelihood",
        releases=(
            Release("m", why="x_i^k'beta_k per row (mu_k'beta_k where missing), summed"),
            Release("q", why="beta_k'Sigma_k beta_k on missing rows, summed"),
            *_summed("ll", "dbeta", why="the block's log-likelihood and max |delta beta|, summed"),
        ),
    ),
    Operation("mstep", "update beta_k, mu_k, Sigma_k", inputs=("e", "w"), updates=True),
    Operation("revert", "undo the last mstep", updates=True),
    Operation("probe_setup", "draw this block's secret SEM directions"),
    Operation(
        "probe_estep",
        "E-step terms at the secretly perturbed parameters",
        releases=(
            Release(
                "m",
                why="per-row predictors' change under the perturbation / step, summed",
                per_row=False,
            ),
            Release(
                "q",
                why="missing-block variances' change under the perturbation / step, summed",
                per_row=False,
            ),
        ),
    ),
    Operation(
        "probe_mstep",
        "M-step at the perturbed parameters (accumulated)",
        inputs=("e", "w", "sigma2"),
    ),
    Operation(
        "sem_sums",
        "this block's share of the SEM Gram matrix",
        releases=_summed("gram", "va", "ub", why="shares of U'U, V'w, U'w over secret directions"),
    ),
    Operation(
        "shift",
        "this block's share of the intercept's change of scale",
        releases=_summed("shift", why="(center/scale)'beta_k, summed"),
    ),
    Operation(
        "finish",
        "the block's coefficients and the diagonal of its covariance",
        inputs=("ginv",),
        releases=(
            Release(
                "coef",
                to="clear",
                why="the fitted coefficients of this party's columns (the method's output)",
                per_row=False,
            ),
            Release("var", to="clear", why="their variances (for standard errors)", per_row=False),
        ),
    ),
    Operation(
        "predict",
        "per-row partial predictions",
        releases=(Release("m", why="x_i^k'beta_k per row, summed"),),
    ),
)

# what a party must allow in its policy's clear_releases to run vfem or its comparators
VFEM_CLEAR = ("design.spectrum", "finish.coef", "finish.var")

SPEC = MethodSpec(
    name="vfem",
    active="securevfl.methods.vfem.active:VfemActive",
    party="securevfl.methods.vfem.party:BlockRegressionParty",
    operations=OPERATIONS,
    options=VfemOptions,
    tasks=("regression",),
    description="VFEM: federated EM linear regression with missing blocks, SEM standard errors",
    checks=(check_regression,),
    secure_defaults=SECURE_DEFAULTS,
    uses_unheld_rows=True,
    example=partial(examples.regression, method="vfem", p_missing=0.2, clear_releases=VFEM_CLEAR),
)
