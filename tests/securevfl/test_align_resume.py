"""`securevfl align` resumes per bucket: a run interrupted after bucket k, run again with the
same files and output directory, restarts at bucket k + 1 (what was sent for buckets 0..k is
not sent again) and gives both sides exactly the intersection; the journals are their owners'
alone and valid only for the same identifiers."""

from __future__ import annotations

import csv
import stat
import threading

import numpy as np
import pytest

import securevfl.align as align
from securevfl.align import BucketJournal, journal_dir
from tests.securevfl.test_align import restore_transport, run_alignment  # noqa: F401

K = 5  # the interrupted run completes buckets 0..K


class Interrupted(Exception):
    """Stands for the process being stopped right after a bucket."""


def _bucket_kinds(sent, kind: str) -> list[int]:
    return [env.meta["bucket"] for env in sent if env.kind == kind]


def test_an_interrupted_alignment_resumes_after_the_last_completed_bucket(
    tmp_path,
    restore_transport,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setattr(align, "BUCKET_TARGET", 64)  # 600 ids: 16 buckets
    record = BucketJournal.record

    def interrupting(self, bucket, bits, rows):
        record(self, bucket, bits, rows)
        if bucket == K:
            raise Interrupted(f"stopped after bucket {bucket}")

    monkeypatch.setattr(BucketJournal, "record", interrupting)
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    cfg, result, sent, common, _, _ = run_alignment(tmp_path, n=600, parties=("bank",))
    assert not result and len(errors) == 2 and all(isinstance(e, Interrupted) for e in errors)
    assert _bucket_kinds(sent, "psi-blinded") == list(range(K + 1))
    active_journal = journal_dir(tmp_path, "active", "bank")
    party_journal = journal_dir(tmp_path, "bank", "active")
    for journal in (active_journal, party_journal):
        assert stat.S_IMODE(journal.stat().st_mode) == 0o700
        for p in journal.iterdir():
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert not (tmp_path / "aligned" / "presence.csv").exists()

    monkeypatch.setattr(BucketJournal, "record", record)
    cfg, result, sent, common, _, _ = run_alignment(tmp_path, n=600, parties=("bank",))
    assert result["bank"] == len(common) == 300
    summary = result["active"]["parties"]["bank"]
    assert summary["buckets"] == 16 and summary["resumed_at_bucket"] == K + 1
    assert summary["intersection"] == 300
    # nothing of buckets 0..K crossed again: fewer messages than a whole run
    assert _bucket_kinds(sent, "psi-blinded") == list(range(K + 1, 16))
    assert _bucket_kinds(sent, "psi-matches") == list(range(K + 1, 16))
    assert _bucket_kinds(sent, "psi-start") == [K + 1]
    with (tmp_path / "aligned" / "presence.csv").open() as fh:
        assert {r["id"] for r in csv.DictReader(fh) if r["bank"] == "1"} == common
    with (tmp_path / "aligned" / "bank.csv").open() as fh:
        assert {r["id"] for r in csv.DictReader(fh)} == common
    assert not active_journal.exists()  # the label holder's go once the outputs are written

    # run again: the label holder's journal is gone, so everything is aligned anew
    cfg, result, sent, common, _, _ = run_alignment(tmp_path, n=600, parties=("bank",))
    assert result["active"]["parties"]["bank"]["resumed_at_bucket"] == 0
    assert _bucket_kinds(sent, "psi-blinded") == list(range(16))
    assert result["bank"] == 300


def test_a_journal_holds_only_for_the_same_identifiers_and_sizes(tmp_path):
    key = {"me": "active", "peer": "bank", "ids": "ab" * 32, "size": 10, "bits": 2}
    journal = BucketJournal(tmp_path / "j", key)
    assert journal.done == 0
    journal.record(0, 2, np.array([1, 4]))
    journal.record(1, 2, np.array([], dtype=np.int64))
    with pytest.raises(RuntimeError):
        journal.record(3, 2, np.array([0]))  # not the next bucket
    again = BucketJournal(tmp_path / "j", dict(key))
    assert again.done == 2
    assert np.flatnonzero(again.shared(10)).tolist() == [1, 4]
    again.keep(1)
    assert BucketJournal(tmp_path / "j", dict(key)).done == 1
    changed = BucketJournal(tmp_path / "j", {**key, "ids": "cd" * 32})
    assert changed.done == 0 and not (tmp_path / "j").exists()


def test_a_bucket_the_party_did_not_complete_is_aligned_again(
    tmp_path,
    restore_transport,  # noqa: F811
    monkeypatch,
):
    """The party stops after the label holder completed bucket K but before it did (it got the
    matches, never recorded them): the run again restarts at bucket K, the last one both
    completed, not K + 1."""
    monkeypatch.setattr(align, "BUCKET_TARGET", 64)
    monkeypatch.setattr(align, "PEER_TIMEOUT_FLOOR", 0.0)  # the label holder notices at once
    record = BucketJournal.record

    def party_stops(self, bucket, bits, rows):
        if self.key["me"] == "bank" and bucket == K:
            raise Interrupted(f"stopped before recording bucket {bucket}")
        record(self, bucket, bits, rows)

    monkeypatch.setattr(BucketJournal, "record", party_stops)
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    network = {"heartbeat_interval": 0.2, "peer_timeout": 1.0}
    run_alignment(tmp_path, n=600, parties=("bank",), network=network)
    assert len(errors) == 2 and any(isinstance(e, Interrupted) for e in errors)
    monkeypatch.setattr(BucketJournal, "record", record)
    _, result, sent, common, _, _ = run_alignment(
        tmp_path, n=600, parties=("bank",), network=network
    )
    assert result["active"]["parties"]["bank"]["resumed_at_bucket"] == K
    assert _bucket_kinds(sent, "psi-blinded") == list(range(K, 16))
    assert result["bank"] == len(common) == result["active"]["parties"]["bank"]["intersection"]
