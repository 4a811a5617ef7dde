"""A small SGLang-like engine fleet, written for the tests independently of the simulator.

It shares no code with ``replay.kernels.sim``: plain Python, its own event loop, cache and
router. Ranks run FCFS queues with chunked prefill and *mixed* steps (running decodes ride
in every prefill step), a step time that grows with the batch, a page-granular prefix cache
with LRU eviction of unreferenced leaves, round-robin data-parallel dispatch, and LoadStat
samples after every step plus a heartbeat every second while nothing changes (or, with
``cadence="sglang"``, after each prefill step, after every 15th decode step since the last
sample and on going idle); a sample an arrival causes is stamped 1 us after it, as a
recorder stamps what it receives (the router had routed the request by then). Its router
sends a request to the worker holding the longest cached prefix when that worker has fewer
than ``queue_limit`` waiting requests, else to the least loaded worker; or, given ``router``
(a ``RouterConfig``), the production router does: ``replay.reference.select_prefill`` (the
router's spec, held equal to the sweep's kernels) on the samples this engine published and
the prefix each worker truly holds. The router is the product under test, not the engine
model: the engine shares nothing with the simulator.

:func:`run` writes a trace directory (requests, loads, workers, outcomes with ``dp_rank``)
that ``replay.simulate.tracelog.read_trace_log`` reads."""

from __future__ import annotations

import heapq
import json
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from replay.reference import DrawStream, LoadTable, NativeTail, PrefixSignal, RankSample, select_prefill


@dataclass
class Engine:
    prefill_tps: float = 8000.0
    decode_a_ms: float = 20.0       # decode step at batch 1
    decode_b_ms: float = 0.4        # growth per running request
    overhead_ms: float = 0.0        # a fixed cost on every step (not in the simulator's model)
    kv_tokens: int = 120_000
    max_running: int = 24
    chunk: int = 2048


class _Rank:
    def __init__(self, eng: Engine):
        self.e = eng
        self.queue: deque[int] = deque()
        self.running: list[int] = []      # decoding
        self.chunked: int | None = None   # request whose prompt continues next step
        self.left: dict[int, int] = {}    # prompt tokens still to compute
        self.gen: dict[int, int] = {}     # output tokens still to produce
        self.present: dict[int, int] = {}  # cached block -> last use
        self.refs: dict[int, int] = {}
        self.kids: dict[int, int] = {}
        self.private = 0                   # KV of running requests outside cached blocks
        self.locked = 0                    # cached blocks some running request holds
        self.busy_until = -1.0
        self.ptok = 0
        self.pbusy_us = 0.0


