"""Calibration, validation and prediction on a recorded trace, with hidden ground truth.

A "production" trace is simulated from a heterogeneous fleet whose parameters
only the fixture knows (drawn from a seeded generator, never shown to the
code under test); ``router-replay calibrate`` sees the trace directory alone.
Real files, the real CLI, no mocks.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, load_fleet, simulate, simulate_grid
from replay.simulate.fidelity import validate
from replay.simulate.tracelog import read_trace_log

PROD_CONFIG = RouterConfig(worker_queue_limit=4)
PROD_SEED = 7
N_WORKERS = 4


def _run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _hidden_fleet(rng: np.random.Generator, **engine):
    """A heterogeneous fleet: every worker its own speeds and capacities (dp 2)."""
    per = {}
    for i in range(N_WORKERS):
        per[i] = dict(prefill_tokens_per_s=float(rng.uniform(5500, 9500)),
                      decode_tokens_per_s=float(rng.uniform(30, 55)),
                      max_running_requests=int(rng.integers(8, 15)),
                      max_total_num_tokens=int(rng.integers(45_000, 70_000)))
    spec = FleetSpec(workers=N_WORKERS, dp_size=2, publish_policy="on_change", **engine)
    return build_fleet(spec, per), per


def _production(tmp: Path, name: str, seed: int, rate_per_s: float = 12.0, **engine):
    rng = np.random.default_rng(seed)
    fleet, truth = _hidden_fleet(rng, **engine)
    log = generate_log(1500, seed=seed, rate_per_s=rate_per_s)
    out = tmp / name
    simulate(log, fleet, PROD_CONFIG, out, seed=PROD_SEED)
    return out, fleet, truth, log


@pytest.fixture(scope="module")
def prod(tmp_path_factory):
    return _production(tmp_path_factory.mktemp("prod"), "trace", 101)


@pytest.fixture(scope="module")
def calibrated(prod, tmp_path_factory):
    trace, *_ = prod
    d = tmp_path_factory.mktemp("cal")
    r = _run(["calibrate", trace, "--out", d / "fleet.toml", "--validate", d / "fit"])
    assert r.exit_code == 0, r.output
    return d, r.output


def _worker_values(toml_path: Path) -> dict[int, dict]:
    data = tomllib.loads(toml_path.read_text())
    return {w["index"]: w for w in data["worker"]}


# ---------------------------------------------------------------------------
# parameter recovery

def test_parameter_recovery(prod, calibrated):
    _, _, truth, _ = prod
    d, output = calibrated
    got = _worker_values(d / "fleet.toml")
    assert sorted(got) == list(range(N_WORKERS))
    for i, t in truth.items():
        g = got[i]
        assert g["prefill_tokens_per_s"] == pytest.approx(t["prefill_tokens_per_s"], rel=0.03), i
        assert g["decode_tokens_per_s"] == pytest.approx(t["decode_tokens_per_s"], rel=0.05), i
        assert g["max_running_requests"] == t["max_running_requests"], i
        assert g["max_total_num_tokens"] == t["max_total_num_tokens"], i
        assert g["decode_step_ms_per_request"] == 0.0   # the truth has no batch slope
    data = tomllib.loads((d / "fleet.toml").read_text())
    assert data["publish_policy"] == "on_change" and data["idle_publish_ms"] == 1000
    # every value printed with its samples, and what was not fitted said plainly
    assert output.count("prefill_tokens_per_s = ") == N_WORKERS
    assert "samples" in output and "residual" in output
    assert "max_prefill_tokens, schedule_policy, enable_mixed_chunk: not fitted" in output
    assert "chunked_prefill_size = 0" not in output   # never claimed unfitted when it was fitted


def test_calibrate_json_carries_fitted_values_and_fidelity_parts(prod, calibrated, tmp_path):
    trace, _, truth, _ = prod
    d, _ = calibrated
    r = _run(["calibrate", trace, "--out", tmp_path / "fleet.toml", "--validate", tmp_path / "fit", "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)  # one JSON object and nothing else on stdout
    tps = {f["worker"]: f["value"] for f in rec["fitted"] if f["name"] == "prefill_tokens_per_s"}
    assert sorted(tps) == list(range(N_WORKERS))
    for i, t in truth.items():
        assert tps[i] == pytest.approx(t["prefill_tokens_per_s"], rel=0.03), i
    written = _worker_values(tmp_path / "fleet.toml")
    assert all(tps[i] == pytest.approx(written[i]["prefill_tokens_per_s"]) for i in tps)
    fid = json.loads((tmp_path / "fit" / "fidelity.json").read_text())
    assert rec["fidelity"]["parts"] == fid["parts"] and rec["fidelity"]["good"] == fid["good"]
    assert rec["prediction"] is None


def test_fleet_file_is_ordinary(calibrated, prod, tmp_path):
    """The fleet file is what simulate accepts, and a trace dir is accepted as the log."""
    trace, *_ = prod
    d, _ = calibrated
    r = _run(["simulate", trace, "--fleet", d / "fleet.toml", "--out", tmp_path / "s",
              "--worker-queue-limit", "4", "--seed", PROD_SEED, "-q"])
    assert r.exit_code == 0, r.output
    a = pl.read_parquet(tmp_path / "s" / "requests.parquet")
    b = pl.read_parquet(trace / "requests.parquet")
    for c in ("input_tokens", "output_tokens", "hash_ids", "query_blocks"):
        assert a[c].to_list() == b[c].to_list(), c
    assert json.loads((tmp_path / "s" / "trace.json").read_text())["router"] == {"worker_queue_limit": 4}


# ---------------------------------------------------------------------------
# validation

def test_forced_placement_true_params_reproduces_waiting_exactly(prod, tmp_path):
    trace, fleet, _, _ = prod
    r = _run(["simulate", trace, "--fleet", tmp_path / "none.toml", "--out", tmp_path / "x"])
    assert r.exit_code == 2  # (no such fleet file: one line)
    rec = read_trace_log(trace)
    fid = validate(rec, fleet, out_dir=tmp_path / "v")
    assert fid.good, fid.lines()
    assert all(p["waiting_mae"] == 0.0 for p in fid.per_rank)
    # the machinery, row by row: the forced run writes the recorded load samples
    rec_loads = pl.read_parquet(trace / "loads.parquet")
    sim_loads = pl.read_parquet(tmp_path / "v" / "forced" / "loads.parquet")
    assert sim_loads["num_waiting_reqs"].to_list() == rec_loads["num_waiting_reqs"].to_list()
    shift = int(rec_loads["ts"][0]) - int(sim_loads["ts"][0])  # the log starts at its first request
    assert (sim_loads["ts"] + shift).to_list() == rec_loads["ts"].to_list()


def test_calibrated_fidelity(calibrated):
    d, output = calibrated
    fid = json.loads((d / "fit" / "fidelity.json").read_text())
    assert fid["good"], output
    assert max(p["waiting_mae"] for p in fid["per_rank"]) <= 0.5
    parts = {p["name"]: p for p in fid["parts"]}
    assert parts["agreement"]["value"] >= 0.95
    assert parts["hit_rate"]["passed"] and parts["ttft"]["passed"] and parts["latency"]["passed"]
    assert "fidelity GOOD" in output
    assert (d / "fit" / "forced" / "loads.parquet").is_file()
    assert (d / "fit" / "router" / "requests.parquet").is_file()


@pytest.mark.parametrize("engine, decode_model, failing", [
    # batch-dependent step time in production, a constant-step model calibrated
    ({"decode_step_ms_per_request": 1.2}, "constant", {"waiting_mae"}),
    # mixed prefill/decode steps in production (not in a trace, so not fitted), a model
    # without them
    ({"chunked_prefill_size": 512, "enable_mixed_chunk": True}, "auto", set()),
])
def test_model_mismatch_is_flagged(tmp_path, engine, decode_model, failing):
    trace, *_ = _production(tmp_path, "mismatch", 202, **engine)
    r = _run(["calibrate", trace, "--out", tmp_path / "f.toml", "--decode-model", decode_model,
              "--validate", tmp_path / "fit", "--worker-queue-limit", "2,4", "--seeds", "2"])
    assert r.exit_code == 0, r.output
    fid = json.loads((tmp_path / "fit" / "fidelity.json").read_text())
    assert not fid["good"]
    assert failing <= set(fid["failing"]), fid["failing"]
    out = r.output
    poor = out.index("fidelity POOR")
    assert out.index("closed-loop prediction") > out.index("WARNING: fidelity POOR") > poor
    for name in failing:
        assert f"FAIL {name}" in out
    pred = pl.read_parquet(tmp_path / "fit" / "prediction" / "closed_loop_summary.parquet")
    assert pred.height == 2 and pred["seeds"].to_list() == [[PROD_SEED, PROD_SEED + 1]] * 2


def test_batch_slope_recovered_when_modelled(tmp_path):
    """A batch-dependent step time is recovered; modelling it brings TTFT and latency
    closer than the constant-step model on the same trace."""
    trace, _, truth, _ = _production(tmp_path, "slope", 303, rate_per_s=8.0,
                                     decode_step_ms_per_request=0.9)
    fids, errs = {}, {}
    for model in ("auto", "constant"):
        r = _run(["calibrate", trace, "--out", tmp_path / f"{model}.toml", "--decode-model", model,
                  "--validate", tmp_path / f"fit-{model}"])
        assert r.exit_code == 0, r.output
        fid = json.loads((tmp_path / f"fit-{model}" / "fidelity.json").read_text())
        fids[model] = {p["name"]: p["passed"] for p in fid["parts"]}
        errs[model] = {p["name"]: p["value"] for p in fid["parts"]}
    got = _worker_values(tmp_path / "auto.toml")
    for i, t in truth.items():
        assert got[i]["decode_step_ms_per_request"] == pytest.approx(0.9, rel=0.1)
        assert got[i]["decode_tokens_per_s"] == pytest.approx(t["decode_tokens_per_s"], rel=0.05)
        assert got[i]["prefill_tokens_per_s"] == pytest.approx(t["prefill_tokens_per_s"], rel=0.03)
    assert fids["auto"]["ttft"] and fids["auto"]["latency"] and fids["auto"]["waiting_mae"]
    assert fids["auto"]["hit_rate"]
    # on this trace the constant-step model passes too (round-robin dispatch keeps the
    # queues short), but its TTFT and latency errors are the larger ones
    assert errs["auto"]["ttft"] < errs["constant"]["ttft"]
    assert errs["auto"]["latency"] < errs["constant"]["latency"]


# ---------------------------------------------------------------------------
# prediction

GRID = {"worker_queue_limit": "none,2,4,8", "min_load_choices": "1,2",
        "cache_affinity_min_matched_tokens": "512,1024"}


SEEDS = (0, 1, 2)


def test_prediction_grid_matches_truth(prod, calibrated):
    """16 configs: the calibrated fleet's mean over seeds against the hidden fleet's, for every
    config whose truth is stable across the seeds (hit rate spread <= 2 points, TTFT p99
    coefficient of variation <= 0.2)."""
    _, fleet, _, log = prod
    d, _ = calibrated
    cal = load_fleet(d / "fleet.toml")
    truth = [simulate_grid(log, fleet, GRID, seed=s, threads=2) for s in SEEDS]
    pred = [simulate_grid(log, cal, GRID, seed=s, threads=2) for s in SEEDS]
    assert pred[0].height >= 16
    stable = 0
    for j in range(pred[0].height):
        hits = np.array([t["true_hit_rate"][j] for t in truth])
        p99s = np.array([t["ttft_ms_p99"][j] for t in truth])
        if np.ptp(hits) > 0.02 or p99s.std() / p99s.mean() > 0.2:
            continue  # the truth itself is not stable across seeds
        stable += 1
        ph = np.mean([p["true_hit_rate"][j] for p in pred])
        pp = np.mean([p["ttft_ms_p99"][j] for p in pred])
        assert abs(ph - hits.mean()) <= 0.01, j
        assert abs(pp / p99s.mean() - 1) <= 0.15, j
    assert stable >= 5, stable   # not vacuous: a third of the grid is stable at this load


# ---------------------------------------------------------------------------
# bad input: one line, exit 2, nothing written

def test_calibrate_bad_trace_one_line(tmp_path, prod):
    trace, *_ = prod
    bad = tmp_path / "bad"
    bad.mkdir()
    req = pl.read_parquet(trace / "requests.parquet")
    for f in ("workers.parquet", "loads.parquet"):
        (bad / f).write_bytes((trace / f).read_bytes())
    req.drop("hash_ids").write_parquet(bad / "requests.parquet")
    r = _run(["calibrate", bad, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 2 and "requests.parquet: missing column 'hash_ids'" in r.output
    assert len(r.output.strip().splitlines()) == 1
    twice = pl.col("hash_ids").list.concat(pl.col("hash_ids"))    # neither ceil nor floor of row 5
    doubled = req.with_columns(pl.when(pl.int_range(pl.len()) == 5).then(twice)
                               .otherwise(pl.col("hash_ids")).alias("hash_ids"))
    doubled.write_parquet(bad / "requests.parquet")
    r = _run(["calibrate", bad, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 2 and "column 'hash_ids' row 5" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "f.toml").exists()
    # an existing fleet file is not replaced without --force
    (tmp_path / "keep.toml").write_text("workers = 1\n")
    r = _run(["calibrate", trace, "--out", tmp_path / "keep.toml"])
    assert r.exit_code == 2 and "--force" in r.output
    # and --force replaces only a fleet file calibrate wrote, not the user's own
    r = _run(["calibrate", trace, "--out", tmp_path / "keep.toml", "--force"])
    assert r.exit_code == 2 and "not a fleet file written by router-replay calibrate" in r.output
    assert (tmp_path / "keep.toml").read_text() == "workers = 1\n"
    assert _run(["calibrate", trace, "--out", tmp_path / "mine.toml"]).exit_code == 0
    assert _run(["calibrate", trace, "--out", tmp_path / "mine.toml", "--force"]).exit_code == 0


def _copy_trace(src: Path, dst: Path, drop_requests=(), drop_loads=()) -> Path:
    dst.mkdir()
    (dst / "workers.parquet").write_bytes((src / "workers.parquet").read_bytes())
    (dst / "trace.json").write_bytes((src / "trace.json").read_bytes())
    pl.read_parquet(src / "requests.parquet").drop(list(drop_requests)).write_parquet(
        dst / "requests.parquet")
    pl.read_parquet(src / "loads.parquet").drop(list(drop_loads)).write_parquet(dst / "loads.parquet")
    return dst


def test_decode_from_littles_law_without_latencies(prod, tmp_path):
    trace, _, truth, _ = prod
    d = _copy_trace(trace, tmp_path / "t", drop_requests=("ttft_ms", "latency_ms"))
    r = _run(["calibrate", d, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 0, r.output
    got = _worker_values(tmp_path / "f.toml")
    for i, t in truth.items():
        assert got[i]["decode_tokens_per_s"] == pytest.approx(t["decode_tokens_per_s"], rel=0.05), i
    assert "Little's law" in r.output
    assert "decode_step_ms_per_request = 0  NOT FITTED (needs ttft_ms and latency_ms; default used)" \
        in r.output


def test_missing_native_counters_say_which_default(prod, tmp_path):
    trace, _, truth, _ = prod
    d = _copy_trace(trace, tmp_path / "t",
                    drop_loads=("total_prefill_uncached_tokens", "total_prefill_busy_us"))
    r = _run(["calibrate", d, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 0, r.output
    assert r.output.count("prefill_tokens_per_s = 10,000  NOT FITTED (no native prefill counters; "
                          "default used)") == N_WORKERS
    assert "not fitted from this trace" in r.output
    got = _worker_values(tmp_path / "f.toml")
    assert all(w["prefill_tokens_per_s"] == 10_000.0 for w in got.values())
    # decode still comes from the latencies: the least-interrupted requests
    for i, t in truth.items():
        assert got[i]["decode_tokens_per_s"] == pytest.approx(t["decode_tokens_per_s"], rel=0.05), i
    assert "5th percentile (no busy counters" in r.output


def test_unpublished_running_limit_is_a_lower_bound(prod, tmp_path):
    trace, _, truth, _ = prod
    d = _copy_trace(trace, tmp_path / "t", drop_loads=("max_running_requests",))
    r = _run(["calibrate", d, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 0, r.output
    got = _worker_values(tmp_path / "f.toml")
    loads = pl.read_parquet(trace / "loads.parquet")
    urls = sorted(loads["worker"].unique().to_list())
    for i, t in truth.items():
        seen = int(loads.filter(pl.col("worker") == urls[i])["num_running_reqs"].max())
        assert got[i]["max_running_requests"] == seen <= t["max_running_requests"]
    assert "largest num_running_reqs seen (not published): a lower bound" in r.output


def test_two_models_refused(prod, tmp_path):
    trace, *_ = prod
    d = _copy_trace(trace, tmp_path / "t")
    req = pl.read_parquet(d / "requests.parquet")
    req.with_columns(pl.when(pl.int_range(pl.len()) % 2 == 0).then(pl.lit("a")).otherwise(pl.lit("b"))
                     .alias("model")).write_parquet(d / "requests.parquet")
    r = _run(["calibrate", d, "--out", tmp_path / "f.toml"])
    assert r.exit_code == 2 and "column 'model': 2 models" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_forced_replay_exact_with_interval_publishing(tmp_path):
    """The bundled sample (interval publishing, seeded phases): with its own fleet file and the
    seed trace.json records, the forced run writes the recorded load samples again."""
    root = Path(__file__).resolve().parents[1]
    rec = read_trace_log(root / "traces" / "sample")
    fid = validate(rec, load_fleet(root / "traces" / "sample-fleet.toml"), out_dir=tmp_path / "v")
    assert fid.good, fid.lines()
    assert all(p["waiting_mae"] == 0.0 for p in fid.per_rank)
    a = pl.read_parquet(root / "traces" / "sample" / "loads.parquet")
    b = pl.read_parquet(tmp_path / "v" / "forced" / "loads.parquet")
    assert a.drop("ts").equals(b.drop("ts"))


def test_validate_dir_may_not_overlap_the_trace(prod, tmp_path):
    trace, *_ = prod
    before = sorted(p.name for p in trace.iterdir())
    for vdir in (trace, trace.parent, trace / "fit"):
        r = _run(["calibrate", trace, "--out", tmp_path / "f.toml", "--validate", vdir, "--force"])
        assert r.exit_code == 2 and "overlaps the trace" in r.output, r.output
    r = _run(["calibrate", trace, "--out", tmp_path / "v" / "f.toml", "--validate", tmp_path / "v"])
    assert r.exit_code == 2 and "would hold the fleet file" in r.output
    r = _run(["calibrate", trace, "--out", trace / "requests.parquet", "--force"])
    assert r.exit_code == 2 and "is a file of the trace" in r.output
    assert sorted(p.name for p in trace.iterdir()) == before


def test_page_size_disagreement_refused(prod, tmp_path):
    trace, *_ = prod
    d = _copy_trace(trace, tmp_path / "t")
    info = json.loads((d / "trace.json").read_text())
    info["page_size"] = 16
    (d / "trace.json").write_text(json.dumps(info))
    r = _run(["simulate", d, "--out", tmp_path / "o"])
    assert r.exit_code == 2 and "key 'page_size': 16 disagrees with workers.parquet page_size 512" \
        in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_validation_without_selected_worker_uses_the_router_run(prod, tmp_path):
    """No recorded placement: decode speed comes from the whole fleet (one value), there is no
    forced run and no agreement, and the other parts compare the router-in-the-loop run and say
    so.  The hidden fleet is heterogeneous, so the one-value model must be flagged."""
    trace, *_ = prod
    d = _copy_trace(trace, tmp_path / "t", drop_requests=("selected_worker",))
    r = _run(["calibrate", d, "--out", tmp_path / "f.toml", "--validate", tmp_path / "fit"])
    assert r.exit_code == 0, r.output
    assert r.output.count("Little's law over the whole fleet (no selected_worker") == N_WORKERS
    assert len({w["decode_tokens_per_s"] for w in _worker_values(tmp_path / "f.toml").values()}) == 1
    fid = json.loads((tmp_path / "fit" / "fidelity.json").read_text())
    parts = {p["name"]: p for p in fid["parts"]}
    assert parts["agreement"]["passed"] is None and "no selected_worker" in parts["agreement"]["detail"]
    for name in ("waiting_mae", "hit_rate", "ttft", "latency"):
        assert parts[name]["passed"] is not None, name
        assert "router in the loop: no selected_worker recorded" in parts[name]["detail"]
    assert not (tmp_path / "fit" / "forced").exists()
    assert not fid["good"] and "fidelity POOR" in r.output


def test_refine_by_forced_replays(tmp_path):
    """Interval publishing leaves the decode fit about 1% off on the bundled sample (true speed
    40 tokens/s, traces/sample-fleet.toml): --refine brings it within 0.3%, and every
    forced-placement part of the fidelity passes, and so does the router-in-the-loop agreement."""
    root = Path(__file__).resolve().parents[1]
    trace = root / "traces" / "sample"
    plain = _run(["calibrate", trace, "--out", tmp_path / "a.toml"])
    r = _run(["calibrate", trace, "--out", tmp_path / "b.toml", "--refine", "--validate",
              tmp_path / "fit"])
    assert plain.exit_code == 0 and r.exit_code == 0, r.output
    a, b = _worker_values(tmp_path / "a.toml"), _worker_values(tmp_path / "b.toml")
    assert max(abs(w["decode_tokens_per_s"] / 40 - 1) for w in a.values()) > 0.005
    assert max(abs(w["decode_tokens_per_s"] / 40 - 1) for w in b.values()) < 0.003
    assert "refined by forced-placement replays" in r.output
    fid = {p["name"]: p["passed"] for p in
           json.loads((tmp_path / "fit" / "fidelity.json").read_text())["parts"]}
    for name in ("waiting_mae", "waiting_p99", "hit_rate", "ttft", "latency"):
        assert fid[name], name
    # the router in the loop drifts on this KV-bound fleet: judged against its own drift, it passes
    assert fid["agreement"], r.output


def test_wrong_production_flags_are_named(prod, tmp_path):
    """trace.json claims the router defaults while production ran with a queue limit: the
    open-loop replay of those flags on the recorded loads disagrees, and the part says so."""
    trace, fleet, _, _ = prod
    d = _copy_trace(trace, tmp_path / "t")
    info = json.loads((d / "trace.json").read_text())
    info["router"] = {}
    (d / "trace.json").write_text(json.dumps(info))
    fid = validate(read_trace_log(d), fleet)
    parts = {p.name: p for p in fid.parts}
    assert parts["router_flags"].passed is False and parts["router_flags"].value < 0.99
    assert "router_flags" in fid.failing
    # with the right flags the same fleet passes it exactly
    assert {p.name: p for p in validate(read_trace_log(trace), fleet).parts}["router_flags"].value == 1.0
