"""The fleet simulator: fidelity with sweep, the unbounded-cache hit rate,
conservation, determinism, the CLI and the log readers.  Real files, real CLI, no mocks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay import run_sweep
from replay.cli import main
from replay.config import RouterConfig
from replay.errors import ReplayError
from replay.simulate import (
    FleetSpec,
    build_fleet,
    generate_log,
    load_fleet,
    read_azure,
    read_mooncake,
    simulate,
    simulate_grid,
    write_mooncake_jsonl,
)
from replay.simulate.logs import LogError, RequestLog

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
MOONCAKE = SHARED / "mooncake" / "conversation_trace.jsonl"
AZURE = SHARED / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="../shared/traces/mooncake absent")
needs_azure = pytest.mark.skipif(not AZURE.is_file(), reason="../shared/traces/azure-llm-2023 absent")

LABELS = ("cache_hit", "cache_miss", "cache_worker_queued", "all_queued")


@pytest.fixture(scope="module")
def small_log() -> RequestLog:
    return generate_log(1200, seed=3, rate_per_s=30.0)


@pytest.fixture(scope="module")
def tight_fleet():
    # small KV and slow prefill: queues, gate rejections, evictions
    return build_fleet(FleetSpec(workers=4, dp_size=2, prefill_tokens_per_s=6000,
                                 max_running_requests=8, max_total_num_tokens=40_000))


def _knobs(cfg: RouterConfig) -> dict:
    out = {}
    for k, v in cfg.given_flags().items():
        out[k] = "none" if v is None else str(v).lower()
    return out


def _assert_fidelity(res, trace_dir: Path, freshness_ms: int = 5000, seed: int = 0) -> None:
    sweep = run_sweep(trace_dir, _knobs(res.config), freshness_ms=freshness_ms, seed=seed)
    row = sweep.summary.row(0, named=True)
    assert row["requests"] == res.summary["requests"]
    assert row["agreement"] == 1.0
    for label in LABELS:
        assert row[label] == res.summary[label], label


# ---------------------------------------------------------------------------
# (1) fidelity: sweep on the simulated trace reproduces every decision

@pytest.mark.parametrize("cfg, kw", [
    (RouterConfig(), {}),
    (RouterConfig(worker_queue_limit=4), {}),
    (RouterConfig(worker_queue_limit=6, saturation_queue_floor=2, min_load_choices=1), {}),
    (RouterConfig(worker_queue_limit=2, cache_affinity_min_matched_tokens=None,
                  cache_candidate_min_workers=2),
     {"publish_interval_ms": 37, "index_lag_ms": 250}),
    # a freshness window shorter than the publish interval: stale ranks, fail-open gates
    (RouterConfig(worker_queue_limit=3), {"publish_interval_ms": 100, "freshness_ms": 60}),
])
def test_fidelity_synthetic(tmp_path, small_log, tight_fleet, cfg, kw):
    res = simulate(small_log, tight_fleet, cfg, tmp_path / "t", seed=5, **kw)
    # the workload really exercised the router (not a trivially idle fleet)
    assert res.stats["ss_evictions"] > 0
    assert res.summary["cache_hit"] > 0 and res.summary["cache_miss"] > 0
    _assert_fidelity(res, tmp_path / "t", kw.get("freshness_ms", 5000), seed=5)


def test_fidelity_exercises_gate(tmp_path, small_log, tight_fleet):
    res = simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=2), tmp_path / "t")
    assert res.summary["cache_worker_queued"] + res.summary["all_queued"] > 0
    _assert_fidelity(res, tmp_path / "t")


@needs_mooncake
def test_fidelity_mooncake_head(tmp_path):
    log = read_mooncake(MOONCAKE, limit=2000)
    fleet = build_fleet(FleetSpec(workers=8, dp_size=2, prefill_tokens_per_s=6000,
                                  max_running_requests=16, max_total_num_tokens=200_000))
    for cfg in (RouterConfig(worker_queue_limit=2, saturation_queue_floor=1),
                RouterConfig(cache_affinity_min_matched_tokens=None)):
        out = tmp_path / f"m{cfg.worker_queue_limit}"
        res = simulate(log, fleet, cfg, out)
        _assert_fidelity(res, out)


# ---------------------------------------------------------------------------
# (2) one worker, unbounded KV: the true hit rate is the log's prefix-cache hit rate

def _unbounded(log: RequestLog, *, full_pages_only: bool = True) -> tuple[float, float]:
    """Prefix-cache hit rate of an infinite cache, from the block ids alone (blocks, tokens).

    ``full_pages_only``: a request's partial last block is neither cached nor hit
    (CAPTURE.md s.2: engines publish full pages only), as the simulator does; False
    counts every block id, the trace's own statistic (traces/README.md)."""
    seen: set[int] = set()
    hit_b = tot_b = hit_t = 0
    for i in range(log.n_requests):
        h = log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]].tolist()
        L = int(log.input_tokens[i])
        cacheable = h[:L // log.block_size] if full_pages_only else h
        d = 0
        while d < len(cacheable) and cacheable[d] in seen:
            d += 1
        hit_b += d
        tot_b += len(h)
        hit_t += sum(min(log.block_size, max(L - j * log.block_size, 0)) for j in range(d))
        seen.update(cacheable)
    return hit_b / tot_b, hit_t / int(log.input_tokens.sum())


def _one_unbounded_worker():
    return build_fleet(FleetSpec(workers=1, dp_size=1, prefill_tokens_per_s=50_000,
                                 max_running_requests=1_000_000, max_total_num_tokens=10**13))


def test_unbounded_single_worker_synthetic(small_log):
    res = simulate(small_log, _one_unbounded_worker(), RouterConfig())
    blocks, tokens = _unbounded(small_log)
    assert res.stats["ss_evictions"] == 0
    assert res.summary["block_hit_rate"] == pytest.approx(blocks, abs=1e-12)
    assert res.summary["true_hit_rate"] == pytest.approx(tokens, abs=1e-12)


@needs_mooncake
def test_unbounded_single_worker_mooncake():
    log = read_mooncake(MOONCAKE)
    assert _unbounded(log, full_pages_only=False)[0] == pytest.approx(0.366, abs=0.0005)  # traces/README.md
    blocks, tokens = _unbounded(log)
    # repeated prompts hit their partial last blocks in the trace's own count, never in a cache
    assert blocks < _unbounded(log, full_pages_only=False)[0]
    res = simulate(log, _one_unbounded_worker(), RouterConfig())
    assert res.summary["block_hit_rate"] == pytest.approx(blocks, abs=1e-12)
    assert res.summary["true_hit_rate"] == pytest.approx(tokens, abs=1e-12)


def test_partial_last_block_is_never_cached():
    """CAPTURE.md s.2: engines publish full pages only, so a request's trailing partial
    block never matches.  Two requests with the same three blocks (the last one partial),
    then two with the same three full blocks, each pair far apart on one worker: the
    repeat is served its two full blocks in the first case, all three in the second, and
    the router's matches (the written trace) say the same."""
    B = 16
    ts = np.array([0, 10, 20, 30], dtype=np.int64) * 1_000_000_000
    inp = np.array([2 * B + 5, 2 * B + 5, 3 * B, 3 * B], dtype=np.int64)
    ids = np.array([1, 2, 3, 1, 2, 3, 7, 8, 9, 7, 8, 9], dtype=np.int64)
    log = RequestLog(ts, inp, np.ones(4, dtype=np.int64), np.arange(0, 13, 3, dtype=np.int64), ids,
                     np.arange(4, dtype=np.int64), B, "test")
    res = simulate(log, _one_unbounded_worker(), RouterConfig())
    out = res.outcomes.sort("request_id")
    assert out["cached_tokens"].to_list() == [0, 2 * B, 0, 3 * B]
    matched = [sum(m["blocks"] for m in row) for row in res.requests.sort("request_id")["matches"].to_list()]
    assert matched == [0, 2, 0, 3]
    assert res.requests.sort("request_id")["query_blocks"].to_list() == [3, 3, 3, 3]


# ---------------------------------------------------------------------------
# (3) conservation

def test_conservation(small_log, tight_fleet):
    res = simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=4))
    o = res.outcomes
    assert (o["completions"] == 1).all()
    assert o["worker"].null_count() == 0
    assert (o["admit_ts"] >= o["arrival_ts"]).all()
    assert (o["first_token_ts"] > o["admit_ts"]).all()
    assert (o["completion_ts"] >= o["first_token_ts"]).all()
    assert (o["cached_tokens"] <= o["input_tokens"]).all()
    ld = res.loads
    for c in ("num_waiting_reqs", "num_running_reqs", "num_tokens", "num_waiting_uncached_tokens",
              "router_inflight"):
        assert (ld[c] >= 0).all(), c
    assert (ld["num_tokens"] <= ld["max_total_num_tokens"]).all()
    assert (ld["num_running_reqs"] <= ld["max_running_requests"]).all()
    assert res.stats["ss_neg_queue"] == 0
    assert res.stats["max_kv_used_minus_capacity"] <= 0   # cache + running never above capacity
    # monotonic native counters per rank
    mono = ld.group_by("worker", "dp_rank", maintain_order=True).agg(
        pl.col("total_prefill_uncached_tokens").diff().min().alias("a"),
        pl.col("total_prefill_busy_us").diff().min().alias("b"))
    assert (mono["a"] >= 0).all() and (mono["b"] >= 0).all()
    # every prefilled token was counted: the counters' end equals the uncached work
    last = ld.group_by("worker", "dp_rank").agg(pl.col("total_prefill_uncached_tokens").max())
    work = (o["input_tokens"] - o["cached_tokens"]).clip(lower_bound=1).sum()
    # (retracted requests compute their prompt and output so far again)
    assert last["total_prefill_uncached_tokens"].sum() <= work + res.stats["ss_recomputed"]
    assert last["total_prefill_uncached_tokens"].sum() >= 0.9 * work  # last samples precede the drain


