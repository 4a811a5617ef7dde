"""The numba engine against the pure-Python reference, decision by decision.

Both implement ROUTER_SEMANTICS.md independently; every field of every
(request, config) decision must be identical, on generated traces full of
edge cases, on a trace read from real Parquet files, and whatever the thread
count, chunk size or config order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trace_factory import Shape, random_trace, shape_strategy

from replay import reference
from replay.config import Grid, RouterConfig
from replay.sweep import engine
from replay.trace import load_trace
from replay.trace.synthetic import generate_trace


def assert_same(ref: dict, ker: dict, context: str = "") -> None:
    assert ref.keys() == ker.keys()
    for name in ref:
        a, b = ref[name], ker[name]
        assert a.shape == b.shape, name
        if a.dtype.kind == "f":
            same = (a == b) | (np.isnan(a) & np.isnan(b))
        else:
            same = a == b
        if not same.all():
            i, c = np.argwhere(~same)[0]
            raise AssertionError(
                f"{context} field {name!r} differs at request {i}, config {c}: "
                f"reference {a[i, c]!r}, kernel {b[i, c]!r} ({int((~same).sum())} cells differ)")


def mixed_configs() -> list[RouterConfig]:
    """Gate, floor, sampler, guard and candidate knobs crossed (valid and not)."""
    out = []
    for limit, floor in ((None, None), (2, None), (2, 1), (2, 2), (5, None), (5, 3), (1, 1)):
        for k in (1, 2, 3, 9):
            for guard, ms, rel in ((True, None, 1.5), (True, 5.0, 1.2), (False, None, 1.5)):
                out.append(RouterConfig(
                    worker_queue_limit=limit, saturation_queue_floor=floor, min_load_choices=k,
                    pressure_guard=guard, pressure_abs_threshold_ms=ms, pressure_rel_threshold=rel,
                    cache_affinity_min_matched_tokens=(0 if k != 3 else 1024),
                    cache_affinity_min_match_ratio=(0.3 if k == 9 else None),
                    cache_candidate_min_workers=(2 if k == 1 else 8),
                    cache_switch_margin_tokens=(0 if k == 2 else 1024),
                    pressure_abs_threshold_tokens=(0 if guard and k == 3 else 1024),
                ))
    return out


CONFIGS = mixed_configs()

shapes = shape_strategy(max_requests=60, max_workers=7, max_loads=300, spans=[2.0, 10.0, 40.0],
                        max_matches=6, queue_max=[0, 2, 8])



@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, rng_seed=st.integers(0, 2**63 - 1))
def test_kernel_equals_reference_on_generated_traces(seed, shape, rng_seed):
    trace = random_trace(seed, shape)
    ref = reference.replay(trace, CONFIGS, seed=rng_seed)
    ker = engine.decide_all(trace, CONFIGS, seed=rng_seed)
    assert_same(ref, ker, f"trace seed {seed}, {shape}")


@pytest.mark.parametrize("freshness_ms", [0, 1000, 5000])
def test_kernel_equals_reference_under_freshness(freshness_ms):
    trace = random_trace(11, Shape(n_requests=150, n_loads=500, span_s=30.0))
    ns = freshness_ms * 1_000_000
    assert_same(reference.replay(trace, CONFIGS, seed=5, freshness_ns=ns),
                engine.decide_all(trace, CONFIGS, seed=5, freshness_ns=ns), f"freshness {freshness_ms}")


@pytest.fixture(scope="module")
def parquet_trace(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "trace"
    generate_trace(out, n_requests=1500, n_workers=6, dp_size=2, sample_interval_ms=100,
                   max_matches=8, seed=3)
    return load_trace(out)


def test_kernel_equals_reference_on_a_parquet_trace(parquet_trace):
    grid = Grid.from_texts({"--worker-queue-limit": "none,1..4,8",
                            "--saturation-queue-floor": "none,1..3",
                            "--min-load-choices": "1,2,16"})
    ref = reference.replay(parquet_trace, grid.configs, seed=1)
    ker = engine.decide_all(parquet_trace, grid.configs, seed=1)
    assert_same(ref, ker, "generated parquet trace")
    # the grid must exercise what it claims to: every mechanism fires somewhere
    reasons = set(np.unique(ker["reason"]).tolist())
    assert {0, 1, 6}.issubset(reasons), reasons  # Primary, CacheCandidate, SaturationPin
    assert ker["fell_back"].any() and (ker["decision"] == 2).any()  # fell-back tier, cache_worker_queued


def test_results_do_not_depend_on_threads_chunks_or_config_order(parquet_trace):
    configs = mixed_configs()
    base = engine.decide_all(parquet_trace, configs, seed=9, threads=2)
    one = engine.decide_all(parquet_trace, configs, seed=9, threads=1, chunk_decisions=997)
    assert_same(base, one, "threads")
    # many small blocks (each starting from a pre-swept state) and many chunks
    small = engine.decide_all(parquet_trace, configs, seed=9, chunk_decisions=5000, blocks=7)
    assert_same(base, small, "blocks/chunks")
    order = np.random.default_rng(0).permutation(len(configs))
    shuffled = engine.decide_all(parquet_trace, [configs[i] for i in order], seed=9)
    assert_same(base, {k: v[:, np.argsort(order)] for k, v in shuffled.items()}, "config order")


def test_each_config_alone_equals_its_column_in_the_grid(parquet_trace):
    """The per-request outcome memo must never leak one config's result into another."""
    configs = mixed_configs()[::5]
    together = engine.decide_all(parquet_trace, configs, seed=2)
    for c, cfg in enumerate(configs):
        alone = engine.decide_all(parquet_trace, [cfg], seed=2)
        assert_same({k: v[:, c:c + 1] for k, v in together.items()}, alone, f"config {c}")


