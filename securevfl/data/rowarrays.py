"""Per-row arrays of a streamed role, on disk: the active party's train/test split, which of its
rows each party holds, id lists filtered from those, an epoch's shuffled order.

A table held in memory keeps these in memory (`table.train_test_split`, `ActiveRound`); a
streamed one (`rowstore.DiskRows`) keeps them in files of its row cache (`RowArrays`: a
directory of mode 0700 inside it, files 0600, removed with it), written and read a block of
`BLOCK` entries at a time; batches of them are read with `pread`. Each function gives what its
in-memory counterpart gives, entry for entry: `split_ids` is `table.train_test_split`,
`permutation` is `Generator.permutation`, `shuffled_batches` is `methods.blocks.nets.batches`,
`filter_ids` is `ids[keep(ids)]`.

A shuffle is the one pass that needs random access to a whole array: NumPy shuffles the file in
place through a shared memory map (the same draws as in memory; 4 bytes a row for positions
below 2**31), so its pages are file-backed page cache, which the kernel may write back and
reclaim, and they are handed back to the kernel (`MADV_DONTNEED`) as soon as it ends.
"""

from __future__ import annotations

import itertools
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from securevfl.data.rowstore import gather

BLOCK = 1 << 20  # entries written or scanned at a time (8 MiB of int64)
# ids that `filter_ids` asks its `keep` about at once: a look-up in a streamed table's id index
# (`has`, `labeled`, presence) allocates some 300 bytes an id while it runs
FILTER_ROWS = 1 << 16


class RowArrays:
    """A directory of per-row arrays (mode 0700, files 0600) inside `parent` (a streamed
    table's row cache); removed when this object is, at exit, or by `close`."""

    def __init__(self, parent: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="arrays-", dir=parent))  # mode 0700
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self._names = itertools.count()

    def spool(self, name: str, dtype: Any) -> Spool:
        """A new file to append blocks to (`Spool.write`), then read as an array."""
        return Spool(self.dir / f"{next(self._names):04d}-{name}", dtype)

    def close(self) -> None:
        self._finalizer()


class Spool:
    """Blocks appended to a file of `dtype` values; `array()` maps it read-only."""

    def __init__(self, path: Path, dtype: Any) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.n = 0
        self._fh: BinaryIO | None = os.fdopen(
            os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"
        )

    def write(self, block: np.ndarray) -> None:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        block.tofile(self._fh)
        self.n += len(block)

    def close(self) -> Path:
        """Stop writing; the file's path."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        return self.path

    def array(self, *, writable: bool = False) -> np.ndarray:
        """The values written: a memory map of the file (read-only unless `writable`), removed
        once the map is garbage-collected; an empty in-memory array if nothing was written."""
        self.close()
        if self.n == 0:
            self.path.unlink(missing_ok=True)
            return np.empty(0, dtype=self.dtype)
        out = np.memmap(self.path, dtype=self.dtype, mode="r+" if writable else "r")
        weakref.finalize(out, _unlink, str(self.path))
        return out


def filled(arrays: RowArrays, name: str, dtype: Any, blocks: Iterator[np.ndarray]) -> np.ndarray:
    """The concatenation of `blocks` in a file of `arrays` (a read-only map)."""
    spool = arrays.spool(name, dtype)
    for block in blocks:
        spool.write(block)
    return spool.array()


def id_slices(ids: np.ndarray, rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(start, block) of `ids`, `rows` (default `BLOCK`) at a time; the pages of a memory map
    under `ids` are handed back to the kernel after each block."""
    rows = BLOCK if rows is None else rows
    mapped = _map_of(ids)
    for start in range(0, len(ids), rows):
        yield start, np.array(ids[start : start + rows])
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)


def filter_ids(
    arrays: RowArrays, ids: np.ndarray, keep: Callable[[np.ndarray], np.ndarray], name: str
) -> np.ndarray:
    """`ids[keep(ids)]`, computed a block of at most `FILTER_ROWS` ids at a time into a file
    of `arrays`."""
    return filled(
        arrays,
        name,
        np.int64,
        (block[keep(block)] for _, block in id_slices(ids, min(BLOCK, FILTER_ROWS))),
    )


