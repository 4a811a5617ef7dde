"""Decision kernels of the reorg routing engine (ROUTER_REORG.md, line A: ``--chat-routing reorg``).

The same conventions as ``kernels/decide.py`` (snapshot ``snap[w, S_*]`` and
``est[w]`` by worker id, None knobs as -1 / NaN).  The reorg cache policy's
resolution is legacy's with other hard admission (``decide.resolve_cache_with_nb``
given a ``cap``); what is the reorg's own lives here: candidate gathering with
duplicate matches merged by depth over a group (3.3), the miss fallback's
power-of-N / power-of-two draw and ranking (3.9, 4), the factory buckets (2)
and the replay's outcome codes (``labels.REORG_OUTCOMES``).  The pure-Python
``replay/reference.py`` (``select_reorg``) implements the same sections.
"""

from __future__ import annotations

import math

import numpy as np

from replay import labels
from replay.config import KNOBS
from replay.kernels._jit import njit
from replay.kernels.decide import (
    A_ADM_REJECTED,
    A_FELL_BACK,
    A_NCOLS,
    A_PIN_REJECTED,
    A_REASON,
    A_SOURCE,
    C_BLOCKS,
    C_BUDGET,
    C_E,
    C_H,
    C_WORKER,
    _cmp_int,
    any_fresh_queue_below_nb,
    candidate_limit_nb,
    cmp_pair_nb,
    cmp_tuple_nb,
    fleet_all_queued_nb,
    gate_admits_nb,
    resolve_cache_with_nb,
    sort_candidates_nb,
)
from replay.kernels.rng import draw_at_nb, draw_key_nb
from replay.kernels.snapshot import S_INFLIGHT, S_NATIVE, S_WAITING

REORG = KNOBS["chat_routing"].choices.index("reorg")
RANK_SET = KNOBS["variant_reorg_ranking"].choices.index("power-of-n")
RANK_TWO = KNOBS["variant_reorg_ranking"].choices.index("power-of-two")
DEFAULT_CHOICES = 2

CACHE_WIN = labels.REORG_CACHE_WIN
PIN = labels.REORG_SATURATION_PIN
MISS = labels.REORG_MISS_FALLBACK
NO_ADMISSIBLE = labels.REORG_NO_ADMISSIBLE
NO_WORKERS = labels.REORG_NO_WORKERS
CACHE_CANDIDATE = labels.CACHE_CANDIDATE
SATURATION_PIN = labels.SATURATION_PIN


@njit(allocates=False)
def admits_nb(snap, w, cap):
    """ROUTER_REORG.md 3.5: the in-flight cap (-1 = none) on the router-local count."""
    return cap < 0 or snap[w, S_INFLIGHT] < cap


@njit(allocates=False)
def merged_blocks_nb(m_worker, m_blocks, w):
    """A worker's deepest match entry (3.3 step 1; 0 without one)."""
    d = 0
    for e in range(m_worker.shape[0]):
        if m_worker[e] == w and m_blocks[e] > d:
            d = m_blocks[e]
    return d


@njit(allocates=False)
def is_key_nb(m_worker, w):
    for e in range(m_worker.shape[0]):
        if m_worker[e] == w:
            return True
    return False


@njit(allocates=False)
def prepare_nb(L, qb, m_worker, m_blocks, group, snap, est, min_tokens, min_ratio, cmin, cratio, cmax,
               cand, tmp_workers):
    """3.3: fill ``cand`` with the group's candidates in sort order; return K or fewer (0: a miss).

    The caller has checked the signal (``qb > 0`` and a match entry).  The sort
    key is legacy's seed order: ``H`` descending is ``E`` ascending at one ``L``.
    """
    n = 0
    for j in range(group.shape[0]):
        w = group[j]
        if not is_key_nb(m_worker, w):
            continue
        blocks = min(merged_blocks_nb(m_worker, m_blocks, w), qb)
        if blocks <= 0:
            continue
        H = (L * blocks) // qb
        if min_tokens >= 0 and H < min_tokens:
            continue
        if not math.isnan(min_ratio) and H / max(L, 1) < min_ratio:
            continue
        cand[n, C_WORKER] = w
        cand[n, C_H] = H
        cand[n, C_E] = L - H
        cand[n, C_BLOCKS] = blocks
        cand[n, C_BUDGET] = -1
        n += 1
    if n == 0:
        return 0
    sort_candidates_nb(snap, est, cand, n, tmp_workers)
    return min(n, candidate_limit_nb(group.shape[0], cmin, cratio, cmax))


