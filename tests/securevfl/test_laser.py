"""LASER-VFL: task sampling (Lemma 1), prediction for any subset, per-subset secure sums,
skipped subsets in secure modes, and training on with a lost party.

`DirectFederation` runs a method's party and active stages in this thread with the real
secure-sum stages (no transport), so the method can be tested alone; the end-to-end run over the
real protocol is at the bottom."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from securevfl.config import ConfigError, parse_config
from securevfl.data.table import (
    write_csv,
)
from securevfl.direct import DirectFederation
from securevfl.methods import method_spec
from securevfl.methods.blocks.batches import pattern_batches, pattern_codes
from securevfl.methods.blocks.options import lr_at
from securevfl.methods.blocks.party import BlockParty
from securevfl.methods.laser import (
    LaserActive,
    draw_family,
    exact_tasks,
    laser_objective,
    sample_tasks,
    task_weights,
)
from tests.securevfl.conftest import permissive_policy

# --------------------------------------------------------------------------------------------
# kit


# short timeouts for federations run as threads over inproc ZeroMQ
INPROC_NETWORK = {
    "heartbeat_interval": 0.2,
    "peer_timeout": 5.0,
    "round_timeout": 30.0,
    "startup_timeout": 30.0,
}


def block_csv(
    path: Path, *, n: int = 600, blocks: int = 4, cols: int = 2, seed: int = 0
) -> list[list[str]]:
    """A binary task where every block carries part of the signal."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, blocks * cols))
    w = rng.normal(size=blocks * cols)
    y = (x @ w + 0.5 * rng.normal(size=n) > 0).astype(float)
    names = [f"X{i + 1}" for i in range(blocks * cols)]
    write_csv(
        path, id_column="ID", ids=np.arange(1, n + 1), columns=names, values=x, label="Y", labels=y
    )
    return [names[b * cols : (b + 1) * cols] for b in range(blocks)]


def block_config(
    directory: Path,
    *,
    method: str = "laser",
    aggregation: str = "plain",
    blocks: int = 4,
    p_train: float = 0.0,
    p_test: float = 0.0,
    epochs: int = 3,
    options: Mapping[str, Any] | None = None,
    n: int = 600,
    **sections: Mapping[str, Any],
):
    groups = block_csv(directory / "data.csv", n=n, blocks=blocks)
    raw: dict[str, Any] = {
        "run": {"method": method, "aggregation": aggregation, "seed": 0},
        "data": {"path": "data.csv", "task": "binary", "test_fraction": 0.25},
        "active": {"columns": []},
        "parties": {f"p{i}": {"columns": g} for i, g in enumerate(groups)},
        "train": {"epochs": epochs, "batch_size": 32, "lr": 0.01},
        "model": {"hidden": [16], "width": 8},
        "missing": {"train": {"kind": "mcar", "p": p_train}, "test": {"kind": "mcar", "p": p_test}},
    }
    if options:
        raw["method"] = dict(options)
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    if p_train == 0:
        raw["missing"].pop("train")
    if p_test == 0:
        raw["missing"].pop("test")
    return parse_config(permissive_policy(raw), source=directory / "config.toml")


# --------------------------------------------------------------------------------------------
# task sampling


def test_task_weights_match_the_paper():
    assert task_weights(4).tolist() == [1.0, 1.5, 1.0, 0.25]
    for k in range(1, 9):
        assert task_weights(k).sum() == pytest.approx((2**k - 1) / k)


def test_every_head_samples_one_subset_per_size_containing_it():
    present = ("a", "b", "c", "d")
    rng = np.random.default_rng(0)
    for _ in range(50):
        tasks = sample_tasks(present, rng)
        assert len(tasks) == 16  # K_o^2 head evaluations
        for k in present:
            mine = [t for t in tasks if t.head == k]
            assert sorted(len(t.subset) for t in mine) == [1, 2, 3, 4]
            assert all(k in t.subset for t in mine)
            assert all(t.subset == tuple(b for b in present if b in t.subset) for t in mine)
            assert [t.subset for t in mine if len(t.subset) in (1, 4)] == [(k,), present]


