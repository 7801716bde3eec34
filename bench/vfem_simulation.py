"""Monte-Carlo study of VFEM and its comparators (not run in CI).

    python bench/vfem_simulation.py --reps 200 --out bench/results/vfem_simulation.json

Design (implementation notes `shared/methods/vfem.md` §7.2; the paper's own simulation is in an
unavailable supplement): K = 3 parties with p_k = (3, 2, 2) columns,
beta = (1, -0.5, 0.8 | 1, 0.5 | -1, 0.6), sigma = 1, x^k ~ N(0, AR1(0.5)) independent across
parties, y = x'beta + eps (the fit includes an intercept, true value 0). Missingness designs:

* S1: MCAR with rates (0, 0.3, 0.6) (the first party is complete);
* S2: MCAR with rates (0.2, 0.4, 0.6);
* MAR: our own design: party 1 complete, parties 2 and 3 lack a row with probability
  logistic(g_k + standardised y) (g = -1, 0: about 30% and 50% missing), so missingness depends
  on the (always observed) response: the likelihood stays valid, CC and mean imputation do not.

each at n = 500 and 2000. Rows that no party holds are dropped (as the federation does).
Methods: Full (OLS before deletion, the oracle), CC-OLS, MeanImp-OLS, EM (exact centralised EM)
and VFEM (default step size, complete-case start). VFEM's standard errors are SEM on the VFEM
map (notes §5.1); EM shares VFEM's fixed point, so it reports the same SEs.

VFEM runs through `securevfl.stats.reference`, which calls the same per-block functions as the
federated parties; `--federated-reps K` also runs the first K replications of each cell through
a real in-process federation (mask aggregation) and records the largest difference.

Writes JSON (per cell, method and coefficient; every replication too with
`--save-replications`) and a markdown table next to it: per cell and method, averaged over the
7 slopes: |bias|, RMSE, empirical SD, mean SE, SE/SD and 95% Wald coverage (mean and range over
the slopes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from securevfl.stats.reference import (  # noqa: E402
    DivergenceError,
    RegressionData,
    beta_positions,
    cc_ols,
    default_eta,
    fit_em,
    fit_vfem,
    impute_ols,
    initial_theta,
    jacobian,
    ols,
    sem_beta_variances,
    vfem_step,
)

DIMS = (3, 2, 2)
BETA = np.array([1.0, -0.5, 0.8, 1.0, 0.5, -1.0, 0.6])
DESIGNS = {"S1": (0.0, 0.3, 0.6), "S2": (0.2, 0.4, 0.6), "MAR": None}
MAR_OFFSETS = (None, -1.0, 0.0)
METHODS = ("Full", "CC", "MeanImp", "EM", "VFEM")
Z95 = 1.959963984540054
TOL = {"tol_loss": 1e-13, "tol_beta": 1e-10, "max_iter": 50_000}


def ar1(p: int, rho: float = 0.5) -> np.ndarray:
    return rho ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))


def simulate(design: str, n: int, rep: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(y, blocks with NaN rows where missing, the complete design)."""
    rng = np.random.default_rng([1000 * n + rep, list(DESIGNS).index(design)])
    blocks = [rng.multivariate_normal(np.zeros(p), ar1(p), size=n) for p in DIMS]
    x = np.concatenate(blocks, axis=1)
    y = x @ BETA + rng.normal(size=n)
    out = []
    for k, block in enumerate(blocks):
        block = block.copy()
        if design == "MAR":
            offset = MAR_OFFSETS[k]
            if offset is not None:
                ys = (y - y.mean()) / y.std()
                missing = rng.random(n) < 1.0 / (1.0 + np.exp(-(offset + ys)))
                block[missing] = np.nan
        else:
            block[rng.random(n) < DESIGNS[design][k]] = np.nan
        out.append(block)
    return y, out, x


