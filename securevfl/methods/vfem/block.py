"""One role's covariate block in a VFEM (or OLS) fit: its standardised rows, its parameters and
its SEM probes. Everything here is computed from that role's own rows."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from securevfl.errors import MethodInputError
from securevfl.lazy import torch
from securevfl.methods.vfem.cells import (
    CellPattern,
    available_cell_moments,
    cell_patterns,
    column_means,
    estep_cells,
    loglik_cells,
    mstep_cells,
)
from securevfl.stats.gaussian_blocks import (
    BlockParams,
    available_case_moments,
    block_loglik,
    estep_terms,
    mstep,
)

# rows where two cells of a block are both observed, at least, to estimate their covariance
MIN_PAIR_ROWS = 3


class VfemInputError(MethodInputError):
    """The data cannot be fitted (constant or collinear block, no rows, empty cells); the
    message names the party and the column."""


class VfemDivergence(RuntimeError):
    """The iteration produced a non-finite or exploding loss."""


def _describe_columns(columns: Sequence[str]) -> str:
    return ", ".join(repr(c) for c in columns)


def row_namer(table: Any, ids: np.ndarray) -> Callable[[int], str]:
    """Names row i of `ids` for a message: its identifier as written in the role's file where
    the table knows it, else the integer id."""
    texts = getattr(table, "texts", None)

    def name(i: int) -> str:
        if texts is not None:
            try:
                return str(texts(ids[i : i + 1])[0])
            except (LookupError, ValueError):  # DataError: an id the table lacks
                pass
        return str(ids[i])

    return name


class BlockState:
    """One role's covariate block in a fit: its standardised rows, which design rows it holds,
    its parameters (beta, mu, Sigma on the standardised scale) and its SEM probes.

    A row whose cells are all empty is a row the role lacks (the block is missing as a whole).
    With `allow_cells` (the active party's own block) a row may also lack some of its cells:
    each pattern of missing cells is its own pattern in the EM (`securevfl.methods.vfem.cells`,
    exact for the Gaussian block model under MAR). Without it (a passive party) such a row is
    refused, naming the column and the row (`row_name(i)`: the identifier of row i).

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
        allow_cells: bool = False,
        row_name: Callable[[int], str] | None = None,
    ) -> None:
        self.owner = owner
        self.columns = tuple(columns)
        values = np.asarray(values, dtype=np.float64)
        nan = np.isnan(values)
        held = ~nan.all(axis=1)
        partial = nan & held[:, None]
        # whether some held row lacks some (not all) of its cells: then cell patterns are used
        self.cellwise = bool(partial.any())
        if self.cellwise and not allow_cells:
            j = int(np.argmax(partial.any(axis=0)))
            i = int(np.argmax(partial[:, j]))
            row = f"row {row_name(i)!r}" if row_name is not None else f"training row {i + 1}"
            raise VfemInputError(
                f"{owner}: column {self.columns[j]!r} is empty on {row} (and on "
                f"{int(partial[:, j].sum()) - 1} more of the rows it holds) while other columns "
                "of the row have values; VFEM models missing cells only in the active party's "
                "own block (a passive party would need 1/tau_i on the rows it holds, which "
                "reveals the other parties' missingness), so fill those cells, or leave the "
                "party's whole row empty (the block then counts as missing on that row), or "
                "give these columns to the active party ([active] columns)"
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
        cells = ~nan
        if self.cellwise:
            mean, sd = self._cell_checks(values, cells)
            complete = cells.all(axis=1)
        else:
            x = values[held]
            mean, sd = x.mean(axis=0), x.std(axis=0)
            complete = held
        n_complete = int(complete.sum())
        for j in range(p):
            if not sd[j] > 1e-12 * max(1.0, abs(mean[j])):
                raise VfemInputError(
                    f"{owner}: column {self.columns[j]!r} is constant (= {mean[j]:.6g}) on the "
                    f"{int(cells[:, j].sum())} training rows where it has a value, so its "
                    "coefficient is not identified; drop the column"
                )
        if n_complete >= p + 2:
            # collinearity shows on the rows that have every cell (all held rows, without cells)
            corr = np.corrcoef(values[complete], rowvar=False).reshape(p, p)
            evals, evecs = np.linalg.eigh(corr)
            if evals[0] < 1e-10 * max(evals[-1], 1.0):
                weights = np.abs(evecs[:, 0])
                involved = [self.columns[j] for j in np.flatnonzero(weights > 0.1 * weights.max())]
                where = "it has every cell" if self.cellwise else "it holds"
                raise VfemInputError(
                    f"{owner}: columns {_describe_columns(involved)} are collinear on the "
                    f"{n_complete} training rows {where} (one is a linear combination of the "
                    "others), so their coefficients are not identified; drop one of them"
                )
        self.center = mean if (intercept and standardize) else np.zeros(p)
        self.scale = sd if standardize else np.ones(p)
        self.held = held
        self.cells = cells
        self.z = np.where(cells, (np.where(nan, 0.0, values) - self.center) / self.scale, 0.0)
        mu, sigma = self._moments(self.z, held, cells)
        self.params = BlockParams(np.zeros(p), mu, sigma)
        self.model_x = True
        self.dbeta = 0.0
        self.positions = np.arange(len(values))
        self.z_d = self.z
        self.obs_d = held
        self.cells_d = cells
        self.patterns_d: list[CellPattern] | None = cell_patterns(cells) if self.cellwise else None

    def _cell_checks(self, values: np.ndarray, cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-column mean and sd over the cells that have a value; refuses a column with
        fewer than two values and two columns seldom observed together."""
        p = len(self.columns)
        count = cells.sum(axis=0)
        for j in range(p):
            if count[j] < 2:
                raise VfemInputError(
                    f"{self.owner}: column {self.columns[j]!r} has a value on only "
                    f"{int(count[j])} training rows, so its mean and variance cannot be "
                    "estimated; drop the column"
                )
        both = cells.T.astype(np.int64) @ cells.astype(np.int64)
        for j in range(p):
            for k in range(j):
                if both[j, k] < MIN_PAIR_ROWS:
                    raise VfemInputError(
                        f"{self.owner}: columns {self.columns[k]!r} and {self.columns[j]!r} "
                        f"both have values on only {int(both[j, k])} training rows, too few "
                        f"(at least {MIN_PAIR_ROWS}) to estimate their covariance; drop one of "
                        "them"
                    )
        filled = np.where(cells, values, 0.0)
        mean = filled.sum(axis=0) / count
        sd = np.sqrt(np.where(cells, (values - mean) ** 2, 0.0).sum(axis=0) / count)
        return mean, sd

    def _moments(
        self, z: np.ndarray, held: np.ndarray, cells: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        if self.cellwise:
            return available_cell_moments(z, cells)
        return available_case_moments(z, held)

    @property
    def p(self) -> int:
        return len(self.columns)

    def n_coordinates(self) -> int:
        return BlockParams.n_coordinates(self.p, model_x=self.model_x)

    def transform(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Standardised rows (zero on empty cells) and which cells have a value."""
        values = np.asarray(values, dtype=np.float64)
        cells = ~np.isnan(values)
        z = np.where(cells, (np.nan_to_num(values) - self.center) / self.scale, 0.0)
        return z, cells

    # the block's E-step terms, covariate log-likelihood and update: by cell pattern when some
    # row lacks some of its cells, else by whole rows (`securevfl.stats.gaussian_blocks`)

    def _terms(self, params: BlockParams) -> tuple[np.ndarray, np.ndarray]:
        if self.patterns_d is not None:
            return estep_cells(self.z_d, self.patterns_d, params)
        return estep_terms(self.z_d, self.obs_d, params)

    def _update(self, params: BlockParams, **kwargs: Any) -> BlockParams:
        if self.patterns_d is not None:
            return mstep_cells(self.z_d, self.patterns_d, params, model_x=self.model_x, **kwargs)
        return mstep(self.z_d, self.obs_d, params, model_x=self.model_x, **kwargs)

    # -- designs -------------------------------------------------------------------------

    def set_design(self, kind: str, positions: np.ndarray, *, reset: bool) -> None:
        """Select the rows of a fit. kind "blocks": the VFEM model (missing rows, and missing
        cells, stay missing); "impute": missing rows and cells filled with this block's
        available-case means; "complete": every cell of every row must be present. `reset`
        restarts mu and Sigma from the available-case moments (beta is kept: it may be the
        start from a previous fit)."""
        z_d, obs_d, cells_d = self.z[positions], self.held[positions], self.cells[positions]
        if kind == "impute":
            z_d = z_d.copy()
            if self.cellwise:
                z_d = np.where(cells_d, z_d, column_means(self.z, self.cells))
            else:
                z_d[~obs_d] = self.z[self.held].mean(axis=0)
            obs_d = np.ones(len(positions), dtype=bool)
            cells_d = np.ones_like(cells_d)
        elif kind == "complete":
            if not cells_d.all():
                raise RuntimeError(f"{self.owner}: a complete-case design names rows it lacks")
        elif kind != "blocks":
            raise ValueError(f"unknown design kind {kind!r}")
        if not obs_d.any():
            raise VfemInputError(f"{self.owner} holds none of the rows of this fit")
        self.positions, self.z_d, self.obs_d, self.cells_d = positions, z_d, obs_d, cells_d
        self.patterns_d = cell_patterns(cells_d) if (self.cellwise and kind == "blocks") else None
        self.model_x = kind == "blocks"
        self.dbeta = 0.0
        if reset:
            mu, sigma = self._moments(z_d, obs_d, cells_d)
            self.params = BlockParams(self.params.beta.copy(), mu, sigma)

    def spectrum(self) -> np.ndarray:
        """[lambda_min(Sigma), lambda_max(Sigma), ||mu||^2]: what the default step size needs."""
        ev = np.linalg.eigvalsh(self.params.sigma)
        return np.array([ev[0], ev[-1], float(self.params.mu @ self.params.mu)])

    # -- one iteration -------------------------------------------------------------------

    def estep(self) -> dict[str, np.ndarray]:
        h, q = self._terms(self.params)
        out = {"m": h, "dbeta": np.array([self.dbeta])}
        if self.model_x:
            n = len(h)
            if self.patterns_d is not None:
                ll = loglik_cells(self.z_d, self.patterns_d, self.params)
                # on the original scale: the Jacobian of the standardisation, per present cell
                ll -= float(self.cells_d.sum(axis=0) @ np.log(self.scale))
            else:
                ll = block_loglik(self.z_d, self.obs_d, self.params)
                ll -= int(self.obs_d.sum()) * float(np.sum(np.log(self.scale)))
            out["q"] = q
            out["ll"] = np.array([ll / n])
        return out

    def mstep(self, *, e: np.ndarray, w: np.ndarray, sigma2: float, eta: float) -> None:
        new = self._update(self.params, e=e, w=w, sigma2=sigma2, eta=eta)
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
        """Per probe, the change of the E-step terms from the estimate, divided by the step:
        (h(theta + s h v_j) - h(theta)) / h, likewise q. The active party adds the step times
        their sum to the last E-step's sums; sent this way (values of order one, not 1e-5
        changes of order-one values), the fixed-point rounding of a masked sum costs the SEM
        differences ~1e-12 relative instead of ~1e-7."""
        base_h, base_q = self._terms(self.theta_hat)
        hs, qs = [], []
        for j in cols:
            for sign in (1.0, -1.0):
                h, q = self._terms(self._probe_params(j, sign))
                hs.append((h - base_h) / self.h)
                qs.append((q - base_q) / self.h)
        return {"m": np.stack(hs), "q": np.stack(qs)}

    def probe_mstep(
        self, cols: Sequence[int], *, e: np.ndarray, w: np.ndarray, sigma2: np.ndarray, eta: float
    ) -> None:
        """Accumulate the central differences (G(theta + h v_j) - G(theta - h v_j)) / 2h of this
        block's part of the map."""
        for i, j in enumerate(cols):
            for s, sign in enumerate((1.0, -1.0)):
                k = 2 * i + s
                out = self._update(
                    self._probe_params(j, sign), e=e[k], w=w[k], sigma2=float(sigma2[k]), eta=eta
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
        """Per-row partial predictor E[x_i' beta | the row's present cells]: mu' beta where the
        block is missing, the conditional mean of the empty cells where some are."""
        z, cells = self.transform(values)
        held = cells.any(axis=1)
        if np.array_equal(cells, np.repeat(held[:, None], self.p, axis=1)):
            return estep_terms(z, held, self.params)[0]
        return estep_cells(z, cell_patterns(cells), self.params)[0]

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


def secret_directions(rows: int, d: int, *, rng: np.random.Generator | None = None) -> np.ndarray:
    """`rows` orthonormal random rows of length d (a role's rows of the SEM direction matrix V,
    d directions), from the operating system's CSPRNG so that no other role can regenerate them
    (`rng`: another generator, for tests that replay draws). Orthonormal within a role; across
    roles the rows are independent, which is why SEM probes more directions than coordinates
    (`inference.sem_directions`): a square V would be badly conditioned in some draws."""
    if rng is None:
        rng = np.random.default_rng(secrets.randbits(128))
    q, _ = np.linalg.qr(rng.standard_normal((d, rows)))
    return q.T.copy()
