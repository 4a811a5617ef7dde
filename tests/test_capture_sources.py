"""The other import sources: polled /v1/loads, Prometheus scrapes, Dynamo traces, Mooncake logs."""

from __future__ import annotations

import gzip
import json

import polars as pl
from capture_fixture import NS, T0, build
from click.testing import CliRunner

from replay.cli import main


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_v1_loads_and_prometheus(tmp_path):
    fx = build(tmp_path / "fleet", n_requests=60)
    a, b = fx.workers[0][0], fx.workers[1][0]
    v1 = tmp_path / "a-loads.jsonl"
    lines = []
    for k in range(5):
        lines.append(json.dumps({"loads": [
            {"dp_rank": r, "num_running_reqs": k, "num_waiting_reqs": r, "num_waiting_uncached_tokens": 7,
             "num_used_tokens": 100 + k, "num_total_tokens": 200, "max_total_num_tokens": 4000,
             "max_running_requests": 16, "timestamp": (T0 + k * NS) / NS} for r in range(2)]}))
    v1.write_text("\n".join(lines) + "\n")
    prom = tmp_path / "b-metrics.txt"
    text = []
    for k in range(3):
        text.append(f"# scrape_ts_ms {(T0 + k * NS) // 1_000_000}")
        text.append("# TYPE sglang:num_running_reqs gauge")
        text.append(f'sglang:num_running_reqs{{model_name="m1"}} {k}')
        text.append("# TYPE sglang:num_queue_reqs gauge")
        text.append(f'sglang:num_queue_reqs{{model_name="m1"}} {k + 1}')
        text.append("# TYPE sglang_num_used_tokens gauge")
        text.append(f'sglang_num_used_tokens{{model_name="m1"}} {500 * (k + 1)}')
        text.append("# TYPE sglang:token_usage gauge")
        text.append(f'sglang:token_usage{{model_name="m1"}} {0.25 if k else 0}')
    prom.write_text("\n".join(text) + "\n")
    out = tmp_path / "trace"
    res = run("import", "--out", out, "--token-export", fx.token_dir, "--page-size", 4,
              "--v1-loads", f"{a}={v1}", "--prometheus", f"{b}={prom}", "--matches", "none")
    assert res.exit_code == 0, res.output
    loads = pl.read_parquet(out / "loads" / "polled.parquet")
    pa_ = loads.filter(pl.col("worker") == a).sort("ts", "dp_rank")
    assert pa_.height == 10
    assert pa_["num_tokens"].to_list()[:2] == [100, 100] and pa_["num_waiting_uncached_tokens"][0] == 7
    assert pa_["ts"][0] == T0 and pa_["ts"][2] == T0 + NS
    pb = loads.filter(pl.col("worker") == b).sort("ts")
    assert pb["num_running_reqs"].to_list() == [0, 1, 2]
    assert pb["num_waiting_reqs"].to_list() == [1, 2, 3]
    assert pb["max_total_num_tokens"].to_list() == [0, 4000, 6000]   # used / usage; 0 = unknown
    assert pb["num_total_tokens"].null_count() == 3                   # no native tail from Prometheus
    f = json.loads((out / "trace.json").read_text())["extra"]["capture"]
    assert any("coarser" in s for s in f["loads_source"])
    assert f["matches_source"] == "none (no prefix signal)"
    assert run("validate", out).exit_code == 0


def test_dynamo_trace_and_placement(tmp_path):
    d = tmp_path / "dyn"
    d.mkdir()
    recs = []
    for i in range(40):
        hashes = [1000 + (i % 3), 2000 + i] if i % 4 else [1000 + (i % 3)]
        recs.append({"event": "request_end", "request_id": f"d{i}", "input_tokens": 32 * len(hashes) - 5,
                     "output_tokens": 10, "cached_tokens": 0, "request_received_ms": T0 / 1e6 + 100 * i,
                     "ttft_ms": 5.0, "total_time_ms": 50.0,
                     "worker": {"prefill_worker_id": str(i % 2), "prefill_dp_rank": 0},
                     "replay": {"trace_block_size": 32, "input_length": 32 * len(hashes) - 5,
                                "input_sequence_hashes": hashes}})
    recs.append({"event": "request_start", "request_id": "ignored"})
    with gzip.open(d / "trace-0.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "trace"
    res = run("import", "--out", out, "--dynamo-trace", d, "--dynamo-worker", "0=http://w0:1",
              "--dynamo-worker", "1=http://w1:1", "--kv-capacity-tokens", 10_000)
    assert res.exit_code == 0, res.output
    req = pl.read_parquet(out / "requests.parquet")
    assert req.height == 40
    assert set(req["selected_worker"].unique().to_list()) == {"http://w0:1", "http://w1:1"}
    assert req["ttft_ms"][0] == 5.0 and req["latency_ms"][0] == 50.0
    f = json.loads((out / "trace.json").read_text())
    assert f["page_size"] == 32 and f["extra"]["capture"]["matches_source"] == "placement model (approximate)"
    # request 3 (prefix 1000) follows request 0 (same prefix 1000, served by w0, done 50 ms later) 300 ms on
    r3 = req.filter(pl.col("request_id") == "d3").row(0, named=True)
    assert {m["worker"]: m["blocks"] for m in r3["matches"]}.get("http://w0:1") == 1
    assert run("validate", out).exit_code == 0


def test_mooncake_log(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 3,
                                       "hash_ids": [0, i + 1]}) + "\n" for i in range(20)))
    out = tmp_path / "trace"
    res = run("import", "--out", out, "--mooncake", log)
    assert res.exit_code == 0, res.output
    assert "no prefix signal" in res.output
    req = pl.read_parquet(out / "requests.parquet")
    assert req["query_blocks"].to_list() == [2] * 20 and req["matches"].list.len().sum() == 0
    assert run("validate", out).exit_code == 0
