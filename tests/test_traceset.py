"""Trace sets (``replay/trace/sets.py``): ``requests/`` and ``loads/`` folders of Parquet files,
read whole (``load_trace``) or window by window (``TraceSet.iter_windows``, ``sweep --window``).

Everything here is real Parquet on disk, no mocks.  The promises checked:

* layouts: a set replays exactly like the one file it was split from (any split points and
  row-group sizes, ties of ``ts`` across files in file order), path order component by
  component, hidden and non-Parquet entries skipped, hive ``key=value`` columns;
* errors name the part file and the row inside it, whole and windowed, library and CLI, and
  leave no run directory behind;
* windows are exact: sweeps by window equal the in-memory sweep (summary, decisions, fleet
  table, facts) on a hand-built trace full of boundary cases, and ``decide_all`` over windows
  equals ``decide_all`` on the whole trace for random traces (hypothesis);
* ``parse_window`` / ``auto_window`` and the CLI's window summary.

Tests that once documented library bugs found while writing this file now hold the fixes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal
from trace_factory import Shape, random_trace, shape_strategy

from replay import labels, run_sweep
from replay.cli import main
from replay.config import Grid, RouterConfig
from replay.errors import ParamError, ReplayError
from replay.fields import empty_decisions
from replay.sweep import engine
from replay.trace import (
    LOAD_FIELDS,
    NS,
    Trace,
    TraceError,
    TraceSet,
    auto_window,
    format_window,
    load_trace,
    parse_window,
)
from replay.trace import windows as trace_windows

T0 = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z, a whole number of days since the epoch
MS = 1_000_000
MATCH_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))
TAIL = ("num_waiting_uncached_tokens", "num_total_tokens", "max_running_requests",
        "total_prefill_uncached_tokens", "total_prefill_busy_us")


# ---------------------------------------------------------------------------
# writing traces


def write_parquet(path: Path, df: pl.DataFrame, row_group_size: int | None = None) -> Path:
    """Write ``df`` with pyarrow (exact row groups of ``row_group_size`` rows)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(df.to_arrow(), str(path), row_group_size=row_group_size)
    return path


def write_single(d: Path, req: pl.DataFrame, loads: pl.DataFrame,
                 workers: pl.DataFrame | None = None) -> Path:
    """The one-file layout: requests.parquet, loads.parquet (+ workers.parquet)."""
    write_parquet(d / "requests.parquet", req)
    write_parquet(d / "loads.parquet", loads)
    if workers is not None:
        write_parquet(d / "workers.parquet", workers)
    return d


def write_pieces(d: Path, kind: str, df: pl.DataFrame, cuts, names, row_group_size=None) -> None:
    """Split ``df`` at the row positions ``cuts`` into the files ``d/kind/names[i]``."""
    bounds = [0, *sorted(int(c) for c in cuts), df.height]
    assert len(names) == len(bounds) - 1
    for name, a, b in zip(names, bounds[:-1], bounds[1:], strict=True):
        write_parquet(d / kind / name, df.slice(a, b - a), row_group_size)


def piece_names(n: int, prefix: str = "date=2026-01-01") -> list[str]:
    """``n`` file names whose path order is their index order, at mixed depths."""
    out = []
    for i in range(n):
        deeper = "sub=x/" if i % 2 else ""
        out.append(f"{prefix}/h={i:03d}/{deeper}part-{i:03d}.parquet")
    return out


def request_frame(ts, ids, *, models=None, tokens=None, matches=None) -> pl.DataFrame:
    n = len(ts)
    cols = {
        "ts": pl.Series(list(ts), dtype=pl.Int64),
        "request_id": list(ids),
        "input_tokens": pl.Series(tokens if tokens is not None else [1024 + 64 * i for i in range(n)],
                                  dtype=pl.Int64),
        "query_blocks": pl.Series([2 + i % 3 for i in range(n)], dtype=pl.Int64),
        "matches": pl.Series(matches if matches is not None else
                             [[{"worker": f"http://w{i % 2}", "blocks": 1 + i % 3}] for i in range(n)],
                             dtype=MATCH_T),
    }
    if models is not None:
        cols["model"] = list(models)
    return pl.DataFrame(cols)


def load_frame(ts, workers, *, ranks=None, waiting=None) -> pl.DataFrame:
    n = len(ts)
    return pl.DataFrame({
        "ts": pl.Series(list(ts), dtype=pl.Int64),
        "worker": list(workers),
        "dp_rank": pl.Series(ranks if ranks is not None else [0] * n, dtype=pl.Int64),
        "num_running_reqs": pl.Series([i % 3 for i in range(n)], dtype=pl.Int64),
        "num_waiting_reqs": pl.Series(waiting if waiting is not None else [i % 4 for i in range(n)],
                                      dtype=pl.Int64),
        "num_tokens": pl.Series([100 * i for i in range(n)], dtype=pl.Int64),
        "max_total_num_tokens": pl.Series([100_000] * n, dtype=pl.Int64),
    })


# ---------------------------------------------------------------------------
# comparing


def assert_same_trace(a: Trace, b: Trace) -> None:
    """Every array, list and fact of two Traces equal (dtypes included); not path/files."""
    for f in dataclasses.fields(Trace):
        if f.name in ("path", "files"):
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if isinstance(va, np.ndarray) or isinstance(vb, np.ndarray):
            assert isinstance(va, np.ndarray) and isinstance(vb, np.ndarray), f.name
            assert va.dtype == vb.dtype, (f.name, va.dtype, vb.dtype)
            assert va.shape == vb.shape, (f.name, va.shape, vb.shape)
            assert np.array_equal(va, vb), f.name
        else:
            assert va == vb, f.name


