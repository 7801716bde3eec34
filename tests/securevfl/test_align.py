"""Private set intersection (`securevfl align`): each side learns exactly the intersection, and
what crosses is blinded points and positions only — no identifier, no unblinded hash."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from crypto import psi
from securevfl.align import align_active, align_party, bucket_bits
from securevfl.config import parse_config
from securevfl.keys import generate_keys
from transport import Hub, Peer


def test_blinding_commutes_and_refuses_points_outside_the_group():
    a, b = psi.new_secret(), psi.new_secret()
    h = psi.hash_to_group("alice")
    assert h == psi.hash_to_group("alice") != psi.hash_to_group("bob")
    assert psi.blind(b, psi.blind(a, [h])) == psi.blind(a, psi.blind(b, [h]))
    with pytest.raises(psi.PsiError):
        psi.blind(a, [bytes(32)])  # the identity / a small-order point
    with pytest.raises(psi.PsiError):
        psi.from_array(np.zeros((3, 31), dtype=np.uint8), limit=10)
    assert sorted(psi.shuffle(50).tolist()) == list(range(50))


def _files(tmp_path, n: int, overlap: float):
    common = [f"client-{i:07d}" for i in range(int(n * overlap))]
    only_a = [f"active-only-{i}" for i in range(n - len(common))]
    only_b = [f"party-only-{i}" for i in range(n - len(common))]
    (tmp_path / "a.csv").write_text("id,y\n" + "".join(f"{x},1\n" for x in common + only_a))
    (tmp_path / "b.csv").write_text("id,v\n" + "".join(f"{x},0.5\n" for x in only_b + common))
    return set(common), set(only_a), set(only_b)


def run_alignment(tmp_path, n: int, overlap: float = 0.5, parties=("bank", "shop"), network=None):
    common, only_a, only_b = _files(tmp_path, n, overlap)
    raw = {
        "run": {"method": "splitnn", "aggregation": "mask"},
        "data": {"path": "a.csv", "id": "id", "label": "y"},
        "parties": {p: {"columns": [f"v{j}"]} for j, p in enumerate(parties)},
        "policy": {"min_group": 1},
    }
    if network:
        raw["network"] = dict(network)
    raw["run"]["min_group"] = 1
    cfg = parse_config(raw, source=tmp_path / "c.toml")
    if not (tmp_path / "keys" / "public.json").exists():  # a run again keeps the keys
        generate_keys(cfg.role_names, tmp_path / "keys")
    sent: list = []
    for cls in (Hub, Peer):  # record every envelope that leaves either side
        original = cls.send

        def spy(self, *args, _original=original, **kwargs):
            sent.append(args[-1])
            return _original(self, *args, **kwargs)

        cls.send = spy  # restored below
    bound = threading.Event()
    address = {}
    result = {}
    log = logging.getLogger("test-align")

    def active():
        result["active"] = align_active(
            cfg,
            data=tmp_path / "a.csv",
            keys_dir=tmp_path / "keys",
            bind="tcp://127.0.0.1:0",
            out=tmp_path,
            logger=log,
            on_bound=lambda e: (address.setdefault("a", e), bound.set()),
        )

    def party(name):
        bound.wait(30)
        result[name] = align_party(
            cfg,
            name=name,
            data=tmp_path / "b.csv",
            keys_dir=tmp_path / "keys",
            address=address["a"],
            out=tmp_path,
            logger=log,
        )

    threads = [threading.Thread(target=active)] + [
        threading.Thread(target=party, args=(p,)) for p in parties
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return cfg, result, sent, common, only_a, only_b


@pytest.fixture
def restore_transport():
    hub_send, peer_send = Hub.send, Peer.send
    yield
    Hub.send, Peer.send = hub_send, peer_send


def test_align_gives_both_sides_exactly_the_intersection_and_sends_only_blinded_points(
    tmp_path, restore_transport
):
    cfg, result, sent, common, only_a, only_b = run_alignment(tmp_path, n=4000)
    import csv

    with (tmp_path / "aligned" / "presence.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["id"] for r in rows if r["bank"] == "1"} == common
    assert {r["id"] for r in rows if r["shop"] == "1"} == common
    with (tmp_path / "aligned" / "bank.csv").open() as fh:
        assert {r["id"] for r in csv.DictReader(fh)} == common
    assert result["bank"] == len(common) and result["active"]["parties"]["bank"]["size"] == 4000
    # what crossed: points of the group, positions, sizes; no identifier, no unblinded hash
    hashes = {psi.hash_to_group(x) for x in common | only_a | only_b}
    kinds = set()
    for env in sent:
        kinds.add(env.kind)
        blob = repr(env.meta).encode() + b"".join(
            np.ascontiguousarray(t).tobytes() for t in env.tensors.values()
        )
        assert b"client-" not in blob and b"only-" not in blob
        for name, t in env.tensors.items():
            if t.dtype == np.uint8:
                points = psi.from_array(t, limit=10**7)
                assert not hashes & set(points), "an unblinded H(id) crossed"
            else:
                assert name == "positions" and t.dtype == np.int64
    assert kinds == {"psi-join", "psi-start", "psi-blinded", "psi-reply", "psi-matches"}


def test_the_label_holder_keeps_heartbeating_while_it_blinds(
    tmp_path, restore_transport, monkeypatch
):
    """Blinding a bucket takes longer than the peers' timeout (here: 10 ms a point, 1.2 s a
    bucket, against a 1 s timeout); the label holder's heartbeats go out between slices of
    points, so the party does not report it lost (the 10^6-id run did, before)."""
    import securevfl.align as align

    slow_blind = psi.blind

    def blind(scalar, points):
        time.sleep(0.01 * len(points))
        return slow_blind(scalar, points)

    monkeypatch.setattr(psi, "blind", blind)
    monkeypatch.setattr(align, "PEER_TIMEOUT_FLOOR", 0.0)
    monkeypatch.setattr(align, "KEEPALIVE_POINTS", 10)
    network = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
    cfg, result, _, common, _, _ = run_alignment(
        tmp_path, n=120, parties=("bank",), network=network
    )
    assert cfg.peer_timeout == 1.0
    assert result["bank"] == len(common) == 60, result
    assert result["active"]["parties"]["bank"]["intersection"] == 60


def test_buckets_keep_messages_bounded():
    assert bucket_bits(10) == 0 and bucket_bits(2**16) == 0
    assert bucket_bits(10**6) == 4  # 16 buckets of about 62 500 ids


@pytest.mark.slow
def test_align_on_100k_ids_with_half_overlap(tmp_path, restore_transport):
    """The issue's size: 10^5 ids per side, 50 % shared (about a minute on 2 cores)."""
    cfg, result, sent, common, _, _ = run_alignment(tmp_path, n=100_000)
    assert result["bank"] == len(common) == 50_000
    assert result["active"]["parties"]["bank"]["intersection"] == 50_000


