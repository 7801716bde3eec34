"""Missing cells inside one role's block: the VFEM block model when a row may lack some of the
block's cells, not only all of them.

The model is unchanged: x^k ~ N(mu, Sigma). On a row whose observed cells are O and missing
cells are M, x_M given x_O is N(c_i, C) with

    c_i = mu_M + Sigma_MO Sigma_OO^{-1} (x_O - mu_O),
    C   = Sigma_MM - Sigma_MO Sigma_OO^{-1} Sigma_OM,

and C depends only on which cells are missing. So each missingness pattern of the block's
columns is its own pattern in the EM, exactly as a whole missing block is (O empty: c_i = mu,
C = Sigma); this is the exact E-step of the joint Gaussian model, and the fixed point is the
maximiser of the observed-data likelihood, valid when the cells are missing at random (MAR:
missingness may depend on y and on observed cells, not on the missing values).

Per pattern, with b = beta, a = C b_M (the block-missing case's a_k = Sigma_k beta_k):

* E-step terms: h_i = x_O' b_O + c_i' b_M (the conditional-mean predictor), q_i = b_M' C b_M;
* pseudo-complete cells x~_M = c_i + a e_i / sigma^2, posterior covariance C - a a' / tau_i;
* gradient correction a sigma^2 / tau_i on the missing coordinates;
* M-step of mu and Sigma from the pseudo-complete rows plus the posterior covariances.

With only whole-row patterns these equal `securevfl.stats.gaussian_blocks` (which `BlockState`
keeps using then); everything here is computed from the role's own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from securevfl.stats.gaussian_blocks import LOG_2PI, BlockParams

# the start's pairwise covariance is lifted to at least this fraction of its largest eigenvalue
START_EIG_FLOOR = 1e-3


@dataclass(frozen=True)
class CellPattern:
    """The rows that share one set of observed cells."""

    rows: np.ndarray  # positions of the rows
    obs: np.ndarray  # indices of the observed columns
    mis: np.ndarray  # indices of the missing columns


def cell_patterns(observed: np.ndarray) -> list[CellPattern]:
    """The distinct missingness patterns of an (n, p) observed-cell mask, with their rows."""
    observed = np.asarray(observed, dtype=bool)
    if observed.shape[0] == 0:
        return []
    unique, inverse = np.unique(observed, axis=0, return_inverse=True)
    inverse = np.asarray(inverse).reshape(-1)
    out = []
    for k, row in enumerate(unique):
        out.append(
            CellPattern(
                rows=np.flatnonzero(inverse == k),
                obs=np.flatnonzero(row),
                mis=np.flatnonzero(~row),
            )
        )
    return out


def _conditional(
    params: BlockParams, pat: CellPattern, z: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(c_i for the pattern's rows, C): the prior conditional mean and covariance of the
    missing cells given the observed ones."""
    mu, sigma = params.mu, params.sigma
    mis, obs = pat.mis, pat.obs
    if obs.size == 0:
        return np.broadcast_to(mu, (len(pat.rows), len(mu))), sigma
    s_mo = sigma[np.ix_(mis, obs)]
    k = np.linalg.solve(sigma[np.ix_(obs, obs)], s_mo.T).T  # Sigma_MO Sigma_OO^{-1}
    cond = sigma[np.ix_(mis, mis)] - k @ s_mo.T
    c = mu[mis] + (z[np.ix_(pat.rows, obs)] - mu[obs]) @ k.T
    return c, 0.5 * (cond + cond.T)


