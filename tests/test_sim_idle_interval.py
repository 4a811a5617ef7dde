"""Interval publishing over a long idle gap: the load rows are every rank's sample
every interval over the whole span, made from the kernel's change records and streamed to
loads.parquet chunk by chunk.  Real files, the real CLI, no mocks; expected values come from
the publishing rules (docs/simulator.md), not from a previous run."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pyarrow.parquet as pq
from click.testing import CliRunner

from replay import run_sweep
from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate, write_mooncake_jsonl
from replay.simulate.logs import RequestLog
from replay.simulate.sim import START_NS
from replay.trace.files import write_options

DAY_NS = 24 * 3600 * 10**9
INTERVAL_MS = 1000


def _gap_log(n: int = 240, at: int = 120, gap_ns: int = DAY_NS) -> RequestLog:
    a = generate_log(n, seed=11, rate_per_s=8.0)
    ts = a.ts_ns.copy()
    ts[at:] += gap_ns
    return RequestLog(ts, a.input_tokens, a.output_tokens, a.hash_off, a.block_key[a.hash_ids],
                      a.request_id, a.block_size, "a day's gap")


def _fleet():
    return build_fleet(FleetSpec(workers=3, dp_size=2, prefill_tokens_per_s=8000,
                                 max_running_requests=8, max_total_num_tokens=60_000,
                                 publish_interval_ms=INTERVAL_MS))


def test_a_days_gap_writes_every_interval_row(tmp_path):
    log = _gap_log()
    fleet = _fleet()
    cfg = RouterConfig(worker_queue_limit=4)
    out = tmp_path / "t"
    res = simulate(log, fleet, cfg, out)
    loads = pl.read_parquet(out / "loads.parquet")
    outc = res.outcomes
    p = INTERVAL_MS * 1_000_000
    first_arrival = START_NS + int(log.ts_ns[0])
    t_final = int(outc["completion_ts"].max())
    ranks = loads.group_by("worker", "dp_rank").agg(pl.col("ts").sort()).sort("worker", "dp_rank")
    assert ranks.height == 6
    expect_rows = 0
    for ts in ranks["ts"].to_list():
        ts = np.asarray(ts)
        # each rank: one sample every interval from its phase (its first one interval
        # before the first request at most), none missing over the day, until the last completion
        assert (np.diff(ts) == p).all()
        assert first_arrival - p <= ts[0] < first_arrival
        assert ts[-1] < t_final <= ts[-1] + p
        expect_rows += (t_final - 1 - ts[0]) // p + 1
    assert loads.height == expect_rows == res.stats["load_rows"]
    assert loads.height > 6 * DAY_NS // p          # the day is there, row by row
    # written order: by time, each instant's ranks in one fixed order
    assert (np.diff(loads["ts"].to_numpy()) >= 0).all()
    # inside the gap nothing runs or waits, and every rank repeats one sample but for its stamp
    last_before = int(outc["completion_ts"][:120].max())
    first_after = START_NS + int(log.ts_ns[120])
    idle = loads.filter((pl.col("ts") > last_before) & (pl.col("ts") < first_after))
    assert first_after - last_before > DAY_NS - 3600 * 10**9
    assert idle.height >= 6 * ((first_after - last_before) // p - 1)
    assert idle["num_running_reqs"].max() == 0 and idle["num_waiting_reqs"].max() == 0
    values = [c for c in idle.columns if c != "ts"]
    assert idle.select(values).unique().height == 6
    # the in-memory rows are the file's rows; chunks of any size concatenate to them
    assert res.loads.equals(loads)
    small = pl.concat([pl.from_arrow(t) for t in res.load_rows.chunks(100_003)])
    assert small.equals(loads)
    # the file is one write's file: pyarrow's default row groups (1 Mi rows), zstd
    meta = pq.ParquetFile(out / "loads.parquet").metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)][0] == min(
        loads.height, 1024 * 1024)
    # and the router saw exactly these rows: sweep on the written trace agrees on every decision
    sweep = run_sweep(out, {"worker_queue_limit": "4"})
    assert sweep.summary["agreement"][0] == 1.0


def test_streamed_loads_file_equals_one_write(tmp_path):
    """More than one row group: the chunked loads.parquet has the bytes of writing the whole
    table at once with the same options."""
    log = _gap_log(n=80, at=40, gap_ns=DAY_NS)
    fleet = build_fleet(FleetSpec(workers=4, dp_size=4, max_total_num_tokens=60_000,
                                  publish_interval_ms=1000))
    res = simulate(log, fleet, RouterConfig(), tmp_path / "t")
    assert res.stats["load_rows"] > 1024 * 1024
    whole = res.load_rows.table()
    pq.write_table(whole, tmp_path / "whole.parquet", **write_options(whole.schema))
    assert (tmp_path / "whole.parquet").read_bytes() == (tmp_path / "t" / "loads.parquet").read_bytes()


def test_cli_interval_gap(tmp_path):
    log = _gap_log(n=60, at=30, gap_ns=DAY_NS // 4)
    src = tmp_path / "log.jsonl"
    write_mooncake_jsonl(log, src)
    before = src.read_bytes()
    out = tmp_path / "sim"
    r = CliRunner().invoke(main, ["simulate", str(src), "--out", str(out), "--workers", "2",
                                  "--dp-size", "2", "--publish-interval-ms", "500",
                                  "--worker-queue-limit", "4", "-q"])
    assert r.exit_code == 0, r.output
    assert src.read_bytes() == before
    meta = json.loads((out / "sim.json").read_text())
    loads = pl.read_parquet(out / "loads.parquet")
    assert loads.height == meta["stats"]["load_rows"]
    assert loads.height >= 4 * (DAY_NS // 4) // 500_000_000
