"""The rows of set-up, a block at a time, for an active party whose table is streamed.

Set-up tells every party the active party's sample ids and which of them are training rows,
and each party answers which of those it holds. A table read whole sends both id lists in the
set-up call and gets the answers back in its result (`ActiveRound.setup`). A streamed table
(millions of rows, `securevfl.data.rowstore.DiskRows`) would put 16 bytes a row into one
message, held whole at the active party, the aggregator and each party. Instead:

    active  setup.rows    part k: a block of `ROWS_PER_PART` sorted ids, 1 bit each: training?
    active  setup         {"rows": parts, ids, training rows, SHA-256 of every part}
    active  setup.present part k: each party answers which ids of its part k it holds

Each is an ordinary call: tagged by the active party for each recipient (the aggregator cannot
change, drop, reorder or replay a part unnoticed), checked by the party's guard (`CallGuard`:
the run terms, `share_presence` before any presence leaves). The party (`ReceivedRows`) accepts
only consecutive parts of strictly increasing ids, writes them to per-row files of its own
(`securevfl.data.rowarrays.RowArrays`, mode 0600, removed with the party's table), and runs
set-up only when the count and the digest announced match what it received: it then sees the
same two id lists a table read whole would send (read-only maps of those files), and answers
presence only after set-up ran. Memory on every side: one part.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.data.rowarrays import RowArrays, Spool, copied, id_slices

ROWS_PER_PART = 1 << 20  # ids per setup.rows call: 8 MiB of ids and 128 KiB of bits
DIGEST_INFO = b"securevfl/setup-rows/v1"


def rows_digest() -> Any:
    """The running SHA-256 both ends compute over the parts, in order."""
    return hashlib.sha256(DIGEST_INFO)


def add_part(digest: Any, ids: np.ndarray, bits: np.ndarray) -> None:
    digest.update(len(ids).to_bytes(8, "big"))
    digest.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(bits, dtype=np.uint8).tobytes())


def training_bits(block: np.ndarray, train_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """The training rows among `block` (sorted ids) as a bitmap (little bit order), and how
    many; `train_ids` is sorted (an in-memory array or a read-only map: only the slice within
    the block's range is read)."""
    if len(block) == 0:
        return np.zeros(0, dtype=np.uint8), 0
    lo = int(np.searchsorted(train_ids, block[0], side="left"))
    hi = int(np.searchsorted(train_ids, block[-1], side="right"))
    inside = np.isin(block, copied(train_ids, lo, hi), assume_unique=True)
    return np.packbits(inside, bitorder="little"), int(np.count_nonzero(inside))


def announcement(*, parts: int, ids: int, train: int, digest: Any) -> dict[str, Any]:
    """The set-up call's args["rows"]: what the party must have received."""
    return {"parts": parts, "ids": ids, "train": train, "sha256": digest.hexdigest()}


class RowsRefused(ValueError):
    """A setup.rows part (or the set-up announcing them) that a party does not accept."""


class ReceivedRows:
    """A party's side: the parts received so far, in files of `arrays`, and their digest."""

    def __init__(self, arrays: RowArrays) -> None:
        self.arrays = arrays
        self.ids: Spool = arrays.spool("setup.all.ids", np.int64)
        self.train: Spool = arrays.spool("setup.train.ids", np.int64)
        self.digest = rows_digest()
        self.parts = 0
        self.last: int | None = None
        self.bounds: list[int] = [0]  # where each part starts among the ids
        self.all_ids: np.ndarray | None = None
        self.train_ids: np.ndarray | None = None

    def add(self, part: Any, ids: np.ndarray, bits: np.ndarray) -> None:
        """Accept part `part`; raises `RowsRefused` naming what is wrong (and keeps nothing)."""
        if self.all_ids is not None:
            raise RowsRefused("a setup.rows part after the set-up that announced the parts")
        if isinstance(part, bool) or not isinstance(part, int) or part != self.parts:
            raise RowsRefused(f"setup.rows part {part!r} where part {self.parts} was due")
        if ids.dtype != np.int64 or ids.ndim != 1 or not 0 < len(ids) <= ROWS_PER_PART:
            raise RowsRefused(
                f"setup.rows part {part}: ids must be 1 to {ROWS_PER_PART} int64, got "
                f"{ids.dtype} of shape {ids.shape}"
            )
        if bits.dtype != np.uint8 or bits.shape != ((len(ids) + 7) // 8,):
            raise RowsRefused(
                f"setup.rows part {part}: the training bits must be uint8 of shape "
                f"({(len(ids) + 7) // 8},), got {bits.dtype} of shape {bits.shape}"
            )
        if (self.last is not None and ids[0] <= self.last) or not (ids[1:] > ids[:-1]).all():
            raise RowsRefused(f"setup.rows part {part}: the ids are not sorted and unique")
        inside = np.unpackbits(bits, bitorder="little", count=len(ids)).astype(bool)
        self.ids.write(ids)
        self.train.write(ids[inside])
        add_part(self.digest, ids, bits)
        self.parts += 1
        self.last = int(ids[-1])
        self.bounds.append(self.bounds[-1] + len(ids))

    def finish(self, announced: Any) -> tuple[np.ndarray, np.ndarray]:
        """(training ids, all ids) as read-only maps, once what set-up announces matches what
        was received; raises `RowsRefused` otherwise."""
        want = {"parts", "ids", "train", "sha256"}
        if not isinstance(announced, Mapping) or set(announced) != want:
            raise RowsRefused(f"set-up announces its rows as {announced!r}, not {sorted(want)}")
        got = {
            "parts": self.parts,
            "ids": self.ids.n,
            "train": self.train.n,
            "sha256": self.digest.hexdigest(),
        }
        if any(announced[k] != got[k] for k in ("parts", "ids", "train")):
            raise RowsRefused(
                f"set-up announces {announced['parts']!r} parts of {announced['ids']!r} ids "
                f"({announced['train']!r} training); this party received {got['parts']} parts "
                f"of {got['ids']} ids ({got['train']} training)"
            )
        if announced["sha256"] != got["sha256"]:
            raise RowsRefused("the digest set-up announces differs from the parts received")
        self.all_ids, self.train_ids = self.ids.array(), self.train.array()
        return self.train_ids, self.all_ids

    def part(self, part: Any) -> np.ndarray:
        """The ids of part `part` (for the presence answer); raises `RowsRefused`."""
        if self.all_ids is None:
            raise RowsRefused("setup.present before the set-up that announced the parts")
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < self.parts:
            raise RowsRefused(f"setup.present part {part!r}: the parts are 0..{self.parts - 1}")
        return copied(self.all_ids, self.bounds[part], self.bounds[part + 1])


def held_count(table: Any, ids: np.ndarray) -> int:
    """How many of `ids` `table` holds, a block at a time (no array as long as `ids`)."""
    return sum(int(np.count_nonzero(table.has(block))) for _, block in id_slices(ids))


def party_arrays(table: Any, run_dir: Path) -> RowArrays:
    """Where a party keeps the rows it is told of: its table's row cache when streamed,
    otherwise a private directory in its run directory (removed at exit)."""
    if getattr(table, "streamed", False):
        return table.rowstore.arrays()
    run_dir.mkdir(parents=True, exist_ok=True)
    return RowArrays(run_dir)


def setup_in_parts(
    ctx: Any, *, train_ids: np.ndarray, args: Mapping[str, Any], inputs: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """The active party's set-up of a streamed table (`ActiveRound.setup`): the parts, the
    set-up call announcing them (`args`, `inputs`: what set-up carries besides the ids), then
    each party's presence part by part. Returns party -> which rows it holds (bool, a
    read-only map of a file of the table's row cache). Aligned by PSI (`ctx.shared`: party ->
    which rows it shares with the label holder), each party is told only the rows it shares,
    in parts of its own, and must hold every one of them."""
    from securevfl.errors import RunAborted

    table = ctx.method.table
    store = table.rowstore
    if ctx.shared is None:
        return _tell(
            ctx, ctx.parties, lambda: store.id_blocks(ROWS_PER_PART), train_ids, args, inputs
        )
    for p in ctx.parties:
        flags = ctx.shared[p]

        def shared_blocks(flags: np.ndarray = flags) -> Iterator[np.ndarray]:
            start = 0
            for block in store.id_blocks(ROWS_PER_PART):
                mine = block[copied(flags, start, start + len(block)).astype(bool)]
                start += len(block)
                if len(mine):
                    yield mine

        held = _tell(ctx, [p], shared_blocks, train_ids, args, inputs)[p]
        for _, block in id_slices(held):
            if not block.all():
                raise RunAborted(
                    f"{p} does not hold every row the alignment says it shares; run `securevfl "
                    "align` again with the current files",
                    lost=p,
                )
    return {p: ctx.shared[p] for p in ctx.parties}


def _tell(
    ctx: Any,
    to: Any,
    id_blocks: Any,
    train_ids: np.ndarray,
    args: Mapping[str, Any],
    inputs: Mapping[str, Any],
) -> dict[str, np.ndarray]:
    """setup.rows of `id_blocks()` to the parties `to`, set-up, then their presence."""
    from securevfl.errors import RunAborted
    from securevfl.roles import protocol as P

    arrays = ctx.method.table.rowstore.arrays()
    no_ids = np.empty(0, dtype=np.int64)
    run = {"run": args["run"]}
    digest = rows_digest()
    count = told = 0
    sizes: list[int] = []
    for k, block in enumerate(id_blocks()):
        bits, n = training_bits(block, train_ids)
        ctx.call(
            P.OP_SETUP_ROWS,
            ids=no_ids,
            args={**run, "part": k},
            inputs={"all_ids": block, "train_bits": bits},
            to=list(to),
        )
        add_part(digest, block, bits)
        count, told = count + len(block), told + n
        sizes.append(len(block))
    if ctx.shared is None and told != len(train_ids):
        raise RunAborted(
            f"{ctx.config.active_name}: set-up: {len(train_ids) - told} training ids are not "
            "among the table's ids"
        )
    rows = announcement(parts=len(sizes), ids=count, train=told, digest=digest)
    ctx.call(P.OP_SETUP, ids=no_ids, args={**args, "rows": rows}, inputs=inputs, to=list(to))
    spools = {p: arrays.spool(f"present.{p}", np.bool_) for p in to}
    for k, size in enumerate(sizes):
        held = ctx.call(
            P.OP_SETUP_PRESENT,
            ids=no_ids,
            args={**run, "part": k},
            to=list(to),
            collect=["present"],
        )
        for p in to:
            flags = held[f"present@{p}"]
            if flags.dtype != np.bool_ or flags.shape != (size,):
                raise RunAborted(
                    f"{p} answered set-up part {k} with a malformed row-presence vector "
                    f"({flags.dtype}, shape {flags.shape}; expected bool of shape ({size},))",
                    lost=p,
                )
            spools[p].write(flags)
    return {p: spool.array() for p, spool in spools.items()}


def load_presence_in_parts(path: Path, table: Any, parties: Any) -> dict[str, np.ndarray]:
    """`roles.active.load_presence` of a streamed table: `securevfl align`'s presence.csv read
    `ROWS_PER_PART` lines at a time into one file of flags per party in the table's row cache
    (writable maps, in the order of the table's sorted ids), with the same refusals."""
    import csv
    import itertools
    import mmap

    from securevfl.data.columns import row_ids
    from securevfl.data.rowarrays import _map_of
    from securevfl.errors import DataError

    arrays = table.rowstore.arrays()
    n = len(table)
    out: dict[str, np.ndarray] = {}
    for name in [*parties, " seen"]:
        spool = arrays.spool(f"aligned.{name.strip()}", np.bool_)
        for start in range(0, n, ROWS_PER_PART):
            spool.write(np.zeros(min(ROWS_PER_PART, n - start), dtype=bool))
        out[name] = spool.array(writable=True)
    seen = out.pop(" seen")
    with Path(path).open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [p for p in parties if p not in (reader.fieldnames or [])]
        lines = 0
        while True:
            chunk = list(itertools.islice(reader, ROWS_PER_PART))
            if not chunk:
                break
            if missing:
                break
            lines += len(chunk)
            ids = row_ids([r["id"] for r in chunk], where=str(path))
            known = table.has(ids)
            positions = table.positions(ids[known])
            if n and seen[positions].any():
                raise DataError(
                    f"{path}: an identifier appears more than once (e.g. "
                    f"{chunk[int(np.flatnonzero(known)[np.argmax(seen[positions])])]['id']!r}); "
                    "run `securevfl align` again"
                )
            if n:
                seen[positions] = True
            for p in parties:
                flags = np.array([r[p] == "1" for r in chunk], dtype=bool)[known]
                if n:
                    out[p][positions] = flags
            for array in (seen, *out.values()):  # shared maps: the data stays in the page cache
                mapped = _map_of(array)
                if mapped is not None:
                    mapped.madvise(mmap.MADV_DONTNEED)
    if not lines or missing:
        raise DataError(f"{path}: no alignment for parties {missing or list(parties)}")
    return out
