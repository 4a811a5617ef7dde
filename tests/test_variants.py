"""Replay-only policy variants (docs/replay-model.md, "Policy variants").

``--pin-order locality`` and ``--floor-scaling per-worker`` are built twice,
in the reference and the kernels, and held equal here by the same property
runs as the router's own logic; the properties each variant promises are
checked, including where an equivalence must break (a mixed-dp fleet), and
the variants go through the real CLI and the closed-loop simulator.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_vs_reference import CONFIGS, assert_same, shapes
from test_waterfall import BASE, lost_of, one_request
from trace_factory import Shape, random_trace

from replay import labels, reference
from replay.cli import main
from replay.config import Grid, RouterConfig
from replay.fields import waterfall_terms
from replay.sweep import engine

VARIANTS = [("pressure", "fleet"), ("locality", "fleet"), ("pressure", "per-worker"),
            ("locality", "per-worker")]


def with_variants(configs, variants=VARIANTS):
    return [dataclasses.replace(c, variant_pin_order=p, variant_floor_scaling=f)
            for c in configs for p, f in variants]


VARIANT_CONFIGS = with_variants(CONFIGS[::4])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), shape=shapes, rng_seed=st.integers(0, 2**63 - 1))
def test_kernel_equals_reference_under_variants(seed, shape, rng_seed):
    trace = random_trace(seed, shape)
    assert_same(reference.replay(trace, VARIANT_CONFIGS, seed=rng_seed),
                engine.decide_all(trace, VARIANT_CONFIGS, seed=rng_seed), f"trace seed {seed}, {shape}")


def test_variants_change_decisions_and_grid_sharing_is_exact():
    """Not vacuous: each variant changes some decision; and a variant config
    decided alone equals its column in the mixed grid (the one-pass sharing)."""
    changed = {"locality": 0, "per-worker": 0}
    for seed in range(4):
        tr = random_trace(seed, Shape(n_workers=6, n_ranks=3, dp_known=False, queue_max=8))
        dec = engine.decide_all(tr, VARIANT_CONFIGS, seed=seed)
        w = dec["worker"].reshape(tr.n_requests, -1, len(VARIANTS))
        changed["locality"] += int((w[:, :, 1] != w[:, :, 0]).sum())
        changed["per-worker"] += int((w[:, :, 2] != w[:, :, 0]).sum())
        for c in (1, 6, 11, 14):
            alone = engine.decide_all(tr, [VARIANT_CONFIGS[c]], seed=seed)
            for name in dec:
                assert np.array_equal(alone[name][:, 0], dec[name][:, c],
                                      equal_nan=dec[name].dtype.kind == "f"), (c, name)
    assert changed["locality"] > 0 and changed["per-worker"] > 0, changed


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_per_worker_equals_fleet_scaling_on_a_uniform_fleet(dp):
    """With one dp_size d everywhere, a per-rank (limit, floor) under per-worker
    scaling decides exactly as (limit x d, floor x d) under the router's scaling."""
    tr = random_trace(21 + dp, Shape(n_workers=6, n_ranks=dp, dp_known=True, queue_max=4 * dp))
    pairs = [(None, None), (1, None), (2, 1), (3, 3), (2, 2)]
    per_worker = [RouterConfig(worker_queue_limit=lim, saturation_queue_floor=fl,
                               variant_floor_scaling="per-worker") for lim, fl in pairs]
    fleet = [RouterConfig(worker_queue_limit=None if lim is None else lim * dp,
                          saturation_queue_floor=None if fl is None else fl * dp) for lim, fl in pairs]
    assert_same(engine.decide_all(tr, fleet, seed=3), engine.decide_all(tr, per_worker, seed=3))


def test_per_worker_differs_from_fleet_scaling_on_a_mixed_fleet():
    """The same identity must fail where dp_size differs between workers: a
    worker with dp 1 reading 2 waiting is gated by a per-rank limit 2 under
    per-worker scaling, but not by the fleet value 2 x 2 = 4."""
    tr = one_request({"a": (8, 2, 0), "b": (5, 0, 0)}, extra_workers=("c",))
    tr.worker_dp_size[:] = [1, 2, 2]  # a: dp 1 (its one rank is its only required rank)
    per_worker = lost_of(tr, RouterConfig(worker_queue_limit=2, variant_floor_scaling="per-worker", **BASE))
    fleet = lost_of(tr, RouterConfig(worker_queue_limit=4, **BASE))
    assert fleet["worker"] == "a" and fleet["lost_queue_gate"] == 0
    assert per_worker["worker"] == "b" and per_worker["lost_queue_gate"] == 3


def one_request_dp(owners, dps):
    tr = one_request(owners)
    tr.worker_dp_size[:] = dps
    return tr


