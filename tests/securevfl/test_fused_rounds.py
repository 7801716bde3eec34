"""Message batching per round ([network] fuse_rounds): a batch's backward rides in the envelope of
the next batch's forward. The party runs the two in order, each checked by its guard as its own
call, so a fused run is the unfused run bit for bit, with half the exchanges; and a modified
active party or aggregator cannot use the piggyback to get anything a lone call would not."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal, RunAborted
from securevfl.methods import SumSpec
from securevfl.roles import protocol as P
from securevfl.roles.guard import call_tags
from securevfl.roles.rounds import AHEAD, Call, calls_of, first_round, fuse
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv
from tests.securevfl.fixed_seeds import fixed_seeds

PARTIES = ("alpha", "beta", "gamma")


def config(
    tmp_path, *, fuse_rounds: bool, aggregation: str = "mask", epochs: int = 2, batch: int = 64
):
    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # fused and unfused compared
    raw["run"]["aggregation"] = aggregation
    raw["train"]["epochs"] = epochs
    raw["train"]["batch_size"] = batch
    raw["network"]["fuse_rounds"] = fuse_rounds
    if not (tmp_path / "data.csv").exists():
        synthetic_csv(tmp_path / "data.csv", n=300)
    return make_config(raw, tmp_path)


def trained(tmp_path, *, fuse_rounds: bool, aggregation: str):
    fed = DirectFederation(
        config(tmp_path, fuse_rounds=fuse_rounds, aggregation=aggregation, batch=16),
        run_dir=tmp_path / f"run-{fuse_rounds}",
    )
    exchanges_before = fed.exchanges
    metrics = fed.run()
    return fed, metrics, fed.exchanges - exchanges_before


def weights(fed):
    state = {"head": fed.method.state_dict()}
    for p, m in fed.party_methods.items():
        state[p] = m.state_dict()
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value.detach().cpu().numpy().copy()
        elif isinstance(value, np.ndarray):
            flat[prefix] = value.copy()

    walk("", state)
    return flat


@pytest.mark.parametrize("aggregation", ["plain", "mask"])
def test_a_fused_run_is_the_unfused_run_bit_for_bit_with_half_the_exchanges(tmp_path, aggregation):
    fused, m_fused, n_fused = trained(tmp_path, fuse_rounds=True, aggregation=aggregation)
    alone, m_alone, n_alone = trained(tmp_path, fuse_rounds=False, aggregation=aggregation)
    assert m_fused == m_alone
    assert fused.history[-1]["loss"] == alone.history[-1]["loss"]
    assert [h["loss"] for h in fused.history] == [h["loss"] for h in alone.history]
    w_fused, w_alone = weights(fused), weights(alone)
    assert w_fused.keys() == w_alone.keys() and len(w_fused) > 4
    for k in w_fused:
        assert np.array_equal(w_fused[k], w_alone[k]), k
    # the same calls, in the same order, with the same round numbers
    assert [(c[0], c[1], c[2]) for c in fused.calls] == [(c[0], c[1], c[2]) for c in alone.calls]
    assert fused.round == alone.round
    # training: unfused 2 exchanges per batch + 1 checkpoint per epoch; fused 1 per batch, the
    # last backward of each epoch alone, the checkpoint; evaluation is the same in both
    batches = sum(1 for c in alone.calls if c[0] == "backward")
    epochs = len(alone.history)
    evaluation = n_alone - (2 * batches + epochs)
    assert n_fused == batches + 2 * epochs + evaluation
    assert n_fused - evaluation <= 0.6 * (n_alone - evaluation)


def test_fusing_is_on_by_default_and_can_be_turned_off(tmp_path):
    raw = copy.deepcopy(BASE_RAW)
    synthetic_csv(tmp_path / "data.csv", n=100)
    assert make_config(raw, tmp_path).fuse_rounds is True
    assert config(tmp_path, fuse_rounds=False).fuse_rounds is False


def test_an_inproc_federation_fused_equals_unfused(tmp_path):
    """The same over ZeroMQ (every role a thread, the roles' own loops and aggregator)."""
    from securevfl.inproc import run_federation

    results = {}
    for fuse_rounds in (True, False):
        cfg = config(tmp_path, fuse_rounds=fuse_rounds, epochs=2)
        code, metrics = run_federation(cfg, out=tmp_path / f"inproc-{fuse_rounds}")
        assert code == 0
        results[fuse_rounds] = metrics
    assert results[True]["test"] == results[False]["test"]
    assert results[True]["history"] == [
        {**h, "rows_per_s": results[True]["history"][i]["rows_per_s"]}
        for i, h in enumerate(results[False]["history"])
    ]
    assert results[True]["rounds"] == results[False]["rounds"]
    for role in PARTIES:
        fused = torch.load(tmp_path / "inproc-True" / "checkpoints" / role / "epoch_0001.pt")
        alone = torch.load(tmp_path / "inproc-False" / "checkpoints" / role / "epoch_0001.pt")
        for k, v in fused["method"]["encoder"].items():
            assert torch.equal(v, alone["method"]["encoder"][k]), (role, k)


# ------------------------------------------------------------------------------ the envelope


def two_calls(fed, *, first="backward", second="forward", ids=None):
    """A backward for the last call sent (`train_forward`'s, when it was), then a forward."""
    ids = fed.train_ids[:8] if ids is None else ids
    r = fed.round
    backward = Call(
        op=first,
        round=r + 1,
        session=fed.session_hex,
        ids=ids,
        args={"forward": r},
        inputs={"grad": np.full((len(ids), fed.config.width), 0.1, dtype=np.float32)},
        to=PARTIES,
    )
    forward = Call(
        op=second,
        round=r + 2,
        session=fed.session_hex,
        ids=fed.train_ids[8:16],
        args={"train": True},
        sums=(SumSpec(key="S", tensor="rep", group=PARTIES),),
        to=PARTIES,
    )
    return backward, forward


def signed(fed, env):
    """Tag as the (modified) active party would: it holds the keys."""
    env.meta["auth"] = call_tags(
        env.meta, session=fed.session, round=env.round, tensors=env.tensors, keys=fed._auth_keys
    )
    return env


@pytest.fixture
def fed(tmp_path):
    return DirectFederation(config(tmp_path, fuse_rounds=True), run_dir=tmp_path / "run")


def test_the_envelope_carries_both_calls_in_order(fed):
    backward, forward = two_calls(fed)
    env = fuse([backward, forward], sender="active")
    assert env.round == forward.round and len(env.meta[AHEAD]) == 1
    assert first_round(env) == backward.round
    back, fwd = calls_of(env)
    assert (back.op, back.round, fwd.op, fwd.round) == (
        "backward",
        backward.round,
        "forward",
        forward.round,
    )
    assert np.array_equal(back.ids, backward.ids) and np.array_equal(fwd.ids, forward.ids)
    assert set(back.inputs) == {"grad"} and not fwd.inputs


@pytest.mark.parametrize(
    "bad",
    [
        "sums ahead",
        "other parties",
        "rounds backwards",
    ],
)
def test_calls_that_cannot_share_an_envelope_are_refused_when_built(fed, bad):
    backward, forward = two_calls(fed)
    from dataclasses import replace

    if bad == "sums ahead":
        backward = replace(backward, sums=forward.sums)
    elif bad == "other parties":
        backward = replace(backward, to=("alpha", "beta"))
    else:
        backward = replace(backward, round=forward.round + 1)
    with pytest.raises(ValueError):
        fuse([backward, forward], sender="active")


def train_forward(fed):
    """A training forward on the rows `two_calls`' backward is for (what a backward follows)."""
    fed.call(
        "forward",
        ids=fed.train_ids[:8],
        args={"train": True},
        sums=[SumSpec(key="S", tensor="rep", group=PARTIES)],
    )


def answer_all(fed, env):
    return {p: fed.party_rounds[p].answer(env) for p in PARTIES}


def encoder_weights(fed, party="alpha"):
    return [p.detach().clone() for p in fed.party_methods[party].encoder.parameters()]


def test_an_honest_fused_envelope_is_served(fed):
    train_forward(fed)
    before = encoder_weights(fed)
    backward, forward = two_calls(fed)
    fed.round = forward.round
    replies = answer_all(fed, signed(fed, fuse([backward, forward], sender="active")))
    assert all(r.kind == P.CONTRIB and r.round == forward.round for r in replies.values())
    assert all(set(r.tensors) == {"S"} for r in replies.values())
    after = encoder_weights(fed)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))  # stepped


