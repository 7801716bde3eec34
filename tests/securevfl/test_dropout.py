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
