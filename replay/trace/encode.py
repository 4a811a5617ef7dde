"""Encoding: checked frames -> the flat numpy columns of a :class:`Trace`.

One step per table part, each raising the one-line :class:`TraceError` on the
first bad row (rows as they are in the files, before any sorting):
:func:`read_requests`, :func:`read_matches`, :func:`read_closed_loop`,
:func:`read_loads` check and convert; :func:`to_ids` maps names to the
universe's ids; :class:`Requests` / :class:`Loads` ``take`` rows, which is
both the stable sort by ``ts`` (:func:`stable_order`) and the model filter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import polars as pl

from replay.trace.base import (
    DEFAULT_MODEL,
    LOAD_REQUIRED,
    MAX_DP_SIZE,
    MAX_INT32,
    MAX_VALUE,
    TAIL_COLUMNS,
    run_both,
)
from replay.trace.blocks import conform_blocks
from replay.trace.columns import Coded, Columns, IntSpec, all_distinct, first_out_of_range, map_names
from replay.trace.workers import Universe

MATCH_SHAPE = "list<struct{worker: string, blocks: integer}>"


# ---------------------------------------------------------------------------
# row order
# ---------------------------------------------------------------------------
def stable_order(ts: np.ndarray) -> np.ndarray | None:
    """Stable argsort by ts, or None when already sorted."""
    if ts.shape[0] < 2 or bool(np.all(ts[1:] >= ts[:-1])):
        return None
    return np.argsort(ts, kind="stable")


def take_csr(offsets: np.ndarray, rows: np.ndarray, *cols: np.ndarray):
    """CSR ``offsets`` and value columns restricted to / reordered by ``rows``."""
    lens = np.diff(offsets)[rows]
    new_off = np.zeros(rows.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    total = int(new_off[-1])
    gather = np.repeat(offsets[:-1][rows] - new_off[:-1], lens) + np.arange(total, dtype=np.int64)
    return new_off, [c[gather] for c in cols]


def segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row max of a CSR column (0 for empty rows)."""
    n = offsets.shape[0] - 1
    out = np.zeros(n, dtype=np.int64)
    lens = np.diff(offsets)
    nz = np.nonzero(lens > 0)[0]
    if nz.shape[0]:
        out[nz] = np.maximum.reduceat(values, offsets[nz])
    return out


def _offsets(lens: np.ndarray) -> np.ndarray:
    off = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    return off


def _list_values(s: pl.Series) -> pl.Series:
    """The entries of a list series' non-null lists, in row order (``flatten`` of its Arrow
    array).  Exploded by polars, not taken through Arrow: ``pl.Series`` of an Arrow array
    imports ``pyarrow.compute``, 0.1 s of a cached start."""
    return s.explode(empty_as_null=False, keep_nulls=False)


# ---------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------
@dataclass
class RequestColumns:
    """``requests`` checked column by column, names not yet mapped to ids."""

    ts: np.ndarray
    request_id: np.ndarray
    model: pl.Series | Coded
    input_tokens: np.ndarray
    query_blocks: np.ndarray
    query_blocks_null: int
    best_prefix: np.ndarray | None    # -1 = null; None = no column
    selected: pl.Series | Coded | None


def request_id_column(R: Columns):
    """``request_id`` checked (integers in int64, else non-null strings): the column, and its
    int64 array when it holds integers (None for strings)."""
    rid_s = R.require("request_id")
    if rid_s.dtype.is_integer():
        return rid_s, R.ints("request_id", nullable=False, lo=-(2**63), hi=2**63 - 1, s=rid_s)
    return R.strings("request_id", nullable=False, s=rid_s), None


def unique_request_ids(R: Columns):
    """:func:`request_id_column`, each id once (the first repeat is the error, naming both rows)."""
    rid_s, request_id = request_id_column(R)
    dup = None if all_distinct(rid_s) else ~rid_s.is_first_distinct()   # the cheap test first
    if dup is not None and dup.any():
        row = int(dup.arg_max())
        first_name, first = R.where(int((rid_s == rid_s[row]).arg_max()))
        at = f"row {first}" if first_name == R.where(row)[0] else f"{first_name} row {first}"
        R.fail("request_id", f"duplicate request_id {rid_s[row]!r} (first at {at})", row)
    return rid_s, request_id


