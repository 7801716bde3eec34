"""A hostile but allowlisted peer: every bad message is logged with a reason and dropped,
and the hub keeps serving honest peers."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.transport.transport_testkit import DROP, SMALL_LIMITS, good_frames, header
from transport import Envelope, Limits, ReceiveTimeout, pack

X = np.arange(4, dtype=np.float64).tobytes()
BIG = bytes(100 * 1024)  # above SMALL_LIMITS (64 KiB), far below libzmq's hard frame cap


@pytest.fixture
def hostile(make_hub, make_peer, raw_dealer, keys, caplog):
    """A hub with small limits, an honest party1, and a raw socket holding mallory's real key."""
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub(limits=SMALL_LIMITS)
    honest = make_peer("party1", hub)
    raw = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory")
    hub.wait_for(["party1"], timeout=3)
    return hub, honest, raw


def assert_rejected_then_served(hub, honest, raw, caplog, reason: str, *, before: int = 0):
    """The bad message was logged with ``reason``; mallory's next good one and party1's arrive."""
    raw.send_multipart(good_frames("mallory", seq=1000, meta={"after": True}))
    got = hub.recv(timeout=3)  # same connection: the bad message was handled first
    assert (got.sender, got.meta) == ("mallory", {"after": True})
    assert hub.rejected == before + 1
    record = next(r for r in caplog.records if "rejected a message" in r.getMessage())
    assert record.levelno == logging.WARNING
    assert "mallory" in record.getMessage()
    assert reason in record.getMessage()
    honest.send(Envelope(kind="contribution", sender="party1"))
    assert hub.recv(timeout=3).sender == "party1"


CASES = {
    "not msgpack": ([b"\xc1\xc1 definitely not msgpack"], "not valid msgpack"),
    "missing field": ([header(round=DROP), X], "missing field(s) ['round']"),
    "wrong type": ([header(seq="7"), X], "seq must be an int"),
    "negative round": ([header(round=-2), X], "round must be between 0"),
    "truncated tensor": ([header(), X[:-3]], "needs 32 bytes but its frame has 29"),
    "extra frame": ([header(), X, X], "describes 1 tensors but 2 tensor frames"),
    "disallowed dtype": (
        [header(tensors=[{"name": "x", "dtype": "object", "shape": [4]}]), X],
        "dtype 'object', which is not in the allowlist",
    ),
    "shape lies": (
        [header(tensors=[{"name": "x", "dtype": "float64", "shape": [2, 3]}]), X],
        "shape (2, 3)) needs 48 bytes but its frame has 32",
    ),
    "too many dims": (
        [header(tensors=[{"name": "x", "dtype": "uint8", "shape": [1] * 9}]), b"\x01"],
        "9 dimensions",
    ),
    "oversized": (
        [header(tensors=[{"name": "x", "dtype": "uint8", "shape": [len(BIG)]}]), BIG],
        f"bytes, above the limit of {SMALL_LIMITS.max_message_bytes}",
    ),
    "wrong version": ([header(version=2), X], "protocol version 2 is not supported"),
    "unknown kind": ([header(kind="exfiltrate"), X], "kind 'exfiltrate' is not one of"),
    "impersonation": ([header(sender="party1"), X], "says 'party1' but the connection is"),
    "heartbeat with payload": (
        [header(kind="heartbeat", tensors=[], meta={"smuggled": 1})],
        "must carry no tensors or meta",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_message_is_rejected_with_a_logged_reason(hostile, caplog, case):
    hub, honest, raw = hostile
    frames, reason = CASES[case]
    if case == "oversized":  # the application limit must speak before libzmq's hard cap
        assert SMALL_LIMITS.max_message_bytes < len(BIG) < SMALL_LIMITS.hard_frame_cap
    raw.send_multipart(frames)
    assert_rejected_then_served(hub, honest, raw, caplog, reason)


def test_wrong_session_is_rejected(hostile, caplog):
    hub, honest, raw = hostile
    hub.session = honest.session = "current"
    raw.send_multipart([header(session="stale", seq=5), X])
    raw.send_multipart(good_frames("mallory", seq=6, session="current", meta={"after": True}))
    got = hub.recv(timeout=3)
    assert got.meta == {"after": True}
    assert "session 'stale', not the current session 'current'" in caplog.text
    honest.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).sender == "party1"


def test_replayed_message_is_rejected(hostile, caplog):
    hub, honest, raw = hostile
    frames = good_frames("mallory", seq=10, meta={"vote": "yes"})
    raw.send_multipart(frames)
    assert hub.recv(timeout=3).meta == {"vote": "yes"}
    raw.send_multipart(frames)  # the very same bytes again
    older = good_frames("mallory", seq=9, meta={"vote": "older"})
    raw.send_multipart(older)
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)
    assert hub.rejected == 2
    assert caplog.text.count("replayed or reordered") == 2
    assert "seq 10, not above 10" in caplog.text
    raw.send_multipart(good_frames("mallory", seq=11, meta={"vote": "new"}))
    assert hub.recv(timeout=3).meta == {"vote": "new"}
    honest.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).sender == "party1"


