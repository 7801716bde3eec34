"""Runs are reproducible from their directory (issue 16, item 4): the effective config (after
every `--set`) is recorded there; `--resume` refuses a config that differs in what decides the
model, the protocol, the privacy or the data unless `--force` (which is recorded in
effective_config.json, run.json and the ledger); operational settings may change; every role,
the aggregator included, resumes."""

from __future__ import annotations

import copy
import json
import os

import pytest

from securevfl import cli
from securevfl.errors import ConfigError
from securevfl.privacy.ledger import LEDGER_FILENAME, PrivacyLedger
from securevfl.run_record import EFFECTIVE_CONFIG, RUN_RECORD, read_record
from securevfl.threads import THREAD_VARS
from tests.securevfl.conftest import BASE_RAW, synthetic_csv, write_toml


@pytest.fixture(autouse=True)
def _thread_env(monkeypatch):
    for var in THREAD_VARS:
        monkeypatch.setenv(var, os.environ.get(var, "1"))


@pytest.fixture
def finished(tmp_path, capsys):
    """A finished two-epoch run (in-process transport) started with one `--set`."""
    synthetic_csv(tmp_path / "data.csv", n=120)
    raw = copy.deepcopy(BASE_RAW)
    raw["train"]["epochs"] = 2
    raw["run"]["transport"] = "inproc"
    config = write_toml(raw, tmp_path / "config.toml")
    out = tmp_path / "run"
    assert cli.main(["run", str(config), "--out", str(out), "--set", "train.lr=0.02"]) == 0
    capsys.readouterr()
    return config, out


def _resume(config, out, *extra):
    return cli.main(["run", str(config), "--out", str(out), "--resume", *extra])


def test_the_effective_config_after_set_is_recorded_with_its_hash(finished):
    _, out = finished
    record = json.loads((out / EFFECTIVE_CONFIG).read_text())
    assert record["config"]["lr"] == 0.02  # the --set value, not the file's
    assert record["overrides"] == {"train.lr": 0.02}  # and the --set itself
    assert record["config"]["aggregation"] == "mask" and record["config"]["epochs"] == 2
    assert len(record["hash"]) == 64 and set(record["data"]) >= {"table", "active", "alpha"}
    assert json.loads((out / RUN_RECORD).read_text())["config_hash"] == record["hash"]


def test_resume_refuses_a_changed_setting_naming_it_and_the_fix(finished, capsys):
    config, out = finished
    before = (out / EFFECTIVE_CONFIG).read_bytes()
    assert _resume(config, out, "--set", "train.lr=0.05") == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "lr 0.02 -> 0.05" in line and "--force" in line, line
    assert (out / EFFECTIVE_CONFIG).read_bytes() == before  # nothing rewritten


def test_resume_refuses_a_changed_data_file(finished, capsys):
    config, out = finished
    table = config.parent / "data.csv"
    lines = table.read_text().splitlines()
    lines[5] = lines[5].rsplit(",", 1)[0] + ",1"
    table.write_text("\n".join(lines) + "\n")
    assert _resume(config, out, "--set", "train.lr=0.02") == 2
    assert "data.table" in capsys.readouterr().err


def test_a_forced_resume_goes_on_and_is_recorded_everywhere(finished, capsys):
    config, out = finished
    old_hash = read_record(out)["hash"]
    assert _resume(config, out, "--set", "train.lr=0.05", "--force") == 0
    assert "--force" in capsys.readouterr().err  # a warning says what changed
    record = read_record(out)
    assert record["config"]["lr"] == 0.05 and record["hash"] != old_hash
    [entry] = [r for r in record["resumes"] if r["forced"]]
    assert entry["changed"]["lr"] == [0.02, 0.05] and entry["previous_hash"] == old_hash
    assert any(r["forced"] for r in json.loads((out / RUN_RECORD).read_text())["resumes"])
    notes = [e for e in PrivacyLedger.read(out / LEDGER_FILENAME) if isinstance(e, dict)]
    assert any(n.get("what") == "forced resume" and "lr" in n["detail"] for n in notes)


