"""The closed-loop trace columns and trace.json (traces/README.md):
read, checked with one-line errors through the real CLI, exposed on the Trace and as
``request_log``, the same from a trace set and window by window."""

from __future__ import annotations

import json
import os

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from test_cli_validate import loads_df, one_error_line, req_df
from test_trace import digest, write_trace

from replay import RouterConfig
from replay.cli import main
from replay.trace import TraceSet, load_trace, request_log, validate_trace

S = 10**9
PAGE = 16


def closed_req(**over):
    """Four requests, written out of time order, with every closed-loop column."""
    cols = dict(
        ts=[4 * S, 1 * S, 3 * S, 2 * S],
        input_tokens=[40, 16, 0, 17],             # pages of 16: 3, 1, 0, 2 hashes
        hash_ids=pl.Series([[-7, 8, 2**62], [5], [], [5, -(2**63)]], dtype=pl.List(pl.Int64)),
        output_tokens=pl.Series([4, None, 6, 7], dtype=pl.Int64),
        cached_tokens=pl.Series([32, 16, 0, None], dtype=pl.Int64),
        ttft_ms=pl.Series([10.5, None, 3.0, 2.0], dtype=pl.Float64),
        latency_ms=pl.Series([20, 5, 3, None], dtype=pl.Int64),
        selected_worker=["w1", None, "w0", "nowhere"],
    )
    cols.update(over)
    return req_df(**cols)


def workers_df(**over):
    cols = dict(worker=["w0", "w1"], page_size=pl.Series([PAGE, None], dtype=pl.Int64))
    cols.update(over)
    return pl.DataFrame(cols)


TRACE_JSON = {"router": {"worker_queue_limit": 8, "saturation_queue_floor": 2,
                         "pressure_rel_threshold": 2},
              "source": "test capture", "page_size": PAGE}


def write_closed(d, *, requests=None, workers=None, trace_json=TRACE_JSON):
    write_trace(d, requests=closed_req() if requests is None else requests, loads=loads_df(),
                workers=workers_df() if workers is None else workers)
    if trace_json is not None:
        (d / "trace.json").write_text(trace_json if isinstance(trace_json, str) else json.dumps(trace_json))
    return d


def test_columns_follow_the_time_sort(tmp_path):
    t = load_trace(write_closed(tmp_path / "t"))
    # time order: rows 1, 3, 2, 0 of the file
    assert t.request_id.tolist() == ["b", "d", "c", "a"]
    assert t.hash_offsets.tolist() == [0, 1, 3, 3, 6]
    assert t.hash_values.tolist() == [5, 5, -(2**63), -7, 8, 2**62]
    assert t.req_hash_known.tolist() == [True] * 4
    assert t.req_output_tokens.tolist() == [-1, 7, 6, 4]
    assert t.req_cached_tokens.tolist() == [16, -1, 0, 32]
    np.testing.assert_array_equal(t.req_ttft_ms, [np.nan, 2.0, 3.0, 10.5])
    np.testing.assert_array_equal(t.req_latency_ms, [5.0, np.nan, 3.0, 20.0])
    assert t.req_page_size.tolist() == [PAGE] * 4
    assert t.worker_page_size.tolist() == [PAGE, 0]
    assert t.info.router == {"worker_queue_limit": 8, "saturation_queue_floor": 2,
                             "pressure_rel_threshold": 2.0}
    assert t.info.router_config() == RouterConfig(worker_queue_limit=8, saturation_queue_floor=2,
                                                  pressure_rel_threshold=2.0)
    assert t.info.source == "test capture" and t.info.page_size == PAGE
    assert t.facts.closed_loop_columns == {"hash_ids": 4, "output_tokens": 3, "cached_tokens": 3,
                                           "ttft_ms": 3, "latency_ms": 3}


def test_request_log(tmp_path):
    d = write_closed(tmp_path / "t")
    log = request_log(d)
    assert log.columns == ["ts", "request_id", "model", "input_tokens", "output_tokens", "hash_ids",
                           "page_size", "selected_worker", "cached_tokens", "ttft_ms", "latency_ms"]
    assert log["ts"].to_list() == [1 * S, 2 * S, 3 * S, 4 * S]
    assert log["request_id"].to_list() == ["b", "d", "c", "a"]
    assert log["hash_ids"].to_list() == [[5], [5, -(2**63)], [], [-7, 8, 2**62]]
    assert log["output_tokens"].to_list() == [None, 7, 6, 4]
    assert log["cached_tokens"].to_list() == [16, None, 0, 32]
    assert log["ttft_ms"].to_list() == [None, 2.0, 3.0, 10.5]
    assert log["latency_ms"].to_list() == [5.0, None, 3.0, 20.0]
    assert log["selected_worker"].to_list() == [None, None, "w0", "w1"]   # "nowhere" is no known worker
    assert log["page_size"].to_list() == [PAGE] * 4
    assert log.schema["hash_ids"] == pl.List(pl.Int64) and log.schema["ttft_ms"] == pl.Float64


