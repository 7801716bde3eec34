"""`securevfl audit RUN_DIR`: the table, JSON, the attack, and clear refusals; and exit status 3
from `securevfl run` when a budget runs out."""

from __future__ import annotations

import json

import pytest

from securevfl.cli import main as cli_main
from securevfl.inproc import run_federation
from securevfl.privacy.audit import NO_GUARANTEE
from securevfl.privacy.ledger import LEDGER_FILENAME
from securevfl.roles import protocol as P
from tests.securevfl.conftest import make_config, securevfl_cli, write_toml


@pytest.fixture
def plain_run(small_federation):
    """A 2-epoch plain run with label DP whose parties keep what they receive."""
    raw, d = small_federation
    raw["run"]["aggregation"] = "plain"
    raw["train"]["epochs"] = 2
    raw["privacy"] = {"label_dp": {"noise_multiplier": 1.0, "clip": 1.0}, "record_received": True}
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    return d / "run"


def test_audit_prints_epsilon_per_role_and_mechanism_and_unprotected_releases(plain_run, capsys):
    assert cli_main(["audit", str(plain_run)]) == 0
    out = capsys.readouterr().out
    assert f"Privacy audit of {plain_run / LEDGER_FILENAME}" in out
    label_line = next(line for line in out.splitlines() if "label_dp" in line)
    assert label_line.split()[:3] == ["active", "label_dp", "5.42"]  # sigma 1, 2 steps
    assert f"Releases with {NO_GUARANTEE}:" in out
    for party in ("alpha", "beta", "gamma"):
        assert any(
            line.startswith(party) and "aggregation = plain" in line for line in out.splitlines()
        )


def test_audit_attack_scores_each_party_and_says_whose_labels_it_used(plain_run, capsys):
    assert cli_main(["audit", str(plain_run), "--attack", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["leakage"]) == {"alpha", "beta", "gamma"}
    assert report["leakage_labels"].endswith("data/active.csv")
    assert cli_main(["audit", str(plain_run), "--attack"]) == 0
    out = capsys.readouterr().out
    assert "only the active party holds" in out and "cooperation" in out


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--attack"], "record_received = true"),
        (["--delta", "2"], "--delta: must be in (0, 1)"),
    ],
)
def test_audit_refuses_what_it_cannot_do(small_federation, capsys, args, words):
    raw, d = small_federation
    raw["train"]["epochs"] = 1
    code, _ = run_federation(make_config(raw, d), out=d / "run")
    assert code == 0
    assert cli_main(["audit", str(d / "run"), *args]) == P.EXIT_USAGE
    assert words in capsys.readouterr().err


def test_audit_of_a_directory_without_a_ledger_exits_2(tmp_path, capsys):
    assert cli_main(["audit", str(tmp_path)]) == P.EXIT_USAGE
    assert "no privacy ledger" in capsys.readouterr().err


def test_run_exits_3_when_a_party_budget_runs_out_and_the_audit_shows_it(small_federation):
    """Through the command, the roles as threads of one process (every role's own status as a
    process: test_role_exit_statuses.py, test_hostile_roles.py)."""
    raw, d = small_federation
    raw["run"]["transport"] = "inproc"
    raw["train"]["epochs"] = 4
    raw["parties"]["gamma"]["embedding_dp"] = {"noise_multiplier": 2.0, "clip": 1.0}
    raw["parties"]["gamma"]["max_epsilon"] = 2.5  # two epochs fit (2.33), a third does not
    config = write_toml(raw, d / "config.toml")
    done = securevfl_cli("run", str(config), "--out", str(d / "run"), timeout=180)
    assert done.returncode == P.EXIT_BUDGET, done.stderr
    assert "privacy budget exhausted for role 'gamma', mechanism 'embedding_dp' at epoch 3" in (
        done.stderr
    )
    audited = securevfl_cli("audit", str(d / "run"), "--json", timeout=60)
    assert audited.returncode == 0, audited.stderr
    row = next(m for m in json.loads(audited.stdout)["mechanisms"] if m["role"] == "gamma")
    assert row["mechanism"] == "embedding_dp" and row["steps"] == 2 and row["epsilon"] <= 2.5