def read_requests(R: Columns) -> RequestColumns:
    """The scalar request columns, checked (``request_id`` unique)."""
    n = R.df.height
    ts = R.timestamps("ts")
    rid_s, request_id = unique_request_ids(R)
    if request_id is None:
        request_id = rid_s.to_numpy()
    model = (R.strings("model", nullable=True).fill_null(DEFAULT_MODEL) if R.has("model")
             else pl.Series("model", [DEFAULT_MODEL] * n, dtype=pl.String))
    input_tokens = R.ints("input_tokens", nullable=False)
    qb_s = R.require("query_blocks")
    query_blocks = R.ints("query_blocks", nullable=True, fill=0, s=qb_s)
    best = R.ints("best_prefix_blocks", nullable=True, fill=-1) if R.has("best_prefix_blocks") else None
    sel = R.strings("selected_worker", nullable=True) if R.has("selected_worker") else None
    return RequestColumns(ts, request_id, model, input_tokens, query_blocks, int(qb_s.null_count()),
                          best, sel)


@dataclass
class MatchColumns:
    lens: np.ndarray          # int64 entries per request
    offsets: np.ndarray       # int64 CSR
    worker: pl.Series | Coded  # string, one per entry
    blocks: np.ndarray        # int64, one per entry


def read_matches(R: Columns) -> MatchColumns:
    """``matches``: list<struct{worker, blocks}> as CSR, every entry checked."""
    m_s = R.require("matches")
    if isinstance(m_s.dtype, pl.Array):
        m_s = m_s.cast(pl.List(m_s.dtype.inner))
    inner = m_s.dtype.inner if isinstance(m_s.dtype, pl.List) else None
    fields = {f.name: f.dtype for f in inner.fields} if isinstance(inner, pl.Struct) else None
    if fields is None or "worker" not in fields or "blocks" not in fields:
        R.fail("matches", f"wrong type {m_s.dtype}, expected {MATCH_SHAPE}")
    lens = m_s.list.len().fill_null(0).cast(pl.Int64).to_numpy()
    off = _offsets(lens)
    ent = _list_values(m_s)

    def row_of(i: int) -> tuple[int, int]:
        row = int(np.searchsorted(off, i, side="right") - 1)
        return i - int(off[row]), row

    if ent.null_count():
        k, row = row_of(int(ent.is_null().arg_max()))
        R.fail("matches", f"entry {k} is null", row)
    ent_worker = ent.struct.field("worker")
    ent_blocks = ent.struct.field("blocks")
    for name, col, kind in (("worker", ent_worker, "string"), ("blocks", ent_blocks, "int")):
        ok = (col.dtype.is_integer() if kind == "int"
              else col.dtype == pl.String or isinstance(col.dtype, (pl.Categorical, pl.Enum)))
        if not ok:
            R.fail("matches", f"wrong type {m_s.dtype}, expected {MATCH_SHAPE}")
        if col.null_count():
            k, row = row_of(int(col.is_null().arg_max()))
            R.fail("matches", f"entry {k} has a null {name}", row)
    i = first_out_of_range(ent_blocks, 0, MAX_VALUE)
    if i is not None:
        v = ent_blocks[i]
        k, row = row_of(i)
        R.fail("matches", f"entry {k} blocks must be " + (f">= 0, got {v}" if v < 0 else f"< 2**53, got {v}"),
               row)
    return MatchColumns(lens, off, ent_worker.cast(pl.String), ent_blocks.cast(pl.Int64).to_numpy())


