"""Real tables at the party that holds them: reading CSV (any delimiter, quoted fields, UTF-8
with or without BOM) or Parquet, identifiers that may be strings, column types (numeric,
boolean, categorical) inferred or configured, and the encodings a party fits on its own
training rows and keeps (`ColumnEncoder`), and the label holder's label codes (`LabelCodec`).

Nothing here leaves the party: categories, their counts and scaling statistics stay in the
party's process; methods see the encoded numeric columns only.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.errors import DataError

KINDS = ("numeric", "boolean", "categorical")
NA_TOKENS = ("", "NA", "N/A", "NaN", "nan", "null", "NULL", "?")
ROW_NUMBER_ID = "@row"  # [data] id for tables without an id column: the 1-based line number
OTHER = "other"  # the bucket of categories unseen in training
_TRUE = ("true", "yes", "y", "t", "1")
_FALSE = ("false", "no", "n", "f", "0")


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
    out = np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        t = text.strip()
        if not t:
            raise DataError(f"{where}: row {i + 2} has an empty identifier")
        if t.isdigit() and (t == "0" or not t.startswith("0")) and len(t) < 19:
            out[i] = int(t)
        else:
            digest = hashlib.sha256(b"securevfl/id/v1" + t.encode()).digest()
            out[i] = -(int.from_bytes(digest[:8], "big") >> 1) - 1
    if len(np.unique(out)) != len(out):
        uniq, counts = np.unique(out, return_counts=True)
        dup = [texts[i] for i in np.flatnonzero(np.isin(out, uniq[counts > 1]))[:5]]
        raise DataError(f"{where}: identifiers must be unique; repeated: {dup}")
    return out


def read_table(
    path: Path,
    *,
    columns: Sequence[str],
    id_column: str,
    label: str | None = None,
    na: Sequence[str] = NA_TOKENS,
    delimiter: str | None = None,
) -> RawTable:
    """Read `columns` (and the id and label) of a CSV or Parquet file as text. `id_column` may
    be ``"@row"`` (the line number). Raises DataError naming the file and the first problem."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist; check [data] path")
    wanted = [*columns] + ([label] if label is not None else [])
    if path.suffix.lower() in (".parquet", ".pq"):
        header, data = _read_parquet(path, [id_column, *wanted])
    else:
        header, data = _read_csv(path, delimiter)
    index = {name: i for i, name in enumerate(header)}
    # "@row": the line number, unless the file carries it (a per-role file of such a table)
    by_line = id_column == ROW_NUMBER_ID and id_column not in index
    if not by_line:
        wanted = [id_column, *wanted]
    for name in wanted:
        if name not in index:
            raise DataError(f"{path} has no column {name!r}; its columns are {header[:30]}")
    na_set = set(na)

    def column(name: str) -> np.ndarray:
        j = index[name]
        return np.array(
            [None if (j >= len(r) or r[j].strip() in na_set) else r[j].strip() for r in data],
            dtype=object,
        )

    id_text = (
        np.array([str(i + 1) for i in range(len(data))], dtype=object)
        if by_line
        else np.array(
            [r[index[id_column]] if index[id_column] < len(r) else "" for r in data], dtype=object
        )
    )
    return RawTable(
        ids=row_ids(list(id_text), where=str(path)),
        id_text=id_text,
        cells={c: column(c) for c in columns},
        label=column(label) if label is not None else None,
    )


def _read_csv(path: Path, delimiter: str | None) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="", encoding="utf-8-sig") as fh:  # a BOM is dropped
        head = fh.read(64 * 1024)
        fh.seek(0)
        if delimiter is None:
            try:
                delimiter = csv.Sniffer().sniff(head.split("\n", 1)[0], ",;\t|").delimiter
            except csv.Error:
                delimiter = ","
        reader = csv.reader(fh, delimiter=delimiter)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise DataError(f"{path} is empty") from None
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from None
        try:
            rows = [r for r in reader if r]
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text ({exc.reason})") from None
    return header, rows


