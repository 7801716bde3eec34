"""Where a role's rows live once read: in memory (`MemoryRows`), or, for a file too large for
that, in a cache directory of the role's own (`DiskRows`), read back through memory maps.

Both hold the compact form of the rows (`securevfl.data.columns.CompactConverter`: float64
numbers, int32 category codes) and the identifiers as written, and answer the same two
questions: the rows at some positions of the sorted ids (`take`), and every row of a set in
blocks (`scan`). Encoding happens above them, the same way for both.

The disk cache is the role's alone: created with mode 0700 inside the directory it is given
(the run directory of that role) or a fresh temporary one, and removed when the table is
garbage-collected or the process exits. Rows asked for at random (`take`, `texts`: a batch)
are read with `pread`, so they cost the process only their own bytes: through a memory map,
each row would make resident the pages the kernel maps around the fault (on recent kernels
whole large folios, about 1 MB a row). Blocks of a scan, in file order, are read through
read-only memory maps whose pages are handed back to the kernel (`madvise(MADV_DONTNEED)`)
every `RELEASE_BYTES` of the span read, so the process holds about that much of the files
(they stay in the page cache, which the kernel reclaims).
"""

from __future__ import annotations

import mmap
import os
import shutil
import struct
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

PAGE = mmap.PAGESIZE
RELEASE_BYTES = 64 << 20  # at most about this much of the mapped files stays resident
SCAN_ROWS = 1 << 16  # rows per block of `scan`
# a read fault through a map may make up to a 2 MiB folio resident (a scan's sparse rows count so)
FAULT_PAGES = max(1, (2 << 20) // PAGE)


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
    """Appends compact rows (in file order) to the files of a new cache directory."""

    def __init__(self, parent: Path | None, *, prefix: str, n_numbers: int, n_codes: int) -> None:
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=parent))  # mode 0700
        self.n_numbers, self.n_codes = n_numbers, n_codes
        self.n = 0
        self._text_bytes = 0
        self._files = {
            name: (self.dir / name).open("wb")
            for name in ("numbers.f64", "codes.i32", "ids.txt", "ids.off")
        }
        np.zeros(1, dtype=np.int64).tofile(self._files["ids.off"])

    def append(self, numbers: np.ndarray, codes: np.ndarray, id_text: pa.Array | None) -> None:
        np.ascontiguousarray(numbers, dtype=np.float64).tofile(self._files["numbers.f64"])
        np.ascontiguousarray(codes, dtype=np.int32).tofile(self._files["codes.i32"])
        if id_text is not None:
            offsets, data = _string_buffers(id_text)
            self._files["ids.txt"].write(data)
            (offsets[1:] + self._text_bytes).tofile(self._files["ids.off"])
            self._text_bytes += len(data)
        self.n += len(numbers)

    def finish(self, order: np.ndarray, *, texts: bool) -> DiskRows:
        """The rows, read back; `order[i]` is the file row of the i-th smallest id."""
        for fh in self._files.values():
            fh.close()
        return DiskRows(self.dir, self.n, self.n_numbers, self.n_codes, order, texts=texts)

    def abandon(self) -> None:
        for fh in self._files.values():
            fh.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class DiskRows:
    """Compact rows in the files of a cache directory (file order): batches at random read with
    `pread`, scans through read-only memory maps; `order` (int32 where it fits, 4 bytes per
    row) maps the sorted ids to file rows. The directory is removed when this object is."""

    def __init__(
        self,
        directory: Path,
        n: int,
        n_numbers: int,
        n_codes: int,
        order: np.ndarray,
        *,
        texts: bool,
    ) -> None:
        self.dir = Path(directory)
        self.n = n
        self.order = order.astype(np.int32 if n < 2**31 else np.int64)
        self._maps: list[mmap.mmap] = []
        self._fds: dict[str, int] = {}
        self.n_numbers, self.n_codes = n_numbers, n_codes
        self.numbers = self._map("numbers.f64", np.float64, (n, n_numbers))
        self.codes = self._map("codes.i32", np.int32, (n, n_codes))
        self.row_bytes = 8 * n_numbers + 4 * n_codes
        self.has_texts = texts
        if texts:
            self._offsets = self._map("ids.off", np.int64, (n + 1,))
            self._text = self._map("ids.txt", np.uint8, (-1,))
        self._touched = 0
        self._finalizer = weakref.finalize(self, _remove, str(self.dir), self._fds)

    def __len__(self) -> int:
        return self.n

    def take(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.order[positions]
        return (
            self._pread("numbers.f64", rows, self.n_numbers, np.float64),
            self._pread("codes.i32", rows, self.n_codes, np.int32),
        )

    def scan(
        self, positions: np.ndarray, *, rows: int = SCAN_ROWS
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(positions, numbers, codes) blocks covering `positions`, in file order (so each
        block reads a few runs of pages)."""
        file_rows = self.order[positions]
        by_file = np.argsort(file_rows, kind="stable")
        for i in range(0, len(by_file), rows):
            pick = by_file[i : i + rows]
            block = file_rows[pick]
            numbers, codes = self.numbers[block], self.codes[block]
            self._touch(block, ordered=True)
            yield positions[pick], numbers, codes

    def texts(self, positions: np.ndarray) -> np.ndarray | None:
        """The identifiers at `positions` as written (None: the table has none)."""
        if not self.has_texts:
            return None
        offsets, text = self._fds.get("ids.off", -1), self._fds.get("ids.txt", -1)
        out = []
        for r in self.order[positions].tolist():
            start, end = struct.unpack("=qq", _pread_exact(offsets, 16, 8 * r, self.dir))
            out.append(_pread_exact(text, end - start, start, self.dir).decode())
        return np.array(out, dtype=object)

    def release(self) -> None:
        """Hand the mapped pages back to the kernel (they stay in its page cache)."""
        for mm in self._maps:
            mm.madvise(mmap.MADV_DONTNEED)
        self._touched = 0

    def close(self) -> None:
        """Remove the cache directory now (the maps stay valid until this object goes)."""
        self._finalizer()

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