def test_littles_law_per_rank(small_log, tight_fleet):
    """Time-average waiting count (samples) ~ arrival rate x mean queue wait, per rank."""
    res = simulate(small_log, tight_fleet, RouterConfig(), publish_interval_ms=10)
    o = res.outcomes
    ld = res.loads
    t0, t1 = int(ld["ts"].min()), int(ld["ts"].max())
    per = o.group_by("worker", "dp_rank").agg(pl.len().alias("n"), pl.col("queue_wait_ms").sum().alias("w"))
    q = ld.group_by("worker", "dp_rank").agg(pl.col("num_waiting_reqs").mean().alias("lq"))
    j = per.join(q, on=["worker", "dp_rank"])
    span_ms = (t1 - t0) / 1e6
    little = j["w"] / span_ms  # = lambda * W over the span
    busy = j.filter(little > 0.05)
    assert busy.height > 0
    ratio = (busy["lq"] / (busy["w"] / span_ms)).to_numpy()
    assert np.all(np.abs(ratio - 1) < 0.1), ratio


# ---------------------------------------------------------------------------
# (4) determinism

def test_determinism_bytes(tmp_path, small_log, tight_fleet):
    cfg = RouterConfig(worker_queue_limit=3, saturation_queue_floor=2)
    simulate(small_log, tight_fleet, cfg, tmp_path / "a", seed=11, index_lag_ms=40)
    simulate(small_log, tight_fleet, cfg, tmp_path / "b", seed=11, index_lag_ms=40)
    for name in ("requests.parquet", "loads.parquet", "workers.parquet", "outcomes.parquet",
                 "sim.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_grid_equals_single_runs(tmp_path, small_log, tight_fleet):
    table = simulate_grid(small_log, tight_fleet,
                          {"worker_queue_limit": "2,4", "saturation_queue_floor": "none,2"},
                          tmp_path / "g", threads=2)
    assert table.height == 4
    for row in table.iter_rows(named=True):
        cfg = RouterConfig(worker_queue_limit=row["worker_queue_limit"],
                           saturation_queue_floor=row["saturation_queue_floor"])
        one = simulate(small_log, tight_fleet, cfg)
        assert row["true_hit_rate"] == one.summary["true_hit_rate"]
        assert row["ttft_ms_p99"] == one.summary["ttft_ms_p99"]
        d = tmp_path / "g" / f"config-{row['config_id']}"
        assert (d / "requests.parquet").is_file() and (d / "outcomes.parquet").is_file()
    assert (tmp_path / "g" / "closed_loop_summary.parquet").is_file()


# ---------------------------------------------------------------------------
# CLI

def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_cli_single_and_grid(tmp_path):
    log = ROOT / "traces" / "sample-log" / "requests.jsonl"
    fleet = ROOT / "traces" / "sample-fleet.toml"
    out = tmp_path / "one"
    r = _run(["simulate", str(log), "--fleet", str(fleet), "--out", str(out), "--requests", "600",
              "--worker-queue-limit", "4"])
    assert r.exit_code == 0, r.output
    assert "true hit rate" in r.output
    meta = json.loads((out / "sim.json").read_text())
    assert meta["config"]["worker_queue_limit"] == 4 and meta["requests"] == 600
    r = _run(["sweep", str(out), "--out", str(tmp_path / "run"), "--worker-queue-limit", "4", "-q"])
    assert r.exit_code == 0, r.output
    assert pl.read_parquet(tmp_path / "run" / "summary.parquet")["agreement"][0] == 1.0
    # refuse a non-empty DIR without --force: one line, exit 2
    r = _run(["simulate", str(log), "--fleet", str(fleet), "--out", str(out), "--requests", "50"])
    assert r.exit_code == 2 and "not empty" in r.output and len(r.output.strip().splitlines()) == 1
    r = _run(["simulate", str(log), "--fleet", str(fleet), "--out", str(tmp_path / "grid"),
              "--requests", "400", "--worker-queue-limit", "2,4", "--workers", "3"])
    assert r.exit_code == 0, r.output
    s = pl.read_parquet(tmp_path / "grid" / "closed_loop_summary.parquet")
    assert s["worker_queue_limit"].to_list() == [2, 4]
    w = pl.read_parquet(tmp_path / "grid" / "config-1" / "workers.parquet")
    assert w.height == 3


@pytest.mark.parametrize("args, text", [
    (["--out", "{o}", "{missing}"], "no such file"),
    (["--out", "{o}", "{log}", "--fleet", "{badfleet}"], "unknown key 'worker_count'"),
    (["--out", "{o}", "{log}", "--workers", "0"], "--workers: 0 is out of range (>= 1)"),
    (["--out", "{o}", "{log}", "--saturation-queue-floor", "2"], "requires --worker-queue-limit"),
    (["--out", "{o}", "{log}", "--max-total-num-tokens", "100"], "more than max_total_num_tokens"),
])
def test_cli_errors_one_line(tmp_path, args, text):
    bad = tmp_path / "bad.toml"
    bad.write_text("worker_count = 3\n")
    subs = {"o": str(tmp_path / "o"), "missing": str(tmp_path / "nope.jsonl"),
            "log": str(ROOT / "traces" / "sample-log" / "requests.jsonl"), "badfleet": str(bad)}
    r = _run(["simulate"] + [a.format(**subs) for a in args])
    assert r.exit_code == 2, r.output
    assert text in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------
# logs and fleets

def test_sample_log_regenerates():
    """traces/sample-log/requests.jsonl is generate_log(3000, seed=7) (docs/simulator.md)."""
    log = generate_log(3000, seed=7)
    path = ROOT / "traces" / "sample-log" / "requests.jsonl"
    tmp = path.parent / ".regen-check.jsonl"
    try:
        write_mooncake_jsonl(log, tmp)
        assert tmp.read_bytes() == path.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)


