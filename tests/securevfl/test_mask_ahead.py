"""A masking party makes the next call's masks while it waits for that call (`MaskParty.idle`,
issue 17: keystreams for the next round made while the current one is on the wire). What is
sent must not change, a wrong guess must be dropped unused, and the guesses must really be used
in a federation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from crypto.keys import MaskingKeyPair
from crypto.masking import MaskedSumAggregator
from securevfl.config import ConfigError
from securevfl.secure_sum import MaskActive, MaskParty, SumSession, masks_ahead
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv
from tests.securevfl.fixed_seeds import fixed_seeds
from tests.securevfl.test_aggregator_in_active import PARTIES, encoders

NAMES = ("p1", "p2", "p3")
SESSION = b"s" * 16


def stages(monkeypatch, ahead: str) -> dict[str, MaskParty]:
    monkeypatch.setenv("SECUREVFL_MASK_AHEAD", ahead)
    keys = {n: MaskingKeyPair.generate() for n in NAMES}
    publics = {n: k.public for n, k in keys.items()}
    return {
        n: MaskParty(
            SumSession(name=n, session=SESSION, mask_keypair=keys[n], mask_publics=publics)
        )
        for n in NAMES
    }


def masked_rounds(parties: dict[str, MaskParty], rounds, values) -> list[dict[str, np.ndarray]]:
    """Each round: every party masks its value and then waits (idle), as the party loop does."""
    out = []
    for r, size in rounds:
        sent = {}
        for n, p in parties.items():
            sent[n] = p.protect(values[n][:size], round=r, group=NAMES, key="S")["S"].copy()
            p.idle()
        out.append(sent)
    return out


def test_masks_made_ahead_are_bit_identical_and_a_wrong_guess_is_dropped(monkeypatch):
    rng = np.random.default_rng(0)
    values = {n: rng.normal(size=64) for n in NAMES}
    # steady rounds 3, 5, 7, 9 (guesses after 5, 7, 9: 7 and 9 taken), round 10 (the guess
    # of 11: wrong, dropped at the next wait; then a guess of 11 from the step 9 -> 10), a
    # shorter call at 12 (no guess: the sums changed; the guess of 11 is dropped)
    plan = [(3, 64), (5, 64), (7, 64), (9, 64), (10, 64), (12, 32)]
    on = stages(monkeypatch, "1")
    got = masked_rounds(on, plan, values)
    monkeypatch.setenv("SECUREVFL_MASK_AHEAD", "0")
    fresh = {
        n: MaskParty(
            SumSession(
                name=n,
                session=SESSION,
                mask_keypair=p.s.mask_keypair,
                mask_publics=p.s.mask_publics,
            )
        )
        for n, p in on.items()
    }
    want = masked_rounds(fresh, plan, values)
    for sent_on, sent_off in zip(got, want, strict=True):
        for n in NAMES:
            assert np.array_equal(sent_on[n], sent_off[n])
    for p in fresh.values():
        assert (p.ahead_made, p.ahead_used, p.masker.pending) == (0, 0, 0)
    for p in on.values():
        assert p.stats() == {"mask_ahead": {"made": 4, "used": 2}}
        p.idle()  # a wait after a call without sums (a checkpoint): nothing made again
        assert p.stats() == {"mask_ahead": {"made": 4, "used": 2}}
    # the sums still cancel, and the wrong guess (round 11) left no masks behind
    active = MaskActive(SumSession(name="active", session=SESSION))
    for (_, size), sent in zip(plan, got, strict=True):
        total = MaskedSumAggregator.add(sent, group=NAMES)
        want_sum = sum(values[n][:size] for n in NAMES)
        got_sum = active.reveal({"S": total}, group=NAMES, key="S", shape=(size,))
        assert np.allclose(got_sum, want_sum, atol=1e-5)
    assert all(p.masker.pending == 0 for p in on.values())


def test_a_guess_is_never_made_for_a_domain_already_used(monkeypatch):
    parties = stages(monkeypatch, "1")
    p = parties["p1"]
    x = np.ones(8)
    p.protect(x, round=1, group=NAMES, key="S")
    p.protect(x, round=2, group=NAMES, key="S")
    p.protect(x, round=3, group=NAMES, key="S")  # the guess after 1, 2 would be 3: used
    p._calls = [(1, [(NAMES, "S", 8)]), (2, [(NAMES, "S", 8)])]  # a wait that comes late
    p._waited_after = None
    p.idle()
    assert p.masker.pending == 0 and p.ahead_made == 0


def test_the_switch_reads_0_or_1_and_names_itself_otherwise(monkeypatch):
    monkeypatch.delenv("SECUREVFL_MASK_AHEAD", raising=False)
    assert masks_ahead() is True
    monkeypatch.setenv("SECUREVFL_MASK_AHEAD", "0")
    assert masks_ahead() is False
    monkeypatch.setenv("SECUREVFL_MASK_AHEAD", "on")
    with pytest.raises(ConfigError, match="SECUREVFL_MASK_AHEAD.*1 \\(on\\), 0 \\(off\\)"):
        masks_ahead()


def test_masks_made_ahead_train_the_same_model_and_are_used(tmp_path, monkeypatch):
    from securevfl.inproc import run_federation

    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # two runs compared
    raw["run"]["aggregation"] = "mask"
    raw["train"].update({"epochs": 2, "batch_size": 32})
    synthetic_csv(tmp_path / "data.csv", n=300)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SECUREVFL_MASK_AHEAD", flag)
        code, metrics = run_federation(make_config(raw, tmp_path), out=tmp_path / f"run-{flag}")
        assert code == 0
        runs[flag] = (metrics, encoders(tmp_path / f"run-{flag}", 1))
    (off, off_weights), (on, on_weights) = runs["0"], runs["1"]
    assert on["test"] == off["test"]
    assert [h["loss"] for h in on["history"]] == [h["loss"] for h in off["history"]]
    for p in PARTIES:
        for k, v in off_weights[p].items():
            assert torch.equal(on_weights[p][k], v), (p, k)
        assert off["roles"][p]["mask_ahead"] == {"made": 0, "used": 0}
        ahead = on["roles"][p]["mask_ahead"]
        # every guess but those at an epoch's or a phase's edge is used
        assert ahead["used"] >= 8 and ahead["made"] - ahead["used"] <= 4, ahead
