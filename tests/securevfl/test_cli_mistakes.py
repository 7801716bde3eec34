"""Ordinary mistakes a new user makes on the command line, each refused before any role starts:
exit status 2, one line on stderr naming the problem (no traceback), and no role run (the
launcher never starts a process, no role function is called, no role log is written).

The commands run in this process (`securevfl.cli.main`), with spies in place of the launcher's
process start and of the role loops; two run as real `python -m securevfl` processes."""

from __future__ import annotations

import copy
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from securevfl import cli
from securevfl.errors import ConfigError
from securevfl.keys import generate_keys
from securevfl.threads import THREAD_VARS
from tests.securevfl.conftest import BASE_RAW, securevfl_cli, synthetic_csv, write_toml

PARTIES = ("alpha", "beta", "gamma")


@dataclass
class Setup:
    """A small federation written to disk: config, joint table, per-role tables, keys."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def out(self) -> Path:
        return self.root / "run"

    def write_config(self, name: str, text: str | bytes) -> Path:
        path = self.root / name
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return path

    def role(self, command: str, *extra: str, name: str | None = None) -> list[str]:
        argv = [command, "--config", str(self.config), "--out", str(self.out)]
        argv += ["--keys", str(self.keys)]
        if name is not None:
            argv += ["--name", name, "--data", str(self.root / f"{name}.csv")]
        return [*argv, *extra]

    def run(self, *extra: str, config: Path | None = None) -> list[str]:
        return ["run", str(config or self.config), "--out", str(self.out), *extra]


def make_setup(root: Path) -> Setup:
    s = Setup(root)
    synthetic_csv(root / "data.csv", n=60)
    raw = copy.deepcopy(BASE_RAW)
    raw["train"]["epochs"] = 1
    write_toml(raw, s.config)
    lines = (root / "data.csv").read_text().splitlines()
    header = lines[0].split(",")
    for i, p in enumerate(PARTIES):  # each party's own table: the id and its two columns
        cols = [0, 1 + 2 * i, 2 + 2 * i]
        rows = [",".join(line.split(",")[c] for c in cols) for line in lines]
        (root / f"{p}.csv").write_text("\n".join(rows) + "\n")
    assert header[0] == "ID"
    generate_keys(["active", *PARTIES], s.keys)
    return s


# --------------------------------------------------------------------------------- the mistakes


def _config_with(s: Setup, old: str, new: str) -> Path:
    return s.write_config("edited.toml", s.config.read_text().replace(old, new, 1))


def _table_with(s: Setup, edit: Callable[[list[str]], None]) -> str:
    lines = (s.root / "data.csv").read_text().splitlines()
    edit(lines)
    (s.root / "edited.csv").write_text("\n".join(lines) + "\n")
    return "data.path=edited.csv"


def _relabel(recode: Callable[[str], str]) -> Callable[[list[str]], None]:
    """An edit of the joint table's rows: every label (the last cell) recoded."""

    def edit(lines: list[str]) -> None:
        for i in range(1, len(lines)):
            cells = lines[i].split(",")
            lines[i] = ",".join([*cells[:-1], recode(cells[-1])])

    return edit


