"""Decision kernels: one prefill selection (ROUTER_SEMANTICS.md sections 2-5).

Everything here sees a captured snapshot (``snap[w, S_*]`` int64 and
``est[w]`` float64, indexed by worker id), the request's scalars and one
config's knobs.  Worker ids are ascending in the router's stable-id order, so
"worker id" tie-breaks are integer comparisons.  None-valued knobs arrive as
-1 (integers) or NaN (floats).

Each function names the spec section it implements; the pure-Python
``replay/reference.py`` implements the same sections independently.
"""

from __future__ import annotations

import math

import numpy as np

from replay import labels
from replay.config import KNOBS
from replay.kernels._jit import njit, njit_inner, popcount, trailing_zeros
from replay.kernels.rng import draw_at_nb, draw_key_nb
from replay.kernels.snapshot import (
    S_BASIC,
    S_INFLIGHT,
    S_MAXRUN,
    S_MAXTOT,
    S_NATIVE,
    S_RUNNING,
    S_TOTAL,
    S_WAITING,
    S_WAITING_PER_RANK,
    S_WU,
)

# label codes as module constants numba can freeze
PRIMARY = labels.PRIMARY
CACHE_CANDIDATE = labels.CACHE_CANDIDATE
BACKUP_PRIMARY_ADMISSION = labels.BACKUP_PRIMARY_ADMISSION
RANGE_FALLBACK = labels.RANGE_FALLBACK
CAPACITY_FALLBACK = labels.CAPACITY_FALLBACK_POWER_OF_TWO
SATURATION_PIN = labels.SATURATION_PIN
CACHE_HIT = labels.CACHE_HIT
CACHE_MISS = labels.CACHE_MISS
CACHE_WORKER_QUEUED = labels.CACHE_WORKER_QUEUED
ALL_QUEUED = labels.ALL_QUEUED
FAIL_PREFILL = labels.FAIL_PREFILL_ADMISSION_EXHAUSTED
FAIL_CACHE = labels.FAIL_CACHE_CANDIDATES_EXHAUSTED
FAIL_EMPTY = labels.FAIL_PROPOSAL_EMPTY
SRC_MS = labels.SRC_ESTIMATED_MS
SRC_TOKENS = labels.SRC_NATIVE_TOKENS
SRC_LOCAL = labels.SRC_ROUTER_LOCAL
NO_LOSS = labels.NO_LOSS
LOST_CANDIDATES = labels.LOST_CANDIDATES
LOST_QUEUE_GATE = labels.LOST_QUEUE_GATE
LOST_CAPACITY = labels.LOST_CAPACITY
LOST_PIN = labels.LOST_PIN
LOST_TOURNAMENT = labels.LOST_TOURNAMENT
LOST_FALLBACK = labels.LOST_FALLBACK

# Candidate table columns (int64), one row per prepared candidate.
C_WORKER = 0
C_H = 1          # matched_prefix_tokens
C_E = 2          # uncached_tokens
C_BLOCKS = 3     # capped matched blocks
C_BUDGET = 4     # max_pending_prefill_tokens, -1 = None
C_NCOLS = 5

# Resolution audit (int64 vector), section 3.9.
A_SELECTED = 0
A_REASON = 1
A_EVALUATED = 2
A_ADM_REJECTED = 3
A_GATE_REJECTED = 4
A_BEST_REJECTED = 5
A_FELL_BACK = 6
A_ALL_QUEUED = 7
A_COMPARED = 8
A_OVERRIDES = 9
A_SOURCE = 10
# depths (capped matched blocks) of the deepest candidate of each set, for the
# locality waterfall: prepared, gate-evaluated, capacity-admitted, pin pool
A_DEPTH_PREPARED = 11
A_DEPTH_EVALUATED = 12
A_DEPTH_ADMITTED = 13
A_DEPTH_PIN_POOL = 14
A_PIN_REJECTED = 15     # reorg: pin candidates its caps rejected (legacy's pin skips them silently)
A_NCOLS = 16


# Policy variants (docs/replay-model.md "Policy variants"): codes of the
# ``choice`` knobs, their index in ``config.KNOBS[...].choices``.
PIN_LOCALITY = KNOBS["variant_pin_order"].choices.index("locality")
SCALING_PER_WORKER = KNOBS["variant_floor_scaling"].choices.index("per-worker")


@njit(allocates=False)
def gate_column_nb(floor_scaling):
    """The snapshot column the queue gate and the floor read under a floor-scaling code."""
    return S_WAITING_PER_RANK if floor_scaling == SCALING_PER_WORKER else S_WAITING


# ---------------------------------------------------------------------------
# Section 3.1 / 3.2 / 3.6: queue readings
@njit(allocates=False)
def gate_admits_nb(snap, w, limit, wcol):
    """queue_gate_admits: no limit or no fresh basic sample admits; else waiting < limit.

    ``wcol`` is the snapshot column the gate reads: ``S_WAITING`` (the router's
    fleet scaling) or ``S_WAITING_PER_RANK`` (the per-worker floor-scaling
    variant: waiting < limit x dp_size  <=>  waiting // dp_size < limit).
    """
    if limit < 0:
        return True
    if snap[w, S_BASIC] == 0:
        return True
    return snap[w, wcol] < limit


