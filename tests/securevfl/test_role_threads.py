"""Every role process sets its own thread count ([run] threads), whichever command starts it:
in the environment before NumPy or torch is imported (BLAS and OpenMP read it once, then), and
in torch. A variable the user set wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from securevfl import cli
from securevfl.launcher import cpu_env, pinned_cores
from securevfl.threads import (
    CPU_ENV,
    THREAD_VARS,
    configured_threads,
    default_threads,
    set_thread_env,
)
from tests.securevfl.test_cli_mistakes import make_setup

# a `securevfl party` process whose role loop is replaced by a report: the thread variables
# seen when numpy and torch were first imported, torch's and the BLAS libraries' thread counts
PROBE = r"""
import json, os, sys, types
VARS = tuple(os.environ["PROBE_VARS"].split(","))
seen = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in ("numpy", "torch") and name not in seen:
            seen[name] = {v: os.environ.get(v) for v in VARS}
        return None
sys.meta_path.insert(0, Watch())
fake = types.ModuleType("securevfl.roles.party")
def run_party(cfg, **kwargs):
    import threadpoolctl, torch
    blas = {i["internal_api"]: i["num_threads"] for i in threadpoolctl.threadpool_info()}
    cpus = sorted(os.sched_getaffinity(0))
    report = {"torch": torch.get_num_threads(), "seen": seen, "blas": blas, "cpus": cpus}
    print(json.dumps(report))
    return 0
fake.run_party = run_party
sys.modules["securevfl.roles.party"] = fake
from securevfl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def probe_party(tmp_path, *extra: str, env: dict[str, str] | None = None) -> dict:
    s = make_setup(tmp_path)
    clean = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARS, CPU_ENV)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *s.role("party", *extra, name="alpha")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "PROBE_VARS": ",".join(THREAD_VARS), **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_party_command_uses_the_configured_threads_from_before_numpy_is_imported(tmp_path):
    report = probe_party(tmp_path, "--set", "run.threads=3")
    assert report["torch"] == 3
    for module in ("numpy", "torch"):
        assert report["seen"][module] == dict.fromkeys(THREAD_VARS, "3"), module


def test_blas_runs_the_configured_threads(tmp_path):
    pytest.importorskip("threadpoolctl")
    report = probe_party(tmp_path, "--set", "run.threads=1")
    assert report["torch"] == 1
    assert report["blas"] and set(report["blas"].values()) == {1}, report["blas"]


def test_the_users_omp_num_threads_wins(tmp_path):
    report = probe_party(tmp_path, "--set", "run.threads=3", env={"OMP_NUM_THREADS": "2"})
    assert report["torch"] == 2
    assert report["seen"]["numpy"] == dict.fromkeys(THREAD_VARS, "2")


def test_set_thread_env_fills_only_what_the_user_left_unset():
    env = {"MKL_NUM_THREADS": "7"}
    assert set_thread_env(3, env) == 3
    assert env == {**dict.fromkeys(THREAD_VARS, "3"), "MKL_NUM_THREADS": "7"}
    env = {"OMP_NUM_THREADS": "2"}
    assert set_thread_env(3, env) == 2 and env == dict.fromkeys(THREAD_VARS, "2")
    env = {"OMP_NUM_THREADS": "lots"}  # not a count: the configured one is used elsewhere
    assert set_thread_env(3, env) == 3 and env["OMP_NUM_THREADS"] == "lots"


@pytest.mark.parametrize(
    ("shared", "cores", "expected"),
    [(True, 64, 1), (False, 1, 1), (False, 2, 1), (False, 6, 3), (False, 64, 4)],
)
def test_default_threads(shared, cores, expected):
    assert default_threads(shared=shared, cores=cores) == expected


