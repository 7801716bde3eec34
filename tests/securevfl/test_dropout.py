"""A party lost mid-training: methods that tolerate it go on with the survivors; others stop with
an error naming the party (resumable)."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.inproc import run_federation
from securevfl.methods import MethodSpec, method_spec, register_method, registry
from securevfl.methods.splitnn import SplitNNActive, SplitNNParty
from tests.securevfl.conftest import make_config

FAIL_AT = {"party": "gamma", "call": 12}


class FlakyParty(SplitNNParty):
    """Dies (raises) at its FAIL_AT-th backward: the role reports the failure and leaves."""

    calls = 0

    def handle(self, op, **kw):
        if op == "backward" and self.name == FAIL_AT["party"]:
            type(self).calls += 1
            if type(self).calls == FAIL_AT["call"]:
                raise RuntimeError("simulated crash")
        return super().handle(op, **kw)


class TolerantActive(SplitNNActive):
    """Split-NN that goes on without a lost party: later sums are over the survivors (a
    forward the others answered is never re-run over the survivors: that would difference)."""


def _register(name, active, *, tolerant):
    if name not in registry():
        register_method(
            MethodSpec(
                name=name,
                active=active,
                party=FlakyParty,
                operations=method_spec("splitnn").operations,
                tolerates_dropout=tolerant,
            )
        )


@pytest.fixture(autouse=True)
def _reset():
    FlakyParty.calls = 0
    _register("test-tolerant", TolerantActive, tolerant=True)
    _register("test-intolerant", SplitNNActive, tolerant=False)


def test_tolerant_method_continues_without_the_lost_party(small_federation):
    raw, d = small_federation
    raw["run"].update({"method": "test-tolerant", "min_group": 2})
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    assert metrics["lost_parties"] == ["gamma"]
    assert metrics["roles"]["gamma"] == {"lost": True}
    assert FlakyParty.calls == FAIL_AT["call"]
    assert len(metrics["history"]) == raw["train"]["epochs"]
    log = (d / "run" / "logs" / "aggregator.log").read_text()
    assert "lost party 'gamma'" in log and "continuing without it" in log
    assert np.isfinite(metrics["test"]["accuracy"])


def test_intolerant_method_stops_naming_the_party(small_federation):
    raw, d = small_federation
    raw["run"].update({"method": "test-intolerant"})
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 4 and metrics is None
    log = (d / "run" / "logs" / "active.log").read_text()
    assert "gamma failed: RuntimeError: simulated crash" in log


SLOW_AT = {"party": "gamma", "call": 5, "seconds": 3.0}


class SlowParty(SplitNNParty):
    """Alive (its heartbeat goes on) but silent past the round deadline at one backward."""

    calls = 0

    def handle(self, op, **kw):
        if op == "backward" and self.name == SLOW_AT["party"]:
            type(self).calls += 1
            if type(self).calls == SLOW_AT["call"]:
                import time

                time.sleep(SLOW_AT["seconds"])
        return super().handle(op, **kw)


def _register_slow(name, *, tolerant):
    if name not in registry():
        register_method(
            MethodSpec(
                name=name,
                active=TolerantActive if tolerant else SplitNNActive,
                party=SlowParty,
                operations=method_spec("splitnn").operations,
                tolerates_dropout=tolerant,
            )
        )


def test_a_party_that_misses_the_round_deadline_is_dropped_by_a_tolerant_method(
    small_federation,
):
    """A party that keeps its heartbeat but does not answer within round_timeout is lost to the
    run like one whose process died: the aggregator names it, tells it, and the others go on
    (its late contribution is ignored); the late party itself stops instead of waiting."""
    SlowParty.calls = 0
    _register_slow("test-tolerant-slow", tolerant=True)
    raw, d = small_federation
    raw["run"].update({"method": "test-tolerant-slow", "min_group": 2})
    raw["network"].update({"round_timeout": 1.0, "peer_timeout": 10.0})
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    assert metrics["lost_parties"] == ["gamma"]
    assert len(metrics["history"]) == raw["train"]["epochs"]
    log = (d / "run" / "logs" / "aggregator.log").read_text()
    assert "'gamma' did not answer round" in log and "round_timeout" in log
    gamma = (d / "run" / "logs" / "gamma.log").read_text()
    assert "did not answer round" in gamma  # told why it was dropped


def test_an_intolerant_method_stops_when_a_party_misses_the_round_deadline(small_federation):
    SlowParty.calls = 0
    _register_slow("test-intolerant-slow", tolerant=False)
    raw, d = small_federation
    raw["run"].update({"method": "test-intolerant-slow"})
    raw["network"].update({"round_timeout": 1.0, "peer_timeout": 10.0})
    code, metrics = run_federation(make_config(raw, d), out=d / "run")
    assert code != 0 and metrics is None
    log = (d / "run" / "logs" / "aggregator.log").read_text()
    assert "nothing arrived within 1 s while waiting for round" in log


# ---------------------------------------------------------------- a late party that comes back


class ScriptedHub:
    """The aggregator's hub with the messages it receives scripted (None: the receive times
    out) and what it sends recorded: the round logic without sockets or clocks."""

    def __init__(self, script):
        self.script = list(script)
        self.sent = []
        self.forgotten = []
        self.session = "00" * 32

    def recv(self, *, timeout):
        from transport import ReceiveTimeout

        item = self.script.pop(0)
        if item is None:
            raise ReceiveTimeout(f"nothing within {timeout} s")
        return item

    def send(self, to, env):
        self.sent.append((to, env))

    def send_each(self, names, env):
        for to in names:
            self.send(to, env)
        return {}

    def forget(self, name):
        self.forgotten.append(name)

    def connected(self):
        return set()


def _tabvfl_aggregator(tmp_path, script):
    import logging

    from securevfl.methods.tabvfl.federations import synthetic_federation
    from securevfl.roles.aggregator import Aggregator
    from securevfl.roles.rounds import AggregatorRound

    raw = synthetic_federation(tmp_path, method="tabvfl", n_rows=60)
    cfg = make_config(raw, tmp_path)
    hub = ScriptedHub(script)
    agg = Aggregator(cfg=cfg, hub=hub, logger=logging.getLogger("test-aggregator"))
    agg.rounds = AggregatorRound(cfg=cfg, session=bytes(32))
    return agg, hub


def _forward(round_):
    from securevfl.roles.rounds import Call

    call = Call(
        op="forward",
        round=round_,
        session="00" * 32,
        ids=np.arange(4),
        args={"train": True},
        to=("g0", "g1"),
        collect=("h",),
    )
    return call.envelope(sender="active")


def _h(party, round_, value):
    from securevfl.roles import protocol as P
    from transport import Envelope

    return Envelope(
        kind=P.CONTRIB,
        sender=party,
        session="00" * 32,
        round=round_,
        tensors={f"h@{party}": np.full((4, 2), value, np.float32)},
        meta={"shapes": {}},
    )


def test_a_late_party_misses_only_that_round_and_its_stale_reply_is_never_used(tmp_path):
    """tabvfl readmits a late guest: g1 misses round 5's deadline (the active party is told it
    is late, not lost; g1 is neither told to stop nor forgotten); its reply to round 5 then
    arrives during round 6 and is dropped by round id, and round 6 carries g1's fresh output."""
    agg, hub = _tabvfl_aggregator(
        tmp_path,
        [_h("g0", 5, 1.0), None, _h("g1", 5, -99.0), _h("g0", 6, 2.0), _h("g1", 6, 3.0)],
    )
    agg._round(_forward(5))
    ((to, late),) = [(t, e) for t, e in hub.sent if e.kind == "result"]
    assert to == "active" and late.round == 5
    assert late.meta["late"] == ["g1"] and late.meta["lost"] == [] and not late.tensors
    assert agg.dead == set() and hub.forgotten == []
    assert [e.kind for t, e in hub.sent if t == "g1"] == ["call"]  # no abort
    hub.sent.clear()
    agg._round(_forward(6))
    assert [e.kind for t, e in hub.sent if t == "g1"] == ["call"]  # called again
    (result,) = [e for t, e in hub.sent if e.kind == "result"]
    assert result.round == 6 and "late" not in result.meta
    assert np.all(result.tensors["h@g1"] == 3.0) and np.all(result.tensors["h@g0"] == 2.0)
    assert agg.missed == {}


