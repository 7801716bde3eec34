"""Feature blocks and pattern-homogeneous batches: every row of a batch has the same present
blocks, so the secure sums of a batch have fixed groups."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from securevfl.config import RunConfig

EVAL_BATCH = 4096


def block_names(cfg: RunConfig) -> tuple[str, ...]:
    """The feature blocks: every passive party, then the active party if it holds columns."""
    return (*cfg.party_names, cfg.active_name) if cfg.active_columns else cfg.party_names


def subset_code(subset: Iterable[str], blocks: Sequence[str]) -> int:
    return sum(1 << blocks.index(b) for b in subset)


def chunks(ids: np.ndarray, size: int = EVAL_BATCH) -> list[np.ndarray]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


# --------------------------------------------------------------------------------------------
# Batches


def pattern_codes(present: np.ndarray) -> np.ndarray:
    """Bit code of each row's present blocks (bit j = block j)."""
    present = np.asarray(present, dtype=bool)
    return (present.astype(np.int64) << np.arange(present.shape[1])).sum(axis=1)


def pattern_batches(
    ids: np.ndarray,
    present: np.ndarray,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    labels: np.ndarray | None = None,
    keys: np.ndarray | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The epoch's batches as (ids, present-blocks row): every row of a batch has the same present
    blocks (and the same `keys` value, if given). Rows are shuffled, bucketed by pattern, cut into
    batches, and the batch order is shuffled; all reproducible from (seed, epoch). With `labels`,
    the epoch is a class-balanced draw of len(ids) rows with replacement (torch's
    WeightedRandomSampler, as the paper's Credit runs) before bucketing. Rows with no present
    block are left out."""
    rng = np.random.default_rng([seed, epoch, 0x1A5E])
    n = len(ids)
    if labels is not None and n:
        _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        w = 1.0 / counts[inverse]
        order = rng.choice(n, size=n, replace=True, p=w / w.sum())
    else:
        order = rng.permutation(n)
    codes = pattern_codes(present)[order]
    if keys is not None:  # bucket by (pattern, key): pattern in the low bits
        shifted = (np.asarray(keys)[order].astype(np.int64) + 1) << present.shape[1]
        codes = np.where(codes == 0, 0, codes + shifted)
    cut: list[np.ndarray] = []
    for code in np.unique(codes):
        if code == 0:
            continue
        rows = order[codes == code]
        cut += [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
    return [(ids[cut[j]], present[cut[j][0]]) for j in rng.permutation(len(cut))]