def test_sample_sim_regenerates(tmp_path):
    """traces/sample (the bundled sample) is the documented simulate command's output: byte for
    byte when the installed pyarrow is the release that wrote it (the file names its writer), and
    otherwise the same rows, schema and key-value metadata (the writer's version string differs)."""
    r = _run(["simulate", str(ROOT / "traces" / "sample-log" / "requests.jsonl"), "--fleet",
              str(ROOT / "traces" / "sample-fleet.toml"), "--out", str(tmp_path / "s"), "-q",
              "--worker-queue-limit", "8", "--saturation-queue-floor", "2"])
    assert r.exit_code == 0, r.output
    for name in ("requests.parquet", "loads.parquet", "workers.parquet", "outcomes.parquet"):
        new, bundled = tmp_path / "s" / name, ROOT / "traces" / "sample" / name
        if pq.read_metadata(new).created_by == pq.read_metadata(bundled).created_by:
            assert new.read_bytes() == bundled.read_bytes(), name
        else:
            assert pq.read_metadata(new).metadata == pq.read_metadata(bundled).metadata, name
            assert pl.read_parquet(new).equals(pl.read_parquet(bundled)), name
            assert pl.read_parquet_schema(new) == pl.read_parquet_schema(bundled), name


def test_mooncake_roundtrip_and_parquet(tmp_path, small_log):
    write_mooncake_jsonl(small_log, tmp_path / "log.jsonl")
    back = read_mooncake(tmp_path / "log.jsonl")
    assert np.array_equal(back.input_tokens, small_log.input_tokens)
    assert np.array_equal(back.hash_ids, small_log.hash_ids)
    df = pl.read_ndjson(tmp_path / "log.jsonl")
    df.write_parquet(tmp_path / "log.parquet")
    pq = read_mooncake(tmp_path / "log.parquet")
    assert np.array_equal(pq.hash_off, small_log.hash_off)


