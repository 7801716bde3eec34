"""Tables keyed by sample id, and the per-party split a real federation starts from.

Each role reads only its own file: `split_federation` writes one CSV per role (the id column plus
that role's columns; the active party's also carries the label) so that the launcher can hand each
process nothing but its own data.

Files are read chunk by chunk (`securevfl.data.chunks`), so a multi-gigabyte table never has to
fit in memory. A role's table is held in memory when its file is small, and otherwise streamed
([data] stream = "auto", the default: files over `STREAM_ABOVE_BYTES`; true; false): its rows
then go, in compact form, to a cache of the role's own on disk, with an index of the sorted
ids (each one's row, and the active party's labels) built there by an external sort, and each
batch is read and encoded from there, so memory holds the chunk being read, the batch, a run of
the sort while loading, and no array with one entry per row (`securevfl.data.rowstore`). Peak
memory measured on 0.5, 2 and 5 GB files: bench/stream_rss.py. Both ways
give the same encoded matrix, bit for bit. The split streams too: two passes over the table;
with no missingness generator and no labeled budget, a streamed one keeps nothing per row in
memory (the ids are checked by the external sort, each chunk's rows go where its cells say),
otherwise about 30 bytes per row (ids, labels, which role gets which row). The active party's
per-row arrays of a streamed table (split, presence, filtered ids, shuffled orders) are files
of its cache too (`securevfl.data.rowarrays`).
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securevfl.config import ConfigError, RunConfig, categorical_encoding
from securevfl.data.chunks import CHUNK_BYTES, TableReader, TextChunk
from securevfl.data.columns import (
    NA_TOKENS,
    ROW_NUMBER_ID,
    ColumnEncoder,
    CompactConverter,
    KindSniffer,
    LabelCodec,
    check_unique,
    chunk_id_text,
    chunk_ids,
    numbers_of,
)
from securevfl.data.rowstore import DiskRows, DiskRowsWriter, MemoryRows
from securevfl.errors import DataError

log = logging.getLogger(__name__)

# [data] stream = "auto": a role's file larger than this is streamed from a cache on disk
STREAM_ABOVE_BYTES = 256 << 20
# ids spanning at most 2 * rows + this are looked up through a dense id -> position table
_DENSE_MARGIN = 4096


@dataclass
class PartyTable:
    """One role's feature block: rows keyed by integer sample id. NaN marks an empty cell.

    The rows are held in compact form (`rowstore`: numbers and category codes, in memory or in
    a cache on disk). A table with non-numeric columns has an `encoder`, unfitted until
    `prepare(train_ids)` fits it on the training rows the table holds and sets `columns` to
    the encoded (numeric) columns. Methods see only those: `rows(ids)` (a batch),
    `row_blocks` and `column_summary` (every training row, a block at a time) and `values`
    (the whole matrix: kept in memory for a table read whole; for a streamed one it is built
    on request, so streaming methods use `rows`)."""

    ids: np.ndarray  # int64, sorted, unique
    columns: tuple[str, ...]
    rowstore: MemoryRows | DiskRows
    encoder: ColumnEncoder | None = None
    levels: dict[str, list[str]] = field(default_factory=dict)  # categorical: values seen
    where: str = "table"
    matrix: np.ndarray | None = None  # float64 [n_rows, n_columns]: the encoded rows, in memory
    source: str | None = None  # the file it was read from: resolved path, size, mtime (ns)

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.ids, dtype=np.int64)
        # a streamed table's ids are its row cache's index: sorted and unique when built
        if not self.streamed and len(self.ids) > 1 and not (self.ids[1:] > self.ids[:-1]).all():
            raise ValueError("PartyTable ids must be sorted and unique")
        self._encoded = self.encoder is None
        if self.encoder is None and self.matrix is None and not self.streamed:
            self.matrix = self.rowstore.numbers

    @property
    def streamed(self) -> bool:
        """Whether the rows are read from a cache on disk (batch by batch) rather than memory."""
        return isinstance(self.rowstore, DiskRows)

    @property
    def values(self) -> np.ndarray | None:
        """float64 [n_rows, n_columns], the encoded rows in id order (None until text columns
        are encoded). For a streamed table this builds the whole matrix in memory (logged):
        methods that stream use `rows`, `row_blocks` and `column_summary` instead."""
        if self.matrix is not None or not self._encoded:
            return self.matrix
        log.warning(
            "%s: a method asked for the whole encoded table (%d rows x %d columns, %.2f GB) "
            "in memory; the table is streamed from disk, memory is no longer bounded by the "
            "batch",
            self.where,
            len(self.ids),
            len(self.columns),
            len(self.ids) * len(self.columns) * 8 / 1e9,
        )
        self.matrix = self._encode_at(np.arange(len(self.ids)))
        return self.matrix

    def prepare(self, train_ids: np.ndarray) -> None:
        """Fit the encoding of text columns on the training rows this table holds (once)."""
        if self._encoded:
            return
        train = np.asarray(train_ids, dtype=np.int64)
        if self.streamed:  # the held training rows, block by block: no array of the rows
            blocks = (codes for _, codes in self.rowstore.scan_ids(train, missing="skip"))
        else:
            positions = self.positions(train[self.has(train)])
            blocks = (codes for _, _, codes in self.rowstore.scan(positions))
        self.encoder.fit_codes(self.levels, blocks)
        self._encoded_now()

    def use_encoding(self, state: dict | None) -> None:
        """Encode the text columns with a saved encoding (a trained model scoring new rows)."""
        if self._encoded:
            return
        if state is None:
            raise DataError(f"{self.where}: text columns but no saved encoding to score them")
        self.encoder.load_state_dict(state)
        self._encoded_now()

    def _encoded_now(self) -> None:
        self.columns = self.encoder.out_columns
        self._encoded = True
        if not self.streamed:
            store = self.rowstore
            self.matrix = self.encoder.encode(store.numbers, store.codes, self.levels)

    def texts(self, ids: np.ndarray) -> np.ndarray:
        """The identifiers of `ids` as written in the file."""
        texts = self.rowstore.texts(self.positions(ids))
        if texts is None:
            return np.asarray(ids).astype(str).astype(object)
        return texts

    def encoding_state(self) -> dict | None:
        return None if self.encoder is None else self.encoder.state_dict()

    def __len__(self) -> int:
        return len(self.ids)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Row positions of `ids`; raises DataError naming ids this table does not hold."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.streamed:  # through the row cache's id index, on disk
            pos = self.rowstore.locate(ids)
            ok = pos >= 0
        else:
            pos = self._index_of(ids)
            ok = pos >= 0
        if not ok.all():
            missing = ids[~ok][:5].tolist()
            raise DataError(
                f"{int((~ok).sum())} requested sample ids are not in this table, e.g. {missing}"
            )
        return pos

    def has(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of `ids` this table holds."""
        return self.index_of(ids) >= 0

    def _index_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 positions of int64 `ids` in this (in-memory) table, -1 where it does not
        hold them. Where the ids are compact (they span at most twice the rows, plus a margin:
        row numbers, a split of them), through a dense table from id to position, made once per
        `ids` array: one read per id, where a binary search makes ~log2(rows) reads, each a
        likely cache miss in a role that shares its core with others; else a binary search."""
        n = len(self.ids)
        if n == 0:
            return np.full(len(ids), -1, dtype=np.int64)
        dense = getattr(self, "_dense", None)
        if dense is None or dense[0] is not self.ids:
            lo, hi = int(self.ids[0]), int(self.ids[-1])
            table = None
            if hi - lo <= 2 * n + _DENSE_MARGIN:  # int32 positions: 4 bytes per id spanned
                dtype = np.int32 if n < 2**31 else np.int64
                table = np.full(hi - lo + 1, -1, dtype=dtype)
                table[self.ids - lo] = np.arange(n, dtype=dtype)
            dense = self._dense = (self.ids, lo, table)
        _, lo, table = dense
        if table is not None:  # compared before subtracting: no id wraps around into range
            inside = (ids >= lo) & (ids <= lo + len(table) - 1)
            if inside.all():
                return table[ids - lo].astype(np.int64)
            pos = np.full(len(ids), -1, dtype=np.int64)
            pos[inside] = table[ids[inside] - lo]
            return pos
        pos = np.minimum(np.searchsorted(self.ids, ids), n - 1)
        return np.where(self.ids[pos] == ids, pos, -1)

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        """int64 positions of `ids` in this table, -1 where it does not hold them (a streamed
        table's through its row cache's index)."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.streamed:
            return np.asarray(self.rowstore.locate(ids), dtype=np.int64)
        return self._index_of(ids)

    def held_ids(self, ids: np.ndarray) -> np.ndarray:
        """`ids[self.has(ids)]`: the rows of `ids` this table holds, in that order. For a
        streamed table, computed a block at a time into a file of its row cache (no mask or
        copy of `ids` in memory)."""
        if not self.streamed:
            return np.asarray(ids, dtype=np.int64)[self.has(ids)]
        from securevfl.data.rowarrays import filter_ids

        return filter_ids(self.rowstore.arrays(), ids, self.has, "held")

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """float64 [len(ids), n_columns]: the encoded rows of `ids`, in that order."""
        if not self._encoded:
            raise RuntimeError(f"{self.where}: the text columns are encoded at set-up (prepare)")
        positions = self.positions(ids)
        if self.matrix is not None:
            return self.matrix[positions]
        return self._encode_at(positions)

    def row_blocks(self, ids: np.ndarray) -> Iterator[np.ndarray]:
        """The encoded rows of `ids` a block at a time (in memory: one block, in their order;
        streamed: blocks of `rowstore.SCAN_ROWS` rows in file order)."""
        if not self._encoded:
            raise RuntimeError(f"{self.where}: the text columns are encoded at set-up (prepare)")
        if self.matrix is not None:
            yield self.rows(ids)
            return
        for numbers, codes in self.rowstore.scan_ids(ids):
            if self.encoder is None:
                yield numbers
            else:
                yield self.encoder.encode(numbers, codes, self.levels)

    def column_summary(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per encoded column over the rows of `ids`, empty cells ignored: count, mean,
        (population) std, min and max. A table in memory computes them as NumPy's nan-functions
        do on those rows (so a scaler fitted on them is the one fitted on the rows); a streamed
        one merges blocks (equal to within rounding, ~1e-15 relative). With no row: mean 0,
        std 1, min 0, max 1 (what the scalers use)."""
        d = len(self.columns)
        if len(ids) == 0:
            return {
                "count": np.zeros(d),
                "mean": np.zeros(d),
                "std": np.ones(d),
                "min": np.zeros(d),
                "max": np.ones(d),
            }
        with np.errstate(all="ignore"):
            if not self.streamed:
                rows = self.rows(ids)
                return {
                    "count": (~np.isnan(rows)).sum(axis=0).astype(np.float64),
                    "mean": np.nanmean(rows, axis=0),
                    "std": np.nanstd(rows, axis=0),
                    "min": np.nanmin(rows, axis=0),
                    "max": np.nanmax(rows, axis=0),
                }
            return _merged_summary(self.row_blocks(ids), d)

    def _encode_at(self, positions: np.ndarray) -> np.ndarray:
        numbers, codes = self.rowstore.take(positions)
        if self.encoder is None:
            return numbers
        return self.encoder.encode(numbers, codes, self.levels)


def _merged_summary(blocks: Iterator[np.ndarray], d: int) -> dict[str, np.ndarray]:
    """Count, mean, std, min, max per column over row blocks (Chan et al.'s pairwise update of
    the sum of squared deviations), NaN ignored."""
    count = np.zeros(d)
    mean = np.zeros(d)
    m2 = np.zeros(d)
    low = np.full(d, np.nan)
    high = np.full(d, np.nan)
    for block in blocks:
        seen = ~np.isnan(block)
        c = seen.sum(axis=0).astype(np.float64)
        if not c.any():
            continue
        filled = np.where(seen, block, 0.0)
        m = filled.sum(axis=0) / np.maximum(c, 1)
        dev = np.where(seen, block - m, 0.0)
        s2 = (dev * dev).sum(axis=0)
        total = count + c
        delta = m - mean
        share = np.where(total > 0, c / np.maximum(total, 1), 0.0)
        mean = np.where(c > 0, mean + delta * share, mean)
        m2 = np.where(c > 0, m2 + s2 + delta * delta * count * share, m2)
        count = total
        low = np.fmin(low, np.nanmin(np.where(seen, block, np.inf), axis=0))
        high = np.fmax(high, np.nanmax(np.where(seen, block, -np.inf), axis=0))
    none = count == 0
    return {
        "count": count,
        "mean": np.where(none, np.nan, mean),
        "std": np.where(none, np.nan, np.sqrt(m2 / np.maximum(count, 1))),
        "min": np.where(none, np.nan, low),
        "max": np.where(none, np.nan, high),
    }


@dataclass
class ActiveTable(PartyTable):
    """The active party's table: its own columns (possibly none) and the labels."""

    labels: np.ndarray | None = None  # float64 [n_rows], in id order

    def label_rows(self, ids: np.ndarray) -> np.ndarray:
        if self.streamed:  # the labels are in the row cache's id index, on disk
            return self.rowstore.label_rows(self.positions(ids))
        return self.labels[self.positions(ids)]

    def labeled(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` carry a label (a labeled budget leaves the others empty)."""
        return ~np.isnan(self.label_rows(ids))


# ---------------------------------------------------------------------------------------------
# streaming or not


def streams(size: int, setting: bool | str | None) -> bool:
    """Whether a file of `size` bytes is streamed under the [data] stream `setting`."""
    if setting is None or setting == "auto":
        return size > STREAM_ABOVE_BYTES
    return bool(setting)


def _source(reader: TableReader, streamed: bool) -> Callable[[], Iterator[TextChunk]]:
    """The chunks, again at each call: read anew when streaming, kept in memory otherwise."""
    if streamed:
        return reader.chunks
    kept = list(reader.chunks())
    return lambda: iter(kept)


def _stream_setting(cfg: RunConfig, stream: bool | str | None) -> bool | str | None:
    return getattr(cfg, "stream", None) if stream is None else stream


def _id_column(cfg: RunConfig) -> str:
    return ROW_ID_COLUMN if cfg.id_column == ROW_NUMBER_ID else cfg.id_column


def _texts_at(reader: TableReader, rows: np.ndarray) -> list[str]:
    """The identifiers as written of file rows `rows` (one more pass; for error messages)."""
    wanted = {int(r) for r in rows}
    found: dict[int, str] = {}
    for chunk in reader.chunks():
        inside = [r for r in wanted if chunk.first_row <= r < chunk.first_row + chunk.n_rows]
        text = chunk_id_text(chunk)
        for r in inside:
            found[r] = text[r - chunk.first_row].as_py()
        if len(found) == len(wanted):
            break
    return [found[int(r)] for r in rows]


def _held_mask(chunk: TextChunk, columns: Sequence[str]) -> np.ndarray:
    """Rows of a chunk with at least one non-empty cell among `columns` (all, with none)."""
    held = np.zeros(chunk.n_rows, dtype=bool) if columns else np.ones(chunk.n_rows, dtype=bool)
    for c in columns:
        held |= pc.is_valid(chunk.cells[c]).to_numpy(zero_copy_only=False)
    return held


# ---------------------------------------------------------------------------------------------
# a role's table


def _load(
    path: Path,
    cfg: RunConfig,
    *,
    role: str,
    columns: Sequence[str],
    types: Sequence[tuple[str, str]],
    where: str,
    label: str | None,
    saved: dict | None,
    drop_unheld: bool,
    stream: bool | str | None,
    cache_dir: Path | None,
    chunk_bytes: int,
) -> dict[str, Any]:
    """Read a role's file in two passes (types, then compact rows) into a row store."""
    reader = TableReader(
        path,
        columns=[*columns] + ([label] if label is not None else []),
        id_column=_id_column(cfg),
        na=cfg.na_tokens,
        delimiter=cfg.delimiter,
        chunk_bytes=chunk_bytes,
    )
    streamed = streams(reader.size, _stream_setting(cfg, stream))
    chunks = _source(reader, streamed)
    if saved is not None:  # a trained model scoring new rows: the types it was trained with
        kinds = dict(saved["kinds"])
    else:
        declared = dict(types)
        unknown = [c for c in columns if not declared.get(c)]
        sniffers = {c: KindSniffer() for c in unknown}
        if unknown:
            for chunk in chunks():
                for c in unknown:
                    sniffers[c].update(chunk.cells[c])
        kinds = {c: declared.get(c) or sniffers[c].kind for c in columns}
    converter = CompactConverter(kinds)
    label_levels = CompactConverter({label: "categorical"}) if label is not None else None
    regression = cfg.task == "regression"
    file_where = str(reader.path)
    ids_parts: list[np.ndarray] = []
    held_parts: list[np.ndarray] = []
    label_parts: list[np.ndarray] = []
    numbers_parts: list[np.ndarray] = []
    codes_parts: list[np.ndarray] = []
    text_parts: list[pa.Array] = []
    writer = (
        DiskRowsWriter(
            cache_dir,
            prefix=f"rows-{role}",
            n_numbers=len(converter.numeric),
            n_codes=len(converter.categorical),
            labels=role == cfg.active_name,
        )
        if streamed
        else None
    )
    try:
        for chunk in chunks():
            chunk_id = chunk_ids(chunk, where=file_where)
            numbers, codes = converter.convert(
                chunk.cells, chunk.n_rows, where=where, first_row=chunk.first_row
            )
            held = _held_mask(chunk, columns) if drop_unheld else np.ones(chunk.n_rows, bool)
            text = chunk_id_text(chunk).filter(pa.array(held))
            part = None
            if label is not None:
                cells = chunk.cells[label]
                if regression:
                    part = numbers_of(cells, column=label, where=where, first_row=chunk.first_row)
                else:
                    part = label_levels.convert({label: cells}, chunk.n_rows, where=where)[1][:, 0]
                part = part[held]
            if writer is not None:  # every per-row array goes to disk, the ids included
                writer.append(
                    numbers[held],
                    codes[held],
                    None if reader.by_line else text,
                    ids=chunk_id,
                    held=held,
                    labels=part,
                )
            else:
                ids_parts.append(chunk_id)
                held_parts.append(held)
                if part is not None:
                    label_parts.append(part)
                numbers_parts.append(numbers[held])
                codes_parts.append(codes[held])
                text_parts.append(text)
        if writer is not None:  # the ids are sorted and checked on disk (`rowstore`)
            store: MemoryRows | DiskRows = writer.finish(
                texts=not reader.by_line,
                where=file_where,
                texts_at=lambda rows: _texts_at(reader, rows),
                label_map=_label_map(cfg, label, label_levels, where),
            )
            ids, order = store.ids, None
        else:
            all_ids = np.concatenate(ids_parts) if ids_parts else np.empty(0, np.int64)
            del ids_parts
            check_unique(all_ids, where=file_where, texts_at=lambda rows: _texts_at(reader, rows))
            held_all = np.concatenate(held_parts) if held_parts else np.empty(0, bool)
            ids = all_ids[held_all]
            del all_ids, held_all
            order = np.argsort(ids, kind="stable")
            ids = ids[order]
            store = MemoryRows(
                _stack(numbers_parts, len(converter.numeric), np.float64)[order],
                _stack(codes_parts, len(converter.categorical), np.int32)[order],
                _object_text(text_parts)[order],
            )
    except BaseException:
        if writer is not None:
            writer.abandon()
        raise
    labels, first_empty = None, None  # first_empty: the first file row with an empty label
    if isinstance(store, DiskRows):
        labels, first_empty = store.labels, store.first_empty_label
    elif label is not None:
        joined = np.concatenate(label_parts) if label_parts else np.empty(0)
        if not regression:
            joined = LabelCodec(cfg.task, positive=cfg.positive).encode_levels(
                label_levels.levels[label], joined.astype(np.int32), column=label, where=where
            )
        labels = joined
        empty = np.isnan(labels)
        first_empty = int(np.argmax(empty)) if empty.any() else None
    return {
        "ids": ids,
        "order": order,
        "store": store,
        "kinds": kinds,
        "levels": converter.levels,
        "labels": labels,
        "first_empty_label": first_empty,
        "where": where,
    }


def _label_map(
    cfg: RunConfig, label: str | None, levels: CompactConverter | None, where: str
) -> Callable[[np.ndarray], np.ndarray] | None:
    """Raw labels (codes into the label's values, -1 empty) to the stored ones, for the
    row cache (regression or no label: None, the numbers as read)."""
    if label is None or cfg.task == "regression":
        return None
    values = levels.levels[label]
    lookup = LabelCodec(cfg.task, positive=cfg.positive).encode_levels(
        values, np.arange(-1, len(values), dtype=np.int32), column=label, where=where
    )  # lookup[code + 1]
    return lambda raw: lookup[raw.astype(np.int64) + 1]


def _stack(parts: list[np.ndarray], width: int, dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty((0, width), dtype=dtype)


def _object_text(parts: list[pa.Array]) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=object)
    return np.asarray(pa.concat_arrays(parts).to_numpy(zero_copy_only=False), dtype=object)


def _make(
    cls: type,
    loaded: dict[str, Any],
    columns: Sequence[str],
    *,
    categorical: str = "onehot",
    **extra: Any,
) -> PartyTable:
    kinds = loaded["kinds"]
    text = any(k != "numeric" for k in kinds.values())
    return cls(
        ids=loaded["ids"],
        columns=tuple(columns),
        rowstore=loaded["store"],
        # a saved encoding (scoring) brings its own `categorical` (`use_encoding`)
        encoder=ColumnEncoder(kinds, categorical=categorical) if text else None,
        levels=loaded["levels"],
        where=loaded["where"],
        **extra,
    )


def load_party_table(
    path: Path,
    cfg: RunConfig,
    role: str,
    *,
    encoding: dict | None = None,
    stream: bool | str | None = None,
    cache_dir: Path | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> PartyTable:
    """A passive party's own file. A row whose cells are all empty is a row the party lacks.
    Text columns (inferred, or declared in [parties.NAME] types) are encoded at set-up; with a
    saved `encoding` (scoring new rows), with the types and categories it holds.

    `stream` (default: the config's [data] stream, "auto") streams the file into a row cache
    in a new directory under `cache_dir` (default: a temporary directory), removed with the
    table. Refuses (DataError naming the file, column and row) a bad identifier or value."""
    party = cfg.party(role)
    loaded = _load(
        path,
        cfg,
        role=role,
        columns=party.columns,
        types=party.types,
        where=f"party {role!r} ({Path(path).name})",
        label=None,
        saved=encoding,
        drop_unheld=True,
        stream=stream,
        cache_dir=cache_dir,
        chunk_bytes=chunk_bytes,
    )
    stat = Path(path).stat()
    return _make(
        PartyTable,
        loaded,
        party.columns,
        categorical=categorical_encoding(cfg, role),
        source=f"{Path(path).resolve()}|{stat.st_size}|{stat.st_mtime_ns}",
    )


def load_active_table(
    path: Path,
    cfg: RunConfig,
    *,
    encoding: dict | None = None,
    scoring: bool = False,
    stream: bool | str | None = None,
    cache_dir: Path | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> ActiveTable:
    """The active party's file; `scoring`: rows to score, whose labels may be absent.
    `stream`, `cache_dir` as in `load_party_table`."""
    label = cfg.label
    if scoring and cfg.label not in _header_of(Path(path), cfg):
        label = None
    where = f"the active party ({Path(path).name})"
    loaded = _load(
        path,
        cfg,
        role=cfg.active_name,
        columns=cfg.active_columns,
        types=cfg.active_types,
        where=where,
        label=label,
        saved=encoding,
        drop_unheld=False,
        stream=stream,
        cache_dir=cache_dir,
        chunk_bytes=chunk_bytes,
    )
    labels = loaded["labels"]
    if labels is None:
        labels = np.full(len(loaded["ids"]), np.nan)
    elif loaded["first_empty_label"] is not None and cfg.labeled is None and not scoring:
        line = loaded["first_empty_label"] + 2
        raise DataError(
            f"{path}:{line}: the label {cfg.label!r} is empty (set [missing] labeled if some "
            "training rows are unlabeled on purpose)"
        )
    return _make(
        ActiveTable,
        loaded,
        cfg.active_columns,
        categorical=categorical_encoding(cfg, cfg.active_name),
        labels=labels if loaded["order"] is None else labels[loaded["order"]],
    )


def read_csv_columns(
    path: Path,
    *,
    id_column: str,
    columns: Sequence[str],
    label: str | None = None,
    empty_labels: bool = False,
    task: str = "binary",
    positive: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Read the ids, numeric `columns` (empty cell -> NaN) and optionally the label (coded by
    `LabelCodec`), chunk by chunk. Raises DataError naming the file and the first bad column
    or value."""
    reader = TableReader(
        Path(path),
        columns=[*columns] + ([label] if label is not None else []),
        id_column=id_column,
        na=NA_TOKENS,
    )
    where = str(path)
    ids, values, codes, numbers = [], [], [], []
    levels = CompactConverter({label: "categorical"}) if label is not None else None
    for chunk in reader.chunks():
        ids.append(chunk_ids(chunk, where=where))
        block = np.empty((chunk.n_rows, len(columns)))
        for j, c in enumerate(columns):
            block[:, j] = numbers_of(
                chunk.cells[c], column=c, where=where, first_row=chunk.first_row
            )
        values.append(block)
        if label is not None:
            if task == "regression":
                numbers.append(
                    numbers_of(
                        chunk.cells[label], column=label, where=where, first_row=chunk.first_row
                    )
                )
            else:
                cells = {label: chunk.cells[label]}
                codes.append(levels.convert(cells, chunk.n_rows, where=where)[1])
    all_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
    check_unique(all_ids, where=where, texts_at=lambda rows: _texts_at(reader, rows))
    matrix = _stack(values, len(columns), np.float64)
    labels = None
    if label is not None:
        if task == "regression":
            labels = np.concatenate(numbers) if numbers else np.empty(0)
        else:
            labels = LabelCodec(task, positive=positive).encode_levels(
                levels.levels[label],
                _stack(codes, 1, np.int32)[:, 0],
                column=label,
                where=where,
            )
        if np.isnan(labels).any() and not empty_labels:
            line = int(np.argmax(np.isnan(labels))) + 2
            raise DataError(
                f"{path}:{line}: the label {label!r} is empty (set [missing] labeled if some "
                "training rows are unlabeled on purpose)"
            )
    return all_ids, matrix, labels


def write_csv(
    path: Path,
    *,
    id_column: str,
    ids: np.ndarray,
    columns: Sequence[str],
    values: np.ndarray,
    label: str | None = None,
    labels: np.ndarray | None = None,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([id_column, *columns] + ([label] if label else []))
        for i, row_id in enumerate(ids):
            cells = ["" if math.isnan(v) else repr(float(v)) for v in values[i]]
            if label:
                cells.append(repr(float(labels[i])))
            w.writerow([int(row_id), *cells])


# the id column of the per-role files when the source table has none ([data] id = "@row")
ROW_ID_COLUMN = "@row"


def role_data_path(run_dir: Path, role: str) -> Path:
    return run_dir / "data" / f"{role}.csv"


# ---------------------------------------------------------------------------------------------
# splitting a table into one file per role

# missingness generators that read at most whether a party's block of a row has a number
_AVAILABILITY_ONLY = frozenset({"none", "mcar", "beta"})


def split_federation(
    cfg: RunConfig,
    run_dir: Path,
    *,
    stream: bool | str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, Path]:
    """Split the config's table into one CSV per role inside `run_dir/data/`, cells as written
    (text columns stay text: each role encodes its own).

    A passive party's file has no line for the rows it lacks: rows whose cells of its columns are
    all empty (NA) in the source table, or rows the configured missingness generator ([missing])
    removes. Rows that no passive party holds are dropped from every file. Returns role -> file.

    Two passes over the table, chunk by chunk (`stream` as in `load_party_table`; a table kept
    in memory is read once): the first keeps ids, labels and which party holds each row (and,
    for a value-dependent missingness generator, the parties' numeric cells), the second writes.
    A streamed table with no missingness generator and no labeled budget keeps none of that:
    its first pass only checks (`_check_pass`, the ids on disk in `run_dir/cache`), its second
    decides each chunk's rows from the chunk (`_write_roles`); the files are the same.
    Raises ConfigError naming a missing column or a bad value."""
    from securevfl.data.missing import presence

    roles = [(cfg.active_name, cfg.active_columns)] + [(p.name, p.columns) for p in cfg.parties]
    parties = list(cfg.party_names)
    try:
        reader = TableReader(
            cfg.data_path,
            columns=[c for _, cols in roles for c in cols] + [cfg.label],
            id_column=cfg.id_column,
            na=cfg.na_tokens,
            delimiter=cfg.delimiter,
            chunk_bytes=chunk_bytes,
        )
        streamed = streams(reader.size, _stream_setting(cfg, stream))
        chunks = _source(reader, streamed)
        if streamed and _split_blocks(cfg) == (False, False):
            _check_pass(cfg, reader, chunks, Path(run_dir) / "cache")
            return _write_roles(cfg, run_dir, roles, chunks)
        first = _first_pass(cfg, reader, chunks, parties)
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    labels = first["labels"]
    if cfg.labeled is None and np.isnan(labels).any():
        line = int(np.argmax(np.isnan(labels))) + 2
        raise ConfigError(
            "[data] path",
            f"{cfg.data_path}:{line}: the label {cfg.label!r} is empty (drop the row, or set "
            "[missing] labeled if some training rows are unlabeled on purpose)",
        )
    _check_labels(cfg, labels)
    blocks = first["blocks"]
    present = first["held"]
    is_test = holdout_mask(
        first["ids"],
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=labels,
        stratify=stratified(cfg),
    )
    del first
    for split, spec, rows in (
        ("train", cfg.missing_train, ~is_test),
        ("test", cfg.missing_test, is_test),
    ):
        if spec.kind == "none":
            continue
        sub = {p: blocks[p][rows] for p in parties}
        present[rows] &= presence(
            spec,
            parties=parties,
            n_rows=int(rows.sum()),
            seed=cfg.seed,
            split=split,
            features=sub,
        )
    kept_labels = _labeled_budget(cfg, blocks, labels, present, is_test)
    del blocks, labels, is_test
    keep = present.any(axis=1)
    masks = {cfg.active_name: None}  # the active party keeps every row
    for k, p in enumerate(parties):
        masks[p] = keep & present[:, k]
    del present, keep
    label_kept = ~np.isnan(kept_labels)
    del kept_labels
    id_name = _id_column(cfg)
    out = {role: role_data_path(run_dir, role) for role, _ in roles}
    headers = {role: [id_name, *cols] for role, cols in roles}
    headers[cfg.active_name].append(cfg.label)
    try:
        with _RoleWriters(out, headers) as writers:
            for chunk in chunks():
                s, e = chunk.first_row, chunk.first_row + chunk.n_rows
                text = pc.fill_null(chunk_id_text(chunk), "")
                for role, cols in roles:
                    body = [text, *(chunk.cells[c] for c in cols)]
                    if role == cfg.active_name:
                        body.append(_where_kept(chunk.cells[cfg.label], label_kept[s:e]))
                    writers.write(role, body, None if masks[role] is None else masks[role][s:e])
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    return out


def _check_labels(cfg: RunConfig, labels: np.ndarray) -> None:
    """Refuse, before any role starts, labels the task cannot train on (the active party would
    refuse them at its start, alone, while the other roles wait for it)."""
    from securevfl.methods.blocks.nets import class_count

    try:
        class_count(cfg.task, labels)
    except DataError as exc:
        raise ConfigError("[data] label", str(exc)) from None


def _check_pass(
    cfg: RunConfig,
    reader: TableReader,
    chunks: Callable[[], Iterator[TextChunk]],
    cache_dir: Path,
) -> None:
    """The first pass of a streamed split that needs no per-row array (no missingness generator,
    no labeled budget): the checks of `_first_pass` and `split_federation`, in their order and
    words (repeated ids, through an external sort in a cache of `cache_dir` removed after; the
    labels; the first empty label)."""
    where = str(reader.path)
    regression = cfg.task == "regression"
    label_levels = CompactConverter({cfg.label: "categorical"})
    first_empty: int | None = None
    writer = DiskRowsWriter(cache_dir, prefix="split-ids", n_numbers=0, n_codes=0)
    try:
        for chunk in chunks():
            n = chunk.n_rows
            ids = chunk_ids(chunk, where=where)
            writer.append(np.empty((n, 0)), np.empty((n, 0), np.int32), None, ids=ids)
            cells = chunk.cells[cfg.label]
            if regression:
                empty = np.isnan(
                    numbers_of(cells, column=cfg.label, where=where, first_row=chunk.first_row)
                )
            else:
                empty = label_levels.convert({cfg.label: cells}, n, where=where)[1][:, 0] < 0
            if first_empty is None and empty.any():
                first_empty = chunk.first_row + int(np.argmax(empty))
        writer.finish(
            texts=False, where=where, texts_at=lambda rows: _texts_at(reader, rows)
        ).close()
    except BaseException:
        writer.abandon()
        raise
    if not regression:  # refuses a bad [data] positive, as the codec over every row does
        levels = label_levels.levels[cfg.label]
        coded = LabelCodec(cfg.task, positive=cfg.positive).encode_levels(
            levels, np.arange(len(levels), dtype=np.int32), column=cfg.label, where=where
        )
        _check_labels(cfg, coded)  # each label once: what the rows hold
    if first_empty is not None and cfg.labeled is None:
        raise ConfigError(
            "[data] path",
            f"{cfg.data_path}:{first_empty + 2}: the label {cfg.label!r} is empty (drop the "
            "row, or set [missing] labeled if some training rows are unlabeled on purpose)",
        )


def _write_roles(
    cfg: RunConfig,
    run_dir: Path,
    roles: Sequence[tuple[str, Sequence[str]]],
    chunks: Callable[[], Iterator[TextChunk]],
) -> dict[str, Path]:
    """The second pass of a split with no missingness generator nor labeled budget: each chunk's
    rows to the role files, a passive party getting the rows with a cell of its own (what
    `split_federation` keeps, computed chunk by chunk)."""
    parties = roles[1:]
    id_name = _id_column(cfg)
    out = {role: role_data_path(run_dir, role) for role, _ in roles}
    headers = {role: [id_name, *cols] for role, cols in roles}
    headers[cfg.active_name].append(cfg.label)
    try:
        with _RoleWriters(out, headers) as writers:
            for chunk in chunks():
                text = pc.fill_null(chunk_id_text(chunk), "")
                held = [_held_mask(chunk, cols) for _, cols in parties]
                writers.write(
                    cfg.active_name,
                    [text, *(chunk.cells[c] for c in cfg.active_columns), chunk.cells[cfg.label]],
                    None,
                )
                for (role, cols), mask in zip(parties, held, strict=True):
                    writers.write(role, [text, *(chunk.cells[c] for c in cols)], mask)
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    return out


def _first_pass(
    cfg: RunConfig,
    reader: TableReader,
    chunks: Callable[[], Iterator[TextChunk]],
    parties: Sequence[str],
) -> dict[str, Any]:
    """Ids, labels, which party holds each row, and the blocks the missingness generators and
    the labeled budget read (`_split_blocks`)."""
    where = str(reader.path)
    regression = cfg.task == "regression"
    label_levels = CompactConverter({cfg.label: "categorical"})
    columns = {p: cfg.party(p).columns for p in parties}
    full, numbers_any = _split_blocks(cfg)
    ids, held, labels = [], [], []
    blocks: dict[str, list[np.ndarray]] = {p: [] for p in parties}
    for chunk in chunks():
        ids.append(chunk_ids(chunk, where=where))
        held.append(np.stack([_held_mask(chunk, columns[p]) for p in parties], axis=1))
        cells = chunk.cells[cfg.label]
        if regression:
            labels.append(
                numbers_of(cells, column=cfg.label, where=where, first_row=chunk.first_row)
            )
        else:
            labels.append(
                label_levels.convert({cfg.label: cells}, chunk.n_rows, where=where)[1][:, 0]
            )
        if not (full or numbers_any):
            continue
        for p in parties:
            # numbers for the value-dependent generators (text cells count as missing)
            block = np.full((chunk.n_rows, len(columns[p])), np.nan)
            for j, c in enumerate(columns[p]):
                block[:, j] = numbers_of(chunk.cells[c], column=c, where=where, strict=False)
            if not full:  # availability only: one column, NaN where the block has no number
                block = np.where(np.isnan(block).all(axis=1), np.nan, 0.0)[:, None]
            blocks[p].append(block)
    all_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
    del ids
    check_unique(all_ids, where=where, texts_at=lambda rows: _texts_at(reader, rows))
    joined = np.concatenate(labels) if labels else np.empty(0)
    if not regression:
        joined = LabelCodec(cfg.task, positive=cfg.positive).encode_levels(
            label_levels.levels[cfg.label],
            joined.astype(np.int32),
            column=cfg.label,
            where=where,
        )
    n = len(all_ids)
    return {
        "ids": all_ids,
        "labels": joined,
        "held": np.concatenate(held) if held else np.zeros((0, len(parties)), bool),
        "blocks": {
            p: np.concatenate(b) if b else np.full((n, 1), np.nan)
            for p, b in blocks.items()
            if full or numbers_any
        },
    }


def _split_blocks(cfg: RunConfig) -> tuple[bool, bool]:
    """(whether the parties' numeric cells are needed, whether only the availability of a
    number in each party's block of a row is)."""
    kinds = {cfg.missing_train.kind, cfg.missing_test.kind}
    full = not kinds <= _AVAILABILITY_ONLY
    return full, not full and (cfg.labeled is not None or kinds != {"none"})


def _where_kept(label: pa.Array, kept: np.ndarray) -> pa.Array:
    """The label cells, emptied where the labeled budget removed the label."""
    return pc.if_else(pa.array(kept), label, pa.scalar(None, pa.string()))


class _RoleWriters:
    """One CSV writer per role file (header first); `write` appends the rows a mask selects."""

    def __init__(self, paths: Mapping[str, Path], headers: Mapping[str, Sequence[str]]) -> None:
        self.paths, self.headers = paths, headers
        self._stack = ExitStack()
        self._writers: dict[str, Any] = {}

    def __enter__(self) -> _RoleWriters:
        for role, path in self.paths.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = self._stack.enter_context(path.open("w", newline="", encoding="utf-8"))
            self._writers[role] = csv.writer(fh)
            self._writers[role].writerow(self.headers[role])
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def write(self, role: str, columns: Sequence[pa.Array], mask: np.ndarray | None) -> None:
        if mask is not None:
            if not mask.any():
                return
            selected = pa.array(mask)
            columns = [c.filter(selected) for c in columns]
        lists = [pc.fill_null(c, "").to_pylist() for c in columns]
        self._writers[role].writerows(zip(*lists, strict=True))


def split_rows(cfg: RunConfig, source: Path, out_dir: Path) -> dict[str, Path]:
    """New rows to score: the table `source` (the run's columns; the label optional) split
    into one file per role in `out_dir`, every row to every role that has a cell of it. One
    pass, chunk by chunk."""
    roles = [(cfg.active_name, cfg.active_columns)] + [(p.name, p.columns) for p in cfg.parties]
    columns = [c for _, cols in roles for c in cols]
    try:
        has_label = cfg.label in _header_of(Path(source), cfg)
        reader = TableReader(
            Path(source),
            columns=columns + ([cfg.label] if has_label else []),
            id_column=cfg.id_column,
            na=cfg.na_tokens,
            delimiter=cfg.delimiter,
        )
        id_name = _id_column(cfg)
        out = {role: Path(out_dir) / f"{role}.csv" for role, _ in roles}
        headers = {
            role: [id_name, *cols] + ([cfg.label] if role == cfg.active_name and has_label else [])
            for role, cols in roles
        }
        ids = []
        where = str(reader.path)
        with _RoleWriters(out, headers) as writers:
            for chunk in reader.chunks():
                ids.append(chunk_ids(chunk, where=where))
                text = pc.fill_null(chunk_id_text(chunk), "")
                for role, cols in roles:
                    body = [text, *(chunk.cells[c] for c in cols)]
                    if role == cfg.active_name:
                        if has_label:
                            body.append(chunk.cells[cfg.label])
                        writers.write(role, body, None)
                    else:
                        writers.write(role, body, _held_mask(chunk, cols))
        all_ids = np.concatenate(ids) if ids else np.empty(0, np.int64)
        check_unique(all_ids, where=where, texts_at=lambda rows: _texts_at(reader, rows))
    except DataError as exc:
        raise ConfigError("--data", str(exc)) from None
    return out


def _header_of(path: Path, cfg: RunConfig) -> list[str]:
    return TableReader(
        path, columns=[], id_column=ROW_NUMBER_ID, na=cfg.na_tokens, delimiter=cfg.delimiter
    ).header


def stratified(cfg: RunConfig) -> bool:
    """Whether the train/test split is stratified by label: for classification, unless a
    labeled budget empties labels (the active party must redo the split from its file)."""
    return cfg.task != "regression" and cfg.labeled is None


def _labeled_budget(
    cfg: RunConfig,
    blocks: dict[str, np.ndarray],
    labels: np.ndarray,
    present: np.ndarray,
    is_test: np.ndarray,
) -> np.ndarray:
    """With `[missing] labeled`: keep the label of `labeled` training rows only (test rows keep
    theirs), of which `aligned` are drawn among rows every party holds in the source and made
    fully present (`present` is updated in place). Returns the labels to write."""
    if cfg.labeled is None:
        return labels
    from securevfl.data.missing import force_aligned, labeled_rows

    train = ~is_test
    complete = np.stack([~np.all(np.isnan(blocks[p]), axis=1) for p in cfg.party_names], 1)
    try:
        lab, ali = labeled_rows(
            int(train.sum()),
            n_labeled=cfg.labeled,
            n_aligned=cfg.aligned,
            rng=np.random.default_rng([cfg.seed, 0x1ABE1]),
            complete=complete[train].all(axis=1),
        )
    except ValueError as exc:
        raise ConfigError("[missing] labeled", str(exc)) from None
    present[train] = force_aligned(present[train], ali)
    out = labels.copy()
    out[np.flatnonzero(train)[~lab]] = np.nan
    return out


def holdout_mask(
    ids: np.ndarray,
    *,
    test_fraction: float,
    seed: int,
    labels: np.ndarray | None = None,
    stratify: bool = False,
) -> np.ndarray:
    """Which of `ids` (in their order) are test rows: `train_test_split` as a mask."""
    rng = np.random.default_rng([seed, 0x5EED])
    mask = np.zeros(len(ids), dtype=bool)
    if test_fraction <= 0:
        return mask
    groups = (
        [np.arange(len(ids))]
        if not stratify or labels is None
        else [np.flatnonzero(labels == c) for c in np.unique(labels)]
    )
    for g in groups:
        perm = rng.permutation(g)
        n_test = int(round(test_fraction * len(g)))
        mask[perm[:n_test]] = True
    return mask


def train_test_split(
    ids: np.ndarray,
    *,
    test_fraction: float,
    seed: int,
    labels: np.ndarray | None = None,
    stratify: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split of sample ids (stratified by label for classification)."""
    ids = np.asarray(ids, dtype=np.int64)
    mask = holdout_mask(
        ids, test_fraction=test_fraction, seed=seed, labels=labels, stratify=stratify
    )
    return np.sort(ids[~mask]), np.sort(ids[mask])
