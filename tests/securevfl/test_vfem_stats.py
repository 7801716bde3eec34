"""VFEM's statistics on the centralised NumPy reference: VFEM = exact EM = the maximiser of the
closed-form likelihood, and SEM standard errors = observed-information standard errors.

Also the kit shared with `test_vfem_federation.py`: simulated block data, and the oracle: the
closed-form observed-data log-likelihood (notes §1.4) in torch, maximised by a generic optimiser
(scipy's trust-region Newton with the exact Hessian), with observed-information standard errors
(inverse negative Hessian). The oracle shares no code with the EM it checks."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch

from securevfl.methods.vfem.block import VfemInputError, secret_directions
from securevfl.methods.vfem.inference import sem_directions, sem_inverse
from securevfl.stats.gaussian_blocks import BlockParams, unvech, vech
from securevfl.stats.reference import (
    RegressionData,
    beta_positions,
    cc_ols,
    default_eta,
    fit_em,
    fit_vfem,
    initial_theta,
    jacobian,
    observed_loglik,
    sem_beta_variances,
    sem_beta_variances_masked,
    vfem_step,
)

LOG_2PI = float(np.log(2 * np.pi))
DIMS = (3, 2, 2)
BETA = np.array([1.0, -0.5, 0.8, 1.0, 0.5, -1.0, 0.6])


def ar1(p: int, rho: float = 0.5) -> np.ndarray:
    return rho ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))


def simulate(
    n: int,
    rates=(0.2, 0.4, 0.6),
    *,
    seed: int = 0,
    intercept: float = 0.5,
    dims=DIMS,
    beta=BETA,
    means=None,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """y and K blocks (NaN rows where missing, MCAR with `rates`); no row is missing at every
    block (the federation drops such rows, so tests compare on the same rows)."""
    rng = np.random.default_rng(seed)
    blocks = [
        rng.multivariate_normal(np.zeros(p) if means is None else means[k], ar1(p), size=n)
        for k, p in enumerate(dims)
    ]
    y = intercept + np.concatenate(blocks, axis=1) @ beta + rng.normal(size=n)
    present = np.stack([rng.random(n) >= r for r in rates], axis=1)
    nobody = ~present.any(axis=1)
    present[nobody, int(np.argmin(rates))] = True
    for k, block in enumerate(blocks):
        block[~present[:, k]] = np.nan
    return y, blocks


def _loglik(data: RegressionData, beta0, betas, mus, sigmas, sigma2) -> torch.Tensor:
    y = torch.as_tensor(data.y)
    m = beta0 + torch.zeros_like(y)
    q = torch.zeros_like(y)
    total = torch.zeros((), dtype=torch.float64)
    for zk, ok, b, mu, sig in zip(data.z, data.observed, betas, mus, sigmas, strict=True):
        z = torch.as_tensor(zk)
        o = torch.as_tensor(ok)
        m = m + torch.where(o, z @ b, mu @ b)
        q = q + torch.where(o, 0.0, b @ sig @ b)
        # the covariate part through sufficient statistics (fast second derivatives)
        zo = z[o]
        n_o, p = zo.shape
        sx = zo.sum(0)
        scatter = zo.T @ zo - torch.outer(mu, sx) - torch.outer(sx, mu) + n_o * torch.outer(mu, mu)
        logdet = torch.logdet(sig)
        total = total - 0.5 * (
            n_o * (p * LOG_2PI + logdet) + torch.trace(torch.linalg.solve(sig, scatter))
        )
    tau = sigma2 + q
    r = y - m
    return total - 0.5 * torch.sum(LOG_2PI + torch.log(tau) + r * r / tau)


def _unpack_natural(vec: torch.Tensor, dims: list[int], intercept: bool):
    beta0 = vec[0] if intercept else torch.zeros((), dtype=torch.float64)
    i = 1 if intercept else 0
    betas, mus, sigmas = [], [], []
    for p in dims:
        betas.append(vec[i : i + p])
        i += p
    for p in dims:
        mus.append(vec[i : i + p])
        i += p
    for p in dims:
        rows, cols = np.tril_indices(p)
        k = len(rows)
        s = torch.zeros((p, p), dtype=torch.float64)
        s = s.index_put((torch.as_tensor(rows), torch.as_tensor(cols)), vec[i : i + k])
        s = s + s.T - torch.diag(torch.diag(s))
        sigmas.append(s)
        i += k
    return beta0, betas, mus, sigmas, vec[i]


def _unpack_chol(vec: torch.Tensor, dims: list[int], intercept: bool):
    beta0, betas, mus, lows, logs2 = _unpack_natural(vec, dims, intercept)
    sigmas = []
    for low in lows:
        lo = torch.tril(low)
        lo = lo - torch.diag(torch.diag(lo)) + torch.diag(torch.exp(torch.diag(lo)))
        sigmas.append(lo @ lo.T)
    return beta0, betas, mus, sigmas, torch.exp(logs2)


def fit_mle(data: RegressionData, *, beta_start: np.ndarray) -> dict:
    """Maximise the closed-form likelihood with BFGS from the CC estimate and available-case
    moments; return beta (beta_0 first) and the observed-information SEs of beta."""
    dims = data.dims
    start = [beta_start[0:1]] if data.intercept else []
    start.append(beta_start[1:])
    chols = []
    for zk, ok, p in zip(data.z, data.observed, dims, strict=True):
        mu = zk[ok].mean(0)
        start.append(mu)
        cov = np.cov(zk[ok].T, bias=True).reshape(p, p)
        lo = np.linalg.cholesky(cov)
        lo[np.diag_indices(p)] = np.log(np.diag(lo))
        chols.append(lo[np.tril_indices(p)])
    # order: beta, mu (per block), chol (per block), log sigma2
    x0 = np.concatenate([*start, *chols, [np.log(np.var(data.y))]])

    def objective(v: torch.Tensor) -> torch.Tensor:
        return -_loglik(data, *_unpack_chol(v, dims, data.intercept)) / data.n

    def f(x):
        t = torch.tensor(x, requires_grad=True)
        val = objective(t)
        val.backward()
        return float(val.detach()), t.grad.numpy().copy()

    def hess(x):
        return torch.autograd.functional.hessian(objective, torch.tensor(x)).numpy()

    # a generic second-order optimiser (no EM inside): trust region with the exact Hessian;
    # one thread: these small tensors only lose time to thread hand-offs
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = scipy.optimize.minimize(
            f, x0, jac=True, hess=hess, method="trust-exact", options={"gtol": 1e-9, "maxiter": 500}
        )
    finally:
        torch.set_num_threads(threads)
    beta0, betas, mus, sigmas, sigma2 = _unpack_chol(torch.tensor(res.x), dims, data.intercept)
    natural = (
        ([beta0.reshape(1)] if data.intercept else [])
        + betas
        + mus
        + [s[tuple(torch.as_tensor(np.array(np.tril_indices(s.shape[0]))))] for s in sigmas]
        + [sigma2.reshape(1)]
    )
    nat = torch.cat(natural).detach()
    hess = torch.autograd.functional.hessian(
        lambda v: _loglik(data, *_unpack_natural(v, dims, data.intercept)), nat
    )
    cov = np.linalg.inv(-hess.numpy())
    p_beta = (1 if data.intercept else 0) + sum(dims)
    beta = nat.numpy()[:p_beta]
    if not data.intercept:
        beta = np.concatenate([[0.0], beta])
    se = np.sqrt(np.diag(cov)[:p_beta])
    return {
        "beta": beta,
        "se": se,
        "loglik": -res.fun * data.n,
        "grad_norm": float(np.max(np.abs(res.jac))),
        "message": res.message,
    }


# ------------------------------------------------------------------------------------ tests
TIGHT = {"tol_loss": 1e-14, "tol_beta": 1e-11, "max_iter": 50_000}


def _fit_both(data: RegressionData):
    cc = cc_ols(data)
    theta0 = initial_theta(data, cc.coef)
    eta = default_eta(theta0, intercept=data.intercept)
    vf = fit_vfem(data, theta0, eta=eta, **TIGHT)
    em = fit_em(data, theta0, **TIGHT)
    assert vf.converged and em.converged
    return cc, eta, vf, em


@pytest.fixture(scope="module")
def fitted():
    """Three parties, missing rates 0.2/0.4/0.6: VFEM, EM and the likelihood's maximiser."""
    y, blocks = simulate(1200, (0.2, 0.4, 0.6), seed=3)
    data = RegressionData.from_blocks(y, blocks)
    cc, eta, vf, em = _fit_both(data)
    return {
        "data": data,
        "cc": cc,
        "eta": eta,
        "vf": vf,
        "em": em,
        "mle": fit_mle(data, beta_start=cc.coef),
    }


