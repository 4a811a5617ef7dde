"""What the output rule and the plan step cost (issues 9 and 14): ``rundir.guard`` walks
every input file (symlinks resolved), ``sweep.plan`` reads the Parquet footers instead of
an index pass.  Run with ``python -m pytest benches/test_bench_outputs.py --benchmark-enable``."""

from __future__ import annotations

import pytest

from replay import executors, rundir
from replay.generate import generate_trace_set
from replay.sweep import plan
from replay.trace import TraceSet


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    """A trace set of 400 partitions (801 files)."""
    d = tmp_path_factory.mktemp("set") / "ts"
    generate_trace_set(d, n_requests=20_000, n_workers=4, dp_size=2, sample_interval_ms=100, max_matches=4,
                       seed=0, rate_per_s=10, partition_s=5, router_inflight=True)
    return d


def test_bench_guard_on_801_input_files(benchmark, many_files, tmp_path):
    outs = benchmark(rundir.guard, [(tmp_path / "run", "run")], inputs=[many_files])
    assert outs == [tmp_path / "run"]
    benchmark.extra_info["files"] = sum(1 for _ in many_files.rglob("*.parquet"))


def test_bench_plan_from_footers(benchmark, many_files):
    p = benchmark(plan, many_files, None, executors.LocalExecutor())
    assert p.tset is None and p.window_ns == 0


def test_bench_index_pass_the_plan_skips(benchmark, many_files):
    tset = benchmark(TraceSet.open, many_files, hash_files=False)
    assert tset.n_requests == 20_000
