"""An in-process federation (`transport = "inproc"`, every role a thread) ends soon after a role
fails at start, as a federation of processes does: the others are not left waiting for the
start-up timeout."""

from __future__ import annotations

import time

import pytest

from securevfl.errors import ConfigError
from securevfl.roles import protocol as P

from .conftest import make_config


@pytest.mark.parametrize("failing", ["beta", "aggregator"])
def test_a_role_that_fails_at_start_ends_the_run_long_before_the_startup_timeout(
    small_federation, monkeypatch, failing
):
    import securevfl.inproc as inproc
    import securevfl.roles.aggregator as aggregator_module
    import securevfl.roles.party as party_module
    from securevfl.inproc import run_federation

    monkeypatch.setattr(inproc, "STOP_GRACE_S", 2.0)  # what is tested does not need the full 10 s

    raw, directory = small_federation
    raw["run"]["aggregation"] = "plain"
    raw["network"].update({"peer_timeout": 0.5, "startup_timeout": 120.0})
    cfg = make_config(raw, directory)

    def broken(*args, **kwargs):
        raise ConfigError("[parties.beta] columns", "a failure planted by the test")

    if failing == "aggregator":
        monkeypatch.setattr(aggregator_module, "run_aggregator", broken)
    else:
        real = party_module.run_party

        def run_party(cfg, *, name, **kwargs):
            if name == failing:
                broken()
            return real(cfg, name=name, **kwargs)

        monkeypatch.setattr(party_module, "run_party", run_party)
    started = time.monotonic()
    code, metrics = run_federation(cfg, out=directory / "run")
    took = time.monotonic() - started
    assert code == P.EXIT_USAGE and metrics is None  # the planted error's status, no result
    # failure + grace (peer_timeout + STOP_GRACE_S) + stopping: far below the 120 s start-up
    # timeout (the grace, not the start-up timeout, is what ended it)
    assert 2.0 < took < 30, took