def first_difference(a: dict, b: dict) -> str | None:
    """Where two decide_all results differ first (NaN equals NaN), or None."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape:
            return f"{name}: shape {x.shape} vs {y.shape}"
        same = (x == y) | (np.isnan(x) & np.isnan(y)) if x.dtype.kind == "f" else x == y
        if not same.all():
            i, c = np.argwhere(~same)[0]
            return f"{name} at request {i}, config {c}: {x[i, c]!r} vs {y[i, c]!r}"
    return None


def concat_decisions(parts: list[dict], n_configs: int) -> dict:
    if not parts:
        return empty_decisions(0, n_configs)
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}


def window_traces(d, window_ns: int, model: str | None = None) -> list[Trace]:
    return [w.trace for w in TraceSet.open(d).iter_windows(window_ns, model=model)]


# ---------------------------------------------------------------------------
# 1. layouts


def ties_trace() -> tuple[pl.DataFrame, pl.DataFrame]:
    """21 requests on only three distinct timestamps (unsorted on disk) and 15 load samples
    on four, so every split puts equal ``ts`` on both sides of a file boundary."""
    n = 21
    ts = [T0 + ((7 * i) % 3) * NS for i in range(n)]
    req = request_frame(ts, [f"r{i:02d}" for i in range(n)])
    lts = [T0 + ((5 * i) % 4) * NS // 2 for i in range(15)]
    loads = load_frame(lts, [f"http://w{i % 2}" for i in range(15)], waiting=[i % 5 for i in range(15)])
    return req, loads


@pytest.mark.parametrize("req_cuts, load_cuts, rgs", [
    ([], [], None),                       # one file per folder
    ([10], [7], 1),                       # two files, one row per row group
    ([3, 3, 9, 20], [0, 4, 15], 2),       # empty files (first, middle, last) and small groups
    (list(range(1, 21)), list(range(1, 15)), 1000),  # one row per file
    ([0, 21], [15], 4),                   # all rows in one middle file
])
def test_set_equals_single_file_for_any_split(tmp_path, req_cuts, load_cuts, rgs):
    req, loads = ties_trace()
    single = write_single(tmp_path / "single", req, loads)
    d = tmp_path / "set"
    write_pieces(d, "requests", req, req_cuts, piece_names(len(req_cuts) + 1), rgs)
    write_pieces(d, "loads", loads, load_cuts, piece_names(len(load_cuts) + 1, "day=1"), rgs)
    whole = load_trace(single)
    got = load_trace(d)
    assert_same_trace(whole, got)
    # stable order = file order: equal ts keep the on-disk (concatenated) order
    order = np.argsort(req["ts"].to_numpy(), kind="stable")
    assert got.request_id.tolist() == [req["request_id"][int(i)] for i in order]
    assert got.facts.requests_sorted_on_disk is False
    # provenance names every part file, relative to the trace directory
    names = {f"requests/{n}" for n in piece_names(len(req_cuts) + 1)}
    assert names <= set(got.files)
    for name in names:
        info = got.files[name]
        assert info["path"] == os.path.abspath(d / name) and info["bytes"] == (d / name).stat().st_size
    # the windowed path sees the same requests in the same order, and the same index
    tset = TraceSet.open(d)
    assert tset.n_requests == whole.n_requests and tset.n_load_rows == whole.load_ts.shape[0]
    assert tset.workers == whole.workers and tset.models == whole.models
    wins = list(tset.iter_windows(NS))
    assert [t for w in wins for t in w.trace.request_id.tolist()] == whole.request_id.tolist()
    assert np.concatenate([w.trace.req_index for w in wins]).tolist() == list(range(21))
    assert [w.first_request for w in wins] == [int(np.sum(whole.req_ts < w.t0)) for w in wins]


def test_path_order_is_component_by_component(tmp_path):
    """``a/..`` sorts before ``a-b/..`` (although '-' < '/'), ``part-10`` before ``part-9``;
    every request has the same ts, so the trace's order is exactly the file order."""
    d = tmp_path / "t"
    rels = ["part-9.parquet", "a-b/part.parquet", "a/sub/x.parquet", "a/part.parquet",
            "part-10.parquet", "a/sub=1/deeper/x.parquet"]
    for rel in rels:
        write_parquet(d / "requests" / rel, request_frame([T0], [rel]))
    write_parquet(d / "loads.parquet", load_frame([T0], ["http://w0"]))
    expect = ["a/part.parquet", "a/sub/x.parquet", "a/sub=1/deeper/x.parquet", "a-b/part.parquet",
              "part-10.parquet", "part-9.parquet"]
    assert load_trace(d).request_id.tolist() == expect
    assert [p.name for p in TraceSet.open(d).requests] == [f"requests/{r}" for r in expect]
    assert [t for tr in window_traces(d, NS) for t in tr.request_id.tolist()] == expect


def test_hidden_and_non_parquet_entries_are_skipped(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "requests" / "date=2026-01-01" / "part-0.parquet",
                  request_frame([T0, T0 + NS], ["a", "b"]))
    write_parquet(d / "loads" / "part-0.parquet", load_frame([T0], ["http://w0"]))
    junk = b"this is not parquet"
    for rel in ("requests/.x.parquet", "requests/_x.parquet", "requests/date=2026-01-01/.part-1.parquet",
                "requests/date=2026-01-01/_SUCCESS", "requests/_temporary/part-9.parquet",
                "requests/.hidden/part-9.parquet", "requests/date=2026-01-01/_tmp/deep/part.parquet",
                "requests/date=2026-01-01/part-0.parquet.crc", "requests/notes.txt",
                "requests/date=2026-01-01/part-2.parq", "loads/_common_metadata", "loads/.part-0.parquet.crc",
                "loads/README.md"):
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(junk)
    t = load_trace(d)
    assert t.request_id.tolist() == ["a", "b"]
    assert set(t.files) == {"requests/date=2026-01-01/part-0.parquet", "loads/part-0.parquet"}
    tset = TraceSet.open(d)
    assert [p.name for p in tset.requests] == ["requests/date=2026-01-01/part-0.parquet"]
    assert [p.name for p in tset.loads] == ["loads/part-0.parquet"]
    res = run_sweep(d, {"worker_queue_limit": [2]}, window="1s")
    assert res.run["execution"]["windows"] == 2 and res.run["trace"]["layout"] == "set"


def test_hive_segments_become_string_columns(tmp_path):
    d = tmp_path / "t"
    # no model column: the hive value (url-decoded) is the model
    write_parquet(d / "requests" / "model=llama" / "part.parquet",
                  request_frame([T0 + 2 * NS, T0], ["l1", "l0"]))
    write_parquet(d / "requests" / "model=mis%20tral" / "date=2026-01-01" / "part.parquet",
                  request_frame([T0 + NS], ["m0"]))
    # the file's own column wins over the path
    write_parquet(d / "requests" / "model=ignored" / "part.parquet",
                  request_frame([T0 + NS, T0 + 3 * NS], ["o0", "o1"], models=["own", None]))
    write_parquet(d / "loads" / "date=2026-01-01" / "part.parquet",
                  load_frame([T0, T0 + NS], ["http://w0", "http://w1"]))
    t = load_trace(d)
    assert t.models == ["default", "llama", "mis tral", "own"]
    got = dict(zip(t.request_id.tolist(), (t.models[m] for m in t.req_model), strict=True))
    assert got == {"l0": "llama", "l1": "llama", "m0": "mis tral", "o0": "own", "o1": "default"}
    assert t.request_id.tolist() == ["l0", "o0", "m0", "l1", "o1"]
    assert t.facts.models == {"default": 1, "llama": 2, "mis tral": 1, "own": 1}
    tset = TraceSet.open(d)
    assert tset.model_counts == t.facts.models and tset.models == t.models
    wins = window_traces(d, NS)
    assert [tr.models[m] for tr in wins for m in tr.req_model] == [got[i] for i in t.request_id]
    # --model selects a hive-given model, whole and windowed alike
    only = load_trace(d, model="llama")
    assert only.request_id.tolist() == ["l0", "l1"] and only.req_index.tolist() == [0, 3]
    by_win = window_traces(d, NS, model="llama")
    assert [i for tr in by_win for i in tr.request_id.tolist()] == ["l0", "l1"]
    assert np.concatenate([tr.req_index for tr in by_win]).tolist() == [0, 3]
    grid = {"worker_queue_limit": [None, 1]}
    mem = run_sweep(d, grid, model="llama", window="none")
    win = run_sweep(d, grid, model="llama", window="1s")
    assert_frame_equal(mem.summary, win.summary)
    assert win.run["trace"]["requests"] == 2 and win.run["execution"]["windows"] == 4


