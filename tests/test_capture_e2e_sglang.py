"""End to end on the released engine's publishers (sglang 0.5.23): record -> import ->
calibrate --validate -> simulate --seeds -> recommend.

A fleet the simulator can represent (two workers of two data-parallel ranks,
parameters drawn here and never shown to the code under test) is simulated;
every LoadStat sample and every cache store / eviction of that run is then
played, in real time, through the engine package's own ``SchedulerLoadPublisher``
and ``KVCacheEventRecorder`` + ``SchedulerKvEventsPublisher`` (tests/sglang_engine.py
loads them without torch), while ``record`` listens on loopback.  The router's
token export and the engines' request exports of the same run, shifted to the
wall clock of the replay, complete what a live fleet would have left.

The chain then runs through the real CLI and must come back to the run it came
from: exact matches, fidelity GOOD on every part, and a recommendation from
the grid.  Production flags that differ from the ones the fleet ran under
make the same chain say POOR.  About 20 s of real time for the replay.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
import re
import time
import tomllib
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import sglang_engine as sg
from click.testing import CliRunner
from test_capture_record import read_table, start_record, stop

from replay.capture.from_sim import synthetic_tokens, write_capture
from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate

WHY = sg.missing()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the released engine is not loadable: {WHY}")

WORKERS, DP = 2, 2
PROD = RouterConfig(worker_queue_limit=4)
PROD_SEED = 7
LIMITS = "none,2,4"
NS = 1_000_000_000
QUIET_MS = 30      # no request arrives within this long after a state change of the run (see _quiet_run)
STATE = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "num_waiting_uncached_tokens", "num_total_tokens",
         "total_prefill_uncached_tokens", "total_prefill_busy_us")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _hidden_fleet():
    """Each worker its own speeds and capacities, drawn here (the chain sees only recordings)."""
    rng = np.random.default_rng(2026)
    per = {i: dict(prefill_tokens_per_s=float(rng.uniform(5500, 9500)),
                   decode_tokens_per_s=float(rng.uniform(100, 150)),
                   max_running_requests=int(rng.integers(8, 15)),
                   max_total_num_tokens=int(rng.integers(45_000, 70_000))) for i in range(WORKERS)}
    # idle samples every 1.2 s: the engine's publisher re-sends an unchanged stat at most once a
    # second (LOAD_PUBLISH_HEARTBEAT_S), so a 1 s cadence would lose about half of them to it
    spec = FleetSpec(workers=WORKERS, dp_size=DP, publish_policy="on_change", idle_publish_ms=1200)
    return build_fleet(spec, per), per


def _first_crowded(res) -> tuple[int, int] | None:
    """The first request arriving less than QUIET_MS after a change of the fleet's state (a load
    sample that differs from its rank's previous one, a cache store or eviction), and how much
    later it would have to come; None when every request has that quiet time before it."""
    ld = res.loads.sort("worker", "dp_rank", "ts", maintain_order=True)
    changed = ld.filter(pl.any_horizontal([pl.col(c).diff().over("worker", "dp_rank").fill_null(0) != 0
                                           for c in STATE]))
    times = np.sort(np.concatenate([changed["ts"].to_numpy(), res.extra["cache_log"][:, 0]]))
    req = res.requests.sort("request_id")
    t = req["ts"].to_numpy()
    k = np.searchsorted(times, t, side="left") - 1      # changes at t itself come from the request
    gap = np.where(k >= 0, t - times[np.maximum(k, 0)], 1 << 62)
    bad = np.nonzero(gap < QUIET_MS * 1_000_000)[0]
    if not bad.size:
        return None
    i = int(bad[0])
    return i, int(QUIET_MS * 1_000_000 - gap[i] + 1_000_000)


def _quiet_run(log, fleet, out: Path):
    """Simulate production so that a recording's receive lag (the recorder stamps arrival, a
    few ms after the engine sent) cannot change what the router had seen: while a request
    arrives within QUIET_MS of a state change, it and every later request come later and the
    run is simulated again (what happened before it stays as it was)."""
    for _ in range(1000):
        res = simulate(log, fleet, PROD, seed=PROD_SEED, cache_log=True)
        crowded = _first_crowded(res)
        if crowded is None:
            return simulate(log, fleet, PROD, out, seed=PROD_SEED, cache_log=True)
        i, push = crowded
        log.ts_ns[i:] += push
    raise AssertionError("no quiet production run found")


def _rfc3339(ns: int) -> str:
    t = dt.datetime.fromtimestamp(ns // NS, tz=dt.UTC)
    return f"{t:%Y-%m-%dT%H:%M:%S}.{ns % NS:09d}Z"


def _warm(engines, out: Path) -> None:
    """Idle samples and empty-cache clears on every rank until the recorder has heard each
    (PUB/SUB joins late): what an idle fleet sends, so nothing false enters the recording."""
    def poke():
        for e in engines:
            for r in range(e.ranks):
                e.load(r, 0, 0, 0, total=0)
                e.clear(r)

    def heard():
        ld, kv = read_table(out, "loads"), read_table(out, "kv_events")
        if not (ld.height and kv.height):
            return False
        return all(ld.filter((pl.col("worker") == e.url) & (pl.col("dp_rank") == r)).height
                   and kv.filter((pl.col("worker") == e.url) & (pl.col("dp_rank") == r)).height
                   for e in engines for r in range(e.ranks))

    deadline = time.monotonic() + 60
    while not heard():
        assert time.monotonic() < deadline, "the recorder never heard every rank of the engines"
        poke()
        time.sleep(0.2)


def _schedule(res, log, engine_of: dict) -> list:
    """Every load sample and cache change of the run as (sim ns, order, action), in time order."""
    items = []
    ld = res.loads
    cols = {c: ld[c].to_list() for c in ld.columns}
    for k in range(ld.height):
        e, rank = engine_of[cols["worker"][k]], cols["dp_rank"][k]
        fields = dict(running=cols["num_running_reqs"][k], waiting=cols["num_waiting_reqs"][k],
                      used=cols["num_tokens"][k], waiting_uncached=cols["num_waiting_uncached_tokens"][k],
                      total=cols["num_total_tokens"][k], prefill_uncached=cols["total_prefill_uncached_tokens"][k],
                      busy_us=cols["total_prefill_busy_us"][k])
        items.append((cols["ts"][k], 1, k, ("load", e, rank, fields)))
    # the radix tree's nodes: one per dense block, its key the block's tokens, shared by the
    # ranks (its hash is a function of the chain alone); hashes computed parent first
    root = sg.Node(None, sg.Key([]))
    nodes: dict[int, sg.Node] = {}
    first = sg.load().events.KVCacheEventRecorder(enabled=True, page_size=int(log.block_size))
    for b in dict.fromkeys(log.hash_ids.tolist()):
        p = int(log.block_parent[b])
        nodes[b] = sg.Node(nodes[p] if p >= 0 else root,
                           sg.Key(synthetic_tokens(b, int(log.block_tokens[b])).tolist()))
        first.record_store(nodes[b])
    first.take()
    urls = list(engine_of)
    groups: dict = {}
    for ts, w, b, sr in res.extra["cache_log"].tolist():
        groups.setdefault((ts, w, abs(sr) - 1), []).append((nodes[b], sr > 0))
    for n, ((ts, w, rank), changes) in enumerate(groups.items()):
        items.append((ts, 0, n, ("kv", engine_of[urls[w]], rank, changes)))
    items.sort(key=lambda x: x[:3])
    return [(ts, act) for ts, _, _, act in items]


def _play(schedule, wall0_ns: int, sim0_ns: int) -> float:
    """Publish each item at its wall time; returns the worst lateness (s)."""
    late = 0.0
    for ts, act in schedule:
        due = (wall0_ns + ts - sim0_ns) / NS
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        else:
            late = max(late, -wait)
        kind, e, rank, what = act
        if kind == "load":
            e.load(rank, what["running"], what["waiting"], what["used"], waiting_uncached=what["waiting_uncached"],
                   total=what["total"], prefill_uncached=what["prefill_uncached"], busy_us=what["busy_us"])
        else:
            rec = e.recorders[rank]
            for node, stored in what:
                if stored:
                    rec.record_store(node)
                else:
                    rec.record_remove(node)
            e.flush(rank)
    return late


def _token_export(cap: Path, dest: Path, shift_ns: int, ts_ns: list[int]) -> Path:
    """The run's token export, every ``ts`` moved to the replay's wall clock."""
    for src in sorted((cap / "token_export").rglob("*.ndjson.gz")):
        out = dest / src.relative_to(cap / "token_export")
        out.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(src, "rt") as fh, gzip.open(out, "wt") as oh:
            for line in fh:
                rec = json.loads(line)
                rec["ts"] = _rfc3339(ts_ns[int(rec["request_id"])] + shift_ns)
                oh.write(json.dumps(rec) + "\n")
    return dest


def _lag_note(d: Path, late: float) -> str:
    """How far behind the run the recording was (the replay's lateness plus the recorder's receive
    lag on KV batches, whose engine time is on the wire), said when an outcome differs."""
    wall0 = int(d.joinpath("wall0").read_text())
    kv = read_table(d / "rec", "kv_events").filter(~pl.col("replayed") & (pl.col("engine_ts") >= wall0))
    lag_ms = float((kv["ts"] - kv["engine_ts"]).max()) / 1e6 + late * 1e3
    print(f"replay late by at most {late * 1e3:.1f} ms; recorded at most {lag_ms:.1f} ms after the run's time")
    if lag_ms < QUIET_MS:
        return ""
    return (f" (the recording lagged the run by up to {lag_ms:.0f} ms, more than the {QUIET_MS} ms quiet time "
            "the run leaves before each request: the machine was too loaded for this check)")


def _import(d: Path, out: Path, flags: str):
    args = ["import", "--out", out, "--token-export", d / "te", "--recorded", d / "rec",
            "--router-inflight", "derived", "--router-flags", flags]
    for w, url in enumerate(d.joinpath("urls.json").read_text().split()):
        args += ["--engine-export", f"{url}={d / 'cap' / 'engines' / f'{w:03d}'}"]
    return run(*args)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    fleet, per = _hidden_fleet()
    log = generate_log(120, seed=3, rate_per_s=6.0, think_s=1.0, turns_mean=1.0)
    t = time.perf_counter()
    res = _quiet_run(log, fleet, d / "sim")
    print(f"quiet production run in {time.perf_counter() - t:.1f} s, span "
          f"{(int(res.requests['ts'].max()) - int(res.requests['ts'].min())) / NS:.1f} s")
    write_capture(res, log, fleet, d / "cap")
    engines = [sg.RealEngine(dp_size=DP, page_size=int(log.block_size), model=fleet.spec.model)
               for _ in range(WORKERS)]
    try:
        # worker w of the run is the w-th engine in URL order (the router's order)
        engines.sort(key=lambda e: e.url)
        for w, e in enumerate(engines):
            e.cap, e.max_running = per[w]["max_total_num_tokens"], per[w]["max_running_requests"]
        engine_of = dict(zip(fleet.urls, engines, strict=True))
        (d / "urls.json").write_text(" ".join(e.url for e in engines))
        schedule = _schedule(res, log, engine_of)
        proc = start_record(d / "rec", [e.url for e in engines], "--kv-format", "default")
        try:
            _warm(engines, d / "rec")
            time.sleep(0.5)
            sim0 = min(int(res.requests["ts"].min()), schedule[0][0])
            wall0 = time.time_ns() + 300_000_000
            (d / "wall0").write_text(str(wall0))
            late = _play(schedule, wall0, sim0)
            time.sleep(1.0)
            rc, _, err = stop(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert rc == 0, err
    finally:
        for e in engines:
            e.close()
    _token_export(d / "cap", d / "te", wall0 - sim0, res.requests["ts"].to_list())
    return d, res, late, list(fleet.urls)


def test_recording_of_the_engines_publishers_imports_exactly(chain):
    d, res, late, sim_urls = chain
    why = _lag_note(d, late)
    facts = json.loads((d / "rec" / "record.json").read_text())
    assert facts["complete"] and facts["gaps"] == 0 and facts["restarts"] == 0 and facts["malformed_frames"] == 0
    r = _import(d, d / "imp", "--worker-queue-limit 4")
    assert r.exit_code == 0, r.output
    cap = json.loads((d / "imp" / "trace.json").read_text())["extra"]["capture"]
    assert cap["matches_exact"] is True and cap["requests"] == res.requests.height
    assert cap["requests_without_engine_record"] == 0
    # the rebuilt index answers what the simulated cache held, request for request
    imp = pl.read_parquet(d / "imp" / "requests.parquet").sort(pl.col("request_id").cast(pl.Int64))
    sim = pl.read_parquet(d / "sim" / "requests.parquet").sort("request_id")
    urls = d.joinpath("urls.json").read_text().split()
    to_sim = dict(zip(urls, sim_urls, strict=True))
    got = [sorted((to_sim[m["worker"]], m["blocks"]) for m in (x or [])) for x in imp["matches"].to_list()]
    want = [sorted((m["worker"], m["blocks"]) for m in (x or [])) for x in sim["matches"].to_list()]
    same = sum(a == b for a, b in zip(got, want, strict=True))
    assert sum(1 for x in want if x) > 40, "too few requests find a cached prefix to test the index"
    assert same == len(want), f"{len(want) - same} of {len(want)} requests' matches differ from the run's{why}"
    assert [to_sim[u] for u in imp["selected_worker"].to_list()] == sim["selected_worker"].to_list()


def test_calibrate_validate_simulate_recommend(chain):
    d, _, late, _ = chain
    if not (d / "imp").is_dir():
        assert _import(d, d / "imp", "--worker-queue-limit 4").exit_code == 0
    # decode speed from the engines' latencies (forced replays): the token export has no TTFT
    c = run("calibrate", d / "imp", "--out", d / "fleet.toml", "--validate", d / "fit", "--seed", PROD_SEED,
            "--refine", "--worker-queue-limit", LIMITS, "--seeds", 3)
    assert c.exit_code == 0, c.output
    assert "fidelity GOOD" in c.output, c.output + _lag_note(d, late)
    fid = json.loads((d / "fit" / "fidelity.json").read_text())
    parts = {p["name"]: p for p in fid["parts"]}
    assert fid["good"] and fid["score"] == 1.0
    for name in ("waiting_mae", "waiting_p99", "hit_rate", "latency", "router_flags", "agreement"):
        assert parts[name]["passed"] is True, (name, parts[name])
    # the queue's correlation is scored only where a rank's recorded queue varies: under SGLang's
    # round-robin dispatch this light fleet's queues barely move, and the part must say so, not pass
    corr = parts["waiting_corr"]
    assert corr["passed"] is True or (corr["value"] is None and corr["passed"] is None
                                      and "varies" in corr["detail"]), corr
    assert parts["router_flags"]["value"] >= 0.99 and parts["agreement"]["value"] >= 0.95
    # the capacities the engines published are the hidden ones
    _, per = _hidden_fleet()
    got = {w["index"]: w for w in tomllib.loads((d / "fleet.toml").read_text())["worker"]}
    for i, w in per.items():
        assert (got[i]["max_total_num_tokens"], got[i]["max_running_requests"]) == (
            w["max_total_num_tokens"], w["max_running_requests"])
        assert got[i]["prefill_tokens_per_s"] == pytest.approx(w["prefill_tokens_per_s"], rel=0.02)
        assert got[i]["decode_tokens_per_s"] == pytest.approx(w["decode_tokens_per_s"], rel=0.02)
    # the grid under several seeds from the command line, on the imported trace set
    s = run("simulate", d / "imp", "--fleet", d / "fleet.toml", "--out", d / "grid", "--worker-queue-limit", LIMITS,
            "--seeds", 2, "--seed", PROD_SEED)
    assert s.exit_code == 0, s.output
    seeds = pl.read_parquet(d / "grid" / "closed_loop_seeds.parquet")
    assert seeds.height == 3 * 2
    # the answer: fidelity first, then a config of the grid
    r = run("recommend", d / "fit", "--max-ttft-p99-ms", 10**9)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("model fidelity GOOD"), r.output
    summ = pl.read_parquet(d / "fit" / "prediction" / "closed_loop_summary.parquet")
    assert summ.height == 3
    got = re.findall(r"recommended: limit=(\w+) \(config (\d+)\)", r.output)
    assert len(got) == 1, r.output
    # the grid's best config by mean served hit rate (then TTFT p99, then id) among those whose
    # seeds agree, or disagree only within the bound and within 2 points of hit rate, read here
    best = min((row for row in summ.iter_rows(named=True)
                if row["stable"] or (row["ttft_ms_p99_max"] <= 10**9
                                     and row["true_hit_rate_max"] - row["true_hit_rate_min"] <= 0.02)),
               key=lambda row: (-row["true_hit_rate"], row["ttft_ms_p99"], row["config_id"]))
    assert int(got[0][1]) == best["config_id"], (r.output, best)
    assert got[0][0] == ("none" if best["worker_queue_limit"] is None else str(best["worker_queue_limit"]))


def test_wrong_production_flags_make_the_chain_say_poor(chain):
    """Imported as if production had run --worker-queue-limit 1: the replayed flags cannot
    reproduce the recorded decisions, and the verdict says so."""
    d, *_ = chain
    r = _import(d, d / "imp-wrong", "--worker-queue-limit 1")
    assert r.exit_code == 0, r.output
    c = run("calibrate", d / "imp-wrong", "--out", d / "fleet-wrong.toml", "--validate", d / "fit-wrong",
            "--seed", PROD_SEED, "--refine")
    assert c.exit_code == 0, c.output
    fid = json.loads((d / "fit-wrong" / "fidelity.json").read_text())
    assert not fid["good"] and "router_flags" in fid["failing"], fid["failing"]
    assert "fidelity POOR" in c.output