def one_replication(args: tuple[str, int, int]) -> dict:
    design, n, rep = args
    y, blocks, x = simulate(design, n, rep)
    held = np.stack([~np.isnan(b[:, 0]) for b in blocks], axis=1).any(axis=1)
    data = RegressionData.from_blocks(y[held], [b[held] for b in blocks])
    out: dict[str, dict[str, list[float]]] = {}

    def record(name: str, est: np.ndarray, se: np.ndarray) -> None:
        out[name] = {"est": [float(v) for v in est], "se": [float(v) for v in se]}

    full = ols(y, x)
    record("Full", full.coef, full.se)
    cc = cc_ols(data)
    record("CC", cc.coef, cc.se)
    imp = impute_ols(data)
    record("MeanImp", imp.coef, imp.se)
    theta0 = initial_theta(data, cc.coef)
    eta = default_eta(theta0, intercept=True)
    started = time.perf_counter()
    while True:  # as the federation's eta = "auto": a smaller step if this one diverges
        try:
            vf = fit_vfem(data, theta0, eta=eta, **TOL)
            break
        except DivergenceError:
            eta /= 2
    jac = jacobian(lambda th: vfem_step(data, th, eta=eta), vf.theta, intercept=True)
    var = sem_beta_variances(
        jac, beta_positions(vf.theta, intercept=True), eta=eta, sigma2=vf.theta.sigma2, n=data.n
    )
    se = np.sqrt(var)
    record("VFEM", vf.theta.beta, se)
    seconds = time.perf_counter() - started
    em = fit_em(data, theta0, **TOL)
    record("EM", em.theta.beta, se)
    return {
        "design": design,
        "n": n,
        "rep": rep,
        "methods": out,
        "vfem": {
            "iterations": vf.iterations,
            "converged": vf.converged,
            "eta": eta,
            "seconds": seconds,
            "em_gap": float(np.max(np.abs(vf.theta.beta - em.theta.beta))),
        },
    }


def summarise(records: list[dict]) -> list[dict]:
    truth = np.concatenate([[0.0], BETA])
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        cells.setdefault((r["design"], r["n"]), []).append(r)
    rows = []
    for (design, n), recs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        for method in METHODS:
            est = np.array([r["methods"][method]["est"] for r in recs])
            se = np.array([r["methods"][method]["se"] for r in recs])
            reps = len(recs)
            bias = est.mean(axis=0) - truth
            sd = est.std(axis=0, ddof=1)
            rmse = np.sqrt(np.mean((est - truth) ** 2, axis=0))
            cover = np.mean(np.abs(est - truth) <= Z95 * se, axis=0)
            slopes = slice(1, None)
            rows.append(
                {
                    "design": design,
                    "n": n,
                    "method": method,
                    "reps": reps,
                    "abs_bias": float(np.mean(np.abs(bias[slopes]))),
                    "max_bias_in_mc_se": float(
                        np.max(np.abs(bias[slopes]) / (sd[slopes] / math.sqrt(reps)))
                    ),
                    "rmse": float(np.mean(rmse[slopes])),
                    "sd": float(np.mean(sd[slopes])),
                    "mean_se": float(np.mean(se[:, slopes])),
                    "se_over_sd": float(np.mean(se[:, slopes].mean(axis=0) / sd[slopes])),
                    "coverage": float(np.mean(cover[slopes])),
                    "coverage_min": float(np.min(cover[slopes])),
                    "coverage_max": float(np.max(cover[slopes])),
                    "intercept_coverage": float(cover[0]),
                    "per_coefficient": {
                        "bias": bias.tolist(),
                        "sd": sd.tolist(),
                        "rmse": rmse.tolist(),
                        "mean_se": se.mean(axis=0).tolist(),
                        "coverage": cover.tolist(),
                    },
                }
            )
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# VFEM Monte-Carlo study",
        "",
        f"{meta['reps']} replications per cell; averages over the 7 slopes (bias, RMSE, SD, "
        "SE, coverage of the 95% Wald interval; coverage range over the slopes in brackets). "
        "`bias/MCSE` is the largest |bias| in Monte-Carlo standard errors (SD / sqrt(reps)). "
        "EM shares VFEM's fixed point and reports VFEM's SEM standard errors.",
        "",
        "| design | n | method | abs bias | bias/MCSE | RMSE | SD | mean SE | SE/SD | coverage "
        "| intercept cov. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['design']} | {r['n']} | {r['method']} | {r['abs_bias']:.4f} | "
            f"{r['max_bias_in_mc_se']:.1f} | {r['rmse']:.4f} | {r['sd']:.4f} | "
            f"{r['mean_se']:.4f} | {r['se_over_sd']:.3f} | {r['coverage']:.3f} "
            f"[{r['coverage_min']:.3f}, {r['coverage_max']:.3f}] | "
            f"{r['intercept_coverage']:.3f} |"
        )
    v = meta["vfem"]
    lines += [
        "",
        f"VFEM: median {v['median_iterations']:.0f} iterations, all converged: "
        f"{v['all_converged']}, largest |VFEM - EM| = {v['max_em_gap']:.2e}, "
        f"median {v['median_seconds']:.2f} s per fit + SEM (NumPy reference).",
    ]
    if meta.get("federated"):
        f = meta["federated"]
        lines.append(
            f"Federated spot check ({f['runs']} runs, mask aggregation, in-process federation): "
            f"largest |estimate - reference| = {f['max_estimate_gap']:.2e}, largest relative SE "
            f"gap = {f['max_se_rel_gap']:.2e}."
        )
    lines += [
        "",
        f"Run: {meta['command']} ({meta['seconds']:.0f} s, {meta['workers']} workers, "
        f"{meta['platform']})",
        "",
    ]
    return "\n".join(lines)