@njit(allocates=False)
def fleet_all_queued_nb(snap, fleet, limit, wcol):
    """fleet_is_all_queued (3.2): a limit, a non-empty fleet, every worker gated out."""
    if limit < 0 or fleet.shape[0] == 0:
        return False
    for w in fleet:
        if gate_admits_nb(snap, w, limit, wcol):
            return False
    return True


@njit(allocates=False)
def any_fresh_queue_below_nb(snap, fleet, floor, wcol):
    """any_fresh_queue_below (3.6): some fleet worker with a fresh basic sample reads waiting < floor."""
    for w in fleet:
        if snap[w, S_BASIC] == 1 and snap[w, wcol] < floor:
            return True
    return False


# ---------------------------------------------------------------------------
# Section 3.5 / 4.1: capacity
@njit(allocates=False)
def has_kv_capacity_nb(snap, w, tokens):
    if snap[w, S_NATIVE] == 0:
        return True
    return snap[w, S_RUNNING] + 1 <= snap[w, S_MAXRUN] and snap[w, S_TOTAL] + tokens <= snap[w, S_MAXTOT]


@njit(allocates=False)
def cache_candidate_admitted_nb(snap, w, L, uncached, budget):
    """is_cache_candidate_admitted: KV check on the full input, pending budget on uncached work."""
    if snap[w, S_NATIVE] == 0:
        return True
    if not has_kv_capacity_nb(snap, w, L):
        return False
    return budget < 0 or snap[w, S_WU] + uncached <= budget


LEGACY_ADMISSION = -2
"""The ``cap`` of a cache resolution under legacy's KV admission (3.5); a reorg
resolution passes its in-flight cap instead (-1 = none; ROUTER_REORG.md 3.5)."""


@njit(allocates=False)
def candidate_admitted_nb(snap, w, L, uncached, budget, cap):
    """Hard admission of a cache candidate: legacy's (``cap == LEGACY_ADMISSION``),
    or the reorg's in-flight cap on the router-local count (request size unused)."""
    if cap == LEGACY_ADMISSION:
        return cache_candidate_admitted_nb(snap, w, L, uncached, budget)
    return cap < 0 or snap[w, S_INFLIGHT] < cap


@njit(allocates=False)
def prefill_admitted_nb(snap, w, L):
    """is_prefill_admitted with no range pending budget (no bucket config, section 0 item 8)."""
    return has_kv_capacity_nb(snap, w, L)


# ---------------------------------------------------------------------------
# Section 3.7: pressure comparisons (-1 less, 0 equal, 1 greater)
@njit(allocates=False)
def _cmp_int(a, b):
    if a < b:
        return -1
    if a > b:
        return 1
    return 0


@njit(allocates=False)
def cmp_tuple_nb(snap, a, b):
    """(waiting_uncached, waiting_reqs, running_reqs) lexicographically."""
    c = _cmp_int(snap[a, S_WU], snap[b, S_WU])
    if c != 0:
        return c
    c = _cmp_int(snap[a, S_WAITING], snap[b, S_WAITING])
    if c != 0:
        return c
    return _cmp_int(snap[a, S_RUNNING], snap[b, S_RUNNING])


@njit(allocates=False)
def cmp_load_nb(snap, est, a, b):
    """compare_prefill_load: both estimates -> ms, then the tuple; else the tuple."""
    ea = est[a]
    eb = est[b]
    if not math.isnan(ea) and not math.isnan(eb):
        if ea < eb:
            return -1
        if ea > eb:
            return 1
    return cmp_tuple_nb(snap, a, b)


@njit(allocates=False)
def cmp_set_nb(snap, est, a, b, engine):
    """CandidateLoads.compare_prefill_pressure for a set whose coverage flag is ``engine``."""
    if engine:
        c = cmp_load_nb(snap, est, a, b)
        if c != 0:
            return c
    return _cmp_int(snap[a, S_INFLIGHT], snap[b, S_INFLIGHT])


@njit(allocates=False)
def cmp_pair_nb(snap, est, a, b):
    """The free pairwise compare_prefill_pressure(a, b, snapshot) used by the sampler."""
    return cmp_set_nb(snap, est, a, b, snap[a, S_NATIVE] == 1 and snap[b, S_NATIVE] == 1)


@njit(allocates=False)
def set_coverage_nb(snap, est, workers, n):
    """(compare_engine, every native entry has an estimate) of CandidateLoads over workers[:n]."""
    if n == 0:
        return False, False
    all_est = True
    for i in range(n):
        w = workers[i]
        if snap[w, S_NATIVE] == 0:
            return False, False
        if math.isnan(est[w]):
            all_est = False
    return True, all_est


@njit(allocates=False)
def pressure_source_nb(engine, all_est):
    if engine and all_est:
        return SRC_MS
    if engine:
        return SRC_TOKENS
    return SRC_LOCAL


