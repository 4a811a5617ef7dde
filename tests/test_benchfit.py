"""calibrate from SGLang bench_serving's per-request file: the two speeds it supports.

The "benchmark" is run on the independent SGLang-like engine (tests/sglang_like.py: chunked
prefill, mixed steps) with speeds drawn here and never given to the code under test, which
sees only the bench_serving JSON line (lengths, ttfts, itls, errors).  Tolerance 10%.  A
saturated run, where no request ran alone, must call its prefill speed a lower bound."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from sglang_like import Engine
from sglang_like import run as engine_run

from replay.cli import main
from replay.errors import ParamsError
from replay.simulate import load_fleet
from replay.simulate.benchfit import calibrate_bench_file
from replay.simulate.logs import RequestLog


def _prompts(n: int, rate: float, seed: int) -> RequestLog:
    """Random prompts, none sharing a block (bench_serving's random dataset)."""
    g = np.random.default_rng(seed)
    L = g.integers(200, 3000, n)
    out = g.integers(20, 300, n)
    ts = np.cumsum(g.exponential(1 / rate, n))
    sizes = -(-L // 64)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    return RequestLog((ts * 1e9).astype(np.int64), L.astype(np.int64), out.astype(np.int64), off,
                      np.arange(1, int(off[-1]) + 1, dtype=np.int64), np.arange(n, dtype=np.int64), 64, "bench")


def _bench_file(tmp, name, rate, seed, eng):
    log = _prompts(400, rate, seed)
    engine_run(log, 1, 1, eng, tmp / name)
    req = pl.read_parquet(tmp / name / "requests.parquet").sort("request_id")
    ttft = req["ttft_ms"].to_numpy() / 1e3
    dec = req["latency_ms"].to_numpy() / 1e3 - ttft
    out = req["output_tokens"].to_numpy()
    errors = [""] * len(out)
    errors[3] = "Connection reset"           # a failed request is dropped
    line = {"backend": "sglang", "request_rate": rate, "completed": len(out) - 1,
            "input_lens": req["input_tokens"].to_list(), "output_lens": out.tolist(),
            "ttfts": ttft.tolist(), "itls": [[d / (o - 1)] * (o - 1) for d, o in zip(dec, out, strict=True)],
            "errors": errors}
    p = tmp / f"{name}.jsonl"
    p.write_text(json.dumps({"backend": "sglang", "note": "a summary line without details"}) + "\n"
                 + json.dumps(line) + "\n")
    return p


def _hidden(seed):
    g = np.random.default_rng(seed)
    return Engine(prefill_tps=float(g.uniform(5000, 12000)), decode_a_ms=float(g.uniform(12, 30)),
                  decode_b_ms=0.0, kv_tokens=400_000, max_running=64, chunk=8192)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize("seed", [41, 42])
def test_speeds_recovered_from_a_light_run(tmp_path, seed):
    eng = _hidden(seed)
    p = _bench_file(tmp_path, "light", 0.5, seed, eng)
    r = run("calibrate", p, "--out", tmp_path / "fleet.toml")
    assert r.exit_code == 0, r.output
    f = load_fleet(tmp_path / "fleet.toml")
    assert f.spec.prefill_tokens_per_s == pytest.approx(eng.prefill_tps, rel=0.10)
    assert f.spec.decode_tokens_per_s == pytest.approx(1e3 / eng.decode_a_ms, rel=0.10)
    assert "399 requests" in r.output                  # the failed one dropped
    assert "LOWER BOUND" not in r.output
    # what the file cannot tell is said, and the fleet file says it too
    for k in ("workers, dp_size", "max_total_num_tokens", "load_balance_method", "prefix cache"):
        assert k in r.output and k in (tmp_path / "fleet.toml").read_text()


def test_saturated_run_gives_a_lower_bound(tmp_path):
    eng = _hidden(41)
    p = _bench_file(tmp_path, "busy", 40.0, 41, eng)
    r = run("calibrate", p, "--out", tmp_path / "fleet.toml")
    assert r.exit_code == 0, r.output
    assert "LOWER BOUND" in r.output
    assert load_fleet(tmp_path / "fleet.toml").spec.prefill_tokens_per_s <= eng.prefill_tps * 1.001


def test_bench_file_refuses_what_it_cannot_do(tmp_path):
    p = _bench_file(tmp_path, "light", 0.5, 41, _hidden(41))
    for extra, flag in ((["--validate", tmp_path / "v"], "--validate"), (["--refine"], "--refine")):
        r = run("calibrate", p, "--out", tmp_path / "f.toml", *extra)
        assert r.exit_code == 2 and flag in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "f.toml").exists()
    other = tmp_path / "mooncake.jsonl"
    other.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n")
    r = run("calibrate", other, "--out", tmp_path / "f.toml")
    assert r.exit_code == 2 and "a mooncake log" in r.output, r.output



def test_the_library_refuses_alike_naming_parameters(tmp_path):
    """``calibrate_bench_file`` is the command on a file: what it cannot do is refused before
    anything is written, naming the parameter where the command names its flag."""
    p = _bench_file(tmp_path, "light", 0.5, 41, _hidden(41))
    out = tmp_path / "f.toml"
    for kw, lib, flags in (
            ({"validate_dir": tmp_path / "v"}, "validate_dir: a bench_serving file", ["--validate", tmp_path / "v"]),
            ({"refine": True}, "refine: a bench_serving file", ["--refine"]),
            ({"seeds": "3"}, "seeds: a bench_serving file", ["--seeds", "3"]),
            ({"knobs": {"worker_queue_limit": "2,4"}}, "worker_queue_limit: router knobs make a prediction grid",
             ["--worker-queue-limit", "2,4"])):
        with pytest.raises(ParamsError) as err:
            calibrate_bench_file(p, out, **kw)
        assert str(err.value).startswith(lib), str(err.value)
        r = run("calibrate", p, "--out", out, *flags)
        assert r.exit_code == 2 and r.output.strip() == f"error: {err.value.cli_text()}", r.output
        assert r.output.startswith(f"error: {flags[0]}: ")
    assert not out.exists()
    fit = calibrate_bench_file(p, out)
    assert fit.requests > 0 and load_fleet(out).spec.workers >= 1