def test_a_party_late_round_after_round_is_dropped(tmp_path):
    """Readmission is for a slow party, not a hung one: LATE_ROUNDS_TO_DROP misses in a row
    drop it for the rest of the run (told, forgotten, reported lost), as without readmission;
    an answer in time in between starts the count again."""
    from securevfl.roles.aggregator import LATE_ROUNDS_TO_DROP

    script = [_h("g0", 10, 0.0), None]  # late once ...
    script += [_h("g0", 11, 0.0), _h("g1", 11, 0.0)]  # ... in time: the count starts again
    for r in range(12, 12 + LATE_ROUNDS_TO_DROP):
        script += [_h("g0", r, 0.0), None]
    agg, hub = _tabvfl_aggregator(tmp_path, script)
    for r in range(10, 12 + LATE_ROUNDS_TO_DROP):
        agg._round(_forward(r))
    results = [e for t, e in hub.sent if e.kind == "result"]
    assert [e.meta.get("late") for e in results] == [["g1"], None] + [["g1"]] * (
        LATE_ROUNDS_TO_DROP - 1
    ) + [None]
    assert results[-1].meta["lost"] == ["g1"]
    assert agg.dead == {"g1"} and hub.forgotten == ["g1"]
    assert [e.kind for t, e in hub.sent if t == "g1"][-1] == "abort"