def test_vfem_equals_em_and_the_likelihood_maximiser(fitted):
    vf, em, mle, cc = fitted["vf"], fitted["em"], fitted["mle"], fitted["cc"]
    assert np.max(np.abs(vf.theta.beta - em.theta.beta)) < 1e-6
    assert mle["grad_norm"] < 1e-8, mle["message"]
    assert np.max(np.abs(vf.theta.beta - mle["beta"])) < 1e-5
    loglik = observed_loglik(fitted["data"], vf.theta)
    assert abs(loglik - mle["loglik"]) < 1e-9 * abs(mle["loglik"])
    # the start is far from the answer: the test is not passed at the start
    assert np.max(np.abs(cc.coef - mle["beta"])) > 1e-2


@pytest.mark.parametrize(
    ("rates", "intercept"), [((0.0, 0.3, 0.6), True), ((0.5, 0.2, 0.6), False)]
)
def test_vfem_equals_em_in_other_designs(rates, intercept):
    y, blocks = simulate(
        600,
        rates,
        seed=5,
        intercept=0.0 if not intercept else 1.0,
        means=[np.full(p, 0.5) for p in DIMS],
    )
    data = RegressionData.from_blocks(y, blocks, intercept=intercept)
    _, _, vf, em = _fit_both(data)
    assert np.max(np.abs(vf.theta.beta - em.theta.beta)) < 1e-6
    assert abs(vf.theta.sigma2 - em.theta.sigma2) < 1e-8


