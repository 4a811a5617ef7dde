"""The 40 shared kv-cache-tester agentic sessions as a closed-loop benchmark (optional).

The sessions become one request log (started as a seeded arrival process),
a saturating fleet of 4 workers x dp 2 whose parameters only this test knows
serves it, and the tool must (1) replay the router's every decision from the
written trace (``sweep`` agreement 1.0) and (2) recover the hidden fleet from
the trace alone (``calibrate``), and say so when its engine model cannot fit
(a batch-dependent step time calibrated with the constant-step model).
Skips when ``../shared/traces`` (or ``$REPLAY_SHARED_TRACES``) is absent.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, read_log, simulate

ROOT = Path(__file__).resolve().parents[1]
KV = Path(os.environ.get("REPLAY_SHARED_TRACES", ROOT.parent / "shared" / "traces")) / "kv-cache-tester"
pytestmark = pytest.mark.skipif(not KV.is_dir(), reason="../shared/traces/kv-cache-tester absent")

PROD = RouterConfig(worker_queue_limit=4)
SEED = 7


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def production(out: Path, fleet_seed: int, **engine):
    """The sessions served by a hidden heterogeneous 4 x dp 2 fleet, prefill-bound at the
    sessions' busy start (about 7-11 k tokens/s per rank against 646 k-token prompts)."""
    log = read_log(KV, session_rate=0.5, seed=0)
    rng = np.random.default_rng(fleet_seed)
    truth = {i: dict(prefill_tokens_per_s=float(rng.uniform(7_000, 11_000)),
                     decode_tokens_per_s=float(rng.uniform(30, 55)),
                     max_running_requests=int(rng.integers(6, 12)),
                     max_total_num_tokens=int(rng.integers(700_000, 900_000))) for i in range(4)}
    fleet = build_fleet(FleetSpec(workers=4, dp_size=2, publish_policy="on_change", **engine), truth)
    res = simulate(log, fleet, PROD, out, seed=SEED)
    return log, truth, res


def test_agentic_sessions_sweep_back_and_calibrate(tmp_path):
    log, truth, res = production(tmp_path / "trace", 2028)
    assert log.n_requests == 2835 and log.partial_blocks_added > 2700
    s = res.summary
    # saturating: every worker's queue gate closed for some requests, seconds of queueing at the tail
    assert s["all_queued"] > 20 and s["queue_wait_ms_p99"] > 5_000, s
    assert s["true_hit_rate"] > 0.8          # agentic sessions: most of every prompt is cached
    facts = json.loads(run("validate", tmp_path / "trace", "--json").output)
    assert facts["closed_loop_columns"]["hash_ids"] == 2835
    # (1) every decision replays from the written trace
    r = run("sweep", tmp_path / "trace", "--out", tmp_path / "run", "--worker-queue-limit", 4, "--seed", SEED,
            "--no-report", "-q")
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(tmp_path / "run" / "summary.parquet")["agreement"][0] == 1.0
    # (2) the hidden fleet recovered from the trace alone, and the fit validated
    r = run("calibrate", tmp_path / "trace", "--out", tmp_path / "fit.toml", "--validate", tmp_path / "fit")
    assert r.exit_code == 0, r.output
    got = {w["index"]: w for w in tomllib.loads((tmp_path / "fit.toml").read_text())["worker"]}
    for i, t in truth.items():
        assert got[i]["prefill_tokens_per_s"] == pytest.approx(t["prefill_tokens_per_s"], rel=1e-3), i
        assert got[i]["decode_tokens_per_s"] == pytest.approx(t["decode_tokens_per_s"], rel=1e-3), i
        assert got[i]["max_running_requests"] == t["max_running_requests"], i
        assert got[i]["max_total_num_tokens"] == t["max_total_num_tokens"], i
    fid = json.loads((tmp_path / "fit" / "fidelity.json").read_text())
    assert fid["good"], r.output


def test_agentic_sessions_model_mismatch_is_flagged(tmp_path):
    """A batch-dependent decode step in production, calibrated with the constant-step model."""
    _, _, res = production(tmp_path / "trace", 2029, decode_step_ms_per_request=2.0)
    r = run("calibrate", tmp_path / "trace", "--out", tmp_path / "fit.toml", "--decode-model", "constant",
            "--validate", tmp_path / "fit")
    assert r.exit_code == 0, r.output
    fid = json.loads((tmp_path / "fit" / "fidelity.json").read_text())
    assert not fid["good"] and "fidelity POOR" in r.output, fid["failing"]