def _random_setup(k: int = 4, n: int = 8, d: int = 5, seed: int = 0):
    torch.manual_seed(seed)
    blocks = [f"b{i}" for i in range(k)]
    reps = {b: torch.randn(n, d) for b in blocks}
    heads = {b: torch.nn.Linear(d, 1) for b in blocks}
    y = torch.randint(0, 2, (n,))

    def sums(tasks):
        return {t.subset: sum(reps[b] for b in t.subset) for t in tasks}

    return blocks, heads, y, sums


@pytest.mark.parametrize("k", [3, 4])
def test_monte_carlo_mean_of_sampled_loss_equals_exact_objective(k):
    """Lemma 1: E[L_hat] = sum_k sum_{I containing k} L_kI / |I|."""
    blocks, heads, y, sums = _random_setup(k=k)
    with torch.no_grad():
        exact = exact_tasks(blocks)
        objective = float(laser_objective(sums(exact), exact, heads, y, "binary"))
        # the per-(head, subset) losses, so that many draws are cheap; checked against the
        # real objective on a few draws below
        per_task = {}
        for t in exact:
            unit = type(t)(head=t.head, subset=t.subset, weight=1.0)
            per_task[(t.head, t.subset)] = float(
                laser_objective(sums([unit]), [unit], heads, y, "binary")
            )
        rng = np.random.default_rng(1)
        draws = []
        for i in range(3000):
            tasks = sample_tasks(blocks, rng)
            value = sum(t.weight * per_task[(t.head, t.subset)] for t in tasks)
            if i < 5:
                assert value == pytest.approx(
                    float(laser_objective(sums(tasks), tasks, heads, y, "binary")), rel=1e-5
                )
            draws.append(value)
    mean, stderr = np.mean(draws), np.std(draws) / np.sqrt(len(draws))
    assert abs(mean - objective) < 4 * stderr + 1e-6 * objective, (mean, objective, stderr)


def test_exact_objective_gives_every_subset_total_weight_one():
    tasks = exact_tasks(("a", "b", "c"))
    weight: dict[tuple[str, ...], float] = {}
    for t in tasks:
        weight[t.subset] = weight.get(t.subset, 0.0) + t.weight
    assert len(weight) == 7 and all(w == pytest.approx(1.0) for w in weight.values())


# --------------------------------------------------------------------------------------------
# batches and options


def test_batches_are_pattern_homogeneous_and_reshuffled_every_epoch():
    rng = np.random.default_rng(0)
    ids = np.arange(1000, 1500)
    present = rng.random((500, 4)) > 0.4
    present[0] = False  # a row nobody holds is left out
    b0 = pattern_batches(ids, present, batch_size=16, seed=3, epoch=0)
    b1 = pattern_batches(ids, present, batch_size=16, seed=3, epoch=1)
    pos = {int(i): j for j, i in enumerate(ids)}
    for batch, pattern in b0:
        rows = present[[pos[int(i)] for i in batch]]
        assert (rows == pattern).all() and len(batch) <= 16
    seen = np.sort(np.concatenate([b for b, _ in b0]))
    assert np.array_equal(seen, np.sort(ids[present.any(axis=1)]))
    assert [b.tolist() for b, _ in b0] != [b.tolist() for b, _ in b1]
    again = pattern_batches(ids, present, batch_size=16, seed=3, epoch=0)
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(b0, again, strict=True))


def test_balanced_batches_draw_both_classes_equally():
    ids = np.arange(2000)
    labels = (np.arange(2000) < 400).astype(float)  # 20 % positives
    present = np.ones((2000, 2), dtype=bool)
    batches = pattern_batches(ids, present, batch_size=64, seed=0, epoch=0, labels=labels)
    drawn = np.concatenate([b for b, _ in batches])
    assert len(drawn) == 2000
    assert labels[drawn].mean() == pytest.approx(0.5, abs=0.05)


def test_pattern_codes_are_bitmasks():
    assert pattern_codes(np.array([[1, 0, 1], [0, 1, 0]], dtype=bool)).tolist() == [5, 2]


