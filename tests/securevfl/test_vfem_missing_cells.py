"""VFEM with missing cells in the active party's own block (NA tokens), on top of missing
passive blocks and rows that have only y.

The oracle here shares no code with VFEM: the observed-data likelihood of each row is the
marginal density of its present coordinates under the joint Gaussian of (x, y) implied by the
model (x ~ N(mu, blockdiag(Sigma_k)), y = beta_0 + x'beta + eps), maximised by SciPy's
trust-region Newton method with torch's exact derivatives; standard errors are the inverse of
the observed information (the negative Hessian of that likelihood) at the maximum."""

from __future__ import annotations

import copy
import csv
import io
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import scipy.optimize
import torch

from securevfl.config import parse_config
from securevfl.inproc import run_federation
from securevfl.methods.vfem import block as vfem_block
from securevfl.methods.vfem import inference as vfem_inference
from securevfl.methods.vfem.active import VfemActive
from securevfl.methods.vfem.block import BlockState, VfemInputError
from securevfl.methods.vfem.cells import (
    cell_patterns,
    estep_cells,
    loglik_cells,
    mstep_cells,
)
from securevfl.stats.gaussian_blocks import BlockParams, block_loglik, estep_terms, mstep
from tests.securevfl.conftest import permissive_policy

LOG_2PI = float(np.log(2 * np.pi))
COLS = [f"X{i + 1}" for i in range(7)]
DIMS = (3, 2, 2)  # the active party's block, then parties b and c
BETA = np.array([1.0, -0.5, 0.8, 1.0, 0.5, -1.0, 0.6])
INTERCEPT = 0.5


def ar1(p: int, rho: float = 0.5) -> np.ndarray:
    return rho ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))


