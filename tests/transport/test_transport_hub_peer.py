"""Hub <-> peer over real CURVE sockets on 127.0.0.1: delivery, identity, liveness, deadlines."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

import numpy as np
import pytest
import zmq

from tests.transport.transport_testkit import FAST, HUB_KINDS, PEER_KINDS, wait_until
from transport import (
    ALLOWED_DTYPES,
    Allowlist,
    Envelope,
    Hub,
    KeyRefused,
    Peer,
    PeerLost,
    ReceiveTimeout,
    TransportError,
    pack,
)
from transport.envelope import frames_nbytes


def every_dtype(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for dtype in sorted(ALLOWED_DTYPES):
        raw = rng.integers(0, 256, size=(3, 5, 8), dtype=np.uint8).tobytes()
        if dtype == "bool":
            raw = bytes(b & 1 for b in raw)
        tensors[f"{dtype}-3d"] = np.frombuffer(raw, dtype=dtype).reshape(3, 5, -1)
        tensors[f"{dtype}-empty"] = np.zeros((0, 4), dtype=dtype)
    tensors["scalar"] = np.array(-1.25)
    tensors["big"] = rng.standard_normal(100_000).astype(np.float32)  # above zmq's copy threshold
    return tensors


def assert_same_tensors(sent: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert list(got) == list(sent)
    for name, array in sent.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name  # bit-exact, NaN payloads included


def test_envelope_round_trips_bit_exact_both_ways_over_curve(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    assert hub.connected() == {"party1"}

    up = every_dtype(1)
    meta = {"round_name": "forward", "ids": [1, 2, 3], "lr": 0.5, "blob": b"\x00\x01", "x": None}
    peer.send(Envelope(kind="contribution", sender="ignored", round=3, tensors=up, meta=meta))
    got = hub.recv(timeout=3)
    assert (got.kind, got.sender, got.round, got.meta) == ("contribution", "party1", 3, meta)
    assert_same_tensors(up, got.tensors)

    down = every_dtype(2)
    hub.send("party1", Envelope(kind="sum", sender="ignored", tensors=down, meta={"n": 2}))
    back = peer.recv(timeout=3)
    assert (back.kind, back.sender, back.meta) == ("sum", "aggregator", {"n": 2})
    assert_same_tensors(down, back.tensors)


def test_user_id_is_the_role_name_and_sender_is_overwritten(make_hub, make_peer):
    hub = make_hub()
    make_peer("active", hub).send(Envelope(kind="config", sender="party2"))
    got = hub.recv(timeout=3)
    assert got.sender == "active"  # Peer.send stamps its own name, so a typo cannot impersonate


def test_several_peers_are_told_apart(make_hub, make_peer):
    hub = make_hub()
    peers = {name: make_peer(name, hub) for name in ("active", "party1", "party2")}
    hub.wait_for(peers, timeout=3)
    for name, peer in peers.items():
        peer.send(Envelope(kind="contribution", sender=name, meta={"me": name}))
    got = {hub.recv(timeout=3).sender for _ in peers}
    assert got == set(peers)
    for name, peer in peers.items():
        hub.send(name, Envelope(kind="sum", sender="", meta={"to": name}))
        assert peer.recv(timeout=3).meta == {"to": name}


def test_peer_with_a_key_outside_the_allowlist_is_refused_and_logged(
    make_hub, make_peer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    outsider = make_peer("party2", hub, keypair=keys.outsider)
    honest = make_peer("party1", hub)
    with contextlib.suppress(KeyRefused):  # raised once the refusal has come back
        outsider.send(Envelope(kind="contribution", sender="party2", meta={"evil": True}))
    honest.send(Envelope(kind="contribution", sender="party1"))

    assert hub.recv(timeout=3).sender == "party1"
    assert wait_until(lambda: "not in the federation allowlist" in caplog.text)
    assert keys.outsider.public.decode() in caplog.text
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)  # the outsider's message never arrives
    assert "party2" not in hub.connected()
    with pytest.raises(KeyRefused, match="refused party2's CURVE key"):
        outsider.recv(timeout=2)


def test_a_client_without_curve_is_never_heard_and_the_honest_peers_are(
    make_hub, make_peer, closer
):
    """A plaintext (NULL mechanism) client reaches the hub's port and sends a well-formed
    envelope under a role's name: the CURVE handshake never completes, so nothing it sends is
    delivered, and the hub keeps serving the federation's peers."""
    hub = make_hub()
    context = closer(zmq.Context())
    plain = closer(context.socket(zmq.DEALER))
    plain.linger = 0
    plain.routing_id = b"party1/" + uuid.uuid4().hex.encode()
    plain.connect(hub.endpoint)
    forged = pack(Envelope(kind="contribution", sender="party1", meta={"evil": True}))
    for _ in range(3):
        with contextlib.suppress(zmq.Again):
            plain.send_multipart(forged, flags=zmq.NOBLOCK)
    honest = make_peer("party1", hub)
    honest.send(Envelope(kind="contribution", sender="party1", meta={"honest": True}))
    got = hub.recv(timeout=3)
    assert got.meta == {"honest": True}
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)  # nothing from the plaintext client, ever
    assert set(hub.connected()) == {"party1"}


