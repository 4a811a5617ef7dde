"""Python API of the fleet simulator: one simulation, or one closed-loop simulation per config.

:func:`simulate` runs the numba event loop (``nb.simulate_nb``) for one
router config and returns (and optionally writes) a trace directory in the
exact format ``sweep`` reads plus ``outcomes.parquet``;
:func:`grid_task` is one simulation of a grid or plan as a pool's task
(:mod:`replay.simulate.batch` runs them).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from numba import types
from numba.typed import List

from replay import __version__
from replay import labels as L_
from replay.config import Grid, RouterConfig
from replay.errors import ParamError, ReplayError
from replay.kernels import layout as kl
from replay.kernels import sim as nb
from replay.kernels._jit import holding_signals
from replay.kernels.lists import int64_array_nb
from replay.runs import names
from replay.runs.rundir import building, guard
from replay.simulate.fleet import LOAD_BALANCE_METHODS, Fleet
from replay.simulate.logs import RequestLog
from replay.sweep.engine import encode_configs
from replay.trace.files import write_options

START_NS = 1_767_225_600 * 1_000_000_000  # 2026-01-01T00:00:00Z, the epoch of written traces
SUMMARY = names.CLOSED_LOOP
SEEDS_TABLE = names.CLOSED_LOOP_SEEDS
OUTCOMES = names.OUTCOMES
SIM_JSON = names.SIM_JSON
TRACE_JSON = names.TRACE_JSON
PUBLISH_DELAY_NS = 1_000_000
# "sglang": the engine publishes at the step's end; 1 us later, so the sample is never stamped
# with an arrival it did not see, and the next step (at least one token long) has not ended
SGLANG_PUBLISH_DELAY_NS = 1_000
MAX_MS = 10**9  # about 11.6 days: intervals beyond this are refused (int64 ns stay far from overflow)
# load rows are made and written this many at a time: pyarrow's default row group
# length, so loads.parquet streamed chunk by chunk has the row groups (and bytes) of one
# write of the whole table
CHUNK_ROWS = 1024 * 1024


@dataclass
class LoadRows:
    """The load rows (``loads.parquet``) of one simulation, made on demand, chunk by chunk.

    On-change publishing writes its rows in the kernel (``rows``, ``[kl.LD_*, n]``);
    interval publishing's rows grow with the span (idle time included), so the
    kernel keeps only each rank's changes (``recs``) and
    :func:`nb.expand_interval_nb` makes the rows from them, ``CHUNK_ROWS`` at a
    time: memory is bounded by the events and one chunk, whatever the span.
    """

    urls: list[str]
    n_rows: int
    rows: np.ndarray | None = None
    recs: np.ndarray | None = None
    order: np.ndarray | None = None
    phs: np.ndarray | None = None
    t0: int = 0
    publish_ns: int = 0
    rank_worker: np.ndarray | None = None
    rank_local: np.ndarray | None = None

    def _table(self, block: np.ndarray) -> pa.Table:
        return pa.table({
            "ts": pa.array(block[kl.LD_TS]),
            # decoded from a dictionary in C++: a million Python strings would dominate
            "worker": pa.DictionaryArray.from_arrays(
                pa.array(block[kl.LD_WORKER].astype(np.int32)), pa.array(self.urls, type=pa.string())
            ).dictionary_decode(),
            "dp_rank": pa.array(block[kl.LD_RANK]),
            "num_running_reqs": pa.array(block[kl.LD_RUNNING]),
            "num_waiting_reqs": pa.array(block[kl.LD_WAITING]),
            "num_tokens": pa.array(block[kl.LD_TOKENS]),
            "max_total_num_tokens": pa.array(block[kl.LD_MAXTOT]),
            "num_waiting_uncached_tokens": pa.array(block[kl.LD_WU]),
            "num_total_tokens": pa.array(block[kl.LD_TOTAL]),
            "max_running_requests": pa.array(block[kl.LD_MAXRUN]),
            "total_prefill_uncached_tokens": pa.array(block[kl.LD_PTOK]),
            "total_prefill_busy_us": pa.array(block[kl.LD_PBUSY]),
            "router_inflight": pa.array(block[kl.LD_INFLIGHT]),
        })

    def chunks(self, size: int = CHUNK_ROWS) -> Iterator[pa.Table]:
        """The rows in order, as tables of ``size`` rows (the last one shorter; one
        empty table when there is no row)."""
        if self.rows is not None:
            for lo in range(0, max(self.n_rows, 1), size):
                yield self._table(self.rows[:, lo:min(lo + size, self.n_rows)])
            return
        assert self.recs is not None and self.order is not None
        cur = np.zeros(self.order.shape[0], dtype=np.int64)
        p = 0
        for lo in range(0, max(self.n_rows, 1), size):
            hi = min(lo + size, self.n_rows)
            block = np.empty((kl.LD_NCOLS, hi - lo), dtype=np.int64)
            p = nb.expand_interval_nb(self.recs, self.order, self.phs, self.t0, self.publish_ns,
                                      self.rank_worker, self.rank_local, lo, hi, cur, p, block)
            t = self._table(block)
            del block
            yield t
            del t

    def table(self) -> pa.Table:
        """Every row in one table (memory grows with the rows: interval publishing's with the span)."""
        return pa.concat_tables(list(self.chunks()))


@dataclass
class SimResult:
    """One simulation: the per-request outcomes, the run statistics, and the trace tables.

    ``loads`` is made from ``load_rows`` on first use (with interval publishing its
    rows grow with the log's span, idle time included; writing them streams in chunks)."""

    config: RouterConfig
    tables: dict[str, pa.Table] = field(repr=False)
    load_rows: LoadRows
    summary: dict[str, Any]
    stats: dict[str, int]
    out_dir: Path | None = None
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    _frames: dict[str, pl.DataFrame] = field(default_factory=dict, repr=False)

    def _frame(self, name: str) -> pl.DataFrame:
        # made on first use: a grid's or plan's task reads only the summary
        if name not in self._frames:
            self._frames[name] = pl.from_arrow(self.load_rows.table() if name == names.LOADS
                                               else self.tables[name])
        return self._frames[name]

    @property
    def requests(self) -> pl.DataFrame:
        """``requests.parquet`` as a DataFrame."""
        return self._frame(names.REQUESTS)

    @property
    def workers(self) -> pl.DataFrame:
        """``workers.parquet`` as a DataFrame."""
        return self._frame(names.WORKERS)

    @property
    def outcomes(self) -> pl.DataFrame:
        """``outcomes.parquet`` as a DataFrame."""
        return self._frame(OUTCOMES)

    @property
    def loads(self) -> pl.DataFrame:
        """The load rows (``loads.parquet``) as a DataFrame."""
        return self._frame(names.LOADS)


LB_CODES = dict(zip(LOAD_BALANCE_METHODS, (kl.LB_ROUND_ROBIN, kl.LB_TOTAL_REQUESTS, kl.LB_TOTAL_TOKENS,
                                          kl.LB_BOOTSTRAP_ROOM, kl.LB_ROUTER, kl.LB_PREFIX_AFFINITY),
                    strict=True))


def kernel_inputs(log: RequestLog, fleet: Fleet, publish_ms: int, seed: int) -> dict:
    workers = fleet.workers
    nw = len(workers)
    fleet_ids = np.array(fleet.prefill, dtype=np.int64)
    if fleet_ids.size == 0:
        raise ReplayError("fleet: no prefill worker")
    in_fleet = np.zeros(nw, dtype=np.bool_)
    in_fleet[fleet_ids] = True
    dp = np.array([w.dp_size if w.role != "decode" else 0 for w in workers], dtype=np.int64)
    rank_off = np.zeros(nw + 1, dtype=np.int64)
    np.cumsum(dp, out=rank_off[1:])
    rw = np.repeat(np.arange(nw), dp)
    rank_local = np.arange(rw.shape[0], dtype=np.int64) - rank_off[rw]
    prefill_tps = np.array([workers[w].prefill_tokens_per_s for w in rw], dtype=np.float64)
    decode_ns = np.array([max(1, round(1e9 / workers[w].decode_tokens_per_s)) for w in rw],
                         dtype=np.int64)
    maxrun = np.array([workers[w].max_running_requests for w in rw], dtype=np.int64)
    cap = np.array([workers[w].max_total_num_tokens for w in rw], dtype=np.int64)
    publish_ns = int(publish_ms) * 1_000_000
    # publisher phases: seeded, fixed per rank
    phase = np.random.default_rng([int(seed), 0x5EED]).integers(0, max(publish_ns, 1), rank_off[-1])
    # Only a request's full blocks are cached (CAPTURE.md s.2: with page size > 1 an engine
    # publishes full pages only, so a trailing partial block never matches); its partial last
    # block, any input beyond its hashed blocks and its output are private to it.
    sizes = np.diff(log.hash_off)
    full = np.minimum(sizes, log.input_tokens // log.block_size).astype(np.int64)
    # Output KV grows one token per decode step (SGLang allocates it step by step).
    private = log.input_tokens - full * log.block_size
    need = log.input_tokens + log.output_tokens
    min_cap = int(cap[np.isin(rw, fleet_ids)].min())
    if need.size and int(need.max()) >= min_cap:
        i = int(np.argmax(need))
        raise ReplayError(f"request {i} needs {int(need[i])} KV tokens (input + output) and one "
                          f"spare, more than max_total_num_tokens {min_cap} of some rank; raise "
                          f"the capacity")
    heap_cap = min(log.n_blocks, log.n_requests) + 4096
    slope = np.array([max(0, round(workers[w].decode_step_ms_per_request * 1e6)) for w in rw],
                     dtype=np.int64)
    chunk = np.array([workers[w].chunked_prefill_size for w in rw], dtype=np.int64)
    policy = np.array([kl.POLICY_LPM if workers[w].schedule_policy == "lpm" else kl.POLICY_FCFS
                       for w in rw], dtype=np.int64)
    # new_token_ratio (SGLang's scheduler): initial min(0.7 x conservativeness, 1), floor
    # initial x 0.14, falling linearly to it over 600 decode steps; 1e-9 units
    sp = fleet.spec
    eng = np.zeros((rw.shape[0], kl.EN_NCOLS), dtype=np.int64)
    for r, w in enumerate(rw):
        ws = workers[w]
        init = min(sp.init_new_token_ratio * ws.schedule_conservativeness, 1.0)
        floor = init * sp.min_new_token_ratio_factor
        eng[r, kl.EN_MAXPF] = ws.max_prefill_tokens
        eng[r, kl.EN_NR_INIT] = round(init * kl.RATIO_ONE)
        eng[r, kl.EN_NR_MIN] = round(floor * kl.RATIO_ONE)
        eng[r, kl.EN_NR_DECAY] = round((init - floor) / sp.new_token_ratio_decay_steps * kl.RATIO_ONE)
        eng[r, kl.EN_MIXED] = int(ws.enable_mixed_chunk)
    dispatch = LB_CODES[sp.load_balance_method]
    most_cap = max((workers[w].max_total_num_tokens for w in rw), default=0)
    _check_cache_memory(int(rank_off[-1]), min(log.n_blocks, most_cap // max(int(log.block_size), 1)),
                        log.n_blocks, nw, heap_cap, dispatch == kl.LB_ROUTER)
    # "sglang" is on-change publishing at the engine's own moments (kernels.sim._publish_sgl)
    eng[:, kl.EN_PUB_SGL] = int(sp.publish_policy == "sglang")
    on_change = sp.publish_policy in ("on_change", "sglang")
    # REPLAY CHOICE: on-change samples are stamped 1 ms after the change (SGLang
    # throttles to every few scheduler steps; a recorder stamps receive time),
    # so a sample never shares its stamp with the arrival that caused it.
    pub_delay = (SGLANG_PUBLISH_DELAY_NS if sp.publish_policy == "sglang" else PUBLISH_DELAY_NS
                 ) if on_change else 0
    pub_idle = int(fleet.spec.idle_publish_ms) * 1_000_000
    # the router's snapshot uses dp_size 1 for decode peers (no samples, never fleet)
    dp_view = np.where(dp > 0, dp, 1).astype(np.int64)
    req = kl.SimRequests(
        ts=np.ascontiguousarray(log.ts_ns + START_NS, dtype=np.int64),
        input_tokens=np.ascontiguousarray(log.input_tokens, dtype=np.int64),
        output_tokens=np.ascontiguousarray(log.output_tokens, dtype=np.int64),
        private=np.ascontiguousarray(private, dtype=np.int64),
        full=np.ascontiguousarray(full, dtype=np.int64),
        h_off=np.ascontiguousarray(log.hash_off, dtype=np.int64),
        h_ids=np.ascontiguousarray(log.hash_ids, dtype=np.int64),
        btok=np.ascontiguousarray(log.block_tokens, dtype=np.int64),
        parent=np.ascontiguousarray(log.block_parent, dtype=np.int64),
        forced=np.full(log.n_requests, -1, dtype=np.int64))
    sim_fleet = kl.SimFleet(
        n_workers=nw, fleet=fleet_ids, in_fleet=in_fleet, dp_size=dp_view, rank_off=rank_off,
        prefill_tps=prefill_tps, decode_ns=decode_ns, decode_slope=slope, max_running=maxrun,
        capacity=cap, phase=phase.astype(np.int64), chunk=chunk, policy=policy, engine=eng,
        dispatch=int(dispatch), publish_ns=publish_ns, pub_delay=int(pub_delay),
        pub_idle=int(pub_idle), heap_cap=int(heap_cap))
    # the cache tables' size, the same for every config and seed of a batch on this log and fleet
    slots = nb.cache_slots(req, sim_fleet.capacity)
    return dict(req=req, fleet=sim_fleet, rank_worker=rw.astype(np.int64), rank_local=rank_local, slots=slots)


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _check_cache_memory(ranks: int, held: int, blocks: int, workers: int, heap_cap: int, by_rank: bool) -> None:
    """Refuse, before allocating it, a fleet whose caches and KV indexes for this log
    (``kernels.sim.sim_cache``: per rank a table of at least 4 slots of 20 bytes per block
    it can hold, ``held``, and two heaps of ``heap_cap`` int64; the router's index 4 bytes
    per prefix block of the log and worker, or rank) need more than this machine's memory:
    999 workers x dp 1,024 asked numpy for 32 GiB at once and ended in a traceback."""
    need = ranks * (80 * held + 16 * heap_cap) + 4 * blocks * workers + (4 * blocks * ranks if by_rank else 0)
    have = _physical_memory()
    if have is not None and need > have:
        raise ReplayError(f"fleet: {ranks:,} ranks would need {need / 2**30:,.1f} GiB of simulator caches for this "
                          f"log ({blocks:,} prefix blocks, {need / max(ranks, 1) / 1024:,.0f} KiB per rank), more "
                          f"than this machine's {have / 2**30:,.1f} GiB of memory; simulate fewer workers or ranks "
                          "per worker (--workers, --dp-size) or fewer requests (--requests)")


def _run_kernel(inputs: dict, config: RouterConfig, seed: int, freshness_ms: int, index_lag_ms: int,
                forced: np.ndarray | None = None, cache_log=None) -> kl.SimOutputs:
    enc = encode_configs([config])
    req = inputs["req"]
    if forced is not None:
        req = req._replace(forced=np.ascontiguousarray(forced, dtype=np.int64))
    with holding_signals():
        cache = nb.sim_cache(req, inputs["fleet"], int(index_lag_ms) * 1_000_000, inputs["slots"])
        return nb.simulate_nb(req, inputs["fleet"], cache, enc.knobs, int(seed), int(freshness_ms) * 1_000_000,
                              cache_log)  # None, or the optional store/eviction log (replay.capture.from_sim)


def _load_rows(fleet: Fleet, inputs: dict, out: kl.SimOutputs) -> LoadRows:
    """The load rows of a kernel run ``out``."""
    n_rows = int(out.n_rows)
    if inputs["fleet"].pub_delay > 0:  # on-change: the kernel wrote the rows
        return LoadRows(list(fleet.urls), n_rows, rows=out.loads)
    return LoadRows(list(fleet.urls), n_rows, recs=out.loads, order=out.order, phs=out.phs,
                    t0=int(out.t0), publish_ns=int(inputs["fleet"].publish_ns),
                    rank_worker=inputs["rank_worker"],
                    rank_local=inputs["rank_local"])


def _labels(codes: np.ndarray, names: Sequence[str]) -> pa.Array:
    """String column of ``names[code]`` (null where ``code < 0``), decoded from a dictionary
    in C++: a Python string per row would cost more than the simulation's kernel."""
    return pa.DictionaryArray.from_arrays(
        pa.array(codes.astype(np.int32), mask=codes < 0), pa.array(list(names), type=pa.string())
    ).dictionary_decode()


def _tables(log: RequestLog, fleet: Fleet, rq, m_off, m_w, m_b, inputs) -> tuple:
    n = log.n_requests

    def ms(a, b):
        ok = (a >= 0) & (b >= 0)
        return pa.array(np.where(ok, (a - b) / 1e6, np.nan), mask=~ok)

    ts = inputs["req"].ts
    qb = np.diff(log.hash_off)
    sel = rq[:, kl.RQ_WORKER]
    struct = pa.StructArray.from_arrays(
        [_labels(m_w, fleet.urls),
         pa.array(m_b, type=pa.int64())], names=["worker", "blocks"])
    matches = pa.ListArray.from_arrays(pa.array(m_off, type=pa.int32()), struct)
    sel_names = _labels(sel, fleet.urls)
    requests = pa.table({
        "ts": pa.array(ts, type=pa.int64()),
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "model": _labels(np.zeros(n, dtype=np.int64), [fleet.spec.model]),
        "input_tokens": pa.array(log.input_tokens.astype(np.int64)),
        "query_blocks": pa.array(qb.astype(np.int64)),
        "matches": matches,
        "best_prefix_blocks": pa.array(rq[:, kl.RQ_BEST]),
        "selected_worker": sel_names,
        # the optional closed-loop columns (traces/README.md), so a simulated trace
        # can be calibrated and simulated again
        "hash_ids": pa.ListArray.from_arrays(pa.array(log.hash_off, type=pa.int32()),
                                             pa.array(log.block_key[log.hash_ids], type=pa.int64())),
        "output_tokens": pa.array(log.output_tokens.astype(np.int64)),
        "cached_tokens": pa.array(rq[:, kl.RQ_CACHED_TOKENS], mask=sel < 0, type=pa.int64()),
        "ttft_ms": ms(rq[:, kl.RQ_FIRST], ts),
        "latency_ms": ms(np.where(sel >= 0, rq[:, kl.RQ_DONE], -1), ts),
    })
    workers = pa.table({
        "worker": pa.array(fleet.urls, type=pa.string()),
        "model": pa.array([w.model for w in fleet.workers], type=pa.string()),
        "role": pa.array([w.role for w in fleet.workers], type=pa.string()),
        "dp_size": pa.array([w.dp_size for w in fleet.workers], type=pa.int64()),
        "page_size": pa.array([log.block_size] * len(fleet.workers), type=pa.int64()),
    })

    arrive = ts
    outcomes = pa.table({
        "request_id": pa.array(np.arange(n, dtype=np.int64)),
        "worker": sel_names,
        "dp_rank": pa.array(np.where(rq[:, kl.RQ_RANK] >= 0,
                                     rq[:, kl.RQ_RANK] - inputs["fleet"].rank_off[np.maximum(sel, 0)], -1)),
        "input_tokens": pa.array(log.input_tokens.astype(np.int64)),
        "output_tokens": pa.array(log.output_tokens.astype(np.int64)),
        "cached_tokens": pa.array(np.maximum(rq[:, kl.RQ_CACHED_TOKENS], 0)),
        "cached_blocks": pa.array(np.maximum(rq[:, kl.RQ_CACHED_BLOCKS], 0)),
        "query_blocks": pa.array(qb.astype(np.int64)),
        "arrival_ts": pa.array(arrive),
        "admit_ts": pa.array(rq[:, kl.RQ_ADMIT]),
        "first_token_ts": pa.array(rq[:, kl.RQ_FIRST]),
        "completion_ts": pa.array(rq[:, kl.RQ_DONE]),
        "queue_wait_ms": ms(rq[:, kl.RQ_ADMIT], arrive),
        "ttft_ms": ms(rq[:, kl.RQ_FIRST], arrive),
        "latency_ms": ms(rq[:, kl.RQ_DONE], arrive),
        "reason": _labels(rq[:, kl.RQ_REASON], L_.REASONS),
        "decision": _labels(rq[:, kl.RQ_DECISION], L_.DECISIONS),
        "completions": pa.array(rq[:, kl.RQ_COMPLETIONS]),
    })
    if (rq[:, kl.RQ_REORG_OUTCOME] >= 0).any():   # a reorg config: the replay's own outcome labels
        outcomes = outcomes.append_column("reorg_outcome",
                                          _labels(rq[:, kl.RQ_REORG_OUTCOME], L_.REORG_OUTCOMES))
    return requests, workers, outcomes


def _summary(log: RequestLog, rq, outcomes: pa.Table, stats) -> dict[str, Any]:
    n = log.n_requests
    L = log.input_tokens.astype(np.int64)
    cached = np.maximum(rq[:, kl.RQ_CACHED_TOKENS], 0)
    ttft = outcomes["ttft_ms"].to_numpy(zero_copy_only=False)
    wait = outcomes["queue_wait_ms"].to_numpy(zero_copy_only=False)
    done = rq[:, kl.RQ_DONE]
    span_ns = int(done.max() - (log.ts_ns[0] + START_NS)) if n else 0

    def q(a, p):
        a = a[~np.isnan(a)]
        return float(np.percentile(a, p)) if a.size else None

    row: dict[str, Any] = {
        "requests": n,
        "routed": int((rq[:, kl.RQ_WORKER] >= 0).sum()),
        "failed": int((rq[:, kl.RQ_WORKER] < 0).sum()),
        "true_hit_rate": float(cached.sum() / L.sum()) if L.sum() else None,
        "block_hit_rate": (float(np.maximum(rq[:, kl.RQ_CACHED_BLOCKS], 0).sum() / log.hash_ids.size)
                           if log.hash_ids.size else None),
        "cold_prefill_tokens": int((L - cached).sum()),
        "ttft_ms_mean": float(np.nanmean(ttft)) if np.isfinite(ttft).any() else None,
        "ttft_ms_p50": q(ttft, 50),
        "ttft_ms_p99": q(ttft, 99),
        "queue_wait_ms_mean": float(np.nanmean(wait)) if np.isfinite(wait).any() else None,
        "queue_wait_ms_p50": q(wait, 50),
        "queue_wait_ms_p99": q(wait, 99),
        "makespan_s": span_ns / 1e9,
        "throughput_req_s": n / (span_ns / 1e9) if span_ns > 0 else None,
        "throughput_output_tok_s": (float(log.output_tokens.sum()) / (span_ns / 1e9)
                                    if span_ns > 0 else None),
        "evictions": int(stats[kl.SS_EVICTIONS]),
    }
    dec = rq[:, kl.RQ_DECISION]
    for code, name in enumerate(L_.DECISIONS):
        row[name] = int((dec == code).sum())
    reason = np.where(rq[:, kl.RQ_REORG_OUTCOME] >= 0, -1, rq[:, kl.RQ_REASON])  # reorg: no policy reason
    for code, name in enumerate(L_.POLICY_REASONS):
        pr = np.array([L_.reason_to_policy_reason(int(r)) if r >= 0 else -1 for r in range(7)])
        row[f"policy_{name}"] = int(np.isin(reason, np.nonzero(pr == code)[0]).sum())
    outcome = rq[:, kl.RQ_REORG_OUTCOME]
    for code, name in enumerate(L_.REORG_OUTCOMES):   # the replay's own labels of a reorg config
        row[f"reorg_{name}"] = int((outcome == code).sum())
    return row


def _write_parquet(table: pa.Table, path: Path) -> None:
    pq.write_table(table, path, **write_options(table.schema))


def interval_rows(log: RequestLog, fleet: Fleet, publish_interval_ms: int | None = None) -> int:
    """Load rows interval publishing writes for ``log`` (one per rank per interval over the
    span); 0 under on-change publishing, whose rows do not grow with idle time."""
    if fleet.spec.publish_policy != "interval" or not log.n_requests:
        return 0
    ms = publish_interval_ms or fleet.publish_interval_ms
    ranks = sum(w.dp_size for w in fleet.workers if w.role != "decode")
    return int(ranks * ((int(log.ts_ns[-1] - log.ts_ns[0]) // (ms * 1_000_000)) + 2))


def _check_knob_range(config: RouterConfig) -> None:
    """Refuse integer knobs beyond int64 (the kernels take int64 arrays): one line."""
    for k, v in config.as_dict().items():
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2**62:
            raise ReplayError(f"--{k.replace('_', '-')}: {v} is beyond the simulator's range "
                              "(< 2**62)")
        if isinstance(v, float) and not math.isfinite(v):
            raise ReplayError(f"--{k.replace('_', '-')}: must be finite, got {v}")


def _check_ms(name: str, v: int, lo: int) -> None:
    if not lo <= v <= MAX_MS:
        raise ParamError(name, f"must be in {lo}..{MAX_MS} (ms), got {v}")


def simulate(log: RequestLog, fleet: Fleet, config: RouterConfig | None = None,
             out_dir: str | os.PathLike | None = None, *, seed: int = 0,
             publish_interval_ms: int | None = None, index_lag_ms: int = 0,
             freshness_ms: int = 5000, force: bool = False, placement: np.ndarray | None = None,
             grid: Grid | None = None, _inputs: dict | None = None,
             cache_log: bool = False) -> SimResult:
    """Simulate ``log`` on ``fleet`` with the router deciding under ``config``.

    With ``out_dir``, writes ``requests.parquet``, ``loads.parquet``,
    ``workers.parquet`` (the trace ``sweep`` reads, with the optional
    closed-loop columns), ``outcomes.parquet``, ``trace.json`` (the router
    flags) and ``sim.json`` (parameters, summary, statistics), atomically.
    ``publish_interval_ms`` None takes the fleet's (default 100).
    ``placement`` (one fleet worker index per request, -1 = let the router
    decide) forces where requests go: validation against a recording.
    ``grid`` (the one-config grid it came from) puts its description, with
    any combinations the router refused, in ``sim.json``.  The result is a
    pure function of the arguments.  ``cache_log=True`` keeps every
    cache store and eviction per rank in ``result.extra["cache_log"]``
    (int64 rows ``(ts + index lag, worker, block, +/-(rank + 1))``).
    """
    config = config or RouterConfig()
    config.validate()
    _check_knob_range(config)
    if publish_interval_ms is None:
        publish_interval_ms = fleet.publish_interval_ms
    _check_ms("publish_interval_ms", publish_interval_ms, 1)
    _check_ms("index_lag_ms", index_lag_ms, 0)
    _check_ms("freshness_ms", freshness_ms, 0)
    if not 0 <= seed < 2**63:
        raise ParamError("seed", f"must be in 0..2**63-1, got {seed}")
    forced = None
    if placement is not None:
        forced = np.ascontiguousarray(placement, dtype=np.int64)
        if forced.shape != (log.n_requests,):
            raise ReplayError(f"placement has {forced.shape[0]} entries for {log.n_requests} requests")
        ok = (forced == -1) | np.isin(forced, np.array(fleet.prefill, dtype=np.int64))
        if not ok.all():
            i = int(np.argmin(ok))
            raise ReplayError(f"placement of request {i}: worker {int(forced[i])} is not a prefill "
                              f"worker of the fleet (0..{len(fleet.workers) - 1})")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        guard([(out, "sim")], force=force)
    t0 = time.perf_counter()
    inputs = _inputs or kernel_inputs(log, fleet, publish_interval_ms, seed)
    if not log.n_requests:
        raise ReplayError(f"{log.source}: the log has no request")
    log_list = None
    if cache_log:

        log_list = List.empty_list(types.int64)
    kout = _run_kernel(inputs, config, seed, freshness_ms, index_lag_ms, forced, log_list)
    rq, m_off, m_w, m_b, stats, rs = kout.rq, kout.m_off, kout.m_worker, kout.m_blocks, kout.stats, kout.rs
    seconds = time.perf_counter() - t0
    load_rows = _load_rows(fleet, inputs, kout)
    req_t, workers_t, out_t = _tables(log, fleet, rq, m_off, m_w, m_b, inputs)
    stat = {name.lower(): int(stats[getattr(kl, name)]) for name in dir(kl) if name.startswith("SS_")
            and name != "SS_NCOLS"}
    stat["max_kv_used_minus_capacity"] = int((rs[:, kl.RS_MAX_USED] - rs[:, kl.RS_CAP]).max())
    stat["max_queue_len"] = int(rs[:, kl.RS_MAX_QLEN].max())
    stat["load_rows"] = load_rows.n_rows
    summary = _summary(log, rq, out_t, stats)
    res = SimResult(config, {names.REQUESTS: req_t, names.WORKERS: workers_t, OUTCOMES: out_t}, load_rows,
                    summary, stat, out, seconds)
    if log_list is not None:
        res.extra["cache_log"] = int64_array_nb(log_list).reshape(-1, 4)
    if out is not None:
        meta = {"tool": names.SIM_TOOL, "version": __version__, "log": log.source,
                "requests": log.n_requests, "seed": int(seed),
                "publish_interval_ms": int(publish_interval_ms), "index_lag_ms": int(index_lag_ms),
                "freshness_ms": int(freshness_ms), "config": config.as_dict(),
                "fleet": fleet.describe(), "summary": summary, "stats": stat}
        if grid is not None:
            meta["grid"] = grid.describe()
        extra: dict = {"seed": int(seed), "freshness_ms": int(freshness_ms),
                       "publish_policy": fleet.spec.publish_policy,
                       "publish_interval_ms": int(publish_interval_ms),
                       "forced_placement": forced is not None}
        if log.partial_blocks_added:   # the log's full-blocks-only lists (replay.trace.blocks), for validate
            extra["log_hash_ids_full_blocks_only"] = int(log.partial_blocks_added)
        trace_info = {"source": f"router-replay simulate {log.source}", "page_size": int(log.block_size),
                      "router": config.given_flags(), "extra": extra}
        _write_dir(out, {names.REQUESTS: req_t, names.LOADS: load_rows,
                         names.WORKERS: workers_t, OUTCOMES: out_t}, meta,
                   {TRACE_JSON: trace_info})
    return res


def _write_chunks(rows: LoadRows, path: Path) -> None:
    """``rows`` written chunk by chunk: the bytes of ``_write_parquet`` of the whole table
    (each chunk is one row group of pyarrow's default length), in memory bounded by a chunk."""
    writer = None
    try:
        for t in rows.chunks(CHUNK_ROWS):
            if writer is None:
                writer = pq.ParquetWriter(path, t.schema, **write_options(t.schema))
            writer.write_table(t)
            del t
    finally:
        if writer is not None:
            writer.close()


def _write_dir(out: Path, tables: Mapping[str, pa.Table | LoadRows], meta: dict,
               extra_json: Mapping[str, dict] | None = None) -> None:
    with building(out) as tmp:
        # the load rows (the most to encode) on a thread of their own, beside the other
        # tables: pyarrow releases the GIL while it encodes, so two cores write both
        with ThreadPoolExecutor(max_workers=1) as ex:
            pending = [ex.submit(_write_chunks, t, tmp / name) for name, t in tables.items()
                       if isinstance(t, LoadRows)]
            for name, t in tables.items():
                if not isinstance(t, LoadRows):
                    _write_parquet(t, tmp / name)
            for f in pending:
                f.result()
        for name, obj in (extra_json or {}).items():
            (tmp / name).write_text(json.dumps(_nan_to_null(obj), indent=2, allow_nan=False, default=_json) + "\n")
        (tmp / SIM_JSON).write_text(json.dumps(_nan_to_null(meta), indent=2, allow_nan=False, default=_json) + "\n")


def _nan_to_null(v):
    """``v`` with every non-finite float as None (JSON null): a run where no request was served
    (``--max-in-flight 0``) has NaN latencies, which ``json.dumps`` passes to no ``default``."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Mapping):
        return {k: _nan_to_null(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_nan_to_null(x) for x in v]
    return v


def _json(v):
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    raise TypeError(type(v).__name__)


def write_summary(table: pl.DataFrame, path: Path) -> None:
    """A summary table as ``path`` (Parquet) and beside it as CSV (seed lists joined by commas)."""
    table.write_parquet(path)
    flat = table.with_columns([pl.col(c).cast(pl.List(pl.String)).list.join(",")
                               for c in ("seeds", "unstable_seeds") if c in table.columns])
    flat.write_csv(path.with_suffix(".csv"))


def summary_json(summary: dict[str, Any]) -> dict[str, Any]:
    """A simulation's summary as it reads back from JSON (a grid's journal): numpy scalars made
    plain, so a summary read back and one just made give the same tables."""
    return json.loads(json.dumps(summary, default=_json, allow_nan=True))


def grid_task(log: RequestLog, fleet: Fleet, config: RouterConfig, sub: str | None, seed: int,
              kw: dict, inputs: dict | None = None) -> dict[str, Any]:
    """One (config, seed) of a grid or plan, as a pool's task: the summary of :func:`simulate`
    (its trace written to ``sub``, whose parent is made)."""
    if sub is not None:
        Path(sub).parent.mkdir(parents=True, exist_ok=True)
    return simulate(log, fleet, config, sub, seed=seed, _inputs=inputs, **kw).summary
