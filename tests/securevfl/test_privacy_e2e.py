"""DP in a running federation: the ledger of a real run, budgets that stop everyone cleanly, bad
privacy settings refused with exit status 2, and measured label leakage with and without DP."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from securevfl.cli import main as cli_main
from securevfl.inproc import run_federation
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger
from securevfl.privacy.run_audit import audit_run
from securevfl.roles import protocol as P
from securevfl.roles.checkpoint import latest_epoch
from tests.securevfl.conftest import REPO, make_config, write_toml

N_TRAIN = 300  # the synthetic table's 400 rows, test_fraction 0.25
DELTA = 1e-3  # default_delta(300)
BATCH = 64


def every_mechanism(raw: dict) -> dict:
    raw["privacy"] = {"label_dp": {"noise_multiplier": 1.3, "clip": 1.0}}
    raw["active"]["dp_sgd"] = {"noise_multiplier": 1.1, "clip": 1.0}
    raw["parties"]["alpha"]["embedding_dp"] = {"noise_multiplier": 0.9, "clip": 2.0}
    raw["parties"]["beta"]["dp_sgd"] = {"noise_multiplier": 1.7, "clip": 0.5}
    return raw


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """One 3-epoch masked run with every mechanism: label DP, embedding DP (alpha), DP-SGD
    (beta, and the active party's head)."""
    from tests.securevfl.conftest import BASE_RAW, synthetic_csv

    d = tmp_path_factory.mktemp("dp-run")
    synthetic_csv(d / "data.csv")
    raw = every_mechanism(json.loads(json.dumps(BASE_RAW)))
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    return d / "run", metrics


def opacus_rdp(steps: list[tuple[float, float]], delta: float) -> float:
    acc = RDPAccountant()
    for sigma, q in steps:
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return acc.get_epsilon(delta=delta)


def test_ledger_has_one_event_per_use_and_step_before_metrics(dp_run):
    run_dir, metrics = dp_run
    events = [
        e for e in PrivacyLedger.read(run_dir / LEDGER_FILENAME) if isinstance(e, LedgerEvent)
    ]
    by = {}
    for e in events:
        by.setdefault((e.role, e.mechanism), []).append(e)
    # label DP and embedding DP: each training row is released once per epoch, one event each
    assert [e.steps for e in by[("active", "label_dp")]] == [1, 1, 1]
    assert [e.epoch for e in by[("active", "label_dp")]] == [0, 1, 2]
    assert [e.steps for e in by[("alpha", "embedding_dp")]] == [1, 1, 1]
    assert all(
        e.sample_rate == 1.0 and not e.amplified
        for key in (("active", "label_dp"), ("alpha", "embedding_dp"))
        for e in by[key]
    )
    # DP-SGD: one event per optimizer step, amplified at batch / N
    steps = 3 * math.ceil(N_TRAIN / BATCH)
    for role in ("active", "beta"):
        sgd = by[(role, "dp_sgd")]
        assert len(sgd) == steps and all(e.sample_rate == BATCH / N_TRAIN for e in sgd)
    assert ("gamma", "embedding_dp") not in by and ("gamma", "dp_sgd") not in by
    assert metrics["privacy"]["steps"]["active/label_dp"] == 3
    assert all(e.delta == DELTA for e in events)


def test_audit_epsilon_equals_opacus_for_each_mechanism(dp_run, capsys):
    run_dir, metrics = dp_run
    assert cli_main(["audit", str(run_dir), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = {(m["role"], m["mechanism"]): m["epsilon"] for m in report["mechanisms"]}
    q = BATCH / N_TRAIN
    sgd_steps = 3 * math.ceil(N_TRAIN / BATCH)
    expected = {
        ("active", "label_dp"): opacus_rdp([(1.3, 1.0)] * 3, DELTA),
        ("alpha", "embedding_dp"): opacus_rdp([(0.9, 1.0)] * 3, DELTA),
        ("active", "dp_sgd"): opacus_rdp([(1.1, q)] * sgd_steps, DELTA),
        ("beta", "dp_sgd"): opacus_rdp([(1.7, q)] * sgd_steps, DELTA),
    }
    assert set(got) == set(expected)
    for key, eps in expected.items():
        assert got[key] == pytest.approx(eps, abs=1e-6), key
        assert metrics["privacy"]["epsilon"]["/".join(key)] == pytest.approx(eps, abs=1e-6)


def test_audit_reports_the_replace_one_epsilon_of_row_releases(dp_run, capsys):
    """A flipped label moves a row's clipped gradient by up to 2C: the label-flip epsilon is
    the same history at sigma / 2, reported beside the add/remove one (not for DP-SGD)."""
    run_dir, _ = dp_run
    assert cli_main(["audit", str(run_dir), "--json"]) == 0
    rows = {
        (m["role"], m["mechanism"]): m for m in json.loads(capsys.readouterr().out)["mechanisms"]
    }
    flip = rows[("active", "label_dp")]["epsilon_replace_one"]
    assert flip == pytest.approx(opacus_rdp([(1.3 / 2, 1.0)] * 3, DELTA), abs=1e-6)
    assert flip > rows[("active", "label_dp")]["epsilon"]
    assert rows[("alpha", "embedding_dp")]["epsilon_replace_one"] == pytest.approx(
        opacus_rdp([(0.9 / 2, 1.0)] * 3, DELTA), abs=1e-6
    )
    assert rows[("beta", "dp_sgd")]["epsilon_replace_one"] is None
    assert cli_main(["audit", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "flipped label" in text and f"{flip:.4g}" in text


def test_audit_with_prv_and_another_delta_equals_opacus(dp_run, capsys):
    run_dir, _ = dp_run
    assert (
        cli_main(["audit", str(run_dir), "--json", "--accountant", "prv", "--delta", "1e-4"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    row = next(m for m in report["mechanisms"] if m["mechanism"] == "label_dp")
    acc = PRVAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.3, sample_rate=1.0)
    with np.errstate(divide="ignore"):  # PRV at sample rate 1 takes log(1 - q) = log(0)
        expected = acc.get_epsilon(delta=1e-4)
    assert row["accountant"] == "prv" and row["delta"] == 1e-4
    assert row["epsilon"] == pytest.approx(expected, abs=1e-6)


def budget_raw(raw: dict, *, where: str) -> dict:
    raw["train"]["epochs"] = 5
    # sigma 2 at delta 1e-3: 3 steps cost 2.97, a 4th would reach 3.54
    if where == "active":
        raw["privacy"] = {"label_dp": {"noise_multiplier": 2.0, "clip": 1.0}}
        raw["active"]["max_epsilon"] = 3.2
    else:
        raw["parties"]["beta"]["embedding_dp"] = {"noise_multiplier": 2.0, "clip": 1.0}
        raw["parties"]["beta"]["max_epsilon"] = 3.2
    return raw


@pytest.mark.parametrize(
    ("where", "role", "mechanism"),
    [("active", "active", "label_dp"), ("party", "beta", "embedding_dp")],
)
def test_budget_stops_everyone_at_the_last_step_that_fits(small_federation, where, role, mechanism):
    raw, d = small_federation
    cfg = make_config(budget_raw(raw, where=where), d)
    code, metrics = run_federation(cfg, out=d / "run")
    assert code == P.EXIT_BUDGET and metrics is None
    report = audit_run(d / "run")
    row = report.row(role, mechanism)
    assert row.steps == 3 and row.epsilon <= 3.2
    # three epochs fitted and were committed by every role; the fourth never started a release
    for r in ("active", "alpha", "beta", "gamma"):
        assert latest_epoch(d / "run", r) == 2
    log = (d / "run" / "logs" / f"{role}.log").read_text()
    assert f"privacy budget exhausted for role '{role}', mechanism '{mechanism}' at epoch 4" in log
    if role != "active":  # the whole federation learnt why it stopped
        active_log = (d / "run" / "logs" / "active.log").read_text()
        assert "BudgetExceeded" in active_log and "'beta'" in active_log


def test_resume_after_a_budget_stop_with_a_larger_budget_finishes(small_federation):
    raw, d = small_federation
    raw = budget_raw(raw, where="active")
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == P.EXIT_BUDGET
    raw["active"]["max_epsilon"] = 5.0
    code, metrics = run_federation(make_config(raw, d), out=d / "run", resume=True)
    assert code == 0
    row = audit_run(d / "run").row("active", "label_dp")
    # every row counted as used 3 times at the stop, then twice more: 5 steps in all
    assert row.steps == 5 and row.epsilon == pytest.approx(4.052804900168968, abs=1e-9)
    assert len(metrics["history"]) == 5


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"privacy": {"delta": 0.01}}, "[privacy] delta: must be smaller than 1/N"),
        (
            {
                "privacy": {"label_dp": {"noise_multiplier": 0.5, "clip": 1.0}},
                "active": {"max_epsilon": 1.0},
            },
            "[active] max_epsilon: max_epsilon = 1 cannot pay",
        ),
        (
            {
                "parties": {
                    "alpha": {"dp_sgd": {"noise_multiplier": 0.3, "clip": 1.0}, "max_epsilon": 0.1}
                }
            },
            "[parties.alpha] max_epsilon: max_epsilon = 0.1 cannot pay for a single dp_sgd",
        ),
        (
            {"privacy": {"label_dp": {"noise_multiplier": 0.0, "clip": 1.0}}},
            "[privacy] label_dp.noise_multiplier: must be > 0.0",
        ),
        (
            {"parties": {"alpha": {"embedding_dp": {"noise_multiplier": 1.0, "clip": -1}}}},
            "[parties.alpha] embedding_dp.clip: must be > 0.0",
        ),
        ({"privacy": {"accountant": "gdp"}}, "[privacy] accountant: unknown value 'gdp'"),
        (
            {"privacy": {"label_dp": {"target_epsilon": 1e-9, "clip": 1.0}}},
            "[privacy] label_dp.target_epsilon",
        ),
    ],
)
def test_bad_privacy_settings_exit_2_naming_the_key(small_federation, capsys, edit, words):
    raw, d = small_federation
    for section, values in edit.items():
        if section == "parties":
            for name, extra in values.items():
                raw["parties"][name].update(extra)
        else:
            raw.setdefault(section, {}).update(values)
    config = write_toml(raw, d / "config.toml")
    assert cli_main(["run", str(config), "--out", str(d / "run")]) == P.EXIT_USAGE
    assert words in capsys.readouterr().err
    assert not (d / "run").exists()  # refused before anything started


def test_roles_refuse_a_delta_too_large_for_n_too(small_federation):
    """The active party and the parties check again with the exact N (a run built in code
    never went through `securevfl run`)."""
    raw, d = small_federation
    raw["privacy"] = {"delta": 1 / 250}
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == P.EXIT_USAGE
    log = (d / "run" / "logs" / "active.log").read_text()
    assert "[privacy] delta: must be smaller than 1/N" in log


def test_target_epsilon_is_calibrated_for_the_configured_epochs(small_federation):
    raw, d = small_federation
    raw["run"]["aggregation"] = "plain"
    raw["privacy"] = {"label_dp": {"target_epsilon": 2.0, "clip": 1.0}}
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    eps = metrics["privacy"]["epsilon"]["active/label_dp"]
    assert 1.9 <= eps <= 2.0  # calibrated within Opacus's tolerance, never above the target


def attack_run(small_federation, privacy: dict):
    raw, d = small_federation
    raw["run"]["aggregation"] = "plain"
    raw["train"]["epochs"] = 2
    raw["privacy"] = {"record_received": True, **privacy}
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    return audit_run(d / "run", attack=True)


def test_attack_reads_labels_from_received_gradients_without_dp(small_federation):
    report = attack_run(small_federation, {})
    assert set(report.leakage) == {"alpha", "beta", "gamma"}
    m = report.leakage["alpha"]
    assert m.rows == 2 * N_TRAIN
    assert m.direction_auc >= 0.95  # the sign of dL/dS gives the label away
    unprotected = {(u.role, u.what) for u in report.unprotected}
    assert ("active", "gradients returned to the passive parties") in unprotected
    assert ("alpha", "representations sent to sums") in unprotected


def test_label_dp_brings_the_attack_near_chance(small_federation):
    report = attack_run(small_federation, {"label_dp": {"target_epsilon": 1.0, "clip": 0.5}})
    for m in report.leakage.values():
        assert m.direction_auc <= 0.65 and m.norm_auc <= 0.65
    assert report.row("active", "label_dp").epsilon <= 1.0


def test_single_contributor_sums_are_recorded_as_unprotected(small_federation):
    raw, d = small_federation
    raw["run"]["min_group"] = 1
    raw["parties"] = {"alpha": {"columns": ["X1", "X2", "X3", "X4", "X5", "X6"]}}
    raw["train"]["epochs"] = 2
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    releases = audit_run(d / "run").unprotected
    alone = [u for u in releases if u.role == "alpha" and "alone" in u.what]
    assert alone and "min_group = 1" in alone[0].reason
    # once per sum and epoch (the training epochs, then evaluation), not once per batch
    assert sum(u.count for u in alone) <= 3


CREDIT = REPO.parent / "shared" / "data" / "credit_default.csv"


@pytest.mark.slow
@pytest.mark.skipif(not CREDIT.exists(), reason="needs ../shared/data/credit_default.csv")
@pytest.mark.parametrize(("eps", "low", "high"), [(math.inf, 0.75, 1.0), (2.0, 0.0, 0.6)])
def test_credit_label_leakage_without_and_with_label_dp(tmp_path, eps, low, high):
    """On the Credit split (4 parties x 5 columns), an attack reads the labels from the received
    gradients without DP (AUC >= 0.75), and label DP at epsilon 2 brings it to <= 0.6."""
    sys.path.insert(0, str(REPO / "bench"))
    from privacy_utility import credit_config

    raw = credit_config(data=CREDIT, seed=0, epochs=2, eps=eps, clip=0.5, batch_size=256, lr=1e-3)
    cfg = make_config(raw, tmp_path)
    code, _ = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    report = audit_run(tmp_path / "run", attack=True)
    for m in report.leakage.values():
        assert low <= max(m.norm_auc, m.direction_auc) <= high
