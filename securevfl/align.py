"""`securevfl align`: private set intersection of each passive party's identifiers with the label
holder's, over ZeroMQ with CurveZMQ (the active party binds, each party connects; the
aggregator takes no part and learns nothing), so that each side learns which of its rows the
other holds and nothing about the other rows (`crypto.psi`: ECDH-PSI on edwards25519).

Identifiers are bucketed by a hash prefix (2^k buckets, k chosen from the set sizes so that a
bucket holds about 2^16 identifiers), so each message and each blinding step is bounded by a
bucket. Each side journals the buckets it has completed with each peer (`BucketJournal`: the
rows of its own found shared in each, in `OUT/aligned/.psi-<role>-<peer>/`, mode 0700, files
0600), so an interrupted alignment run again with the same files and `--out` restarts after
the last bucket both sides completed (the label holder says where, `psi-start`), with fresh
scalars, and sends nothing again for the buckets before. The label holder
sends heartbeats between slices of `KEEPALIVE_POINTS` points while it blinds, so a party does
not take a long bucket on a loaded machine for a lost peer. What leaks, besides the
intersection: each side's set size, and how many of its identifiers fall in each bucket (a hash
of the identifiers, as SecretFlow's bucketed PSI).

Outputs (`--out DIR`): each party writes `aligned/<party>.csv`, its rows shared with the label
holder; the active party writes `aligned/presence.csv` (its id, then one 0/1 column per party)
and `aligned/summary.json` (sizes, intersection sizes, seconds, bytes, the bucket each PSI
resumed at). The label holder removes its journals once these are written; a party keeps its
own (what it holds is its output's rows), used again only if the label holder's journal with
it is there too.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from crypto import psi
from securevfl.config import RunConfig
from securevfl.data.columns import read_table
from securevfl.errors import DataError, RunAborted
from securevfl.keys import load_public, load_secrets
from transport import Allowlist, Envelope, Hub, Peer, ReceiveTimeout

KINDS = frozenset({"psi-join", "psi-start", "psi-blinded", "psi-reply", "psi-matches"})
BUCKET_TARGET = 2**16
MAX_IDS = 10**8
# the label holder blinds this many points between heartbeats (its hub sends them only when
# called): a bucket's blinding takes far longer than the peers' timeout on a loaded machine
KEEPALIVE_POINTS = 4096
PEER_TIMEOUT_FLOOR = 60.0  # seconds; [network] peer_timeout if larger


def bucket_bits(n: int) -> int:
    return max(0, math.ceil(math.log2(max(1, n) / BUCKET_TARGET)))


def bucket_of(identifiers: Sequence[str], bits: int) -> np.ndarray:
    """The bucket of each identifier: the first `bits` bits of SHA-256 (0 with no bits)."""
    if bits == 0:
        return np.zeros(len(identifiers), dtype=np.int64)
    return np.array(
        [
            int.from_bytes(
                hashlib.sha256(b"securevfl/psi-bucket|" + x.encode()).digest()[:4], "big"
            )
            >> (32 - bits)
            for x in identifiers
        ],
        dtype=np.int64,
    )


class BucketJournal:
    """The buckets of one PSI (this role with one peer) completed so far, in `directory` (mode
    0700, files 0600): the rows of this role's identifiers found shared in each, so that an
    interrupted alignment resumes after the last completed one. Valid only for the same `key`
    (identifiers' digest, sizes, peers; any change and the journal starts empty)."""

    def __init__(self, directory: Path, key: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.key = key
        state = self._read()
        if state is None or state.get("key") != key:
            shutil.rmtree(self.dir, ignore_errors=True)
            state = {"key": key, "done": 0, "bits": None}
        self.done = int(state["done"])  # buckets 0 .. done - 1 are complete
        self.bits = state.get("bits")

    def keep(self, buckets: int) -> None:
        """Forget the buckets from `buckets` on (the peer has not completed them)."""
        if buckets < self.done:
            self.done = buckets
            self._write_state()

    def restart(self, bits: int) -> None:
        """An empty journal for `bits` bucket bits."""
        self.done, self.bits = 0, bits
        self._write_state()

    def record(self, bucket: int, bits: int, rows: np.ndarray) -> None:
        """Bucket `bucket` complete: `rows` (positions among this role's identifiers) shared."""
        if bucket != self.done or (self.bits is not None and bits != self.bits):
            raise RuntimeError(f"{self.dir}: bucket {bucket} recorded after {self.done} done")
        self._write(f"bucket-{bucket}.npy", _npy(np.asarray(rows, dtype=np.int64)))
        self.done, self.bits = bucket + 1, bits
        self._write_state()

    def shared(self, n: int) -> np.ndarray:
        """Which of the `n` identifiers the completed buckets found shared."""
        out = np.zeros(n, dtype=bool)
        for b in range(self.done):
            rows = np.load(self.dir / f"bucket-{b}.npy", allow_pickle=False)
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                raise DataError(f"{self.dir}: bucket {b} names rows outside 0..{n - 1}")
            out[rows] = True
        return out

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _read(self) -> dict[str, Any] | None:
        try:
            state = json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return None
        return state if isinstance(state, dict) else None

    def _write_state(self) -> None:
        state = {"key": self.key, "done": self.done, "bits": self.bits}
        self._write("state.json", json.dumps(state).encode())

    def _write(self, name: str, data: bytes) -> None:
        """`data` as file `name`, whole or not at all (written aside, then renamed)."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.dir / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / name)


def _npy(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _digest(ids: Sequence[str]) -> str:
    h = hashlib.sha256()
    for x in ids:
        h.update(x.encode() + b"\n")
    return h.hexdigest()


def journal_dir(out: Path, role: str, peer: str) -> Path:
    return Path(out) / "aligned" / f".psi-{role}-{peer}"


def identifiers(path: Path, cfg: RunConfig, columns: Sequence[str]) -> list[str]:
    """The identifiers of a role's table, as written."""
    table = read_table(path, columns=columns, id_column=cfg.id_column, na=cfg.na_tokens)
    ids = [str(x).strip() for x in table.id_text]
    if len(ids) > MAX_IDS:
        raise DataError(f"{path}: {len(ids)} identifiers, more than the {MAX_IDS} allowed")
    return ids


# ------------------------------------------------------------------------------------ active


def align_active(
    cfg: RunConfig,
    *,
    data: Path,
    keys_dir: Path,
    bind: str,
    out: Path,
    logger: logging.Logger,
    timeout: float = 600.0,
    on_bound: Any = None,
) -> dict[str, Any]:
    """The label holder's side with every party of the config; returns the summary."""
    started = time.perf_counter()
    mine = identifiers(data, cfg, [])
    public = load_public(keys_dir)
    secrets = load_secrets(keys_dir, cfg.active_name)
    hub = Hub(
        name=cfg.active_name,
        bind=bind,
        keypair=secrets.curve,
        allowlist=Allowlist({p: public.curve_public(p) for p in cfg.party_names}),
        kinds=KINDS,
        heartbeat_interval=cfg.heartbeat_interval,
        peer_timeout=max(cfg.peer_timeout, PEER_TIMEOUT_FLOOR),
        logger=logger,
    )
    if on_bound is not None:
        on_bound(hub.endpoint)
    from securevfl.roles.protocol import announce_endpoint

    announce_endpoint(hub.endpoint)  # for `securevfl align` starting every role here
    presence = {}
    summary: dict[str, Any] = {"active": len(mine), "parties": {}}
    digest = _digest(mine)
    journals: dict[str, BucketJournal] = {}
    try:
        sizes, claims = {}, {}
        deadline = time.monotonic() + timeout
        while len(sizes) < len(cfg.party_names):
            if time.monotonic() > deadline:
                absent = sorted(set(cfg.party_names) - set(sizes))
                raise RunAborted(f"parties {absent} did not join the alignment", lost=absent[0])
            try:
                env = hub.recv(timeout=1.0)
            except ReceiveTimeout:
                continue
            if env.kind == "psi-join" and isinstance(env.meta.get("size"), int):
                sizes[env.sender] = int(env.meta["size"])
                done = env.meta.get("done", 0)  # buckets it has completed with me before
                claims[env.sender] = done if isinstance(done, int) and done > 0 else 0
        for party in cfg.party_names:
            t0, sent0, recv0 = time.perf_counter(), hub.bytes_sent, hub.bytes_received
            bits = bucket_bits(max(len(mine), sizes[party]))
            key = {"me": cfg.active_name, "peer": party, "ids": digest, "size": len(mine)}
            journal = BucketJournal(
                journal_dir(out, cfg.active_name, party),
                {**key, "theirs": sizes[party], "bits": bits},
            )
            journals[party] = journal
            start = min(journal.done, claims[party])
            journal.keep(start)
            if start:
                logger.info("%s: resuming at bucket %d of %d", party, start + 1, 2**bits)
            shared = _with_party(
                hub, party, mine, sizes[party], bits, journal, timeout=timeout, logger=logger
            )
            presence[party] = shared
            summary["parties"][party] = {
                "size": sizes[party],
                "intersection": int(shared.sum()),
                "buckets": 2**bits,
                "resumed_at_bucket": start,
                "seconds": round(time.perf_counter() - t0, 3),
                "bytes_sent": int(hub.bytes_sent - sent0),
                "bytes_received": int(hub.bytes_received - recv0),
            }
            logger.info("aligned with %s: %s", party, summary["parties"][party])
    finally:
        hub.close()
    summary["seconds"] = round(time.perf_counter() - started, 3)
    out = Path(out) / "aligned"
    out.mkdir(parents=True, exist_ok=True)
    with (out / "presence.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", *cfg.party_names])
        for i, x in enumerate(mine):
            w.writerow([x, *(int(presence[p][i]) for p in cfg.party_names)])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for journal in journals.values():
        journal.remove()
    return summary


def _with_party(
    hub: Hub,
    party: str,
    mine: list[str],
    theirs: int,
    bits: int,
    journal: BucketJournal,
    *,
    timeout: float,
    logger: logging.Logger,
) -> np.ndarray:
    """One PSI with `party`, bucket by bucket from the journal's first bucket not done (the
    party is told where, `psi-start`); returns which of `mine` it holds."""
    buckets = bucket_of(mine, bits)
    shared = journal.shared(len(mine))
    hub.send(
        party,
        Envelope(kind="psi-start", sender=hub.name, meta={"bucket": journal.done, "bits": bits}),
    )
    for b in range(journal.done, 2**bits):
        rows = np.flatnonzero(buckets == b)
        alpha = psi.new_secret()  # fresh per party and bucket: no linkage across them
        order = psi.shuffle(len(rows))
        sent = _blinding(hub, alpha, [mine[rows[i]] for i in order], identifiers=True)
        hub.send(
            party,
            Envelope(
                kind="psi-blinded",
                sender=hub.name,
                tensors={"points": psi.to_array(sent)},
                meta={"bucket": b, "bits": bits},
            ),
        )
        reply = _await(hub, party, "psi-reply", b, timeout)
        again = psi.from_array(reply.tensors["again"], limit=len(sent))
        theirs_b = psi.from_array(reply.tensors["points"], limit=psi_limit(theirs))
        if len(again) != len(sent):
            raise RunAborted(
                f"{party} answered bucket {b} with {len(again)} points, not {len(sent)}"
            )
        doubled = _blinding(hub, alpha, theirs_b, identifiers=False)
        twice = set(doubled)
        hit = np.array([p in twice for p in again], dtype=bool)
        shared[rows[order[hit]]] = True
        mine_twice = set(again)
        matches = np.array([j for j, p in enumerate(doubled) if p in mine_twice], dtype=np.int64)
        hub.send(
            party,
            Envelope(
                kind="psi-matches",
                sender=hub.name,
                tensors={"positions": matches},
                meta={"bucket": b},
            ),
        )
        journal.record(b, bits, rows[order[hit]])
        logger.info(
            "%s: bucket %d of %d done (%d of my ids, %d shared)",
            party,
            b + 1,
            2**bits,
            len(rows),
            int(hit.sum()),
        )
    return shared


def _blinding(hub: Hub, scalar: bytes, items: Sequence[Any], *, identifiers: bool) -> list[bytes]:
    """`psi.blind_identifiers` (identifiers) or `psi.blind` (points), `KEEPALIVE_POINTS` at a
    time with the hub's heartbeats in between, so the party waiting meanwhile does not report
    the label holder lost."""
    out: list[bytes] = []
    for i in range(0, len(items), KEEPALIVE_POINTS):
        part = items[i : i + KEEPALIVE_POINTS]
        out += psi.blind_identifiers(scalar, part) if identifiers else psi.blind(scalar, part)
        hub.keepalive()
    return out


def psi_limit(n: int) -> int:
    return max(16, 4 * n)


def _await(endpoint: Any, sender: str, kind: str, bucket: int | None, timeout: float) -> Envelope:
    """The next `kind` envelope from `sender` for `bucket` (None: any)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            env = endpoint.recv(timeout=1.0)
        except ReceiveTimeout:
            continue
        if env.kind == kind and env.sender == sender:
            if bucket is None or env.meta.get("bucket") == bucket:
                return env
    raise RunAborted(
        f"no {kind} for bucket {bucket} from {sender} within {timeout:.0f} s", lost=sender
    )


# ------------------------------------------------------------------------------------ party


def align_party(
    cfg: RunConfig,
    *,
    name: str,
    data: Path,
    keys_dir: Path,
    address: str,
    out: Path,
    logger: logging.Logger,
    timeout: float = 600.0,
) -> int:
    """A party's side: learns which of its rows the label holder has, writes them."""
    theirs_ids = identifiers(data, cfg, [])
    public = load_public(keys_dir)
    secrets = load_secrets(keys_dir, name)
    peer = Peer(
        name=name,
        connect=address,
        keypair=secrets.curve,
        server_public=public.curve_public(cfg.active_name),
        kinds=KINDS,
        heartbeat_interval=cfg.heartbeat_interval,
        peer_timeout=max(cfg.peer_timeout, PEER_TIMEOUT_FLOOR),
        logger=logger,
        hub_name=cfg.active_name,
    )
    key = {"me": name, "peer": cfg.active_name, "ids": _digest(theirs_ids)}
    journal = BucketJournal(journal_dir(out, name, cfg.active_name), key)
    try:
        meta = {"size": len(theirs_ids), "done": journal.done}
        peer.send(Envelope(kind="psi-join", sender=name, meta=meta))
        start = _await(peer, cfg.active_name, "psi-start", None, timeout)
        bits, done = start.meta.get("bits"), start.meta.get("bucket")
        valid = isinstance(bits, int) and isinstance(done, int)
        if not valid or not 0 <= bits <= 32 or not 0 <= done <= 2**bits:
            raise RunAborted(f"the label holder started the alignment with {start.meta}")
        if done > (journal.done if journal.bits == bits else 0):
            raise RunAborted(
                f"the label holder resumes at bucket {done}, but this party completed only "
                f"{journal.done if journal.bits == bits else 0}; remove {journal.dir} and the "
                "label holder's journal, and align again"
            )
        if journal.bits != bits:
            journal.restart(bits)
        journal.keep(done)
        shared = journal.shared(len(theirs_ids))
        buckets = bucket_of(theirs_ids, bits)
        while done < 2**bits:
            blinded = _await(peer, cfg.active_name, "psi-blinded", done, timeout)
            rows = np.flatnonzero(buckets == done)
            points = psi.from_array(blinded.tensors["points"], limit=psi.POINT_BYTES * 10**7)
            beta = psi.new_secret()
            order = psi.shuffle(len(rows))
            again = psi.blind(beta, points)
            mine = psi.blind_identifiers(beta, [theirs_ids[rows[i]] for i in order])
            peer.send(
                Envelope(
                    kind="psi-reply",
                    sender=name,
                    tensors={"again": psi.to_array(again), "points": psi.to_array(mine)},
                    meta={"bucket": done},
                )
            )
            matches = _await(peer, cfg.active_name, "psi-matches", done, timeout)
            positions = np.asarray(matches.tensors["positions"], dtype=np.int64)
            if positions.size and (positions.min() < 0 or positions.max() >= len(rows)):
                raise RunAborted("the label holder sent positions outside this bucket")
            shared[rows[order[positions]]] = True
            journal.record(done, bits, rows[order[positions]])
            done += 1
    finally:
        peer.close()
    _write_rows(data, cfg, name, shared, Path(out) / "aligned" / f"{name}.csv")
    logger.info(
        "%s: %d of %d rows shared with the label holder", name, int(shared.sum()), len(shared)
    )
    return int(shared.sum())


def _write_rows(source: Path, cfg: RunConfig, role: str, keep: np.ndarray, path: Path) -> None:
    """The rows of the role's own file that are shared, as written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with (
        Path(source).open(newline="", encoding="utf-8-sig") as src,
        path.open("w", newline="") as dst,
    ):
        reader = csv.reader(src, delimiter=cfg.delimiter or ",")
        writer = csv.writer(dst)
        writer.writerow(next(reader))
        rows = [r for r in reader if r]
        for r, k in zip(rows, keep, strict=True):
            if k:
                writer.writerow(r)
