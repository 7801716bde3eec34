"""VFEM and its OLS comparators end to end: every role a thread over in-process ZeroMQ with the
real protocol (`run_federation`), checked against the centralised NumPy reference."""

from __future__ import annotations

import copy
import csv
import io
import math
from pathlib import Path

import numpy as np
import pytest

from securevfl.config import ConfigError, parse_config
from securevfl.data.table import read_csv_columns, train_test_split, write_csv
from securevfl.inproc import run_federation
from securevfl.methods.vfem.block import BlockState, VfemInputError
from securevfl.stats.reference import (
    RegressionData,
    beta_positions,
    cc_ols,
    default_eta,
    fit_em,
    impute_ols,
    initial_theta,
    jacobian,
    sem_beta_variances,
    single_ols,
    vfem_step,
)
from tests.securevfl.conftest import permissive_policy
from tests.securevfl.test_vfem_stats import fit_mle, simulate

COLS = [f"X{i + 1}" for i in range(7)]
THREE_PARTIES = {
    "a": {"columns": COLS[:3]},
    "b": {"columns": COLS[3:5]},
    "c": {"columns": COLS[5:]},
}
BASE = {
    "run": {"method": "vfem", "aggregation": "mask", "seed": 0, "transport": "inproc"},
    "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.0},
    "parties": THREE_PARTIES,
    "secure": {"frac_bits": 40, "bound": 2.0**18},
    "network": {
        "heartbeat_interval": 0.2,
        "peer_timeout": 3.0,
        "round_timeout": 30.0,
        "startup_timeout": 30.0,
    },
    "method": {"tol_loss": 1e-13, "tol_beta": 1e-10},
}
TIGHT = {"tol_loss": 1e-14, "tol_beta": 1e-11, "max_iter": 50_000}


