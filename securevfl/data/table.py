"""Tables keyed by sample id, and the per-party split a real federation starts from.

Each role reads only its own file: `split_federation` writes one CSV per role (the id column plus
that role's columns; the active party's also carries the label) so that the launcher can hand each
process nothing but its own data.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from securevfl.config import ConfigError, RunConfig
from securevfl.data.columns import (
    ROW_NUMBER_ID,
    ColumnEncoder,
    LabelCodec,
    RawTable,
    infer_kind,
    numeric,
    read_table,
)
from securevfl.errors import DataError


@dataclass
class PartyTable:
    """One role's feature block: rows keyed by integer sample id. NaN marks an empty cell.

    A table with non-numeric columns holds them as text (`raw`) with an unfitted
    `ColumnEncoder`; `prepare(train_ids)` fits the encoding on the training rows it holds and
    sets `values` and `columns` to the encoded (numeric) columns. Methods see only those."""

    ids: np.ndarray  # int64, sorted, unique
    columns: tuple[str, ...]
    values: np.ndarray | None  # float64 [n_rows, n_columns]; None until `prepare` (encoded)
    raw: dict[str, np.ndarray] | None = None
    encoder: ColumnEncoder | None = None
    where: str = "table"
    id_text: np.ndarray | None = None  # the identifiers as written (for outputs)

    def __post_init__(self) -> None:
        order = np.argsort(self.ids, kind="stable")
        self.ids = np.asarray(self.ids, dtype=np.int64)[order]
        if self.values is not None:
            self.values = np.asarray(self.values, dtype=np.float64)[order]
        if self.raw is not None:
            self.raw = {c: v[order] for c, v in self.raw.items()}
        if self.id_text is not None:
            self.id_text = np.asarray(self.id_text, dtype=object)[order]
        if len(np.unique(self.ids)) != len(self.ids):
            dup = self.ids[1:][self.ids[1:] == self.ids[:-1]][:5]
            raise DataError(f"sample ids must be unique; repeated ids: {dup.tolist()}")

    def prepare(self, train_ids: np.ndarray) -> None:
        """Fit the encoding of text columns on the training rows this table holds (once)."""
        if self.encoder is None or self.values is not None:
            return
        train = np.asarray(train_ids, dtype=np.int64)
        rows = self.positions(train[self.has(train)])
        self.encoder.fit({c: v[rows] for c, v in self.raw.items()})
        self.values = self.encoder.transform(self.raw, where=self.where)
        self.columns = self.encoder.out_columns

    def use_encoding(self, state: dict | None) -> None:
        """Encode the text columns with a saved encoding (a trained model scoring new rows)."""
        if self.encoder is None or self.values is not None:
            return
        if state is None:
            raise DataError(f"{self.where}: text columns but no saved encoding to score them")
        self.encoder.load_state_dict(state)
        self.values = self.encoder.transform(self.raw, where=self.where)
        self.columns = self.encoder.out_columns

    def texts(self, ids: np.ndarray) -> np.ndarray:
        """The identifiers of `ids` as written in the file."""
        if self.id_text is None:
            return np.asarray(ids).astype(str).astype(object)
        return self.id_text[self.positions(ids)]

    def encoding_state(self) -> dict | None:
        return None if self.encoder is None else self.encoder.state_dict()

    def __len__(self) -> int:
        return len(self.ids)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """Row positions of `ids`; raises DataError naming ids this table does not hold."""
        ids = np.asarray(ids, dtype=np.int64)
        pos = np.searchsorted(self.ids, ids)
        pos = np.minimum(pos, max(len(self.ids) - 1, 0))
        ok = (len(self.ids) > 0) & (self.ids[pos] == ids)
        if not np.all(ok):
            missing = ids[~ok][:5].tolist()
            raise DataError(
                f"{int((~ok).sum())} requested sample ids are not in this table, e.g. {missing}"
            )
        return pos

    def has(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which of `ids` this table holds."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(self.ids) == 0:
            return np.zeros(len(ids), dtype=bool)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return self.ids[pos] == ids

    def rows(self, ids: np.ndarray) -> np.ndarray:
        if self.values is None:
            raise RuntimeError(f"{self.where}: the text columns are encoded at set-up (prepare)")
        return self.values[self.positions(ids)]


@dataclass
class ActiveTable(PartyTable):
    """The active party's table: its own columns (possibly none) and the labels."""

    labels: np.ndarray | None = None  # float64 [n_rows]

    def __post_init__(self) -> None:
        order = np.argsort(self.ids, kind="stable")
        labels = np.asarray(self.labels, dtype=np.float64)
        self.labels = labels[order]
        super().__post_init__()

    def label_rows(self, ids: np.ndarray) -> np.ndarray:
        return self.labels[self.positions(ids)]

    def labeled(self, ids: np.ndarray) -> np.ndarray:
        """Which of `ids` carry a label (a labeled budget leaves the others empty)."""
        return ~np.isnan(self.label_rows(ids))


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
    `LabelCodec`). Raises DataError naming the file and the first bad column or value."""
    raw = read_table(Path(path), columns=columns, id_column=id_column, label=label)
    values = _matrix([numeric(raw.cells[c], column=c, where=str(path)) for c in columns], raw)
    labels = None
    if label is not None:
        labels = LabelCodec(task, positive=positive).encode(
            raw.label, column=label, where=str(path)
        )
        if np.isnan(labels).any() and not empty_labels:
            line = int(np.argmax(np.isnan(labels))) + 2
            raise DataError(
                f"{path}:{line}: the label {label!r} is empty (set [missing] labeled if some "
                "training rows are unlabeled on purpose)"
            )
    return raw.ids, values, labels


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


def split_federation(cfg: RunConfig, run_dir: Path) -> dict[str, Path]:
    """Split the config's table into one CSV per role inside `run_dir/data/`, cells as written
    (text columns stay text: each role encodes its own).

    A passive party's file has no line for the rows it lacks: rows whose cells of its columns are
    all empty (NA) in the source table, or rows the configured missingness generator ([missing])
    removes. Rows that no passive party holds are dropped from every file. Returns role -> file.
    Raises ConfigError naming a missing column."""
    from securevfl.data.missing import presence

    roles = [(cfg.active_name, cfg.active_columns)] + [(p.name, p.columns) for p in cfg.parties]
    try:
        raw = read_table(
            cfg.data_path,
            columns=[c for _, cols in roles for c in cols],
            id_column=cfg.id_column,
            label=cfg.label,
            na=cfg.na_tokens,
            delimiter=cfg.delimiter,
        )
        labels = LabelCodec(cfg.task, positive=cfg.positive).encode(
            raw.label, column=cfg.label, where=str(cfg.data_path)
        )
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    if cfg.labeled is None and np.isnan(labels).any():
        line = int(np.argmax(np.isnan(labels))) + 2
        raise ConfigError(
            "[data] path",
            f"{cfg.data_path}:{line}: the label {cfg.label!r} is empty (drop the row, or set "
            "[missing] labeled if some training rows are unlabeled on purpose)",
        )
    # numbers for the value-dependent missingness generators (text cells count as missing)
    blocks = {role: _numbers(raw, cols) for role, cols in roles}
    present = np.stack([_held(raw, cfg.party(p).columns) for p in cfg.party_names], axis=1)
    _, test_ids = train_test_split(
        raw.ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=labels,
        stratify=stratified(cfg),
    )
    is_test = np.isin(raw.ids, test_ids)
    for split, spec, rows in (
        ("train", cfg.missing_train, ~is_test),
        ("test", cfg.missing_test, is_test),
    ):
        sub = {p: blocks[p][rows] for p in cfg.party_names}
        present[rows] &= presence(
            spec,
            parties=cfg.party_names,
            n_rows=int(rows.sum()),
            seed=cfg.seed,
            split=split,
            features=sub,
        )
    kept_labels = _labeled_budget(cfg, blocks, labels, present, is_test)
    label_text = np.where(np.isnan(kept_labels), None, raw.label)
    keep = present.any(axis=1)
    id_name = ROW_ID_COLUMN if cfg.id_column == ROW_NUMBER_ID else cfg.id_column
    out: dict[str, Path] = {}
    for role, cols in roles:
        is_active = role == cfg.active_name
        # the active party keeps every row (and so the same train/test split); it learns at
        # set-up which rows each party holds and drops the rows nobody holds
        rows = (
            np.ones(len(raw.ids), dtype=bool)
            if is_active
            else (keep & present[:, cfg.party_names.index(role)])
        )
        header = [id_name, *cols] + ([cfg.label] if is_active else [])
        body = [raw.id_text[rows], *(raw.cells[c][rows] for c in cols)]
        if is_active:
            body.append(label_text[rows])
        path = role_data_path(run_dir, role)
        _write_text(path, header, body)
        out[role] = path
    return out


def _matrix(columns: Sequence[np.ndarray], raw: RawTable) -> np.ndarray:
    """The columns side by side, [n_rows, len(columns)] (also with no column)."""
    if not columns:
        return np.empty((len(raw.ids), 0))
    return np.stack(columns, axis=1)


def _numbers(raw: RawTable, columns: Sequence[str]) -> np.ndarray:
    """float64 [n, len(columns)]: each cell as a number, NaN where empty or not a number."""
    out = np.full((len(raw.ids), len(columns)), np.nan)
    for j, c in enumerate(columns):
        for i, v in enumerate(raw.cells[c]):
            if v is not None:
                try:
                    out[i, j] = float(v)
                except ValueError:
                    pass
    return out


def _held(raw: RawTable, columns: Sequence[str]) -> np.ndarray:
    """Rows with at least one non-empty cell among `columns`."""
    if not columns:
        return np.ones(len(raw.ids), dtype=bool)
    return np.any(np.stack([raw.cells[c] != None for c in columns]), axis=0)  # noqa: E711


def _write_text(path: Path, header: Sequence[str], columns: Sequence[np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        for row in zip(*columns, strict=True):
            w.writerow(["" if v is None else v for v in row])


def _load_block(
    path: Path,
    cfg: RunConfig,
    columns: Sequence[str],
    types: Sequence[tuple[str, str]],
    *,
    label: str | None = None,
    saved: dict | None = None,
) -> tuple[RawTable, dict[str, str]]:
    raw = read_table(
        path,
        columns=columns,
        id_column=ROW_ID_COLUMN if cfg.id_column == ROW_NUMBER_ID else cfg.id_column,
        label=label,
        na=cfg.na_tokens,
        delimiter=cfg.delimiter,
    )
    declared = dict(types)
    kinds = {c: declared.get(c) or infer_kind(raw.cells[c]) for c in columns}
    if saved is not None:  # a trained model scoring new rows: the types it was trained with
        kinds = dict(saved["kinds"])
    return raw, kinds


def _table(
    cls: type, raw: RawTable, kinds: dict[str, str], columns: Sequence[str], where: str, **extra
) -> PartyTable:
    if all(k == "numeric" for k in kinds.values()):
        values = _matrix([numeric(raw.cells[c], column=c, where=where) for c in columns], raw)
        return cls(
            ids=raw.ids,
            columns=tuple(columns),
            values=values,
            where=where,
            id_text=raw.id_text,
            **extra,
        )
    for c in columns:  # a bad number is named now, not at set-up
        if kinds[c] == "numeric":
            numeric(raw.cells[c], column=c, where=where)
    return cls(
        ids=raw.ids,
        columns=tuple(columns),
        values=None,
        raw=raw.cells,
        encoder=ColumnEncoder(kinds),
        where=where,
        id_text=raw.id_text,
        **extra,
    )


def split_rows(cfg: RunConfig, source: Path, out_dir: Path) -> dict[str, Path]:
    """New rows to score: the table `source` (the run's columns; the label optional) split
    into one file per role in `out_dir`, every row to every role that has a cell of it."""
    roles = [(cfg.active_name, cfg.active_columns)] + [(p.name, p.columns) for p in cfg.parties]
    with Path(source).open(encoding="utf-8-sig") as fh:
        has_label = cfg.label in fh.readline()
    try:
        raw = read_table(
            Path(source),
            columns=[c for _, cols in roles for c in cols],
            id_column=cfg.id_column,
            label=cfg.label if has_label else None,
            na=cfg.na_tokens,
            delimiter=cfg.delimiter,
        )
    except DataError as exc:
        raise ConfigError("--data", str(exc)) from None
    id_name = ROW_ID_COLUMN if cfg.id_column == ROW_NUMBER_ID else cfg.id_column
    out: dict[str, Path] = {}
    for role, cols in roles:
        is_active = role == cfg.active_name
        rows = np.ones(len(raw.ids), dtype=bool) if is_active else _held(raw, cols)
        header = [id_name, *cols] + ([cfg.label] if is_active and has_label else [])
        body = [raw.id_text[rows], *(raw.cells[c][rows] for c in cols)]
        if is_active and has_label:
            body.append(raw.label[rows])
        out[role] = Path(out_dir) / f"{role}.csv"
        _write_text(out[role], header, body)
    return out


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


def load_party_table(
    path: Path, cfg: RunConfig, role: str, *, encoding: dict | None = None
) -> PartyTable:
    """A passive party's own file. A row whose cells are all empty is a row the party lacks.
    Text columns (inferred, or declared in [parties.NAME] types) are encoded at set-up; with a
    saved `encoding` (scoring new rows), with the types and categories it holds."""
    party = cfg.party(role)
    raw, kinds = _load_block(path, cfg, party.columns, party.types, saved=encoding)
    held = _held(raw, party.columns)
    raw = RawTable(
        ids=raw.ids[held],
        id_text=raw.id_text[held],
        cells={c: v[held] for c, v in raw.cells.items()},
    )
    return _table(PartyTable, raw, kinds, party.columns, f"party {role!r} ({path.name})")


def load_active_table(
    path: Path, cfg: RunConfig, *, encoding: dict | None = None, scoring: bool = False
) -> ActiveTable:
    """The active party's file; `scoring`: rows to score, whose labels may be absent."""
    label = cfg.label
    if scoring:
        with path.open(encoding="utf-8-sig") as fh:
            if cfg.label not in fh.readline():
                label = None
    raw, kinds = _load_block(
        path, cfg, cfg.active_columns, cfg.active_types, label=label, saved=encoding
    )
    where = f"the active party ({path.name})"
    if label is None:
        labels = np.full(len(raw.ids), np.nan)
    else:
        labels = LabelCodec(cfg.task, positive=cfg.positive).encode(
            raw.label, column=cfg.label, where=where
        )
    if np.isnan(labels).any() and cfg.labeled is None and not scoring:
        line = int(np.argmax(np.isnan(labels))) + 2
        raise DataError(
            f"{path}:{line}: the label {cfg.label!r} is empty (set [missing] labeled if some "
            "training rows are unlabeled on purpose)"
        )
    return _table(ActiveTable, raw, kinds, cfg.active_columns, where, labels=labels)


def train_test_split(
    ids: np.ndarray,
    *,
    test_fraction: float,
    seed: int,
    labels: np.ndarray | None = None,
    stratify: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split of sample ids (stratified by label for classification)."""
    rng = np.random.default_rng([seed, 0x5EED])
    ids = np.asarray(ids, dtype=np.int64)
    if test_fraction <= 0:
        return np.sort(ids), np.empty(0, dtype=np.int64)
    test_mask = np.zeros(len(ids), dtype=bool)
    groups = (
        [np.arange(len(ids))]
        if not stratify or labels is None
        else [np.flatnonzero(labels == c) for c in np.unique(labels)]
    )
    for g in groups:
        perm = rng.permutation(g)
        n_test = int(round(test_fraction * len(g)))
        test_mask[perm[:n_test]] = True
    return np.sort(ids[~test_mask]), np.sort(ids[test_mask])
