"""One pass over a chunk of requests for every config of a grid.

Why it is cheap (README, "How it works"): for one request the snapshot, the
fleet's queue readings and the prepared candidates do not depend on the queue
limit or the floor.  A limit ``L`` only matters through *which* fleet workers
read ``waiting >= L``, so limits that leave the same workers gated form one
"limit class"; a floor only matters through whether it is set and whether some
fleet worker reads below it, and only when the limit gates some candidate
(otherwise neither the fell-back tier nor the pin can fire).  Configs of the
same other knobs ("group") and the same classes make the same decision (the
sampler's draws do not depend on the config, see docs/replay-model.md), so
each request computes every distinct outcome once and the other configs refer
to it.  The domain rungs depend on the limit class alone and are shared the
same way.  ``stats`` counts both, so a run can report how much was shared.
"""

from __future__ import annotations

import numba
import numpy as np

from ._jit import njit, njit_parallel
from .decide import (
    A_ADM_REJECTED,
    A_ALL_QUEUED,
    A_BEST_REJECTED,
    A_COMPARED,
    A_EVALUATED,
    A_FELL_BACK,
    A_GATE_REJECTED,
    A_NCOLS,
    A_OVERRIDES,
    A_REASON,
    A_SOURCE,
    C_NCOLS,
    locality_nb,
    C_WORKER,
    cache_rung_with_nb,
    domain_rungs_nb,
    failure_of_nb,
    prepare_candidates_nb,
)
from .accumulate import accumulate_request_nb, book_block_constants_nb
from .snapshot import (
    S_BASIC,
    S_NATIVE,
    S_NCOLS,
    S_WAITING,
    S_WU,
    advance_dirty_nb,
    fleet_reading_nb,
    refresh_nb,
)

from .columns import (  # noqa: E402  (re-exported: results.py and engine.py read them here)
    O_ADM_REJECTED,
    O_ALL_QUEUED,
    O_BEST_REJECTED,
    O_COMPARED,
    O_DECISION,
    O_EVALUATED,
    O_FAILURE,
    O_FELL_BACK,
    O_GATE_REJECTED,
    O_MATCHED,
    O_NCOLS,
    O_OVERRIDES,
    O_POLICY_REASON,
    O_REASON,
    O_SEL_WAITING,
    O_SEL_WU,
    O_SELECTED_BLOCKS,
    O_SOURCE,
    O_UNCACHED,
    O_WORKER,
)

# policy reason of a DecisionReason code (labels.reason_to_policy_reason as a table)
_POLICY_OF_REASON = np.array([2, 0, 3, 4, 5, 6, 1], dtype=np.int64)


@njit
def split_states_nb(ptr, block_ts, load_ts, load_worker, load_rank, load_running, load_waiting,
                    load_tokens, load_maxtot, load_tail, load_wu, load_total, load_maxrun,
                    load_ptok, load_pbusy, load_inflight, dp_size, table, inflight, tables,
                    inflights, ptrs):
    """Per-block starting states for a chunk (a sequential pre-pass over the loads only).

    Block ``b`` starts from every sample with ``ts <= block_ts[b]`` (its first
    request's time); ``table``/``inflight``/``ptr`` enter at the chunk's start
    and are left at the last block's start.
    """
    dirty = np.zeros(inflight.shape[0], dtype=np.bool_)
    for b in range(block_ts.shape[0]):
        ptr = advance_dirty_nb(ptr, block_ts[b], load_ts, load_worker, load_rank, load_running,
                               load_waiting, load_tokens, load_maxtot, load_tail, load_wu,
                               load_total, load_maxrun, load_ptok, load_pbusy, load_inflight,
                               dp_size, table, inflight, dirty)
        tables[b] = table
        inflights[b] = inflight
        ptrs[b] = ptr
    return ptr


@njit
def _count_below(values, n, bound):
    """How many of ``values[:n]`` are below ``bound`` (absent readings are stored huge)."""
    cnt = 0
    for x in range(n):
        cnt += values[x] < bound
    return cnt