def refusal(fed, env, party="alpha"):
    with pytest.raises(PolicyRefusal) as info:
        fed.party_rounds[party].answer(env)
    return info.value


def test_an_undeclared_operation_cannot_ride_in_the_piggyback(fed):
    """A modified active party signs a fused envelope whose first call is an op the method
    never declared: refused before anything runs (the model does not step)."""
    before = encoder_weights(fed)
    dump, forward = two_calls(fed, first="dump_table")
    exc = refusal(fed, signed(fed, fuse([dump, forward], sender="active")))
    assert exc.rule == "fused call" and "dump_table" in exc.detail
    assert all(torch.equal(a, b) for a, b in zip(before, encoder_weights(fed), strict=True))


def test_a_declared_pair_is_still_checked_op_by_op(fed):
    """backward then forward is a declared pair, but the forward asks for an undeclared sum
    tensor, and a backward with an undeclared input: each refused as it would be alone."""
    train_forward(fed)
    backward, forward = two_calls(fed)
    from dataclasses import replace

    raw = replace(forward, sums=(SumSpec(key="S", tensor="raw_rows", group=PARTIES),))
    exc = refusal(fed, signed(fed, fuse([backward, raw], sender="active")))
    assert exc.rule == "undeclared sum"
    labels = replace(backward, inputs={"labels": np.zeros(8, dtype=np.float32)})
    exc = refusal(fed, signed(fed, fuse([labels, forward], sender="active")))
    assert exc.rule == "undeclared input"
    # a sum over one party, riding behind an honest backward: the min_group rule holds (the
    # first envelope's backward ran before its forward was refused: train a forward again)
    train_forward(fed)
    backward, forward = two_calls(fed)
    alone = replace(
        forward, to=("alpha",), sums=(SumSpec(key="S", tensor="rep", group=("alpha",)),)
    )
    exc = refusal(
        fed, signed(fed, fuse([replace(backward, to=("alpha",)), alone], sender="active"))
    )
    assert exc.rule == "min_group"


