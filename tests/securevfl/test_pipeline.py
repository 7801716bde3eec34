"""Pipelined batches ([network] pipeline_depth): the active party keeps the forwards of the next
d batches in flight while it waits for a batch's sum, so a round trip is paid once per d + 1
batches. Depth 0 is the one-at-a-time protocol; depth d > 0 is declared stale (a method says it
tolerates it) and deterministic, so the direct path and ZeroMQ give the same run bit for bit; a
party's backward must name the training forward it belongs to, and a modified active party
cannot make it step on a forward it never computed or step twice on one."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from securevfl.config import MAX_PIPELINE_DEPTH
from securevfl.direct import DirectFederation
from securevfl.errors import ConfigError, PolicyRefusal
from securevfl.methods import MethodSpec, SumSpec, method_spec, register_method, registry
from securevfl.methods.splitnn import SplitNNActive, SplitNNParty
from securevfl.roles.guard import call_tags
from securevfl.roles.rounds import Call, fuse
from tests.securevfl.conftest import BASE_RAW, make_config, synthetic_csv
from tests.securevfl.fixed_seeds import fixed_seeds

PARTIES = ("alpha", "beta", "gamma")


def config(
    tmp_path: Path,
    *,
    depth: int | None,
    epochs: int = 3,
    batch: int = 32,
    aggregation: str = "mask",
    **network,
):
    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # runs of several depths compared
    raw["run"]["aggregation"] = aggregation
    raw["train"].update({"epochs": epochs, "batch_size": batch})
    if depth is not None:
        raw["network"]["pipeline_depth"] = depth
    raw["network"].update(network)
    if not (tmp_path / "data.csv").exists():
        synthetic_csv(tmp_path / "data.csv", n=600)
    return make_config(raw, tmp_path)


def weights(fed: DirectFederation) -> dict[str, np.ndarray]:
    flat = {f"head/{k}": v.numpy().copy() for k, v in fed.method.head.state_dict().items()}
    for p, m in fed.party_methods.items():
        flat.update({f"{p}/{k}": v.numpy().copy() for k, v in m.encoder.state_dict().items()})
    return flat


class InFlight:
    """Spies on `ActiveRound._transmit`: the calls in flight when each call is sent."""

    def __init__(self, monkeypatch) -> None:
        from securevfl.roles.active_round import ActiveRound

        self.seen: list[int] = []
        transmit = ActiveRound._transmit

        def spy(ctx, env):
            self.seen.append(len(ctx._in_flight))
            return transmit(ctx, env)

        monkeypatch.setattr(ActiveRound, "_transmit", spy)


# ------------------------------------------------------------------------------ depth 0


def test_depth_zero_is_the_default_and_sends_one_call_at_a_time(tmp_path, monkeypatch):
    """The default (and an explicit 0) is the unpipelined protocol: no call is ever sent while
    another is in flight, the party steps on the forward's own graph, and the two runs are the
    same bit for bit."""
    assert config(tmp_path, depth=None).pipeline_depth == 0
    spy = InFlight(monkeypatch)
    default = DirectFederation(
        config(tmp_path, depth=None, epochs=2, batch=64), run_dir=tmp_path / "a"
    )
    m_default = default.run()
    assert spy.seen and max(spy.seen) == 0
    explicit = DirectFederation(
        config(tmp_path, depth=0, epochs=2, batch=64), run_dir=tmp_path / "b"
    )
    assert explicit.run() == m_default
    assert [h["loss"] for h in explicit.history] == [h["loss"] for h in default.history]
    a, b = weights(default), weights(explicit)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # every backward named the forward just before it: the one pending forward, by its round
    backward = [c for c in default.calls if c[0] == "backward"]
    assert backward and all(not m._pending for m in default.party_methods.values())


# ------------------------------------------------------------------------------ depth d > 0


def test_a_pipelined_run_is_the_same_over_zeromq_and_in_memory(tmp_path, monkeypatch):
    """The order in which each party runs the calls is fixed by the active party alone, so the
    ZeroMQ federation (aggregator routing several masked rounds at once, each round's sums from
    its own contributions) gives the in-memory run bit for bit, with d + 1 forwards in flight."""
    from securevfl.inproc import run_federation

    cfg = config(tmp_path, depth=2, epochs=2)
    spy = InFlight(monkeypatch)
    code, metrics = run_federation(cfg, out=tmp_path / "inproc")
    assert code == 0
    assert max(spy.seen) >= 3  # the forwards of batches t, t+1, t+2 (and an update) in flight
    fed = DirectFederation(cfg, run_dir=tmp_path / "direct")
    assert fed.run() == metrics["test"]
    assert [h["loss"] for h in fed.history] == [h["loss"] for h in metrics["history"]]
    for p in PARTIES:
        saved = torch.load(tmp_path / "inproc" / "checkpoints" / p / "epoch_0001.pt")
        mine = fed.party_methods[p].encoder.state_dict()
        for k, v in saved["method"]["encoder"].items():
            assert torch.equal(v, mine[k]), (p, k)


def test_depth_two_trains_to_metrics_comparable_with_depth_zero(tmp_path):
    """Staleness changes the trajectory, not what is learnt: on the small fixture (450 training
    rows, batch 32, 3 epochs: ~15 steps per epoch, so 2 stale steps are 13 % of an epoch) the
    test ROC-AUC stays within 0.03 of the unpipelined run's (measured: within 0.002) and the
    loss falls as it does."""
    runs = {}
    for depth in (0, 2):
        fed = DirectFederation(config(tmp_path, depth=depth), run_dir=tmp_path / f"d{depth}")
        runs[depth] = (fed.run(), [h["loss"] for h in fed.history])
    (m0, loss0), (m2, loss2) = runs[0], runs[2]
    assert m0["roc_auc"] > 0.9
    assert abs(m2["roc_auc"] - m0["roc_auc"]) <= 0.03
    assert loss2[-1] < 0.5 * loss2[0] and loss2[-1] <= 1.5 * loss0[-1]
    assert loss2 != loss0  # stale: not the same run


def test_a_pipelined_party_keeps_one_forward_per_batch_in_flight_keyed_by_round(tmp_path):
    fed = DirectFederation(config(tmp_path, depth=2), run_dir=tmp_path / "run")
    spec = [SumSpec(key="S", tensor="rep", group=PARTIES)]
    tickets = [
        fed.post("forward", ids=fed.train_ids[i * 8 : i * 8 + 8], args={"train": True}, sums=spec)
        for i in range(4)
    ]
    party = fed.party_methods["alpha"]
    # d + 1 = 3 kept: the oldest (never stepped on) is gone, and its backward will be refused
    assert list(party._pending) == [t.round for t in tickets[1:]]
    assert all(p.out is None and p.x is not None for p in party._pending.values())
    for t in tickets:
        fed.wait(t)


# ------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    ("value", "network", "match"),
    [
        (-1, {}, "pipeline_depth"),
        (1.5, {}, "pipeline_depth"),
        (MAX_PIPELINE_DEPTH + 1, {}, "pipeline_depth"),
        (2, {"fuse_rounds": False}, "fuse_rounds = true"),
    ],
)
def test_a_bad_pipeline_depth_is_refused_at_load(tmp_path, value, network, match):
    with pytest.raises(ConfigError, match=match):
        config(tmp_path, depth=value, **network)


def test_a_method_that_does_not_declare_staleness_cannot_pipeline(tmp_path):
    assert method_spec("splitnn").tolerates_staleness
    assert not method_spec("laser").tolerates_staleness
    raw = copy.deepcopy(BASE_RAW)
    raw["run"]["method"] = "laser"
    raw["network"]["pipeline_depth"] = 2
    synthetic_csv(tmp_path / "data.csv", n=100)
    with pytest.raises(ConfigError, match="pipeline_depth") as info:
        make_config(raw, tmp_path)
    assert "'laser'" in str(info.value) and "pipeline_depth = 0" in str(info.value)


# ------------------------------------------------------------------------------ attacker


def signed(fed, env):
    """Tagged as a modified active party would: it holds the keys."""
    env.meta["auth"] = call_tags(
        env.meta, session=fed.session, round=env.round, tensors=env.tensors, keys=fed._auth_keys
    )
    return env


def backward(fed, *, forward, ids):
    fed.round += 1
    return Call(
        op="backward",
        round=fed.round,
        session=fed.session_hex,
        ids=ids,
        args={"forward": forward},
        inputs={"grad": np.full((len(ids), fed.config.width), 0.1, dtype=np.float32)},
        to=PARTIES,
    )


def refused_without_a_step(fed, env, party="alpha") -> PolicyRefusal:
    before = [p.detach().clone() for p in fed.party_methods[party].encoder.parameters()]
    with pytest.raises(PolicyRefusal) as info:
        fed.party_rounds[party].answer(signed(fed, env))
    after = fed.party_methods[party].encoder.parameters()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return info.value


@pytest.mark.parametrize("depth", [0, 2])
def test_a_backward_for_a_forward_the_party_never_computed_or_already_stepped_is_refused(
    tmp_path, depth
):
    fed = DirectFederation(config(tmp_path, depth=depth), run_dir=tmp_path / "run")
    ids = fed.train_ids[:8]
    fed.call(
        "forward",
        ids=ids,
        args={"train": True},
        sums=[SumSpec(key="S", tensor="rep", group=PARTIES)],
    )
    trained = fed.round
    # a round the party never served a training forward in, and no round at all
    for forward in (trained + 7, trained - 1, None, True):
        exc = refused_without_a_step(
            fed, fuse([backward(fed, forward=forward, ids=ids)], sender="active")
        )
        assert exc.rule == "method" and "forward" in exc.detail
    # the right forward on other rows
    other = fed.train_ids[8:16]
    exc = refused_without_a_step(
        fed, fuse([backward(fed, forward=trained, ids=other)], sender="active")
    )
    assert exc.rule == "method" and "other rows" in exc.detail
    # the honest backward steps once; the same backward again (a new round: past the replay
    # check) is refused: that forward was consumed
    honest = backward(fed, forward=trained, ids=ids)
    for p in PARTIES:
        fed.party_rounds[p].answer(signed(fed, fuse([honest], sender="active")))
    exc = refused_without_a_step(
        fed, fuse([backward(fed, forward=trained, ids=ids)], sender="active")
    )
    assert exc.rule == "method" and "already stepped" in exc.detail


# ------------------------------------------------------------------------------ failures


FAIL = {"op": "backward", "at": 6, "how": "crash"}


class FailingParty(SplitNNParty):
    """gamma crashes at, refuses or stalls past the round deadline in its FAIL["at"]-th
    FAIL["op"] call."""

    calls = 0

    def check_call(self, op, **kw):
        if self.name == "gamma" and op == FAIL["op"] and FAIL["how"] == "refuse":
            type(self).calls += 1
            if type(self).calls == FAIL["at"]:
                return "test: refused mid-pipeline"
        return super().check_call(op, **kw)

    def handle(self, op, **kw):
        if self.name == "gamma" and op == FAIL["op"] and FAIL["how"] in ("crash", "stall"):
            type(self).calls += 1
            if type(self).calls == FAIL["at"] and FAIL["how"] == "crash":
                raise RuntimeError("simulated crash")
            if type(self).calls == FAIL["at"]:
                time.sleep(1.6)  # its heartbeat goes on; the round deadline is 1 s
        return super().handle(op, **kw)


@pytest.fixture
def failing_method():
    name = "test-pipeline-failing"
    if name not in registry():
        register_method(
            MethodSpec(
                name=name,
                active=SplitNNActive,
                party=FailingParty,
                operations=method_spec("splitnn").operations,
                fuse=method_spec("splitnn").fuse,
                tolerates_staleness=True,
            )
        )
    FailingParty.calls = 0
    return name


@pytest.mark.parametrize(
    ("op", "how", "on_refusal", "says"),
    [
        ("backward", "crash", "stop", "gamma failed: RuntimeError: simulated crash"),
        ("forward", "refuse", "skip", "was refused by a party's release policy"),
        ("backward", "refuse", "stop", "test: refused mid-pipeline"),
        ("forward", "stall", "stop", "nothing arrived within 1 s while waiting for round"),
    ],
)
def test_a_failure_mid_pipeline_stops_the_run_with_its_cause(
    tmp_path, failing_method, op, how, on_refusal, says
):
    """A party that crashes, refuses or stalls while several rounds are in flight stops every
    role with the cause (no hang, no result built from the rounds in flight)."""
    from securevfl.inproc import run_federation

    FAIL.update({"op": op, "how": how})
    raw = copy.deepcopy(BASE_RAW)
    raw["run"]["method"] = failing_method
    raw["train"].update({"epochs": 2, "batch_size": 32})
    raw["network"].update({"pipeline_depth": 3, "round_timeout": 1.0 if how == "stall" else 10.0})
    raw["policy"] = {"on_refusal": on_refusal}
    synthetic_csv(tmp_path / "data.csv", n=400)
    code, metrics = run_federation(make_config(raw, tmp_path), out=tmp_path / "run")
    assert code != 0 and metrics is None
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))
    assert says in logs
    if how != "refuse" or on_refusal == "stop":  # gamma stopped at that call
        assert FailingParty.calls == FAIL["at"]
    else:  # it refused that call and may have served one more in flight before the abort
        assert FailingParty.calls >= FAIL["at"]


# ------------------------------------------------------------------------------ aggregator


class ScriptedHub:
    """The aggregator's hub, scripted: `recv` hands out the envelopes given, `send` records."""

    session = "00" * 16
    bytes_sent = bytes_received = 0

    def __init__(self, script) -> None:
        self.script = list(script)
        self.sent: list[tuple[str, object]] = []

    def recv(self, *, timeout):
        from transport import ReceiveTimeout

        if not self.script:
            raise ReceiveTimeout("the script is over")
        return self.script.pop(0)

    gone: frozenset[str] = frozenset()  # roles whose link is lost: a send to them fails

    def send(self, to, env) -> None:
        from transport import TransportError

        if to in self.gone:
            raise TransportError(f"cannot send to {to!r}: its connection to aggregator is gone")
        self.sent.append((to, env))

    def send_each(self, names, env) -> dict:
        from transport import TransportError

        failed = {}
        for to in names:
            try:
                self.send(to, env)
            except TransportError as exc:
                failed[to] = exc
        return failed

    def queued(self):
        return list(self.script)

    def connected(self):
        return set()


