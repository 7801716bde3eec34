"""Where a role's rows live once read: in memory (`MemoryRows`), or, for a file too large for
that, in a cache directory of the role's own (`DiskRows`), so that memory holds no array with
a length of the table: what the process keeps per row is nothing but 1 bit (a scan's row set)
and 1/32 of an identifier (the fence of the id index, every `FENCE`-th sorted id).

Both hold the compact form of the rows (`securevfl.data.columns.CompactConverter`: float64
numbers, int32 category codes) and the identifiers as written. `MemoryRows` answers, for
positions among the sorted ids, their rows (`take`) and every row of a set in blocks (`scan`);
the table above it holds the sorted ids. `DiskRows` holds the ids too, on disk: the sorted ids,
the file row of each and, for the active party, its label (`sorted.ids`, `sorted.rows`,
`sorted.labels`), built while loading by an external merge sort (runs of `RUN_ROWS` records
sorted in memory, then merged a few MiB at a time), which also refuses repeated identifiers as
`check_unique` does. A lookup (`locate`) finds an id's block of `FENCE` sorted ids through the
fence and reads that block with `pread`; `scan_ids` marks the wanted file rows in a bitmap and
reads the row files in file order. Encoding happens above the stores, the same way for both.

The disk cache is the role's alone: a directory of mode 0700 (files 0600) inside the directory
it is given (the run directory of that role) or a fresh temporary one, removed when the table is
garbage-collected, when the process exits, or when loading fails. Rows asked for at random
(`take`, `texts`, `label_rows`: a batch) are read with `pread`, so they cost the process only
their own bytes: through a memory map, each row would make resident the pages the kernel maps
around the fault (on recent kernels whole large folios, about 1 MB a row). Blocks of a scan, in
file order, are read through read-only memory maps whose pages are handed back to the kernel
(`madvise(MADV_DONTNEED)`) every `RELEASE_BYTES` of the span read, so the process holds about
that much of the files (they stay in the page cache, which the kernel reclaims). An id array
handed in may itself be a read-only `np.memmap` (a spooled list of ids): it is read
`ID_BLOCK` ids at a time and its pages are handed back after each block.
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from securevfl.errors import DataError

PAGE = mmap.PAGESIZE
RELEASE_BYTES = 64 << 20  # at most about this much of the mapped files stays resident
SCAN_ROWS = 1 << 14  # rows per block of a scan (a 75-column encoded block: ~10 MB, and its sums)
# a read fault through a map may make up to a 2 MiB folio resident (a scan's sparse rows count so)
FAULT_PAGES = max(1, (2 << 20) // PAGE)
FENCE = 256  # sorted ids per entry of the in-memory fence (8 bytes per 256 rows)
GATHER = 512  # items read by one pread when gathering values of a narrow file at positions
ID_BLOCK = 1 << 18  # ids looked up at a time (a large id array is handled block by block)
SPANS = 4096  # blocks of the id index read at a time by a lookup (8 MiB)
RUN_ROWS = 1 << 19  # records sorted in memory per run of the external sort (~16 MiB)
MERGE_BYTES = 16 << 20  # read buffers of the merge, all runs together


class MemoryRows:
    """Compact rows in memory, in the order of the sorted ids."""

    def __init__(self, numbers: np.ndarray, codes: np.ndarray, id_text: np.ndarray) -> None:
        self.numbers = numbers
        self.codes = codes
        self.id_text = id_text

    def __len__(self) -> int:
        return len(self.numbers)

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.numbers[positions], self.codes[positions]

    def scan(
        self, positions: np.ndarray, *, rows: int = SCAN_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(positions, numbers, codes) blocks covering `positions`, in their order."""
        for i in range(0, len(positions), rows):
            block = positions[i : i + rows]
            yield block, self.numbers[block], self.codes[block]

    def texts(self, positions: np.ndarray) -> np.ndarray:
        return self.id_text[positions]