def simulate_cells(n: int, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """y and the 7 covariates (NaN where missing): the active party's 3 columns lack single
    cells (X1 MCAR 15 %, X2 more often where y is large: MAR, X3 MCAR 10 %), and the whole
    block on every 11th row; parties b and c lack 30 % and 50 % of their rows; every 9th row
    has only y."""
    rng = np.random.default_rng(seed)
    means = [np.array([0.5, -0.3, 1.0]), np.zeros(2), np.array([0.2, 0.0])]
    scales = [np.array([1.0, 2.0, 0.5]), np.ones(2), np.array([1.5, 1.0])]
    blocks = [
        rng.multivariate_normal(mu, ar1(p) * np.outer(s, s), size=n)
        for mu, s, p in zip(means, scales, DIMS, strict=True)
    ]
    x = np.concatenate(blocks, axis=1)
    y = INTERCEPT + x @ BETA + rng.normal(size=n)
    # the active block's cells: MCAR, MAR on y, MCAR
    x[rng.random(n) < 0.15, 0] = np.nan
    x[rng.random(n) < 1.0 / (1.0 + np.exp(-(y - y.mean()) / y.std() - 1.5)), 1] = np.nan
    x[rng.random(n) < 0.10, 2] = np.nan
    x[np.arange(n) % 11 == 5, :3] = np.nan
    x[rng.random(n) < 0.3, 3:5] = np.nan
    x[rng.random(n) < 0.5, 5:7] = np.nan
    x[np.arange(n) % 9 == 0, :] = np.nan
    return y, x


# ------------------------------------------------------------------------------- the oracle


def _unpack(vec: torch.Tensor, dims, *, chol: bool):
    """(beta_0, beta, mu, [Sigma_k], sigma^2) from beta_0, beta, mu, then per block the lower
    triangle of Sigma_k (natural) or of its Cholesky factor with log diagonal (chol), then
    sigma^2 (natural) or log sigma^2 (chol)."""
    p = sum(dims)
    beta0, beta, mu = vec[0], vec[1 : 1 + p], vec[1 + p : 1 + 2 * p]
    i = 1 + 2 * p
    sigmas = []
    for d in dims:
        rows, cols = np.tril_indices(d)
        low = torch.zeros((d, d), dtype=torch.float64)
        low = low.index_put((torch.as_tensor(rows), torch.as_tensor(cols)), vec[i : i + len(rows)])
        i += len(rows)
        if chol:
            low = low - torch.diag(torch.diag(low)) + torch.diag(torch.exp(torch.diag(low)))
            sigmas.append(low @ low.T)
        else:
            sigmas.append(low + low.T - torch.diag(torch.diag(low)))
    sigma2 = torch.exp(vec[i]) if chol else vec[i]
    return beta0, beta, mu, sigmas, sigma2


def _loglik(data: np.ndarray, groups, beta0, beta, mu, sigmas, sigma2) -> torch.Tensor:
    """sum_i log N(present coordinates of (x_i, y_i); their mean, their covariance) under the
    joint Gaussian of (x, y)."""
    cov_x = torch.block_diag(*sigmas)
    cxy = cov_x @ beta
    mean = torch.cat([mu, (beta0 + mu @ beta).reshape(1)])
    cov = torch.cat(
        [
            torch.cat([cov_x, cxy[:, None]], dim=1),
            torch.cat([cxy, (beta @ cxy + sigma2).reshape(1)])[None, :],
        ]
    )
    total = torch.zeros((), dtype=torch.float64)
    for idx, values in groups:
        i = torch.as_tensor(idx)
        chol = torch.linalg.cholesky(cov[i][:, i])
        d = torch.as_tensor(values) - mean[i]
        sol = torch.linalg.solve_triangular(chol, d.T, upper=False)
        total = total - 0.5 * (
            values.shape[0] * (len(idx) * LOG_2PI + 2 * torch.sum(torch.log(torch.diag(chol))))
            + torch.sum(sol * sol)
        )
    return total


def joint_gaussian_mle(y: np.ndarray, x: np.ndarray, dims=DIMS) -> dict:
    """The maximiser of the observed-data likelihood and its observed-information standard
    errors for (beta_0, beta)."""
    data = np.concatenate([x, y[:, None]], axis=1)
    present = ~np.isnan(data)
    groups = []
    for pattern in np.unique(present, axis=0):
        rows = np.all(present == pattern, axis=1)
        idx = np.flatnonzero(pattern)
        groups.append((idx, data[np.ix_(rows, idx)]))
    n, p = x.shape
    # start: complete-case least squares, available-case moments
    cc = ~np.isnan(x).any(axis=1)
    design = np.concatenate([np.ones((cc.sum(), 1)), x[cc]], axis=1)
    coef = np.linalg.lstsq(design, y[cc], rcond=None)[0]
    start = [coef, np.nanmean(x, axis=0)]
    at = 0
    for d in dims:
        block = x[:, at : at + d]
        block = block[~np.isnan(block).any(axis=1)]
        low = np.linalg.cholesky(np.cov(block.T, bias=True).reshape(d, d))
        low[np.diag_indices(d)] = np.log(np.diag(low))
        start.append(low[np.tril_indices(d)])
        at += d
    x0 = np.concatenate([*start, [np.log(np.var(y))]])

    def objective(v: torch.Tensor) -> torch.Tensor:
        return -_loglik(data, groups, *_unpack(v, dims, chol=True)) / n

    def value_and_grad(v):
        t = torch.tensor(v, requires_grad=True)
        val = objective(t)
        val.backward()
        return float(val.detach()), t.grad.numpy().copy()

    def hessian(v):
        return torch.autograd.functional.hessian(objective, torch.tensor(v)).numpy()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads only add hand-offs
    try:
        res = scipy.optimize.minimize(
            value_and_grad,
            x0,
            jac=True,
            hess=hessian,
            method="trust-exact",
            options={"gtol": 1e-11, "maxiter": 500},
        )
        beta0, beta, mu, sigmas, sigma2 = _unpack(torch.tensor(res.x), dims, chol=True)
        natural = torch.cat(
            [
                beta0.reshape(1),
                beta,
                mu,
                *(s[tuple(torch.as_tensor(np.array(np.tril_indices(len(s)))))] for s in sigmas),
                sigma2.reshape(1),
            ]
        ).detach()

        def loglik(v: torch.Tensor) -> torch.Tensor:
            return _loglik(data, groups, *_unpack(v, dims, chol=False))

        # polish with Newton steps on the natural parameters (quadratic convergence from
        # the trust region's answer, whose stopping rule leaves ~1e-9 in the gradient)
        for _ in range(20):
            t = natural.clone().requires_grad_(True)
            grad = torch.autograd.grad(loglik(t), t)[0].numpy()
            info = -torch.autograd.functional.hessian(loglik, natural).numpy()
            step = np.linalg.solve(info, grad)
            natural = natural + torch.as_tensor(step)
            if np.max(np.abs(step)) < 1e-14:
                break
        t = natural.clone().requires_grad_(True)
        grad = torch.autograd.grad(loglik(t), t)[0].numpy() / n
        info = -torch.autograd.functional.hessian(loglik, natural).numpy()
    finally:
        torch.set_num_threads(threads)
    cov = np.linalg.inv(info)
    return {
        "beta": natural.numpy()[: 1 + p],
        "se": np.sqrt(np.diag(cov)[: 1 + p]),
        "grad": float(np.max(np.abs(grad))),
        "message": res.message,
    }


# ------------------------------------------------------------------------------- federation

BASE = {
    "run": {"method": "vfem", "aggregation": "mask", "seed": 0, "transport": "inproc"},
    "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.0},
    "active": {"columns": COLS[:3]},
    "parties": {"b": {"columns": COLS[3:5]}, "c": {"columns": COLS[5:]}},
    "secure": {"frac_bits": 40, "bound": 2.0**18},
    "network": {
        "heartbeat_interval": 0.2,
        "peer_timeout": 3.0,
        "round_timeout": 30.0,
        "startup_timeout": 30.0,
    },
    "method": {"tol_loss": 1e-14, "tol_beta": 1e-11, "max_iter": 50_000},
}


def write_table(path: Path, y: np.ndarray, x: np.ndarray) -> None:
    """The table as a user's file would have it: empty cells of the active party's columns
    written as the NA tokens "?", "NA" and "" in turn."""
    tokens = ("?", "NA", "")
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["ID", *COLS, "Y"])
        for i in range(len(y)):
            cells = [
                (tokens[(i + j) % 3] if j < 3 else "") if np.isnan(v) else repr(float(v))
                for j, v in enumerate(x[i])
            ]
            out.writerow([i + 1, *cells, repr(float(y[i]))])