def aggregator_with(tmp_path, script, *, depth):
    import logging

    from securevfl.roles.aggregator import Aggregator
    from securevfl.roles.rounds import AggregatorRound

    cfg = config(tmp_path, depth=depth, aggregation="plain")
    hub = ScriptedHub(script)
    agg = Aggregator(cfg=cfg, hub=hub, logger=logging.getLogger("test.aggregator"))
    agg.session = bytes(16)
    agg.rounds = AggregatorRound(cfg=cfg, session=agg.session)
    return agg, hub


def active_call(op, r, **fields):
    from securevfl.roles import protocol as P

    call = Call(op=op, round=r, session="00" * 16, ids=np.arange(2), to=PARTIES, **fields)
    env = call.envelope(sender="active")
    assert env.kind == P.CALL
    return env


def contribution(party, r, value=None, **tensors):
    from securevfl.roles import protocol as P
    from transport import Envelope

    if value is not None:
        tensors["S"] = np.full((2, 4), float(value))
    return Envelope(
        kind=P.CONTRIB,
        sender=party,
        session="00" * 16,
        round=r,
        tensors=tensors,
        meta={"shapes": {"S": [2, 4]} if value is not None else {}},
    )


def test_the_aggregator_routes_rounds_in_flight_each_sum_from_its_own_round(tmp_path):
    """Two forwards in flight; the parties answer the later one first and a stray answer names
    no round in flight: each result is the sum of exactly its own round's contributions, sent
    as soon as that round is complete."""
    from securevfl.roles import protocol as P
    from transport import Envelope

    sums = (SumSpec(key="S", tensor="rep", group=PARTIES),)
    present = {f"present@{p}": np.ones(2, dtype=bool) for p in PARTIES}
    script = [
        active_call(P.OP_SETUP, 1, collect=("present",)),
        *[contribution(p, 1, **{f"present@{p}": present[f"present@{p}"]}) for p in PARTIES],
        active_call("forward", 2, args={"train": True}, sums=sums),
        active_call("forward", 3, args={"train": True}, sums=sums),
        contribution("alpha", 9, 100.0),  # no such round in flight: dropped
        *[contribution(p, 3, 10.0 * (i + 1)) for i, p in enumerate(PARTIES)],
        *[contribution(p, 2, i + 1) for i, p in enumerate(PARTIES)],
        Envelope(kind=P.BYE, sender="active", session="00" * 16, round=4),
        *[
            Envelope(kind=P.STATS, sender=p, session="00" * 16, round=4, meta={"stats": {p: {}}})
            for p in PARTIES
        ],
    ]
    agg, hub = aggregator_with(tmp_path, script, depth=1)
    assert agg._serve_pipelined() == P.EXIT_OK
    to_active = [env for to, env in hub.sent if to == "active" and env.kind == P.RESULT]
    assert [env.round for env in to_active] == [1, 3, 2]
    assert np.all(to_active[1].tensors["S"] == 60.0) and np.all(to_active[2].tensors["S"] == 6.0)
    forwarded = [(to, env.round) for to, env in hub.sent if env.kind == P.CALL]
    # both calls reached every party before any contribution to round 2 had come back
    assert forwarded[3:] == [(p, 2) for p in PARTIES] + [(p, 3) for p in PARTIES]


