"""A modified active party hands each member of one masked sum its own signed call for the same
round ("split view"). Each party checks only the call it got, and its masks used to depend on
the round, group and sum only, so they cancelled whatever each member was told. On FALSE-VFL's
mixed batches that isolates a party: on rows only p2 holds, p2 is told p0 holds them too, and
p0 and p1 are each told the truth about themselves and a lie about the other; every guard
admits its call, p0 and p1 contribute zeros, and the sum over all three was p2's value.

Now every masked contribution is bound to the digest of the whole call its party was sent
(`MaskedSumParty.bind`): a sum whose members were sent different calls is random ring
elements. And a party whose own config does not say `batching = "mixed"` refuses a mixed call
outright."""

from __future__ import annotations

import numpy as np
import pytest

from crypto import MaskedSumAggregator
from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal
from securevfl.methods import SumSpec
from securevfl.methods.false_vfl import example
from securevfl.roles.guard import call_tags
from securevfl.roles.rounds import Call
from tests.securevfl.conftest import make_config

PARTIES = ("p0", "p1", "p2")


def federation(tmp_path, *, batching: str):
    raw = example(tmp_path)
    raw["method"]["batching"] = batching
    cfg = make_config(raw, tmp_path)
    assert cfg.aggregation == "mask" and cfg.min_group == 2
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    ids = np.sort(fed.active_table.ids)
    held = {p: fed.tables[p].has(ids) for p in PARTIES}
    only_p2 = ids[held["p2"] & ~held["p0"] & ~held["p1"]][:6]
    assert len(only_p2) >= 3
    return cfg, fed, only_p2


def signed(fed, cfg, *, round, ids, present, sums):
    call = Call(
        op="encode",
        round=round,
        session=fed.session_hex,
        ids=ids,
        args={"train": False},
        inputs={"present": present},
        sums=sums,
        to=PARTIES,
    )
    env = call.envelope(sender=cfg.active_name)
    env.meta["auth"] = call_tags(
        env.meta, session=fed.session, round=round, tensors=env.tensors, keys=fed._auth_keys
    )
    return env


def test_members_sent_different_calls_give_a_sum_that_reveals_nothing(tmp_path):
    cfg, fed, rows = federation(tmp_path, batching="mixed")
    n = len(rows)
    told = {  # columns p0, p1, p2: each party's own column is the truth
        "p2": np.tile(np.array([1, 0, 1], np.uint8), (n, 1)),
        "p0": np.tile(np.array([0, 1, 1], np.uint8), (n, 1)),
        "p1": np.tile(np.array([1, 0, 1], np.uint8), (n, 1)),
    }
    first = fed.party_methods["p2"].first
    sums = (SumSpec(key="P", tensor=first, group=PARTIES),)
    r = fed.round + 1
    replies = {
        p: fed.party_rounds[p].answer(
            signed(fed, cfg, round=r, ids=rows, present=told[p], sums=sums)
        )
        for p in PARTIES
    }  # every guard and the method's own check admit their call
    fed.round = r
    assert float(np.max(np.abs(fed._values[("P", "p0")]))) == 0.0  # p0 and p1 sent zeros
    assert float(np.max(np.abs(fed._values[("P", "p1")]))) == 0.0
    total = MaskedSumAggregator.add({p: replies[p].tensors["P"] for p in PARTIES}, group=PARTIES)
    stage = fed.stage  # the active party's own decoding
    with pytest.raises(ValueError):
        stage.reveal({"P": total}, group=PARTIES, key="P", shape=replies["p2"].meta["shapes"]["P"])
    truth = fed._values[("P", "p2")]
    encoded = stage.encoder.encode(np.asarray(truth, dtype=np.float64)).reshape(-1)
    assert not np.any(total.reshape(-1) == encoded)


def test_members_sent_the_same_call_still_give_the_sum(tmp_path):
    cfg, fed, _ = federation(tmp_path, batching="mixed")
    ids = np.sort(fed.active_table.ids)
    both = ids[fed.tables["p0"].has(ids) & fed.tables["p1"].has(ids)][:6]
    present = np.stack([fed.tables[p].has(both) for p in PARTIES], axis=1).astype(np.uint8)
    first = fed.party_methods["p0"].first
    sums = (SumSpec(key="P", tensor=first, group=PARTIES),)
    r = fed.round + 1
    env = signed(fed, cfg, round=r, ids=both, present=present, sums=sums)
    replies = {p: fed.party_rounds[p].answer(env) for p in PARTIES}
    fed.round = r
    total = MaskedSumAggregator.add({p: replies[p].tensors["P"] for p in PARTIES}, group=PARTIES)
    shape = replies["p0"].meta["shapes"]["P"]
    revealed = fed.stage.reveal({"P": total}, group=PARTIES, key="P", shape=shape)
    expected = sum(np.asarray(fed._values[("P", p)], dtype=np.float64) for p in PARTIES)
    assert np.allclose(revealed, expected, atol=1e-5)


def test_a_party_that_did_not_agree_to_mixed_calls_refuses_one(tmp_path):
    cfg, fed, rows = federation(tmp_path, batching="pattern")
    present = np.tile(np.array([1, 0, 1], np.uint8), (len(rows), 1))
    sums = (SumSpec(key="P", tensor=fed.party_methods["p2"].first, group=PARTIES),)
    env = signed(fed, cfg, round=fed.round + 1, ids=rows, present=present, sums=sums)
    with pytest.raises(PolicyRefusal, match="batching"):
        fed.party_rounds["p2"].answer(env)