def test_a_late_notice_for_a_method_that_does_not_readmit_stops_the_run(small_federation):
    """Only a method that declares `readmits_late` keeps a late party; an honest aggregator
    never reports one late to the others, so a modified one that does (here to a method that
    drops lost parties) stops the run, rather than leave a party in `ctx.parties` that the
    method believes gone."""
    from securevfl.direct import DirectFederation
    from securevfl.errors import RunAborted

    raw, d = small_federation
    raw["run"].update({"method": "test-tolerant", "min_group": 2})

    class ForgingAggregator(DirectFederation):
        def _exchange(self, env):
            result = super()._exchange(env)
            if env.meta.get("op") == "forward" and env.round > 5:
                call = self.aggregator.open(env)
                return self.aggregator.lost(call, [], delivered=True, late=["gamma"])
            return result

    fed = ForgingAggregator(make_config(raw, d), run_dir=d / "run")
    with pytest.raises(RunAborted, match="does not readmit late parties"):
        fed.run()


def test_a_party_late_for_set_up_is_not_readmitted(tmp_path):
    """Set-up is not a round a party can miss (it would hold nothing to run): even tabvfl drops
    a party that misses its deadline, as a lost one."""
    from securevfl.roles import protocol as P
    from securevfl.roles.rounds import Call

    setup = Call(
        op=P.OP_SETUP,
        round=1,
        session="00" * 32,
        ids=np.empty(0, dtype=np.int64),
        to=("g0", "g1"),
        collect=("present",),
    ).envelope(sender="active")
    agg, hub = _tabvfl_aggregator(tmp_path, [_h("g0", 1, 0.0), None])
    agg._round(setup)
    (result,) = [e for t, e in hub.sent if e.kind == "result"]
    assert result.meta["lost"] == ["g1"] and "late" not in result.meta
    assert agg.dead == {"g1"}