def run(directory: Path, y: np.ndarray, x: np.ndarray, *, name: str, **changes):
    directory.mkdir(parents=True, exist_ok=True)
    write_table(directory / "data.csv", y, x)
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    cfg = parse_config(permissive_policy(raw), source=directory / "config.toml")
    code, metrics = run_federation(cfg, out=directory / name, stdout=io.StringIO())
    return code, metrics, directory / name


@pytest.fixture(scope="module")
def cells_mle():
    """The acceptance design (600 rows) and its full-data maximum-likelihood fit."""
    y, x = simulate_cells(600, seed=31)
    mle = joint_gaussian_mle(y, x)
    assert mle["grad"] < 1e-10, mle["message"]
    return y, x, mle


def test_missing_cells_in_the_active_block_reach_the_full_data_mle(tmp_path, cells_mle):
    """Acceptance (issue 15, item 4): on a design where the active party's block lacks single
    cells (NA tokens, MAR on y for one column) and some rows have only y, VFEM's estimates and
    standard errors equal the full-data maximum-likelihood fit to 1e-6 relative."""
    y, x, mle = cells_mle
    own = x[:, :3]
    partial = np.isnan(own).any(axis=1) & ~np.isnan(own).all(axis=1)
    only_y = np.isnan(x).all(axis=1)
    assert partial.sum() > 150 and only_y.sum() > 60  # the design has both kinds of row
    code, metrics, run_dir = run(tmp_path, y, x, name="cells")
    assert code == 0, (run_dir / "logs" / "active.log").read_text()[-3000:]
    assert metrics["fit"]["n"] == 600 and metrics["fit"]["converged"]
    rows = metrics["coefficients"]
    assert [r["name"] for r in rows] == ["(intercept)", *COLS]
    est = np.array([r["estimate"] for r in rows])
    se = np.array([r["se"] for r in rows])
    rel_est = np.max(np.abs(est / mle["beta"] - 1))
    rel_se = np.max(np.abs(se / mle["se"] - 1))
    print(f"max relative error: estimates {rel_est:.2e}, standard errors {rel_se:.2e}")
    assert rel_est < 1e-6
    assert rel_se < 1e-6


# direction draws checked below; with a square d x d direction matrix (before SEM probed more
# directions than coordinates) draws 11 and 13 put a standard error 1.4e-6 and 7.8e-6 off
DRAWS = range(20)


