"""The grid replay engine: a Trace and a list of configs in, decisions out, chunk by chunk.

This is the Python side of ``replay/kernels``: it encodes configs into flat
arrays, keeps the snapshot sweep's state between chunks, and hands each
chunk's decisions to a consumer.  ``decide_all`` returns the whole result in
the same form as ``reference.replay`` (for tests and small traces).
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numba
import numpy as np

from replay import labels
from replay.config import KNOBS, RouterConfig
from replay.fields import DECISION_FIELDS, empty_decisions
from replay.kernels import accumulate as kacc
from replay.kernels import layout, one_pass, warm
from replay.kernels.snapshot import new_rank_table
from replay.trace import Trace

DEFAULT_FRESHNESS_NS = 5_000_000_000
# decisions held at once (requests x configs) before a chunk is handed on
DEFAULT_CHUNK_DECISIONS = 1 << 20


@dataclass
class EncodedConfigs:
    """Configs as kernel arrays (``kernels/layout.py``): one array per knob, and
    the grid pass's sharing plan (groups, limit and floor classes, parents)."""

    knobs: layout.KnobArrays
    plan: layout.GridPlan


def encode_configs(configs: Sequence[RouterConfig]) -> EncodedConfigs:
    rows = [cfg.as_dict() for cfg in configs]
    knobs = layout.knob_arrays(rows)
    n = len(rows)
    groups: dict[tuple, int] = {}
    group = np.zeros(n, dtype=np.int64)
    lim_list: list[int] = []
    fl_list: list[int] = []
    li = np.zeros(n, dtype=np.int64)
    fi = np.zeros(n, dtype=np.int64)
    limits = knobs.worker_queue_limit
    floors = knobs.saturation_queue_floor
    for c in range(n):
        # NaN != NaN: a None float knob keys as the string "nan"
        other = tuple("nan" if isinstance(x, float) and math.isnan(x) else x
                      for x in (getattr(knobs, k)[c].item() for k in layout.GROUP_KNOBS))
        group[c] = groups.setdefault(other, len(groups))
        lim, fl = int(limits[c]), int(floors[c])
        if lim not in lim_list:
            lim_list.append(lim)
        if fl not in fl_list:
            fl_list.append(fl)
        li[c] = lim_list.index(lim)
        fi[c] = fl_list.index(fl)
    # parent: the previous config of the same group and limit (configs differing
    # only in the floor, in canonical order), so a chain of floors shares one
    # booking wherever neighbouring floors decide alike; the first config of a
    # limit hangs off the first config of the group's previous limit, so
    # neighbouring limits that decide alike share one booking too
    last: dict[tuple[int, int], int] = {}
    first_of_group: dict[int, int] = {}
    parent = np.arange(n, dtype=np.int64)
    for c in range(n):
        key = (int(group[c]), int(li[c]))
        if key in last:
            parent[c] = last[key]
        else:
            parent[c] = first_of_group.get(key[0], c)
            first_of_group[key[0]] = c
        last[key] = c
    per_worker = bool((knobs.variant_floor_scaling
                       == KNOBS["variant_floor_scaling"].choices.index("per-worker")).any())
    plan = layout.GridPlan(group, li, fi, np.array(lim_list or [-1], dtype=np.int64),
                           np.array(fl_list or [-1], dtype=np.int64), parent, max(len(groups), 1),
                           per_worker)
    return EncodedConfigs(knobs, plan)


