"""A passive party announces each call's sums before its method computes them
(`PartyRound._expect`, with SECUREVFL_OVERLAP_SUMS=1), so the mask keystreams are made on a worker
thread while the model runs (on a GPU: the CPU makes keystreams while the GPU computes). What is
sent must not change: the same model with and without, and the prepared keystreams really used."""

from __future__ import annotations

import copy

import pytest
import torch

import crypto.masking as masking
from securevfl.config import ConfigError
from securevfl.roles.rounds import overlaps_sums
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv
from tests.securevfl.fixed_seeds import fixed_seeds
from tests.securevfl.test_aggregator_in_active import PARTIES, encoders


def test_overlapped_keystreams_train_the_same_model_and_are_used(tmp_path, monkeypatch):
    from securevfl.inproc import run_federation

    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # two runs compared
    raw["run"]["aggregation"] = "mask"
    raw["train"].update({"epochs": 2, "batch_size": 32})
    synthetic_csv(tmp_path / "data.csv", n=300)
    used = []
    real = masking._prepared_masks

    def spy(prepared, total):
        net = real(prepared, total)
        used.append(net is not None)
        return net

    monkeypatch.setattr(masking, "_prepared_masks", spy)
    # the masks made ahead in a party's wait (SECUREVFL_MASK_AHEAD, tests/securevfl/
    # test_mask_ahead.py) are off here: this test counts the overlap's own preparations
    monkeypatch.setenv("SECUREVFL_MASK_AHEAD", "0")
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SECUREVFL_OVERLAP_SUMS", flag)
        used.clear()
        code, metrics = run_federation(make_config(raw, tmp_path), out=tmp_path / f"run-{flag}")
        assert code == 0
        runs[flag] = (metrics, encoders(tmp_path / f"run-{flag}", 1), list(used))
    off, on = runs["0"], runs["1"]
    assert not any(off[2])  # nothing prepared without the overlap
    # with it, every masked call but each op's first (its size is not known yet) found its
    # keystreams prepared; the last batch of an epoch (fewer rows) is guessed right as well
    assert sum(on[2]) >= len(on[2]) - 3 * 3 and sum(on[2]) > 0
    assert on[0]["test"] == off[0]["test"]
    assert [h["loss"] for h in on[0]["history"]] == [h["loss"] for h in off[0]["history"]]
    for p in PARTIES:
        for k, v in off[1][p].items():
            assert torch.equal(on[1][p][k], v), (p, k)


def test_the_overlap_is_off_unless_asked_for(tmp_path, monkeypatch):
    cfg = make_config(copy.deepcopy(BASE_RAW), tmp_path)
    monkeypatch.delenv("SECUREVFL_OVERLAP_SUMS", raising=False)
    assert overlaps_sums(cfg) is False
    assert overlaps_sums(cfg.__class__(**{**cfg.__dict__, "device": "cuda"})) is False
    monkeypatch.setenv("SECUREVFL_OVERLAP_SUMS", "1")
    assert overlaps_sums(cfg) is True
    monkeypatch.setenv("SECUREVFL_OVERLAP_SUMS", "yes")
    with pytest.raises(ConfigError, match="SECUREVFL_OVERLAP_SUMS.*1 \\(on\\), 0 \\(off\\)"):
        overlaps_sums(cfg)
