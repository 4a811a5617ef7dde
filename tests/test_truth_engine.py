"""Calibrate + simulate against an engine written independently of the simulator
(tests/sglang_like.py: chunked prefill, mixed prefill/decode steps, a batch-dependent step
time, its own cache, router and LoadStat cadence with every 1 s heartbeat).  Its
parameters are drawn here from a seeded generator and never given to the code under
test, which sees only the trace directory.  Tolerances (stated, not tuned per draw):
served hit rate within 1 point, TTFT p50 and p99 within 25%, with forced placement.
A session-affine rank choice, which neither SGLang nor the model has, must come out POOR
with the dispatch named."""

from __future__ import annotations

import numpy as np
import pytest
from sglang_like import Engine, run

from replay.config import RouterConfig
from replay.simulate import generate_log, simulate
from replay.simulate.calibrate import calibrate
from replay.simulate.fidelity import validate
from replay.simulate.tracelog import read_trace_log


def _hidden(seed):
    g = np.random.default_rng(seed)
    eng = Engine(prefill_tps=float(g.uniform(6000, 9000)), decode_a_ms=float(g.uniform(15, 30)),
                 decode_b_ms=float(g.uniform(0.2, 0.6)), kv_tokens=int(g.integers(120_000, 180_000)),
                 max_running=int(g.integers(16, 25)), chunk=int(g.choice([1024, 2048, 4096])))
    return eng, float(g.uniform(8, 11))


def _truth(tmp_path, seed, sticky=False):
    eng, rate = _hidden(seed)
    log = generate_log(1500, seed=seed, rate_per_s=rate)
    run(log, 3, 2, eng, tmp_path / "truth", sticky=sticky)
    return read_trace_log(tmp_path / "truth")


def _forced(rec):
    fleet = calibrate(rec).to_fleet()
    pre = np.array(fleet.prefill)
    return fleet, simulate(rec.log, fleet, RouterConfig(), placement=pre[rec.placement])


@pytest.mark.parametrize("seed", [21, 22])
def test_calibrated_model_recovers_the_independent_engine(tmp_path, seed):
    rec = _truth(tmp_path, seed)
    fleet, r = _forced(rec)
    assert fleet.spec.load_balance_method == "round_robin"
    L = rec.log.input_tokens.sum()
    hit_truth = rec.cached_tokens.sum() / L
    hit_model = r.outcomes["cached_tokens"].sum() / L
    assert abs(hit_model - hit_truth) * 100 <= 1.0
    t50, t99 = np.percentile(rec.ttft_ms, [50, 99])
    m50, m99 = np.percentile(r.outcomes["ttft_ms"].to_numpy(), [50, 99])
    assert m50 == pytest.approx(t50, rel=0.25)
    assert m99 == pytest.approx(t99, rel=0.25)


def test_session_affine_dispatch_is_poor_and_named(tmp_path):
    rec = _truth(tmp_path, 21, sticky=True)
    cal = calibrate(rec)
    f = next(f for f in cal.fitted if f.name == "load_balance_method")
    assert not f.fitted and "neither" in f.how
    fid = validate(rec, cal.to_fleet(), seed=0)
    assert not fid.good
    assert "dispatch" in fid.failing