def test_standard_errors_reach_the_mle_for_every_direction_draw(tmp_path, monkeypatch, cells_mle):
    """SEM's directions are random by design (each role draws its own, secretly), so the
    standard errors' accuracy must not depend on the draw. One fit, then SEM repeated for 20
    seeded draws of every role's directions (in place of the CSPRNG): every standard error of
    every draw within 1e-7 relative of the observed-information one."""
    y, x, mle = cells_mle
    draw = {"seed": -1}
    calls: list[tuple[int, str, int, int]] = []
    secret = vfem_block.secret_directions

    def seeded_directions(rows: int, d: int) -> np.ndarray:
        # one stream per (draw, role, rows): the roles are threads of this process (inproc)
        role = threading.current_thread().name
        calls.append((draw["seed"], role, rows, d))
        rng = np.random.default_rng([draw["seed"], zlib.crc32(role.encode()), rows, d])
        return secret(rows, d, rng=rng)

    monkeypatch.setattr(vfem_block, "secret_directions", seeded_directions)
    monkeypatch.setattr(vfem_inference, "secret_directions", seeded_directions)
    tables: list[list[dict]] = []
    inference_once = VfemActive._inference

    def inference_per_draw(self, ctx):
        for seed in DRAWS:
            draw["seed"] = seed
            inference_once(self, ctx)
            tables.append(copy.deepcopy(self.coefficients))

    monkeypatch.setattr(VfemActive, "_inference", inference_per_draw)
    code, metrics, run_dir = run(tmp_path, y, x, name="draws")
    assert code == 0, (run_dir / "logs" / "active.log").read_text()[-3000:]
    assert len(tables) == len(DRAWS)
    # every draw: the active party's own block and its two global coordinates, parties b and c
    for seed in DRAWS:
        got = [(role, rows) for s, role, rows, _ in calls if s == seed]
        assert sorted(rows for _, rows in got) == [2, 7, 7, 12], got
        assert len({role for role, _ in got}) == 3, got
    errors = []
    for table in tables:
        se = np.array([r["se"] for r in table])
        errors.append(float(np.max(np.abs(se / mle["se"] - 1))))
    print("max relative error of the standard errors per draw:", [f"{e:.1e}" for e in errors])
    assert max(errors) < 1e-7, errors


@pytest.mark.parametrize("method", ["cc-ols", "impute-ols"])
def test_comparators_with_missing_cells_equal_closed_form_ols(tmp_path, method):
    """cc-ols keeps the rows with every cell of every block; impute-ols (on the rows some
    passive party holds, as the OLS comparators do) fills each empty cell, and each row a party
    lacks, with its column's mean over the cells present."""
    y, x = simulate_cells(300, seed=32)
    if method == "cc-ols":
        rows = ~np.isnan(x).any(axis=1)
        design, target = x[rows], y[rows]
    else:
        rows = ~np.isnan(x[:, 3:]).all(axis=1)
        design, target = x[rows], y[rows]
        design = np.where(np.isnan(design), np.nanmean(design, axis=0), design)
    design = np.concatenate([np.ones((len(target), 1)), design], axis=1)
    coef = np.linalg.lstsq(design, target, rcond=None)[0]
    resid = target - design @ coef
    s2 = resid @ resid / (len(target) - design.shape[1])
    se = np.sqrt(np.diag(s2 * np.linalg.inv(design.T @ design)))
    code, metrics, run_dir = run(tmp_path, y, x, name=method, **{"run.method": method})
    assert code == 0, (run_dir / "logs" / "active.log").read_text()[-3000:]
    assert metrics["fit"]["n"] == len(target)
    est = np.array([r["estimate"] for r in metrics["coefficients"]])
    got_se = np.array([r["se"] for r in metrics["coefficients"]])
    assert np.max(np.abs(est - coef) / np.maximum(np.abs(coef), 1.0)) < 1e-6
    assert np.max(np.abs(got_se / se - 1)) < 1e-6