# ---------------------------------------------------------------------------
# Section 2: cache candidate preparation
@njit(allocates=False)
def candidate_limit_nb(n_fleet, cmin, cratio, cmax):
    """K = min(n_fleet, max_workers, max(min_workers, ceil(clamp(ratio, 0, 1) * n_fleet)))."""
    r = cratio
    if r < 0.0:
        r = 0.0
    if r > 1.0:
        r = 1.0
    k = max(cmin, int(math.ceil(r * n_fleet)))
    return min(n_fleet, cmax, k)


@njit(allocates=False)
def estimate_matched_tokens_nb(L, blocks, query_blocks):
    """H = floor(L * blocks / max(query_blocks, 1)) with blocks already capped."""
    return (L * blocks) // max(query_blocks, 1)


@njit(allocates=False)
def _seed_before(snap, est, cand, i, j, engine, all_est):
    """Seed order (2, step 8; section 0 item 7): H desc, pressure asc over the set, id asc."""
    hi = cand[i, C_H]
    hj = cand[j, C_H]
    if hi != hj:
        return hi > hj
    a = cand[i, C_WORKER]
    b = cand[j, C_WORKER]
    if engine:
        if all_est:
            if est[a] != est[b]:
                return est[a] < est[b]
        c = cmp_tuple_nb(snap, a, b)
        if c != 0:
            return c < 0
    c = _cmp_int(snap[a, S_INFLIGHT], snap[b, S_INFLIGHT])
    if c != 0:
        return c < 0
    return a < b


@njit(allocates=False)
def prepare_candidates_nb(L, query_blocks, m_worker, m_blocks, in_fleet, n_fleet, snap, est,
                          min_tokens, min_ratio, cmin, cratio, cmax, seen, cand, tmp_workers):
    """cache_candidate_proposal: fill ``cand`` rows in seed order; return the kept count.

    0 means no proposal (the caller has already checked the signal).  ``seen``
    is a bool scratch vector over worker ids, left all-False on return.
    """
    if query_blocks <= 0 or n_fleet == 0:
        return 0
    n = 0
    for e in range(m_worker.shape[0]):
        w = m_worker[e]
        if w < 0 or not in_fleet[w]:
            continue  # unknown address (step 1)
        b = m_blocks[e]
        if b == 0 or seen[w]:
            continue  # zero-block entries never mark a worker as seen (section 0 item 13)
        seen[w] = True
        blocks = min(b, query_blocks)
        H = estimate_matched_tokens_nb(L, blocks, query_blocks)
        if min_tokens >= 0 and H < min_tokens:
            continue
        if not math.isnan(min_ratio):
            if not (L > 0 and H / L >= min_ratio):
                continue
        cand[n, C_WORKER] = w
        cand[n, C_H] = H
        cand[n, C_E] = max(L - H, 0)
        cand[n, C_BLOCKS] = blocks
        cand[n, C_BUDGET] = -1
        n += 1
    for e in range(m_worker.shape[0]):
        w = m_worker[e]
        if w >= 0:
            seen[w] = False
    if n == 0:
        return 0
    K = candidate_limit_nb(n_fleet, cmin, cratio, cmax)
    if K <= 0:
        return 0
    sort_candidates_nb(snap, est, cand, n, tmp_workers)
    return min(n, K)


@njit(allocates=False)
def sort_candidates_nb(snap, est, cand, n, tmp_workers):
    """Sort ``cand[:n]`` into seed order (2 step 8) over the pressure coverage of all ``n``."""
    for i in range(n):
        tmp_workers[i] = cand[i, C_WORKER]
    engine, all_est = set_coverage_nb(snap, est, tmp_workers, n)
    # insertion sort (small n; stable, and the key is total)
    for i in range(1, n):
        j = i
        while j > 0 and _seed_before(snap, est, cand, j, j - 1, engine, all_est):
            for col in range(C_NCOLS):
                t = cand[j, col]
                cand[j, col] = cand[j - 1, col]
                cand[j - 1, col] = t
            j -= 1


# ---------------------------------------------------------------------------
# Section 3.8: the tournament's pairwise compare
@njit(allocates=False)
def _materially_more(snap, est, x, y, engine, abs_tokens, abs_ms, rel):
    if not engine:
        return False
    if not math.isnan(abs_ms) and not math.isnan(est[x]) and not math.isnan(est[y]):
        return est[x] - est[y] > abs_ms and est[x] > est[y] * rel
    wx = snap[x, S_WU]
    wy = snap[y, S_WU]
    diff = wx - wy if wx > wy else 0
    return diff > abs_tokens and wx > wy * rel


@njit(allocates=False)
def _tournament_cmp(snap, est, lw, le, rw, re, engine, margin, guard, abs_tokens, abs_ms, rel):
    d = le - re if le > re else re - le
    if d <= margin and guard:
        if _materially_more(snap, est, lw, rw, engine, abs_tokens, abs_ms, rel):
            return 1
        if _materially_more(snap, est, rw, lw, engine, abs_tokens, abs_ms, rel):
            return -1
    c = _cmp_int(le, re)
    if c != 0:
        return c
    c = cmp_set_nb(snap, est, lw, rw, engine)
    if c != 0:
        return c
    return _cmp_int(lw, rw)


