"""Synthetic vertically partitioned tables whose label needs features from two guests.

:func:`cross_guest_xor` builds the stress test of spec tabvfl.md section 8.1: ``y = 1[a * b > 0]``
with ``a`` a numeric column of guest 0 and ``b`` one of guest 1, so no function of one guest's
columns alone (and no sum of such functions, i.e. no linear head over concatenated local
latents) predicts y better than chance, while a model over the joint columns can. Every guest
also holds noise numerics and one-hot categorical columns. Pandas-free: numpy arrays, column
names, and which guest holds which column; deterministic for a seed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.special import ndtri


@dataclass(frozen=True)
class SyntheticTable:
    """A table already encoded for TabNet: numerics standard normal, categoricals one-hot.

    ``x`` (N, D) float32 in column order; ``y`` (N,) int64 labels 0..C-1; ``columns`` the D
    column names; ``owner[j]`` the guest holding column j (contiguous blocks, guest 0 first);
    ``feature_of[j]`` the original feature of column j (the one-hot columns of a categorical
    share it, and never straddle guests); ``informative`` the columns the label is built from.
    """

    x: np.ndarray
    y: np.ndarray
    columns: tuple[str, ...]
    owner: tuple[int, ...]
    feature_of: tuple[str, ...]
    n_guests: int
    informative: tuple[str, ...]

    @property
    def n_classes(self) -> int:
        return int(self.y.max()) + 1

    def guest_columns(self, k: int) -> np.ndarray:
        """Column indices held by guest k; refuses k outside 0..n_guests-1."""
        if not 0 <= k < self.n_guests:
            raise ValueError(f"guest {k} not in 0..{self.n_guests - 1}")
        return np.flatnonzero(np.asarray(self.owner) == k)

    @property
    def guest_dims(self) -> tuple[int, ...]:
        return tuple(len(self.guest_columns(k)) for k in range(self.n_guests))

    def guest_blocks(self, rows: np.ndarray | slice | None = None) -> list[np.ndarray]:
        """Each guest's (rows x d_k) block, row-aligned, in guest order."""
        sel = slice(None) if rows is None else rows
        return [self.x[sel][:, self.guest_columns(k)] for k in range(self.n_guests)]

    def features(self, k: int) -> list[str]:
        """The original features guest k holds (a categorical once, not its one-hot columns),
        in column order; refuses k outside 0..n_guests-1."""
        return list(dict.fromkeys(self.feature_of[j] for j in self.guest_columns(k)))

    def write_csv(self, path: Path, *, id_column: str = "ID", label: str = "Y") -> Path:
        """The table as a raw CSV file, as a data owner would hold it: ids 1..N, numerics as
        numbers, each categorical as one text column (level ``c<j>`` of its ``feature=j``
        one-hot column), the label as 0/1.. integers. A party's one-hot encoding of that file
        gives back this table's columns (plus the encoder's column for unseen levels)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        features = list(dict.fromkeys(self.feature_of))
        cells: dict[str, list[str]] = {}
        for feature in features:
            cols = [j for j, f in enumerate(self.feature_of) if f == feature]
            if len(cols) == 1 and self.columns[cols[0]] == feature:
                cells[feature] = [repr(float(v)) for v in self.x[:, cols[0]]]
            else:
                levels = [self.columns[j].split("=", 1)[1] for j in cols]
                which = self.x[:, cols].argmax(axis=1)
                cells[feature] = [f"c{levels[i]}" for i in which]
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow([id_column, *features, label])
            for i in range(len(self.y)):
                w.writerow([i + 1, *(cells[f][i] for f in features), int(self.y[i])])
        return path


def cross_guest_xor(
    n_rows: int,
    *,
    seed: int,
    n_guests: int = 2,
    numeric_per_guest: int = 3,
    categorical_per_guest: int = 1,
    n_categories: int = 3,
    label_noise: float = 0.0,
) -> SyntheticTable:
    """Guest g holds numerics ``g{g}_num{i}`` ~ N(0, 1) and categoricals ``g{g}_cat{j}`` one-hot
    over `n_categories` levels (``g{g}_cat{j}=c``). The label is ``1[g0_num0 * g1_num0 > 0]``,
    flipped with probability `label_noise`. ``g0_cat0`` and ``g1_cat0`` bin ``|g0_num0|`` and
    ``|g1_num0|`` (magnitude only: correlated with the informative columns but carrying no sign,
    so they do not let one guest predict y); other categoricals are uniform noise.

    Refuses ``n_guests < 2``, ``numeric_per_guest < 1``, ``n_categories < 2``, ``n_rows < 2``
    and `label_noise` outside [0, 0.5).
    """
    if n_guests < 2:
        raise ValueError("the label needs two guests: n_guests must be >= 2")
    if numeric_per_guest < 1:
        raise ValueError("numeric_per_guest must be >= 1")
    if categorical_per_guest < 0:
        raise ValueError("categorical_per_guest must be >= 0")
    if n_categories < 2:
        raise ValueError("n_categories must be >= 2")
    if n_rows < 2:
        raise ValueError("n_rows must be >= 2")
    if not 0.0 <= label_noise < 0.5:
        raise ValueError("label_noise must be in [0, 0.5)")
    rng = np.random.default_rng([seed, 0x7AB7F1])
    numerics = rng.standard_normal((n_guests, n_rows, numeric_per_guest))
    # magnitude bins at the quantiles of |N(0,1)|, so the levels are balanced
    edges = ndtri((1.0 + np.arange(1, n_categories) / n_categories) / 2.0)
    cols: list[np.ndarray] = []
    names: list[str] = []
    owner: list[int] = []
    feature_of: list[str] = []
    for g in range(n_guests):
        for i in range(numeric_per_guest):
            name = f"g{g}_num{i}"
            cols.append(numerics[g, :, i])
            names.append(name)
            owner.append(g)
            feature_of.append(name)
        for j in range(categorical_per_guest):
            feature = f"g{g}_cat{j}"
            if j == 0 and g < 2:
                level = np.digitize(np.abs(numerics[g, :, 0]), edges)
            else:
                level = rng.integers(0, n_categories, size=n_rows)
            for c in range(n_categories):
                cols.append((level == c).astype(np.float64))
                names.append(f"{feature}={c}")
                owner.append(g)
                feature_of.append(feature)
    y = (numerics[0, :, 0] * numerics[1, :, 0] > 0).astype(np.int64)
    flip = rng.random(n_rows) < label_noise
    y = np.where(flip, 1 - y, y)
    return SyntheticTable(
        x=np.stack(cols, axis=1).astype(np.float32),
        y=y,
        columns=tuple(names),
        owner=tuple(owner),
        feature_of=tuple(feature_of),
        n_guests=n_guests,
        informative=("g0_num0", "g1_num0"),
    )


def stratified_split(
    y: np.ndarray, fractions: tuple[float, ...], *, seed: int
) -> tuple[np.ndarray, ...]:
    """Row indices of a stratified split into parts of the given fractions (summing to 1),
    each sorted ascending (so guests iterate them in the same fixed order); deterministic for
    a seed. Refuses fractions that are not positive or do not sum to 1."""
    fr = np.asarray(fractions, dtype=np.float64)
    if np.any(fr <= 0) or not np.isclose(fr.sum(), 1.0):
        raise ValueError(f"fractions must be positive and sum to 1, got {fractions}")
    rng = np.random.default_rng([seed, 0x5B117])
    parts: list[list[np.ndarray]] = [[] for _ in fr]
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        cuts = np.round(np.cumsum(fr)[:-1] * len(idx)).astype(int)
        for p, chunk in enumerate(np.split(idx, cuts)):
            parts[p].append(chunk)
    return tuple(np.sort(np.concatenate(p)) for p in parts)


# VFEM's simulated design (shared/methods/vfem.md §7.2, `securevfl example vfem-simulated`):
# three parties of (3, 2, 2) columns, x^k ~ N(0, AR1(0.5)) independent across parties,
# y = 0.5 + x'beta + N(0, 1), each party lacking 20 %, 40 %, 60 % of the rows.
VFEM_DIMS = (3, 2, 2)
VFEM_BETA = np.array([1.0, -0.5, 0.8, 1.0, 0.5, -1.0, 0.6])
VFEM_MISSING = (0.2, 0.4, 0.6)


def vfem_simulated(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x with empty (NaN) cells where a party lacks the row, y)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for p in VFEM_DIMS:
        cov = 0.5 ** np.abs(np.subtract.outer(np.arange(p), np.arange(p)))
        blocks.append(rng.multivariate_normal(np.zeros(p), cov, size=n))
    x = np.concatenate(blocks, axis=1)
    y = 0.5 + x @ VFEM_BETA + rng.normal(size=n)
    start = 0
    for p, rate in zip(VFEM_DIMS, VFEM_MISSING, strict=True):
        x[rng.random(n) < rate, start : start + p] = np.nan
        start += p
    return x, y


def write_vfem_simulated_csv(path: Path, n: int = 2000, seed: int = 0) -> None:
    """Write the simulated table (ID, X1..X7 with empty cells, Y) of `vfem_simulated.toml`."""
    from securevfl.data.table import write_csv

    x, y = vfem_simulated(n, seed)
    write_csv(
        path,
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=[f"X{i + 1}" for i in range(x.shape[1])],
        values=x,
        label="Y",
        labels=y,
    )