def test_a_passive_block_with_missing_cells_is_refused_naming_column_row_and_fix(tmp_path):
    """A passive party would need 1/tau_i on rows it holds to model its own missing cells; VFEM
    refuses instead, at the party, naming the column, the row and the fixes."""
    y, x = simulate_cells(200, seed=33)
    x[16, 3:5] = [np.nan, 0.7]  # row id 17: party b has X5 but not X4
    code, metrics, run_dir = run(tmp_path, y, x, name="passive-cells")
    assert code != 0 and metrics is None
    log = (run_dir / "logs" / "active.log").read_text()
    for words in ("party 'b'", "column 'X4'", "row '17'", "[active] columns", "whole row empty"):
        assert words in log, (words, log[-2000:])


# ---------------------------------------------------------------------- the block, in-process


def _random_params(rng: np.random.Generator, p: int) -> BlockParams:
    a = rng.normal(size=(p, p))
    return BlockParams(rng.normal(size=p), rng.normal(size=p), a @ a.T / p + np.eye(p))


def test_cell_patterns_of_whole_rows_reduce_to_the_block_model():
    """With whole rows present or missing, the cell-pattern E-step, log-likelihood and update
    are the block model's (`securevfl.stats.gaussian_blocks`)."""
    rng = np.random.default_rng(0)
    n, p = 50, 3
    params = _random_params(rng, p)
    held = rng.random(n) > 0.3
    z = np.where(held[:, None], rng.normal(size=(n, p)), 0.0)
    pats = cell_patterns(np.repeat(held[:, None], p, axis=1))
    for got, want in zip(estep_cells(z, pats, params), estep_terms(z, held, params), strict=True):
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.isclose(loglik_cells(z, pats, params), block_loglik(z, held, params), rtol=1e-12)
    e, w = rng.normal(size=n), rng.random(n) + 0.5
    kw = {"e": e, "w": w, "sigma2": 0.8, "eta": 0.3}
    a, b = mstep_cells(z, pats, params, **kw), mstep(z, held, params, **kw)
    for got, want in zip(a.coordinates(model_x=True), b.coordinates(model_x=True), strict=True):
        assert np.isclose(got, want, rtol=1e-12, atol=1e-12)


def test_cell_terms_are_the_conditional_moments_of_the_missing_cells():
    """h_i = E[x_i'beta | present cells], q_i = Var[x_i'beta | present cells] (Gaussian
    conditioning written out here), and the block's prediction uses them on new rows."""
    rng = np.random.default_rng(1)
    p = 3
    params = _random_params(rng, p)
    row = np.array([0.4, np.nan, -1.2])
    o, m = np.array([0, 2]), np.array([1])
    s = params.sigma
    cond_mean = params.mu[m] + s[np.ix_(m, o)] @ np.linalg.solve(
        s[np.ix_(o, o)], row[o] - params.mu[o]
    )
    cond_cov = s[np.ix_(m, m)] - s[np.ix_(m, o)] @ np.linalg.solve(s[np.ix_(o, o)], s[np.ix_(o, m)])
    want_h = row[o] @ params.beta[o] + cond_mean @ params.beta[m]
    want_q = params.beta[m] @ cond_cov @ params.beta[m]
    z = np.nan_to_num(row)[None, :]
    h, q = estep_cells(z, cell_patterns(~np.isnan(row)[None, :]), params)
    assert np.isclose(h[0], want_h, rtol=1e-12) and np.isclose(q[0], want_q, rtol=1e-12)
    values = rng.normal(size=(20, p))
    values[3, 1] = values[7] = np.nan
    block = BlockState(
        owner="the active party",
        columns=("u", "v", "w"),
        values=values,
        intercept=False,
        standardize=False,
        allow_cells=True,
    )
    block.params = params
    pred = block.predict(np.stack([row, np.full(p, np.nan), np.ones(p)]))
    assert np.allclose(pred, [want_h, params.mu @ params.beta, params.beta.sum()], rtol=1e-12)


def test_a_block_with_missing_cells_is_refused_only_where_not_allowed():
    values = np.array([[1.0, 2.0], [np.nan, 1.0], [np.nan, np.nan], [2.0, 0.5], [0.3, 4.0]])
    kwargs = {"columns": ("u", "v"), "values": values, "intercept": True, "standardize": True}
    with pytest.raises(VfemInputError, match=r"party 'z': column 'u' is empty on row 'id-2'"):
        BlockState(owner="party 'z'", row_name=lambda i: f"id-{i + 1}", **kwargs)
    block = BlockState(owner="the active party", allow_cells=True, **kwargs)
    assert block.cellwise and block.held.tolist() == [True, True, False, True, True]