def estep_cells(
    z: np.ndarray, patterns: list[CellPattern], params: BlockParams
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row partial predictor h_i = E[x_i' beta | observed cells] and variance term
    q_i = Var[x_i' beta | observed cells]. `z` may hold anything on missing cells."""
    beta = params.beta
    n = sum(len(p.rows) for p in patterns)
    h = np.empty(n)
    q = np.zeros(n)
    for pat in patterns:
        if pat.mis.size == 0:
            h[pat.rows] = z[pat.rows] @ beta
            continue
        c, cond = _conditional(params, pat, z)
        b_m = beta[pat.mis]
        h[pat.rows] = z[np.ix_(pat.rows, pat.obs)] @ beta[pat.obs] + c @ b_m
        q[pat.rows] = float(b_m @ cond @ b_m)
    return h, q


def loglik_cells(z: np.ndarray, patterns: list[CellPattern], params: BlockParams) -> float:
    """sum over rows of log N(x_O; mu_O, Sigma_OO): the block's covariate part of the
    observed-data log-likelihood. Returns -inf if a needed Sigma_OO is not positive definite."""
    total = 0.0
    for pat in patterns:
        obs = pat.obs
        if obs.size == 0:
            continue
        try:
            chol = np.linalg.cholesky(params.sigma[np.ix_(obs, obs)])
        except np.linalg.LinAlgError:
            return -np.inf
        d = z[np.ix_(pat.rows, obs)] - params.mu[obs]
        sol = np.linalg.solve(chol, d.T)
        logdet = 2.0 * float(np.sum(np.log(np.diag(chol))))
        total -= 0.5 * (len(pat.rows) * (obs.size * LOG_2PI + logdet) + float(np.sum(sol * sol)))
    return total


def mstep_cells(
    z: np.ndarray,
    patterns: list[CellPattern],
    params: BlockParams,
    *,
    e: np.ndarray,
    w: np.ndarray,
    sigma2: float,
    eta: float,
    model_x: bool = True,
) -> BlockParams:
    """One VFEM update of the block, all from theta^(t): pseudo-complete cells, the gradient
    step for beta and (when the covariates are modelled) the closed-form mu and Sigma. `w`
    (1/tau_i) is read on rows with a missing cell only."""
    n = len(e)
    beta, mu, sigma = params.beta, params.mu, params.sigma
    p = len(beta)
    xt = np.array(z, dtype=np.float64, copy=True)
    correction = np.zeros(p)
    extra = np.zeros((p, p))
    for pat in patterns:
        if pat.mis.size == 0:
            continue
        rows, mis = pat.rows, pat.mis
        c, cond = _conditional(params, pat, z)
        a = cond @ beta[mis]
        xt[np.ix_(rows, mis)] = c + np.outer(e[rows] / sigma2, a)
        w_sum = float(np.sum(w[rows]))
        correction[mis] += a * (sigma2 * w_sum)
        extra[np.ix_(mis, mis)] += len(rows) * cond - w_sum * np.outer(a, a)
    g = (e @ xt - correction) / n
    beta_next = beta + eta * g
    if not model_x:
        return BlockParams(beta_next, mu.copy(), sigma.copy())
    mu_next = xt.mean(axis=0)
    d = xt - mu_next
    sigma_next = (d.T @ d + extra) / n
    return BlockParams(beta_next, mu_next, 0.5 * (sigma_next + sigma_next.T))


def available_cell_moments(z: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The EM's start: each column's mean over its observed cells and the pairwise-complete
    covariance (divisor: the rows where both cells are observed), lifted to be positive
    definite. Only the start: the fixed point does not depend on it."""
    observed = np.asarray(observed, dtype=bool)
    count = observed.sum(axis=0)
    mu = np.where(observed, z, 0.0).sum(axis=0) / np.maximum(count, 1)
    d = np.where(observed, z - mu, 0.0)
    both = observed.T.astype(np.float64) @ observed.astype(np.float64)
    sigma = d.T @ d / np.maximum(both, 1.0)
    sigma = 0.5 * (sigma + sigma.T)
    evals, evecs = np.linalg.eigh(sigma)
    floor = START_EIG_FLOOR * max(float(evals[-1]), 1e-12)
    if evals[0] < floor:
        sigma = (evecs * np.maximum(evals, floor)) @ evecs.T
    return mu, sigma


def column_means(z: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Each column's mean over its observed cells (what mean imputation fills in)."""
    count = np.maximum(observed.sum(axis=0), 1)
    return np.where(observed, z, 0.0).sum(axis=0) / count