def test_configured_threads_reads_the_file_and_set_without_numpy(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\nthreads = 5\n")
    assert configured_threads(path) == 5
    assert configured_threads(path, {"run.threads": 2}) == 2
    assert configured_threads(tmp_path / "missing.toml") is None
    path.write_text("[run]\nthreads = 0\n")  # invalid: load_config says so later
    assert configured_threads(path) is None
    path.write_bytes(b"\xff")
    assert configured_threads(path) is None


@pytest.mark.parametrize(
    ("extra", "expected"), [((), "1"), (("--set", "run.threads=2"), "2")], ids=["default", "set"]
)
def test_run_gives_its_roles_one_thread_each_unless_configured(
    tmp_path, monkeypatch, extra, expected
):
    """`securevfl run` sets the count in its own environment, which its role processes
    inherit (the launcher copies it)."""
    s = make_setup(tmp_path)
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    cli._prepare_threads(cli.build_parser().parse_args(s.run(*extra)))
    assert {v: os.environ[v] for v in THREAD_VARS} == dict.fromkeys(THREAD_VARS, expected)


def test_a_role_command_alone_defaults_to_half_the_cores(tmp_path, monkeypatch):
    s = make_setup(tmp_path)
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    cli._prepare_threads(cli.build_parser().parse_args(s.role("aggregator")))
    assert os.environ["OMP_NUM_THREADS"] == str(default_threads(shared=False))


ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(ALLOWED) < 2, reason="pinning needs at least two usable cores")
def test_a_role_pins_itself_to_the_core_its_launcher_names_before_it_starts(tmp_path):
    """`SECUREVFL_CPU=k`: the role process runs on the k-th usable core (modulo their number),
    set before torch starts its threads; unset, it may run on every core."""
    for sub in "abc":
        (tmp_path / sub).mkdir()
    report = probe_party(tmp_path / "a", env={CPU_ENV: "1"})
    assert report["cpus"] == [ALLOWED[1]]
    report = probe_party(tmp_path / "b", env={CPU_ENV: str(len(ALLOWED))})
    assert report["cpus"] == [ALLOWED[0]]  # modulo the cores
    assert probe_party(tmp_path / "c")["cpus"] == ALLOWED


def test_a_bad_core_index_stops_the_role_naming_the_variable(tmp_path):
    s = make_setup(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "securevfl", *s.role("party", name="alpha")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, CPU_ENV: "first"},
    )
    assert done.returncode == 2
    assert "SECUREVFL_CPU='first' is not a core index" in done.stderr
    assert "unset it" in done.stderr


def test_the_launcher_pins_the_active_party_and_the_aggregator_apart_then_the_parties():
    """Round-robin in the launcher's order: active party, aggregator, parties; none with
    [run] pin_cores = false; an inherited SECUREVFL_CPU never reaches an unpinned role."""
    from types import SimpleNamespace

    cmds = dict.fromkeys(["aggregator", "p1", "bank", "p2", "p3"], [])
    cfg = SimpleNamespace(pin_cores=True, active_name="bank")
    assert pinned_cores(cfg, cmds) == {"bank": 0, "aggregator": 1, "p1": 2, "p2": 3, "p3": 4}
    colocated = {k: v for k, v in cmds.items() if k != "aggregator"}
    assert pinned_cores(cfg, colocated) == {"bank": 0, "p1": 1, "p2": 2, "p3": 3}
    assert pinned_cores(SimpleNamespace(pin_cores=False, active_name="bank"), cmds) == {}
    assert cpu_env({"A": "1", CPU_ENV: "7"}, 2) == {"A": "1", CPU_ENV: "2"}
    assert cpu_env({"A": "1", CPU_ENV: "7"}, None) == {"A": "1"}


def test_pin_cores_is_a_boolean_of_run(tmp_path):
    from securevfl.config import ConfigError, load_config

    s = make_setup(tmp_path)
    assert load_config(s.config).pin_cores is True
    assert load_config(s.config, overrides={"run.pin_cores": False}).pin_cores is False
    with pytest.raises(ConfigError, match="pin_cores"):
        load_config(s.config, overrides={"run.pin_cores": "yes"})


def test_a_system_that_refuses_to_pin_leaves_the_role_unpinned(monkeypatch):
    """Pinning is an optimisation: where the system refuses it (a container's policy) the role
    runs unpinned instead of failing."""
    from securevfl import threads

    def refuse(pid, cpus):
        raise PermissionError("not here")

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.os, "sched_setaffinity", refuse)
    assert threads.pin_from_env({CPU_ENV: "1"}) is None
    assert threads.pin_from_env({CPU_ENV: ""}) is None
    with pytest.raises(ValueError, match="SECUREVFL_CPU='-1'"):
        threads.pin_from_env({CPU_ENV: "-1"})
