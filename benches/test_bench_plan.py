"""Capacity-plan cost: fleets x traffic levels x configs x seeds on Mooncake.

The full plan of the issue is 5 fleets (4, 6, 8, 12, 16 workers x dp 2) x 3
traffic levels (x1, x1.5, x2) x 16 router configs x 3 seeds = 720
closed-loop simulations of the Mooncake conversation trace (12,031
requests, one hour), run end to end as ``python3 -m replay simulate`` in a
subprocess (wall time, and the child's peak RSS from ``getrusage``).  The
reduced plan (the same fleets and levels, 5 configs x 2 seeds = 150
simulations) is the default; ``ROUTER_REPLAY_PLAN_FULL=1`` runs the full one.
Skipped when ``$ROUTER_REPLAY_TRACES/mooncake`` (default /work/shared/traces) is absent.  Run with
``python -m pytest benches/test_bench_plan.py --benchmark-enable -s``.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import stat

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(os.environ.get("ROUTER_REPLAY_TRACES", "/work/shared/traces"))
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"{MOONCAKE} absent")

FLEET = """workers = 8
dp_size = 2
prefill_tokens_per_s = 20000.0
decode_tokens_per_s = 40.0
max_running_requests = 32
max_total_num_tokens = 300000
publish_policy = "on_change"
"""
FULL = {"limits": "none,2,4,8,16,32", "floors": "none,1,2", "seeds": "3"}      # 16 configs x 3
REDUCED = {"limits": "none,4,16", "floors": "none,2", "seeds": "2"}            # 5 configs x 2 seeds


def run_plan(tmp: Path, grid: dict) -> tuple[float, int, str]:
    """One plan as a subprocess: (wall s, child peak RSS in bytes, stdout)."""
    fleet = tmp / "fleet.toml"
    fleet.write_text(FLEET)
    out = tmp / "plan"
    cmd = [sys.executable, "-m", "replay", "simulate", str(MOONCAKE), "--fleet", str(fleet),
           "--out", str(out), "--force", "--workers", "4,6,8,12,16", "--load-scale", "1,1.5,2",
           "--per-dp-rank", "--worker-queue-limit", grid["limits"],
           "--saturation-queue-floor", grid["floors"], "--seeds", grid["seeds"], "--threads", "2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-2000:]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, max(peak, before) * 1024, p.stdout


@needs_mooncake
def test_plan_mooncake(benchmark, report, tmp_path):
    import polars as pl

    full = os.environ.get("ROUTER_REPLAY_PLAN_FULL") == "1"
    grid = FULL if full else REDUCED
    subprocess.run([sys.executable, "-m", "replay", "simulate", str(MOONCAKE), "--out",
                    str(tmp_path / "warm"), "--requests", "200", "-q"],
                   env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)  # compile once
    benchmark.group = "plan"
    res = benchmark.pedantic(run_plan, args=(tmp_path, grid), rounds=1, iterations=1)
    wall, peak, _ = res
    t = pl.read_parquet(tmp_path / "plan" / "plan_summary.parquet")
    configs = t["config_id"].n_unique()
    seeds = int(grid["seeds"])
    sims = t.height * seeds
    answer = subprocess.run([sys.executable, "-m", "replay", "recommend", str(tmp_path / "plan"),
                             "--plan", "--max-ttft-p99-ms", "8000"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert answer.returncode in (0, 1), answer.stderr
    per_sim = wall / sims
    report(plan="full" if full else "reduced", fleets=5, levels=3, configs=configs, seeds=seeds,
           simulations=sims, wall_s=round(wall, 1), s_per_simulation=round(per_sim, 3),
           peak_rss_mib=round(peak / 2**20), full_plan_extrapolated_s=round(per_sim * 720),
           timed_min_s=stat(benchmark, "min"), answer=answer.stdout.strip().splitlines())
