"""Reading a table chunk by chunk: the columns a role needs, as text, a bounded number of bytes
at a time, so a multi-gigabyte file never has to fit in memory.

CSV goes through pyarrow's streaming reader (any one-character delimiter, quoted fields with
delimiters or line breaks inside, UTF-8 with or without BOM); a file whose rows do not all have
the header's number of fields continues through Python's `csv` reader, which reads a short row's
missing cells as empty, from the row where pyarrow stopped. Parquet goes by record batches.

Every chunk holds the cells of the wanted columns stripped of surrounding white space (exactly
what `str.strip` removes) with the NA tokens as nulls, and the identifiers as written.
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from securevfl.errors import DataError

# bytes of text per chunk (CSV blocks); Parquet batches are sized alike. pyarrow's streaming CSV
# reader keeps about 40 blocks in flight (its read-ahead): on a 0.5 GB CSV its memory pool
# peaked at 370 MB with 8 MiB blocks, 87 MB with 2 MiB and 43 MB with 1 MiB ones, read in the
# same time (on a 0.6 GB CSV: 900 MB resident with 32 MiB chunks, 510 MB with 8 MiB)
CHUNK_BYTES = 1 << 20
ROW_NUMBER_ID = "@row"  # [data] id for tables without an id column: the 1-based row number
# every character `str.strip()` removes (str.isspace): cells are stripped exactly as before
PY_WHITESPACE = (
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class TextChunk:
    """Consecutive data rows of a file: `first_row` is the 0-based index of the first (blank
    lines are not rows); `ids` the identifier cells as written (None: the table is keyed by
    row number); `cells` column -> stripped text, NA tokens as nulls."""

    first_row: int
    n_rows: int
    ids: pa.Array | None
    cells: dict[str, pa.Array]


class TableReader:
    """The header of a CSV or Parquet file, checked against the columns a role needs, and an
    iterator over its chunks (`chunks()`, restartable: each call reads the file again).

    Refuses (DataError naming the file) a missing file, an empty or non-UTF-8 one, and a
    missing column."""

    def __init__(
        self,
        path: Path,
        *,
        columns: Sequence[str],
        id_column: str,
        na: Sequence[str],
        delimiter: str | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"data file {self.path} does not exist; check [data] path")
        self.parquet = self.path.suffix.lower() in PARQUET_SUFFIXES
        self.chunk_bytes = max(int(chunk_bytes), 1)
        self.na = pa.array(sorted(set(na)), type=pa.string())
        if self.parquet:
            self.delimiter = ","
            self.header = _parquet_header(self.path)
        else:
            self.header, self.delimiter = _csv_header(self.path, delimiter)
        # a repeated column name means its last occurrence (as Python's csv module did)
        self.index = {name: j for j, name in enumerate(self.header)}
        # "@row": the row number, unless the file carries it (a per-role file of such a table)
        self.by_line = id_column == ROW_NUMBER_ID and id_column not in self.index
        self.id_column = id_column
        self.columns = list(dict.fromkeys(columns))
        wanted = self.columns if self.by_line else [id_column, *self.columns]
        for name in wanted:
            if name not in self.index:
                raise DataError(
                    f"{self.path} has no column {name!r}; its columns are {self.header[:30]}"
                )

    @property
    def size(self) -> int:
        return self.path.stat().st_size

    def chunks(self) -> Iterator[TextChunk]:
        """The file's chunks, in order."""
        raw = self._parquet_chunks() if self.parquet else self._csv_chunks()
        for first, n, ids, cells in raw:
            yield TextChunk(
                first_row=first,
                n_rows=n,
                ids=None if self.by_line else _as_text(ids, fill=""),
                cells={c: self._clean(cells[c]) for c in self.columns},
            )

    def _clean(self, cells: pa.Array) -> pa.Array:
        text = pc.utf8_trim(_as_text(cells), characters=PY_WHITESPACE)
        return pc.if_else(pc.is_in(text, value_set=self.na), pa.scalar(None, pa.string()), text)

    def _wanted(self) -> list[str]:
        return self.columns if self.by_line else [self.id_column, *self.columns]

    def _csv_chunks(self) -> Iterator[tuple[int, int, pa.Array | None, dict[str, pa.Array]]]:
        import pyarrow.csv as pcsv

        internal = [f"c{j}" for j in range(len(self.header))]
        wanted = self._wanted()
        keys = {name: internal[self.index[name]] for name in wanted}
        done = 0
        try:
            reader = pcsv.open_csv(
                self.path,
                read_options=pcsv.ReadOptions(
                    column_names=internal, skip_rows=1, block_size=self.chunk_bytes
                ),
                parse_options=pcsv.ParseOptions(
                    delimiter=self.delimiter,
                    quote_char='"',
                    double_quote=True,
                    escape_char=False,
                    newlines_in_values=True,
                    ignore_empty_lines=True,
                ),
                convert_options=pcsv.ConvertOptions(
                    include_columns=sorted(set(keys.values())),
                    column_types={k: pa.string() for k in keys.values()},
                    strings_can_be_null=False,
                    quoted_strings_can_be_null=False,
                ),
            )
            for batch in reader:
                if batch.num_rows == 0:
                    continue
                cols = {name: batch.column(key) for name, key in keys.items()}
                yield done, batch.num_rows, cols.get(self.id_column), cols
                done += batch.num_rows
        except pa.ArrowInvalid as exc:
            text = str(exc)
            if "UTF8" in text or "UTF-8" in text:
                raise DataError(f"{self.path} is not UTF-8 text ({text})") from None
            if "Expected" not in text or "columns" not in text:
                raise DataError(f"{self.path}: {text}") from None
            # a row with fewer or more fields than the header: the csv module reads it
            yield from self._python_csv_chunks(skip=done)

    def _python_csv_chunks(
        self, *, skip: int
    ) -> Iterator[tuple[int, int, pa.Array | None, dict[str, pa.Array]]]:
        wanted = self._wanted()
        with self.path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh, delimiter=self.delimiter)
            try:
                next(reader)  # the header
                rows = (r for r in reader if r)
                for _ in itertools.islice(rows, skip):
                    pass
                done = skip
                while True:
                    batch: list[list[str]] = []
                    size = 0
                    for r in rows:
                        batch.append(r)
                        size += sum(len(x) for x in r) + len(r)
                        if size >= self.chunk_bytes:
                            break
                    if not batch:
                        return
                    cols = {}
                    for name in wanted:
                        j = self.index[name]
                        cols[name] = pa.array(
                            [r[j] if j < len(r) else None for r in batch], type=pa.string()
                        )
                    yield done, len(batch), cols.get(self.id_column), cols
                    done += len(batch)
            except UnicodeDecodeError as exc:
                raise DataError(f"{self.path} is not UTF-8 text ({exc.reason})") from None

    def _parquet_chunks(self) -> Iterator[tuple[int, int, pa.Array | None, dict[str, pa.Array]]]:
        import pyarrow.parquet as pq

        wanted = self._wanted()
        file = pq.ParquetFile(self.path)
        n_rows = max(file.metadata.num_rows, 1)
        per_row = max(self.size / n_rows, 1.0) * 4  # decoded rows are larger than encoded ones
        batch_rows = max(int(self.chunk_bytes / per_row), 1)
        done = 0
        for batch in file.iter_batches(batch_size=batch_rows, columns=wanted):
            if batch.num_rows == 0:
                continue
            cols = {name: _parquet_text(batch.column(name)) for name in wanted}
            yield done, batch.num_rows, cols.get(self.id_column), cols
            done += batch.num_rows


