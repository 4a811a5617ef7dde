"""End-to-end ``router-replay sweep`` as a subprocess: wall time and peak RSS
on the 1M trace (Parquet reading and writing included), and CLI start times.
"""

from __future__ import annotations

import _support as S
import pytest


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
    """Issue 13's first start: README's sample sweep with an empty numba cache
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


def test_cli_help_start(benchmark):
    benchmark.group = "cli-start"
    benchmark.pedantic(S.run_cli, args=(["--help"],), rounds=3, iterations=1)