def test_log_rejects_inconsistent_prefix_ids(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}\n'
                 '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [3, 2]}\n')
    with pytest.raises(LogError, match="follows different blocks"):
        read_mooncake(p)


def test_azure_synthetic_prefixes(tmp_path):
    p = tmp_path / "az.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rng = np.random.default_rng(0)
    for i in range(400):
        rows.append(f"2023-11-16 18:{15 + i // 60:02d}:{i % 60:02d}.{rng.integers(0, 10**7):07d},"
                    f"{int(rng.integers(50, 6000))},{int(rng.integers(1, 300))}")
    p.write_text("\n".join(rows) + "\n")
    a = read_azure(p, seed=1)
    b = read_azure(p, seed=1)
    assert np.array_equal(a.hash_ids, b.hash_ids)
    assert np.array_equal(a.query_blocks, -(-a.input_tokens // 512))
    blocks, _ = _unbounded(a)
    assert 0.05 < blocks < 0.95   # shared prompts and sessions give some, not total, reuse
    res = simulate(a, build_fleet(FleetSpec(workers=2)), RouterConfig())
    assert (res.outcomes["completions"] == 1).all()


@needs_azure
def test_azure_real_csv_head():
    log = read_azure(AZURE, seed=0, limit=3000)
    assert log.n_requests == 3000
    res = simulate(log, build_fleet(FleetSpec(workers=4, max_total_num_tokens=400_000)), RouterConfig())
    assert (res.outcomes["completions"] == 1).all()


def test_fleet_file_and_overrides(tmp_path):
    f = tmp_path / "f.toml"
    f.write_text('workers = 3\ndp_size = 2\ndecode_peers = 1\n[[worker]]\nindex = 1\n'
                 'prefill_tokens_per_s = 500\n')
    fl = load_fleet(f, dp_size=4)
    assert [w.role for w in fl.workers].count("decode") == 1
    pre = [fl.workers[i] for i in fl.prefill]
    assert [w.dp_size for w in pre] == [4, 4, 4]
    assert pre[1].prefill_tokens_per_s == 500
    assert fl.urls == sorted(fl.urls)
    j = tmp_path / "f.json"
    j.write_text(json.dumps({"workers": 2}))
    assert len(load_fleet(j).prefill) == 2


# ---------------------------------------------------------------------------
# engine model options: each keeps sweep's agreement at 1.0

def _fleet(**kw):
    base = dict(workers=4, dp_size=2, prefill_tokens_per_s=6000, max_running_requests=8,
                max_total_num_tokens=40_000)
    base.update(kw)
    return build_fleet(FleetSpec(**base))


@pytest.mark.parametrize("engine", [
    {"publish_policy": "on_change"},
    {"publish_policy": "on_change", "idle_publish_ms": 250},
    {"publish_policy": "sglang"},
    {"publish_policy": "sglang", "chunked_prefill_size": 512, "decode_step_ms_per_request": 0.3},
    {"chunked_prefill_size": 1024},
    {"schedule_policy": "lpm"},
    {"decode_step_ms_per_request": 0.5},
    {"publish_policy": "on_change", "chunked_prefill_size": 512, "schedule_policy": "lpm",
     "decode_step_ms_per_request": 0.3},
])
def test_fidelity_engine_options(tmp_path, small_log, engine):
    res = simulate(small_log, _fleet(**engine), RouterConfig(worker_queue_limit=4), tmp_path / "t",
                   seed=5)
    assert (res.outcomes["completions"] == 1).all()
    assert res.stats["ss_neg_queue"] == 0 and res.stats["max_kv_used_minus_capacity"] <= 0
    _assert_fidelity(res, tmp_path / "t", seed=5)


def test_engine_defaults_are_sglangs(small_log, tight_fleet):
    """sglang 0.5.23's defaults, spelled out, give the same run as a fleet that does not name
    them (chunked_prefill_size: 4096, SGLang's value when the device memory is unknown)."""
    spelled = _fleet(decode_step_ms_per_request=0.0, chunked_prefill_size=4096, schedule_policy="fcfs",
                     publish_policy="interval", publish_interval_ms=100,
                     load_balance_method="round_robin", max_prefill_tokens=16384,
                     schedule_conservativeness=1.0, init_new_token_ratio=0.7,
                     min_new_token_ratio_factor=0.14, new_token_ratio_decay_steps=600,
                     retraction_policy="length", enable_mixed_chunk=False)
    a = simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=3))
    b = simulate(small_log, spelled, RouterConfig(worker_queue_limit=3))
    assert a.loads.equals(b.loads) and a.outcomes.equals(b.outcomes)