def test_cosine_schedule_goes_from_lr_to_the_floor(tmp_path):
    cfg = block_config(tmp_path, epochs=10, options={"lr_schedule": "cosine", "lr_min_ratio": 0.2})
    assert lr_at(cfg, 0) == pytest.approx(0.01)
    assert lr_at(cfg, 10) == pytest.approx(0.002)
    assert lr_at(cfg, 5) == pytest.approx(0.006)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"bogus": 1}, "[method] bogus"),
        ({"balanced": "yes"}, "[method] balanced"),
        ({"lr_schedule": "step"}, "[method] lr_schedule"),
        ({"momentum": 1.5}, "[method] momentum"),
        ({"eval_test_missing": [1.0]}, "[method] eval_test_missing"),
        ({"exact_objective": 1}, "[method] exact_objective"),
    ],
)
def test_bad_method_options_name_the_key(tmp_path, options, key):
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, options=options)
    assert info.value.key == key


# --------------------------------------------------------------------------------------------
# the method over (direct) secure sums


def test_single_present_party_prediction_is_the_head_of_its_representation(tmp_path):
    cfg = block_config(tmp_path, p_train=0.3, p_test=0.5, epochs=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.fit()
    pres = fed.presence(fed.test_ids)
    rows = fed.test_ids[pres.sum(axis=1) == 1]
    party = cfg.party_names[int(np.argmax(pres[pres.sum(axis=1) == 1][0]))]
    rows = rows[fed.presence(rows)[:, cfg.party_names.index(party)]]
    assert len(rows) > 3
    logits = fed.method.predict_subset(fed, rows, (party,))
    assert set(logits) == {party}
    pm = fed.party_methods[party]
    with torch.no_grad():
        rep = pm.models["rep"](pm._inputs(rows))
        expected = fed.method.heads[party](rep)
    torch.testing.assert_close(logits[party], expected, rtol=1e-5, atol=1e-5)
    # and the evaluation uses exactly that head for those rows
    pred = fed.method.predict_rows(fed, rows, (party,))
    assert set(pred.classes) == {party} and not pred.fallback


def test_prediction_uses_the_mean_over_present_parties_for_every_head(tmp_path):
    cfg = block_config(tmp_path, epochs=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.fit()
    rows = fed.test_ids[:20]
    subset = ("p0", "p2", "p3")
    logits = fed.method.predict_subset(fed, rows, ("p3", "p0", "p2"))  # order does not matter
    with torch.no_grad():
        reps = [
            fed.party_methods[p].models["rep"](fed.party_methods[p]._inputs(rows)) for p in subset
        ]
        z = sum(reps) / 3
        for k in subset:
            torch.testing.assert_close(logits[k], fed.method.heads[k](z), rtol=1e-5, atol=1e-5)


def test_masked_subset_sums_decode_to_the_plaintext_subset_sums(tmp_path):
    cfg = block_config(tmp_path, aggregation="mask", p_train=0.3, epochs=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.fit()
    assert fed.sums, "no secure sums were asked for"
    groups = {spec.group for spec, _, _ in fed.sums}
    assert len(groups) > 4  # many different subsets
    assert all(len(g) >= 2 for g in groups)  # singletons were skipped, never asked
    for spec, plain, decoded in fed.sums:
        # LASER-VFL declares split-NN's encoding: 16 bits after the point
        np.testing.assert_allclose(decoded, plain, atol=len(spec.group) * 2.0**-17)
    # one call per batch carries every sampled subset's sum
    forwards = [c for c in fed.calls if c[0] == "forward"]
    assert max(len(c[2]) for c in forwards) > 1
    # the aggregator saw ring elements, not representations
    spec, views = fed.seen[0]
    for arr in views.values():
        assert arr.dtype in (np.uint32, np.uint64)  # the ring of the sum's size


def test_secure_mode_skips_terms_it_cannot_sum_safely_and_logs_the_count(tmp_path):
    cfg = block_config(tmp_path, aggregation="mask", p_train=0.5, p_test=0.5, epochs=2)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    metrics = fed.run()
    assert len(fed.history) == 2
    for h in fed.history:
        assert h["skipped_tasks"] > 0
    assert any("skipped" in line and "min_group" in line for line in fed.logs)
    assert fed.method.summary()["skipped_tasks_total"] == sum(
        h["skipped_tasks"] for h in fed.history
    )
    assert metrics["n_fallback"] > 0  # test rows with one present party
    # parties whose gradients differ get their own calls: with a family {abcd, ab, cd}, a and
    # b get dL/dS_abcd + dL/dS_ab, c and d get dL/dS_abcd + dL/dS_cd
    backward = [c for c in fed.calls if c[0] == "backward"]
    assert any(len(to) == 2 for _, to, _, _ in backward)
    assert fed.method.summary()["row_families"]


def _low_weight_vector_in_span(groups, parties, min_group):
    """A 0/1 combination over fewer than `min_group` parties that the sums over `groups` (of
    the same rows) determine, or None."""
    from itertools import combinations as comb

    rows = np.array([[p in g for p in parties] for g in groups], dtype=float)
    rank = np.linalg.matrix_rank(rows)
    for size in range(1, min_group):
        for members in comb(range(len(parties)), size):
            v = np.zeros(len(parties))
            v[list(members)] = 1
            if np.linalg.matrix_rank(np.vstack([rows, v])) == rank:
                return [parties[i] for i in members]
    return None


@pytest.mark.parametrize(("min_group", "blocks"), [(2, 4), (3, 6)])
def test_secure_sums_of_a_row_never_difference_to_fewer_than_min_group(tmp_path, min_group, blocks):
    cfg = block_config(
        tmp_path,
        aggregation="mask",
        p_train=0.2,
        epochs=2,
        n=400,
        blocks=blocks,
        run={"min_group": min_group},
    )
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.run()
    groups_of: dict[int, set[tuple[str, ...]]] = {}
    for op, _, specs, ids in fed.calls:
        if op == "forward":
            for row in ids.tolist():
                groups_of.setdefault(row, set()).update(spec.group for spec in specs)
    assert groups_of
    assert any(len(g) > 1 for g in groups_of.values())  # rows are summed over several groups
    for row, groups in groups_of.items():
        leak = _low_weight_vector_in_span(sorted(groups), cfg.party_names, min_group)
        assert leak is None, f"row {row}: sums over {sorted(groups)} reveal {leak}"


def test_the_papers_sampling_would_leak_through_differences():
    # why secure modes use fixed families: one step of the paper's sampling over four parties
    tasks = sample_tasks(("a", "b", "c", "d"), np.random.default_rng(0))
    groups = sorted({t.subset for t in tasks if len(t.subset) >= 2})
    assert _low_weight_vector_in_span(groups, ("a", "b", "c", "d"), 2) is not None


def test_families_are_laminar_with_large_enough_members():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(200):
        fam = draw_family(("a", "b", "c", "d", "e"), 2, rng)
        seen.add(tuple(len(m) for m in fam))
        assert fam[0] == ("a", "b", "c", "d", "e")
        assert all(len(m) >= 2 for m in fam)
        parts = fam[1:]
        assert sum(len(m) for m in parts) in (0, 5)  # a partition of the present set, or none
        assert _low_weight_vector_in_span(fam, ("a", "b", "c", "d", "e"), 2) is None
    assert seen == {(5,), (5, 3, 2)}
    assert draw_family(("a",), 2, rng) == ()


def test_secure_modes_refuse_re_evaluating_rows_under_other_patterns(tmp_path):
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, aggregation="mask", options={"eval_test_missing": [0.5]})
    assert info.value.key == "[method] eval_test_missing"
    block_config(
        tmp_path, aggregation="mask", options={"eval_test_missing": [0.5]}, run={"min_group": 1}
    )  # the explicit opt-in allows it


def test_families_can_be_asked_for_in_plain_mode_but_not_turned_off_in_secure_modes(tmp_path):
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, aggregation="mask", options={"families": False})
    assert info.value.key == "[method] families"
    cfg = block_config(tmp_path, options={"families": True}, epochs=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    fed.fit()
    assert fed.method.use_families and fed.history[0]["skipped_tasks"] > 0
    assert all(len(spec.group) >= 2 for spec, _, _ in fed.sums)


def test_min_group_one_is_an_explicit_opt_in_that_trains_every_task(tmp_path):
    cfg = block_config(tmp_path, aggregation="mask", p_train=0.5, epochs=1, run={"min_group": 1})
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    metrics = fed.run()
    assert fed.history[0]["skipped_tasks"] == 0
    assert metrics["n_fallback"] == 0
    assert any(len(spec.group) == 1 for spec, _, _ in fed.sums)


@pytest.mark.parametrize("method", ["laser", "standard-vfl"])
def test_two_logit_heads_train_under_softmax_and_score_the_positive_class(tmp_path, method):
    cfg = block_config(tmp_path, method=method, epochs=3, options={"two_logit_head": True})
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    assert fed.method.loss_task == "multiclass" and fed.method.out_dim == 2
    assert all(m[-1].out_features == 2 for m in fed.method.heads.values())
    metrics = fed.run()
    assert metrics["accuracy"] > 0.75 and metrics["f1"] > 0.7
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, options={"two_logit_head": "yes"})
    assert info.value.key == "[method] two_logit_head"


def test_plain_and_mask_runs_agree(tmp_path):
    out = {}
    for aggregation in ("plain", "mask"):
        d = tmp_path / aggregation
        d.mkdir()
        run = {"min_group": 1, "shared_init": True}  # two runs compared: one initial model
        cfg = block_config(d, aggregation=aggregation, epochs=2, run=run)
        out[aggregation] = DirectFederation(cfg, run_dir=d / "run").run()
    assert out["mask"]["accuracy"] == pytest.approx(out["plain"]["accuracy"], abs=0.02)


def test_laser_learns_with_missing_blocks(tmp_path):
    cfg = block_config(
        tmp_path, p_train=0.3, p_test=0.3, epochs=6, options={"eval_test_missing": [0.0, 0.5]}
    )
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    metrics = fed.run()
    assert metrics["accuracy"] > 0.72, metrics
    assert metrics["n_fallback"] == 0 and metrics["n_eval"] == len(fed.test_ids)
    assert set(metrics["f1_per_predictor"]) == set(cfg.party_names)
    extra = fed.method.summary()["extra_tests"]
    assert extra["p_test=0"]["accuracy"] >= extra["p_test=0.5"]["accuracy"] - 0.02
    losses = [h["loss"] for h in fed.history]
    assert losses[-1] < losses[0]


def test_a_lost_party_is_treated_as_missing_and_training_goes_on(tmp_path):
    cfg = block_config(tmp_path, aggregation="mask", p_train=0.2, epochs=3)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    assert method_spec("laser").tolerates_dropout
    fed.drop("p1", at_round=40)
    metrics = fed.run()
    assert len(fed.history) == 3
    assert fed.method.dead == ["p1"]
    # calls[39] is round 40, the one p1 died in (recorded as asked); nothing after it
    after = [c for c in fed.calls[40:] if "p1" in c[1]]
    assert not after, "a call went to the lost party"
    assert all("p1" not in spec.group for c in fed.calls[40:] for spec in c[2])
    assert metrics["n_eval"] == len(fed.test_ids)
    assert any("lost" in line for line in fed.logs)


def test_a_party_lost_during_backward_keeps_the_others_updates(tmp_path):
    """The survivors ran the backward of the round the party died in: it is not sent to them
    again (they would apply it twice; the real party stage refuses a second backward)."""
    cfg = block_config(tmp_path, epochs=1)
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    # round 1 is the set-up, round 2 the first batch's forward, round 3 its first backward
    fed.drop("p0", at_round=3)
    fed.run()
    assert fed.method.dead == ["p0"]
    assert fed.calls[2][0] == "backward" and "p0" not in fed.calls[2][1]
    # between the first batch's forward and the next one, each survivor gets one backward
    nxt = next(i for i, c in enumerate(fed.calls[2:], start=2) if c[0] == "forward")
    got = [p for c in fed.calls[2:nxt] for p in c[1]]
    assert sorted(got) == ["p1", "p2", "p3"], "a backward was sent twice"
    assert all(fed.party_methods[p]._pending is None for p in ("p1", "p2", "p3"))


def test_active_party_with_its_own_block(tmp_path):
    groups = block_csv(tmp_path / "data.csv", n=500, blocks=3)
    raw = {
        "run": {"method": "laser", "aggregation": "mask", "seed": 0},
        "data": {"path": "data.csv", "task": "binary", "test_fraction": 0.25},
        "active": {"columns": groups[2]},
        "parties": {"p0": {"columns": groups[0]}, "p1": {"columns": groups[1]}},
        "train": {"epochs": 4, "batch_size": 32, "lr": 0.01},
        "model": {"hidden": [16], "width": 8},
        "missing": {"train": {"kind": "mcar", "p": 0.3}},
    }
    cfg = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    metrics = fed.run()
    assert fed.method.blocks == ("p0", "p1", "active")
    # {active, p_i} would be a sum over one passive party: skipped; {p0, p1} is allowed
    assert all(spec.group == ("p0", "p1") for spec, _, _ in fed.sums)
    assert fed.history[0]["skipped_tasks"] > 0
    assert metrics["accuracy"] > 0.7


# --------------------------------------------------------------------------------------------
# end to end over the real protocol (threads, in-process ZeroMQ, CURVE)


def test_laser_gradients_go_through_label_dp(tmp_path):
    from securevfl.inproc import run_federation

    cfg = block_config(
        tmp_path,
        aggregation="mask",
        p_train=0.3,
        epochs=2,
        n=300,
        run={"transport": "inproc"},
        privacy={"label_dp": {"noise_multiplier": 1.0, "clip": 1.0}, "delta": 1e-5},
        network=INPROC_NETWORK,
    )
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    ledgers = list((tmp_path / "run").rglob("*ledger*"))
    assert ledgers and any("label_dp" in p.read_text() for p in ledgers if p.is_file())


class CrashingParty(BlockParty):
    """Dies at its 12th training forward (the role reports the failure and leaves)."""

    forwards = 0

    def handle(self, op, **kw):
        if op == "forward" and self.name == "p2" and kw["args"].get("train"):
            type(self).forwards += 1
            if type(self).forwards == 12:
                raise RuntimeError("simulated crash")
        return super().handle(op, **kw)


def test_laser_run_survives_a_party_lost_mid_training(tmp_path):
    from securevfl.inproc import run_federation
    from securevfl.methods import MethodSpec, register_method, registry

    if "test-laser-crash" not in registry():
        register_method(
            MethodSpec(
                name="test-laser-crash",
                active=LaserActive,
                party=CrashingParty,
                operations=method_spec("laser").operations,
                options=method_spec("laser").options,
                tasks=("binary",),
                tolerates_dropout=True,
            )
        )
    CrashingParty.forwards = 0
    cfg = block_config(
        tmp_path,
        method="test-laser-crash",
        aggregation="mask",
        p_train=0.2,
        p_test=0.2,
        epochs=2,
        n=400,
        run={"transport": "inproc"},
        network=INPROC_NETWORK,
    )
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    assert metrics["lost_parties"] == ["p2"]
    assert len(metrics["history"]) == 2
    # rows held only by p2 can no longer be scored; the others are predicted without p2
    assert 0.9 * metrics["n_test"] <= metrics["test"]["n_eval"] < metrics["n_test"]
    assert metrics["test"]["accuracy"] > 0.6


def test_laser_end_to_end_inproc_mask(tmp_path):
    from securevfl.inproc import run_federation

    cfg = block_config(
        tmp_path,
        aggregation="mask",
        p_train=0.3,
        p_test=0.3,
        epochs=2,
        n=400,
        run={"transport": "inproc"},
        network=INPROC_NETWORK,
    )
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    assert metrics["test"]["accuracy"] > 0.6
    assert all("skipped_tasks" in h for h in metrics["history"])


def test_the_credit_example_config_is_valid():
    from securevfl.config import load_config

    path = Path(__file__).resolve().parents[2] / "securevfl/examples/credit_laser.toml"
    cfg = load_config(path)
    assert cfg.method == "laser" and cfg.aggregation == "mask" and len(cfg.parties) == 4
    assert cfg.options.balanced is True and cfg.missing_train.get("p") == 0.5
