"""A table's id -> position lookup: the dense table (compact ids) and the binary search (sparse
ids) give the same positions and the same refusals, for ids the table holds, ids it does not,
and ids at the ends of int64 (no difference wraps around into range)."""

from __future__ import annotations

import numpy as np
import pytest

from securevfl.data.rowstore import MemoryRows
from securevfl.data.table import PartyTable
from securevfl.errors import DataError

I64 = np.iinfo(np.int64)


def _table(ids: np.ndarray) -> PartyTable:
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    numbers = np.arange(n, dtype=np.float64)[:, None]
    return PartyTable(
        ids=ids,
        columns=("x",),
        rowstore=MemoryRows(numbers, np.zeros((n, 0), np.int32), np.empty(n, object)),
    )


def _searched(ids: np.ndarray, asked: np.ndarray) -> np.ndarray:
    """What the lookup must give: the position by binary search, -1 where not held."""
    pos = np.minimum(np.searchsorted(ids, asked), len(ids) - 1)
    return np.where(ids[pos] == asked, pos, -1)


@pytest.mark.parametrize(
    "ids",
    [
        np.arange(30_000),  # row numbers: dense
        np.sort(np.random.default_rng(1).choice(40_000, 24_000, replace=False)),  # a split
        np.array([5]),
        np.sort(np.random.default_rng(2).integers(I64.min, I64.max, 5_000)),  # hashed ids
        np.array([I64.max - 3, I64.max - 1, I64.max]),  # dense, at the top of int64
        np.array([I64.min, I64.min + 2]),  # dense, at the bottom
    ],
    ids=["rows", "split", "one", "hashed", "top", "bottom"],
)
def test_the_lookup_gives_the_binary_searchs_positions_and_refusals(ids):
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    table = _table(ids)
    dense = table._index_of(ids[:1])  # builds the index
    assert dense[0] == 0
    is_dense = table._dense[2] is not None
    assert is_dense == (int(ids[-1]) - int(ids[0]) <= 2 * len(ids) + 4096)
    rng = np.random.default_rng(3)
    held = rng.choice(ids, min(len(ids), 256))
    near = [max(int(ids[0]) - 1, I64.min), min(int(ids[-1]) + 1, I64.max)]
    hostile = np.array([I64.min, I64.max, I64.min + 1, I64.max - 2, -1, 0, *near], np.int64)
    asked = np.concatenate([held, hostile, rng.integers(I64.min, I64.max, 64)])
    np.testing.assert_array_equal(table._index_of(asked), _searched(ids, asked))
    np.testing.assert_array_equal(table.has(asked), _searched(ids, asked) >= 0)
    np.testing.assert_array_equal(table.positions(held), _searched(ids, held))
    np.testing.assert_array_equal(table.rows(held)[:, 0], _searched(ids, held).astype(float))
    missing = asked[_searched(ids, asked) < 0]
    if len(missing):
        with pytest.raises(DataError, match="not in this table"):
            table.positions(np.concatenate([held, missing[:1]]))


def test_the_lookup_follows_a_new_ids_array():
    table = _table(np.arange(10))
    assert table.positions(np.array([9])).tolist() == [9]
    table.ids = np.arange(100, 110, dtype=np.int64)
    assert table.positions(np.array([109, 100])).tolist() == [9, 0]
    assert not table.has(np.array([9])).any()


def test_an_empty_table_holds_nothing():
    table = _table(np.empty(0, np.int64))
    assert table.has(np.array([0, 1])).tolist() == [False, False]
    with pytest.raises(DataError, match="2 requested sample ids"):
        table.positions(np.array([0, 1]))


def test_positions_are_int64_whatever_the_index_holds():
    table = _table(np.arange(50))
    assert table.positions(np.array([3, 7])).dtype == np.int64
    assert table._index_of(np.array([3, 99])).dtype == np.int64
