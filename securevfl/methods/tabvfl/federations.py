"""Raw configs of the federations TabVFL is measured on (tests, bench/tabvfl.py): the synthetic
cross-guest table and UCI Bank Marketing split across five guests as the paper does. Each
builder returns the TOML-shaped dict `securevfl.config.parse_config` reads, with the release
policy the method needs (tabvfl: plain aggregation and its clear releases, named)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from securevfl.methods.tabvfl import TABVFL_CLEAR

# the paper's split: contiguous blocks of original features, floor(F/M) each, the first F mod M
# guests one more (16 features over 5 guests: 4, 3, 3, 3, 3)
BANK_GUESTS = (
    ("age", "job", "marital", "education"),
    ("default", "balance", "housing"),
    ("loan", "contact", "day"),
    ("month", "duration", "campaign"),
    ("pdays", "previous", "poutcome"),
)


def _policy(method: str, aggregation: str) -> dict[str, Any]:
    if method == "tabvfl":
        return {"aggregations": ["plain"], "clear_releases": list(TABVFL_CLEAR)}
    return {"aggregations": sorted({"mask", "ckks", aggregation})}


def federation(
    *,
    method: str,
    data: dict[str, Any],
    parties: dict[str, list[str]],
    seed: int,
    aggregation: str | None = None,
    train: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A raw config: `method` over `parties` (name -> columns), the host holding the labels
    only. Defaults: tabvfl on plain, tabvfl-le on mask; [train] batch 64, lr 2e-2 (pytorch-
    tabnet's; the authors' 1e-3 needs their 300 epochs of 35K rows), weight decay 1e-4."""
    aggregation = aggregation or ("plain" if method == "tabvfl" else "mask")
    return {
        "run": {"method": method, "aggregation": aggregation, "seed": seed},
        "data": dict(data),
        "parties": {p: {"columns": list(c)} for p, c in parties.items()},
        "train": {
            "epochs": 30,
            "batch_size": 64,
            "lr": 0.02,
            "weight_decay": 1e-4,
            **(train or {}),
        },
        "method": dict(options or {}),
        "policy": {
            **_policy(method, aggregation),
            # a test's or benchmark's `guest_seed`: the guests must accept it (not private)
            **({"config_seeds": True} if (options or {}).get("guest_seed") is not None else {}),
        },
    }


def synthetic_federation(
    directory: Path,
    *,
    method: str,
    n_rows: int = 2000,
    n_guests: int = 2,
    seed: int = 0,
    test_fraction: float = 0.3,
    **kwargs: Any,
) -> dict[str, Any]:
    """The cross-guest XOR table (`securevfl.data.synthetic_tables.cross_guest_xor`, table
    seed 0) written to ``directory/data.csv`` with guest ``g<k>`` holding its features; the run
    uses `seed`. `kwargs` go to :func:`federation`."""
    from securevfl.data.synthetic_tables import cross_guest_xor

    table = cross_guest_xor(n_rows, seed=0, n_guests=n_guests)
    table.write_csv(Path(directory) / "data.csv")
    data = {
        "path": "data.csv",
        "id": "ID",
        "label": "Y",
        "task": "binary",
        "test_fraction": test_fraction,
    }
    parties = {f"g{k}": table.features(k) for k in range(n_guests)}
    return federation(method=method, data=data, parties=parties, seed=seed, **kwargs)


def bank_federation(path: Path, *, method: str, seed: int = 0, **kwargs: Any) -> dict[str, Any]:
    """UCI Bank Marketing (45 211 rows, label y yes/no, no id column) over the paper's five
    guests, 15 % test rows (the paper's 70/15/15 with `valid_fraction` 0.1765 of the rest)."""
    data = {
        "path": str(path),
        "id": "@row",
        "label": "y",
        "positive": "yes",
        "task": "binary",
        "test_fraction": 0.15,
    }
    parties = {f"g{k}": list(cols) for k, cols in enumerate(BANK_GUESTS)}
    return federation(method=method, data=data, parties=parties, seed=seed, **kwargs)


@dataclass(frozen=True)
class PartyBlocks:
    """Every guest's columns as the federation's guests see them (encoded and scaled at the
    party on its training rows), with the federation's rows: `ids` (sorted), labels `y`, the
    training rows `train`, test rows `test`, fit rows in their fixed order `order` and the
    validation rows `valid`. For the single-process baselines (LT, CT) on the same data."""

    ids: np.ndarray
    y: np.ndarray
    blocks: tuple[np.ndarray, ...]
    train: np.ndarray
    test: np.ndarray
    order: np.ndarray
    valid: np.ndarray

    def rows(self, ids: np.ndarray) -> list[np.ndarray]:
        pos = np.searchsorted(self.ids, ids)
        return [b[pos] for b in self.blocks]

    def labels(self, ids: np.ndarray) -> np.ndarray:
        return self.y[np.searchsorted(self.ids, ids)]


def party_blocks(cfg: Any, run_dir: Path) -> PartyBlocks:
    """The guests' blocks of config `cfg` (parsed), split into role files under `run_dir`,
    with the same train/test split and validation carve as a run of tabvfl with `cfg`."""
    from securevfl.data.table import (
        load_active_table,
        load_party_table,
        split_federation,
        stratified,
        train_test_split,
    )
    from securevfl.methods.tabvfl.party import ColumnScaler
    from securevfl.methods.tabvfl.schedule import carve_validation

    paths = split_federation(cfg, Path(run_dir))
    active = load_active_table(paths[cfg.active_name], cfg)
    train, test = train_test_split(
        active.ids,
        test_fraction=cfg.test_fraction,
        seed=cfg.seed,
        labels=active.labels,
        stratify=stratified(cfg),
    )
    opts = cfg.options
    fraction = opts.valid_fraction if opts.patience > 0 else 0.0
    order, valid = carve_validation(
        train, active.label_rows(train), fraction=fraction, seed=cfg.seed
    )
    blocks = []
    for p in cfg.party_names:
        table = load_party_table(paths[p], cfg, p)
        table.prepare(train)
        scaler = ColumnScaler().fit(table.rows(train[table.has(train)]))
        blocks.append(scaler.transform(table.rows(active.ids)))
    return PartyBlocks(
        ids=active.ids,
        y=active.labels.astype(np.int64),
        blocks=tuple(blocks),
        train=np.sort(train),
        test=np.sort(test),
        order=order,
        valid=valid,
    )
