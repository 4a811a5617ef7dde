"""The grid pass's sharing of cache-rung results across limits (kernels/one_pass.py).

The cache rung is evaluated once per (group, gated-candidate count, fleet all
queued, floor class) and its decision row reused by every limit class with the
same key; configs are visited in runs of one (group, limit).  On grids shaped
like the second speed round's (every limit, every floor up to it, and none) over traces whose
queues reach past the limits, so that limits gate candidates, the rung falls
back and the floors pin, the engine must decide exactly as the pure-Python
reference, config by config, and its totals must equal each config replayed
alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_vs_reference import assert_same
from trace_factory import Shape, random_trace

from replay import reference
from replay.config import RouterConfig
from replay.sweep import engine


def _grid(max_limit: int) -> list[RouterConfig]:
    return [RouterConfig(worker_queue_limit=lim, saturation_queue_floor=fl)
            for lim in range(1, max_limit + 1) for fl in [None, *range(1, lim + 1)]]


@pytest.mark.parametrize("seed", [3, 11, 29])
def test_limit_floor_grid_equals_reference(seed):
    trace = random_trace(seed, Shape(n_requests=160, n_workers=8, n_loads=900, span_s=20.0,
                                     max_matches=6, queue_max=9))
    configs = _grid(7)
    assert_same(reference.replay(trace, configs), engine.decide_all(trace, configs), f"seed {seed}")


def _totals(trace, configs):
    t = engine.new_totals(len(configs))
    for _ in engine.iter_chunks(trace, configs, keep=False, totals=t):
        pass
    return t.merged()


def test_limit_floor_grid_totals_equal_each_config_alone():
    trace = random_trace(7, Shape(n_requests=200, n_workers=8, n_loads=900, span_s=20.0,
                                  max_matches=6, queue_max=9))
    configs = _grid(5)
    grid = _totals(trace, configs)
    for c, cfg in enumerate(configs):
        alone = _totals(trace, [cfg])
        np.testing.assert_array_equal(grid.acc[0][:, c], alone.acc[0][:, 0], err_msg=str(cfg))
        np.testing.assert_array_equal(grid.hist_wait[0][:, c], alone.hist_wait[0][:, 0])
        np.testing.assert_array_equal(grid.hist_div[0][:, c], alone.hist_div[0][:, 0])
