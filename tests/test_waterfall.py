"""The locality waterfall (docs/replay-model.md, "Where locality goes").

Per decision the kernels and the reference each store three terms and the
label of the first step that lost blocks (field by field equal:
test_engine_vs_reference.py); here: the six terms add up to
``matched - selected`` on every routed decision, every step is reached, the
kernels' integer accumulators equal the reference's terms summed, and on
hand-built requests each step loses exactly the blocks worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_vs_reference import CONFIGS
from trace_factory import Shape, random_trace

from replay import labels, reference
from replay.config import RouterConfig
from replay.fields import waterfall_terms
from replay.kernels.layout import ACC
from replay.sweep import engine
from replay.sweep.results import Accumulator
from replay.trace import Trace

STEPS = [f"lost_{s}" for s in labels.LOSS_STEPS]
SHAPES = [Shape(), Shape(n_workers=7, queue_max=8, max_matches=6, tail_share=1.0),
          Shape(n_workers=4, queue_max=2, n_ranks=1, tail_share=0.5)]


def _routed_with_match(dec):
    return (dec["worker"] >= 0) & (dec["matched_blocks"] > 0)


def test_terms_add_up_and_reach_every_step():
    reached = set()
    for seed, shape in enumerate(SHAPES):
        tr = random_trace(seed, shape)
        dec = engine.decide_all(tr, CONFIGS, seed=seed)
        terms = waterfall_terms(dec)
        routed = dec["worker"] >= 0
        total = sum(terms[s] for s in STEPS)
        assert (total[routed] == (dec["matched_blocks"] - dec["selected_blocks"])[routed]).all()
        for s in STEPS:
            assert (terms[s] >= 0).all(), s
            assert (terms[s][~routed] == 0).all(), s
            if terms[s].any():
                reached.add(s)
        # lost_to names the first step (chain order) with a positive term
        first = np.full(dec["worker"].shape, labels.NO_LOSS)
        for k in range(len(STEPS) - 1, -1, -1):
            first = np.where(terms[STEPS[k]] > 0, k, first)
        assert (dec["lost_to"] == first).all()
    assert reached == set(STEPS), sorted(set(STEPS) - reached)


@pytest.mark.parametrize("blocks", [1, 3])
def test_kernel_accumulators_equal_reference_terms(blocks):
    tr = random_trace(11, SHAPES[1])
    ref = reference.replay(tr, CONFIGS, seed=4)
    mask = _routed_with_match(ref)
    terms = waterfall_terms(ref)
    totals = engine.new_totals(len(CONFIGS), blocks=blocks)
    for _ in engine.iter_chunks(tr, CONFIGS, seed=4, keep=False, totals=totals, blocks=blocks,
                                chunk_decisions=40 * len(CONFIGS)):
        pass
    acc = totals.merged().acc[0]
    for s in STEPS:
        want = np.where(mask, terms[s], 0).sum(axis=0)
        assert (acc[ACC[s]] == want).all(), s
    # the summary's terms add up to matched - selected, config by config
    rows = [{"config_id": c} for c in range(len(CONFIGS))]
    summ = Accumulator(len(CONFIGS), totals).summary(rows, has_selected=False)
    lost = sum(summ[s].to_numpy() for s in STEPS)
    assert (summ["matched_blocks"].to_numpy() - lost == summ["selected_blocks"].to_numpy()).all()
    assert summ.select(STEPS).to_numpy().sum() > 0


# ---------------------------------------------------------------------------
# hand-built requests: the truth worked out by hand

MS = 1_000_000


def one_request(owners: dict[str, tuple[int, int, int]], query_blocks: int = 10,
                extra_workers: tuple[str, ...] = ()) -> Trace:
    """One request at t=1 s whose prefix is held by ``owners``: name -> (blocks,
    waiting, router_inflight); every worker (owners and ``extra_workers``,
    which hold nothing and wait 0) has one fresh basic sample (no native tail,
    so capacity admits everyone and pressure is the router-local in-flight count)."""
    names = sorted(set(owners) | set(extra_workers))
    wid = {n: i for i, n in enumerate(names)}
    n = len(names)
    waiting = [owners.get(w, (0, 0, 0))[1] for w in names]
    inflight = [owners.get(w, (0, 0, 0))[2] for w in names]
    mw = [wid[w] for w in owners]
    mb = [owners[w][0] for w in owners]
    z = np.zeros(n, dtype=np.int64)
    return Trace(
        path="memory:one", workers=names, models=["m"], worker_model=np.zeros(n, dtype=np.int32),
        worker_role=np.zeros(n, dtype=np.int8), worker_dp_size=np.ones(n, dtype=np.int32),
        has_workers_table=True, request_id=np.array([1], dtype=np.int64),
        req_ts=np.array([1000 * MS], dtype=np.int64), req_model=np.zeros(1, dtype=np.int32),
        req_input_tokens=np.array([query_blocks * 256], dtype=np.int64),
        req_query_blocks=np.array([query_blocks], dtype=np.int64),
        req_best_prefix_blocks=np.array([max(mb, default=0)], dtype=np.int64),
        match_offsets=np.array([0, len(mw)], dtype=np.int64), match_worker=np.array(mw, dtype=np.int32),
        match_blocks=np.array(mb, dtype=np.int64), req_selected_worker=None,
        load_ts=np.full(n, 900 * MS, dtype=np.int64), load_worker=np.arange(n, dtype=np.int32),
        load_rank=np.zeros(n, dtype=np.int32), load_running=z.copy(),
        load_waiting=np.array(waiting, dtype=np.int64), load_num_tokens=z.copy(),
        load_max_total=np.full(n, 100_000, dtype=np.int64), load_has_tail=np.zeros(n, dtype=np.bool_),
        load_waiting_uncached=z.copy(), load_total_tokens=z.copy(), load_max_running=z.copy(),
        load_prefill_tokens=z.copy(), load_prefill_busy_us=z.copy(),
        load_router_inflight=np.array(inflight, dtype=np.int64),
    )


def lost_of(trace: Trace, cfg: RouterConfig) -> dict:
    dec = engine.decide_all(trace, [cfg])
    ref = reference.replay(trace, [cfg])
    for name in dec:
        assert np.array_equal(dec[name], ref[name], equal_nan=dec[name].dtype.kind == "f"), name
    terms = {s: int(v[0, 0]) for s, v in waterfall_terms(dec).items()}
    terms["worker"] = trace.workers[int(dec["worker"][0, 0])]
    terms["lost_to"] = labels.name_or_none(labels.LOSS_STEPS, int(dec["lost_to"][0, 0]))
    return terms


BASE = dict(cache_affinity_min_matched_tokens=0, cache_switch_margin_tokens=0)


def test_gate_diversion_loses_the_depth_difference():
    # a holds 9 blocks but waits 5 >= limit 3; b holds 4 and is free: the gate sends it to b
    tr = one_request({"a": (9, 5, 0), "b": (4, 0, 0)}, extra_workers=("c",))
    got = lost_of(tr, RouterConfig(worker_queue_limit=3, **BASE))
    assert got["worker"] == "b" and got["lost_queue_gate"] == 5 and got["lost_to"] == "queue_gate"
    assert sum(got[s] for s in STEPS) == 5
    # without a limit the deepest owner wins and nothing is lost
    got = lost_of(tr, RouterConfig(**BASE))
    assert got["worker"] == "a" and sum(got[s] for s in STEPS) == 0 and got["lost_to"] is None


def test_pin_choosing_a_shallower_owner():
    # every worker waits >= floor 2, both owners are gated by limit 3; the pin orders by
    # pressure (router-local in-flight: a 4, b 1) and takes b, 3 blocks shallower
    tr = one_request({"a": (7, 6, 4), "b": (4, 3, 1)})
    got = lost_of(tr, RouterConfig(worker_queue_limit=3, saturation_queue_floor=2, **BASE))
    assert got["worker"] == "b" and got["lost_pin"] == 3 and got["lost_to"] == "pin"
    assert got["lost_queue_gate"] == 0 and sum(got[s] for s in STEPS) == 3


def test_fallback_when_no_owner_survives_preparation():
    # the affinity threshold (min matched tokens) drops the only owner: the domain rungs choose
    tr = one_request({"a": (2, 0, 0)}, extra_workers=("b", "c"))
    got = lost_of(tr, RouterConfig(cache_affinity_min_matched_tokens=4096))
    assert got["lost_fallback"] == 2 - (2 if got["worker"] == "a" else 0)
    assert sum(got[s] for s in STEPS) == got["lost_fallback"]


def test_owner_outside_the_fleet_is_lost_to_candidates():
    # the deepest match names a worker of no fleet (here: a decode peer); b is the deepest routable owner
    tr = one_request({"a": (8, 0, 0), "b": (5, 0, 0)})
    tr.worker_role[0] = labels.ROLE_DECODE
    got = lost_of(tr, RouterConfig(**BASE))
    assert got["worker"] == "b" and got["lost_candidates"] == 3 and got["lost_to"] == "candidates"


def test_report_draws_the_waterfall(gen_trace, tmp_path):
    """The report's waterfall: per shown config, matched minus every step's loss is the
    selected share, which is that config's hit rate; the page carries the figure."""
    import polars as pl
    from click.testing import CliRunner

    from replay.cli import main
    from replay.report.run_page import figures

    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(out), "-q",
                                    "--worker-queue-limit", "none,2,4", "--saturation-queue-floor", "none,1"])
    assert res.exit_code == 0, res.output
    summary = pl.read_parquet(out / "summary.parquet")
    fig = figures(out)["waterfall"]
    assert len(fig.data) >= 1
    for tr in fig.data:
        y = list(tr.y)
        assert tr.x[0].startswith("matched") and tr.x[-1] == "selected"
        assert abs(y[0] + sum(y[1:-1]) - y[-1]) < 1e-9
        # the bars are one config's summary terms: its matched and selected blocks, so the
        # last bar over the query blocks is that config's hit rate
        rows = summary.filter((pl.col("matched_blocks") == y[0]) & (pl.col("selected_blocks") == y[-1]))
        assert rows.height >= 1
        assert any(abs(r["selected_blocks"] / r["query_blocks"] - r["hit_rate"]) < 1e-12
                   for r in rows.iter_rows(named=True))
    assert "Where locality goes" in (out / "report.html").read_text()