# ---------------------------------------------------------------------------
# Section 3: resolve_cache_candidates
@njit(allocates=False)
def resolve_cache_nb(cand, n, L, snap, est, fleet, limit, floor, margin, guard,
                     abs_tokens, abs_ms, rel, audit, ev, rj, adm, tmp, wcol, pin_locality):
    """Resolve prepared candidates ``cand[:n]``; write the audit; return the selected worker or -1.

    ``ev``, ``rj``, ``adm`` and ``tmp`` are int64 scratch vectors of length >= n
    (candidate row indices / worker ids).
    """
    return resolve_cache_with_nb(cand, n, L, snap, est, limit, floor, margin, guard, abs_tokens,
                                 abs_ms, rel, audit, ev, rj, adm, tmp,
                                 fleet_all_queued_nb(snap, fleet, limit, wcol),
                                 floor >= 0 and any_fresh_queue_below_nb(snap, fleet, floor, wcol),
                                 wcol, pin_locality, LEGACY_ADMISSION)


@njit_inner(allocates=False)
def resolve_cache_with_nb(cand, n, L, snap, est, limit, floor, margin, guard, abs_tokens, abs_ms,
                          rel, audit, ev, rj, adm, tmp, all_queued, any_below, wcol, pin_locality, cap):
    """``resolve_cache_nb`` given the two fleet-wide readings, which depend only on
    the snapshot and the limit / floor: ``fleet_is_all_queued`` (3.2) and
    ``any_fresh_queue_below(floor)`` (3.6).  The grid pass computes them once per
    request and value.  ``cap`` picks the hard admission (``candidate_admitted_nb``):
    the reorg's resolution is this one with its own caps (ROUTER_REORG.md 3.4-3.7),
    its pin's rejections counted in ``A_PIN_REJECTED``.
    """
    for j in range(A_NCOLS):
        audit[j] = 0
    audit[A_SELECTED] = -1
    audit[A_REASON] = -1
    # 3.3 gate pass
    n_ev = 0
    n_rj = 0
    best_rej = 0
    depth = 0
    for i in range(n):
        depth = max(depth, cand[i, C_BLOCKS])
    audit[A_DEPTH_PREPARED] = depth
    for i in range(n):
        w = cand[i, C_WORKER]
        if gate_admits_nb(snap, w, limit, wcol):
            ev[n_ev] = i
            n_ev += 1
        else:
            rj[n_rj] = i
            n_rj += 1
            if cand[i, C_BLOCKS] > best_rej:
                best_rej = cand[i, C_BLOCKS]
    # 3.4 fell-back tier (a configured floor supersedes it)
    fell_back = n_ev == 0 and n_rj > 0 and all_queued and floor < 0
    if fell_back:
        for i in range(n):
            ev[i] = i
        n_ev = n
    audit[A_GATE_REJECTED] = n_rj
    audit[A_BEST_REJECTED] = best_rej
    audit[A_FELL_BACK] = 1 if fell_back else 0
    audit[A_ALL_QUEUED] = 1 if all_queued else 0
    audit[A_EVALUATED] = n_ev
    # 3.5 admission over the evaluated set
    for i in range(n_ev):
        tmp[i] = cand[ev[i], C_WORKER]
    engine, all_est = set_coverage_nb(snap, est, tmp, n_ev)
    audit[A_SOURCE] = pressure_source_nb(engine, all_est)
    n_adm = 0
    d_ev = 0
    d_adm = 0
    for k in range(n_ev):
        i = ev[k]
        d_ev = max(d_ev, cand[i, C_BLOCKS])
        if candidate_admitted_nb(snap, cand[i, C_WORKER], L, cand[i, C_E], cand[i, C_BUDGET], cap):
            adm[n_adm] = i
            n_adm += 1
            d_adm = max(d_adm, cand[i, C_BLOCKS])
    audit[A_ADM_REJECTED] = n_ev - n_adm
    audit[A_DEPTH_EVALUATED] = d_ev
    audit[A_DEPTH_ADMITTED] = d_adm
    if n_adm == 0:
        # 3.6 saturation pin
        if n_rj > 0 and floor >= 0 and not any_below:
            for k in range(n_rj):
                tmp[k] = cand[rj[k], C_WORKER]
            pin_engine, _unused = set_coverage_nb(snap, est, tmp, n_rj)
            best = -1
            best_i = -1
            for k in range(n_rj):
                i = rj[k]
                w = cand[i, C_WORKER]
                if not candidate_admitted_nb(snap, w, L, cand[i, C_E], cand[i, C_BUDGET], cap):
                    audit[A_PIN_REJECTED] += 1
                    continue
                audit[A_DEPTH_PIN_POOL] = max(audit[A_DEPTH_PIN_POOL], cand[i, C_BLOCKS])
                if best < 0:
                    best = w
                    best_i = i
                    continue
                if pin_locality:
                    # variant --pin-order locality: deepest match first, then pressure, then id
                    if cand[i, C_BLOCKS] != cand[best_i, C_BLOCKS]:
                        if cand[i, C_BLOCKS] > cand[best_i, C_BLOCKS]:
                            best = w
                            best_i = i
                        continue
                c = cmp_set_nb(snap, est, w, best, pin_engine)
                if c < 0 or (c == 0 and w < best):
                    best = w
                    best_i = i
            if best >= 0:
                audit[A_SELECTED] = best
                audit[A_REASON] = SATURATION_PIN
        return audit[A_SELECTED]
    # work floor: first admitted candidate with minimal E
    floor_i = adm[0]
    for k in range(1, n_adm):
        if cand[adm[k], C_E] < cand[floor_i, C_E]:
            floor_i = adm[k]
    # 3.8 tournament
    ceiling = cand[floor_i, C_E] + margin
    win = floor_i
    compared = 0
    overrides = 0
    for k in range(n_adm):
        c = adm[k]
        if c == win or cand[c, C_E] > ceiling:
            continue
        ww = cand[win, C_WORKER]
        cw = cand[c, C_WORKER]
        base = _tournament_cmp(snap, est, ww, cand[win, C_E], cw, cand[c, C_E], engine,
                               margin, False, abs_tokens, abs_ms, rel)
        res = base
        if guard and engine:
            compared += 1
            g = _tournament_cmp(snap, est, ww, cand[win, C_E], cw, cand[c, C_E], engine,
                                margin, True, abs_tokens, abs_ms, rel)
            if g != base:
                overrides += 1
            res = g
        if res > 0:
            win = c
    audit[A_COMPARED] = compared
    audit[A_OVERRIDES] = overrides
    audit[A_SELECTED] = cand[win, C_WORKER]
    audit[A_REASON] = CACHE_CANDIDATE
    return audit[A_SELECTED]