@njit
def _decide_request(req_index, L, qb, best_prefix, m_worker, m_blocks, in_fleet, fleet, snap,
                    est, cfg_i, cfg_f, cfg_group, cfg_li, cfg_fi, lim_vals, fl_vals, seed,
                    res_i, res_f, src_of, memo, lclass, fclass, fleet_wait, audit, scratch_i, cands,
                    group_n, group_rep, gated_any, ladder_w, ladder_r, seen):
    """Decide one request under every config.

    Each distinct outcome is computed once, into the column ``res_i[:, c]`` /
    ``res_f[c]`` of the first config ``c`` that reaches it; ``src_of[c]`` names
    the column holding config ``c``'s decision.  Candidates are prepared once
    per knob group (``cands[g]``, ``group_n[g]``; ``group_rep[g]`` is a config
    of the group).
    """
    n_fleet = fleet.shape[0]
    n_cfg = cfg_i.shape[0]
    # limit classes: number of fresh fleet workers reading below the limit;
    # floor classes: unset, nobody fresh below it, somebody fresh below it
    big = np.int64(1) << 62
    n_absent = 0
    for j in range(n_fleet):
        w = fleet[j]
        if snap[w, S_BASIC] == 1:
            fleet_wait[j] = snap[w, S_WAITING]
        else:
            fleet_wait[j] = big
            n_absent += 1
    for j in range(lim_vals.shape[0]):
        lim = lim_vals[j]
        lclass[j] = 0 if lim < 0 else _count_below(fleet_wait, n_fleet, lim) + 1
    for j in range(fl_vals.shape[0]):
        fl = fl_vals[j]
        if fl < 0:
            fclass[j] = 0
        else:
            fclass[j] = 2 if _count_below(fleet_wait, n_fleet, fl) > 0 else 1
    has_signal = qb > 0
    matched = 0
    if has_signal and m_worker.shape[0] > 0:
        matched = min(best_prefix, qb)
    # candidates once per knob group; whether a limit gates any of them (when
    # none is gated, neither the fell-back tier nor the pin can fire, so the
    # floor cannot change the outcome)
    for g in range(group_n.shape[0]):
        c0 = group_rep[g]
        n = 0
        if has_signal and m_worker.shape[0] > 0:
            n = prepare_candidates_nb(L, qb, m_worker, m_blocks, in_fleet, n_fleet, snap, est,
                                      cfg_i[c0, 6], cfg_f[c0, 2], cfg_i[c0, 7], cfg_f[c0, 3],
                                      cfg_i[c0, 8], seen, cands[g], scratch_i[0])
        group_n[g] = n
        for j in range(lim_vals.shape[0]):
            lim = lim_vals[j]
            gated = False
            if lim >= 0:
                for t in range(n):
                    w = cands[g, t, C_WORKER]
                    if snap[w, S_BASIC] == 1 and snap[w, S_WAITING] >= lim:
                        gated = True
                        break
            gated_any[g, j] = gated
    width = n_fleet + 2
    used = 0
    n_ladder = 0
    for c in range(n_cfg):
        g = cfg_group[c]
        li = cfg_li[c]
        fc = fclass[cfg_fi[c]] if gated_any[g, li] else 0
        key = (g * width + lclass[li]) * 3 + fc
        src = memo[key]
        if src >= 0:
            src_of[c] = src
            continue
        memo[key] = c
        src_of[c] = c
        scratch_i[6, used] = key
        used += 1
        cand = cands[g]
        lim = cfg_i[c, 0]
        all_queued = lim >= 0 and n_fleet > 0 and n_absent == 0 and lclass[li] == 1
        w, reason, decision = cache_rung_with_nb(
            group_n[g], cand, L, snap, est, lim, cfg_i[c, 1], cfg_i[c, 3], cfg_i[c, 4] == 1,
            cfg_i[c, 5], cfg_f[c, 0], cfg_f[c, 1], audit, scratch_i, all_queued,
            fclass[cfg_fi[c]] == 2)
        failure = -1
        if w < 0:
            # the domain rungs depend on (group, limit class) only: computed once
            lk = g * width + lclass[li]
            if ladder_w[lk] == -2:
                lw, lr = domain_rungs_nb(fleet, snap, est, L, cfg_i[c, 0], cfg_i[c, 2], seed,
                                         req_index, scratch_i)
                ladder_w[lk] = lw
                ladder_r[lk] = lr
                scratch_i[7, n_ladder] = lk
                n_ladder += 1
            w = ladder_w[lk]
            reason = ladder_r[lk]
            if w < 0:
                decision = -1
                failure = failure_of_nb(group_n[g] > 0, n_fleet)
        row = res_i[:, c]
        row[O_WORKER] = w
        row[O_REASON] = reason
        row[O_POLICY_REASON] = _POLICY_OF_REASON[reason] if reason >= 0 else -1
        row[O_DECISION] = decision
        row[O_FAILURE] = failure
        row[O_MATCHED] = matched
        resolved = audit[A_REASON] != -2
        row[O_GATE_REJECTED] = audit[A_GATE_REJECTED]
        row[O_EVALUATED] = audit[A_EVALUATED]
        row[O_ADM_REJECTED] = audit[A_ADM_REJECTED]
        row[O_BEST_REJECTED] = audit[A_BEST_REJECTED]
        row[O_ALL_QUEUED] = audit[A_ALL_QUEUED]
        row[O_FELL_BACK] = audit[A_FELL_BACK]
        row[O_COMPARED] = audit[A_COMPARED]
        row[O_OVERRIDES] = audit[A_OVERRIDES]
        row[O_SOURCE] = audit[A_SOURCE] if resolved else -1
        if w >= 0:
            _q, _m, sel_blocks, uncached = locality_nb(L, qb, best_prefix, m_worker, m_blocks, w)
            row[O_SELECTED_BLOCKS] = sel_blocks
            row[O_UNCACHED] = uncached
            row[O_SEL_WAITING] = snap[w, S_WAITING] if snap[w, S_BASIC] == 1 else -1
            row[O_SEL_WU] = snap[w, S_WU] if snap[w, S_NATIVE] == 1 else -1
            res_f[c] = est[w]
        else:
            row[O_SELECTED_BLOCKS] = 0
            row[O_UNCACHED] = -1
            row[O_SEL_WAITING] = -1
            row[O_SEL_WU] = -1
            res_f[c] = np.nan
    for u in range(used):
        memo[scratch_i[6, u]] = -1
    for u in range(n_ladder):
        ladder_w[scratch_i[7, u]] = -2
    return used, n_ladder


