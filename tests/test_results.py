"""Summary correctness: every summary column recomputed independently from decisions.parquet.

The sweeps run through the real CLI on real Parquet traces (``conftest.py``);
the expected summary is rebuilt here with plain polars expressions from the
decisions file (and, for ``agreement``, from the trace's own
``requests.parquet``), never through ``replay.sweep.results``.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay import labels
from replay.cli import main
from replay.config import Grid
from replay.sweep.engine import iter_chunks
from replay.sweep.results import DecisionWriter, _quantiles
from replay.trace import load_trace

BOUNDS = [2**i for i in range(14)]  # 1, 2, 4, ..., 8192; then +inf
DECISION_LABELS = ["cache_hit", "cache_miss", "cache_worker_queued", "all_queued"]
POLICY_REASONS = [
    "cache_candidate", "saturation_pin", "no_cache_candidate", "no_cache_candidate_admission_backup",
    "no_cache_candidate_pressure_backup", "no_cache_candidate_range_fallback",
    "no_cache_candidate_capacity_fallback_power_of_two",
]
FAILURES = ["prefill_admission_exhausted", "cache_candidates_exhausted", "proposal_empty"]

GEN_GRID = ["--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1,2",
            "--disable-pressure-guard", "true,false"]
MODELS_GRID = ["--worker-queue-limit", "none,1,2", "--saturation-queue-floor", "none,1",
               "--chat-routing", "legacy,reorg", "--max-in-flight", "none,0"]


def cli_sweep(trace, out, *args):
    res = CliRunner().invoke(main, ["sweep", str(trace), "--out", str(out), *args])
    assert res.exit_code == 0, res.output
    return res


@pytest.fixture(scope="module")
def runs(gen_trace, models_trace, tmp_path_factory):
    base = tmp_path_factory.mktemp("results")
    out = {}
    for name, trace, grid in (("gen", gen_trace, GEN_GRID), ("models", models_trace, MODELS_GRID)):
        d = base / name
        cli_sweep(trace, d, *grid)
        out[name] = dict(
            trace=trace,
            dir=d,
            summary=pl.read_parquet(d / "summary.parquet"),
            decisions=pl.read_parquet(d / "decisions.parquet"),
            requests=pl.read_parquet(trace / "requests.parquet"),
        )
    return out


# ---------------------------------------------------------------------------
# the independent recomputation


def nearest_rank(values: list[int], q: Fraction):
    """Nearest-rank quantile: the ceil(q*n)-th smallest value (rank >= 1); None when empty."""
    if not values:
        return None
    v = sorted(values)
    rank = max(1, math.ceil(q * len(v)))
    return v[rank - 1]


def known_workers(trace) -> set[str]:
    """Trace.workers per traces/README.md: table workers plus load workers (no table: load and match workers)."""
    loads = pl.read_parquet(trace / "loads.parquet")
    known = set(loads["worker"].to_list())
    if (trace / "workers.parquet").exists():
        known |= set(pl.read_parquet(trace / "workers.parquet")["worker"].to_list())
    else:
        req = pl.read_parquet(trace / "requests.parquet")
        known |= set(req.select(pl.col("matches").explode().struct.field("worker")).to_series().drop_nulls())
    return known


def expected_summary(run) -> dict[int, dict]:
    dec = run["decisions"]
    req = run["requests"]
    has_sel = "selected_worker" in req.columns
    if has_sel:
        known = known_workers(run["trace"])
        sel = req.select("request_id", "selected_worker").with_columns(
            pl.when(pl.col("selected_worker").is_in(list(known))).then(pl.col("selected_worker"))
            .alias("selected_worker"))
        dec = dec.join(sel, on="request_id", how="left")
    out = {}
    for (cid,), g in dec.group_by(["config_id"]):
        r = g.filter(pl.col("worker").is_not_null())
        e: dict = {
            "requests": g.height,
            "routed": r.height,
            "failed": g.filter(pl.col("worker").is_null()).height,
        }
        for d in DECISION_LABELS:
            e[d] = r.filter(pl.col("decision") == d).height
        for p in POLICY_REASONS:
            e[f"policy_{p}"] = r.filter(pl.col("policy_reason") == p).height
        for f in FAILURES:
            e[f"failure_{f}"] = g.filter(pl.col("failure") == f).height
        for o in labels.REORG_OUTCOMES:
            e[f"reorg_{o}"] = g.filter(pl.col("reorg_outcome") == o).height
        q = int(r["query_blocks"].sum())
        m = int(r["matched_blocks"].sum())
        s = int(r["selected_blocks"].sum())
        e.update(query_blocks=q, matched_blocks=m, selected_blocks=s,
                 hit_rate=s / q if q else None, matched_rate=m / q if q else None)
        chances = r.filter(pl.col("matched_blocks") > 0)
        e["owner_rate"] = (chances.filter(pl.col("selected_blocks") > 0).height / chances.height
                           if chances.height else None)
        e["pinned"] = r.filter(pl.col("reason") == "SaturationPin").height
        e["diverted"] = r.filter((pl.col("gate_rejected") > 0) & ~pl.col("fell_back")
                                 & (pl.col("reason").fill_null("") != "SaturationPin")).height
        e["fell_back"] = r.filter(pl.col("fell_back")).height
        e["fleet_all_queued"] = r.filter(pl.col("fleet_all_queued")).height
        waits = r["selected_waiting"].drop_nulls().to_list()
        e["selected_waiting_mean"] = sum(waits) / len(waits) if waits else None
        e["selected_waiting_p50"] = nearest_rank(waits, Fraction(1, 2))
        e["selected_waiting_p99"] = nearest_rank(waits, Fraction(99, 100))
        # the waiting histogram is exact below 2**14; the test traces stay far below that
        assert max(waits, default=0) < 1000
        e["selected_waiting_max_bucket"] = max(waits) if waits else None
        wu = r["selected_waiting_uncached"].drop_nulls().to_list()
        e["selected_waiting_uncached_mean"] = sum(wu) / len(wu) if wu else None
        ms = r["selected_queue_ms"].drop_nulls().drop_nans().to_list()
        e["selected_queue_ms_mean"] = math.fsum(ms) / len(ms) if ms else None
        e["cold_prefill_tokens"] = int(r["uncached_tokens"].sum())
        for col in ("guard_compared", "guard_overrides", "admission_evaluated", "admission_rejected",
                    "gate_rejected"):
            e[col] = int(r[col].sum())
        queued = r.filter(pl.col("decision") == "cache_worker_queued")["best_rejected_blocks"].to_list()
        prev = -math.inf
        for b in BOUNDS:
            e[f"diverted_overlap_le_{b}"] = sum(1 for v in queued if prev < v <= b)
            prev = b
        e["diverted_overlap_le_inf"] = sum(1 for v in queued if v > BOUNDS[-1])
        # the locality waterfall: the stored terms, and the choosing step keeps the rest
        lost = r.filter(pl.col("matched_blocks") > 0).with_columns(
            rest=pl.col("matched_blocks") - pl.col("selected_blocks") - pl.col("lost_candidates")
            - pl.col("lost_queue_gate") - pl.col("lost_capacity"))
        for step in ("candidates", "queue_gate", "capacity"):
            e[f"lost_{step}"] = int(lost[f"lost_{step}"].sum())
        e["lost_pin"] = int(lost.filter(pl.col("reason") == "SaturationPin")["rest"].sum())
        e["lost_tournament"] = int(lost.filter(pl.col("reason") == "CacheCandidate")["rest"].sum())
        # (a reorg miss fallback has no legacy reason: null)
        e["lost_fallback"] = int(lost.filter(~pl.col("reason").fill_null("").is_in(["SaturationPin",
                                                                                    "CacheCandidate"]))
                                 ["rest"].sum())
        if has_sel:
            # the code's definition: routed requests whose selected_worker is a known worker
            k = r.filter(pl.col("selected_worker").is_not_null())
            e["agreement_requests"] = k.height
            e["agreement"] = (k.filter(pl.col("worker") == pl.col("selected_worker")).height / k.height
                              if k.height else None)
        out[cid] = e
    return out


def close(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(b, float) or isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return a == b


@pytest.mark.parametrize("name", ["gen", "models"])
def test_summary_recomputed_from_decisions(runs, name):
    run = runs[name]
    summary = run["summary"]
    expected = expected_summary(run)
    assert sorted(expected) == summary["config_id"].to_list()
    cols = set(next(iter(expected.values())))
    assert cols <= set(summary.columns), cols - set(summary.columns)
    mismatches = []
    for row in summary.iter_rows(named=True):
        exp = expected[row["config_id"]]
        for col, want in exp.items():
            if col == "selected_queue_ms_mean" and want is not None and row[col] is not None:
                # the accumulator may sum this float in whole microseconds (exact and
                # order-free); the mean then carries at most 0.5 us of rounding
                if abs(row[col] - want) > 5e-4 + 1e-9 * abs(want):
                    mismatches.append((row["config_id"], col, row[col], want))
                continue
            if not close(row[col], want):
                mismatches.append((row["config_id"], col, row[col], want))
    assert not mismatches, mismatches[:20]
    # every accumulator column of the summary is covered by the recomputation
    knob_cols = {"config_id", *Grid({}).rows()[0]} - {"dp_size", "per_rank_limit", "per_rank_floor"}
    assert set(summary.columns) - knob_cols == cols


def test_recomputation_exercises_every_path(runs):
    """The comparison above is not vacuous: the data reach every counted path."""
    gen = runs["gen"]["summary"]
    for col in ("cache_hit", "cache_miss", "cache_worker_queued", "all_queued", "pinned", "diverted",
                "fell_back", "fleet_all_queued", "guard_overrides", "policy_saturation_pin",
                "admission_evaluated", "gate_rejected"):
        assert gen[col].sum() > 0, col
    hist = [c for c in gen.columns if c.startswith("diverted_overlap_le_")]
    assert sum(1 for c in hist if gen[c].sum() > 0) >= 3
    assert gen["selected_waiting_p99"].max() > gen["selected_waiting_p50"].min()
    assert gen["agreement"].drop_nulls().len() == gen.height
    assert 0 < gen["agreement_requests"].min() < gen["requests"].min()
    models = runs["models"]["summary"]
    legacy = models.filter(pl.col("chat_routing") == "legacy")
    reorg = models.filter(pl.col("chat_routing") == "reorg")
    assert (legacy["failed"] == 2).all()  # model c has no fleet
    assert (legacy["failure_proposal_empty"] == 2).all()
    # the reorg books no router label; its own outcomes: no engines for model c, and
    # 503s under the in-flight cap
    assert (reorg["reorg_no_workers"] == 2).all() and (reorg["failure_proposal_empty"] == 0).all()
    assert (reorg["failed"] == 2 + reorg["reorg_no_admissible_engine"]).all()
    assert reorg["reorg_no_admissible_engine"].max() > 0
    for col in ("reorg_cache_win", "reorg_miss_fallback", "reorg_saturation_pin"):
        assert reorg[col].sum() > 0, col
    assert (legacy.select(pl.col("^reorg_.*$")).sum_horizontal() == 0).all()
    assert (reorg.select(DECISION_LABELS).sum_horizontal() == 0).all()
    assert "agreement" not in models.columns  # no selected_worker column in that trace


@pytest.mark.parametrize("name", ["gen", "models"])
def test_decisions_file_shape(runs, name):
    run = runs[name]
    dec, summary, req = run["decisions"], run["summary"], run["requests"]
    assert dec.height == req.height * summary.height
    assert dec.select("request_id", "config_id").is_duplicated().sum() == 0
    assert set(dec["config_id"].unique()) == set(summary["config_id"])
    assert set(dec["request_id"].unique()) == set(req["request_id"])
    routed = dec["worker"].is_not_null()
    reorg = dec["reorg_outcome"].is_not_null()
    # legacy: failure columns are null exactly on routed rows, label columns exactly on
    # failed rows; the reorg books no router label at all, only its own outcome
    assert (dec["failure"].is_null() == (routed | reorg)).all()
    leg = dec.filter(~reorg)
    for col in ("reason", "policy_reason", "decision"):
        assert (leg[col].is_not_null() == leg["worker"].is_not_null()).all(), col
    assert (dec.filter(reorg)["policy_reason"].is_null()).all() and (dec.filter(reorg)["decision"].is_null()).all()
    assert (dec["uncached_tokens"].is_not_null() == routed).all()
    assert set(dec["reorg_outcome"].drop_nulls()) <= set(labels.REORG_OUTCOMES)
    assert set(dec["decision"].drop_nulls()) <= set(DECISION_LABELS)
    assert set(dec["reason"].drop_nulls()) <= set(labels.REASONS)
    # rows are (request, config) in trace time order, configs in id order
    ids = summary["config_id"].to_list()
    assert dec["config_id"].head(len(ids)).to_list() == ids
    assert dec.filter(pl.col("config_id") == ids[0])["request_id"].to_list() == \
        req.sort("ts", maintain_order=True)["request_id"].to_list()
    # query_blocks echoes the trace (null read as 0)
    qb = dec.filter(pl.col("config_id") == ids[0]).join(
        req.select("request_id", pl.col("query_blocks").fill_null(0).alias("qb")), on="request_id")
    assert (qb["query_blocks"] == qb["qb"]).all()


def test_summary_csv_matches_parquet(runs):
    d = runs["gen"]["dir"]
    pq_df = pl.read_parquet(d / "summary.parquet")
    csv_df = pl.read_csv(d / "summary.csv")
    assert csv_df.columns == pq_df.columns
    assert csv_df.height == pq_df.height
    for col in pq_df.columns:
        a, b = pq_df[col].to_list(), csv_df[col].to_list()
        if pq_df[col].dtype == pl.Boolean:
            b = [None if v is None else (v if isinstance(v, bool) else v == "true") for v in b]
        assert all(close(x, y) for x, y in zip(a, b, strict=True)), col


def test_summary_schema_does_not_depend_on_values(runs, models_trace, tmp_path):
    """A knob left at a None default, or a metric with no known value, keeps its real dtype."""
    cli_sweep(models_trace, tmp_path / "one")  # default grid: limit/floor/ms/ratio all None
    one = pl.read_parquet(tmp_path / "one" / "summary.parquet")
    full = runs["gen"]["summary"]
    assert one.height == 1
    for col, dtype in one.schema.items():
        assert dtype != pl.Null, col
        if col in full.columns:
            assert dtype == full.schema[col], (col, dtype, full.schema[col])
    assert one.schema["worker_queue_limit"] == pl.Int64
    assert one.schema["pressure_abs_threshold_ms"] == pl.Float64
    assert one.schema["selected_queue_ms_mean"] == pl.Float64  # no native tails in that trace
    assert one["selected_queue_ms_mean"].to_list() == [None]


# ---------------------------------------------------------------------------
# library pieces: quantiles, merging, chunked writing


def test_quantiles_nearest_rank():
    h = np.zeros((4, 8), dtype=np.int64)
    h[0, [1, 2, 3, 4]] = 1           # values 1,2,3,4
    h[1, 5] = 1                      # a single value
    h[2, [0, 7]] = [99, 1]           # 99 zeros and one value in the top bucket (>= 7)
    # row 3 empty
    assert _quantiles(h, 0.5) == [2, 5, 0, None]
    assert _quantiles(h, 0.99) == [4, 5, 0, None]
    assert _quantiles(h, 1.0) == [4, 5, 7, None]
    for n in (1, 7, 100, 101, 1000):
        vals = list(np.random.default_rng(n).integers(0, 8, n))
        hh = np.bincount(vals, minlength=8)[None, :]
        for q in (Fraction(1, 2), Fraction(99, 100)):
            assert _quantiles(hh, float(q)) == [nearest_rank(vals, q)]


def test_chunked_decision_writing_equals_one_pass(gen_trace, tmp_path):
    """Small chunks (many row groups) write exactly the decisions of one big chunk."""
    import pyarrow.parquet as pq

    trace = load_trace(gen_trace)
    grid = Grid({"worker_queue_limit": [None, 2, 4], "saturation_queue_floor": [None, 1]})

    def run(chunk_decisions, path):
        writer = DecisionWriter(str(path), trace, grid.config_ids)
        n = 0
        for chunk in iter_chunks(trace, grid.configs, seed=3, chunk_decisions=chunk_decisions):
            writer.write(chunk)
            n += 1
        writer.close()
        return n

    n_small = run(grid.n_configs * 97, tmp_path / "small.parquet")
    n_big = run(1 << 22, tmp_path / "big.parquet")
    assert n_big == 1 and n_small > 10
    assert pq.ParquetFile(tmp_path / "small.parquet").num_row_groups == n_small
    a = pl.read_parquet(tmp_path / "small.parquet")
    b = pl.read_parquet(tmp_path / "big.parquet")
    assert a.height == trace.n_requests * grid.n_configs
    assert a.equals(b)


def test_config_result_independent_of_grid_and_chunking(gen_trace, tmp_path):
    """A config's summary row is the same in a 2-config grid (one chunk) and in an
    860-config grid (1.29 M decisions: more than one default chunk of 2**20)."""
    big, small = tmp_path / "big", tmp_path / "small"
    cli_sweep(gen_trace, big, "--worker-queue-limit", "1..40", "--saturation-queue-floor", "none,1..40",
              "--no-decisions", "--quiet")
    cli_sweep(gen_trace, small, "--worker-queue-limit", "3,17", "--saturation-queue-floor", "2",
              "--no-decisions", "--quiet")
    b = pl.read_parquet(big / "summary.parquet")
    s = pl.read_parquet(small / "summary.parquet")
    assert b.height == 40 + 40 * 41 // 2 and b.height * 1500 > 1 << 20
    keys = ["worker_queue_limit", "saturation_queue_floor"]
    picked = b.join(s.select(keys), on=keys, how="semi").sort(keys)
    assert picked.height == 2
    float_col = "selected_queue_ms_mean"  # a float sum: equal up to summation order
    assert picked.drop("config_id", float_col).equals(s.sort(keys).drop("config_id", float_col))
    assert all(close(x, y) for x, y in zip(picked[float_col], s.sort(keys)[float_col], strict=True))


def test_decision_writer_leaves_empty_readable_file(gen_trace, tmp_path):
    trace = load_trace(gen_trace)
    w = DecisionWriter(str(tmp_path / "d.parquet"), trace, [0, 5])
    w.close()
    df = pl.read_parquet(tmp_path / "d.parquet")
    assert df.height == 0
    assert "selected_waiting" in df.columns and df.schema["config_id"] == pl.Int32


def test_run_json_grid_matches_summary(runs):
    run = json.loads((runs["gen"]["dir"] / "run.json").read_text())
    s = runs["gen"]["summary"]
    assert run["config_ids"] == s["config_id"].to_list()
    assert run["grid"]["n_configs"] == s.height
    assert run["grid"]["n_combinations"] == s.height + len(run["grid"]["skipped"])