@njit(allocates=False)
def _set_less(snap, est, a, b, engine, all_est):
    """3b33a3d2's set-wide ranking: ``a`` strictly below ``b``."""
    if engine:
        if all_est and est[a] != est[b]:
            return est[a] < est[b]
        c = cmp_tuple_nb(snap, a, b)
        if c != 0:
            return c < 0
    return _cmp_int(snap[a, S_INFLIGHT], snap[b, S_INFLIGHT]) < 0


@njit(allocates=False)
def load_pick_nb(snap, est, pool, n, n_choices, ranking, key, draw):
    """ROUTER_REORG.md 4: the load-only pick over ``pool[:n]`` (n >= 1; ``pool`` is
    scratch and is shuffled in place).  Returns (worker, next draw index)."""
    if ranking == RANK_TWO:
        if n == 1:
            return pool[0], draw
        i = np.int64(draw_at_nb(key, draw) % np.uint64(n))
        j = np.int64(draw_at_nb(key, draw + 1) % np.uint64(n - 1))
        if j >= i:
            j += 1
        a = pool[i]
        b = pool[j]
        return (b if cmp_pair_nb(snap, est, a, b) > 0 else a), draw + 2
    m = min(n_choices if n_choices > 0 else DEFAULT_CHOICES, n)
    for i in range(m):   # partial Fisher-Yates: pool[:m] is the sample, in sample order
        j = i + np.int64(draw_at_nb(key, draw) % np.uint64(n - i))
        draw += 1
        t = pool[i]
        pool[i] = pool[j]
        pool[j] = t
    best = pool[0]
    if ranking == RANK_SET:
        engine = True
        all_est = True
        for s in range(m):
            w = pool[s]
            if snap[w, S_NATIVE] == 0:
                engine = False
            if math.isnan(est[w]):
                all_est = False
        for s in range(1, m):
            if _set_less(snap, est, pool[s], best, engine, engine and all_est):
                best = pool[s]
    else:
        for s in range(1, m):
            if cmp_pair_nb(snap, est, best, pool[s]) > 0:
                best = pool[s]
    return best, draw


@njit(allocates=False)
def pick_nb(n, cand, L, group, snap, est, limit, floor, margin, guard, abs_tokens, abs_ms, rel, cap,
            n_choices, ranking, key, draw, audit, scratch_i, all_queued, any_below):
    """3 (``CacheAwarePolicy::pick``) over one non-empty group, its ``n`` candidates
    prepared in ``cand``; ``all_queued`` / ``any_below`` are the group's readings
    under the limit and floor.  Returns (worker, reason, outcome, next draw index):
    outcome ``NO_ADMISSIBLE`` (worker -1) when the bucket fails.  ``audit`` as
    ``decide.resolve_cache_with_nb`` (A_REASON = -2 when no resolution ran)."""
    for j in range(A_NCOLS):
        audit[j] = 0
    audit[A_REASON] = -2
    audit[A_SOURCE] = -1
    if n > 0:
        w = resolve_cache_with_nb(cand, n, L, snap, est, limit, floor, margin, guard, abs_tokens, abs_ms,
                                  rel, audit, scratch_i[1], scratch_i[2], scratch_i[3], scratch_i[4],
                                  all_queued, any_below, S_WAITING, False, cap)
        if w >= 0:
            # the saturated tier is Pick.reason saturation_pin, legacy's CacheCandidate tier
            reason = audit[A_REASON]
            if reason == SATURATION_PIN or audit[A_FELL_BACK] == 1:
                return w, reason, PIN, draw
            return w, reason, CACHE_WIN, draw
        if audit[A_ADM_REJECTED] + audit[A_PIN_REJECTED] > 0:
            return -1, -1, NO_ADMISSIBLE, draw
    # 3.9: the unqueued tier in group order, else the whole group
    pool = scratch_i[10]
    m = 0
    for j in range(group.shape[0]):
        if gate_admits_nb(snap, group[j], limit, S_WAITING):
            pool[m] = group[j]
            m += 1
    if m == 0:
        for j in range(group.shape[0]):
            pool[j] = group[j]
        m = group.shape[0]
    w, draw = load_pick_nb(snap, est, pool, m, n_choices, ranking, key, draw)
    if not admits_nb(snap, w, cap):
        return -1, -1, NO_ADMISSIBLE, draw
    return w, -1, MISS, draw


