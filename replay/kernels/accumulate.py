"""Per-config accumulators, filled inside the grid pass (every metric mergeable).

``acc[block, c, ACC_*]`` int64 counts and sums (config-major inside the kernel, so
one booking touches one config's contiguous row; ``engine.Totals.acc`` shows
them as ``[block, ACC_*, c]``) (the chosen worker's estimated queue
time is summed in whole microseconds, so sums stay exact and order-free),
``hist_wait[block, v, c]`` an exact histogram
of the chosen worker's waiting count (last bucket: that value or more),
``hist_div[block, bucket, c]`` the router's diverted-overlap buckets.  ``results.py``
names and divides them.
"""

from __future__ import annotations

import math

import numpy as np

from replay import labels
from replay.kernels._jit import njit, njit_inner
from replay.kernels.layout import (
    ACC,
    F_SELECTED_QUEUE_MS,
    N_ACC,
    O_ADMISSION_EVALUATED,
    O_ADMISSION_REJECTED,
    O_BEST_REJECTED_BLOCKS,
    O_DECISION,
    O_FAILURE,
    O_FELL_BACK,
    O_FLEET_ALL_QUEUED,
    O_GATE_REJECTED,
    O_GUARD_COMPARED,
    O_GUARD_OVERRIDES,
    O_LOST_CANDIDATES,
    O_LOST_CAPACITY,
    O_LOST_QUEUE_GATE,
    O_MATCHED_BLOCKS,
    O_POLICY_REASON,
    O_PRESSURE_SOURCE,
    O_REASON,
    O_REORG_OUTCOME,
    O_SELECTED_BLOCKS,
    O_SELECTED_WAITING,
    O_SELECTED_WAITING_UNCACHED,
    O_UNCACHED_TOKENS,
    O_WORKER,
)

_REQUESTS = ACC["requests"]
_ROUTED = ACC["routed"]
_FAILED = ACC["failed"]
_DEC0 = ACC["decision_cache_hit"]
_POL0 = ACC["policy_cache_candidate"]
_FAIL0 = ACC["failure_prefill_admission_exhausted"]
_REORG0 = ACC["reorg_" + labels.REORG_OUTCOMES[0]]
_QUERY = ACC["query_blocks"]
_MATCHED = ACC["matched_blocks"]
_SELECTED = ACC["selected_blocks"]
_OWNER_HITS = ACC["owner_hits"]
_OWNER_CHANCES = ACC["owner_chances"]
_DIVERTED = ACC["diverted"]
_PINNED = ACC["pinned"]
_FELL_BACK = ACC["fell_back"]
_ALL_QUEUED = ACC["fleet_all_queued"]
_WAIT_KNOWN = ACC["waiting_known"]
_WAIT_SUM = ACC["waiting_sum"]
_WU_KNOWN = ACC["waiting_uncached_known"]
_WU_SUM = ACC["waiting_uncached_sum"]
_MS_KNOWN = ACC["queue_ms_known"]
_US_SUM = ACC["queue_us_sum"]
_COLD = ACC["cold_prefill_tokens"]
_AGREE = ACC["agree"]
_AGREE_KNOWN = ACC["agree_known"]
_COMPARED = ACC["guard_compared"]
_OVERRIDES = ACC["guard_overrides"]
_EVAL = ACC["admission_evaluated"]
_ADM_REJ = ACC["admission_rejected"]
_GATE_REJ = ACC["gate_rejected"]
_LOST_CANDIDATES = ACC["lost_candidates"]
_LOST_GATE = ACC["lost_queue_gate"]
_LOST_CAPACITY = ACC["lost_capacity"]
_LOST_PIN = ACC["lost_pin"]
_LOST_TOURNAMENT = ACC["lost_tournament"]
_LOST_FALLBACK = ACC["lost_fallback"]
_CANDIDATE = labels.CACHE_CANDIDATE
_PIN = labels.SATURATION_PIN
_WORKER_QUEUED = labels.CACHE_WORKER_QUEUED
_N_BOUNDS = len(labels.DIVERTED_BUCKETS)


@njit(allocates=False)
def diverted_bucket_nb(v):
    """Index of the first bound 1, 2, 4, ..., 8192 with ``v <= bound``; the last index is +Inf."""
    b = 0
    bound = 1
    while b < _N_BOUNDS and v > bound:
        b += 1
        bound *= 2
    return b


# Columns of a decision's terms (``decision_terms_nb``): what it adds to each
# accumulator of its config, then its bucket of each histogram (-1 = none).
T_WAIT_BUCKET = N_ACC
T_DIV_BUCKET = N_ACC + 1
N_TERMS = N_ACC + 2


