"""Engine throughput: request-config decisions per second on the 1M trace.

``engine.iter_chunks`` over the loaded trace as ``sweep --no-decisions`` runs it:
every decision is booked into the per-config accumulators, none is kept, no Parquet.  Compilation is excluded (``warmed``
replays the small sample trace first); trace loading is timed separately.
"""

from __future__ import annotations

import pytest

import _support as S
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


# Policy variants (issue 15): the "mixed" grid under each variant, and under both values
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
