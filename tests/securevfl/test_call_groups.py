"""A modified active party asks, in one signed call, for sums whose groups each party finds
harmless on its own but that together isolate a party: the pairs {alpha,beta}, {alpha,gamma},
{beta,gamma} of split-NN's representations give gamma's = (S_ag + S_bg - S_ab) / 2, though no
party is in all three. Every member of a masked sum was sent the same call (or the sum opens to
nothing: `MaskedSumParty.bind`), so each party checks the call's sums of a tensor together,
those it is not in too, and refuses; nothing is computed or released."""

from __future__ import annotations

import copy

import pytest

from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal
from securevfl.methods import SumSpec
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv

A, B, G = "alpha", "beta", "gamma"


def federation(tmp_path):
    raw = copy.deepcopy(BASE_RAW)
    synthetic_csv(tmp_path / "data.csv", n=200)
    cfg = make_config(raw, tmp_path)
    assert cfg.aggregation == "mask" and cfg.min_group == 2
    return DirectFederation(cfg, run_dir=tmp_path / "run")


def test_pairwise_sums_of_one_call_that_isolate_a_party_are_refused(tmp_path):
    fed = federation(tmp_path)
    rows = fed.test_ids[:20]
    sums = [
        SumSpec(key="ab", tensor="rep", group=(A, B)),
        SumSpec(key="ag", tensor="rep", group=(A, G)),
        SumSpec(key="bg", tensor="rep", group=(B, G)),
    ]
    released = len(fed.sums)
    with pytest.raises(PolicyRefusal, match="differencing") as info:
        fed.call("forward", ids=rows, args={"train": False}, sums=sums, to=[A, B, G])
    assert "{alpha,beta} {alpha,gamma} {beta,gamma}" in str(info.value)
    assert len(fed.sums) == released  # no sum came back


def test_sums_of_one_call_that_isolate_nobody_are_answered(tmp_path):
    """The check refuses combinations only: one group under two keys, or one group, goes."""
    fed = federation(tmp_path)
    sums = [
        SumSpec(key="x", tensor="rep", group=(A, B, G)),
        SumSpec(key="y", tensor="rep", group=(A, B, G)),
    ]
    out = fed.call("forward", ids=fed.test_ids[:20], args={"train": False}, sums=sums, to=[A, B, G])
    assert (out["x"] == out["y"]).all() and out["x"].shape[0] == 20
