"""Simulator speed (issue 3): the Mooncake conversation trace on 16 workers x dp 2.

Skipped when ``../shared/traces/mooncake`` is absent.  Compilation is
excluded (one warm-up simulation on the first 200 requests).  Reports wall
time per config, requests and events per second, and a 9-config closed-loop
grid (threads).  Run with ``python -m pytest benches/test_bench_simulate.py
--benchmark-enable -s``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from conftest import stat

MOONCAKE = (Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake"
            / "conversation_trace.jsonl")
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="../shared/traces/mooncake absent")


@pytest.fixture(scope="module")
def mooncake():
    from replay.simulate import FleetSpec, build_fleet, read_mooncake, simulate

    log = read_mooncake(MOONCAKE)
    fleet = build_fleet(FleetSpec(workers=16, dp_size=2, prefill_tokens_per_s=10_000,
                                  decode_tokens_per_s=40, max_running_requests=32,
                                  max_total_num_tokens=300_000))
    simulate(log.head(200), fleet)  # compile (or load numba's cache)
    return log, fleet


@needs_mooncake
@pytest.mark.parametrize("publish", ["interval", "on_change"])
def test_simulate_one_config(benchmark, report, mooncake, publish):
    from dataclasses import replace

    from replay.config import RouterConfig
    from replay.simulate import build_fleet, simulate

    log, fleet = mooncake
    fleet = build_fleet(replace(fleet.spec, publish_policy=publish))
    cfg = RouterConfig(worker_queue_limit=4, saturation_queue_floor=2)
    benchmark.group = "simulate"
    res = benchmark.pedantic(simulate, args=(log, fleet, cfg), rounds=3, iterations=1)
    best = stat(benchmark, "min")
    report(requests=log.n_requests, workers=16, dp_size=2,
           kernel_s=round(res.seconds, 3), wall_s=round(best, 3) if best else None,
           requests_per_s=round(log.n_requests / res.seconds),
           events=res.stats["ss_events"], events_per_s=round(res.stats["ss_events"] / res.seconds),
           load_rows=res.stats["load_rows"], target_s_per_config=0.5)


@needs_mooncake
def test_simulate_grid_9(benchmark, report, mooncake):
    from replay.simulate import simulate_grid

    log, fleet = mooncake
    benchmark.group = "simulate"
    grid = {"worker_queue_limit": "2,4,8", "saturation_queue_floor": "none,1,2"}
    t0 = time.perf_counter()
    table = benchmark.pedantic(simulate_grid, args=(log, fleet, grid), kwargs={"threads": 2},
                               rounds=1, iterations=1)
    wall = time.perf_counter() - t0
    report(configs=table.height, wall_s=round(wall, 3), s_per_config=round(wall / table.height, 3))


# ---------------------------------------------------------------------------
# calibrate on a 1M-request trace (issue 10 s.6: under 30 s)

@pytest.fixture(scope="module")
def calib_trace():
    """A 1M-request simulated trace (32 workers x dp 2, on-change publishing, about an hour),
    made once into the bench directory and reused."""
    import _support as S
    from replay.config import RouterConfig
    from replay.simulate import FleetSpec, build_fleet, generate_log, simulate

    n = int(os.environ.get("ROUTER_REPLAY_BENCH_REQUESTS", 1_000_000))
    d = S.bench_root() / f"calib-{n}"
    if not (d / "requests.parquet").is_file():
        log = generate_log(n, seed=1, rate_per_s=n / 3600)
        fleet = build_fleet(FleetSpec(workers=32, dp_size=2, prefill_tokens_per_s=20_000,
                                      decode_tokens_per_s=60, max_running_requests=48,
                                      max_total_num_tokens=400_000, publish_policy="on_change"))
        simulate(log, fleet, RouterConfig(worker_queue_limit=8), d, force=True)
    return d, n


def test_calibrate_1m(benchmark, report, calib_trace):
    from replay.simulate.calibrate import calibrate
    from replay.simulate.tracelog import read_trace_log

    d, n = calib_trace

    def run():
        return calibrate(read_trace_log(d))

    benchmark.group = "calibrate"
    cal = benchmark.pedantic(run, rounds=1, iterations=1)
    best = stat(benchmark, "min")
    report(requests=n, workers=len(cal.urls), wall_s=round(best, 2) if best else None,
           target_s=30, fitted=sum(f.fitted for f in cal.fitted), not_fitted=len(cal.not_fitted()))


def test_idle_time_costs_no_memory(benchmark, report):
    """Issue 10 s.5: 12,000 requests stretched over 123 hours (the log that took 5.9 GB per
    config with interval publishing) on 8 workers x dp 2, on-change publishing: load rows
    bounded by the events, peak RSS reported."""
    import resource

    import numpy as np

    from replay.config import RouterConfig
    from replay.simulate import FleetSpec, build_fleet, generate_log, simulate
    from replay.simulate.logs import RequestLog

    a = generate_log(12_000, seed=5, rate_per_s=20.0)
    span = a.ts_ns[-1] - a.ts_ns[0]
    ts = ((a.ts_ns - a.ts_ns[0]) * (123 * 3600e9 / span)).astype(np.int64)
    log = RequestLog(ts, a.input_tokens, a.output_tokens, a.hash_off, a.block_key[a.hash_ids],
                     a.request_id, a.block_size, "stretched to 123 h")
    fleet = build_fleet(FleetSpec(workers=8, dp_size=2, max_total_num_tokens=300_000,
                                  publish_policy="on_change"))
    simulate(log.head(200), fleet)
    benchmark.group = "simulate"
    res = benchmark.pedantic(simulate, args=(log, fleet, RouterConfig(worker_queue_limit=4)),
                             rounds=1, iterations=1)
    rows = res.stats["load_rows"]
    # each arrival and each change sample (about 4 per request: queued, admitted, prefilled,
    # done) writes at most one pending heartbeat per rank: a bound without the span in it
    assert rows <= (16 + 1) * 5 * log.n_requests
    report(requests=log.n_requests, span_h=123, load_rows=rows,
           interval_rows_would_be=int(123 * 3600 * 10 * 16),
           peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
