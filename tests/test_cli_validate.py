"""router-replay validate through the real CLI: facts on good traces, one-line errors on bad ones."""

from __future__ import annotations

import json
import os

import polars as pl
import pytest
from click.testing import CliRunner
from test_trace import MATCH_T, digest, write_trace

from replay.cli import main
from replay.trace import validate_trace
from replay.trace.synthetic import generate_trace

REQ = dict(
    ts=[1, 2, 3, 4],
    request_id=["a", "b", "c", "d"],
    input_tokens=[10, 20, 30, 40],
    query_blocks=[1, 2, 3, 4],
)
LOADS = dict(
    ts=[1, 2, 3, 4],
    worker=["w0", "w1", "w0", "w1"],
    dp_rank=[0, 0, 0, 0],
    num_running_reqs=[0, 1, 2, 3],
    num_waiting_reqs=[0, 1, 2, 3],
    num_tokens=[0, 1, 2, 3],
    max_total_num_tokens=[9, 9, 9, 9],
)


def req_df(**over):
    cols = dict(REQ, matches=pl.Series([[{"worker": "w0", "blocks": 1}]] * 4, dtype=MATCH_T))
    cols.update(over)
    return pl.DataFrame({k: v for k, v in cols.items() if v is not None})


def loads_df(**over):
    cols = dict(LOADS)
    cols.update(over)
    return pl.DataFrame({k: v for k, v in cols.items() if v is not None})


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_validate_generated_trace_facts(tmp_path):
    d = tmp_path / "g"
    generate_trace(d, n_requests=2000, n_workers=6, dp_size=2, seed=3)
    res = run("validate", str(d))
    assert res.exit_code == 0, res.output
    out = res.output
    for text in ("requests: 2,000", "time span:", "workers: 7 known (6 prefill, 1 decode)",
                 "ranks per worker", "no fresh sample from any fleet worker", "partial tail",
                 "unknown match addresses: ", "ignored rank rows"):
        assert text in out
    res = run("validate", str(d), "--json")
    assert res.exit_code == 0
    facts = json.loads(res.output)
    assert facts["requests"] == 2000
    assert facts["fleet_workers"] == {"default": 6}
    assert facts["unknown_match_entries"] > 0
    assert 0 < facts["share_without_fresh_fleet_sample"] < 0.5   # the generator's fleet-wide pause


def test_fresh_fleet_sample_fact(tmp_path):
    # w0 samples at 0 s and 20 s; requests at 1 s (fresh), 10 s (stale), 20 s (fresh, inclusive), 25 s (fresh)
    s = 10**9
    d = write_trace(tmp_path / "t", requests=req_df(ts=[1 * s, 10 * s, 20 * s, 25 * s]),
                    loads=loads_df(ts=[0, 20 * s, 0, 0], worker=["w0", "w0", "w0", "w0"]))
    facts = validate_trace(d)
    assert facts.requests_without_fresh_fleet_sample == 1
    assert facts.share_without_fresh_fleet_sample == 0.25
    # a decode peer's samples do not count for the fleet
    d2 = write_trace(tmp_path / "t2", requests=req_df(ts=[1 * s, 10 * s, 20 * s, 25 * s]),
                     loads=loads_df(ts=[0, 20 * s, 9 * s, 9 * s], worker=["w0", "w0", "dec", "dec"]),
                     workers=pl.DataFrame({"worker": ["w0", "dec"], "role": ["plain", "decode"]}))
    assert validate_trace(d2).requests_without_fresh_fleet_sample == 1