@dataclass
class ClosedLoopColumns:
    """The optional closed-loop request columns (None: the files lack it)."""

    output_tokens: np.ndarray | None = None
    cached_tokens: np.ndarray | None = None
    ttft_ms: np.ndarray | None = None
    latency_ms: np.ndarray | None = None
    hash_offsets: np.ndarray | None = None
    hash_values: np.ndarray | None = None
    hash_known: np.ndarray | None = None
    partial_blocks_added: int = 0       # full-blocks-only lists completed (replay.trace.blocks)

    def take(self, rows: np.ndarray) -> ClosedLoopColumns:
        out = ClosedLoopColumns(*(None if v is None else v[rows] for v in
                                  (self.output_tokens, self.cached_tokens, self.ttft_ms, self.latency_ms)))
        out.partial_blocks_added = self.partial_blocks_added
        if self.hash_offsets is not None:
            out.hash_offsets, (out.hash_values,) = take_csr(self.hash_offsets, rows, self.hash_values)
            out.hash_known = self.hash_known[rows]
        return out

    def counts(self) -> dict[str, int] | None:
        """Rows with a value, per present column (None when there is none)."""
        out = {}
        if self.hash_known is not None:
            out["hash_ids"] = int(self.hash_known.sum())
        for name in ("output_tokens", "cached_tokens"):
            v = getattr(self, name)
            if v is not None:
                out[name] = int((v >= 0).sum())
        for name in ("ttft_ms", "latency_ms"):
            v = getattr(self, name)
            if v is not None:
                out[name] = int((~np.isnan(v)).sum())
        return out or None


@dataclass
class Requests:
    """Request columns, row-aligned (CSR columns by their offsets)."""

    ts: np.ndarray
    request_id: np.ndarray
    model: np.ndarray                 # int32 model id
    input_tokens: np.ndarray
    query_blocks: np.ndarray
    best_prefix: np.ndarray
    selected: np.ndarray | None
    match_offsets: np.ndarray
    match_worker: np.ndarray
    match_blocks: np.ndarray
    closed: ClosedLoopColumns

    def take(self, rows: np.ndarray) -> Requests:
        """The requests ``rows`` (a permutation: the sort; a subset: the model filter)."""
        off, (worker, blocks) = take_csr(self.match_offsets, rows, self.match_worker, self.match_blocks)
        return Requests(self.ts[rows], self.request_id[rows], self.model[rows], self.input_tokens[rows],
                        self.query_blocks[rows], self.best_prefix[rows],
                        None if self.selected is None else self.selected[rows], off, worker, blocks,
                        self.closed.take(rows))


def read_closed_loop(R: Columns, input_tokens: np.ndarray) -> ClosedLoopColumns:
    """``hash_ids``, ``output_tokens``, ``cached_tokens``, ``ttft_ms``, ``latency_ms``
    where present, each checked; the ``hash_ids`` length is checked later,
    once the request's page size is known (:func:`check_hash_lengths`)."""
    out = ClosedLoopColumns()
    if R.has("output_tokens"):
        out.output_tokens = R.ints("output_tokens", nullable=True, fill=-1)
    if R.has("cached_tokens"):
        c = R.ints("cached_tokens", nullable=True, fill=-1)
        bad = c > input_tokens
        if bad.any():
            row = int(np.argmax(bad))
            R.fail("cached_tokens", f"must be <= input_tokens ({input_tokens[row]}), got {c[row]}", row)
        out.cached_tokens = c
    if R.has("latency_ms"):
        out.latency_ms = R.floats("latency_ms")
    if R.has("ttft_ms"):
        t = R.floats("ttft_ms")
        if out.latency_ms is not None:
            bad = t > out.latency_ms          # False wherever either is NaN
            if bad.any():
                row = int(np.argmax(bad))
                R.fail("ttft_ms", f"must be <= latency_ms ({out.latency_ms[row]}), got {t[row]}", row)
        out.ttft_ms = t
    if R.has("hash_ids"):
        h = R.require("hash_ids")
        if isinstance(h.dtype, pl.Array):
            h = h.cast(pl.List(h.dtype.inner))
        if not (isinstance(h.dtype, pl.List) and (h.dtype.inner.is_integer() or h.dtype.inner == pl.Null)):
            R.fail("hash_ids", f"wrong type {h.dtype}, expected list<int64>")
        known = h.is_not_null().to_numpy()
        lens = h.list.len().fill_null(0).cast(pl.Int64).to_numpy()
        off = _offsets(lens)
        vals = _list_values(h)
        if vals.null_count():
            i = int(vals.is_null().arg_max())
            row = int(np.searchsorted(off, i, side="right") - 1)
            R.fail("hash_ids", f"entry {i - int(off[row])} is null", row)
        i = first_out_of_range(vals, -(2**63), 2**63 - 1)
        if i is not None:
            row = int(np.searchsorted(off, i, side="right") - 1)
            R.fail("hash_ids", f"entry {i - int(off[row])} is not an int64, got {vals[i]}", row)
        out.hash_offsets, out.hash_values, out.hash_known = off, vals.cast(pl.Int64).to_numpy(), known
    return out


