"""Engine throughput: request-config decisions per second on the 1M trace.

``engine.iter_chunks`` over the loaded trace as ``sweep --no-decisions`` runs it:
every decision is booked into the per-config accumulators, none is kept, no Parquet.  Compilation is excluded
(``warmed`` replays the small sample trace first); trace loading is timed separately.
"""

from __future__ import annotations

import time

import _support as S
import pytest
from conftest import stat


def test_load_trace(benchmark, report, bench_trace_dir, warmed):
    """Parquet read + checks + encoding of the 1M trace (``load_trace``)."""
    from replay.trace import load_trace

    benchmark.group = "load"
    tr = benchmark.pedantic(load_trace, args=(bench_trace_dir,), rounds=1, iterations=1)
    report(requests=tr.n_requests, load_rows=int(tr.load_ts.shape[0]))


@pytest.mark.parametrize("grid_name", list(S.GRIDS))
def test_engine_decisions_per_second(benchmark, report, bench_trace, grid_name):
    g = S.grid(grid_name)
    configs = g.configs
    benchmark.group = f"engine-{S.size_label(S.BENCH_PARAMS['n_requests'])}"
    n = benchmark.pedantic(S.run_engine, args=(bench_trace, configs), rounds=2, iterations=1,
                           warmup_rounds=0)
    best = stat(benchmark, "min")
    report(
        grid=S.GRIDS[grid_name], configs=len(configs), skipped=len(g.skipped), decisions=n,
        decisions_per_s=(n / best) if best else None, floor_decisions_per_s=S.FLOORS["decisions_per_s"],
    )


# The second speed round's engine floor: the 152-config grid (16 limits x none,1..16 floors, floor > limit
# refused), on one thread and on two.  Decisions per wall second is the floor's figure; the
# process CPU time per run is reported beside it because the machine is shared (wall figures
# swing with other work, CPU seconds much less).
GRID_152 = S.GRIDS["g152"]
FLOOR_152 = 60e6


@pytest.mark.parametrize("threads", [1, 2])
def test_engine_152_grid(benchmark, report, bench_trace, threads):
    from replay.config import Grid

    configs = Grid.from_texts(GRID_152).configs
    cpu: list[float] = []

    def run() -> int:
        t0 = time.process_time()
        n = S.run_engine(bench_trace, configs, threads=threads)
        cpu.append(time.process_time() - t0)
        return n

    benchmark.group = f"engine-152-{S.size_label(S.BENCH_PARAMS['n_requests'])}"
    n = benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    best = stat(benchmark, "min")
    report(grid=GRID_152, configs=len(configs), threads=threads, decisions=n,
           decisions_per_s=(n / best) if best else None, cpu_s=min(cpu),
           decisions_per_cpu_s=n / min(cpu), floor_decisions_per_s=FLOOR_152)


# Policy variants: the "mixed" grid under each variant, and under both values
# of both at once (4 x the configs); what each variant costs against the router's rules.
VARIANT_GRIDS = {
    "router": {},
    "pin_locality": {"--pin-order": "locality"},
    "per_worker": {"--floor-scaling": "per-worker"},
    "all_four": {"--pin-order": "pressure,locality", "--floor-scaling": "fleet,per-worker"},
}


@pytest.mark.parametrize("variant", list(VARIANT_GRIDS))
def test_engine_variant_cost(benchmark, report, bench_trace, variant):
    from replay.config import Grid

    g = Grid.from_texts({**S.GRIDS["mixed"], **VARIANT_GRIDS[variant]})
    benchmark.group = f"engine-variants-{S.size_label(S.BENCH_PARAMS['n_requests'])}"
    n = benchmark.pedantic(S.run_engine, args=(bench_trace, g.configs), rounds=2, iterations=1,
                           warmup_rounds=0)
    best = stat(benchmark, "min")
    report(grid={**S.GRIDS["mixed"], **VARIANT_GRIDS[variant]}, configs=len(g.configs), decisions=n,
           decisions_per_s=(n / best) if best else None)