# ---------------------------------------------------------------------------
# Section 4.2: the min-load sampler
@njit(allocates=False)
def sample_pair_nb(snap, est, workers, k, limit, wcol, seed, req_index, draw, pool, idx):
    """best_two_of_sample over the queue-gate tier of ``workers``.

    ``pool`` is int64 scratch (at least one word per 64 workers) for the
    tier's bit set.  Returns (best, runner_up, next_draw_index); best = -1
    for an empty list.
    """
    m, whole = gate_tier_bits_nb(snap, workers, limit, wcol, pool)
    return sample_from_bits_nb(snap, est, workers, pool, whole, m, k, draw_key_nb(seed, req_index), draw, idx)


@njit(allocates=False)
def gate_tier_bits_nb(snap, workers, limit, wcol, bits):
    """The sampler's tier of ``workers`` as a bit set (``sample_from_bits_nb``):
    the workers the queue gate admits under ``limit``, else (no limit, or
    nobody admitted) all of them.  Returns (m, whole): the tier's size, and
    whether it is the whole list (``bits`` then unread).  The grid pass
    builds the same set from its fleet readings (``one_pass._decide_request``)."""
    n = workers.shape[0]
    m = 0
    if limit >= 0:
        for q in range((n + 63) >> 6):
            lo = q << 6
            word = np.int64(0)
            for j in range(lo, min(lo + 64, n)):
                word |= np.int64(gate_admits_nb(snap, workers[j], limit, wcol)) << (j - lo)
            bits[q] = word
            m += popcount(word)
    if m == 0:
        return n, True
    return m, False


@njit(allocates=False, inline=True)
def draw_positions_nb(m, k, key, draw, idx):
    """The sampler's draws: the positions in a tier of ``m >= 1`` workers it
    samples, into ``idx[:n_s]`` in draw order (``idx`` needs room for
    ``3 * max(k, 1)`` or ``m`` entries).  Returns (n_s, next_draw_index).
    """
    kk = max(k, 1)
    if kk >= m:
        for i in range(m):
            idx[i] = i
        n_s = m
    elif kk == 1:
        idx[0] = np.int64(draw_at_nb(key, draw) % np.uint64(m))
        draw += 1
        n_s = 1
    elif 3 * kk > idx.shape[0]:
        for i in range(m):
            idx[i] = i
        for i in range(kk):
            j = i + np.int64(draw_at_nb(key, draw) % np.uint64(m - i))
            draw += 1
            t = idx[i]
            idx[i] = idx[j]
            idx[j] = t
        n_s = kk
    else:
        # partial Fisher-Yates over [0..m-1], touching only the swapped positions:
        # idx[0:kk] holds positions' current values as drawn, idx[kk:2kk] the
        # swapped-away positions and idx[2kk:3kk] their values
        n_sw = 0
        for i in range(kk):
            j = i + np.int64(draw_at_nb(key, draw) % np.uint64(m - i))
            draw += 1
            vi = i
            vj = j
            for t in range(n_sw):  # current values at positions i and j
                if idx[kk + t] == i:
                    vi = idx[2 * kk + t]
                if idx[kk + t] == j:
                    vj = idx[2 * kk + t]
            idx[i] = vj  # position i now holds vj (final: positions < i+1 never move again)
            # position j now holds vi
            found = False
            for t in range(n_sw):
                if idx[kk + t] == j:
                    idx[2 * kk + t] = vi
                    found = True
            if not found:
                idx[kk + n_sw] = j
                idx[2 * kk + n_sw] = vi
                n_sw += 1
        n_s = kk
    return n_s, draw