def check_hash_lengths(R: Columns, cl: ClosedLoopColumns, input_tokens: np.ndarray,
                       page: np.ndarray) -> None:
    """The block-count rule (:mod:`replay.trace.blocks`) wherever the request's
    page size is known (``page`` per request, -1 = unknown): a list with a
    partial last block is kept, a full-blocks-only list gets a fresh id for its
    partial block (counted in ``cl.partial_blocks_added``), any other length is
    an error naming the row.

    REPLAY CHOICE: CAPTURE.md section 3 gives ``query_blocks = ceil(len / B)``
    for the router's own query; ``query_blocks`` is not tied to
    ``len(hash_ids)`` here, because a trace may record ``query_blocks = 0``
    (no prefix signal) for a request whose hashes are known.
    """
    if cl.hash_offsets is None:
        return
    off, vals, counts = conform_blocks(cl.hash_offsets, cl.hash_values, input_tokens, page,
                                       known=cl.hash_known)
    if counts.bad is not None:
        R.fail("hash_ids", counts.message, counts.bad)
    cl.hash_offsets, cl.hash_values = off, vals
    cl.partial_blocks_added = counts.n_full_only


# ---------------------------------------------------------------------------
# loads
# ---------------------------------------------------------------------------
@dataclass
class Loads:
    """Load columns, row-aligned, named as the Trace fields (``base.LOAD_FIELDS``)."""

    load_ts: np.ndarray
    load_worker: np.ndarray
    load_rank: np.ndarray
    load_running: np.ndarray
    load_waiting: np.ndarray
    load_num_tokens: np.ndarray
    load_max_total: np.ndarray
    load_has_tail: np.ndarray
    load_waiting_uncached: np.ndarray
    load_total_tokens: np.ndarray
    load_max_running: np.ndarray
    load_prefill_tokens: np.ndarray
    load_prefill_busy_us: np.ndarray
    load_router_inflight: np.ndarray

    def take(self, rows: np.ndarray) -> Loads:
        return Loads(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))


@dataclass
class LoadColumns:
    """``loads`` checked column by column, worker names not yet mapped to ids."""

    ts: np.ndarray
    worker: pl.Series | Coded
    rank: np.ndarray
    required: list[np.ndarray]        # LOAD_REQUIRED order
    tail_valid: np.ndarray
    tail_any: np.ndarray
    tails: list[np.ndarray]           # TAIL_COLUMNS order, 0 where no full tail
    inflight: np.ndarray
    has_inflight: bool


def load_specs() -> list[IntSpec]:
    """The integer load columns besides ``ts``, as :meth:`Columns.int_columns` checks them."""
    return [IntSpec("dp_rank", True, 0, 0, MAX_INT32, pl.Int32), *(IntSpec(c, False) for c in LOAD_REQUIRED),
            *(IntSpec(c, True) for c in TAIL_COLUMNS), IntSpec("router_inflight", True)]


def read_loads(L: Columns, worker: Coded | None = None) -> LoadColumns:
    """The load columns, checked; ``worker`` given (coded) when the frame lacks it."""
    n = L.df.height
    ts = L.timestamps("ts")
    worker_col: pl.Series | Coded = L.strings("worker", nullable=False) if worker is None else worker
    return loads_from_columns(n, ts, worker_col, L.int_columns(load_specs()))


