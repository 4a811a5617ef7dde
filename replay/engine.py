"""The grid replay engine: a Trace and a list of configs in, decisions out, chunk by chunk.

This is the Python side of ``replay/kernels``: it encodes configs into flat
arrays, keeps the snapshot sweep's state between chunks, and hands each
chunk's decisions to a consumer.  ``decide_all`` returns the whole result in
the same form as ``reference.replay`` (for tests and small traces).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numba
import numpy as np

from .config import RouterConfig
from .fields import DECISION_FIELDS, empty_decisions
from .kernels import accumulate as kacc
from .kernels import grid as kgrid
from .kernels.snapshot import new_rank_table
from .trace import Trace

DEFAULT_FRESHNESS_NS = 5_000_000_000
# decisions held at once (requests x configs) before a chunk is handed on
DEFAULT_CHUNK_DECISIONS = 1 << 20


@dataclass
class EncodedConfigs:
    """Configs as kernel arrays, with the memo layout of kernels/grid.py."""

    cfg_i: np.ndarray      # int64[n, 9]: limit, floor, k, margin, guard, abs_tokens, min_tokens, cmin, cmax
    cfg_f: np.ndarray      # float64[n, 4]: abs_ms, rel, min_ratio, cratio
    group: np.ndarray      # int64[n]: index of the config's other knobs
    li: np.ndarray         # int64[n]: index into lim_vals
    fi: np.ndarray         # int64[n]: index into fl_vals
    lim_vals: np.ndarray   # int64: distinct limits (-1 = None)
    fl_vals: np.ndarray    # int64: distinct floors (-1 = None)
    n_groups: int
    parent: np.ndarray     # int64[n]: previous config of the same group and limit (accumulate.py)


def _int(v) -> int:
    return -1 if v is None else int(v)


def _float(v) -> float:
    return math.nan if v is None else float(v)


def encode_configs(configs: Sequence[RouterConfig]) -> EncodedConfigs:
    n = len(configs)
    cfg_i = np.zeros((n, 9), dtype=np.int64)
    cfg_f = np.zeros((n, 4), dtype=np.float64)
    groups: dict[tuple, int] = {}
    group = np.zeros(n, dtype=np.int64)
    lim_list: list[int] = []
    fl_list: list[int] = []
    li = np.zeros(n, dtype=np.int64)
    fi = np.zeros(n, dtype=np.int64)
    for c, cfg in enumerate(configs):
        row_i = (
            _int(cfg.worker_queue_limit), _int(cfg.saturation_queue_floor), int(cfg.min_load_choices),
            int(cfg.cache_switch_margin_tokens), int(bool(cfg.pressure_guard)),
            int(cfg.pressure_abs_threshold_tokens), _int(cfg.cache_affinity_min_matched_tokens),
            int(cfg.cache_candidate_min_workers), int(cfg.cache_candidate_max_workers),
        )
        row_f = (
            _float(cfg.pressure_abs_threshold_ms), float(cfg.pressure_rel_threshold),
            _float(cfg.cache_affinity_min_match_ratio), float(cfg.cache_candidate_ratio),
        )
        cfg_i[c] = row_i
        cfg_f[c] = row_f
        other = (row_i[2:], tuple("nan" if math.isnan(x) else x for x in row_f))
        group[c] = groups.setdefault(other, len(groups))
        if row_i[0] not in lim_list:
            lim_list.append(row_i[0])
        if row_i[1] not in fl_list:
            fl_list.append(row_i[1])
        li[c] = lim_list.index(row_i[0])
        fi[c] = fl_list.index(row_i[1])
    # parent: the previous config of the same group and limit (configs differing
    # only in the floor, in canonical order), so a chain of floors shares one
    # booking wherever neighbouring floors decide alike
    last: dict[tuple[int, int], int] = {}
    parent = np.arange(n, dtype=np.int64)
    for c in range(n):
        key = (int(group[c]), int(li[c]))
        if key in last:
            parent[c] = last[key]
        last[key] = c
    return EncodedConfigs(cfg_i, cfg_f, group, li, fi, np.array(lim_list or [-1], dtype=np.int64),
                          np.array(fl_list or [-1], dtype=np.int64), max(len(groups), 1), parent)


@dataclass
class Chunk:
    """Decisions of requests ``start..stop`` (sorted trace order) under every config.

    ``out_i``/``out_f`` are None when the run keeps no decisions.
    """

    start: int
    stop: int
    out_i: np.ndarray | None  # int64[O_NCOLS, stop-start, n_configs] (one contiguous block per column)
    out_f: np.ndarray | None  # float64[stop-start, n_configs]: selected_queue_ms
    # per request, config-independent: the fleet readings of replay/fleet.py
    fleet_min: np.ndarray | None = None    # int64: smallest fresh waiting count, -1 = none
    fleet_fresh: np.ndarray | None = None  # int64: fleet workers with a fresh reading


class Totals:
    """Per-config accumulators of a run (kernels/accumulate.py), one slice per thread block.

    Every field is a count, a sum or a fixed-bucket histogram, so blocks,
    chunks and shards merge exactly; :meth:`merged` folds the blocks.
    """

    def __init__(self, n_blocks: int, n_configs: int, parent: np.ndarray | None = None):
        # children are booked relative to their parent config (kernels/accumulate.py)
        self.parent = (np.arange(n_configs, dtype=np.int64) if parent is None
                       else np.asarray(parent, dtype=np.int64))
        self.acc = np.zeros((n_blocks, kacc.N_ACC, n_configs), dtype=np.int64)
        self.hist_wait = np.zeros((n_blocks, kacc.WAIT_HIST, n_configs), dtype=np.int64)
        self.hist_div = np.zeros((n_blocks, kacc.N_DIV, n_configs), dtype=np.int64)
        # work done: distinct outcomes computed, domain-rung evaluations
        self.stats = np.zeros((n_blocks, 2), dtype=np.int64)

    def add(self, other: "Totals") -> None:
        """Fold another run's totals (same configs) into this one (both made absolute)."""
        mine, theirs = self.merged(), other.merged()
        self.parent = mine.parent
        self.acc = mine.acc + theirs.acc
        self.hist_wait = mine.hist_wait + theirs.hist_wait
        self.hist_div = mine.hist_div + theirs.hist_div
        self.stats = mine.stats + theirs.stats

    def merged(self) -> "Totals":
        """A one-block Totals holding the exact (integer) sum over blocks, with
        every config's totals absolute (children folded onto their parents)."""
        out = Totals(1, self.acc.shape[2])
        out.acc[0] = self.acc.sum(axis=0)
        out.hist_wait[0] = self.hist_wait.sum(axis=0)
        out.hist_div[0] = self.hist_div.sum(axis=0)
        out.stats[0] = self.stats.sum(axis=0)
        kacc.fold_parents(out.acc[0], out.hist_wait[0], out.hist_div[0], self.parent)
        return out


