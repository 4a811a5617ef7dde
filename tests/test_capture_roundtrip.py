"""Simulator -> capture formats -> ``import`` -> ``sweep``: the placement and the matches come back exactly."""

from __future__ import annotations

import json

import polars as pl
import pytest
from click.testing import CliRunner

from replay.capture.from_sim import engine_dirs, write_capture
from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate

LAG_MS = 20


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    d = tmp_path_factory.mktemp("rt")
    log = generate_log(500, seed=11, rate_per_s=25.0, turns_mean=2.5)
    fleet = build_fleet(FleetSpec(workers=4, dp_size=2, prefill_tokens_per_s=6000, decode_tokens_per_s=40,
                                  max_running_requests=8, max_total_num_tokens=70_000))
    cfg = RouterConfig(worker_queue_limit=4)
    res = simulate(log, fleet, cfg, d / "sim", index_lag_ms=LAG_MS, cache_log=True)
    write_capture(res, log, fleet, d / "cap", index_lag_ms=LAG_MS)
    return d, res, log, fleet


def import_cap(d, out, lag_ms, *extra):
    args = ["import", "--out", out, "--token-export", d / "cap" / "token_export", "--recorded", d / "cap" / "recorded",
            "--index-lag-ms", lag_ms, "--router-inflight", "derived", *extra]
    for url, p in engine_dirs(d / "cap"):
        args += ["--engine-export", f"{url}={p}"]
    return run(*args)


def by_request(df):
    return {int(r["request_id"]): sorted((m["worker"], m["blocks"]) for m in (r["matches"] or []))
            for r in df.select("request_id", "matches").iter_rows(named=True)}


def test_roundtrip_matches_and_agreement(capture):
    d, res, log, fleet = capture
    cl = res.extra["cache_log"]
    assert (cl[:, 3] < 0).sum() > 0, "the run must evict, or removals go untested"
    assert len(set((abs(cl[:, 3]) - 1).tolist())) == 2, "both ranks of a worker store blocks"
    r = import_cap(d, d / "imp", LAG_MS)
    assert r.exit_code == 0, r.output
    imp = pl.read_parquet(d / "imp" / "requests.parquet")
    sim = pl.read_parquet(d / "sim" / "requests.parquet")
    assert imp.height == sim.height
    assert by_request(imp) == by_request(sim)             # every request's matches, as sets
    assert sum(1 for v in by_request(sim).values() if len(v) > 1) > 20
    # order: the import answers in worker-URL order, as the router's index does
    for row in imp.head(200).iter_rows(named=True):
        ws = [m["worker"] for m in row["matches"]]
        assert ws == sorted(ws)
    assert imp["query_blocks"].to_list() == sim["query_blocks"].to_list()
    assert imp["input_tokens"].to_list() == sim["input_tokens"].to_list()
    assert imp["selected_worker"].to_list() == sim["selected_worker"].to_list()
    # sweep under the simulated config: every placement reproduced
    s = run("sweep", d / "imp", "--out", d / "run-imp", "--worker-queue-limit", 4, "--no-report")
    assert s.exit_code == 0, s.output
    summ = pl.read_parquet(d / "run-imp" / "summary.parquet")
    assert summ["agreement"][0] == 1.0
    # and the sim's own trace (matches deepest first) decides the same: order cannot change a decision
    s = run("sweep", d / "sim", "--out", d / "run-sim", "--worker-queue-limit", 4, "--no-report")
    assert s.exit_code == 0, s.output
    ssim = pl.read_parquet(d / "run-sim" / "summary.parquet")
    keep = [c for c in ssim.columns if c in summ.columns and c not in ("config_id",)]
    assert summ.select(keep).row(0) == ssim.select(keep).row(0)
    dimp = pl.read_parquet(d / "run-imp" / "decisions.parquet")
    dsim = pl.read_parquet(d / "run-sim" / "decisions.parquet")
    assert dimp["worker"].to_list() == dsim["worker"].to_list()
    assert run("validate", d / "imp").exit_code == 0


