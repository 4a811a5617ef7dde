"""One pass over a chunk of requests for every config of a grid.

Why it is cheap (docs/engine.md): for one request the snapshot, the fleet's
queue readings and the prepared candidates do not depend on the queue limit
or the floor.  A limit ``L`` only matters through *which* fleet workers read
``waiting >= L``, so limits that leave the same workers gated are one "limit
class"; a floor only matters through whether it is set and whether some fleet
worker reads below it.  Configs of the same other knobs ("group") and the
same classes make the same decision (the sampler's draws do not depend on the
config, see docs/replay-model.md), so each request computes every distinct
(group, limit class, floor class) once and copies it to the other configs.
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
    select_prefill_nb,
)
from .snapshot import S_BASIC, S_NATIVE, S_NCOLS, S_WAITING, S_WU, advance_nb, capture_all_nb

# Integer output columns of out_i[request, config, column]; the float column
# (selected_queue_ms) lives in out_f[request, config].
O_WORKER = 0
O_REASON = 1
O_POLICY_REASON = 2
O_DECISION = 3
O_FAILURE = 4
O_MATCHED = 5
O_SELECTED_BLOCKS = 6
O_UNCACHED = 7
O_GATE_REJECTED = 8
O_EVALUATED = 9
O_ADM_REJECTED = 10
O_BEST_REJECTED = 11
O_ALL_QUEUED = 12
O_FELL_BACK = 13
O_COMPARED = 14
O_OVERRIDES = 15
O_SOURCE = 16
O_SEL_WAITING = 17
O_SEL_WU = 18
O_NCOLS = 19

# policy reason of a DecisionReason code (labels.reason_to_policy_reason as a table)
_POLICY_OF_REASON = np.array([2, 0, 3, 4, 5, 6, 1], dtype=np.int64)


@njit
def snapshot_chunk_nb(ptr, req_ts, freshness, load_ts, load_worker, load_rank, load_running,
                      load_waiting, load_tokens, load_maxtot, load_tail, load_wu, load_total,
                      load_maxrun, load_ptok, load_pbusy, load_inflight, dp_size, table, inflight,
                      snap, est):
    """Sweep load samples up to each request of the chunk and capture its snapshot."""
    for i in range(req_ts.shape[0]):
        ptr = advance_nb(ptr, req_ts[i], load_ts, load_worker, load_rank, load_running,
                         load_waiting, load_tokens, load_maxtot, load_tail, load_wu, load_total,
                         load_maxrun, load_ptok, load_pbusy, load_inflight, dp_size, table,
                         inflight)
        capture_all_nb(table, inflight, dp_size, req_ts[i], freshness, snap[i], est[i])
    return ptr


@njit
def _decide_request(i, req_index, L, qb, best_prefix, m_worker, m_blocks, in_fleet, fleet, snap,
                    est, cfg_i, cfg_f, cfg_group, cfg_li, cfg_fi, lim_vals, fl_vals, seed,
                    out_i, out_f, memo, lclass, fclass, audit, scratch_i, cand, seen):
    n_fleet = fleet.shape[0]
    n_cfg = cfg_i.shape[0]
    # limit classes: number of fresh fleet workers reading below the limit
    for j in range(lim_vals.shape[0]):
        lim = lim_vals[j]
        if lim < 0:
            lclass[j] = 0
        else:
            cnt = 0
            for w in fleet:
                if snap[w, S_BASIC] == 1 and snap[w, S_WAITING] < lim:
                    cnt += 1
            lclass[j] = cnt + 1
    for j in range(fl_vals.shape[0]):
        fl = fl_vals[j]
        if fl < 0:
            fclass[j] = 0
        else:
            below = False
            for w in fleet:
                if snap[w, S_BASIC] == 1 and snap[w, S_WAITING] < fl:
                    below = True
                    break
            fclass[j] = 2 if below else 1
    has_signal = qb > 0
    matched = 0
    if has_signal and m_worker.shape[0] > 0:
        matched = min(best_prefix, qb)
    width = n_fleet + 2
    used = 0
    for c in range(n_cfg):
        key = (cfg_group[c] * width + lclass[cfg_li[c]]) * 3 + fclass[cfg_fi[c]]
        src = memo[key]
        if src >= 0:
            for col in range(O_NCOLS):
                out_i[i, c, col] = out_i[i, src, col]
            out_f[i, c] = out_f[i, src]
            continue
        memo[key] = c
        scratch_i[6, used] = key
        used += 1
        w, reason, decision, failure = select_prefill_nb(
            L, qb, m_worker, m_blocks, in_fleet, fleet, snap, est,
            cfg_i[c, 0], cfg_i[c, 1], cfg_i[c, 2], cfg_i[c, 3], cfg_i[c, 4] == 1, cfg_i[c, 5],
            cfg_f[c, 0], cfg_f[c, 1], cfg_i[c, 6], cfg_f[c, 2], cfg_i[c, 7], cfg_f[c, 3],
            cfg_i[c, 8], seed, req_index, audit, scratch_i, cand, seen)
        row = out_i[i, c]
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
            out_f[i, c] = est[w]
        else:
            row[O_SELECTED_BLOCKS] = 0
            row[O_UNCACHED] = -1
            row[O_SEL_WAITING] = -1
            row[O_SEL_WU] = -1
            out_f[i, c] = np.nan
    for u in range(used):
        memo[scratch_i[6, u]] = -1


@njit_parallel
def decide_chunk_nb(req_index, req_L, req_qb, req_best, req_model, m_off, m_worker, m_blocks,
                    in_fleet, fleet_off, fleet_w, snap, est, cfg_i, cfg_f, cfg_group, cfg_li,
                    cfg_fi, lim_vals, fl_vals, n_groups, seed, max_matches, out_i, out_f, n_blocks):
    """Decide every request of the chunk under every config (parallel over request blocks).

    ``req_index[i]`` is row ``i``'s request index for the generator (its position
    in the whole time-sorted trace); results depend on nothing but (trace,
    config, seed), never on threads or chunking.
    """
    n = req_L.shape[0]
    n_workers = snap.shape[1]
    max_fleet = 0
    for m in range(fleet_off.shape[0] - 1):
        max_fleet = max(max_fleet, fleet_off[m + 1] - fleet_off[m])
    width = max(n_workers, max_matches, 1) + 1
    memo_size = n_groups * (max_fleet + 2) * 3
    n_cfg = cfg_i.shape[0]
    step = (n + n_blocks - 1) // n_blocks
    for blk in numba.prange(n_blocks):
        lo = blk * step
        hi = min(n, lo + step)
        memo = np.full(memo_size, -1, dtype=np.int64)
        lclass = np.zeros(lim_vals.shape[0], dtype=np.int64)
        fclass = np.zeros(fl_vals.shape[0], dtype=np.int64)
        audit = np.zeros(A_NCOLS, dtype=np.int64)
        scratch_i = np.zeros((7, max(width, n_cfg)), dtype=np.int64)
        cand = np.zeros((max(max_matches, 1), C_NCOLS), dtype=np.int64)
        seen = np.zeros(n_workers, dtype=np.bool_)
        for i in range(lo, hi):
            mdl = req_model[i]
            fleet = fleet_w[fleet_off[mdl]:fleet_off[mdl + 1]]
            a = m_off[i]
            b = m_off[i + 1]
            _decide_request(i, req_index[i], req_L[i], req_qb[i], req_best[i],
                            m_worker[a:b], m_blocks[a:b], in_fleet[mdl], fleet, snap[i], est[i],
                            cfg_i, cfg_f, cfg_group, cfg_li, cfg_fi, lim_vals, fl_vals, seed,
                            out_i, out_f, memo, lclass, fclass, audit, scratch_i, cand, seen)
