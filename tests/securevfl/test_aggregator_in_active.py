"""[network] aggregator_in_active: the aggregator as a thread of the active party's process (its
own hub for the parties, an in-process socket for the active party). The same model as with a
separate aggregator, one process fewer, and every party knows of it (its own config, the active
party's authenticated set-up) and may refuse it (`[policy] aggregator_in_active`)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from securevfl.config import ConfigError, load_config
from securevfl.direct import DirectFederation
from securevfl.errors import PolicyRefusal, RunAborted
from securevfl.roles.guard import call_tags, run_terms
from securevfl.roles.rounds import Call, fuse
from tests.securevfl.conftest import (
    BASE_RAW,
    make_config,
    securevfl_cli,
    synthetic_csv,
    write_toml,
)
from tests.securevfl.fixed_seeds import fixed_seeds
from tests.securevfl.test_pipeline import failing_method  # noqa: F401 (a fixture)

PARTIES = ("alpha", "beta", "gamma")


def raw_config(tmp_path: Path, *, aggregation: str = "mask", colocated: bool, epochs: int = 2):
    raw = fixed_seeds(copy.deepcopy(BASE_RAW))  # colocated and apart compared
    raw["run"]["aggregation"] = aggregation
    raw["train"].update({"epochs": epochs, "batch_size": 32})
    raw["network"]["aggregator_in_active"] = colocated
    if not (tmp_path / "data.csv").exists():
        synthetic_csv(tmp_path / "data.csv", n=300)
    return raw


def encoders(run_dir: Path, epoch: int) -> dict[str, dict[str, torch.Tensor]]:
    return {
        p: torch.load(run_dir / "checkpoints" / p / f"epoch_{epoch:04d}.pt")["method"]["encoder"]
        for p in PARTIES
    }


@pytest.mark.parametrize("aggregation", ["plain", "mask"])
def test_a_colocated_aggregator_trains_the_same_model_as_a_separate_one(tmp_path, aggregation):
    from securevfl.inproc import run_federation

    runs = {}
    for colocated in (False, True):
        cfg = make_config(
            raw_config(tmp_path, aggregation=aggregation, colocated=colocated), tmp_path
        )
        code, metrics = run_federation(cfg, out=tmp_path / f"run-{colocated}")
        assert code == 0
        runs[colocated] = metrics
    assert runs[True]["test"] == runs[False]["test"]
    assert [h["loss"] for h in runs[True]["history"]] == [h["loss"] for h in runs[False]["history"]]
    assert runs[True]["rounds"] == runs[False]["rounds"]
    apart, together = encoders(tmp_path / "run-False", 1), encoders(tmp_path / "run-True", 1)
    for p in PARTIES:
        for k, v in apart[p].items():
            assert torch.equal(v, together[p][k]), (p, k)
    # the aggregator ran in the active party's thread, its hub serving the active party in-process
    log = (tmp_path / "run-True" / "logs" / "aggregator.log").read_text()
    assert "in active's process" in log and "active connects in-process" in log
    assert runs[True]["roles"]["aggregator"]["rejected_messages"] == 0


def test_the_launcher_starts_no_aggregator_process_and_the_active_party_binds(tmp_path):
    from securevfl.launcher import role_commands

    cmds = {}
    for colocated in (False, True):
        path = write_toml(raw_config(tmp_path, colocated=colocated), tmp_path / f"{colocated}.toml")
        cfg = load_config(path)
        cmds[colocated] = role_commands(
            tmp_path / "config.toml",  # the same path: only the placement differs
            cfg,
            out=tmp_path / "run",
            keys=tmp_path / "keys",
            address="tcp://127.0.0.1:5999",
            resume=False,
        )
    assert set(cmds[False]) == {"aggregator", "active", *PARTIES}
    assert set(cmds[True]) == {"active", *PARTIES}  # one process fewer
    active = cmds[True]["active"]
    assert 'network.bind="tcp://127.0.0.1:5999"' in active  # it binds where the parties connect
    for p in PARTIES:
        assert cmds[True][p] == cmds[False][p]


def test_securevfl_run_with_the_aggregator_in_the_active_party_process(tmp_path):
    """Real processes: `securevfl run` starts the active party and the parties only; the
    parties reach the aggregator over CURVE at the active party's port; the model is the one the
    in-process federation with a separate aggregator trains."""
    from securevfl.inproc import run_federation

    raw = raw_config(tmp_path, colocated=True, epochs=1)
    path = write_toml(raw, tmp_path / "colocated.toml")
    done = securevfl_cli("run", str(path), "--out", str(tmp_path / "run"), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = json.loads((tmp_path / "run" / "pids.json").read_text())
    assert set(pids) == {"active", *PARTIES}
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["roles"]["aggregator"]["pid"] == pids["active"]
    for p in PARTIES:  # every party took part over the network, through the hub
        assert metrics["roles"][p]["bytes_sent"] > 0 and metrics["roles"][p]["pid"] == pids[p]
    apart = make_config(raw_config(tmp_path, colocated=False, epochs=1), tmp_path)
    code, reference = run_federation(apart, out=tmp_path / "reference")
    assert code == 0
    assert metrics["test"] == reference["test"]
    assert [h["loss"] for h in metrics["history"]] == [h["loss"] for h in reference["history"]]


def test_a_party_policy_may_refuse_a_colocated_aggregator(tmp_path):
    raw = raw_config(tmp_path, colocated=True)
    raw["parties"]["beta"]["policy"] = {"aggregator_in_active": False}
    with pytest.raises(ConfigError) as info:
        make_config(raw, tmp_path)
    assert info.value.key == "[parties.beta.policy] aggregator_in_active"
    assert "active party's process" in str(info.value)
    raw["network"]["aggregator_in_active"] = False  # the same policy accepts a separate one
    assert make_config(raw, tmp_path).party("beta").policy.aggregator_in_active is False
    raw["parties"]["beta"]["policy"] = {"aggregator_in_active": "no"}
    with pytest.raises(ConfigError, match="must be true or false"):
        make_config(raw, tmp_path)


@pytest.mark.parametrize("own", [False, True])
def test_a_party_refuses_a_set_up_that_announces_another_aggregator_placement(tmp_path, own):
    """The placement a party accepts is its own config's: a (modified) active party announcing
    the other one at set-up is refused there, before anything is computed."""
    fed = DirectFederation(
        make_config(raw_config(tmp_path, colocated=own), tmp_path), run_dir=tmp_path / "r"
    )
    for announced, refused in ((not own, True), (own, False)):
        fed.round += 1
        call = Call(
            op="setup",
            round=fed.round,
            session=fed.session_hex,
            ids=np.empty(0, dtype=np.int64),
            args={
                "resume_epoch": -1,
                "run": {**run_terms(fed.config), "aggregator_in_active": announced},
            },
            inputs={"train_ids": fed.train_ids, "all_ids": fed.train_ids},
            to=PARTIES,
            collect=("present",),
        )
        env = fuse([call], sender="active")
        env.meta["auth"] = call_tags(
            env.meta, session=fed.session, round=env.round, tensors=env.tensors, keys=fed._auth_keys
        )
        if refused:
            with pytest.raises(PolicyRefusal) as info:
                fed.party_rounds["alpha"].answer(env)
            assert info.value.rule == "run"
            assert f"'aggregator_in_active': {announced}" in info.value.detail
        else:
            fed.party_rounds["alpha"].guard._check_setup(call)


def test_the_colocated_aggregator_refuses_ckks_even_past_config_validation(tmp_path):
    """Config validation refuses ckks with aggregator_in_active; the aggregator thread refuses
    it again before it binds anything (the aggregator would sit next to the secret key)."""
    from securevfl.roles.aggregator import colocated_aggregator

    raw = raw_config(tmp_path, colocated=True)
    raw["run"]["aggregation"] = "ckks"
    with pytest.raises(ConfigError, match="aggregator_in_active"):
        make_config(raw, tmp_path)
    cfg = dataclasses.replace(
        make_config(raw_config(tmp_path, colocated=True), tmp_path), aggregation="ckks"
    )
    with (
        pytest.raises(RunAborted, match="ckks"),
        colocated_aggregator(
            cfg, keys_dir=tmp_path / "keys", bind="tcp://127.0.0.1:0", run_dir=tmp_path
        ),
    ):
        pass


def test_a_separate_aggregator_is_refused_when_the_config_colocates_it(tmp_path):
    """`securevfl aggregator` with a config whose aggregator runs in the active party's process
    would wait for an active party that never connects to it: refused at once, naming the key."""
    from securevfl.roles.aggregator import run_aggregator
    from securevfl.roles.protocol import role_logger

    cfg = make_config(raw_config(tmp_path, colocated=True), tmp_path)
    with pytest.raises(ConfigError) as info:
        run_aggregator(
            cfg, keys_dir=tmp_path / "keys", bind="tcp://127.0.0.1:0", logger=role_logger("a", None)
        )
    assert info.value.key == "[network] aggregator_in_active"


def test_a_party_failure_stops_a_colocated_federation_with_its_cause(
    tmp_path,
    failing_method,  # noqa: F811 (the fixture imported above)
):
    """A party that crashes mid-training: the aggregator thread tells every role (the active
    party over its in-process socket) and the run stops with the cause, nothing hangs."""
    from securevfl.inproc import run_federation
    from tests.securevfl.test_pipeline import FAIL, FailingParty

    FAIL.update({"op": "backward", "at": 3, "how": "crash"})
    raw = raw_config(tmp_path, colocated=True)
    raw["run"]["method"] = failing_method
    code, metrics = run_federation(make_config(raw, tmp_path), out=tmp_path / "run")
    assert code != 0 and metrics is None
    assert FailingParty.calls == 3
    logs = {p.stem: p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log")}
    assert "gamma failed: RuntimeError: simulated crash" in logs["aggregator"]
    assert "gamma failed: RuntimeError: simulated crash" in logs["active"]
