"""The passive party protects itself: every call is checked here before the party computes or
releases anything.

* **Authenticated end to end.** The active party tags each call for each recipient with an
  HMAC-SHA256 under a key derived from their pinned X25519 masking keys and the session
  (`call_tags`), over everything the call says: op, round, recipients, sums and their groups,
  clear collects, args, and digests of the ids and of every input tensor. The aggregator holds
  no such key: a call it changed, replayed from another session or invented fails
  (`CallGuard.authenticate`); a replay within the session fails the round check.
* **Declared.** The op must be one the method declares (`MethodSpec.operations`) or a role
  operation; a sum may carry only a tensor the op declares as summed; a clear collect only a
  tensor the op declares as clear *and* the party's policy allows; inputs only declared ones.
* **Groups of passive data owners.** Every group this party contributes to names distinct
  passive parties of the party's own config, includes the party, and has at least the policy's
  `min_group` of them; the active party and the aggregator never count.
* **No differencing within a model version.** For each row, the sums a party contributes the
  same value to (same tensor, same model version) must not combine linearly into a sum over
  fewer than `min_group` passive parties (`FamilyGuard`). The version is what the contributions
  are a function of besides the row: the model's weights (`model_digest`), not a count of
  updates nor the file the row came from; what was summed at each version is kept on the
  party's disk (`FamilyLog`), so that an update that moved nothing, restored weights and later
  sessions at the same weights (`securevfl predict`, `--resume`) are held to it. With
  embedding DP each call's contribution carries fresh noise, so only the sums of one call are
  checked together.

A refusal is a `PolicyRefusal` naming the rule; the party records it in the ledger and either
stops cleanly or refuses the call and keeps serving (`on_refusal`); it never releases.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from crypto import MaskingKeyPair, pair_key
from securevfl.config import RunConfig, policy_refusal
from securevfl.errors import PolicyRefusal
from securevfl.methods import MethodSpec
from securevfl.roles import protocol as P
from securevfl.secure_sum import isolating_set

AUTH_INFO = b"securevfl/call-auth/v1"


# ------------------------------------------------------------------------------------ tags


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not plain data: {type(value).__name__}")


def _digest(array: np.ndarray) -> bytes:
    a = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{a.dtype.str}|{a.shape}|".encode())
    h.update(a.data)
    return h.digest()


CALL_BINDING_PREFIX = b"securevfl/call-binding/v1"
# the one "row" under which the differencing rule files the sums of a tensor that is not one
# value per row (`Release.per_row = False`): they are checked together whatever rows a call names
WHOLE_CALL = np.array([np.iinfo(np.int64).min], dtype=np.int64)


def row_keys(ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """int64 keys of rows: a mix of each row's id and the bits of its values (float64, -0.0 as
    0.0 and every NaN as one), so equal rows (same id, same values) always share a key, in any
    file and process, and rows that differ in their id or a value almost never do (two that
    did would be filed as one: the party refuses more, never less). Never `WHOLE_CALL`."""
    ids = np.asarray(ids, dtype=np.int64)
    v = np.array(values, dtype=np.float64, copy=True).reshape(len(ids), -1) + 0.0
    v[np.isnan(v)] = np.nan
    bits = v.view(np.uint64)
    with np.errstate(over="ignore"):
        h = ids.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for j in range(bits.shape[1]):
            h ^= bits[:, j]
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    keys = h.view(np.int64)
    keys[keys == WHOLE_CALL[0]] += 1
    return keys


class TableRowKeys:
    """Which of a call's rows a party's table holds and the `row_keys` of those rows (its ids
    and encoded values), for `CallGuard`: the keys of every row of an in-memory table are
    made once per encoded matrix (8 bytes a row) and a call reads its rows' keys from there;
    a streamed table's are made from the rows a call names. The same keys as `row_keys` of
    the call's held ids and `table.rows` of them, row for row."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self._made_for: tuple[Any, Any] | None = None  # (ids, matrix) the keys were made of
        self._keys: np.ndarray | None = None

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(held: bool per id, the keys of the held ids in their order)."""
        t = self.table
        ids = np.asarray(ids, dtype=np.int64)
        pos = t.index_of(ids)
        held = pos >= 0
        if t.streamed or t.matrix is None:
            mine = ids[held]
            return held, row_keys(mine, t.rows(mine)) if len(mine) else mine
        made = self._made_for
        if made is None or made[0] is not t.ids or made[1] is not t.matrix:
            self._keys = row_keys(t.ids, t.matrix)
            self._made_for = (t.ids, t.matrix)
        return held, self._keys[pos if held.all() else pos[held]]


def call_digest(
    env_meta: Mapping[str, Any], *, session: str, round: int, tensors: Mapping
) -> bytes:
    """The bytes a call's tags cover: its meta (auth tags left out; msgpack, whose encoding the
    transport preserves key order for), session, round, and the digests of its tensors (ids
    included)."""
    meta = {k: v for k, v in env_meta.items() if k != "auth"}
    parts = [
        session.encode(),
        int(round).to_bytes(8, "big", signed=True),
        msgpack.packb(meta, default=_plain, use_bin_type=True),
    ]
    for name in sorted(tensors):
        parts += [name.encode(), _digest(tensors[name])]
    return b"\x00".join(length_prefixed(p) for p in parts)


def length_prefixed(part: bytes) -> bytes:
    return len(part).to_bytes(4, "big") + part


def auth_key(
    *, keypair: MaskingKeyPair, me: str, peer: str, peer_public: bytes, session: bytes
) -> bytes:
    """The call-authentication key of the pair (active party, party): only those two can derive
    it from their pinned masking keys."""
    base = pair_key(
        my_private=keypair.private, peer_public=peer_public, session=session, me=me, peer=peer
    )
    return hmac.digest(base, AUTH_INFO, "sha256")


def call_tag(key: bytes, digest: bytes) -> str:
    return hmac.digest(key, digest, "sha256").hex()


# ------------------------------------------------------------------------------------ families


class FamilyGuard:
    """Per tensor and model version, the groups the rows' values have been summed over: a row's
    family is the groups of every call that summed it.

    Kept as disjoint blocks of sorted row ids, each row with the index of its family (families
    are deduplicated), merged like a binary counter (a block is merged into the one before it
    while that one is at most twice its size), so there are O(log n) blocks for n rows. A call
    of k rows then costs O(k log n) look-ups and amortised O(log n) per row to store: an
    evaluation of a million rows in 4096-row calls is linear in the rows, not quadratic."""

    def __init__(self, *, min_group: int) -> None:
        self.min_group = min_group
        self._tensors: dict[str, _Families] = {}
        # per tensor, groups counted in every row's family: a version's sums folded into one
        # record when its rows were dropped from the log (`FamilyLog.compact`)
        self._everywhere: dict[str, tuple[frozenset[str], ...]] = {}
        # whether the last `admit` that passed changed a row's family (else the call repeated
        # sums already made: nothing for the log to keep)
        self.grew = False

    def new_version(self) -> None:
        self._tensors.clear()
        self._everywhere.clear()

    def admit_everywhere(self, tensor: str, groups: Iterable[frozenset[str]]) -> None:
        """Count `groups` in the family of every row of `tensor`, whichever rows a later call
        names: what is left of a version's sums after `FamilyLog.compact` folded them (the
        rows are gone; that they were summed over these groups is not). Refuses more, never
        less: a row summed over one group then counts as summed over all of them."""
        known = self._everywhere.get(tensor, ())
        self._everywhere[tensor] = tuple(dict.fromkeys(known + tuple(groups)))

    def admit(
        self,
        tensor: str,
        ids: np.ndarray,
        groups: Iterable[frozenset[str]],
        *,
        shown: np.ndarray | None = None,
    ) -> str | None:
        """Add `groups` to the family of every row of `ids` for `tensor`; returns a reason
        (and records nothing) if some row's family would isolate fewer than min_group
        parties. `shown`: what the reason names each row by (its id, where `ids` are the keys
        the party files rows under); default `ids`."""
        ids = np.asarray(ids, dtype=np.int64)
        shown = ids if shown is None else shown
        groups = tuple(dict.fromkeys(groups))
        if len(ids) == 0:
            return None
        everywhere = self._everywhere.get(tensor, ())
        known = self._tensors.get(tensor)
        if known is None:
            known = self._tensors[tensor] = _Families()
        if not known.blocks and known.first is None:
            # the first sum of this version (every training forward): no family to look up,
            # and the rows are sorted only if a second sum of the version comes
            family = tuple(dict.fromkeys(everywhere + groups))
            isolated = isolating_set(family, self.min_group)
            if isolated is not None:
                row = int(shown[0])
                return _isolating(tensor, family, isolated, row=row, versioned=bool(everywhere))
            known.first = (ids.copy(), known.index(groups))
            self.grew = True
            return None
        known.settle()
        found = known.find(ids)  # (block, positions in it, mask over ids) per block hit
        which = np.zeros(len(ids), dtype=np.int64)  # each row's family (0: none yet)
        for b, positions, hit in found:
            which[hit] = known.blocks[b][1][positions]
        grown: dict[int, int] = {}  # old family -> old family + groups
        for old in np.unique(which).tolist():
            family = tuple(dict.fromkeys(known.families[old] + groups))
            checked = tuple(dict.fromkeys(everywhere + family)) if everywhere else family
            isolated = isolating_set(checked, self.min_group)
            if isolated is not None:
                row = int(shown[np.argmax(which == old)])
                versioned = bool(old) or bool(everywhere)
                return _isolating(tensor, checked, isolated, row=row, versioned=versioned)
            grown[old] = known.index(family)
        lookup = np.arange(len(known.families), dtype=np.int64)
        lookup[list(grown)] = list(grown.values())
        for b, positions, _ in found:
            block_families = known.blocks[b][1]
            block_families[positions] = lookup[block_families[positions]]
        new = np.ones(len(ids), dtype=bool)
        for _, _, hit in found:
            new &= ~hit
        if new.any():
            known.add(np.unique(ids[new]), grown[0])
        self.grew = bool(new.any()) or any(old != now for old, now in grown.items())
        return None


def _isolating(
    tensor: str, family: Sequence[frozenset[str]], isolated: Any, *, row: int, versioned: bool
) -> str:
    sums = " ".join("{" + ",".join(sorted(g)) + "}" for g in family)
    version = " (one model version)" if versioned else ""
    return (
        f"row {row}: the sums {sums} of tensor {tensor!r}{version} combine into the "
        f"contribution of {list(isolated)} alone"
    )


class _Families:
    """One tensor's rows and their families for `FamilyGuard`: `families[0]` is the empty one;
    `blocks` are disjoint (sorted ids, family index per id), each no larger than half of the
    one before it but for the binary-counter slack."""

    def __init__(self) -> None:
        self.families: list[tuple[frozenset[str], ...]] = [()]
        self._numbers: dict[tuple[frozenset[str], ...], int] = {(): 0}
        self.blocks: list[tuple[np.ndarray, np.ndarray]] = []
        # the version's first sum, kept as given (ids, family) until a second one comes
        self.first: tuple[np.ndarray, int] | None = None

    def settle(self) -> None:
        """Store the first sum's rows (sorted, unique) as a block."""
        if self.first is not None:
            ids, family = self.first
            self.first = None
            self.add(np.unique(ids), family)

    def index(self, family: tuple[frozenset[str], ...]) -> int:
        number = self._numbers.get(family)
        if number is None:
            number = self._numbers[family] = len(self.families)
            self.families.append(family)
        return number

    def find(self, ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        out = []
        for b, (rows, _) in enumerate(self.blocks):
            pos = np.searchsorted(rows, ids)
            hit = rows[np.minimum(pos, len(rows) - 1)] == ids
            if hit.any():
                out.append((b, pos[hit], hit))
        return out

    def add(self, rows: np.ndarray, family: int) -> None:
        """Store `rows` (sorted, unique, in no block yet) with `family`, merging blocks."""
        self.blocks.append((rows, np.full(len(rows), family, dtype=np.int64)))
        while len(self.blocks) > 1 and len(self.blocks[-2][0]) <= 2 * len(self.blocks[-1][0]):
            (a, fa), (b, fb) = self.blocks[-2], self.blocks.pop()
            ids = np.concatenate([a, b])
            order = np.argsort(ids, kind="stable")
            self.blocks[-1] = (ids[order], np.concatenate([fa, fb])[order])


# ----------------------------------------------------------------------- model versions


class FamilyLog:
    """What a party summed, kept on its own disk per model version, so that the differencing
    rule holds across sessions: a `securevfl predict` or `--resume` session, or a fresh run
    whose seeded model starts where an earlier one did, finds the model's weights (its
    version, `model_digest`) again and with them every sum of that version already released.
    The same holds within a session for an update that leaves the weights as they were (a
    zero gradient) or brings back earlier ones (restoring a best model): the version is the
    weights, not a count of updates.

    An append-only file of records (version, tensor, groups, ids), each written before the
    contribution it admits leaves the party (the page cache keeps it if the process is killed;
    a record cut short by a crash is dropped on opening, as its contribution never left).
    Costs 8 bytes a row a call on disk and nothing in memory but an index of offsets. Training
    makes a new version every step, so at each checkpoint the file keeps the rows only of the
    versions a later session starts from (`compact`): the current one, those the session was
    set up at, and those of the checkpoints still on disk (`pin`). Every other version is
    folded, not dropped: one record per tensor of the groups it was summed over, counted for
    every row (`FamilyGuard.admit_everywhere`). A version can be come back to by other ways
    than a checkpoint (replaying the same steps from an earlier one; the weights are the
    version), and must then still be held to its sums."""

    _HEAD = struct.Struct("<II")  # header bytes, id count

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()

    def _open(self) -> None:
        self._index: dict[bytes, list[int]] = {}
        self.pins: dict[int, bytes] = {}  # checkpoint epoch -> its version
        self._file = self.path.open("a+b")
        size = os.fstat(self._file.fileno()).st_size
        self._file.seek(0)
        end = 0
        while True:
            head = self._file.read(self._HEAD.size)
            if len(head) < self._HEAD.size:
                break
            hbytes, count = self._HEAD.unpack(head)
            header = self._file.read(hbytes)
            self._file.seek(8 * count, 1)
            if len(header) < hbytes or self._file.tell() > size:
                break
            fields = msgpack.unpackb(header, raw=False)
            version = bytes.fromhex(fields["v"])
            if "pin" in fields:
                self.pins[int(fields["pin"])] = version
            else:
                self._index.setdefault(version, []).append(end)
            end = self._file.tell()
        self._file.truncate(end)  # a record cut short by a crash: its contribution never left
        self._file.seek(0, 2)
        # records are appended through a descriptor of their own, unbuffered (one write call
        # each: in the page cache when it returns); the buffered file above only reads
        self._end = end
        self._append = self.path.open("ab", buffering=0)
        self._headers: dict[tuple, bytes] = {}  # (tensor, groups) -> their packed fields

    @classmethod
    def _record(cls, fields: Mapping[str, Any], ids: np.ndarray) -> bytes:
        header = msgpack.packb(dict(fields), use_bin_type=True)
        ids = np.ascontiguousarray(ids, dtype="<i8")
        return cls._HEAD.pack(len(header), len(ids)) + header + ids.tobytes()

    def _write(self, fields: Mapping[str, Any], ids: np.ndarray) -> int:
        return self._write_bytes(self._record(fields, ids))

    def _write_bytes(self, record: bytes) -> int:
        """Append `record` (in the page cache before the contribution is released); returns
        its offset."""
        offset = self._end
        view = memoryview(record)
        while view:
            view = view[self._append.write(view) :]
        self._end = offset + len(record)
        return offset

    def _raw(self, offset: int) -> bytes:
        """The record at `offset`, as written."""
        self._file.seek(offset)
        head = self._file.read(self._HEAD.size)
        hbytes, count = self._HEAD.unpack(head)
        return head + self._file.read(hbytes + 8 * count)

    def append(
        self, version: bytes, tensor: str, groups: Sequence[frozenset[str]], ids: np.ndarray
    ) -> None:
        """Record that `ids` of `tensor` were summed over `groups` at `version`: the record
        `_record` writes for ``{"v": version.hex(), "t": tensor, "g": sorted groups}``, its
        header packed from the pieces (the tensor's and groups' part packed once)."""
        if len(version) != 16:  # not a `model_digest`: the general path
            fields = {"v": version.hex(), "t": tensor, "g": [sorted(g) for g in groups]}
            self._index.setdefault(version, []).append(self._write(fields, ids))
            return
        key = (tensor, *groups)
        tail = self._headers.get(key)
        if tail is None:
            packed = msgpack.packb(
                {"v": "", "t": tensor, "g": [sorted(g) for g in groups]}, use_bin_type=True
            )
            assert packed[:4] == b"\x83\xa1v\xa0"  # a 3-entry map, then "v": ""
            tail = self._headers[key] = packed[4:]
            if len(self._headers) > 256:  # bounded: a method sums a few tensors and groups
                self._headers.clear()
        # "v": the version's 32 hex digits (a str of 32 bytes: 0xd9 0x20)
        header = b"\x83\xa1v\xd9\x20" + version.hex().encode() + tail
        ids = np.ascontiguousarray(ids, dtype="<i8")
        record = self._HEAD.pack(len(header), len(ids)) + header + ids.tobytes()
        self._index.setdefault(version, []).append(self._write_bytes(record))

    def pin(self, epoch: int, version: bytes) -> None:
        """The checkpoint of `epoch` holds the weights of `version`."""
        self._write({"v": version.hex(), "pin": int(epoch)}, np.empty(0))
        self.pins[int(epoch)] = version

    def compact(self, *, keep: Iterable[bytes], epochs: Iterable[int], min_group: int = 2) -> None:
        """Rewrite the file with the records of the versions `keep` and of the checkpoints of
        `epochs` (those still on disk), and their pins. Every other version's records of a
        tensor are folded into one (its groups, for every row: `records` yields it with
        ``everywhere`` true) where those groups together isolate nobody (`min_group`: e.g.
        split-NN's one group of all parties); otherwise they are kept as written, so that a
        session brought back to that version (replaying the same steps after a resume) is
        held to them exactly rather than refused everything. Atomic: a crash leaves the old
        file or the new one."""
        pins = {e: v for e, v in self.pins.items() if e in set(epochs)}
        wanted = set(keep) | set(pins.values())
        temp = self.path.with_suffix(".compacting")
        with temp.open("wb") as out:
            for version, offsets in self._index.items():
                if version in wanted:  # copied as written, in their order
                    out.write(b"".join(self._raw(offset) for offset in offsets))
                    continue
                union: dict[str, list[frozenset[str]]] = {}
                tensors = []  # of each offset's record
                for tensor, groups, _, _ in self.records(version):
                    known = union.setdefault(tensor, [])
                    known.extend(g for g in groups if g not in known)
                    tensors.append(tensor)
                folded = {t for t, g in union.items() if isolating_set(tuple(g), min_group) is None}
                for offset, tensor in zip(offsets, tensors, strict=True):
                    if tensor not in folded:
                        out.write(self._raw(offset))
                for tensor in sorted(folded):
                    groups = [sorted(g) for g in union[tensor]]
                    fields = {"v": version.hex(), "t": tensor, "g": groups, "all": True}
                    out.write(self._record(fields, np.empty(0)))
            for epoch, version in pins.items():
                out.write(self._record({"v": version.hex(), "pin": epoch}, np.empty(0)))
            out.flush()
            os.fsync(out.fileno())
        self._file.close()
        self._append.close()
        os.replace(temp, self.path)
        self._open()

    def records(
        self, version: bytes
    ) -> Iterator[tuple[str, list[frozenset[str]], np.ndarray, bool]]:
        """(tensor, groups, ids, everywhere) of every record of `version`, in the order they
        were written; ``everywhere``: a folded record (`compact`), whose groups count for every
        row (its ids are empty)."""
        for offset in list(self._index.get(version, ())):
            self._file.seek(offset)
            hbytes, count = self._HEAD.unpack(self._file.read(self._HEAD.size))
            header = msgpack.unpackb(self._file.read(hbytes), raw=False)
            ids = np.frombuffer(self._file.read(8 * count), dtype="<i8").astype(np.int64)
            yield header["t"], [frozenset(g) for g in header["g"]], ids, bool(header.get("all"))

    def close(self) -> None:
        self._file.close()
        self._append.close()


_RAW_DIGEST_VALUES = 1 << 16  # CPU tensors up to this size are hashed byte for byte


def model_digest(method: Any, *, views: dict | None = None) -> bytes:
    """The version of a party's model: the digest of what the method declares as its version
    (`PartyMethod.version_state`: a model not held in torch modules, e.g. VFEM's
    coefficients); else a digest of the parameters and buffers of every torch module the
    party's method holds (attributes, and lists, tuples or dicts of them); else one version
    for the whole session (`_ONE_VERSION`: a method without a model refuses more, never
    less; it used to start a new version at every update, which let an update that changed
    nothing clear what the rule had seen). Equal weights
    give equal digests, in any process and with any thread count: a small CPU tensor is hashed
    byte for byte; a large or GPU one by integer sums of its bytes read as integers (exact and
    independent of the order of summation; one device sync for all). Two different weights
    that share a digest only make the party refuse more, never less.

    `views` (a dict the caller keeps between calls; a party digests after every update) holds
    what the next call may reuse, so that a digest costs the hashing and little else: the
    `_DigestPlan` (the modules' named tensors, in the order `named_parameters` then
    `named_buffers` give them, used only while every module, submodule, parameter and buffer
    is the one it was), with each small CPU tensor's byte view, which aliases its storage and
    so follows in-place updates (used only while the tensor is at the same address, shape,
    dtype and layout; anything else is read again). The digest is the same as without it."""
    declare = getattr(method, "version_state", None)
    declared = declare() if callable(declare) else None
    if declared is not None:
        return _state_digest(declared)
    module_type = _module_type()
    found: dict[int, Any] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, module_type):
            found.setdefault(id(value), value)
        elif depth < 2 and isinstance(value, list | tuple):
            for item in value:
                visit(item, depth + 1)
        elif depth < 2 and isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)

    for value in vars(method).values():  # depth 0 inline: most attributes are neither
        if isinstance(value, module_type):
            found.setdefault(id(value), value)
        elif isinstance(value, list | tuple | dict):
            visit(value, 0)
    if not found:
        return _ONE_VERSION
    plan = views.get(_PLAN) if views is not None else None
    if plan is None or not plan.holds(found):
        plan = _DigestPlan(found)
        if views is not None:
            views.clear()
            views[_PLAN] = plan  # the plan keeps the byte views: none outlives its module
    h = hashlib.blake2b(digest_size=16)
    update = h.update
    cached_views = plan.views
    stats = []
    for i, (name, t) in enumerate(plan.tensors):
        cached = cached_views[i]
        if cached is not None and cached[0] == _layout(t):
            update(cached[1])
            update(cached[2])
            continue
        from securevfl.lazy import torch

        cached_views[i] = None
        d = t.detach()
        head = f"{name}|{tuple(d.shape)}|{d.dtype}|".encode()
        update(head)
        ints = _INT_VIEW.get(d.element_size())
        if (d.device.type == "cpu" and d.numel() <= _RAW_DIGEST_VALUES) or ints is None:
            flat = d.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            update(flat)
            if views is not None and d.device.type == "cpu" and d.is_contiguous():
                cached_views[i] = (_layout(t), head, flat)  # `flat` aliases t
        else:  # its bytes as integers: an exact sum in any order
            v = d.contiguous().reshape(-1).view(getattr(torch, ints))
            stats.append(v.sum(dtype=torch.int64))
    if stats:
        from securevfl.lazy import torch

        update(torch.stack(stats).cpu().numpy().tobytes())
    return h.digest()