def test_null_hash_ids_are_unknown_not_empty(tmp_path):
    req = closed_req(hash_ids=pl.Series([[1, 2, 3], None, [], None], dtype=pl.List(pl.Int64)))
    t = load_trace(write_closed(tmp_path / "t", requests=req))
    assert t.req_hash_known.tolist() == [False, False, True, True]    # b, d, c, a
    assert request_log(tmp_path / "t")["hash_ids"].to_list() == [None, None, [], [1, 2, 3]]
    assert t.facts.closed_loop_columns["hash_ids"] == 2


def test_a_trace_without_the_columns(tmp_path):
    d = write_trace(tmp_path / "t", requests=req_df(), loads=loads_df())
    t = load_trace(d)
    assert t.hash_offsets is None and t.req_output_tokens is None and t.req_ttft_ms is None
    assert t.info.router == {} and t.info.path is None and t.info.router_config() == RouterConfig()
    assert t.req_page_size.tolist() == [-1] * 4 and t.facts.closed_loop_columns is None
    log = request_log(d)
    assert log.height == 4
    for c in ("output_tokens", "hash_ids", "page_size", "selected_worker", "cached_tokens", "ttft_ms",
              "latency_ms"):
        assert log[c].null_count() == 4, c
    # validate's text and JSON say nothing new about such a trace
    res = CliRunner().invoke(main, ["validate", str(d), "--json"])
    facts = json.loads(res.output)
    assert not {"closed_loop_columns", "page_sizes", "trace_json"} & set(facts)


def test_page_size_from_the_workers_table_alone_is_checked(tmp_path):
    d = write_closed(tmp_path / "t", trace_json=None)
    assert load_trace(d).req_page_size.tolist() == [PAGE] * 4
    bad = closed_req(input_tokens=[40, 16, 0, 49])       # row 3: 49 tokens want 4 hashes (or 3), has 2
    d2 = write_closed(tmp_path / "t2", requests=bad, trace_json=None)
    res = CliRunner().invoke(main, ["validate", str(d2)])
    assert res.exit_code == 2
    assert res.output.strip() == ("error: requests.parquet: column 'hash_ids' row 3: has 2 hashes, "
                                  "expected ceil(input_tokens 49 / page_size 16) = 4 (or 3, its full "
                                  "blocks only)")


def test_unknown_page_size_leaves_lengths_unchecked(tmp_path):
    bad = closed_req(input_tokens=[40, 16, 0, 33])
    d = write_closed(tmp_path / "t", requests=bad, trace_json=None,
                     workers=pl.DataFrame({"worker": ["w0", "w1"]}))
    t = load_trace(d)
    assert t.req_page_size.tolist() == [-1] * 4 and t.facts.page_sizes is None


def test_validate_reports_the_columns(tmp_path):
    d = write_closed(tmp_path / "t")
    res = CliRunner().invoke(main, ["validate", str(d)])
    assert res.exit_code == 0, res.output
    assert ("closed-loop columns (rows with a value): hash_ids 4, output_tokens 3, cached_tokens 3, "
            "ttft_ms 3, latency_ms 3") in res.output
    assert "page size (block size of hash_ids): default 16" in res.output
    assert ("trace.json: production router worker_queue_limit=8, saturation_queue_floor=2, "
            "pressure_rel_threshold=2.0; source: test capture") in res.output
    facts = json.loads(CliRunner().invoke(main, ["validate", str(d), "--json"]).output)
    assert facts["page_sizes"] == {"default": PAGE}
    assert facts["trace_json"]["router"]["worker_queue_limit"] == 8


def test_model_filter_keeps_the_right_hashes(tmp_path):
    req = closed_req(model=["m1", "m2", "m1", "m2"])
    wk = workers_df(worker=["w0", "w1"], model=["m1", "m2"], page_size=pl.Series([PAGE, PAGE]))
    d = write_closed(tmp_path / "t", requests=req, workers=wk)
    t = load_trace(d, model="m2")
    assert t.request_id.tolist() == ["b", "d"]
    assert t.req_index.tolist() == [0, 1]
    assert [t.hash_values[t.hash_offsets[i]:t.hash_offsets[i + 1]].tolist() for i in range(2)] == \
        [[5], [5, -(2**63)]]
    assert request_log(d, model="m1")["hash_ids"].to_list() == [[], [-7, 8, 2**62]]


