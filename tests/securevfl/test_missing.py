"""Missingness generators and how the per-party split applies them."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.config import ConfigError, MissingSpec, parse_config
from securevfl.data.missing import kinds, presence
from securevfl.data.table import (
    load_active_table,
    load_party_table,
    split_federation,
    train_test_split,
    write_csv,
)
from tests.securevfl.conftest import permissive_policy

PARTIES = ("a", "b", "c", "d")


def mcar(p: float) -> MissingSpec:
    return MissingSpec(kind="mcar", params=(("p", p),))


def test_registry_has_mcar_and_beta():
    assert {"mcar", "beta"} <= set(kinds())


def test_none_keeps_every_block():
    present = presence(MissingSpec(), parties=PARTIES, n_rows=50, seed=0, split="train")
    assert present.shape == (50, 4) and present.all()


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
def test_mcar_drops_each_block_independently_with_probability_p(p):
    present = presence(mcar(p), parties=PARTIES, n_rows=40000, seed=1, split="train")
    assert present.dtype == bool and present.shape == (40000, 4)
    np.testing.assert_allclose(1 - present.mean(axis=0), p, atol=0.01)
    # independence across blocks: P(both missing) = p^2
    both = (~present[:, 0] & ~present[:, 1]).mean()
    assert both == pytest.approx(p * p, abs=0.01)


def test_train_and_test_draws_differ_and_are_reproducible():
    a = presence(mcar(0.5), parties=PARTIES, n_rows=1000, seed=3, split="train")
    b = presence(mcar(0.5), parties=PARTIES, n_rows=1000, seed=3, split="test")
    again = presence(mcar(0.5), parties=PARTIES, n_rows=1000, seed=3, split="train")
    other_seed = presence(mcar(0.5), parties=PARTIES, n_rows=1000, seed=4, split="train")
    assert np.array_equal(a, again)
    assert not np.array_equal(a, b) and not np.array_equal(a, other_seed)


def test_beta_rates_differ_per_block_and_average_one_half():
    spec = MissingSpec(kind="beta", params=(("a", 2.0), ("b", 2.0)))
    rates = []
    for seed in range(200):
        present = presence(spec, parties=PARTIES, n_rows=2000, seed=seed, split="train")
        rates.append(1 - present.mean(axis=0))
    rates = np.array(rates)
    # Beta(2, 2): mean 1/2, variance 1/20 (plus the binomial noise of 2000 rows)
    assert rates.mean() == pytest.approx(0.5, abs=0.03)
    assert rates.var() == pytest.approx(0.05, abs=0.012)
    assert np.ptp(rates[0]) > 0.05  # blocks of one draw have different rates
    test_rates = 1 - presence(spec, parties=PARTIES, n_rows=2000, seed=0, split="test").mean(0)
    assert not np.allclose(test_rates, rates[0], atol=0.02)  # drawn independently for test


def _raw(tmp_path, missing):
    ids = np.arange(1, 2001)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 4))
    y = (x.sum(axis=1) > 0).astype(float)
    write_csv(
        tmp_path / "data.csv",
        id_column="ID",
        ids=ids,
        columns=["X1", "X2", "X3", "X4"],
        values=x,
        label="Y",
        labels=y,
    )
    raw = {
        "run": {"method": "laser", "aggregation": "plain", "seed": 0},
        "data": {"path": "data.csv", "test_fraction": 0.25},
        "active": {"columns": []},
        "parties": {p: {"columns": [f"X{i + 1}"]} for i, p in enumerate(PARTIES)},
        "missing": missing,
    }
    return parse_config(permissive_policy(raw), source=tmp_path / "config.toml")


def test_split_federation_applies_train_and_test_rates_separately(tmp_path):
    cfg = _raw(tmp_path, {"train": {"kind": "mcar", "p": 0.5}, "test": {"kind": "mcar", "p": 0.1}})
    paths = split_federation(cfg, tmp_path / "run")
    active = load_active_table(paths["active"], cfg)
    assert len(active) == 2000  # the active party keeps every row (and so the split)
    train, test = train_test_split(
        active.ids, test_fraction=0.25, seed=0, labels=active.labels, stratify=True
    )
    tables = {p: load_party_table(paths[p], cfg, p) for p in PARTIES}
    held_train = np.stack([tables[p].has(train) for p in PARTIES], axis=1)
    held_test = np.stack([tables[p].has(test) for p in PARTIES], axis=1)
    # rows missing at every party are in nobody's file
    assert held_train.any(axis=1).mean() == pytest.approx(1 - 0.5**4, abs=0.02)
    kept = held_train[held_train.any(axis=1)]
    # among kept rows P(present) = 0.5 / (1 - 0.5^4)
    assert kept.mean() == pytest.approx(0.5 / (1 - 0.5**4), abs=0.03)
    assert 1 - held_test.mean() == pytest.approx(0.1, abs=0.02)
    # a party's file holds only its own columns and no label
    header = paths["a"].read_text().splitlines()[0]
    assert header == "ID,X1"


def test_missing_blocks_are_the_generators_draw(tmp_path):
    cfg = _raw(tmp_path, {"test": {"kind": "mcar", "p": 0.5}})
    paths = split_federation(cfg, tmp_path / "run")
    active = load_active_table(paths["active"], cfg)
    _, test = train_test_split(
        active.ids, test_fraction=0.25, seed=0, labels=active.labels, stratify=True
    )
    tables = {p: load_party_table(paths[p], cfg, p) for p in PARTIES}
    held = np.stack([tables[p].has(test) for p in PARTIES], axis=1)
    drawn = presence(mcar(0.5), parties=PARTIES, n_rows=len(test), seed=0, split="test")
    keep = drawn.any(axis=1)
    assert np.array_equal(held[keep], drawn[keep]) and not held[~keep].any()


@pytest.mark.parametrize(
    ("missing", "key"),
    [
        ({"train": {"kind": "mcar", "p": 1.0}}, "[missing] train.p"),
        ({"test": {"kind": "mcar"}}, "[missing] test"),
        ({"train": {"kind": "nmar", "p": 0.1}}, "[missing] train"),
    ],
)
def test_bad_missingness_is_refused_naming_the_key(tmp_path, missing, key):
    with pytest.raises(ConfigError) as info:
        _raw(tmp_path, missing)
    assert info.value.key.startswith(key)


def test_a_labeled_budget_keeps_labels_of_that_many_training_rows_and_aligns_some(tmp_path):
    """[missing] labeled / aligned: only `labeled` training rows keep their label, `aligned` of
    them are held by every party whatever the training mechanism drops; test rows keep theirs,
    and a method that does not use unlabeled rows trains on the labeled ones only."""
    from securevfl.data.table import load_active_table, load_party_table
    from securevfl.direct import DirectFederation

    cfg = _raw(
        tmp_path,
        {"train": {"kind": "mcar", "p": 0.5}, "labeled": 120, "aligned": 40},
    )
    paths = split_federation(cfg, tmp_path / "run")
    active = load_active_table(paths["active"], cfg)
    train, test = train_test_split(active.ids, test_fraction=0.25, seed=0)
    assert active.labeled(test).all()
    assert int(active.labeled(train).sum()) == 120
    held = np.stack([load_party_table(paths[p], cfg, p).has(train) for p in PARTIES], axis=1)
    full = held.all(axis=1)
    # at least the 40 aligned rows are complete, among the labeled ones (0.5^4 = 6% by chance)
    assert int((full & active.labeled(train)).sum()) >= 40
    assert full[~active.labeled(train)].mean() < 0.15
    fed = DirectFederation(cfg, run_dir=tmp_path / "fed")
    assert len(fed.train_ids) > 120  # the parties learn every training row
    from securevfl.roles.active_round import train_and_evaluate

    used, _, _ = train_and_evaluate(fed, train_ids=fed.train_ids, test_ids=fed.test_ids[:50])
    assert len(used) <= 120 and active.labeled(used).all()