def test_sem_standard_errors_match_observed_information(fitted):
    data, eta, vf, mle = fitted["data"], fitted["eta"], fitted["vf"], fitted["mle"]
    jac = jacobian(lambda th: vfem_step(data, th, eta=eta), vf.theta, intercept=True)
    idx = beta_positions(vf.theta, intercept=True)
    se = np.sqrt(sem_beta_variances(jac, idx, eta=eta, sigma2=vf.theta.sigma2, n=data.n))
    assert np.max(np.abs(se / mle["se"] - 1)) < 0.01
    # and much closer than that: SEM on the map actually iterated is exact up to differencing
    assert np.max(np.abs(se / mle["se"] - 1)) < 1e-5
    # the federation's formula (random directions, U'U only) gives the same numbers
    masked = sem_beta_variances_masked(
        jac, idx, eta=eta, sigma2=vf.theta.sigma2, n=data.n, rng=np.random.default_rng(1)
    )
    assert np.allclose(np.sqrt(masked), se, rtol=1e-9)


def _role_directions(rng: np.random.Generator, dims, n_dirs: int) -> np.ndarray:
    """V as the roles draw it: each role's rows orthonormal, independent across roles."""
    return np.concatenate([secret_directions(r, n_dirs, rng=rng) for r in dims])


def _sem_diagonal(v: np.ndarray, u: np.ndarray, rank: int) -> np.ndarray:
    return np.einsum("ij,jk,ik->i", v, sem_inverse(u.T @ u, rank, label="vfem"), u)


