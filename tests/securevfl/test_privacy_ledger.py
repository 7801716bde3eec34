"""The ledger: append-only and fsynced, survives crashes, refuses corrupt or dishonest events."""

from __future__ import annotations

import json
import os

import pytest

from securevfl.privacy.audit import NO_GUARANTEE, audit, format_report
from securevfl.privacy.ledger import (
    LEDGER_FILENAME,
    LedgerError,
    LedgerEvent,
    PrivacyLedger,
)
from securevfl.privacy.mechanisms import DPSGD, LabelGradientDP


def label_event(epoch: int = 0, **changes) -> LedgerEvent:
    fields = dict(
        role="active",
        mechanism="label_dp",
        noise_multiplier=1.1,
        clip=1.0,
        sample_rate=1.0,
        steps=1,
        delta=1e-5,
        epoch=epoch,
        amplified=False,
    )
    fields.update(changes)
    return LedgerEvent(**fields)


def test_events_round_trip_in_order(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    ledger = PrivacyLedger(path)
    written = [label_event(e) for e in range(3)]
    for e in written:
        ledger.record(e)
    ledger.record_unprotected(role="alice", what="representation sum", reason="plain mode")
    read = PrivacyLedger.read(path)
    assert read[:3] == written
    assert read[3]["mechanism"] == "unprotected" and read[3]["role"] == "alice"
    assert ledger.events == read
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["schema"] == 1 for line in lines)


def test_events_written_before_an_exception_are_readable(tmp_path):
    path = tmp_path / "run" / LEDGER_FILENAME
    ledger = PrivacyLedger(path)
    with pytest.raises(RuntimeError, match="boom"):
        for epoch in range(10):
            ledger.record(label_event(epoch))
            if epoch == 4:
                raise RuntimeError("boom")
    assert [e.epoch for e in PrivacyLedger.read(path)] == [0, 1, 2, 3, 4]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_events_survive_a_process_killed_without_cleanup(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    pid = os.fork()
    if pid == 0:  # child: record, then die without flushing or closing anything
        try:
            ledger = PrivacyLedger(path)
            for epoch in range(3):
                ledger.record(label_event(epoch))
        finally:
            os._exit(17)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 17
    assert [e.epoch for e in PrivacyLedger.read(path)] == [0, 1, 2]


def test_a_corrupt_line_is_refused_naming_its_number(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    ledger = PrivacyLedger(path)
    ledger.record(label_event(0))
    ledger.record(label_event(1))
    lines = path.read_text().splitlines()
    lines.insert(1, '{"schema": 1, "kind": "dp", "role": "active"')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(LedgerError, match="line 2"):
        PrivacyLedger.read(path)
    with pytest.raises(LedgerError, match="line 2"):
        audit(path)


def test_a_valid_json_line_with_a_dishonest_event_is_refused(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    PrivacyLedger(path).record(label_event(0))
    bad = label_event(1).to_json()
    bad.update(sample_rate=0.01, amplified=True)  # label DP claiming amplification
    with path.open("a") as f:
        f.write(json.dumps(bad) + "\n")
    with pytest.raises(LedgerError, match=r"line 2 .*without subsampling amplification"):
        PrivacyLedger.read(path)


def test_a_torn_last_line_is_explained_and_can_be_dropped(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    ledger = PrivacyLedger(path)
    ledger.record(label_event(0))
    with path.open("a") as f:
        f.write('{"schema": 1, "kind": "dp", "ro')
    with pytest.raises(LedgerError, match=r"line 2 .*torn"):
        PrivacyLedger.read(path)
    assert len(PrivacyLedger.read(path, tolerate_torn_tail=True)) == 1
    with pytest.raises(LedgerError, match="line 2"):
        PrivacyLedger(path)  # never append after a torn line


def test_reopening_a_ledger_appends_to_it(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    PrivacyLedger(path).record(label_event(0))
    resumed = PrivacyLedger(path)
    assert len(resumed.events) == 1
    resumed.record(label_event(1))
    assert [e.epoch for e in PrivacyLedger.read(path)] == [0, 1]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"sample_rate": 0.1, "amplified": True}, "without subsampling amplification"),
        ({"mechanism": "embedding_dp", "sample_rate": 0.5, "amplified": True}, "amplification"),
        ({"sample_rate": 0.1}, "disagrees"),
        ({"mechanism": "dp_sgd", "amplified": True}, "disagrees"),
        ({"mechanism": "laplace"}, "unknown mechanism"),
        ({"steps": 0}, "steps"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"delta": 1.0}, "delta"),
        ({"role": ""}, "role"),
        ({"epoch": -1}, "epoch"),
    ],
)
def test_ledger_event_refuses_what_an_accountant_cannot_honestly_use(changes, message):
    with pytest.raises(ValueError, match=message):
        label_event(**changes)


def test_record_release_takes_sigma_and_clip_from_the_mechanism(tmp_path):
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    label = LabelGradientDP(noise_multiplier=2.0, clip=0.5)
    e = ledger.record_release(label, role="active", delta=1e-5, epoch=0)
    assert (e.mechanism, e.noise_multiplier, e.clip, e.sample_rate, e.amplified) == (
        "label_dp",
        2.0,
        0.5,
        1.0,
        False,
    )
    with pytest.raises(ValueError, match="without subsampling amplification"):
        ledger.record_release(label, role="active", delta=1e-5, sample_rate=0.1)
    sgd = DPSGD(noise_multiplier=1.0, clip=1.0)
    e = ledger.record_release(sgd, role="alice", delta=1e-5, sample_rate=0.01)
    assert e.amplified
    assert len(PrivacyLedger.read(ledger.path)) == 2  # the refused release was not written


def test_history_merges_consecutive_equal_steps(tmp_path):
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    for sigma in (1.0, 1.0, 2.0, 2.0, 2.0, 1.0):
        ledger.record(label_event(noise_multiplier=sigma))
    ledger.record(label_event(role="other"))
    assert ledger.history(role="active", mechanism="label_dp") == [
        (1.0, 1.0, 2),
        (2.0, 1.0, 3),
        (1.0, 1.0, 1),
    ]


def test_unprotected_releases_appear_in_the_audit_as_no_formal_guarantee(tmp_path):
    ledger = PrivacyLedger(tmp_path / LEDGER_FILENAME)
    ledger.record(label_event(0))
    for epoch in range(3):
        ledger.record_unprotected(
            role="alice",
            what="representation sum (min_group=1)",
            reason="a sum over one contributor is its value",
            epoch=epoch,
        )
    report = audit(tmp_path)  # a run directory works too
    [release] = report.unprotected
    assert (release.role, release.count, release.guarantee) == ("alice", 3, NO_GUARANTEE)
    assert (release.first_epoch, release.last_epoch) == (0, 2)
    text = format_report(report)
    assert "no formal guarantee" in text and "representation sum (min_group=1)" in text
    js = report.to_json()
    assert js["unprotected"][0]["guarantee"] == "no formal guarantee"
    json.dumps(js)  # plain data