def loads_from_columns(n: int, ts: np.ndarray, worker_col: pl.Series | Coded,
                       cols: dict[str, np.ndarray],
                       tails_done: tuple[list[np.ndarray], np.ndarray, np.ndarray] | None = None) -> LoadColumns:
    """:func:`read_loads` after the checks: ``cols`` as :meth:`Columns.int_columns` returns
    them (present columns only, nulls filled) -> the rank, tail and inflight columns.
    ``tails_done``: :func:`load_tails` and :func:`tail_flags` of every row, already made."""
    rank = cols["dp_rank"] if "dp_rank" in cols else np.zeros(n, dtype=np.int32)
    required = [cols[c] for c in LOAD_REQUIRED]
    if tails_done is None:
        tails, tail_valid, tail_any = load_tails(n, cols), np.empty(n, dtype=bool), np.empty(n, dtype=bool)
        tail_flags(tails, tail_valid, tail_any, 0, n)
    else:
        tails, tail_valid, tail_any = tails_done
    has_inflight = "router_inflight" in cols
    inflight = cols["router_inflight"] if has_inflight else np.full(n, -1, dtype=np.int64)
    return LoadColumns(ts, worker_col, rank, required, tail_valid, tail_any, tails, inflight, has_inflight)


def load_tails(n: int, cols: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The tail columns (``TAIL_COLUMNS`` order) as arrays of their own: -1 where absent."""
    tails = [cols[c] if c in cols else np.full(n, -1, dtype=np.int64) for c in TAIL_COLUMNS]
    return [v if v.flags.writeable else v.copy() for v in tails]   # own arrays, as always


def tail_flags(tails: list[np.ndarray], tail_valid: np.ndarray, tail_any: np.ndarray, start: int,
               stop: int) -> None:
    """Rows ``start:stop``: whether every tail is there (>= 0) and whether any is, and the
    tails set to 0 where not every one is (a partial tail is not used)."""
    valid, some = tail_valid[start:stop], tail_any[start:stop]
    valid[:] = True
    some[:] = False
    for v in tails:
        ok = v[start:stop] >= 0
        valid &= ok
        some |= ok
    if not valid.all():
        for v in tails:                      # times 0 or 1: a plain loop, no masked store
            seg = v[start:stop]
            np.multiply(seg, valid, out=seg)


def check_rank_bound(L: Columns, worker: np.ndarray, rank: np.ndarray, worker_dp: np.ndarray) -> None:
    """A worker without a dp_size takes its dp_size from the ranks it publishes
    from, so those ranks are bounded as a dp_size is (``MAX_DP_SIZE``)."""
    if rank.size == 0 or int(rank.max()) < MAX_DP_SIZE:
        return
    bad = (rank >= MAX_DP_SIZE) & (worker_dp[worker] <= 0) if worker_dp.size else rank >= MAX_DP_SIZE
    if bad.any():
        row = int(np.argmax(bad))
        L.fail("dp_rank", f"must be < {MAX_DP_SIZE} on a worker without a dp_size in workers.parquet "
               f"(its ranks set its dp_size, at most {MAX_DP_SIZE}), got {rank[row]}", row)


# ---------------------------------------------------------------------------
# names -> ids
# ---------------------------------------------------------------------------
def match_ids(universe: Universe, ent_worker: pl.Series) -> np.ndarray:
    """Match addresses -> worker ids; with a table only listed workers are known (-1 otherwise)."""
    workers = universe.workers
    if universe.has_table:
        known_ids = np.nonzero(universe.worker_listed)[0].astype(np.int32)
        # index into the listed workers, then to worker ids; -1 (unknown) picks the appended -1
        lookup = np.append(known_ids, np.int32(-1))
        return lookup[map_names(ent_worker, [workers[i] for i in known_ids])]
    return map_names(ent_worker, workers)


def to_ids(universe: Universe, R: Columns, L: Columns, model: pl.Series, load_worker: pl.Series,
           ent_worker: pl.Series, *, parallel: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request model ids, load worker ids, match worker ids); with a fixed
    universe (a window) a name outside it is an error."""
    (match_worker, req_model), lw = run_both(
        lambda: (match_ids(universe, ent_worker), map_names(model, universe.models)),
        lambda: map_names(load_worker, universe.workers), parallel=parallel)
    if lw.size and (lw < 0).any():   # only with a fixed universe
        row = int(np.argmax(lw < 0))
        L.fail("worker", f"worker {load_worker[row]!r} is not in the trace's worker index", row)
    if req_model.size and (req_model < 0).any():
        row = int(np.argmax(req_model < 0))
        R.fail("model", f"model {model[row]!r} is not in the trace's model index", row)
    return req_model, lw, match_worker
