"""The whole sweep, and its loading, against a plain read (second speed round, then the
sweep's loading gap): ``router-replay sweep TRACE --out RUN --no-decisions
--worker-queue-limit 1..16 --saturation-queue-floor none,1..16`` on the 1M bench trace (152
valid configs), as a user runs it (a subprocess, report included, kernels already cached),
against a plain polars read of the same two Parquet files (``pl.read_parquet`` each).

The plain read the floors are held to is a **warm** one, as users meet polars: the files
read once in a fresh process (page cache, polars' allocator and thread pool warmed), then
read again and timed.  The floor: the whole sweep (wall clock of the subprocess) at most
10x that read.  Loading itself is held to 2x a warm read in one process by
``test_bench_load.py::test_load_trace_vs_plain_read``; here the sweep's own ``load_s``
(run.json: read, check, sort, encode, the first load in a fresh process) is reported beside
it, against the warm read and against the first (fresh) read of the same process.

Plain read and sweep are timed in alternation, best of ``ROUNDS``, so a busy shared machine
slows both alike.  CPU seconds (user + system of the child and every thread, from
``getrusage``) are reported beside the wall clock figures: on a loaded machine they are the
steadier ones.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import _support as S

ROUNDS = 3
FLOOR_RATIO = 10.0

_READ_TWICE = r"""
import json, sys, time
import polars as pl
out = {}
for name in ("fresh", "warm"):       # the first read in the process, then the same read again
    t0, c0 = time.perf_counter(), time.process_time()
    req = pl.read_parquet(sys.argv[1] + "/requests.parquet")
    loads = pl.read_parquet(sys.argv[1] + "/loads.parquet")
    out[name] = {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                 "rows": req.height + loads.height}
    del req, loads
print(json.dumps(out))
"""


def plain_reads(d: Path) -> dict:
    """The plain read of both files in a fresh Python process, twice: ``fresh`` (the
    process's first read) and ``warm`` (the same read again), wall and CPU seconds of the
    reads alone (the interpreter's start and ``import polars`` left out)."""
    p = subprocess.run([sys.executable, "-c", _READ_TWICE, str(d)], capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _sweep(trace_dir: Path, work: Path) -> dict:
    c0 = _children_cpu()
    r = S.run_sweep_cli(trace_dir, "g152", decisions=False, work=work)
    r["cpu_s"] = _children_cpu() - c0
    return r


def test_sweep_vs_plain_read(benchmark, report, bench_trace_dir, warmed, work_dir):
    benchmark.group = "end-to-end"
    _sweep(bench_trace_dir, work_dir)  # the 152 configs' kernels compiled or loaded once, untimed
    reads: list[dict] = []
    sweeps: list[dict] = []

    def once():
        reads.append(plain_reads(bench_trace_dir))
        sweeps.append(_sweep(bench_trace_dir, work_dir))

    benchmark.pedantic(once, rounds=ROUNDS, iterations=1)
    best = min(sweeps, key=lambda r: r["wall_s"])
    warm = min(r["warm"]["wall_s"] for r in reads)
    warm_cpu = min(r["warm"]["cpu_s"] for r in reads)
    fresh = min(r["fresh"]["wall_s"] for r in reads)
    load = min(r["timings"]["load_s"] for r in sweeps)
    sweep_cpu = min(r["cpu_s"] for r in sweeps)
    ratio = best["wall_s"] / warm
    decisions = best["n_configs"] * best["n_requests"]
    report(configs=best["n_configs"], requests=best["n_requests"],
           plain_read_warm_s=round(warm, 3), plain_read_warm_cpu_s=round(warm_cpu, 3),
           plain_read_fresh_s=round(fresh, 3),
           load_s=round(load, 3), load_ratio_warm=round(load / warm, 2), load_ratio_fresh=round(load / fresh, 2),
           sweep_s=round(best["wall_s"], 2), sweep_cpu_s=round(sweep_cpu, 2),
           ratio=round(ratio, 1), cpu_ratio=round(sweep_cpu / warm_cpu, 1),
           floor_ratio=FLOOR_RATIO, decisions_per_s_end_to_end=round(decisions / best["wall_s"]),
           run_timings=best["timings"], peak_rss_bytes=best["peak_rss_bytes"])
    if benchmark.enabled:
        assert best["n_configs"] == 152, best["n_configs"]
        assert ratio <= FLOOR_RATIO, (f"the sweep {best['wall_s']:.2f} s is {ratio:.1f}x the warm plain read "
                                      f"{warm:.2f} s (floor {FLOOR_RATIO:.0f}x)")