@njit(allocates=False, inline=True)
def best_two_nb(snap, est, workers, n):
    """(best, runner_up) of the sampled ``workers[:n]`` (n >= 1) in sample order,
    by the pairwise pressure compare; runner_up = -1 for one worker."""
    best = workers[0]
    runner = -1
    for s in range(1, n):
        w = workers[s]
        if cmp_pair_nb(snap, est, w, best) < 0:
            runner = best
            best = w
        elif runner < 0 or cmp_pair_nb(snap, est, w, runner) < 0:
            runner = w
    return best, runner


@njit(allocates=False, inline=True)
def select_bit_nb(x, t):
    """The position of the ``t``-th set bit (from 0, lowest first) of the int64
    bit set ``x``; ``t < popcount(x)``."""
    pos = 0
    c = popcount(x & 0xFFFFFFFF)
    if t >= c:
        t -= c
        x = x >> 32
        pos = 32
    x = x & 0xFFFFFFFF
    c = popcount(x & 0xFFFF)
    if t >= c:
        t -= c
        x = x >> 16
        pos += 16
    c = popcount(x & 0xFF)
    if t >= c:
        t -= c
        x = x >> 8
        pos += 8
    for _ in range(t):
        x &= x - 1
    return pos + trailing_zeros(x)


@njit(allocates=False, inline=True)
def sample_from_bits_nb(snap, est, fleet, bits, whole, m, k, key, draw, idx):
    """best_two_of_sample over a tier given as a bit set: bit ``j`` of
    ``bits`` (64 fleet positions a word) marks ``fleet[j]`` as in the tier of
    ``m`` workers, fleet order kept; ``whole``: the tier is the whole fleet
    (``bits`` unread).  The grid pass builds the bit set with a compare per
    worker that needs no list: a worker's place in the tier is found only for
    the few the draws pick.
    """
    if m == 0:
        return -1, -1, draw
    n_s, draw = draw_positions_nb(m, k, key, draw, idx)
    for s in range(n_s):
        t = idx[s]
        if whole:
            idx[s] = fleet[t]
            continue
        q = 0
        while True:
            c = popcount(bits[q])
            if t < c:
                idx[s] = fleet[(q << 6) + select_bit_nb(bits[q], t)]
                break
            t -= c
            q += 1
    best, runner = best_two_nb(snap, est, idx, n_s)
    return best, runner, draw


# ---------------------------------------------------------------------------
# Section 4.1: resolve_prefill_admitted (strict, with the two-tier range fallback)
@njit(allocates=False, inline=True)
def resolve_admitted_nb(snap, est, primary, backup, legal, L, limit, wcol, pool):
    """Returns (worker, reason) or (-1, -1)."""
    p_ok = prefill_admitted_nb(snap, primary, L) and gate_admits_nb(snap, primary, limit, wcol)
    if p_ok:
        return primary, PRIMARY  # cache-aware pairs carry no guard hints: never BackupPressureGuard
    if backup >= 0 and prefill_admitted_nb(snap, backup, L) and gate_admits_nb(snap, backup, limit, wcol):
        return backup, BACKUP_PRIMARY_ADMISSION
    # range fallback: tier 1 = capacity-admitted and gate-admitted; tier 2 = capacity-admitted
    m = 0
    if limit >= 0:
        for w in legal:
            if prefill_admitted_nb(snap, w, L) and gate_admits_nb(snap, w, limit, wcol):
                pool[m] = w
                m += 1
    if m == 0:
        for w in legal:
            if prefill_admitted_nb(snap, w, L):
                pool[m] = w
                m += 1
    if m == 0:
        return -1, -1
    engine, _unused = set_coverage_nb(snap, est, pool, m)
    best = pool[0]
    for i in range(1, m):
        if cmp_set_nb(snap, est, pool[i], best, engine) < 0:
            best = pool[i]
    return best, RANGE_FALLBACK


# ---------------------------------------------------------------------------
# Section 5.4 and section 0 items 10, 13, 16
@njit(allocates=False)
def locality_nb(L, query_blocks, best_prefix, m_worker, m_blocks, w):
    """(query, matched, selected, uncached_tokens) of a decision that chose worker ``w``.

    A worker's blocks are those of its first entry in ``matches`` (0 if none),
    capped by the query for the token estimate and by ``matched`` for the
    triple.  Without a prefix signal the triple is zeros and uncached = L.
    """
    if query_blocks <= 0:
        return 0, 0, 0, L
    matched = min(best_prefix, query_blocks) if m_worker.shape[0] > 0 else 0
    blocks = 0
    for e in range(m_worker.shape[0]):
        if m_worker[e] == w:
            blocks = min(m_blocks[e], query_blocks)
            break
    H = estimate_matched_tokens_nb(L, blocks, query_blocks)
    return query_blocks, matched, min(blocks, matched), max(L - H, 0)