def _one_rank(**kw):
    base = dict(workers=1, dp_size=1, prefill_tokens_per_s=1000, decode_tokens_per_s=100,
                max_running_requests=64, max_total_num_tokens=10**6, publish_policy="on_change")
    base.update(kw)
    return build_fleet(FleetSpec(**base))


def _log(rows, block_size=512):
    """rows: (ts_ms, input_tokens, output_tokens, hash ids)."""
    sizes = [len(r[3]) for r in rows]
    off = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    return RequestLog(np.array([r[0] * 1_000_000 for r in rows], dtype=np.int64),
                      np.array([r[1] for r in rows], dtype=np.int64),
                      np.array([r[2] for r in rows], dtype=np.int64), off,
                      np.array([h for r in rows for h in r[3]], dtype=np.int64),
                      np.arange(len(rows), dtype=np.int64), block_size, "test")


def test_chunked_prefill_steps():
    """A 2000-token prompt at chunk 512 is computed in 4 steps (512, 512, 512, 464) at 1000
    tokens/s: its first token comes after the same 2 s, and no step computes more than 512."""
    log = _log([(0, 2000, 3, [1, 2, 3, 4])])
    whole = simulate(log, _one_rank())
    chunked = simulate(log, _one_rank(chunked_prefill_size=512))
    assert whole.outcomes["ttft_ms"][0] == pytest.approx(2000.0)
    assert chunked.outcomes["ttft_ms"][0] == pytest.approx(2000.0)
    steps = np.diff(chunked.loads["total_prefill_uncached_tokens"].to_numpy())
    assert sorted(steps[steps > 0].tolist()) == [464, 512, 512, 512]
    assert np.diff(whole.loads["total_prefill_uncached_tokens"].to_numpy()).max() == 2000
    # a prompt queued behind it joins the last chunk's step with the 48 tokens left of the
    # budget (512 - 464) and finishes its other 52 in the next step
    log2 = _log([(0, 2000, 3, [1, 2, 3, 4]), (1, 100, 3, [9])])
    o = simulate(log2, _one_rank(chunked_prefill_size=512)).outcomes
    assert o["admit_ts"][1] == o["first_token_ts"][0] - 512 * 1_000_000
    assert o["first_token_ts"][1] == o["first_token_ts"][0] + 52 * 1_000_000


def test_lpm_admits_the_longest_cached_prefix_first():
    """One running slot: B (cold) and C (shares A's prefix) wait behind A; lpm serves C first,
    fcfs serves B first."""
    rows = [(0, 1024, 200, [1, 2]),      # A: runs, caches blocks 1, 2
            (10, 1024, 5, [7, 8]),       # B: nothing cached
            (20, 1536, 5, [1, 2, 3])]    # C: 2 of 3 blocks cached once A is in
    order = {}
    for policy in ("fcfs", "lpm"):
        r = simulate(_log(rows), _one_rank(max_running_requests=1, schedule_policy=policy))
        admit = r.outcomes["admit_ts"].to_list()
        order[policy] = sorted(range(3), key=lambda i: admit[i])
    assert order["fcfs"] == [0, 1, 2]
    assert order["lpm"] == [0, 2, 1]