def test_seed_changes_only_sampler_draws(parquet_trace):
    cfg = [RouterConfig(worker_queue_limit=4)]
    a = engine.decide_all(parquet_trace, cfg, seed=1)
    b = engine.decide_all(parquet_trace, cfg, seed=2)
    cache_rung = (a["reason"] == 1) | (a["reason"] == 6)
    assert (a["worker"][cache_rung] == b["worker"][cache_rung]).all()
    assert (a["worker"] != b["worker"]).any()  # the sampler did draw differently somewhere


def test_totals_equal_with_and_without_kept_decisions(parquet_trace):
    configs = mixed_configs()[:12]
    totals = []
    for keep, blocks in ((True, None), (False, None), (False, 29)):
        t = engine.new_totals(len(configs), blocks=blocks)
        for _ in engine.iter_chunks(parquet_trace, configs, seed=4, keep=keep, totals=t,
                                    blocks=blocks):
            pass
        totals.append(t.merged())
    for t in totals[1:]:
        assert (t.acc == totals[0].acc).all()
        assert (t.hist_wait == totals[0].hist_wait).all()
        assert (t.hist_div == totals[0].hist_div).all()
    assert totals[0].acc.sum() > 0


def test_grid_totals_equal_each_config_replayed_alone(parquet_trace):
    """Configs are booked relative to a neighbouring config and folded at the end;
    the folded totals must equal a run of that config alone."""
    grid = Grid.from_texts({"--worker-queue-limit": "none,1..4",
                            "--saturation-queue-floor": "none,1..3",
                            "--min-load-choices": "1,2"})

    def totals_of(configs):
        t = engine.new_totals(len(configs))
        for _ in engine.iter_chunks(parquet_trace, configs, seed=6, keep=False, totals=t):
            pass
        return t.merged()

    together = totals_of(grid.configs)
    assert (together.acc[0][0] == parquet_trace.n_requests).all()  # "requests" of every config
    for c, cfg in enumerate(grid.configs):
        alone = totals_of([cfg])
        assert (together.acc[0][:, c] == alone.acc[0][:, 0]).all(), f"config {c}"
        assert (together.hist_wait[0][:, c] == alone.hist_wait[0][:, 0]).all(), f"config {c}"
        assert (together.hist_div[0][:, c] == alone.hist_div[0][:, 0]).all(), f"config {c}"