@dataclass
class Chunk:
    """Decisions of requests ``start..stop`` (sorted trace order) under every config.

    ``out_i``/``out_f`` are None when the run keeps no decisions.
    """

    start: int
    stop: int
    # int64[O_NCOLS, stop-start, n_configs] (kernels/layout.py O_*; one contiguous block per column)
    out_i: np.ndarray | None
    out_f: np.ndarray | None  # float64[F_NCOLS, stop-start, n_configs] (layout.F_*)
    # per request, config-independent: the fleet readings of replay/sweep/readings.py
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
        # config-major for the kernel (one booking touches one config's row); ``acc`` is the
        # [block, ACC_*, config] view every reader uses
        self._acc = np.zeros((n_blocks, n_configs, layout.N_ACC), dtype=np.int64)
        self.hist_wait = np.zeros((n_blocks, layout.WAIT_HIST, n_configs), dtype=np.int64)
        self.hist_div = np.zeros((n_blocks, layout.N_DIV, n_configs), dtype=np.int64)
        # work done: cache-rung evaluations, domain-rung evaluations
        self.stats = np.zeros((n_blocks, 2), dtype=np.int64)

    @property
    def acc(self) -> np.ndarray:
        """Counts and sums, ``[block, ACC_*, config]`` (a view: writes go through)."""
        return np.swapaxes(self._acc, 1, 2)

    @acc.setter
    def acc(self, value: np.ndarray) -> None:
        self._acc = np.ascontiguousarray(np.swapaxes(value, 1, 2))

    def add(self, other: Totals) -> None:
        """Fold another run's totals (same configs) into this one (both made absolute)."""
        mine, theirs = self.merged(), other.merged()
        self.parent = mine.parent
        self.acc = mine.acc + theirs.acc
        self.hist_wait = mine.hist_wait + theirs.hist_wait
        self.hist_div = mine.hist_div + theirs.hist_div
        self.stats = mine.stats + theirs.stats

    def merged(self) -> Totals:
        """A one-block Totals holding the exact (integer) sum over blocks, with
        every config's totals absolute (children folded onto their parents)."""
        out = Totals(1, self._acc.shape[1])
        out.acc[0] = self.acc.sum(axis=0)
        out.hist_wait[0] = self.hist_wait.sum(axis=0)
        out.hist_div[0] = self.hist_div.sum(axis=0)
        out.stats[0] = self.stats.sum(axis=0)
        kacc.fold_parents(out.acc[0], out.hist_wait[0], out.hist_div[0], self.parent)
        return out


def fleet_tables(trace: Trace) -> layout.Fleets:
    """Every model's routable fleet as ``layout.Fleets``."""
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
    plain = np.ones(max(trace.n_workers, 1), dtype=np.bool_)
    if trace.has_workers_table:
        plain[:trace.n_workers] = np.asarray(trace.worker_role) == labels.ROLE_PLAIN
    return layout.Fleets(np.array(offs, dtype=np.int64), fleet_w.astype(np.int64), in_fleet, plain)


def load_columns(trace: Trace) -> layout.LoadColumns:
    """The load samples as ``layout.LoadColumns`` (``Trace.load_<field>``)."""
    return layout.LoadColumns(*(
        np.ascontiguousarray(getattr(trace, "load_" + name),
                             dtype=np.bool_ if name == "has_tail" else np.int64)
        for name in layout.LoadColumns._fields))


def request_columns(trace: Trace) -> layout.Requests:
    """The requests as ``layout.Requests`` (``selected_worker`` empty when the trace has none)."""
    sel = trace.req_selected_worker
    return layout.Requests(*(
        np.zeros(0, dtype=np.int64) if name == "selected_worker" and sel is None
        else np.ascontiguousarray(getattr(trace, "req_" + name), dtype=np.int64)
        for name in layout.Requests._fields))


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
    # (when every worker's dp_size is known, no sample needs looking at)
    if trace.load_rank.size and (trace.worker_dp_size <= 0).any():
        unknown = trace.worker_dp_size[trace.load_worker] <= 0
        if unknown.any():
            top = int(trace.load_rank[unknown].max()) + 1
    return max(top, dp, 1)


# Requests a chunk holds when no decisions are kept (bookkeeping only).
CHUNK_REQUESTS = 1 << 17


# Blocks per thread x configs a thread's accumulators hold at most (each block
# keeps about 33 KB per config: counters and a 4096-bucket queue histogram)
BLOCK_CONFIGS_PER_THREAD = 4_000