def test_role_operations_never_ride_in_the_piggyback(fed):
    backward, forward = two_calls(fed)
    from dataclasses import replace

    checkpoint = replace(backward, op=P.OP_CHECKPOINT, inputs={}, args={"epoch": 0})
    exc = refusal(fed, signed(fed, fuse([checkpoint, forward], sender="active")))
    assert exc.rule == "fused call"


def test_a_fused_envelope_the_aggregator_changed_is_refused(fed):
    """The tag covers both calls: stripping the backward, adding a call, or changing the
    backward's gradient all fail authentication."""
    backward, forward = two_calls(fed)

    def strip(env):
        del env.meta[AHEAD]
        for k in [k for k in env.tensors if k.startswith("ahead0:")]:
            del env.tensors[k]

    def add(env):
        env.meta[AHEAD].append(
            {"round": env.round - 1, "op": "backward", "args": {}, "to": list(PARTIES)}
        )
        env.meta[AHEAD][0]["round"] = env.round - 2

    def regrad(env):
        env.tensors["ahead0:grad"] = env.tensors["ahead0:grad"] + 1.0

    for tamper in (strip, add, regrad):
        env = signed(fed, fuse([backward, forward], sender="active"))
        tamper(env)
        assert refusal(fed, env).rule == "authentication"


@pytest.mark.parametrize(
    "tamper",
    [
        lambda env: env.meta[AHEAD][0].__setitem__("round", env.round),  # not increasing
        lambda env: env.meta[AHEAD][0].__setitem__("extra", 1),  # unknown field
        lambda env: env.meta[AHEAD][0].__setitem__("to", ["alpha", "beta"]),  # other parties
        lambda env: env.tensors.__setitem__("ahead3:grad", np.zeros(2)),  # no such call
        lambda env: env.meta.__setitem__(AHEAD, []),  # empty
    ],
)
def test_a_malformed_fused_envelope_is_refused_even_when_signed(fed, tamper):
    backward, forward = two_calls(fed)
    env = fuse([backward, forward], sender="active")
    tamper(env)
    assert refusal(fed, signed(fed, env)).rule == "malformed call"


def test_the_aggregator_refuses_a_malformed_fused_call(fed):
    backward, forward = two_calls(fed)
    env = fuse([backward, forward], sender="active")
    env.meta[AHEAD][0]["to"] = ["alpha"]
    with pytest.raises(RunAborted, match="malformed call"):
        fed.aggregator.open(env)


