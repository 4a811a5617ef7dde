"""The list columns' entries as the loaders take them apart (without
``pyarrow.compute``): ``replay/trace/fast.py``'s ``list_entries`` and ``valid_rows`` against
pyarrow's own ``flatten`` / ``list_value_length`` / ``is_valid``, and the full path's
``_list_values`` against ``flatten`` read back through polars, on arrays with null lists
(empty and over entries), null entries, empty lists and slices."""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from replay.trace.encode import _list_values
from replay.trace.fast import list_entries, valid_rows


def _lists() -> list[pa.Array]:
    plain = pa.array([[1, 2], None, [3], [], None, [4, None, 6], [7]], type=pa.list_(pa.int64()))
    # a null list over entries (Arrow allows it; flatten skips them)
    over = pa.ListArray.from_arrays(pa.array([0, 2, 3, 5, 5], type=pa.int32()), pa.array([1, 2, 3, 4, 5]),
                                    mask=pa.array([False, False, True, False]))
    large = pa.array([[1], None, [2, 3]], type=pa.large_list(pa.int64()))
    structs = pa.array([[{"worker": "a", "blocks": 1}], None, [{"worker": "b", "blocks": 2},
                                                               {"worker": "a", "blocks": 3}]],
                       type=pa.list_(pa.struct([("worker", pa.string()), ("blocks", pa.int64())])))
    out = []
    for a in (plain, over, large, structs):
        out += [a, a.slice(1), a.slice(2, 2), a.slice(len(a))]
    return out


@pytest.mark.parametrize("arr", _lists(), ids=lambda a: f"{a.type}@{a.offset}+{len(a)}")
def test_list_entries_as_flatten(arr):
    lens, ent = list_entries(arr)
    want = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    assert lens.dtype == np.int64 and np.array_equal(lens, want)
    assert ent.equals(arr.flatten())
    assert np.array_equal(valid_rows(arr), pc.is_valid(arr).to_numpy(zero_copy_only=False))


@pytest.mark.parametrize("arr", _lists(), ids=lambda a: f"{a.type}@{a.offset}+{len(a)}")
def test_list_values_as_flatten(arr):
    s = pl.Series(arr)
    got = _list_values(s)
    want = pl.Series(arr.flatten())
    assert got.dtype == want.dtype and got.to_list() == want.to_list()
    assert got.null_count() == want.null_count()