@njit(allocates=False, inline=True)
def decision_terms_nb(t, row, ms, q, selected_worker, top):
    """Fill ``t`` (int64[N_TERMS]) with what decision ``row`` (``O_*`` fields;
    ``ms`` its selected queue estimate) books into its config's accumulators:
    ``t[ACC_*]`` the amounts, ``t[T_WAIT_BUCKET]`` / ``t[T_DIV_BUCKET]`` its
    waiting-count bucket (``top`` the last) and diverted-overlap bucket.  ``q``
    is the request's query blocks (at least 0), ``selected_worker`` the
    recorded choice (-1 = none)."""
    for j in range(N_TERMS):
        t[j] = 0
    t[T_WAIT_BUCKET] = -1
    t[T_DIV_BUCKET] = -1
    w = row[O_WORKER]
    # "requests" and "agree_known" are per-request constants: booked per block
    # by book_block_constants_nb.  A replayed 503 counts as a disagreement.
    if selected_worker >= 0 and selected_worker == w:
        t[_AGREE] = 1
    outcome = row[O_REORG_OUTCOME]
    if outcome >= 0:  # a reorg decision: the replay's own outcome, and no router label
        t[_REORG0 + outcome] = 1
    if w < 0:
        t[_FAILED] = 1
        f = row[O_FAILURE]
        if f >= 0:
            t[_FAIL0 + f] += 1
        return
    t[_ROUTED] = 1
    dec = row[O_DECISION]
    if dec >= 0:
        t[_DEC0 + dec] += 1
    if row[O_POLICY_REASON] >= 0:
        t[_POL0 + row[O_POLICY_REASON]] += 1
    t[_QUERY] = q
    matched = row[O_MATCHED_BLOCKS]
    if matched > 0:
        sel = row[O_SELECTED_BLOCKS]
        t[_MATCHED] = matched
        t[_SELECTED] = sel
        t[_OWNER_CHANCES] = 1
        if sel > 0:
            t[_OWNER_HITS] = 1
        # the waterfall: three stored terms, the choosing step keeps the rest
        lc = row[O_LOST_CANDIDATES]
        lg = row[O_LOST_QUEUE_GATE]
        lcap = row[O_LOST_CAPACITY]
        t[_LOST_CANDIDATES] = lc
        t[_LOST_GATE] = lg
        t[_LOST_CAPACITY] = lcap
        rest = matched - sel - lc - lg - lcap
        reason = row[O_REASON]
        if reason == _PIN:
            t[_LOST_PIN] += rest
        elif reason == _CANDIDATE:
            t[_LOST_TOURNAMENT] += rest
        else:
            t[_LOST_FALLBACK] += rest
    t[_COLD] = row[O_UNCACHED_TOKENS]
    sw = row[O_SELECTED_WAITING]
    if sw >= 0:
        t[_WAIT_KNOWN] = 1
        t[_WAIT_SUM] = sw
        t[T_WAIT_BUCKET] = sw if sw < top else top
    wu = row[O_SELECTED_WAITING_UNCACHED]
    if wu >= 0:
        t[_WU_KNOWN] = 1
        t[_WU_SUM] = wu
        if not math.isnan(ms):
            t[_MS_KNOWN] = 1
            t[_US_SUM] = np.int64(np.round(ms * 1000.0))
    if row[O_PRESSURE_SOURCE] < 0:
        return  # no cache resolution ran: every audit counter is 0
    gate = row[O_GATE_REJECTED]
    fell = row[O_FELL_BACK]
    if row[O_REASON] == _PIN:
        t[_PINNED] = 1
    elif gate > 0 and fell == 0:
        t[_DIVERTED] = 1
    t[_FELL_BACK] = fell
    t[_ALL_QUEUED] = row[O_FLEET_ALL_QUEUED]
    t[_COMPARED] = row[O_GUARD_COMPARED]
    t[_OVERRIDES] = row[O_GUARD_OVERRIDES]
    t[_EVAL] = row[O_ADMISSION_EVALUATED]
    t[_ADM_REJ] = row[O_ADMISSION_REJECTED]
    t[_GATE_REJ] = gate
    if dec == _WORKER_QUEUED:
        t[T_DIV_BUCKET] = diverted_bucket_nb(row[O_BEST_REJECTED_BLOCKS])