def test_a_trace_set_reads_like_the_single_files(tmp_path):
    single = write_closed(tmp_path / "single")
    req = pl.read_parquet(single / "requests.parquet")
    s = tmp_path / "set"
    os.makedirs(s / "requests" / "date=x")
    req[:2].write_parquet(s / "requests" / "date=x" / "part-0.parquet")
    # the second file has narrower integers and no latency column: both allowed
    req[2:].drop("latency_ms").with_columns(pl.col("output_tokens").cast(pl.Int16)) \
        .write_parquet(s / "requests" / "date=x" / "part-1.parquet")
    for name in ("loads.parquet", "workers.parquet", "trace.json"):
        (s / name).write_bytes((single / name).read_bytes())
    a, b = load_trace(single), load_trace(s)
    assert a.hash_values.tolist() == b.hash_values.tolist()
    assert a.hash_offsets.tolist() == b.hash_offsets.tolist()
    assert a.req_output_tokens.tolist() == b.req_output_tokens.tolist()
    assert np.isnan(b.req_latency_ms).tolist() == [False, True, True, False]  # rows 2, 3 lack it
    wins = list(TraceSet.open(s).iter_windows(S))      # second 0 holds only load samples
    assert [w.trace.hash_values.tolist() for w in wins] == [[], [5], [5, -(2**63)], [], [-7, 8, 2**62]]
    windowed = validate_trace(s, window=S)
    assert windowed.windows == 5
    assert windowed.closed_loop_columns == validate_trace(s).closed_loop_columns
    assert windowed.trace_json == validate_trace(single).trace_json


def test_narrow_hash_ids_widen(tmp_path):
    req = closed_req(hash_ids=pl.Series([[1, 2, 3], [4], [], [5, 6]], dtype=pl.List(pl.Int16)))
    d = write_closed(tmp_path / "t", requests=req)
    assert load_trace(d).hash_values.tolist() == [4, 5, 6, 1, 2, 3]


