"""VFEM inference: SEM standard errors (central differences of the iterated map along secret
random directions, notes §5.1), the coefficient table, and the report."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from securevfl.methods.base import ActiveContext
from securevfl.methods.vfem.block import VfemInputError, secret_directions
from securevfl.stats.gaussian_blocks import BlockParams, combine_rows

# probe evaluations per secure-sum round: rows x evaluations stays below this many floats
PROBE_FLOATS = 1 << 21
# fewest directions SEM probes beyond the number of coordinates (`sem_directions`)
SEM_EXTRA_MIN = 8


class VfemInference:
    """Mixed into the active stage: SEM inference after the fit, and the outputs."""

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
            n_dirs = sem_directions(d_total)
            v_g, u_g = self._probe(n_dirs)
            sums = fed.sums(
                "sem_sums",
                ids=d.ids,
                names=["gram", "va", "ub"],
                args={"intercept": opts.intercept},
            )
            gram = u_g.T @ u_g + sums.get("gram", 0.0)
            va = sums.get("va", np.zeros(n_dirs)).copy()
            ub = sums.get("ub", np.zeros(n_dirs)).copy()
            if own is not None:
                mine = own.sem_sums(intercept=opts.intercept)
                gram = gram + mine["gram"]
                va += mine["va"]
                ub += mine["ub"]
            if opts.intercept:
                va += v_g[0]
                ub += u_g[0]
            ginv = sem_inverse(gram, d_total, label=self.method_label)
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

    def _probe(self, n_dirs: int) -> tuple[np.ndarray, np.ndarray]:
        """Central differences of the map along `n_dirs` secret random directions (more than
        the coordinates, `sem_directions`); returns the active party's global rows (V_g,
        U_g = V_g - J V_g) for alpha0 and sigma^2."""
        d, own, fed = self.design, self._own(), self.fed
        assert d is not None and fed is not None
        h = self.opts.sem_step
        yz = self.yz_all[d.positions]
        n = len(yz)
        fed.broadcast("probe_setup", ids=d.ids, args={"d": n_dirs, "h": h})
        if own is not None:
            own.probe_setup(d=n_dirs, h=h)
        glob = self._global_coords()
        v_g = secret_directions(len(glob), n_dirs)
        w_g = np.zeros_like(v_g)
        ia = glob.index("alpha0") if "alpha0" in glob else None
        isg = glob.index("sigma2") if "sigma2" in glob else None
        batch = max(1, min(n_dirs, PROBE_FLOATS // (2 * n)))
        # the last E-step's sums at the estimate (the intercept is added per probe below)
        base_m = self.last_terms["m"] - (self.alpha0 if ia is not None else 0.0)
        base_q = self.last_terms["q"]
        for start in range(0, n_dirs, batch):
            cols = list(range(start, min(n_dirs, start + batch)))
            names = ["m", "q"] if d.model_x else ["m"]
            got = fed.sums("probe_estep", ids=d.ids, names=names, args={"cols": cols})
            evals = 2 * len(cols)
            dm = got.get("m", np.zeros((evals, n)))
            dq = got.get("q", np.zeros((evals, n)))
            if own is not None:
                mine = own.probe_estep(cols)
                dm = dm + mine["m"]
                dq = dq + (mine["q"] if d.model_x else 0.0)
            # each role sent (term(theta + s h v_j) - term(theta)) / h
            m = base_m[None, :] + h * dm
            q = base_q[None, :] + h * dq if d.model_x else np.zeros((evals, n))
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


def sem_directions(d: int) -> int:
    """How many secret directions SEM probes for d coordinates: d plus a quarter, at least
    SEM_EXTRA_MIN more. Each role draws its rows of V alone, so a square V (d x d) is a random
    matrix whose condition number has a heavy tail (at d = 28: median 73, 1 draw in 100 above
    6e3, up to 6e5), and it multiplies the differences' own error (~1e-10 relative): standard
    errors were off by up to 7e-5 relative. A V with more columns than rows is a rectangular
    random matrix whose smallest singular value stays away from zero (at d = 28, 36 directions:
    condition below 30 in 2000 draws), for a quarter more probes."""
    return d + max(SEM_EXTRA_MIN, -(-d // 4))


def sem_inverse(gram: np.ndarray, rank: int, *, label: str) -> np.ndarray:
    """The pseudo-inverse of U'U on its `rank` largest eigenvalues (rank = the number of
    coordinates d). U = (I - J) V has rank d however many directions V has, so
    V (U'U)^+ U' = (I - J)^{-1}; the eigenvalues past the d-th come from the differences' and
    the sums' rounding only, and are dropped. Raises `VfemInputError` where the kept part is
    singular (a coefficient not identified)."""
    lam, vec = np.linalg.eigh(0.5 * (gram + gram.T))
    lam, vec = lam[::-1], vec[:, ::-1]
    top = lam[:rank]
    cond = top[0] / top[-1] if top[-1] > 0 else math.inf
    if not (np.isfinite(cond) and cond < 1e15):
        raise VfemInputError(
            f"{label}: the information matrix is singular (condition {cond:.3g}): some "
            "coefficient is not identified, e.g. columns collinear across parties; drop one of "
            "them"
        )
    kept = vec[:, :rank]
    return (kept / top) @ kept.T


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
