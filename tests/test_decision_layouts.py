"""The ``outcomes`` layout of decisions.parquet loses nothing.

Real sweeps through the CLI write both layouts of the same trace and grid;
``replay.read_decisions`` of the ``outcomes`` run must equal ``pl.read_parquet``
of the ``long`` run's file exactly (columns, dtypes, values, row order), and the
readers (compare, report's over-time counts, the waterfall drill-down) give the
same answers on either.  The jitted outcome encoder is held to its plain
Python statement, on real chunks and on hypothesis-drawn ones.
"""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

import replay
from replay import run_sweep
from replay.analysis import waterfall as wf
from replay.cli import main
from replay.config import Grid
from replay.kernels import outcomes
from replay.report.run_page import decision_counts, fleet_bins
from replay.runs import decisions as decision_store
from replay.runs.rundir import decision_files, load_run
from replay.sweep.engine import iter_chunks
from replay.trace import load_trace
from replay.trace.synthetic import generate_trace_set

GRID = ["--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1,2",
        "--disable-pressure-guard", "true,false"]


def sweep(trace, out, *args):
    res = CliRunner().invoke(main, ["sweep", str(trace), "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def pair(gen_trace, models_trace, tmp_path_factory):
    """Per trace (int request ids; string ids): the same sweep in both layouts."""
    base = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, trace in (("gen", gen_trace), ("models", models_trace)):
        for layout in decision_store.LAYOUTS:
            sweep(trace, base / f"{name}-{layout}", *GRID, "--decisions-layout", layout)
        out[name] = {layout: base / f"{name}-{layout}" for layout in decision_store.LAYOUTS}
    return out


@pytest.mark.parametrize("name", ["gen", "models"])
def test_outcomes_read_back_as_the_long_table(pair, name):
    long_dir, out_dir = pair[name]["long"], pair[name]["outcomes"]
    want = pl.read_parquet(long_dir / "decisions.parquet")
    got = replay.read_decisions(out_dir)
    assert got.columns == want.columns == list(decision_store.LONG_COLUMNS)
    assert_frame_equal(got, want, check_exact=True)
    assert replay.read_decisions(long_dir).equals(want)
    # the file says its layout, and so does the run record
    assert decision_store.layout_of(out_dir / "decisions.parquet") == "outcomes"
    assert decision_store.layout_of(long_dir / "decisions.parquet") == "long"
    assert json.loads((out_dir / "run.json").read_text())["decisions_layout"] == "outcomes"
    assert json.loads((long_dir / "run.json").read_text())["decisions_layout"] == "long"
    # the summary does not depend on the layout; the file is smaller
    assert pl.read_parquet(out_dir / "summary.parquet").equals(pl.read_parquet(long_dir / "summary.parquet"))
    # one row per request (fleet.parquet has one per request too)
    assert pl.read_parquet(out_dir / "decisions.parquet").height == pl.read_parquet(out_dir / "fleet.parquet").height


@pytest.mark.parametrize("name", ["gen", "models"])
def test_projections_slices_and_filters(pair, name):
    path = pair[name]["outcomes"] / "decisions.parquet"
    want = pl.read_parquet(pair[name]["long"] / "decisions.parquet")
    n = want.height
    assert decision_store.file_info(path)[0] == n
    for cols in (["request_id"], ["config_id"], ["worker", "config_id"], ["blocks_lost", "request_id", "lost_to"]):
        assert_frame_equal(decision_store.scan_file(path, cols).collect(), want.select(cols))
    for lo, hi in ((0, 1), (5, 17), (n // 3, n // 2 + 7), (n - 3, n), (n - 1, n + 50), (n + 3, n + 9)):
        assert_frame_equal(decision_store.scan_file(path, rows=slice(lo, hi)).collect(), want.slice(lo, hi - lo))
    lf = decision_store.scan_decisions([path])
    q = (pl.col("config_id") == 3) & (pl.col("worker").is_not_null())
    assert_frame_equal(lf.filter(q).select("request_id", "decision").collect(),
                       want.filter(q).select("request_id", "decision"))
    assert_frame_equal(lf.head(11).collect(), want.head(11))
    with pytest.raises(pl.exceptions.ColumnNotFoundError):
        decision_store.scan_file(path, ["no_such_column"])


def test_readers_agree_across_layouts(pair, gen_trace, tmp_path):
    runs = pair["gen"]
    # compare: long vs long and long vs outcomes find the same changed requests
    res = {}
    for b in ("long", "outcomes"):
        other = runs[b]
        r = CliRunner().invoke(main, ["compare", str(runs["long"]), str(other), "--out", str(tmp_path / b)])
        assert r.exit_code == 0, r.output
        res[b] = pl.read_parquet(tmp_path / b / "changed_requests.parquet")
    assert res["long"].height == res["outcomes"].height == 0   # the same decisions
    # a long run against an outcomes run of another seed: the same as long against long
    seeded = {}
    for layout in ("long", "outcomes"):
        sweep(gen_trace, tmp_path / f"s1-{layout}", *GRID, "--seed", "1", "--decisions-layout", layout)
        r = CliRunner().invoke(main, ["compare", str(tmp_path / f"s1-{layout}"), str(runs["outcomes"]),
                                      "--out", str(tmp_path / f"c-{layout}")])
        assert r.exit_code == 0, r.output
        seeded[layout] = (pl.read_parquet(tmp_path / f"c-{layout}" / "transitions.parquet"),
                          pl.read_parquet(tmp_path / f"c-{layout}" / "changed_requests.parquet")
                          .sort("config_id_a", "request_id"))   # a join's row order is the engine's
    assert seeded["long"][0].equals(seeded["outcomes"][0]) and seeded["long"][1].equals(seeded["outcomes"][1])
    assert seeded["long"][1].height > 0
    # report's over-time counts and the waterfall drill-down
    a, b = load_run(runs["long"]), load_run(runs["outcomes"])
    ids = a.summary["config_id"].to_list()
    bins = fleet_bins(a.fleet)
    counts = [decision_counts(r.decisions, ids, r.fleet, bins).sort("config_id", "bin") for r in (a, b)]
    assert counts[0].equals(counts[1]) and counts[0].height > 0
    for cid in ids[:6]:
        assert wf.drilldown(a.decisions, cid).equals(wf.drilldown(b.decisions, cid))
    r = CliRunner().invoke(main, ["report", str(runs["outcomes"]), "--out", str(tmp_path / "r.html")])
    assert r.exit_code == 0, r.output


def test_windowed_and_sharded_outcomes_equal_the_in_memory_long_table(tmp_path):
    d = tmp_path / "set"
    generate_trace_set(d, n_requests=1200, n_workers=4, dp_size=2, max_matches=5, seed=2,
                       rate_per_s=40.0, partition_s=10)
    grid = Grid.from_texts({"--worker-queue-limit": "none,2,4", "--saturation-queue-floor": "none,1"})
    run_sweep(d, grid, out=tmp_path / "mem", report=False, window="none")
    run_sweep(d, grid, out=tmp_path / "win", report=False, window="7s", decisions_layout="outcomes")
    want = replay.read_decisions(tmp_path / "mem")
    assert len(decision_files(tmp_path / "win")) == 1
    assert_frame_equal(replay.read_decisions(tmp_path / "win"), want)
    pytest.importorskip("ray")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        run_sweep(d, grid, out=tmp_path / "ray", report=False, window="10s", executor="ray",
                  configs_per_task=2, decisions_layout="outcomes")
    finally:
        ray.shutdown()
    files = decision_files(tmp_path / "ray")
    assert len(files) > 1 and all(decision_store.layout_of(f) == "outcomes" for f in files)
    key = ["request_id", "config_id"]
    assert_frame_equal(replay.read_decisions(tmp_path / "ray").sort(key), want.sort(key))


def test_bad_layout_and_unreadable_outcomes_file(pair, tmp_path):
    res = CliRunner().invoke(main, ["sweep", "traces/sample", "--out", str(tmp_path / "x"),
                                    "--decisions-layout", "wide"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("run.json", "summary.parquet", "summary.csv", "fleet.parquet"):
        (bad / f).write_bytes((pair["gen"]["outcomes"] / f).read_bytes())
    (bad / "decisions.parquet").write_bytes((pair["gen"]["outcomes"] / "decisions.parquet").read_bytes()[:300])
    res = CliRunner().invoke(main, ["compare", str(pair["gen"]["long"]), str(bad)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "decisions.parquet" in lines[0]
    with pytest.raises(replay.ReplayError):
        replay.read_decisions(tmp_path / "nothing-here")


# ---------------------------------------------------------------------------
# the encoder against its plain statement


def _check(out_i: np.ndarray, out_f: np.ndarray) -> None:
    codes, rep, counts = outcomes.encode(out_i, out_f)
    r_codes, r_rep, r_counts = outcomes.encode_reference(out_i, out_f)
    assert codes.dtype == r_codes.dtype
    assert np.array_equal(codes, r_codes) and np.array_equal(rep, r_rep) and np.array_equal(counts, r_counts)
    # decoding gathers every (request, config) back, NaN bits included
    n_i, n, n_cfg = out_i.shape
    g = outcomes.decode(codes, counts)
    flat_i = out_i.reshape(n_i, n * n_cfg)
    flat_f = np.ascontiguousarray(out_f).view(np.int64).reshape(out_f.shape[0], n * n_cfg)
    assert np.array_equal(flat_i[:, rep][:, g], flat_i)
    assert np.array_equal(flat_f[:, rep][:, g], flat_f)
    assert counts.sum() == len(rep) and (codes < counts[:, None]).all()


def test_encoder_on_real_chunks(gen_trace):
    trace = load_trace(gen_trace)
    grid = Grid.from_texts({"--worker-queue-limit": "none,1..8", "--saturation-queue-floor": "none,1..3"})
    for chunk in iter_chunks(trace, grid.configs, seed=4, chunk_decisions=20_000):
        _check(chunk.out_i, chunk.out_f)


@st.composite
def chunks(draw):
    n = draw(st.integers(0, 6))
    n_cfg = draw(st.integers(1, 9))
    n_i, n_f = draw(st.integers(1, 4)), draw(st.integers(0, 2))
    # few distinct values, so configs share outcomes and differ late in the fields too
    ints = draw(st.lists(st.integers(-2, 2), min_size=n_i * n * n_cfg, max_size=n_i * n * n_cfg))
    floats = draw(st.lists(st.sampled_from([0.0, -0.0, 1.5, float("nan"), float("inf")]),
                           min_size=n_f * n * n_cfg, max_size=n_f * n * n_cfg))
    return (np.array(ints, dtype=np.int64).reshape(n_i, n, n_cfg),
            np.array(floats, dtype=np.float64).reshape(n_f, n, n_cfg))


@settings(max_examples=300, deadline=None)
@given(chunks())
def test_encoder_property(chunk):
    _check(*chunk)


def test_code_dtype_widens_with_the_grid():
    assert outcomes.code_dtype(256) == np.uint8 and outcomes.code_dtype(257) == np.uint16
    out_i = np.arange(300, dtype=np.int64).reshape(1, 1, 300)   # every config its own outcome
    _check(out_i, np.zeros((1, 1, 300)))


def test_empty_files_read_back_alike(tmp_path):
    """A writer closed before any chunk (no requests) leaves a readable empty file in either layout."""
    from replay.sweep.results import DecisionWriter

    trace = load_trace("traces/sample")
    for layout in decision_store.LAYOUTS:
        DecisionWriter(str(tmp_path / f"{layout}.parquet"), trace, [0, 3, 5], layout=layout).close()
    want = pl.read_parquet(tmp_path / "long.parquet")
    got = decision_store.scan_decisions([tmp_path / "outcomes.parquet"]).collect()
    assert want.height == 0 and got.schema == want.schema
    assert decision_store.file_info(tmp_path / "outcomes.parquet")[0] == 0
