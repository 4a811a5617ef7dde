"""A trace's read columns assembled into a :class:`Trace`: the last step of both readers
(:mod:`replay.trace.load`, the general one, and :mod:`replay.trace.fast`, the Arrow one)."""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from replay.trace.base import LOAD_FIELDS, MAX_DP_SIZE, REQUESTS, TraceError
from replay.trace.columns import Coded, Columns, pool_empty
from replay.trace.core import Trace
from replay.trace.encode import (
    ClosedLoopColumns,
    LoadColumns,
    Loads,
    MatchColumns,
    RequestColumns,
    Requests,
    check_hash_lengths,
    check_rank_bound,
    segment_max,
    stable_order,
)
from replay.trace.facts import TraceFacts
from replay.trace.files import Frames
from replay.trace.info import TraceInfo
from replay.trace.workers import Universe

# dtypes of the Trace's load columns other than int64
LOAD_DTYPES = {"load_worker": np.int32, "load_rank": np.int32, "load_has_tail": np.bool_}


def finish_trace(fr: Frames, universe: Universe, R: Columns, L: Columns, rq: RequestColumns, mt: MatchColumns,
                 cl: ClosedLoopColumns, ld: LoadColumns, req_model: np.ndarray, load_worker: np.ndarray,
                 match_worker: np.ndarray, sel: tuple[np.ndarray | None, int | None, int | None], *,
                 model: str | None, strict_model: bool, index_offset: int, facts: bool,
                 info: TraceInfo, ranks: dict[str, list[int]] | None = None) -> Trace:
    """The steps after names are ids (both load paths): the checks that need
    the universe, the default best prefix, the stable sort, the facts, the
    model filter.  ``ranks``: :func:`observed_ranks` of these loads, when the
    caller has it already."""
    check_rank_bound(L, load_worker, ld.rank, universe.worker_dp)
    check_hash_lengths(R, cl, rq.input_tokens, universe.model_page[req_model] if req_model.size
                       else np.zeros(0, dtype=np.int64))
    selected, sel_null, sel_unknown = sel
    best = rq.best_prefix
    if best is None or (best < 0).any():      # default: max of the row's match blocks (0 if none)
        dflt = segment_max(mt.blocks, mt.offsets)
        best = dflt if best is None else np.where(best < 0, dflt, best)

    req = Requests(rq.ts, rq.request_id, req_model, rq.input_tokens, rq.query_blocks, best, selected,
                   mt.offsets, match_worker, mt.blocks, cl)
    load_cols: list[Any] = [ld.ts, load_worker, ld.rank, *ld.required, ld.tail_valid, *ld.tails, ld.inflight]
    loads = Loads(*load_cols)
    req_perm = stable_order(req.ts)
    load_perm = stable_order(loads.load_ts)
    tf = trace_facts(universe, rq, mt, cl, ld, req_model, load_worker, match_worker, sel_null, sel_unknown,
                     req_perm is None, load_perm is None, want=facts, info=info, ranks=ranks)

    if req_perm is not None:
        req = req.take(req_perm)
    if load_perm is not None:
        loads = loads.take(load_perm)
    req_index = (None if index_offset == 0
                 else np.arange(index_offset, index_offset + req.ts.shape[0], dtype=np.int64))
    if model is not None:
        req, req_index = keep_model(req, universe, model, tf, strict_model, index_offset)
    return make_trace(fr, universe, req, loads, req_index, tf, info)