def blocks_per_thread(n_configs: int) -> int:
    """Blocks a chunk gives each thread: eight for grids of up to 500 configs,
    fewer for larger ones (at most :data:`BLOCK_CONFIGS_PER_THREAD` block-configs,
    about 130 MB a thread), never fewer than two.

    A chunk ends when its slowest block does, and a block's cost follows the
    fleet's load (up to 2x between parts of the bench trace), so smaller blocks
    lose less at a chunk's end.  152 configs on 2 threads, M decisions/s: two per
    thread 48-53, four 56-57 (one series); four against eight, 8 alternating
    rounds, medians 58.0 against 61.5 (second speed round).
    """
    return max(2, min(8, BLOCK_CONFIGS_PER_THREAD // max(1, int(n_configs))))


def kernel_threads(threads: int | None) -> int:
    """The kernel threads a replay asked for ``threads`` runs: numba runs at most
    ``NUMBA_NUM_THREADS`` (more would only size counters for threads that never run)."""
    n = threads if threads is not None else numba.get_num_threads()
    return max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))


def _blocks_per_chunk(threads: int | None, n_configs: int) -> int:
    return max(1, blocks_per_thread(n_configs) * kernel_threads(threads))


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (no copy)."""
    v = a.view()
    v.flags.writeable = False
    return v


def frozen(columns):
    """A ``kernels/layout.py`` tuple with every array a read-only view.

    numba compiles a kernel once per argument *type*, and a read-only array
    is another type than a writable one: the loader hands over some columns
    zero-copy from Arrow (read-only) and others converted, and which ones
    differ from trace to trace (the bundled sample and the 1M bench trace
    differed in 10 of 14 load columns), so each trace layout compiled the
    grid kernel again (half a minute).  Every kernel input is passed
    read-only, whatever the loader did.
    """
    return type(columns)(*(readonly(x) if isinstance(x, np.ndarray) else x for x in columns))


def _block_pool(n_threads: int) -> ThreadPoolExecutor | None:
    """The threads that replay a chunk's blocks (None: one thread, the caller's)."""
    if n_threads <= 1:
        return None
    global _POOL
    if _POOL is None or _POOL[0] != n_threads:
        _POOL = (n_threads, ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="replay-block"))
    return _POOL[1]


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def close_block_pool() -> None:
    """Join the block threads (idle once a replay has returned), so a finished command's
    process holds no thread of ours and may end without the interpreter's teardown."""
    global _POOL
    if _POOL is not None:
        _POOL[1].shutdown(wait=True)
        _POOL = None


def start_blocks(pool: ThreadPoolExecutor | None, nb: int, blocks: layout.BlockStates, req, matches,
                 fleets, loads, dp, freshness_ns: int, knobs, plan, seed: int, max_matches: int,
                 keep: bool, out: layout.Outputs, totals: layout.Accumulators, slots: queue.SimpleQueue,
                 link: np.ndarray, scratch: Callable[[], tuple]) -> list[Future]:
    """``one_pass.run_chunk_nb`` on each of a chunk's ``nb`` blocks, on ``pool``'s
    threads; returns their futures (with no pool: runs them here, and returns none).

    The kernel is plain ``njit`` with ``nogil`` (not numba's ``parallel=True``,
    whose compile took a quarter of a first start's): each call gets one
    block's one-row slices of the block states, and one slot of the
    accumulators, taken from ``slots`` (indices into ``totals``) for the
    call and given back after it, so no two running blocks share a slot.  The
    accumulators are counts and sums, merged over slots at the end, so which
    slot a block books into changes no total.  Every call has the same
    argument types, so there is one specialization.  ``scratch()`` makes a
    block's fresh working memory (``one_pass.new_scratch``).
    """
    def one(k: int) -> None:
        sc, snapshot = scratch()
        j = slots.get()
        try:
            one_pass.run_chunk_nb(
                layout.BlockStates(blocks.lo[k:k + 2], blocks.ptrs[k:k + 1], blocks.tables[k:k + 1],
                                   blocks.inflights[k:k + 1]),
                req, matches, fleets, loads, dp, freshness_ns, knobs, plan, seed, max_matches, keep, out,
                layout.Accumulators(totals.acc[j:j + 1], totals.hist_wait[j:j + 1], totals.hist_div[j:j + 1],
                                    totals.stats[j:j + 1]), link, sc, snapshot)
        finally:
            slots.put(j)

    if pool is None:
        for k in range(nb):
            one(k)
        return []
    return [pool.submit(one, k) for k in range(nb)]


