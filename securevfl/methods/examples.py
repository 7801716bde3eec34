"""Small federations a method declares as its example (`MethodSpec.example`): the shared
conformance suite (tests/securevfl/test_method_conformance.py) runs every registered method on
its example, so a new method inherits those checks. Each builder writes a synthetic table into a
folder and returns the raw (TOML-shaped) config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from securevfl.data.table import write_csv


def classification(
    directory: Path,
    *,
    method: str,
    blocks: int = 3,
    active_block: bool = False,
    p_missing: float = 0.0,
    n: int = 240,
) -> dict[str, Any]:
    """A binary task whose label needs every block; `active_block`: the active party holds the
    last block; `p_missing`: each passive block missing at random (training and test)."""
    rng = np.random.default_rng(17)
    x = rng.normal(size=(n, 2 * blocks))
    y = (x @ rng.normal(size=2 * blocks) + 0.5 * rng.normal(size=n) > 0).astype(float)
    names = [f"X{i + 1}" for i in range(2 * blocks)]
    write_csv(
        directory / "data.csv",
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=names,
        values=x,
        label="Y",
        labels=y,
    )
    groups = [names[2 * b : 2 * b + 2] for b in range(blocks)]
    raw: dict[str, Any] = {
        "run": {"method": method, "aggregation": "mask", "seed": 5},
        "data": {"path": "data.csv", "task": "binary", "test_fraction": 0.25},
        "active": {"columns": groups[-1] if active_block else []},
        "parties": {
            f"p{i}": {"columns": g} for i, g in enumerate(groups[:-1] if active_block else groups)
        },
        "train": {"epochs": 1, "batch_size": 32, "lr": 0.01},
        "model": {"hidden": [8], "width": 4},
    }
    if p_missing:
        spec = {"kind": "mcar", "p": p_missing}
        raw["missing"] = {"train": spec, "test": spec}
    return raw


def regression(
    directory: Path,
    *,
    method: str,
    n: int = 240,
    p_missing: float = 0.0,
    clear_releases: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A linear regression task over three passive blocks of two columns."""
    rng = np.random.default_rng(19)
    x = rng.normal(size=(n, 6))
    y = 0.5 + x @ np.array([1.0, -0.5, 0.8, 0.3, -1.0, 0.6]) + rng.normal(size=n)
    if p_missing:
        for b in range(3):
            x[rng.random(n) < p_missing, 2 * b : 2 * b + 2] = np.nan
    names = [f"X{i + 1}" for i in range(6)]
    write_csv(
        directory / "data.csv",
        id_column="ID",
        ids=np.arange(1, n + 1),
        columns=names,
        values=x,
        label="Y",
        labels=y,
    )
    raw: dict[str, Any] = {
        "run": {"method": method, "aggregation": "mask", "seed": 5},
        "data": {"path": "data.csv", "task": "regression", "test_fraction": 0.25},
        "parties": {f"r{b}": {"columns": names[2 * b : 2 * b + 2]} for b in range(3)},
    }
    if clear_releases:  # what the parties must let leave them in the clear
        raw["policy"] = {"clear_releases": list(clear_releases)}
    return raw
