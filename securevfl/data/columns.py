"""Real tables at the party that holds them: reading CSV (any delimiter, quoted fields, UTF-8
with or without BOM) or Parquet, identifiers that may be strings, column types (numeric,
boolean, categorical) inferred or configured, and the encodings a party fits on its own
training rows and keeps (`ColumnEncoder`), and the label holder's label codes (`LabelCodec`).

Cells are converted chunk by chunk (`securevfl.data.chunks`) into a compact form
(`CompactConverter`: numbers as float64, categories as int32 codes into the values seen), from
which the encoder fits and encodes: a table read whole and one streamed from disk go through
the same functions, so they encode to the same matrix bit for bit.

Nothing here leaves the party: categories, their counts and scaling statistics stay in the
party's process; methods see the encoded numeric columns only.

A categorical column is encoded one of two ways (`ENCODINGS`, chosen per role and method:
`securevfl.config.categorical_encoding`): ``onehot``, one 0/1 column per training category
plus ``other``; or ``embedding``, one column of integer codes (`CODE_MISSING` for an NA cell,
1..n for the n training categories in sorted order, n + 1 for ``other``) that the party's model
embeds (`securevfl.methods.blocks.embedding`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from securevfl.data.chunks import PY_WHITESPACE, ROW_NUMBER_ID, TableReader, TextChunk
from securevfl.errors import DataError

__all__ = ["ROW_NUMBER_ID"]  # re-exported: the historical home of the constant

KINDS = ("numeric", "boolean", "categorical")
NA_TOKENS = ("", "NA", "N/A", "NaN", "nan", "null", "NULL", "?")
OTHER = "other"  # the bucket of categories unseen in training
ENCODINGS = ("onehot", "embedding")  # how a categorical column reaches the party's model
CODE_MISSING = 0  # embedding codes: an NA cell (stored as NaN, read as 0 once scaled)
CODE_SUFFIX = "#code"  # an embedding code column is named "<column>#code"
_TRUE = ("true", "yes", "y", "t", "1")
_FALSE = ("false", "no", "n", "f", "0")
_BOOL_WORDS = frozenset(_TRUE + _FALSE)
# a canonical non-negative integer identifier (at most 18 digits, no leading zero) is itself
_CANONICAL_ID = r"^(0|[1-9][0-9]{0,17})$"
_ID_PREFIX = b"securevfl/id/v1"  # domain of the SHA-256 of string identifiers


@dataclass
class RawTable:
    """Columns of a file as text (NA cells are None), with the row identifiers."""

    ids: np.ndarray  # int64, one per row (see `row_ids`)
    id_text: np.ndarray  # object: the identifiers as written
    cells: dict[str, np.ndarray]  # column -> object array of str | None
    label: np.ndarray | None = None  # object array of str | None


def row_ids(texts: Sequence[str], *, where: str) -> np.ndarray:
    """int64 sample ids from identifiers as written: a canonical non-negative integer is itself;
    any other string is hashed (SHA-256, negative 63-bit), identically at every party. Refuses
    duplicates and empty identifiers (DataError naming the file)."""
    out = ids_of(pa.array(list(texts), type=pa.string()), where=where)
    check_unique(out, where=where, texts_at=lambda rows: [texts[i] for i in rows])
    return out


def ids_of(texts: pa.Array, *, where: str, first_row: int = 0) -> np.ndarray:
    """`row_ids` of one chunk of identifiers (`first_row`: the chunk's first data row), without
    the uniqueness check (`check_unique`, once every chunk is in). Refuses an empty one."""
    n = len(texts)
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    stripped = pc.utf8_trim(pc.fill_null(texts, ""), characters=PY_WHITESPACE)
    canonical = pc.match_substring_regex(stripped, _CANONICAL_ID).to_numpy(zero_copy_only=False)
    if canonical.any():
        out[canonical] = pc.cast(stripped.filter(pa.array(canonical)), pa.int64()).to_numpy()
    others = np.flatnonzero(~canonical)
    if len(others) == 0:
        return out
    texts_left = stripped.filter(pa.array(~canonical)).to_pylist()
    # empty or (non-ASCII) digit strings go one by one; every other string is hashed in bulk
    special = [k for k, t in enumerate(texts_left) if not t or t.isdigit()]
    for k in special:
        out[others[k]] = _one_id(texts_left[k], where=where, row=first_row + int(others[k]))
    if len(special) < len(texts_left):
        skip = set(special)
        sha = hashlib.sha256
        digests = b"".join(
            sha(_ID_PREFIX + t.encode()).digest()[:8]
            for k, t in enumerate(texts_left)
            if k not in skip
        )
        rest = others if not special else np.delete(others, special)
        top = np.frombuffer(digests, dtype=">u8") >> np.uint64(1)
        out[rest] = -top.astype(np.int64) - 1
    return out


def _one_id(t: str, *, where: str, row: int) -> int:
    if not t:
        raise DataError(f"{where}: row {row + 2} has an empty identifier")
    if t.isdigit() and (t == "0" or not t.startswith("0")) and len(t) < 19:
        return int(t)
    digest = hashlib.sha256(_ID_PREFIX + t.encode()).digest()
    return -(int.from_bytes(digest[:8], "big") >> 1) - 1


def check_unique(ids: np.ndarray, *, where: str, texts_at: Any) -> None:
    """Refuses repeated identifiers (DataError listing up to five as written: `texts_at(rows)`
    gives the texts of row positions of `ids`)."""
    if len(ids) < 2:
        return
    order = np.argsort(ids, kind="stable")
    same = ids[order[1:]] == ids[order[:-1]]
    if not same.any():
        return
    repeated = np.unique(ids[order[1:]][same])
    rows = np.flatnonzero(np.isin(ids, repeated))[:5]
    raise DataError(f"{where}: identifiers must be unique; repeated: {list(texts_at(rows))}")


def chunk_ids(chunk: TextChunk, *, where: str) -> np.ndarray:
    """The int64 sample ids of a chunk: its identifiers, or its 1-based row numbers."""
    if chunk.ids is None:
        return np.arange(chunk.first_row + 1, chunk.first_row + chunk.n_rows + 1, dtype=np.int64)
    return ids_of(chunk.ids, where=where, first_row=chunk.first_row)


def chunk_id_text(chunk: TextChunk) -> pa.Array:
    """The identifiers of a chunk as written (row numbers as text for a table without ids)."""
    if chunk.ids is None:
        return pa.array(
            np.arange(chunk.first_row + 1, chunk.first_row + chunk.n_rows + 1).astype(str),
            type=pa.string(),
        )
    return chunk.ids


def read_table(
    path: Path,
    *,
    columns: Sequence[str],
    id_column: str,
    label: str | None = None,
    na: Sequence[str] = NA_TOKENS,
    delimiter: str | None = None,
) -> RawTable:
    """Read `columns` (and the id and label) of a CSV or Parquet file as text, whole. `id_column`
    may be ``"@row"`` (the line number). Raises DataError naming the file and the first problem.
    (Roles read their files chunk by chunk instead: `securevfl.data.table`.)"""
    wanted = [*columns] + ([label] if label is not None else [])
    reader = TableReader(path, columns=wanted, id_column=id_column, na=na, delimiter=delimiter)
    parts = list(reader.chunks())
    id_text = _objects([chunk_id_text(c) for c in parts])
    where = str(reader.path)
    ids = np.concatenate([chunk_ids(c, where=where) for c in parts]) if parts else _no_ids()
    check_unique(ids, where=where, texts_at=lambda rows: id_text[rows].tolist())
    cells = {c: _objects([p.cells[c] for p in parts]) for c in wanted}
    return RawTable(
        ids=ids,
        id_text=id_text,
        cells={c: cells[c] for c in columns},
        label=cells[label] if label is not None else None,
    )


def _objects(parts: list[pa.Array]) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=object)
    return np.asarray(pa.concat_arrays(parts).to_numpy(zero_copy_only=False), dtype=object)


def _no_ids() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# column types


class KindSniffer:
    """Infers a column's type from its cells, chunk after chunk (`update`), as `infer_kind`
    does from all of them at once: numeric if every non-NA cell is a finite number; boolean if
    every one is a yes/no word or 0/1 (not only 0/1); else categorical."""

    def __init__(self) -> None:
        self.numbers = True
        self.words: set[str] | None = set()  # lower-cased cells; None: not all yes/no words

    def update(self, cells: pa.Array) -> KindSniffer:
        seen = cells.drop_null()
        if len(seen) == 0:
            return self
        if self.numbers:
            self.numbers = _all_numbers(seen)
        if self.words is not None:
            distinct = pc.unique(seen)
            if len(distinct) > 4 * len(_BOOL_WORDS) * 8:  # more spellings than the words have
                self.words = None
            else:
                self.words |= {v.lower() for v in distinct.to_pylist()}
                if not self.words <= _BOOL_WORDS:
                    self.words = None
        return self

    @property
    def kind(self) -> str:
        if self.numbers:
            return "numeric"
        if self.words and not self.words <= {"0", "1"}:
            return "boolean"
        return "categorical"


def infer_kind(values: np.ndarray) -> str:
    """numeric if every non-NA cell is a number; boolean if every one is a yes/no word or 0/1
    with both present or one present; else categorical."""
    return KindSniffer().update(_text(values)).kind


def _text(values: Any) -> pa.Array:
    if isinstance(values, pa.Array):
        return values
    return pa.array(list(values), type=pa.string())


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _distinct(cells: pa.Array) -> tuple[list[str], np.ndarray]:
    """(distinct non-null values, int32 index of each cell into them; -1 for null)."""
    encoded = cells.dictionary_encode()
    codes = pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False)
    return encoded.dictionary.to_pylist(), codes.astype(np.int32, copy=False)


def _all_numbers(cells: pa.Array) -> bool:
    """Every (non-null) cell is a finite number as Python's `float` reads it."""
    try:
        values = pc.cast(cells, pa.float64()).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        values, _ = _distinct(cells)
        return all(_is_number(v) for v in values)
    return bool(np.isfinite(values).all())


def numbers_of(
    cells: pa.Array, *, column: str, where: str, first_row: int = 0, strict: bool = True
) -> np.ndarray:
    """float64 of a text column as Python's `float` reads each cell (null -> NaN). `strict`
    refuses a non-number or a non-finite value, naming the column and the row; otherwise a cell
    that is not a number is NaN (and infinities stay)."""
    try:  # pyarrow reads what `float` reads (a subset of it), to the same double
        values = pc.cast(cells, pa.float64()).to_numpy(zero_copy_only=False)
        status = None
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        distinct, codes = _distinct(cells)
        table = np.full(len(distinct) + 1, np.nan)
        state = np.zeros(len(distinct) + 1, dtype=np.int8)  # 0 ok, 1 not a number
        for k, v in enumerate(distinct):
            try:
                table[k] = float(v)
            except ValueError:
                state[k] = 1
        values = table[codes]
        status = state[codes]
    values = np.asarray(values, dtype=np.float64)
    if not strict:
        return values
    bad = ~np.isfinite(values) & ~np.asarray(pc.is_null(cells).to_numpy(zero_copy_only=False))
    if status is not None:
        bad |= status == 1
    if bad.any():
        i = int(np.argmax(bad))
        v = cells[i].as_py()
        if status is not None and status[i] == 1:
            raise DataError(
                f"{where}: value {v!r} in column {column!r} (row {first_row + i + 2}) is not a "
                "number; declare the column categorical ([parties.NAME] types) or fix the value"
            )
        raise DataError(
            f"{where}: value {v!r} in column {column!r} (row {first_row + i + 2}) is not finite"
        )
    return values


def numeric(values: np.ndarray, *, column: str, where: str) -> np.ndarray:
    """float64 of a numeric column (NA -> NaN); refuses a non-number naming the column and row."""
    return numbers_of(_text(values), column=column, where=where)


def booleans_of(cells: pa.Array, *, column: str, where: str, first_row: int = 0) -> np.ndarray:
    """1.0 for a yes-word, 0.0 for a no-word, NaN for NA; refuses any other value, naming the
    column and the row (`first_row`: the 0-based data row of the chunk's first cell)."""
    distinct, codes = _distinct(cells)
    table = np.full(len(distinct) + 1, np.nan)
    bad = np.zeros(len(distinct) + 1, dtype=bool)
    for k, v in enumerate(distinct):
        low = v.lower()
        if low in _TRUE:
            table[k] = 1.0
        elif low in _FALSE:
            table[k] = 0.0
        else:
            bad[k] = True
    if bad.any():
        i = int(np.argmax(bad[codes]))
        raise DataError(
            f"{where}: value {distinct[codes[i]]!r} in boolean column {column!r} "
            f"(row {first_row + i + 2}); declare the column categorical ([parties.NAME] types) "
            "or fix the value"
        )
    return table[codes]


# ---------------------------------------------------------------------------------------------
# compact cells and the encoder


class CompactConverter:
    """Converts a party's cells, chunk by chunk, to its compact form: numeric and boolean
    columns as float64 (`numbers`, NaN for NA, in `kinds` order), categorical ones as int32
    codes into the values seen so far (`levels`, first seen first; -1 for NA). Refuses a value
    its column's type cannot hold (DataError naming the column)."""

    def __init__(self, kinds: Mapping[str, str]) -> None:
        self.kinds = dict(kinds)
        self.numeric = [c for c, k in self.kinds.items() if k != "categorical"]
        self.categorical = [c for c, k in self.kinds.items() if k == "categorical"]
        self.levels: dict[str, list[str]] = {c: [] for c in self.categorical}
        self._code: dict[str, dict[str, int]] = {c: {} for c in self.categorical}

    def convert(
        self, cells: Mapping[str, pa.Array], n_rows: int, *, where: str, first_row: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        numbers = np.empty((n_rows, len(self.numeric)), dtype=np.float64)
        for j, c in enumerate(self.numeric):
            if self.kinds[c] == "numeric":
                numbers[:, j] = numbers_of(cells[c], column=c, where=where, first_row=first_row)
            else:
                numbers[:, j] = booleans_of(cells[c], column=c, where=where, first_row=first_row)
        codes = np.empty((n_rows, len(self.categorical)), dtype=np.int32)
        for j, c in enumerate(self.categorical):
            distinct, local = _distinct(cells[c])
            code = self._code[c]
            lookup = np.empty(len(distinct) + 1, dtype=np.int32)
            lookup[-1] = -1
            for k, v in enumerate(distinct):
                if v not in code:
                    code[v] = len(self.levels[c])
                    self.levels[c].append(v)
                lookup[k] = code[v]
            codes[:, j] = lookup[local]
        return numbers, codes


class ColumnEncoder:
    """A party's encoding of its columns, fitted on its training rows: numeric as is, boolean
    as 0/1, categorical one-hot over the training categories plus ``other`` for values unseen in
    training (``categorical = "onehot"``), or as one column of codes (``"embedding"``: 1..n for
    the n training categories in sorted order, n + 1 for ``other``). An NA cell is NaN in every
    output column of its input column (a missing cell; an embedding reads it as
    `CODE_MISSING`)."""

    def __init__(self, kinds: Mapping[str, str], *, categorical: str = "onehot") -> None:
        if categorical not in ENCODINGS:
            raise ValueError(
                f"categorical encoding must be one of {ENCODINGS}, got {categorical!r}"
            )
        self.kinds = dict(kinds)
        self.categorical = categorical
        self.categories: dict[str, list[str]] = {}
        self._lookups: dict[str, tuple[int, np.ndarray]] = {}

    @property
    def fitted(self) -> bool:
        return all(c in self.categories for c, k in self.kinds.items() if k == "categorical")

    @property
    def out_columns(self) -> tuple[str, ...]:
        out: list[str] = []
        for c, k in self.kinds.items():
            if k != "categorical":
                out.append(c)
            elif self.categorical == "embedding":
                out.append(f"{c}{CODE_SUFFIX}")
            else:
                out += [f"{c}={v}" for v in self.categories[c]] + [f"{c}={OTHER}"]
        return tuple(out)

    def code_columns(self) -> tuple[tuple[int, str, int], ...]:
        """With ``categorical = "embedding"``: (position among `out_columns`, column, number of
        codes) of each code column; the codes are 0 (`CODE_MISSING`) .. number - 1. Empty for
        one-hot."""
        if self.categorical != "embedding":
            return ()
        found = []
        for j, (c, k) in enumerate(self.kinds.items()):
            if k == "categorical":
                found.append((j, c, len(self.categories[c]) + 2))  # + missing + other
        return tuple(found)

    def fit(self, cells: Mapping[str, np.ndarray]) -> ColumnEncoder:
        """Fit on text cells (object arrays of str | None)."""
        converter = CompactConverter(self.kinds)
        _, codes = converter.convert(_texts(cells), _n_rows(cells), where="fit")
        return self.fit_codes(converter.levels, [codes])

    def fit_codes(
        self, levels: Mapping[str, Sequence[str]], codes: Iterable[np.ndarray]
    ) -> ColumnEncoder:
        """Fit on the compact codes of the training rows (blocks of [rows, categorical])."""
        categorical = [c for c, k in self.kinds.items() if k == "categorical"]
        seen: list[set[int]] = [set() for _ in categorical]
        for block in codes:
            for j in range(len(categorical)):
                seen[j].update(np.unique(block[:, j]).tolist())
        for j, c in enumerate(categorical):
            self.categories[c] = sorted(levels[c][k] for k in seen[j] if k >= 0)
        self._lookups.clear()
        return self

    def transform(self, cells: Mapping[str, np.ndarray], *, where: str) -> np.ndarray:
        """Encode text cells (object arrays of str | None)."""
        converter = CompactConverter(self.kinds)
        numbers, codes = converter.convert(_texts(cells), _n_rows(cells), where=where)
        return self.encode(numbers, codes, converter.levels)

    def encode(
        self, numbers: np.ndarray, codes: np.ndarray, levels: Mapping[str, Sequence[str]]
    ) -> np.ndarray:
        """float64 [rows, out_columns] of compact rows (`CompactConverter` with these kinds)."""
        n = len(numbers)
        blocks = []
        i_num = i_cat = 0
        for c, k in self.kinds.items():
            if k != "categorical":
                blocks.append(numbers[:, i_num : i_num + 1])
                i_num += 1
                continue
            code = codes[:, i_cat]
            i_cat += 1
            held = code >= 0
            if self.categorical == "embedding":
                coded = np.full((n, 1), np.nan)
                # training category j -> j + 1, `other` -> n_categories + 1 (0: a missing cell)
                coded[held, 0] = self._lookup(c, levels[c])[code[held]] + 1.0
                blocks.append(coded)
                continue
            width = len(self.categories[c]) + 1
            onehot = np.zeros((n, width))
            onehot[np.flatnonzero(held), self._lookup(c, levels[c])[code[held]]] = 1.0
            onehot[~held] = np.nan
            blocks.append(onehot)
        return np.concatenate(blocks, axis=1) if blocks else np.empty((n, 0))

    def _lookup(self, column: str, levels: Sequence[str]) -> np.ndarray:
        """Output position of each level: its training category, or `other`."""
        cached = self._lookups.get(column)
        if cached is not None and cached[0] == len(levels):
            return cached[1]
        cats = self.categories[column]
        position = {v: j for j, v in enumerate(cats)}
        lookup = np.array([position.get(v, len(cats)) for v in levels], dtype=np.intp)
        self._lookups[column] = (len(levels), lookup)
        return lookup

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "kinds": dict(self.kinds),
            "categories": {c: list(v) for c, v in self.categories.items()},
        }
        if self.categorical != "onehot":  # a one-hot state reads as it did before embeddings
            state["categorical"] = self.categorical
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kinds = dict(state["kinds"])
        self.categories = {c: list(v) for c, v in state["categories"].items()}
        self.categorical = str(state.get("categorical", "onehot"))
        self._lookups.clear()


def _texts(cells: Mapping[str, Any]) -> dict[str, pa.Array]:
    return {c: _text(v) for c, v in cells.items()}


def _n_rows(cells: Mapping[str, Any]) -> int:
    return len(next(iter(cells.values()))) if cells else 0


class LabelCodec:
    """The label holder's label codes: regression labels as numbers; classification labels
    (numbers or text) as 0..C-1 in sorted order, or, for a binary task with `positive`, that
    value as 1. Empty labels are NaN (a labeled budget)."""

    def __init__(self, task: str, *, positive: str | None = None) -> None:
        self.task = task
        self.positive = positive
        self.classes: list[str] = []

    def encode(self, values: np.ndarray, *, column: str, where: str) -> np.ndarray:
        cells = _text(values)
        if self.task == "regression":
            return numbers_of(cells, column=column, where=where)
        distinct, codes = _distinct(cells)
        return self.encode_levels(distinct, codes, column=column, where=where)

    def encode_levels(
        self, levels: Sequence[str], codes: np.ndarray, *, column: str, where: str
    ) -> np.ndarray:
        """Classification labels from distinct values (`levels`, each present) and per-row
        int32 codes into them (-1 for an empty label)."""
        seen = sorted(set(levels), key=_class_order)
        if self.positive is not None:
            if self.positive not in seen:
                raise DataError(
                    f"{where}: [data] positive {self.positive!r} is not a value of {column!r}; "
                    f"it has {seen[:10]}"
                )
            seen = [v for v in seen if v != self.positive] + [self.positive]
        numeric_labels = all(_is_number(v) for v in seen)
        table = np.full(len(levels) + 1, np.nan)
        if numeric_labels and self.positive is None:
            # numbers keep their meaning (0/1, 0..C-1), as before this codec existed
            table[: len(levels)] = [float(v) for v in levels]
        else:
            self.classes = seen
            code = {v: float(j) for j, v in enumerate(seen)}
            table[: len(levels)] = [code[v] for v in levels]
        return table[np.asarray(codes)]


def _class_order(value: str) -> tuple[int, float | str]:
    return (0, float(value)) if _is_number(value) else (1, value)


def as_csv_text(rows: Sequence[Sequence[str]]) -> str:
    """Rows as CSV text (quoting what needs it)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()
