"""Capacity planning: traffic growth, fleet grids and `recommend --plan`.

The adequate fleet is known by construction: requests share no prefix, so
each one costs a rank ``S = L / P`` seconds of prefill and a fleet of ``c``
ranks serves at most ``c / S`` requests per second.  The test draws ``P``
and the arrival rate from a seeded RNG (the tool sees only the log and the
fleet), derives the smallest adequate rank count from that arithmetic, and
checks the plan names it, and that one rank fewer is over the bound.
"""

from __future__ import annotations

import json
import math

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay.analysis.plan import plan
from replay.cli import main
from replay.report.plan_page import fig_frontier
from replay.simulate.logs import RequestLog, generate_log
from replay.simulate.plan import parse_list, scale_log, trunk_and_families

L_TOKENS = 1024  # two 512-token blocks, none shared


def unbounded_hit_rate(log: RequestLog) -> float:
    """Block hit rate of one infinite cache that sees the requests in arrival order."""
    seen = np.zeros(log.n_blocks, dtype=bool)
    hits = 0
    for i in range(log.n_requests):
        b = log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]]
        hits += int(seen[b].sum())
        seen[b] = True
    return hits / max(1, log.hash_ids.size)


def periodic_log(path, n, rate_per_s):
    """n requests, one every 1/rate s, each with two blocks of its own and one output token."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"timestamp": round(i * 1000.0 / rate_per_s, 6),
                                "input_length": L_TOKENS, "output_length": 1,
                                "hash_ids": [2 * i, 2 * i + 1]}) + "\n" for i in range(n))


def fleet_file(path, prefill_tps, workers=1, dp=1):
    path.write_text(f"workers = {workers}\ndp_size = {dp}\nprefill_tokens_per_s = {prefill_tps}\n"
                    "decode_tokens_per_s = 1000.0\nmax_running_requests = 64\n"
                    "max_total_num_tokens = 10000000\npublish_interval_ms = 10\n")


def run(args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == code, res.output
    return res.output


# -- traffic growth -------------------------------------------------------------------------

def test_integer_scale_preserves_unbounded_hit_rate_and_scales_count_and_rate():
    log = generate_log(400, seed=3, rate_per_s=20.0)
    base = unbounded_hit_rate(log)
    assert base > 0.2  # the log shares prefixes, so a namespace leak would show
    for k in (2, 3):
        big = scale_log(log, float(k))
        assert big.n_requests == k * log.n_requests
        assert unbounded_hit_rate(big) == pytest.approx(base, abs=1e-12)
        span0 = (log.ts_ns[-1] - log.ts_ns[0])
        span = (big.ts_ns[-1] - big.ts_ns[0])
        assert span - span0 < np.median(np.diff(log.ts_ns))  # same window, k times the arrivals
        assert big.input_tokens.sum() == k * log.input_tokens.sum()
        trunk, _fam = trunk_and_families(log)
        assert trunk.sum() == 0  # several root blocks: nothing every request carries
        assert big.n_blocks == k * log.n_blocks  # fresh namespaces: no block shared across copies


def test_fractional_scale_keeps_prefix_families_whole_and_is_seeded():
    log = generate_log(1500, seed=7, rate_per_s=50.0)
    a = scale_log(log, 1.5, seed=1)
    b = scale_log(log, 1.5, seed=1)
    c = scale_log(log, 1.5, seed=2)
    assert np.array_equal(a.ts_ns, b.ts_ns) and np.array_equal(a.hash_ids, b.hash_ids)
    assert not np.array_equal(a.ts_ns, c.ts_ns)
    extra = a.n_requests - log.n_requests
    assert 0.3 * log.n_requests < extra < 0.7 * log.n_requests
    # every family of the second copy is complete: its requests are all the recording's
    n = log.n_requests
    _trunk, fam = trunk_and_families(log)
    kept = set((a.request_id[a.request_id >= n] - n).tolist())
    for f in set(fam[list(kept)].tolist()):
        assert set(np.nonzero(fam == f)[0].tolist()) <= kept
    assert unbounded_hit_rate(a) >= unbounded_hit_rate(log) - 0.05
    half = scale_log(log, 0.5, seed=1)  # below 1: the recording thinned by whole families
    assert 0.3 * n < half.n_requests < 0.7 * n


def test_a_system_prompt_every_request_carries_stays_shared_across_copies():
    # every request starts with the same two blocks (a system prompt), then its session's
    rng = np.random.default_rng(4)
    rows, t = [], 0
    for sess in range(60):
        hist = [1000 + 100 * sess]
        for _turn in range(int(rng.integers(1, 5))):
            t += int(rng.integers(1, 50))
            rows.append((t, [7, 8] + hist))
            hist = hist + [hist[-1] + 1]
    rows.sort(key=lambda r: r[0])
    ids = [b for _, h in rows for b in h]
    off = np.cumsum([0] + [len(h) for _, h in rows])
    log = RequestLog(np.array([r[0] for r in rows], dtype=np.int64) * 1_000_000,
                     np.array([512 * len(h) for _, h in rows]), np.ones(len(rows), dtype=np.int64),
                     off.astype(np.int64), np.array(ids, dtype=np.int64), np.arange(len(rows)), 512)
    trunk, fam = trunk_and_families(log)
    assert trunk.sum() == 2 and len(set(fam.tolist())) == 60  # the prompt; one family a session
    base_hits = unbounded_hit_rate(log) * log.hash_ids.size
    for k in (2, 3):
        big = scale_log(log, float(k))
        assert big.n_blocks == k * (log.n_blocks - 2) + 2
        hits = unbounded_hit_rate(big) * big.hash_ids.size
        # each later copy's first request finds the prompt cached: 2 more hits per copy
        assert hits == pytest.approx(k * base_hits + (k - 1) * 2, abs=1e-6)


def test_scale_one_is_the_log_and_bad_values_are_refused():
    log = generate_log(20, seed=1)
    assert scale_log(log, 1.0) is log
    assert parse_list("2, 1,4", "--workers", int, 1) == [1, 2, 4]
    with pytest.raises(Exception, match="--load-scale: 0 is out of range"):
        parse_list("1,0", "--load-scale", float, 1e-9)
    with pytest.raises(Exception, match="listed twice"):
        parse_list("2,2", "--workers", int, 1)
    with pytest.raises(Exception, match="is not an integer"):
        parse_list("2,x", "--workers", int, 1)


# -- the plan against a truth known by construction -------------------------------------------

@pytest.mark.parametrize("case", [11, 12])
def test_plan_finds_the_adequate_fleet_known_from_service_rates(tmp_path, case):
    rng = np.random.default_rng(case)
    prefill_tps = float(rng.uniform(8000, 16000))     # hidden from the tool
    service_s = L_TOKENS / prefill_tps
    load0 = float(rng.uniform(1.62, 1.78))            # offered work in ranks at x1 (x2: 3.2..3.6)
    rate = load0 / service_s
    n = 900
    periodic_log(tmp_path / "log.jsonl", n, rate)
    fleet_file(tmp_path / "fleet.toml", prefill_tps)
    bound_ms = 6 * service_s * 1000
    levels = (1.0, 2.0, 4.0)
    out = tmp_path / "plan"
    run(["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "--out", out,
         "--workers", "1,2,3,4,5", "--load-scale", ",".join(map(str, levels)), "--seeds", "2",
         "-q", "--worker-queue-limit", "none,64"])
    t = pl.read_parquet(out / "plan_summary.parquet")
    assert t.height == 3 * 5 * 2
    assert set(t["ranks"]) == {1, 2, 3, 4, 5} and "ttft_ms_p99_hi" in t.columns

    def truth(level):
        work = level * load0                          # ranks' worth of prefill offered
        need = math.floor(work) + 1
        return need if need <= 5 else None

    answers = {a.load_scale: a for a in plan(t, "ttft", bound_ms)}
    for level in levels:
        want = truth(level)
        got = answers[level].row
        if want is None:  # the model must say no fleet in the grid is enough
            assert got is None and answers[level].best_miss is not None
            continue
        assert got is not None and got["ranks"] == want, (level, want, got and got["ranks"])
        # one rank fewer must violate: its backlog grows by (work - (want - 1)) / S per second
        fewer = t.filter((pl.col("load_scale") == level) & (pl.col("ranks") == want - 1))
        excess = (level * load0 - (want - 1)) / service_s
        tail_wait_ms = excess * (n / (level * rate)) * 0.9 * service_s / (want - 1) * 1000
        assert tail_wait_ms > 2 * bound_ms  # the arithmetic says it must fail ...
        assert fewer["ttft_ms_p99_hi"].min() > bound_ms  # ... and the simulator agrees
    text = run(["recommend", out, "--plan", "--max-ttft-p99-ms", bound_ms], code=1)
    assert "traffic x4: NO fleet in the grid meets the bound" in text
    rec = json.loads(run(["recommend", out, "--plan", "--max-ttft-p99-ms", bound_ms, "--json"], code=1))
    by_level = {lv["load_scale"]: lv for lv in rec["levels"]}
    for level in levels:
        got = by_level[level]["fleet"]
        assert (got and got["ranks"]) == (truth(level) or None), (level, got)
        if got:
            assert got["value_ms"] <= bound_ms and got["router_flags"].startswith("--worker-queue-limit ")
    assert f"traffic x1: {truth(1.0)} workers x dp 1" in text
    assert "headroom" in text or "over the bound" in text
    # a bound everyone meets at x1 and x2 but not x4: exit 1; only levels 1,2: exit 0
    t.filter(pl.col("load_scale") < 3).write_parquet(out / "plan_summary.parquet")
    text = run(["recommend", out, "--plan", "--max-ttft-p99-ms", bound_ms], code=0)
    assert f"traffic x2: {truth(2.0)} workers" in text and "over the bound by" in text


def test_plan_prefers_fewer_ranks_then_fewer_workers_and_scales_per_rank_knobs(tmp_path):
    prefill_tps = 10240.0
    periodic_log(tmp_path / "log.jsonl", 500, 3.4 / 0.1)  # 3.4 ranks of work: 4 ranks are enough
    fleet_file(tmp_path / "fleet.toml", prefill_tps)
    out = tmp_path / "plan"
    run(["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "--out", out,
         "--workers", "2,3,4", "--dp-size", "1,2", "--per-dp-rank", "--worker-queue-limit", "8",
         "-q"])
    t = pl.read_parquet(out / "plan_summary.parquet")
    a = plan(t, "ttft", 600.0)[0]
    assert a.row is not None and (a.row["workers"], a.row["dp_size"]) == (2, 2)
    sub = json.loads((out / "x1-w2-dp2" / "sim.json").read_text())
    assert sub["grid"]["dp_size"] == 2 and sub["fleet"]["workers"][0]["dp_size"] == 2
    one = json.loads((out / "x1-w2-dp1" / "sim.json").read_text())
    assert one["grid"]["dp_size"] == 1
    # the frontier: one marker per fleet, green exactly where the fleet's best config meets it
    fig = fig_frontier(t, "ttft", 600.0)
    met, miss, chosen = fig.data
    best = (t.group_by("ranks", "workers", "dp_size").agg(pl.col("ttft_ms_p99").min())
            .with_columns(shape=pl.format("{} x {} ({} ranks)", "workers", "dp_size", "ranks")))
    assert sorted(met.y) == sorted(best.filter(pl.col("ttft_ms_p99") <= 600)["shape"].to_list())
    assert sorted(miss.y) == sorted(best.filter(pl.col("ttft_ms_p99") > 600)["shape"].to_list())
    # equal rank counts, different shapes: two rows, and the chosen one drawn as meeting the bound
    assert "2 x 2 (4 ranks)" in met.y and {"4 x 1 (4 ranks)", "2 x 2 (4 ranks)"} <= {*met.y, *miss.y}
    assert list(chosen.y) == ["2 x 2 (4 ranks)"] and "3 x 1 (3 ranks)" in miss.y  # 3 of 3.4 ranks' work: over
    text = run(["recommend", out, "--plan", "--max-queue-wait-p99-ms", 1e9])
    assert "queue_wait_ms_p99 <= 16666.7 min" in text and "traffic x1: 2 workers x dp 1 (2 ranks)" in text
    run(["report", out, "-q"])
    page = (out / "report.html").read_text()
    assert 'id="fig-frontier"' in page and "capacity plan: ttft_ms_p99" in page
    run(["report", out, "-q", "--force", "--max-ttft-p99-ms", "600"])
    page = (out / "report.html").read_text()
    assert "ttft_ms_p99 &lt;= 600 ms" in page and "traffic x1: 2 workers x dp 2 (4 ranks)" in page
    # a finished plan may be replaced with --force (and is refused without it)
    args = ["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "--out", out,
            "--workers", "2,3", "-q"]
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exit_code == 2 and "--force" in res.output
    run(args + ["--force"])
    assert pl.read_parquet(out / "plan_summary.parquet")["workers"].unique().sort().to_list() == [2, 3]
    assert not (out / "x1-w4-dp2").exists()


def test_resized_fleet_keeps_per_worker_rates(tmp_path):
    from replay.simulate import load_fleet

    p = tmp_path / "fleet.toml"
    p.write_text("workers = 2\nprefill_tokens_per_s = 1000.0\n[[worker]]\nindex = 0\n"
                 "prefill_tokens_per_s = 2000.0\ndp_size = 2\n[[worker]]\nindex = 1\n"
                 "prefill_tokens_per_s = 3000.0\n")
    f = load_fleet(p, workers=5, dp_size=1, resize=True)
    rates = [w.prefill_tokens_per_s for w in f.workers]
    assert rates == [2000.0, 3000.0, 2000.0, 3000.0, 2000.0]
    assert {w.dp_size for w in f.workers} == {1}
    with pytest.raises(Exception, match="outside"):
        load_fleet(p, workers=1)  # without resize a file's [[worker]] beyond the count is refused


def test_plan_refusals_are_one_line(tmp_path):
    periodic_log(tmp_path / "log.jsonl", 20, 10.0)
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "log.jsonl"), "--out",
                                    str(tmp_path / "o"), "--load-scale", "1,-2"])
    assert res.exit_code == 2 and "--load-scale: -2 is out of range" in res.output
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "log.jsonl"), "--out",
                                    str(tmp_path / "o"), "--workers", "1,0"])
    assert res.exit_code == 2 and "--workers: 0 is out of range (>= 1)" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(main, ["recommend", str(tmp_path), "--plan", "--max-ttft-p99-ms", "5"])
    assert res.exit_code == 2 and "no plan_summary.parquet" in res.output
    res = CliRunner().invoke(main, ["recommend", str(tmp_path), "--plan"])
    assert res.exit_code == 2 and "exactly one of" in res.output
    res = CliRunner().invoke(main, ["recommend", str(tmp_path)])
    assert res.exit_code == 2 and "needs --max-p99-waiting" in res.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "plan_summary.parquet").write_bytes(b"PAR1 not really")
    res = CliRunner().invoke(main, ["recommend", str(bad), "--plan", "--max-ttft-p99-ms", "5"])
    assert res.exit_code == 2 and "plan_summary.parquet" in res.output and "Traceback" not in res.output


def test_plan_is_the_same_whatever_the_threads_or_ray(tmp_path):
    pytest.importorskip("ray")
    periodic_log(tmp_path / "log.jsonl", 120, 20.0)
    fleet_file(tmp_path / "fleet.toml", 10240.0)
    common = ["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml",
              "--workers", "1,2", "--load-scale", "1,1.5", "--seeds", "2", "-q",
              "--worker-queue-limit", "none,4"]
    run(common + ["--out", tmp_path / "t1", "--threads", "1"])
    run(common + ["--out", tmp_path / "t3", "--threads", "3"])
    run(common + ["--out", tmp_path / "ray", "--executor", "ray", "--ray-cpus", "2"])
    a = pl.read_parquet(tmp_path / "t1" / "plan_summary.parquet")
    assert a.height == 2 * 2 * 2
    for other in ("t3", "ray"):
        b = pl.read_parquet(tmp_path / other / "plan_summary.parquet")
        assert a.equals(b), other
        assert ((tmp_path / other / "x1.5-w2-dp1" / "config-0" / "seed-1" / "requests.parquet")
                .read_bytes() == (tmp_path / "t1" / "x1.5-w2-dp1" / "config-0" / "seed-1"
                                  / "requests.parquet").read_bytes())


def test_a_plan_that_fails_part_way_leaves_nothing_that_looks_complete(tmp_path):
    periodic_log(tmp_path / "log.jsonl", 60, 10.0)
    f = tmp_path / "fleet.toml"
    fleet_file(f, 10240.0, workers=2)
    # worker 1 of every fleet of 2+ cannot hold one request: the x1-w2 point fails in its run
    f.write_text(f.read_text() + "[[worker]]\nindex = 1\nmax_total_num_tokens = 100\n")
    out = tmp_path / "plan"
    res = CliRunner().invoke(main, ["simulate", str(tmp_path / "log.jsonl"), "--fleet", str(f),
                                    "--out", str(out), "--workers", "1,2", "-q"])
    assert res.exit_code == 2, res.output
    assert len(res.output.strip().splitlines()) == 1 and "Traceback" not in res.output
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet.toml", "log.jsonl"]


def test_per_dp_rank_on_one_fleet_scales_by_its_dp_size(tmp_path):
    periodic_log(tmp_path / "log.jsonl", 40, 10.0)
    fleet_file(tmp_path / "fleet.toml", 10240.0, workers=2, dp=2)
    out = tmp_path / "grid"
    run(["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "--out", out,
         "--per-dp-rank", "--worker-queue-limit", "2,4", "-q"])
    meta = json.loads((out / "sim.json").read_text())
    assert meta["grid"]["dp_size"] == 2
    assert not (out / "plan_summary.parquet").exists()  # one fleet: an ordinary grid