def test_after_alignment_each_party_is_told_only_the_ids_it_shares(tmp_path):
    """With `[data] presence` (align's presence.csv), set-up sends each party only the label
    holder's ids it shares (not every id of the label holder), and training goes on."""
    from securevfl.direct import DirectFederation
    from securevfl.methods.examples import classification
    from tests.securevfl.conftest import permissive_policy

    raw = classification(tmp_path, method="laser", blocks=3, p_missing=0.3, n=240)
    raw["run"]["seed"] = 1
    cfg0 = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    # what a PSI would have found: which of the active party's rows each party holds
    from securevfl.data.table import load_party_table, split_federation

    files = split_federation(cfg0, tmp_path / "split")
    held = {p: set(load_party_table(files[p], cfg0, p).ids.tolist()) for p in cfg0.party_names}
    ids = list(range(1, 241))
    lines = ["id," + ",".join(cfg0.party_names)] + [
        f"{i}," + ",".join("1" if i in held[p] else "0" for p in cfg0.party_names) for i in ids
    ]
    (tmp_path / "presence.csv").write_text("\n".join(lines) + "\n")
    raw["data"]["presence"] = "presence.csv"
    cfg = parse_config(permissive_policy(raw), source=tmp_path / "config.toml")
    fed = DirectFederation(cfg, run_dir=tmp_path / "run")
    for p in cfg.party_names:
        told = set(fed.party_rounds[p].privacy._rows.tolist())
        assert told == held[p] & set(fed.active_table.ids.tolist())
        assert len(told) < 240  # not the label holder's whole id list
    fed.run()
    assert fed.history


def test_align_command_starts_every_role_as_processes_on_a_port_the_kernel_picks(tmp_path):
    """`securevfl align` without --role: the label holder binds port 0 and writes the port it
    got; the parties, started at the same time, connect there (no port probed beforehand that
    another process could take in between)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from securevfl.demo import write_breast_cancer_csv

    subprocess.run(
        [sys.executable, "-m", "securevfl", "example", "breast-cancer", "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    write_breast_cancer_csv(tmp_path / "breast_cancer.csv")
    out = tmp_path / "al"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "securevfl", "align", "--config", "breast_cancer.toml"]
        + ["--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    address = (out / "endpoint.txt").read_text().strip()
    port = int(address.rsplit(":", 1)[1])
    assert address.startswith("tcp://127.0.0.1:") and port > 0
    assert done.stdout.count("569 of 569 ids shared") == 3
    assert sorted(p.name for p in Path(out, "aligned").glob("*.csv")) == [
        "error.csv",
        "mean.csv",
        "presence.csv",
        "worst.csv",
    ]
