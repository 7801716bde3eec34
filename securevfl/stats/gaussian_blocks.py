"""One party's block of the VFEM model, as pure NumPy: the quantities a party computes from its
own rows only. Both the federated method (`securevfl.methods.vfem`) and the centralised
reference (`securevfl.stats.reference`) call these functions, so "federated = centralised"
holds by construction and is pinned by tests.

Model (Tang et al., VFEM; notes `shared/methods/vfem.md` §1-3): for block k,
x_i^k ~ N(mu_k, Sigma_k) independently across blocks, and
y_i = beta_0 + sum_k x_i^k' beta_k + eps_i with eps_i ~ N(0, sigma^2). A block is missing as a
whole for a row (``observed[i]`` is False) or present as a whole.

Names follow the notes: a_k = Sigma_k beta_k, s_k = beta_k' Sigma_k beta_k, tau_i = sigma^2 +
sum over the blocks missing on row i of s_k, e_i the residual on the pseudo-complete data and
w_i = 1 / tau_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LOG_2PI = float(np.log(2.0 * np.pi))


def vech_indices(p: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column indices of the lower triangle, the order of the vech coordinates."""
    return np.tril_indices(p)


def vech(matrix: np.ndarray) -> np.ndarray:
    rows, cols = vech_indices(matrix.shape[0])
    return matrix[rows, cols].copy()


def unvech(vector: np.ndarray, p: int) -> np.ndarray:
    """The symmetric matrix whose lower triangle is `vector`."""
    rows, cols = vech_indices(p)
    out = np.zeros((p, p))
    out[rows, cols] = vector
    out[cols, rows] = vector
    return out


@dataclass
class BlockParams:
    """A block's parameters. `mu` and `sigma` are unused (but carried) in OLS mode."""

    beta: np.ndarray  # (p,)
    mu: np.ndarray  # (p,)
    sigma: np.ndarray  # (p, p)

    @property
    def p(self) -> int:
        return len(self.beta)

    def copy(self) -> BlockParams:
        return BlockParams(self.beta.copy(), self.mu.copy(), self.sigma.copy())

    def coordinates(self, *, model_x: bool) -> np.ndarray:
        """The block's SEM coordinates: beta, then (if the covariates are modelled) mu and
        vech(Sigma)."""
        if not model_x:
            return self.beta.copy()
        return np.concatenate([self.beta, self.mu, vech(self.sigma)])

    def moved(self, direction: np.ndarray, *, model_x: bool) -> BlockParams:
        """These parameters plus `direction`, given in `coordinates` order."""
        p = self.p
        beta = self.beta + direction[:p]
        if not model_x:
            return BlockParams(beta, self.mu.copy(), self.sigma.copy())
        mu = self.mu + direction[p : 2 * p]
        sigma = self.sigma + unvech(direction[2 * p :], p)
        return BlockParams(beta, mu, sigma)

    @staticmethod
    def n_coordinates(p: int, *, model_x: bool) -> int:
        return p if not model_x else 2 * p + p * (p + 1) // 2


def available_case_moments(z: np.ndarray, observed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance (divisor m = number of observed rows) over the observed rows: the
    paper's initial mu_k and Sigma_k."""
    zo = z[observed]
    mu = zo.mean(axis=0)
    d = zo - mu
    return mu, d.T @ d / len(zo)


def estep_terms(
    z: np.ndarray, observed: np.ndarray, params: BlockParams
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row partial predictor and missing-block variance term of this block.

    h_i = x_i' beta on an observed row, mu' beta on a missing one (the mean-imputed predictor);
    q_i = beta' Sigma beta on a missing row, 0 on an observed one. `z` may hold anything on
    missing rows (they are not read)."""
    beta = params.beta
    h = np.where(observed, z @ beta, float(params.mu @ beta))
    s = float(beta @ params.sigma @ beta)
    q = np.where(observed, 0.0, s)
    return h, q


def combine_rows(
    y: np.ndarray, m: np.ndarray, q: np.ndarray, sigma2: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """The active party's per-row step: from the summed predictor m_i and variance terms q_i,
    the pseudo-complete residuals e_i = (y_i - m_i) sigma^2 / tau_i, the weights w_i = 1/tau_i
    and the next sigma^2 = mean(e_i^2 + (tau_i - sigma^2) sigma^2 / tau_i) (notes §3.2 step 10).
    """
    tau = sigma2 + q
    w = 1.0 / tau
    e = (y - m) * sigma2 * w
    sigma2_next = float(np.mean(e * e + q * sigma2 * w))
    return e, w, sigma2_next


def y_loglik(y: np.ndarray, m: np.ndarray, q: np.ndarray, sigma2: float) -> float:
    """sum_i log N(y_i; m_i, tau_i): the response part of the observed-data log-likelihood."""
    tau = sigma2 + q
    r = y - m
    return float(-0.5 * np.sum(LOG_2PI + np.log(tau) + r * r / tau))


def block_loglik(z: np.ndarray, observed: np.ndarray, params: BlockParams) -> float:
    """sum over observed rows of log N_p(x_i; mu, Sigma): this block's covariate part of the
    observed-data log-likelihood (notes §1.4). Returns -inf if Sigma is not positive definite."""
    p = params.p
    zo = z[observed] - params.mu
    try:
        chol = np.linalg.cholesky(params.sigma)
    except np.linalg.LinAlgError:
        return -np.inf
    sol = np.linalg.solve(chol, zo.T)
    logdet = 2.0 * float(np.sum(np.log(np.diag(chol))))
    return float(-0.5 * (len(zo) * (p * LOG_2PI + logdet) + np.sum(sol * sol)))


def mstep(
    z: np.ndarray,
    observed: np.ndarray,
    params: BlockParams,
    *,
    e: np.ndarray,
    w: np.ndarray,
    sigma2: float,
    eta: float,
    model_x: bool = True,
) -> BlockParams:
    """One VFEM update of this block (notes §3.2 steps 4, 8, 9), all from theta^(t):

    pseudo-complete rows x~_i = x_i (observed) or mu + a r_i / tau_i (missing, r_i/tau_i =
    e_i / sigma^2); the gradient g = mean_i(e_i x~_i) - a sigma^2 mean_i(w_i 1{missing});
    beta <- beta + eta g; and, when the covariates are modelled, the closed-form mu and Sigma.
    `w` is read on missing rows only."""
    n = len(e)
    beta, mu, sigma = params.beta, params.mu, params.sigma
    a = sigma @ beta
    missing = ~observed
    xt = np.array(z, dtype=np.float64, copy=True)
    if missing.any():
        xt[missing] = mu + np.outer(e[missing] / sigma2, a)
    w_missing = float(np.sum(w[missing]))
    g = (e @ xt - a * (sigma2 * w_missing)) / n
    beta_next = beta + eta * g
    if not model_x:
        return BlockParams(beta_next, mu.copy(), sigma.copy())
    mu_next = xt.mean(axis=0)
    d = xt - mu_next
    sigma_next = (d.T @ d + missing.sum() * sigma - w_missing * np.outer(a, a)) / n
    return BlockParams(beta_next, mu_next, 0.5 * (sigma_next + sigma_next.T))
