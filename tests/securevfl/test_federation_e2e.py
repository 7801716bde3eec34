"""End to end: real OS processes over ZeroMQ with CURVE, the way `securevfl run` starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from securevfl.demo import prepare_demo
from tests.securevfl.conftest import (
    kill_role_after_epoch,
    permissive_policy,
    run_until_epoch,
    securevfl_cli,
    write_toml,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """The embedded demo, trained with plain, mask and ckks (same seed, `[run] shared_init`);
    the plain reference as threads of one process (the same bits as processes, as
    bench/chaos.py checks)."""
    out = {}
    for aggregation in ("plain", "mask", "ckks"):
        d = tmp_path_factory.mktemp(f"demo-{aggregation}")
        config = prepare_demo(d, aggregation=aggregation)
        inproc = ["--set", 'run.transport="inproc"'] if aggregation == "plain" else []
        # the three runs are compared: every party's initial model from the run's seed
        shared = ["--set", "run.shared_init=true", "--set", "policy.config_seeds=true"]
        done = securevfl_cli("run", str(config), "--out", str(d / "run"), *inproc, *shared)
        assert done.returncode == 0, done.stderr
        out[aggregation] = (json.loads((d / "run" / "metrics.json").read_text()), done, d)
    return out


def test_demo_mask_meets_the_quality_floor(demo_runs):
    metrics, done, _ = demo_runs["mask"]
    assert metrics["aggregation"] == "mask"
    assert metrics["test"]["accuracy"] >= 0.93
    assert metrics["test"]["roc_auc"] >= 0.97
    assert "epoch 1/" in done.stdout and "test:" in done.stdout


@pytest.mark.parametrize("secure", ["mask", "ckks"])
def test_plain_and_secure_give_the_same_metrics(demo_runs, secure):
    plain = demo_runs["plain"][0]["test"]
    other = demo_runs[secure][0]["test"]
    for key in ("accuracy", "f1", "roc_auc"):
        assert abs(plain[key] - other[key]) <= 0.005, (key, plain[key], other[key])


def test_ckks_parties_in_processes_of_their_own_make_zeros_with_a_helper(demo_runs):
    """A party that runs as its own process gets a low-priority helper process for its CKKS
    encryptions of zero (`SECUREVFL_CKKS_ZEROS` unset): each party's statistics say so and
    count the zeros the helper supplied (none is guaranteed on a busy machine: the helper gets
    only CPU time nothing else wants)."""
    from securevfl.config import load_config

    metrics, _, d = demo_runs["ckks"]
    roles = metrics["roles"]
    (config,) = d.glob("*.toml")
    parties = load_config(config).party_names
    assert parties and set(parties) <= set(roles)
    for p in parties:
        assert roles[p]["ckks_zeros"] == "helper", roles[p]
        assert roles[p]["ckks_zeros_from_helper"] >= 0


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="pinning needs at least two usable cores"
)
def test_securevfl_run_pins_each_role_to_one_core_round_robin(demo_runs):
    """[run] pin_cores (on by default): every role process of `securevfl run` ran on one core,
    the active party and the aggregator on different ones, the roles spread round-robin."""
    from securevfl.config import load_config

    metrics, _, d = demo_runs["mask"]
    roles = metrics["roles"]
    (config,) = d.glob("*.toml")
    cfg = load_config(config)
    allowed = sorted(os.sched_getaffinity(0))
    order = [cfg.active_name, "aggregator", *cfg.party_names]
    for i, role in enumerate(order):
        assert roles[role]["cpus"] == [allowed[i % len(allowed)]], (role, roles[role])


def test_ckks_bytes_show_the_expansion(demo_runs):
    plain = demo_runs["plain"][0]["roles"]
    ckks = demo_runs["ckks"][0]["roles"]
    # every party encrypts 32x8 values per step into one ciphertext of 2048 slots (degree 4096,
    # sized to the demo's sums): ~60 kB where plain sends ~1 kB
    assert ckks["mean"]["bytes_sent"] > 20 * plain["mean"]["bytes_sent"]
    # and the active party receives only the summed ciphertexts, not each party's
    assert ckks["active"]["bytes_received"] < 1.5 * ckks["mean"]["bytes_sent"]


def test_every_role_is_its_own_process_and_reports_bytes(demo_runs):
    metrics = demo_runs["mask"][0]
    roles = metrics["roles"]
    assert set(roles) == {"aggregator", "active", "mean", "error", "worst"}
    pids = {r["pid"] for r in roles.values()}
    assert len(pids) == 5 and os.getpid() not in pids
    for r in roles.values():
        assert r["bytes_sent"] > 0 and r["bytes_received"] > 0
    assert len(metrics["epoch_seconds"]) == 20 and metrics["wall_seconds"] > 0
    # masked representation sums are 4-byte ring elements (Z_2^32), a float32's size: a party
    # sends about what it sends plain (8-byte elements would be about twice)
    plain_sent = demo_runs["plain"][0]["roles"]["mean"]["bytes_sent"]
    assert 0.9 * plain_sent < roles["mean"]["bytes_sent"] < 1.3 * plain_sent


def test_role_processes_start_with_the_collector_off_and_run_it_again_once_set_up(demo_runs):
    """`securevfl.startup_gc`: the active party and every passive party process turned the
    garbage collector off for its imports and on again before reading its data, freezing the
    imported objects; the threads of an in-process run keep the collector as it was."""
    roles = demo_runs["mask"][0]["roles"]
    for name in ("active", "mean", "error", "worst"):
        assert roles[name]["gc"]["enabled"] is True, (name, roles[name]["gc"])
        assert roles[name]["gc"]["frozen"] > 10_000, (name, roles[name]["gc"])  # torch & co.
    inproc = demo_runs["plain"][0]["roles"]  # threads of this test's own process
    assert all(r["gc"]["frozen"] == 0 for n, r in inproc.items() if "gc" in r), inproc


def test_each_party_reads_only_its_own_file(demo_runs):
    _, _, d = demo_runs["mask"]
    header = (d / "run" / "data" / "mean.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "ID" and all(h.startswith("mean_") for h in header[1:])
    assert "Y" not in header
    log = (d / "run" / "logs" / "mean.log").read_text()
    assert "columns ['mean_radius'" in log


def test_checkpoints_written_per_role_each_epoch(demo_runs):
    _, _, d = demo_runs["mask"]
    for role in ("active", "mean", "error", "worst"):
        files = sorted((d / "run" / "checkpoints" / role).glob("epoch_*.pt"))
        assert files and files[-1].name == "epoch_0019.pt"


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"run": {"method": "magic"}}, "[run] method: unknown value 'magic'"),
        ({"parties": {"alpha": {"columns": ["X1", "NOPE"]}}}, "no column 'NOPE'"),
        ({"train": {"epochs": "many"}}, "[train] epochs: must be an integer"),
    ],
)
def test_bad_config_exits_2_naming_the_problem(small_federation, edit, words):
    raw, d = small_federation
    for section, values in edit.items():
        if section == "parties":
            raw["parties"].update(values)
        else:
            raw[section].update(values)
    config = write_toml(raw, d / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(d / "run"), timeout=60)
    assert done.returncode == 2
    assert words in done.stderr


def test_killed_party_stops_everyone_then_resume_finishes(small_federation):
    raw, d = small_federation
    raw["train"].update({"epochs": 8, "batch_size": 16})
    config = write_toml(raw, d / "config.toml")
    run_dir = d / "run"
    code, _, stderr, pids, stopped_after = kill_role_after_epoch(
        config, run_dir, "beta", deadline=120, timeout=60
    )
    assert code == 4, stderr
    assert "'beta'" in stderr and "lost" in stderr
    # the peer timeout is 3 s: everyone stops well within the deadline, nobody hangs
    assert stopped_after < 30
    for role in ("aggregator", "active", "alpha", "gamma"):
        pid = pids[role]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (run_dir / "metrics.json").exists()

    resumed = securevfl_cli("run", str(config), "--out", str(run_dir), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after epoch" in resumed.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert len(metrics["history"]) == 8
    assert metrics["test"]["accuracy"] > 0.7


def test_party_with_unknown_key_is_refused_and_logged(small_federation):
    """The refusal must happen inside the aggregator's 4 s start-up window. Started side by
    side, the party (which reads its data first) reached the aggregator 3.8 s into that window
    even at light load and after it closed under load (4 of 6 runs at load 9): so the party
    starts first with a long start-up timeout of its own, retries its connection (at most
    ~2.1 s apart: ZeroMQ's reconnect interval is capped at 2 s plus jitter) and the aggregator
    starts only once the party says it is connecting."""
    import time

    from securevfl.launcher import free_port

    raw, d = small_federation
    raw["network"].update({"startup_timeout": 4.0})
    config = write_toml(raw, d / "config.toml")
    keys = d / "keys"
    assert securevfl_cli("keys", "--config", str(config), "--out", str(keys)).returncode == 0
    rogue = d / "rogue-keys"
    assert securevfl_cli("keys", "--config", str(config), "--out", str(rogue)).returncode == 0
    # the rogue party pins the real aggregator key but presents its own, unlisted key
    public = json.loads((keys / "public.json").read_text())
    rogue_public = json.loads((rogue / "public.json").read_text())
    rogue_public["roles"]["aggregator"] = public["roles"]["aggregator"]
    (rogue / "public.json").write_text(json.dumps(rogue_public))
    # a port the kernel just handed out to bind(): odd, and Linux picks even local ports for
    # the party's connect(), so its retries cannot take the port before the aggregator binds
    address = f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    role = [sys.executable, "-m", "securevfl"]
    party = subprocess.Popen(
        [
            *role,
            "party",
            "--config",
            str(config),
            "--name",
            "alpha",
            "--out",
            str(d / "alpha"),
            "--keys",
            str(rogue),
            "--address",
            address,
            "--data",
            str(d / "data.csv"),
            "--set",
            "network.startup_timeout=60.0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    agg = None
    try:
        party_log = d / "alpha" / "logs" / "alpha.log"
        until = time.monotonic() + 120
        while not (party_log.exists() and "connecting to the aggregator" in party_log.read_text()):
            assert party.poll() is None, party.communicate()
            assert time.monotonic() < until, "the party never started connecting"
            time.sleep(0.05)
        agg = subprocess.Popen(
            [*role, "aggregator", "--config", str(config), "--out", str(d / "agg")]
            + ["--keys", str(keys), "--bind", address],
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        party_err = party.communicate(timeout=60)[1]
        agg_err = agg.communicate(timeout=60)[1]
    finally:
        for proc in (party, agg):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert party.returncode != 0
    assert "refused the CURVE key of 'alpha'" in party_err
    log = (d / "agg" / "logs" / "aggregator.log").read_text()
    assert "not in the federation allowlist" in log
    assert agg.returncode != 0 and "did not connect" in agg_err


def test_a_ckks_value_beyond_the_declared_magnitude_stops_the_run_with_the_fix(small_federation):
    """CKKS decrypts a sum past its modulus to wrong numbers rather than failing, so a party
    refuses to encrypt a value the sized parameters cannot carry: declared far too small here
    (`[secure] ckks.magnitude = 0.01`), the run stops at once, every role, and the active
    party names the value, the limit and the fix."""
    raw, d = small_federation
    raw["run"]["aggregation"] = "ckks"
    raw.setdefault("secure", {})["ckks"] = {"magnitude": 0.01}
    raw["train"].update({"epochs": 1})
    config = write_toml(permissive_policy(raw), d / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(d / "run"), timeout=240)
    assert done.returncode != 0
    assert "contribution to the CKKS sum" in done.stderr
    assert "set a larger [secure] ckks.magnitude" in done.stderr
    assert "securevfl active:" in done.stderr and "failed: ValueError" in done.stderr
    assert "no heartbeat" not in done.stderr  # reported, not noticed as a lost peer
    assert not (d / "run" / "metrics.json").exists()


def test_one_ctrl_c_stops_every_role_once_and_resume_finishes(small_federation):
    """Ctrl-C in a terminal sends SIGINT to every process of the group, and `securevfl run`
    passes it on to its roles as well: each role stops once (a second SIGINT cannot break its
    clean-up), the run ends 130 within the deadline with one line saying how to continue, no
    role is left running, and `--resume` finishes the run."""
    import signal
    import time

    raw, d = small_federation
    epochs = 10
    raw["train"].update({"epochs": epochs, "batch_size": 16})
    config = write_toml(raw, d / "config.toml")
    run_dir = d / "run"
    with run_until_epoch(config, run_dir, group=True, deadline=120) as (proc, pids):
        os.killpg(proc.pid, signal.SIGINT)  # what one Ctrl-C does
        interrupted = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
    finished = (run_dir / "metrics.json").exists()  # the signal was ignored, or came late
    assert proc.returncode == 130, (f"finished: {finished}", stderr)
    assert time.monotonic() - interrupted < 60
    assert stderr.count("interrupted; continue later with --resume") == 1, stderr
    assert "Traceback" not in stderr, stderr
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    resumed = securevfl_cli("run", str(config), "--out", str(run_dir), "--resume", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after epoch" in resumed.stdout
    assert len(json.loads((run_dir / "metrics.json").read_text())["history"]) == epochs
