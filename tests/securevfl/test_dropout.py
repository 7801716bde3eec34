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