@njit_parallel
def run_chunk_nb(block_lo, ptrs, tables, inflights, req_ts, req_index, req_L, req_qb, req_best,
                 req_model, req_selected, m_off, m_worker, m_blocks, in_fleet, fleet_off, fleet_w,
                 load_ts, load_worker, load_rank, load_running, load_waiting, load_tokens,
                 load_maxtot, load_tail, load_wu, load_total, load_maxrun, load_ptok, load_pbusy,
                 load_inflight, dp_size, freshness, cfg_i, cfg_f, cfg_group, cfg_li, cfg_fi,
                 lim_vals, fl_vals, n_groups, parent, seed, max_matches, keep, out_i, out_f,
                 fleet_min, fleet_fresh, acc, hist_wait, hist_div, stats):
    """Replay a chunk of requests under every config, one block of requests per thread.

    Block ``b`` covers requests ``block_lo[b]..block_lo[b+1]`` and starts from
    ``tables[b]``/``inflights[b]``/``ptrs[b]`` (``split_states_nb``); it sweeps
    its own loads, keeps its own snapshot current (``refresh_nb``), decides
    every config and books the results into its own accumulators
    ``acc[b]``... (merged exactly afterwards); ``stats[b]`` counts the distinct
    outcomes and domain-rung evaluations it computed.  With ``keep``, every decision
    is also written to ``out_i[i, c, O_*]`` / ``out_f[i, c]``.  Results depend
    on nothing but (trace, config, seed), never on threads or chunking.
    ``out_i`` is column-major, ``out_i[O_*, request, config]``, so each output
    column is one contiguous array.  ``fleet_min[i]``/``fleet_fresh[i]`` get the
    request's fleet readings as ``replay/fleet.py`` defines them (smallest fresh
    basic waiting count of its fleet, -1 when none; fleet workers with one).
    """
    n_blocks = block_lo.shape[0] - 1
    n_workers = tables.shape[1]
    max_fleet = 0
    for m in range(fleet_off.shape[0] - 1):
        max_fleet = max(max_fleet, fleet_off[m + 1] - fleet_off[m])
    memo_size = n_groups * (max_fleet + 2) * 3
    n_cfg = cfg_i.shape[0]
    width = max(n_workers, max_matches, n_cfg, 1) + 1
    for b in numba.prange(n_blocks):
        table = tables[b]
        inflight = inflights[b]
        ptr = ptrs[b]
        snap = np.zeros((n_workers, S_NCOLS), dtype=np.int64)
        est = np.full(n_workers, np.nan)
        oldest = np.zeros(n_workers, dtype=np.int64)
        dirty = np.ones(n_workers, dtype=np.bool_)
        memo = np.full(memo_size, -1, dtype=np.int64)
        lclass = np.zeros(lim_vals.shape[0], dtype=np.int64)
        fclass = np.zeros(fl_vals.shape[0], dtype=np.int64)
        fleet_wait = np.zeros(max(max_fleet, 1), dtype=np.int64)
        audit = np.zeros(A_NCOLS, dtype=np.int64)
        scratch_i = np.zeros((8, width), dtype=np.int64)
        ladder_w = np.full(n_groups * (max_fleet + 2), -2, dtype=np.int64)
        ladder_r = np.zeros(n_groups * (max_fleet + 2), dtype=np.int64)
        seen = np.zeros(n_workers, dtype=np.bool_)
        res_i = np.zeros((O_NCOLS, n_cfg), dtype=np.int64)
        src_of = np.zeros(n_cfg, dtype=np.int64)
        cands = np.zeros((n_groups, max(max_matches, 1), C_NCOLS), dtype=np.int64)
        group_n = np.zeros(n_groups, dtype=np.int64)
        group_rep = np.full(n_groups, -1, dtype=np.int64)
        for c in range(n_cfg):
            if group_rep[cfg_group[c]] < 0:
                group_rep[cfg_group[c]] = c
        gated_any = np.zeros((n_groups, lim_vals.shape[0]), dtype=np.bool_)
        res_f = np.zeros(n_cfg, dtype=np.float64)
        s_rung = 0
        s_ladder = 0
        for i in range(block_lo[b], block_lo[b + 1]):
            now = req_ts[i]
            ptr = advance_dirty_nb(ptr, now, load_ts, load_worker, load_rank, load_running,
                                   load_waiting, load_tokens, load_maxtot, load_tail, load_wu,
                                   load_total, load_maxrun, load_ptok, load_pbusy, load_inflight,
                                   dp_size, table, inflight, dirty)
            refresh_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty)
            mdl = req_model[i]
            fleet = fleet_w[fleet_off[mdl]:fleet_off[mdl + 1]]
            lo = m_off[i]
            hi = m_off[i + 1]
            n_rung, n_ladder = _decide_request(req_index[i], req_L[i], req_qb[i], req_best[i], m_worker[lo:hi],
                            m_blocks[lo:hi], in_fleet[mdl], fleet, snap, est, cfg_i, cfg_f,
                            cfg_group, cfg_li, cfg_fi, lim_vals, fl_vals, seed, res_i, res_f,
                            src_of, memo, lclass, fclass, fleet_wait, audit, scratch_i, cands,
                            group_n, group_rep, gated_any, ladder_w, ladder_r, seen)
            s_rung += n_rung
            s_ladder += n_ladder
            fleet_min[i], fleet_fresh[i] = fleet_reading_nb(snap, fleet)
            sel = req_selected[i] if req_selected.shape[0] > 0 else -1
            accumulate_request_nb(acc, hist_wait, hist_div, b, res_i, res_f, src_of, parent,
                                  req_qb[i], sel)
            if keep:
                for c in range(n_cfg):
                    src = src_of[c]
                    for col in range(O_NCOLS):
                        out_i[col, i, c] = res_i[col, src]
                    out_f[i, c] = res_f[src]
        n_sel = 0
        if req_selected.shape[0] > 0:
            for i in range(block_lo[b], block_lo[b + 1]):
                n_sel += req_selected[i] >= 0
        book_block_constants_nb(acc, b, parent, block_lo[b + 1] - block_lo[b], n_sel)
        stats[b, 0] += s_rung  # once per block: neighbouring blocks share a cache line
        stats[b, 1] += s_ladder
        ptrs[b] = ptr