def test_sem_is_accurate_for_every_draw_of_the_secret_directions():
    """The federation's SEM recovers diag (I - J)^{-1} from U = (I - J) V + E, E the central
    differences' error (1e-10, as measured there), with V drawn by the roles independently. A
    square V (as many directions as coordinates) is a random matrix whose condition has a heavy
    tail, which multiplies E: some draws are off by 1e-5. With `sem_directions` (more
    directions) every one of 300 draws is within 3e-8."""
    rng = np.random.default_rng(5)
    dims = (12, 2, 7, 7)  # the missing-cells acceptance design: own block, globals, b, c
    d = sum(dims)
    eye = np.eye(d)
    s = eye + 0.3 * rng.normal(size=(d, d)) / np.sqrt(d)
    jac = s @ np.diag(rng.uniform(0.0, 0.9, d)) @ np.linalg.inv(s)
    want = np.diag(np.linalg.inv(eye - jac))
    n_dirs = sem_directions(d)
    assert d < n_dirs < 2 * d
    worst = {d: 0.0, n_dirs: 0.0}
    for _ in range(300):
        for n in worst:
            v = _role_directions(rng, dims, n)
            u = (eye - jac) @ v + 1e-10 * rng.normal(size=v.shape)
            err = float(np.max(np.abs(_sem_diagonal(v, u, d) / want - 1)))
            worst[n] = max(worst[n], err)
    assert worst[n_dirs] < 3e-8, worst
    assert worst[d] > 1e-6, worst  # why: the square design's tail


def test_sem_refuses_a_singular_information_matrix_with_extra_directions():
    """The extra directions' null space (U has rank d) is not mistaken for singularity, but a
    J with an eigenvalue 1 (a coefficient not identified) is refused."""
    rng = np.random.default_rng(6)
    dims = (5, 2, 3)
    d = sum(dims)
    v = _role_directions(rng, dims, sem_directions(d))
    jac = np.diag(rng.uniform(0.0, 0.9, d))
    u = (np.eye(d) - jac) @ v
    assert np.allclose(_sem_diagonal(v, u, d), 1 / (1 - np.diag(jac)), rtol=1e-10)
    jac[3, 3] = 1.0
    u = (np.eye(d) - jac) @ v
    with pytest.raises(VfemInputError, match="information matrix is singular"):
        sem_inverse(u.T @ u, d, label="vfem")


def test_closed_form_alpha_equals_the_papers_matrix_route():
    """Notes §3.1: alpha_i = Sigma_{i,mis|obs} beta_{i,mis} (the paper's V_i messages) equals
    a_k sigma^2 / tau_i per missing block."""
    rng = np.random.default_rng(0)
    dims, sigma2 = (3, 2), 0.7
    params = []
    for p in dims:
        a = rng.normal(size=(p, p))
        params.append(BlockParams(rng.normal(size=p), rng.normal(size=p), a @ a.T + np.eye(p)))
    s = sum(float(b.beta @ b.sigma @ b.beta) for b in params)
    tau = sigma2 + s
    sig_mis = np.block([[params[0].sigma, np.zeros((3, 2))], [np.zeros((2, 3)), params[1].sigma]])
    beta_mis = np.concatenate([b.beta for b in params])
    v = sig_mis @ beta_mis
    cond = sig_mis - np.outer(v, v) / tau
    alpha = cond @ beta_mis
    closed = np.concatenate([b.sigma @ b.beta * sigma2 / tau for b in params])
    assert np.allclose(alpha, closed, rtol=1e-12)
    assert np.isclose(beta_mis @ cond @ beta_mis, (tau - sigma2) * sigma2 / tau)


def test_vech_round_trip():
    m = np.array([[2.0, 0.3, 0.1], [0.3, 1.0, -0.2], [0.1, -0.2, 3.0]])
    assert np.array_equal(unvech(vech(m), 3), m)
