"""Centralised reference implementations (one process holds every block): the VFEM map, exact
EM, the closed-form observed-data log-likelihood, SEM standard errors and OLS.

They are what the federated method is tested against and what the Monte-Carlo bench runs. The
VFEM map here calls the same per-block functions as the federated parties
(`securevfl.stats.gaussian_blocks`), so both follow one definition of the algorithm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from securevfl.stats.gaussian_blocks import (
    BlockParams,
    available_case_moments,
    block_loglik,
    combine_rows,
    estep_terms,
    mstep,
    y_loglik,
)


class DivergenceError(RuntimeError):
    """The iteration produced a non-finite loss."""


@dataclass
class RegressionData:
    """y and K covariate blocks; `observed[k][i]` says whether row i of block k is present.
    Missing rows of `z[k]` are zero-filled (never read)."""

    y: np.ndarray
    z: list[np.ndarray]
    observed: list[np.ndarray]
    intercept: bool = True

    @classmethod
    def from_blocks(
        cls, y: np.ndarray, blocks: Sequence[np.ndarray], *, intercept: bool = True
    ) -> RegressionData:
        """Blocks with NaN rows for the rows they lack."""
        z, observed = [], []
        for block in blocks:
            block = np.asarray(block, dtype=np.float64)
            obs = ~np.all(np.isnan(block), axis=1)
            z.append(np.where(obs[:, None], block, 0.0))
            observed.append(obs)
        return cls(np.asarray(y, dtype=np.float64), z, observed, intercept)

    @property
    def n(self) -> int:
        return len(self.y)

    @property
    def dims(self) -> list[int]:
        return [zk.shape[1] for zk in self.z]

    def complete_rows(self) -> np.ndarray:
        return np.all(np.stack(self.observed, axis=1), axis=1)


@dataclass
class Theta:
    blocks: list[BlockParams]
    sigma2: float
    beta0: float = 0.0

    def copy(self) -> Theta:
        return Theta([b.copy() for b in self.blocks], self.sigma2, self.beta0)

    @property
    def beta(self) -> np.ndarray:
        """(beta_0, beta_1, ..., beta_K) stacked (beta_0 first, always present)."""
        return np.concatenate([[self.beta0], *(b.beta for b in self.blocks)])


@dataclass
class FitResult:
    theta: Theta
    iterations: int
    converged: bool
    losses: list[float] = field(default_factory=list)


# ------------------------------------------------------------------------------ the maps


def rows_terms(data: RegressionData, theta: Theta) -> tuple[np.ndarray, np.ndarray]:
    """Summed partial predictors m_i (with the intercept) and variance terms q_i."""
    m = np.full(data.n, theta.beta0 if data.intercept else 0.0)
    q = np.zeros(data.n)
    for zk, ok, bk in zip(data.z, data.observed, theta.blocks, strict=True):
        h, qk = estep_terms(zk, ok, bk)
        m += h
        q += qk
    return m, q


def vfem_step(data: RegressionData, theta: Theta, *, eta: float, model_x: bool = True) -> Theta:
    """The VFEM one-step map G (notes §3.2): closed-form mu, Sigma, sigma^2 and one gradient
    step of size eta for beta, every update from theta^(t)."""
    m, q = rows_terms(data, theta)
    e, w, sigma2_next = combine_rows(data.y, m, q, theta.sigma2)
    blocks = [
        mstep(zk, ok, bk, e=e, w=w, sigma2=theta.sigma2, eta=eta, model_x=model_x)
        for zk, ok, bk in zip(data.z, data.observed, theta.blocks, strict=True)
    ]
    beta0 = theta.beta0 + eta * float(np.mean(e)) if data.intercept else 0.0
    return Theta(blocks, sigma2_next, beta0)


def em_step(data: RegressionData, theta: Theta) -> Theta:
    """The exact EM map F (notes §2.3, with mu^(t+1) and beta^(t+1) in the Sigma and sigma^2
    updates). Needs every block at once: the centralised baseline."""
    n = data.n
    m, q = rows_terms(data, theta)
    tau = theta.sigma2 + q
    w = 1.0 / tau
    r = data.y - m
    xts, avecs, dims = [], [], []
    for zk, ok, bk in zip(data.z, data.observed, theta.blocks, strict=True):
        a = bk.sigma @ bk.beta
        xt = zk.copy()
        xt[~ok] = bk.mu + np.outer(r[~ok] * w[~ok], a)
        xts.append(xt)
        avecs.append(a)
        dims.append(len(a))
    cols = ([np.ones((n, 1))] if data.intercept else []) + xts
    xt_all = np.concatenate(cols, axis=1)
    offset0 = 1 if data.intercept else 0
    starts = np.cumsum([offset0, *dims])
    cond = np.zeros((xt_all.shape[1],) * 2)
    for k, (ok, bk) in enumerate(zip(data.observed, theta.blocks, strict=True)):
        sk = slice(starts[k], starts[k + 1])
        mk = ~ok
        cond[sk, sk] += mk.sum() * bk.sigma - np.sum(w[mk]) * np.outer(avecs[k], avecs[k])
        for l in range(len(data.z)):
            if l == k:
                continue
            both = mk & ~data.observed[l]
            sl = slice(starts[l], starts[l + 1])
            cond[sk, sl] -= np.sum(w[both]) * np.outer(avecs[k], avecs[l])
    a_mat = xt_all.T @ xt_all + cond
    beta = np.linalg.solve(a_mat, xt_all.T @ data.y)
    beta0 = float(beta[0]) if data.intercept else 0.0
    blocks = []
    resid_var = np.zeros(n)
    cross = np.zeros(n)
    for k, (ok, bk) in enumerate(zip(data.observed, theta.blocks, strict=True)):
        bnew = beta[starts[k] : starts[k + 1]]
        mk = ~ok
        xt = xts[k]
        mu = xt.mean(axis=0)
        d = xt - mu
        a = avecs[k]
        sig = (d.T @ d + mk.sum() * bk.sigma - np.sum(w[mk]) * np.outer(a, a)) / n
        blocks.append(BlockParams(bnew, mu, 0.5 * (sig + sig.T)))
        resid_var += mk * float(bnew @ bk.sigma @ bnew)
        cross += mk * float(a @ bnew)
    fitted = xt_all @ beta
    sigma2 = float(np.mean((data.y - fitted) ** 2 + resid_var - cross**2 * w))
    return Theta(blocks, sigma2, beta0)


def observed_loglik(data: RegressionData, theta: Theta) -> float:
    """The closed-form observed-data log-likelihood (notes §1.4)."""
    m, q = rows_terms(data, theta)
    total = y_loglik(data.y, m, q, theta.sigma2)
    for zk, ok, bk in zip(data.z, data.observed, theta.blocks, strict=True):
        total += block_loglik(zk, ok, bk)
    return total


# ------------------------------------------------------------------------------ fitting


def initial_theta(data: RegressionData, beta: np.ndarray | None = None) -> Theta:
    """The paper's start: available-case mu_k and Sigma_k, sigma^2 = var(y), and `beta`
    ((beta_0, beta_1, ..., beta_K) stacked, beta_0 left out if the model has no intercept, as
    `ols` returns it; zeros if None)."""
    dims = data.dims
    if beta is None:
        beta = np.zeros(1 + sum(dims))
    beta = np.asarray(beta, dtype=np.float64)
    if len(beta) == sum(dims):
        beta = np.concatenate([[0.0], beta])
    blocks, start = [], 1
    for zk, ok, p in zip(data.z, data.observed, dims, strict=True):
        mu, sigma = available_case_moments(zk, ok)
        blocks.append(BlockParams(np.array(beta[start : start + p], dtype=float), mu, sigma))
        start += p
    sigma2 = float(np.mean((data.y - data.y.mean()) ** 2))
    return Theta(blocks, sigma2, float(beta[0]) if data.intercept else 0.0)


def beta_change(a: Theta, b: Theta) -> float:
    """|delta beta_0| + sum over blocks of max |delta beta_k|: the bound on max |delta beta| that
    the federated run can learn from one secure sum."""
    return abs(a.beta0 - b.beta0) + sum(
        float(np.max(np.abs(x.beta - y.beta))) for x, y in zip(a.blocks, b.blocks, strict=True)
    )


def iterate(
    step: Callable[[Theta], Theta],
    theta0: Theta,
    *,
    tol_loss: float = 1e-10,
    tol_beta: float = 1e-8,
    max_iter: int = 10_000,
) -> FitResult:
    """Run `step` with the federated method's stopping rule: stop at theta^(t) when
    |loss_t - loss_(t-1)| < tol_loss and the beta change into theta^(t) is below tol_beta,
    where loss_t is the sigma^2 that step(theta^(t)) produces."""
    theta = theta0
    prev_loss: float | None = None
    prev: Theta | None = None
    losses: list[float] = []
    for t in range(max_iter + 1):
        nxt = step(theta)
        loss = nxt.sigma2
        if not np.isfinite(loss):
            raise DivergenceError(f"the loss became {loss} at iteration {t}")
        losses.append(loss)
        change = np.inf if prev is None else beta_change(theta, prev)
        if prev_loss is not None and abs(loss - prev_loss) < tol_loss and change < tol_beta:
            return FitResult(theta, t, True, losses)
        if t == max_iter:
            return FitResult(theta, t, False, losses)
        prev_loss, prev, theta = loss, theta, nxt
    raise AssertionError("unreachable")


def fit_vfem(data: RegressionData, theta0: Theta, *, eta: float, **stop: float) -> FitResult:
    return iterate(lambda th: vfem_step(data, th, eta=eta), theta0, **stop)


def fit_em(data: RegressionData, theta0: Theta, **stop: float) -> FitResult:
    return iterate(lambda th: em_step(data, th), theta0, **stop)


def default_eta(theta: Theta, *, intercept: bool) -> float:
    """eta = 2 / (lambda_max + lambda_min) over the blocks' covariances (and 1 for the
    intercept), plus sum ||mu_k||^2 on lambda_max (notes §3.4: the spectrum of
    E[x x'] = blockdiag(Sigma_k) + mu mu')."""
    lows, highs = ([1.0], [1.0]) if intercept else ([], [])
    shift = 0.0
    for b in theta.blocks:
        ev = np.linalg.eigvalsh(b.sigma)
        lows.append(float(ev[0]))
        highs.append(float(ev[-1]))
        shift += float(b.mu @ b.mu)
    return 2.0 / (max(highs) + shift + min(lows))


# ------------------------------------------------------------------------------ SEM


def coordinates(theta: Theta, *, intercept: bool, model_x: bool = True) -> np.ndarray:
    """SEM coordinates: [beta_0], then per block (beta_k[, mu_k, vech Sigma_k]), then
    [sigma^2] (when the covariates are modelled)."""
    parts = [[theta.beta0]] if intercept else []
    parts += [b.coordinates(model_x=model_x) for b in theta.blocks]
    if model_x:
        parts.append([theta.sigma2])
    return np.concatenate(parts)


def from_coordinates(
    vec: np.ndarray, like: Theta, *, intercept: bool, model_x: bool = True
) -> Theta:
    start = 0
    beta0 = like.beta0
    if intercept:
        beta0 = float(vec[0])
        start = 1
    blocks = []
    for b in like.blocks:
        size = BlockParams.n_coordinates(b.p, model_x=model_x)
        blocks.append(
            b.moved(vec[start : start + size] - b.coordinates(model_x=model_x), model_x=model_x)
        )
        start += size
    sigma2 = float(vec[start]) if model_x else like.sigma2
    return Theta(blocks, sigma2, beta0)


def beta_positions(theta: Theta, *, intercept: bool, model_x: bool = True) -> np.ndarray:
    """Indices of (beta_0 if any, beta_1, ..., beta_K) among the SEM coordinates."""
    idx = [0] if intercept else []
    start = 1 if intercept else 0
    for b in theta.blocks:
        idx += list(range(start, start + b.p))
        start += BlockParams.n_coordinates(b.p, model_x=model_x)
    return np.asarray(idx)


def jacobian(
    step: Callable[[Theta], Theta],
    theta: Theta,
    *,
    intercept: bool,
    model_x: bool = True,
    h: float = 1e-5,
) -> np.ndarray:
    """J[j, i] = d step_j / d theta_i by central differences along each coordinate."""
    x0 = coordinates(theta, intercept=intercept, model_x=model_x)
    d = len(x0)
    jac = np.empty((d, d))
    for i in range(d):
        cols = []
        for sign in (1.0, -1.0):
            x = x0.copy()
            x[i] += sign * h
            out = step(from_coordinates(x, theta, intercept=intercept, model_x=model_x))
            cols.append(coordinates(out, intercept=intercept, model_x=model_x))
        jac[:, i] = (cols[0] - cols[1]) / (2 * h)
    return jac


def sem_beta_variances(
    jac: np.ndarray, beta_idx: np.ndarray, *, eta: float, sigma2: float, n: int
) -> np.ndarray:
    """Var(beta_j) for the VFEM map (notes §5.1, P = blockdiag((n/(eta sigma^2)) I, I_oc)):
    the beta-block of (I - J)^{-1} P^{-1} is (I - J)^{-1}_{beta beta} eta sigma^2 / n."""
    inv = np.linalg.inv(np.eye(len(jac)) - jac)
    return np.diag(inv)[beta_idx] * eta * sigma2 / n


def sem_beta_variances_masked(
    jac: np.ndarray,
    beta_idx: np.ndarray,
    *,
    eta: float,
    sigma2: float,
    n: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """The same variances computed the way the federation does: from U = (I - J) V for random
    directions V, using only U'U (a sum over parties) and each coordinate's own rows of U and V:
    diag((I - J)^{-1})_j = V[j] (U'U)^{-1} U[j]'."""
    d = len(jac)
    v = rng.standard_normal((d, d))
    u = v - jac @ v
    ginv = np.linalg.inv(u.T @ u)
    diag = np.einsum("ij,jk,ik->i", v, ginv, u)
    return diag[beta_idx] * eta * sigma2 / n


# ------------------------------------------------------------------------------ OLS


@dataclass
class OlsResult:
    coef: np.ndarray  # (beta_0 if intercept, then the columns)
    se: np.ndarray
    s2: float
    n: int


def ols(y: np.ndarray, x: np.ndarray, *, intercept: bool = True) -> OlsResult:
    """Ordinary least squares with classical standard errors (s^2 = RSS / (n - p))."""
    design = np.column_stack([np.ones(len(y)), x]) if intercept else np.asarray(x)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    n, p = design.shape
    s2 = float(resid @ resid / (n - p))
    cov = s2 * np.linalg.inv(design.T @ design)
    return OlsResult(coef, np.sqrt(np.diag(cov)), s2, n)


def cc_ols(data: RegressionData) -> OlsResult:
    rows = data.complete_rows()
    return ols(
        data.y[rows], np.concatenate([z[rows] for z in data.z], axis=1), intercept=data.intercept
    )


def impute_ols(data: RegressionData) -> OlsResult:
    cols = []
    for zk, ok in zip(data.z, data.observed, strict=True):
        filled = zk.copy()
        filled[~ok] = zk[ok].mean(axis=0)
        cols.append(filled)
    return ols(data.y, np.concatenate(cols, axis=1), intercept=data.intercept)


def single_ols(data: RegressionData, block: int) -> OlsResult:
    rows = data.observed[block]
    return ols(data.y[rows], data.z[block][rows], intercept=data.intercept)
