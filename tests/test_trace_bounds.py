"""Input the docs accept must cost what the data costs (output safety, trace side):
an outlier timestamp with small windows, huge dp_size / dp_rank values, broken
symlinks in a trace set.  Real files, the real CLI."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from test_cli_validate import one_error_line

from replay.cli import main
from replay.trace import MAX_DP_SIZE, NS, TraceSet, load_trace, row_counts
from replay.trace.synthetic import generate_trace

DAY = 86_400 * NS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("bounds") / "base"
    generate_trace(d, n_requests=300, n_workers=4, dp_size=2, seed=5)
    return d


def copy_trace(src, dst, *, requests=None, loads=None, workers=None):
    os.makedirs(dst)
    for name, df in (("requests", requests), ("loads", loads), ("workers", workers)):
        (pl.read_parquet(src / f"{name}.parquet") if df is None else df).write_parquet(dst / f"{name}.parquet")
    return dst


def with_outlier(base, dst, ts):
    """The base trace with one more request (a copy of request 10) at ``ts``."""
    req = pl.read_parquet(base / "requests.parquet")
    extra = req[10].with_columns(pl.lit(ts, dtype=pl.Int64).alias("ts"), pl.lit("outlier").alias("request_id"))
    return copy_trace(base, dst, requests=pl.concat([req, extra.select(req.columns)]))


@pytest.mark.parametrize("ts", [-5, 0])
def test_an_outlier_timestamp_costs_one_window(base, tmp_path, ts):
    d = with_outlier(base, tmp_path / "t", ts)
    tset = TraceSet.open(d)
    data_seconds = int(np.unique(np.concatenate([
        pl.read_parquet(d / "requests.parquet")["ts"].to_numpy() // NS,
        pl.read_parquet(d / "loads.parquet")["ts"].to_numpy() // NS])).shape[0])
    # the span is 56 years; the windows are those holding a row
    assert (tset.ts_max - tset.ts_min) > 50 * 365 * DAY
    assert len(tset.window_bounds(DAY)) == 2
    b10 = tset.window_bounds(10 * NS)
    assert len(b10) <= data_seconds
    assert b10[0] == (ts // (10 * NS) * 10 * NS, ts // (10 * NS) * 10 * NS + 10 * NS)
    assert all(b[0] < c[0] for b, c in zip(b10, b10[1:], strict=False))
    t0 = time.perf_counter()
    res = CliRunner().invoke(main, ["validate", str(d), "--window", "10s", "--json"])
    assert res.exit_code == 0, res.output
    facts = json.loads(res.output)
    assert facts["windows"] == len(b10) and facts["requests"] == 301
    assert time.perf_counter() - t0 < 60          # a correctness bound, not a speed target


def test_an_outlier_timestamp_sweeps_in_windows_as_in_memory(base, tmp_path):
    d = with_outlier(base, tmp_path / "t", 0)
    out = {}
    for window in ("none", "1d", "10s"):
        o = tmp_path / f"run-{window}"
        res = CliRunner().invoke(main, ["sweep", str(d), "--out", str(o), "--window", window,
                                        "--worker-queue-limit", "none,2", "--no-report"])
        assert res.exit_code == 0, res.output
        out[window] = o
    run = json.loads((out["1d"] / "run.json").read_text())
    assert run["execution"]["windows"] == 2
    mem = pl.read_parquet(out["none"] / "decisions.parquet")
    for window in ("1d", "10s"):
        assert pl.read_parquet(out[window] / "decisions.parquet").equals(mem), window
    assert mem.filter(pl.col("request_id") == "outlier").height == 2


@pytest.mark.parametrize("dp", [10**6, 2**31 - 1])
def test_a_huge_dp_size_is_refused_in_one_line(base, tmp_path, dp):
    wk = pl.read_parquet(base / "workers.parquet")
    wk = wk.with_columns(pl.when(pl.int_range(pl.len()) == 1).then(dp).otherwise(pl.col("dp_size"))
                         .alias("dp_size"))
    d = copy_trace(base, tmp_path / "t", workers=wk)
    want = f"error: workers.parquet: column 'dp_size' row 1: must be <= {MAX_DP_SIZE}, got {dp}"
    assert one_error_line("validate", "validate", str(d)) == want
    assert one_error_line("validate 1s", "validate", str(d), "--window", "1s") == want
    assert one_error_line("sweep", "sweep", str(d), "--out", str(tmp_path / "run"), "--no-report") == want
    assert not (tmp_path / "run").exists()


def test_dp_size_at_the_bound_is_accepted(base, tmp_path):
    wk = pl.read_parquet(base / "workers.parquet").with_columns(pl.lit(MAX_DP_SIZE).alias("dp_size"))
    d = copy_trace(base, tmp_path / "t", workers=wk)
    assert int(load_trace(d).worker_dp_size.max()) == MAX_DP_SIZE


@pytest.mark.parametrize("rank", [MAX_DP_SIZE, 2**31 - 1])
def test_a_huge_rank_without_dp_size_is_refused_in_one_line(base, tmp_path, rank):
    loads = pl.read_parquet(base / "loads.parquet")
    loads = loads.with_columns(pl.when(pl.int_range(pl.len()) == 7).then(rank).otherwise(pl.col("dp_rank"))
                               .alias("dp_rank"))
    wk = pl.read_parquet(base / "workers.parquet").drop("dp_size")
    d = copy_trace(base, tmp_path / "t", loads=loads, workers=wk)
    want = (f"error: loads.parquet: column 'dp_rank' row 7: must be < {MAX_DP_SIZE} on a worker without a "
            f"dp_size in workers.parquet (its ranks set its dp_size, at most {MAX_DP_SIZE}), got {rank}")
    assert one_error_line("validate", "validate", str(d)) == want
    assert one_error_line("validate 1s", "validate", str(d), "--window", "1s") == want
    assert one_error_line("sweep 1s", "sweep", str(d), "--out", str(tmp_path / "r1"), "--window", "1s",
                          "--no-report") == want
    assert one_error_line("sweep", "sweep", str(d), "--out", str(tmp_path / "r2"), "--no-report") == want
    # with a dp_size, the same rank is a stray sample (ignored, counted), not an error
    d2 = copy_trace(base, tmp_path / "t2", loads=loads)
    assert load_trace(d2).facts.ignored_rank_rows >= 1


def _as_set(base, dst):
    """The base trace as a trace set: requests/ and loads/ folders of two files each."""
    for name in ("requests", "loads"):
        df = pl.read_parquet(base / f"{name}.parquet")
        os.makedirs(dst / name / "date=2026-01-01")
        half = df.height // 2
        df[:half].write_parquet(dst / name / "date=2026-01-01" / "part-0.parquet")
        df[half:].write_parquet(dst / name / "date=2026-01-01" / "part-1.parquet")
    (dst / "workers.parquet").write_bytes((base / "workers.parquet").read_bytes())
    return dst


@pytest.mark.parametrize("kind", ["requests", "loads"])
def test_a_dangling_parquet_symlink_in_a_set_is_one_line(base, tmp_path, kind):
    d = _as_set(base, tmp_path / "set")
    link = d / kind / "date=2026-01-01" / "part-2.parquet"
    os.symlink(tmp_path / "gone.parquet", link)
    want = (f"error: {kind}/date=2026-01-01/part-2.parquet: broken symbolic link (its target "
            f"{tmp_path / 'gone.parquet'} does not exist)")
    for args in (["validate", str(d)], ["validate", str(d), "--window", "1s"],
                 ["sweep", str(d), "--out", str(tmp_path / "run"), "--no-report"]):
        assert one_error_line(args[0], *args) == want
    assert os.path.islink(link)                     # nothing the user gave is touched


def test_a_dangling_single_file_symlink_is_one_line(base, tmp_path):
    d = copy_trace(base, tmp_path / "t")
    os.remove(d / "loads.parquet")
    os.symlink(tmp_path / "gone.parquet", d / "loads.parquet")
    assert one_error_line("validate", "validate", str(d)) == (
        f"error: loads.parquet: broken symbolic link (its target {tmp_path / 'gone.parquet'} does not exist)")


def test_row_counts_read_only_the_footers(base, tmp_path):
    d = _as_set(base, tmp_path / "set")
    t = load_trace(base)
    assert row_counts(d) == {"requests": t.n_requests, "loads": int(t.load_ts.shape[0])}
    assert row_counts(base) == row_counts(d)


def test_the_first_error_in_file_order_wins_on_large_frames(tmp_path):
    """Frames this large are encoded in two threads (requests | loads); the error a
    user sees is still the sequential one: requests before loads, and within the
    loads the column order of the checks."""
    from replay.trace.base import PARALLEL_ROWS

    n = PARALLEL_ROWS
    loads = pl.DataFrame({
        "ts": np.arange(n, dtype=np.int64), "worker": ["w0", "w1"] * (n // 2),
        "dp_rank": np.zeros(n, dtype=np.int64), "num_running_reqs": np.ones(n, dtype=np.int64),
        "num_waiting_reqs": np.ones(n, dtype=np.int64), "num_tokens": np.ones(n, dtype=np.int64),
        "max_total_num_tokens": np.full(n, 9, dtype=np.int64)})
    bad_loads = loads.with_columns(
        pl.when(pl.int_range(pl.len()) == n - 3).then(-1).otherwise(pl.col("num_tokens")).alias("num_tokens"),
        pl.when(pl.int_range(pl.len()) == 5).then(-2).otherwise(pl.col("num_waiting_reqs"))
        .alias("num_waiting_reqs"))
    req = req_df_big(n)
    d = tmp_path / "t"
    write_trace_files(d, req, bad_loads)
    # num_waiting_reqs is checked before num_tokens, whatever the rows
    assert one_error_line("loads", "validate", str(d)) == \
        "error: loads.parquet: column 'num_waiting_reqs' row 5: must be >= 0, got -2"
    bad_req = req.with_columns(pl.when(pl.int_range(pl.len()) == n - 1).then(-7)
                               .otherwise(pl.col("input_tokens")).alias("input_tokens"))
    write_trace_files(d, bad_req, bad_loads)
    assert one_error_line("both", "validate", str(d)) == \
        f"error: requests.parquet: column 'input_tokens' row {n - 1}: must be >= 0, got -7"
    write_trace_files(d, req, loads)
    assert load_trace(d).n_requests == n


def req_df_big(n):
    from test_trace import MATCH_T

    return pl.DataFrame({
        "ts": np.arange(n, dtype=np.int64), "request_id": np.arange(n, dtype=np.int64),
        "input_tokens": np.full(n, 100, dtype=np.int64), "query_blocks": np.ones(n, dtype=np.int64),
        "matches": pl.Series([[{"worker": "w0", "blocks": 1}]] * n, dtype=MATCH_T)})


def write_trace_files(d, req, loads):
    os.makedirs(d, exist_ok=True)
    req.write_parquet(d / "requests.parquet")
    loads.write_parquet(d / "loads.parquet")


def test_auto_windows_follow_the_data_not_the_span(base, tmp_path, monkeypatch):
    """With an outlier ts the span is 56 years; ``--window auto`` on a trace too
    large for memory still picks windows of about AUTO_WINDOW_REQUESTS requests."""
    from replay.trace import auto_window
    from replay.trace import windows as trace_windows

    monkeypatch.setattr(trace_windows, "AUTO_IN_MEMORY_REQUESTS", 50)
    monkeypatch.setattr(trace_windows, "AUTO_WINDOW_REQUESTS", 100)
    monkeypatch.setattr(trace_windows, "AUTO_WINDOW_LOAD_ROWS", 10**9)
    plain = auto_window(TraceSet.open(base))
    assert 0 < plain < 60 * NS
    assert auto_window(TraceSet.open(with_outlier(base, tmp_path / "t", 0))) == plain
