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

import csv
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from securevfl.config import ConfigError, RunConfig
from securevfl.methods.base import (
    ActiveContext,
    ActiveMethod,
    MethodSpec,
    PartyMethod,
    SumSpec,
    UnknownOperation,
    register_method,
)
from securevfl.metrics import task_metrics
from securevfl.stats.gaussian_blocks import (
    BlockParams,
    available_case_moments,
    block_loglik,
    combine_rows,
    estep_terms,
    mstep,
    y_loglik,
)

# ------------------------------------------------------------------------------------ options

COMMON_OPTIONS: dict[str, Any] = {
    "intercept": True,
    "eta": "auto",
    "max_iter": 5000,
    "tol_loss": 1e-10,
    "tol_beta": 1e-8,
    "se": "sem",
    "sem_step": 1e-5,
    "level": 0.95,
    "checkpoint_every": 100,
}
VFEM_OPTIONS: dict[str, Any] = {**COMMON_OPTIONS, "init": "impute"}
INITS = ("cc", "impute", "zero")
MIN_FRAC_BITS = 32
SUGGESTED_FRAC_BITS = 40
SUGGESTED_BOUND = 2.0**18
# the [secure] defaults of the regression methods when the config leaves them out
VFEM_SECURE_DEFAULTS = (("frac_bits", SUGGESTED_FRAC_BITS), ("bound", SUGGESTED_BOUND))
# probe evaluations per secure-sum round: rows x evaluations stays below this many floats
PROBE_FLOATS = 1 << 21
# sigma^2 is ~1 on the internal (standardised) scale; far beyond means the iteration diverged
DIVERGED_LOSS = 1e4


class VfemInputError(ValueError):
    """The data cannot be fitted (constant or collinear block, no rows, empty cells); the
    message names the party and the column."""


class VfemDivergence(RuntimeError):
    """The iteration produced a non-finite or exploding loss."""


@dataclass(frozen=True)
class FitOptions:
    """The `[method]` options of vfem and the OLS comparators, validated."""

    intercept: bool
    eta: float | None  # None: from the spectrum
    max_iter: int
    tol_loss: float
    tol_beta: float
    se: bool
    sem_step: float
    level: float
    checkpoint_every: int
    init: str = "impute"
    party: str | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> FitOptions:
        eta = cfg.option("eta", "auto")
        return cls(
            intercept=bool(cfg.option("intercept", True)),
            eta=None if eta == "auto" else float(eta),
            max_iter=int(cfg.option("max_iter", COMMON_OPTIONS["max_iter"])),
            tol_loss=float(cfg.option("tol_loss", COMMON_OPTIONS["tol_loss"])),
            tol_beta=float(cfg.option("tol_beta", COMMON_OPTIONS["tol_beta"])),
            se=cfg.option("se", "sem") == "sem",
            # CKKS sums carry ~1e-7 relative noise: a longer difference step keeps SEM accurate
            sem_step=float(cfg.option("sem_step", 1e-3 if cfg.aggregation == "ckks" else 1e-5)),
            level=float(cfg.option("level", COMMON_OPTIONS["level"])),
            checkpoint_every=int(cfg.option("checkpoint_every", 100)),
            init=str(cfg.option("init", "impute")),
            party=cfg.option("party"),
        )