def test_locality_pin_takes_the_deepest_owner():
    # the pressure pin of test_waterfall takes b (less in flight), 3 blocks shallower;
    # the locality order takes a, the deepest gated owner, and loses nothing
    tr = one_request({"a": (7, 6, 4), "b": (4, 3, 1)})
    cfg = RouterConfig(worker_queue_limit=3, saturation_queue_floor=2, **BASE)
    assert lost_of(tr, cfg)["worker"] == "b"
    got = lost_of(tr, dataclasses.replace(cfg, variant_pin_order="locality"))
    assert got["worker"] == "a" and sum(got[f"lost_{s}"] for s in labels.LOSS_STEPS) == 0


def test_locality_pin_never_loses_to_the_pin():
    """Property: a locality-ordered pin takes the deepest owner of its pool
    (lost_pin is 0), and where both orders pin, it holds at least as many blocks.
    (Match entries of 0 blocks are raised to 1 first: with a worker's first entry
    at 0 blocks and a later one deeper, its candidate depth and its booked
    selected_blocks differ by docs/replay-model.md's first-entry rule.)"""
    deeper = 0
    for seed in range(5):
        tr = random_trace(seed, Shape(n_workers=7, queue_max=8, max_matches=6))
        tr.match_blocks = np.maximum(tr.match_blocks, 1)
        cfgs = with_variants(CONFIGS, [("pressure", "fleet"), ("locality", "fleet")])
        dec = engine.decide_all(tr, cfgs, seed=seed)
        terms = waterfall_terms(dec)
        loc = np.arange(len(cfgs)) % 2 == 1
        assert (terms["lost_pin"][:, loc] == 0).all()
        pinned = (dec["reason"][:, loc] == labels.SATURATION_PIN) & (dec["reason"][:, ~loc] == labels.SATURATION_PIN)
        sel_loc, sel_pr = dec["selected_blocks"][:, loc], dec["selected_blocks"][:, ~loc]
        assert (sel_loc[pinned] >= sel_pr[pinned]).all()
        deeper += int((sel_loc[pinned] > sel_pr[pinned]).sum())
    assert deeper > 0


# ---------------------------------------------------------------------------
# the real CLI and the closed loop


def test_sweep_cli_sweeps_variants(gen_trace, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(out), "-q",
                                    "--worker-queue-limit", "2,4", "--saturation-queue-floor", "none,1",
                                    "--pin-order", "pressure,locality",
                                    "--floor-scaling", "fleet,per-worker", "--per-dp-rank"])
    assert res.exit_code == 0, res.output
    s = pl.read_parquet(out / "summary.parquet")
    assert s.height == 2 * 2 * 2 * 2
    assert set(s["variant_pin_order"]) == {"pressure", "locality"}
    assert set(s["variant_floor_scaling"]) == {"fleet", "per-worker"}
    # --per-dp-rank scales the router's fleet values only; per-worker keeps per-rank values
    dp = s["dp_size"][0]
    fleet = s.filter(pl.col("variant_floor_scaling") == "fleet")
    pw = s.filter(pl.col("variant_floor_scaling") == "per-worker")
    assert sorted(set(fleet["worker_queue_limit"])) == [2 * dp, 4 * dp]
    assert sorted(set(pw["worker_queue_limit"])) == [2, 4]
    # the generated fleet has one dp_size: per-worker equals fleet scaling there, config by config
    keys = ["per_rank_limit", "per_rank_floor", "variant_pin_order"]
    both = fleet.join(pw, on=keys, suffix="_pw", nulls_equal=True)
    assert both.height == 8 and (both["hit_rate"] == both["hit_rate_pw"]).all()
    assert (s.filter(pl.col("variant_pin_order") == "locality")["lost_pin"] == 0).all()
    run = json.loads((out / "run.json").read_text())
    assert run["grid"]["flags"]["variant_pin_order"] == "--pin-order"
    # bad values: one line naming the flag, exit 2
    bad = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(tmp_path / "x"),
                                    "--pin-order", "deepest"])
    assert bad.exit_code == 2 and "--pin-order: 'deepest' is not one of pressure, locality" in bad.output


def test_help_marks_variants_as_not_router_flags():
    res = CliRunner().invoke(main, ["sweep", "--help"], terminal_width=200)
    text = " ".join(res.output.split())
    assert "--pin-order" in text and "--floor-scaling" in text
    assert text.count("not a router flag") >= 2


def test_grid_keeps_variants_out_of_router_flags():
    cfg = RouterConfig(worker_queue_limit=4, variant_pin_order="locality")
    assert cfg.given_flags() == {"worker_queue_limit": 4}
    assert cfg.variants() == {"variant_pin_order": "locality"}
    g = Grid({"--worker-queue-limit": "4", "--pin-order": "locality,pressure"})
    assert [c.variant_pin_order for c in g.configs] == ["locality", "pressure"]


