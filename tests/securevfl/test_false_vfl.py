"""FALSE-VFL as a method of the engine (`method = "false-vfl"`) and its vanilla VFL baseline
(`method = "vanilla-vfl"`): training and prediction through the kit on plain and mask, mask
agreeing with plain, the secure sums decoding to the plaintext sums, no posterior or likelihood
ever summed over fewer than min_group parties (or over a party lacking the rows), the labeled
budget, refusals, and a ckks run over real processes."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from securevfl.config import ConfigError
from securevfl.data.table import write_csv
from securevfl.direct import DirectFederation
from tests.securevfl.conftest import make_config, securevfl_cli, write_toml
from tests.securevfl.fixed_seeds import fixed_seeds

PARTIES = ("p0", "p1", "p2", "p3")
FAST = {
    "d_h": 4,
    "d_z": 2,
    "hidden": [16],
    "mask_hidden": [8],
    "disc_hidden": [16],
    "kappa": 4,
    "n_predict": 16,
    "stage1_epochs": 10,
    "stage2_epochs": 10,
    "stage1_batch": 16,
    "stage2_batch": 16,
    "stage1_lr": 0.01,
    "stage2_lr": 0.01,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def block_csv(path, *, n: int = 400, seed: int = 0, single: float = 0.0) -> None:
    """Four blocks of two columns driven by one latent (so every block predicts the label and the
    others), each block missing with probability 0.3 but every row keeping two blocks, except a
    fraction `single` of rows that keep exactly one; the first 60 rows are complete."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(n, 2))
    x = np.concatenate(
        [u @ rng.normal(size=(2, 2)) + 0.3 * rng.normal(size=(n, 2)) for _ in PARTIES], 1
    )
    y = (u[:, 0] + 0.5 * u[:, 1] > 0).astype(float)
    present = rng.random((n, len(PARTIES))) >= 0.3
    for i in range(n):
        while present[i].sum() < 2:
            present[i, rng.integers(len(PARTIES))] = True
        if i >= 60 and rng.random() < single:
            present[i] = False
            present[i, rng.integers(len(PARTIES))] = True
    present[:60] = True
    for k in range(len(PARTIES)):
        x[~present[:, k], 2 * k : 2 * k + 2] = np.nan
    cols = [f"X{i + 1}" for i in range(2 * len(PARTIES))]
    write_csv(
        path, id_column="ID", ids=np.arange(1, n + 1), columns=cols, values=x, label="Y", labels=y
    )


def raw_config(directory, *, aggregation: str = "plain", single: float = 0.0, **options) -> dict:
    block_csv(directory / "data.csv", single=single)
    # fixed_seeds: most tests here compare two runs, or a run and the reference, of one seed
    return fixed_seeds(
        {
            "run": {"method": "false-vfl", "aggregation": aggregation, "seed": 3, "min_group": 2},
            "data": {"path": "data.csv", "task": "binary", "test_fraction": 0.5},
            "active": {"columns": []},
            "parties": {
                p: {"columns": [f"X{2 * k + 1}", f"X{2 * k + 2}"]} for k, p in enumerate(PARTIES)
            },
            "missing": {"labeled": 80, "aligned": 20},
            "method": {**FAST, **options},
        }
    )


def federation(tmp_path, name: str, raw: dict) -> DirectFederation:
    d = tmp_path / name
    d.mkdir()
    raw = copy.deepcopy(raw)
    raw["data"]["path"] = str(tmp_path / "data.csv")
    cfg = make_config(raw, d)
    return DirectFederation(cfg, run_dir=d / "run")