# ---------------------------------------------------------------------------
# The locality waterfall (docs/replay-model.md "Where locality goes")
@njit(allocates=False)
def waterfall_nb(matched, selected, reason, audit):
    """(lost_candidates, lost_queue_gate, lost_capacity, lost_to) of a routed decision.

    ``matched``/``selected`` are its locality blocks, ``reason`` its DecisionReason
    and ``audit`` its cache resolution's (A_REASON = -2 when none ran).  The
    chain of depths from ``matched`` down to ``selected`` runs through the
    deepest prepared, gate-evaluated and admitted candidate (the pin: the deepest
    of its pool), each clamped to [selected, previous]; a term is the drop at
    its step, and the step that chose the worker (pin, tournament or fallback
    ladder) keeps the rest, so the terms add up to ``matched - selected``.
    """
    if matched <= 0:
        return 0, 0, 0, NO_LOSS
    cands = 0
    gate = 0
    capacity = 0
    last = 0  # the choosing step's loss
    last_step = LOST_FALLBACK
    if audit[A_REASON] == -2:
        # no proposal: the domain rungs chose
        last = matched - selected
    else:
        x1 = min(matched, max(audit[A_DEPTH_PREPARED], selected))
        cands = matched - x1
        if reason == SATURATION_PIN:
            # the pin re-admits gated owners: no gate loss; capacity, then the pin's order
            x2 = min(x1, max(audit[A_DEPTH_PIN_POOL], selected))
            capacity = x1 - x2
            last = x2 - selected
            last_step = LOST_PIN
        else:
            x2 = min(x1, max(audit[A_DEPTH_EVALUATED], selected))
            x3 = min(x2, max(audit[A_DEPTH_ADMITTED], selected))
            gate = x1 - x2
            capacity = x2 - x3
            last = x3 - selected
            if reason == CACHE_CANDIDATE:
                last_step = LOST_TOURNAMENT
    if cands > 0:
        first = LOST_CANDIDATES
    elif gate > 0:
        first = LOST_QUEUE_GATE
    elif capacity > 0:
        first = LOST_CAPACITY
    elif last > 0:
        first = last_step
    else:
        first = NO_LOSS
    return cands, gate, capacity, first


# ---------------------------------------------------------------------------
# Section 5.3
@njit(allocates=False)
def fallback_decision_nb(rejected, evaluated, all_queued):
    """cache_aware_fallback_decision(rejected, evaluated, fleet_all_queued)."""
    if rejected == 0:
        return CACHE_MISS
    if all_queued:
        return ALL_QUEUED
    if evaluated > 0:
        return CACHE_MISS
    return CACHE_WORKER_QUEUED


# ---------------------------------------------------------------------------
# Section 8: the whole selection of one request under one config
@njit(allocates=False)
def select_prefill_nb(L, query_blocks, m_worker, m_blocks, in_fleet, fleet, snap, est, knobs, c,
                      seed, req_index, audit, scratch_i, cand, seen):
    """Run the ladder for config ``c`` of ``knobs`` (``layout.KnobArrays``);
    return (worker, reason, decision, failure).

    ``audit`` receives the cache resolution's audit (A_* columns; A_REASON = -2
    when no resolution ran).  ``scratch_i`` is an int64 matrix with at least 6
    rows of length >= max(n_workers, matches); ``cand`` has >= matches rows.
    """
    n = 0
    if query_blocks > 0 and m_worker.shape[0] > 0:
        n = prepare_candidates_nb(L, query_blocks, m_worker, m_blocks, in_fleet, fleet.shape[0],
                                  snap, est, knobs.cache_affinity_min_matched_tokens[c],
                                  knobs.cache_affinity_min_match_ratio[c],
                                  knobs.cache_candidate_min_workers[c], knobs.cache_candidate_ratio[c],
                                  knobs.cache_candidate_max_workers[c], seen, cand, scratch_i[0])
    return select_prepared_nb(n, cand, L, fleet, snap, est, knobs.worker_queue_limit[c],
                              knobs.saturation_queue_floor[c], knobs.min_load_choices[c],
                              knobs.cache_switch_margin_tokens[c], knobs.pressure_guard[c] == 1,
                              knobs.pressure_abs_threshold_tokens[c],
                              knobs.pressure_abs_threshold_ms[c], knobs.pressure_rel_threshold[c],
                              seed, req_index, audit, scratch_i,
                              gate_column_nb(knobs.variant_floor_scaling[c]),
                              knobs.variant_pin_order[c] == PIN_LOCALITY)


@njit(allocates=False)
def cache_rung_nb(n, cand, L, fleet, snap, est, limit, floor, margin, guard, abs_tokens, abs_ms,
                  rel, audit, scratch_i, wcol, pin_locality):
    """Section 8's cache rung (see ``cache_rung_with_nb``)."""
    return cache_rung_with_nb(n, cand, L, snap, est, limit, floor, margin, guard, abs_tokens,
                              abs_ms, rel, audit, scratch_i,
                              fleet_all_queued_nb(snap, fleet, limit, wcol),
                              floor >= 0 and any_fresh_queue_below_nb(snap, fleet, floor, wcol),
                              wcol, pin_locality)


