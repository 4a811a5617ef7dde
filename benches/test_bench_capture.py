"""Capture speed: ``record`` at 64 workers x dp 2 every 10 ms, ``import`` of 1M requests.

Run with ``python -m pytest benches/test_bench_capture.py --benchmark-enable -s`` (or
``python3 benches/test_bench_capture.py`` for the figures alone, written to
``benches/results-capture.json``).  ``ROUTER_REPLAY_CAPTURE_SECONDS`` (default 20) sets the
record run, ``ROUTER_REPLAY_CAPTURE_REQUESTS`` (default 1,000,000) the import size.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
NS = 1_000_000_000


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _rss(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def measure_record(work: Path, workers=64, dp=2, interval_ms=10, seconds=20, flush="5s") -> dict:
    """Run record against the publisher; every stream's rows must equal what was sent."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    base = 20000 + s.getsockname()[1] % 20000
    s.close()
    load_base, kv_base = base, base + 10
    out = work / "rec"
    args = [sys.executable, "-m", "replay", "record", "--out", str(out), "--flush-interval", flush,
            "--load-port-base", str(load_base), "--kv-port-base", str(kv_base), "--dp-size", str(dp),
            "--page-size", "16"]
    for i in range(workers):
        args += ["--worker", f"http://127.0.0.{i + 2}:30000"]
    pub = subprocess.Popen([sys.executable, str(HERE / "_capture_pub.py"), str(workers), str(dp), str(interval_ms),
                            str(seconds), str(load_base), str(kv_base)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)   # the publisher binds first
    rec = subprocess.Popen(args, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = []
    ready = json.loads(pub.stdout.readline())
    assert ready.get("ready"), ready
    cpu0 = _cpu_s(rec.pid)   # start-up (imports, discovery) excluded
    t0 = time.monotonic()
    while pub.poll() is None:
        rss.append((time.monotonic() - t0, _rss(rec.pid)))
        time.sleep(0.5)
    sent = json.loads(pub.stdout.readline())
    cpu = _cpu_s(rec.pid) - cpu0
    time.sleep(2.0)
    rec.send_signal(signal.SIGTERM)
    so, se = rec.communicate(timeout=120)
    assert rec.returncode == 0, se
    facts = json.loads((out / "record.json").read_text())
    loads = pl.scan_parquet(str(out / "loads" / "**" / "*.parquet"), hive_partitioning=False) \
        .group_by("worker", "dp_rank").agg(pl.len().alias("n"), pl.col("seq").max().alias("last")).collect()
    got = int(loads["n"].sum())
    kv = pl.scan_parquet(str(out / "kv_events" / "**" / "*.parquet"), hive_partitioning=False).select(pl.len()) \
        .collect().item()
    assert kv == facts["rows"]["kv_events"]
    # receive stamp minus the publisher's batch time (same clock): how late the recorder reads
    delay = pl.scan_parquet(str(out / "kv_events" / "**" / "*.parquet"), hive_partitioning=False) \
        .select(((pl.col("ts") - pl.col("engine_ts")) / 1e6).alias("ms")).collect()["ms"]
    first_half = max((r for t, r in rss if t <= seconds / 2), default=0)
    peak = max(r for _, r in rss)
    return {"workers": workers, "dp": dp, "interval_ms": interval_ms, "seconds": seconds, "flush": flush,
            "sent_loads": sent["loads"], "recorded_loads": got, "sent_kv_batches": sent["kv"],
            "recorded_kv_events": kv, "gaps": facts["gaps"], "malformed": facts["malformed_frames"],
            "publisher_wall_s": round(sent["wall_s"], 2), "publisher_late_ticks": sent["late_ticks"],
            "offered_samples_per_s": round(sent["loads"] / sent["wall_s"]),
            "rss_peak_first_half_mib": round(first_half / 2**20, 1), "rss_peak_mib": round(peak / 2**20, 1),
            "lost": sent["loads"] - got, "lost_kv": sent["kv"] - kv,
            "recorder_cpu_s": round(cpu, 1),
            "recorder_cpu_us_per_message": round(1e6 * cpu / (sent["loads"] + sent["kv"]), 1),
            "stamp_delay_ms_p50_p99_max": [round(delay.quantile(0.5), 2), round(delay.quantile(0.99), 2),
                                           round(delay.max(), 2)]}


def build_import_fixture(d: Path, n: int, workers=64, dp=2, page=16, seed=0) -> dict:
    """n requests (48..95 tokens, 800 shared prompts of 32 tokens) in a token export, KV events
    (each request's full pages stored on a rank of its worker 5 ms after arrival; 1 in 20
    evicts a block) and loads in the recorder's layout.  Generated with numpy, cached."""
    marker = d / "fixture.json"
    if marker.is_file():
        return json.loads(marker.read_text())
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    t0 = 1_764_604_800 * NS
    ts = t0 + np.cumsum(rng.integers(100_000, 5_000_000, n))          # ~2.5 ms apart
    prompts = rng.integers(1, 100_000, (800, 32))
    which = rng.zipf(1.3, n) % 800
    extra = rng.integers(16, 64, n)
    tails = rng.integers(1, 100_000, (n, 64))
    # a cache-aware fleet keeps a prompt on a few workers: prompt p lives on workers 7p .. 7p+2
    w = (which * 7 + rng.integers(0, 3, n)) % workers
    rank = rng.integers(0, dp, n)
    urls = [f"http://10.1.{i // 250}.{i % 250}:30000" for i in range(workers)]
    from replay.capture.blockhash import block_hashes

    ids = [np.concatenate([prompts[which[i]], tails[i, :extra[i]]]) for i in range(n)]
    # events: full pages of each request
    ev_ts, ev_w, ev_r, ev_h, ev_type = [], [], [], [], []
    for i in range(n):
        hs = block_hashes(ids[i], page)
        full = len(ids[i]) // page
        ev_ts.append(ts[i] + 5_000_000)
        ev_w.append(urls[w[i]])
        ev_r.append(int(rank[i]))
        ev_h.append(hs[:full])
        ev_type.append("BlockStored")
        if i % 20 == 0:
            ev_ts.append(ts[i] + 6_000_000)
            ev_w.append(urls[w[i]])
            ev_r.append(int(rank[i]))
            ev_h.append([hs[full - 1]])
            ev_type.append("BlockRemoved")
    m = len(ev_ts)
    order = np.argsort(np.array(ev_ts), kind="stable")
    tbl = pa.table({"ts": pa.array(np.array(ev_ts)[order]), "worker": pa.array([ev_w[k] for k in order]),
                    "dp_rank": pa.array(np.array(ev_r)[order]), "seq": pa.array(np.arange(m)),
                    "event_index": pa.array(np.zeros(m, np.int32)), "type": pa.array([ev_type[k] for k in order]),
                    "block_hashes": pa.array([ev_h[k] for k in order], type=pa.list_(pa.int64())),
                    "medium": pa.nulls(m, pa.string()), "lora_id": pa.nulls(m, pa.int64()),
                    "block_size": pa.array(np.full(m, page))})
    # one part per 10 s flush, in hourly folders, as record writes them
    from replay.capture.store import period_folder

    flush = (tbl["ts"].to_numpy() - t0) // (10 * NS)
    bounds = np.concatenate([[0], np.nonzero(np.diff(flush))[0] + 1, [m]])
    for k in range(len(bounds) - 1):
        part = tbl.slice(int(bounds[k]), int(bounds[k + 1] - bounds[k]))
        folder = d / "recorded" / "kv_events" / period_folder(int(part["ts"][0].as_py()), 3600)
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(part, folder / f"part-{k:06d}.parquet")
    # loads: every rank every second
    lt = np.arange(t0, ts[-1] + NS, NS)
    k = len(lt)
    ld = pl.DataFrame({"ts": np.tile(lt, workers * dp), "worker": np.repeat(urls, dp * k),
                       "dp_rank": np.tile(np.repeat(np.arange(dp), k), workers)}).with_columns(
        pl.lit(1).alias("num_running_reqs"), pl.lit(0).alias("num_waiting_reqs"), pl.lit(100).alias("num_tokens"),
        pl.lit(200_000).alias("max_total_num_tokens"))
    (d / "recorded" / "loads").mkdir(parents=True, exist_ok=True)
    ld.write_parquet(d / "recorded" / "loads" / "part-000000.parquet")
    pl.DataFrame({"worker": urls, "model": ["m"] * workers, "role": ["plain"] * workers,
                  "dp_size": [dp] * workers, "page_size": [page] * workers}).write_parquet(
        d / "recorded" / "workers.parquet")
    (d / "recorded" / "record.json").write_text(json.dumps({"complete": True}))
    # token export, 8 files
    te = d / "export" / "slug=bench" / "date=2025-12-01"
    te.mkdir(parents=True, exist_ok=True)
    tstr = pl.Series(ts).cast(pl.Datetime("ns", "UTC")).dt.to_string("%Y-%m-%dT%H:%M:%S%.9fZ")
    df = pl.DataFrame({"kind": ["ingest"] * n, "request_id": [f"r{i}" for i in range(n)], "model": ["m"] * n,
                       "input_ids": [x.tolist() for x in ids], "ts": tstr})
    for p in range(8):
        part = df[p * n // 8:(p + 1) * n // 8]
        with gzip.open(te / f"router-{p}-{t0}-0.ndjson.gz", "wb", compresslevel=3) as fh:
            part.write_ndjson(fh)
    info = {"requests": n, "kv_events": m, "load_rows": ld.height}
    marker.write_text(json.dumps(info))
    return info


def measure_import(work: Path, n: int) -> dict:
    from _support import bench_root

    fx = bench_root() / f"capture-import-v3-{n}"
    t = time.perf_counter()
    info = build_import_fixture(fx, n)
    gen_s = time.perf_counter() - t
    out = work / "trace"
    load = open("/proc/loadavg").read().split()[0]
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "replay", "import", "--out", str(out),
           "--token-export", str(fx / "export"), "--recorded", str(fx / "recorded")]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    assert r.returncode == 0, r.stderr
    peak = next((int(x.split()[-1]) * 1024 for x in r.stderr.splitlines() if "Maximum resident" in x), 0)
    cpu = sum(float(x.split()[-1]) for x in r.stderr.splitlines() if "User time" in x or "System time" in x)
    req = pq.read_metadata(out / "requests.parquet").num_rows
    entries = pl.read_parquet(out / "requests.parquet", columns=["matches"])["matches"].list.len().sum()
    return {"requests": req, "kv_events": info["kv_events"], "match_entries": int(entries), "wall_s": round(wall, 1),
            "cpu_s": round(cpu, 1), "peak_rss_gib": round(peak / 2**30, 2), "fixture_build_s": round(gen_s, 1),
            "load_before": load, "load_after": open("/proc/loadavg").read().split()[0]}


def test_record_12800_samples_per_s(tmp_path):
    seconds = int(os.environ.get("ROUTER_REPLAY_CAPTURE_SECONDS", "20"))
    res = measure_record(tmp_path, seconds=seconds)
    print(json.dumps(res, indent=2))
    assert res["lost"] == 0 and res["lost_kv"] == 0 and res["gaps"] == 0


def test_import_1m_with_kv_events(tmp_path):
    n = int(os.environ.get("ROUTER_REPLAY_CAPTURE_REQUESTS", "1000000"))
    res = measure_import(tmp_path, n)
    print(json.dumps(res, indent=2))
    assert res["requests"] == n
    # targets (1M requests): 30 s and 2 GiB peak on the 2-core machine.  Two threads work (the next
    # file is parsed while one is hashed), so on idle cores the wall time is at most the CPU time;
    # on the shared machine the wall time follows the load (recorded beside it): the CPU time is
    # held to the target
    if n >= 1_000_000:
        assert res["cpu_s"] < 30 and res["peak_rss_gib"] < 2, res


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        figures = {"record": measure_record(Path(td) / "a",
                                            seconds=int(os.environ.get("ROUTER_REPLAY_CAPTURE_SECONDS", "20"))),
                   "import": measure_import(Path(td) / "b",
                                            int(os.environ.get("ROUTER_REPLAY_CAPTURE_REQUESTS", "1000000")))}
    print(json.dumps(figures, indent=2))
    (HERE / "results-capture.json").write_text(json.dumps(figures, indent=2) + "\n")