@njit_inner(allocates=False)
def accumulate_request_nb(totals, b, res_i, res_f, src_of, parent, query_blocks, selected_worker, terms):
    """Book one request's decisions under every config into block ``b``'s accumulators.

    Config ``c``'s decision is row ``src_of[c]`` of ``res_i[:, O_*]`` /
    ``res_f[:, F_*]`` (kernels/layout.py; one row per distinct decision, so two
    configs decide alike exactly when their rows are the same); ``totals`` is a ``layout.Accumulators``
    whose ``acc[b, c, ACC_*]`` keeps one config's counters together and
    ``hist_wait[b, v, c]`` and ``hist_div[b, bucket, c]`` keep configs innermost.

    Configs are booked relative to a parent (``parent[c] < c``: the previous
    config of the same knob group and limit, so a chain over the floors, and for
    the first config of a limit the first config of the group's previous limit;
    a group's first config is its own parent).  A parent books
    its decision; a child books nothing when its decision is its parent's (the
    usual case: a floor only matters when the limit gates a candidate) and
    otherwise the difference.  ``fold_parents`` adds each parent's totals to its
    children once, at the end, so every total is exact.  The configs that book
    (their own parent, or deciding otherwise than it) are listed after the
    ``n_cfg`` rows of ``src_of``: ``src_of[n_cfg]`` of them in
    ``src_of[n_cfg + 1:]`` (the grid pass lists them as it decides).

    Each row's terms (``decision_terms_nb``) are worked out once, into
    ``terms[row]`` (int64[n_cfg, N_TERMS] scratch), and a booking adds them,
    or the difference of two rows' terms, to the config's counters in one
    pass: a row is booked by several configs, and a difference touches each
    counter once, not twice.
    """
    n_cfg = parent.shape[0]
    n_book = src_of[n_cfg]
    if n_book == 0:
        return
    q = query_blocks if query_blocks > 0 else 0
    a = totals.acc[b]
    hw = totals.hist_wait[b]
    hd = totals.hist_div[b]
    # the rows the bookings read are the first ones (rows are numbered as first made)
    last = 0
    for t in range(n_book):
        c = src_of[n_cfg + 1 + t]
        last = max(last, src_of[c], src_of[parent[c]])
    for k in range(last + 1):
        decision_terms_nb(terms[k], res_i[k], res_f[k, F_SELECTED_QUEUE_MS], q, selected_worker,
                          hw.shape[0] - 1)
    for t in range(n_book):
        c = src_of[n_cfg + 1 + t]
        p = parent[c]
        tk = terms[src_of[c]]
        ac = a[c]
        if p == c:
            for j in range(N_ACC):
                ac[j] += tk[j]
            if tk[T_WAIT_BUCKET] >= 0:
                hw[tk[T_WAIT_BUCKET], c] += 1
            if tk[T_DIV_BUCKET] >= 0:
                hd[tk[T_DIV_BUCKET], c] += 1
            continue
        tp = terms[src_of[p]]
        for j in range(N_ACC):
            ac[j] += tk[j] - tp[j]
        if tk[T_WAIT_BUCKET] != tp[T_WAIT_BUCKET]:
            if tk[T_WAIT_BUCKET] >= 0:
                hw[tk[T_WAIT_BUCKET], c] += 1
            if tp[T_WAIT_BUCKET] >= 0:
                hw[tp[T_WAIT_BUCKET], c] -= 1
        if tk[T_DIV_BUCKET] != tp[T_DIV_BUCKET]:
            if tk[T_DIV_BUCKET] >= 0:
                hd[tk[T_DIV_BUCKET], c] += 1
            if tp[T_DIV_BUCKET] >= 0:
                hd[tp[T_DIV_BUCKET], c] -= 1


def fold_parents(acc, hist_wait, hist_div, parent):
    """Turn parent-relative totals (one block, ``acc[ACC_*, c]``) into absolute ones, in place.

    Parents come before their children, so one ascending pass folds whole chains.
    """
    for c, p in enumerate(parent):
        if p != c:
            acc[:, c] += acc[:, p]
            hist_wait[:, c] += hist_wait[:, p]
            hist_div[:, c] += hist_div[:, p]


@njit(allocates=False)
def book_block_constants_nb(acc, b, parent, n_requests, n_with_selected):
    """Book the per-request constants of a block: every config saw every request
    (parents only: children inherit them through ``fold_parents``)."""
    for c in range(acc.shape[1]):
        if parent[c] == c:
            acc[b, c, _REQUESTS] += n_requests
            acc[b, c, _AGREE_KNOWN] += n_with_selected
