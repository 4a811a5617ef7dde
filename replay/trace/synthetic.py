"""Seeded synthetic trace generator (vectorised numpy + pyarrow).

``generate_trace`` writes a valid trace directory (``requests.parquet``,
``loads.parquet``, ``workers.parquet``) whose shape exercises every branch of
the router's cache-aware decision under worker-queue limits of 2..16:

* arrivals: Poisson with a slowly varying base rate plus bursts of 1.3x-2.6x
  the fleet's service capacity, so that queues build on the whole fleet
  (queue gate, fleet-all-queued / fell-back tier and saturation pin fire);
* prefix groups (shared system prompts and sessions, Zipf popularity): a
  request's ``matches`` name its group's owners in provider order with
  non-increasing block counts (up to ``max_matches`` entries);
  ``query_blocks = ceil(input_tokens / block_size)``; input lengths lognormal;
* per-rank load samples every ``sample_interval_ms`` (random phase, jitter);
  waiting queues follow a Lindley recursion driven by the same arrivals;
  most samples carry the native tail, some workers never do (old publishers),
  some periods drop it, a handful of rows carry a partial tail;
* stale gaps: per-rank publisher pauses of 6-20 s and one fleet-wide pause;
* decode peers in the load table (role ``decode`` in ``workers.parquet``),
  a few unknown match addresses, zero-block and duplicate match entries,
  ``selected_worker`` on part of the requests, optional ``router_inflight``;
* the closed-loop columns (traces/README.md): ``hash_ids``, one id per block
  (``ceil(input_tokens / block_size)``, the partial last block included; the
  group's system-prompt blocks are shared by every request of the group, the
  rest are the request's own) and ``output_tokens`` (lognormal, median 200),
  with ``page_size`` in ``workers.parquet``, so the block-count rule applies and
  ``calibrate`` and ``simulate TRACE_DIR`` read the trace.  They are drawn from
  a generator of their own, so every other column is what it was without them.

Everything is a pure function of the arguments (``seed`` included).

``generate_trace_set`` writes the same kind of trace as a *trace set*
(``requests/`` and ``loads/`` folders of hive-partitioned Parquet files, one
pair per partition of ``partition_s`` seconds) in bounded memory: each
partition is generated on its own, by the same code as a whole
``generate_trace`` directory, with its own start time, request count and seed.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.errors import ConfigError, ParamsError
from replay.trace.base import LOADS, MAX_DP_SIZE, REQUESTS, WORKERS

NS = 1_000_000_000
DAY_S = 86_400
START_NS = 1_767_225_600 * NS  # 2026-01-01T00:00:00Z


def worker_url(i: int) -> str:
    return f"http://10.0.{i // 200}.{10 + i % 200}:30000"


def _write(table: pa.Table, path: str) -> None:
    pq.write_table(table, path, compression="zstd", row_group_size=1 << 20)


@dataclass(frozen=True)
class _Fleet:
    """What every partition of a trace shares: the fleet and the sampling knobs."""

    n_workers: int
    n_decode: int
    dp_size: int
    sample_interval_ms: int
    max_matches: int
    block_size: int
    router_inflight: bool

    @property
    def urls(self) -> list[str]:
        return [worker_url(i) for i in range(self.n_workers + self.n_decode)]


def _fleet(n_requests, n_workers, dp_size, sample_interval_ms, max_matches, block_size, n_decode,
           router_inflight) -> _Fleet:
    if n_requests < 0 or n_workers < 1 or dp_size < 1 or sample_interval_ms < 1 or max_matches < 0:
        raise ValueError("need n_requests >= 0, n_workers >= 1, dp_size >= 1, "
                         "sample_interval_ms >= 1, max_matches >= 0")
    n_decode = (1 if n_workers < 16 else 2) if n_decode is None else n_decode
    return _Fleet(n_workers, n_decode, dp_size, sample_interval_ms, max_matches, block_size,
                  bool(router_inflight))


# What one generated file (a whole trace, or one partition of a set) may hold:
# it is built in memory (about 250 bytes a load row and 500 a request at peak).
MAX_PART_LOAD_ROWS = 40_000_000
MAX_PART_REQUESTS = 20_000_000


def _check_size(fleet: _Fleet, n_sec: int, n_requests: int, *, partitioned: bool) -> None:
    """Refuse, in one line, a file too large to build in memory (before anything is allocated)."""
    if fleet.dp_size > MAX_DP_SIZE:
        raise ParamsError("generate: {dp_size} {given} is above {most}, the largest dp_size a trace may have "
                          "(traces/README.md)", "dp_size", given=fleet.dp_size, most=MAX_DP_SIZE)
    publishers = (fleet.n_workers + fleet.n_decode) * fleet.dp_size
    rows = publishers * -(-n_sec * 1000 // fleet.sample_interval_ms)
    cut = "a smaller {partition_s}" if partitioned else "{partition_s} to write a trace set"
    if rows > MAX_PART_LOAD_ROWS:
        raise ParamsError(f"generate: {fleet.n_workers + fleet.n_decode:,} workers x dp {fleet.dp_size} "
                          f"sampled every {fleet.sample_interval_ms} ms for {n_sec:,} s is {rows:,} load rows "
                          f"in one file, above the {MAX_PART_LOAD_ROWS:,} one file may hold in memory; use "
                          "fewer workers, a longer {sample_interval_ms} or " + cut,
                          "sample_interval_ms", "partition_s")
    if n_requests > MAX_PART_REQUESTS:
        raise ConfigError(f"generate: {n_requests:,} requests in one file, above the {MAX_PART_REQUESTS:,} one "
                          f"file may hold in memory; use {cut}")


def _span_s(n_requests: int, rate_per_s: float | None) -> int:
    """Whole seconds a trace of ``n_requests`` spans (see ``generate_trace``)."""
    duration_s = max(60.0, n_requests / 280.0) if rate_per_s is None else max(1.0, n_requests / rate_per_s)
    return int(np.ceil(duration_s))


def _requests(rng: np.random.Generator, fleet: _Fleet, *, n_requests: int, n_sec: int, start_ns: int,
              id_prefix: str):
    """The requests table of one partition; also its sorted ``ts`` and match-entry count."""
    n_workers, n_decode = fleet.n_workers, fleet.n_decode
    block_size, max_matches = fleet.block_size, fleet.max_matches
    urls = fleet.urls
    fleet_urls = urls[:n_workers]
    unknown_urls = [f"http://10.9.0.{i}:30000" for i in range(1, 4)]

    # ---------------- arrival-rate profile (1 s bins) ----------------
    t = np.arange(n_sec, dtype=np.float64)
    mult = 1.0 + 0.15 * np.sin(2 * np.pi * t / 900.0 + rng.uniform(0, 2 * np.pi))
    n_bursts = max(2, rng.poisson(n_sec / 240.0))
    b_start = rng.uniform(0, n_sec, n_bursts)
    b_start[:2] = [0.25 * n_sec, 0.6 * n_sec]          # always at least two bursts
    b_len = rng.uniform(5, 40, n_bursts)
    b_len[:2] = np.minimum(b_len[:2], max(5.0, 0.15 * n_sec))
    b_amp = rng.uniform(1.3, 2.6, n_bursts)
    b_amp[:2] = rng.uniform(2.2, 2.8, 2)              # ... that saturate the whole fleet
    for s0, ln, a in zip(b_start, b_len, b_amp, strict=True):        # loop over bursts, not rows
        sl = slice(int(s0), min(n_sec, int(s0 + ln)))
        mult[sl] *= a                                   # base load is ~0.72 of capacity
    p = mult / mult.sum()
    per_sec = rng.multinomial(n_requests, p)
    req_ts = (np.repeat(np.arange(n_sec, dtype=np.int64), per_sec) * NS
              + rng.integers(0, NS, n_requests))
    req_ts.sort()
    req_ts += start_ns

    # ---------------- prefix groups and matches ----------------
    n_groups = max(8, n_requests // 50)
    pop = 1.0 / np.arange(1, n_groups + 1) ** 1.05
    group = rng.choice(n_groups, size=n_requests, p=pop / pop.sum())
    sys_tokens = np.round(rng.lognormal(np.log(1500), 0.8, n_groups)).astype(np.int64)
    user_tokens = np.round(rng.lognormal(np.log(1200), 1.0, n_requests)).astype(np.int64)
    input_tokens = sys_tokens[group] + user_tokens
    input_tokens = np.minimum(input_tokens, 131_072)
    query_blocks = -(-input_tokens // block_size)
    k_max = max(0, min(max_matches, n_workers))
    if k_max:
        keys = rng.random((n_groups, n_workers))
        owners = np.argsort(keys, axis=1)[:, :k_max].astype(np.int64)
        g_k = rng.integers(1, k_max + 1, n_groups)
        req_k = np.minimum(g_k[group], rng.integers(1, k_max + 1, n_requests))
    else:
        owners = np.zeros((n_groups, 1), dtype=np.int64)
        req_k = np.zeros(n_requests, dtype=np.int64)
    empty = rng.random(n_requests) < 0.10               # brand-new prefixes
    req_k[empty] = 0
    null_list = empty & (rng.random(n_requests) < 0.5)  # half of them null, half []
    offsets = np.zeros(n_requests + 1, dtype=np.int64)
    np.cumsum(req_k, out=offsets[1:])
    total = int(offsets[-1])
    e_req = np.repeat(np.arange(n_requests), req_k)
    e_pos = np.arange(total) - offsets[:-1][e_req]
    e_worker = owners[group[e_req], e_pos]
    # owner 0 holds the system prompt plus part of the session; later owners less
    top = (sys_tokens[group] // block_size
           + (rng.random(n_requests) * user_tokens / block_size).astype(np.int64))
    top = np.clip(top, 1, query_blocks)
    decay = rng.uniform(0.45, 0.95, n_requests)
    e_blocks = np.maximum(1, np.floor(top[e_req] * decay[e_req] ** e_pos)).astype(np.int64)
    r = rng.random(total)
    e_blocks[r < 0.005] = 0                              # zero-block entries (skipped by the router)
    e_name = e_worker.astype(np.int64)
    unk = r > 0.998                                     # unknown match addresses
    e_name[unk] = n_workers + n_decode + rng.integers(0, len(unknown_urls), int(unk.sum()))
    dup = (r > 0.995) & (r <= 0.998) & (e_pos > 0)       # repeat of the previous worker
    e_name[dup] = e_name[np.nonzero(dup)[0] - 1]
    all_names = pa.array(urls + unknown_urls, pa.string())
    entries = pa.StructArray.from_arrays(
        [all_names.take(pa.array(e_name)), pa.array(e_blocks, pa.int64())], names=["worker", "blocks"])
    matches = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), entries,
                                       mask=pa.array(null_list))
    best = np.zeros(n_requests, dtype=np.int64)
    nz = np.nonzero(req_k > 0)[0]
    if nz.size:
        best[nz] = np.maximum.reduceat(e_blocks, offsets[nz])
    # selected_worker: ~60% of requests; the top owner mostly, else a random fleet worker
    first_owner = np.where(req_k > 0, owners[group, 0], rng.integers(0, n_workers, n_requests))
    sel_idx = np.where(rng.random(n_requests) < 0.8, first_owner, rng.integers(0, n_workers, n_requests))
    sel_mask = rng.random(n_requests) >= 0.6
    selected = pa.array(fleet_urls, pa.string()).take(pa.array(sel_idx))
    selected = pa.compute.if_else(pa.array(sel_mask), pa.nulls(n_requests, pa.string()), selected)
    req_ids = pa.compute.binary_join_element_wise(
        id_prefix, pa.array(np.arange(n_requests)).cast(pa.string()), "")
    qb = pa.array(query_blocks, pa.int64(), mask=(req_k == 0) & (rng.random(n_requests) < 0.05))
    hash_ids, output_tokens = _closed_loop_columns(rng, group, sys_tokens, input_tokens, block_size,
                                                   start_ns)
    requests = pa.table({
        "ts": pa.array(req_ts, pa.int64()),
        "request_id": req_ids,
        "model": pa.DictionaryArray.from_arrays(np.zeros(n_requests, np.int32), ["default"]).cast(pa.string()),
        "input_tokens": pa.array(input_tokens, pa.int64()),
        "query_blocks": qb,
        "matches": matches,
        "best_prefix_blocks": pa.array(best, pa.int64()),
        "selected_worker": selected,
        "hash_ids": hash_ids,
        "output_tokens": pa.array(output_tokens, pa.int64()),
    })
    return requests, req_ts, total


GROUP_STRIDE = 1 << 20     # a group's shared blocks: ids g * GROUP_STRIDE + j (j < 2**20)
PRIVATE_BASE = 1 << 40     # a request's own blocks: above every shared id


def _closed_loop_columns(rng: np.random.Generator, group: np.ndarray, sys_tokens: np.ndarray,
                         input_tokens: np.ndarray, block_size: int, start_ns: int):
    """``hash_ids`` (a list of ``ceil(L / block_size)`` ids per request) and ``output_tokens``.

    A group's full system-prompt blocks have ids ``g * GROUP_STRIDE + j``, the same in
    every partition of a trace set (so a chain always has the same parent); every other
    block is the request's own, numbered from ``PRIVATE_BASE`` plus a per-partition
    offset taken from the partition's start second (partitions less than 2**22 s apart
    never share one).  Drawn from a generator spawned from ``rng``'s seed, which leaves
    ``rng``'s own stream, and so every other column, unchanged."""
    sub = np.random.default_rng(rng.bit_generator.seed_seq.spawn(1)[0])  # type: ignore[attr-defined]
    n = input_tokens.shape[0]
    nb = -(-input_tokens // block_size)
    shared = np.minimum(sys_tokens[group] // block_size, nb)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(nb, out=off[1:])
    total = int(off[-1])
    owner = np.repeat(np.arange(n), nb)
    pos = np.arange(total, dtype=np.int64) - off[:-1][owner]
    base = PRIVATE_BASE * (1 + (start_ns // NS) % (1 << 22))
    ids = np.where(pos < shared[owner], group[owner].astype(np.int64) * GROUP_STRIDE + pos,
                   base + np.arange(total, dtype=np.int64))
    lists = pa.ListArray if total < 2**31 else pa.LargeListArray
    hash_ids = lists.from_arrays(pa.array(off.astype(np.int32) if total < 2**31 else off),
                                 pa.array(ids, pa.int64()))
    out = np.clip(np.round(sub.lognormal(np.log(200), 0.8, n)), 1, 8192).astype(np.int64)
    return hash_ids, out


def _loads(rng: np.random.Generator, fleet: _Fleet, req_ts: np.ndarray, *, n_requests: int, n_sec: int,
           start_ns: int, counters=None):
    """The loads table of one partition, its row count and the publishers' final
    prefill counters.  ``counters`` (the previous partition's final counters)
    offsets this partition's monotonic counters so they continue across partitions."""
    n_workers, n_decode, dp_size = fleet.n_workers, fleet.n_decode, fleet.dp_size
    sample_interval_ms, router_inflight = fleet.sample_interval_ms, fleet.router_inflight
    urls = fleet.urls

    # ---------------- load samples ----------------
    interval_ns = sample_interval_ms * 1_000_000
    n_ticks = int(np.ceil(n_sec * NS / interval_ns)) + 1
    n_pub_workers = n_workers + n_decode
    n_pub = n_pub_workers * dp_size
    pub_worker = np.repeat(np.arange(n_pub_workers), dp_size)
    pub_rank = np.tile(np.arange(dp_size), n_pub_workers)
    # arrivals per tick per publisher, driven by the real request stream
    tick_of_req = (req_ts - start_ns) // interval_ns
    per_tick = np.bincount(tick_of_req, minlength=n_ticks)[:n_ticks].astype(np.float64)
    share = rng.lognormal(0, 0.35, n_pub)
    share[n_workers * dp_size:] *= 0.6                   # decode peers: their own traffic
    share /= share[: n_workers * dp_size].sum()
    mean_per_tick = max(n_requests, 1) / n_ticks
    cap = (mean_per_tick / 0.72) * share * rng.uniform(0.85, 1.15, n_pub)  # service per tick
    arr = rng.poisson(np.outer(per_tick, share))          # (n_ticks, n_pub)
    S = np.cumsum(arr - cap[None, :], axis=0)
    queue = S - np.minimum(0.0, np.minimum.accumulate(S, axis=0))   # Lindley, vectorised
    waiting = np.floor(queue).astype(np.int64)
    del S, queue
    max_running = np.where(rng.random(n_pub) < 0.5, 48, 64).astype(np.int64)
    # utilisation: moving average of arrivals / capacity over ~2 s
    w = max(1, int(2000 / sample_interval_ms))
    c = np.cumsum(arr, axis=0, dtype=np.float64)
    c[w:] = c[w:] - c[:-w]
    util = c / (np.minimum(np.arange(1, n_ticks + 1), w)[:, None] * cap[None, :])
    del c
    running = np.minimum(max_running[None, :],
                         np.round(max_running[None, :] * np.clip(0.2 + 0.7 * util, 0, 1)
                                  + (waiting > 0) * max_running[None, :])).astype(np.int64)
    running = np.maximum(running - (rng.random(running.shape) < 0.3), 0)
    del util
    max_total = np.where(rng.random(n_pub) < 0.5, 300_000, 400_000).astype(np.int64)
    num_tokens = np.minimum(max_total[None, :],
                            running * rng.integers(2200, 3800, running.shape)).astype(np.int64)
    waiting_uncached = waiting * rng.integers(600, 2600, waiting.shape)
    total_tokens = np.minimum(num_tokens + waiting_uncached, 2 * max_total[None, :])
    # monotonic prefill counters: served tokens and busy microseconds
    served = np.minimum(arr + (waiting > 0), np.ceil(cap)[None, :] + 1) * rng.integers(500, 2500, arr.shape)
    served[rng.random(served.shape) < 0.05] = 0          # idle ticks (no throughput)
    thr = rng.uniform(8_000, 20_000, n_pub)              # tokens/s per rank
    busy = np.minimum(interval_ns // 1000, np.ceil(served * 1e6 / thr[None, :])).astype(np.int64)
    prefill_tokens = np.cumsum(served, axis=0).astype(np.int64)
    prefill_busy = np.cumsum(busy, axis=0).astype(np.int64)
    if counters is not None:                             # continue the previous partition's counters
        prefill_tokens += counters[0][None, :]
        prefill_busy += counters[1][None, :]
    counters_end = (prefill_tokens[-1].copy(), prefill_busy[-1].copy())
    del served, busy, arr

    ts = (np.arange(n_ticks, dtype=np.int64)[:, None] * interval_ns
          + rng.integers(0, interval_ns, n_pub)[None, :]
          + rng.integers(0, max(1, interval_ns // 20), (n_ticks, n_pub)))
    keep = np.ones((n_ticks, n_pub), dtype=bool)
    tick_s = interval_ns / NS
    # per-rank publisher pauses of 6-20 s
    n_pauses = max(2, int(n_pub * n_sec / 1800))
    for pr, p0, pl_ in zip(rng.integers(0, n_pub, n_pauses), rng.uniform(0, n_sec, n_pauses),
                           rng.uniform(6, 20, n_pauses), strict=True):
        keep[int(p0 / tick_s): int((p0 + pl_) / tick_s), pr] = False
    # one fleet-wide pause (every publisher silent for 7 s)
    f0 = rng.uniform(0.4, 0.5) * n_sec
    keep[int(f0 / tick_s): int((f0 + 7) / tick_s), :] = False
    keep &= ts < n_sec * NS
    # native tail: absent for old-publisher workers and some periods; partial on a few rows
    tail = np.ones((n_ticks, n_pub), dtype=bool)
    old = rng.random(n_pub_workers) < 0.12
    old[0] = False
    tail[:, old[pub_worker]] = False
    n_gaps = max(1, int(n_pub * n_sec / 3600))
    for pr, p0, pl_ in zip(rng.integers(0, n_pub, n_gaps), rng.uniform(0, n_sec, n_gaps),
                           rng.uniform(10, 60, n_gaps), strict=True):
        tail[int(p0 / tick_s): int((p0 + pl_) / tick_s), pr] = False
    partial = tail & (rng.random(tail.shape) < 0.0005)

    flat = keep.ravel()
    rows = np.nonzero(flat)[0]
    order = np.argsort(ts.ravel()[rows], kind="stable")
    rows = rows[order]

    def col(a):
        return a.ravel()[rows]

    pub = np.broadcast_to(np.arange(n_pub)[None, :], (n_ticks, n_pub))
    l_pub = col(pub)
    has_tail = col(tail)
    l_partial = col(partial)
    tail_mask = ~has_tail
    n_rows = rows.shape[0]
    partial_field = rng.integers(0, 5, n_rows)

    def tail_col(a, k):
        return pa.array(col(a), pa.int64(), mask=tail_mask | (l_partial & (partial_field == k)))

    l_rank = pub_rank[l_pub].astype(np.int32)
    stray = rng.random(n_rows) < 0.0003                 # a rank outside dp_size: ignored by the replay
    l_rank[stray] = dp_size
    load_names = pa.array(urls, pa.string()).take(pa.array(pub_worker[l_pub]))
    l_wait = col(waiting)
    l_run = col(running)
    table = {
        "ts": pa.array(col(ts) + start_ns, pa.int64()),
        "worker": load_names,
        "dp_rank": pa.array(l_rank, pa.int32()),
        "num_running_reqs": pa.array(l_run, pa.int64()),
        "num_waiting_reqs": pa.array(l_wait, pa.int64()),
        "num_tokens": pa.array(col(num_tokens), pa.int64()),
        "max_total_num_tokens": pa.array(max_total[l_pub], pa.int64()),
        "num_waiting_uncached_tokens": tail_col(waiting_uncached, 0),
        "num_total_tokens": tail_col(total_tokens, 1),
        "max_running_requests": tail_col(np.broadcast_to(max_running[None, :], (n_ticks, n_pub)), 2),
        "total_prefill_uncached_tokens": tail_col(prefill_tokens, 3),
        "total_prefill_busy_us": tail_col(prefill_busy, 4),
    }
    if router_inflight:
        inflight = (l_run + l_wait) * dp_size
        table["router_inflight"] = pa.array(inflight, pa.int64(), mask=rng.random(n_rows) < 0.05)
    return pa.table(table), int(n_rows), counters_end


def _generate_part(rng: np.random.Generator, fleet: _Fleet, requests_path: str, loads_path: str, *,
                   n_requests: int, n_sec: int, start_ns: int, id_prefix: str, counters=None) -> dict:
    """Generate and write one partition (a whole ``generate_trace`` trace is one):
    ``n_requests`` requests in ``[start_ns, start_ns + n_sec s)`` and the load
    samples of that span.  The requests are written and dropped before the
    loads are built, so the peak memory is the larger of the two, not the sum."""
    requests, req_ts, n_entries = _requests(rng, fleet, n_requests=n_requests, n_sec=n_sec,
                                            start_ns=start_ns, id_prefix=id_prefix)
    _write(requests, requests_path)
    del requests
    pa.default_memory_pool().release_unused()
    loads, n_rows, counters_end = _loads(rng, fleet, req_ts, n_requests=n_requests, n_sec=n_sec,
                                         start_ns=start_ns, counters=counters)
    del req_ts
    _write(loads, loads_path)
    del loads
    pa.default_memory_pool().release_unused()
    return {"load_rows": n_rows, "match_entries": n_entries, "counters": counters_end}


def _workers_table(fleet: _Fleet) -> pa.Table:
    urls = fleet.urls
    return pa.table({
        "worker": pa.array(urls, pa.string()),
        "model": pa.array(["default"] * len(urls), pa.string()),
        "role": pa.array(["prefill"] * fleet.n_workers + ["decode"] * fleet.n_decode, pa.string()),
        "dp_size": pa.array([fleet.dp_size] * len(urls), pa.int32()),
        "page_size": pa.array([fleet.block_size] * len(urls), pa.int32()),
    })


def generate_trace(
    out_dir: str | os.PathLike,
    *,
    n_requests: int,
    n_workers: int,
    dp_size: int,
    sample_interval_ms: int = 100,
    max_matches: int = 8,
    seed: int = 0,
    rate_per_s: float | None = None,
    block_size: int = 512,
    n_decode: int | None = None,
    router_inflight: bool = True,
    start_ns: int = START_NS,
) -> dict:
    """Write a synthetic trace directory; return a small summary dict.

    ``rate_per_s`` defaults to ``n_requests / max(60, n_requests / 280)``:
    about 280 requests per second (1M requests span about an hour), and at
    least a 60 s span for small traces.  ``n_decode`` decode peers (default
    1, 2 from 16 workers) publish load samples but are not fleet members.
    The directory is created if needed; existing trace files are overwritten.
    """
    fleet = _fleet(n_requests, n_workers, dp_size, sample_interval_ms, max_matches, block_size, n_decode,
                   router_inflight)
    rng = np.random.default_rng(seed)
    n_sec = _span_s(n_requests, rate_per_s)
    _check_size(fleet, n_sec, n_requests, partitioned=False)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    part = _generate_part(rng, fleet, os.path.join(out_dir, REQUESTS),
                          os.path.join(out_dir, LOADS),
                          n_requests=n_requests, n_sec=n_sec, start_ns=start_ns, id_prefix="req-")
    _write(_workers_table(fleet), os.path.join(out_dir, WORKERS))
    return {
        "out_dir": out_dir,
        "requests": n_requests,
        "load_rows": part["load_rows"],
        "workers": n_workers,
        "decode_peers": fleet.n_decode,
        "dp_size": dp_size,
        "span_s": n_sec,
        "match_entries": part["match_entries"],
    }


# ---------------------------------------------------------------------------
# trace sets


class Partition(NamedTuple):
    """One partition of a generated trace set."""

    index: int  # type: ignore[assignment]  # shadows tuple.index; renaming would change the API. 0-based position
    start_ns: int       # first instant of the partition (inclusive)
    n_sec: int          # length in seconds (the last partition may be shorter)
    n_requests: int
    name: str           # path of its file under requests/ and loads/, e.g. date=2026-01-01/part-00.parquet

    @property
    def end_ns(self) -> int:
        """First instant after the partition (exclusive)."""
        return self.start_ns + self.n_sec * NS


def plan_trace_set(n_requests: int, *, rate_per_s: float | None = None, partition_s: int = 3600,
                   start_ns: int = START_NS) -> list[Partition]:
    """The partitions ``generate_trace_set`` writes, without writing anything.

    The span is ``generate_trace``'s (whole seconds from ``n_requests`` and
    ``rate_per_s``), cut into ``partition_s``-second partitions (the last one
    shorter); requests are spread in proportion to partition length, exactly
    ``n_requests`` in all.  When ``partition_s`` divides a day, a file is named
    ``date=<UTC date of its start>/part-<partition of that day>.parquet``
    (zero-padded: ``part-00`` .. ``part-23`` for hourly partitions); otherwise
    ``date=<UTC date of its start>/part-<running index, 5+ digits>.parquet``.
    """
    if n_requests < 0:
        raise ValueError("need n_requests >= 0")
    if int(partition_s) != partition_s or partition_s < 1:
        raise ValueError(f"partition_s must be a whole number of seconds >= 1, got {partition_s!r}")
    partition_s = int(partition_s)
    span = _span_s(n_requests, rate_per_s)
    n_parts = -(-span // partition_s)
    per_day = DAY_S // partition_s if DAY_S % partition_s == 0 else 0
    width = max(2, len(str(per_day - 1))) if per_day else max(5, len(str(n_parts - 1)))
    parts = []
    for k in range(n_parts):
        a, b = k * partition_s, min(span, (k + 1) * partition_s)
        p_start = start_ns + a * NS
        sec = p_start // NS
        date = _dt.datetime.fromtimestamp(sec, _dt.UTC).strftime("%Y-%m-%d")
        num = (sec % DAY_S) // partition_s if per_day else k
        parts.append(Partition(index=k, start_ns=p_start, n_sec=b - a,
                               n_requests=n_requests * b // span - n_requests * a // span,
                               name=f"date={date}/part-{num:0{width}d}.parquet"))
    return parts


def _remove_stale(out_dir: str, keep: set[str]) -> None:
    """Remove trace files of an earlier run that this set does not rewrite (a
    reader would otherwise pick them up): single-layout ``requests.parquet`` /
    ``loads.parquet`` and Parquet files under ``requests/`` and ``loads/``."""
    for name in (REQUESTS, LOADS):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    for sub in ("requests", "loads"):
        root = os.path.join(out_dir, sub)
        for dirpath, _dirs, files in os.walk(root, topdown=False):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".parquet") and os.path.relpath(path, out_dir) not in keep:
                    os.remove(path)
            if dirpath != root and not os.listdir(dirpath):
                os.rmdir(dirpath)


def generate_trace_set(
    out_dir: str | os.PathLike,
    *,
    n_requests: int,
    n_workers: int,
    dp_size: int,
    sample_interval_ms: int = 100,
    max_matches: int = 8,
    seed: int = 0,
    rate_per_s: float | None = None,
    partition_s: int = 3600,
    router_inflight: bool = True,
    start_ns: int = START_NS,
    progress: Callable[[int], None] | None = None,
    block_size: int = 512,
    n_decode: int | None = None,
) -> dict:
    """Write a synthetic *trace set*; return a summary dict.

    Layout (``plan_trace_set`` names the partitions)::

        OUT/workers.parquet
        OUT/requests/date=2026-01-01/part-00.parquet   (hour 00 of that day)
        OUT/loads/date=2026-01-01/part-00.parquet
        ...

    Each partition is generated on its own, as ``generate_trace`` generates a
    whole trace: its own span, request count, and a seed derived from
    ``(seed, partition index)``; request ids carry the partition
    (``p0003-17``), so they are unique across the set.  Every partition has the
    same workers (``workers.parquet`` is written once).  The only state carried
    from one partition to the next is each publisher's pair of monotonic
    prefill counters, so they stay monotonic over the whole set.  Memory is
    bounded by one partition.  ``progress(k)`` is called after each partition
    is written, ``k`` being the number of partitions written so far.

    The arguments mean what they mean for ``generate_trace``.  Trace files of
    an earlier run in ``out_dir`` that this set does not rewrite are removed.
    """
    fleet = _fleet(n_requests, n_workers, dp_size, sample_interval_ms, max_matches, block_size, n_decode,
                   router_inflight)
    parts = plan_trace_set(n_requests, rate_per_s=rate_per_s, partition_s=partition_s, start_ns=start_ns)
    if parts:
        _check_size(fleet, max(p.n_sec for p in parts), max(p.n_requests for p in parts), partitioned=True)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _remove_stale(out_dir, {os.path.join(sub, *p.name.split("/")) for p in parts
                            for sub in ("requests", "loads")})
    _write(_workers_table(fleet), os.path.join(out_dir, WORKERS))
    id_width = max(4, len(str(len(parts) - 1)))
    load_rows = entries = 0
    counters = None
    for p in parts:
        paths = []
        for sub in ("requests", "loads"):
            path = os.path.join(out_dir, sub, *p.name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            paths.append(path)
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(p.index,)))
        info = _generate_part(rng, fleet, *paths, n_requests=p.n_requests, n_sec=p.n_sec,
                              start_ns=p.start_ns, id_prefix=f"p{p.index:0{id_width}d}-", counters=counters)
        counters = info["counters"]
        load_rows += info["load_rows"]
        entries += info["match_entries"]
        if progress is not None:
            progress(p.index + 1)
    return {
        "out_dir": out_dir,
        "requests": n_requests,
        "load_rows": load_rows,
        "files": 2 * len(parts) + 1,
        "partitions": len(parts),
        "partition_s": int(partition_s),
        "span_s": sum(p.n_sec for p in parts),
        "workers": n_workers,
        "decode_peers": fleet.n_decode,
        "dp_size": dp_size,
        "match_entries": entries,
    }
