"""The baselines of the LASER-VFL paper as methods: what they train on, how they predict, and
which secure modes they can run in."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.config import ConfigError
from securevfl.direct import DirectFederation
from tests.securevfl.test_laser import block_config


def run(tmp_path, method, **kwargs):
    cfg = block_config(tmp_path, method=method, **kwargs)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    return fed, fed.run()


@pytest.mark.parametrize(
    "method", ["local", "ensemble", "standard-vfl", "combinatorial", "plugvfl"]
)
def test_every_baseline_learns_the_synthetic_task(tmp_path, method):
    fed, metrics = run(tmp_path, method, p_train=0.1, epochs=4)
    assert metrics["accuracy"] > 0.62, metrics
    assert len(fed.history) == 4


@pytest.mark.parametrize("method", ["local", "ensemble"])
def test_single_party_methods_are_refused_in_secure_modes(tmp_path, method):
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, method=method, aggregation="mask")
    assert info.value.key == "[run] aggregation" and "min_group = 1" in info.value.reason


def test_local_predicts_with_every_present_party(tmp_path):
    fed, metrics = run(tmp_path, "local", p_train=0.3, p_test=0.3, epochs=2)
    assert set(metrics["f1_per_predictor"]) == set(fed.config.party_names)
    assert metrics["n_fallback"] == 0


def test_standard_vfl_trains_on_complete_rows_and_guesses_otherwise(tmp_path):
    fed, metrics = run(
        tmp_path, "standard-vfl", aggregation="mask", p_train=0.3, p_test=0.3, epochs=2
    )
    forwards = [c for c in fed.calls if c[0] == "forward" and c[2]]
    train_groups = {spec.group for _, _, specs, _ in forwards for spec in specs}
    assert train_groups == {tuple(sorted(fed.config.party_names))}
    complete = fed.presence(fed.test_ids).all(axis=1)
    assert metrics["n_fallback"] == int((~complete).sum()) > 0
    # the gradient dL/dS is the same for every contributor: one backward call to all of them
    backward = [c for c in fed.calls if c[0] == "backward"]
    assert all(len(to) == 4 for _, to, _, _ in backward)


def test_ensemble_is_a_vote_of_the_local_models(tmp_path):
    fed, metrics = run(tmp_path, "ensemble", p_train=0.2, epochs=3)
    local = fed.method.local_classes(fed, fed.test_ids[:50], tuple(fed.config.party_names))[0]
    joint = fed.method.predict_rows(fed, fed.test_ids[:50], tuple(fed.config.party_names))
    votes = np.stack(list(local.values())).sum(axis=0)
    clear = votes != 2  # 4 voters: 2-2 is a tie broken at random
    assert np.array_equal(joint.classes["joint"][clear], (votes[clear] > 2).astype(int))
    assert "f1_per_predictor" not in metrics


def test_combinatorial_uses_the_model_of_the_exact_present_set(tmp_path):
    fed, metrics = run(
        tmp_path, "combinatorial", aggregation="mask", p_train=0.3, p_test=0.5, epochs=1
    )
    assert len(fed.method.heads) == 15
    assert len(fed.party_methods["p0"].models) == 8
    eval_specs = [c[2] for c in fed.calls if c[0] == "forward" and c[2] and len(c[2]) == 1]
    # at test time each pattern's rows use the tensor of exactly that subset
    for (spec,) in eval_specs[-5:]:
        assert spec.tensor == fed.method.tensor_of(spec.group)
    # singletons cannot be summed securely: skipped in training, random at test time
    assert fed.history[0]["skipped_tasks"] > 0
    assert metrics["n_fallback"] > 0


def test_plugvfl_leaves_out_rows_without_its_anchor(tmp_path):
    fed, metrics = run(
        tmp_path, "plugvfl", p_train=0.3, p_test=0.3, epochs=1, options={"p_drop": 0.25}
    )
    has_anchor = fed.presence(fed.test_ids)[:, -1]
    assert metrics["n_excluded"] == int((~has_anchor).sum()) > 0
    assert metrics["n_eval"] == int(has_anchor.sum())
    forwards = [c for c in fed.calls if c[0] == "forward" and c[2]]
    assert all("p3" in spec.group for _, _, specs, _ in forwards for spec in specs)
    assert fed.method.anchor == "p3"


def test_plugvfl_options_are_checked(tmp_path):
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, method="plugvfl", options={"anchor": "nobody"})
    assert info.value.key == "[method] anchor"
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, method="plugvfl", options={"p_drop": 1.0})
    assert info.value.key == "[method] p_drop"
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, method="local", options={"p_drop": 0.1})
    assert info.value.key == "[method] p_drop"
    with pytest.raises(ConfigError) as info:  # dropout lets sums difference to one party
        block_config(tmp_path, method="plugvfl", aggregation="mask", options={"p_drop": 0.1})
    assert info.value.key == "[method] p_drop"
