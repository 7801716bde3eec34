"""Missingness generators: which parties hold which rows, for simulating real federations.

A small registry (`register_missingness`): each generator takes the party names, the row count,
a NumPy generator and (for value-dependent mechanisms) `features`, party -> that party's raw
block for those rows (float, NaN for empty cells), and returns a boolean matrix
`present[row, party]`. The split applies the configured generator separately to training and
test rows; a party then simply does not hold the rows it "lacks" (its file has no line for them).
Rows missing at every party are dropped.

Besides MCAR (`mcar`, `beta`) the registry holds the FALSE-VFL patterns (Sec. 5.1, App. D.3):
MCAR 0/2/5 are `mcar` with p = 0, 0.2, 0.5; `mar1` and `mar2` are the paper's Algorithms 1 and
2; `mnar` is its sign-of-the-mean self-masking (MNAR 7: p = 0.7, MNAR 9: p = 0.9).
`labeled_rows` and `force_aligned` give the paper's labeled budget and its fully aligned subset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from securevfl.config import MissingSpec, register_missing_kind

Generator = Callable[..., np.ndarray]
_REGISTRY: dict[str, Generator] = {}

# the paper's defaults (App. D.3, Alg. 1 and 2; B = 0.5 was used for ModelNet10 only)
MAR1_T, MAR1_DELTA = 1.1, 0.15
MAR2_T, MAR2_B, MAR2_DELTA = 0.5, 0.7, 0.15


def register_missingness(
    kind: str, params: Mapping[str, float | None] | set[str]
) -> Callable[[Generator], Generator]:
    """Register `fn` under `kind`; `params` maps each parameter to its default (None: required),
    or is a set of required names. Config validation learns the parameters from here."""

    def wrap(fn: Generator) -> Generator:
        _REGISTRY[kind] = fn
        register_missing_kind(kind, params)
        return fn

    return wrap


@register_missingness("mcar", {"p": None, "at_least_one": 0.0})
def mcar(
    *,
    parties: Sequence[str],
    n_rows: int,
    rng: np.random.Generator,
    p: float,
    at_least_one: float = 0.0,
    features: Mapping[str, np.ndarray] | None = None,
    **_: object,
) -> np.ndarray:
    """Every block missing independently with probability p (MCAR 0/2/5: p = 0, 0.2, 0.5).

    `at_least_one = 0` (default) leaves rows that lose every block empty, and the split drops
    them. `at_least_one = 1` instead observes one uniformly random party in such rows (among
    the parties whose block of that row is not all-empty, when `features` is given), so every
    row survives, as the paper assumes; the per-block missing rate is then slightly below p.
    Refuses p outside [0, 1] and `at_least_one` other than 0 or 1 (ValueError)."""
    _check_probability(p, "p")
    present = rng.random((n_rows, len(parties))) >= p
    if _flag(at_least_one):
        available = (
            _available(features, parties, n_rows)
            if features is not None
            else np.ones((n_rows, len(parties)), dtype=bool)
        )
        present = _observe_one_if_empty(present & available, available, rng)
    return present


@register_missingness("beta", {"a", "b"})
def beta_rates(
    *,
    parties: Sequence[str],
    n_rows: int,
    rng: np.random.Generator,
    a: float,
    b: float,
    **_: object,
) -> np.ndarray:
    """Per-block missing rate p_k ~ Beta(a, b), then MCAR with p_k (LASER-VFL, App. E)."""
    rates = rng.beta(a, b, size=len(parties))
    return rng.random((n_rows, len(parties))) >= rates[None, :]


# ---------------------------------------------------------------------------------------------
# FALSE-VFL MAR / MNAR (value-dependent: they need `features`)


def piece_stats(
    features: Mapping[str, np.ndarray], parties: Sequence[str], n_rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, variance), each float[n_rows, n_parties], of every piece (one party's block of
    one row) after a per-feature z-score.

    The z-score uses each feature's mean and (population) standard deviation over the rows
    given, ignoring empty cells: the split calls the generators once with the training rows and
    once with the test rows, so each split is normalised by its own statistics. A constant
    feature becomes 0. A piece's mean and (population, ddof = 0) variance are taken across that
    party's normalised features of the row, ignoring empty cells; a piece with no non-empty
    cell has NaN mean and variance (it does not exist). Refuses a missing party or a block
    with the wrong number of rows (ValueError)."""
    means = np.full((n_rows, len(parties)), np.nan)
    variances = np.full((n_rows, len(parties)), np.nan)
    for k, party in enumerate(parties):
        z = _zscore(_block(features, party, n_rows))
        seen = ~np.isnan(z)
        count = seen.sum(axis=1)
        has = count > 0
        filled = np.where(seen, z, 0.0)
        mean = filled.sum(axis=1)[has] / count[has]
        dev = np.where(seen[has], z[has] - mean[:, None], 0.0)
        means[has, k] = mean
        variances[has, k] = (dev * dev).sum(axis=1) / count[has]
    return means, variances


