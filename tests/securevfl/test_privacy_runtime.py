"""The run-time glue: plans resolved from the config, per-row use counts, budget checks before
the ledger event, DP-SGD steps charged, received gradients kept without pickle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from securevfl.config import ConfigError
from securevfl.privacy.accounting import calibrate_noise, epsilon
from securevfl.privacy.budget import BudgetExceeded
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger
from securevfl.privacy.runtime import (
    PrivateTraining,
    ReceivedGradients,
    RolePrivacy,
    plan_role,
    resolve_delta,
)
from tests.securevfl.conftest import make_config


def config(small_federation, **privacy):
    raw, d = small_federation
    for key, value in privacy.items():
        section, _, name = key.partition("__")
        if section == "parties":
            party, _, field = name.partition("__")
            raw["parties"][party][field] = value
        else:
            raw.setdefault(section, {})[name] = value
    return make_config(raw, d)


def role_privacy(tmp_path, cfg, role="active", n_train=1000) -> RolePrivacy:
    privacy = RolePrivacy(
        plan=plan_role(cfg, role=role, n_train=n_train),
        ledger=PrivacyLedger(tmp_path / LEDGER_FILENAME),
    )
    privacy.set_rows(np.arange(n_train))
    return privacy


def test_delta_defaults_to_a_power_of_ten_below_one_over_n(small_federation):
    cfg = config(small_federation)
    assert resolve_delta(cfg, n_train=24000) == 1e-5
    cfg = config(small_federation, privacy__delta=1e-3)
    with pytest.raises(ConfigError, match=r"\[privacy\] delta: must be smaller than 1/N"):
        resolve_delta(cfg, n_train=1000)


def test_target_epsilon_is_calibrated_per_mechanism_for_the_whole_schedule(small_federation):
    cfg = config(
        small_federation,
        privacy__label_dp={"target_epsilon": 2.0, "clip": 1.0},
        parties__alpha__dp_sgd={"target_epsilon": 3.0, "clip": 1.0},
    )
    active = plan_role(cfg, role="active", n_train=1000)
    assert active.label_dp.noise_multiplier == calibrate_noise(
        target_epsilon=2.0, delta=1e-4, sample_rate=1.0, steps=cfg.epochs
    )
    alpha = plan_role(cfg, role="alpha", n_train=1000)
    q = cfg.batch_size / 1000
    assert alpha.dp_sgd_sample_rate == q
    assert alpha.dp_sgd.noise_multiplier == calibrate_noise(
        target_epsilon=3.0, delta=1e-4, sample_rate=q, steps=cfg.epochs * math.ceil(1000 / 64)
    )
    assert dict(alpha.calibrated) == {"dp_sgd": alpha.dp_sgd.noise_multiplier}


def test_label_release_charges_once_per_rise_of_the_most_used_row(tmp_path, small_federation):
    cfg = config(small_federation, privacy__label_dp={"noise_multiplier": 1.0, "clip": 1.0})
    privacy = role_privacy(tmp_path, cfg, n_train=10)
    grads = {"a": np.ones((5, 2), dtype=np.float32), "b": np.ones((5, 1), dtype=np.float32)}
    out = privacy.release_gradients(grads, ids=np.arange(5), epoch=0)
    assert set(out) == {"a", "b"} and out["a"].dtype == np.float32
    assert not np.allclose(out["a"], grads["a"])  # noised
    privacy.release_gradients(grads, ids=np.arange(5, 10), epoch=0)  # other rows: no new step
    privacy.release_gradients(grads, ids=np.arange(3, 8), epoch=1)  # second use of 3..7
    events = [e for e in privacy.ledger.events if isinstance(e, LedgerEvent)]
    assert [(e.steps, e.epoch) for e in events] == [(1, 0), (1, 1)]


def test_release_without_ids_counts_n_rows_per_epoch_as_one_use(tmp_path, small_federation):
    cfg = config(small_federation, privacy__label_dp={"noise_multiplier": 1.0, "clip": 1.0})
    privacy = role_privacy(tmp_path, cfg, n_train=10)
    g = {"g": np.ones((4, 2), dtype=np.float32)}
    for epoch in (0, 0, 0, 1):  # 12 rows in epoch 0 are more than N = 10: two uses
        privacy.release_gradients(g, ids=None, epoch=epoch)
    assert privacy.steps_spent("label_dp") == 3


def test_budget_is_checked_before_the_event_is_written(tmp_path, small_federation):
    cfg = config(
        small_federation,
        privacy__label_dp={"noise_multiplier": 2.0, "clip": 1.0},
        active__max_epsilon=3.2,
    )
    privacy = role_privacy(tmp_path, cfg, n_train=100)
    g = {"g": np.ones((100, 2), dtype=np.float32)}
    for epoch in range(3):
        privacy.release_gradients(g, ids=np.arange(100), epoch=epoch)
    with pytest.raises(BudgetExceeded, match="'label_dp' at epoch 4") as caught:
        privacy.release_gradients(g, ids=np.arange(100), epoch=3)
    assert caught.value.epsilon > 3.2
    history = PrivacyLedger.read(tmp_path / LEDGER_FILENAME)
    assert sum(e.steps for e in history) == 3
    assert epsilon(history=[(2.0, 1.0, 3)], delta=1e-2) <= 3.2


def test_a_budget_too_small_for_one_step_is_a_config_error(small_federation):
    cfg = config(
        small_federation,
        parties__beta__embedding_dp={"noise_multiplier": 0.5, "clip": 1.0},
        parties__beta__max_epsilon=1.0,
    )
    with pytest.raises(
        ConfigError,
        match=r"\[parties\.beta\] max_epsilon: .* single "
        r"embedding_dp step",
    ):
        plan_role(cfg, role="beta", n_train=1000)
    plan_role(cfg, role="alpha", n_train=1000)  # another party's budget is not alpha's


def test_dp_sgd_step_charges_one_amplified_event_then_steps(tmp_path, small_federation):
    cfg = config(small_federation, parties__alpha__dp_sgd={"noise_multiplier": 1.0, "clip": 1.0})
    privacy = role_privacy(tmp_path, cfg, role="alpha", n_train=640)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    training = PrivateTraining(
        model, torch.optim.SGD(model.parameters(), lr=0.1), privacy=privacy, expected_batch_size=64
    )
    assert training.private and training.module is model
    before = model.weight.detach().clone()
    out = training.model(torch.randn(64, 3))
    out.backward(torch.randn(64, 2) / 64)
    training.step(epoch=0)
    assert not torch.equal(before, model.weight)
    (event,) = privacy.ledger.events
    assert event.mechanism == "dp_sgd" and event.sample_rate == 0.1 and event.amplified


def test_plain_training_passes_through(tmp_path, small_federation):
    cfg = config(small_federation)
    privacy = role_privacy(tmp_path, cfg, role="alpha")
    model = nn.Linear(3, 2)
    training = PrivateTraining(
        model, torch.optim.SGD(model.parameters(), lr=0.1), privacy=privacy, expected_batch_size=64
    )
    assert not training.private and training.model is model
    training.model(torch.randn(4, 3)).sum().backward()
    training.step(epoch=0)
    assert privacy.ledger.events == []


def test_received_gradients_round_trip_without_pickle_and_survive_resume(tmp_path):
    path = tmp_path / "received" / "alpha.npz"
    rec = ReceivedGradients(path)
    rec.add({"grad": np.ones((3, 2)), "count": np.array([3])}, ids=np.array([4, 5, 6]), epoch=0)
    rec.save()
    again = ReceivedGradients(path)  # a resumed run appends to what was kept
    again.add({"grad": np.zeros((2, 2))}, ids=np.array([1, 2]), epoch=1)
    again.save()
    block = ReceivedGradients.load(path)["grad"]
    assert block["ids"].tolist() == [4, 5, 6, 1, 2]
    assert block["epoch"].tolist() == [0, 0, 0, 1, 1]
    assert block["batch"].tolist() == [3, 3, 3, 2, 2]
    assert block["grads"].shape == (5, 2)
    with np.load(path, allow_pickle=False) as data:  # loads without pickle
        assert "names" in data