class DiskRowsWriter:
    """Appends compact rows (in file order) to the files of a new cache directory, and spools
    each row's identifier (held or not) into sorted runs for the id index (`finish`).

    `labels`: the rows carry a float64 label each (the active party's), stored in id order."""

    def __init__(
        self,
        parent: Path | None,
        *,
        prefix: str,
        n_numbers: int,
        n_codes: int,
        labels: bool = False,
    ) -> None:
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=parent))  # mode 0700
        # removed at exit if neither finished nor abandoned (an interrupted load)
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.n_numbers, self.n_codes = n_numbers, n_codes
        self.labels = labels
        self.n = 0  # rows stored (held)
        self.n_source = 0  # rows read, held or not
        self._text_bytes = 0
        self._files: dict[str, BinaryIO] = {}
        for name in ("numbers.f64", "codes.i32", "ids.txt", "ids.off", "runs.bin"):
            self._files[name] = _create(self.dir / name)
        np.zeros(1, dtype=np.int64).tofile(self._files["ids.off"])
        fields = [("id", "<i8"), ("src", "<i8"), ("row", "<i8")]
        self._record = np.dtype(fields + ([("label", "<f8")] if labels else []))
        self._buffer = np.empty(RUN_ROWS, dtype=self._record)
        self._fill = 0
        self._runs: list[tuple[int, int]] = []  # (byte offset, records) of each sorted run
        self._run_bytes = 0

    def append(
        self,
        numbers: np.ndarray,
        codes: np.ndarray,
        id_text: pa.Array | None,
        *,
        ids: np.ndarray,
        held: np.ndarray | None = None,
        labels: np.ndarray | None = None,
    ) -> None:
        """The next rows of the file: `ids` (int64) of every row read and `held`, which of them
        the role holds; `numbers`, `codes`, `id_text` and `labels` of the held rows only."""
        ids = np.asarray(ids, dtype=np.int64)
        held = np.ones(len(ids), dtype=bool) if held is None else np.asarray(held, dtype=bool)
        n_held = len(numbers)
        if len(held) != len(ids) or int(held.sum()) != n_held:
            raise ValueError("DiskRowsWriter.append: held rows and stored rows disagree")
        np.ascontiguousarray(numbers, dtype=np.float64).tofile(self._files["numbers.f64"])
        np.ascontiguousarray(codes, dtype=np.int32).tofile(self._files["codes.i32"])
        if id_text is not None:
            offsets, data = _string_buffers(id_text)
            self._files["ids.txt"].write(data)
            (offsets[1:] + self._text_bytes).tofile(self._files["ids.off"])
            self._text_bytes += len(data)
        records = np.empty(len(ids), dtype=self._record)
        records["id"] = ids
        records["src"] = np.arange(self.n_source, self.n_source + len(ids))
        records["row"] = -1
        records["row"][held] = np.arange(self.n, self.n + n_held)
        if self.labels:
            records["label"] = np.nan
            if labels is not None:
                records["label"][held] = labels
        self._spool(records)
        self.n += n_held
        self.n_source += len(ids)

    def finish(
        self,
        *,
        texts: bool,
        where: str,
        texts_at: Callable[[np.ndarray], Sequence[str]],
        label_map: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> DiskRows:
        """The rows, read back, with the id index built. Refuses (DataError, as `check_unique`
        words it: up to five identifiers as written, `texts_at(file rows)`) repeated ids among
        every row read, held or not. `label_map` turns the raw labels into the stored ones."""
        if self._fill:
            self._flush_run()
        for fh in self._files.values():
            fh.close()
        fence, first_empty, repeated = self._merge(label_map)
        (self.dir / "runs.bin").unlink()
        if len(repeated):
            raise DataError(
                f"{where}: identifiers must be unique; repeated: {list(texts_at(repeated))}"
            )
        rows = DiskRows(
            self.dir,
            self.n,
            self.n_numbers,
            self.n_codes,
            texts=texts,
            labels=self.labels,
            fence=fence,
            first_empty_label=first_empty,
        )
        self._finalizer.detach()  # the directory is the DiskRows' now
        return rows

    def abandon(self) -> None:
        """Remove the cache directory (loading failed)."""
        for fh in self._files.values():
            fh.close()
        self._finalizer()

    def _spool(self, records: np.ndarray) -> None:
        done = 0
        while done < len(records):
            take = min(len(records) - done, RUN_ROWS - self._fill)
            self._buffer[self._fill : self._fill + take] = records[done : done + take]
            self._fill += take
            done += take
            if self._fill == RUN_ROWS:
                self._flush_run()

    def _flush_run(self) -> None:
        part = self._buffer[: self._fill]
        run = part[np.argsort(part["id"], kind="stable")]
        run.tofile(self._files["runs.bin"])
        self._runs.append((self._run_bytes, len(run)))
        self._run_bytes += run.nbytes
        self._fill = 0

    def _merge(
        self, label_map: Callable[[np.ndarray], np.ndarray] | None
    ) -> tuple[np.ndarray, int | None, np.ndarray]:
        """Merge the sorted runs into sorted.ids / sorted.rows (/ sorted.labels) of the held
        rows. Returns (the fence, the first file row whose stored label is empty, the first
        five file rows of repeated ids)."""
        size = self._record.itemsize
        per = max(64, MERGE_BYTES // max(len(self._runs), 1) // size)
        rows_dtype = _rows_dtype(self.n)
        names = ["sorted.ids", "sorted.rows"] + (["sorted.labels"] if self.labels else [])
        out = {name: _create(self.dir / name) for name in names}
        fd = os.open(self.dir / "runs.bin", os.O_RDONLY)
        at = [offset for offset, _ in self._runs]
        left = [count for _, count in self._runs]
        buffers: list[np.ndarray] = [np.empty(0, dtype=self._record) for _ in self._runs]

        def refill(r: int) -> None:
            m = min(per, left[r])
            data = _pread_exact(fd, m * size, at[r], self.dir)
            buffers[r] = np.frombuffer(data, dtype=self._record)
            at[r] += m * size
            left[r] -= m

        fence = np.empty(-(-self.n // FENCE), dtype=np.int64)  # every FENCE-th sorted id
        written = 0
        first_empty: int | None = None
        repeated = np.empty(0, dtype=np.int64)
        previous: tuple[int, int] | None = None  # (id, file row) of the last record merged
        try:
            for r in range(len(buffers)):
                refill(r)
            while True:
                live = [r for r in range(len(buffers)) if len(buffers[r])]
                if not live:
                    break
                # every record up to the smallest last id of the runs with more on disk is final
                bounds = [int(buffers[r]["id"][-1]) for r in live if left[r] > 0]
                bound = min(bounds) if bounds else None
                parts = []
                for r in live:
                    b = buffers[r]
                    cut = len(b) if bound is None else int(np.searchsorted(b["id"], bound, "right"))
                    parts.append(b[:cut])
                    buffers[r] = b[cut:]
                    if not len(buffers[r]) and left[r] > 0:
                        refill(r)
                merged = np.concatenate(parts)
                merged = merged[np.argsort(merged["id"], kind="stable")]
                if not len(merged):
                    continue
                ids = merged["id"]
                same = ids[1:] == ids[:-1]
                involved = np.zeros(len(merged), dtype=bool)
                involved[1:] |= same
                involved[:-1] |= same
                extra = np.empty(0, dtype=np.int64)
                if previous is not None and int(ids[0]) == previous[0]:
                    involved[0] = True
                    extra = np.array([previous[1]], dtype=np.int64)
                if involved.any():  # keep the first five file rows of repeated ids
                    found = np.concatenate([repeated, extra, merged["src"][involved]])
                    repeated = np.unique(found)[:5]
                previous = (int(ids[-1]), int(merged["src"][-1]))
                kept = merged[merged["row"] >= 0]
                if not len(kept):
                    continue
                every = kept["id"][(-written) % FENCE :: FENCE]
                first = -(-written // FENCE)
                fence[first : first + len(every)] = every
                np.ascontiguousarray(kept["id"]).tofile(out["sorted.ids"])
                kept["row"].astype(rows_dtype).tofile(out["sorted.rows"])
                if self.labels:
                    labels = np.ascontiguousarray(kept["label"], dtype=np.float64)
                    if label_map is not None:
                        labels = np.asarray(label_map(labels), dtype=np.float64)
                    labels.tofile(out["sorted.labels"])
                    empty = np.isnan(labels)
                    if empty.any():
                        row = int(kept["src"][empty].min())
                        first_empty = row if first_empty is None else min(first_empty, row)
                written += len(kept)
        finally:
            os.close(fd)
            for fh in out.values():
                fh.close()
        if written != self.n:
            raise RuntimeError(f"row cache {self.dir}: {written} ids indexed for {self.n} rows")
        return fence, first_empty, repeated


class DiskRows:
    """Compact rows in the files of a cache directory (file order) with their id index (the
    sorted ids, each one's file row, its label): batches at random read with `pread`, scans
    through read-only memory maps. Memory holds the fence of the index (every `FENCE`-th
    sorted id) and nothing else per row. The directory is removed when this object is."""

    def __init__(
        self,
        directory: Path,
        n: int,
        n_numbers: int,
        n_codes: int,
        *,
        texts: bool,
        labels: bool = False,
        fence: np.ndarray,
        first_empty_label: int | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.n = n
        self.fence = np.asarray(fence, dtype=np.int64)
        self.rows_dtype = _rows_dtype(n)
        self.first_empty_label = first_empty_label
        self._maps: list[mmap.mmap] = []
        self._fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _remove, str(self.dir), self._fds)
        self.n_numbers, self.n_codes = n_numbers, n_codes
        self.numbers = self._map("numbers.f64", np.float64, (n, n_numbers))
        self.codes = self._map("codes.i32", np.int32, (n, n_codes))
        self.row_bytes = 8 * n_numbers + 4 * n_codes
        self.has_texts = texts
        if texts:
            self._offsets = self._map("ids.off", np.int64, (n + 1,))
            self._text = self._map("ids.txt", np.uint8, (-1,))
        for name in ("sorted.ids", "sorted.rows") + (("sorted.labels",) if labels else ()):
            self._fds[name] = os.open(self.dir / name, os.O_RDONLY)
        # the sorted ids (and labels) as read-only maps, for callers that want arrays; whole
        # passes over them make them resident (use `id_blocks`, `locate`, `label_rows`)
        self.ids = self._memmap("sorted.ids", np.int64)
        self.labels = self._memmap("sorted.labels", np.float64) if labels else None
        self._touched = 0
        self._arrays: Any = None

    def __len__(self) -> int:
        return self.n

    # -- the id index

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """int64 positions of `ids` among the sorted ids; -1 for an id the table lacks."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.full(len(ids), -1, dtype=np.int64)
        for start, block in _id_slices(ids):
            out[start : start + len(block)] = self._locate_block(block)
        return out

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """The sorted ids at `positions` (read with `pread`)."""
        return self._gather("sorted.ids", positions, np.int64)

    def id_blocks(self, rows: int = 1 << 20) -> Iterator[np.ndarray]:
        """Every sorted id, in order, `rows` at a time (read with `pread`)."""
        for start in range(0, self.n, rows):
            count = min(rows, self.n - start)
            data = _pread_exact(self._fds["sorted.ids"], 8 * count, 8 * start, self.dir)
            yield np.frombuffer(data, dtype=np.int64)

    def label_blocks(self, rows: int = 1 << 20) -> Iterator[np.ndarray]:
        """Every label (float64, NaN: empty) in the order of the sorted ids, `rows` at a time
        (read with `pread`; the blocks of `id_blocks`)."""
        for start in range(0, self.n, rows):
            count = min(rows, self.n - start)
            if self.labels is None:
                yield np.full(count, np.nan)
                continue
            data = _pread_exact(self._fds["sorted.labels"], 8 * count, 8 * start, self.dir)
            yield np.frombuffer(data, dtype=np.float64)

    def arrays(self) -> Any:
        """The role's per-row arrays on disk (`securevfl.data.rowarrays.RowArrays`): a
        directory inside this cache, removed with it. Made on first use."""
        if self._arrays is None:
            from securevfl.data.rowarrays import RowArrays

            self._arrays = RowArrays(self.dir)
        return self._arrays

    def label_rows(self, positions: np.ndarray) -> np.ndarray:
        """float64 labels at `positions` of the sorted ids (NaN: empty)."""
        if self.labels is None:
            return np.full(len(positions), np.nan)
        return self._gather("sorted.labels", positions, np.float64)

    def _locate_block(self, ids: np.ndarray) -> np.ndarray:
        """Positions of `ids` (-1: absent): each id's block of `FENCE` sorted ids is read (one
        `pread` per block, at most `SPANS` blocks at a time) and the blocks read, sorted as a
        whole, searched at once."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if self.n == 0 or not len(ids):
            return out
        block = np.searchsorted(self.fence, ids, side="right") - 1  # -1: below the smallest id
        wanted = np.unique(block[block >= 0])
        for g in range(0, len(wanted), SPANS):
            some = wanted[g : g + SPANS]
            inside = np.flatnonzero((block >= some[0]) & (block <= some[-1]))
            lo = some * FENCE
            values, starts = _read_spans(
                self._fds["sorted.ids"], lo, np.minimum(self.n, lo + FENCE), np.int64, self.dir
            )
            asked = ids[inside]
            j = np.minimum(np.searchsorted(values, asked), len(values) - 1)
            hit = values[j] == asked
            span = np.searchsorted(starts, j[hit], side="right") - 1
            out[inside[hit]] = lo[span] + j[hit] - starts[span]
        return out

    # -- rows

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self._gather("sorted.rows", positions, self.rows_dtype)
        return (
            self._pread("numbers.f64", rows, self.n_numbers, np.float64),
            self._pread("codes.i32", rows, self.n_codes, np.int32),
        )

    def scan_ids(
        self, ids: np.ndarray, *, missing: str = "error", rows: int | None = None
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(numbers, codes) blocks of `rows` rows covering the rows of `ids`, in file order (so
        each block reads a few runs of pages). `missing`: "error" refuses (DataError, before
        any block) ids the table lacks, "skip" leaves them out."""
        wanted = np.zeros((self.n + 7) // 8, dtype=np.uint8)  # one bit per file row
        lacking, examples = 0, []
        for _, block in _id_slices(np.asarray(ids, dtype=np.int64)):
            positions = self._locate_block(block)
            bad = positions < 0
            if bad.any():
                lacking += int(bad.sum())
                examples += block[bad][: 5 - len(examples)].tolist()
            file_rows = self._gather("sorted.rows", positions[~bad], self.rows_dtype).astype(
                np.int64
            )
            bits = np.left_shift(1, file_rows & 7).astype(np.uint8)
            np.bitwise_or.at(wanted, file_rows >> 3, bits)
        if lacking and missing == "error":
            raise DataError(
                f"{lacking} requested sample ids are not in this table, e.g. {examples}"
            )
        rows = SCAN_ROWS if rows is None else rows
        span = (rows + 7) // 8 * 8  # file rows whose bits are unpacked at a time
        pending: list[np.ndarray] = []
        count = 0
        for start in range(0, self.n, span):
            end = min(self.n, start + span)
            bits = np.unpackbits(wanted[start // 8 : (end + 7) // 8], bitorder="little")
            found = np.flatnonzero(bits[: end - start]) + start
            if not len(found):
                continue
            pending.append(found)
            count += len(found)
            while count >= rows:
                joined = np.concatenate(pending)
                yield self._read_block(joined[:rows])
                pending, count = [joined[rows:]], count - rows
        if count:
            yield self._read_block(np.concatenate(pending))

    def _read_block(self, file_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        numbers, codes = self.numbers[file_rows], self.codes[file_rows]
        self._touch(file_rows, ordered=True)
        return numbers, codes

    def texts(self, positions: np.ndarray) -> np.ndarray | None:
        """The identifiers at `positions` as written (None: the table has none)."""
        if not self.has_texts:
            return None
        offsets, text = self._fds.get("ids.off", -1), self._fds.get("ids.txt", -1)
        out = []
        for r in self._gather("sorted.rows", positions, self.rows_dtype).astype(np.int64).tolist():
            start, end = struct.unpack("=qq", _pread_exact(offsets, 16, 8 * r, self.dir))
            out.append(_pread_exact(text, end - start, start, self.dir).decode())
        return np.array(out, dtype=object)

    def release(self) -> None:
        """Hand the mapped pages back to the kernel (they stay in its page cache)."""
        for mm in self._maps:
            mm.madvise(mmap.MADV_DONTNEED)
        for array in (self.ids, self.labels):
            mapped = _read_only_map(array)
            if mapped is not None:
                mapped.madvise(mmap.MADV_DONTNEED)
        self._touched = 0

    def close(self) -> None:
        """Remove the cache directory now (the maps stay valid until this object goes)."""
        self._finalizer()

    def _gather(self, name: str, positions: np.ndarray, dtype: Any) -> np.ndarray:
        """The values at `positions` of a file of single `dtype` values: one `pread` per run of
        positions within `GATHER` items of each other."""
        return gather(self._fds[name], positions, dtype, n=self.n, where=self.dir)

    def _pread(self, name: str, rows: np.ndarray, width: int, dtype: type) -> np.ndarray:
        """The rows `rows` of a file of `width` values each, read one by one with `pread`."""
        out = np.empty((len(rows), width), dtype=dtype)
        size = out.itemsize * width
        if size == 0 or len(rows) == 0:
            return out
        fd, view = self._fds[name], memoryview(out).cast("B")
        for k, r in enumerate(rows.tolist()):
            if os.preadv(fd, [view[k * size : (k + 1) * size]], r * size) != size:
                raise OSError(f"row cache {self.dir}: {name} is shorter than expected")
        return out

    def _touch(self, rows: np.ndarray, *, ordered: bool, files: int = 2) -> None:
        """Count the pages `rows` (file rows, sorted when `ordered`) made resident in `files`
        of the maps; release them past the cap."""
        if len(rows) == 0:
            return
        pages = len(rows) * FAULT_PAGES * files
        if ordered:  # one run of pages per file, at most
            span = (int(rows[-1]) - int(rows[0]) + 1) * max(self.row_bytes, 1) // PAGE
            pages = min(pages, span + (FAULT_PAGES + 1) * files)
        self._touched += pages * PAGE
        if self._touched >= RELEASE_BYTES:
            self.release()

    def _map(self, name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        path = self.dir / name
        if path.stat().st_size == 0:
            return np.empty(tuple(0 if s == -1 else s for s in shape), dtype=dtype)
        fd = os.open(path, os.O_RDONLY)
        self._fds[name] = fd  # for pread; closed with the directory
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        self._maps.append(mm)
        return np.frombuffer(mm, dtype=dtype).reshape(shape)

    def _memmap(self, name: str, dtype: type) -> np.ndarray:
        if self.n == 0:
            return np.empty(0, dtype=dtype)
        return np.memmap(self.dir / name, dtype=dtype, mode="r", shape=(self.n,))


def gather(fd: int, positions: np.ndarray, dtype: Any, *, n: int, where: Path) -> np.ndarray:
    """The values at `positions` of a file (`fd`) of `n` single `dtype` values: one `pread`
    per run of positions within `GATHER` items of each other (no map, so a batch costs the
    process its own bytes only)."""
    positions = np.asarray(positions, dtype=np.int64)
    out = np.empty(len(positions), dtype=dtype)
    if not len(positions):
        return out
    order = np.argsort(positions, kind="stable")
    at = positions[order]
    if at[0] < 0 or at[-1] >= n:
        raise IndexError(f"row cache {where}: positions outside 0..{n - 1}")
    first = np.r_[0, np.flatnonzero(np.diff(at // GATHER)) + 1]
    lo, hi = at[first], at[np.r_[first[1:], len(at)] - 1] + 1
    values, starts = _read_spans(fd, lo, hi, dtype, where)
    group = np.repeat(np.arange(len(first)), np.diff(np.r_[first, len(at)]))
    out[order] = values[starts[group] + at - lo[group]]
    return out


def _read_spans(
    fd: int, lo: np.ndarray, hi: np.ndarray, dtype: Any, where: Path
) -> tuple[np.ndarray, np.ndarray]:
    """The values [lo[k], hi[k]) of a file of `dtype` values, for every k, one `pread` each,
    concatenated; and where each span starts in the result."""
    item = np.dtype(dtype).itemsize
    sizes = hi - lo
    data = b"".join(
        [os.pread(fd, s * item, a * item) for a, s in zip(lo.tolist(), sizes.tolist(), strict=True)]
    )
    if len(data) != int(sizes.sum()) * item:
        raise OSError(f"row cache {where}: a file is shorter than expected")
    return np.frombuffer(data, dtype=dtype), np.r_[0, np.cumsum(sizes)[:-1]]


def _rows_dtype(n: int) -> type:
    return np.int32 if n < 2**31 else np.int64


def _create(path: Path) -> BinaryIO:
    """A new file readable and writable by its owner only."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _read_only_map(array: Any) -> mmap.mmap | None:
    """The read-only memory map under `array` (an np.memmap of mode "r", or a view of one)."""
    while isinstance(array, np.ndarray):
        if isinstance(array, np.memmap) and array.mode == "r":
            return getattr(array, "_mmap", None)
        array = array.base
    return None


def _id_slices(ids: np.ndarray, rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(start, block) of `ids`, `rows` (default `ID_BLOCK`) at a time; the pages of a read-only
    memory map under `ids` are handed back to the kernel after each block."""
    rows = ID_BLOCK if rows is None else rows
    mapped = _read_only_map(ids)
    for start in range(0, len(ids), rows):
        yield start, np.asarray(ids[start : start + rows], dtype=np.int64)
        if mapped is not None:
            mapped.madvise(mmap.MADV_DONTNEED)


def _pread_exact(fd: int, size: int, offset: int, where: Path) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise OSError(f"row cache {where}: a file is shorter than expected")
    return data


def _remove(directory: str, fds: dict[str, int]) -> None:
    """Close the cache's descriptors and remove its directory."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(directory, ignore_errors=True)


def _string_buffers(text: pa.Array) -> tuple[np.ndarray, memoryview]:
    """(int64 offsets from 0, UTF-8 bytes) of a string array without nulls."""
    if text.type != pa.large_string():
        text = text.cast(pa.large_string())
    _, offsets_buf, data_buf = text.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[text.offset : text.offset + len(text) + 1]
    start, end = int(offsets[0]), int(offsets[-1])
    data = memoryview(b"") if data_buf is None else memoryview(data_buf)[start:end]
    return offsets - start, data