def fleet_tables(trace: Trace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_models = max(len(trace.models), 1)
    offs = [0]
    members: list[np.ndarray] = []
    in_fleet = np.zeros((n_models, max(trace.n_workers, 1)), dtype=np.bool_)
    for m in range(n_models):
        f = np.asarray(trace.fleet(m), dtype=np.int64)
        members.append(f)
        in_fleet[m, f] = True
        offs.append(offs[-1] + len(f))
    fleet_w = np.concatenate(members) if members else np.zeros(0, dtype=np.int64)
    return np.array(offs, dtype=np.int64), fleet_w.astype(np.int64), in_fleet


def load_columns(trace: Trace) -> tuple[np.ndarray, ...]:
    """The load samples as the argument tuple of ``snapshot.advance_dirty_nb`` (ts .. inflight)."""
    cols = (trace.load_ts, trace.load_worker, trace.load_rank, trace.load_running,
            trace.load_waiting, trace.load_num_tokens, trace.load_max_total, trace.load_has_tail,
            trace.load_waiting_uncached, trace.load_total_tokens, trace.load_max_running,
            trace.load_prefill_tokens, trace.load_prefill_busy_us, trace.load_router_inflight)
    return tuple(np.ascontiguousarray(a, dtype=np.bool_ if a.dtype == np.bool_ else np.int64)
                 for a in cols)


def dp_sizes(trace: Trace) -> np.ndarray:
    """int64 dp_size per worker id (0 = use the ranks observed so far)."""
    n_w = max(trace.n_workers, 1)
    dp = np.zeros(n_w, dtype=np.int64)
    dp[:trace.worker_dp_size.shape[0]] = trace.worker_dp_size
    return dp


def n_rank_slots(trace: Trace) -> int:
    """Rank slots of the per-rank table: a worker with a known dp_size needs
    dp_size of them (samples of higher ranks are ignored before the table is
    touched); a worker without one, its highest observed rank + 1."""
    dp = int(trace.worker_dp_size.max()) if trace.worker_dp_size.size else 0
    top = 0
    if trace.load_rank.size:
        unknown = trace.worker_dp_size[trace.load_worker] <= 0
        if unknown.any():
            top = int(trace.load_rank[unknown].max()) + 1
    return max(top, dp, 1)


# Requests a chunk holds when no decisions are kept (bookkeeping only).
CHUNK_REQUESTS = 1 << 17


def _blocks_per_chunk(threads: int | None) -> int:
    n = threads if threads is not None else numba.get_num_threads()
    return max(1, 2 * int(n))


def iter_chunks(trace: Trace, configs: Sequence[RouterConfig], *, seed: int = 0,
                freshness_ns: int = DEFAULT_FRESHNESS_NS,
                chunk_decisions: int = DEFAULT_CHUNK_DECISIONS,
                threads: int | None = None, keep: bool = True, totals: Totals | None = None,
                blocks: int | None = None,
                progress: Callable[[int], None] | None = None) -> Iterator[Chunk]:
    """Replay the trace under every config; yield decisions chunk by chunk, in request order.

    With ``keep`` each chunk carries every decision (``out_i``/``out_f``);
    without it the chunks are bookkeeping only.  With ``totals`` (made by
    :func:`new_totals`), the per-config accumulators are filled as well.
    Each chunk is split into ``blocks`` slices (default: two per thread), each
    replayed by one thread from its own exact copy of the load state, so no
    result depends on threads, chunk or block sizes.
    ``progress(n)`` is called with the number of requests finished after each chunk.
    """
    if not configs:
        return
    enc = encode_configs(configs)
    n_cfg = len(configs)
    n_req = trace.n_requests
    n_w = max(trace.n_workers, 1)
    chunk = max(1, chunk_decisions // n_cfg) if keep else CHUNK_REQUESTS
    if threads is not None:
        numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    blocks_per_chunk = max(1, int(blocks)) if blocks is not None else _blocks_per_chunk(threads)
    fleet_off, fleet_w, in_fleet = fleet_tables(trace)
    table, inflight = new_rank_table(n_w, n_rank_slots(trace))
    dp = dp_sizes(trace)
    m_off = trace.match_offsets.astype(np.int64)
    m_worker = trace.match_worker.astype(np.int64)
    m_blocks = trace.match_blocks.astype(np.int64)
    sizes = np.diff(m_off)
    max_matches = int(sizes.max()) if sizes.size else 0
    loads = load_columns(trace)
    req = (np.ascontiguousarray(trace.req_ts, dtype=np.int64),
           np.ascontiguousarray(trace.req_index, dtype=np.int64),
           np.ascontiguousarray(trace.req_input_tokens, dtype=np.int64),
           np.ascontiguousarray(trace.req_query_blocks, dtype=np.int64),
           np.ascontiguousarray(trace.req_best_prefix_blocks, dtype=np.int64),
           np.ascontiguousarray(trace.req_model, dtype=np.int64))
    selected = (np.ascontiguousarray(trace.req_selected_worker, dtype=np.int64)
                if trace.req_selected_worker is not None else None)
    if totals is None:
        totals = Totals(blocks_per_chunk, n_cfg)
    if totals.acc[:, :, :].any() and not (totals.parent == enc.parent).all():
        raise ValueError("totals were filled for configs in another order")
    totals.parent = enc.parent
    if totals.acc.shape[0] < blocks_per_chunk:
        raise ValueError("totals has fewer block slots than a chunk has blocks")
    tables = np.zeros((blocks_per_chunk,) + table.shape, dtype=np.int64)
    inflights = np.zeros((blocks_per_chunk, n_w), dtype=np.int64)
    ptrs = np.zeros(blocks_per_chunk, dtype=np.int64)
    empty_sel = np.zeros(0, dtype=np.int64)
    dummy_i = np.zeros((kgrid.O_NCOLS, 1, n_cfg), dtype=np.int64)
    dummy_f = np.zeros((1, n_cfg), dtype=np.float64)
    ptr = 0
    for start in range(0, n_req, chunk):
        stop = min(n_req, start + chunk)
        n = stop - start
        block = -(-n // blocks_per_chunk)
        lo = np.arange(0, n, block, dtype=np.int64)
        nb = lo.shape[0]
        block_lo = np.append(lo, n).astype(np.int64)
        ptr = kgrid.split_states_nb(ptr, req[0][start:stop][lo], *loads, dp, table, inflight,
                                    tables[:nb], inflights[:nb], ptrs[:nb])
        if keep:
            out_i = np.empty((kgrid.O_NCOLS, n, n_cfg), dtype=np.int64)
            out_f = np.empty((n, n_cfg), dtype=np.float64)
        else:
            out_i, out_f = dummy_i, dummy_f
        fl_min = np.empty(n, dtype=np.int64)
        fl_fresh = np.empty(n, dtype=np.int64)
        a, b = m_off[start], m_off[stop]
        kgrid.run_chunk_nb(
            block_lo, ptrs[:nb], tables[:nb], inflights[:nb],
            *(col[start:stop] for col in req),
            selected[start:stop] if selected is not None else empty_sel,
            m_off[start:stop + 1] - a, m_worker[a:b], m_blocks[a:b], in_fleet, fleet_off, fleet_w,
            *loads, dp, int(freshness_ns), enc.cfg_i, enc.cfg_f, enc.group, enc.li, enc.fi,
            enc.lim_vals, enc.fl_vals, enc.n_groups, enc.parent, int(seed), max_matches, keep,
            out_i, out_f, fl_min, fl_fresh,
            totals.acc[:nb], totals.hist_wait[:nb], totals.hist_div[:nb], totals.stats[:nb])
        # the next chunk starts where the last block ended
        table[...] = tables[nb - 1]
        inflight[...] = inflights[nb - 1]
        ptr = int(ptrs[nb - 1])
        if progress is not None:
            progress(n)
        yield Chunk(start, stop, out_i if keep else None, out_f if keep else None, fl_min, fl_fresh)


def chunk_readings(mins: list, fresh: list) -> tuple[np.ndarray, np.ndarray]:
    """A trace's per-request fleet readings ``(min_waiting, fresh_workers)``
    (``replay/fleet.py``) from its chunks' ``fleet_min``/``fleet_fresh``."""
    if not mins:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return np.concatenate(mins), np.concatenate(fresh).astype(np.int32)


def new_totals(n_configs: int, *, threads: int | None = None, blocks: int | None = None) -> Totals:
    """Accumulators sized for ``iter_chunks`` with the same ``threads``/``blocks``."""
    n = max(1, int(blocks)) if blocks is not None else _blocks_per_chunk(threads)
    return Totals(n, n_configs)


# kernel column -> decision field name (fields.py order); selected_queue_ms comes from out_f
_COLUMN_OF_FIELD = {
    "worker": kgrid.O_WORKER, "reason": kgrid.O_REASON, "policy_reason": kgrid.O_POLICY_REASON,
    "decision": kgrid.O_DECISION, "failure": kgrid.O_FAILURE, "matched_blocks": kgrid.O_MATCHED,
    "selected_blocks": kgrid.O_SELECTED_BLOCKS, "uncached_tokens": kgrid.O_UNCACHED,
    "gate_rejected": kgrid.O_GATE_REJECTED, "admission_evaluated": kgrid.O_EVALUATED,
    "admission_rejected": kgrid.O_ADM_REJECTED, "best_rejected_blocks": kgrid.O_BEST_REJECTED,
    "fleet_all_queued": kgrid.O_ALL_QUEUED, "fell_back": kgrid.O_FELL_BACK,
    "guard_compared": kgrid.O_COMPARED, "guard_overrides": kgrid.O_OVERRIDES,
    "pressure_source": kgrid.O_SOURCE, "selected_waiting": kgrid.O_SEL_WAITING,
    "selected_waiting_uncached": kgrid.O_SEL_WU,
}


def chunk_fields(ch: Chunk) -> dict[str, np.ndarray]:
    """A chunk's decisions as the typed per-field arrays of fields.py, shape (n, n_configs)."""
    out = {}
    for name, dtype, _null, _doc in DECISION_FIELDS:
        if name == "selected_queue_ms":
            out[name] = ch.out_f.astype(dtype, copy=True)
        else:
            out[name] = ch.out_i[_COLUMN_OF_FIELD[name]].astype(dtype)
    return out


def decide_all(trace: Trace, configs: Sequence[RouterConfig], *, seed: int = 0,
               freshness_ns: int = DEFAULT_FRESHNESS_NS, **kw) -> dict[str, np.ndarray]:
    """Every decision of the trace under every config, as one dict of (n_requests, n_configs) arrays.

    Same form as ``reference.replay``; meant for tests and small traces (the
    sweep streams chunks instead).
    """
    result = empty_decisions(trace.n_requests, len(configs))
    for ch in iter_chunks(trace, configs, seed=seed, freshness_ns=freshness_ns, **kw):
        for name, arr in chunk_fields(ch).items():
            result[name][ch.start:ch.stop] = arr
    return result


def default_threads() -> int:
    return int(os.environ.get("NUMBA_NUM_THREADS", numba.config.NUMBA_NUM_THREADS))
