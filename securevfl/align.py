"""`securevfl align`: private set intersection of each passive party's identifiers with the label
holder's, over ZeroMQ with CurveZMQ (the active party binds, each party connects; the
aggregator takes no part and learns nothing), so that each side learns which of its rows the
other holds and nothing about the other rows (`crypto.psi`: ECDH-PSI on edwards25519).

Identifiers are bucketed by a hash prefix (2^k buckets, k chosen from the set sizes so that a
bucket holds about 2^16 identifiers), so each message and each blinding step is bounded by a
bucket (a failed run is restarted from the beginning, with fresh scalars). The label holder
sends heartbeats between slices of `KEEPALIVE_POINTS` points while it blinds, so a party does
not take a long bucket on a loaded machine for a lost peer. What leaks, besides the
intersection: each side's set size, and how many of its identifiers fall in each bucket (a hash
of the identifiers, as SecretFlow's bucketed PSI).

Outputs (`--out DIR`): each party writes `aligned/<party>.csv`, its rows shared with the label
holder; the active party writes `aligned/presence.csv` (its id, then one 0/1 column per party)
and `aligned/summary.json` (sizes, intersection sizes, seconds, bytes).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
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

KINDS = frozenset({"psi-join", "psi-blinded", "psi-reply", "psi-matches"})
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
    presence = {}
    summary: dict[str, Any] = {"active": len(mine), "parties": {}}
    try:
        sizes = {}
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
        for party in cfg.party_names:
            t0, sent0, recv0 = time.perf_counter(), hub.bytes_sent, hub.bytes_received
            shared = _with_party(hub, party, mine, sizes[party], timeout=timeout, logger=logger)
            presence[party] = shared
            summary["parties"][party] = {
                "size": sizes[party],
                "intersection": int(shared.sum()),
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
    return summary


def _with_party(
    hub: Hub,
    party: str,
    mine: list[str],
    theirs: int,
    *,
    timeout: float,
    logger: logging.Logger,
) -> np.ndarray:
    """One PSI with `party`, bucket by bucket; returns which of `mine` it holds."""
    bits = bucket_bits(max(len(mine), theirs))
    buckets = bucket_of(mine, bits)
    shared = np.zeros(len(mine), dtype=bool)
    for b in range(2**bits):
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


def _await(endpoint: Any, sender: str, kind: str, bucket: int, timeout: float) -> Envelope:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            env = endpoint.recv(timeout=1.0)
        except ReceiveTimeout:
            continue
        if env.kind == kind and env.sender == sender and env.meta.get("bucket") == bucket:
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
    shared = np.zeros(len(theirs_ids), dtype=bool)
    try:
        peer.send(Envelope(kind="psi-join", sender=name, meta={"size": len(theirs_ids)}))
        bits = None
        done = 0
        while bits is None or done < 2**bits:
            blinded = _await(peer, cfg.active_name, "psi-blinded", done, timeout)
            bits = int(blinded.meta["bits"])
            buckets = bucket_of(theirs_ids, bits)
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