def copied(array: np.ndarray, start: int, stop: int) -> np.ndarray:
    """`array[start:stop]` in memory; when `array` is (a view of) a memory map, the map's pages
    are handed back to the kernel after the copy, so reading a file part by part does not
    leave the whole file resident."""
    out = np.array(array[start:stop])
    mapped = _map_of(array)
    if mapped is not None:
        mapped.madvise(mmap.MADV_DONTNEED)
    return out


def take(array: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`array[positions]`: read with `pread` from a whole file-backed map (so a batch costs its
    own bytes, not the pages around each fault), indexed in memory otherwise."""
    if isinstance(array, np.memmap) and isinstance(array.base, mmap.mmap) and array.filename:
        fd = os.open(array.filename, os.O_RDONLY)
        try:
            return gather(fd, positions, array.dtype, n=len(array), where=Path(array.filename))
        finally:
            os.close(fd)
    return np.asarray(array)[positions]


def permutation(
    rng: np.random.Generator, x: int | np.ndarray, arrays: RowArrays, *, dtype: Any = None
) -> np.ndarray:
    """`rng.permutation(x)` (`x`: a count, or a 1-D array such as a map of a file) in a file of
    `arrays`: the same draws, the same order, `rng` left in the same state. `dtype`: of the
    result (default: int64 for a count, `x`'s otherwise); any integer type that holds the
    values gives the same order, since a shuffle's swaps do not depend on the values."""
    n = int(x) if np.ndim(x) == 0 else len(x)
    dtype = np.dtype(dtype or (np.int64 if np.ndim(x) == 0 else np.asarray(x[:0]).dtype))
    spool = arrays.spool("permutation", dtype)
    if np.ndim(x) == 0:
        for start in range(0, n, BLOCK):
            spool.write(np.arange(start, min(n, start + BLOCK)))
    else:
        for _, block in id_slices(x):
            spool.write(block)
    out = spool.array(writable=True)
    if n == 0:
        return out
    # a plain ndarray over the map: NumPy shuffles an ndarray subclass (np.memmap) through a
    # generic path about 150 times slower, with the same draws
    rng.shuffle(out.view(np.ndarray))
    _map_of(out).madvise(mmap.MADV_DONTNEED)  # shared map: the data stays in the page cache
    return out


def shuffled_batches(
    ids: np.ndarray, batch_size: int, *, seed: int, epoch: int, arrays: RowArrays
) -> Iterator[np.ndarray]:
    """The batches of `methods.blocks.nets.batches(ids, batch_size, seed=, epoch=)`, one at a
    time, from an order kept in a file (positions into `ids`, read with `pread`)."""
    rng = np.random.default_rng([seed, epoch, 0xBA7C])
    order = permutation(rng, len(ids), arrays, dtype=_positions_dtype(len(ids)))
    for start in range(0, len(order), batch_size):
        positions = take(order, np.arange(start, min(len(order), start + batch_size)))
        yield take(ids, positions.astype(np.int64))


def holdout_bits(
    n: int,
    *,
    test_fraction: float,
    seed: int,
    label_blocks: Callable[[], Iterator[np.ndarray]] | None,
    arrays: RowArrays,
) -> np.ndarray:
    """`table.holdout_mask` of `n` rows as a bitmap (1 bit a row, little bit order), the groups
    (per label value of `label_blocks()`, the labels in row order, when stratified) and their
    shuffles kept in files of `arrays`."""
    rng = np.random.default_rng([seed, 0x5EED])
    bits = np.zeros((n + 7) // 8, dtype=np.uint8)
    if test_fraction <= 0:
        return bits
    positions = _positions_dtype(n)
    if label_blocks is None:
        groups: Sequence[Any] = [n]
    else:
        values = [np.unique(block) for block in label_blocks()]
        classes = np.unique(np.concatenate(values)) if values else np.empty(0)
        groups = [
            filled(
                arrays,
                "group",
                positions,
                (np.flatnonzero(block == c) + start for start, block in _starts(label_blocks())),
            )
            for c in classes
        ]
    for g in groups:
        perm = permutation(rng, g, arrays, dtype=positions)
        del g
        n_test = int(round(test_fraction * len(perm)))
        for _, block in id_slices(perm[:n_test]):
            at = block.astype(np.int64)
            np.bitwise_or.at(bits, at >> 3, np.left_shift(1, at & 7).astype(np.uint8))
        del perm
    return bits


def split_ids(
    table: Any, *, test_fraction: float, seed: int, stratify: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """`table.train_test_split(table.ids, labels=table.labels, ...)` of a streamed table: the
    sorted training and test ids, each in a file of the table's row cache (read-only maps)."""
    store = table.rowstore
    arrays = store.arrays()
    stratified = stratify and getattr(table, "labels", None) is not None
    bits = holdout_bits(
        len(table),
        test_fraction=test_fraction,
        seed=seed,
        label_blocks=(lambda: store.label_blocks(BLOCK)) if stratified else None,
        arrays=arrays,
    )
    train, test = arrays.spool("train.ids", np.int64), arrays.spool("test.ids", np.int64)
    for start, block in _starts(store.id_blocks(BLOCK)):
        chunk = bits[start // 8 : (start + len(block) + 7) // 8]
        held_out = np.unpackbits(chunk, bitorder="little")[: len(block)].astype(bool)
        train.write(block[~held_out])
        test.write(block[held_out])
    return train.array(), test.array()


class PresenceRows:
    """Which parties hold each row of a streamed table (`ActiveRound.set_presence`): one bit a
    party, in a file of `arrays`, in the order of the table's sorted ids; rows read with
    `pread`."""

    def __init__(
        self, arrays: RowArrays, held: Mapping[str, np.ndarray], parties: Sequence[str]
    ) -> None:
        self.parties = tuple(parties)
        self.width = max(1, (len(self.parties) + 7) // 8)
        self.n = len(held[self.parties[0]]) if self.parties else 0
        spool = arrays.spool("presence", np.dtype(f"V{self.width}"))
        maps = [m for m in (_map_of(held[p]) for p in self.parties) if m is not None]
        for start in range(0, self.n, BLOCK):
            flags = np.stack(
                [np.asarray(held[p][start : start + BLOCK], dtype=bool) for p in self.parties],
                axis=1,
            )
            spool.write(np.packbits(flags, axis=1, bitorder="little").view(spool.dtype)[:, 0])
            for mapped in maps:  # answers handed in as maps of files: their pages go back
                mapped.madvise(mmap.MADV_DONTNEED)
        self.path = spool.close()
        self._fd = os.open(self.path, os.O_RDONLY)
        self._finalizer = weakref.finalize(self, _close, self._fd, str(self.path))

    def rows(self, positions: np.ndarray) -> np.ndarray:
        """bool [len(positions), parties]: who holds the rows at `positions`."""
        raw = gather(self._fd, positions, np.dtype(f"V{self.width}"), n=self.n, where=self.path)
        flags = np.unpackbits(raw.view(np.uint8).reshape(-1, self.width), axis=1, bitorder="little")
        return flags[:, : len(self.parties)].astype(bool)

    def count_unheld(self) -> int:
        """How many rows no party holds."""
        unheld = 0
        for start in range(0, self.n, BLOCK):
            block = self.rows(np.arange(start, min(self.n, start + BLOCK)))
            unheld += int((~block.any(axis=1)).sum())
        return unheld


def _starts(blocks: Iterator[np.ndarray]) -> Iterator[tuple[int, np.ndarray]]:
    start = 0
    for block in blocks:
        yield start, block
        start += len(block)


def _positions_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


def _map_of(array: Any) -> mmap.mmap | None:
    """The memory map under `array` (an np.memmap or a view of one), if any."""
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap):
            return getattr(array, "_mmap", None)
        array = array.base
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _close(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
    _unlink(path)
