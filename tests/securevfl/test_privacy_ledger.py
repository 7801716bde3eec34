"""The ledger: append-only and fsynced, survives crashes, refuses corrupt or dishonest events."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


# ------------------------------------------------------------------------------ hostile files

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from securevfl.privacy.ledger import repair_torn_tail  # noqa: E402

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


_TEMPLATES: dict[str, bytes] = {}


def _write_valid_ledger(path, kinds) -> list[bytes]:
    """A ledger of the given record kinds, each line as the API writes it (written through
    the API once, then copied: an fsync per line would make the property tests slow)."""
    if not _TEMPLATES:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            ledger = PrivacyLedger(Path(tmp) / LEDGER_FILENAME)
            ledger.record(label_event(3, noise_multiplier=1.5))
            ledger.record_unprotected(role="alpha", what="sum", reason="plain mode", epoch=2)
            ledger.record_refusal(role="beta", rule="min_group", detail="one party", round=7)
            ledger.record_note(role="active", what="resume", detail="forced")
            lines = ledger.path.read_bytes().splitlines(keepends=True)
        _TEMPLATES.update(zip(("dp", "unprotected", "refusal", "note"), lines, strict=True))
    lines = [_TEMPLATES[kind] for kind in kinds]
    path.write_bytes(b"".join(lines))
    return lines


def _read_cleanly(path):
    """Read a ledger; the only failure allowed is a `LedgerError` naming the file and a line."""
    try:
        return PrivacyLedger.read(path)
    except LedgerError as exc:
        assert str(path) in str(exc) and " line " in str(exc), exc
        return None


KINDS = st.lists(st.sampled_from(["dp", "unprotected", "refusal", "note"]), min_size=1, max_size=5)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats()
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@FUZZ
@given(data=st.binary(max_size=400))
def test_any_bytes_are_events_or_a_ledger_error_naming_the_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("ledger") / LEDGER_FILENAME
    path.write_bytes(data)
    _read_cleanly(path)


@FUZZ
@given(
    kinds=KINDS,
    changes=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    "schema",
                    "kind",
                    "role",
                    "mechanism",
                    "noise_multiplier",
                    "clip",
                    "sample_rate",
                    "steps",
                    "delta",
                    "epoch",
                    "amplified",
                    "note",
                    "time",
                    "what",
                    "reason",
                    "rule",
                    "detail",
                    "round",
                    "extra",
                ]
            ),
            JSON_VALUES,
        ),
        min_size=1,
        max_size=3,
    ),
    drop=st.booleans(),
)
def test_a_valid_line_with_any_field_changed_is_an_event_or_a_ledger_error(
    tmp_path_factory, kinds, changes, drop
):
    """Well-formed JSON with wrong types, missing or unknown keys: never a crash."""
    path = tmp_path_factory.mktemp("ledger") / LEDGER_FILENAME
    lines = _write_valid_ledger(path, kinds)
    record = json.loads(lines[-1])
    for key, value in changes:
        if drop and key in record:
            del record[key]
        else:
            record[key] = value
    lines[-1] = json.dumps(record).encode() + b"\n"
    path.write_bytes(b"".join(lines))
    _read_cleanly(path)


@FUZZ
@given(kinds=KINDS, seed=st.integers(0, 2**32 - 1), edits=st.integers(1, 6))
def test_a_mutated_ledger_is_events_or_a_ledger_error(tmp_path_factory, kinds, seed, edits):
    """Random byte flips, deletions, insertions and duplications of a real ledger."""
    import random

    path = tmp_path_factory.mktemp("ledger") / LEDGER_FILENAME
    data = bytearray(b"".join(_write_valid_ledger(path, kinds)))
    rng = random.Random(seed)
    for _ in range(edits):
        at = rng.randrange(len(data) + 1)
        op = rng.randrange(4)
        if op == 0 and at < len(data):
            data[at] = rng.randrange(256)
        elif op == 1:
            del data[at : at + rng.randrange(1, 40)]
        elif op == 2:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
        else:
            data[at:at] = data[rng.randrange(len(data) + 1) :][: rng.randrange(1, 80)]
    path.write_bytes(bytes(data))
    _read_cleanly(path)


def test_json_nested_deeper_than_the_parser_allows_is_a_ledger_error(tmp_path):
    path = tmp_path / LEDGER_FILENAME
    path.write_bytes(b"[" * 100_000 + b"\n")
    with pytest.raises(LedgerError, match="line 1 is corrupt"):
        PrivacyLedger.read(path)
    path.write_bytes(b'{"schema":1,"kind":"dp","a":' + b"[" * 100_000)  # torn, too
    assert repair_torn_tail(path) is not None
    assert PrivacyLedger.read(path)[-1]["what"] == "torn line repaired"


def _complete(lines: list[bytes], cut: int) -> tuple[int, bytes]:
    """(how many whole lines a file cut after `cut` bytes keeps, the torn fragment)."""
    whole, size = 0, 0
    for line in lines:
        if size + len(line) > cut:
            break
        whole, size = whole + 1, size + len(line)
    return whole, b"".join(lines)[size:cut]


@FUZZ
@given(kinds=KINDS, where=st.floats(0.0, 1.0, exclude_max=True))
def test_a_ledger_cut_at_any_byte_is_detected_reported_and_repaired_without_undercounting(
    tmp_path_factory, kinds, where
):
    path = tmp_path_factory.mktemp("ledger") / LEDGER_FILENAME
    lines = _write_valid_ledger(path, kinds)
    data = b"".join(lines)
    cut = 1 + int(where * (len(data) - 1))
    path.write_bytes(data[:cut])
    whole, fragment = _complete(lines, cut)
    before = PrivacyLedger.read(path, tolerate_torn_tail=True)
    assert len(before) == whole + (fragment == lines[whole][:-1] if fragment else 0)
    if not fragment:  # cut at a line end: nothing torn
        assert len(PrivacyLedger(path).events) == whole
        assert repair_torn_tail(path) is None
        return
    if fragment != lines[whole][:-1]:  # detected, and reported naming the torn line
        with pytest.raises(LedgerError, match=rf"line {whole + 1} is corrupt.*torn"):
            PrivacyLedger.read(path)
    with pytest.raises(LedgerError, match="no final newline|torn"):
        PrivacyLedger(path)  # never appends after a torn line

    torn = repair_torn_tail(path)
    assert torn is not None and torn.size == len(fragment)
    assert fragment in torn.quarantine.read_bytes()  # nothing thrown away
    after = PrivacyLedger(path).events  # appendable again
    assert after[:whole] == before[:whole] and after[-1]["what"] == "torn line repaired"
    dp = lambda events: sum(isinstance(e, LedgerEvent) for e in events)  # noqa: E731
    cut_line = json.loads(lines[whole])
    if cut_line["kind"] == "dp":
        survived = len(fragment) > lines[whole].index(b',"epoch":')  # every accounted field
        assert dp(after) == dp(before[:whole]) + (1 if survived else 0)
        if survived:
            counted = [e for e in after if isinstance(e, LedgerEvent)][-1]
            assert (
                counted.history_entry
                == LedgerEvent(
                    **{k: v for k, v in cut_line.items() if k not in ("schema", "kind")}
                ).history_entry
            )
    else:
        assert dp(after) == dp(before[:whole])
    PrivacyLedger(path).record(label_event(99))
    assert PrivacyLedger.read(path)[-1].epoch == 99
