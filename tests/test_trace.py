"""load_trace: encoding contract, sorting, workers table semantics (real Parquet files)."""

from __future__ import annotations

import datetime as dt
import hashlib
import os

import numpy as np
import polars as pl
import pytest

from replay import labels
from replay.trace import Trace, TraceError, load_trace

MATCH_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))


def write_trace(d, *, requests=None, loads=None, workers=None):
    """Write a small valid trace (overridable per file) into directory ``d``."""
    os.makedirs(d, exist_ok=True)
    if requests is None:
        requests = pl.DataFrame({
            "ts": [30, 10, 20, 10],
            "request_id": ["c", "a", "b", "a2"],
            "input_tokens": [3000, 1000, 2000, 500],
            "query_blocks": [6, 2, None, 1],
            "matches": pl.Series([
                [{"worker": "http://w1", "blocks": 5}, {"worker": "http://w0", "blocks": 2}],
                None,
                [],
                [{"worker": "http://x", "blocks": 1}],
            ], dtype=MATCH_T),
        })
    if loads is None:
        loads = pl.DataFrame({
            "ts": [12, 5, 7],
            "worker": ["http://w1", "http://w0", "http://w1"],
            "dp_rank": [0, 0, 1],
            "num_running_reqs": [1, 2, 3],
            "num_waiting_reqs": [0, 4, 1],
            "num_tokens": [10, 20, 30],
            "max_total_num_tokens": [100, 100, 100],
            "num_waiting_uncached_tokens": [5, None, 7],
            "num_total_tokens": [15, 1, 37],
            "max_running_requests": [64, 64, 64],
            "total_prefill_uncached_tokens": [100, 200, 300],
            "total_prefill_busy_us": [1000, 2000, 3000],
        })
    requests.write_parquet(os.path.join(d, "requests.parquet"))
    loads.write_parquet(os.path.join(d, "loads.parquet"))
    if workers is not None:
        workers.write_parquet(os.path.join(d, "workers.parquet"))
    return d


def digest(d):
    return {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest() for n in sorted(os.listdir(d))}


def test_encoding_contract(tmp_path):
    d = write_trace(tmp_path / "t")
    t = load_trace(d)
    assert isinstance(t, Trace)
    assert t.workers == ["http://w0", "http://w1", "http://x"]  # sorted, loads + matches
    assert t.models == ["default"] and not t.has_workers_table
    assert t.worker_role.tolist() == [labels.ROLE_PLAIN] * 3
    # requests sorted by ts, stable: a (row 1) before a2 (row 3)
    assert t.request_id.tolist() == ["a", "a2", "b", "c"]
    assert t.req_ts.dtype == np.int64 and t.req_ts.tolist() == [10, 10, 20, 30]
    assert t.req_query_blocks.tolist() == [2, 1, 0, 6]  # null -> 0
    assert t.match_offsets.tolist() == [0, 0, 1, 1, 3]
    assert t.match_worker.tolist() == [2, 1, 0]
    assert t.match_blocks.tolist() == [1, 5, 2]
    assert t.req_best_prefix_blocks.tolist() == [0, 1, 0, 5]
    assert t.req_selected_worker is None
    # loads sorted by ts
    assert t.load_ts.tolist() == [5, 7, 12]
    assert t.load_worker.tolist() == [0, 1, 1]
    assert t.load_rank.tolist() == [0, 1, 0]
    assert t.load_has_tail.tolist() == [False, True, True]
    assert t.load_waiting_uncached.tolist() == [0, 7, 5]
    assert t.load_total_tokens.tolist() == [0, 37, 15]  # 0 where the tail is partial
    assert t.load_router_inflight.tolist() == [-1, -1, -1]
    assert t.facts.load_rows_partial_tail == 1
    assert t.facts.requests_sorted_on_disk is False
    assert set(t.files) == {"requests.parquet", "loads.parquet"}
    info = t.files["requests.parquet"]
    assert info["bytes"] == os.path.getsize(d / "requests.parquet")
    assert info["sha256"] == hashlib.sha256((d / "requests.parquet").read_bytes()).hexdigest()
    assert t.fleet(0).tolist() == [0, 1, 2]
    assert t.req_index.tolist() == [0, 1, 2, 3]


def test_unsorted_input_sorted_and_files_unchanged(tmp_path):
    d = write_trace(tmp_path / "t")
    before = digest(d)
    mtimes = {n: os.stat(d / n).st_mtime_ns for n in os.listdir(d)}
    t = load_trace(d)
    assert np.all(np.diff(t.req_ts) >= 0) and np.all(np.diff(t.load_ts) >= 0)
    assert digest(d) == before
    assert {n: os.stat(d / n).st_mtime_ns for n in os.listdir(d)} == mtimes
    assert sorted(os.listdir(d)) == ["loads.parquet", "requests.parquet"]


def test_datetime_ts_any_unit_and_tz(tmp_path):
    base = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    ns0 = int(base.timestamp()) * 10**9
    for unit, tz in (("ns", None), ("us", "UTC"), ("ms", "Europe/Paris")):
        req = pl.DataFrame({
            "ts": pl.Series([base + dt.timedelta(milliseconds=3), base], dtype=pl.Datetime(unit, "UTC"))
            .dt.replace_time_zone(None).cast(pl.Datetime(unit)),
            "request_id": [1, 2], "input_tokens": [1, 2], "query_blocks": [1, 1],
            "matches": pl.Series([None, None], dtype=MATCH_T),
        })
        if tz:
            req = req.with_columns(pl.col("ts").dt.replace_time_zone("UTC").dt.convert_time_zone(tz))
        d = write_trace(tmp_path / f"t{unit}", requests=req)
        t = load_trace(d)
        assert t.req_ts.tolist() == [ns0, ns0 + 3_000_000]
        assert t.request_id.dtype == np.int64 and t.request_id.tolist() == [2, 1]


