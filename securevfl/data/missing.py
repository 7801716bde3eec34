"""Missingness generators: which parties hold which rows, for simulating real federations.

A small registry (`register_missingness`): each generator takes the party names, the row count
and a NumPy generator and returns a boolean matrix `present[row, party]`. The split applies the
configured generator separately to training and test rows; a party then simply does not hold the
rows it "lacks" (its file has no line for them). Rows missing at every party are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from securevfl.config import MissingSpec, register_missing_kind

Generator = Callable[..., np.ndarray]
_REGISTRY: dict[str, Generator] = {}


def register_missingness(kind: str, params: set[str]) -> Callable[[Generator], Generator]:
    def wrap(fn: Generator) -> Generator:
        _REGISTRY[kind] = fn
        register_missing_kind(kind, params)
        return fn

    return wrap


@register_missingness("mcar", {"p"})
def mcar(
    *, parties: Sequence[str], n_rows: int, rng: np.random.Generator, p: float, **_: object
) -> np.ndarray:
    """Every block missing independently with probability p."""
    return rng.random((n_rows, len(parties))) >= p


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