def _busy_port(s: Setup) -> list[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    s.busy = listener  # closed by the test
    port = listener.getsockname()[1]
    return s.role("aggregator", "--set", f"network.aggregator=tcp://127.0.0.1:{port}")


def _other_run_secret(s: Setup) -> list[str]:
    other = s.root / "other-keys"
    generate_keys(["active", *PARTIES], other)
    shutil.copyfile(other / "secret" / "alpha.json", s.keys / "secret" / "alpha.json")
    return s.role("party", name="alpha")


def _unreadable_secret(s: Setup) -> list[str]:
    secret = s.keys / "secret" / "alpha.json"
    secret.unlink()
    secret.mkdir(mode=0o700)  # unreadable as a file, whoever runs the test (root included)
    return s.role("party", name="alpha")


def _group_readable_secret(s: Setup) -> list[str]:
    (s.keys / "secret" / "alpha.json").chmod(0o640)
    return s.role("party", name="alpha")


def _damaged_public(s: Setup) -> list[str]:
    (s.keys / "public.json").write_text("{")
    return s.role("party", name="alpha")


def _keys_of_fewer_roles(s: Setup) -> list[str]:
    shutil.rmtree(s.keys)
    generate_keys(["active", "alpha", "beta"], s.keys)
    return s.role("party", name="alpha")


def _out_is_a_file(s: Setup) -> list[str]:
    s.out.write_text("not a directory")
    return s.run()


def _resume_nothing(s: Setup) -> list[str]:
    s.out.mkdir()
    return s.run("--resume")


def _cuda(s: Setup) -> list[str]:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: cuda is no mistake here")
    return s.run("--set", 'run.device="cuda"')


# (id, argv from the setup, words the one line must hold)
MISTAKES: list[tuple[str, Callable[[Setup], list[str]], str]] = [
    ("config file missing", lambda s: s.run(config=s.root / "nope.toml"), "does not exist"),
    (
        "config not TOML",
        lambda s: s.run(config=s.write_config("bad.toml", "[run\nx = 1")),
        "not valid TOML",
    ),
    (
        "config not UTF-8",
        lambda s: s.run(config=s.write_config("bin.toml", b"\xff\xfe[run]\n")),
        "not UTF-8",
    ),
    ("config is a directory", lambda s: s.run(config=s.root), "is a directory"),
    (
        "unknown section",
        lambda s: s.run(config=_config_with(s, "[train]", "[trian]")),
        "[trian]: unknown section",
    ),
    ("unknown method", lambda s: s.run("--set", "run.method=foo"), "unknown value 'foo'"),
    ("--set without a value", lambda s: s.run("--set", "run.method"), "SECTION.KEY=VALUE"),
    ("--set unknown key", lambda s: s.run("--set", "run.bogus=1"), "[run] bogus: unknown key"),
    ("negative epochs", lambda s: s.run("--set", "train.epochs=-1"), "[train] epochs"),
    ("epochs in words", lambda s: s.run("--set", 'train.epochs="ten"'), "must be an integer"),
    ("zero threads", lambda s: s.run("--set", "run.threads=0"), "[run] threads"),
    ("cuda without a GPU", _cuda, "no GPU is visible"),
    (
        "missing data file",
        lambda s: s.run("--set", "data.path=missing.csv"),
        "missing.csv does not exist",
    ),
    (
        "data path is a directory",
        lambda s: (s.root / "sub").mkdir() or s.run("--set", "data.path=sub"),
        "is not a file",
    ),
    ("missing id column", lambda s: s.run("--set", "data.id=NOID"), "no id column 'NOID'"),
    (
        "missing label column",
        lambda s: s.run("--set", "data.label=OUTCOME"),
        "no label column 'OUTCOME'",
    ),
    (
        "a party names a column the table lacks",
        lambda s: s.run("--set", 'parties.alpha={ columns = ["X1", "X9"] }'),
        "no column 'X9', which [parties.alpha] columns names",
    ),
    (
        "duplicate ids",
        lambda s: s.run("--set", _table_with(s, lambda rows: rows.append(rows[1]))),
        "identifiers must be unique",
    ),
    (
        "an empty id",
        lambda s: s.run(
            "--set",
            _table_with(s, lambda rows: rows.__setitem__(2, "," + rows[2].split(",", 1)[1])),
        ),
        "empty identifier",
    ),
    (
        "empty party name",
        lambda s: s.run(config=_config_with(s, "[parties.gamma]", '[parties.""]')),
        "cannot be empty",
    ),
    (
        "party name with spaces",
        lambda s: s.run(config=_config_with(s, "[parties.gamma]", '[parties."Gamma Ltd"]')),
        "may use only",
    ),
    (
        "a party named aggregator",
        lambda s: s.run(config=_config_with(s, "[parties.gamma]", "[parties.aggregator]")),
        "reserved for the aggregator",
    ),
    (
        "binary labels other than 0/1",
        lambda s: s.run("--set", _table_with(s, _relabel(lambda y: str(int(float(y)) + 1)))),
        "task 'binary' needs labels 0 and 1, but the label column has 2 distinct label(s), read "
        "as [1.0, 2.0]",
    ),
    (
        "class labels that are not integers",
        lambda s: s.run(
            "--set",
            _table_with(s, _relabel(lambda y: str(float(y) + 0.5))),
            "--set",
            'data.task="multiclass"',
        ),
        "needs class labels 0..C-1",
    ),
    ("--out is a file", _out_is_a_file, "is a file, not a directory"),
    ("--resume of nothing", _resume_nothing, "holds no run to resume"),
    (
        "unknown --name",
        lambda s: s.role("party", "--name", "nobody"),
        "no passive party 'nobody'",
    ),
    (
        "missing keys directory",
        lambda s: s.role("party", "--keys", str(s.root / "nokeys"), name="alpha"),
        "keys directory",
    ),
    ("key file of another run", _other_run_secret, "does not match"),
    ("unreadable key file", _unreadable_secret, "cannot read"),
    ("group-readable key file", _group_readable_secret, "chmod 600"),
    ("damaged public.json", _damaged_public, "not valid JSON"),
    ("keys of another federation's roles", _keys_of_fewer_roles, "has no keys for ['gamma']"),
    (
        "party's own table missing",
        lambda s: s.role("party", name="alpha") + ["--data", str(s.root / "alhpa.csv")],
        "alhpa.csv does not exist",
    ),
    (
        "party given another party's table",
        lambda s: s.role("party", name="alpha") + ["--data", str(s.root / "beta.csv")],
        "no column 'X1', which [parties.alpha] columns names",
    ),
    (
        "active party's table without labels",
        lambda s: s.role("active", "--data", str(s.root / "alpha.csv")),
        "no label column 'Y'",
    ),
    (
        "address without tcp://",
        lambda s: s.role("party", "--address", "127.0.0.1:5555", name="alpha"),
        "tcp://HOST:PORT",
    ),
    (
        "port in use",
        _busy_port,
        "is in use; pick another: the aggregator listens on [network] bind",
    ),
    (
        "aggregator address of another host",
        lambda s: s.role("aggregator", "--set", "network.aggregator=tcp://192.0.2.1:5555"),
        "not an address of this host",
    ),
]


@pytest.fixture(autouse=True)
def _thread_env(monkeypatch):
    """`main` sets the thread variables it finds unset: keep this process's as they were."""
    for var in THREAD_VARS:
        monkeypatch.setenv(var, os.environ.get(var, "1"))


@pytest.fixture
def started(monkeypatch):
    """Every way a role could start, replaced by a spy that records it."""
    calls: list[str] = []

    def spy(name):
        def record(*args, **kwargs):
            calls.append(name)
            return 0

        return record

    import securevfl.launcher
    import securevfl.roles.active
    import securevfl.roles.aggregator
    import securevfl.roles.party

    monkeypatch.setattr(securevfl.launcher, "_start", spy("launcher"))
    monkeypatch.setattr(securevfl.roles.aggregator, "run_aggregator", spy("aggregator"))
    monkeypatch.setattr(securevfl.roles.active, "run_active", spy("active"))
    monkeypatch.setattr(securevfl.roles.party, "run_party", spy("party"))
    return calls


@pytest.mark.parametrize(
    ("make_argv", "words"),
    [pytest.param(m, w, id=i) for i, m, w in MISTAKES],
)
def test_an_ordinary_mistake_exits_2_with_one_line_before_any_role_starts(
    tmp_path, capsys, started, make_argv, words
):
    s = make_setup(tmp_path)
    argv = make_argv(s)
    try:
        code = cli.main(argv)
    finally:
        if hasattr(s, "busy"):
            s.busy.close()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("securevfl: "), err
    assert "Traceback" not in err
    assert words in lines[0], lines[0]
    assert started == [], f"{started} started"
    assert not (s.out / "logs").exists() and not (s.out / "pids.json").exists()


def test_the_mistakes_cover_what_the_issue_lists():
    names = {i for i, _, _ in MISTAKES}
    assert len(names) >= 21
    for listed in (
        "config file missing",
        "config not TOML",
        "unknown method",
        "unknown --name",
        "missing data file",
        "missing id column",
        "duplicate ids",
        "empty party name",
        "port in use",
        "missing keys directory",
        "key file of another run",
        "unreadable key file",
        "group-readable key file",
        "--set without a value",
        "--set unknown key",
        "negative epochs",
    ):
        assert listed in names


def test_debug_shows_the_traceback(tmp_path, capsys, started):
    s = make_setup(tmp_path)
    assert cli.main(["--debug", *s.run("--set", "data.id=NOID")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("securevfl: ")
    assert cli.main([*s.run("--set", "data.id=NOID"), "--debug"]) == 2  # after the command too
    assert "Traceback" in capsys.readouterr().err


def test_an_unexpected_error_is_one_line_that_points_at_debug(tmp_path, capsys, monkeypatch):
    def broken(args):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(cli, "_keys", broken)
    assert cli.main(["keys", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "securevfl: internal error: ZeroDivisionError: division by zero "
        "(rerun with --debug to see where)"
    ]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda s: s.run(config=_config_with(s, "[parties.gamma]", '[parties.""]')), "empty"),
        (_busy_port, "is in use"),
    ],
    ids=["empty party name", "port in use"],
)
def test_the_command_itself_exits_2_with_one_line(tmp_path, edit, words):
    """The same through `python -m securevfl` (these two once exited 241 and 1)."""
    s = make_setup(tmp_path)
    argv = edit(s)
    try:
        done = securevfl_cli(*argv, timeout=120, cwd=tmp_path)
    finally:
        if hasattr(s, "busy"):
            s.busy.close()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and words in lines[0], done.stderr
    assert not (s.out / "logs").exists()


def test_secret_key_files_are_created_0600_even_over_a_readable_file(tmp_path):
    """Item 6: key files are written owner-only (a file being replaced keeps no group or world
    bits), in an owner-only directory; reading one refuses group/world bits (above)."""
    keys = tmp_path / "keys"
    generate_keys(["active", "alpha"], keys)
    (keys / "secret" / "alpha.json").chmod(0o644)
    generate_keys(["active", "alpha"], keys, overwrite=True)
    assert (keys / "secret").stat().st_mode & 0o777 == 0o700
    for role in ("aggregator", "active", "alpha"):
        assert (keys / "secret" / f"{role}.json").stat().st_mode & 0o777 == 0o600, role


def test_run_binds_the_aggregator_on_loopback_only(tmp_path, monkeypatch):
    """Item 6: `securevfl run` puts every role on one host, so its aggregator listens on
    127.0.0.1 (never on all interfaces); multi-host runs name the address (`--bind`)."""
    import securevfl.launcher as L

    s = make_setup(tmp_path)
    seen = {}
    monkeypatch.setattr(L, "_start", lambda cmds, *a, **k: seen.update(cmds) or 0)
    assert cli.main(s.run()) == 0
    agg = seen["aggregator"]
    bind = agg[agg.index("--bind") + 1]
    # port 0: the kernel picks a free port as it binds, so no other process can take it first
    assert bind == "tcp://127.0.0.1:0", bind
    for role in ("active", *PARTIES):
        cmd = seen[role]
        assert "--address" not in cmd  # each reads where the aggregator listens, once it does
        assert Path(cmd[cmd.index("--address-file") + 1]).name == L.ENDPOINT_FILE


def test_the_address_file_is_written_whole_and_awaited(tmp_path, monkeypatch):
    """The local launcher's rendezvous: the binding role writes its address atomically (a
    reader never sees half of it), only when the launcher asked; a reader that waits past the
    start-up timeout is told which file never came and where to look."""
    import securevfl.launcher as L
    from securevfl.roles import protocol as P

    target = tmp_path / L.ENDPOINT_FILE
    monkeypatch.delenv(P.ENDPOINT_FILE_ENV, raising=False)
    P.announce_endpoint("tcp://127.0.0.1:41234")
    assert not target.exists()  # not asked: nothing written
    monkeypatch.setenv(P.ENDPOINT_FILE_ENV, str(target))
    P.announce_endpoint("inproc://aggregator-local")  # an in-process hub has no address to give
    assert not target.exists()
    P.announce_endpoint("tcp://127.0.0.1:41234")
    assert target.read_text() == "tcp://127.0.0.1:41234\n"
    assert [p.name for p in tmp_path.iterdir()] == [L.ENDPOINT_FILE]  # no temporary file left
    assert L.await_address(target, timeout=0.1) == "tcp://127.0.0.1:41234"
    with pytest.raises(P.RunAborted, match=r"did not write its address to .*within 0.2 s"):
        L.await_address(tmp_path / "never.txt", timeout=0.2)
    (tmp_path / "bad.txt").write_text("tcp://127.0.0.1:0\n")
    with pytest.raises(ConfigError, match="port 0"):
        L.await_address(tmp_path / "bad.txt", timeout=0.1)


@pytest.mark.parametrize("command", [["example"], ["methods", "laser"]])
def test_output_into_a_closed_pipe_ends_quietly(command):
    """`securevfl audit RUN | head`: the reader stops early; the command ends with nothing on
    stderr (no BrokenPipeError traceback): 141 as a shell reports a command its closed pipe
    stopped, where the write met it (PYTHONUNBUFFERED, as here), 0 where only the exit's flush
    did (the command had finished)."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "securevfl", *command],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode in (0, 141) and done.stderr == "", done.stderr


def test_a_failed_command_keeps_its_status_when_its_output_pipe_is_closed():
    """`securevfl run ... | head` under `set -o pipefail`: the pipe closing must not turn the
    command's own failure into success."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from securevfl import cli\n"
        "def failing(args):\n"
        "    print('some output')\n"  # buffered (PYTHONUNBUFFERED unset below)
        "    return 4\n"
        "cli._dispatch = failing\n"
        "sys.argv = ['securevfl', 'example']\n"
        "cli.entry()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:  # finished: the exit's flush meets the closed pipe
        done = subprocess.run(
            [sys.executable, "-c", probe], stdout=write, stderr=subprocess.PIPE, text=True, env=env
        )
    finally:
        os.close(write)
    assert done.returncode == 4 and done.stderr == "", done.stderr
    probe = probe.replace("return 4", "print('more', flush=True)\n    return 4")
    read, write = os.pipe()
    os.close(read)
    try:  # cut short by the closed pipe mid-command: not a success
        done = subprocess.run(
            [sys.executable, "-c", probe], stdout=write, stderr=subprocess.PIPE, text=True, env=env
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == "", done.stderr


def test_the_active_party_started_alone_refuses_labels_its_task_cannot_train_on(tmp_path, capsys):
    """On its own host (`securevfl active`, no split before it) the active party checks its
    labels before it connects: status 2 and the fix, not an internal error (1) while the
    other roles wait for it."""
    s = make_setup(tmp_path)
    _table_with(s, _relabel(lambda y: str(int(float(y)) + 1)))
    argv = s.role("active", "--data", str(s.root / "edited.csv"))
    argv += ["--address", "tcp://127.0.0.1:9"]  # nothing listens: it must not get that far
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "needs labels 0 and 1" in err and 'positive = "2"' in err, err
    assert "Traceback" not in err


def test_class_count_refuses_labels_the_task_cannot_train_on():
    import numpy as np

    from securevfl.errors import DataError, exit_code_for
    from securevfl.methods.blocks.nets import class_count

    assert class_count("binary", np.array([0.0, 1.0, np.nan])) == 2
    assert class_count("multiclass", np.array([0.0, 2.0, 1.0])) == 3
    assert class_count("regression", np.array([0.3, 7.5])) == 1
    assert class_count("binary", np.array([1.0, 1.0])) == 2  # one class seen: still two outputs
    for task, labels, words in [
        ("binary", [1.0, 2.0], 'positive = "2"'),
        ("binary", [-1.0, 1.0], 'positive = "1"'),
        ("binary", [0.0, 1.0, 2.0], "'multiclass' for more than two classes"),
        ("multiclass", [0.0, 1.5], "class labels 0..C-1"),
        ("multiclass", [-1.0, 1.0], "class labels 0..C-1"),
        ("multiclass", [0.0, 1e12], "class ids run up to"),
        ("multiclass", [0.0, np.inf], "finite class labels"),
        ("binary", [np.nan, np.nan], "holds no label"),
    ]:
        with pytest.raises(DataError, match=words) as caught:
            class_count(task, np.array(labels))
        assert exit_code_for(caught.value) == 2


def test_a_streamed_split_refuses_labels_its_task_cannot_train_on(tmp_path):
    """The split's streamed path (a table too big to hold) checks the labels as the in-memory
    path does, each distinct label once."""
    from securevfl.config import load_config
    from securevfl.data.table import split_federation

    s = make_setup(tmp_path)
    _table_with(s, _relabel(lambda y: str(int(float(y)) + 1)))
    cfg = load_config(_config_with(s, 'path = "data.csv"', 'path = "edited.csv"'))
    for stream in (False, True):
        with pytest.raises(
            ConfigError, match=r"\[data\] label: task 'binary' needs labels 0 and 1"
        ):
            split_federation(cfg, tmp_path / f"split-{stream}", stream=stream)
