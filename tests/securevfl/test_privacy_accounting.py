"""Accounting: audit epsilon equals Opacus's accountants, calibration, delta, budgets."""

from __future__ import annotations

import math
import warnings

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from securevfl.privacy.accounting import (
    AccountingWarning,
    calibrate_noise,
    default_delta,
    epsilon,
    epsilon_by_role,
)
from securevfl.privacy.audit import audit, format_report
from securevfl.privacy.budget import BudgetExceeded, PrivacyBudget
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.privacy.mechanisms import DPSGD, EmbeddingDP, LabelGradientDP

N, BATCH, EPOCHS, DELTA = 2000, 200, 4, 1e-4


def opacus_epsilon(accountant_cls, steps: list[tuple[float, float]], delta: float) -> float:
    """An independent computation: an Opacus accountant stepped once per recorded step."""
    acc = accountant_cls()
    for sigma, q in steps:
        acc.step(noise_multiplier=sigma, sample_rate=q)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return acc.get_epsilon(delta=delta)


@pytest.fixture
def vfl_ledger(tmp_path):
    """A ledger as a run writes it: label DP once per epoch (each row released once per epoch,
    no amplification), embedding DP at alice, DP-SGD on bob's encoder once per batch (q=B/N)."""
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    label = LabelGradientDP(noise_multiplier=1.3, clip=1.0)
    emb = EmbeddingDP(noise_multiplier=2.0, clip=0.5)
    sgd = DPSGD(noise_multiplier=0.9, clip=1.0)
    for epoch in range(EPOCHS):
        for _ in range(N // BATCH):
            ledger.record_release(sgd, role="bob", delta=DELTA, sample_rate=BATCH / N, epoch=epoch)
        ledger.record_release(label, role="active", delta=DELTA, epoch=epoch)
        ledger.record_release(emb, role="alice", delta=DELTA, epoch=epoch)
    ledger.record_release(sgd, role="alice", delta=DELTA, sample_rate=BATCH / N, epoch=0)
    return ledger


@pytest.mark.parametrize(("accountant", "cls"), [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_audit_epsilon_equals_opacus_accountant(vfl_ledger, accountant, cls):
    report = audit(vfl_ledger.path, accountant=accountant)
    expected = {
        ("active", "label_dp"): [(1.3, 1.0)] * EPOCHS,
        ("alice", "embedding_dp"): [(2.0, 1.0)] * EPOCHS,
        ("bob", "dp_sgd"): [(0.9, BATCH / N)] * (EPOCHS * N // BATCH),
        ("alice", "dp_sgd"): [(0.9, BATCH / N)],
    }
    for (role, mechanism), steps in expected.items():
        row = report.row(role, mechanism)
        assert row.epsilon == pytest.approx(opacus_epsilon(cls, steps, DELTA), abs=1e-6)
        assert row.steps == len(steps) and row.delta == DELTA and row.accountant == accountant
    assert not report.row("active", "label_dp").amplified
    assert report.row("bob", "dp_sgd").amplified
    assert report.row("bob", "dp_sgd").sample_rates == (BATCH / N,)
    # alice used two mechanisms: her total composes both histories
    both = [(2.0, 1.0)] * EPOCHS + [(0.9, BATCH / N)]
    assert report.role_totals["alice"][0] == pytest.approx(
        opacus_epsilon(cls, both, DELTA), abs=1e-6
    )
    by_role = epsilon_by_role(vfl_ledger.events, accountant=accountant)
    assert by_role[("active", "label_dp")] == pytest.approx(
        report.row("active", "label_dp").epsilon, abs=1e-12
    )
    text = format_report(report)
    for role in ("active", "alice", "bob"):
        assert role in text
    assert "no formal guarantee: none recorded" in text


def test_audit_at_an_explicit_delta(vfl_ledger):
    report = audit(vfl_ledger.path, delta=1e-6)
    row = report.row("active", "label_dp")
    assert row.delta == 1e-6
    assert row.epsilon == pytest.approx(
        opacus_epsilon(RDPAccountant, [(1.3, 1.0)] * EPOCHS, 1e-6), abs=1e-6
    )


def test_epsilon_of_nothing_is_zero_and_bad_histories_are_refused():
    assert epsilon(history=[], delta=1e-5) == 0.0
    assert epsilon(history=[(1.0, 1.0, 0)], delta=1e-5) == 0.0
    with pytest.raises(ValueError, match="sample_rate"):
        epsilon(history=[(1.0, 1.5, 3)], delta=1e-5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        epsilon(history=[(0.0, 1.0, 3)], delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        epsilon(history=[(1.0, 1.0, 3)], delta=0.0)
    with pytest.raises(ValueError, match="accountant"):
        epsilon(history=[(1.0, 1.0, 3)], delta=1e-5, accountant="gdp")


def test_prv_at_sample_rate_one_leaks_no_numpy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eps = epsilon(history=[(1.0, 1.0, 10)], delta=1e-5, accountant="prv")
    assert 0 < eps < epsilon(history=[(1.0, 1.0, 10)], delta=1e-5)


def test_prv_falls_back_to_rdp_with_a_warning_where_it_cannot_work():
    history = [(0.02, 1.0, 1)]  # epsilon in the thousands: PRV's domain blows up
    with pytest.warns(AccountingWarning, match="RDP"):
        eps = epsilon(history=history, delta=1e-5, accountant="prv")
    assert eps == epsilon(history=history, delta=1e-5)


@pytest.mark.parametrize(
    ("target", "q", "steps", "accountant"),
    [(8.0, 1.0, 10, "rdp"), (1.0, 0.01, 300, "rdp"), (3.0, 1.0, 5, "prv")],
)
def test_calibrated_sigma_reaches_the_target_from_below(target, q, steps, accountant):
    sigma = calibrate_noise(
        target_epsilon=target, delta=1e-5, sample_rate=q, steps=steps, accountant=accountant
    )
    eps = epsilon(history=[(sigma, q, steps)], delta=1e-5, accountant=accountant)
    assert target - 0.05 <= eps <= target


def test_calibrate_refuses_an_unreachable_target():
    with pytest.raises(ValueError, match="cannot reach"):
        calibrate_noise(target_epsilon=1e-9, delta=1e-5, sample_rate=1.0, steps=10)
    with pytest.raises(ValueError, match="target_epsilon"):
        calibrate_noise(target_epsilon=0.0, delta=1e-5, sample_rate=1.0, steps=10)


def test_default_delta_is_a_power_of_ten_strictly_below_one_over_n():
    assert default_delta(24000) == 1e-5
    assert default_delta(500) == 1e-3
    assert default_delta(1000) == 1e-4
    for n in [1, 2, 9, 10, 11, 99, 100, 101, 12345, 10**6, 10**6 + 1]:
        d = default_delta(n)
        assert d < 1 / n <= 10 * d * (1 + 1e-12)
        assert math.log10(d) == round(math.log10(d))
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="n_train"):
            default_delta(bad)


def test_check_next_raises_before_the_step_that_would_exceed():
    budget = PrivacyBudget(role="active", mechanism="label_dp", max_epsilon=10.0, delta=1e-5)
    history: list[tuple[float, float, int]] = []
    released = 0
    with pytest.raises(BudgetExceeded) as info:
        for epoch in range(1000):
            budget.check_next(history_so_far=history, next_step=(1.0, 1.0, 1), epoch=epoch)
            history = [(1.0, 1.0, epoch + 1)]
            released += 1
    assert epsilon(history=history, delta=1e-5) <= 10.0
    assert epsilon(history=[(1.0, 1.0, released + 1)], delta=1e-5) > 10.0
    err = info.value
    assert (err.role, err.mechanism, err.max_epsilon, err.epoch) == (
        "active",
        "label_dp",
        10.0,
        released,
    )
    assert err.epsilon > 10.0
    for part in ("'active'", "'label_dp'", "max_epsilon 10", f"epoch {released}"):
        assert part in str(err)


def test_check_next_from_a_ledger(tmp_path):
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    label = LabelGradientDP(noise_multiplier=1.0, clip=1.0)
    budget = PrivacyBudget(role="active", mechanism="label_dp", max_epsilon=12.0, delta=1e-5)
    epochs = 0
    with pytest.raises(BudgetExceeded):
        while True:
            budget.check_next_from_ledger(ledger, next_step=(1.0, 1.0, 1), epoch=epochs)
            ledger.record_release(label, role="active", delta=1e-5, epoch=epochs)
            epochs += 1
    assert epochs == budget.steps_that_fit(noise_multiplier=1.0, sample_rate=1.0)
    assert audit(ledger.path).row("active", "label_dp").epsilon <= 12.0


@pytest.mark.parametrize(
    ("sigma", "q", "max_eps", "history"),
    [(1.0, 1.0, 10.0, []), (2.0, 1.0, 4.0, [(1.0, 1.0, 2)]), (1.0, 0.1, 2.6, [])],
)
def test_steps_that_fit_matches_brute_force(sigma, q, max_eps, history):
    budget = PrivacyBudget(role="r", mechanism="dp_sgd", max_epsilon=max_eps, delta=1e-5)
    k = 0
    while epsilon(history=history + [(sigma, q, k + 1)], delta=1e-5) <= max_eps:
        k += 1
    assert budget.steps_that_fit(noise_multiplier=sigma, sample_rate=q, history_so_far=history) == k
    assert (
        budget.steps_that_fit(
            noise_multiplier=sigma, sample_rate=q, history_so_far=history, max_steps=k // 2
        )
        == k // 2
    )


def test_a_budget_that_cannot_pay_for_one_step_is_detectable():
    budget = PrivacyBudget(role="active", mechanism="label_dp", max_epsilon=0.5, delta=1e-5)
    assert not budget.allows_one_step(noise_multiplier=1.0)
    assert budget.steps_that_fit(noise_multiplier=1.0, sample_rate=1.0) == 0
    assert budget.allows_one_step(noise_multiplier=20.0)


def test_budget_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_epsilon"):
        PrivacyBudget(role="a", mechanism="label_dp", max_epsilon=0.0, delta=1e-5)
    with pytest.raises(ValueError, match="mechanism"):
        PrivacyBudget(role="a", mechanism="nope", max_epsilon=1.0, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        PrivacyBudget(role="a", mechanism="label_dp", max_epsilon=1.0, delta=2.0)
