"""End-to-end ``router-replay sweep`` as a subprocess: wall time and peak RSS
on the 1M trace (Parquet reading and writing included), and CLI start times.
"""

from __future__ import annotations

import os
import resource
import subprocess
import time

import _support as S
import pytest

# the second speed round's floor: the README's sample sweep, numba cache warm, under 2 s (wall, idle machine)
README_SWEEP_FLOOR_S = 2.0
# and `router-replay --help` well under 1 s
HELP_FLOOR_S = 1.0


@pytest.mark.parametrize("decisions", [False, True], ids=["no-decisions", "decisions"])
def test_cli_sweep(benchmark, report, bench_trace_dir, warmed, work_dir, decisions):
    benchmark.group = f"cli-sweep-{S.size_label(S.BENCH_PARAMS['n_requests'])}"
    r = benchmark.pedantic(S.run_sweep_cli, args=(bench_trace_dir, "mixed"),
                           kwargs=dict(decisions=decisions, work=work_dir), rounds=1, iterations=1)
    report(
        configs=r["n_configs"], requests=r["n_requests"], peak_rss_bytes=r["peak_rss_bytes"],
        peak_rss_gib=(r["peak_rss_bytes"] / 2**30) if r["peak_rss_bytes"] else None,
        rss_source=r["rss_source"], run_timings=r["timings"], out_bytes=r["out_bytes"],
        floor_peak_rss_bytes=S.FLOORS["peak_rss_bytes"],
    )


def test_cli_cached_second_start(benchmark, report, work_dir):
    """Sweep of traces/sample with a fresh numba cache dir: the first run (setup,
    compiles and fills the cache) is untimed, the second (timed) loads from it."""
    benchmark.group = "cli-start"
    first: list[float] = []
    stamps: list[dict] = []

    def setup():
        env = S.fresh_numba_cache(work_dir)
        first.append(S.sample_sweep(work_dir, env))
        stamps.append(S.source_stamp())
        return (work_dir, env), {}

    benchmark.pedantic(S.sample_sweep, setup=setup, rounds=1, iterations=1)
    report(first_start_s=first[0] if first else None, floor_cached_start_s=S.FLOORS["cached_start_s"],
           sources_changed_between_runs=bool(stamps) and S.source_stamp() != stamps[0])


def test_first_start(benchmark, report, work_dir):
    """The second speed round's first start: README's sample sweep with an empty numba cache
    (everything it needs compiled), then the same with the cache it filled.
    Timed: the cold run; ``extra_info`` has wall and CPU to the first decision
    and in total for both (CPU is the honest figure on a shared machine)."""
    benchmark.group = "cli-start"
    runs: dict[str, dict] = {}

    def cold_then_warm():
        env = S.fresh_numba_cache(work_dir)
        runs["cold"] = S.first_start(work_dir, env)
        runs["cached"] = S.first_start(work_dir, env)

    benchmark.pedantic(cold_then_warm, rounds=1, iterations=1)
    report(**{f"{k}_{name}": v for k, r in runs.items() for name, v in r.items()},
           floor_first_decision_s=S.FLOORS["first_decision_s"], floor_cached_sample_s=S.FLOORS["cached_sample_s"])


def timed_cli(args: list[str]) -> tuple[float, float]:
    """``router-replay ARGS`` as a subprocess: (wall s, CPU s = user + system of the child, all its
    threads).  On a shared machine the CPU time is the steadier figure; both are reported."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(S.cli_command() + list(args), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"router-replay {' '.join(args)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _best_of(benchmark, report, args: list[str], rounds: int, floor_s: float, **extra) -> None:
    runs: list[tuple[float, float]] = []
    benchmark.pedantic(lambda: runs.append(timed_cli(args)), rounds=rounds, iterations=1)
    walls, cpus = [w for w, _c in runs], [c for _w, c in runs]
    report(best_wall_s=min(walls), best_cpu_s=min(cpus), walls_s=walls, cpus_s=cpus, floor_wall_s=floor_s,
           floor_met_wall=min(walls) < floor_s, loadavg=os.getloadavg(), **extra)


def test_cli_readme_sweep_cached(benchmark, report, work_dir):
    """The README's main command (``sweep traces/sample --force`` on the 4 x 5 grid, report.html
    written) with numba's cache warm: best of 5, wall and CPU.  One untimed run first fills the
    cache if the kernels changed (its time is reported as ``warmup_s``)."""
    benchmark.group = "cli-start"
    args = ["sweep", str(S.SAMPLE_TRACE), "--out", str(work_dir / "readme-sample"), "--force",
            "--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1..4"]
    warm = timed_cli(args)
    _best_of(benchmark, report, args, 5, README_SWEEP_FLOOR_S, warmup_s=warm[0])


def test_cli_help_start(benchmark, report):
    benchmark.group = "cli-start"
    _best_of(benchmark, report, ["--help"], 5, HELP_FLOOR_S)