def option_check(defaults: Mapping[str, Any]) -> Callable[[RunConfig], None]:
    """A MethodSpec extra check: known `[method]` keys with valid values, and a fixed-point
    format precise enough for the estimates (mask aggregation)."""

    def check(cfg: RunConfig) -> None:
        options = dict(cfg.method_options)
        for key in options:
            if key not in defaults:
                raise ConfigError(
                    f"[method] {key}",
                    f"unknown option for {cfg.method!r}; known: {sorted(defaults)}",
                )

        def number(
            key: str, *, integer: bool = False, lo: float = 0.0, hi: float = math.inf
        ) -> None:
            if key not in options:
                return
            v = options[key]
            ok = isinstance(v, int) if integer else isinstance(v, int | float)
            if isinstance(v, bool) or not ok or not (lo < v <= hi) or not math.isfinite(v):
                kind = "an integer" if integer else "a number"
                raise ConfigError(
                    f"[method] {key}", f"must be {kind} in ({lo:g}, {hi:g}], got {v!r}"
                )

        if "intercept" in options and not isinstance(options["intercept"], bool):
            raise ConfigError(
                "[method] intercept", f"must be true or false, got {options['intercept']!r}"
            )
        if "eta" in options and options["eta"] != "auto":
            number("eta", hi=100.0)
        for key in ("tol_loss", "tol_beta", "sem_step"):
            number(key, hi=1.0)
        number("level", hi=0.999999)
        for key in ("max_iter", "checkpoint_every"):
            number(key, integer=True, hi=10**9)
        if options.get("se", "sem") not in ("sem", "none"):
            raise ConfigError("[method] se", f'choose "sem" or "none", got {options["se"]!r}')
        if "init" in defaults and options.get("init", "impute") not in INITS:
            raise ConfigError(
                "[method] init", f"choose one of {', '.join(INITS)}, got {options['init']!r}"
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

    return check


# ---------------------------------------------------------------------------- one block


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


# ---------------------------------------------------------------------------- party stage


def split_for_plain(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plain backend carries float32; send each tensor as float32 part + remainder so the
    decoded sums keep float64 precision (the fixed point needs it). Only used with plain."""
    extra = {}
    for name, value in out.items():
        value = np.asarray(value, dtype=np.float64)
        extra[name + "_lo"] = value - value.astype(np.float32).astype(np.float64)
    return {**out, **extra}


class BlockRegressionParty(PartyMethod):
    """A passive party's stage of vfem and the OLS comparators: answers with its block's
    per-row terms (to secure sums) and keeps its parameters."""

    method_label = "vfem"

    def setup(self, *, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]) -> None:
        self.block: BlockState | None = None
        self.prepared_ids: np.ndarray | None = None
        self.design_ids: np.ndarray | None = None
        self._pending_state: Mapping[str, Any] | None = None

    def _values(self, ids: np.ndarray) -> np.ndarray:
        out = np.full((len(ids), len(self.table.columns)), np.nan)
        held = self.table.has(ids)
        if held.any():
            out[held] = self.table.rows(ids[held])
        return out

    def _check_rows(self, ids: np.ndarray) -> BlockState:
        if self.block is None:
            raise RuntimeError(f"party {self.name!r}: operation before 'prepare'")
        if self.design_ids is None or not np.array_equal(ids, self.design_ids):
            raise RuntimeError(f"party {self.name!r}: rows differ from the current design")
        return self.block

    def _sums(self, out: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
        cfg = self.config
        if cfg.aggregation == "mask":
            for value in out.values():
                worst = float(np.max(np.abs(value))) if np.size(value) else 0.0
                if not worst <= cfg.bound:
                    raise VfemInputError(
                        f"party {self.name!r}: {what} reaches {worst:.4g}, beyond [secure] bound "
                        f"= {cfg.bound:g}; raise the bound (keeping log2(bound) + frac_bits "
                        "<= 58), or, if the values grew over the iterations, the iteration "
                        "diverges: lower [method] eta"
                    )
        return split_for_plain(out) if cfg.aggregation == "plain" else out

    def handle(
        self, op: str, *, ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if op == "prepare":
            self.block = BlockState(
                owner=f"party {self.name!r}",
                columns=self.table.columns,
                values=self._values(ids),
                intercept=bool(args["intercept"]),
                standardize=bool(args["standardize"]),
            )
            self.prepared_ids = np.asarray(ids)
            if self._pending_state is not None:
                self.block.load_state_dict(self._pending_state)
                self._pending_state = None
            return {}
        if op == "design":
            if self.block is None or self.prepared_ids is None:
                raise RuntimeError(f"party {self.name!r}: 'design' before 'prepare'")
            pos = np.searchsorted(self.prepared_ids, ids)
            pos = np.minimum(pos, len(self.prepared_ids) - 1)
            if not np.array_equal(self.prepared_ids[pos], ids):
                raise RuntimeError(f"party {self.name!r}: design rows outside the prepared rows")
            self.block.set_design(str(args["kind"]), pos, reset=bool(args["reset"]))
            self.design_ids = np.asarray(ids)
            return {"spectrum": self.block.spectrum()}
        if op == "estep":
            return self._sums(self._check_rows(ids).estep(), "a per-row partial predictor")
        if op == "mstep":
            block = self._check_rows(ids)
            w = inputs.get("w")
            block.mstep(
                e=np.asarray(inputs["e"], dtype=np.float64),
                w=np.zeros(len(ids)) if w is None else np.asarray(w, dtype=np.float64),
                sigma2=float(args["sigma2"]),
                eta=float(args["eta"]),
            )
            return {}
        if op == "revert":
            self._check_rows(ids).revert()
            return {}
        if op == "probe_setup":
            self._check_rows(ids).probe_setup(d=int(args["d"]), h=float(args["h"]))
            return {}
        if op == "probe_estep":
            out = self._check_rows(ids).probe_estep([int(j) for j in args["cols"]])
            return self._sums(out, "a probe's per-row partial predictor")
        if op == "probe_mstep":
            block = self._check_rows(ids)
            e = np.asarray(inputs["e"], dtype=np.float64)
            w = inputs.get("w")
            block.probe_mstep(
                [int(j) for j in args["cols"]],
                e=e,
                w=np.zeros_like(e) if w is None else np.asarray(w, dtype=np.float64),
                sigma2=np.asarray(inputs["sigma2"], dtype=np.float64),
                eta=float(args["eta"]),
            )
            return {}
        if op == "sem_sums":
            out = self._check_rows(ids).sem_sums(intercept=bool(args["intercept"]))
            return self._sums(out, "the SEM Gram matrix")
        if op == "shift":
            block = self._check_rows(ids)
            return self._sums({"shift": np.array([block.shift()])}, "the intercept shift")
        if op == "finish":
            block = self._check_rows(ids)
            ginv = inputs.get("ginv")
            return block.sem_finish(None if ginv is None else np.asarray(ginv, dtype=np.float64))
        if op == "predict":
            if self.block is None:
                raise RuntimeError(f"party {self.name!r}: 'predict' before 'prepare'")
            return self._sums({"m": self.block.predict(self._values(ids))}, "a per-row prediction")
        raise UnknownOperation(self.method_label, op)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.block is None else self.block.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # applied when the active party re-sends 'prepare' after a resume
        self._pending_state = dict(state) if state else None


# ---------------------------------------------------------------------------- active stage


class _Federation:
    """The active party's view of the parties in one fit: secure sums, per-party calls,
    broadcasts. With no passive party (a single-party fit of the active party's own block),
    every call is skipped."""

    def __init__(self, ctx: ActiveContext, parties: Sequence[str], *, plain: bool) -> None:
        self.ctx = ctx
        self.parties = tuple(parties)
        self.plain = plain

    def sums(
        self,
        op: str,
        *,
        ids: np.ndarray,
        names: Sequence[str],
        args: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """Secure sums over every party of each tensor in `names` (empty dict if no party)."""
        if not self.parties:
            return {}
        wire = [*names, *(f"{n}_lo" for n in names)] if self.plain else list(names)
        specs = [SumSpec(key=n, tensor=n, group=self.parties) for n in wire]
        got = self.ctx.call(op, ids=ids, args=dict(args or {}), sums=specs)
        out = {n: np.asarray(got[n], dtype=np.float64) for n in names}
        if self.plain:
            for n in names:
                out[n] = out[n] + got[f"{n}_lo"]
        return out

    def each(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any],
        inputs: Callable[[int, str], dict[str, np.ndarray]],
    ) -> None:
        """One call per party (inputs meant for that party only)."""
        for k, party in enumerate(self.parties):
            self.ctx.call(op, ids=ids, args=dict(args), inputs=inputs(k, party), to=[party])

    def broadcast(
        self,
        op: str,
        *,
        ids: np.ndarray,
        args: Mapping[str, Any] | None = None,
        inputs: Mapping[str, np.ndarray] | None = None,
        collect: Sequence[str] = (),
    ) -> dict[str, np.ndarray]:
        if not self.parties:
            return {}
        return self.ctx.call(
            op,
            ids=ids,
            args=dict(args or {}),
            inputs=dict(inputs or {}),
            to=list(self.parties),
            collect=list(collect),
        )


class _OscillationTracker:
    """Watches the summed per-row predictor m^(t) (which the active party sees anyway) for the
    iteration oscillating: successive changes dm^(t) pointing in opposite directions means the
    dominant eigenvalue of the map's Jacobian is rho < 0, i.e. 1 - eta lambda_max = rho. After
    three such steps in a row, `update` returns lambda_max = (1 - rho) / eta."""

    def __init__(self) -> None:
        self.prev_m: np.ndarray | None = None
        self.prev_dm: np.ndarray | None = None
        self.count = 0

    def update(self, m: np.ndarray, eta: float) -> float | None:
        found = None
        if self.prev_m is not None:
            dm = m - self.prev_m
            if self.prev_dm is not None:
                denom = float(self.prev_dm @ self.prev_dm)
                # ignore changes at the level of fixed-point noise
                if denom > 1e-18 * len(m):
                    rho = float(dm @ self.prev_dm) / denom
                    self.count = self.count + 1 if rho < -0.3 else 0
                    if self.count >= 3:
                        found = (1.0 - rho) / eta
                        self.count = 0
                        dm = None
            self.prev_dm = dm
        self.prev_m = m
        return found


@dataclass
class _Design:
    """One fit: its rows, which parties take part, and the missing rows of each party."""

    kind: str  # "blocks" | "impute" | "complete"
    ids: np.ndarray
    positions: np.ndarray  # into the prepared (training) rows
    parties: tuple[str, ...]
    missing: dict[str, np.ndarray]  # party -> bool per design row (blocks designs only)
    use_own: bool

    @property
    def model_x(self) -> bool:
        return self.kind == "blocks"


class BlockRegressionActive(ActiveMethod):
    """Active stage of vfem (and, through subclasses, of the OLS comparators)."""

    method_label = "vfem"
    ols = False  # OLS comparators: classical s^2 and t-based inference
    progress_unit = "iteration"  # EM runs to convergence: no fixed total
    progress_total = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opts = FitOptions.from_config(self.config)
        self.own: BlockState | None = None
        self.fed: _Federation | None = None
        self.design: _Design | None = None
        self.progress: dict[str, Any] = {"phase": "start", "epoch": 0}
        self.alpha0 = 0.0
        self.sigma2 = 1.0
        self.eta = 1.0
        self.y_center = 0.0
        self.y_scale = 1.0
        self.fit_info: dict[str, Any] = {}
        self.coefficients: list[dict[str, Any]] = []

    # -- the designs a method fits (overridden by the comparators) ----------------------

    def designs(
        self, ctx: ActiveContext, train_ids: np.ndarray
    ) -> list[tuple[str, np.ndarray, tuple[str, ...], bool]]:
        """[(kind, ids, parties, use_own)] fitted in turn; the last one is reported. VFEM:
        the start (complete-case or mean-imputation OLS), then the EM fit on every row."""
        parties = tuple(ctx.parties)
        own = bool(self.table.columns)
        out = []
        if self.opts.init == "cc":
            cc = self._complete_rows(ctx, train_ids)
            p_total = len(self.table.columns) + sum(
                len(self.config.party(p).columns) for p in parties
            )
            if len(cc) < p_total + 2:
                raise VfemInputError(
                    f'[method] init = "cc": only {len(cc)} training rows are complete at every '
                    f'party, too few for {p_total} coefficients; set [method] init = "impute"'
                )
            out.append(("complete", cc, parties, own))
        elif self.opts.init == "impute":
            out.append(("impute", train_ids, parties, own))
        out.append(("blocks", train_ids, parties, own))
        return out

    def participants(self, ctx: ActiveContext) -> tuple[tuple[str, ...], bool]:
        """The passive parties and whether the active party's own block take part."""
        return tuple(ctx.parties), bool(self.table.columns)

    def _complete_rows(self, ctx: ActiveContext, ids: np.ndarray) -> np.ndarray:
        keep = ctx.presence(ids).all(axis=1)
        if self.table.columns:
            keep &= ~np.isnan(self.table.rows(ids)).all(axis=1)
        return ids[keep]

    # -- fit ----------------------------------------------------------------------------

    def fit(self, ctx: ActiveContext, *, train_ids: np.ndarray) -> None:
        cfg, opts = self.config, self.opts
        y = self.table.label_rows(train_ids)
        if not np.all(np.isfinite(y)):
            bad = train_ids[~np.isfinite(y)][:5].tolist()
            raise VfemInputError(
                f"the response {cfg.label!r} has missing or non-finite values (e.g. ids {bad}); "
                "VFEM needs y on every row: drop those rows first"
            )
        self.train_ids = train_ids
        self.y_center = float(y.mean()) if opts.intercept else 0.0
        self.y_scale = float(np.sqrt(np.mean((y - y.mean()) ** 2)))
        if not self.y_scale > 0:
            raise VfemInputError(f"the response {cfg.label!r} is constant; nothing to explain")
        self.yz_all = (y - self.y_center) / self.y_scale
        # every block checks its data first, so that a party's problem is the one reported
        all_parties, use_own = self.participants(ctx)
        prep = _Federation(ctx, all_parties, plain=cfg.aggregation == "plain")
        prep.broadcast(
            "prepare",
            ids=train_ids,
            args={"intercept": opts.intercept, "standardize": cfg.standardize},
        )
        if use_own:
            self.own = BlockState(
                owner=f"the active party ({cfg.active_name!r})",
                columns=self.table.columns,
                values=self.table.rows(train_ids),
                intercept=opts.intercept,
                standardize=cfg.standardize,
            )
            if "own" in self.progress:
                self.own.load_state_dict(self.progress["own"])
        plan = self.designs(ctx, train_ids)
        start_phase = min(int(self.progress.get("design", 0)), len(plan) - 1)
        # resume in the middle of a design's iterations, or start the next design afresh
        resuming = ctx.start_epoch > 0 and bool(self.progress.get("started", 0))
        for index, (kind, ids, parties, use_own) in enumerate(plan):
            if index < start_phase:
                continue
            last = index == len(plan) - 1
            self._set_design(
                ctx, kind, ids, parties, use_own, reset=not (resuming and index == start_phase)
            )
            self._iterate(ctx, index, resume=resuming and index == start_phase, loose=not last)
        self._inference(ctx)
        self.progress["phase"] = "done"

    def _set_design(
        self,
        ctx: ActiveContext,
        kind: str,
        ids: np.ndarray,
        parties: tuple[str, ...],
        use_own: bool,
        *,
        reset: bool,
    ) -> None:
        positions = np.searchsorted(self.train_ids, ids)
        presence = ctx.presence(ids)
        missing = {p: ~presence[:, self.config.party_names.index(p)] for p in parties}
        self.design = _Design(kind, ids, positions, parties, missing, use_own)
        self.fed = _Federation(ctx, parties, plain=self.config.aggregation == "plain")
        got = self.fed.broadcast(
            "design", ids=ids, args={"kind": kind, "reset": reset}, collect=["spectrum"]
        )
        spectra = [np.asarray(got[f"spectrum@{p}"], dtype=np.float64) for p in parties]
        if use_own and self.own is not None:
            self.own.set_design(kind, positions, reset=reset)
            spectra.append(self.own.spectrum())
        if self.opts.eta is not None:
            self.eta = self.opts.eta
        elif not reset and "eta" in self.progress:
            self.eta = float(self.progress["eta"])
        else:
            lows = [1.0] if self.opts.intercept else []
            highs = list(lows)
            lows += [s[0] for s in spectra]
            highs += [s[1] for s in spectra]
            self.eta = 2.0 / (max(highs) + sum(s[2] for s in spectra) + min(lows))
        # the smallest curvature the blocks alone suggest (for retuning eta, see _iterate)
        self.lam_low = min([1.0] + [s[0] for s in spectra])
        if reset:
            yz = self.yz_all[positions]
            self.sigma2 = float(np.mean((yz - yz.mean()) ** 2))
            self.progress.update({"t": 0, "prev_loss": None, "alpha_prev": None})
            if kind == "blocks" and self.opts.init == "zero":
                self.alpha0 = 0.0

    def _own(self) -> BlockState | None:
        return self.own if (self.design is not None and self.design.use_own) else None

    def _estep(self) -> dict[str, np.ndarray]:
        d, own = self.design, self._own()
        assert d is not None and self.fed is not None
        names = ["m", "dbeta"] + (["q", "ll"] if d.model_x else [])
        got = self.fed.sums("estep", ids=d.ids, names=names)
        n = len(d.ids)
        total = {"m": np.zeros(n), "q": np.zeros(n), "ll": np.zeros(1), "dbeta": np.zeros(1)}
        for name, value in got.items():
            total[name] = total[name] + value
        if own is not None:
            for name, value in own.estep().items():
                total[name] = total[name] + value
        if self.opts.intercept:
            total["m"] = total["m"] + self.alpha0
        return total

    def _mstep(self, e: np.ndarray, w: np.ndarray, sigma2: float) -> None:
        d, own = self.design, self._own()
        assert d is not None and self.fed is not None

        def inputs(_k: int, party: str) -> dict[str, np.ndarray]:
            out = {"e": e}
            if d.model_x and d.missing[party].any():
                # 1/tau_i only on the rows this party lacks
                out["w"] = np.where(d.missing[party], w, 0.0)
            return out

        self.fed.each("mstep", ids=d.ids, args={"sigma2": sigma2, "eta": self.eta}, inputs=inputs)
        if own is not None:
            own.mstep(e=e, w=w, sigma2=sigma2, eta=self.eta)
        if self.opts.intercept:
            self.alpha0 += self.eta * float(np.mean(e))

    def _iterate(self, ctx: ActiveContext, index: int, *, resume: bool, loose: bool) -> None:
        """Iterate the map on the current design until the stopping rule holds.

        Stopping rule: |loss_t - loss_(t-1)| < tol_loss and max |delta beta| < tol_beta (the
        latter bounded by the secure sum of each party's max |delta beta_k|), or max_iter.
        With eta = "auto", a step that lowers the objective (the observed-data log-likelihood;
        -RSS for OLS designs), which a small enough step never does (VFEM is a generalised
        EM), is undone and eta halved; a fixed eta is used as given."""
        d = self.design
        assert d is not None
        opts = self.opts
        tol_beta = opts.tol_beta * (1e3 if loose else 1.0)
        tol_loss = opts.tol_loss * (1e3 if loose else 1.0)
        yz = self.yz_all[d.positions]
        n = len(yz)
        self.progress.update({"phase": "iterate", "design": index, "started": 1})
        t = int(self.progress.get("t", 0)) if resume else 0
        prev_loss = self.progress.get("prev_loss") if resume else None
        alpha_prev = self.progress.get("alpha_prev") if resume else None
        prev_obj: float | None = None
        saved: tuple[float, float] | None = None
        backtracks = int(self.progress.get("backtracks", 0)) if resume else 0
        retunes = 0
        converged = False
        label = f"{self.method_label} ({d.kind} design)"
        tracker = _OscillationTracker()
        while True:
            terms = self._estep()
            e, w, loss = combine_rows(yz, terms["m"], terms["q"], self.sigma2)
            if opts.eta is None:
                lam_top = tracker.update(terms["m"], self.eta)
                if lam_top is not None and 2.0 / (lam_top + self.lam_low) < 0.99 * self.eta:
                    # the iteration oscillates along its stiffest direction: eta is too close
                    # to 2 / lambda_max (cross-party correlation, which the blocks' own spectra
                    # cannot see); retune to 2 / (lambda_max + lambda_min)
                    self.eta = 2.0 / (lam_top + self.lam_low)
                    retunes += 1
            ll = None
            if d.model_x:
                ll = (
                    y_loglik(yz, terms["m"], terms["q"], self.sigma2)
                    - n * math.log(self.y_scale)
                    + n * float(terms["ll"][0])
                )
            obj = ll if ll is not None else -loss
            if not (np.isfinite(loss) and loss < DIVERGED_LOSS and np.isfinite(obj)):
                if opts.eta is None and saved is not None and self.eta > 1e-6:
                    self._backtrack(saved)
                    backtracks += 1
                    prev_loss = alpha_prev = None
                    tracker = _OscillationTracker()
                    continue
                raise VfemDivergence(
                    f"{label}: the loss became {loss:.4g} at iteration {t} with eta = "
                    f"{self.eta:.4g}; the iteration diverges: set a smaller [method] eta"
                )
            if (
                opts.eta is None
                and saved is not None
                and prev_obj is not None
                and obj < prev_obj - 1e-9 * (1.0 + abs(prev_obj))
            ):
                self._backtrack(saved)
                backtracks += 1
                prev_loss = alpha_prev = None
                tracker = _OscillationTracker()
                continue
            change = float(terms["dbeta"][0])
            if alpha_prev is not None:
                change += abs(self.alpha0 - alpha_prev)
            if prev_loss is not None and abs(loss - prev_loss) < tol_loss and change < tol_beta:
                converged = True
                break
            if t >= opts.max_iter:
                break
            alpha_prev = self.alpha0
            saved = (self.alpha0, self.sigma2)
            prev_obj = obj
            self._mstep(e, w, self.sigma2)
            prev_loss = loss
            self.sigma2 = loss
            t += 1
            if t % opts.checkpoint_every == 0:
                self.progress.update(
                    {
                        "t": t,
                        "prev_loss": prev_loss,
                        "alpha_prev": alpha_prev,
                        "backtracks": backtracks,
                        "eta": self.eta,
                    }
                )
                self._commit(
                    ctx, {"iteration": t, "sigma2": loss * self.y_scale**2, "beta_change": change}
                )
        self.last_e = e
        self.fit_info = {
            "design": d.kind,
            "n": n,
            "iterations": t,
            "converged": converged,
            "eta": self.eta,
            "eta_halvings": backtracks,
            "eta_retunes": retunes,
            "sigma2": self.sigma2 * self.y_scale**2,
            "loglik": ll,
            "beta_change": change,
        }
        if not converged and not loose:
            ctx.log(
                f"{label}: not converged after {t} iterations (max_iter); estimates and "
                "standard errors are unreliable: raise [method] max_iter"
            )
        self.progress.update(
            {
                "t": 0,
                "prev_loss": None,
                "alpha_prev": None,
                "backtracks": 0,
                "design": index + 1,
                "started": 0,
            }
        )
        self._commit(
            ctx, {"iteration": t, "sigma2": self.sigma2 * self.y_scale**2, "beta_change": change}
        )

    def _backtrack(self, saved: tuple[float, float]) -> None:
        """Undo the last M-step everywhere and halve eta."""
        d, own = self.design, self._own()
        assert d is not None and self.fed is not None
        self.fed.broadcast("revert", ids=d.ids)
        if own is not None:
            own.revert()
        self.alpha0, self.sigma2 = saved
        self.eta /= 2.0

    def _commit(self, ctx: ActiveContext, stats: Mapping[str, float]) -> None:
        epoch = int(self.progress.get("epoch", 0))
        ctx.epoch_done(epoch, stats=dict(stats))
        self.progress["epoch"] = epoch + 1

    # -- inference ----------------------------------------------------------------------

    def _global_coords(self) -> list[str]:
        d = self.design
        assert d is not None
        return (["alpha0"] if self.opts.intercept else []) + (["sigma2"] if d.model_x else [])

    def _inference(self, ctx: ActiveContext) -> None:
        d, own, fed = self.design, self._own(), self.fed
        assert d is not None and fed is not None
        opts = self.opts
        n = len(d.ids)
        ginv = None
        va = ub = None
        glob = self._global_coords()
        p_beta = (
            (1 if opts.intercept else 0)
            + (own.p if own is not None else 0)
            + sum(len(self.config.party(p).columns) for p in d.parties)
        )
        shift = 0.0
        if opts.intercept:
            # sum_k (center_k / scale_k)' beta_k: moves the intercept back to the original scale
            shift = float(fed.sums("shift", ids=d.ids, names=["shift"]).get("shift", [0.0])[0])
            if own is not None:
                shift += own.shift()
        if opts.se:
            dims = [
                BlockParams.n_coordinates(len(self.config.party(p).columns), model_x=d.model_x)
                for p in d.parties
            ]
            d_total = len(glob) + (own.n_coordinates() if own is not None else 0) + sum(dims)
            v_g, u_g = self._probe(d_total)
            sums = fed.sums(
                "sem_sums",
                ids=d.ids,
                names=["gram", "va", "ub"],
                args={"intercept": opts.intercept},
            )
            gram = u_g.T @ u_g + sums.get("gram", 0.0)
            va = sums.get("va", np.zeros(d_total)).copy()
            ub = sums.get("ub", np.zeros(d_total)).copy()
            if own is not None:
                mine = own.sem_sums(intercept=opts.intercept)
                gram = gram + mine["gram"]
                va += mine["va"]
                ub += mine["ub"]
            if opts.intercept:
                va += v_g[0]
                ub += u_g[0]
            cond = np.linalg.cond(gram)
            if not (np.isfinite(cond) and cond < 1e15):
                raise VfemInputError(
                    f"{self.method_label}: the information matrix is singular (condition "
                    f"{cond:.3g}): some coefficient is not identified, e.g. columns collinear "
                    "across parties; drop one of them"
                )
            ginv = np.linalg.inv(gram)
        got = fed.broadcast(
            "finish",
            ids=d.ids,
            inputs={} if ginv is None else {"ginv": ginv},
            collect=["coef", "var"],
        )
        rss_sigma2 = float(np.mean(self.last_e**2)) if self.ols else self.sigma2
        if self.ols:
            # classical OLS: s^2 = RSS / (n - p)
            scale2 = rss_sigma2 * n / max(n - p_beta, 1)
        else:
            scale2 = self.sigma2
        factor = self.eta * scale2 / n
        rows: list[tuple[str, str, float, float]] = []
        if opts.intercept:
            est = self.y_center + self.y_scale * (self.alpha0 - shift)
            var = float(va @ ginv @ ub) * factor if ginv is not None else math.nan
            rows.append((self.config.active_name, "(intercept)", est, var))
        blocks: list[tuple[str, Sequence[str], dict[str, np.ndarray]]] = []
        if own is not None:
            blocks.append((self.config.active_name, own.columns, own.sem_finish(ginv)))
        for p in d.parties:
            blocks.append(
                (
                    p,
                    self.config.party(p).columns,
                    {
                        "coef": np.asarray(got[f"coef@{p}"], dtype=np.float64),
                        "var": np.asarray(got[f"var@{p}"], dtype=np.float64),
                    },
                )
            )
        for party, columns, out in blocks:
            for j, col in enumerate(columns):
                rows.append((party, col, float(out["coef"][j]), float(out["var"][j]) * factor))
        self.coefficients = self._table(rows, n=n, p_beta=p_beta)
        self.fit_info.update(
            {
                "se": "sem" if ginv is not None else "none",
                "p": p_beta,
                "sigma2": scale2 * self.y_scale**2,
            }
        )

    def _probe(self, d_total: int) -> tuple[np.ndarray, np.ndarray]:
        """Central differences of the map along secret random directions; returns the active
        party's global rows (V_g, U_g = V_g - J V_g) for alpha0 and sigma^2."""
        d, own, fed = self.design, self._own(), self.fed
        assert d is not None and fed is not None
        h = self.opts.sem_step
        yz = self.yz_all[d.positions]
        n = len(yz)
        fed.broadcast("probe_setup", ids=d.ids, args={"d": d_total, "h": h})
        if own is not None:
            own.probe_setup(d=d_total, h=h)
        glob = self._global_coords()
        v_g = secret_directions(len(glob), d_total)
        w_g = np.zeros_like(v_g)
        ia = glob.index("alpha0") if "alpha0" in glob else None
        isg = glob.index("sigma2") if "sigma2" in glob else None
        batch = max(1, min(d_total, PROBE_FLOATS // (2 * n)))
        for start in range(0, d_total, batch):
            cols = list(range(start, min(d_total, start + batch)))
            names = ["m", "q"] if d.model_x else ["m"]
            got = fed.sums("probe_estep", ids=d.ids, names=names, args={"cols": cols})
            evals = 2 * len(cols)
            m = got.get("m", np.zeros((evals, n)))
            q = got.get("q", np.zeros((evals, n)))
            if own is not None:
                mine = own.probe_estep(cols)
                m = m + mine["m"]
                q = q + (mine["q"] if d.model_x else 0.0)
            signs = np.tile([1.0, -1.0], len(cols))
            jcols = np.repeat(cols, 2)
            alpha = np.full(evals, self.alpha0)
            sig2 = np.full(evals, self.sigma2)
            if ia is not None:
                alpha = alpha + signs * h * v_g[ia, jcols]
                m = m + alpha[:, None]
            if isg is not None:
                sig2 = sig2 + signs * h * v_g[isg, jcols]
            e_all = np.empty((evals, n))
            w_all = np.empty((evals, n))
            for k in range(evals):
                e, w, s2n = combine_rows(yz, m[k], q[k], float(sig2[k]))
                e_all[k], w_all[k] = e, w
                out = np.zeros(len(glob))
                if ia is not None:
                    out[ia] = alpha[k] + self.eta * float(np.mean(e))
                if isg is not None:
                    out[isg] = s2n
                w_g[:, jcols[k]] += signs[k] * out / (2 * h)
            if own is not None:
                own.probe_mstep(cols, e=e_all, w=w_all, sigma2=sig2, eta=self.eta)

            def inputs(
                _k: int, party: str, e_all=e_all, w_all=w_all, sig2=sig2
            ) -> dict[str, np.ndarray]:
                out = {"e": e_all, "sigma2": sig2}
                if d.model_x and d.missing[party].any():
                    out["w"] = np.where(d.missing[party][None, :], w_all, 0.0)
                return out

            fed.each("probe_mstep", ids=d.ids, args={"cols": cols, "eta": self.eta}, inputs=inputs)
        return v_g, v_g - w_g

    def _table(
        self, rows: Sequence[tuple[str, str, float, float]], *, n: int, p_beta: int
    ) -> list[dict[str, Any]]:
        from scipy import stats as sps

        level = self.opts.level
        if self.ols:
            df = max(n - p_beta, 1)
            crit = float(sps.t.ppf(0.5 + level / 2, df))

            def pvalue(z: float) -> float:
                return float(2 * sps.t.sf(abs(z), df))
        else:
            crit = float(sps.norm.ppf(0.5 + level / 2))

            def pvalue(z: float) -> float:
                return float(2 * sps.norm.sf(abs(z)))

        out = []
        for party, name, coef, var in rows:
            est = coef if name == "(intercept)" else coef * self.y_scale
            se = math.sqrt(var) * self.y_scale if var >= 0 else math.nan
            if var < 0:
                se = math.nan
            z = est / se if se and math.isfinite(se) and se > 0 else math.nan
            out.append(
                {
                    "party": party,
                    "name": name,
                    "estimate": est,
                    "se": se,
                    "z": z,
                    "p": pvalue(z) if math.isfinite(z) else math.nan,
                    "ci_low": est - crit * se,
                    "ci_high": est + crit * se,
                }
            )
        return out

    # -- prediction, reporting -----------------------------------------------------------

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        d, own = self.design, self._own()
        assert d is not None and self.fed is not None
        got = self.fed.sums("predict", ids=ids, names=["m"])
        m = got.get("m", np.zeros(len(ids)))
        if own is not None:
            m = m + own.predict(self.table.rows(ids))
        pred = self.y_center + self.y_scale * (self.alpha0 + m)
        return task_metrics("regression", y_true=self.table.label_rows(ids), output=pred)

    def summary(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:  # JSON has no NaN: an absent SE (se = "none") is null
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "coefficients": [{k: clean(v) for k, v in row.items()} for row in self.coefficients],
            "fit": {"method": self.config.method, **self.fit_info},
        }

    def report(self, run_dir: Path, out: IO[str]) -> None:
        path = Path(run_dir) / "coefficients.csv"
        fields = ["party", "name", "estimate", "se", "z", "p", "ci_low", "ci_high"]
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=fields)
            writer.writeheader()
            for row in self.coefficients:
                writer.writerow({k: row[k] for k in fields})
        print(format_coefficients(self.coefficients, title=self._title()), file=out, flush=True)

    def _title(self) -> str:
        info = self.fit_info
        state = "converged" if info.get("converged") else "NOT converged"
        return (
            f"{self.config.method}: n = {info.get('n')}, {info.get('iterations')} iterations "
            f"({state}), eta = {info.get('eta', float('nan')):.4g}, "
            f"sigma^2 = {info.get('sigma2', float('nan')):.6g}"
        )

    def state_dict(self) -> dict[str, Any]:
        state = {
            k: (None if v is None else float(v) if k != "phase" else v)
            for k, v in self.progress.items()
            if k != "own"
        }
        state.update({"alpha0": float(self.alpha0), "sigma2": float(self.sigma2)})
        if self.own is not None:
            state["own"] = self.own.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.progress = dict(state)
        self.alpha0 = float(state.get("alpha0", 0.0))
        self.sigma2 = float(state.get("sigma2", 1.0))


def format_coefficients(rows: Sequence[Mapping[str, Any]], *, title: str = "") -> str:
    """A fixed-width table of the coefficients (party, name, estimate, SE, z, p, CI)."""
    head = (
        f"{'party':<12} {'name':<20} {'estimate':>12} {'se':>11} {'z':>8} {'p':>9} "
        f"{'ci_low':>12} {'ci_high':>12}"
    )
    lines = [title, head, "-" * len(head)] if title else [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{str(r['party'])[:12]:<12} {str(r['name'])[:20]:<20} {r['estimate']:>12.6g} "
            f"{r['se']:>11.4g} {r['z']:>8.3f} {r['p']:>9.3g} {r['ci_low']:>12.6g} "
            f"{r['ci_high']:>12.6g}"
        )
    return "\n".join(lines)


SPEC = register_method(
    MethodSpec(
        name="vfem",
        active=BlockRegressionActive,
        party=BlockRegressionParty,
        tasks=("regression",),
        description="VFEM: federated EM linear regression with missing blocks, SEM standard errors",
        extra_checks=(option_check(VFEM_OPTIONS),),
        secure_defaults=VFEM_SECURE_DEFAULTS,
    )
)