def test_int_and_string_request_ids(tmp_path):
    for ids in ([7, 3, 5, 9], ["x", "y", "z", "w"]):
        req = pl.DataFrame({"ts": [1, 2, 3, 4], "request_id": ids, "input_tokens": [1] * 4,
                            "query_blocks": [0] * 4, "matches": pl.Series([[]] * 4, dtype=MATCH_T)})
        t = load_trace(write_trace(tmp_path / str(type(ids[0])), requests=req))
        assert t.request_id.tolist() == ids


def test_workers_table_semantics(tmp_path):
    workers = pl.DataFrame({
        "worker": ["http://w1", "http://w0", "http://d"],
        "model": ["m", None, "m"],
        "role": ["prefill", None, "decode"],
        "dp_size": [1, None, 2],
    })
    req = pl.DataFrame({
        "ts": [1, 2], "request_id": ["a", "b"], "model": ["m", "m"], "input_tokens": [1, 2],
        "query_blocks": [3, 3],
        "matches": pl.Series([[{"worker": "http://w1", "blocks": 2}, {"worker": "http://x", "blocks": 1}],
                              [{"worker": "http://w0", "blocks": 3}]], dtype=MATCH_T),
        "selected_worker": ["http://w1", None],
    })
    loads = pl.DataFrame({
        "ts": [1, 2, 3], "worker": ["http://w1", "http://w1", "http://extra"], "dp_rank": [0, 1, 0],
        "num_running_reqs": [0, 0, 0], "num_waiting_reqs": [0, 0, 0], "num_tokens": [0, 0, 0],
        "max_total_num_tokens": [1, 1, 1], "router_inflight": [3, None, 1],
    })
    t = load_trace(write_trace(tmp_path / "t", requests=req, loads=loads, workers=workers))
    assert t.has_workers_table
    assert t.workers == ["http://d", "http://extra", "http://w0", "http://w1"]
    assert t.models == ["default", "m"]
    assert t.worker_model.tolist() == [1, -1, 0, 1]
    assert t.worker_role.tolist() == [labels.ROLE_DECODE, labels.ROLE_DECODE, labels.ROLE_PLAIN,
                                      labels.ROLE_PREFILL]
    assert t.worker_listed.tolist() == [True, False, True, True]
    assert t.worker_dp_size.tolist() == [2, 0, 0, 1]
    assert t.fleet(1).tolist() == [3]       # decode peer and unlisted loads worker excluded
    assert t.fleet(0).tolist() == [2]
    assert t.match_worker.tolist() == [3, -1, 2]  # unknown address -> -1
    assert t.req_selected_worker.tolist() == [3, -1]
    assert t.load_router_inflight.tolist() == [3, -1, 1]
    assert t.facts.non_fleet_load_workers == ["http://extra"]
    assert t.facts.ignored_rank_rows == 1      # w1 rank 1 with dp_size 1
    assert t.facts.unknown_match_entries == 1
    assert t.load_has_tail.tolist() == [False] * 3  # no tail columns at all


def test_model_filter_keeps_request_index(tmp_path):
    req = pl.DataFrame({"ts": [4, 3, 2, 1], "request_id": [1, 2, 3, 4], "model": ["a", "b", "a", None],
                        "input_tokens": [1] * 4, "query_blocks": [1] * 4,
                        "matches": pl.Series([[{"worker": "http://w0", "blocks": i + 1}] for i in range(4)],
                                             dtype=MATCH_T)})
    d = write_trace(tmp_path / "t", requests=req)
    t = load_trace(d, model="a")
    assert t.models == ["a", "b", "default"]
    assert t.request_id.tolist() == [3, 1]
    assert t.req_index.tolist() == [1, 3]
    assert t.match_blocks.tolist() == [3, 1] and t.match_offsets.tolist() == [0, 1, 2]
    with pytest.raises(TraceError, match="no request has model 'zz'"):
        load_trace(d, model="zz")


def test_large_unsigned_and_small_ints_accepted(tmp_path):
    req = pl.DataFrame({"ts": pl.Series([1, 2], dtype=pl.UInt64), "request_id": [1, 2],
                        "input_tokens": pl.Series([1, 2], dtype=pl.UInt8),
                        "query_blocks": pl.Series([1, 2], dtype=pl.Int16),
                        "matches": pl.Series([[{"worker": "w", "blocks": 1}], []],
                                             dtype=pl.List(pl.Struct({"worker": pl.String, "blocks": pl.UInt32})))})
    t = load_trace(write_trace(tmp_path / "t", requests=req))
    assert t.req_input_tokens.dtype == np.int64 and t.req_input_tokens.tolist() == [1, 2]
    bad = req.with_columns(pl.Series("input_tokens", [1, 2**60], dtype=pl.UInt64))
    with pytest.raises(TraceError, match=r"requests.parquet: column 'input_tokens' row 1: must be < 2\*\*53"):
        load_trace(write_trace(tmp_path / "b", requests=bad))
