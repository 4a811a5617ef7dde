"""Agentic coding sessions as a closed-loop benchmark: the 40 shared kv-cache-tester sessions.

The sessions (2,835 requests, prompts up to 646 k tokens, full-blocks-only
block ids) are read as one log (sessions started at 0.5/s, seed 0), served by
a saturating 4 workers x dp 2 fleet (prefill 7-11 k tokens/s per rank, hidden
per worker, seeded), and the written trace is swept back under the same
config and calibrated.  Each stage is timed alone; the figures it reports are
the ones a release should keep: the simulate -> sweep agreement (1.0) and the
worst relative calibration error over the hidden parameters.
Skips when ``../shared/traces`` (or ``$REPLAY_SHARED_TRACES``) is absent.
"""

from __future__ import annotations

import os
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest

KV = Path(os.environ.get("REPLAY_SHARED_TRACES", Path(__file__).resolve().parents[1].parent / "shared" / "traces")
          ) / "kv-cache-tester"
pytestmark = pytest.mark.skipif(not KV.is_dir(), reason="../shared/traces/kv-cache-tester absent")


def test_agentic_sessions_closed_loop(benchmark, report, tmp_path):
    import polars as pl
    from click.testing import CliRunner

    from replay.cli import main
    from replay.config import RouterConfig
    from replay.simulate import FleetSpec, build_fleet, read_log, simulate

    benchmark.group = "agentic"
    t0 = time.perf_counter()
    log = read_log(KV, session_rate=0.5, seed=0)
    read_s = time.perf_counter() - t0
    rng = np.random.default_rng(2028)
    truth = {i: dict(prefill_tokens_per_s=float(rng.uniform(7_000, 11_000)),
                     decode_tokens_per_s=float(rng.uniform(30, 55)),
                     max_running_requests=int(rng.integers(6, 12)),
                     max_total_num_tokens=int(rng.integers(700_000, 900_000))) for i in range(4)}
    fleet = build_fleet(FleetSpec(workers=4, dp_size=2, publish_policy="on_change"), truth)
    simulate(log.head(50), fleet, RouterConfig(worker_queue_limit=4))   # compile (or load numba's cache)

    def sim():
        return simulate(log, fleet, RouterConfig(worker_queue_limit=4), tmp_path / "trace", seed=7, force=True)

    res = benchmark.pedantic(sim, rounds=1, iterations=1)
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["sweep", str(tmp_path / "trace"), "--out", str(tmp_path / "run"),
                                  "--worker-queue-limit", "4", "--seed", "7", "--no-report", "-q"])
    sweep_s = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    agreement = float(pl.read_parquet(tmp_path / "run" / "summary.parquet")["agreement"][0])
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["calibrate", str(tmp_path / "trace"), "--out", str(tmp_path / "fit.toml")])
    calibrate_s = time.perf_counter() - t0
    assert r.exit_code == 0, r.output
    got = {w["index"]: w for w in tomllib.loads((tmp_path / "fit.toml").read_text())["worker"]}
    worst = max(abs(got[i][k] / v - 1) for i, t in truth.items() for k, v in t.items())
    s = res.summary
    report(requests=log.n_requests, partial_blocks_added=log.partial_blocks_added, read_s=round(read_s, 2),
           simulate_s=round(res.seconds, 2), sweep_s=round(sweep_s, 2), calibrate_s=round(calibrate_s, 2),
           true_hit_rate=round(s["true_hit_rate"], 4), all_queued=s["all_queued"],
           queue_wait_ms_p99=round(s["queue_wait_ms_p99"], 1), agreement=agreement,
           calibration_worst_rel_error=worst)
    assert agreement == 1.0 and worst < 1e-3
