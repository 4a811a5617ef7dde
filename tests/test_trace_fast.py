"""load_trace's fast path (``replay/trace/fast.py``: name columns read as
Parquet dictionary codes) against the full path (``build_trace(read_frames())``),
on real Parquet files: the same arrays (values, dtypes, read-only flags), the
same facts, and on bad input the full path's one-line error."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from replay.trace import TraceError, load_trace
from replay.trace.fast import load_fast
from replay.trace.files import read_frames
from replay.trace.info import read_trace_info
from replay.trace.load import build_trace

MATCH_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))
TAILS = ("num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
         "total_prefill_uncached_tokens", "total_prefill_busy_us")


def frames(seed: int, n_req: int = 400, n_load: int = 1500, *, unsorted: bool = True, selected: bool = True,
           models: bool = True):
    """Random requests and loads with every kind of value the checks allow:
    null and empty match lists, unknown addresses, null models and selected
    workers, null tail columns and router_inflight, rows out of time order."""
    rng = np.random.default_rng(seed)
    workers = [f"http://w{i}" for i in range(6)]
    addr = [*workers, "http://gone"]
    matches = []
    for _ in range(n_req):
        k = int(rng.integers(-1, 4))
        matches.append(None if k < 0 else [{"worker": addr[int(rng.integers(0, len(addr)))],
                                            "blocks": int(rng.integers(0, 50))} for _ in range(k)])
    req_ts = rng.integers(0, 10**9, n_req)
    if not unsorted:
        req_ts = np.sort(req_ts)
    req = {
        "ts": req_ts,
        "request_id": [f"r{i}" for i in range(n_req)],
        "input_tokens": rng.integers(1, 5000, n_req),
        "query_blocks": pl.Series([None if rng.random() < 0.1 else int(v) for v in rng.integers(0, 20, n_req)],
                                  dtype=pl.Int64),
        "matches": pl.Series(matches, dtype=MATCH_T),
        "best_prefix_blocks": pl.Series([None if rng.random() < 0.3 else int(v)
                                         for v in rng.integers(0, 50, n_req)], dtype=pl.Int64),
    }
    if models:
        req["model"] = [None if rng.random() < 0.1 else ("m1" if rng.random() < 0.5 else "m2")
                        for _ in range(n_req)]
    if selected:
        req["selected_worker"] = [None if rng.random() < 0.2 else addr[int(rng.integers(0, len(addr)))]
                                  for _ in range(n_req)]
    load_ts = rng.integers(-10**8, 10**9, n_load)
    if not unsorted:
        load_ts = np.sort(load_ts)
    loads = {
        "ts": load_ts,
        "worker": [workers[int(i)] for i in rng.integers(0, len(workers), n_load)],
        "dp_rank": rng.integers(0, 3, n_load).astype(np.int32),
        "num_running_reqs": rng.integers(0, 9, n_load),
        "num_waiting_reqs": rng.integers(0, 9, n_load),
        "num_tokens": rng.integers(0, 9000, n_load),
        "max_total_num_tokens": rng.integers(9000, 10000, n_load),
        **{c: pl.Series([None if rng.random() < 0.15 else int(v) for v in rng.integers(0, 900, n_load)],
                        dtype=pl.Int64) for c in TAILS},
        "router_inflight": pl.Series([None if rng.random() < 0.3 else int(v) for v in rng.integers(0, 5, n_load)],
                                     dtype=pl.Int64),
    }
    return pl.DataFrame(req), pl.DataFrame(loads)


def write(d, req: pl.DataFrame, loads: pl.DataFrame, *, workers: bool = False, row_group: int | None = None,
          dictionary: bool = True) -> str:
    os.makedirs(d, exist_ok=True)
    for name, df in (("requests.parquet", req), ("loads.parquet", loads)):
        pq.write_table(df.to_arrow(), os.path.join(d, name), row_group_size=row_group, use_dictionary=dictionary)
    if workers:
        pl.DataFrame({"worker": [f"http://w{i}" for i in range(6)], "model": ["m1", "m1", "m1", "m2", "m2", "m2"],
                      "role": ["prefill", "prefill", "decode", "plain", "plain", "plain"],
                      "dp_size": pl.Series([3, 3, 3, None, 3, 3], dtype=pl.Int32)}
                     ).write_parquet(os.path.join(d, "workers.parquet"))
    return str(d)


def full_path(d):
    return build_trace(read_frames(d), info=read_trace_info(d))


def assert_same(a, b):
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, f.name
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert np.array_equal(x, y), f.name
            assert x.flags.writeable == y.flags.writeable, f.name
            assert x.flags.c_contiguous, f.name
        elif f.name == "facts":
            assert x.as_dict() == y.as_dict()
            assert x.unknown_addresses == y.unknown_addresses
        else:
            assert x == y, f.name


@pytest.mark.parametrize("seed,workers,row_group,dictionary,unsorted,selected,models", [
    (1, False, None, True, True, True, True),
    (2, True, None, True, True, True, True),
    (3, True, 256, True, False, True, True),      # several row groups: chunked columns
    (4, False, 300, False, True, False, False),   # plain (not dictionary) pages, no optional columns
    (5, True, 128, False, False, True, True),
])
def test_fast_path_encodes_as_the_full_path(tmp_path, seed, workers, row_group, dictionary, unsorted, selected,
                                            models):
    req, loads = frames(seed, unsorted=unsorted, selected=selected, models=models)
    d = write(tmp_path / "t", req, loads, workers=workers, row_group=row_group, dictionary=dictionary)
    fast = load_fast(d, model=None, info=read_trace_info(d))
    assert fast is not None, "the fast path applies to this layout"
    assert_same(fast, full_path(d))
    assert_same(load_trace(d), fast)


def test_fast_path_model_filter(tmp_path):
    req, loads = frames(7)
    d = write(tmp_path / "t", req, loads, workers=True)
    fast = load_trace(d, model="m2")
    full = build_trace(read_frames(d), model="m2", info=read_trace_info(d))
    assert_same(fast, full)
    with pytest.raises(TraceError) as err:
        load_trace(d, model="nope")
    assert "no request has model 'nope'" in str(err.value)


def _bad(kind: str, req: pl.DataFrame, loads: pl.DataFrame):
    if kind == "duplicate request_id":
        req = req.with_columns(pl.when(pl.int_range(pl.len()) == 17).then(pl.lit("r3"))
                               .otherwise(pl.col("request_id")).alias("request_id"))
    elif kind == "null load worker":
        loads = loads.with_columns(pl.when(pl.int_range(pl.len()) == 40).then(None)
                                   .otherwise(pl.col("worker")).alias("worker"))
    elif kind == "negative match blocks":
        req = req.with_columns(pl.col("matches").list.eval(pl.struct(
            pl.element().struct.field("worker"), (pl.element().struct.field("blocks") - 45))))
    elif kind == "null match worker":
        m = req.get_column("matches").to_list()
        row = next(i for i, v in enumerate(m) if v)
        m[row][0]["worker"] = None
        req = req.with_columns(pl.Series("matches", m, dtype=MATCH_T))
    elif kind == "negative running":
        loads = loads.with_columns(pl.when(pl.int_range(pl.len()) == 9).then(-1)
                                   .otherwise(pl.col("num_running_reqs")).alias("num_running_reqs"))
    elif kind == "integer model":
        req = req.with_columns(pl.lit(1).alias("model"))
    return req, loads


@pytest.mark.parametrize("kind", ["duplicate request_id", "null load worker", "negative match blocks",
                                  "null match worker", "negative running", "integer model"])
def test_bad_input_gives_the_full_paths_error(tmp_path, kind):
    req, loads = _bad(kind, *frames(11, unsorted=True))
    d = write(tmp_path / "t", req, loads)
    with pytest.raises(TraceError) as full:
        full_path(d)
    with pytest.raises(TraceError) as got:
        load_trace(d)
    assert str(got.value) == str(full.value)
    assert "\n" not in str(got.value)


def test_dictionary_chunks_with_different_dictionaries(tmp_path):
    """Row groups whose dictionaries differ (and a name absent from some):
    one set of codes, ids as the full path gives them."""
    req, loads = frames(13, n_load=2000)
    loads = loads.with_columns(pl.when(pl.int_range(pl.len()) < 700).then(pl.lit("http://w5"))
                               .otherwise(pl.col("worker")).alias("worker"))
    d = write(tmp_path / "t", req, loads, row_group=500)
    assert pq.ParquetFile(os.path.join(d, "loads.parquet")).metadata.num_row_groups == 4
    fast = load_fast(d, model=None, info=read_trace_info(d))
    assert fast is not None
    assert_same(fast, full_path(d))


def test_large_string_columns(tmp_path):
    req, loads = frames(17)
    d = str(tmp_path / "t")
    os.makedirs(d)
    t = loads.to_arrow()
    t = t.set_column(t.schema.get_field_index("worker"), "worker", t.column("worker").cast(pa.large_string()))
    pq.write_table(t, os.path.join(d, "loads.parquet"))
    pq.write_table(req.to_arrow(), os.path.join(d, "requests.parquet"))
    assert_same(load_trace(d), full_path(d))