@njit_inner(allocates=False)
def cache_rung_with_nb(n, cand, L, snap, est, limit, floor, margin, guard, abs_tokens, abs_ms,
                       rel, audit, scratch_i, all_queued, any_below, wcol, pin_locality):
    """Section 8's cache rung: returns (worker, reason, label).

    ``worker == -1``: the rung yielded nothing and ``label`` is the
    cache-aware decision a domain-rung selection will book (section 5.3).
    ``audit`` is reset (A_REASON = -2 when no resolution ran, n == 0).
    """
    for j in range(A_NCOLS):
        audit[j] = 0
    audit[A_SELECTED] = -1
    audit[A_REASON] = -2
    audit[A_SOURCE] = -1
    if n == 0:
        return -1, -1, CACHE_MISS
    w = resolve_cache_with_nb(cand, n, L, snap, est, limit, floor, margin, guard, abs_tokens,
                              abs_ms, rel, audit, scratch_i[1], scratch_i[2], scratch_i[3],
                              scratch_i[4], all_queued, any_below, wcol, pin_locality, LEGACY_ADMISSION)
    if w >= 0:
        reason = audit[A_REASON]
        if reason == SATURATION_PIN or audit[A_FELL_BACK] == 1:
            return w, reason, ALL_QUEUED
        return w, reason, CACHE_HIT
    return -1, -1, fallback_decision_nb(audit[A_GATE_REJECTED], audit[A_EVALUATED],
                                        audit[A_ALL_QUEUED] == 1)


@njit_inner(allocates=False)
def domain_rungs_nb(fleet, snap, est, L, limit, wcol, k, seed, req_index, scratch_i):
    """Section 4's domain rungs over the one global domain: (worker, reason).

    Pass 1 draws a pair for the strict resolution; pass 2 draws a fresh pair,
    tries it strictly, then the capacity fallback draws once more.  The draws
    depend on (seed, request, draw index) only, so the result is a function of
    the snapshot, the limit and k.  A non-empty fleet always yields a worker.
    All three draws sample the same tier (``gate_tier_bits_nb``).
    """
    if fleet.shape[0] == 0:
        return -1, -1
    bits = scratch_i[0]
    m, whole = gate_tier_bits_nb(snap, fleet, limit, wcol, bits)
    return domain_rungs_bits_nb(fleet, bits, whole, m, snap, est, L, limit, wcol, k,
                                draw_key_nb(seed, req_index), scratch_i[1], scratch_i[5])


@njit(allocates=False)
def domain_rungs_bits_nb(fleet, bits, whole, m, snap, est, L, limit, wcol, k, key, work, idx):
    """``domain_rungs_nb`` given the sampler's tier as a bit set over fleet
    positions (``sample_from_bits_nb``): the queue-gate tier of ``fleet`` under
    ``limit``, or the whole fleet (``whole``) when that is empty or there is
    no limit.  It depends on the snapshot and the limit class only: the grid
    pass builds it once per request and class.  The three draws all sample
    that same tier; ``work`` is scratch for the range fallback (length >=
    fleet size), ``idx`` the sampler's index scratch; ``key`` is the
    request's ``rng.draw_key_nb`` (the grid pass makes it once per request).
    """
    if fleet.shape[0] == 0:
        return -1, -1
    draw = 0
    p = -1
    for attempt in range(3):   # one call site each: the helpers are inlined once
        p, b, draw = sample_from_bits_nb(snap, est, fleet, bits, whole, m, k, key, draw, idx)
        if attempt == 2:
            break
        w, reason = resolve_admitted_nb(snap, est, p, b, fleet, L, limit, wcol, work)
        if w >= 0:
            return w, reason
    return p, CAPACITY_FALLBACK


@njit(allocates=False)
def failure_of_nb(resolved, n_fleet):
    """The failure reason of a selection that found no worker (section 4, step 3)."""
    if n_fleet > 0:
        return FAIL_PREFILL  # unreachable: a non-empty fleet always routes
    return FAIL_CACHE if resolved else FAIL_EMPTY


@njit(allocates=False)
def select_prepared_nb(n, cand, L, fleet, snap, est, limit, floor, k, margin, guard, abs_tokens,
                       abs_ms, rel, seed, req_index, audit, scratch_i, wcol, pin_locality):
    """The ladder of ``select_prefill_nb`` after candidate preparation.

    ``cand[:n]`` are the prepared candidates in seed order; ``n == 0`` means no
    proposal (no signal, empty outcome, or no candidate survived).
    """
    w, reason, label = cache_rung_nb(n, cand, L, fleet, snap, est, limit, floor, margin, guard,
                                     abs_tokens, abs_ms, rel, audit, scratch_i, wcol, pin_locality)
    if w >= 0:
        return w, reason, label, -1
    w, reason = domain_rungs_nb(fleet, snap, est, L, limit, wcol, k, seed, req_index, scratch_i)
    if w >= 0:
        return w, reason, label, -1
    return -1, -1, -1, failure_of_nb(n > 0, fleet.shape[0])