def _read_parquet(path: Path, wanted: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(path)
    header = list(table.column_names)
    present = [c for c in wanted if c in header]
    cols = [table.column(c).to_pylist() for c in present]
    rows = [["" if v is None else str(v) for v in values] for values in zip(*cols, strict=True)]
    return present, rows


def infer_kind(values: np.ndarray) -> str:
    """numeric if every non-NA cell is a number; boolean if every one is a yes/no word or 0/1
    with both present or one present; else categorical."""
    seen = [v for v in values if v is not None]
    if all(_is_number(v) for v in seen):
        return "numeric"
    words = {v.lower() for v in seen}
    if words and words <= set(_TRUE) | set(_FALSE) and not words <= {"0", "1"}:
        return "boolean"
    return "categorical"


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def numeric(values: np.ndarray, *, column: str, where: str) -> np.ndarray:
    """float64 of a numeric column (NA -> NaN); refuses a non-number naming the column and row."""
    out = np.full(len(values), np.nan)
    for i, v in enumerate(values):
        if v is None:
            continue
        try:
            out[i] = float(v)
        except ValueError:
            raise DataError(
                f"{where}: value {v!r} in column {column!r} (row {i + 2}) is not a number; "
                "declare the column categorical ([parties.NAME] types) or fix the value"
            ) from None
        if not math.isfinite(out[i]):
            raise DataError(f"{where}: value {v!r} in column {column!r} is not finite")
    return out


class ColumnEncoder:
    """A party's encoding of its columns, fitted on its training rows: numeric as is, boolean
    as 0/1, categorical one-hot over the training categories plus ``other`` for values unseen in
    training. An NA cell is NaN in every output column of its input column (a missing cell)."""

    def __init__(self, kinds: Mapping[str, str]) -> None:
        self.kinds = dict(kinds)
        self.categories: dict[str, list[str]] = {}

    @property
    def fitted(self) -> bool:
        return all(c in self.categories for c, k in self.kinds.items() if k == "categorical")

    @property
    def out_columns(self) -> tuple[str, ...]:
        out: list[str] = []
        for c, k in self.kinds.items():
            if k == "categorical":
                out += [f"{c}={v}" for v in self.categories[c]] + [f"{c}={OTHER}"]
            else:
                out.append(c)
        return tuple(out)

    def fit(self, cells: Mapping[str, np.ndarray]) -> ColumnEncoder:
        for c, k in self.kinds.items():
            if k == "categorical":
                self.categories[c] = sorted({v for v in cells[c] if v is not None})
        return self

    def transform(self, cells: Mapping[str, np.ndarray], *, where: str) -> np.ndarray:
        n = len(next(iter(cells.values()))) if cells else 0
        blocks = []
        for c, k in self.kinds.items():
            values = cells[c]
            if k == "numeric":
                blocks.append(numeric(values, column=c, where=where)[:, None])
            elif k == "boolean":
                low = np.array([None if v is None else v.lower() for v in values], dtype=object)
                col = np.where(
                    np.isin(low, _TRUE), 1.0, np.where(np.isin(low, _FALSE), 0.0, np.nan)
                )
                bad = [v for v, x in zip(values, col, strict=True) if v is not None and np.isnan(x)]
                if bad:
                    raise DataError(f"{where}: value {bad[0]!r} in boolean column {c!r}")
                blocks.append(col[:, None])
            else:
                cats = self.categories[c]
                position = {v: j for j, v in enumerate(cats)}
                onehot = np.zeros((n, len(cats) + 1))
                for i, v in enumerate(values):
                    if v is None:
                        onehot[i] = np.nan
                    else:
                        onehot[i, position.get(v, len(cats))] = 1.0
                blocks.append(onehot)
        return np.concatenate(blocks, axis=1) if blocks else np.empty((n, 0))

    def state_dict(self) -> dict[str, Any]:
        return {
            "kinds": dict(self.kinds),
            "categories": {c: list(v) for c, v in self.categories.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.kinds = dict(state["kinds"])
        self.categories = {c: list(v) for c, v in state["categories"].items()}


class LabelCodec:
    """The label holder's label codes: regression labels as numbers; classification labels
    (numbers or text) as 0..C-1 in sorted order, or, for a binary task with `positive`, that
    value as 1. Empty labels are NaN (a labeled budget)."""

    def __init__(self, task: str, *, positive: str | None = None) -> None:
        self.task = task
        self.positive = positive
        self.classes: list[str] = []

    def encode(self, values: np.ndarray, *, column: str, where: str) -> np.ndarray:
        if self.task == "regression":
            return numeric(values, column=column, where=where)
        seen = sorted({v for v in values if v is not None}, key=_class_order)
        if self.positive is not None:
            if self.positive not in seen:
                raise DataError(
                    f"{where}: [data] positive {self.positive!r} is not a value of {column!r}; "
                    f"it has {seen[:10]}"
                )
            seen = [v for v in seen if v != self.positive] + [self.positive]
        numeric_labels = all(_is_number(v) for v in seen)
        if numeric_labels and self.positive is None:
            # numbers keep their meaning (0/1, 0..C-1), as before this codec existed
            return numeric(values, column=column, where=where)
        self.classes = seen
        code = {v: float(j) for j, v in enumerate(seen)}
        return np.array([np.nan if v is None else code[v] for v in values])


def _class_order(value: str) -> tuple[int, float | str]:
    return (0, float(value)) if _is_number(value) else (1, value)


def as_csv_text(rows: Sequence[Sequence[str]]) -> str:
    """Rows as CSV text (quoting what needs it)."""
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    return buf.getvalue()
