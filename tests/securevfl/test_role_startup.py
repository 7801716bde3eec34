"""What a role process loads and how it ends, which every real run pays for in each of its
processes: the aggregator never loads torch; a passive party without DP loads neither Opacus nor
scikit-learn; a role command ends right after its exit hooks and threads (no teardown of the
interpreter), with its status and nothing lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.securevfl.test_cli_mistakes import make_setup

REPO = Path(__file__).resolve().parents[2]


def test_a_party_and_the_rounds_load_neither_opacus_nor_scikit_learn():
    probe = (
        "import sys\n"
        "import securevfl.roles.party, securevfl.roles.rounds, securevfl.privacy.ledger\n"
        "import securevfl.privacy.runtime\n"
        "print(sorted(m for m in ('opacus', 'sklearn', 'scipy.stats') if m in sys.modules))\n"
        "from securevfl.privacy import epsilon\n"  # the package's names still resolve
        "print(round(epsilon(history=[(1.0, 1.0, 1)], delta=1e-5), 3), 'opacus' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    unloaded, computed = done.stdout.splitlines()
    assert unloaded == "[]"
    assert computed.endswith("True")  # an accountant loads Opacus when it is used


def test_the_aggregator_process_never_maps_torch(tmp_path):
    """Checked on the running process (its memory maps), waiting for its roles."""
    s = make_setup(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "securevfl",
            "aggregator",
            "--config",
            str(s.config),
            "--out",
            str(s.out),
            "--keys",
            str(s.keys),
            "--bind",
            "tcp://127.0.0.1:0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        log = s.out / "logs" / "aggregator.log"
        deadline = time.monotonic() + 60
        while not (log.exists() and "listening on" in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "it did not start"
            time.sleep(0.1)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "zmq" in maps  # the process's own maps: pyzmq is loaded
        assert "libtorch" not in maps
    finally:
        proc.kill()
        proc.wait()


EXIT_PROBE = r"""
import atexit, sys, threading, time
from pathlib import Path
from securevfl import cli
out = Path(sys.argv[1])
class Finalised:
    def __del__(self):
        out.joinpath("finalised").write_text("yes")
keep = Finalised()  # collected only in the interpreter's teardown
def role(argv):
    atexit.register(lambda: out.joinpath("atexit").write_text("ran"))
    def slow():
        time.sleep(0.3)
        out.joinpath("thread").write_text("done")
    threading.Thread(target=slow).start()  # not a daemon: exit waits for it
    print("said", end="")  # buffered: flushed before the exit
    import logging
    logging.getLogger("probe").addHandler(logging.FileHandler(out / "log.txt"))
    logging.getLogger("probe").warning("logged")
    return 3
cli.main = role
sys.argv = ["securevfl", sys.argv[2]]
cli.entry()
"""


def test_a_role_command_exits_after_its_hooks_and_threads_without_the_teardown(tmp_path):
    for command in ("party", "example"):
        out = tmp_path / command
        out.mkdir()
        done = subprocess.run(
            [sys.executable, "-c", EXIT_PROBE, str(out), command],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert done.returncode == 3 and done.stdout == "said", (done.stdout, done.stderr)
        assert (out / "atexit").read_text() == "ran" and (out / "thread").read_text() == "done"
        assert "logged" in (out / "log.txt").read_text()
        # a role skips the interpreter's teardown; any other command exits as Python does
        assert (out / "finalised").exists() == (command != "party"), command


def test_the_privacy_packages_names_all_resolve_and_audit_stays_the_function():
    probe = (
        "import securevfl.privacy.audit\n"  # the submodule first: it must not shadow the name
        "import securevfl.privacy as p\n"
        "assert all(getattr(p, n) is not None for n in p.__all__)\n"
        "from securevfl.privacy import audit\n"
        "print(callable(audit) and callable(p.audit) and audit.__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "securevfl.privacy.audit"