def test_decode_step_grows_with_batch():
    """Two requests decoding together: each step lasts 1/decode_tokens_per_s + slope.  The
    second one's 100 ms prefill pauses the first (prefill priority); then both decode their
    10 tokens in the same 10 steps."""
    rows = [(0, 100, 11, [1]), (0, 100, 11, [2])]
    base = simulate(_log(rows), _one_rank())
    slow = simulate(_log(rows), _one_rank(decode_step_ms_per_request=4.0))
    for r, step_ms in ((base, 10.0), (slow, 14.0)):
        o = r.outcomes
        assert (o["latency_ms"] - o["ttft_ms"]).to_list() == pytest.approx(
            [100 + 10 * step_ms, 10 * step_ms])


def test_forced_placement_is_obeyed(small_log, tight_fleet):
    want = np.arange(small_log.n_requests, dtype=np.int64) % 4
    r = simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=2), placement=want)
    urls = tight_fleet.urls
    assert r.outcomes["worker"].to_list() == [urls[w] for w in want]
    assert (r.outcomes["completions"] == 1).all()
    with pytest.raises(ReplayError, match="not a prefill worker"):
        simulate(small_log, tight_fleet, placement=np.full(small_log.n_requests, 9))


def test_on_change_rows_do_not_grow_with_idle_time():
    """Engine model options: a log with a long idle span costs no more load rows with on-change
    publishing (interval publishing would write one row per rank per interval)."""
    a = generate_log(300, seed=2, rate_per_s=20.0)

    def gap(hours):
        ts = a.ts_ns.copy()
        ts[150:] += int(hours * 3600e9)
        return RequestLog(ts, a.input_tokens, a.output_tokens, a.hash_off,
                          a.block_key[a.hash_ids], a.request_id, a.block_size, "gap")

    fleet = _fleet(publish_policy="on_change")
    rows = [simulate(gap(h), fleet, RouterConfig()).stats["load_rows"] for h in (1, 123)]
    assert rows[0] == rows[1]
    assert rows[1] < 12 * a.n_requests   # bounded by the events, not by the span
    # what idle time still shows: every rank publishes before the first request after the gap
    r = simulate(gap(123), fleet, RouterConfig())
    assert (r.outcomes["reason"].is_not_null()).all()


def test_new_trace_columns_and_trace_json(tmp_path, small_log, tight_fleet):
    res = simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=4), tmp_path / "t", seed=3)
    req = pl.read_parquet(tmp_path / "t" / "requests.parquet")
    assert req.schema["hash_ids"] == pl.List(pl.Int64)
    assert req["hash_ids"].list.len().to_list() == req["query_blocks"].to_list()
    o = res.outcomes
    assert req["cached_tokens"].to_list() == o["cached_tokens"].to_list()
    assert req["ttft_ms"].to_list() == o["ttft_ms"].to_list()
    assert req["latency_ms"].to_list() == o["latency_ms"].to_list()
    assert req["output_tokens"].to_list() == small_log.output_tokens.tolist()
    assert pl.read_parquet(tmp_path / "t" / "workers.parquet")["page_size"].to_list() == [512] * 4
    info = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert info["router"] == {"worker_queue_limit": 4} and info["page_size"] == 512
    assert info["extra"]["seed"] == 3


def test_trace_dir_as_log_round_trips(tmp_path, small_log, tight_fleet):
    """simulate DIR (a trace) reads arrivals, lengths and block hashes back: the same run."""
    simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=4), tmp_path / "t")
    fleet = tmp_path / "f.toml"
    fleet.write_text("workers = 4\ndp_size = 2\nprefill_tokens_per_s = 6000\n"
                     "max_running_requests = 8\nmax_total_num_tokens = 40000\n")
    r = _run(["simulate", str(tmp_path / "t"), "--fleet", str(fleet), "--out", str(tmp_path / "again"),
              "--worker-queue-limit", "4", "-q"])
    assert r.exit_code == 0, r.output
    a = pl.read_parquet(tmp_path / "t" / "requests.parquet")
    b = pl.read_parquet(tmp_path / "again" / "requests.parquet")
    assert a.drop("ts").equals(b.drop("ts"))
    r = _run(["simulate", str(tmp_path / "t"), "--fleet", str(fleet), "--out", str(tmp_path / "forced"),
              "--forced-placement", "-q"])
    assert r.exit_code == 0, r.output
    f = pl.read_parquet(tmp_path / "forced" / "requests.parquet")
    assert f["selected_worker"].to_list() == a["selected_worker"].to_list()


