"""The worked example of docs/adding-a-method.md: ridge regression on secure sums, added as one
file (securevfl/methods/ridge.py) with no edit to roles/ or config, runs end to end over the
in-process transport and fits what the closed form fits."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.config import ConfigError, parse_config
from securevfl.data.table import write_csv
from securevfl.inproc import run_federation
from securevfl.methods import method_names
from tests.securevfl.conftest import permissive_policy

NETWORK = {"heartbeat_interval": 0.2, "peer_timeout": 5.0, "round_timeout": 30.0}


def ridge_config(tmp_path, aggregation="mask", **method):
    rng = np.random.default_rng(4)
    n = 400
    x = rng.normal(size=(n, 4)) * [1.0, 3.0, 0.5, 2.0] + [0.0, 5.0, -1.0, 2.0]
    y = 1.5 + x @ np.array([0.8, -0.3, 1.2, 0.4]) + 0.3 * rng.normal(size=n)
    write_csv(
        tmp_path / "data.csv",
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=["X1", "X2", "X3", "X4"],
        values=x,
        label="Y",
        labels=y,
    )
    raw = {
        "run": {"method": "ridge", "aggregation": aggregation, "seed": 1, "transport": "inproc"},
        "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.25},
        "parties": {"a": {"columns": ["X1", "X2"]}, "b": {"columns": ["X3", "X4"]}},
        "network": NETWORK,
        "method": {"alpha": 0.01, "iterations": 200, **method},
    }
    return parse_config(permissive_policy(raw), source=tmp_path / "config.toml"), x, y


def closed_form_rmse(cfg, x, y, train, test, alpha):
    """The ridge objective's minimiser on the training rows, scored on the test rows."""
    mean, sd = x[train].mean(axis=0), x[train].std(axis=0)
    z = (x - mean) / sd
    n = len(train)
    beta = np.linalg.solve(
        z[train].T @ z[train] / n + alpha * np.eye(4), z[train].T @ (y[train] - y[train].mean()) / n
    )
    pred = y[train].mean() + z[test] @ beta
    return float(np.sqrt(np.mean((pred - y[test]) ** 2)))


def test_ridge_is_found_without_being_listed_anywhere():
    assert "ridge" in method_names()


@pytest.mark.parametrize("aggregation", ["plain", "mask"])
def test_ridge_federation_fits_the_closed_form(tmp_path, aggregation):
    from securevfl.data.table import train_test_split

    cfg, x, y = ridge_config(tmp_path, aggregation)
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    ids = np.arange(1, len(y) + 1)
    train, test = train_test_split(ids, test_fraction=0.25, seed=1)
    expected = closed_form_rmse(cfg, x, y, train - 1, test - 1, alpha=0.01)
    assert metrics["test"]["rmse"] == pytest.approx(expected, rel=1e-3)
    assert metrics["method"] == "ridge" and len(metrics["history"]) == 4  # a checkpoint per 50


def test_ridge_options_are_validated_from_their_declaration(tmp_path):
    with pytest.raises(ConfigError, match=r"\[method\] step"):
        ridge_config(tmp_path, step=0)
    with pytest.raises(ConfigError, match=r"\[method\] alhpa: unknown option"):
        ridge_config(tmp_path, alhpa=1.0)