def test_waiting_tells_whether_a_message_arrived_and_is_false_once_closed(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    peer.send(Envelope(kind="contribution", sender="party1"))
    hub.recv(timeout=3)
    hub.send("party1", Envelope(kind="sum", sender="hub", meta={"n": 1}))
    assert wait_until(peer.waiting)
    assert peer.recv(timeout=3).meta == {"n": 1}
    peer.close()
    assert peer.waiting() is False  # a closed peer: nothing to read, no socket error


def test_send_each_delivers_one_encoding_to_every_role_and_names_those_it_cannot_reach(
    make_hub, make_peer
):
    """The aggregator relays a call to all its parties encoded once: every peer gets the same
    envelope, under one seq that still increases for each of them (a heartbeat due meanwhile
    goes after it, not between), and a role that is not connected is reported, not raised."""
    hub = make_hub()
    peers = {name: make_peer(name, hub) for name in ("party1", "party2")}
    hub.wait_for(peers, timeout=3)
    tensors = {"ids": np.arange(5, dtype=np.int64), "grad": np.ones((5, 3), np.float32)}
    for round_ in (1, 2):
        hub._next_heartbeat = 0.0  # a heartbeat is due during the next relay
        failed = hub.send_each(
            ["party1", "party3", "party2"],
            Envelope(kind="sum", sender="", round=round_, tensors=tensors, meta={"op": "x"}),
        )
        assert list(failed) == ["party3"] and "has not connected" in str(failed["party3"])
        got = {name: peer.recv(timeout=3) for name, peer in peers.items()}
        assert {(e.round, e.sender, e.meta["op"]) for e in got.values()} == {
            (round_, "aggregator", "x")
        }
        assert got["party1"].seq == got["party2"].seq  # one stamp
        for env in got.values():
            assert_same_tensors(tensors, env.tensors)
    assert all(peer.rejected == 0 for peer in peers.values())  # no seq went backwards


def test_send_to_a_role_that_never_connected_is_refused(make_hub):
    hub = make_hub()
    with pytest.raises(TransportError, match="'party2': it has not connected"):
        hub.send("party2", Envelope(kind="sum", sender=""))


def test_wait_for_names_the_absent_roles(make_hub, make_peer):
    hub = make_hub()
    make_peer("party1", hub)
    with pytest.raises(ReceiveTimeout, match=r"\['party2'\] did not connect"):
        hub.wait_for(["party1", "party2"], timeout=0.5)


def test_receive_deadlines_raise_receive_timeout(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    start = time.monotonic()
    with pytest.raises(ReceiveTimeout, match="within 0.3 s"):
        hub.recv(timeout=0.3)
    assert 0.25 < time.monotonic() - start < 1.0
    start = time.monotonic()
    with pytest.raises(ReceiveTimeout, match="party1 received no message from aggregator"):
        peer.recv(timeout=0.3)  # the hub's heartbeats keep coming but never count as messages
    assert 0.25 < time.monotonic() - start < 1.0


def test_messages_that_arrive_during_wait_for_are_kept_for_recv(make_hub, make_peer):
    hub = make_hub()
    make_peer("party1", hub).send(Envelope(kind="contribution", sender="", meta={"k": 1}))
    make_peer("party2", hub)
    hub.wait_for(["party1", "party2"], timeout=3)
    assert hub.recv(timeout=3).meta == {"k": 1}


def test_byte_counters_grow_by_the_frame_sizes(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    time.sleep(0.5)  # let heartbeats flow: they must not be counted
    assert (peer.bytes_sent, hub.bytes_received, hub.bytes_sent, peer.bytes_received) == (
        0,
        0,
        0,
        0,
    )

    up = Envelope(kind="contribution", sender="", tensors={"x": np.ones((100, 10), np.float32)})
    peer.send(up)
    size_up = frames_nbytes(pack(up))  # sender and seq are now stamped: the same frames
    assert size_up > 4000
    hub.recv(timeout=3)
    assert peer.bytes_sent == hub.bytes_received == size_up

    down = Envelope(kind="sum", sender="", tensors={"s": np.zeros(7, np.int64)}, meta={"a": "b"})
    hub.send("party1", down)
    size_down = frames_nbytes(pack(down))
    peer.recv(timeout=3)
    assert hub.bytes_sent == peer.bytes_received == size_down
    assert peer.bytes_sent == hub.bytes_received == size_up


def test_a_closed_peer_is_reported_lost_by_name_within_peer_timeout(make_hub, make_peer):
    hub = make_hub()
    keep = make_peer("party1", hub)
    gone = make_peer("party2", hub)
    hub.wait_for(["party1", "party2"], timeout=3)
    time.sleep(0.3)  # both have heartbeated for a while
    gone.close()
    closed_at = time.monotonic()
    with pytest.raises(PeerLost, match="lost party2.*restart it and rerun with --resume") as info:
        hub.recv(timeout=5)
    assert info.value.peer == "party2"
    assert 0.7 < time.monotonic() - closed_at < 1.8
    # reported once; the live peer is still served
    keep.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=2).sender == "party1"


def test_a_busy_peer_is_kept_alive_by_its_heartbeat_thread(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    time.sleep(0.2)
    with pytest.raises(ReceiveTimeout):  # not PeerLost: the peer's main thread never sent
        hub.recv(timeout=1.6)
    peer.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=2).sender == "party1"


def test_forget_stops_the_liveness_check(make_hub, make_peer):
    hub = make_hub()
    gone = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    gone.close()
    hub.forget("party1")
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=1.5)


def test_a_hub_that_disappears_makes_peer_recv_raise_peer_lost(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)  # the hub heartbeats the peer while it waits
    hub.close()
    closed_at = time.monotonic()
    with pytest.raises(PeerLost, match="lost aggregator") as info:
        peer.recv(timeout=5)
    assert info.value.peer == "aggregator"
    assert time.monotonic() - closed_at < 1.8


def test_hub_keepalive_lets_it_compute_longer_than_peer_timeout(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    hub.keepalive()
    for _ in range(8):  # 1.6 s of "computing" with peer_timeout = 1 s
        time.sleep(0.2)
        hub.keepalive()
    hub.send("party1", Envelope(kind="sum", sender=""))
    assert peer.recv(timeout=2).kind == "sum"


def test_session_is_stamped_on_send_and_enforced_on_receive(make_hub, make_peer):
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.session = peer.session = "run-7"
    hub.wait_for(["party1"], timeout=3)
    peer.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).session == "run-7"
    with pytest.raises(ValueError, match="differs from the peer's session"):
        peer.send(Envelope(kind="contribution", sender="", session="run-6"))


def test_arguments_are_checked_before_anything_starts(keys):
    with pytest.raises(ValueError, match="reserved"):
        Hub(
            bind="tcp://127.0.0.1:0",
            keypair=keys.hub,
            allowlist=keys.allowlist,
            kinds={"heartbeat"},
        )
    with pytest.raises(ValueError, match="at least twice"):
        Hub(
            bind="tcp://127.0.0.1:0",
            keypair=keys.hub,
            allowlist=keys.allowlist,
            kinds=HUB_KINDS,
            heartbeat_interval=1,
            peer_timeout=1,
        )
    with pytest.raises(ValueError, match="only allowed for inproc"):
        Hub(bind="tcp://127.0.0.1:0", kinds=HUB_KINDS, curve=False)
    with pytest.raises(ValueError, match="needs keypair"):
        Hub(bind="tcp://127.0.0.1:0", kinds=HUB_KINDS)


def test_binding_a_port_in_use_says_so(make_hub, keys):
    hub = make_hub()
    with pytest.raises(TransportError, match="cannot bind"):
        Hub(bind=hub.endpoint, keypair=keys.hub, allowlist=keys.allowlist, kinds=HUB_KINDS)


# --------------------------------------------------------------------------- in-process channel


def test_inproc_refuses_curve_because_libzmq_skips_it(keys):
    context = zmq.Context()
    try:
        with pytest.raises(ValueError, match="neither CURVE nor ZAP"):
            Hub(bind="inproc://x", keypair=keys.hub, allowlist=keys.allowlist, kinds=HUB_KINDS,
                context=context)  # fmt: skip
        with pytest.raises(ValueError, match="pass the hub's context"):
            Peer(name="party1", connect="inproc://x", kinds=PEER_KINDS, curve=False)
    finally:
        context.term()


def test_inproc_channel_has_the_same_interface(keys, closer, caplog):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    context = zmq.Context()
    endpoint = f"inproc://hub-{uuid.uuid4().hex}"
    hub = Hub(
        bind=endpoint,
        kinds=HUB_KINDS,
        allowlist=Allowlist({"party1": keys.roles["party1"].public}),
        context=context,
        curve=False,
        **FAST,
    )
    peers = [
        Peer(name=n, connect=endpoint, kinds=PEER_KINDS, context=context, curve=False, **FAST)
        for n in ("party1", "stranger")
    ]
    try:
        hub.wait_for(["party1"], timeout=3)
        tensors = every_dtype(3)
        peers[0].send(Envelope(kind="contribution", sender="", tensors=tensors))
        got = hub.recv(timeout=3)
        assert got.sender == "party1"
        assert_same_tensors(tensors, got.tensors)
        hub.send("party1", Envelope(kind="sum", sender="", tensors={"s": got.tensors["scalar"]}))
        assert peers[0].recv(timeout=3).tensors["s"] == -1.25
        assert "'stranger' is not a role of this federation" in caplog.text
        assert "stranger" not in hub.connected()
        peers[0].close()
        with pytest.raises(PeerLost, match="party1"):
            hub.recv(timeout=3)
    finally:
        for peer in peers:
            peer.close()
        hub.close()
        context.term()


def test_queued_shows_what_arrived_without_taking_it_even_after_the_sender_left(
    make_hub, make_peer
):
    # A peer sends its last word and closes: the message is still there to be found (and
    # still returned by recv) after the hub can no longer send to it.
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    assert hub.queued() == []
    for i in range(2):
        peer.send(Envelope(kind="contribution", sender="party1", meta={"i": i}))
    peer.close()
    assert wait_until(lambda: len(hub.queued()) == 2, timeout=3)
    assert [(e.kind, e.sender, e.meta) for e in hub.queued()] == [
        ("contribution", "party1", {"i": 0}),
        ("contribution", "party1", {"i": 1}),
    ]
    assert [hub.recv(timeout=1).meta["i"] for _ in range(2)] == [0, 1]
    assert hub.queued() == []


def test_a_closed_hub_keeps_no_routing_token_in_the_parse_cache(make_hub, make_peer):
    """Routing ids carry each peer's secret token; the hub parses them through a cache for
    speed, and empties it when it closes."""
    from transport.sockets import _parse_routing_id_cached

    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    peer.send(Envelope(kind="contribution", sender="x"))
    hub.recv(timeout=3)
    assert _parse_routing_id_cached.cache_info().currsize > 0
    hub.close()
    assert _parse_routing_id_cached.cache_info().currsize == 0
