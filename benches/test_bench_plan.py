"""Capacity-plan cost: fleets x traffic levels x configs x seeds on Mooncake, and its targets.

Three shapes, run end to end as ``python3 -m replay simulate`` in a subprocess (wall time, the
child's CPU time and peak RSS from ``getrusage``) on the Mooncake conversation trace (12,031
requests, one hour):

- ``reduced`` (the default): 5 fleets (4, 6, 8, 12, 16 workers x dp 2) x 3 traffic levels
  (x1, x1.5, x2) x 5 configs x 2 seeds = 150 simulations;
- ``readme`` (``ROUTER_REPLAY_PLAN=readme``): the README's plan, 5 worker counts x dp 1, 2 x
  3 levels = 30 points x 5 configs x 3 seeds = 450 simulations; target 60 s on 2 cores;
- ``full`` (``ROUTER_REPLAY_PLAN=full``): the 5 fleets x 3 levels x 16 configs x 3 seeds = 720
  simulations; target 4 min on 2 cores.

Every simulation of a plan is one task of one pool, so on a quiet machine the wall time is
the CPU time over the two cores plus the driver's serial start.  The bench asserts the target
on what a shared machine can measure honestly, the child's CPU time over 2 cores, and on the
wall time too when the machine was quiet (1-minute load below 1.5) when the plan started.
Skipped when ``$ROUTER_REPLAY_TRACES/mooncake`` (default /work/shared/traces) is absent.  Run
with ``python -m pytest benches/test_bench_plan.py --benchmark-enable -s``.
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
SHAPES = {
    "reduced": {"workers": "4,6,8,12,16", "dp": "2", "limits": "none,4,16", "floors": "none,2", "seeds": "2"},
    "readme": {"workers": "4,6,8,12,16", "dp": "1,2", "limits": "none,2,4", "floors": "none,1", "seeds": "3"},
    "full": {"workers": "4,6,8,12,16", "dp": "2", "limits": "none,2,4,8,16,32", "floors": "none,1,2",
             "seeds": "3"},
}
TARGET_S = {"readme": 60.0, "full": 240.0}
CORES = 2


def run_plan(tmp: Path, grid: dict) -> tuple[float, float, int, str]:
    """One plan as a subprocess: (wall s, child CPU s, child peak RSS in bytes, stdout)."""
    fleet = tmp / "fleet.toml"
    fleet.write_text(FLEET)
    out = tmp / "plan"
    cmd = [sys.executable, "-m", "replay", "simulate", str(MOONCAKE), "--fleet", str(fleet),
           "--out", str(out), "--force", "--workers", grid["workers"], "--dp-size", grid["dp"],
           "--load-scale", "1,1.5,2", "--per-dp-rank", "--worker-queue-limit", grid["limits"],
           "--saturation-queue-floor", grid["floors"], "--seeds", grid["seeds"], "--threads", str(CORES)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr[-2000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, max(after.ru_maxrss, before.ru_maxrss) * 1024, p.stdout


@needs_mooncake
def test_plan_mooncake(benchmark, report, tmp_path):
    import polars as pl

    shape = os.environ.get("ROUTER_REPLAY_PLAN") or ("full" if os.environ.get("ROUTER_REPLAY_PLAN_FULL") == "1"
                                                     else "reduced")
    grid = SHAPES[shape]
    subprocess.run([sys.executable, "-m", "replay", "simulate", str(MOONCAKE), "--out",
                    str(tmp_path / "warm"), "--requests", "200", "-q"],
                   env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)  # compile once
    load_before = os.getloadavg()[0]
    benchmark.group = "plan"
    wall, cpu, peak, _ = benchmark.pedantic(run_plan, args=(tmp_path, grid), rounds=1, iterations=1)
    load_after = os.getloadavg()[0]
    t = pl.read_parquet(tmp_path / "plan" / "plan_summary.parquet")
    configs = t["config_id"].n_unique()
    seeds = int(grid["seeds"])
    sims = t.height * seeds
    answer = subprocess.run([sys.executable, "-m", "replay", "recommend", str(tmp_path / "plan"),
                             "--plan", "--max-ttft-p99-ms", "8000"], capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), check=False)
    assert answer.returncode in (0, 1), answer.stderr
    report(plan=shape, points=t["fleet"].n_unique(), configs=configs, seeds=seeds, simulations=sims,
           wall_s=round(wall, 1), cpu_s=round(cpu, 1), cpu_s_per_simulation=round(cpu / sims, 3),
           cpu_over_cores_s=round(cpu / CORES, 1), load_before=round(load_before, 1),
           load_after=round(load_after, 1), peak_rss_mib=round(peak / 2**20),
           full_plan_cpu_over_cores_extrapolated_s=round(cpu / sims * 720 / CORES),
           timed_min_s=stat(benchmark, "min"), answer=answer.stdout.strip().splitlines())
    target = TARGET_S.get(shape)
    if target is not None:
        assert cpu / CORES <= target, (f"{shape} plan: {cpu:.0f} CPU s over {CORES} cores = "
                                       f"{cpu / CORES:.0f} s > {target:.0f} s")
        if load_before < 1.5:
            assert wall <= target, f"{shape} plan on a quiet machine: {wall:.0f} s > {target:.0f} s"
