"""Feature blocks and pattern-homogeneous batches: every row of a batch has the same present
blocks, so the secure sums of a batch have fixed groups."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

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


def row_chunks(ids: np.ndarray) -> Iterator[np.ndarray]:
    """`ids` `EVAL_BATCH` at a time, each in memory (the pages of a map of a file of ids are
    handed back after each chunk)."""
    from securevfl.data.rowarrays import id_slices

    for _, block in id_slices(ids, EVAL_BATCH):
        yield block


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


def count_incomplete(ctx: Any, table: Any, ids: np.ndarray) -> int:
    """How many rows of `ids` some passive party lacks (`ctx.presence`); asked `EVAL_BATCH`
    rows at a time for a table streamed from disk."""
    if not getattr(table, "streamed", False):
        return int((~np.asarray(ctx.presence(ids)).all(axis=1)).sum())
    return sum(int((~np.asarray(ctx.presence(c)).all(axis=1)).sum()) for c in row_chunks(ids))


# --------------------------------------------------------------------------------------------
# Batches of a table streamed from disk

Presence = Callable[[np.ndarray], np.ndarray]  # rows -> bool [rows, blocks]
Keys = Callable[[np.ndarray, np.ndarray], np.ndarray | None]  # (rows, presence) -> keys


def table_pattern_batches(
    table: Any,
    ids: np.ndarray,
    presence: Presence,
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    balanced: bool = False,
    keys: Keys | None = None,
) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """`pattern_batches(ids, presence(ids), labels=..., keys=keys(ids, presence(ids)))` of the
    rows `ids` of `table` (with `balanced`, the labels of `ids`). A table in memory computes it
    so; for one streamed from disk the same batches come one at a time: the epoch's order, each
    pattern's rows, each row's code and the batch order are files of its row cache
    (`securevfl.data.rowarrays`), and `presence` and `keys` are asked `EVAL_BATCH` rows at a
    time in the order of `ids` (as `keys` sees them in memory), so the epoch keeps nothing per
    row in memory. With `balanced` the draw equals the in-memory one to float rounding
    (the weights' total is summed block by block)."""
    if not getattr(table, "streamed", False):
        pres = presence(ids)
        return pattern_batches(
            ids,
            pres,
            batch_size=batch_size,
            seed=seed,
            epoch=epoch,
            labels=table.label_rows(ids) if balanced else None,
            keys=None if keys is None else keys(ids, pres),
        )
    rng = np.random.default_rng([seed, epoch, 0x1A5E])
    return _streamed_pattern_batches(table, ids, presence, keys, balanced, rng, batch_size)


def _streamed_pattern_batches(
    table: Any,
    ids: np.ndarray,
    presence: Presence,
    keys: Keys | None,
    balanced: bool,
    rng: Any,
    batch_size: int,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    from securevfl.data.rowarrays import _positions_dtype, permutation, take

    arrays = table.rowstore.arrays()
    n = len(ids)
    width = 0
    # each row's code (pattern, and key) in the order of `ids`, as `keys` sees them in memory
    spool = arrays.spool("pattern.codes", np.int64)
    for rows in row_chunks(ids):
        pres = np.asarray(presence(rows), dtype=bool)
        width = pres.shape[1]
        codes = pattern_codes(pres)
        if keys is not None:
            got = keys(rows, pres)
            if got is not None:
                shifted = (np.asarray(got).astype(np.int64) + 1) << width
                codes = np.where(codes == 0, 0, codes + shifted)
        spool.write(codes)
    row_codes = spool.array()
    if balanced and n:
        order = _balanced_draw(table, ids, rng, arrays)
    else:
        order = permutation(rng, n, arrays, dtype=_positions_dtype(n))
    spools: dict[int, Any] = {}  # code -> positions into `ids`, in the epoch's order
    for block in row_chunks(order):
        positions = block.astype(np.int64)
        codes = take(row_codes, positions)
        for code in np.unique(codes).tolist():
            if code == 0:
                continue
            if code not in spools:
                spools[code] = arrays.spool(f"pattern-{code}", _positions_dtype(n))
            spools[code].write(positions[codes == code])
    del row_codes
    del order
    patterns = sorted(spools)
    members = [spools[c].array() for c in patterns]
    del spools
    per_code = np.array([-(-len(m) // batch_size) for m in members], dtype=np.int64)
    ends = np.cumsum(per_code)
    low = (1 << width) - 1
    batch_order = permutation(rng, int(ends[-1]) if len(ends) else 0, arrays)
    for block in row_chunks(batch_order):
        for j in block.tolist():
            k = int(np.searchsorted(ends, j, side="right"))
            start = (j - (int(ends[k - 1]) if k else 0)) * batch_size
            found = members[k]
            positions = take(found, np.arange(start, min(len(found), start + batch_size)))
            pattern = ((patterns[k] & low) >> np.arange(width)) & 1
            yield take(ids, positions.astype(np.int64)), pattern.astype(bool)
    del members


def _balanced_draw(table: Any, ids: np.ndarray, rng: np.random.Generator, arrays: Any) -> Any:
    """`rng.choice(n, size=n, replace=True, p=w / w.sum())` with w = 1 / (count of the row's
    class) (`pattern_batches`' balanced draw) into a file of `arrays`: the labels read a block
    at a time, the cumulative distribution kept in a file and searched a block of uniforms at
    a time. The same draws as in memory up to the rounding of the weights' total."""
    from securevfl.data.rowarrays import _map_of, _positions_dtype, filled

    def labels() -> Iterator[np.ndarray]:
        for block in row_chunks(ids):
            yield table.label_rows(block)

    seen = [np.unique(b) for b in labels()]
    classes = np.unique(np.concatenate(seen))
    counts = np.zeros(len(classes), dtype=np.int64)
    for b in labels():
        counts += np.bincount(np.searchsorted(classes, b), minlength=len(classes))
    weight = 1.0 / counts  # as 1.0 / counts[inverse], one value per class
    total = sum(float((weight[np.searchsorted(classes, b)]).sum()) for b in labels())

    def running() -> Iterator[np.ndarray]:  # p.cumsum(), summed in the same order
        carry = 0.0
        for b in labels():
            cdf = np.cumsum(np.r_[carry, weight[np.searchsorted(classes, b)] / total])[1:]
            carry = float(cdf[-1]) if len(cdf) else carry
            yield cdf

    cdf = filled(arrays, "balanced.cdf", np.float64, running())
    last = float(cdf[-1])
    n = len(ids)

    def drawn() -> Iterator[np.ndarray]:
        mapped = _map_of(cdf)
        for start in range(0, n, EVAL_BATCH):
            uniform = rng.random(min(EVAL_BATCH, n - start))
            # cdf / cdf[-1] <= u  <=>  cdf <= u * cdf[-1] is not exact: divide as NumPy does
            yield _search_scaled(cdf, last, uniform)
            if mapped is not None:
                mapped.madvise(mmap.MADV_DONTNEED)

    return filled(arrays, "balanced.order", _positions_dtype(n), drawn())


def _search_scaled(cdf: np.ndarray, last: float, uniform: np.ndarray) -> np.ndarray:
    """`(cdf / last).searchsorted(uniform, side="right")` without the divided copy: a binary
    search per uniform over the file, comparing `cdf[k] / last` as NumPy's would."""
    lo = np.zeros(len(uniform), dtype=np.int64)
    hi = np.full(len(uniform), len(cdf), dtype=np.int64)
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        at = np.where(open_, mid, 0)
        below = (np.asarray(cdf[at]) / last) <= uniform
        lo = np.where(open_ & below, mid + 1, lo)
        hi = np.where(open_ & ~below, mid, hi)


class RowKeys:
    """An integer key per row of a table streamed from disk (-1: none yet), in a file of its
    row cache (4 bytes a row), read and written a batch at a time: what a dict from row id to
    key holds for a table in memory (LASER's per-row families)."""

    def __init__(self, table: Any) -> None:
        from securevfl.data.rowarrays import BLOCK

        self.table = table
        spool = table.rowstore.arrays().spool("row-keys", np.int32)
        n = len(table)
        for start in range(0, n, BLOCK):
            spool.write(np.full(min(BLOCK, n - start), -1, dtype=np.int32))
        self._keys = spool.array(writable=True)

    def get(self, ids: np.ndarray) -> np.ndarray:
        """int64 keys of rows `ids` (-1 where none was put)."""
        from securevfl.data.rowarrays import take

        if not len(ids):
            return np.empty(0, dtype=np.int64)
        return take(self._keys, self.table.positions(ids)).astype(np.int64)

    def __getitem__(self, row: int) -> int:
        return int(self.get(np.array([row], dtype=np.int64))[0])

    def put(self, ids: np.ndarray, keys: np.ndarray) -> None:
        from securevfl.data.rowarrays import _map_of

        if not len(ids):
            return
        self._keys[self.table.positions(ids)] = keys
        mapped = _map_of(self._keys)
        if mapped is not None:  # a shared map: the keys stay in the page cache and the file
            mapped.madvise(mmap.MADV_DONTNEED)

    def counts(self) -> dict[int, int]:
        """Rows per key (rows with no key left out), a block of the file at a time."""
        from securevfl.data.rowarrays import id_slices

        out: dict[int, int] = {}
        for _, block in id_slices(self._keys):
            values, counts = np.unique(block[block >= 0], return_counts=True)
            for v, c in zip(values.tolist(), counts.tolist(), strict=True):
                out[v] = out.get(v, 0) + c
        return out
