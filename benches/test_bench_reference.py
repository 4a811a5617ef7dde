"""Ratio of the engine to ``replay/reference.py`` on the same sub-traces.

Sub-traces of the 1M trace (``_support.subtraces``): its first 2,000
requests (calm) and 2,000 requests inside the first fleet-saturating burst,
each with the load rows of the minute before.  Both engines produce the full
decision arrays (``decide_all`` vs ``reference.replay``) under the same
configs; pytest-benchmark's group table shows the ratio, and the engine's
``extra_info`` carries it once the reference has run.
"""

from __future__ import annotations

import _support as S
import pytest
from conftest import stat

_REF_BEST: dict[tuple[str, str], float] = {}
_REF_OUT: dict[tuple[str, str], dict] = {}


@pytest.mark.parametrize("grid_name", ["mixed"])
@pytest.mark.parametrize("window", ["head", "burst"])
def test_reference(benchmark, report, subtraces, grid_name, window):
    tr = subtraces[window]
    configs = S.grid(grid_name).configs
    benchmark.group = f"reference-ratio-{window}-{grid_name}"
    _REF_OUT[(window, grid_name)] = benchmark.pedantic(S.run_reference, args=(tr, configs),
                                                       rounds=1, iterations=1)
    best = stat(benchmark, "min")
    if best:
        _REF_BEST[(window, grid_name)] = best
    report(requests=tr.n_requests, configs=len(configs),
                                decisions_per_s=(tr.n_requests * len(configs) / best) if best else None)


@pytest.mark.parametrize("grid_name", ["mixed"])
@pytest.mark.parametrize("window", ["head", "burst"])
def test_engine_same_subtrace(benchmark, report, subtraces, warmed, grid_name, window):
    tr = subtraces[window]
    configs = S.grid(grid_name).configs
    benchmark.group = f"reference-ratio-{window}-{grid_name}"
    out = benchmark.pedantic(S.run_decide_all, args=(tr, configs), rounds=3, iterations=1,
                             warmup_rounds=1)
    best = stat(benchmark, "min")
    ref = _REF_BEST.get((window, grid_name))
    report(
        requests=tr.n_requests, configs=len(configs),
        decisions_per_s=(tr.n_requests * len(configs) / best) if best else None,
        ratio_to_reference=(ref / best) if (ref and best) else None,
        floor_ratio=S.FLOORS["reference_ratio"],
    )
    # sanity, not a test of correctness (tests/ does that): the same work was done
    ref_out = _REF_OUT.get((window, grid_name))
    report(same_as_reference=S.same_decisions(out, ref_out) if ref_out else None)
