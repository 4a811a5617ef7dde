"""Scale: a streaming sweep of the 100M-request trace set, streaming
against in-memory on a sub-trace that fits, and the Ray executor's overhead
with two local workers against the local executor.

The 100M set (64 workers, dp 2, 100 ms samples, 1000 requests/s, 28 hourly
partitions, ~3.7 GB) is built once by ``_support.bench_set_trace`` (about 5
minutes) and cached; ``ROUTER_REPLAY_BENCH_SET_REQUESTS`` shrinks it for a
smoke run.  Every sweep here is a subprocess (``router-replay sweep``, peak
RSS from ``/usr/bin/time -v``) on the 3 x 3 grid ``SCALE_GRID`` (7 valid
configs), ``--no-decisions --no-report``.
"""

from __future__ import annotations

import sys

import _support as S
import pytest

FLOOR_RSS = 4 * 2**30


@pytest.fixture(scope="module")
def set_dir():
    return S.bench_set_trace(log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="module")
def subset(set_dir, work_dir):
    """The first hourly partition (3.6 M requests): fits in memory."""
    return S.first_partitions(set_dir, 1, work_dir)


def _report(report, r, **more):
    report(wall_s=r["wall_s"], peak_rss_bytes=r["peak_rss_bytes"],
           peak_rss_gib=(r["peak_rss_bytes"] or 0) / 2**30, requests=r["n_requests"], configs=r["n_configs"],
           decisions_per_s=r["decisions_per_s"], timings=r["timings"], execution=r["execution"], **more)


def test_stream_whole_set(benchmark, report, set_dir, warmed, work_dir):
    """The whole set, windows chosen by --window auto: peak RSS must stay under 4 GiB."""
    benchmark.group = "scale-stream"
    r = benchmark.pedantic(S.run_scale_sweep, args=(set_dir, work_dir), rounds=1, iterations=1)
    _report(report, r, floor_peak_rss_bytes=FLOOR_RSS, rss_ok=(r["peak_rss_bytes"] or 0) < FLOOR_RSS)


@pytest.mark.parametrize("mode", ["memory", "stream-15m", "stream-5m"])
def test_stream_against_memory(benchmark, report, subset, warmed, work_dir, mode):
    """One hour (3.6 M requests): in memory, in 15-min windows (what --window auto
    picks for the whole set), in 5-min windows."""
    benchmark.group = "scale-subtrace"
    extra = {"memory": ["--window", "none"], "stream-15m": ["--window", "15m"],
             "stream-5m": ["--window", "5m"]}[mode]
    r = benchmark.pedantic(S.run_scale_sweep, args=(subset, work_dir, *extra), rounds=1, iterations=1)
    _report(report, r, summary_sha256=r["summary_sha256"])


@pytest.mark.parametrize("executor", ["local", "ray"])
def test_ray_overhead(benchmark, report, subset, warmed, work_dir, executor):
    """The same 15-min windows on the local executor and as Ray tasks on a
    local Ray with two workers (one CPU, one numba thread each)."""
    pytest.importorskip("ray")
    benchmark.group = "scale-ray"
    extra = ["--window", "15m"] + (["--executor", "ray", "--ray-cpus", "2"] if executor == "ray" else [])
    r = benchmark.pedantic(S.run_scale_sweep, args=(subset, work_dir, *extra), rounds=1, iterations=1)
    _report(report, r, summary_sha256=r["summary_sha256"])