def keep_model(req: Requests, universe: Universe, model: str, tf: TraceFacts, strict: bool,
               index_offset: int) -> tuple[Requests, np.ndarray]:
    """The model filter: only ``model``'s requests, with their request index in
    the whole time-sorted trace."""
    models = universe.models
    if model not in models or (strict and tf.models.get(model, 0) == 0):
        raise TraceError(f"{REQUESTS}: column 'model': no request has model {model!r} "
                         f"(models: {', '.join(models)})")
    keep = np.nonzero(req.model == models.index(model))[0]
    tf.model_filter = model
    tf.requests_kept = int(keep.shape[0])
    return req.take(keep), keep.astype(np.int64) + int(index_offset)


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def trace_facts(universe: Universe, rq: RequestColumns, mt: MatchColumns, cl: ClosedLoopColumns,
                ld: LoadColumns, req_model: np.ndarray, load_worker: np.ndarray, match_worker: np.ndarray,
                sel_null: int | None, sel_unknown: int | None, req_sorted: bool, loads_sorted: bool, *,
                want: bool, info: TraceInfo, ranks: dict[str, list[int]] | None = None) -> TraceFacts:
    """The data facts of the whole frames (before any model filter).  Without
    ``want``, the facts that cost memory (per-worker ranks, unknown address
    names) are left empty; ``ranks`` is :func:`observed_ranks` when already known."""
    workers, models = universe.workers, universe.models
    n = int(rq.ts.shape[0])
    unknown = match_worker < 0
    unk_names = names_at(mt.worker, unknown) if want and unknown.any() else []
    tf = TraceFacts(
        requests=n,
        requests_with_matches=int((mt.lens > 0).sum()),
        requests_without_prefix_signal=int(((mt.lens == 0) | (rq.query_blocks == 0)).sum()),
        query_blocks_null=rq.query_blocks_null,
        match_entries=int(match_worker.shape[0]),
        unknown_match_entries=int(unknown.sum()),
        unknown_match_addresses=len(unk_names),
        unknown_match_address_examples=unk_names[:5],
        unknown_addresses=unk_names[:1000],
        has_selected_worker=rq.selected is not None,
        selected_worker_null=sel_null,
        selected_worker_unknown=sel_unknown,
        requests_sorted_on_disk=req_sorted,
        load_rows=int(ld.ts.shape[0]),
        loads_sorted_on_disk=loads_sorted,
        load_rows_with_tail=int(ld.tail_valid.sum()),
        load_rows_partial_tail=int((ld.tail_any & ~ld.tail_valid).sum()),
        load_rows_without_tail=int((~ld.tail_any).sum()),
        has_router_inflight=ld.has_inflight,
        workers=len(workers),
        models={m: int(c) for m, c in zip(models, np.bincount(req_model, minlength=len(models)), strict=True)},
        has_workers_table=universe.has_table,
        non_fleet_load_workers=universe.non_fleet_load,
        closed_loop_columns=cl.counts(),
        hash_ids_full_blocks_only=None if cl.hash_offsets is None else cl.partial_blocks_added,
        log_hash_ids_full_blocks_only=_int_or_none(info.extra.get("log_hash_ids_full_blocks_only")),
        page_sizes={m: int(p) for m, p in zip(models, universe.model_page, strict=False) if p > 0} or None,
        trace_json=None if info.path is None else {
            "router": dict(info.router), "page_size": info.page_size, "source": info.source,
            "per_dp_rank": info.per_dp_rank,
            "capture_matches": {k: v for k, v in ((info.extra or {}).get("capture") or {}).items()
                                if k in ("matches_source", "matches_exact", "matches_approximate")}},
    )
    if n:
        tf.span_start_ns = int(rq.ts.min())
        tf.span_end_ns = int(rq.ts.max())
        tf.span_s = (tf.span_end_ns - tf.span_start_ns) / 1e9
    dp_of_row = universe.worker_dp[load_worker] if load_worker.size else np.zeros(0, dtype=np.int32)
    tf.ignored_rank_rows = int(((dp_of_row > 0) & (ld.rank >= dp_of_row)).sum())
    if load_worker.size and want:
        tf.ranks_per_worker = observed_ranks(workers, load_worker, ld.rank) if ranks is None else ranks
    tf.workers_without_samples = sorted(set(workers) - set(tf.ranks_per_worker))
    return tf


def names_at(names: pl.Series | Coded, mask: np.ndarray) -> list[str]:
    """The distinct names of the rows in ``mask``, sorted."""
    if isinstance(names, Coded):
        return names.names_at(mask)
    return names.filter(pl.Series(mask)).unique().sort().to_list()


def observed_ranks(workers: list[str], load_worker: np.ndarray, rank: np.ndarray) -> dict[str, list[int]]:
    """``{worker: sorted distinct ranks}`` of the workers with samples, in worker id order."""
    return RankTable(len(workers)).add(load_worker, rank).result(workers)