def test_an_update_is_never_lost_at_the_end_of_training(tmp_path):
    """The last backward of a run with no checkpoint or evaluation after it still reaches the
    parties: `flush` (train_and_evaluate and DirectFederation.fit call it)."""
    fed = DirectFederation(config(tmp_path, fuse_rounds=True), run_dir=tmp_path / "run")
    ids = fed.train_ids[:8]
    fed.call(
        "forward",
        ids=ids,
        args={"train": True},
        sums=[SumSpec(key="S", tensor="rep", group=PARTIES)],
    )
    before = encoder_weights(fed)
    grad = np.ones((len(ids), fed.config.width), dtype=np.float32)
    fed.return_gradients({PARTIES: {"grad": grad}}, ids=ids, epoch=0, args={"forward": fed.round})
    assert fed._held is not None  # held back for the next forward
    assert all(torch.equal(a, b) for a, b in zip(before, encoder_weights(fed), strict=True))
    fed.flush()
    assert fed._held is None and fed.calls[-1][0] == "backward"
    assert any(not torch.equal(a, b) for a, b in zip(before, encoder_weights(fed), strict=True))


# ------------------------------------------------------------------ against real party processes


@pytest.fixture(scope="module")
def attacker(tmp_path_factory):
    """The hostile-roles attacker (a modified aggregator speaking for a modified active party)
    facing three real party processes, each with its own run directory, as on separate hosts."""
    import subprocess

    from tests.securevfl.test_hostile_roles import Attacker

    popen = subprocess.Popen

    def own_directory(cmd, *args, **kwargs):
        cmd = list(cmd)
        if "party" in cmd and "--out" in cmd:
            out = cmd.index("--out") + 1
            cmd[out] = str(Path(cmd[out]) / cmd[cmd.index("--name") + 1])
        return popen(cmd, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess, "Popen", own_directory)
        a = Attacker(tmp_path_factory.mktemp("fused-hostile"))
    try:
        replies = a.setup()
        assert all(r.kind == P.CONTRIB for r in replies.values()), replies
        yield a
    finally:
        a.close()


def hostile_pair(a, *, first="backward", rounds=None):
    """A backward for the attacker's last call (a training forward on a.ids[:32]), then a
    training forward."""
    from tests.securevfl.test_hostile_roles import PARTIES as REAL

    forward_round = a.round
    r1, r2 = rounds if rounds is not None else (a.round + 1, a.round + 2)
    a.round = max(a.round, r2)
    update = Call(
        op=first,
        round=r1,
        session=a.session.hex(),
        ids=a.ids[:32],
        args={"forward": forward_round},
        inputs={"grad": np.full((32, 4), 0.01, dtype=np.float32)},
        to=REAL,
    )
    forward = Call(
        op="forward",
        round=r2,
        session=a.session.hex(),
        ids=a.ids[32:64],
        args={"train": True},
        sums=(SumSpec(key="S", tensor="rep", group=REAL),),
        to=REAL,
    )
    env = fuse([update, forward], sender="aggregator")
    env.meta["auth"] = call_tags(
        env.meta, session=a.session, round=env.round, tensors=env.tensors, keys=a.keys
    )
    return env, REAL


@pytest.mark.multiprocess
def test_real_parties_serve_a_fused_envelope_and_refuse_its_replays_and_smuggled_ops(attacker):
    from tests.securevfl.test_hostile_roles import refused

    a = attacker
    first = a.call(
        "forward",
        ids=a.ids[:32],
        args={"train": True},
        sums=[SumSpec(key="S", tensor="rep", group=("p1", "p2", "p3"))],
    )
    assert all(r.kind == P.CONTRIB for r in first.values())
    env, to = hostile_pair(a)
    served = a.send(env, to)
    assert all(r.kind == P.CONTRIB and set(r.tensors) == {"S"} for r in served.values()), served
    # the same envelope again, and a new one whose backward reuses a served round
    refused(a.send(env, to), "replay")
    last = a.round
    env, to = hostile_pair(a, rounds=(last, last + 5))
    refused(a.send(env, to), "replay")
    # an undeclared op riding ahead of an honest forward (signed by a modified active party)
    env, to = hostile_pair(a, first="dump_table")
    refused(a.send(env, to), "fused call")
