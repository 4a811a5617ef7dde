"""``validate_trace``: a trace checked (in memory or window by window) and its data facts."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from replay import labels
from replay.errors import ParamError
from replay.trace.base import FRESHNESS_NS, NS
from replay.trace.core import Trace
from replay.trace.facts import TraceFacts
from replay.trace.load import load_trace
from replay.trace.sets import TraceSet, sorted_on_disk
from replay.trace.windows import auto_window

MAX_FRESHNESS_MS = (2**63 - 1) // 1_000_000
"""Largest freshness window (ms) whose nanoseconds fit the kernels' int64 timestamps (about 292 years)."""


def check_freshness_ms(freshness_ms: int) -> int:
    """The freshness window in nanoseconds; :class:`ParamError` when it does not fit 64 bits
    (``sweep`` and ``validate`` apply the same limit)."""
    if not 0 <= int(freshness_ms) <= MAX_FRESHNESS_MS:
        raise ParamError("freshness_ms", f"must be in 0..{MAX_FRESHNESS_MS} (its nanoseconds must fit "
                         f"64 bits), got {freshness_ms}")
    return int(freshness_ms) * 1_000_000


def fresh_fleet_sample_mask(trace: Trace, freshness_ns: int = FRESHNESS_NS) -> np.ndarray:
    """Per request: True when *some* fleet worker of its model has a load sample
    (of a counted rank) with ``0 <= request_ts - sample_ts <= freshness``.

    Not the rank-exact all-ranks rule of the snapshot: a cheap, vectorised
    data fact ("no fresh sample from any fleet worker" is its negation).
    """
    out = np.zeros(trace.n_requests, dtype=bool)
    dp = trace.worker_dp_size[trace.load_worker] if trace.load_ts.size else np.zeros(0, np.int32)
    counted = (dp == 0) | (trace.load_rank < dp)
    for m in np.unique(trace.req_model):          # loop over models, not rows
        in_fleet = np.zeros(trace.n_workers, dtype=bool)
        in_fleet[trace.fleet(int(m))] = True
        fts = trace.load_ts[counted & in_fleet[trace.load_worker]]   # already sorted
        sel = np.nonzero(trace.req_model == m)[0]
        if fts.size == 0:
            continue
        rts = trace.req_ts[sel]
        idx = np.searchsorted(fts, rts, side="right") - 1
        ok = idx >= 0
        out[sel[ok]] = (rts[ok] - fts[idx[ok]]) <= freshness_ns
    return out


def validate_trace(path: str | os.PathLike, *, freshness_ms: int = 5000, window: int | None = 0,
                   progress=None) -> TraceFacts:
    """Load a trace (raising :class:`TraceError` on bad input) and return its data facts.

    Adds to ``Trace.facts``: ``requests_without_fresh_fleet_sample`` (and its
    ``share``), the freshness used, the fleet size per model and the files.
    ``window`` (ns; None = auto, as ``sweep --window``) checks a trace larger
    than memory window by window (:func:`validate_windows`).
    """
    freshness_ns = check_freshness_ms(freshness_ms)
    if window != 0:
        tset = TraceSet.open(path, hash_files=False)
        w = auto_window(tset) if window is None else int(window)
        if w:
            return validate_windows(tset, w, freshness_ns, progress)
    trace = load_trace(path)
    fresh = fresh_fleet_sample_mask(trace, freshness_ns)
    stale = int((~fresh).sum())
    return dataclasses.replace(
        trace.facts,
        freshness_ms=int(freshness_ms),
        requests_without_fresh_fleet_sample=stale,
        share_without_fresh_fleet_sample=stale / trace.n_requests if trace.n_requests else 0.0,
        fleet_workers={m: int(trace.fleet(i).shape[0]) for i, m in enumerate(trace.models)},
        roles={r: int((trace.worker_role == i).sum()) for i, r in enumerate(labels.ROLES)},
        files=trace.files,
        path=trace.path,
    )


# facts summed over windows; the others are merged below
_SUMMED = ("requests", "requests_with_matches", "requests_without_prefix_signal", "match_entries",
           "unknown_match_entries", "load_rows", "load_rows_with_tail", "load_rows_partial_tail",
           "load_rows_without_tail", "ignored_rank_rows", "query_blocks_null", "selected_worker_null",
           "selected_worker_unknown")


def validate_windows(tset: TraceSet, window_ns: int, freshness_ns: int, progress=None) -> TraceFacts:
    """``validate_trace``'s facts for a trace checked window by window (every
    row is checked exactly as in memory; ``request_id`` uniqueness within each
    window only)."""
    sums: dict[str, Any] = dict.fromkeys(_SUMMED, 0)
    stale = 0
    closed: dict[str, int] = {}
    unknown: set[str] = set()
    ranks: dict[str, set[int]] = {}
    has_inflight = False
    span: list[int | None] = [None, None]
    windows = 0
    last: TraceFacts | None = None
    full_only: int | None = None
    for win in tset.iter_windows(window_ns, facts=True):
        windows += 1
        tr = win.trace
        f = tr.facts
        last = f
        for k in _SUMMED:
            sums[k] += int(getattr(f, k) or 0)
        stale += int((~fresh_fleet_sample_mask(tr, freshness_ns)).sum())
        for k, v in (f.closed_loop_columns or {}).items():
            closed[k] = closed.get(k, 0) + v
        if f.hash_ids_full_blocks_only is not None:
            full_only = (full_only or 0) + f.hash_ids_full_blocks_only
        unknown.update(f.unknown_addresses)
        for w, rs in f.ranks_per_worker.items():
            ranks.setdefault(w, set()).update(rs)
        has_inflight |= f.has_router_inflight
        if tr.n_requests:
            a, b = int(tr.req_ts[0]), int(tr.req_ts[-1])
            span = [a if span[0] is None else min(span[0], a), b if span[1] is None else max(span[1], b)]
        if progress is not None:
            progress(tr.n_requests)
    n = sums["requests"]
    u = tset.universe
    names = sorted(unknown)
    facts = TraceFacts(
        **sums,
        unknown_match_addresses=len(names), unknown_match_address_examples=names[:5],
        requests_sorted_on_disk=sorted_on_disk(tset.requests), loads_sorted_on_disk=sorted_on_disk(tset.loads),
        workers=tset.n_workers, models=dict(tset.model_counts), has_workers_table=u.has_table,
        non_fleet_load_workers=list(u.non_fleet_load), has_router_inflight=has_inflight,
        ranks_per_worker={w: sorted(r) for w, r in sorted(ranks.items())},
        has_selected_worker=tset.has_selected,
        closed_loop_columns=closed or None,
        hash_ids_full_blocks_only=full_only,
        log_hash_ids_full_blocks_only=None if last is None else last.log_hash_ids_full_blocks_only,
        page_sizes=None if last is None else last.page_sizes,
        trace_json=None if last is None else last.trace_json,
        freshness_ms=int(freshness_ns) // 1_000_000,
        requests_without_fresh_fleet_sample=stale,
        share_without_fresh_fleet_sample=stale / n if n else 0.0,
        fleet_workers={m: int(tset.fleet(i).shape[0]) for i, m in enumerate(tset.models)},
        roles={r: int((u.worker_role == i).sum()) for i, r in enumerate(labels.ROLES)},
        files=tset.hashed_files(), path=tset.path, window_s=window_ns // NS, windows=windows,
        request_id_unique="within each window",
    )
    facts.workers_without_samples = sorted(set(tset.workers) - set(ranks))
    if n:
        facts.span_start_ns, facts.span_end_ns = span[0], span[1]
        facts.span_s = (span[1] - span[0]) / 1e9
    return facts
