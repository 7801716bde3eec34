"""The active party's stage of vfem (and, through subclasses, of the OLS comparators): the
designs it fits in turn, the EM iteration over secure sums, checkpoints. Inference (SEM
standard errors) and reporting are `VfemInference`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from securevfl.methods.base import ActiveContext, ActiveMethod
from securevfl.methods.vfem.block import (
    BlockState,
    VfemDivergence,
    VfemInputError,
    row_namer,
)
from securevfl.methods.vfem.federation import Design, Federation, FitOptions, OscillationTracker
from securevfl.methods.vfem.inference import VfemInference
from securevfl.metrics import task_metrics
from securevfl.stats.gaussian_blocks import combine_rows, y_loglik

# sigma^2 is ~1 on the internal (standardised) scale; far beyond means the iteration diverged
DIVERGED_LOSS = 1e4


class BlockRegressionActive(VfemInference, ActiveMethod):
    """Active stage of vfem (and, through subclasses, of the OLS comparators)."""

    method_label = "vfem"
    ols = False  # OLS comparators: classical s^2 and t-based inference
    progress_unit = "iteration"  # EM runs to convergence: no fixed total
    progress_total = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opts = FitOptions.from_config(self.config)
        self.own: BlockState | None = None
        self.fed: Federation | None = None
        self.design: Design | None = None
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
            # complete: every cell of the active party's own block present too
            keep &= ~np.isnan(self.table.rows(ids)).any(axis=1)
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
        if getattr(self.table, "streamed", False):
            ctx.log(
                f"{self.method_label}: every role holds its block of the {len(train_ids)} "
                "training rows in memory (each iteration sums per-row terms over all of them "
                "at once, and the standard errors need the whole design); the row caches serve "
                "the loading only"
            )
        self.y_center = float(y.mean()) if opts.intercept else 0.0
        self.y_scale = float(np.sqrt(np.mean((y - y.mean()) ** 2)))
        if not self.y_scale > 0:
            raise VfemInputError(f"the response {cfg.label!r} is constant; nothing to explain")
        self.yz_all = (y - self.y_center) / self.y_scale
        # every block checks its data first, so that a party's problem is the one reported
        all_parties, use_own = self.participants(ctx)
        prep = Federation(ctx, all_parties)
        prep.broadcast(
            "prepare",
            ids=train_ids,
            args={"intercept": opts.intercept, "standardize": cfg.standardize},
        )
        if use_own:
            # the active party's own block may lack single cells (NA tokens): its missing
            # cells are modelled by pattern, locally (no other role needs anything of them)
            self.own = BlockState(
                owner=f"the active party ({cfg.active_name!r})",
                columns=self.table.columns,
                values=self.table.rows(train_ids),
                intercept=opts.intercept,
                standardize=cfg.standardize,
                allow_cells=True,
                row_name=row_namer(self.table, train_ids),
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
        self.design = Design(kind, ids, positions, parties, missing, use_own)
        self.fed = Federation(ctx, parties)
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
        tracker = OscillationTracker()
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
                    tracker = OscillationTracker()
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
                tracker = OscillationTracker()
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
        # the E-step sums at the estimate: SEM probes are sent as changes from these
        self.last_terms = terms
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

    def evaluate(self, ctx: ActiveContext, *, ids: np.ndarray) -> dict[str, Any]:
        d, own = self.design, self._own()
        assert d is not None and self.fed is not None
        got = self.fed.sums("predict", ids=ids, names=["m"])
        m = got.get("m", np.zeros(len(ids)))
        if own is not None:
            m = m + own.predict(self.table.rows(ids))
        pred = self.y_center + self.y_scale * (self.alpha0 + m)
        return task_metrics("regression", y_true=self.table.label_rows(ids), output=pred)

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


class VfemActive(BlockRegressionActive):
    """VFEM: the start (complete-case or mean-imputation OLS), then the EM fit on every row."""
