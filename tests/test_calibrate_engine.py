"""calibrate reads the engine's dispatch, chunk size and publishing from a recording, and
fidelity scores the queue over busy time and names the dispatch.  The "production" traces
are simulated with engine settings the test keeps to itself; calibrate sees only the trace
directory.  Real files, no mocks."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate
from replay.simulate.calibrate import calibrate
from replay.simulate.fidelity import validate
from replay.simulate.tracelog import read_trace_log


def _prod(tmp, name, n=1200, rate=12.0, seed=5, log=None, **engine):
    spec = dict(workers=3, dp_size=2, prefill_tokens_per_s=7000, decode_tokens_per_s=45,
                max_running_requests=12, max_total_num_tokens=60_000, publish_policy="on_change")
    spec.update(engine)
    fleet = build_fleet(FleetSpec(**spec))
    out = tmp / name
    if log is None:
        log = generate_log(n, seed=seed, rate_per_s=rate)
    simulate(log, fleet, RouterConfig(worker_queue_limit=4), out, seed=3)
    return out, fleet


def _fitted(cal, name):
    return next(f for f in cal.fitted if f.name == name)


@pytest.mark.parametrize("method", ["round_robin", "total_requests"])
def test_dispatch_method_inferred(tmp_path, method):
    trace, _ = _prod(tmp_path, method, load_balance_method=method)
    cal = calibrate(read_trace_log(trace))
    f = _fitted(cal, "load_balance_method")
    assert f.fitted, f.how
    assert cal.engine["load_balance_method"] == method, f.how
    assert f"load_balance_method = \"{method}\"" in cal.to_toml()


def test_dispatch_neither_says_so(tmp_path):
    # the old prefix rule is neither a round-robin sequence nor least-loaded choices
    trace, _ = _prod(tmp_path, "pa", load_balance_method="prefix_affinity")
    cal = calibrate(read_trace_log(trace))
    f = _fitted(cal, "load_balance_method")
    assert not f.fitted and "neither" in f.how
    assert "load_balance_method" not in cal.engine
    assert "# load_balance_method: not fitted" in cal.to_toml()


def test_dispatch_unknown_without_ranks(tmp_path):
    trace, _ = _prod(tmp_path, "rr", n=300)
    (trace / "outcomes.parquet").unlink()
    cal = calibrate(read_trace_log(trace))
    f = _fitted(cal, "load_balance_method")
    assert not f.fitted and "does not record which rank" in f.how


def test_chunk_size_read_from_step_sizes(tmp_path):
    # long prompts (Mooncake-like, well above 1536) at a hidden chunk of 1536 tokens
    trace, _ = _prod(tmp_path, "chunk", chunked_prefill_size=1536)
    cal = calibrate(read_trace_log(trace))
    f = _fitted(cal, "chunked_prefill_size")
    assert f.fitted and cal.engine["chunked_prefill_size"] == 1536, f.how
    # interval samples aggregate steps: calibrate says it cannot tell and which default it used
    trace, _ = _prod(tmp_path, "chunk_iv", chunked_prefill_size=1536, publish_policy="interval")
    f = _fitted(calibrate(read_trace_log(trace)), "chunked_prefill_size")
    assert not f.fitted and "4096" in f.how


def _with_every_heartbeat(trace, every_ns=10**9):
    """Rewrite the trace's loads as an engine that re-sends an unchanged load every second
    writes them (the simulator drops heartbeats no decision could see)."""
    path = trace / "loads.parquet"
    ld = pl.read_parquet(path)
    parts = []
    for _, g in ld.group_by("worker", "dp_rank", maintain_order=True):
        ts = g["ts"].to_numpy()
        gap = np.diff(ts)
        k = np.maximum((gap - 1) // every_ns, 0)
        src = np.repeat(np.arange(ts.shape[0] - 1), k)
        step = np.concatenate([np.arange(1, n + 1) for n in k]) if k.sum() else np.zeros(0, int)
        hb = g[src].with_columns(pl.Series("ts", ts[src] + step * every_ns).cast(g["ts"].dtype))
        parts += [g, hb]
    pl.concat(parts).sort("ts", maintain_order=True).write_parquet(path)


def test_on_change_publishing_classified_while_busy(tmp_path):
    # a mostly idle recording of an engine publishing on change with a 1 s heartbeat:
    # nearly all its gaps are heartbeats (regular), but the gaps while busy are not
    trace, _ = _prod(tmp_path, "idle", n=300, rate=0.1)
    _with_every_heartbeat(trace)
    rec = read_trace_log(trace)
    ld = rec.loads
    gaps = np.diff(ld.filter((ld["worker"] == rec.urls[0]) & (ld["dp_rank"] == 0))["ts"].to_numpy())
    # what every gap shows: regular (the classification this test guards against)
    assert np.mean(np.abs(gaps - np.median(gaps)) <= 0.01 * np.median(gaps) + 1000) >= 0.9
    cal = calibrate(rec)
    f = _fitted(cal, "publish_policy")
    assert cal.publish["publish_policy"] == "on_change", f.how
    assert "while busy" in f.how
    assert cal.publish["idle_publish_ms"] == 1000


def test_busy_only_queue_parts_and_dispatch_part(tmp_path):
    # two bursts of 300 requests (30 a second) two hours apart: idle 99% of the time.  A
    # model with a third of the prefill speed queues far longer in the bursts, and the
    # busy-time queue parts say so
    log = generate_log(600, seed=5, rate_per_s=30.0)
    ts = log.ts_ns.copy()
    ts[300:] += 2 * 3600 * 10**9
    trace, fleet = _prod(tmp_path, "burst", log=replace(log, ts_ns=ts))
    rec = read_trace_log(trace)
    good = validate(rec, fleet, seed=3)
    bad_fleet = build_fleet(FleetSpec(**{**fleet.spec.__dict__, "prefill_tokens_per_s": 2300}))
    bad = validate(rec, bad_fleet, seed=3)
    parts = {p.name: p for p in bad.parts}
    assert parts["waiting_mae"].passed is False
    assert "over busy time only" in parts["waiting_mae"].detail
    g = {p.name: p for p in good.parts}
    assert g["waiting_mae"].passed and g["dispatch"].passed
    assert g["dispatch"].value == pytest.approx(0.0)
    # a model dispatching by the old prefix rule spreads requests unlike production: named
    pa = build_fleet(FleetSpec(**{**fleet.spec.__dict__, "load_balance_method": "prefix_affinity"}))
    fid = validate(rec, pa, seed=3)
    d = {p.name: p for p in fid.parts}["dispatch"]
    assert d.passed is False and "prefix_affinity" in d.detail
    assert "dispatch" in fid.failing


@pytest.mark.parametrize("policy", ["sglang", "on_change", "interval"])
def test_sglang_cadence_told_from_on_change_and_interval(tmp_path, policy):
    # the same busy traffic recorded with each publishing policy: only SGLang's own cadence
    # (prefill steps, every 15th decode step, never an arrival) is classified as "sglang",
    # and its chunk size is still read from the per-step samples
    trace, _ = _prod(tmp_path, policy, publish_policy=policy, chunked_prefill_size=1536)
    cal = calibrate(read_trace_log(trace))
    f = _fitted(cal, "publish_policy")
    assert cal.publish["publish_policy"] == policy, f.how
    if policy == "sglang":
        assert "SGLang's cadence" in f.how
        assert cal.publish["idle_publish_ms"] == 1000
        assert cal.engine["chunked_prefill_size"] == 1536