def test_an_operational_change_resumes_without_force_and_is_listed(finished):
    config, out = finished
    assert _resume(config, out, "--set", "train.lr=0.02", "--set", "network.round_timeout=45") == 0
    [entry] = read_record(out)["resumes"][-1:]
    assert not entry["forced"] and entry["changed"]["round_timeout"] == [30.0, 45.0]


@pytest.mark.parametrize("damage", [b"{", b"[]", b'{"schema": 9}', b"[" * 100_000])
def test_a_damaged_record_is_a_config_error_naming_it(finished, damage):
    _, out = finished
    (out / EFFECTIVE_CONFIG).write_bytes(damage)
    with pytest.raises(ConfigError, match=EFFECTIVE_CONFIG):
        read_record(out)


def test_every_role_command_resumes_and_checks_the_record_the_aggregator_included(
    tmp_path, capsys, monkeypatch
):
    """`securevfl aggregator|active|party --resume` are accepted (the aggregator used to refuse
    --resume) and each refuses a run directory whose record differs, before its role starts."""
    import securevfl.roles.active
    import securevfl.roles.aggregator
    import securevfl.roles.party
    from tests.securevfl.test_cli_mistakes import make_setup

    started: list[str] = []
    for module, name in (
        (securevfl.roles.aggregator, "run_aggregator"),
        (securevfl.roles.active, "run_active"),
        (securevfl.roles.party, "run_party"),
    ):
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: started.append(_n) or 0)
    s = make_setup(tmp_path)
    commands = {
        "aggregator": s.role("aggregator"),
        "active": [*s.role("active"), "--data", str(tmp_path / "data.csv")],
        "party": s.role("party", name="alpha"),
    }
    for argv in commands.values():
        assert cli.main(argv) == 0, capsys.readouterr().err  # records the config
        assert cli.main([*argv, "--resume"]) == 0, capsys.readouterr().err
    assert started == ["run_aggregator"] * 2 + ["run_active"] * 2 + ["run_party"] * 2
    started.clear()
    for command, argv in commands.items():
        assert cli.main([*argv, "--resume", "--set", "train.lr=0.5"]) == 2, command
        assert "differs from the one" in capsys.readouterr().err
    assert started == []


def test_fusing_rounds_is_operational_and_roles_sharing_a_folder_write_records_apart(tmp_path):
    from securevfl.run_record import operational

    assert operational("fuse_rounds")
    assert not operational("epochs")
    # each process writes its own temporary file, so two roles writing the same record at once
    # never rename (or lose) each other's
    import multiprocessing

    target = tmp_path / "effective_config.json"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_many, args=(target, 150)) for _ in range(3)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert [w.exitcode for w in writers] == [0, 0, 0]
    assert not list(tmp_path.glob("*.partial"))
    assert json.loads(target.read_text())["n"] == 149


def _write_many(target, n):
    from securevfl.run_record import _write_json

    for i in range(n):
        _write_json(target, {"n": i})


RESUMER = r"""
import sys, time
from pathlib import Path
from securevfl.config import load_config
from securevfl.run_record import check_resume
config, out, role, start = sys.argv[1], Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
cfg = load_config(config)
time.sleep(max(0.0, start - time.time()))  # every role at once, as `securevfl run` starts them
check_resume(out, cfg, data={}, force=True, who=role, config_path=Path(config), always_note=True)
"""


def test_roles_resuming_at_once_each_list_their_resume(finished):
    """The roles of a resumed run share the directory and each records its resume (read, add,
    write): started at the same instant, none of their entries is lost."""
    import subprocess
    import sys
    import time

    config, out = finished
    roles = ["aggregator", "active", "alpha", "beta", "gamma", "delta"]
    start = time.time() + 2.0
    procs = [
        subprocess.Popen([sys.executable, "-c", RESUMER, str(config), str(out), r, str(start)])
        for r in roles
    ]
    assert [p.wait(timeout=120) for p in procs] == [0] * len(roles)
    effective = json.loads((out / EFFECTIVE_CONFIG).read_text())
    run = json.loads((out / RUN_RECORD).read_text())
    assert sorted(e["by"] for e in effective["resumes"]) == sorted(roles)
    assert sorted(e["by"] for e in run["resumes"]) == sorted(roles)