class RankTable:
    """The (worker id, rank) pairs of the loads, gathered slice by slice (a slice's rows in
    any order): :meth:`result` is :func:`observed_ranks` of all the slices' rows."""

    def __init__(self, n_workers: int):
        self.seen = np.zeros((n_workers, MAX_DP_SIZE), dtype=bool)
        self.stray: dict[int, set[int]] = {}      # ranks beyond any dp_size (ignored by the replay, listed)

    def add(self, load_worker: np.ndarray, rank: np.ndarray) -> RankTable:
        if rank.size == 0:
            return self
        top = int(rank.max())
        if top < MAX_DP_SIZE and int(rank.min()) >= 0:
            # (worker, rank) as one small int32 key over the ranks present: a count table of
            # a few hundred slots (one over every possible rank is 256x larger and misses cache)
            width = top + 1
            key = pool_empty(load_worker.shape[0], np.int32)
            np.multiply(load_worker, width, out=key, dtype=np.int32)
            key += rank
            n_workers = self.seen.shape[0]
            self.seen[:, :width] |= np.bincount(key, minlength=n_workers * width).reshape(n_workers, width) > 0
            return self
        small = rank < MAX_DP_SIZE
        key = load_worker.astype(np.int64) * MAX_DP_SIZE + rank
        self.seen |= np.bincount(key[small], minlength=self.seen.size).reshape(self.seen.shape) > 0
        if not small.all():
            for w, r in np.unique(np.stack([load_worker[~small], rank[~small]]).astype(np.int64), axis=1).T:
                self.stray.setdefault(int(w), set()).add(int(r))
        return self

    def result(self, workers: list[str]) -> dict[str, list[int]]:
        seen = self.seen
        out: dict[int, set[int]] = {int(w): set(np.nonzero(seen[w])[0].tolist()) for w in np.nonzero(seen.any(1))[0]}
        for w, ranks in self.stray.items():
            out.setdefault(w, set()).update(ranks)
        return {workers[w]: sorted(out[w]) for w in sorted(out)}


def make_trace(fr: Frames, universe: Universe, req: Requests, loads: Loads, req_index, tf: TraceFacts,
               info: TraceInfo) -> Trace:
    def i32(a):
        return np.ascontiguousarray(a, dtype=np.int32)

    def i64(a):
        return np.ascontiguousarray(a, dtype=np.int64)

    cl = req.closed

    def opt(a, dtype):
        return None if a is None else np.ascontiguousarray(a, dtype=dtype)

    return Trace(
        path=fr.path,
        workers=universe.workers,
        models=universe.models,
        worker_model=i32(universe.worker_model),
        worker_role=np.ascontiguousarray(universe.worker_role, dtype=np.int8),
        worker_dp_size=i32(universe.worker_dp),
        has_workers_table=universe.has_table,
        request_id=req.request_id,
        req_ts=i64(req.ts),
        req_model=i32(req.model),
        req_input_tokens=i64(req.input_tokens),
        req_query_blocks=i64(req.query_blocks),
        req_best_prefix_blocks=i64(req.best_prefix),
        match_offsets=i64(req.match_offsets),
        match_worker=i32(req.match_worker),
        match_blocks=i64(req.match_blocks),
        req_selected_worker=opt(req.selected, np.int32),
        **{f: np.ascontiguousarray(getattr(loads, f), dtype=LOAD_DTYPES.get(f, np.int64)) for f in LOAD_FIELDS},
        files=fr.files,
        facts=tf,
        req_index=req_index,
        worker_listed=universe.worker_listed,
        info=info,
        req_output_tokens=opt(cl.output_tokens, np.int64),
        req_cached_tokens=opt(cl.cached_tokens, np.int64),
        req_ttft_ms=opt(cl.ttft_ms, np.float64),
        req_latency_ms=opt(cl.latency_ms, np.float64),
        hash_offsets=opt(cl.hash_offsets, np.int64),
        hash_values=opt(cl.hash_values, np.int64),
        req_hash_known=opt(cl.hash_known, bool),
        worker_page_size=i32(universe.worker_page),
        model_page_size=i64(universe.model_page),
    )