@njit(allocates=False)
def group_pick_nb(L, qb, m_worker, m_blocks, group, snap, est, knobs, c, key, draw, audit, scratch_i, cand):
    """Prepare and pick over one non-empty group under config ``c`` of ``knobs``."""
    n = 0
    if qb > 0 and m_worker.shape[0] > 0:
        n = prepare_nb(L, qb, m_worker, m_blocks, group, snap, est,
                       knobs.cache_affinity_min_matched_tokens[c], knobs.cache_affinity_min_match_ratio[c],
                       knobs.cache_candidate_min_workers[c], knobs.cache_candidate_ratio[c],
                       knobs.cache_candidate_max_workers[c], cand, scratch_i[0])
    limit = knobs.worker_queue_limit[c]
    floor = knobs.saturation_queue_floor[c]
    return pick_nb(n, cand, L, group, snap, est, limit, floor, knobs.cache_switch_margin_tokens[c],
                   knobs.pressure_guard[c] == 1, knobs.pressure_abs_threshold_tokens[c],
                   knobs.pressure_abs_threshold_ms[c], knobs.pressure_rel_threshold[c],
                   knobs.max_in_flight[c], knobs.power_of_n_choices[c], knobs.variant_reorg_ranking[c],
                   key, draw, audit, scratch_i, fleet_all_queued_nb(snap, group, limit, S_WAITING),
                   floor >= 0 and any_fresh_queue_below_nb(snap, group, floor, S_WAITING))


@njit(allocates=False)
def split_groups_nb(fleet, plain, scratch_i):
    """The factory buckets' groups (2; 1.4): the plain engines, then the prefill
    engines, each in id order, in ``scratch_i[11]`` / ``scratch_i[12]``; returns their sizes."""
    n0 = 0
    n1 = 0
    for j in range(fleet.shape[0]):
        w = fleet[j]
        if plain[w]:
            scratch_i[11, n0] = w
            n0 += 1
        else:
            scratch_i[12, n1] = w
            n1 += 1
    return n0, n1


@njit(allocates=False)
def select_reorg_nb(L, qb, m_worker, m_blocks, fleet, plain, snap, est, knobs, c, seed, req_index,
                    audit, scratch_i, cand):
    """ROUTER_REORG.md section 8 ``reorg_select`` for config ``c``: (worker, reason, outcome).

    ``plain[w]``: worker ``w`` is a plain engine (else a prefill engine of the
    ``pd`` bucket).  ``scratch_i`` needs 13 rows as wide as the worker ids and
    matches; ``cand`` a row per match entry.  A bucket whose pick fails passes
    to the next; the draws continue one stream (``reference.select_reorg``).
    """
    n0, n1 = split_groups_nb(fleet, plain, scratch_i)
    key = draw_key_nb(seed, req_index)
    draw = 0
    rejected = False
    for b in range(2):
        size = n0 if b == 0 else n1
        if size == 0:
            continue
        group = scratch_i[11 + b, :size]
        w, reason, outcome, draw = group_pick_nb(L, qb, m_worker, m_blocks, group, snap, est, knobs, c,
                                                 key, draw, audit, scratch_i, cand)
        if w >= 0:
            return w, reason, outcome
        rejected = True
    # a failed selection keeps no resolution (as reference.select_reorg)
    for j in range(A_NCOLS):
        audit[j] = 0
    audit[A_REASON] = -2
    audit[A_SOURCE] = -1
    return -1, -1, (NO_ADMISSIBLE if rejected else NO_WORKERS)
