"""Real OS processes: a SIGKILLed peer is reported lost and its restart served; import hygiene."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transport import Envelope, PeerLost

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = """
import json, os, sys, time
from transport import CurveKeyPair, Envelope, Peer
cfg = json.loads(sys.argv[1])
peer = Peer(name=cfg["name"], connect=cfg["endpoint"], keypair=CurveKeyPair.from_json(cfg["keys"]),
            server_public=cfg["server"].encode(), kinds={"sum"}, heartbeat_interval=0.2,
            peer_timeout=1.0)
peer.send(Envelope(kind="contribution", sender="", meta={"pid": os.getpid()}))
reply = peer.recv(timeout=30)
peer.send(Envelope(kind="contribution", sender="", meta={"echo": reply.meta["n"]}))
time.sleep(60)
"""


def start_peer(hub, keys, name: str) -> subprocess.Popen:
    cfg = {
        "name": name,
        "endpoint": hub.endpoint,
        "keys": keys.roles[name].to_json(),
        "server": keys.hub.public.decode(),
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, json.dumps(cfg)], cwd=REPO, env=env)


@pytest.mark.multiprocess
def test_killed_peer_process_is_lost_and_its_restart_is_served(make_hub, keys):
    hub = make_hub()
    processes = []
    try:
        for attempt in range(2):
            proc = start_peer(hub, keys, "party1")
            processes.append(proc)
            hello = hub.recv(timeout=20)
            assert (hello.sender, hello.meta) == ("party1", {"pid": proc.pid})
            hub.send("party1", Envelope(kind="sum", sender="", meta={"n": attempt}))
            assert hub.recv(timeout=5).meta == {"echo": attempt}
            proc.kill()
            killed_at = time.monotonic()
            with pytest.raises(PeerLost) as info:
                hub.recv(timeout=5)
            assert info.value.peer == "party1"
            assert time.monotonic() - killed_at < 1.8
    finally:
        for proc in processes:
            proc.kill()
            proc.wait(timeout=5)


def test_transport_imports_no_ml_no_crypto_and_no_pickle_helpers():
    probe = (
        "import sys, transport; "
        "names = ('torch', 'securevfl', 'crypto', 'tenseal', 'opacus'); "
        "bad = [m for m in names if m in sys.modules]; "
        "print(bad)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
    source = "\n".join(p.read_text() for p in (REPO / "transport").glob("*.py"))
    for forbidden in ("import pickle", "send_pyobj", "recv_pyobj", "allow_pickle=True"):
        assert forbidden not in source
