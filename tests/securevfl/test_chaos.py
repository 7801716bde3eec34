"""Chaos in CI: SIGKILLs of random roles at random instants of one real multi-process run
(`securevfl run`: four OS processes over CURVE loopback), each followed by `--resume` of the
same run directory. The run that finally completes equals an uninterrupted run of the same seed
bit for bit (in-process, which gives the same bits as processes): test metrics, every epoch's
loss, every role's final tensors. Nothing hangs, no role process outlives its launcher, and
the checkpoints and the privacy ledger stay whole and append-only. The bench (independent
kills, plain/mask/ckks, each compared with a multi-process run) is bench/chaos.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import chaos  # noqa: E402

from securevfl.privacy.ledger import LEDGER_FILENAME, LedgerEvent, PrivacyLedger  # noqa: E402

STOP_DEADLINE = 60.0  # kill -> the launcher has stopped every role
RUN_DEADLINE = 180.0  # one whole (resumed) run


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kills", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)]
)
def test_random_kills_each_resumed_end_like_an_uninterrupted_run(tmp_path, kills):
    """One kill at a random instant in CI (each costs a launch, ~15 s on 2 cores; a kill of a
    party at a fixed point is test_federation_e2e's, SIGINT there too); two and five with
    `make test-slow`."""
    # the launcher stops a run whose role died within peer_timeout + 10 s; the roles alone, at
    # the start-up timeout when it died before connecting: keep both short. Epochs are cheap
    # next to start-ups: eight leave every resumed launch some training to be killed in
    # (in-epoch kill instants come from the in-process run's epoch time, only an estimate)
    fed = chaos.Federation(
        rows=200, epochs=8, batch_size=16, seed=3, peer_timeout=3.0, startup_timeout=20.0
    )
    result = chaos.run_chain(
        fed=fed,
        work=tmp_path,
        aggregation="mask",
        kills=kills,
        seed=11,
        stop_deadline=STOP_DEADLINE,
        run_deadline=RUN_DEADLINE,
        reference="inproc",  # bit-identical to a multi-process run (checked by the bench)
    )
    final = result["final"]
    print([(k["role"], k["planned"], k["phase"]) for k in result["kills"]], result["launches"])
    landed = result["kills"]
    assert len(landed) == kills, f"only {len(landed)} kills landed in {result['launches']} launches"
    for k in landed:
        where = f"kill of {k['role']} ({k['phase']}, {k['at_seconds']} s)"
        assert not k["hang"] and k["stop_seconds"] is not None, f"{where}: hung"
        assert k["stop_seconds"] < STOP_DEADLINE, where
        assert k["killed_status"] == 4, f"{where}: the run ended {k['killed_status']}, not 4"
        assert k["orphans"] == [], f"{where}: {k['orphans']}"
        assert k["checkpoint_problems"] == [], f"{where}: {k['checkpoint_problems']}"
        assert k["ledger_problems"] == [], f"{where}: {k['ledger_problems']}"
    assert final["resumed_status"] == 0 and not final["hang"], final["error"]
    assert final["orphans"] == [] and final["checkpoint_problems"] == []
    assert final["ledger_problems"] == []
    assert final["identical"], final["diff"]
    assert final["diff"]["metric_diff"] == 0.0 and final["diff"]["loss_diff"] == 0.0
    events = PrivacyLedger.read(tmp_path / "chain" / LEDGER_FILENAME)
    dp = [e for e in events if isinstance(e, LedgerEvent) and e.mechanism == "label_dp"]
    assert {e.epoch for e in dp} == set(range(fed.epochs))  # a DP line per epoch, none lost


def test_the_orphan_check_finds_and_stops_a_process_naming_the_run_dir(tmp_path):
    """The check the chaos runs rely on: a live process whose command line names the run
    directory is reported (and killed, by pid); a process that has exited is not."""
    import subprocess

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run_dir)])
    try:
        left = chaos.orphans(run_dir, {"beta": stray.pid}, grace=0.2)
        assert [(o["pid"], o["role"]) for o in left] == [(stray.pid, "beta")]
        assert stray.wait(timeout=10) == -9
        assert chaos.orphans(run_dir, {"beta": stray.pid}, grace=0.2) == []
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