@pytest.mark.parametrize("n_workers", [63, 64, 65, 130, 200])
def test_kernel_equals_reference_on_fleets_over_a_word(n_workers):
    """The grid pass keeps the sampler's tier as a bit set, 64 fleet positions a
    word: fleets at and across word boundaries, tiers of every size (small queue
    readings against limits 1..8), and samples of every size (k = 1 draw, a
    partial shuffle, a shuffle of the whole tier, k >= the tier)."""
    trace = random_trace(n_workers, Shape(n_requests=200, n_workers=n_workers, n_loads=12 * n_workers,
                                          span_s=10.0, queue_max=8, max_matches=6))
    configs = [RouterConfig(worker_queue_limit=limit, saturation_queue_floor=floor, min_load_choices=k)
               for limit in (None, 1, 3, 8) for floor in (None, 1) if floor is None or limit
               for k in (1, 2, 40, 250)]
    ref = reference.replay(trace, configs, seed=n_workers)
    ker = engine.decide_all(trace, configs, seed=n_workers)
    assert_same(ref, ker, f"{n_workers} workers")
    # the sampler's rungs did choose, from tiers that are neither empty nor the whole fleet
    assert (ker["reason"] == 0).any()


def reorg_configs() -> list[RouterConfig]:
    """The reorg engine's knobs crossed with the gate, floor, guard and candidate knobs,
    beside two legacy configs (one grid holds both engines)."""
    out = [RouterConfig(), RouterConfig(worker_queue_limit=2, saturation_queue_floor=1)]
    for limit, floor in ((None, None), (2, None), (2, 1), (5, 3), (1, 1)):
        for ranking, n in (("power-of-n", None), ("power-of-n", 3), ("power-of-n-fold", 9), ("power-of-two", None)):
            for cap in (None, 1, 3):
                out.append(RouterConfig(
                    chat_routing="reorg", worker_queue_limit=limit, saturation_queue_floor=floor,
                    power_of_n_choices=n, variant_reorg_ranking=ranking, max_in_flight=cap,
                    cache_affinity_min_matched_tokens=(0 if cap != 3 else 1024),
                    cache_affinity_min_match_ratio=(0.3 if n == 9 else None),
                    cache_candidate_min_workers=(2 if n == 3 else 8),
                    cache_switch_margin_tokens=(0 if cap is None else 1024),
                    pressure_guard=ranking != "power-of-two", pressure_abs_threshold_ms=(5.0 if n == 3 else None)))
    return out


REORG_CONFIGS = reorg_configs()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, rng_seed=st.integers(0, 2**63 - 1))
def test_reorg_kernel_equals_reference_on_generated_traces(seed, shape, rng_seed):
    """Plain, prefill and mixed fleets (the buckets), duplicate and unknown match entries
    (the depth merge), caps that reject (503s) and every ranking revision."""
    trace = random_trace(seed, shape)
    assert_same(reference.replay(trace, REORG_CONFIGS, seed=rng_seed),
                engine.decide_all(trace, REORG_CONFIGS, seed=rng_seed), f"trace seed {seed}, {shape}")


def test_reorg_kernel_equals_reference_on_a_parquet_trace(parquet_trace):
    grid = Grid.from_texts({"--chat-routing": "legacy,reorg", "--worker-queue-limit": "none,1..4",
                            "--saturation-queue-floor": "none,1,2", "--max-in-flight": "none,2",
                            "--power-of-n-choices": "none,3"})
    ref = reference.replay(parquet_trace, grid.configs, seed=1)
    ker = engine.decide_all(parquet_trace, grid.configs, seed=1)
    assert_same(ref, ker, "generated parquet trace, both engines")
    reorg = np.array([c.chat_routing == "reorg" for c in grid.configs])
    outcomes = set(np.unique(ker["reorg_outcome"][:, reorg]).tolist())
    assert {0, 1, 2, 3} <= outcomes, outcomes   # cache win, pin, miss fallback and 503s all occur
    assert (ker["reorg_outcome"][:, ~reorg] == -1).all() and (ker["decision"][:, reorg] == -1).all()
    # a reorg config alone decides as its column in the grid (the shared outcome memo)
    c = int(np.flatnonzero(reorg)[7])
    alone = engine.decide_all(parquet_trace, [grid.configs[c]], seed=1)
    assert_same({k: v[:, c:c + 1] for k, v in ker.items()}, alone, "reorg config alone")
