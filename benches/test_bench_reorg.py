"""What the reorg engine costs per decision beside a legacy-only sweep of the same grid.

The ``mixed`` grid (60 configs) on the 1M bench trace, as ``sweep --no-decisions``
runs it (``_support.run_engine``): legacy only, reorg only (``--chat-routing
reorg``), and both engines in one grid (120 configs).  The target: reorg adds at
most 30% per decision (reported as ``per_decision_vs_legacy``, never asserted:
the machine is shared).  CPU seconds are reported beside wall seconds.
"""

from __future__ import annotations

import time

import _support as S
import pytest
from conftest import stat

ENGINES = {"legacy": "legacy", "reorg": "reorg", "both": "legacy,reorg"}
FLOOR_RATIO = 1.30
_PER_DECISION: dict[str, float] = {}


@pytest.mark.parametrize("engines", list(ENGINES))
def test_reorg_cost_per_decision(benchmark, report, bench_trace, engines):
    from replay.config import Grid

    g = Grid.from_texts({**S.GRIDS["mixed"], "--chat-routing": ENGINES[engines]})
    cpu: list[float] = []

    def run() -> int:
        t0 = time.process_time()
        n = S.run_engine(bench_trace, g.configs)
        cpu.append(time.process_time() - t0)
        return n

    benchmark.group = f"reorg-{S.size_label(S.BENCH_PARAMS['n_requests'])}"
    n = benchmark.pedantic(run, rounds=2, iterations=1, warmup_rounds=1)
    best = stat(benchmark, "min")
    per = min(cpu) / n
    _PER_DECISION[engines] = per
    base = _PER_DECISION.get("legacy")
    report(grid={**S.GRIDS["mixed"], "--chat-routing": ENGINES[engines]}, configs=len(g.configs), decisions=n,
           decisions_per_s=(n / best) if best else None, cpu_s=min(cpu), cpu_ns_per_decision=per * 1e9,
           per_decision_vs_legacy=(per / base) if base else None, floor_per_decision_vs_legacy=FLOOR_RATIO)