def federated_check(design: str, n: int, rep: int, workdir: Path) -> tuple[float, float]:
    """Run one replication through a real in-process federation; return the largest estimate
    and relative SE gaps to the NumPy reference."""
    import io

    from securevfl.config import parse_config
    from securevfl.data.table import write_csv
    from securevfl.inproc import run_federation

    y, blocks, _ = simulate(design, n, rep)
    ref = one_replication((design, n, rep))["methods"]["VFEM"]
    cols = [f"X{i + 1}" for i in range(sum(DIMS))]
    d = workdir / f"{design}-{n}-{rep}"
    write_csv(
        d / "data.csv",
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=cols,
        values=np.concatenate(blocks, axis=1),
        label="Y",
        labels=y,
    )
    raw = {
        "run": {"method": "vfem", "aggregation": "mask", "transport": "inproc", "seed": rep},
        "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.0},
        "parties": {
            "a": {"columns": cols[:3]},
            "b": {"columns": cols[3:5]},
            "c": {"columns": cols[5:]},
        },
        "secure": {"frac_bits": 40, "bound": 2.0**18},
        "method": {"tol_loss": 1e-13, "tol_beta": 1e-10, "max_iter": 50_000},
        "policy": {"clear_releases": ["design.spectrum", "finish.coef", "finish.var"]},
    }
    cfg = parse_config(raw, source=d / "config.toml")
    code, metrics = run_federation(cfg, out=d / "run", stdout=io.StringIO())
    if code != 0 or metrics is None:
        raise RuntimeError(f"federated run {design}/{n}/{rep} failed with exit status {code}")
    est = np.array([c["estimate"] for c in metrics["coefficients"]])
    se = np.array([c["se"] for c in metrics["coefficients"]])
    return (
        float(np.max(np.abs(est - ref["est"]))),
        float(np.max(np.abs(se / np.array(ref["se"]) - 1))),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--ns", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--federated-reps", type=int, default=0)
    parser.add_argument(
        "--save-replications",
        action="store_true",
        help="also store every replication's estimates and SEs in the JSON (large)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "vfem_simulation.json",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tasks = [(d, n, r) for d in args.designs for n in args.ns for r in range(args.reps)]
    records = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, rec in enumerate(pool.map(one_replication, tasks, chunksize=4), start=1):
            records.append(rec)
            if i % max(1, len(tasks) // 20) == 0 or i == len(tasks):
                print(
                    f"{i}/{len(tasks)} replications ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    rows = summarise(records)
    vf = [r["vfem"] for r in records]
    meta = {
        "reps": args.reps,
        "ns": args.ns,
        "designs": args.designs,
        "workers": args.workers,
        "command": "python bench/vfem_simulation.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "platform": f"{platform.python_version()} on {platform.machine()}",
        "vfem": {
            "median_iterations": float(np.median([v["iterations"] for v in vf])),
            "all_converged": all(v["converged"] for v in vf),
            "max_em_gap": float(max(v["em_gap"] for v in vf)),
            "median_seconds": float(np.median([v["seconds"] for v in vf])),
        },
    }
    if args.federated_reps:
        gaps = []
        with tempfile.TemporaryDirectory() as tmp:
            for d in args.designs:
                for n in args.ns:
                    for r in range(args.federated_reps):
                        gaps.append(federated_check(d, n, r, Path(tmp)))
        meta["federated"] = {
            "runs": len(gaps),
            "max_estimate_gap": max(g[0] for g in gaps),
            "max_se_rel_gap": max(g[1] for g in gaps),
        }
    meta["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "summary": rows}
    if args.save_replications:
        result["replications"] = records
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    md = markdown(rows, meta)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
