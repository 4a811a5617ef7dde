"""The grid pass's booking list (kernels/one_pass.py, kernels/accumulate.py).

The grid pass visits configs in runs of one (knob group, limit), lists while it
decides the configs whose decision differs from their parent's, and stops at a
run's first config when the limit gates none of the group's candidates (every
floor then decides alike); accumulate.py books only the listed configs.  On
grids of several groups given in a scrambled order (so runs interleave, and a
run's first config hangs off a config of another run far before it), over
traces whose queues pass the limits (so some runs split by floor class and
others do not), the engine must decide as the pure-Python reference, and each
config's totals must equal that config replayed alone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_engine_vs_reference import assert_same
from trace_factory import Shape, random_trace

from replay import reference
from replay.config import RouterConfig
from replay.sweep import engine


def _scrambled_grid(seed: int) -> list[RouterConfig]:
    configs = [RouterConfig(worker_queue_limit=lim, saturation_queue_floor=fl, min_load_choices=k,
                            variant_pin_order=pin)
               for k, pin in ((2, "pressure"), (1, "locality"), (3, "pressure"))
               for lim in (None, 1, 2, 3, 5, 8)
               for fl in (None, 1, 2, 4)
               if lim is None or fl is None or fl <= lim]
    random.Random(seed).shuffle(configs)
    return configs


_SHAPE = Shape(n_requests=150, n_workers=8, n_loads=900, span_s=20.0, max_matches=6, queue_max=9)


@pytest.mark.parametrize("seed", [5, 17])
def test_scrambled_groups_equal_reference(seed):
    trace = random_trace(seed, _SHAPE)
    configs = _scrambled_grid(seed)
    assert_same(reference.replay(trace, configs), engine.decide_all(trace, configs), f"seed {seed}")


def _totals(trace, configs, threads=None):
    t = engine.new_totals(len(configs), threads=threads)
    for _ in engine.iter_chunks(trace, configs, keep=False, totals=t, threads=threads):
        pass
    return t.merged()


@pytest.mark.parametrize("threads", [1, 2])
def test_scrambled_groups_totals_equal_each_config_alone(threads):
    trace = random_trace(23, _SHAPE)
    configs = _scrambled_grid(23)
    grid = _totals(trace, configs, threads)
    assert grid.stats[0, 1] > 0  # some request reached the domain rungs
    # some run splits by floor class: two configs that differ only in the floor book differently
    by_run: dict = {}
    for c, cfg in enumerate(configs):
        by_run.setdefault((cfg.min_load_choices, cfg.variant_pin_order, cfg.worker_queue_limit), []).append(c)
    assert any(not np.array_equal(grid.acc[0][:, cs[0]], grid.acc[0][:, c]) for cs in by_run.values() for c in cs)
    for c, cfg in enumerate(configs):
        alone = _totals(trace, [cfg])
        np.testing.assert_array_equal(grid.acc[0][:, c], alone.acc[0][:, 0], err_msg=str(cfg))
        np.testing.assert_array_equal(grid.hist_wait[0][:, c], alone.hist_wait[0][:, 0], err_msg=str(cfg))
        np.testing.assert_array_equal(grid.hist_div[0][:, c], alone.hist_div[0][:, 0], err_msg=str(cfg))


def test_block_accumulators_stay_bounded_for_large_grids():
    """Smaller blocks for small grids (a chunk waits less for its slowest block),
    but a thread's accumulators never hold more block-configs than the larger of
    ``BLOCK_CONFIGS_PER_THREAD`` and two blocks of the grid (what a 10,000-config
    sweep always took); the sizes ``new_totals`` makes are the ones ``iter_chunks``
    asks for."""
    for n in (1, 152, 500, 501, 1_000, 2_000, 4_000, 10_000):
        per_thread = engine.blocks_per_thread(n)
        assert 2 <= per_thread <= 8
        assert per_thread * n <= max(engine.BLOCK_CONFIGS_PER_THREAD, 2 * n), n
        t = engine.new_totals(n, threads=2)
        assert t.acc.shape[0] == 2 * per_thread
    assert engine.blocks_per_thread(152) > 2      # the bench grid gets the smaller blocks


def test_a_plan_whose_run_starts_off_a_later_config_is_refused():
    """A run that decides alike throughout has only its first config's row
    written, so a run's first config may hang off an earlier run's first config
    only: config_runs refuses a plan that hangs it off another member (and the
    plans encode_configs makes pass)."""
    from replay.kernels import one_pass

    configs = [RouterConfig(worker_queue_limit=lim, saturation_queue_floor=fl)
               for lim in (2, 4) for fl in (None, 1, 2)]
    plan = engine.encode_configs(configs).plan
    gl_cfg, gl_end, _floor, _rep = one_pass.config_runs(plan)
    assert gl_end[0] == 3 and gl_end[3] == 6
    second_run_first = int(gl_cfg[3])
    assert plan.parent[second_run_first] == gl_cfg[0]
    bad_parent = np.array(plan.parent)
    bad_parent[second_run_first] = gl_cfg[2]   # the previous run's last config
    with pytest.raises(ValueError, match="earlier run's first"):
        one_pass.config_runs(plan._replace(parent=bad_parent))