@pytest.mark.parametrize("content, text", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1\n', "line 2: not valid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": "x", "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
     "line 3: field 'timestamp' must be a number"),
    ('{"timestamp": 1e300, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n',
     "column 'timestamp' row 0"),
])
def test_bad_jsonl_names_the_line(tmp_path, content, text):
    p = tmp_path / "log.jsonl"
    p.write_text(content)
    r = _run(["simulate", str(p), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and text in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("fleet_text, args, text", [
    ("workers = 3\n[[worker]]\nindex = 1\n[[worker]]\nindex = 1\n", [],
     "two [[worker]] tables with index = 1"),
    ("max_total_num_tokens = 100000000000000000000\n", [], "max_total_num_tokens must be"),
    ("prefill_tokens_per_s = 1e-300\n", [], "prefill_tokens_per_s must be"),
    ("schedule_policy = \"sjf\"\n", [], "schedule_policy must be"),
    ("publish_interval_ms = 0\n", [], "publish_interval_ms must be"),
    ("workers = 2\n", ["--worker-queue-limit", "99999999999999999999"], "beyond the simulator's range"),
    ("workers = 2\n", ["--index-lag-ms", "99999999999999999999"], "--index-lag-ms must be"),
])
def test_fleet_and_knob_overflow_refused(tmp_path, fleet_text, args, text):
    f = tmp_path / "f.toml"
    f.write_text(fleet_text)
    r = _run(["simulate", str(ROOT / "traces" / "sample-log" / "requests.jsonl"), "--fleet", str(f),
              "--out", str(tmp_path / "o"), "--requests", "50", *args])
    assert r.exit_code == 2 and text in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------
# several seeds per config

def test_grid_seeds_cli(tmp_path):
    log = ROOT / "traces" / "sample-log" / "requests.jsonl"
    fleet = ROOT / "traces" / "sample-fleet.toml"
    outs = []
    for threads in ("1", "2"):
        out = tmp_path / f"g{threads}"
        r = _run(["simulate", str(log), "--fleet", str(fleet), "--out", str(out), "--requests", "500",
                  "--worker-queue-limit", "2,4", "--seeds", "3", "--seed", "5", "--threads", threads])
        assert r.exit_code == 0, r.output
        assert "stable" in r.output
        outs.append(pl.read_parquet(out / "closed_loop_summary.parquet"))
    s = outs[0]
    assert s.equals(outs[1])   # independent of threads
    assert s.height == 2 and s["seeds"].to_list() == [[5, 6, 7]] * 2
    per = pl.read_parquet(tmp_path / "g1" / "closed_loop_seeds.parquet")
    assert per.height == 6
    one = simulate(read_mooncake(log, limit=500), load_fleet(fleet), RouterConfig(worker_queue_limit=4),
                   seed=6)
    row = per.filter((pl.col("worker_queue_limit") == 4) & (pl.col("seed") == 6)).row(0, named=True)
    assert row["true_hit_rate"] == one.summary["true_hit_rate"]
    assert row["ttft_ms_p99"] == one.summary["ttft_ms_p99"]
    for m in ("true_hit_rate", "ttft_ms_p99", "queue_wait_ms_mean"):
        vals = per.filter(pl.col("worker_queue_limit") == 2)[m].to_numpy()
        got = s.filter(pl.col("worker_queue_limit") == 2).row(0, named=True)
        assert got[m] == pytest.approx(vals.mean())
        assert got[f"{m}_lo"] <= got[m] <= got[f"{m}_hi"]
    assert (tmp_path / "g1" / "config-1" / "seed-7" / "loads.parquet").is_file()
    r = _run(["simulate", str(log), "--out", str(tmp_path / "bad"), "--seeds", "1,1"])
    assert r.exit_code == 2 and "listed twice" in r.output


def test_seed_aggregate_flags_a_meltdown():
    from replay.simulate.seeds import aggregate

    rows = [{"config_id": 0, "seed": s, "true_hit_rate": h, "ttft_ms_p99": p}
            for s, h, p in ((0, 0.90, 13_000.0), (1, 0.62, 650_000.0), (2, 0.899, 13_500.0),
                            (3, 0.901, 12_800.0))]
    rows += [{"config_id": 1, "seed": s, "true_hit_rate": 0.8 + s * 1e-4, "ttft_ms_p99": 9000.0 + s}
             for s in range(4)]
    t = aggregate(rows, [])
    a, b = t.row(0, named=True), t.row(1, named=True)
    assert a["stable"] is False and a["unstable_seeds"] == [1]
    assert b["stable"] is True and b["unstable_seeds"] == []
    assert a["true_hit_rate"] == pytest.approx((0.90 + 0.62 + 0.899 + 0.901) / 4)
    h = np.array([0.90, 0.62, 0.899, 0.901])
    half = 3.182 * h.std(ddof=1) / 2          # Student t, 3 degrees of freedom
    assert a["true_hit_rate_lo"] == pytest.approx(h.mean() - half)
    assert a["true_hit_rate_hi"] == pytest.approx(h.mean() + half)
    assert aggregate(rows[:1], []).row(0, named=True)["stable"] is None   # one seed cannot tell


# ---------------------------------------------------------------------------
# the jitted event loop against the same source run as plain Python

_PLAIN = """
import sys
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate
log = generate_log(150, seed=3, rate_per_s=30.0)
fleet = build_fleet(FleetSpec(workers=3, dp_size=2, prefill_tokens_per_s=6000,
                              max_running_requests=4, max_total_num_tokens=20_000,
                              publish_policy=sys.argv[2], chunked_prefill_size=700,
                              schedule_policy="lpm", decode_step_ms_per_request=0.4))
r = simulate(log, fleet, RouterConfig(worker_queue_limit=2), sys.argv[1], seed=4, index_lag_ms=30)
assert r.stats["ss_evictions"] > 0
"""


def assert_jit_equals_plain(tmp_path, code: str, *args: str) -> None:
    """Run ``code`` (writing a simulation to ``sys.argv[1]``) jitted and as plain Python
    (``NUMBA_DISABLE_JIT``): the files written are byte for byte the same."""
    import os
    import subprocess
    import sys

    outs = {}
    for mode in ("jit", "plain"):
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
        if mode == "plain":
            env["NUMBA_DISABLE_JIT"] = "1"
        out = tmp_path / mode
        p = subprocess.run([sys.executable, "-c", code, str(out), *args], env=env, check=False,
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        outs[mode] = out
    for name in ("requests.parquet", "loads.parquet", "outcomes.parquet"):
        assert (outs["jit"] / name).read_bytes() == (outs["plain"] / name).read_bytes(), name


@pytest.mark.parametrize("publish", ["interval", "on_change", "sglang"])
def test_kernel_equals_plain_python(tmp_path, publish):
    assert_jit_equals_plain(tmp_path, _PLAIN, publish)


def test_grid_seeds_on_ray_equal_local(tmp_path):
    """--executor ray (a real local Ray) gives the same closed-loop summary and traces."""
    pytest.importorskip("ray")
    log = ROOT / "traces" / "sample-log" / "requests.jsonl"
    fleet = ROOT / "traces" / "sample-fleet.toml"
    common = [str(log), "--fleet", str(fleet), "--requests", "400", "--worker-queue-limit", "2,4",
              "--seeds", "0,9", "-q"]
    r = _run(["simulate", *common, "--out", str(tmp_path / "local")])
    assert r.exit_code == 0, r.output
    r = _run(["simulate", *common, "--out", str(tmp_path / "ray"), "--executor", "ray",
              "--ray-cpus", "1"])
    assert r.exit_code == 0, r.output
    a = pl.read_parquet(tmp_path / "local" / "closed_loop_summary.parquet")
    b = pl.read_parquet(tmp_path / "ray" / "closed_loop_summary.parquet")
    assert a.equals(b)
    for sub in ("config-0/seed-9", "config-1/seed-0"):
        for name in ("requests.parquet", "loads.parquet", "outcomes.parquet"):
            assert ((tmp_path / "local" / sub / name).read_bytes()
                    == (tmp_path / "ray" / sub / name).read_bytes()), (sub, name)


def test_long_interval_log_warns(tmp_path):
    """A sparse log over 123 hours under interval publishing would hold ~71 M rows: the CLI says
    so before running (and the run under on-change publishing is small)."""
    p = tmp_path / "sparse.jsonl"
    p.write_text("".join(json.dumps({"timestamp": int(i * 123 * 3600e3 / 9), "input_length": 600,
                                     "output_length": 4, "hash_ids": [i, 100 + i]}) + "\n"
                         for i in range(10)))
    f = tmp_path / "f.toml"
    f.write_text('workers = 8\ndp_size = 2\npublish_policy = "on_change"\n')
    r = _run(["simulate", str(p), "--fleet", str(f), "--out", str(tmp_path / "o")])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    assert pl.read_parquet(tmp_path / "o" / "loads.parquet").height < 1000
    # interval publishing: the warning comes first (this log then stops on a request too big
    # for the KV capacity, so the test allocates nothing)
    f.write_text("workers = 8\ndp_size = 2\nmax_total_num_tokens = 500\n")
    r = _run(["simulate", str(p), "--fleet", str(f), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2
    assert "warning: interval publishing will write 70,848,032 load rows" in r.output, r.output
    assert 'publish_policy = "on_change"' in r.output


def test_refused_combinations_are_listed_in_sim_json(tmp_path):
    """Refused combinations: the warning names sim.json, and sim.json lists every refused combination."""
    log = ROOT / "traces" / "sample-log" / "requests.jsonl"
    r = _run(["simulate", str(log), "--out", str(tmp_path / "o"), "--requests", "100",
              "--worker-queue-limit", "2", "--saturation-queue-floor", "1,3,4,5"])
    assert r.exit_code == 0, r.output
    assert "(and 2 more, listed in sim.json)" in r.output
    meta = json.loads((tmp_path / "o" / "sim.json").read_text())
    assert len(meta["grid"]["skipped"]) == 3


def test_forced_placement_refusals_one_line(tmp_path, small_log, tight_fleet):
    simulate(small_log, tight_fleet, RouterConfig(worker_queue_limit=4), tmp_path / "t")
    f3 = tmp_path / "f3.toml"
    f3.write_text("workers = 3\ndp_size = 2\n")
    f4 = tmp_path / "f4.toml"
    f4.write_text("workers = 4\ndp_size = 2\nmax_total_num_tokens = 40000\n")
    log = ROOT / "traces" / "sample-log" / "requests.jsonl"
    for args, text in (
            ([str(tmp_path / "t"), "--fleet", str(f3)], "the trace has 4 prefill workers, the fleet 3"),
            ([str(log)], "--forced-placement needs a trace directory"),
            ([str(tmp_path / "t"), "--fleet", str(f4), "--worker-queue-limit", "2,4"],
             "--forced-placement runs one config, not a grid")):
        r = _run(["simulate", *args, "--out", str(tmp_path / "o"), "--forced-placement"])
        assert r.exit_code == 2 and text in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1
        assert not (tmp_path / "o").exists()