def run(log, n_workers: int, dp: int, eng: Engine, out: Path, *, queue_limit: int = 4,
        heartbeat_s: float = 1.0, sticky: bool = False, router=None, seed: int = 0,
        cadence: str = "step") -> None:
    """``sticky``: a worker sends a request to rank ``first block id mod dp`` (a
    session-affine dispatch SGLang does not have and the simulator cannot express)
    instead of round robin.  ``router``: a ``RouterConfig`` the production router
    routes with (draws seeded by ``seed``); ``cadence``: "step" or "sglang"."""
    bs = log.block_size
    ts = log.ts_ns / 1e9
    L, OUT = log.input_tokens, log.output_tokens
    blocks = [list(log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]][: int(L[i]) // bs])
              for i in range(log.n_requests)]
    parent = {}
    for bl in blocks:
        for j, b in enumerate(bl):
            parent[b] = bl[j - 1] if j else -1
    ranks = [[_Rank(eng) for _ in range(dp)] for _ in range(n_workers)]
    rr = [0] * n_workers
    cached = np.zeros(log.n_requests, dtype=np.int64)
    first = np.full(log.n_requests, np.nan)
    done = np.full(log.n_requests, np.nan)
    where = np.zeros((log.n_requests, 2), dtype=np.int64)
    samples: list[tuple] = []
    last_pub: dict[tuple[int, int], tuple[float, tuple]] = {}
    table = LoadTable()
    for w in range(n_workers):
        table.expect(w, range(dp))
    inflight = dict.fromkeys(range(n_workers), 0)
    since = {}                               # decode steps since a rank's last sample
    seen_inflight = dict.fromkeys(range(n_workers), (-1.0, 0))   # the router's count: its latest row's
    signals: list = [None] * log.n_requests
    events: list[tuple] = [(float(ts[i]), 1, i, -1, -1) for i in range(log.n_requests)]
    heapq.heapify(events)

    def used(rk):
        return len(rk.present) * bs + rk.private

    def evictable(rk):
        return (len(rk.present) - rk.locked) * bs

    def ref(rk, b, by):
        before = rk.refs.get(b, 0)
        rk.refs[b] = before + by
        rk.locked += (before == 0 and by > 0) - (before + by == 0 and by < 0)

    def evict(rk, need):
        while eng.kv_tokens - used(rk) < need:
            leaves = [b for b in rk.present if rk.refs.get(b, 0) == 0 and rk.kids.get(b, 0) == 0]
            if not leaves:
                return False
            b = min(leaves, key=lambda x: (rk.present[x], x))
            del rk.present[b]
            p = parent[b]
            if p >= 0:
                rk.kids[p] -= 1
        return True

    def match(rk, i):
        d = 0
        while d < len(blocks[i]) and blocks[i][d] in rk.present:
            d += 1
        return d

    def publish(w, r, t, force=False):
        rk = ranks[w][r]
        stat = (len(rk.running) + (1 if rk.chunked is not None else 0), len(rk.queue),
                used(rk) - evictable(rk), sum(int(L[i]) for i in rk.queue), rk.ptok,
                int(rk.pbusy_us), sum(int(L[i]) - match(rk, i) * bs for i in rk.queue))
        prev = last_pub.get((w, r))
        since[(w, r)] = 0
        if force or prev is None or prev[1] != stat:
            last_pub[(w, r)] = (t, stat, inflight[w])
            samples.append((t, w, r, *stat[:6], inflight[w], stat[6]))
            see(w, r, stat, t)
            seen_inflight[w] = (t, inflight[w])

    def see(w, r, stat, t):
        """The router's table takes a sample stamped ``t``."""
        native = NativeTail(waiting_uncached=stat[6], total_tokens=stat[2] + stat[3],
                            max_running_requests=eng.max_running, prefill_tokens=stat[4],
                            prefill_busy_us=stat[5])
        table.set(w, r, RankSample(running=stat[0], waiting=stat[1], num_tokens=stat[2],
                                   max_total_num_tokens=eng.kv_tokens, native=native), int(round(t * 1e9)))

    def route(i, t):
        """The production router's pick for request ``i`` at ``t``."""
        for (w, r), (t0, stat, inf) in last_pub.items():   # the heartbeats due by now
            k = int((t - t0) // heartbeat_s)
            if k >= 1:
                see(w, r, stat, t0 + k * heartbeat_s)
                if t0 + k * heartbeat_s >= seen_inflight[w][0]:   # a row repeats its sample's count
                    seen_inflight[w] = (t0 + k * heartbeat_s, inf)
        depth = {}
        for w in range(n_workers):
            d = 0
            while d < len(blocks[i]) and any(blocks[i][d] in rk.present for rk in ranks[w]):
                d += 1
            if d:
                depth[w] = d
        order = sorted(depth.items(), key=lambda x: (-x[1], x[0]))
        q = -(-int(L[i]) // bs)
        signal = PrefixSignal(query_blocks=q, matches=order,
                              best_prefix_blocks=order[0][1] if order else 0,
                              outcome="Matched" if order else "Empty") if q > 0 else None
        signals[i] = order
        snap = table.capture(int(round(t * 1e9)), {w: v for w, (_, v) in seen_inflight.items()})
        sel = select_prefill(int(L[i]), signal, list(range(n_workers)), snap, router, DrawStream(seed, i))
        if sel.worker is None:    # nothing admitted: the least in flight
            return min(range(n_workers), key=lambda w: (inflight[w], w))
        return int(sel.worker)

    def start(w, r, t):
        rk = ranks[w][r]
        budget = eng.chunk
        tokens = 0
        pre: list[int] = []
        if rk.chunked is not None:
            i = rk.chunked
            take = min(rk.left[i], budget)
            rk.left[i] -= take
            tokens += take
            budget -= take
            pre.append(i)
            if rk.left[i] == 0:
                rk.chunked = None
        while budget > 0 and rk.queue and len(rk.running) + len(pre) < eng.max_running:
            i = rk.queue[0]
            d = match(rk, i)
            new = len(blocks[i]) - d
            tail = int(L[i]) - len(blocks[i]) * bs
            need = new * bs + tail + int(OUT[i])
            for b in blocks[i][:d]:
                ref(rk, b, 1)
            if not evict(rk, need):
                for b in blocks[i][:d]:
                    ref(rk, b, -1)
                break
            rk.queue.popleft()
            for j in range(d, len(blocks[i])):
                b = blocks[i][j]
                rk.present[b] = t
                rk.refs[b] = 0
                ref(rk, b, 1)
                rk.kids[b] = 0
                if j:
                    rk.kids[blocks[i][j - 1]] += 1
            for b in blocks[i][:d]:
                rk.present[b] = t
            rk.private += tail + int(OUT[i])
            cached[i] = d * bs
            ext = max(int(L[i]) - d * bs, 1)
            take = min(ext, budget)
            rk.left[i] = ext - take
            tokens += take
            budget -= take
            pre.append(i)
            if rk.left[i] > 0:
                rk.chunked = i
        n_dec = len(rk.running)
        if tokens:
            dur = tokens / eng.prefill_tps + (eng.decode_a_ms + eng.decode_b_ms * n_dec) / 1e3 * (n_dec > 0)
        elif n_dec:
            dur = (eng.decode_a_ms + eng.decode_b_ms * n_dec) / 1e3
        else:
            return
        dur += eng.overhead_ms / 1e3
        rk.busy_until = t + dur
        heapq.heappush(events, (t + dur, 0, w, r, tokens))
        rk._step = (pre, list(rk.running), tokens, dur)

    def finish(w, r, t):
        rk = ranks[w][r]
        pre, dec, tokens, dur = rk._step
        sgl = cadence == "sglang"
        if tokens:
            rk.ptok += tokens
            rk.pbusy_us += dur * 1e6
        for i in dec:              # every running decode gains a token (mixed or decode step)
            rk.gen[i] -= 1
        for i in pre:
            if rk.left[i] == 0 and i != rk.chunked:
                first[i] = t
                rk.gen[i] = int(OUT[i]) - 1
                rk.running.append(i)
        for i in [i for i in rk.running if rk.gen[i] <= 0]:
            rk.running.remove(i)
            done[i] = t
            for b in blocks[i]:
                ref(rk, b, -1)
                rk.present[b] = t
            rk.private -= int(L[i]) - len(blocks[i]) * bs + int(OUT[i])
            inflight[w] -= 1
        rk.busy_until = -1.0
        if sgl:      # at the batch result: a prefill step, or the 15th decode step since
            since[(w, r)] = since.get((w, r), 0) + (0 if tokens else 1)
            if tokens or since[(w, r)] >= 15:
                publish(w, r, t, force=True)
        start(w, r, t)
        if not sgl or rk.busy_until < 0:
            publish(w, r, t)

    if log.n_requests:      # every rank publishes once just before the first request
        for w in range(n_workers):
            for r in range(dp):
                publish(w, r, float(ts[0]) - 1e-3, force=True)
    while events:
        t, kind, a, b, _ = heapq.heappop(events)
        if kind == 0:
            finish(a, b, t)
            continue
        i = a
        # the router: the deepest true prefix if that worker is not over the limit
        if router is not None:
            best = route(i, t)
        else:
            best, depth = -1, 0
            for w in range(n_workers):
                d = max(match(ranks[w][r], i) for r in range(dp))
                if d > depth:
                    best, depth = w, d
            if best < 0 or sum(len(rk.queue) for rk in ranks[best]) >= queue_limit:
                best = min(range(n_workers), key=lambda w: (sum(len(rk.queue) + len(rk.running)
                                                                 for rk in ranks[w]), w))
        inflight[best] += 1
        if sticky:
            r = int(log.hash_ids[log.hash_off[i]]) % dp if log.hash_off[i + 1] > log.hash_off[i] else 0
        else:
            r = rr[best] % dp
            rr[best] += 1
        where[i] = (best, r)
        rk = ranks[best][r]
        rk.queue.append(i)
        if rk.busy_until < 0:
            start(best, r, t)
        if cadence != "sglang":   # stamped 1 us on, as a recorder stamps what it receives: the
            publish(best, r, t + 1e-6)   # router routed this request before the sample existed
    # heartbeats: an unchanged load re-sent every heartbeat_s between samples
    per: dict[tuple[int, int], list[tuple]] = {}
    for s in samples:
        per.setdefault((s[1], s[2]), []).append(s)
    rows = []
    for ss in per.values():
        for a, b in zip(ss, [*ss[1:], None], strict=True):
            rows.append(a)
            if b is not None:
                k = 1
                while a[0] + k * heartbeat_s < b[0]:
                    rows.append((a[0] + k * heartbeat_s, *a[1:]))
                    k += 1
    rows.sort(key=lambda s: (s[0], s[1], s[2]))
    urls = [f"http://truth-{w}:30000" for w in range(n_workers)]
    out.mkdir(parents=True, exist_ok=True)
    t0 = 1_767_225_600 * 10**9
    arr = np.array(rows, dtype=np.float64)
    pl.DataFrame({
        "ts": np.round(arr[:, 0] * 1e9).astype(np.int64) + t0,
        "worker": [urls[int(w)] for w in arr[:, 1]], "dp_rank": arr[:, 2].astype(np.int32),
        "num_running_reqs": arr[:, 3].astype(np.int64), "num_waiting_reqs": arr[:, 4].astype(np.int64),
        "num_tokens": arr[:, 5].astype(np.int64),
        "max_total_num_tokens": np.full(len(rows), eng.kv_tokens, dtype=np.int64),
        "num_total_tokens": (arr[:, 5] + arr[:, 6]).astype(np.int64),
        "max_running_requests": np.full(len(rows), eng.max_running, dtype=np.int64),
        "total_prefill_uncached_tokens": arr[:, 7].astype(np.int64),
        "total_prefill_busy_us": arr[:, 8].astype(np.int64),
        "router_inflight": arr[:, 9].astype(np.int64),
        "num_waiting_uncached_tokens": arr[:, 10].astype(np.int64),
    }).write_parquet(out / "loads.parquet")
    hashes = [list(map(int, log.hash_ids[log.hash_off[i]:log.hash_off[i + 1]]))
              for i in range(log.n_requests)]
    pl.DataFrame({
        "request_id": [f"r{i}" for i in range(log.n_requests)],
        "ts": log.ts_ns + t0, "input_tokens": L, "output_tokens": OUT,
        "hash_ids": pl.Series(hashes, dtype=pl.List(pl.Int64)),
        "selected_worker": [urls[w] for w in where[:, 0]],
        "dp_rank": where[:, 1].astype(np.int32), "cached_tokens": cached,
        "ttft_ms": (first - ts) * 1e3, "latency_ms": (done - ts) * 1e3,
        # what the router saw (the prefix each worker held); only when it is the production router
        **({} if router is None else {
            "query_blocks": -(-L // bs),
            "matches": pl.Series([[{"worker": urls[w], "blocks": d} for w, d in m or []] for m in signals],
                                 dtype=pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))),
            "best_prefix_blocks": [m[0][1] if m else 0 for m in signals]}),
    }).write_parquet(out / "requests.parquet")
    if router is not None:   # the production router's flags and seed, as a recorder notes them
        (out / "trace.json").write_text(json.dumps({
            "source": "tests/sglang_like.py", "page_size": bs, "router": router.given_flags(),
            "extra": {"seed": seed}}))
    pl.DataFrame({"worker": urls, "role": ["plain"] * n_workers, "dp_size": [dp] * n_workers,
                  "page_size": [bs] * n_workers}).write_parquet(out / "workers.parquet")
