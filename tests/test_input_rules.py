"""One reader and one set of rules per input: fleet files and the flags that override them,
a trace read as a request log (calibrate, simulate) under validate's rules, recommend's plans
and SLOs.  Every case runs the real CLI on real files: one ``error:`` line, exit 2, naming the
file and column and row (or the option); inputs byte for byte what they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from test_nothing_lost import digest_tree, invoke, ok, refused

from replay.simulate import load_fleet

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "sample"
SAMPLE_FLEET = REPO / "traces" / "sample-fleet.toml"


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """calibrate's own output: a fleet file with a [[worker]] table per worker."""
    fleet = tmp_path_factory.mktemp("fleet") / "fleet.toml"
    ok(invoke("calibrate", SAMPLE, "--out", fleet, "-q"))
    assert fleet.read_text().count("[[worker]]") == 4
    return fleet


# ---------------------------------------------------------------------------
# fleet files and their override flags


def test_override_flags_apply_to_every_worker_of_a_calibrated_fleet(calibrated):
    plain = load_fleet(calibrated)
    assert {w.dp_size for w in plain.workers} == {2}
    assert {w.prefill_tokens_per_s for w in plain.workers} == {8000.0}
    fleet = load_fleet(calibrated, dp_size=3, prefill_tokens_per_s=1234.5, max_running_requests=7)
    assert [w.dp_size for w in fleet.workers] == [3] * 4
    assert [w.prefill_tokens_per_s for w in fleet.workers] == [1234.5] * 4
    assert [w.max_running_requests for w in fleet.workers] == [7] * 4
    # what was not overridden keeps each worker's fitted value
    assert [w.decode_tokens_per_s for w in fleet.workers] == [w.decode_tokens_per_s for w in plain.workers]
    assert len({w.decode_tokens_per_s for w in fleet.workers}) > 1


def test_simulate_with_an_override_runs_the_overridden_fleet(calibrated, tmp_path):
    out = tmp_path / "sim"
    ok(invoke("simulate", REPO / "traces" / "sample-log" / "requests.jsonl", "--fleet", calibrated, "--out", out,
              "--dp-size", "3", "--requests", "100", "-q"))
    workers = pl.read_parquet(out / "workers.parquet")
    assert workers["dp_size"].to_list() == [3] * 4


@pytest.mark.parametrize("text, key", [("workers = true", "workers"), ("decode_peers = true", "decode_peers"),
                                       ("dp_size = 1048576", "dp_size")])
def test_a_fleet_file_value_is_refused_naming_the_file(tmp_path, text, key):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(text + "\n")
    before = fleet.read_bytes()
    line = refused(invoke("simulate", REPO / "traces" / "sample-log" / "requests.jsonl", "--fleet", fleet,
                          "--out", tmp_path / "o"), f"{fleet}: {key} must be")
    if key == "dp_size":
        assert "GiB of simulator state" in line and "at most 1,024" in line
    assert fleet.read_bytes() == before and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag, value", [("--prefill-tokens-per-s", "-5"), ("--max-running-requests", "0"),
                                         ("--decode-peers", "-1"), ("--max-total-num-tokens", "0")])
def test_an_override_flag_goes_through_the_fleet_validator_and_is_named(calibrated, tmp_path, flag, value):
    line = refused(invoke("simulate", REPO / "traces" / "sample-log" / "requests.jsonl", "--fleet", calibrated,
                          "--out", tmp_path / "o", flag, value), f"{flag} must be")
    assert str(calibrated) not in line


def test_dp_size_above_the_limit_names_the_memory_it_would_need(tmp_path):
    line = refused(invoke("simulate", REPO / "traces" / "sample-log" / "requests.jsonl", "--fleet", SAMPLE_FLEET,
                          "--out", tmp_path / "o", "--dp-size", "1,100000", "--workers", "4"), "--dp-size")
    assert "100,000" in line and "GiB of simulator state" in line


# ---------------------------------------------------------------------------
# a trace read as a request log: validate's rules, one line naming file, column and row


