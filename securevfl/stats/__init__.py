"""Pure-NumPy statistics for VFEM: the per-block model math shared by the federated parties, and
centralised references (VFEM map, exact EM, the closed-form likelihood, SEM, OLS)."""

from securevfl.stats.gaussian_blocks import BlockParams
from securevfl.stats.reference import (
    DivergenceError,
    FitResult,
    RegressionData,
    Theta,
    cc_ols,
    em_step,
    fit_em,
    fit_vfem,
    impute_ols,
    observed_loglik,
    ols,
    single_ols,
    vfem_step,
)

__all__ = [
    "BlockParams",
    "DivergenceError",
    "FitResult",
    "RegressionData",
    "Theta",
    "cc_ols",
    "em_step",
    "fit_em",
    "fit_vfem",
    "impute_ols",
    "observed_loglik",
    "ols",
    "single_ols",
    "vfem_step",
]
