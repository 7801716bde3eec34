"""One role's covariate block in a VFEM (or OLS) fit: its standardised rows, its parameters and
its SEM probes. Everything here is computed from that role's own rows."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.errors import MethodInputError
from securevfl.lazy import torch
from securevfl.stats.gaussian_blocks import (
    BlockParams,
    available_case_moments,
    block_loglik,
    estep_terms,
    mstep,
)


class VfemInputError(MethodInputError):
    """The data cannot be fitted (constant or collinear block, no rows, empty cells); the
    message names the party and the column."""


class VfemDivergence(RuntimeError):
    """The iteration produced a non-finite or exploding loss."""


def _describe_columns(columns: Sequence[str]) -> str:
    return ", ".join(repr(c) for c in columns)


class BlockState:
    """One role's covariate block in a fit: its standardised rows, which design rows it holds,
    its parameters (beta, mu, Sigma on the standardised scale) and its SEM probes.

    Everything here is computed from this role's own rows; nothing leaves except through the
    method's operations. Raises `VfemInputError` naming `owner` and the column for data the
    model cannot fit."""

    def __init__(
        self,
        *,
        owner: str,
        columns: Sequence[str],
        values: np.ndarray,
        intercept: bool,
        standardize: bool,
    ) -> None:
        self.owner = owner
        self.columns = tuple(columns)
        values = np.asarray(values, dtype=np.float64)
        nan = np.isnan(values)
        held = ~nan.all(axis=1)
        partial = nan & held[:, None]
        if partial.any():
            j = int(np.argmax(partial.any(axis=0)))
            raise VfemInputError(
                f"{owner}: column {self.columns[j]!r} has empty cells on "
                f"{int(partial[:, j].sum())} of the rows it holds; VFEM treats a block as present "
                "or missing as a whole, so fill those cells or leave the whole row empty"
            )
        n_held, p = int(held.sum()), len(self.columns)
        if n_held == 0:
            raise VfemInputError(
                f"{owner} holds none of the {len(values)} training rows, so its columns "
                f"{_describe_columns(self.columns)} cannot be estimated; check its data file or "
                "remove it from the config"
            )
        if n_held < p + 2:
            raise VfemInputError(
                f"{owner} holds only {n_held} training rows for {p} columns; at least {p + 2} "
                "are needed to estimate its covariance"
            )
        x = values[held]
        mean, sd = x.mean(axis=0), x.std(axis=0)
        for j in range(p):
            if not sd[j] > 1e-12 * max(1.0, abs(mean[j])):
                raise VfemInputError(
                    f"{owner}: column {self.columns[j]!r} is constant (= {mean[j]:.6g}) on the "
                    f"{n_held} training rows it holds, so its coefficient is not identified; "
                    "drop the column"
                )
        corr = np.corrcoef(x, rowvar=False).reshape(p, p)
        evals, evecs = np.linalg.eigh(corr)
        if evals[0] < 1e-10 * max(evals[-1], 1.0):
            weights = np.abs(evecs[:, 0])
            involved = [self.columns[j] for j in np.flatnonzero(weights > 0.1 * weights.max())]
            raise VfemInputError(
                f"{owner}: columns {_describe_columns(involved)} are collinear on the "
                f"{n_held} training rows it holds (one is a linear combination of the others), "
                "so their coefficients are not identified; drop one of them"
            )
        self.center = mean if (intercept and standardize) else np.zeros(p)
        self.scale = sd if standardize else np.ones(p)
        self.held = held
        self.z = np.where(
            held[:, None], (np.where(nan, 0.0, values) - self.center) / self.scale, 0.0
        )
        mu, sigma = available_case_moments(self.z, held)
        self.params = BlockParams(np.zeros(p), mu, sigma)
        self.model_x = True
        self.dbeta = 0.0
        self.positions = np.arange(len(values))
        self.z_d = self.z
        self.obs_d = held

    @property
    def p(self) -> int:
        return len(self.columns)

    def n_coordinates(self) -> int:
        return BlockParams.n_coordinates(self.p, model_x=self.model_x)

    def transform(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Standardised rows (zero where not held) and which rows are held."""
        values = np.asarray(values, dtype=np.float64)
        held = ~np.isnan(values).all(axis=1)
        z = np.where(held[:, None], (np.nan_to_num(values) - self.center) / self.scale, 0.0)
        return z, held

    # -- designs -------------------------------------------------------------------------

    def set_design(self, kind: str, positions: np.ndarray, *, reset: bool) -> None:
        """Select the rows of a fit. kind "blocks": the VFEM model (missing rows stay missing);
        "impute": missing rows filled with this block's available-case mean; "complete": every
        row must be held. `reset` restarts mu and Sigma from the available-case moments (beta
        is kept: it may be the start from a previous fit)."""
        z_d, obs_d = self.z[positions], self.held[positions]
        if kind == "impute":
            z_d = z_d.copy()
            z_d[~obs_d] = self.z[self.held].mean(axis=0)
            obs_d = np.ones(len(positions), dtype=bool)
        elif kind == "complete":
            if not obs_d.all():
                raise RuntimeError(f"{self.owner}: a complete-case design names rows it lacks")
        elif kind != "blocks":
            raise ValueError(f"unknown design kind {kind!r}")
        if not obs_d.any():
            raise VfemInputError(f"{self.owner} holds none of the rows of this fit")
        self.positions, self.z_d, self.obs_d = positions, z_d, obs_d
        self.model_x = kind == "blocks"
        self.dbeta = 0.0
        if reset:
            mu, sigma = available_case_moments(z_d, obs_d)
            self.params = BlockParams(self.params.beta.copy(), mu, sigma)

    def spectrum(self) -> np.ndarray:
        """[lambda_min(Sigma), lambda_max(Sigma), ||mu||^2]: what the default step size needs."""
        ev = np.linalg.eigvalsh(self.params.sigma)
        return np.array([ev[0], ev[-1], float(self.params.mu @ self.params.mu)])

    # -- one iteration -------------------------------------------------------------------

    def estep(self) -> dict[str, np.ndarray]:
        h, q = estep_terms(self.z_d, self.obs_d, self.params)
        out = {"m": h, "dbeta": np.array([self.dbeta])}
        if self.model_x:
            n = len(h)
            ll = block_loglik(self.z_d, self.obs_d, self.params)
            # on the original scale: the Jacobian of the standardisation
            ll -= int(self.obs_d.sum()) * float(np.sum(np.log(self.scale)))
            out["q"] = q
            out["ll"] = np.array([ll / n])
        return out

    def mstep(self, *, e: np.ndarray, w: np.ndarray, sigma2: float, eta: float) -> None:
        new = mstep(
            self.z_d,
            self.obs_d,
            self.params,
            e=e,
            w=w,
            sigma2=sigma2,
            eta=eta,
            model_x=self.model_x,
        )
        if not np.all(np.isfinite(new.beta)):
            raise VfemDivergence(f"{self.owner}: beta became non-finite; lower [method] eta")
        self.dbeta = float(np.max(np.abs(new.beta - self.params.beta)))
        self.previous = self.params
        self.params = new

    def revert(self) -> None:
        """Undo the last `mstep` (the active party halves the step size and redoes it)."""
        self.params = self.previous
        self.dbeta = 0.0

    # -- SEM probes ----------------------------------------------------------------------

    def probe_setup(self, *, d: int, h: float) -> None:
        """Secret random directions for this block's coordinates (rows of V), drawn from the
        OS's CSPRNG so that no other role can regenerate them."""
        self.v = secret_directions(self.n_coordinates(), d)
        self.w_jac = np.zeros_like(self.v)
        self.theta_hat = self.params.copy()
        self.h = h

    def _probe_params(self, j: int, sign: float) -> BlockParams:
        return self.theta_hat.moved(sign * self.h * self.v[:, j], model_x=self.model_x)

    def probe_estep(self, cols: Sequence[int]) -> dict[str, np.ndarray]:
        hs, qs = [], []
        for j in cols:
            for sign in (1.0, -1.0):
                h, q = estep_terms(self.z_d, self.obs_d, self._probe_params(j, sign))
                hs.append(h)
                qs.append(q)
        return {"m": np.stack(hs), "q": np.stack(qs)}

    def probe_mstep(
        self, cols: Sequence[int], *, e: np.ndarray, w: np.ndarray, sigma2: np.ndarray, eta: float
    ) -> None:
        """Accumulate the central differences (G(theta + h v_j) - G(theta - h v_j)) / 2h of this
        block's part of the map."""
        for i, j in enumerate(cols):
            for s, sign in enumerate((1.0, -1.0)):
                k = 2 * i + s
                out = mstep(
                    self.z_d,
                    self.obs_d,
                    self._probe_params(j, sign),
                    e=e[k],
                    w=w[k],
                    sigma2=float(sigma2[k]),
                    eta=eta,
                    model_x=self.model_x,
                )
                self.w_jac[:, j] += sign * out.coordinates(model_x=self.model_x) / (2 * self.h)

    def sem_sums(self, *, intercept: bool) -> dict[str, np.ndarray]:
        """This block's share of U'U (U = V - JV), and of V'w, U'w and the intercept shift for
        the intercept's variance (w: -center/scale on beta, the intercept's dependence on it)."""
        u = self.v - self.w_jac
        out = {"gram": u.T @ u}
        weight = np.zeros(self.n_coordinates())
        if intercept:
            weight[: self.p] = -self.center / self.scale
        out["va"] = self.v.T @ weight
        out["ub"] = u.T @ weight
        return out

    def shift(self) -> float:
        """(center / scale)' beta: this block's part of the intercept's change of scale."""
        return float(self.center / self.scale @ self.params.beta)

    def sem_finish(self, ginv: np.ndarray | None) -> dict[str, np.ndarray]:
        """beta on the original scale of x (divided by sd(y) still) and the matching diagonal of
        (I - J)^{-1}: diag_j = V[j] (U'U)^{-1} U[j]'."""
        beta = self.params.beta
        coef = beta / self.scale
        if ginv is None:
            return {"coef": coef, "var": np.full(self.p, np.nan)}
        u = self.v - self.w_jac
        diag = np.einsum("ij,jk,ik->i", self.v[: self.p], ginv, u[: self.p])
        return {"coef": coef, "var": diag / self.scale**2}

    def predict(self, values: np.ndarray) -> np.ndarray:
        """Per-row partial predictor; a missing block contributes mu' beta (E[y | observed])."""
        z, held = self.transform(values)
        return estep_terms(z, held, self.params)[0]

    def state_dict(self) -> dict[str, Any]:
        # tensors and Python numbers only: checkpoints are read with torch's weights_only
        return {
            "beta": torch.from_numpy(self.params.beta.copy()),
            "mu": torch.from_numpy(self.params.mu.copy()),
            "sigma": torch.from_numpy(self.params.sigma.copy()),
            "dbeta": float(self.dbeta),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.params = BlockParams(
            np.asarray(state["beta"], dtype=np.float64),
            np.asarray(state["mu"], dtype=np.float64),
            np.asarray(state["sigma"], dtype=np.float64),
        )
        self.dbeta = float(state["dbeta"])


def secret_directions(rows: int, d: int) -> np.ndarray:
    """`rows` orthonormal random rows of length d (a role's rows of the SEM direction matrix V),
    from the operating system's CSPRNG so that no other role can regenerate them. Orthonormal
    within a role keeps V, and so U'U, well conditioned."""
    rng = np.random.default_rng(secrets.randbits(128))
    q, _ = np.linalg.qr(rng.standard_normal((d, rows)))
    return q.T.copy()