def _trace(tmp_path: Path, name: str, *, req=None, loads=None, workers=None, info=None) -> Path:
    d = tmp_path / name
    d.mkdir()
    for f in ("requests", "loads", "workers"):
        shutil.copy(SAMPLE / f"{f}.parquet", d / f"{f}.parquet")
    shutil.copy(SAMPLE / "trace.json", d / "trace.json")
    for f, fix in (("requests", req), ("loads", loads), ("workers", workers)):
        if fix is not None:
            fix(pl.read_parquet(d / f"{f}.parquet")).write_parquet(d / f"{f}.parquet")
    if info is not None:
        text = info if isinstance(info, str) else json.dumps(info(json.loads((d / "trace.json").read_text())))
        (d / "trace.json").write_text(text)
    return d


def _at_row(col: str, row: int, value) -> pl.Expr:
    return pl.when(pl.int_range(pl.len()) == row).then(value).otherwise(pl.col(col)).alias(col)


BAD = {
    "cached above input": dict(req=lambda df: df.with_columns(_at_row("cached_tokens", 5, pl.col("input_tokens") + 1)),
                               needles=("requests.parquet: column 'cached_tokens' row 5",)),
    "ttft above latency": dict(req=lambda df: df.with_columns(_at_row("ttft_ms", 7, pl.col("latency_ms") + 1)),
                               needles=("requests.parquet: column 'ttft_ms' row 7",)),
    "NaN ttft": dict(req=lambda df: df.with_columns(_at_row("ttft_ms", 9, float("nan"))),
                     needles=("requests.parquet: column 'ttft_ms' row 9", "nan")),
    "negative running": dict(loads=lambda df: df.with_columns(_at_row("num_running_reqs", 11, -3)),
                             needles=("loads.parquet: column 'num_running_reqs' row 11", "-3")),
    "float hash ids": dict(req=lambda df: df.with_columns(pl.col("hash_ids").cast(pl.List(pl.Float64))),
                           needles=("requests.parquet: column 'hash_ids'", "Float64")),
    "string hash ids": dict(req=lambda df: df.with_columns(pl.col("hash_ids").cast(pl.List(pl.String))),
                            needles=("requests.parquet: column 'hash_ids'", "String")),
    "u64 hash ids": dict(req=lambda df: df.with_columns(
        pl.col("hash_ids").list.eval(pl.element().cast(pl.UInt64) + 2**63)),
        needles=("requests.parquet: column 'hash_ids' row 0", "not an int64")),
    "output beyond 2**53": dict(req=lambda df: df.with_columns(_at_row("output_tokens", 5, 2**53 + 1)),
                                needles=("requests.parquet: column 'output_tokens' row 5", "2**53")),
    "repeated request_id": dict(req=lambda df: df.with_columns(_at_row("request_id", 8, pl.lit(3, dtype=pl.Int64))),
                                needles=("requests.parquet: column 'request_id' row 8", "first at row 3")),
    "Datetime beyond int64 ns": dict(req=lambda df: df.with_columns(pl.col("ts").cast(pl.Datetime("us"))),
                                     needles=("requests.parquet: column 'ts' row 0", "int64 nanosecond range")),
    "dp_size 2**20": dict(workers=lambda df: df.with_columns(pl.lit(2**20).alias("dp_size")),
                          needles=("workers.parquet: column 'dp_size' row 0", "1024")),
    "list extra": dict(info=lambda j: {**j, "extra": [1, 2]}, needles=("trace.json: key 'extra'",)),
    "deep nesting": dict(info='{"extra": ' + "[" * 50_000 + "]" * 50_000 + "}",
                         needles=("trace.json: nested too deeply",)),
    "variant knob": dict(info=lambda j: {**j, "router": {"variant_pin_order": "locality"}},
                         needles=("trace.json: key 'router.variant_pin_order'", "replay-only")),
    "nested knob": dict(info=lambda j: {**j, "router": {"worker_queue_limit": {"value": 8}}},
                        needles=("trace.json: key 'router.worker_queue_limit'",)),
    "null page_size": dict(info=lambda j: {**j, "page_size": None},
                           needles=("trace.json: key 'page_size': must be an integer >= 1, got null",)),
    "floor above limit": dict(info=lambda j: {**j, "router": {"worker_queue_limit": 2, "saturation_queue_floor": 5}},
                              needles=("trace.json: key 'router'", "--saturation-queue-floor")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_calibrate_and_simulate_refuse_what_validate_refuses_with_its_line(tmp_path, case):
    spec = dict(BAD[case])
    needles = spec.pop("needles")
    d = _trace(tmp_path, "t", **spec)
    before = digest_tree(d)
    want = refused(invoke("validate", d), *needles).removeprefix("error: ")
    fleet = tmp_path / "fleet.toml"
    got = refused(invoke("calibrate", d, "--out", fleet, "-q"), *needles)
    assert got.endswith(want), (got, want)        # the same rule, the same words (a path before the file)
    assert not fleet.exists()
    got = refused(invoke("simulate", d, "--fleet", SAMPLE_FLEET, "--out", tmp_path / "sim", "-q"), *needles)
    assert got.endswith(want), (got, want)
    assert not (tmp_path / "sim").exists()
    assert digest_tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def _fit(fleet: Path) -> str:
    """A fleet file's fitted values, without the header that names the trace."""
    return "\n".join(ln for ln in fleet.read_text().splitlines() if not ln.startswith("#"))


def test_valid_traces_in_other_shapes_fit_the_same_fleet(tmp_path):
    """A Datetime ts, loads without the optional dp_rank, a trace holding only a log's columns
    (as an independent engine writes it), and a trace set of parts are all read, and fit what the
    plain trace fits."""
    ok(invoke("calibrate", _trace(tmp_path, "plain"), "--out", tmp_path / "plain.toml", "-q"))
    want = _fit(tmp_path / "plain.toml")
    log_cols = ["ts", "request_id", "input_tokens", "hash_ids", "output_tokens", "cached_tokens", "ttft_ms",
                "latency_ms", "selected_worker"]
    shapes = {
        "datetime": dict(req=lambda df: df.with_columns(pl.col("ts").cast(pl.Datetime("ns"))),
                         loads=lambda df: df.with_columns(pl.col("ts").cast(pl.Datetime("ns")))),
        "no-dp-rank": dict(loads=lambda df: df.filter(pl.col("dp_rank") == 0).drop("dp_rank"),
                           workers=lambda df: df.with_columns(pl.lit(1).alias("dp_size"))),
        "log-only": dict(req=lambda df: df.select(log_cols)),
    }
    for name, fix in shapes.items():
        d = _trace(tmp_path, name, **fix)
        if name != "log-only":       # validate needs the router-side columns a sweep replays
            ok(invoke("validate", d))
        ok(invoke("calibrate", d, "--out", tmp_path / f"{name}.toml", "-q"))
        if name != "no-dp-rank":
            assert _fit(tmp_path / f"{name}.toml") == want, name
    assert "dp_size = 1" in _fit(tmp_path / "no-dp-rank.toml")
    # a trace set: requests and loads as folders of parts
    ts = tmp_path / "set"
    ts.mkdir()
    for f in ("workers.parquet", "trace.json"):
        shutil.copy(SAMPLE / f, ts / f)
    for kind in ("requests", "loads"):
        df = pl.read_parquet(SAMPLE / f"{kind}.parquet")
        (ts / kind).mkdir()
        half = df.height // 2
        df.head(half).write_parquet(ts / kind / "part-0.parquet")
        df.tail(df.height - half).write_parquet(ts / kind / "part-1.parquet")
    ok(invoke("calibrate", ts, "--out", tmp_path / "set.toml", "-q"))
    assert _fit(tmp_path / "set.toml") == want


def test_forced_placement_reads_a_datetime_ts(tmp_path):
    d = _trace(tmp_path, "dt", req=lambda df: df.with_columns(pl.col("ts").cast(pl.Datetime("ns"))
                                                              .dt.cast_time_unit("us")))
    ok(invoke("calibrate", SAMPLE, "--out", tmp_path / "f.toml", "-q"))
    ok(invoke("simulate", d, "--fleet", tmp_path / "f.toml", "--out", tmp_path / "sim", "--forced-placement",
              "--requests", "200", "-q"))
    assert pl.read_parquet(tmp_path / "sim" / "requests.parquet").height == 200


# ---------------------------------------------------------------------------
# recommend: a grid or plan it cannot use is unusable input (2), never "no config qualifies" (1)

LOG = REPO / "traces" / "sample-log" / "requests.jsonl"


@pytest.fixture(scope="module")
def grid_and_plan(tmp_path_factory):
    base = tmp_path_factory.mktemp("closed")
    ok(invoke("simulate", LOG, "--fleet", SAMPLE_FLEET, "--out", base / "grid", "--worker-queue-limit", "2,4",
              "--requests", "300", "-q"))
    ok(invoke("simulate", LOG, "--fleet", SAMPLE_FLEET, "--out", base / "plan", "--workers", "2,4",
              "--worker-queue-limit", "2,4", "--requests", "300", "-q"))
    return base / "grid", base / "plan"


def _copy_with(src: Path, dst: Path, table: str, fix) -> Path:
    shutil.copytree(src, dst)
    fix(pl.read_parquet(dst / table)).write_parquet(dst / table)
    return dst


def test_recommend_refuses_rates_written_as_strings(grid_and_plan, tmp_path):
    grid, plan = grid_and_plan
    assert invoke("recommend", grid, "--max-ttft-p99-ms", "1e9").exit_code == 0
    assert invoke("recommend", plan, "--plan", "--max-ttft-p99-ms", "1e9").exit_code == 0
    as_text = lambda df: df.with_columns(pl.col("true_hit_rate").cast(pl.String))   # noqa: E731
    g = _copy_with(grid, tmp_path / "g", "closed_loop_summary.parquet", as_text)
    before = digest_tree(g)
    refused(invoke("recommend", g, "--max-ttft-p99-ms", "1e9"),
            f"{g / 'closed_loop_summary.parquet'}: column 'true_hit_rate': must be numeric, got String")
    assert digest_tree(g) == before
    p = _copy_with(plan, tmp_path / "p", "plan_summary.parquet",
                   lambda df: df.with_columns(pl.col("ttft_ms_p99").cast(pl.String)))
    refused(invoke("recommend", p, "--plan", "--max-ttft-p99-ms", "1e9"),
            f"{p / 'plan_summary.parquet'}: column 'ttft_ms_p99': must be numeric, got String")


def test_recommend_refuses_an_empty_plan(grid_and_plan, tmp_path):
    _, plan = grid_and_plan
    p = _copy_with(plan, tmp_path / "p", "plan_summary.parquet", lambda df: df.head(0))
    for extra in ([], ["--json"]):
        refused(invoke("recommend", p, "--plan", "--max-ttft-p99-ms", "1000", *extra),
                f"{p / 'plan_summary.parquet'}: no fleets planned")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_an_slo_must_be_a_finite_number(grid_and_plan, gen_trace, tmp_path, value):
    grid, plan = grid_and_plan
    refused(invoke("recommend", plan, "--plan", "--max-ttft-p99-ms", value), "--max-ttft-p99-ms", "finite")
    refused(invoke("recommend", grid, "--max-queue-wait-p99-ms", value), "--max-queue-wait-p99-ms", "finite")
    run = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", run, "--worker-queue-limit", "2,4", "--no-report", "-q"))
    refused(invoke("report", run, "--max-ttft-p99-ms", value), "--max-ttft-p99-ms", "finite")
    refused(invoke("report", run, "--max-p99-waiting", value), "--max-p99-waiting", "finite")
    assert not (run / "report.html").exists()


def test_a_fit_the_simulator_cannot_run_blames_the_trace_and_writes_nothing(tmp_path):
    """Load counters validate accepts (running counts of 10**12) fit a fleet no simulator runs: the
    refusal names the trace's loads.parquet, not a temporary fleet file, and nothing is left."""
    d = _trace(tmp_path, "t", loads=lambda df: df.with_columns(pl.lit(10**12).alias("num_running_reqs")))
    ok(invoke("validate", d))
    refused(invoke("calibrate", d, "--out", tmp_path / "fleet.toml", "-q"),
            f"{d}: the fleet fitted from its loads.parquet counters cannot be simulated: worker 0:")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


@pytest.mark.parametrize("args, counted", [
    (["--worker-queue-limit", "1..100000"], "100,000 config(s) = 100,000 simulations"),
    (["--worker-queue-limit", "1..100", "--seeds", "200"], "100 config(s) x 200 seeds = 20,000 simulations"),
    (["--worker-queue-limit", "1..500", "--workers", "1,2,3,4,5", "--load-scale", "1,2,4,8,16"],
     "500 config(s) x 25 fleet x traffic points = 12,500 simulations"),
])
def test_a_simulate_grid_too_large_to_run_is_refused_up_front(tmp_path, args, counted):
    refused(invoke("simulate", LOG, "--fleet", SAMPLE_FLEET, "--out", tmp_path / "o", "--requests", "100", *args),
            counted, "more than the 10,000 one simulate runs")
    assert list(tmp_path.iterdir()) == []


def test_a_calibrate_prediction_grid_too_large_to_run_is_refused_before_the_fit(tmp_path):
    refused(invoke("calibrate", SAMPLE, "--out", tmp_path / "f.toml", "--validate", tmp_path / "v",
                   "--worker-queue-limit", "1..200", "--seeds", "100", "-q"),
            "200 config(s) x 100 seeds = 20,000 simulations")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------
# a trace without load samples: calibrate refuses it as validate does; simulate reads it as a log


def test_calibrate_refuses_a_trace_without_loads_as_validate_does_and_simulate_reads_it(calibrated, tmp_path):
    d = _trace(tmp_path, "t")
    (d / "loads.parquet").unlink()
    before = digest_tree(d)
    want = refused(invoke("validate", d), f"loads.parquet: file not found in {d} (nor a loads/ folder)")
    fleet = tmp_path / "fleet.toml"
    shutil.copy(calibrated, fleet)      # the previous fit, which --force may replace
    old = fleet.read_bytes()
    got = refused(invoke("calibrate", d, "--out", fleet, "--force", "-q"))
    assert got == want
    assert fleet.read_bytes() == old
    refused(invoke("calibrate", d, "--out", tmp_path / "new.toml", "--validate", tmp_path / "v", "-q"),
            want.removeprefix("error: "))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.toml", "t"]
    # simulate needs only the requests: the same trace is a request log to it
    ok(invoke("simulate", d, "--fleet", SAMPLE_FLEET, "--out", tmp_path / "sim", "--requests", "200", "-q"))
    assert pl.read_parquet(tmp_path / "sim" / "requests.parquet").height == 200
    assert digest_tree(d) == before


def test_validate_says_a_generated_trace_records_no_production_router(tmp_path):
    ok(invoke("generate", tmp_path / "gen", "--requests", "200", "--seed", "3"))
    out = ok(invoke("validate", tmp_path / "gen"))
    line = next(ln for ln in out.splitlines() if ln.startswith("trace.json:"))
    assert line.startswith("trace.json: synthetic, no production router recorded"), line
    assert "production router defaults" not in out
    # a recorded trace whose trace.json names no router flags still reads as production defaults
    d = _trace(tmp_path, "t", info=lambda j: {k: v for k, v in j.items() if k != "router"})
    assert "trace.json: production router defaults" in ok(invoke("validate", d))


# ---------------------------------------------------------------------------
# knob values that sized memory by themselves, and numbers that are not numbers


def test_more_sweep_threads_than_the_machine_runs_give_the_same_run(gen_trace, tmp_path):
    """--threads above the kernel threads numba runs sized counters for threads that never ran
    (--threads 1000000: 244 GiB, a traceback); the replay runs the threads it can, same result."""
    one, many = tmp_path / "one", tmp_path / "many"
    ok(invoke("sweep", gen_trace, "--out", one, "--worker-queue-limit", "2,4", "--threads", "1", "--no-report",
              "--no-decisions", "-q"))
    ok(invoke("sweep", gen_trace, "--out", many, "--worker-queue-limit", "2,4", "--threads", "1000000",
              "--no-report", "--no-decisions", "-q"))
    a, b = pl.read_parquet(one / "summary.parquet"), pl.read_parquet(many / "summary.parquet")
    assert a.height == 2 and a.equals(b)


def test_a_max_running_requests_of_a_billion_simulates_as_no_limit(tmp_path):
    """max_running_requests = 10**9 (no limit, in effect) sized a table per rank by itself and ran out
    of memory; 100 requests under it are simulated as under a limit of 100, which never binds."""
    outs = {}
    for limit in (100, 10**9):
        fleet = tmp_path / f"fleet-{limit}.toml"
        fleet.write_text(SAMPLE_FLEET.read_text().replace("max_running_requests = 32",
                                                          f"max_running_requests = {limit}"))
        outs[limit] = tmp_path / f"sim-{limit}"
        ok(invoke("simulate", LOG, "--fleet", fleet, "--out", outs[limit], "--requests", "100", "-q"))
    cols = ["request_id", "selected_worker", "ttft_ms", "latency_ms", "cached_tokens"]
    a = pl.read_parquet(outs[100] / "requests.parquet").select(cols)
    b = pl.read_parquet(outs[10**9] / "requests.parquet").select(cols)
    assert a.height == 100 and a.equals(b)
    # and the limit still binds where it is smaller than the log
    fleet = tmp_path / "fleet-1.toml"
    fleet.write_text(SAMPLE_FLEET.read_text().replace("max_running_requests = 32", "max_running_requests = 1"))
    ok(invoke("simulate", LOG, "--fleet", fleet, "--out", tmp_path / "sim-1", "--requests", "100", "-q"))
    c = pl.read_parquet(tmp_path / "sim-1" / "requests.parquet").select(cols)
    assert c["latency_ms"].sum() > a["latency_ms"].sum()


@pytest.mark.parametrize("args, needle", [
    (["--rate", "inf"], "--rate"), (["--rate", "nan"], "--rate"),
    (["--seed", "-1"], "--seed"), (["--seed", str(2**64)], "--seed"),
])
def test_generate_refuses_a_rate_or_seed_it_cannot_use(tmp_path, args, needle):
    refused(invoke("generate", tmp_path / "g", "--requests", "10", *args), needle)
    assert list(tmp_path.iterdir()) == []


def test_validate_refuses_a_freshness_window_sweep_refuses(tmp_path):
    big = str(2**63 // 1_000_000 + 1)
    line = refused(invoke("validate", SAMPLE, "--freshness-ms", big), "--freshness-ms", "64 bits")
    assert refused(invoke("sweep", SAMPLE, "--out", tmp_path / "o", "--freshness-ms", big)) == line
    ok(invoke("validate", SAMPLE, "--freshness-ms", str(2**63 // 1_000_000)))


def test_calibrate_refuses_a_trace_without_requests_and_keeps_the_previous_fit(calibrated, tmp_path):
    d = _trace(tmp_path, "t", req=lambda df: df.head(0))
    before = digest_tree(d)
    ok(invoke("validate", d))           # a valid trace: it just holds no requests
    fleet = tmp_path / "fleet.toml"
    shutil.copy(calibrated, fleet)
    old = fleet.read_bytes()
    for extra in ([], ["--validate", tmp_path / "v"]):
        refused(invoke("calibrate", d, "--out", fleet, "--force", "-q", *extra),
                f"{d / 'requests.parquet'}: no requests; calibrate fits")
        assert fleet.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.toml", "t"]
    assert digest_tree(d) == before


@pytest.mark.parametrize("args, needle", [
    (["--page-size", str(2**63)], "--page-size"), (["--kv-capacity-tokens", str(2**63)], "--kv-capacity-tokens"),
    (["--index-lag-ms", "1e300"], "--index-lag-ms"),
])
def test_import_refuses_numbers_past_what_a_trace_holds(tmp_path, args, needle):
    """--page-size 2**63 overflowed (a traceback); a capacity of 2**63 tokens and a lag of 1e300 ms
    were imported as given (exit 0)."""
    log = tmp_path / "log.jsonl"
    shutil.copy(LOG, log)
    refused(invoke("import", "--mooncake", log, "--out", tmp_path / "t", *args), needle)
    refused(invoke("record", "--worker", "http://127.0.0.1:9", "--out", tmp_path / "r", "--page-size", str(2**63)),
            "--page-size")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]


def test_the_page_size_limit_of_the_options_is_the_trace_json_one():
    from replay.cli.limits import MAX_PAGE_SIZE
    from replay.trace.base import MAX_INT32
    assert MAX_PAGE_SIZE == MAX_INT32


def test_import_of_a_log_without_requests_is_refused_naming_it(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused(invoke("import", "--mooncake", empty, "--out", tmp_path / "t"), f"{empty}: no requests")
    refused(invoke("import", "--mooncake", empty, "--out", tmp_path / "t", "--skip-bad-lines"), f"{empty}: no requests")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_a_fleet_whose_caches_exceed_the_machine_is_refused_before_allocating(tmp_path):
    """999 workers x dp 1,024 asked numpy for tens of GiB at once (a traceback); the refusal
    counts the ranks and the memory they need, and nothing is written."""
    import os
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if have > 2**40:
        pytest.skip("this machine holds the caches of a million ranks")
    line = refused(invoke("simulate", LOG, "--fleet", SAMPLE_FLEET, "--out", tmp_path / "o", "--workers", "999",
                          "--dp-size", "1024", "-q"), "fleet: 1,022,976 ranks would need")
    assert "GiB of simulator caches" in line and "--workers, --dp-size" in line
    assert list(tmp_path.iterdir()) == []


def test_a_simulation_that_serves_no_request_writes_null_metrics(tmp_path):
    """--max-in-flight 0 under reorg routing refuses every request: the run is valid and its
    latency metrics have no value.  Writing sim.json raised on NaN (a traceback, nothing kept)."""
    out = tmp_path / "sim"
    res = invoke("simulate", LOG, "--fleet", SAMPLE_FLEET, "--out", out, "--chat-routing", "reorg",
                 "--max-in-flight", "0", "--requests", "100", "-q")
    ok(res)
    assert res.stderr == ""
    summary = json.loads((out / "sim.json").read_text(), parse_constant=lambda c: pytest.fail(c))["summary"]
    assert (summary["requests"], summary["routed"], summary["failed"]) == (100, 0, 100)
    assert summary["ttft_ms_mean"] is None and summary["ttft_ms_p99"] is None


def test_record_refuses_a_worker_url_whose_port_is_not_a_port(tmp_path):
    """http://HOST:99999 was asked for /server_info and reported as "Connection refused"."""
    refused(invoke("record", "--worker", "http://127.0.0.1:99999", "--out", tmp_path / "r", "--duration", "1s"),
            "--worker: 'http://127.0.0.1:99999': its port is not a port (1..65535)")
    wf = tmp_path / "workers.txt"
    wf.write_text("http://127.0.0.1:30000\nhttp://127.0.0.1:0\n")
    refused(invoke("record", "--workers-file", wf, "--out", tmp_path / "r", "--duration", "1s"),
            f"{wf}: line 2: 'http://127.0.0.1:0': its port is not a port")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["workers.txt"]