def _csv_header(path: Path, delimiter: str | None) -> tuple[list[str], str]:
    with path.open(newline="", encoding="utf-8-sig") as fh:  # a BOM is dropped
        try:
            head = fh.read(64 * 1024)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from None
        fh.seek(0)
        if delimiter is None:
            try:
                delimiter = csv.Sniffer().sniff(head.split("\n", 1)[0], ",;\t|").delimiter
            except csv.Error:
                delimiter = ","
        try:
            header = [h.strip() for h in next(csv.reader(fh, delimiter=delimiter))]
        except StopIteration:
            raise DataError(f"{path} is empty") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from None
    return header, delimiter


def _parquet_header(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.ParquetFile(path).schema_arrow.names)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc})") from None


def _as_text(cells: pa.Array | pa.ChunkedArray, *, fill: str | None = None) -> pa.Array:
    if isinstance(cells, pa.ChunkedArray):
        cells = cells.combine_chunks()
    if cells.type != pa.string():
        cells = cells.cast(pa.string())
    return cells if fill is None else pc.fill_null(cells, fill)


def _parquet_text(column: pa.Array) -> pa.Array:
    """A Parquet column as the text Python's `str` gives its values (empty for null)."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return pc.fill_null(column.cast(pa.string()), "")
    return pa.array(["" if v is None else str(v) for v in column.to_pylist()], type=pa.string())