def _bad_cases(tmp_path):
    """(name, writer, expected substrings) for every kind of bad input."""
    garbage = b"this is not parquet"
    return [
        ("missing requests file", lambda d: (write_trace(d), os.remove(d / "requests.parquet")),
         ["requests.parquet", "file not found"]),
        ("missing loads file", lambda d: (write_trace(d), os.remove(d / "loads.parquet")),
         ["loads.parquet", "file not found"]),
        ("unreadable requests", lambda d: (write_trace(d), (d / "requests.parquet").write_bytes(garbage)),
         ["requests.parquet", "unreadable Parquet"]),
        ("unreadable workers", lambda d: (write_trace(d), (d / "workers.parquet").write_bytes(garbage)),
         ["workers.parquet", "unreadable Parquet"]),
        ("missing column", lambda d: write_trace(d, requests=req_df(input_tokens=None)),
         ["requests.parquet", "column 'input_tokens'", "missing"]),
        ("missing matches", lambda d: write_trace(d, requests=req_df(matches=None)),
         ["requests.parquet", "column 'matches'", "missing"]),
        ("missing loads column", lambda d: write_trace(d, loads=loads_df(num_tokens=None)),
         ["loads.parquet", "column 'num_tokens'", "missing"]),
        ("wrong type float", lambda d: write_trace(d, requests=req_df(input_tokens=[1.0, 2.0, 3.0, 4.0])),
         ["requests.parquet", "column 'input_tokens'", "wrong type"]),
        ("wrong type ts", lambda d: write_trace(d, requests=req_df(ts=["1", "2", "3", "4"])),
         ["requests.parquet", "column 'ts'", "wrong type"]),
        ("wrong type matches", lambda d: write_trace(d, requests=req_df(matches=["w0"] * 4)),
         ["requests.parquet", "column 'matches'", "wrong type"]),
        ("wrong type request_id", lambda d: write_trace(d, requests=req_df(request_id=[1.5, 2.5, 3.5, 4.5])),
         ["requests.parquet", "column 'request_id'", "wrong type"]),
        ("negative input", lambda d: write_trace(d, requests=req_df(input_tokens=[1, 2, -3, -4])),
         ["requests.parquet: column 'input_tokens' row 2: must be >= 0, got -3"]),
        ("negative query_blocks", lambda d: write_trace(d, requests=req_df(query_blocks=[1, -2, 3, 4])),
         ["requests.parquet: column 'query_blocks' row 1: must be >= 0, got -2"]),
        ("null input", lambda d: write_trace(d, requests=req_df(input_tokens=[1, 2, 3, None])),
         ["requests.parquet: column 'input_tokens' row 3: null"]),
        ("null count in loads", lambda d: write_trace(d, loads=loads_df(num_waiting_reqs=[0, None, 1, 1])),
         ["loads.parquet: column 'num_waiting_reqs' row 1: null"]),
        ("negative count in loads", lambda d: write_trace(d, loads=loads_df(max_total_num_tokens=[9, 9, 9, -1])),
         ["loads.parquet: column 'max_total_num_tokens' row 3: must be >= 0, got -1"]),
        ("negative tail", lambda d: write_trace(d, loads=loads_df(total_prefill_busy_us=[None, -5, 1, 1])),
         ["loads.parquet: column 'total_prefill_busy_us' row 1: must be >= 0"]),
        ("negative dp_rank", lambda d: write_trace(d, loads=loads_df(dp_rank=[0, 0, -1, 0])),
         ["loads.parquet: column 'dp_rank' row 2"]),
        ("null load worker", lambda d: write_trace(d, loads=loads_df(worker=["w0", None, "w0", "w0"])),
         ["loads.parquet: column 'worker' row 1: null"]),
        ("null ts", lambda d: write_trace(d, loads=loads_df(ts=[1, 2, None, 4])),
         ["loads.parquet: column 'ts' row 2: null"]),
        ("too large", lambda d: write_trace(d, loads=loads_df(num_tokens=[0, 0, 0, 2**53])),
         ["loads.parquet: column 'num_tokens' row 3: must be < 2**53"]),
        ("duplicate request ids", lambda d: write_trace(d, requests=req_df(request_id=["a", "b", "a", "c"])),
         ["requests.parquet: column 'request_id' row 2: duplicate request_id 'a' (first at row 0)"]),
        ("duplicate int ids", lambda d: write_trace(d, requests=req_df(request_id=[5, 6, 7, 6])),
         ["requests.parquet: column 'request_id' row 3: duplicate"]),
        ("null request id", lambda d: write_trace(d, requests=req_df(request_id=["a", None, "b", "c"])),
         ["requests.parquet: column 'request_id' row 1: null"]),
        ("null match worker", lambda d: write_trace(d, requests=req_df(matches=pl.Series(
            [[], [{"worker": "w0", "blocks": 1}], [{"worker": "w0", "blocks": 1}, {"worker": None, "blocks": 2}],
             []], dtype=MATCH_T))),
         ["requests.parquet: column 'matches' row 2: entry 1 has a null worker"]),
        ("negative match blocks", lambda d: write_trace(d, requests=req_df(matches=pl.Series(
            [None, [{"worker": "w0", "blocks": -1}], [], []], dtype=MATCH_T))),
         ["requests.parquet: column 'matches' row 1: entry 0 blocks must be >= 0, got -1"]),
        ("null match entry", lambda d: write_trace(d, requests=req_df(matches=pl.Series(
            [None, [], [{"worker": "w0", "blocks": 1}, None], []], dtype=MATCH_T))),
         ["requests.parquet: column 'matches' row 2: entry 1 is null"]),
        ("bad role", lambda d: write_trace(d, workers=pl.DataFrame({"worker": ["w0", "w1"],
                                                                     "role": ["plain", "router"]})),
         ["workers.parquet: column 'role' row 1: must be one of prefill|decode|plain, got 'router'"]),
        ("dp_size zero", lambda d: write_trace(d, workers=pl.DataFrame({"worker": ["w0", "w1"],
                                                                         "dp_size": [None, 0]})),
         ["workers.parquet: column 'dp_size' row 1: must be >= 1, got 0"]),
        ("duplicate worker", lambda d: write_trace(d, workers=pl.DataFrame({"worker": ["w0", "w1", "w0"]})),
         ["workers.parquet: column 'worker' row 2: duplicate worker 'w0'"]),
        ("workers without worker column", lambda d: write_trace(d, workers=pl.DataFrame({"role": ["plain"]})),
         ["workers.parquet: column 'worker'", "missing"]),
    ]


@pytest.mark.parametrize("case", range(31))
def test_bad_input_one_line_exit_2(tmp_path, case):
    cases = _bad_cases(tmp_path)
    assert len(cases) == 31
    name, writer, expected = cases[case]
    d = tmp_path / "t"
    os.makedirs(d)
    writer(d)
    before = digest(d)
    line = one_error_line(name, "validate", str(d))
    for text in expected:
        assert text in line, (name, line)
    assert digest(d) == before


def one_error_line(name, *args) -> str:
    """Run the CLI; it must exit 2 printing exactly one ``error: ...`` line, no traceback."""
    res = CliRunner().invoke(main, list(args))
    assert res.exit_code == 2, (name, res.output)
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1, (name, res.output)
    assert lines[0].startswith("error: ")
    return lines[0]


def test_not_a_directory(tmp_path):
    res = run("validate", str(tmp_path / "nope"))
    assert res.exit_code == 2
    assert len(res.output.strip().splitlines()) == 1


def test_dp_rank_beyond_dp_size_is_a_fact_not_an_error(tmp_path):
    d = write_trace(tmp_path / "t", loads=loads_df(dp_rank=[0, 0, 3, 0]),
                    workers=pl.DataFrame({"worker": ["w0", "w1"], "dp_size": [2, 1]}))
    res = run("validate", str(d), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["ignored_rank_rows"] == 1