def test_closed_loop_simulator_runs_a_variant(tmp_path):
    """The simulator calls the decision kernel with the config's knobs, so a
    variant just works: sweeping the simulated trace with the same variant
    reproduces every decision (agreement 1.0), and not without it."""
    from replay import run_sweep
    from replay.simulate import FleetSpec, build_fleet, generate_log, simulate

    # a saturating fleet (8 workers, 80 requests/s over 6 shared prompts) where pins happen
    # with owners of different depths
    log = generate_log(1500, seed=3, rate_per_s=80.0, n_prompts=6)
    # (prefix_affinity, the simulator's old in-worker rule: each worker's load on one rank)
    fleet = build_fleet(FleetSpec(workers=8, dp_size=2, prefill_tokens_per_s=6000,
                                  max_running_requests=8, max_total_num_tokens=40_000,
                                  load_balance_method="prefix_affinity"))
    cfg = RouterConfig(worker_queue_limit=2, saturation_queue_floor=1, variant_pin_order="locality")
    res = simulate(log, fleet, cfg, tmp_path / "t", seed=5)
    knobs = {"worker_queue_limit": "2", "saturation_queue_floor": "1"}
    same = run_sweep(tmp_path / "t", {**knobs, "variant_pin_order": "locality"}, seed=5).summary.row(0, named=True)
    assert same["agreement"] == 1.0 and same["pinned"] > 0 and same["requests"] == res.summary["requests"]
    other = run_sweep(tmp_path / "t", knobs, seed=5).summary.row(0, named=True)
    assert other["agreement"] < 1.0


def test_compare_a_variant_against_the_router(gen_trace, tmp_path):
    """compare matches a variant run to the router's run of the same grid by the
    router's knobs, and shows the changed waterfall terms and requests."""
    from replay.analysis.runs import compare_runs

    grid = ["--worker-queue-limit", "2,3", "--saturation-queue-floor", "1"]
    for name, extra in (("router", []), ("locality", ["--pin-order", "locality"])):
        res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(tmp_path / name), "-q",
                                        *grid, *extra])
        assert res.exit_code == 0, res.output
    cmp = compare_runs(tmp_path / "router", tmp_path / "locality")
    assert cmp.pairs.height == 2 and not cmp.only_a and not cmp.only_b
    lost_pin = cmp.deltas.filter(pl.col("metric") == "lost_pin")
    assert (lost_pin["b"] == 0).all() and (lost_pin["a"] > 0).any()
    assert cmp.changed.collect().height > 0
    res = CliRunner().invoke(main, ["compare", str(tmp_path / "router"), str(tmp_path / "locality")])
    assert res.exit_code == 0, res.output
    assert "locality waterfall, B - A in blocks" in res.output and " pin -" in res.output



def test_report_and_recommend_say_a_variant_is_not_a_router_flag(gen_trace, tmp_path):
    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(run), "-q",
                                    "--worker-queue-limit", "2,4", "--saturation-queue-floor", "1",
                                    "--pin-order", "pressure,locality"])
    assert res.exit_code == 0, res.output
    assert "--pin-order (a replay-only policy variant, not a router flag)" in (run / "report.html").read_text()
    only = tmp_path / "only"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(only), "-q",
                                    "--worker-queue-limit", "2,4", "--saturation-queue-floor", "1",
                                    "--pin-order", "locality"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["recommend", str(only), "--max-p99-waiting", "1000"])
    assert res.exit_code == 0, res.output
    assert "needs the replay-only policy variant --pin-order locality: not a router flag" in res.output


def test_report_draws_each_variant_as_its_own_series(gen_trace, tmp_path):
    """In the hit-rate / pressure plot, configs under a policy variant are their own
    series (named, marked as not a router flag); the router's own configs stay one series."""
    from replay.report.run_page import figures

    run = tmp_path / "run"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(run), "-q", "--no-report",
                                    "--worker-queue-limit", "2,3,4", "--saturation-queue-floor", "none,1",
                                    "--pin-order", "pressure,locality"])
    assert res.exit_code == 0, res.output
    summary = pl.read_parquet(run / "summary.parquet")
    fig = figures(run)["tradeoff"]
    left = [t for t in fig.data if t.xaxis in (None, "x")]
    names = {t.name for t in left}
    tag = "variant --pin-order locality (not a router flag)"
    assert tag in names and "config" in names
    front = next(t for t in left if t.name == "Pareto front")
    drawn = {(x, y) for t in left if t.name in ("config", tag, "Pareto front") for x, y in zip(t.x, t.y, strict=True)}
    every = {(r["selected_waiting_p99"], r["hit_rate"]) for r in summary.iter_rows(named=True)
             if r["selected_waiting_p99"] is not None and r["hit_rate"] is not None}
    assert drawn == every                                   # every config drawn, in one of the series
    loc = {(r["selected_waiting_p99"], r["hit_rate"])
           for r in summary.filter(pl.col("variant_pin_order") == "locality").iter_rows(named=True)}
    series = next(t for t in left if t.name == tag)
    assert set(zip(series.x, series.y, strict=True)) <= loc  # the variant's series holds only its configs
    off_front = loc - set(zip(front.x, front.y, strict=True))
    assert off_front <= set(zip(series.x, series.y, strict=True))   # ... and all of them off the front