def test_roundtrip_wrong_lag_is_detected(capture):
    """Imported with no lag where the fleet had 20 ms, the rebuilt index sees blocks too early:
    the matches must differ from the simulator's somewhere."""
    d, res, log, fleet = capture
    r = import_cap(d, d / "imp0", 0)
    assert r.exit_code == 0, r.output
    imp = pl.read_parquet(d / "imp0" / "requests.parquet")
    sim = pl.read_parquet(d / "sim" / "requests.parquet")
    a, b = by_request(imp), by_request(sim)
    differ = [i for i in a if a[i] != b[i]]
    assert differ, "a lag of 0 instead of 20 ms must change some request's matches"


def test_simulate_command_writes_capture_formats(tmp_path):
    """The same round trip from the command line: `simulate --capture-out` leaves what a live fleet
    would have left; `import` of it sweeps back to the simulated placement (agreement 1.0)."""
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    sim, cap, imp = tmp_path / "sim", tmp_path / "cap", tmp_path / "imp"
    r = run("simulate", root / "traces" / "sample-log" / "requests.jsonl", "--fleet",
            root / "traces" / "sample-fleet.toml", "--requests", 400, "--out", sim, "--capture-out", cap,
            "--worker-queue-limit", 4, "--index-lag-ms", LAG_MS)
    assert r.exit_code == 0, r.output
    assert "capture formats ->" in r.output
    assert (cap / "trace.json").is_file() and (cap / "token_export").is_dir()
    r = import_cap(tmp_path, imp, LAG_MS)
    assert r.exit_code == 0, r.output
    assert (by_request(pl.read_parquet(imp / "requests.parquet"))
            == by_request(pl.read_parquet(sim / "requests.parquet")))
    s = run("sweep", imp, "--out", tmp_path / "run", "--worker-queue-limit", 4, "--no-report")
    assert s.exit_code == 0, s.output
    assert pl.read_parquet(tmp_path / "run" / "summary.parquet")["agreement"][0] == 1.0
    # one config only; and the capture dir is an output, so it may not be an input's folder
    r = run("simulate", root / "traces" / "sample-log" / "requests.jsonl", "--fleet",
            root / "traces" / "sample-fleet.toml", "--requests", 50, "--out", tmp_path / "sim2",
            "--capture-out", tmp_path / "cap2", "--worker-queue-limit", "2,4")
    assert r.exit_code == 2 and "one config" in r.output


def test_imported_trace_set_feeds_calibrate_and_simulate(capture):
    """import writes loads/ as a folder of parts: calibrate reads every load row of it (the
    capacity is fitted from them), and simulate uses the set as a log with forced placement."""
    d, res, log, fleet = capture
    imp = d / "imp-set"
    r = import_cap(d, imp, LAG_MS, "--router-flags", "--worker-queue-limit 4")
    assert r.exit_code == 0, r.output
    assert (imp / "loads").is_dir() and not (imp / "loads.parquet").exists()
    assert json.loads((imp / "trace.json").read_text())["router"] == {"worker_queue_limit": 4}
    c = run("calibrate", imp, "--out", d / "fleet.toml", "--force")
    assert c.exit_code == 0, c.output
    assert "NOT FITTED (no samples)" not in c.output
    assert "max_total_num_tokens" in (d / "fleet.toml").read_text()
    s = run("simulate", imp, "--fleet", d / "fleet.toml", "--out", d / "sim-set", "--force")
    assert s.exit_code == 0, s.output
    assert pl.read_parquet(d / "sim-set" / "requests.parquet").height == res.requests.height


@pytest.mark.parametrize(("flags", "needle"), [
    ("--worker-queue-limit 0", "--worker-queue-limit must be at least 1"),
    ("--saturation-queue-floor 2", "requires --worker-queue-limit"),
    ("--worker-queue-limit 2,4", "one plain value"),
    ("--policy random", "not a router flag the replay models"),
    ("--worker-queue-limit", "needs a value"),
])
def test_import_router_flags_are_checked_like_the_routers_cli(capture, tmp_path, flags, needle):
    d, *_ = capture
    r = import_cap(d, tmp_path / "imp", LAG_MS, "--router-flags", flags)
    assert r.exit_code == 2 and needle in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not (tmp_path / "imp").exists()