def _bad_closed_cases():
    """(name, writer, the exact error line) for each check of the closed-loop columns."""
    return [
        ("hash length", lambda d: write_closed(d, requests=closed_req(input_tokens=[40, 33, 0, 17])),
         "requests.parquet: column 'hash_ids' row 1: has 1 hashes, expected "
         "ceil(input_tokens 33 / page_size 16) = 3 (or 2, its full blocks only)"),
        ("null hash entry", lambda d: write_closed(d, requests=closed_req(
            hash_ids=pl.Series([[1, 2, 3], [5], [], [5, None]], dtype=pl.List(pl.Int64)))),
         "requests.parquet: column 'hash_ids' row 3: entry 1 is null"),
        ("string hashes", lambda d: write_closed(d, requests=closed_req(
            hash_ids=pl.Series([["a"], ["b"], [], ["c"]], dtype=pl.List(pl.String)))),
         "requests.parquet: column 'hash_ids': wrong type List(String), expected list<int64>"),
        ("hash beyond int64", lambda d: write_closed(d, requests=closed_req(
            hash_ids=pl.Series([[1, 2, 3], [2**63], [], [5, 6]], dtype=pl.List(pl.UInt64)))),
         "requests.parquet: column 'hash_ids' row 1: entry 0 is not an int64, got 9223372036854775808"),
        ("negative output", lambda d: write_closed(d, requests=closed_req(
            output_tokens=pl.Series([4, None, -6, 7]))),
         "requests.parquet: column 'output_tokens' row 2: must be >= 0, got -6"),
        ("float output", lambda d: write_closed(d, requests=closed_req(
            output_tokens=pl.Series([4.0, 1.0, 6.0, 7.0]))),
         "requests.parquet: column 'output_tokens': wrong type Float64, expected an integer type"),
        ("cached above input", lambda d: write_closed(d, requests=closed_req(
            cached_tokens=pl.Series([32, 17, 0, None]))),
         "requests.parquet: column 'cached_tokens' row 1: must be <= input_tokens (16), got 17"),
        ("ttft above latency", lambda d: write_closed(d, requests=closed_req(
            ttft_ms=pl.Series([20.5, None, 3.0, 2.0]))),
         "requests.parquet: column 'ttft_ms' row 0: must be <= latency_ms (20.0), got 20.5"),
        ("negative latency", lambda d: write_closed(d, requests=closed_req(
            latency_ms=pl.Series([20.0, -5.0, 3.0, None]))),
         "requests.parquet: column 'latency_ms' row 1: must be finite and >= 0, got -5.0"),
        ("nan ttft", lambda d: write_closed(d, requests=closed_req(
            ttft_ms=pl.Series([1.0, float("nan"), 3.0, 2.0]))),
         "requests.parquet: column 'ttft_ms' row 1: must be finite and >= 0, got nan"),
        ("infinite latency", lambda d: write_closed(d, requests=closed_req(
            latency_ms=pl.Series([20.0, 5.0, float("inf"), None]))),
         "requests.parquet: column 'latency_ms' row 2: must be finite and >= 0, got inf"),
        ("string latency", lambda d: write_closed(d, requests=closed_req(latency_ms=["1", "2", "3", "4"])),
         "requests.parquet: column 'latency_ms': wrong type String, expected a number"),
        ("page size zero", lambda d: write_closed(d, workers=workers_df(page_size=pl.Series([16, 0])),
                                                  trace_json=None),
         "workers.parquet: column 'page_size' row 1: must be >= 1, got 0"),
        ("page sizes disagree", lambda d: write_closed(d, workers=workers_df(page_size=pl.Series([16, 32])),
                                                       trace_json=None),
         "workers.parquet: column 'page_size' row 1: 32 differs from 16 (row 0) for model 'default'; "
         "a model's requests are hashed with one block size"),
        ("trace.json page size disagrees", lambda d: write_closed(d, trace_json=dict(TRACE_JSON, page_size=32)),
         "trace.json: key 'page_size': 32 differs from workers.parquet page_size 16 (row 0, model 'default')"),
        ("trace.json not json", lambda d: write_closed(d, trace_json='{"router": {'),
         "trace.json: not valid JSON (line 1 column 13: Expecting property name enclosed in double quotes)"),
        ("trace.json a list", lambda d: write_closed(d, trace_json="[1]"),
         "trace.json: must be a JSON object, got list"),
        ("trace.json unknown key", lambda d: write_closed(d, trace_json={"routr": {}}),
         "trace.json: key 'routr': unknown key (known: router, page_size, source, per_dp_rank, extra)"),
        ("router knob unknown", lambda d: write_closed(d, trace_json={"router": {"queue_limit": 3}}),
         "trace.json: key 'router.queue_limit': unknown router knob (known: "),
        ("router value a string", lambda d: write_closed(d, trace_json={"router": {"worker_queue_limit": "8"}}),
         "trace.json: key 'router.worker_queue_limit': must be an integer >= 0 or null, got \"8\""),
        ("router value a bool", lambda d: write_closed(d, trace_json={"router": {"min_load_choices": True}}),
         "trace.json: key 'router.min_load_choices': must be an integer >= 0, got true"),
        ("router null where not nullable", lambda d: write_closed(
            d, trace_json={"router": {"min_load_choices": None}}),
         "trace.json: key 'router.min_load_choices': must not be null (the router has no unset value "
         "for --min-load-choices)"),
        ("router refuses", lambda d: write_closed(
            d, trace_json={"router": {"worker_queue_limit": 2, "saturation_queue_floor": 3}}),
         "trace.json: key 'router': the router would refuse these flags: --saturation-queue-floor (3) "
         "must be at most --worker-queue-limit (2)"),
        ("page size a float", lambda d: write_closed(d, trace_json={"page_size": 16.0}),
         "trace.json: key 'page_size': must be an integer >= 1, got 16.0"),
        ("per_dp_rank a string", lambda d: write_closed(d, trace_json={"per_dp_rank": "yes"}),
         "trace.json: key 'per_dp_rank': must be true or false, got \"yes\""),
    ]


@pytest.mark.parametrize("case", range(25))
def test_bad_closed_loop_input_one_line_exit_2(tmp_path, case):
    cases = _bad_closed_cases()
    assert len(cases) == 25
    name, writer, expected = cases[case]
    d = tmp_path / "t"
    os.makedirs(d)
    writer(d)
    before = digest(d)
    for window in ("none", "1s"):
        line = one_error_line(name, "validate", str(d), "--window", window)
        assert line.startswith("error: " + expected), (name, line)
    assert digest(d) == before


def test_per_dp_rank_and_extra_are_kept(tmp_path):
    d = write_closed(tmp_path / "t", trace_json={"router": {"--worker-queue-limit": 2}, "per_dp_rank": True,
                                                  "extra": {"anything": [1, 2]}})
    info = load_trace(d).info
    assert info.router == {"worker_queue_limit": 2} and info.per_dp_rank and info.extra == {"anything": [1, 2]}
    assert info.page_size is None and info.path == os.path.abspath(d / "trace.json")


def test_fixed_size_hash_arrays_are_lists(tmp_path):
    req = closed_req(input_tokens=[32, 32, 17, 30],
                     hash_ids=pl.Series([[1, 2], [3, 4], [5, 6], [7, 8]], dtype=pl.Array(pl.Int32, 2)))
    t = load_trace(write_closed(tmp_path / "t", requests=req))
    assert t.hash_offsets.tolist() == [0, 2, 4, 6, 8]
    assert t.hash_values.tolist() == [3, 4, 7, 8, 5, 6, 1, 2]      # b, d, c, a