# the version of a party whose method holds neither torch modules nor a `version_state`:
# one for the whole session, so its sums are all checked together (it refuses more, never less)
_ONE_VERSION = hashlib.blake2b(b"securevfl: a model without a declared version").digest()[:16]


def _state_digest(state: Mapping[str, Any]) -> bytes:
    """The digest of a method's `version_state`: each entry's name, dtype, shape and bytes, in
    name order (equal values give equal digests in any process)."""
    h = hashlib.blake2b(b"version_state", digest_size=16)
    for name in sorted(state):
        value = state[name]
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        a = np.ascontiguousarray(np.asarray(value))
        if a.dtype == object:
            raise TypeError(f"version_state entry {name!r} is not numeric: {type(value).__name__}")
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.digest()


_PLAN = "plan"  # the `views` entry of the `_DigestPlan`
_ABSENT = object()


@functools.cache
def _module_type() -> type:
    """torch.nn.Module, looked up once (through the lazy import: a digest is the first to need
    torch in some processes)."""
    from securevfl.lazy import torch

    return torch.nn.Module


class _DigestPlan:
    """What `model_digest` hashes for a set of modules: their named tensors, deduplicated, in
    the order `named_parameters` then `named_buffers` give them, module after module; and a
    snapshot of every submodule's `_modules`, `_parameters` and `_buffers` (the dicts and their
    entries themselves, not copies), which `holds` compares by identity: a module, parameter
    or buffer added, removed or replaced, by attribute, by writing those dicts directly or by
    replacing them, makes the party read the modules again. What changes inside a kept tensor
    (its values; its storage, through `.data`) is the per-tensor check's business."""

    def __init__(self, found: Mapping[int, Any]) -> None:
        self.modules = tuple(found.values())  # held, so that their ids stay theirs
        self.ids = tuple(found)
        tensors: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for module in self.modules:
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if id(t) not in seen:
                    seen.add(id(t))
                    tensors.append((name, t))
        self.tensors = tuple(tensors)
        # per tensor: (its layout, head, byte view) once read, while the layout holds
        self.views: list[tuple | None] = [None] * len(tensors)
        snapshot = []
        for module in self.modules:
            for sub in module.modules():
                fields = vars(sub)
                for attr in ("_modules", "_parameters", "_buffers"):
                    entries = fields[attr]
                    snapshot.append((fields, attr, entries, tuple(entries.items())))
        self.snapshot = tuple(snapshot)

    def holds(self, found: Mapping[int, Any]) -> bool:
        """Whether `found` (the method's modules now) has the modules, submodules and tensors
        this plan was made of."""
        if tuple(found) != self.ids:
            return False
        for fields, attr, entries, items in self.snapshot:
            if fields.get(attr) is not entries or len(entries) != len(items):
                return False
            for key, value in items:
                if entries.get(key, _ABSENT) is not value:
                    return False
        return True