def wait_all(futures: list[Future]) -> None:
    """Wait for every future, then raise the first one's error, if any."""
    wait(futures)
    for f in futures:
        f.result()


def kernel_signatures() -> dict:
    """The one argument-type signature of each kernel a sweep calls, ``{dispatcher: types}``.

    Built from tiny arrays of the types :func:`iter_chunks` passes (inputs
    :func:`frozen`, state and outputs writable), so the kernels can be compiled
    (or loaded from numba's cache) before any trace is read.
    ``tests/test_compile.py`` holds a sweep to exactly these signatures.
    """
    i64 = readonly(np.zeros(1, dtype=np.int64))
    loads = layout.LoadColumns(*(readonly(np.zeros(1, dtype=np.bool_ if name == "has_tail" else np.int64))
                                 for name in layout.LoadColumns._fields))
    enc = encode_configs([RouterConfig()])
    table, inflight = new_rank_table(1, 1)
    tables = np.zeros((1,) + table.shape, dtype=np.int64)
    inflights = np.zeros((1, 1), dtype=np.int64)
    ptrs = np.zeros(1, dtype=np.int64)
    totals = Totals(1, 1)
    split_args = (0, i64, loads, i64, table, inflight, tables, inflights, ptrs)
    run_args = (
        layout.BlockStates(np.zeros(2, dtype=np.int64), ptrs, tables, inflights),
        layout.Requests(*(i64 for _ in layout.Requests._fields)), layout.Matches(i64, i64, i64),
        layout.Fleets(i64, i64, readonly(np.zeros((1, 1), dtype=np.bool_)), readonly(np.zeros(1, dtype=np.bool_))),
        loads, i64, 0,
        frozen(enc.knobs), frozen(enc.plan), 0, 0, False,
        layout.Outputs(np.zeros((layout.O_NCOLS, 1, 1), dtype=np.int64),
                       np.zeros((layout.F_NCOLS, 1, 1), dtype=np.float64),
                       np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)),
        layout.Accumulators(totals._acc, totals.hist_wait, totals.hist_div, totals.stats),
        readonly(np.zeros(2, dtype=np.int64)),
        *one_pass.new_scratch(enc.plan, 1, 1, 1, one_pass.config_runs(enc.plan)))
    return {one_pass.split_states_nb: tuple(numba.typeof(a) for a in split_args),
            one_pass.run_chunk_nb: tuple(numba.typeof(a) for a in run_args)}


def kernels_cold() -> bool:
    """True when the grid kernel is not in numba's on-disk cache (a first start compiles)."""
    return warm.cache_is_cold(one_pass.run_chunk_nb)


def compile_kernels() -> None:
    """Compile (or load from the cache) the kernels a sweep calls, for the
    signatures of :func:`kernel_signatures`.

    On a cold cache the compile uses both cores (``kernels/warm.py``): another
    process compiles ``_decide_request``'s tree into the cache while this one
    compiles its own part first, then the kernels (the grid kernel calls
    ``_decide_request`` through its address, so neither waits for the other),
    and last loads the other process's part from the cache and links it
    (:func:`decide_link`).
    """
    sigs = kernel_signatures()
    with warm.both_cores(sigs) as first:
        for dispatcher, sig, done in first:
            try:
                dispatcher.compile(sig)
            except Exception:  # noqa: BLE001 - a helper's signature drifted: the kernel compiles what it needs
                pass
            finally:
                done(dispatcher)
        # the grid kernel first (the other process meanwhile compiles _decide_request's tree)
        for dispatcher in sorted(sigs, key=lambda d: d is not one_pass.run_chunk_nb):
            warm.wait_for(dispatcher)
            dispatcher.compile(sigs[dispatcher])
        warm.link(sigs[one_pass.run_chunk_nb])


def decide_link() -> np.ndarray:
    """The grid kernel's ``link`` argument (``kernels/warm.py``: ``_decide_request``
    compiled or loaded, its address and signature), after the background
    compile if one is running (it links it, with the compile child's help)."""
    global _RUN_SIG
    thread = _BACKGROUND
    if thread is not None and thread is not threading.current_thread():
        thread.join()
    if _RUN_SIG is None:
        _RUN_SIG = kernel_signatures()[one_pass.run_chunk_nb]
    return warm.link(_RUN_SIG)