def test_the_aggregator_stops_an_active_party_past_its_pipeline_depth(tmp_path):
    from securevfl.errors import RunAborted
    from securevfl.roles import protocol as P

    sums = (SumSpec(key="S", tensor="rep", group=PARTIES),)
    calls = [active_call("forward", r, args={"train": True}, sums=sums) for r in range(2, 7)]
    agg, hub = aggregator_with(tmp_path, [active_call(P.OP_SETUP, 1), *calls], depth=1)
    with pytest.raises(RunAborted, match="pipeline_depth = 1 allows 4"):
        agg._serve_pipelined()


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_party_that_crashed_and_left_is_reported_by_its_own_error(tmp_path, pipelined):
    """A party crashes, reports why and closes its link; the aggregator tries to send it the
    next call before reading that report (the race a pipelined run makes likely): the run
    stops with the party's own error, not with "cannot reach" (its report was already
    queued). Without a queued report, the lost link is the cause."""
    from securevfl.errors import RunAborted
    from securevfl.roles import protocol as P
    from transport import Envelope

    sums = (SumSpec(key="S", tensor="rep", group=PARTIES),)
    crash = Envelope(
        kind=P.ERROR,
        sender="gamma",
        session="00" * 16,
        meta={"reason": "RuntimeError: simulated crash", "role": "gamma"},
    )
    for report in (True, False):
        script = [active_call("forward", 2, args={"train": True}, sums=sums)]
        if report:
            script.append(crash)
        agg, hub = aggregator_with(tmp_path, script, depth=2 if pipelined else 0)
        hub.gone = frozenset({"gamma"})
        agg.dead = set()
        env = hub.recv(timeout=1)
        with pytest.raises(RunAborted) as info:
            if pipelined:
                agg._open(env, {}, agg._in_flight_limit())
            else:
                agg._round(env)
        said = str(info.value)
        if report:
            assert said == "gamma failed: RuntimeError: simulated crash", said
        else:
            assert said.startswith("cannot reach 'gamma': cannot send"), said
        assert info.value.lost == "gamma"


