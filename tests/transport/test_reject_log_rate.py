"""The log of rejected messages is rate-limited per sending role (`transport.sockets.RejectionLog`):
an allowlisted peer that floods the hub (or a hub that floods a peer) with invalid messages
gets a few WARNING lines, then one count a window; `rejected` stays exact and honest
messages are still served."""

from __future__ import annotations

import logging
import time

import pytest

import transport.sockets
from tests.transport.transport_testkit import wait_until
from transport import Envelope
from transport.sockets import REJECT_LOG_BURST, RejectionLog

FLOOD = 300  # well past the burst; each message costs the hub a CURVE read and a log line


def warnings_of(caplog, logger: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.levelno == logging.WARNING and "reject" in r.getMessage()
    ]


def serve(hub, seconds: float) -> None:
    """Let the hub read and heartbeat for `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hub.keepalive()
        time.sleep(0.01)


def test_a_flood_of_wrong_session_messages_gets_a_few_warnings_and_an_exact_count(
    make_hub, make_peer, caplog
):
    caplog.set_level(logging.DEBUG, logger="transport.hub")
    hub = make_hub(peer_timeout=30.0)
    mallory = make_peer("mallory", hub, peer_timeout=30.0)
    honest = make_peer("party1", hub, peer_timeout=30.0)
    hub.wait_for(["mallory", "party1"], timeout=3)
    hub.session = "s" * 32
    for _ in range(FLOOD):
        mallory.send(Envelope(kind="contribution", sender="", session="wrong"))
    assert wait_until(lambda: hub.keepalive() or hub.rejected == FLOOD, timeout=4)
    honest.send(Envelope(kind="contribution", sender="", session="s" * 32, meta={"ok": 1}))
    assert hub.recv(timeout=3).meta == {"ok": 1}
    assert hub.rejected == FLOOD
    loud = warnings_of(caplog, "transport.hub")
    assert len(loud) == REJECT_LOG_BURST
    assert all("from mallory" in line and "session 'wrong'" in line for line in loud)
    assert "logged at DEBUG" in loud[-1]
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG and "rejected a" in r.msg]
    assert len(quiet) == FLOOD - REJECT_LOG_BURST
    hub.close()  # the final count: every rejection is accounted for in the log
    summary = warnings_of(caplog, "transport.hub")[-1]
    assert f"rejected {FLOOD - REJECT_LOG_BURST} more messages from mallory" in summary
    assert "session 'wrong'" in summary


def test_a_sustained_flood_gets_one_count_a_window(make_hub, make_peer, caplog):
    """Three floods, each in its own log window (the hub's log on a clock the test moves, so
    a slow machine cannot stretch one flood over several windows)."""
    caplog.set_level(logging.WARNING, logger="transport.hub")
    hub = make_hub(peer_timeout=30.0)
    clock = Clock()
    hub._rejections._clock = clock
    mallory = make_peer("mallory", hub, peer_timeout=30.0)
    hub.wait_for(["mallory"], timeout=3)
    hub.session = "s" * 32
    for window in range(1, 4):  # three windows, each with a flood
        for _ in range(200):
            mallory.send(Envelope(kind="contribution", sender="", session="wrong"))
        assert wait_until(lambda n=200 * window: hub.keepalive() or hub.rejected == n, timeout=20)
        clock.now += hub._rejections.window_s + 1  # the window is over
        serve(hub, 1.2)  # with the heartbeat that flushes its count
    sent = 600
    hub.close()
    loud = warnings_of(caplog, "transport.hub")
    counts = [line for line in loud if "more message" in line]
    assert len(loud) == REJECT_LOG_BURST + len(counts)
    assert 2 <= len(counts) <= 4  # one per window (and the final one at close)
    counted = sum(int(line.split("rejected ")[1].split(" more")[0]) for line in counts)
    assert counted + REJECT_LOG_BURST == sent == hub.rejected


def test_a_peer_flooded_by_its_hub_logs_a_few_warnings(make_hub, make_peer, caplog):
    caplog.set_level(logging.WARNING, logger="transport.peer")
    hub = make_hub(peer_timeout=30.0)
    peer = make_peer("party1", hub, peer_timeout=30.0, logger=logging.getLogger("transport.peer"))
    hub.wait_for(["party1"], timeout=3)
    peer.session = "p" * 32
    for _ in range(500):
        hub.send("party1", Envelope(kind="sum", sender="", session="wrong"))
    hub.send("party1", Envelope(kind="sum", sender="", session="p" * 32, meta={"ok": 1}))
    assert peer.recv(timeout=3).meta == {"ok": 1}
    assert peer.rejected == 500
    loud = warnings_of(caplog, "transport.peer")
    assert len(loud) == REJECT_LOG_BURST
    peer.close()
    assert "rejected 495 more messages from aggregator" in warnings_of(caplog, "transport.peer")[-1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.DEBUG, logger="t.rejections")
    clock = Clock()
    return RejectionLog(logging.getLogger("t.rejections"), window_s=60, burst=3, clock=clock), clock


def levels(caplog) -> list[str]:
    return [r.levelname for r in caplog.records if r.name == "t.rejections"]


def test_the_burst_comes_back_only_after_a_quiet_window(log, caplog):
    rejections, clock = log
    for _ in range(10):
        rejections.rejected("mallory", "mallory", "bad")
    assert levels(caplog) == ["WARNING"] * 3 + ["DEBUG"] * 7
    caplog.clear()
    clock.now += 61
    rejections.flush()  # the window is over: its count, and the sender stays quiet
    rejections.rejected("mallory", "mallory", "worse")
    assert levels(caplog) == ["WARNING", "DEBUG"]
    assert "rejected 7 more messages from mallory" in caplog.records[0].getMessage()
    caplog.clear()
    clock.now += 61  # a window with one rejection past the burst: counted, quiet again
    rejections.rejected("mallory", "mallory", "again")
    assert levels(caplog) == ["WARNING", "DEBUG"]
    assert "rejected 1 more message from mallory" in caplog.records[0].getMessage()
    assert "the last one: worse" in caplog.records[0].getMessage()
    caplog.clear()
    clock.now += 61
    rejections.flush()
    clock.now += 61  # a window with nothing beyond the burst: the burst again
    rejections.rejected("mallory", "mallory", "new")
    assert levels(caplog) == ["WARNING", "WARNING"]


def test_each_sender_has_its_own_burst_and_the_senders_kept_are_bounded(log, caplog):
    rejections, clock = log
    for name in ("alpha", "beta"):
        for _ in range(4):
            rejections.rejected(name, name, "bad")
    assert levels(caplog).count("WARNING") == 6
    for i in range(transport.sockets._REJECT_LOG_MAX_SENDERS + 50):
        rejections.rejected(f"r{i}", f"r{i}", "bad")
    assert len(rejections._senders) <= transport.sockets._REJECT_LOG_MAX_SENDERS + 1