def test_trains_on_plain_and_mask_which_agree_and_decode_the_plaintext_sums(tmp_path):
    raw = raw_config(tmp_path)
    out = {}
    for aggregation in ("plain", "mask"):
        raw["run"]["aggregation"] = aggregation
        fed = federation(tmp_path, aggregation, raw)
        out[aggregation] = (fed.run(), fed)
    (plain, _), (mask, fed) = out["plain"], out["mask"]
    assert plain["accuracy"] > 0.8, plain
    # the same seed trains the same model: fixed-point sums differ by 2^-20 at most
    assert mask["accuracy"] == pytest.approx(plain["accuracy"], abs=0.01)
    assert plain["n_fallback"] == mask["n_fallback"] == 0
    for a, b in zip(out["plain"][1].history, fed.history, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    assert {s.tensor for s, _, _ in fed.sums} == {"prec_mu", "prec", "loglik", "dloglik_dh"}
    for spec, plaintext, decoded in fed.sums:
        assert np.allclose(decoded, plaintext, atol=len(spec.group) * 2.0**-20), spec


@pytest.mark.parametrize("variant", ["mar", "mnar"])
def test_pattern_batches_sum_over_present_groups_of_at_least_min_group(tmp_path, variant):
    """batching = "pattern": no party's posterior or likelihood is ever alone in a sum: every
    encode sum is over the parties holding all its rows (>= min_group of them); decode sums are
    over the same group (mar) or every party (mnar); single-party rows are skipped in training
    and fall back at test time, where plain aggregation predicts them."""
    raw = raw_config(tmp_path, aggregation="mask", single=0.15, variant=variant, stage1_epochs=2)
    raw["method"].update(stage2_epochs=1, batching="pattern")
    fed = federation(tmp_path, "mask", raw)
    metrics = fed.run()
    assert all(h["skipped_rows"] > 0 for h in fed.history)
    test_single = int((fed.presence(fed.test_ids).sum(1) == 1).sum())
    assert test_single > 0 and metrics["n_fallback"] == test_single
    n_sums = 0
    for op, to, sums, ids in fed.calls:
        for spec in sums:
            n_sums += 1
            assert len(spec.group) >= 2, (op, spec)
            holders = tuple(p for p in PARTIES if fed.tables[p].has(ids).all())
            if op == "encode" or variant == "mar":
                assert spec.group == holders, (op, spec, holders)
            else:
                assert spec.group == PARTIES, (op, spec)
        if op == "backward":  # gradients go to the parties that contributed to the sums
            assert set(to) <= set(PARTIES)
    assert n_sums > 0
    raw["run"]["aggregation"] = "plain"
    assert federation(tmp_path, "plain", raw).run()["n_fallback"] == 0


@pytest.mark.parametrize("variant", ["mar", "mnar"])
def test_mixed_batches_add_zeros_for_absent_parties_and_keep_min_group_per_row(tmp_path, variant):
    """batching = "mixed" (opt-in): one encode and one decode per step, each over every
    party; a party adds exact zeros on the rows it lacks (mnar: its mask terms there), so each
    row's sum holds the data of its present parties only, at least min_group of them; rows with
    fewer are skipped in training and fall back at test time."""
    raw = raw_config(tmp_path, aggregation="mask", single=0.15, variant=variant, stage1_epochs=2)
    raw["method"].update(stage2_epochs=1, batching="mixed")
    fed = federation(tmp_path, "mask", raw)
    seen = []  # (op, party, tensor, ids, the party's contribution before masking)
    for p, r in fed.party_rounds.items():

        def watch(spec, value, p=p, inner=r.observe):
            op, _, _, ids = fed.calls[-1]
            seen.append((op, p, spec.tensor, ids, np.array(value)))
            inner(spec, value)

        r.observe = watch
    metrics = fed.run()
    assert all(h["skipped_rows"] > 0 for h in fed.history)
    stage1 = [h for h in fed.history if h["stage"] == 1.0]
    assert all(h["batches"] == h["steps"] for h in stage1)  # one encode/decode pair per step
    test_single = int((fed.presence(fed.test_ids).sum(1) == 1).sum())
    assert test_single > 0 and metrics["n_fallback"] == test_single
    for op, _, sums, ids in fed.calls:
        if op in ("encode", "decode"):
            assert all(spec.group == PARTIES for spec in sums), (op, sums)
            assert (fed.presence(ids).sum(1) >= 2).all()  # min_group data owners per row
    assert not all(fed.presence(ids).all() for _, _, _, ids in fed.calls)  # mixed rows
    zeros = 0
    for op, party, tensor, ids, value in seen:
        lacks = ~fed.tables[party].has(ids)
        if op == "encode" or (variant == "mar" and op == "decode"):
            assert (value[lacks] == 0).all(), (op, party, tensor)
            zeros += int(lacks.sum())
        elif op == "decode" and tensor == "loglik":  # mnar: log P(m = 1 | x_hat) < 0 there
            assert (value[lacks] < 0).all()
        if op in ("encode", "decode"):
            assert (value[~lacks] != 0).any(), (op, party, tensor)
    assert zeros > 0
    for spec, plaintext, decoded in fed.sums:
        assert np.allclose(decoded, plaintext, atol=len(spec.group) * 2.0**-20), spec
    raw["run"]["aggregation"] = "plain"
    assert federation(tmp_path, "plain", raw).run()["n_fallback"] == 0


def test_a_party_refuses_mixed_calls_that_would_expose_it(tmp_path):
    """From a modified active party's side (calls it signs itself): a mixed call is refused,
    before the party computes, if it marks a party present on rows it lacks or absent on rows
    it holds, sums over fewer than every passive party, or leaves a row with fewer than
    min_group present parties."""
    from securevfl.errors import PolicyRefusal
    from securevfl.methods import SumSpec

    raw = raw_config(tmp_path, aggregation="mask", single=0.15, batching="mixed")
    fed = federation(tmp_path, "mask", raw)
    ids = fed.train_ids
    pres = np.asarray(fed.presence(ids), dtype=bool)
    rows = {
        "honest": ids[pres[:, 0] & pres[:, 1]][:6],
        "lie": ids[pres[:, 0] & pres[:, 1] & ~pres[:, 2]][:6],
        "hide": ids[pres[:, 0] & pres[:, 1] & pres[:, 2]][6:12],
        "subset": ids[pres[:, 0] & pres[:, 1]][12:18],
        "single": ids[pres.sum(1) == 1][:3],
    }

    def encode(which, present=None, group=PARTIES):
        r = rows[which]
        present = np.asarray(fed.presence(r), dtype=bool) if present is None else present
        return fed.call(
            "encode",
            ids=r,
            args={"train": False, "epoch": 0},
            inputs={"present": present.astype(np.uint8)},
            sums=[SumSpec(k, k, group) for k in ("prec_mu", "prec")],
        )

    assert encode("honest")["prec"].shape == (6, FAST["d_h"])
    lie = np.asarray(fed.presence(rows["lie"]), dtype=bool)
    lie[:, 2] = True  # p2 "holds" them: its zeros would hide that p0 + p1 are fewer
    hide = np.asarray(fed.presence(rows["hide"]), dtype=bool)
    hide[:, 2] = False  # p2 adds 0: the difference with a full sum would isolate it
    for which, present, group, needle in (
        ("lie", lie, PARTIES, "does not hold"),
        ("hide", hide, PARTIES, "which it holds"),
        ("subset", None, ("p0", "p1", "p2"), "not every passive party"),
        ("single", None, PARTIES, "present parties"),
    ):
        with pytest.raises(PolicyRefusal, match=needle) as info:
            encode(which, present, group)
        assert info.value.rule == "method", which


def test_labeled_budget_stage2_and_metrics(tmp_path):
    """Stage 1 reads every training row (unlabeled ones too), stage 2 only the labeled rows,
    prediction only the test rows; the labels of unlabeled rows are empty at the active party."""
    raw = raw_config(tmp_path, stage1_epochs=1, stage2_epochs=1)
    fed = federation(tmp_path, "budget", raw)
    table = fed.active_table
    labeled = fed.train_ids[table.labeled(fed.train_ids)]
    assert len(labeled) == 80 and table.labeled(fed.test_ids).all()
    assert np.isnan(table.label_rows(fed.train_ids[~table.labeled(fed.train_ids)])).all()
    fed.fit()
    encodes = [ids for op, _, _, ids in fed.calls if op == "encode"]
    last_backward = max(i for i, c in enumerate(fed.calls) if c[0] == "backward")
    stage1 = np.concatenate([c[3] for c in fed.calls[:last_backward] if c[0] == "encode"])
    stage2 = np.concatenate([c[3] for c in fed.calls[last_backward:] if c[0] == "encode"])
    assert len(np.setdiff1d(stage1, labeled)) > 0  # unlabeled rows train stage 1
    assert np.isin(stage2, labeled).all() and len(np.unique(stage2)) == len(labeled)
    n_calls = len(fed.calls)
    metrics = fed.method.evaluate(fed, ids=fed.test_ids)
    evaluated = np.concatenate([ids for op, _, _, ids in fed.calls[n_calls:] if op == "encode"])
    assert np.isin(evaluated, fed.test_ids).all() and metrics["n_eval"] == len(fed.test_ids)
    assert len(encodes) > 0 and np.isfinite(fed.history[-1]["loss"])


def test_refusals(tmp_path):
    raw = raw_config(tmp_path)
    bad = copy.deepcopy(raw)
    bad["active"]["columns"] = ["X1"]
    bad["parties"]["p0"]["columns"] = ["X2"]
    with pytest.raises(ConfigError, match=r"\[active\] columns"):
        make_config(bad, tmp_path)
    for key, value in (("variant", "mcar"), ("aggregation", "sum"), ("kappa", 0)):
        bad = copy.deepcopy(raw)
        bad["method"][key] = value
        with pytest.raises(ConfigError, match=rf"\[method\] {key}"):
            make_config(bad, tmp_path)
    bad = copy.deepcopy(raw)
    bad["parties"]["p0"]["dp_sgd"] = {"clip": 1.0, "noise_multiplier": 1.0}
    with pytest.raises(ConfigError, match="dp_sgd"):
        make_config(bad, tmp_path)
    cfg = make_config(copy.deepcopy(raw), tmp_path)
    assert cfg.options.aggregation == "poe" and cfg.options.variant == "mar"


def test_vanilla_vfl_trains_on_aligned_rows_and_zero_fills_at_test(tmp_path):
    raw = raw_config(tmp_path, aggregation="mask", single=0.15)
    raw["run"]["method"] = "vanilla-vfl"
    del raw["method"]
    raw["train"] = {"epochs": 30, "batch_size": 16, "lr": 0.01}
    raw["model"] = {"hidden": [16], "width": 8, "head_hidden": [8]}
    fed = federation(tmp_path, "vanilla", raw)
    labeled = fed.train_ids[fed.active_table.labeled(fed.train_ids)]
    fed.fit()
    n_calls = len(fed.calls)
    metrics = fed.method.evaluate(fed, ids=fed.test_ids)
    trained = np.concatenate([ids for op, _, _, ids in fed.calls[:n_calls] if op == "forward"])
    assert np.isin(trained, labeled).all()
    assert fed.presence(trained).all()  # fully aligned rows only
    predicted = [c for c in fed.calls[n_calls:] if c[0] == "forward"]
    assert predicted and all(s.group == PARTIES for _, _, sums, _ in predicted for s in sums)
    assert any(not fed.presence(ids).all() for _, _, _, ids in predicted)  # zero-filled rows
    test_single = int((fed.presence(fed.test_ids).sum(1) == 1).sum())
    assert metrics["n_fallback"] == test_single > 0
    assert metrics["accuracy"] > 0.7, metrics


@pytest.mark.multiprocess
def test_ckks_over_processes_agrees_with_plain(tmp_path):
    small = {"stage1_epochs": 6, "stage2_epochs": 4, "stage2_batch": 32, "batching": "mixed"}
    raw = raw_config(tmp_path, **small, stage1_lr=0.02, stage2_lr=0.02)
    fed = federation(tmp_path, "plain", raw)
    plain = fed.run()
    raw["run"]["aggregation"] = "ckks"
    raw["network"] = {"heartbeat_interval": 0.2, "peer_timeout": 5.0, "round_timeout": 60.0}
    config = write_toml(raw, tmp_path / "ckks.toml")
    done = securevfl_cli("run", str(config), "--out", str(tmp_path / "ckks"), timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    ckks = json.loads((tmp_path / "ckks" / "metrics.json").read_text())
    assert ckks["aggregation"] == "ckks" and ckks["test"]["n_eval"] == plain["n_eval"]
    assert plain["accuracy"] > 0.8, plain
    # CKKS encrypts with fresh randomness, so every run's sums carry a different ~1e-6 error:
    # stage 1 follows the plain losses closely, stage 2 (whose discriminator game amplifies
    # small differences) drifts by a few per cent, and a few of the 200 test rows may flip (CI
    # saw 0.865 against plain 0.875; repeated runs 0.87, 0.87, 0.88). The drift grows epoch by
    # epoch: over 5 runs on 2026-11-25 the largest relative loss difference was 0.50 % in stage
    # 1 (its last epoch; 0.62 % in another run) and 5.2 % in stage 2: bounds 2 % and 10 %
    stages = [h["stage"] for h in fed.history]
    assert [h["stage"] for h in ckks["history"]] == stages
    for a, b in zip(fed.history, ckks["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02 if a["stage"] == 1 else 0.1), (a, b)
    assert ckks["test"]["accuracy"] == pytest.approx(plain["accuracy"], abs=0.03)
    assert ckks["test"]["roc_auc"] == pytest.approx(plain["roc_auc"], abs=0.02)


def bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "false_vfl.py"
    spec = importlib.util.spec_from_file_location("bench_false_vfl", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_credit_rows_zero_is_the_whole_table_and_reports_beside_the_main_table(tmp_path):
    """`--credit-rows 0` means every row of the Credit table (a subsample of 0 rows would be
    empty); sizes outside 1..rows are refused naming the table's size; a report at another
    Credit size or other seeds than the main table's goes to its own files."""
    bench = bench_module()
    assert bench.resolve_credit_rows(0, 30000) == 30000
    assert bench.resolve_credit_rows(3000, 30000) == 3000
    for bad in (-1, 30001):
        with pytest.raises(ValueError, match="1..30000 rows"):
            bench.resolve_credit_rows(bad, 30000)
    assert bench.report_suffix(["digits", "credit"], 3000, [0, 1, 2]) == ""
    assert bench.report_suffix(["credit"], 30000, [0, 1, 2]) == "_rows30000"
    assert bench.report_suffix(["digits"], 30000, [0, 1, 2]) == ""
    assert bench.report_suffix(["digits"], 3000, range(8)) == "_seeds0-7"
    assert bench.report_suffix(["credit"], 30000, [0, 2]) == "_rows30000_seeds0_2"
    table = tmp_path / "credit.csv"
    table.write_text("ID,X1,Y\n1,0.5,0\n2,1.5,1\n3,2.5,0\n\n")
    bench.CREDIT = table
    assert bench.credit_table_rows() == 3
    with pytest.raises(SystemExit):  # argparse's error: the size names the table's
        bench.main(["--datasets", "credit", "--credit-rows", "4", "--report-only"])


def test_bench_reference_path_reads_what_the_parties_read(tmp_path):
    """bench/false_vfl.py trains FALSE-VFL's accuracy grid through the single-process reference
    on the federation's own rows: its blocks are each party's z-scored rows (what `encode`
    reads), 0 where the party lacks the row, and its presence is the active party's."""
    bench = bench_module()
    fed = federation(tmp_path, "ref", raw_config(tmp_path, single=0.15))
    ids = np.concatenate([fed.train_ids, fed.test_ids])
    xs, present = bench.party_blocks(fed, ids)
    assert present.numpy().tolist() == np.asarray(fed.presence(ids)).tolist()
    assert not present.all() and present.any(1).all()
    for k, name in enumerate(PARTIES):
        method = fed.party_methods[name]
        held = present[:, k].numpy()
        assert np.array_equal(held, method.table.has(ids))
        read = method._held_inputs(ids[held], "encode").numpy()
        assert np.array_equal(xs[k].numpy()[held], read)
        assert (xs[k].numpy()[~held] == 0).all()


@pytest.mark.parametrize("variant", ["mar", "mnar"])
def test_engine_mixed_batches_compute_what_the_reference_computes(tmp_path, variant):
    """Through the engine (plain, mixed batches: one call per batch over every party, absent
    parties adding zeros) stage 1, stage 2 and prediction are `FalseVFLReference`'s math on the
    same rows, batches, initial weights and noise: every epoch's loss and every test probability
    agree within float tolerance (the sums' order differs). Stage 2 draws its importance samples
    of both epochs up front (`_draw_bank`, 2 * kappa per labeled row, one call); the reference
    draws the same samples from the same generators and runs the same discriminator steps."""
    from securevfl.methods.blocks.nets import derived_seed
    from securevfl.methods.false_vfl.active import EVAL_ROWS, mixed_batches
    from securevfl.methods.false_vfl.model import config_from_options
    from securevfl.methods.false_vfl.reference import FalseVFLReference

    epochs, epochs2 = 3, 2
    raw = raw_config(
        tmp_path, variant=variant, stage1_epochs=epochs, stage2_epochs=epochs2, batching="mixed"
    )
    fed = federation(tmp_path, "engine", raw)
    cfg, opts = fed.config, fed.config.options
    bench = bench_module()
    xs, present = bench.party_blocks(fed, fed.train_ids)
    assert not present.all()  # mixed batches: rows with different present parties
    ref = FalseVFLReference(
        [x.shape[1] for x in xs],
        2,
        config_from_options(opts),
        seed=derived_seed(cfg.seed, "false-vfl"),
        names=PARTIES,
    )
    for k, name in enumerate(PARTIES):  # the same initial weights
        mine = fed.party_methods[name].model.state_dict()
        for key, value in ref.parties[k].state_dict().items():
            assert torch.equal(value, mine[key]), (name, key)
    fed.fit()
    # one call pair per stage-1 step; stage 2 one bank draw in its first epoch, then none
    assert all(h["steps"] == h["batches"] for h in fed.history[:epochs])
    assert [h["batches"] for h in fed.history[epochs:]] == [1.0] + [0.0] * (epochs2 - 1)
    optimizers = [
        torch.optim.Adam(m.parameters(), lr=opts.stage1_lr, weight_decay=opts.weight_decay)
        for m in ref.parties
    ] + [
        torch.optim.Adam(
            ref.active.generative_parameters(), lr=opts.stage1_lr, weight_decay=opts.weight_decay
        )
    ]
    n = len(fed.train_ids)
    for epoch in range(epochs):
        loss_sum = 0.0
        for part in mixed_batches(n, opts.stage1_batch, cfg.seed, epoch):
            rows = torch.as_tensor(part)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            loss_sum += float(ref.stage1_split([x[rows] for x in xs], present[rows])) * len(part)
            for opt in optimizers:
                opt.step()
        assert fed.history[epoch]["loss"] == pytest.approx(loss_sum / n, rel=1e-4), epoch
    # stage 2: the labeled training rows' samples of both epochs, then phi's steps per epoch
    lab_ids = fed.train_ids[fed.active_table.labeled(fed.train_ids)]
    assert 0 < len(lab_ids) <= EVAL_ROWS  # the engine draws them in one chunk
    xl, pl = bench.party_blocks(fed, lab_ids)
    log_w, h = ref.log_weights(xl, pl, epochs2 * opts.kappa)
    y = torch.as_tensor(fed.active_table.label_rows(lab_ids)).long()
    phi_opt = torch.optim.Adam(
        ref.active.discriminator.parameters(), lr=opts.stage2_lr, weight_decay=opts.weight_decay
    )
    for e in range(epochs2):
        cut = slice(e * opts.kappa, (e + 1) * opts.kappa)
        perm = np.random.default_rng([cfg.seed, epochs + e, 0x57A2]).permutation(len(lab_ids))
        loss_sum = 0.0
        for start in range(0, len(perm), opts.stage2_batch):
            b = torch.as_tensor(perm[start : start + opts.stage2_batch])
            phi_opt.zero_grad(set_to_none=True)
            loss = -ref.active.conditional_bound(log_w[b, cut], h[b, cut], y[b]).mean()
            loss.backward()
            phi_opt.step()
            loss_sum += float(loss.detach()) * len(b)
        stats = fed.history[epochs + e]
        assert stats["stage"] == 2.0 and stats["rows"] == len(lab_ids)
        assert stats["loss"] == pytest.approx(loss_sum / len(lab_ids), rel=1e-4), e
    xt, pt = bench.party_blocks(fed, fed.test_ids)
    with torch.no_grad():
        expected = ref.predict_proba(xt, pt).numpy()
    proba, fallback = fed.method.predict_proba(fed, fed.test_ids)
    assert not fallback.any()
    np.testing.assert_allclose(proba, expected, atol=1e-4)


def test_the_default_batching_calls_a_party_only_on_rows_it_holds(tmp_path):
    """batching = "pattern" is the default: no call carries a row to a party that lacks it (a
    party learns nothing about rows the others hold; "mixed" is opt-in)."""
    raw = raw_config(tmp_path, single=0.15, stage1_epochs=1, stage2_epochs=0)
    fed = federation(tmp_path, "plain", raw)
    assert fed.config.options.batching == "pattern"
    fed.run()
    names = list(fed.config.party_names)
    calls = [(op, sums, ids) for op, _, sums, ids in fed.calls if op in ("encode", "decode")]
    assert calls
    for op, sums, ids in calls:
        pres = np.asarray(fed.presence(ids), dtype=bool)
        for spec in sums:
            cols = [names.index(p) for p in spec.group]
            if op == "encode" or fed.config.options.variant == "mar":
                assert pres[:, cols].all(), (op, spec.group)
