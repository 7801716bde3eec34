"""Several hosts on one machine: every role in its own network namespace, joined by a bridge in
a "switch" namespace, talking real TCP across namespaces (`securevfl aggregator|active|party`,
one command and one --out per host), training and then scoring with --score. Skipped where
network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.securevfl.conftest import securevfl_cli, write_toml

pytestmark = pytest.mark.multiprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _can_make_netns() -> bool:
    if shutil.which("ip") is None or os.geteuid() != 0:
        return False
    name = f"svfl-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError):
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True


@pytest.fixture
def hosts():
    """{role: (namespace, ip)} for five hosts on one bridged 10.201.x.0/24 network."""
    if not _can_make_netns():
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = os.getpid() % 10000
    switch = f"svfl-sw-{tag}"
    roles = ["aggregator", "active", "alpha", "beta", "gamma"]
    made = [switch]
    out = {}
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, role in enumerate(roles):
            ns = f"svfl-{role[:5]}-{tag}"
            _ip("netns", "add", ns)
            made.append(ns)
            a, b = f"v{tag}{i}a", f"v{tag}{i}b"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", switch)
            _ip("-n", switch, "link", "set", b, "master", "br0")
            _ip("-n", switch, "link", "set", b, "up")
            addr = f"10.201.{tag % 250}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", a)
            _ip("-n", ns, "link", "set", a, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            out[role] = (ns, addr)
        yield out
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_roles_on_separate_hosts_train_over_tcp(hosts, small_federation):
    raw, d = small_federation
    agg_ip = hosts["aggregator"][1]
    raw["network"].update(
        {
            "aggregator": f"tcp://{agg_ip}:5555",
            "bind": f"tcp://{agg_ip}:5555",
            "keys": "keys",
            "startup_timeout": 60.0,
        }
    )
    config = write_toml(raw, d / "config.toml")
    assert securevfl_cli("keys", "--config", str(config), "--out", str(d / "keys")).returncode == 0
    split = securevfl_cli("split", "--config", str(config), "--out", str(d / "split"))
    assert split.returncode == 0, split.stderr
    results = _on_each_host(hosts, config, d)
    for role, (code, _, err) in results.items():
        assert code == 0, (role, err[-2000:])
    metrics = json.loads((d / "hosts" / "active" / "metrics.json").read_text())
    assert metrics["test"]["accuracy"] > 0.7
    # each role ran on its own "host" (namespace) and sent real traffic over TCP
    assert {r: v["bytes_sent"] > 0 for r, v in metrics["roles"].items()} == dict.fromkeys(
        hosts, True
    )
    agg_log = (d / "hosts" / "aggregator" / "logs" / "aggregator.log").read_text()
    assert f"tcp://{agg_ip}:5555" in agg_log
    # scoring on separate hosts: the same role commands with --score, each role's own rows and
    # its own last checkpoint in its own --out
    scored = _on_each_host(hosts, config, d, score=True)
    for role, (code, _, err) in scored.items():
        assert code == 0, (role, err[-2000:])
    out = scored["active"][1]
    assert "scored: accuracy" in out and "predictions to" in out, out
    predictions = (d / "predictions.csv").read_text().splitlines()
    assert predictions[0] == "id,output" and len(predictions) == 1 + 400


def _on_each_host(hosts, config, d, *, score: bool = False, files=None) -> dict:
    """Every role's command in its own namespace ("host"), its own --out; (status, stdout,
    stderr) of each. `score`: the roles score their split file's rows with --score; `files`:
    a party's table instead of its split file."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = {}
    for role, (ns, _) in hosts.items():
        if role == "aggregator":
            args = ["aggregator"]
        elif role == "active":
            args = ["active", "--data", str(d / "split" / "data" / "active.csv")]
            if score:
                args += ["--score", "--predictions", str(d / "predictions.csv")]
        else:
            table = (files or {}).get(role, d / "split" / "data" / f"{role}.csv")
            args = ["party", "--name", role, "--data", str(table)]
            args += ["--score"] if score else []
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "securevfl", *args]
        cmd += ["--config", str(config), "--out", str(d / "hosts" / role)]
        procs[role] = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    try:
        outputs = {r: p.communicate(timeout=240) for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return {r: (procs[r].returncode, *outputs[r]) for r in procs}


def test_parties_holding_different_rows_align_then_train_on_separate_hosts(hosts, small_federation):
    """The README's steps for rows at different parties, one host per role: `securevfl align
    --role` on each host (the label holder binds, the parties connect, PSI over TCP), then
    training with the label holder's `[data] presence` and each party's aligned file: PSI finds
    exactly each party's rows, and LASER-VFL trains on them. (That set-up then tells each party
    only the ids it shares is tested in process: `test_align.py`.)"""
    raw, d = small_federation
    agg_ip, active_ip = hosts["aggregator"][1], hosts["active"][1]
    raw["network"].update(
        {
            "aggregator": f"tcp://{agg_ip}:5555",
            "bind": f"tcp://{agg_ip}:5555",
            "keys": "keys",
            "startup_timeout": 60.0,
        }
    )
    raw["run"]["method"] = "laser"  # serves the rows a party lacks
    config = write_toml(raw, d / "config.toml")
    assert securevfl_cli("keys", "--config", str(config), "--out", str(d / "keys")).returncode == 0
    assert (
        securevfl_cli("split", "--config", str(config), "--out", str(d / "split")).returncode == 0
    )
    own = d / "split" / "data"
    every = {"alpha": 0, "beta": 4, "gamma": 2}  # beta lacks every 4th row, gamma every 2nd
    for party, k in every.items():
        lines = (own / f"{party}.csv").read_text().splitlines()
        kept = [lines[0]] + [line for i, line in enumerate(lines[1:]) if not k or i % k]
        (own / f"{party}.csv").write_text("\n".join(kept) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    align = {}
    for role, (ns, _) in hosts.items():
        if role == "aggregator":
            continue
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "securevfl", "align"]
        cmd += ["--config", str(config), "--role", role, "--data", str(own / f"{role}.csv")]
        cmd += ["--out", str(d / "aligned" / role), "--bind", f"tcp://{active_ip}:5560"]
        align[role] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for role, proc in align.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, (role, err[-2000:])
    presence = d / "aligned" / "active" / "aligned" / "presence.csv"
    shared = {
        p: len((d / "aligned" / p / "aligned" / f"{p}.csv").read_text().splitlines()) - 1
        for p in every
    }
    assert shared == {"alpha": 400, "beta": 300, "gamma": 200}, shared
    raw["data"]["presence"] = str(presence)
    config = write_toml(raw, d / "config.toml")
    files = {p: d / "aligned" / p / "aligned" / f"{p}.csv" for p in every}
    trained = _on_each_host(hosts, config, d, files=files)
    for role, (code, _, err) in trained.items():
        assert code == 0, (role, err[-2000:])
    metrics = json.loads((d / "hosts" / "active" / "metrics.json").read_text())
    assert len(metrics["history"]) == raw["train"]["epochs"]
    assert metrics["test"]["n_eval"] > 0
    for party, n in shared.items():  # each trained on its aligned file
        log = (d / "hosts" / party / "logs" / f"{party}.log").read_text()
        assert f"{n} rows" in log, (party, n)