def visit_order(available: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int[n_rows, n_parties]: per row, a uniformly random order of the available pieces
    followed by the unavailable ones (in random order too; the MAR rules never visit them)."""
    keys = rng.random(available.shape) + (~available)  # unavailable sort after every available
    return np.argsort(keys, axis=1, kind="stable")


def mar_type1(
    variances: np.ndarray,
    order: np.ndarray,
    *,
    T: float = MAR1_T,
    delta: float = MAR1_DELTA,
) -> np.ndarray:
    """FALSE-VFL MAR Type 1 (App. D.3, Alg. 1, "stop at the first highly informative piece"),
    on given piece variances (float[n, K], NaN = the piece does not exist) and visit orders
    (int[n, K], a permutation of 0..K-1 per row).

    Per row, the existing pieces are visited in `order` (absent ones skipped) and each visited
    piece is observed. After observing a piece with variance v: if v > T, stop; else
    T <- T - delta and visit the next. The j-th visited piece is compared with T - j*delta,
    computed by repeated subtraction exactly as the pseudo-code does. Unvisited pieces are
    missing. Promises at least one observed piece in every row with an existing piece; a row
    with none stays empty."""
    return _sequential_mar(variances, order, lambda vp, t: _first_true(vp > t), T, delta)


def mar_type2(
    variances: np.ndarray,
    order: np.ndarray,
    *,
    T: float = MAR2_T,
    B: float = MAR2_B,
    delta: float = MAR2_DELTA,
) -> np.ndarray:
    """FALSE-VFL MAR Type 2 (App. D.3, Alg. 2, "accumulate several moderately informative
    pieces"); inputs as in `mar_type1`.

    Per row, the existing pieces are visited in `order` and each visited piece is observed.
    After observing a piece with variance v: if v > T, B <- B - (v - T); then if B <= 0, stop;
    else T <- T - delta and visit the next. T may become negative (after 4 decrements with the
    defaults), after which every piece consumes budget. Promises at least one observed piece in
    every row with an existing piece; a row with none stays empty."""

    def stop(vp: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
        budget = np.full(vp.shape[0], float(B))
        spent = np.zeros(vp.shape, dtype=bool)
        for j in range(vp.shape[1]):  # sequential subtraction, as the pseudo-code rounds
            over = vp[:, j] > thresholds[j]
            budget = np.where(over, budget - (vp[:, j] - thresholds[j]), budget)
            spent[:, j] = budget <= 0
        return _first_true(spent)

    return _sequential_mar(variances, order, stop, T, delta)


def mnar_sign(means: np.ndarray, rng: np.random.Generator, *, p: float) -> np.ndarray:
    """FALSE-VFL MNAR self-masking (Sec. 5.1) on given piece means (float[n, K], NaN = the
    piece does not exist): a piece with mean < 0 is dropped with probability p, any other
    with probability 1 - p, independently. Absent pieces are never observed. Rows may come out
    empty (see the `mnar` generator). Refuses p outside [0, 1] (ValueError)."""
    _check_probability(p, "p")
    drop = np.where(means < 0, p, 1.0 - p)
    return (rng.random(means.shape) >= drop) & ~np.isnan(means)


@register_missingness("mar1", {"T": MAR1_T, "delta": MAR1_DELTA})
def mar1(
    *,
    parties: Sequence[str],
    n_rows: int,
    rng: np.random.Generator,
    features: Mapping[str, np.ndarray] | None = None,
    T: float = MAR1_T,
    delta: float = MAR1_DELTA,
    **_: object,
) -> np.ndarray:
    """MAR 1 (`mar_type1`) on the z-scored pieces of `features` (see `piece_stats`: variance
    across the party's normalised features of the row, statistics from the rows given, i.e.
    the training and the test rows separately). Visit order uniformly random per row. Pieces
    that are all-empty in the source are never observed and never visited; every row with at
    least one non-empty piece observes at least one. Refuses `features=None` (ValueError)."""
    _, variances = piece_stats(_need(features, "mar1"), parties, n_rows)
    order = visit_order(~np.isnan(variances), rng)
    return mar_type1(variances, order, T=T, delta=delta)


@register_missingness("mar2", {"T": MAR2_T, "B": MAR2_B, "delta": MAR2_DELTA})
def mar2(
    *,
    parties: Sequence[str],
    n_rows: int,
    rng: np.random.Generator,
    features: Mapping[str, np.ndarray] | None = None,
    T: float = MAR2_T,
    B: float = MAR2_B,
    delta: float = MAR2_DELTA,
    **_: object,
) -> np.ndarray:
    """MAR 2 (`mar_type2`) on the z-scored pieces of `features`; normalisation, visit order
    and empty pieces as in `mar1`. Refuses `features=None` (ValueError)."""
    _, variances = piece_stats(_need(features, "mar2"), parties, n_rows)
    order = visit_order(~np.isnan(variances), rng)
    return mar_type2(variances, order, T=T, B=B, delta=delta)


@register_missingness("mnar", {"p": None, "at_least_one": 1.0})
def mnar(
    *,
    parties: Sequence[str],
    n_rows: int,
    rng: np.random.Generator,
    p: float,
    features: Mapping[str, np.ndarray] | None = None,
    at_least_one: float = 1.0,
    **_: object,
) -> np.ndarray:
    """MNAR (`mnar_sign`) on the z-scored piece means of `features` (normalisation as in
    `mar1`; empty cells ignored in the mean; all-empty pieces never observed).

    The paper assumes no row is missing at every party but does not say how it avoids them.
    With `at_least_one = 1` (default) a row the draw leaves empty observes one uniformly random
    party among those whose piece exists (a value-independent rescue, so it is not drawn by the
    MNAR rule); `at_least_one = 0` leaves it empty and the split drops the row. Refuses
    `features=None`, p outside [0, 1] and `at_least_one` other than 0 or 1 (ValueError)."""
    means, _ = piece_stats(_need(features, "mnar"), parties, n_rows)
    present = mnar_sign(means, rng, p=p)
    if _flag(at_least_one):
        present = _observe_one_if_empty(present, ~np.isnan(means), rng)
    return present


# ---------------------------------------------------------------------------------------------
# labeled budget and the fully aligned labeled subset (FALSE-VFL Sec. 5 "Setup")


def labeled_rows(
    n_rows: int,
    *,
    n_labeled: int,
    n_aligned: int,
    rng: np.random.Generator,
    complete: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(labeled, aligned), each bool[n_rows]: exactly `n_labeled` training rows keep their
    label and exactly `n_aligned` of them are reserved fully aligned (the paper: 500 labeled,
    100 aligned for tabular data; 1,000 and 200 for images). Every other training row is
    unlabeled; every row but the aligned ones gets the training mechanism's mask.

    The aligned rows are a uniform draw among the `complete` rows (default: all rows; pass the
    rows whose every piece exists in the source, since an empty piece cannot be aligned), and
    the other labeled rows a uniform draw from the rest; with `complete=None` this is the same
    as drawing the labeled rows uniformly and then the aligned ones uniformly among them.
    Deterministic for the state of `rng`. Refuses negative counts, n_aligned > n_labeled,
    n_labeled > n_rows, fewer complete rows than n_aligned and a `complete` of the wrong shape
    (ValueError)."""
    if isinstance(n_rows, bool) or isinstance(n_labeled, bool) or isinstance(n_aligned, bool):
        raise ValueError("row counts must be integers")
    n_rows, n_labeled, n_aligned = int(n_rows), int(n_labeled), int(n_aligned)
    if min(n_rows, n_labeled, n_aligned) < 0:
        raise ValueError(f"counts must be >= 0, got {n_rows=}, {n_labeled=}, {n_aligned=}")
    if n_aligned > n_labeled:
        raise ValueError(f"n_aligned ({n_aligned}) exceeds n_labeled ({n_labeled})")
    if n_labeled > n_rows:
        raise ValueError(f"n_labeled ({n_labeled}) exceeds the {n_rows} training rows")
    eligible = np.ones(n_rows, dtype=bool) if complete is None else np.asarray(complete, bool)
    if eligible.shape != (n_rows,):
        raise ValueError(f"complete must have shape ({n_rows},), got {eligible.shape}")
    candidates = np.flatnonzero(eligible)
    if len(candidates) < n_aligned:
        raise ValueError(f"only {len(candidates)} complete rows for {n_aligned} aligned rows")
    aligned = np.zeros(n_rows, dtype=bool)
    aligned[rng.choice(candidates, size=n_aligned, replace=False)] = True
    rest = np.flatnonzero(~aligned)
    labeled = aligned.copy()
    labeled[rng.choice(rest, size=n_labeled - n_aligned, replace=False)] = True
    return labeled, aligned


def force_aligned(present: np.ndarray, aligned: np.ndarray) -> np.ndarray:
    """A copy of `present` (bool[n, K]) with every `aligned` row (bool[n]) fully present; the
    other rows are unchanged. Refuses mismatched shapes (ValueError)."""
    present = np.array(present, dtype=bool, copy=True)
    aligned = np.asarray(aligned, dtype=bool)
    if present.ndim != 2 or aligned.shape != (present.shape[0],):
        raise ValueError(f"present {present.shape} and aligned {aligned.shape} do not match")
    present[aligned] = True
    return present


# ---------------------------------------------------------------------------------------------


def presence(
    spec: MissingSpec,
    *,
    parties: Sequence[str],
    n_rows: int,
    seed: int,
    split: str,
    features: Mapping[str, np.ndarray] | None = None,
) -> np.ndarray:
    """`present[row, party]` for `n_rows` rows; all True when spec.kind == "none"."""
    if spec.kind == "none":
        return np.ones((n_rows, len(parties)), dtype=bool)
    rng = np.random.default_rng([seed, 0x3155, 0 if split == "train" else 1])
    fn = _REGISTRY[spec.kind]
    return np.asarray(
        fn(parties=parties, n_rows=n_rows, rng=rng, features=features, **dict(spec.params)),
        dtype=bool,
    )


def kinds() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


# ---------------------------------------------------------------------------------------------
# helpers


def _sequential_mar(
    variances: np.ndarray,
    order: np.ndarray,
    stop: Callable[[np.ndarray, np.ndarray], np.ndarray],
    T: float,
    delta: float,
) -> np.ndarray:
    """Shared frame of Alg. 1 and 2: `stop(vp, thresholds)` gives, per row, the first visit
    position (into the existing pieces in visit order) after which the procedure stops, or -1
    for "never"; positions up to it are observed."""
    variances = np.asarray(variances, dtype=float)
    order = np.asarray(order)
    n, k = variances.shape
    if order.shape != (n, k) or not (np.sort(order, axis=1) == np.arange(k)).all():
        raise ValueError("order must hold one permutation of the pieces per row")
    exists = ~np.isnan(variances)
    # existing pieces first, keeping the given order among them (absent pieces are skipped)
    ranked = np.take_along_axis(
        order, np.argsort(~np.take_along_axis(exists, order, 1), 1, kind="stable"), 1
    )
    vp = np.take_along_axis(variances, ranked, axis=1)
    n_exist = exists.sum(axis=1)
    thresholds = np.empty(k)
    t = float(T)
    for j in range(k):  # repeated subtraction, as Alg. 1/2 lower T
        thresholds[j] = t
        t -= delta
    position = np.arange(k)[None, :]
    vp = np.where(position < n_exist[:, None], vp, -np.inf)  # absent pieces never trigger stop
    last = stop(vp, thresholds)
    last = np.where(last < 0, n_exist - 1, np.minimum(last, n_exist - 1))
    visited = position <= last[:, None]
    present = np.zeros((n, k), dtype=bool)
    np.put_along_axis(present, ranked, visited, axis=1)
    return present


def _first_true(mask: np.ndarray) -> np.ndarray:
    """Per row, the index of the first True, or -1."""
    return np.where(mask.any(axis=1), mask.argmax(axis=1), -1)


def _observe_one_if_empty(
    present: np.ndarray, available: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Rows of `present` with no observed block get one uniformly random `available` block."""
    keys = np.where(available, rng.random(available.shape), -1.0)
    pick = keys.argmax(axis=1)
    rescue = ~present.any(axis=1) & available.any(axis=1)
    present = present.copy()
    present[np.flatnonzero(rescue), pick[rescue]] = True
    return present


def _zscore(block: np.ndarray) -> np.ndarray:
    """Per-feature z-score over the rows given, ignoring NaN; constant features become 0."""
    seen = ~np.isnan(block)
    count = seen.sum(axis=0)
    safe = np.maximum(count, 1)
    filled = np.where(seen, block, 0.0)
    mean = filled.sum(axis=0) / safe
    dev = np.where(seen, block - mean, 0.0)
    std = np.sqrt((dev * dev).sum(axis=0) / safe)
    # a constant feature carries no information: 0 rather than 0/0
    return np.where(seen, dev / np.where(std > 0, std, 1.0), np.nan)


def _block(features: Mapping[str, np.ndarray], party: str, n_rows: int) -> np.ndarray:
    if party not in features:
        raise ValueError(f"features has no block for party {party!r}")
    block = np.asarray(features[party], dtype=float)
    if block.ndim == 1:
        block = block[:, None]
    if block.ndim != 2 or block.shape[0] != n_rows:
        raise ValueError(f"party {party!r}: expected {n_rows} rows, got shape {block.shape}")
    return block


def _available(
    features: Mapping[str, np.ndarray], parties: Sequence[str], n_rows: int
) -> np.ndarray:
    """bool[n_rows, n_parties]: the piece has at least one non-empty cell."""
    return np.stack(
        [(~np.isnan(_block(features, p, n_rows))).any(axis=1) for p in parties], axis=1
    ).reshape(n_rows, len(parties))


def _need(features: Mapping[str, np.ndarray] | None, kind: str) -> Mapping[str, np.ndarray]:
    if features is None:
        raise ValueError(f"missingness kind {kind!r} depends on the values: pass features=")
    return features


def _check_probability(p: float, name: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {p}")


def _flag(value: float) -> bool:
    if value not in (0, 1):
        raise ValueError(f"at_least_one must be 0 or 1, got {value}")
    return bool(value)