def test_connecting_under_another_roles_name_is_rejected(
    make_peer, raw_dealer, hostile, keys, caplog
):
    hub, honest, raw = hostile
    liar = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="party2")  # not connected yet
    liar.send_multipart(good_frames("party2", seq=1))
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)
    assert "authenticated as 'mallory' uses routing id 'party2'" in caplog.text
    assert "party2" not in hub.connected()
    honest.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).sender == "party1"


def test_heartbeat_socket_may_only_send_heartbeats(raw_dealer, hostile, keys, caplog):
    hub, honest, raw = hostile
    side = raw_dealer(hub, keypair=keys.roles["mallory"], routing_id="mallory/hb")
    side.send_multipart(good_frames("mallory", seq=1))
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)
    assert "the heartbeat socket sent a 'contribution' message" in caplog.text


def test_a_frame_above_the_hard_cap_is_dropped_by_libzmq_and_the_hub_survives(hostile, caplog):
    hub, honest, raw = hostile
    huge = np.zeros(SMALL_LIMITS.hard_frame_cap + 1, dtype=np.uint8)
    raw.send_multipart(
        pack(Envelope(kind="contribution", sender="mallory", seq=1, tensors={"x": huge}))
    )
    with pytest.raises(ReceiveTimeout):
        hub.recv(timeout=0.5)  # libzmq cut the connection (MAXMSGSIZE); nothing reached the hub
    honest.send(Envelope(kind="contribution", sender=""))
    assert hub.recv(timeout=3).sender == "party1"


def test_peer_side_rejects_bad_messages_too(make_hub, make_peer, caplog):
    caplog.set_level(logging.WARNING, logger="transport.peer")
    hub = make_hub()
    peer = make_peer("party1", hub, limits=Limits(max_message_bytes=1024))
    hub.wait_for(["party1"], timeout=3)
    hub.send("party1", Envelope(kind="sum", sender="", tensors={"x": np.zeros(1000)}))
    hub.send("party1", Envelope(kind="sum", sender="", meta={"ok": 1}))
    assert peer.recv(timeout=3).meta == {"ok": 1}
    assert peer.rejected == 1
    assert "rejected a message from aggregator" in caplog.text
    assert "above the limit of 1024" in caplog.text


def test_peer_rejects_a_replay_of_the_hubs_message(make_hub, make_peer, caplog):
    caplog.set_level(logging.WARNING, logger="transport.peer")
    hub = make_hub()
    peer = make_peer("party1", hub)
    hub.wait_for(["party1"], timeout=3)
    env = Envelope(kind="sum", sender="", meta={"n": 1})
    hub.send("party1", env)
    assert peer.recv(timeout=3).meta == {"n": 1}
    hub._socket.send_multipart([hub._routes["party1"], *pack(env)])  # the same frames, once more
    with pytest.raises(ReceiveTimeout):
        peer.recv(timeout=0.4)
    assert "replayed or reordered" in caplog.text


def test_msgpack_bombs_are_refused_before_decoding(hostile, caplog):
    hub, honest, raw = hostile
    # a header that claims a 4 GiB string: refused by size, never allocated
    raw.send_multipart([b"\xdb\xff\xff\xff\xff" + b"x" * 10])
    assert_rejected_then_served(hub, honest, raw, caplog, "not valid msgpack")
