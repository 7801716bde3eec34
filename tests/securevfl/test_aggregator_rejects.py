"""A malformed contribution is rejected alone, with a logged reason, and the round still
completes with the sender's valid one: the aggregator keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from crypto.ckks import CkksKeyHolder
from securevfl import secure_sum
from securevfl.inproc import run_federation
from securevfl.roles import protocol as P
from securevfl.roles.connection import RoleConnection
from tests.securevfl.conftest import make_config


def test_tampered_contribution_is_rejected_and_the_round_completes(monkeypatch, small_federation):
    raw, d = small_federation
    raw["train"]["epochs"] = 1
    original_send = RoleConnection.send
    tampered = {"sent": 0}

    def malicious_send(self, env):
        sums = [k for k in env.tensors if "@" not in k]
        if self.name == "beta" and env.kind == P.CONTRIB and sums and tampered["sent"] < 3:
            bad = dict(env.tensors)
            key = sums[0]
            if tampered["sent"] == 0:
                bad[key] = bad[key].view(np.int64)  # wrong dtype
            elif tampered["sent"] == 1:
                bad[key + "/extra"] = np.zeros(3, dtype=np.uint64)  # a tensor nobody asked for
            else:
                bad = {}  # nothing at all
            tampered["sent"] += 1
            original_send(
                self,
                type(env)(
                    kind=env.kind,
                    sender=env.sender,
                    session=env.session,
                    round=env.round,
                    tensors=bad,
                    meta=env.meta,
                ),
            )
        original_send(self, env)

    monkeypatch.setattr(RoleConnection, "send", malicious_send)
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0, (d / "run" / "logs" / "aggregator.log").read_text()[-2000:]
    assert tampered["sent"] == 3
    assert metrics["roles"]["aggregator"]["rejected_messages"] >= 3
    log = (d / "run" / "logs" / "aggregator.log").read_text()
    assert "rejected round" in log and "contribution from beta" in log
    assert "not uint64 or uint32 ring elements" in log


@pytest.fixture(scope="module")
def ckks_stages():
    holder = CkksKeyHolder()
    session = secure_sum.SumSession(
        name="x", session=b"s" * 16, ckks_public_context=holder.public_context_bytes()
    )
    party = secure_sum.CkksParty(session)
    agg = secure_sum.CkksAggregator(session)
    return holder, party, agg


def test_ckks_aggregator_rejects_truncated_and_garbage_frames(ckks_stages):
    holder, party, agg = ckks_stages
    x = np.linspace(-1, 1, 10000)
    good = party.protect(x, round=1, group=["a", "b"], key="S")
    assert set(good) == {"S/0", "S/1", "S/call"}  # two chunks and the call they answer
    truncated = dict(good, **{"S/0": good["S/0"][: len(good["S/0"]) // 2]})
    with pytest.raises(secure_sum.ContributionError, match="rejected CKKS contribution"):
        agg.accept(truncated, key="S", sender="b")
    garbage = dict(good, **{"S/1": np.frombuffer(b"\x00\x01" * 500, dtype=np.uint8)})
    with pytest.raises(secure_sum.ContributionError, match="from b|b: rejected"):
        agg.accept(garbage, key="S", sender="b")
    missing_chunk = {"S/1": good["S/1"]}
    with pytest.raises(secure_sum.ContributionError):
        agg.accept(missing_chunk, key="S", sender="b")
    # after rejecting, the same stage still sums valid contributions correctly
    y = np.cos(np.arange(10000.0))
    total = agg.combine(
        {"a": good, "b": party.protect(y, round=1, group=["a", "b"], key="S")},
        group=["a", "b"],
        key="S",
    )
    active = secure_sum.CkksActive(agg.s, key_holder=holder)
    out = active.reveal(total, group=["a", "b"], key="S", shape=(10000,))
    assert np.allclose(out, x + y, atol=1e-5)


def test_a_member_of_another_shape_stops_the_run_naming_it(monkeypatch, small_federation):
    """A contribution of the right type but another shape than its sum's other members' cannot
    be added: the run stops (resumable), and the error names the sum, which member sent which
    shape, and what to check."""
    raw, d = small_federation
    raw["train"]["epochs"] = 1
    original_send = RoleConnection.send

    def reshaped_send(self, env):
        shapes = env.meta.get("shapes") if env.kind == P.CONTRIB else None
        if self.name == "beta" and shapes:
            meta = dict(env.meta, shapes={k: [1, *v] for k, v in shapes.items()})
            env = type(env)(
                kind=env.kind,
                sender=env.sender,
                session=env.session,
                round=env.round,
                tensors=env.tensors,
                meta=meta,
            )
        original_send(self, env)

    monkeypatch.setattr(RoleConnection, "send", reshaped_send)
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code != 0
    log = (d / "run" / "logs" / "aggregator.log").read_text()
    assert "contributions of different shapes" in log, log[-2000:]
    assert "['beta'] [1," in log and "resume from the last checkpoint" in log
