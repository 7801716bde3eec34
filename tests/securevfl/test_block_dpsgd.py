"""DP-SGD (Opacus) on the party models of LASER-VFL and the baselines: every optimizer step of
a configured party is clipped, noised and charged to the ledger; methods without SGD-trained
models there refuse the key instead of ignoring it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from securevfl.config import ConfigError
from securevfl.data.table import load_party_table, split_federation
from securevfl.inproc import run_federation
from securevfl.methods.blocks.party import BlockParty
from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger
from tests.securevfl.test_laser import INPROC_NETWORK, block_config


def _run(tmp_path, method: str, **kw):
    cfg = block_config(
        tmp_path,
        method=method,
        aggregation="mask",
        p_train=0.2,
        epochs=2,
        n=300,
        run={"transport": "inproc"},
        network=INPROC_NETWORK,
        parties={"p1": {"columns": ["X3", "X4"], "dp_sgd": {"noise_multiplier": 1.0, "clip": 1.0}}},
        privacy={"delta": 1e-4},
        **kw,
    )
    code, metrics = run_federation(cfg, out=tmp_path / "run")
    assert code == 0
    events = [
        e
        for e in PrivacyLedger.read(tmp_path / "run" / LEDGER_FILENAME)
        if isinstance(e, LedgerEvent)
    ]
    return cfg, metrics, events


@pytest.mark.parametrize("method", ["laser", "combinatorial"])
def test_party_dp_sgd_steps_are_charged_to_the_ledger(tmp_path, method):
    cfg, metrics, events = _run(tmp_path, method)
    sgd = [e for e in events if e.mechanism == "dp_sgd"]
    assert sgd and {e.role for e in sgd} == {"p1"}
    # q = B / N with N the training rows p1 holds (fewer than the federation's: 20% missing)
    held = metrics["n_train"] * 0.8
    assert len({e.sample_rate for e in sgd}) == 1
    assert sgd[0].sample_rate == pytest.approx(cfg.batch_size / held, rel=0.15)
    assert all(e.amplified for e in sgd)
    assert {e.epoch for e in sgd} == {0, 1}
    assert metrics["privacy"]["epsilon"]["p1/dp_sgd"] > 0
    assert metrics["privacy"]["steps"]["p1/dp_sgd"] == len(sgd)
    assert np.isfinite(metrics["test"]["accuracy"])


def test_dp_sgd_clips_and_noises_the_party_update(tmp_path):
    """The same backward through a private party moves the weights by a noised, clipped step:
    different from the plain party's step, and different again with another noise draw."""
    cfg = block_config(tmp_path, epochs=1, n=200)
    ids = np.arange(1, 33)

    class FakePrivacy:
        def __init__(self, sigma):
            from securevfl.privacy.mechanisms import DPSGD

            self.plan = type(
                "Plan",
                (),
                {"dp_sgd": DPSGD(noise_multiplier=sigma, clip=0.01), "dp_sgd_sample_rate": 0.1},
            )()
            self.charged = 0

        def charge(self, mechanism, **kw):
            self.charged += 1

    paths = split_federation(cfg, tmp_path / "split")
    table = load_party_table(paths["p0"], cfg, "p0")
    updates = []
    for privacy in (None, FakePrivacy(1.0), FakePrivacy(1.0)):
        party = BlockParty(name="p0", table=table, config=cfg, device=torch.device("cpu"))
        if privacy is not None:
            party.privacy = privacy
        party.setup(args={}, inputs={"train_ids": ids})
        before = [p.detach().clone() for p in party.models.parameters()]
        out = party.handle("forward", ids=ids, args={"train": True, "epoch": 0}, inputs={})
        grad = np.ones_like(out["rep"]) / len(ids)
        party.handle("backward", ids=ids, args={}, inputs={"rep": grad})
        after = list(party.models.parameters())
        updates.append(torch.cat([(a - b).reshape(-1) for a, b in zip(after, before, strict=True)]))
        if privacy is not None:
            assert privacy.charged == 1
            assert party.private and party.state_dict()["optimizers"]
    plain, noised1, noised2 = updates
    assert not torch.allclose(plain, noised1) and not torch.allclose(noised1, noised2)


@pytest.mark.parametrize(
    ("method", "section", "key"),
    [
        ("vfem", "parties", "[parties.p0] dp_sgd"),
        ("laser", "active", "[active] dp_sgd"),
    ],
)
def test_methods_refuse_dp_sgd_they_cannot_apply(tmp_path, method, section, key):
    dp = {"noise_multiplier": 1.0, "clip": 1.0}
    kw = {"data": {"task": "regression"}} if method == "vfem" else {}
    if section == "parties":
        kw["parties"] = {"p0": {"columns": ["X1", "X2"], "dp_sgd": dp}}
    else:
        kw["active"] = {"columns": [], "dp_sgd": dp}
    with pytest.raises(ConfigError) as info:
        block_config(tmp_path, method=method, **kw)
    assert info.value.key == key
    assert "remove the key" in str(info.value)
