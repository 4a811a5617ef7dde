"""The fast path's loads of several row groups (``replay/trace/fast.py: _ints_by_group``),
on real Parquet files: the path is taken, its arrays equal the full path's, and a bad value
in a later row group gives the full path's one-line error (file, column, row)."""

from __future__ import annotations

import os

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trace_fast import assert_same, frames, full_path, write

import replay.trace.fast as fast
from replay.trace import TraceError, load_trace
from replay.trace.assemble import RankTable
from replay.trace.columns import all_distinct, put_ints, take_by_blocks
from replay.trace.encode import tail_flags
from replay.trace.info import read_trace_info


def _spy(monkeypatch) -> list:
    calls: list = []
    real = fast._ints_by_group

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fast, "_ints_by_group", spy)
    return calls


def test_row_groups_read_one_by_one_equal_the_full_path(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    req, loads = frames(21, n_load=3000)
    d = write(tmp_path / "t", req, loads, row_group=700)
    assert pq.ParquetFile(os.path.join(d, "loads.parquet")).metadata.num_row_groups == 5
    got = fast.load_fast(d, model=None, info=read_trace_info(d))
    assert got is not None and len(calls) == 1
    assert_same(got, full_path(d))
    assert all(a.flags.writeable for a in (got.load_running, got.load_ts, got.load_rank))


def test_int32_and_narrow_columns(tmp_path, monkeypatch):
    calls = _spy(monkeypatch)
    req, loads = frames(22, n_load=2000)
    loads = loads.with_columns(pl.col("num_running_reqs").cast(pl.Int16), pl.col("dp_rank").cast(pl.Int64),
                               pl.col("router_inflight").cast(pl.Int32))
    d = write(tmp_path / "t", req, loads, row_group=600)
    got = load_trace(d)
    assert len(calls) == 1
    assert_same(got, full_path(d))
    assert got.load_rank.dtype == np.int32 and got.load_running.dtype == np.int64


@pytest.mark.parametrize("col,value", [("num_running_reqs", -1), ("num_tokens", None), ("ts", None),
                                       ("dp_rank", 2**31), ("num_total_tokens", 2**53)])
def test_bad_value_in_a_later_group_gives_the_full_paths_error(tmp_path, col, value):
    req, loads = frames(23, n_load=2000)
    dtype = loads.schema[col] if col != "dp_rank" else pl.Int64
    loads = loads.with_columns(pl.when(pl.int_range(pl.len()) == 1777).then(pl.lit(value, dtype=dtype))
                               .otherwise(pl.col(col).cast(dtype)).alias(col))
    d = write(tmp_path / "t", req, loads, row_group=500)
    with pytest.raises(TraceError) as full:
        full_path(d)
    with pytest.raises(TraceError) as got:
        load_trace(d)
    assert str(got.value) == str(full.value)
    assert "row 1777" in str(got.value) and f"'{col}'" in str(got.value) and "\n" not in str(got.value)


def test_bad_value_in_a_later_group_through_the_cli(tmp_path):
    from click.testing import CliRunner

    from replay.cli import main

    req, loads = frames(24, n_load=2000)
    loads = loads.with_columns(pl.when(pl.int_range(pl.len()) == 1500).then(-3)
                               .otherwise(pl.col("num_waiting_reqs")).alias("num_waiting_reqs"))
    d = write(tmp_path / "t", req, loads, row_group=400)
    before = {f: os.path.getmtime(os.path.join(d, f)) for f in os.listdir(d)}
    r = CliRunner().invoke(main, ["sweep", d, "--out", str(tmp_path / "run"), "--worker-queue-limit", "2"])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert lines == ["error: loads.parquet: column 'num_waiting_reqs' row 1500: must be >= 0, got -3"], r.output
    assert "Traceback" not in r.output
    assert {f: os.path.getmtime(os.path.join(d, f)) for f in os.listdir(d)} == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0, 1, 2, 3, 7, 1023, 1024, 5000])),
                min_size=1, max_size=60),
       st.integers(1, 4))
def test_rank_table_equals_the_pairs_seen(pairs, n_slices):
    """The ranks per worker gathered slice by slice (the small-key count and the wide one for
    ranks past any dp_size) equal the distinct (worker, rank) pairs counted in plain Python."""
    workers = [f"w{i}" for i in range(7)]
    w = np.array([p[0] for p in pairs], dtype=np.int32)
    r = np.array([p[1] for p in pairs], dtype=np.int32)
    table = RankTable(len(workers))
    for part in np.array_split(np.arange(len(pairs)), n_slices):
        table.add(w[part], r[part])
    want: dict[str, set[int]] = {}
    for wi, ri in pairs:
        want.setdefault(workers[wi], set()).add(ri)
    assert table.result(workers) == {k: sorted(v) for k, v in sorted(want.items(), key=lambda kv: int(kv[0][1:]))}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-1, 9), min_size=4, max_size=4), min_size=1, max_size=40))
def test_tail_flags_zero_a_partial_tail(rows):
    """Every tail there: kept and valid; some there: all zeroed, flagged as partial; none: zeroed."""
    tails = [np.array([row[k] for row in rows], dtype=np.int64) for k in range(4)]
    valid, some = np.empty(len(rows), dtype=bool), np.empty(len(rows), dtype=bool)
    tail_flags(tails, valid, some, 0, len(rows))
    for i, row in enumerate(rows):
        full, any_ = all(v >= 0 for v in row), any(v >= 0 for v in row)
        assert (bool(valid[i]), bool(some[i])) == (full, any_)
        assert [int(t[i]) for t in tails] == (row if full else [0, 0, 0, 0])


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.lists(st.text(max_size=3), max_size=30), st.lists(st.integers(-3, 3), max_size=30)))
def test_all_distinct_equals_a_set_count(values):
    assert all_distinct(pl.Series("request_id", values)) == (len(set(values)) == len(values))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(-(2**40), 2**40)), min_size=1, max_size=40),
       st.integers(0, 5), st.sampled_from([-1, 0, 7]), st.sampled_from([pl.Int64, pl.Int32]))
def test_put_ints_equals_polars_fill_null(values, cut, fill, dtype):
    """A chunk copied with its nulls filled (a slice too: the Arrow offset applied) equals
    polars' own ``fill_null``; what dense_ints and the row-group copy both build on."""
    if dtype == pl.Int32:
        values = [None if v is None else v % 2**31 for v in values]
    s = pl.Series("c", values, dtype=dtype)[min(cut, len(values) - 1):]
    dest = np.full(len(s), 12345, dtype=np.int64)
    put_ints(dest, s, fill)
    assert dest.tolist() == s.fill_null(fill).cast(pl.Int64).to_list()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-1, 4), max_size=50), st.integers(1, 8))
def test_take_by_blocks_equals_take(codes, block):
    """The names' ids mapped a block at a time (block edges anywhere, -1 = the table's last
    slot, as np.take wraps it) equal one np.take."""
    table = np.array([3, -1, 0, 2, 1, -1], dtype=np.int32)
    c = np.array(codes, dtype=np.int32)
    out = np.full(len(codes), 99, dtype=np.int32)
    assert take_by_blocks(table, c, out, block=block).tolist() == np.take(table, c).tolist()
