"""The grid pass's limit and floor classes (kernels/one_pass.py) beyond its counting pass.

Limits and floors up to ``one_pass._HIST_MAX`` are classed by one counting pass
over the fleet's queue readings; a grid holding a larger value scans instead.
Both must decide exactly as the pure-Python reference, on traces whose
waiting counts reach past the bound.
"""

from __future__ import annotations

import pytest
from test_engine_vs_reference import assert_same
from trace_factory import Shape, random_trace

from replay import reference
from replay.config import RouterConfig
from replay.kernels import one_pass
from replay.sweep import engine

BIG = one_pass._HIST_MAX


@pytest.mark.parametrize("seed", [5, 23])
@pytest.mark.parametrize("pairs", [
    # every value within the counting pass
    ((None, None), (1, None), (2, 1), (3, 3), (BIG, None), (BIG, BIG), (BIG - 1, 2)),
    # one value past it: the whole grid scans
    ((None, None), (2, None), (2, 1), (BIG + 1, None), (BIG + 1, BIG), (3 * BIG, 1)),
], ids=["counted", "scanned"])
def test_classes_equal_reference_around_the_counting_bound(seed, pairs):
    trace = random_trace(seed, Shape(n_requests=150, n_workers=6, n_loads=700, span_s=20.0,
                                     queue_max=3 * BIG + 5))
    configs = [RouterConfig(worker_queue_limit=lim, saturation_queue_floor=fl) for lim, fl in pairs]
    assert_same(reference.replay(trace, configs), engine.decide_all(trace, configs),
                f"seed {seed}")