def test_a_pipelined_party_with_dp_sgd_charges_every_step(tmp_path):
    """DP-SGD (Opacus) at a pipelined party: the stale forward is computed without autograd
    and again at its backward, so each backward is one private step, charged once."""
    from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger

    steps = {}
    for depth in (0, 2):
        raw = copy.deepcopy(BASE_RAW)
        raw["train"].update({"epochs": 1, "batch_size": 32})
        raw["network"]["pipeline_depth"] = depth
        raw["parties"]["alpha"]["dp_sgd"] = {"noise_multiplier": 1.0, "clip": 1.0}
        if not (tmp_path / "data.csv").exists():
            synthetic_csv(tmp_path / "data.csv", n=300)
        fed = DirectFederation(make_config(raw, tmp_path), run_dir=tmp_path / f"d{depth}")
        assert 0.5 < fed.run()["roc_auc"] <= 1.0
        events = PrivacyLedger.read(tmp_path / f"d{depth}" / LEDGER_FILENAME)
        sgd = [e for e in events if isinstance(e, LedgerEvent) and e.mechanism == "dp_sgd"]
        steps[depth] = sum(e.steps for e in sgd)
        assert sgd and {e.role for e in sgd} == {"alpha"}
    assert steps[2] == steps[0] > 0


def test_a_party_refuses_at_set_up_a_run_at_another_pipeline_depth(tmp_path):
    """The staleness a party accepts is its own config's: a (modified) active party announcing
    another pipeline depth at set-up is refused there, before any forward is computed."""
    from securevfl.roles.guard import run_terms

    fed = DirectFederation(config(tmp_path, depth=0), run_dir=tmp_path / "run")
    for announced, refused in ((8, True), (0, False)):
        fed.round += 1
        call = Call(
            op="setup",
            round=fed.round,
            session=fed.session_hex,
            ids=np.empty(0, dtype=np.int64),
            args={
                "resume_epoch": -1,
                "run": {**run_terms(fed.config), "pipeline_depth": announced},
            },
            inputs={"train_ids": fed.train_ids, "all_ids": fed.train_ids},
            to=PARTIES,
            collect=("present",),
        )
        env = signed(fed, fuse([call], sender="active"))
        if refused:
            with pytest.raises(PolicyRefusal) as info:
                fed.party_rounds["alpha"].answer(env)
            assert info.value.rule == "run" and "'pipeline_depth': 8" in info.value.detail
        else:  # the same call at the party's own depth passes the check
            fed.party_rounds["alpha"].guard._check_setup(call)