def run(
    directory: Path, y: np.ndarray, blocks: list[np.ndarray], *, name: str, **changes
) -> tuple[int, dict | None, str, Path]:
    """Write the table, run a federation with BASE updated by `changes` ({"run.method": ...}),
    return (exit status, metrics, stdout, run directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(
        directory / "data.csv",
        id_column="ID",
        ids=np.arange(1, len(y) + 1),
        columns=COLS,
        values=np.concatenate(blocks, axis=1),
        label="Y",
        labels=y,
    )
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if key:
            raw.setdefault(section, {})[key] = value
        else:
            raw[section] = value
    cfg = parse_config(permissive_policy(raw), source=directory / "config.toml")
    out = io.StringIO()
    code, metrics = run_federation(cfg, out=directory / name, stdout=out)
    return code, metrics, out.getvalue(), directory / name


def estimates(metrics: dict) -> tuple[np.ndarray, np.ndarray]:
    rows = metrics["coefficients"]
    return (np.array([r["estimate"] for r in rows]), np.array([r["se"] for r in rows]))


def reference_vfem(data: RegressionData) -> tuple[np.ndarray, np.ndarray, float]:
    """Exact EM from the complete-case start, and SEM standard errors (unit directions)."""
    theta0 = initial_theta(data, cc_ols(data).coef)
    em = fit_em(data, theta0, **TIGHT)
    assert em.converged
    eta = default_eta(theta0, intercept=data.intercept)
    jac = jacobian(lambda th: vfem_step(data, th, eta=eta), em.theta, intercept=data.intercept)
    var = sem_beta_variances(
        jac,
        beta_positions(em.theta, intercept=data.intercept),
        eta=eta,
        sigma2=em.theta.sigma2,
        n=data.n,
    )
    beta = em.theta.beta if data.intercept else em.theta.beta[1:]
    return beta, np.sqrt(var), em.theta.sigma2


@pytest.fixture(scope="module")
def three_party(tmp_path_factory):
    """n = 800, three passive parties missing 20%, 40%, 60% of rows; vfem with mask and plain."""
    d = tmp_path_factory.mktemp("vfem3")
    y, blocks = simulate(800, (0.2, 0.4, 0.6), seed=11)
    runs = {
        agg: run(d, y, blocks, name=f"run-{agg}", **{"run.aggregation": agg})
        for agg in ("mask", "plain")
    }
    return {
        "y": y,
        "blocks": blocks,
        "runs": runs,
        "dir": d,
        "data": RegressionData.from_blocks(y, blocks),
    }


def test_vfem_mask_equals_plain_and_centralised_em(three_party):
    (code_m, m_mask, _, _), (code_p, m_plain, _, _) = (
        three_party["runs"]["mask"],
        three_party["runs"]["plain"],
    )
    assert code_m == 0 and code_p == 0
    est_mask, se_mask = estimates(m_mask)
    est_plain, se_plain = estimates(m_plain)
    assert np.max(np.abs(est_mask - est_plain)) < 1e-6
    beta, se, sigma2 = reference_vfem(three_party["data"])
    assert np.max(np.abs(est_mask - beta)) < 1e-6
    # SEM standard errors of the federation (random secret directions) = unit-direction SEM
    assert np.max(np.abs(se_mask / se - 1)) < 1e-4
    assert np.max(np.abs(se_plain / se - 1)) < 1e-4
    fit = m_mask["fit"]
    assert fit["converged"] and fit["se"] == "sem" and fit["n"] == 800
    assert math.isclose(fit["sigma2"], sigma2, rel_tol=1e-6)


def test_federation_matches_the_likelihood_oracle(three_party):
    """Acceptance: estimates = the maximiser of the closed-form likelihood (1e-5), standard
    errors = its observed-information standard errors (1%)."""
    data = three_party["data"]
    mle = fit_mle(data, beta_start=cc_ols(data).coef)
    # the test-side optimiser stops within ~1e-8 (SciPy versions differ in the last digit)
    assert mle["grad_norm"] < 1e-7
    for agg in ("mask", "plain"):
        est, se = estimates(three_party["runs"][agg][1])
        assert np.max(np.abs(est - mle["beta"])) < 1e-5
        assert np.max(np.abs(se / mle["se"] - 1)) < 0.01


def test_coefficients_reach_metrics_csv_and_the_printed_table(three_party):
    code, metrics, stdout, run_dir = three_party["runs"]["mask"]
    rows = metrics["coefficients"]
    assert [(r["party"], r["name"]) for r in rows] == [("active", "(intercept)")] + [
        (p, c) for p, spec in THREE_PARTIES.items() for c in spec["columns"]
    ]
    for r in rows:
        assert set(r) == {"party", "name", "estimate", "se", "z", "p", "ci_low", "ci_high"}
        assert math.isclose(r["z"], r["estimate"] / r["se"])
        assert math.isclose(r["ci_low"], r["estimate"] - 1.959963984540054 * r["se"])
        assert 0.0 <= r["p"] <= 1.0
    with (run_dir / "coefficients.csv").open() as fh:
        saved = list(csv.DictReader(fh))
    assert [s["name"] for s in saved] == [r["name"] for r in rows]
    assert math.isclose(float(saved[1]["se"]), rows[1]["se"], rel_tol=1e-12)
    assert "(intercept)" in stdout and "ci_high" in stdout and "converged" in stdout
    assert metrics["n_test"] == 0 and metrics["test"] == {}


@pytest.mark.parametrize(("method", "reference"), [("cc-ols", cc_ols), ("impute-ols", impute_ols)])
def test_comparators_equal_closed_form_ols(three_party, method, reference):
    code, metrics, _, _ = run(
        three_party["dir"],
        three_party["y"],
        three_party["blocks"],
        name=f"run-{method}",
        **{"run.method": method},
    )
    assert code == 0
    est, se = estimates(metrics)
    ref = reference(three_party["data"])
    assert np.max(np.abs(est - ref.coef)) < 1e-6
    assert np.max(np.abs(se / ref.se - 1)) < 1e-6
    assert metrics["fit"]["n"] == ref.n


def test_active_block_holdout_and_single_party_fit(tmp_path):
    """The active party holds the first block (missing 20%) besides y; 25% of rows held out."""
    y, blocks = simulate(900, (0.2, 0.3, 0.5), seed=4)
    parties = {"b": {"columns": COLS[3:5]}, "c": {"columns": COLS[5:]}}
    changes = {
        "parties": parties,
        "active": {"columns": COLS[:3]},
        "data.test_fraction": 0.25,
        "method.init": "cc",
    }
    code, metrics, _, _ = run(tmp_path, y, blocks, name="vfem", **changes)
    assert code == 0
    ids = np.arange(1, len(y) + 1)
    train, _ = train_test_split(ids, test_fraction=0.25, seed=0)
    rows = np.isin(ids, train)
    # VFEM uses every training row, those only the active party's block has too
    every = RegressionData.from_blocks(y[rows], [b[rows] for b in blocks])
    # the OLS comparators drop rows no passive party holds
    rows &= ~np.isnan(blocks[1][:, 0]) | ~np.isnan(blocks[2][:, 0])
    data = RegressionData.from_blocks(y[rows], [b[rows] for b in blocks])
    est, se = estimates(metrics)
    beta, se_ref, _ = reference_vfem(every)
    assert np.max(np.abs(est - beta)) < 1e-6
    assert np.max(np.abs(se / se_ref - 1)) < 1e-4
    assert metrics["coefficients"][1]["party"] == "active"
    assert set(metrics["test"]) == {"rmse", "r2"} and metrics["test"]["r2"] > 0.5
    code, metrics, _, _ = run(
        tmp_path,
        y,
        blocks,
        name="single",
        **{k: v for k, v in changes.items() if k != "method.init"},
        **{"run.method": "single-ols"},
    )
    assert code == 0
    ref = single_ols(data, 0)
    est, se = estimates(metrics)
    assert np.max(np.abs(est - ref.coef)) < 1e-6 and np.max(np.abs(se / ref.se - 1)) < 1e-6


def test_missingness_generator_without_intercept(tmp_path):
    """[missing] train = mcar: the blocks each party lacks come from the generator."""
    y, blocks = simulate(500, (0.0, 0.0, 0.0), seed=8, intercept=0.0)
    code, metrics, _, run_dir = run(
        tmp_path,
        y,
        blocks,
        name="gen",
        **{
            "missing": {"train": {"kind": "mcar", "p": 0.3}},
            "method.intercept": False,
            "method.init": "zero",
        },
    )
    assert code == 0
    held = []
    for party, spec in THREE_PARTIES.items():
        ids, _, _ = read_csv_columns(
            run_dir / "data" / f"{party}.csv", id_column="ID", columns=spec["columns"]
        )
        held.append(np.isin(np.arange(1, 501), ids))
    held = np.stack(held, axis=1)
    assert 0.2 < 1 - held.mean() < 0.4
    rows = np.ones(500, dtype=bool)  # VFEM uses the rows no party holds too (y only)
    masked = [np.where(held[:, [k]], b, np.nan)[rows] for k, b in enumerate(blocks)]
    beta, se_ref, _ = reference_vfem(RegressionData.from_blocks(y[rows], masked, intercept=False))
    est, se = estimates(metrics)
    assert "(intercept)" not in [r["name"] for r in metrics["coefficients"]]
    assert np.max(np.abs(est - beta)) < 1e-6 and np.max(np.abs(se / se_ref - 1)) < 1e-4


def test_without_standard_errors_the_json_says_null(tmp_path):
    y, blocks = simulate(300, (0.2, 0.4, 0.6), seed=9)
    code, metrics, stdout, _ = run(tmp_path, y, blocks, name="nose", **{"method.se": "none"})
    assert code == 0 and metrics["fit"]["se"] == "none"
    assert all(r["se"] is None and r["p"] is None for r in metrics["coefficients"])
    assert all(math.isfinite(r["estimate"]) for r in metrics["coefficients"])


# ------------------------------------------------------------------------------- bad input


def _broken(kind: str, y: np.ndarray, blocks: list[np.ndarray]) -> list[np.ndarray]:
    blocks = [b.copy() for b in blocks]
    if kind == "constant":
        held = ~np.isnan(blocks[1][:, 1])
        blocks[1][held, 1] = 3.0
    elif kind == "collinear":
        blocks[2][:, 1] = 2.0 * blocks[2][:, 0] + 1.0
    elif kind == "no-rows":
        blocks[2][:] = np.nan
    return blocks


@pytest.mark.parametrize(
    ("kind", "changes", "words"),
    [
        ("constant", {}, ["party 'b'", "'X5'", "constant"]),
        ("collinear", {}, ["party 'c'", "'X6', 'X7'", "collinear"]),
        ("no-rows", {}, ["party 'c'", "holds none of the", "'X6', 'X7'"]),
        ("diverge", {"method.eta": 40.0}, ["diverges", "eta = 40", "[method] eta"]),
    ],
)
def test_bad_input_stops_with_a_message_naming_the_cause(tmp_path, kind, changes, words):
    y, blocks = simulate(300, (0.2, 0.4, 0.6), seed=2)
    code, metrics, _, run_dir = run(tmp_path, y, _broken(kind, y, blocks), name=kind, **changes)
    assert code != 0 and metrics is None
    log = (run_dir / "logs" / "active.log").read_text()
    for w in words:
        assert w in log, (w, log[-2000:])


def test_a_missing_response_is_refused_naming_the_label(tmp_path):
    y, blocks = simulate(100, (0.2, 0.4, 0.6), seed=2)
    y[7] = np.nan
    with pytest.raises(ConfigError, match="label 'Y' is empty"):
        run(tmp_path, y, blocks, name="nan-y")


def test_block_with_empty_cells_in_held_rows_names_the_column():
    values = np.array([[1.0, 2.0], [np.nan, 1.0], [np.nan, np.nan], [2.0, 0.5], [0.3, 4.0]])
    with pytest.raises(VfemInputError, match="party 'z': column 'u' is empty on training row 2"):
        BlockState(
            owner="party 'z'", columns=("u", "v"), values=values, intercept=True, standardize=True
        )


@pytest.mark.parametrize(
    ("changes", "key", "words"),
    [
        ({"secure": {"frac_bits": 20}}, "[secure] frac_bits", "frac_bits = 40"),
        ({"method": {"init": "mean"}}, "[method] init", "cc, impute, zero"),
        ({"method": {"stepsize": 1}}, "[method] stepsize", "unknown option"),
        ({"method": {"eta": -1}}, "[method] eta", "or a number in (0, 100]"),
        (
            {"run": {"method": "single-ols", "aggregation": "mask"}, "method": {"party": "b"}},
            "[method] party",
            "min_group = 1",
        ),
        (
            {"run": {"method": "single-ols", "aggregation": "mask"}},
            "[method] party",
            "holds no columns",
        ),
        ({"data": {"task": "binary"}}, "[data] task", "supports tasks regression"),
    ],
)
def test_config_checks_name_the_key(changes, key, words):
    raw = copy.deepcopy(BASE)
    raw["data"]["path"] = "data.csv"
    for section, values in changes.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError) as info:
        parse_config(permissive_policy(raw), source=Path("/tmp/x/config.toml"))
    assert info.value.key == key
    assert words in str(info.value)


def test_resume_after_a_crash_gives_the_same_estimates(tmp_path, monkeypatch):
    from securevfl.methods.vfem import block as vfem

    y, blocks = simulate(400, (0.2, 0.4, 0.6), seed=6)
    every = {"method.checkpoint_every": 20}
    code, reference, _, _ = run(tmp_path, y, blocks, name="whole", **every)
    assert code == 0
    update = vfem.BlockState.mstep
    calls = {"n": 0}

    def crash_at_iteration_70(self, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3 * 70:  # three parties
            raise RuntimeError("simulated crash")
        return update(self, **kwargs)

    monkeypatch.setattr(vfem.BlockState, "mstep", crash_at_iteration_70)
    code, _, _, run_dir = run(tmp_path, y, blocks, name="crashed", **every)
    assert code != 0
    monkeypatch.setattr(vfem.BlockState, "mstep", update)
    raw = copy.deepcopy(BASE)
    raw["method"]["checkpoint_every"] = 20
    cfg = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    code, resumed = run_federation(cfg, out=run_dir, resume=True, stdout=io.StringIO())
    assert code == 0
    assert resumed["fit"]["iterations"] == reference["fit"]["iterations"]
    est, se = estimates(resumed)
    est_ref, se_ref = estimates(reference)
    assert np.max(np.abs(est - est_ref)) < 1e-9
    assert np.max(np.abs(se / se_ref - 1)) < 1e-5


def test_rows_with_only_the_response_are_used_as_the_mle_uses_them(tmp_path):
    """Rows no passive party holds (only y at the active party) carry information about the
    intercept and sigma^2 in the observed-data likelihood: VFEM keeps them, and its estimates
    and standard errors are those of the full-data maximum-likelihood fit (closed form plus
    observed information, computed here without the federation)."""
    y, blocks = simulate(600, (0.2, 0.4, 0.6), seed=21)
    only_y = np.arange(0, 600, 7)  # about 14 % of the rows: every block missing
    for block in blocks:
        block[only_y] = np.nan
    code, metrics, _, _ = run(tmp_path, y, blocks, name="only-y", **{"method.tol_loss": 1e-14})
    assert code == 0
    assert metrics["fit"]["n"] == 600  # every row used, none dropped
    data = RegressionData.from_blocks(y, blocks)
    mle = fit_mle(data, beta_start=cc_ols(data).coef)
    est, se = estimates(metrics)
    assert np.max(np.abs(est - mle["beta"]) / np.maximum(np.abs(mle["beta"]), 1.0)) < 1e-6
    assert np.max(np.abs(se / mle["se"] - 1)) < 0.01
