"""The public request-log formats: each built small in tmp, read, detected, simulated.

Optional tests read the real files under ``../shared/traces`` (or
``$REPLAY_SHARED_TRACES``) and skip when they are absent.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.simulate import detect_format, read_log
from replay.simulate.logs import LogError

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("REPLAY_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
KV = SHARED / "kv-cache-tester"
S = 1_000_000_000


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ---------------------------------------------------------------------------
# kv-cache-tester sessions

def _session(sid: str, prefix_blocks: int, turns: list[tuple[float, int, int]], *, sub=None,
             block: int = 64) -> dict:
    """A session: ids 1..prefix_blocks are the tools + system prefix, then the conversation
    grows; ``turns`` (t, in, out); full blocks only, as the real files."""
    reqs = []
    for t, n_in, n_out in turns:
        ids = list(range(1, n_in // block + 1))
        reqs.append({"t": t, "type": "s", "model": "m", "in": n_in, "out": n_out, "hash_ids": ids,
                     "stop": "tool_use", "ttft": 0.5 + t / 1000, "api_time": 2.0 + t / 1000, "think_time": 1.0})
    if sub is not None:
        reqs.append(sub)
    return {"id": sid, "block_size": block, "hash_id_scope": "local", "tool_tokens": prefix_blocks * block - 10,
            "system_tokens": 10, "requests": reqs}


def _kv_folder(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    sub = {"t": 30.0, "type": "subagent", "requests": [
        {"t": 0.0, "in": 64 * 4 + 3, "out": 5, "hash_ids": [1, 2, 900, 901]},
        {"t": 7.5, "in": 64 * 5, "out": 5, "hash_ids": [1, 2, 900, 901, 902]}]}
    (d / "trace_a.json").write_text(json.dumps(_session("a", 3, [(0.0, 64 * 5 + 7, 20), (12.0, 64 * 7 + 1, 30)],
                                                        sub=sub)))
    (d / "trace_b.json").write_text(json.dumps(_session("b", 3, [(0.0, 64 * 6 + 20, 10), (4.0, 64 * 8, 10)])))
    return d


def test_kv_cache_tester_sessions(tmp_path):
    d = _kv_folder(tmp_path / "kv")
    assert detect_format(d) == "kv-cache-tester" and detect_format(d / "trace_a.json") == "kv-cache-tester"
    log = read_log(d, seed=3, session_rate=0.01)
    assert log.block_size == 64 and log.n_requests == 6
    # full-blocks-only lists got their partial block: all but the two exact multiples
    assert log.partial_blocks_added == 4
    sizes = np.diff(log.hash_off)
    assert sizes.tolist() == (-(-log.input_tokens // 64)).tolist()
    keys = [log.block_key[log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]]] for i in range(6)]
    by_len = {int(L): k for L, k in zip(log.input_tokens, keys, strict=True)}
    a0, b0 = by_len[64 * 5 + 7], by_len[64 * 6 + 20]
    assert a0[:3].tolist() == b0[:3].tolist() == [1, 2, 3]          # the shared tools + system prefix
    assert a0[3] != b0[3]                                           # local id 4: two namespaces
    sub0, sub1 = by_len[64 * 4 + 3], by_len[64 * 5]
    assert sub0[:2].tolist() == [1, 2] and sub1[:4].tolist() == sub0[:4].tolist()
    # sub-agent requests at the parent's time plus their own; observed outcomes kept
    t = {int(L): int(ts) for L, ts in zip(log.input_tokens, log.ts_ns, strict=True)}
    assert t[64 * 4 + 3] - t[64 * 5 + 7] == 30 * S and t[64 * 5] - t[64 * 4 + 3] == int(7.5 * S)
    assert t[64 * 7 + 1] - t[64 * 5 + 7] == 12 * S
    obs = dict(zip(log.input_tokens.tolist(), log.observed_ttft_ms.tolist(), strict=True))
    assert obs[64 * 7 + 1] == pytest.approx(512.0) and np.isnan(obs[64 * 4 + 3])
    # seeded arrival process: the same seed, the same log; another seed moves the sessions
    again = read_log(d, seed=3, session_rate=0.01)
    assert again.ts_ns.tolist() == log.ts_ns.tolist()
    other = read_log(d, seed=4, session_rate=0.01)
    assert other.ts_ns.tolist() != log.ts_ns.tolist()
    # more sessions than files: each instance its own namespace, the prefix still shared
    many = read_log(d, sessions=5, session_rate=1.0)
    assert many.n_requests in (2 * 4 + 3 * 2, 3 * 4 + 2 * 2)     # five instances of two sessions
    firsts = [many.block_key[many.hash_ids[many.hash_off[i]:many.hash_off[i] + 4]] for i in range(many.n_requests)
              if many.input_tokens[i] in (64 * 5 + 7, 64 * 6 + 20)]
    assert len(firsts) == 5 and len({int(f[3]) for f in firsts}) == 5
    assert all(f[:3].tolist() == [1, 2, 3] for f in firsts)


def test_kv_cache_tester_bad_files_are_one_line(tmp_path):
    d = _kv_folder(tmp_path / "kv")
    doc = json.loads((d / "trace_b.json").read_text())
    doc["requests"][1]["hash_ids"] = [1, 2, 3]        # 512 tokens want 8 ids
    (d / "trace_b.json").write_text(json.dumps(doc))
    with pytest.raises(LogError, match=r"trace_b.json: request 1: hash_ids has 3 hashes, expected "
                                       r"ceil\(in 512 / block_size 64\) = 8$"):
        read_log(d)
    doc["requests"][1]["hash_ids"] = list(range(1, 9))
    doc["block_size"] = 16
    (d / "trace_b.json").write_text(json.dumps(doc))
    r = run("simulate", d, "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2 and "block_size 16 differs from 64" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = run("simulate", tmp_path / "kv" / "trace_a.json", "--out", tmp_path / "o", "--workers", 2,
            "--session-rate", 0)
    assert r.exit_code == 2 and "--session-rate" in r.output


def test_kv_cache_tester_simulates_and_sweeps_back(tmp_path):
    d = _kv_folder(tmp_path / "kv")
    out = tmp_path / "sim"
    r = run("simulate", d, "--workers", 2, "--dp-size", 2, "--out", out, "--sessions", 6, "--session-rate", 0.2,
            "--worker-queue-limit", 2)
    assert r.exit_code == 0, r.output
    assert "list their full blocks only" in r.output
    # the written trace holds complete lists, and its facts say how many the log lacked
    want = read_log(d, sessions=6, session_rate=0.2, seed=0).partial_blocks_added
    assert want >= 6 * 1                # every instance's first request has a partial block
    v = run("validate", out, "--json")
    facts = json.loads(v.output)
    assert facts["log_hash_ids_full_blocks_only"] == want and facts["hash_ids_full_blocks_only"] == 0
    assert f"full blocks only for {want:,} requests" in run("validate", out).output
    s = run("sweep", out, "--out", tmp_path / "run", "--worker-queue-limit", 2, "--no-report", "-q")
    assert s.exit_code == 0, s.output
    assert pl.read_parquet(tmp_path / "run" / "summary.parquet")["agreement"][0] == 1.0


# ---------------------------------------------------------------------------
# arrivals and lengths only: Azure 2023 / 2024, BurstGPT, bench_serving

def test_azure_2023_and_2024_csv(tmp_path):
    a = tmp_path / "AzureLLMInferenceTrace_code.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n"
                 "2023-11-16 18:17:04.0319600,3180,8\n")
    b = tmp_path / "AzureLLMInferenceTrace_code_1week.csv"
    b.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.003000+00:00,1200,40\n"
                 "2024-05-10 00:00:01.503000+00:00,800,4\n")
    for p, gap in ((a, 52_000_000), (b, 1_500_000_000)):
        assert detect_format(p) == "azure"
        log = read_log(p, seed=1)
        assert log.ts_ns.tolist() == [0, gap]
        assert read_log(p, seed=1).hash_ids.tolist() == log.hash_ids.tolist()


def test_burstgpt_csv(tmp_path):
    p = tmp_path / "BurstGPT_1.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "5,ChatGPT,472,18,490,Conversation log\n45,ChatGPT,1087,0,1087,Conversation log\n"
                 "118,GPT-4,417,276,693,API log\n")
    assert detect_format(p) == "burstgpt"
    log = read_log(p, seed=2, block_size=16)
    assert log.ts_ns.tolist() == [0, 40 * S, 113 * S]
    assert log.input_tokens.tolist() == [472, 1087, 417] and log.output_tokens.tolist() == [18, 0, 276]
    assert np.diff(log.hash_off).tolist() == [30, 68, 27]
    bad = tmp_path / "bad.csv"
    bad.write_text("Timestamp,Model,Request tokens,Response tokens\n5,x,-1,3\n")
    with pytest.raises(LogError, match="column 'Request tokens' row 0"):
        read_log(bad, fmt="burstgpt")


def _bench_line(n=5, rate=4.0, errors=None):
    return {"backend": "sglang", "dataset_name": "random", "request_rate": rate, "duration": 3.0,
            "completed": n, "input_lens": [100 * (i + 1) for i in range(n)],
            "output_lens": [10 + i for i in range(n)], "ttfts": [0.05 * (i + 1) for i in range(n)],
            "itls": [[0.01] * (10 + i) for i in range(n)], "generated_texts": [""] * n,
            "errors": errors or [""] * n, "cached_tokens": [0] * n}


def test_bench_serving_output(tmp_path):
    p = tmp_path / "sglang_1207_5_random.jsonl"
    first = {k: v for k, v in _bench_line(3).items() if k not in ("input_lens", "ttfts", "itls")}  # no details
    p.write_text(json.dumps(first) + "\n" + json.dumps(_bench_line(errors=["", "boom", "", "", ""])) + "\n")
    assert detect_format(p) == "bench-serving"
    log = read_log(p, seed=5, block_size=64)
    assert log.n_requests == 4                          # the failed request is dropped
    assert sorted(log.input_tokens.tolist()) == [100, 300, 400, 500]
    i = int(np.nonzero(log.input_tokens == 300)[0][0])
    assert log.observed_ttft_ms[i] == pytest.approx(150.0)
    assert log.observed_latency_ms[i] == pytest.approx(150.0 + 12 * 10.0)
    assert log.ts_ns[0] == 0 and np.all(np.diff(log.ts_ns) > 0)
    assert read_log(p, seed=5, block_size=64).ts_ns.tolist() == log.ts_ns.tolist()
    p.write_text(json.dumps(_bench_line(rate="trace")) + "\n")
    r = run("simulate", p, "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2 and "request_rate \"trace\"" in r.output and len(r.output.strip().splitlines()) == 1


# ---------------------------------------------------------------------------
# real block ids: Mooncake, Dynamo

def test_mooncake_and_dynamo(tmp_path):
    m = tmp_path / "toolagent_trace.jsonl"
    m.write_text("".join(json.dumps({"timestamp": t, "input_length": L, "output_length": 3, "hash_ids": h}) + "\n"
                         for t, L, h in ((0, 1024, [0, 1]), (7, 1500, [0, 1, 2]), (9, 600, [0]))))
    assert detect_format(m) == "mooncake"
    log = read_log(m)
    assert log.partial_blocks_added == 1 and np.diff(log.hash_off).tolist() == [2, 3, 2]
    dy = tmp_path / "dynamo.jsonl.gz"
    recs = [{"event": "request_end", "request_id": f"r{i}", "input_tokens": L, "output_tokens": 4,
             "cached_tokens": 0, "request_received_ms": 1000.0 + 50 * i, "ttft_ms": 20.0, "total_time_ms": 90.0,
             "worker": {"prefill_worker_id": "7", "prefill_dp_rank": 0},
             "replay": {"trace_block_size": 16, "input_length": L, "input_sequence_hashes": h}}
            for i, (L, h) in enumerate(((40, [11, 12]), (48, [11, 12, 13]), (5, [99])))]
    with gzip.open(dy, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    assert detect_format(dy) == "dynamo"
    log = read_log(dy)
    assert log.block_size == 16 and log.ts_ns.tolist() == [0, 50_000_000, 100_000_000]
    assert np.diff(log.hash_off).tolist() == [3, 3, 1] and log.partial_blocks_added == 1
    assert log.observed_ttft_ms.tolist() == [20.0] * 3


# ---------------------------------------------------------------------------
# detection: unknown and mixed files are one line

@pytest.mark.parametrize("name, content, text", [
    ("x.csv", "a,b,c\n1,2,3\n", "unknown CSV log (header a, b, c)"),
    ("x.jsonl", '{"foo": 1}\n', "line 1: not a record of a known log format"),
    ("x.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                + json.dumps(_bench_line()) + "\n", "mixed log: line 1 is mooncake, line 2 is bench-serving"),
    ("x.json", '{"foo": 1}', "unknown JSON log (keys foo)"),
])
def test_unknown_or_mixed_is_one_line(tmp_path, name, content, text):
    p = tmp_path / name
    p.write_text(content)
    r = run("simulate", p, "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2 and text in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1


def test_mixed_folder_is_one_line(tmp_path):
    d = _kv_folder(tmp_path / "kv")
    (d / "extra.jsonl").write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    r = run("simulate", d, "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2 and "mixed folder: extra.jsonl is mooncake, trace_a.json is kv-cache-tester" in r.output
    r = run("simulate", d / "trace_a.json", "--format", "azure", "--out", tmp_path / "o", "--workers", 2)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1


# ---------------------------------------------------------------------------
# the real files (optional)

@pytest.mark.skipif(not KV.is_dir(), reason="../shared/traces/kv-cache-tester absent")
def test_shared_kv_cache_tester_sessions():
    log = read_log(KV)
    assert log.n_requests == 2835 and log.block_size == 64
    assert log.partial_blocks_added == int((log.input_tokens % 64 != 0).sum())
    assert np.diff(log.hash_off).tolist() == (-(-log.input_tokens // 64)).tolist()


@pytest.mark.skipif(not (SHARED / "mooncake").is_dir(), reason="../shared/traces/mooncake absent")
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_shared_mooncake_files(name):
    p = SHARED / "mooncake" / name
    assert detect_format(p) == "mooncake"
    log = read_log(p, limit=3000)
    assert log.partial_blocks_added == 0 and log.n_requests == 3000


@pytest.mark.skipif(not (SHARED / "azure-llm-2023").is_dir(), reason="../shared/traces/azure-llm-2023 absent")
@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_code.csv", "AzureLLMInferenceTrace_conv.csv"])
def test_shared_azure_files(name):
    p = SHARED / "azure-llm-2023" / name
    assert detect_format(p) == "azure"
    assert read_log(p, limit=2000).n_requests == 2000
