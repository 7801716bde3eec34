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
from securevfl.errors import DataError


@dataclass
class PartyTable:
    """One role's feature block: rows keyed by integer sample id. NaN marks an empty cell."""

    ids: np.ndarray  # int64, sorted, unique
    columns: tuple[str, ...]
    values: np.ndarray  # float64 [n_rows, n_columns]

    def __post_init__(self) -> None:
        order = np.argsort(self.ids, kind="stable")
        self.ids = np.asarray(self.ids, dtype=np.int64)[order]
        self.values = np.asarray(self.values, dtype=np.float64)[order]
        if len(np.unique(self.ids)) != len(self.ids):
            dup = self.ids[1:][self.ids[1:] == self.ids[:-1]][:5]
            raise DataError(f"sample ids must be unique; repeated ids: {dup.tolist()}")

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
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Read the id column, `columns` (float, empty cell -> NaN) and optionally the label.

    Raises DataError naming the file and the first bad column or value."""
    if not path.exists():
        raise DataError(f"data file {path} does not exist; check [data] path")
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        try:
            header = next(reader)
        except StopIteration:
            raise DataError(f"{path} is empty") from None
        index = {name: i for i, name in enumerate(header)}
        wanted = [id_column, *columns] + ([label] if label is not None else [])
        for name in wanted:
            if name not in index:
                raise DataError(f"{path} has no column {name!r}; its columns are {header[:30]}")
        cols = [index[c] for c in columns]
        ids: list[int] = []
        values: list[list[float]] = []
        labels: list[float] = []
        for line_no, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                ids.append(int(row[index[id_column]]))
            except ValueError:
                raise DataError(
                    f"{path}:{line_no}: id {row[index[id_column]]!r} in column {id_column!r} "
                    "is not an integer (sample ids must be integers)"
                ) from None
            values.append([_cell(row[c], path, line_no, header[c]) for c in cols])
            if label is not None:
                y = _cell(row[index[label]], path, line_no, label)
                if math.isnan(y) and not empty_labels:
                    raise DataError(
                        f"{path}:{line_no}: the label {label!r} is empty (set [missing] "
                        "labeled if some training rows are unlabeled on purpose)"
                    )
                labels.append(y)
    vals = np.asarray(values, dtype=np.float64).reshape(len(ids), len(columns))
    return (
        np.asarray(ids, dtype=np.int64),
        vals,
        np.asarray(labels, dtype=np.float64) if label is not None else None,
    )


def _cell(text: str, path: Path, line_no: int, column: str) -> float:
    text = text.strip()
    if text == "" or text.lower() in ("na", "nan"):
        return math.nan
    try:
        return float(text)
    except ValueError:
        raise DataError(
            f"{path}:{line_no}: value {text!r} in column {column!r} is not a number"
        ) from None


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


def role_data_path(run_dir: Path, role: str) -> Path:
    return run_dir / "data" / f"{role}.csv"


def split_federation(cfg: RunConfig, run_dir: Path) -> dict[str, Path]:
    """Split the config's table into one CSV per role inside `run_dir/data/`.

    A passive party's file has no line for the rows it lacks: rows whose cells of its columns are
    all empty in the source table, or rows the configured missingness generator ([missing])
    removes. Rows that no passive party holds are dropped from every file. Returns role -> file.
    Raises ConfigError naming a missing column."""
    from securevfl.data.missing import presence

    try:
        ids, values, labels = read_csv_columns(
            cfg.data_path,
            id_column=cfg.id_column,
            columns=[*cfg.active_columns, *(c for p in cfg.parties for c in p.columns)],
            label=cfg.label,
        )
    except DataError as exc:
        raise ConfigError("[data] path", str(exc)) from None
    blocks: dict[str, np.ndarray] = {}
    offset = 0
    for role, cols in [(cfg.active_name, cfg.active_columns)] + [
        (p.name, p.columns) for p in cfg.parties
    ]:
        blocks[role] = values[:, offset : offset + len(cols)]
        offset += len(cols)
    present = np.stack([~np.all(np.isnan(blocks[p]), axis=1) for p in cfg.party_names], axis=1)
    _, test_ids = train_test_split(
        ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=labels,
        stratify=stratified(cfg),
    )
    is_test = np.isin(ids, test_ids)
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
    labels = _labeled_budget(cfg, blocks, labels, present, is_test)
    keep = present.any(axis=1)
    out: dict[str, Path] = {}
    for role, block in blocks.items():
        is_active = role == cfg.active_name
        # the active party keeps every row (and so the same train/test split); it learns at
        # set-up which rows each party holds and drops the rows nobody holds
        rows = (
            np.ones(len(ids), dtype=bool)
            if is_active
            else (keep & present[:, cfg.party_names.index(role)])
        )
        path = role_data_path(run_dir, role)
        write_csv(
            path,
            id_column=cfg.id_column,
            ids=ids[rows],
            columns=(cfg.active_columns if is_active else cfg.party(role).columns),
            values=block[rows],
            label=cfg.label if is_active else None,
            labels=labels[rows] if is_active else None,
        )
        out[role] = path
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


def load_party_table(path: Path, cfg: RunConfig, role: str) -> PartyTable:
    """A passive party's own file. A row whose cells are all empty is a row the party lacks."""
    cols = cfg.party(role).columns
    ids, values, _ = read_csv_columns(path, id_column=cfg.id_column, columns=cols)
    held = ~np.all(np.isnan(values), axis=1) if len(cols) else np.ones(len(ids), dtype=bool)
    return PartyTable(ids=ids[held], columns=cols, values=values[held])


def load_active_table(path: Path, cfg: RunConfig) -> ActiveTable:
    ids, values, labels = read_csv_columns(
        path,
        id_column=cfg.id_column,
        columns=cfg.active_columns,
        label=cfg.label,
        empty_labels=cfg.labeled is not None,
    )
    return ActiveTable(ids=ids, columns=cfg.active_columns, values=values, labels=labels)


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
