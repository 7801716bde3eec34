"""Issue #16, transport part: per-message limits, routing ids bound to CURVE keys, escaped
peer text in logs, and wrong keys named at once on both sides."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid

import pytest
import zmq

from tests.transport.transport_testkit import SMALL_LIMITS, good_frames, header, wait_until
from transport import (
    CurveKeyPair,
    Envelope,
    HandshakeFailed,
    Hub,
    KeyRefused,
    Limits,
    ReceiveTimeout,
    key_fingerprint,
)
from transport.sockets import new_routing_id, parse_routing_id, readable, recv_bounded

# --------------------------------------------------------------------------- per-message limits


@pytest.fixture
def pair(closer):
    """Two ends of an in-process PAIR channel, for the receive loop alone."""
    context = closer(zmq.Context())
    sender, receiver = closer(context.socket(zmq.PAIR)), closer(context.socket(zmq.PAIR))
    endpoint = f"inproc://pair-{uuid.uuid4().hex}"
    receiver.bind(endpoint)
    sender.connect(endpoint)
    return sender, receiver


def test_receive_keeps_at_most_the_per_message_limits_and_consumes_the_whole_message(pair):
    sender, receiver = pair
    limits = Limits(max_message_bytes=1000, max_tensors=4)
    sender.send_multipart([b"header", *(b"x" for _ in range(10_000))])
    sender.send_multipart([b"next", b"y"])
    assert receiver.poll(2000)
    got = recv_bounded(receiver, limits=limits)
    assert got.nframes == 10_001
    assert len(got.frames) == 1  # only the header frame, which tells who sent it
    assert "10000 tensor frames" in got.overflow and "limit of 4" in got.overflow
    assert [f.bytes for f in recv_bounded(receiver, limits=limits).frames] == [b"next", b"y"]


def test_receive_stops_keeping_frames_once_the_message_passes_its_byte_limit(pair):
    sender, receiver = pair
    limits = Limits(max_message_bytes=1000, max_tensors=8)
    sender.send_multipart([b"h", *(bytes(400) for _ in range(8))])  # 3201 bytes, 9 frames
    assert receiver.poll(2000)
    got = recv_bounded(receiver, limits=limits)
    assert (got.nframes, got.nbytes, len(got.frames)) == (9, 3201, 1)
    assert "the message is 3201 bytes, above the limit of 1000" in got.overflow
    sender.send_multipart([b"h", bytes(400)])
    assert receiver.poll(2000)
    within = recv_bounded(receiver, limits=limits)
    assert within.overflow is None and len(within.frames) == 2


def test_a_message_of_many_small_frames_is_dropped_unread_and_the_hub_serves_on(
    make_hub, make_peer, raw_dealer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub(limits=Limits(max_message_bytes=1024 * 1024, max_tensors=8))
    honest = make_peer("party1", hub)
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    hub.wait_for(["party1"], timeout=3)
    chunk = bytes(60_000)  # each frame far below the per-frame cap, 120 of them: 7 MB
    raw.send_multipart([header(), *(chunk for _ in range(120))])
    raw.send_multipart(good_frames("mallory", seq=50, meta={"after": True}))
    assert hub.recv(timeout=5).meta == {"after": True}
    assert hub.rejected == 1
    assert "120 tensor frames (" in caplog.text and "dropped without being decoded" in caplog.text
    honest.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).sender == "party1"


def test_the_hub_queues_at_most_max_pending_messages_per_role(
    make_hub, make_peer, raw_dealer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    # mallory sends no heartbeats: a peer_timeout the test's own pace cannot reach on a slow
    # machine (FAST's 1 s declared it lost mid-test under load)
    hub = make_hub(limits=Limits(max_pending_messages=3), peer_timeout=30.0)
    honest = make_peer("party1", hub)
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    hub.wait_for(["party1"], timeout=3)
    for seq in range(1, 11):
        raw.send_multipart(good_frames("mallory", seq=seq, meta={"n": seq}))
    # keepalive() queues what arrives; a flood from one role must not grow the queue
    assert wait_until(lambda: hub.keepalive() or hub.rejected == 7)
    honest.send(Envelope(kind="contribution", sender="", meta={"honest": True}))
    got = [hub.recv(timeout=3).meta for _ in range(4)]
    assert got == [{"n": 1}, {"n": 2}, {"n": 3}, {"honest": True}]
    assert "3 messages" in caplog.text and "already wait to be read" in caplog.text
    raw.send_multipart(good_frames("mallory", seq=11, meta={"n": 11}))  # read: room again
    assert hub.recv(timeout=3).meta == {"n": 11}


def test_the_hub_queues_at_most_max_pending_bytes_per_role(make_hub, raw_dealer, keys):
    hub = make_hub(limits=Limits(max_pending_bytes=1000))
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    for seq in range(1, 6):
        raw.send_multipart(good_frames("mallory", seq=seq, meta={"pad": "x" * 300}))
    assert wait_until(lambda: hub.keepalive() or hub.rejected == 3)
    assert [hub.recv(timeout=1).meta["pad"] == "x" * 300 for _ in range(2)] == [True, True]
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.3)


# --------------------------------------------------------------------------- routing identities


def test_peer_routing_ids_are_fresh_secret_tokens_under_the_role_name():
    ids = {new_routing_id("party1") for _ in range(50)}
    assert len(ids) == 50
    for rid in ids:
        assert re.fullmatch(rb"party1/[0-9a-f]{32}", rid)
        assert parse_routing_id(rid).tokened
    beat = parse_routing_id(new_routing_id("party1", heartbeat=True))
    assert (beat.name, beat.heartbeat, beat.tokened) == ("party1", True, True)
    legacy = parse_routing_id(b"party1")
    assert (legacy.name, legacy.heartbeat, legacy.tokened) == ("party1", False, False)
    for bad in (b"", b"/x", b"a/b/c/d", b"a/zz", b"\xff", b"a\nb/hb"):
        assert parse_routing_id(bad) is None


def test_another_role_cannot_take_over_a_peers_connection_by_presenting_its_name(
    make_hub, make_peer, raw_dealer, keys
):
    hub = make_hub()
    victim = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    # mallory, allowlisted, presents the victim's name (and a handover-style duplicate id)
    thieves = [
        raw_dealer(hub, keypair=keys.roles["mallory"], routing_id=rid)
        for rid in ("party1", "party1/hb")
    ]
    time.sleep(0.4)  # let both handshakes finish: a takeover would have happened by now
    for n in range(3):
        hub.keepalive()
        hub.send("party1", Envelope(kind="sum", sender="", meta={"secret": n}))
        assert victim.recv(timeout=3).meta == {"secret": n}
    time.sleep(0.3)
    for thief in thieves:
        assert thief.poll(200) == 0, "another role received what was sent to party1"
    assert hub.connected() == {"party1"}


def test_a_role_that_sends_under_another_roles_tokened_id_is_refused(
    make_hub, make_peer, raw_dealer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    forged = new_routing_id("party1").decode()
    liar = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id=forged)
    liar.send_multipart(good_frames("party1", seq=1))
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)
    assert "authenticated as 'mallory' uses routing id 'party1/<token>'" in caplog.text
    assert forged.split("/")[1] not in caplog.text  # tokens are secrets: never logged


def test_the_hub_never_sends_to_a_guessable_routing_id(make_hub, raw_dealer, keys, caplog):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    raw.send_multipart(good_frames("mallory", seq=1, meta={"hi": 1}))
    assert hub.recv(timeout=3).meta == {"hi": 1}  # it may speak: its key says who it is
    assert "mallory" not in hub.connected()  # but a bare name is no route: anyone can claim it
    assert "guessable routing id 'mallory'" in caplog.text


def test_a_restarted_peer_takes_over_its_own_role(make_hub, make_peer):
    hub = make_hub()
    first = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    first.close()
    second = make_peer("party1", hub)
    second.send(Envelope(kind="contribution", sender="", meta={"second": True}))
    assert hub.recv(timeout=3).meta == {"second": True}
    hub.send("party1", Envelope(kind="sum", sender="", meta={"to": "second"}))
    assert second.recv(timeout=3).meta == {"to": "second"}


# --------------------------------------------------------------------------- escaped peer text


def test_peer_text_reaches_the_hub_log_escaped_and_bounded(
    make_hub, make_peer, raw_dealer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub(limits=SMALL_LIMITS)
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    forged = "\x1b[2J\nWARNING transport.hub: party1 connected \u202e"
    raw.send_multipart([header(kind=forged)])
    raw.send_multipart([header(version="v" * 50_000)])
    raw.send_multipart([header(sender=forged, seq=3)])
    raw.send_multipart([header(**{forged * 20: 1}, seq=4)])
    raw.send_multipart([header(tensors=[{"name": forged, "dtype": forged, "shape": [1]}])])
    raw.send_multipart(good_frames("mallory", seq=9, meta={"after": True}))
    assert hub.recv(timeout=3).meta == {"after": True}
    records = [r.getMessage() for r in caplog.records if "rejected a message" in r.getMessage()]
    assert len(records) == 5
    for line in records:
        assert line.isascii() and line.isprintable(), line
        assert len(line) < 1200, len(line)
    assert "\\x1b[2J\\nWARNING" in records[0]


# --------------------------------------------------------------------------- wrong keys


def test_a_refused_key_is_logged_with_fingerprint_address_and_the_roles_still_missing(
    make_hub, make_peer, keys, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    outsider = make_peer("party2", hub, keypair=keys.outsider)
    with pytest.raises(KeyRefused):
        outsider.recv(timeout=3)
    assert wait_until(lambda: "not in the federation allowlist" in caplog.text)
    line = next(r.getMessage() for r in caplog.records if "allowlist" in r.getMessage())
    assert key_fingerprint(keys.outsider.public) in line
    assert keys.outsider.public.decode() in line
    assert "from '127.0.0.1'" in line
    assert "roles not connected yet: ['active', 'mallory', 'party2']" in line


def test_a_peer_whose_key_is_refused_learns_it_within_a_second_with_its_fingerprint(
    make_hub, make_peer, keys
):
    hub = make_hub()
    outsider = make_peer("party2", hub, keypair=keys.outsider)
    start = time.monotonic()
    with pytest.raises(KeyRefused) as info:
        outsider.recv(timeout=10)
    assert time.monotonic() - start < 1.5
    assert key_fingerprint(keys.outsider.public) in str(info.value)
    assert not isinstance(info.value, HandshakeFailed)
    assert hub is not None


def test_a_peer_holding_another_hubs_key_fails_fast_and_names_the_likely_cause(
    make_hub, make_peer, caplog
):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    stale = CurveKeyPair.generate()  # e.g. public.json from another run
    peer = make_peer("party1", hub, server_public=stale.public)
    start = time.monotonic()
    with pytest.raises(HandshakeFailed, match="not the key of the hub running there") as info:
        peer.recv(timeout=20)
    assert time.monotonic() - start < 5  # seconds, not the round timeout
    assert key_fingerprint(stale.public) in str(info.value)
    with pytest.raises(HandshakeFailed):  # it stays refused
        peer.send(Envelope(kind="contribution", sender=""))
    # the hub cannot know the client's key or role, but it says what happened
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.3)
    assert hub.handshake_failures >= 1
    assert "failed the CURVE handshake" in caplog.text
    assert "another hub's public key" in caplog.text


def test_a_hub_restart_does_not_make_its_peers_give_up(make_hub, make_peer, keys, closer):
    timing = {"heartbeat_interval": 0.2, "peer_timeout": 3.0}
    hub = make_hub(**timing)
    peer = make_peer("party1", hub, **timing)
    hub.wait_for(["party1"], timeout=3)
    endpoint = hub.endpoint
    hub.close()
    time.sleep(0.3)  # the peer sees its link drop and retries: no handshake fails meanwhile
    again = closer(
        Hub(bind=endpoint, keypair=keys.hub, allowlist=keys.allowlist, kinds={"contribution"},
            **timing)
    )  # fmt: skip
    waiter = threading.Thread(target=again.wait_for, args=(["party1"],), kwargs={"timeout": 5})
    waiter.start()
    deadline = time.monotonic() + 5
    while waiter.is_alive() and time.monotonic() < deadline:
        with pytest.raises(ReceiveTimeout):
            peer.recv(timeout=0.2)  # a waiting role: it says hello again on the new link
    waiter.join()
    assert again.connected() == {"party1"}
    again.send("party1", Envelope(kind="sum", sender="", meta={"back": True}))
    assert peer.recv(timeout=3).meta == {"back": True}


def test_only_the_newest_connection_of_a_role_is_served(make_hub, make_peer, caplog):
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub()
    older = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    newer = make_peer("party1", hub)  # e.g. a second process started with the same keys
    newer.send(Envelope(kind="contribution", sender="", meta={"from": "newer"}))
    assert hub.recv(timeout=3).meta == {"from": "newer"}
    older.send(Envelope(kind="contribution", sender="", meta={"from": "older"}))
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)
    assert "a newer one of party1 has replaced" in caplog.text
    hub.send("party1", Envelope(kind="sum", sender="", meta={"to": "newest"}))
    assert newer.recv(timeout=3).meta == {"to": "newest"}
    with pytest.raises(ReceiveTimeout):
        older.recv(timeout=0.3)


def test_readable_says_whether_a_message_waits_without_consuming_it() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://readable-test")
        b.connect("inproc://readable-test")
        assert not readable(b)
        a.send_multipart([b"one", b"two"])
        wait_until(lambda: readable(b), timeout=5)
        assert readable(b) and readable(b)  # asking consumes nothing
        assert b.recv_multipart() == [b"one", b"two"]
        assert not readable(b)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()
