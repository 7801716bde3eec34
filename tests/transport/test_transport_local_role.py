"""A hub's local role (`Hub(local=...)`): one role served over an in-process socket of the hub's
own process (the active party when the aggregator runs in its process), never over the network,
and nobody else served there."""

from __future__ import annotations

import numpy as np
import pytest

from tests.transport.transport_testkit import FAST, PEER_KINDS, wait_until
from transport import Envelope, Peer, TransportError


def local_peer(hub, name: str, closer) -> Peer:
    return closer(
        Peer(
            name=name,
            connect=hub.local_endpoint,
            kinds=PEER_KINDS,
            context=hub.context,
            curve=False,
            **FAST,
        )
    )


def test_the_local_role_is_served_in_process_next_to_curve_peers(make_hub, make_peer, closer):
    hub = make_hub(local="active")
    assert hub.local_endpoint.startswith("inproc://")
    active = local_peer(hub, "active", closer)
    party = make_peer("party1", hub)
    hub.wait_for(["active", "party1"], timeout=3)
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    active.send(Envelope(kind="contribution", sender="active", round=1, tensors={"x": x}))
    party.send(Envelope(kind="contribution", sender="party1", round=1, tensors={"x": 2 * x}))
    got = {}
    for _ in range(2):
        env = hub.recv(timeout=3)
        got[env.sender] = env.tensors["x"]
    assert np.array_equal(got["active"], x) and np.array_equal(got["party1"], 2 * x)
    hub.send("active", Envelope(kind="sum", sender="hub", round=1, tensors={"s": 3 * x}))
    hub.send("party1", Envelope(kind="gradient", sender="hub", round=1))
    assert np.array_equal(active.recv(timeout=3).tensors["s"], 3 * x)
    assert party.recv(timeout=3).kind == "gradient"
    # heartbeats reach the local role as any other: it does not report the hub lost
    assert wait_until(lambda: active._last_heard is not None)


def test_the_local_role_is_refused_over_the_network_even_with_its_own_key(
    make_hub, make_peer, closer, caplog
):
    """A remote process holding the local role's key (left in the allowlist by mistake) cannot
    stand in for it: the hub refuses it on the network socket and never routes to it there."""
    hub = make_hub(local="active")
    remote = make_peer("active", hub)  # authenticates as active over CURVE
    remote.send(Envelope(kind="contribution", sender="active", round=1))
    assert wait_until(lambda: (hub.keepalive(), hub.rejected)[1] >= 1)
    assert "active" not in hub.connected()
    assert "runs in the hub's own process" in caplog.text
    with pytest.raises(TransportError, match="has not connected"):
        hub.send("active", Envelope(kind="sum", sender="hub", round=1))


def test_the_in_process_socket_serves_the_local_role_only(make_hub, closer, caplog):
    """Code of the hub's process that connects under another role's name is refused there."""
    hub = make_hub(local="active")
    intruder = local_peer(hub, "party1", closer)
    intruder.send(Envelope(kind="contribution", sender="party1", round=1))
    assert wait_until(lambda: (hub.keepalive(), hub.rejected)[1] >= 1)
    assert "party1" not in hub.connected()
    assert "in-process socket serves 'active' only" in caplog.text


def test_a_hub_cannot_be_its_own_local_role(keys):
    from transport import Hub

    with pytest.raises(ValueError, match="own name"):
        Hub(
            name="hub",
            bind="tcp://127.0.0.1:0",
            keypair=keys.hub,
            allowlist=keys.allowlist,
            kinds={"contribution"},
            local="hub",
        )