_RUN_SIG: tuple | None = None


def compile_in_background() -> threading.Thread:
    """:func:`compile_kernels` on a daemon thread, started now.

    A sweep starts it before reading its trace: the first start compiles
    while the trace is read and checked (numba's compiler lock makes the
    replay wait for the kernel if it is not ready yet; a failed compile here
    is simply made again, and raised, by the replay's own call).
    """
    def run() -> None:
        try:
            compile_kernels()
        except Exception:  # noqa: BLE001 - the replay's own call compiles again and raises
            pass

    global _BACKGROUND
    thread = threading.Thread(target=run, name="compile-kernels", daemon=True)
    _BACKGROUND = thread
    thread.start()
    return thread


_BACKGROUND: threading.Thread | None = None


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
    Each chunk is split into ``blocks`` slices (default: :func:`blocks_per_thread`), each
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
        numba.set_num_threads(kernel_threads(threads))
    blocks_per_chunk = max(1, int(blocks)) if blocks is not None else _blocks_per_chunk(threads, len(configs))
    fleets = frozen(fleet_tables(trace))
    table, inflight = new_rank_table(n_w, n_rank_slots(trace))
    dp = readonly(dp_sizes(trace))
    # (no copy of a column already int64: the kernels only read them)
    m_off = np.ascontiguousarray(trace.match_offsets, dtype=np.int64)
    m_worker = readonly(np.ascontiguousarray(trace.match_worker, dtype=np.int64))
    m_blocks = readonly(np.ascontiguousarray(trace.match_blocks, dtype=np.int64))
    sizes = np.diff(m_off)
    max_matches = int(sizes.max()) if sizes.size else 0
    loads = frozen(load_columns(trace))
    req = frozen(request_columns(trace))
    knobs = frozen(enc.knobs)
    has_selected = req.selected_worker.shape[0] > 0
    plan = frozen(enc.plan)
    if totals is None:
        totals = Totals(blocks_per_chunk, n_cfg)
    if totals.acc[:, :, :].any() and not (totals.parent == plan.parent).all():
        raise ValueError("totals were filled for configs in another order")
    totals.parent = enc.plan.parent
    if totals.acc.shape[0] < blocks_per_chunk:
        raise ValueError("totals has fewer block slots than a chunk has blocks")
    # the blocks' starting states, two sets: while a chunk's blocks replay from
    # one, the next chunk's are split into the other (the load sweep does not
    # depend on any decision)
    tables = np.zeros((2, blocks_per_chunk) + table.shape, dtype=np.int64)
    inflights = np.zeros((2, blocks_per_chunk, n_w), dtype=np.int64)
    ptrs = np.zeros((2, blocks_per_chunk), dtype=np.int64)
    dummy_i = np.zeros((layout.O_NCOLS, 1, n_cfg), dtype=np.int64)
    dummy_f = np.zeros((layout.F_NCOLS, 1, n_cfg), dtype=np.float64)
    ptr = 0
    pool = _block_pool(numba.get_num_threads())
    link = readonly(decide_link())
    runs = one_pass.config_runs(enc.plan)
    max_fleet = int(np.diff(fleets.offsets).max()) if fleets.offsets.shape[0] > 1 else 0

    def scratch() -> tuple:
        return one_pass.new_scratch(enc.plan, n_w, max_fleet, max_matches, runs)

    starts = list(range(0, n_req, chunk))
    block_los: list[np.ndarray] = []

    def split(k: int) -> None:
        # chunk k's block starts and their load states (into state set k % 2),
        # sweeping the loads on from where chunk k-1's last block started
        nonlocal ptr
        start, stop = starts[k], min(n_req, starts[k] + chunk)
        n = stop - start
        block = -(-n // blocks_per_chunk)
        lo = np.arange(0, n, block, dtype=np.int64)
        nb = lo.shape[0]
        block_los.append(np.append(lo, n).astype(np.int64))
        ptr = one_pass.split_states_nb(ptr, readonly(req.ts[start:stop][lo]), loads, dp, table, inflight,
                                       tables[k % 2, :nb], inflights[k % 2, :nb], ptrs[k % 2, :nb])

    # accumulator slots, lent to one running block at a time (start_blocks)
    slots: queue.SimpleQueue = queue.SimpleQueue()
    for j in range(totals.acc.shape[0]):
        slots.put(j)
    # A chunk's blocks are handed to the threads before the previous chunk's are
    # waited for, so no thread idles while the previous chunk's last blocks run;
    # then the next chunk's load states are split here, beside them, into the
    # state set the previous chunk has just released.
    pending: tuple[list[Future], Chunk] | None = None
    running: list[Future] = []
    try:
        if starts:
            split(0)
        for k, start in enumerate(starts):
            stop = min(n_req, start + chunk)
            n = stop - start
            block_lo = block_los[k]
            nb = block_lo.shape[0] - 1
            tb, inf, pt = tables[k % 2, :nb], inflights[k % 2, :nb], ptrs[k % 2, :nb]
            if keep:
                out_i = np.empty((layout.O_NCOLS, n, n_cfg), dtype=np.int64)
                out_f = np.empty((layout.F_NCOLS, n, n_cfg), dtype=np.float64)
            else:
                out_i, out_f = dummy_i, dummy_f
            fl_min = np.empty(n, dtype=np.int64)
            fl_fresh = np.empty(n, dtype=np.int64)
            a, b = m_off[start], m_off[stop]
            chunk_req = layout.Requests(*(
                col[start:stop] if (name != "selected_worker" or has_selected) else col
                for name, col in zip(layout.Requests._fields, req, strict=True)))
            running = start_blocks(
                pool, nb, layout.BlockStates(block_lo, pt, tb, inf), chunk_req,
                layout.Matches(readonly(m_off[start:stop + 1] - a), m_worker[a:b], m_blocks[a:b]),
                fleets, loads, dp, int(freshness_ns), knobs, plan, int(seed), max_matches, keep,
                layout.Outputs(out_i, out_f, fl_min, fl_fresh),
                layout.Accumulators(totals._acc, totals.hist_wait, totals.hist_div, totals.stats), slots,
                link, scratch)
            done = Chunk(start, stop, out_i if keep else None, out_f if keep else None, fl_min, fl_fresh)
            if pending is not None:
                wait_all(pending[0])
            if k + 1 < len(starts):
                split(k + 1)
            if pending is not None:
                if progress is not None:
                    progress(pending[1].stop - pending[1].start)
                yield pending[1]
            pending = (running, done)
        if pending is not None:
            wait_all(pending[0])
            if progress is not None:
                progress(pending[1].stop - pending[1].start)
            yield pending[1]
            pending = None
    finally:
        # a consumer that stops early (or an error) leaves no block running into
        # its accumulators
        outstanding = running + (pending[0] if pending is not None else [])
        for f in outstanding:
            f.cancel()
        wait(outstanding)


def chunk_readings(mins: list, fresh: list) -> tuple[np.ndarray, np.ndarray]:
    """A trace's per-request fleet readings ``(min_waiting, fresh_workers)``
    (``replay/sweep/readings.py``) from its chunks' ``fleet_min``/``fleet_fresh``."""
    if not mins:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    return np.concatenate(mins), np.concatenate(fresh).astype(np.int32)


def new_totals(n_configs: int, *, threads: int | None = None, blocks: int | None = None) -> Totals:
    """Accumulators sized for ``iter_chunks`` with the same ``threads``/``blocks``."""
    n = max(1, int(blocks)) if blocks is not None else _blocks_per_chunk(threads, n_configs)
    return Totals(n, n_configs)


def chunk_fields(ch: Chunk) -> dict[str, np.ndarray]:
    """A chunk's decisions as the typed per-field arrays of fields.py, shape (n, n_configs)."""
    out = {}
    for name, dtype, _null, _doc in DECISION_FIELDS:
        if name in layout.FLOAT_FIELDS:
            out[name] = ch.out_f[layout.FLOAT_FIELDS.index(name)].astype(dtype, copy=True)
        else:
            out[name] = ch.out_i[layout.INT_FIELDS.index(name)].astype(dtype)
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