def test_hive_worker_column_for_loads_whole(tmp_path):
    """``loads/worker=<url-encoded>/..`` supplies the required ``worker`` column."""
    d = tmp_path / "t"
    write_parquet(d / "requests.parquet", request_frame([T0, T0 + NS], ["a", "b"]))
    for w in ("http://w0", "http://w1"):
        enc = w.replace(":", "%3A").replace("/", "%2F")
        write_parquet(d / "loads" / f"worker={enc}" / "part.parquet",
                      load_frame([T0, T0 + NS // 2], [w, w]).drop("worker"))
    t = load_trace(d)
    assert t.workers == ["http://w0", "http://w1"]
    assert t.load_worker.tolist() == [0, 1, 0, 1]


def test_hive_worker_column_for_loads_windowed(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "requests.parquet", request_frame([T0, T0 + NS], ["a", "b"]))
    write_parquet(d / "loads" / "worker=http%3A%2F%2Fw0" / "part.parquet",
                  load_frame([T0, T0 + NS // 2], ["x", "x"]).drop("worker"))
    wins = window_traces(d, NS)
    assert np.concatenate([tr.load_worker for tr in wins]).size >= 2


@pytest.mark.parametrize("kind", ["requests", "loads"])
def test_layout_errors(tmp_path, kind):
    other = "loads" if kind == "requests" else "requests"
    file_of = {"requests": "requests.parquet", "loads": "loads.parquet"}
    frames = {"requests": request_frame([T0], ["a"]), "loads": load_frame([T0], ["http://w0"])}

    def base(name):
        d = tmp_path / name
        write_parquet(d / file_of[other], frames[other])
        return d

    def check(d, *needles, start=None):
        for attempt in (lambda: load_trace(d), lambda: TraceSet.open(d),
                        lambda: run_sweep(d, {}, window="1s")):
            with pytest.raises(TraceError) as err:
                attempt()
            msg = str(err.value)
            assert "\n" not in msg
            for n in needles:
                assert n in msg, (n, msg)
            if start is not None:
                assert msg.startswith(start), msg

    both = base("both")
    write_parquet(both / file_of[kind], frames[kind])
    write_parquet(both / kind / "part-0.parquet", frames[kind])
    check(both, file_of[kind], f"{kind}/", "both")

    empty = base("empty")
    (empty / kind).mkdir()
    check(empty, f"{kind}/", "no .parquet files")

    ignored_only = base("ignored")
    (ignored_only / kind / "_tmp").mkdir(parents=True)
    write_parquet(ignored_only / kind / "_tmp" / "part-0.parquet", frames[kind])
    write_parquet(ignored_only / kind / ".part-1.parquet", frames[kind])
    (ignored_only / kind / "part-2.txt").write_text("x")
    check(ignored_only, f"{kind}/", "no .parquet files")

    neither = base("neither")
    check(neither, str(neither), start=f"{file_of[kind]}: file not found")


# ---------------------------------------------------------------------------
# 2. errors name the part file and the row inside it


def error_set(d: Path, *, req_mut=None, load_mut=None) -> Path:
    """A valid set: part-0 holds seconds 0..9, part-1 seconds 10..21 written newest first
    (unsorted on disk) in row groups of 4; ``*_mut`` change part-1's frame before writing."""
    r0 = request_frame([T0 + i * NS for i in range(10)], [f"p0-{i}" for i in range(10)])
    r1 = request_frame([T0 + (21 - i) * NS + 250 * MS for i in range(12)], [f"p1-{i}" for i in range(12)])
    l0 = load_frame([T0 + i * NS for i in range(10)], ["http://w0", "http://w1"] * 5)
    l1 = load_frame([T0 + (21 - i) * NS + 500 * MS for i in range(12)], ["http://w0", "http://w1"] * 6)
    if req_mut is not None:
        r1 = req_mut(r1)
    if load_mut is not None:
        l1 = load_mut(l1)
    write_parquet(d / "requests" / "date=x" / "part-0.parquet", r0, 4)
    write_parquet(d / "requests" / "date=x" / "part-1.parquet", r1, 4)
    write_parquet(d / "loads" / "date=x" / "part-0.parquet", l0, 4)
    write_parquet(d / "loads" / "date=x" / "part-1.parquet", l1, 4)
    return d


def set_row(df: pl.DataFrame, col: str, row: int, value, dtype=None) -> pl.DataFrame:
    values = df[col].to_list()
    values[row] = value
    return df.with_columns(pl.Series(col, values, dtype=dtype or df[col].dtype))


def bad_blocks(df):
    m = df["matches"].to_list()
    m[7] = [{"worker": "http://w0", "blocks": 1}, {"worker": "http://w1", "blocks": -2}]
    return df.with_columns(pl.Series("matches", m, dtype=MATCH_T))


ROW_ERRORS = {
    "negative input_tokens": (
        dict(req_mut=lambda df: set_row(df, "input_tokens", 7, -3)),
        "requests/date=x/part-1.parquet: column 'input_tokens' row 7: must be >= 0, got -3"),
    "negative num_waiting_reqs": (
        dict(load_mut=lambda df: set_row(df, "num_waiting_reqs", 7, -1)),
        "loads/date=x/part-1.parquet: column 'num_waiting_reqs' row 7: must be >= 0, got -1"),
    "null ts in loads": (
        dict(load_mut=lambda df: set_row(df, "ts", 7, None)),
        "loads/date=x/part-1.parquet: column 'ts' row 7:"),
    "null worker": (
        dict(load_mut=lambda df: set_row(df, "worker", 7, None)),
        "loads/date=x/part-1.parquet: column 'worker' row 7:"),
    "negative match blocks": (
        dict(req_mut=bad_blocks),
        "requests/date=x/part-1.parquet: column 'matches' row 7: entry 1 blocks must be >= 0, got -2"),
}
TYPE_ERRORS = {
    "requests type mismatch": (
        dict(req_mut=lambda df: df.with_columns(pl.col("input_tokens").cast(pl.Float64))),
        "requests/date=x/part-1.parquet: column 'input_tokens'"),
    "loads type mismatch": (
        dict(load_mut=lambda df: df.with_columns(pl.col("num_tokens").cast(pl.String))),
        "loads/date=x/part-1.parquet: column 'num_tokens'"),
}
DUPLICATE = (
    dict(req_mut=lambda df: set_row(df, "request_id", 7, "p0-2")),
    "requests/date=x/part-1.parquet: column 'request_id' row 7: duplicate request_id 'p0-2' "
    "(first at requests/date=x/part-0.parquet row 2)")


def raise_whole(d, out=None):
    load_trace(d)


def raise_windows(d, out=None):
    for _ in TraceSet.open(d).iter_windows(NS):
        pass


def raise_sweep(d, out=None):
    run_sweep(d, {"worker_queue_limit": [None, 2]}, window="1s", out=out, report=False)


PATHS = {"load_trace": raise_whole, "iter_windows": raise_windows, "run_sweep": raise_sweep}


def error_cases():
    for name, (mut, prefix) in ROW_ERRORS.items():
        for path in PATHS:
            yield pytest.param(mut, prefix, path, id=f"{name}-{path}")
    for name, (mut, prefix) in TYPE_ERRORS.items():
        for path in PATHS:
            marks = []
            yield pytest.param(mut, prefix, path, id=f"{name}-{path}", marks=marks)


@pytest.mark.parametrize("mut, prefix, path", list(error_cases()))
def test_errors_name_part_file_and_row(tmp_path, mut, prefix, path):
    d = error_set(tmp_path / "t", **mut)
    runs = tmp_path / "runs"
    runs.mkdir()
    with pytest.raises(TraceError) as err:
        PATHS[path](d, runs / "run")
    msg = str(err.value)
    assert msg.startswith(prefix), msg
    assert "\n" not in msg
    assert os.listdir(runs) == []          # nothing left behind, not even a hidden partial dir


@pytest.mark.parametrize("name", list(TYPE_ERRORS))
def test_type_mismatch_names_later_file_when_files_share_a_window(tmp_path, name):
    mut, prefix = TYPE_ERRORS[name]
    d = error_set(tmp_path / "t", **mut)
    with pytest.raises(TraceError) as err:
        for _ in TraceSet.open(d).iter_windows(3600 * NS):
            pass
    assert str(err.value).startswith(prefix + ": type "), str(err.value)
    assert "differs from" in str(err.value) and "date=x/part-0.parquet" in str(err.value)


def test_duplicate_request_id(tmp_path):
    """Duplicates are an error naming both rows, whole and within a window; across windows a
    windowed sweep does not see them (documented in traces/README.md: ids are only echoed)."""
    mut, prefix = DUPLICATE
    d = error_set(tmp_path / "t", **mut)
    with pytest.raises(TraceError) as err:
        load_trace(d)
    assert str(err.value) == prefix
    with pytest.raises(TraceError) as err:
        for _ in TraceSet.open(d).iter_windows(3600 * NS):
            pass
    assert str(err.value) == prefix
    with pytest.raises(TraceError) as err:
        run_sweep(d, {}, window="none")
    assert str(err.value) == prefix
    res = run_sweep(d, {}, window="1s")
    assert res.run["trace"]["requests"] == 22


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_line_error(res, prefix):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: " + prefix), lines[0]
    assert "Traceback" not in res.output


def cli_cases():
    for name, (mut, prefix) in ROW_ERRORS.items():
        yield pytest.param(mut, prefix, id=name)
    for name, (mut, prefix) in TYPE_ERRORS.items():
        yield pytest.param(mut, prefix, id=name)


@pytest.mark.parametrize("mut, prefix", list(cli_cases()))
def test_cli_error_is_one_line_and_leaves_no_run(tmp_path, mut, prefix):
    d = error_set(tmp_path / "t", **mut)
    runs = tmp_path / "runs"
    runs.mkdir()
    res = cli("sweep", d, "--out", runs / "run", "--window", "1s", "--worker-queue-limit", "none,2")
    assert_one_line_error(res, prefix)
    assert os.listdir(runs) == []


def test_cli_layout_error_and_bad_window(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "loads.parquet", load_frame([T0], ["http://w0"]))
    (d / "requests").mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    assert_one_line_error(cli("sweep", d, "--out", runs / "run", "--window", "1s"), "requests/: no .parquet")
    write_parquet(d / "requests" / "part.parquet", request_frame([T0], ["a"]))
    for bad in ("1w", "0.5h", "-1", ""):
        assert_one_line_error(cli("sweep", d, "--out", runs / "run", "--window", bad), "--window must be")
    assert os.listdir(runs) == []


def test_empty_row_group_in_the_middle_of_a_file(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "loads.parquet", load_frame([T0], ["http://w0"]))
    table = request_frame([T0 + i * NS for i in range(6)], list("abcdef")).to_arrow()
    (d / "requests").mkdir()
    with pq.ParquetWriter(str(d / "requests" / "part-0.parquet"), table.schema) as w:
        w.write_table(table.slice(0, 3))
        w.write_table(table.slice(0, 0))
        w.write_table(table.slice(3, 3))
    assert pq.ParquetFile(str(d / "requests" / "part-0.parquet")).metadata.num_row_groups == 3
    assert load_trace(d).request_id.tolist() == list("abcdef")
    assert [i for tr in window_traces(d, 3600 * NS) for i in tr.request_id.tolist()] == list("abcdef")


def test_empty_workers_table_with_matches(tmp_path):
    d = write_single(tmp_path / "t", request_frame([T0], ["a"]), load_frame([T0], ["http://w0"]),
                     pl.DataFrame({"worker": pl.Series([], dtype=pl.String)}))
    t = load_trace(d)
    assert t.match_worker.tolist() == [-1] and t.fleet(0).tolist() == []


def test_match_block_widths_may_differ_between_files(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "loads.parquet", load_frame([T0], ["http://w0"]))
    write_parquet(d / "requests" / "p0.parquet", request_frame([T0], ["a"]))
    narrow = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.UInt32}))
    write_parquet(d / "requests" / "p1.parquet", request_frame([T0 + NS], ["b"]).with_columns(
        pl.col("matches").cast(narrow)))
    assert load_trace(d).match_blocks.tolist() == [1, 1]


def test_datetime_units_mixed_across_files_whole_and_windowed_agree(tmp_path):
    d = tmp_path / "t"
    write_parquet(d / "loads.parquet", load_frame([T0], ["http://w0"]))
    write_parquet(d / "requests" / "p0.parquet",
                  request_frame([T0], ["a"]).with_columns(pl.col("ts").cast(pl.Datetime("ns"))))
    write_parquet(d / "requests" / "p1.parquet",
                  request_frame([T0 + NS], ["b"]).with_columns(pl.col("ts").cast(pl.Datetime("us"))))
    outcomes = []
    for read in (lambda: load_trace(d).req_ts.tolist(),
                 lambda: [t for tr in window_traces(d, NS) for t in tr.req_ts.tolist()]):
        try:
            outcomes.append(read())
        except TraceError:
            outcomes.append("TraceError")
    assert outcomes[0] == outcomes[1]


# ---------------------------------------------------------------------------
# 3. windows are exact: a hand-built trace full of boundary cases

EDGE_WORKERS = pl.DataFrame({
    "worker": ["http://a0", "http://a1", "http://a2", "http://b0", "http://b1", "http://d0"],
    "model": ["a", "a", "a", "b", "b", "a"],
    "role": ["prefill", "prefill", "plain", "prefill", "prefill", "decode"],
    "dp_size": pl.Series([2, 2, 1, 1, None, 1], dtype=pl.Int64),
})
# the trace covers seconds [0, 30) and [33, 37); 25..30 has samples but no request, 30..33 nothing
LATE = list(range(33_000, 37_000, 1000))


def edge_loads() -> pl.DataFrame:
    rows: list[dict] = []
    counters: dict[tuple[str, int], tuple[int, int]] = {}

    def sample(t_ms, worker, rank, waiting, *, tail=True, inflight=None, partial=False):
        n = len(rows)
        ptok, pbusy = counters.get((worker, rank), (0, 0))
        ptok += 500 + 131 * (n % 7)                 # monotonic per publisher, uneven rates
        pbusy += 30_000 + 11_000 * (n % 5)
        counters[(worker, rank)] = (ptok, pbusy)
        row = dict(ts=T0 + t_ms * MS, worker=worker, dp_rank=rank, num_running_reqs=1 + n % 4,
                   num_waiting_reqs=waiting, num_tokens=4_000 + 900 * waiting,
                   max_total_num_tokens=100_000, router_inflight=inflight)
        vals = (700 * waiting + 100 * (n % 3), 6_000 + 800 * waiting, 16, ptok, pbusy)
        for c, v in zip(TAIL, vals, strict=True):
            row[c] = v if tail else None
        if partial:
            row["num_waiting_uncached_tokens"] = None   # a partial tail counts as no tail
        rows.append(row)

    # a0 (dp 2): rank 0 on every whole second (exactly on window boundaries), no tail at 4-5 s;
    # rank 1 on the half seconds but silent from 8.5 s to 13.5 s (longer than 1..3 s windows,
    # still fresh at 13.5 s), so its state must come from the carry
    for t in [*range(0, 30_000, 1000), *LATE]:
        sample(t, "http://a0", 0, (3 * t // 1000) % 5, tail=t not in (4000, 5000))
    for t in [*range(500, 30_000, 1000), *(x + 500 for x in LATE)]:
        if not 9_000 < t < 13_000:
            sample(t, "http://a0", 1, (t // 1000) % 3)
    # a0 rank 2 >= dp_size: ignored for loads, but its router_inflight is a0's
    sample(3_250, "http://a0", 2, 9, inflight=4)
    sample(20_250, "http://a0", 2, 9, inflight=1)
    # a1 (dp 2): router_inflight on rank 0 until 6 s, then null until 16 s (the 4 s value
    # must carry through the windows), then again; rank 1 has no tail before 10 s
    for t in [*range(0, 30_000, 2000), 34_000, 36_000]:
        inf = 1 + t // 2000 if t < 6000 else (None if t < 16_000 else (t // 1000) % 3)
        sample(t, "http://a1", 0, (t // 2000) % 4, inflight=inf)
    for t in [*range(1000, 30_000, 2000), 33_000, 35_000]:
        sample(t, "http://a1", 1, 2 - (t // 2000) % 3, tail=t >= 10_000)
    # a2 (dp 1): an old publisher (no tail), silent from 5 s to 19 s (stale)
    for t in [*range(0, 6000, 1000), *range(19_000, 30_000, 1000), *LATE]:
        sample(t, "http://a2", 0, 0, tail=False)
    # b0 (dp 1): partial tails at 10.75 s and 11.75 s
    for t in [*range(750, 30_000, 1000), *(x + 750 for x in LATE)]:
        sample(t, "http://b0", 0, (t // 1000) % 4, partial=t in (10_750, 11_750))
    # b1 (dp unknown): rank 1 only appears at 12 s
    for t in [*range(0, 30_000, 1500), *LATE]:
        sample(t, "http://b1", 0, (t // 1500) % 3)
    for t in [*range(12_000, 30_000, 3000), 33_000, 36_000]:
        sample(t, "http://b1", 1, 1 + (t // 3000) % 2)
    # a decode peer
    for t in range(0, 30_000, 3000):
        sample(t, "http://d0", 0, 0, tail=False)
    schema = {"ts": pl.Int64, "worker": pl.String, "dp_rank": pl.Int64, "num_running_reqs": pl.Int64,
              "num_waiting_reqs": pl.Int64, "num_tokens": pl.Int64, "max_total_num_tokens": pl.Int64,
              "router_inflight": pl.Int64, **{c: pl.Int64 for c in TAIL}}
    # on disk by publisher, not by time
    return pl.DataFrame(rows, schema=schema)


def edge_requests() -> pl.DataFrame:
    times = sorted([*range(0, 25_000, 1000), *range(500, 25_000, 1000), 7_000, *LATE, 36_999])
    fleets = {"a": ["http://a0", "http://a1", "http://a2"], "b": ["http://b0", "http://b1"]}
    rows = []
    for i, t in enumerate(times):
        model = "b" if i % 3 == 2 else "a"
        fleet = fleets[model]
        if i % 5 == 4:
            matches = []
        else:
            order = fleet[i % len(fleet):] + fleet[:i % len(fleet)]
            matches = [{"worker": w, "blocks": b} for w, b in zip(order, (6 + i % 4, 3, 1), strict=False)]
            if i % 7 == 0:
                matches.append({"worker": "http://zz-unknown", "blocks": 2})
        tokens = 1024 + (i * 733) % 5000
        rows.append(dict(ts=T0 + t * MS, request_id=f"r{i:03d}", model=model, input_tokens=tokens,
                         query_blocks=None if i % 11 == 0 else (tokens + 511) // 512, matches=matches,
                         selected_worker=matches[0]["worker"] if i % 3 == 0 and matches else None))
    return pl.DataFrame(rows, schema={"ts": pl.Int64, "request_id": pl.String, "model": pl.String,
                                      "input_tokens": pl.Int64, "query_blocks": pl.Int64,
                                      "matches": MATCH_T, "selected_worker": pl.String})


EDGE_GRID = {"worker_queue_limit": [None, 1, 3], "saturation_queue_floor": [None, 1, 2],
             "pressure_abs_threshold_ms": [None, 20.0], "cache_affinity_min_matched_tokens": [0, 1024]}


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    root = tmp_path_factory.mktemp("edge")
    req, loads = edge_requests(), edge_loads()
    single = write_single(root / "single", req, loads, EDGE_WORKERS)
    d = root / "set"
    write_parquet(d / "workers.parquet", EDGE_WORKERS)
    ts_s = (req["ts"].to_numpy() - T0) // NS
    cuts = [int(np.searchsorted(ts_s, 10)), int(np.searchsorted(ts_s, 20))]
    write_pieces(d, "requests", req, cuts, ["date=2026-01-01/part-00.parquet",
                                            "date=2026-01-01/part-01.parquet",
                                            "date=2026-01-02/h=00/part-02.parquet"], 5)
    write_pieces(d, "loads", loads, [61, 62, 150], ["part-0.parquet", "part-1.parquet",
                                                   "part-2.parquet", "sub=x/part-3.parquet"], 7)
    cache: dict = {}

    def whole(model=None):
        if model not in cache:
            cache[model] = outputs(single, root / f"whole-{model}", window="none", model=model)
        return cache[model]

    return dict(root=root, single=single, set=d, whole=whole)


def outputs(src, out, **kw) -> dict:
    res = run_sweep(src, EDGE_GRID, out=out, report=False, **kw)
    return dict(res=res, summary=pl.read_parquet(out / "summary.parquet"),
                decisions=pl.read_parquet(out / "decisions.parquet"),
                fleet=pl.read_parquet(out / "fleet.parquet"),
                run=json.loads((out / "run.json").read_text()))


def test_edge_trace_set_reads_like_the_single_files(edge):
    whole, got = load_trace(edge["single"]), load_trace(edge["set"])
    assert_same_trace(whole, got)
    f = whole.facts
    # the trace holds what the window tests rely on
    assert f.ignored_rank_rows == 2 and f.load_rows_partial_tail == 2
    assert f.load_rows_with_tail > 0 and f.load_rows_without_tail > 0
    assert f.loads_sorted_on_disk is False and f.has_router_inflight
    assert f.unknown_match_entries > 0 and f.models == {"a": 38, "b": 18}
    on_boundary = whole.req_ts % NS == 0
    assert on_boundary.sum() > 20 and (whole.load_ts % NS == 0).sum() > 50
    tset = TraceSet.open(edge["set"])
    assert tset.n_requests == whole.n_requests and tset.n_load_rows == whole.load_ts.shape[0]
    assert tset.workers == whole.workers and tset.models == whole.models
    assert tset.model_counts == f.models
    assert tset.fleet_dp_sizes() == whole.fleet_dp_sizes()
    assert [tset.fleet(m).tolist() for m in range(2)] == [whole.fleet(m).tolist() for m in range(2)]


@pytest.mark.parametrize("window, model", [
    ("1s", None), ("2s", None), ("3s", None), ("7s", None), ("1m", None), ("1d", None),
    ("1s", "b"), ("4s", "a"),
])
def test_windowed_sweep_equals_in_memory_sweep(edge, tmp_path, window, model):
    whole = edge["whole"](model)
    got = outputs(edge["set"], tmp_path / "run", window=window, model=model)
    assert_frame_equal(got["res"].summary, whole["res"].summary)
    assert_frame_equal(got["summary"], whole["summary"])
    assert_frame_equal(got["decisions"], whole["decisions"])
    assert_frame_equal(got["fleet"], whole["fleet"])
    assert got["run"]["trace"]["facts"] == whole["run"]["trace"]["facts"]
    for key in ("requests", "workers", "models"):
        assert got["run"]["trace"][key] == whole["run"]["trace"][key]
    assert got["run"]["config_ids"] == whole["run"]["config_ids"]
    ex = got["run"]["execution"]
    window_ns = parse_window(window)
    assert ex["window_s"] == window_ns // NS
    assert ex["windows"] == len(TraceSet.open(edge["set"]).window_bounds(window_ns))
    if window == "1d":
        assert ex["windows"] == 1
    if window == "1s":
        assert ex["windows"] >= 34            # every used second of [0, 30) and [33, 37)
    assert whole["run"]["execution"]["windows"] == 1
    assert got["run"]["trace"]["layout"] == "set" and whole["run"]["trace"]["layout"] == "files"
    assert set(got["run"]["trace"]["files"]) == {
        "workers.parquet", "requests/date=2026-01-01/part-00.parquet",
        "requests/date=2026-01-01/part-01.parquet", "requests/date=2026-01-02/h=00/part-02.parquet",
        "loads/part-0.parquet", "loads/part-1.parquet", "loads/part-2.parquet", "loads/sub=x/part-3.parquet"}
    assert all("sha256" in info for info in got["run"]["trace"]["files"].values())


def test_edge_outputs_exercise_the_state(edge):
    """The in-memory sweep of the edge trace shows the states the windows must reproduce."""
    w = edge["whole"]()
    dec, fleet = w["decisions"], w["fleet"]
    assert dec["selected_queue_ms"].is_not_null().any()          # throughput estimates
    sources = set(dec["pressure_source"].drop_nulls().unique())
    assert {"estimated_prefill_queue_ms", "native_queue_tokens"} <= sources <= set(labels.PRESSURE_SOURCES)
    assert dec["reason"].drop_nulls().n_unique() >= 4
    assert fleet["fleet_min_waiting"].drop_nulls().n_unique() >= 2


def _replace_loads(tr: Trace, keep: np.ndarray) -> Trace:
    return dataclasses.replace(tr, **{f: getattr(tr, f)[keep] for f in LOAD_FIELDS})


def test_edge_windows_need_the_whole_carry(edge):
    """decide_all over 1 s windows equals the whole trace; without the carry, with only each
    rank's last carried sample, or without the extra router_inflight rows it does not (so the
    edge trace really tests each part of the carry)."""
    cfgs = Grid(EDGE_GRID).configs
    whole = engine.decide_all(load_trace(edge["single"]), cfgs, seed=3)
    variants: dict[str, list] = {"full": [], "no carry": [], "last sample only": [], "no inflight rows": []}
    carried = 0
    for win in TraceSet.open(edge["set"]).iter_windows(NS):
        tr, k = win.trace, win.carry_rows
        carried += k
        n = tr.load_ts.shape[0]
        idx = np.arange(n)
        key = tr.load_worker[:k].astype(np.int64) * 1000 + tr.load_rank[:k]
        last_of_key = np.array([i == max(np.nonzero(key == key[i])[0]) for i in range(k)], dtype=bool)
        second_of_key = np.array([np.sum(key[i + 1:] == key[i]) == 1 for i in range(k)], dtype=bool)
        variants["full"].append(engine.decide_all(tr, cfgs, seed=3))
        variants["no carry"].append(engine.decide_all(_replace_loads(tr, idx[k:]), cfgs, seed=3))
        # drop each rank's second-to-last carried sample: throughput deltas lose their base
        keep = np.concatenate([idx[:k][~second_of_key | (tr.load_router_inflight[:k] >= 0)], idx[k:]])
        variants["last sample only"].append(engine.decide_all(_replace_loads(tr, keep), cfgs, seed=3))
        # a naive carry: the last two samples of each rank, nothing more
        keep = np.concatenate([idx[:k][last_of_key | second_of_key], idx[k:]])
        variants["no inflight rows"].append(engine.decide_all(_replace_loads(tr, keep), cfgs, seed=3))
    assert carried > 0
    n_cfg = len(cfgs)
    assert first_difference(whole, concat_decisions(variants["full"], n_cfg)) is None
    for name in ("no carry", "last sample only", "no inflight rows"):
        assert first_difference(whole, concat_decisions(variants[name], n_cfg)) is not None, name


# ---------------------------------------------------------------------------
# 3b. property: decide_all over windows == decide_all on the whole trace

PROPERTY_CONFIGS = [
    RouterConfig(),
    RouterConfig(worker_queue_limit=2),
    RouterConfig(worker_queue_limit=2, saturation_queue_floor=1),
    RouterConfig(worker_queue_limit=1, saturation_queue_floor=1, min_load_choices=3),
    RouterConfig(min_load_choices=1, pressure_abs_threshold_ms=5.0, pressure_rel_threshold=1.2),
    RouterConfig(pressure_guard=False, cache_affinity_min_matched_tokens=0, cache_switch_margin_tokens=0),
    RouterConfig(worker_queue_limit=5, saturation_queue_floor=3, min_load_choices=9,
                 cache_affinity_min_match_ratio=0.3, cache_candidate_min_workers=2),
]

# split points as thousandths of the table's height
CUTS = st.lists(st.integers(0, 1000), max_size=4)
shapes = shape_strategy(max_requests=50, max_workers=5, max_loads=200, spans=[3.0, 12.0, 30.0],
                        max_matches=4, queue_max=[0, 3, 8])


def frames_of(tr: Trace, base_ns: int):
    """A factory Trace as the three Parquet tables (unknown match workers get a made-up URL)."""
    def name(w):
        return tr.workers[int(w)] if w >= 0 else "http://zz-unknown"

    offs = tr.match_offsets
    matches = [[{"worker": name(w), "blocks": int(b)}
                for w, b in zip(tr.match_worker[a:b], tr.match_blocks[a:b], strict=True)]
               for a, b in zip(offs[:-1], offs[1:], strict=True)]
    req = {
        "ts": pl.Series(tr.req_ts + base_ns, dtype=pl.Int64),
        "request_id": pl.Series(tr.request_id, dtype=pl.Int64),
        "model": pl.Series([tr.models[m] for m in tr.req_model], dtype=pl.String),
        "input_tokens": pl.Series(tr.req_input_tokens, dtype=pl.Int64),
        "query_blocks": pl.Series(tr.req_query_blocks, dtype=pl.Int64),
        "matches": pl.Series(matches, dtype=MATCH_T),
        "best_prefix_blocks": pl.Series(tr.req_best_prefix_blocks, dtype=pl.Int64),
    }
    if tr.req_selected_worker is not None:
        req["selected_worker"] = pl.Series([name(s) if s >= 0 else None for s in tr.req_selected_worker],
                                           dtype=pl.String)
    tail = tr.load_has_tail

    def tail_col(a):
        return pl.Series([int(v) if t else None for v, t in zip(a, tail, strict=True)], dtype=pl.Int64)

    loads = pl.DataFrame({
        "ts": pl.Series(tr.load_ts + base_ns, dtype=pl.Int64),
        "worker": pl.Series([tr.workers[w] for w in tr.load_worker], dtype=pl.String),
        "dp_rank": pl.Series(tr.load_rank, dtype=pl.Int64),
        "num_running_reqs": pl.Series(tr.load_running, dtype=pl.Int64),
        "num_waiting_reqs": pl.Series(tr.load_waiting, dtype=pl.Int64),
        "num_tokens": pl.Series(tr.load_num_tokens, dtype=pl.Int64),
        "max_total_num_tokens": pl.Series(tr.load_max_total, dtype=pl.Int64),
        "num_waiting_uncached_tokens": tail_col(tr.load_waiting_uncached),
        "num_total_tokens": tail_col(tr.load_total_tokens),
        "max_running_requests": tail_col(tr.load_max_running),
        "total_prefill_uncached_tokens": tail_col(tr.load_prefill_tokens),
        "total_prefill_busy_us": tail_col(tr.load_prefill_busy_us),
        "router_inflight": pl.Series([int(v) if v >= 0 else None for v in tr.load_router_inflight],
                                     dtype=pl.Int64),
    })
    workers = None
    if tr.has_workers_table:
        workers = pl.DataFrame({
            "worker": pl.Series(tr.workers, dtype=pl.String),
            "model": pl.Series([tr.models[m] for m in tr.worker_model], dtype=pl.String),
            "role": pl.Series([labels.ROLES[r] for r in tr.worker_role], dtype=pl.String),
            "dp_size": pl.Series([int(x) if x > 0 else None for x in tr.worker_dp_size], dtype=pl.Int64),
        })
    return pl.DataFrame(req), loads, workers


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, base_ns=st.sampled_from([0, T0 + 123_456_789]),
       shuffle=st.booleans(), req_cuts=CUTS, load_cuts=CUTS, rgs=st.sampled_from([1, 5, 64, None]),
       window_s=st.one_of(st.integers(1, 4), st.integers(5, 40)), model=st.sampled_from([None, "m0", "m1"]),
       rng_seed=st.integers(0, 2**63 - 1))
@example(seed=5, shape=Shape(n_requests=50, n_workers=5, n_loads=200, span_s=30.0, n_models=2),
         base_ns=T0, shuffle=True, req_cuts=[0, 333, 500, 501], load_cuts=[250, 990], rgs=5,
         window_s=3, model="m1", rng_seed=11)
@example(seed=8, shape=Shape(n_requests=40, n_workers=4, n_ranks=3, n_loads=150, span_s=12.0,
                             workers_table=False, tail_share=0.5),
         base_ns=0, shuffle=False, req_cuts=[100, 900], load_cuts=[1000, 0, 450], rgs=1,
         window_s=1, model=None, rng_seed=2**40)
def test_property_windows_decide_like_the_whole_trace(tmp_path_factory, seed, shape, base_ns, shuffle,
                                                      req_cuts, load_cuts, rgs, window_s, model, rng_seed):
    req, loads, workers = frames_of(random_trace(seed, shape), base_ns)
    if shuffle:  # unsorted on disk: the single file and the set share the row order
        perm = np.random.default_rng(seed)
        req = req[perm.permutation(req.height)]
        loads = loads[perm.permutation(loads.height)]
    root = tmp_path_factory.mktemp("prop")
    single = write_single(root / "single", req, loads, workers)
    d = root / "set"
    if workers is not None:
        write_parquet(d / "workers.parquet", workers)
    req_cuts = [req.height * c // 1000 for c in req_cuts]
    load_cuts = [loads.height * c // 1000 for c in load_cuts]
    write_pieces(d, "requests", req, req_cuts, piece_names(len(req_cuts) + 1), rgs)
    write_pieces(d, "loads", loads, load_cuts, piece_names(len(load_cuts) + 1, "day=0"), rgs)

    whole_all = load_trace(single)
    assert_same_trace(whole_all, load_trace(d))
    if model is not None and whole_all.facts.models.get(model, 0) == 0:
        with pytest.raises(TraceError, match="no request has model"):
            load_trace(single, model=model)
        with pytest.raises(TraceError, match="no request has model"):
            next(TraceSet.open(d).iter_windows(window_s * NS, model=model))
        model = None
    whole = load_trace(single, model=model)
    expect = engine.decide_all(whole, PROPERTY_CONFIGS, seed=rng_seed)
    wins = list(TraceSet.open(d).iter_windows(window_s * NS, model=model))
    got = concat_decisions([engine.decide_all(w.trace, PROPERTY_CONFIGS, seed=rng_seed) for w in wins],
                           len(PROPERTY_CONFIGS))
    assert first_difference(expect, got) is None, first_difference(expect, got)
    ids = [i for w in wins for i in w.trace.request_id.tolist()]
    assert ids == whole.request_id.tolist()
    idx = np.concatenate([w.trace.req_index for w in wins]) if wins else np.zeros(0, np.int64)
    assert idx.tolist() == whole.req_index.tolist()
    for w in wins:
        assert w.t1 - w.t0 == window_s * NS and w.t0 % (window_s * NS) == 0
        assert ((w.trace.req_ts >= w.t0) & (w.trace.req_ts < w.t1)).all()
        assert (w.trace.load_ts[:w.carry_rows] < w.t0).all()
        assert ((w.trace.load_ts[w.carry_rows:] >= w.t0) & (w.trace.load_ts[w.carry_rows:] < w.t1)).all()


# ---------------------------------------------------------------------------
# 4. window sizes


@pytest.mark.parametrize("text, expect", [
    ("auto", None), ("AUTO", None), ("none", 0), ("0", 0), ("off", 0), ("90s", 90 * NS),
    ("15m", 900 * NS), ("1h", 3600 * NS), ("1d", 86_400 * NS), ("3600", 3600 * NS), (" 2H ", 7200 * NS),
])
def test_parse_window_accepts(text, expect):
    assert parse_window(text) == expect


@pytest.mark.parametrize("text", ["0.5h", "-1", "", "1w", "0s", "1.5", "h", "1 h 2m", "none1"])
def test_parse_window_rejects(text):
    with pytest.raises(ParamError, match="^window must be") as err:
        parse_window(text)
    assert err.value.flag == "--window"


def test_format_window():
    assert [format_window(s * NS) for s in (1, 90, 120, 3600, 5400, 86_400, 90_000)] == \
        ["1s", "90s", "2m", "1h", "90m", "1d", "25h"]


def test_sweep_refuses_bad_windows(edge):
    for bad in ("0.5h", "1w", 1_500_000_000, NS // 2):
        with pytest.raises(ReplayError, match="window must"):
            run_sweep(edge["set"], {}, window=bad)


def test_auto_window(edge, tmp_path, monkeypatch):
    tset = TraceSet.open(edge["set"])
    assert auto_window(tset) == 0
    small = run_sweep(edge["set"], EDGE_GRID, window="auto", report=False)
    assert small.run["execution"]["windows"] == 1 and small.run["execution"]["window_s"] is None
    # make the 56-request trace "large": windows of about 10 requests over its ~37 s span,
    # i.e. at most floor(10 / (56 / 37 s)) = 6 s
    monkeypatch.setattr(trace_windows, "AUTO_IN_MEMORY_REQUESTS", 40)
    monkeypatch.setattr(trace_windows, "AUTO_WINDOW_REQUESTS", 10)
    monkeypatch.setattr(trace_windows, "AUTO_WINDOW_LOAD_ROWS", 10_000_000)
    w = auto_window(tset)
    assert w % NS == 0 and NS <= w <= 6 * NS
    got = outputs(edge["set"], tmp_path / "auto", window="auto")
    whole = edge["whole"]()
    assert got["run"]["execution"]["window_s"] == w // NS and got["run"]["execution"]["windows"] > 1
    assert_frame_equal(got["summary"], whole["summary"])
    assert_frame_equal(got["decisions"], whole["decisions"])
    assert_frame_equal(got["fleet"], whole["fleet"])
    assert got["run"]["trace"]["facts"] == whole["run"]["trace"]["facts"]


# ---------------------------------------------------------------------------
# 5. the CLI's window summary


def test_cli_reports_windows(edge, tmp_path):
    out = tmp_path / "run"
    res = cli("sweep", edge["set"], "--out", out, "--window", "1s", "--worker-queue-limit", "none,2",
              "--no-report")
    assert res.exit_code == 0, (res.output, res.exception)
    run = json.loads((out / "run.json").read_text())
    n = run["execution"]["windows"]
    assert n > 30
    line = next(x for x in res.stdout.splitlines() if x.startswith("replayed "))
    assert f"({n} windows of 1s) -> {out}" in line
    assert line.startswith("replayed 56 requests x 2 configs = 112 decisions in ")
    mem = tmp_path / "mem"
    res = cli("sweep", edge["single"], "--out", mem, "--window", "none", "--worker-queue-limit", "none,2",
              "--no-report")
    assert res.exit_code == 0 and "windows of" not in res.stdout
    assert_frame_equal(pl.read_parquet(out / "decisions.parquet"), pl.read_parquet(mem / "decisions.parquet"))


def test_stray_huge_rank_is_ignored_not_allocated(tmp_path):
    """A sample of rank 2**31-1 on a worker with dp_size 2 is ignored for loads
    (its router_inflight still counts): the per-rank table keeps 2 slots, and
    the decisions equal those with the rank written as 2 (also ignored), whole
    and in 1 s windows."""
    from replay.config import Grid
    from replay.trace.synthetic import generate_trace

    grid = Grid.from_texts({"--worker-queue-limit": "2,4", "--saturation-queue-floor": "none,1"}).configs
    out = []
    for rank in (2**31 - 1, 2):
        d = tmp_path / f"r{rank}"
        generate_trace(d, n_requests=400, n_workers=4, dp_size=2, seed=2)
        loads = pl.read_parquet(d / "loads.parquet")
        loads = loads.with_columns(pl.when(pl.int_range(pl.len()) % 50 == 7).then(rank)
                                   .otherwise(pl.col("dp_rank")).alias("dp_rank"))
        loads.write_parquet(d / "loads.parquet")
        tr = load_trace(d)
        assert engine.n_rank_slots(tr) == 2
        whole = engine.decide_all(tr, grid)
        wins = [engine.decide_all(w.trace, grid) for w in TraceSet.open(d).iter_windows(NS)]
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([w[k] for w in wins]), whole[k])
        out.append(whole)
    for k in out[0]:
        np.testing.assert_array_equal(out[0][k], out[1][k])
