"""FALSE-VFL missingness patterns (Sec. 5.1, App. D.3) and the labeled / aligned budget."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from securevfl.config import ConfigError, MissingSpec
from securevfl.data.missing import (
    MAR1_DELTA,
    MAR1_T,
    MAR2_B,
    MAR2_DELTA,
    MAR2_T,
    force_aligned,
    kinds,
    labeled_rows,
    mar1,
    mar2,
    mar_type1,
    mar_type2,
    mcar,
    mnar,
    mnar_sign,
    piece_stats,
    presence,
    visit_order,
)
from securevfl.data.table import load_party_table, split_federation

from .conftest import BASE_RAW, make_config, synthetic_csv

PARTIES = ("a", "b", "c", "d")
FAST = settings(max_examples=150, deadline=None)


# --- direct transcriptions of the paper's pseudo-code (one row; NaN = piece absent) ----------


def ref_mar1(v, order, T=MAR1_T, d=MAR1_DELTA):
    obs = np.zeros(len(v), bool)
    for k in (k for k in order if not math.isnan(v[k])):
        obs[k] = True
        if v[k] > T:
            break
        T -= d
    return obs


def ref_mar2(v, order, T=MAR2_T, B=MAR2_B, d=MAR2_DELTA):
    obs = np.zeros(len(v), bool)
    for k in (k for k in order if not math.isnan(v[k])):
        obs[k] = True
        if v[k] > T:
            B -= v[k] - T
        if B <= 0:
            break
        T -= d
    return obs


def gaussian_features(n, widths=(3, 2, 4, 1), seed=0, shift=0.0, nan_rate=0.0):
    rng = np.random.default_rng(seed)
    out = {}
    for party, w in zip(PARTIES, widths, strict=True):
        x = rng.normal(loc=shift, scale=2.0, size=(n, w)) + rng.normal(size=(n, 1))
        x[rng.random(x.shape) < nan_rate] = np.nan
        out[party] = x
    return out


# variance values on and around the thresholds, so ties and the stop rule are exercised
_near = st.sampled_from([0.0, 0.05, 0.2, 0.35, 0.5, 0.65, 0.8, 0.95, 1.1, 1.25, -0.1])
_value = st.one_of(_near, st.floats(0, 3, allow_nan=False), st.just(math.nan))


@st.composite
def variance_rows(draw):
    k = draw(st.integers(1, 8))
    v = np.array(draw(st.lists(_value, min_size=k, max_size=k)), dtype=float)
    order = np.array(draw(st.permutations(range(k))))
    return v, order


# --- registry and MCAR ------------------------------------------------------------------------


def test_registry_has_the_false_vfl_kinds():
    assert {"mcar", "mar1", "mar2", "mnar"} <= set(kinds())


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5])
def test_mcar_0_2_5_drop_each_block_with_probability_p(p):
    n = 20000
    present = presence(
        MissingSpec(kind="mcar", params=(("p", p),)),
        parties=PARTIES,
        n_rows=n,
        seed=7,
        split="test",
    )
    draws = n * len(PARTIES)
    tol = 5 * math.sqrt(p * (1 - p) / draws) + 1e-12
    assert abs((1 - present.mean()) - p) <= tol
    if p == 0.0:
        assert present.all()  # MCAR 0: fully aligned


def test_mcar_at_least_one_observes_one_random_available_party_in_empty_rows():
    n = 20000
    feats = gaussian_features(n)
    feats["d"][: n // 2] = np.nan  # party d lacks the first half of the rows in the source
    present = mcar(
        parties=PARTIES,
        n_rows=n,
        rng=np.random.default_rng(1),
        p=0.5,
        at_least_one=1.0,
        features=feats,
    )
    assert present.any(axis=1).all()
    assert not present[: n // 2, 3].any()
    # the rescue hits rows where every block was dropped: rate 0.5^4 of the rows with d
    single = present[n // 2 :].sum(axis=1) == 1
    assert single.mean() == pytest.approx(4 * 0.5**4 + 0.5**4, abs=0.015)
    with pytest.raises(ValueError, match="at_least_one"):
        mcar(parties=PARTIES, n_rows=3, rng=np.random.default_rng(0), p=0.5, at_least_one=2.0)


def test_mcar_default_keeps_the_previous_draw():
    old = np.random.default_rng(3).random((50, 4)) >= 0.3
    new = mcar(parties=PARTIES, n_rows=50, rng=np.random.default_rng(3), p=0.3)
    assert np.array_equal(old, new)


# --- MAR against the pseudo-code --------------------------------------------------------------


@FAST
@given(variance_rows(), st.floats(0, 2), st.floats(0, 0.5))
def test_mar1_matches_algorithm_1(row, T, d):
    v, order = row
    got = mar_type1(v[None], order[None], T=T, delta=d)[0]
    assert np.array_equal(got, ref_mar1(v, order, T, d))
    assert np.array_equal(mar_type1(v[None], order[None])[0], ref_mar1(v, order))


@FAST
@given(variance_rows(), st.floats(0, 2), st.floats(0, 2), st.floats(0, 0.5))
def test_mar2_matches_algorithm_2(row, T, B, d):
    v, order = row
    got = mar_type2(v[None], order[None], T=T, B=B, delta=d)[0]
    assert np.array_equal(got, ref_mar2(v, order, T, B, d))
    assert np.array_equal(mar_type2(v[None], order[None])[0], ref_mar2(v, order))


def test_mar_on_many_rows_at_once_matches_row_by_row():
    rng = np.random.default_rng(0)
    v = rng.gamma(2.0, 0.4, size=(500, 8))
    v[rng.random(v.shape) < 0.2] = np.nan
    order = np.argsort(rng.random(v.shape), axis=1)
    m1, m2 = mar_type1(v, order), mar_type2(v, order)
    for i in range(len(v)):
        assert np.array_equal(m1[i], ref_mar1(v[i], order[i]))
        assert np.array_equal(m2[i], ref_mar2(v[i], order[i]))


def test_mar1_hand_built_stops():
    order = np.arange(8)[None]
    # a very informative first piece: stop at once, a fully unaligned row
    assert mar_type1(np.array([[1.2, 0, 0, 0, 0, 0, 0, 0.0]]), order).sum() == 1
    # nothing ever exceeds T (1.1, 0.95, ..., 0.05): every piece observed
    assert mar_type1(np.zeros((1, 8)), order).all()
    # thresholds fall: 0.9 passes at T = 1.1 and 0.95, then stops at T = 0.8 (third piece)
    got = mar_type1(np.full((1, 8), 0.9), order)[0]
    assert got.tolist() == [True] * 3 + [False] * 5
    # the visit order decides which pieces are seen, not the column index
    got = mar_type1(np.array([[0.0, 2.0, 0.0]]), np.array([[2, 1, 0]]))[0]
    assert got.tolist() == [False, True, True]
    # absent pieces are skipped: the stop still lands on the next existing piece
    got = mar_type1(np.array([[0.0, np.nan, 2.0, 0.0]]), np.array([[1, 0, 2, 3]]))[0]
    assert got.tolist() == [True, False, True, False]


def test_mar2_hand_built_budget_and_negative_thresholds():
    order = np.arange(8)[None]
    # v = 0: T = 0.5, 0.35, 0.2, 0.05 costs nothing; then T < 0 and every piece costs -T:
    # 0.1 + 0.25 + 0.4 = 0.75 > B = 0.7, so the 7th piece is the last observed
    got = mar_type2(np.zeros((1, 8)), order)[0]
    assert got.tolist() == [True] * 7 + [False]
    # with five pieces the budget is never spent: all observed
    assert mar_type2(np.zeros((1, 5)), np.arange(5)[None]).all()
    # one piece of variance 1.2 > 0.5 spends exactly B = 0.7: B <= 0, stop
    assert mar_type2(np.array([[1.2, 0, 0, 0.0]]), np.arange(4)[None]).sum() == 1
    # 1.0 spends 0.5 (B = 0.2), then 0.6 at T = 0.35 spends 0.25: stop after two
    got = mar_type2(np.array([[1.0, 0.6, 0, 0.0]]), np.arange(4)[None])[0]
    assert got.tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    ("c", "expected"),
    # MAR 1 stops at the first j with c > 1.1 - 0.15 j (8 pieces): falling thresholds
    [(0.0, 8), (0.04, 8), (0.06, 8), (0.3, 7), (0.5, 6), (0.51, 5), (0.96, 2), (1.11, 1)],
)
def test_mar1_constant_variance_stops_where_the_threshold_falls_below_it(c, expected):
    assert mar_type1(np.full((1, 8), c), np.arange(8)[None]).sum() == expected


@FAST
@given(variance_rows(), st.lists(st.floats(0, 2), min_size=8, max_size=8))
def test_mar_more_variance_never_observes_more(row, extra):
    v, order = row
    more = v + np.array(extra[: len(v)])
    for rule in (mar_type1, mar_type2):
        assert rule(more[None], order[None]).sum() <= rule(v[None], order[None]).sum()


@FAST
@given(variance_rows())
def test_mar_observes_at_least_one_existing_piece_and_never_an_absent_one(row):
    v, order = row
    for rule in (mar_type1, mar_type2):
        got = rule(v[None], order[None])[0]
        assert not (got & np.isnan(v)).any()
        assert got.sum() >= (1 if (~np.isnan(v)).any() else 0)


def test_mar_refuses_a_bad_order():
    with pytest.raises(ValueError, match="permutation"):
        mar_type1(np.zeros((1, 3)), np.array([[0, 0, 1]]))


# --- normalisation and the generators -----------------------------------------------------------


def test_piece_stats_zscores_per_feature_on_the_rows_given_and_ignores_empty_cells():
    x = np.array([[1.0, 10.0], [3.0, np.nan], [np.nan, 30.0], [np.nan, np.nan]])
    means, variances = piece_stats({"a": x, "b": np.full((4, 1), 5.0)}, ("a", "b"), 4)
    # feature 0: mean 2, sd 1 -> -1, 1 ; feature 1: mean 20, sd 10 -> -1, 1
    z = np.array([[-1.0, -1.0], [1.0, np.nan], [np.nan, 1.0]])
    np.testing.assert_allclose(means[:3, 0], np.nanmean(z, axis=1))
    np.testing.assert_allclose(variances[:3, 0], np.nanvar(z, axis=1))
    assert np.isnan(means[3, 0]) and np.isnan(variances[3, 0])  # an all-empty piece
    assert (means[:, 1] == 0).all() and (variances[:, 1] == 0).all()  # constant feature


def test_mar_generators_are_the_rules_on_zscored_pieces_with_a_random_order():
    n = 300
    feats = gaussian_features(n, nan_rate=0.3)
    _, variances = piece_stats(feats, PARTIES, n)
    order = visit_order(~np.isnan(variances), np.random.default_rng(9))
    got1 = mar1(parties=PARTIES, n_rows=n, rng=np.random.default_rng(9), features=feats)
    got2 = mar2(parties=PARTIES, n_rows=n, rng=np.random.default_rng(9), features=feats, B=0.5)
    assert np.array_equal(got1, mar_type1(variances, order))
    assert np.array_equal(got2, mar_type2(variances, order, B=0.5))
    with pytest.raises(ValueError, match="features"):
        mar1(parties=PARTIES, n_rows=n, rng=np.random.default_rng(0))


def test_visit_order_is_uniform_over_available_pieces_and_puts_absent_ones_last():
    available = np.tile([True, False, True, True], (30000, 1))
    order = visit_order(available, np.random.default_rng(2))
    assert set(order[:, 3].tolist()) == {1}
    counts = np.bincount(order[:, 0], minlength=4) / len(order)
    np.testing.assert_allclose(counts, [1 / 3, 0, 1 / 3, 1 / 3], atol=0.015)


@pytest.mark.parametrize("p", [0.7, 0.9])
def test_mnar_drops_negative_mean_pieces_with_p_and_the_others_with_1_minus_p(p):
    n = 20000
    feats = gaussian_features(n, seed=4)
    means, _ = piece_stats(feats, PARTIES, n)
    present = mnar(
        parties=PARTIES,
        n_rows=n,
        rng=np.random.default_rng(5),
        p=p,
        features=feats,
        at_least_one=0.0,
    )
    neg = means < 0
    for mask, rate in ((neg, p), (~neg, 1 - p)):
        tol = 5 * math.sqrt(rate * (1 - rate) / mask.sum())
        assert abs((~present[mask]).mean() - rate) <= tol
    # the default rescues rows the draw left empty with one random party
    rescued = mnar(parties=PARTIES, n_rows=n, rng=np.random.default_rng(5), p=p, features=feats)
    assert rescued.any(axis=1).all()
    changed = (rescued != present).any(axis=1)
    assert np.array_equal(changed, ~present.any(axis=1))
    assert (rescued[changed].sum(axis=1) == 1).all()


def test_mnar_depends_on_the_values_not_only_on_chance():
    feats = gaussian_features(4000, seed=1)
    low = {k: v - 100.0 * (np.arange(4000) < 2000)[:, None] for k, v in feats.items()}
    present = mnar(
        parties=PARTIES,
        n_rows=4000,
        rng=np.random.default_rng(0),
        p=0.9,
        features=low,
        at_least_one=0.0,
    )
    # the shifted half has negative z-scored means: dropped w.p. 0.9 there, 0.1 elsewhere
    assert (~present[:2000]).mean() == pytest.approx(0.9, abs=0.02)
    assert (~present[2000:]).mean() == pytest.approx(0.1, abs=0.02)


def test_mnar_never_observes_absent_pieces_and_refuses_bad_p():
    means = np.array([[-1.0, np.nan, 2.0]] * 200)
    got = mnar_sign(means, np.random.default_rng(0), p=0.7)
    assert not got[:, 1].any()
    with pytest.raises(ValueError, match="p must be"):
        mnar_sign(means, np.random.default_rng(0), p=1.5)


@pytest.mark.parametrize(
    "spec",
    [
        MissingSpec("mcar", (("p", 0.2),)),
        MissingSpec("mar1", (("T", 1.1), ("delta", 0.15))),
        MissingSpec("mar2", (("B", 0.7), ("T", 0.5), ("delta", 0.15))),
        MissingSpec("mnar", (("p", 0.7),)),
    ],
    ids=lambda s: s.kind,
)
def test_every_pattern_is_deterministic_for_a_seed(spec):
    feats = gaussian_features(400, nan_rate=0.1)

    def draw(seed, split="train"):
        return presence(spec, parties=PARTIES, n_rows=400, seed=seed, split=split, features=feats)

    assert np.array_equal(draw(3), draw(3))
    assert not np.array_equal(draw(3), draw(4))
    assert not np.array_equal(draw(3), draw(3, "test"))


# --- config -------------------------------------------------------------------------------------


def config_with_missing(tmp_path, missing):
    raw = copy.deepcopy(BASE_RAW)
    raw["missing"] = missing
    return make_config(raw, tmp_path)


def test_config_applies_the_paper_defaults_and_takes_p(tmp_path):
    cfg = config_with_missing(tmp_path, {"train": {"kind": "mar1"}, "test": {"kind": "mar2"}})
    assert cfg.missing_train == MissingSpec("mar1", (("T", 1.1), ("delta", 0.15)))
    assert cfg.missing_test == MissingSpec("mar2", (("B", 0.7), ("T", 0.5), ("delta", 0.15)))
    cfg = config_with_missing(
        tmp_path, {"train": {"kind": "mnar", "p": 0.7}, "test": {"kind": "mar2", "B": 0.5}}
    )
    assert cfg.missing_train.kind == "mnar" and cfg.missing_train.get("p") == 0.7
    assert cfg.missing_train.get("at_least_one") == 1.0
    assert cfg.missing_test.get("B") == 0.5 and cfg.missing_test.get("T") == 0.5
    cfg = config_with_missing(tmp_path, {"test": {"kind": "mcar", "p": 0}})  # MCAR 0
    assert cfg.missing_test.get("p") == 0.0 and cfg.missing_test.get("at_least_one") == 0.0


@pytest.mark.parametrize(
    "missing",
    [
        {"train": {"kind": "mnar"}},
        {"train": {"kind": "mar1", "budget": 1}},
        {"test": {"kind": "mar2", "T": "high"}},
    ],
)
def test_config_refuses_bad_patterns(tmp_path, missing):
    with pytest.raises(ConfigError) as info:
        config_with_missing(tmp_path, missing)
    assert info.value.key.startswith("[missing]")


@pytest.mark.parametrize("kind", ["mar1", "mar2", "mnar"])
def test_split_federation_applies_the_value_dependent_patterns(tmp_path, kind):
    synthetic_csv(tmp_path / "data.csv", n=400)
    spec = {"kind": kind, "p": 0.9} if kind == "mnar" else {"kind": kind}
    cfg = config_with_missing(tmp_path, {"train": spec, "test": spec})
    paths = split_federation(cfg, tmp_path / "run")
    held = [len(load_party_table(paths[p], cfg, p).ids) for p in cfg.party_names]
    assert 0 < min(held) and max(held) < 400


# --- labeled budget -----------------------------------------------------------------------------


@FAST
@given(st.integers(0, 300), st.data())
def test_labeled_rows_counts_and_aligned_rows_are_labeled(n, data):
    n_labeled = data.draw(st.integers(0, n))
    n_aligned = data.draw(st.integers(0, n_labeled))
    seed = data.draw(st.integers(0, 2**32 - 1))
    labeled, aligned = labeled_rows(
        n, n_labeled=n_labeled, n_aligned=n_aligned, rng=np.random.default_rng(seed)
    )
    assert labeled.shape == aligned.shape == (n,)
    assert labeled.sum() == n_labeled and aligned.sum() == n_aligned
    assert not (aligned & ~labeled).any()
    again = labeled_rows(
        n, n_labeled=n_labeled, n_aligned=n_aligned, rng=np.random.default_rng(seed)
    )
    assert np.array_equal(labeled, again[0]) and np.array_equal(aligned, again[1])


def test_labeled_rows_paper_budget_and_complete_rows():
    complete = np.arange(5000) % 3 == 0
    labeled, aligned = labeled_rows(
        5000, n_labeled=500, n_aligned=100, rng=np.random.default_rng(0), complete=complete
    )
    assert labeled.sum() == 500 and aligned.sum() == 100 and complete[aligned].all()
    assert not complete[labeled & ~aligned].all()  # the others are drawn from every row


def test_labeled_rows_are_uniform():
    hits = np.zeros(20)
    for seed in range(2000):
        labeled, aligned = labeled_rows(
            20, n_labeled=5, n_aligned=2, rng=np.random.default_rng(seed)
        )
        hits += aligned
    np.testing.assert_allclose(hits / 2000, 0.1, atol=0.03)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_labeled": 11, "n_aligned": 1}, "exceeds the 10"),
        ({"n_labeled": 3, "n_aligned": 4}, "exceeds n_labeled"),
        ({"n_labeled": -1, "n_aligned": 0}, ">= 0"),
        ({"n_labeled": 5, "n_aligned": 3, "complete": np.arange(10) < 2}, "complete rows"),
        ({"n_labeled": 5, "n_aligned": 3, "complete": np.ones(4, bool)}, "shape"),
    ],
)
def test_labeled_rows_refuses_impossible_budgets(kwargs, match):
    with pytest.raises(ValueError, match=match):
        labeled_rows(10, rng=np.random.default_rng(0), **kwargs)


def test_force_aligned_fills_aligned_rows_only():
    present = np.random.default_rng(0).random((50, 4)) < 0.5
    aligned = np.arange(50) < 10
    out = force_aligned(present, aligned)
    assert out[:10].all() and np.array_equal(out[10:], present[10:])
    assert not present[:10].all()  # the input is not modified
    with pytest.raises(ValueError, match="do not match"):
        force_aligned(present, aligned[:5])