def _layout(t: Any) -> tuple:
    """What must not change for a kept byte view of `t` to still be its bytes: the address
    (the view holds the storage, so an equal address is the same storage), shape, strides,
    dtype, device."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


_INT_VIEW = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # element size -> integer view


# ------------------------------------------------------------------------------------ the guard


class CallGuard:
    """A passive party's checks on every call (see the module docstring)."""

    def __init__(
        self,
        *,
        cfg: RunConfig,
        name: str,
        spec: MethodSpec,
        session: bytes,
        keypair: MaskingKeyPair,
        active_public: bytes,
        keyed: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
        scoring: bool = False,
    ) -> None:
        """`keyed`: for a call's ids, which rows this party holds and the keys of those rows
        (`TableRowKeys` of its table): a held row is filed under its id and its own values
        (`row_keys`), so the same row in another file (a scoring session's) shares its record
        and another row under a reused id does not; the rows it lacks are filed as one
        (`_filed_rows`). None: every row held, filed under its id. `scoring`: the party
        was started to score rows with its trained model (`securevfl party --score`, its own
        command line): it then refuses anything that would train or checkpoint
        (`_check_mode`)."""
        self.cfg = cfg
        self.name = name
        self.scoring = scoring
        self.spec = spec
        self.policy = cfg.party(name).policy
        self.session_hex = session.hex()
        self.key = auth_key(
            keypair=keypair,
            me=name,
            peer=cfg.active_name,
            peer_public=active_public,
            session=session,
        )
        self.passive = frozenset(cfg.party_names)
        secure = cfg.aggregation != "plain"
        self.families = FamilyGuard(min_group=self.policy.min_group) if secure else None
        self.fresh_noise = cfg.party(name).embedding_dp is not None
        # the model's version (`model_digest`) and what was summed at each (`FamilyLog`)
        self.log: FamilyLog | None = None
        self.version: bytes | None = None
        self.binding: bytes | None = None  # of the call last authenticated (`authenticate`)
        self.keyed = keyed
        self.set_up_at: list[bytes] = []  # every version a set-up of this session started at
        self.seconds = 0.0  # time spent checking calls (reported with the party's stats)

    @property
    def first_version(self) -> bytes | None:
        """The version the session's first set-up started at (a later one, a retry or a
        resume, does not replace it)."""
        return self.set_up_at[0] if self.set_up_at else None

    def refuse(self, rule: str, detail: str) -> PolicyRefusal:
        return PolicyRefusal(self.name, rule, detail)

    def check_run(self) -> None:
        """Before anything: the party's own policy accepts the run its own config describes."""
        refused = policy_refusal(self.cfg, self.policy, self.spec, party=self.name)
        if refused is not None:
            raise self.refuse(f"policy {refused[0]}", refused[1])

    def authenticate(
        self, meta: Mapping[str, Any], *, session: str, round: int, tensors: Mapping
    ) -> None:
        self.binding = None  # until this call's tag has checked
        tags = meta.get("auth")
        tag = tags.get(self.name) if isinstance(tags, dict) else None
        if session != self.session_hex:
            raise self.refuse("authentication", f"a call of another session ({session[:12]}...)")
        covered = call_digest(meta, session=session, round=round, tensors=tensors)
        expected = call_tag(self.key, covered)
        if not isinstance(tag, str) or not hmac.compare_digest(tag, expected):
            raise self.refuse(
                "authentication",
                f"round {round}: the call's tag does not match: it was not sent as is by the "
                f"active party {self.cfg.active_name!r} (changed, replayed from elsewhere or "
                "invented on the way)",
            )
        # what this party's masked contributions to the call's sums are bound to: the sums
        # open only if every member was sent this same call (`MaskedSumParty.bind`)
        self.binding = hashlib.sha256(CALL_BINDING_PREFIX + covered).digest()

    def check(self, call: Any) -> None:
        """Refuse (`PolicyRefusal`) a call this party must not answer."""
        if self.name not in call.to:
            raise self.refuse("recipients", f"a call for {list(call.to)} reached {self.name!r}")
        self._check_mode(call)
        if call.op == P.OP_SETUP:
            return self._check_setup(call)
        if call.op == P.OP_SETUP_ROWS:  # a part of a streamed table's rows, before set-up
            return self._check_setup(call, inputs=("all_ids", "train_bits"), collects=())
        if call.op == P.OP_SETUP_PRESENT:  # which rows of a part it holds, after set-up
            return self._check_setup(call, inputs=(), collects=("present",))
        if call.op == P.OP_CHECKPOINT:
            return self._check_plain_call(call, inputs=(), collects=())
        op = self.spec.operation(call.op)
        if op is None:
            declared = [o.name for o in self.spec.operations]
            raise self.refuse(
                "undeclared operation",
                f"method {self.spec.name!r} declares {declared}, not {call.op!r}",
            )
        for name in call.inputs:
            if not op.accepts_input(name):
                raise self.refuse(
                    "undeclared input", f"{call.op!r} takes no input {name!r} ({list(op.inputs)})"
                )
        for name in call.collect:
            release = op.release_of(name)
            if release is None or release.to != "clear":
                raise self.refuse(
                    "clear release",
                    f"{call.op}.{name} in the clear: the method does not declare it as a clear "
                    "release (what it declares may only go into secure sums)",
                )
            if not any(
                fnmatch.fnmatchcase(f"{call.op}.{name}", p) for p in self.policy.clear_releases
            ):
                raise self.refuse(
                    "clear release",
                    f"{call.op}.{name} in the clear: this party's policy does not allow it "
                    "(clear_releases)",
                )
        mine = [s for s in call.sums if self.name in s.group]
        for s in mine:
            release = op.release_of(s.tensor)
            if release is None or release.to != "sum":
                raise self.refuse(
                    "undeclared sum", f"{call.op!r} declares no summed tensor {s.tensor!r}"
                )
            self._check_group(s.group, s.key)
        if self.cfg.aggregation != "plain":
            self._check_call_groups(call, mine)
        if self.families is not None and mine:
            if self.fresh_noise:  # fresh embedding-DP noise per call: only this call's sums
                self.families.new_version()
            by_tensor: dict[str, list[frozenset[str]]] = {}
            for s in mine:
                by_tensor.setdefault(s.tensor, []).append(frozenset(s.group))
            per_row: tuple[np.ndarray, np.ndarray] | None = None  # the call's rows, keyed once
            for tensor, groups in by_tensor.items():
                # a tensor that is not one value per row (VFEM's shift, dbeta, SEM shares) is
                # the same whichever rows a call names: all its sums are checked together
                if not op.release_of(tensor).per_row:
                    rows, shown = WHOLE_CALL, WHOLE_CALL
                else:
                    per_row = per_row or self._filed_rows(call.ids)
                    rows, shown = per_row
                reason = self.families.admit(tensor, rows, groups, shown=shown)
                if reason is not None:
                    raise self.refuse("differencing", reason)
                logged = self.log is not None and self.version is not None
                if logged and not self.fresh_noise and self.families.grew:
                    self.log.append(self.version, tensor, groups, rows)

    def _check_mode(self, call: Any) -> None:
        """A party started to score (`scoring`) sets up only to score and never trains or
        checkpoints: an update would overwrite the trained model and leave the version its
        sums are held to, a checkpoint would re-pin the log to the scoring session; a party
        started to train sets up only to train. The mode is the party's own command line's,
        never the active party's word."""
        if call.op == P.OP_SETUP and bool(call.args.get("predict", False)) != self.scoring:
            mine = "to score rows (--score)" if self.scoring else "to train"
            raise self.refuse(
                "mode",
                f"set-up {'to score' if call.args.get('predict') else 'to train'}, but this "
                f"party was started {mine}",
            )
        if not self.scoring:
            return
        op = self.spec.operation(call.op)
        if call.op == P.OP_CHECKPOINT or (op is not None and op.updates):
            raise self.refuse(
                "mode",
                f"{call.op!r} while scoring: this party was started to score rows with its "
                "trained model (--score), which it neither trains nor checkpoints",
            )

    def _filed_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The keys the differencing rule files a call's sums of a per-row tensor under, and
        the ids they stand for (for a refusal's reason): each row this party holds under its
        own key (`row_keys` of its id and values); the rows it lacks under `WHOLE_CALL`, as
        one. What a party sends for a row it lacks has no data of that row in it (VFEM's
        mu_k'beta_k, FALSE-VFL's and vanilla VFL's fill-ins): it is one value per model
        version whichever row a call names, so two sums over different lacking rows could
        otherwise difference. (A tensor not per row, `Release.per_row = False`, is all one
        `WHOLE_CALL`: `check`.)"""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return ids, ids
        if self.keyed is None:
            return ids, ids
        held, keys = self.keyed(ids)
        held = np.asarray(held, dtype=bool)
        if held.all():
            return keys, ids
        return np.concatenate([keys, WHOLE_CALL]), np.concatenate([ids[held], WHOLE_CALL])

    def _check_call_groups(self, call: Any, mine: Sequence[Any]) -> None:
        """Refuse a call whose sums of one tensor this party contributes to, together with the
        call's other sums of that tensor (those it is not in too: every member of a masked sum
        was sent this same call, or the sum opens to nothing, `MaskedSumParty.bind`), combine
        into the contribution of fewer than `min_group` parties: e.g. the pairs {a,b}, {a,c},
        {b,c} of one call give c = (S_ac + S_bc - S_ab) / 2, though no party is in all three."""
        tensors = {s.tensor for s in mine}
        for tensor in tensors:
            groups = tuple(
                dict.fromkeys(frozenset(s.group) for s in call.sums if s.tensor == tensor)
            )
            if len(groups) < 2:
                continue
            isolated = isolating_set(groups, self.policy.min_group)
            if isolated is not None:
                shown = " ".join("{" + ",".join(sorted(g)) + "}" for g in groups)
                raise self.refuse(
                    "differencing",
                    f"the call's sums {shown} of tensor {tensor!r} combine into the contribution "
                    f"of {list(isolated)} alone",
                )

    def check_fused(self, calls: Sequence[Any]) -> None:
        """A fused envelope (several calls run in order) may carry only consecutive calls the
        method declares may share one (`MethodSpec.fuse`), never a role operation; each is then
        checked as its own call by `check` right before it runs."""
        if len(calls) < 2:
            return
        for a, b in zip(calls, calls[1:], strict=False):
            if (a.op, b.op) not in self.spec.fuse:
                declared = [f"{u} then {n}" for u, n in self.spec.fuse] or "none"
                raise self.refuse(
                    "fused call",
                    f"{a.op!r} then {b.op!r} in one envelope: method {self.spec.name!r} lets "
                    f"only {declared} share one; nothing was run",
                )

    def attach(self, log_path: Path, digest: Callable[[], bytes | None]) -> None:
        """At set-up, once the model is loaded: keep what is summed per model version in
        `log_path` (this party's own disk), and start at the model's version (`digest()`, as in
        `after`) with every sum already released at it, in this session or an earlier one."""
        if self.families is None or self.fresh_noise:
            return  # nothing summed securely, or fresh noise in every call: nothing to keep
        if self.log is not None:
            self.log.close()
        self.log = FamilyLog(log_path)
        version = digest()
        if version is not None and version not in self.set_up_at:
            self.set_up_at.append(version)
        self._use_version(version)

    def checkpointed(self, epoch: int, on_disk: Iterable[int]) -> None:
        """The party saved its checkpoint of `epoch` (`on_disk`: the epochs whose checkpoints
        remain): pin the current version to it and drop the versions no session can return
        to (see `FamilyLog`)."""
        if self.log is None or self.version is None:
            return
        self.log.pin(epoch, self.version)
        keep = [v for v in (self.version, *self.set_up_at) if v is not None]
        self.log.compact(keep=keep, epochs=on_disk, min_group=self.families.min_group)

    def after(self, call: Any, *, digest: Callable[[], bytes | None] | None = None) -> None:
        """Note a model update: sums after it are of a new model version if the weights changed
        (`digest()`: their `model_digest`; None: every update starts a new version). An update
        that left the weights as they were keeps the version and its sums; one that brought
        back earlier weights returns to theirs."""
        op = self.spec.operation(call.op)
        if self.families is None or op is None or not op.updates:
            return
        version = digest() if digest is not None else None
        if version is None:
            self.families.new_version()
            self.version = None
        elif version != self.version:
            self._use_version(version)

    def _use_version(self, version: bytes | None) -> None:
        self.families.new_version()
        self.version = version
        if self.log is None or version is None:
            return
        for tensor, groups, ids, everywhere in self.log.records(version):
            if everywhere:  # a folded version: its groups, for every row
                self.families.admit_everywhere(tensor, groups)
            else:
                self.families.admit(tensor, ids, groups)  # admitted before, in this order

    def _check_group(self, group: Sequence[str], key: str) -> None:
        members = list(group)
        if len(set(members)) != len(members):
            raise self.refuse("group", f"sum {key!r} lists a member twice: {members}")
        outsiders = [m for m in members if m not in self.passive]
        if outsiders:
            raise self.refuse(
                "group",
                f"sum {key!r} names {outsiders}, which are not passive parties of this "
                "federation: only passive data owners count towards a group",
            )
        if self.cfg.aggregation != "plain" and len(members) < self.policy.min_group:
            raise self.refuse(
                "min_group",
                f"sum {key!r} over {members} has {len(members)} passive contributor(s); this "
                f"party's policy needs at least {self.policy.min_group}",
            )

    def _check_plain_call(
        self, call: Any, *, inputs: Sequence[str], collects: Sequence[str]
    ) -> None:
        if call.sums or set(call.collect) - set(collects) or set(call.inputs) - set(inputs):
            raise self.refuse(
                "role operation", f"{call.op!r} asks for sums or tensors it never carries"
            )

    def _check_setup(
        self,
        call: Any,
        *,
        inputs: Sequence[str] = ("train_ids", "all_ids", "ckks_context"),
        collects: Sequence[str] = ("present",),
    ) -> None:
        self._check_plain_call(call, inputs=inputs, collects=collects)
        if "present" in call.collect and not self.policy.share_presence:
            raise self.refuse(
                "share_presence", "set-up asks which rows this party holds; its policy says no"
            )
        run = call.args.get("run", {})
        cfg = self.cfg
        mine = run_terms(cfg)
        if not isinstance(run, dict) or any(run.get(k) != v for k, v in mine.items()):
            raise self.refuse(
                "run",
                f"the active party runs {run!r}, this party's config says {mine}: every role "
                "must run the same federation config",
            )


def run_terms(cfg: RunConfig) -> dict[str, Any]:
    """What the active party announces at set-up and each party compares with its own config:
    the method, the aggregation, min_group, the pipeline depth (a party accepts only the
    staleness its own config allows), and whether the aggregator runs in the active party's
    process (a party knows it from its own config, which its policy may refuse, and holds the
    active party to it)."""
    return {
        "method": cfg.method,
        "aggregation": cfg.aggregation,
        "min_group": cfg.min_group,
        "pipeline_depth": cfg.pipeline_depth,
        "aggregator_in_active": cfg.aggregator_in_active,
    }


def call_tags(
    meta: Mapping[str, Any],
    *,
    session: bytes,
    round: int,
    tensors: Mapping[str, np.ndarray],
    keys: Mapping[str, bytes],
) -> dict[str, str]:
    """The active party's tag of a call for each recipient (`keys`: party -> auth key)."""
    digest = call_digest(meta, session=session.hex(), round=round, tensors=tensors)
    return {party: call_tag(key, digest) for party, key in keys.items()}
