"""Label inference from received gradients: the attacks work where they should, not on noise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from securevfl.privacy.attacks import (
    attack_auc,
    best_of_both_auc,
    direction_scores,
    measure_label_leakage,
    norm_scores,
    reference_direction,
)
from securevfl.privacy.audit import audit, format_report
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.privacy.mechanisms import LabelGradientDP, NoiseSource


def split_nn_gradients(n: int = 4000, width: int = 8, positive_rate: float = 0.1, seed: int = 0):
    """dL/dS for a sigmoid head with rare positives: row i is (p_i - y_i) * J_i, where the
    model predicts low p for most rows, so positives get the large, opposite gradients."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < positive_rate).astype(int)
    p = 1 / (1 + np.exp(-rng.normal(-2.0, 1.0, size=n)))
    w = rng.normal(size=width)
    jac = w + 0.3 * rng.normal(size=(n, width))  # a head whose Jacobian varies a little per row
    grads = (p - y)[:, None] * jac / n
    return grads, y


def test_norm_attack_recovers_rare_positives():
    grads, y = split_nn_gradients()
    assert attack_auc(norm_scores(grads), y) > 0.9


def test_direction_attack_recovers_labels_without_knowing_any():
    grads, y = split_nn_gradients()
    scores = direction_scores(grads)
    assert attack_auc(scores, y) > 0.9
    # the minority side of the principal direction is called positive
    assert np.mean(scores > 0) < 0.5
    assert np.mean(scores[y == 1] > 0) > 0.9


def test_direction_attack_with_a_known_positive_reference():
    grads, y = split_nn_gradients()
    ref = grads[np.flatnonzero(y == 1)[0]]
    assert attack_auc(direction_scores(grads, reference=ref), y) > 0.9
    with pytest.raises(ValueError, match="entries"):
        direction_scores(grads, reference=ref[:3])


def test_attacks_are_chance_on_pure_noise():
    rng = np.random.default_rng(1)
    grads = rng.normal(size=(6000, 8))
    y = (rng.random(6000) < 0.3).astype(int)
    assert attack_auc(norm_scores(grads), y) == pytest.approx(0.5, abs=0.04)
    assert attack_auc(direction_scores(grads), y) == pytest.approx(0.5, abs=0.04)


def test_label_dp_drives_measured_leakage_towards_chance():
    grads, y = split_nn_gradients()
    clean = measure_label_leakage(grads=grads, labels=y)
    mech = LabelGradientDP(
        noise_multiplier=8.0,
        clip=float(np.median(norm_scores(grads))),
        generator=NoiseSource(seed=0),
    )
    noised = mech.apply(torch.from_numpy(grads)).numpy()
    private = measure_label_leakage(grads=noised, labels=y)
    assert clean.norm_auc > 0.9 and clean.direction_auc > 0.9
    assert abs(private.norm_auc - 0.5) < 0.06 and abs(private.direction_auc - 0.5) < 0.1
    assert private.rows == 4000 and private.positive_rate == pytest.approx(y.mean())


def test_attack_auc_reports_the_stated_rule_and_best_of_both_is_separate():
    grads, y = split_nn_gradients()
    s = norm_scores(grads)
    assert attack_auc(-s, y) == pytest.approx(1 - attack_auc(s, y))
    assert attack_auc(-s, y) < 0.1
    assert best_of_both_auc(-s, y) == pytest.approx(attack_auc(s, y))


def test_attack_inputs_are_validated():
    with pytest.raises(ValueError, match="single class"):
        attack_auc(np.arange(4.0), np.zeros(4))
    with pytest.raises(ValueError, match="labels"):
        attack_auc(np.arange(4.0), np.array([0, 1, 1]))
    with pytest.raises(ValueError, match="binary"):
        attack_auc(np.arange(4.0), np.array([0, 1, 2, 1]))
    with pytest.raises(ValueError, match="NaN"):
        norm_scores(np.array([[np.nan, 1.0]]))
    with pytest.raises(ValueError, match="zero"):
        reference_direction(np.zeros((5, 3)))
    assert norm_scores(torch.ones(3, 4)).tolist() == [2.0, 2.0, 2.0]


def test_measured_leakage_stands_next_to_epsilon_in_the_audit(tmp_path):
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    label = LabelGradientDP(noise_multiplier=1.0, clip=1.0)
    ledger.record_release(label, role="active", delta=1e-5, epoch=0)
    grads, y = split_nn_gradients(n=500)
    leak = measure_label_leakage(grads=grads, labels=y)
    report = audit(ledger.path, leakage={"alice": leak})
    assert report.to_json()["leakage"]["alice"]["norm_auc"] == leak.norm_auc
    assert "Measured label inference" in format_report(report)
