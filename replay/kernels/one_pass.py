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
to it.  The cache rung sees the limit only through which candidates it gates
(their count names the set) and whether the whole fleet is queued, so it runs
once per such key and a rung that chose decides the row for every limit class
with that key.  The domain rungs depend on the limit class alone and are shared
the same way.  ``stats`` counts both, so a run can report how much was shared.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba.core import types

from replay.kernels._jit import address_of, call_at, njit, njit_inner, popcount
from replay.kernels.accumulate import N_TERMS, accumulate_request_nb, book_block_constants_nb
from replay.kernels.decide import (
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
    C_WORKER,
    PIN_LOCALITY,
    cache_rung_with_nb,
    domain_rungs_bits_nb,
    failure_of_nb,
    gate_column_nb,
    locality_nb,
    prepare_candidates_nb,
    waterfall_nb,
)
from replay.kernels.layout import (
    F_NCOLS,
    F_SELECTED_QUEUE_MS,
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
    O_LOST_TO,
    O_MATCHED_BLOCKS,
    O_NCOLS,
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
from replay.kernels.layout import Accumulators as layout_acc
from replay.kernels.reorg import NO_WORKERS, REORG, merged_blocks_nb, pick_nb, select_reorg_nb
from replay.kernels.reorg import prepare_nb as reorg_prepare_nb
from replay.kernels.rng import draw_key_nb
from replay.kernels.snapshot import (
    S_BASIC,
    S_NATIVE,
    S_NCOLS,
    S_WAITING,
    S_WAITING_PER_RANK,
    S_WU,
    UNKNOWN_OLDEST,
    advance_dirty_nb,
    refresh_until_nb,
)

# policy reason of a DecisionReason code (labels.reason_to_policy_reason as a table)
_POLICY_OF_REASON = np.array([2, 0, 3, 4, 5, 6, 1], dtype=np.int64)


# Per-block working memory of ``_decide_request`` (made once per block, reused per request).
Scratch = namedtuple("Scratch", (
    "memo",        # int64[n_groups * (max_fleet + 2) * 3]: outcome key -> config column, -1 = none yet
    "lclass",      # int64[2, lim_vals]: limit class of each distinct limit (row: gate reading)
    "fleet_wait",  # int64[2, max_fleet]: gate reading per fleet worker (huge when absent)
    "audit",       # int64[A_NCOLS]: the last cache resolution's audit
    "ints",        # int64[13, width]: scratch rows of decide.py, rows 6/7/8 the keys to reset (memo, ladder,
                   # rung), rows 10-12 the reorg's pool and groups (kernels/reorg.py)
    "cands",       # int64[n_groups, max_matches, C_NCOLS]: prepared candidates per group
    "group_n",     # int64[n_groups]: candidates kept per group
    "group_rep",   # int64[n_groups]: a config of each group
    "gated_n",     # int64[n_groups, lim_vals]: how many of the group's candidates the limit gates
    "ladder_w",    # int64[n_groups * (max_fleet + 2)]: domain-rung worker per (group, limit class), -2 = not yet
    "ladder_r",    # int64[same]: its reason
    "seen",        # bool[n_workers]: prepare_candidates_nb's scratch
    "res_i",       # int64[n_cfg, O_NCOLS]: the distinct decisions, one row each (layout.O_*)
    "res_f",       # float64[n_cfg, F_NCOLS]
    "src_of",      # int64[2 * n_cfg + 1]: row of res_i holding config c's decision (c < n_cfg),
                   # then the booking list: its length, and the configs accumulate.py books
    "hist",        # int64[4 * (_HIST_MAX + 2)]: fleet readings per value (the classes' counting pass)
    "rung",        # int64[n_groups * (max_matches + 1) * 6, _R_NCOLS]: cache-rung results by rung key
    "gl_cfg",      # int64[n_cfg]: the configs in runs of one (group, limit), config order inside a run
    "gl_end",      # int64[n_cfg]: where the run starting at position t of gl_cfg ends; 0 inside a run
    "gl_floor",    # int64[n_cfg]: the floor of the config at position t of gl_cfg, -1 = none
    "run_slot",    # int64[n_cfg]: at a run's start, the row of every config of a run that decides
                   # alike throughout (src_of then holds only its first config), else -1
    "terms",       # int64[n_cfg, accumulate.N_TERMS]: what each decision row books (accumulate.py)
), module=__name__)

# Each Scratch field's (dtype, ndim), as new_scratch makes it. Keep the two
# in step: a cold first start types the compile child's _decide_request from this
# table (warm.inner_signatures), and tests/test_compile_child.py fails when the
# parent then finds no cached _decide_request of the type it calls.
_i, _f, _b = np.int64, np.float64, np.bool_
SCRATCH_TYPES = {"memo": (_i, 1), "lclass": (_i, 2), "fleet_wait": (_i, 2), "audit": (_i, 1),
                 "ints": (_i, 2), "cands": (_i, 3), "group_n": (_i, 1), "group_rep": (_i, 1), "gated_n": (_i, 2),
                 "ladder_w": (_i, 1), "ladder_r": (_i, 1), "seen": (_b, 1), "res_i": (_i, 2), "res_f": (_f, 2),
                 "src_of": (_i, 1), "hist": (_i, 1), "rung": (_i, 2), "gl_cfg": (_i, 1), "gl_end": (_i, 1),
                 "gl_floor": (_i, 1), "run_slot": (_i, 1), "terms": (_i, 2)}

# Columns of ``Scratch.rung``: the audit (A_*), then whether the row is filled,
# the rung's worker, reason and label, and the decision row it chose (a slot
# of ``res_i``, when the rung chose a worker).
_R_SET = A_NCOLS
_R_W = A_NCOLS + 1
_R_REASON = A_NCOLS + 2
_R_LABEL = A_NCOLS + 3
_R_SLOT = A_NCOLS + 4
_R_NCOLS = A_NCOLS + 5

# Limit and floor classes count the fleet readings below each distinct limit and
# floor; when every such value is at most this, one counting pass over the fleet
# serves them all (else each value scans the fleet).
_HIST_MAX = 1024


def config_runs(plan) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(gl_cfg, gl_end, gl_floor, group_rep)`` of a grid plan (``layout.GridPlan``):
    the configs in runs of one (group, limit), config order inside a run (runs
    in the order of their first config); at the position where a run starts,
    the position where it ends (0 inside a run); the floor of the config at
    each position (-1 = none); the first config of each group.

    ``_decide_request`` relies on the parents ``engine.encode_configs`` gives:
    inside a run each config hangs off the one before, and a run's first config
    off itself or the first config of an earlier run (a run that decides alike
    throughout has only its first config's row written); a plan that breaks
    that is refused (ValueError) rather than replayed wrong."""
    group, li, parent = np.asarray(plan.group), np.asarray(plan.li), np.asarray(plan.parent)
    n_cfg = group.shape[0]
    gl_cfg = np.empty(n_cfg, dtype=np.int64)
    gl_end = np.zeros(n_cfg, dtype=np.int64)
    pos = np.full(n_cfg, -1, dtype=np.int64)
    t = 0
    for key in dict.fromkeys(zip(group.tolist(), li.tolist(), strict=True)):
        members = np.flatnonzero((group == key[0]) & (li == key[1]))
        first = int(members[0])
        if parent[first] != first and not (0 <= pos[parent[first]] < t and gl_end[pos[parent[first]]] > 0):
            raise ValueError("a run's first config hangs off a config that is not an earlier run's first")
        if np.any(parent[members[1:]] != members[:-1]):
            raise ValueError("a config's parent is not the one before it in its (group, limit) run")
        pos[members] = np.arange(t, t + members.shape[0])
        gl_cfg[t:t + members.shape[0]] = members
        gl_end[t] = t + members.shape[0]
        t += members.shape[0]
    group_rep = np.full(plan.n_groups, -1, dtype=np.int64)
    for c in range(n_cfg - 1, -1, -1):
        group_rep[group[c]] = c
    gl_floor = np.asarray(plan.fl_vals, dtype=np.int64)[np.asarray(plan.fi)[gl_cfg]]
    return gl_cfg, gl_end, gl_floor, group_rep


def new_scratch(plan, n_workers: int, max_fleet: int, max_matches: int,
                runs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> tuple[Scratch, tuple]:
    """One block's working memory for ``run_chunk_nb``: its ``Scratch`` and its
    running snapshot ``(snap, est, oldest, dirty)`` (``snapshot.refresh_until_nb``),
    all fresh; ``runs`` is :func:`config_runs` of the plan (read only, so
    shared by every block).  Sizes: ``n_workers`` of the rank tables, the
    largest fleet, the most matches of a request."""
    n_groups = plan.n_groups
    n_cfg = plan.group.shape[0]
    n_lim = plan.lim_vals.shape[0]
    width = max(n_workers, max_matches, n_cfg, 1) + 1
    gl_cfg, gl_end, gl_floor, group_rep = runs
    sc = Scratch(
        np.full(n_groups * (max_fleet + 2) * 3, -1, dtype=np.int64),
        np.zeros((2, n_lim), dtype=np.int64),
        np.zeros((2, max(max_fleet, 1)), dtype=np.int64),
        np.zeros(A_NCOLS, dtype=np.int64),
        np.zeros((13, width), dtype=np.int64),
        np.zeros((n_groups, max(max_matches, 1), C_NCOLS), dtype=np.int64),
        np.zeros(n_groups, dtype=np.int64),
        group_rep,
        np.zeros((n_groups, n_lim), dtype=np.int64),
        np.full(n_groups * (max_fleet + 2), -2, dtype=np.int64),
        np.zeros(n_groups * (max_fleet + 2), dtype=np.int64),
        np.zeros(n_workers, dtype=np.bool_),
        np.zeros((n_cfg, O_NCOLS), dtype=np.int64),
        np.zeros((n_cfg, F_NCOLS), dtype=np.float64),
        np.zeros(2 * n_cfg + 1, dtype=np.int64),
        np.zeros(4 * (_HIST_MAX + 2), dtype=np.int64),
        np.zeros((n_groups * (max(max_matches, 1) + 1) * 6, _R_NCOLS), dtype=np.int64),
        gl_cfg,
        gl_end,
        gl_floor,
        np.full(n_cfg, -1, dtype=np.int64),
        np.zeros((n_cfg, N_TERMS), dtype=np.int64),
    )
    snapshot = (np.zeros((n_workers, S_NCOLS), dtype=np.int64), np.full(n_workers, np.nan),
                np.zeros(n_workers, dtype=np.int64), np.ones(n_workers, dtype=np.bool_))
    return sc, snapshot


@njit
def split_states_nb(ptr, block_ts, loads, dp_size, table, inflight, tables, inflights, ptrs):
    """Per-block starting states for a chunk (a sequential pre-pass over the loads only).

    Block ``b`` starts from every sample with ``ts <= block_ts[b]`` (its first
    request's time); ``table``/``inflight``/``ptr`` enter at the chunk's start
    and are left at the last block's start.
    """
    dirty = np.zeros(inflight.shape[0], dtype=np.bool_)
    for b in range(block_ts.shape[0]):
        ptr = advance_dirty_nb(ptr, block_ts[b], loads, dp_size, table, inflight, dirty)
        tb = tables[b]
        for w in range(table.shape[0]):
            inflights[b, w] = inflight[w]
            for r in range(table.shape[1]):
                for k in range(table.shape[2]):
                    tb[w, r, k] = table[w, r, k]
        ptrs[b] = ptr
    return ptr


@njit(allocates=False)
def _count_below(values, n, bound):
    """How many of ``values[:n]`` are below ``bound`` (absent readings are stored huge)."""
    cnt = 0
    for x in range(n):
        cnt += values[x] < bound
    return cnt


@njit_inner(allocates=False)
def _decide_request(req_index, L, qb, best_prefix, m_worker, m_blocks, in_fleet, fleet, plain, snap,
                    est, knobs_at, plan, seed, sc_at):
    """Decide one request under every config.

    Each distinct outcome is computed once, into the next row ``sc.res_i[u]`` /
    ``sc.res_f[u]``; an outcome equal in every field to an earlier row is kept
    only once, so the rows are the request's distinct decisions and
    ``sc.src_of[c]`` names the row holding config ``c``'s decision (for a run
    of configs that decides alike throughout, only its first config's, and
    ``sc.run_slot`` at the run's start names the row of all of them); after
    the ``n_cfg`` rows, ``sc.src_of`` lists the configs ``accumulate_request_nb``
    books (their count, then the configs).
    Candidates are prepared once per knob group (``sc.cands[g]``,
    ``sc.group_n[g]``; ``sc.group_rep[g]`` is a config of the group).
    A reorg config (``kernels/reorg.py``) shares decisions by the same (group,
    limit class, floor class) key when its group is the whole fleet (a fleet of
    plain engines only, or of prefill engines only: ``plain[w]``); in a fleet
    of both its buckets differ from the fleet, and each such config is decided
    on its own.
    Returns (cache-rung evaluations, domain-rung evaluations) and the
    request's fleet readings (``snapshot.fleet_reading_nb``: smallest fresh
    waiting count, -1 when none; fresh fleet workers).
    ``knobs_at`` and ``sc_at`` are the addresses of the grid's ``KnobArrays``
    and the block's ``Scratch`` (``_jit.address_of``: the grid kernel calls this
    once per request with the same two).
    """
    knobs = knobs_at[0]
    sc = sc_at[0]
    n_fleet = fleet.shape[0]
    n_cfg = plan.group.shape[0]
    lim_vals = plan.lim_vals
    fleet_wait = sc.fleet_wait
    lclass = sc.lclass
    memo = sc.memo
    res_i = sc.res_i
    res_f = sc.res_f
    audit = sc.audit
    scratch_i = sc.ints
    cands = sc.cands
    group_n = sc.group_n
    group_rep = sc.group_rep
    gated_n = sc.gated_n
    rung = sc.rung
    ladder_w = sc.ladder_w
    ladder_r = sc.ladder_r
    src_of = sc.src_of
    seen = sc.seen
    group = plan.group
    cfg_li = plan.li
    # (array fields read in the loops below are unpacked once: cheaper than a
    # tuple field access per config)
    k_limit = knobs.worker_queue_limit
    k_floor = knobs.saturation_queue_floor
    k_choices = knobs.min_load_choices
    k_margin = knobs.cache_switch_margin_tokens
    k_guard = knobs.pressure_guard
    k_abs_tokens = knobs.pressure_abs_threshold_tokens
    k_abs_ms = knobs.pressure_abs_threshold_ms
    k_rel = knobs.pressure_rel_threshold
    k_scaling = knobs.variant_floor_scaling
    k_pin_order = knobs.variant_pin_order
    # limit classes: number of fresh fleet workers reading below the limit;
    # floor classes: unset (0), nobody fresh below it (1), somebody fresh below
    # it (2), that is, the floor is above the smallest fresh reading (fmin).
    # Row 0 reads the router's fleet scaling (S_WAITING), row 1 the per-worker
    # floor-scaling variant's per-rank reading (only when a config uses it).
    big = np.int64(1) << 62
    n_absent = 0
    fleet_min = -1
    fmin0 = big
    fmin1 = big
    per_worker = plan.per_worker
    n_rows = 2 if per_worker else 1
    fw0 = fleet_wait[0]
    fw1 = fleet_wait[1]
    for j in range(n_fleet):
        w = fleet[j]
        if snap[w, S_BASIC] == 1:
            x = snap[w, S_WAITING]
            fw0[j] = x
            fmin0 = min(fmin0, x)
            if per_worker:
                y = snap[w, S_WAITING_PER_RANK]
                fw1[j] = y
                fmin1 = min(fmin1, y)
        else:
            fw0[j] = big
            fw1[j] = big
            n_absent += 1
    if n_absent < n_fleet:
        fleet_min = fmin0
    top = -1
    for j in range(lim_vals.shape[0]):
        top = max(top, lim_vals[j])
    hist = sc.hist
    for r in range(n_rows):
        fw = fleet_wait[r]
        counted = top <= _HIST_MAX
        hw = top + 2
        if counted:
            # hist[v] = readings below v for v <= top + 1 (absent and larger readings
            # land in the last bucket; a negative reading takes the scanning path),
            # counted in four interleaved histograms (worker j into the (j % 4)-th):
            # neighbouring workers reading alike do not wait for each other's store
            for v in range(4 * hw):
                hist[v] = 0
            for j in range(n_fleet):
                x = fw[j]
                if x < 0:
                    counted = False
                    break
                hist[(j & 3) * hw + (x if x <= top else top + 1)] += 1
        if counted:
            run = 0
            for v in range(hw):
                h = hist[v] + hist[hw + v] + hist[2 * hw + v] + hist[3 * hw + v]
                hist[v] = run
                run += h
            for j in range(lim_vals.shape[0]):
                lim = lim_vals[j]
                lclass[r, j] = 0 if lim < 0 else hist[lim] + 1
        else:
            for j in range(lim_vals.shape[0]):
                lim = lim_vals[j]
                lclass[r, j] = 0 if lim < 0 else _count_below(fw, n_fleet, lim) + 1
    has_signal = qb > 0
    matched = 0
    if has_signal and m_worker.shape[0] > 0:
        matched = min(best_prefix, qb)
    # candidates once per knob group; whether a limit gates any of them (when
    # none is gated, neither the fell-back tier nor the pin can fire, so the
    # floor cannot change the outcome)
    k_routing = knobs.chat_routing
    n_plain = -1
    for g in range(group_n.shape[0]):
        c0 = group_rep[g]
        n = 0
        if k_routing[c0] == REORG:
            if n_plain < 0:
                n_plain = 0
                for j in range(n_fleet):
                    n_plain += plain[fleet[j]]
            if n_plain != 0 and n_plain != n_fleet:
                group_n[g] = -1  # two buckets: decided config by config
                for j in range(lim_vals.shape[0]):
                    gated_n[g, j] = 1
                continue
            if has_signal and m_worker.shape[0] > 0:
                n = reorg_prepare_nb(L, qb, m_worker, m_blocks, fleet, snap, est,
                                     knobs.cache_affinity_min_matched_tokens[c0],
                                     knobs.cache_affinity_min_match_ratio[c0],
                                     knobs.cache_candidate_min_workers[c0], knobs.cache_candidate_ratio[c0],
                                     knobs.cache_candidate_max_workers[c0], cands[g], scratch_i[0])
        elif has_signal and m_worker.shape[0] > 0:
            n = prepare_candidates_nb(L, qb, m_worker, m_blocks, in_fleet, n_fleet, snap, est,
                                      knobs.cache_affinity_min_matched_tokens[c0],
                                      knobs.cache_affinity_min_match_ratio[c0],
                                      knobs.cache_candidate_min_workers[c0],
                                      knobs.cache_candidate_ratio[c0],
                                      knobs.cache_candidate_max_workers[c0],
                                      seen, cands[g], scratch_i[0])
        group_n[g] = n
        wcol = gate_column_nb(k_scaling[c0])
        # the candidates' gate readings once (-1: no fresh sample, never gated)
        reading = scratch_i[1]
        for t in range(n):
            w = cands[g, t, C_WORKER]
            reading[t] = snap[w, wcol] if snap[w, S_BASIC] == 1 else -1
        for j in range(lim_vals.shape[0]):
            lim = lim_vals[j]
            n_gated = 0
            if lim >= 0:
                for t in range(n):
                    n_gated += reading[t] >= lim
            gated_n[g, j] = n_gated
    width = n_fleet + 2
    rwidth = cands.shape[1] + 1
    used = 0
    n_ladder = 0
    n_dist = 0
    n_rungs = 0
    gl_cfg = sc.gl_cfg
    gl_end = sc.gl_end
    gl_floor = sc.gl_floor
    run_slot = sc.run_slot
    parent = plan.parent
    # configs in runs of one (group, limit): inside a run only the floor class
    # can change the decision, so each run computes (or looks up) at most three.
    # Each config whose decision differs from its parent's (and every config
    # that is its own parent) goes on the booking list for accumulate.py.  Inside
    # a run each config hangs off the one before (config_runs checks), so a
    # config books exactly when its floor class's row differs from the previous
    # config's, and a run whose limit gates no candidate decides alike
    # throughout: only its first config can book.
    n_book = 0
    key = 0
    rkey = draw_key_nb(seed, req_index)
    t = 0
    while t < n_cfg:
        c = gl_cfg[t]
        end = gl_end[t]
        g = group[c]
        li = cfg_li[c]
        wcol = gate_column_nb(k_scaling[c])
        r = 1 if wcol == S_WAITING_PER_RANK else 0
        lcl = lclass[r, li]
        n_gated = gated_n[g, li]
        fmin = fmin1 if r == 1 else fmin0
        run_slot[t] = -1
        # the run's decision row per floor class so far (-1 = none yet), kept in
        # registers: a config's class comes from its floor and fmin, not from memory
        s0 = -1
        s1 = -1
        s2 = -1
        prev = -1
        reorg = k_routing[c] == REORG
        direct = reorg and group_n[g] < 0
        for tt in range(t, end):
            c = gl_cfg[tt]
            fl = gl_floor[tt]
            fcl = 0 if fl < 0 else (2 if fmin < fl else 1)
            fc = fcl if n_gated > 0 else 0
            slot = -1 if direct else (s0 if fc == 0 else (s1 if fc == 1 else s2))
            if slot < 0:
                key = (g * width + lcl) * 3 + fc
                slot = -1 if direct else memo[key]
                if slot < 0:
                    if not direct:
                        scratch_i[6, used] = key
                        used += 1
                    lim = k_limit[c]
                    all_queued = lim >= 0 and n_fleet > 0 and n_absent == 0 and lcl == 1
                    # the cache rung sees the limit only through the set of gated candidates
                    # (the gate is monotone in the limit, so their count names the set) and
                    # whether the fleet is all queued; the floor through its class: one
                    # evaluation per rung key, and a rung that chose decides the whole row
                    rk = ((g * rwidth + n_gated) * 2 + (1 if all_queued else 0)) * 3 + fc
                    rrow = rung[rk]
                    outcome = -1
                    if not reorg and rrow[_R_SET] == 1 and rrow[_R_W] >= 0:
                        slot = rrow[_R_SLOT]
                    else:
                        slot = n_dist
                        if reorg:
                            # the reorg: no rung or ladder sharing (its miss fallback draws over
                            # the unqueued tier, named by the limit class like the whole key)
                            failure = -1
                            decision = -1
                            if direct:
                                w, reason, outcome = select_reorg_nb(
                                    L, qb, m_worker, m_blocks, fleet, plain, snap, est, knobs, c, seed,
                                    req_index, audit, scratch_i, cands[g])
                            elif n_fleet == 0:
                                w, reason, outcome = -1, -1, NO_WORKERS
                                for j in range(A_NCOLS):
                                    audit[j] = 0
                                audit[A_REASON] = -2
                            else:
                                w, reason, outcome, _d = pick_nb(
                                    group_n[g], cands[g], L, fleet, snap, est, lim, k_floor[c], k_margin[c],
                                    k_guard[c] == 1, k_abs_tokens[c], k_abs_ms[c], k_rel[c],
                                    knobs.max_in_flight[c], knobs.power_of_n_choices[c],
                                    knobs.variant_reorg_ranking[c], rkey, 0, audit, scratch_i, all_queued,
                                    fcl == 2)
                                if w < 0:   # the bucket failed: no other bucket has engines
                                    for j in range(A_NCOLS):
                                        audit[j] = 0
                                    audit[A_REASON] = -2
                        elif rrow[_R_SET] == 1:
                            for j in range(A_NCOLS):
                                audit[j] = rrow[j]
                            w = np.int64(-1)
                            reason = rrow[_R_REASON]
                            decision = rrow[_R_LABEL]
                        else:
                            w, reason, decision = cache_rung_with_nb(
                                group_n[g], cands[g], L, snap, est, lim, k_floor[c],
                                k_margin[c], k_guard[c] == 1,
                                k_abs_tokens[c], k_abs_ms[c],
                                k_rel[c], audit, scratch_i, all_queued, fcl == 2, wcol,
                                k_pin_order[c] == PIN_LOCALITY)
                            for j in range(A_NCOLS):
                                rrow[j] = audit[j]
                            rrow[_R_SET] = 1
                            rrow[_R_W] = w
                            rrow[_R_REASON] = reason
                            rrow[_R_LABEL] = decision
                            scratch_i[8, n_rungs] = rk
                            n_rungs += 1
                        if not reorg:
                            failure = -1
                        if w < 0 and not reorg:
                            # the domain rungs depend on (group, limit class) only: computed once
                            lk = g * width + lcl
                            if ladder_w[lk] == -2:
                                # the sampler's tier: the queue-gate tier (absent readings pass the
                                # gate), or the whole fleet without a limit or when it is empty; as
                                # a bit set over fleet positions, 64 a word (a compare per worker
                                # and no list to build: only the drawn positions are looked up)
                                bits = scratch_i[0]
                                m = 0
                                if lim >= 0:
                                    fw = fleet_wait[r]
                                    for q in range((n_fleet + 63) >> 6):
                                        lo = q << 6
                                        word = np.int64(0)
                                        for j in range(lo, min(lo + 64, n_fleet)):
                                            x = fw[j]
                                            word |= np.int64((x < lim) | (x == big)) << (j - lo)
                                        bits[q] = word
                                        m += popcount(word)
                                whole = m == 0
                                if whole:
                                    m = n_fleet
                                lw, lr = domain_rungs_bits_nb(fleet, bits, whole, m, snap, est, L, lim, wcol,
                                                              k_choices[c], rkey, scratch_i[1], scratch_i[5])
                                ladder_w[lk] = lw
                                ladder_r[lk] = lr
                                scratch_i[7, n_ladder] = lk
                                n_ladder += 1
                            w = ladder_w[lk]
                            reason = ladder_r[lk]
                            if w < 0:
                                decision = -1
                                failure = failure_of_nb(group_n[g] > 0, n_fleet)
                        row = res_i[n_dist]
                        row[O_WORKER] = w
                        row[O_REASON] = reason
                        row[O_POLICY_REASON] = _POLICY_OF_REASON[reason] if reason >= 0 and not reorg else -1
                        row[O_REORG_OUTCOME] = outcome
                        row[O_DECISION] = decision
                        row[O_FAILURE] = failure
                        row[O_MATCHED_BLOCKS] = matched
                        resolved = audit[A_REASON] != -2
                        row[O_GATE_REJECTED] = audit[A_GATE_REJECTED]
                        row[O_ADMISSION_EVALUATED] = audit[A_EVALUATED]
                        row[O_ADMISSION_REJECTED] = audit[A_ADM_REJECTED]
                        row[O_BEST_REJECTED_BLOCKS] = audit[A_BEST_REJECTED]
                        row[O_FLEET_ALL_QUEUED] = audit[A_ALL_QUEUED]
                        row[O_FELL_BACK] = audit[A_FELL_BACK]
                        row[O_GUARD_COMPARED] = audit[A_COMPARED]
                        row[O_GUARD_OVERRIDES] = audit[A_OVERRIDES]
                        row[O_PRESSURE_SOURCE] = audit[A_SOURCE] if resolved else -1
                        if w >= 0:
                            _q, _m, sel_blocks, uncached = locality_nb(L, qb, best_prefix, m_worker, m_blocks, w)
                            if reorg and qb > 0:   # the chosen worker's deepest entry (reference.worker_blocks)
                                blocks = min(merged_blocks_nb(m_worker, m_blocks, w), qb)
                                sel_blocks = min(blocks, matched)
                                uncached = max(L - (L * blocks) // qb, 0)
                            row[O_SELECTED_BLOCKS] = sel_blocks
                            row[O_UNCACHED_TOKENS] = uncached
                            (row[O_LOST_CANDIDATES], row[O_LOST_QUEUE_GATE], row[O_LOST_CAPACITY],
                             row[O_LOST_TO]) = waterfall_nb(matched, sel_blocks, reason, audit)
                            row[O_SELECTED_WAITING] = snap[w, S_WAITING] if snap[w, S_BASIC] == 1 else -1
                            row[O_SELECTED_WAITING_UNCACHED] = snap[w, S_WU] if snap[w, S_NATIVE] == 1 else -1
                            res_f[n_dist, F_SELECTED_QUEUE_MS] = est[w]
                        else:
                            row[O_SELECTED_BLOCKS] = 0
                            row[O_UNCACHED_TOKENS] = -1
                            row[O_LOST_CANDIDATES] = 0
                            row[O_LOST_QUEUE_GATE] = 0
                            row[O_LOST_CAPACITY] = 0
                            row[O_LOST_TO] = -1
                            row[O_SELECTED_WAITING] = -1
                            row[O_SELECTED_WAITING_UNCACHED] = -1
                            res_f[n_dist, F_SELECTED_QUEUE_MS] = np.nan
                        # an outcome equal in every field to one computed before (another key can
                        # decide alike) refers to that one, so it books as shared
                        # (the float field is est[w] or NaN: equal whenever the worker is)
                        for d in range(n_dist):
                            rd = res_i[d]
                            same = True
                            for col in range(O_NCOLS):
                                if rd[col] != row[col]:
                                    same = False
                                    break
                            if same:
                                slot = d
                                break
                        if slot == n_dist:
                            n_dist += 1
                        if rrow[_R_W] >= 0 and not reorg:
                            rrow[_R_SLOT] = slot
                    if not direct:
                        memo[key] = slot
                if fc == 0:
                    s0 = slot
                elif fc == 1:
                    s1 = slot
                else:
                    s2 = slot
            src_of[c] = slot
            if tt > t:
                if slot != prev:
                    src_of[n_cfg + 1 + n_book] = c
                    n_book += 1
            else:
                p = parent[c]
                if p == c or src_of[p] != slot:
                    src_of[n_cfg + 1 + n_book] = c
                    n_book += 1
            prev = slot
            if n_gated == 0:
                run_slot[t] = slot   # the other configs of the run: run_chunk_nb reads it
                break
        t = end
    src_of[n_cfg] = n_book
    for u in range(used):
        memo[scratch_i[6, u]] = -1
    for u in range(n_ladder):
        ladder_w[scratch_i[7, u]] = -2
    for u in range(n_rungs):
        rung[scratch_i[8, u], _R_SET] = 0
    return n_rungs, n_ladder, fleet_min, n_fleet - n_absent


# the grid kernel calls _decide_request through its address (``link``), not linked
# into its own module (_jit.call_at; warm.link makes the link)
_decide_request_at = call_at("_decide_request", _decide_request, types.UniTuple(types.int64, 4))


@njit(allocates=False)
def run_chunk_nb(blocks, req, matches, fleets, loads, dp_size, freshness, knobs, plan, seed,
                 max_matches, keep, out, totals, link, sc, snapshot):
    """Replay a chunk of requests under every config, one block of requests per thread.

    Arguments are the named tuples of ``kernels/layout.py``: ``blocks``
    (BlockStates), ``req`` (Requests), ``matches`` (Matches, offsets from the
    chunk's first request), ``fleets`` (Fleets), ``loads`` (LoadColumns),
    ``knobs`` (KnobArrays), ``plan`` (GridPlan), ``out`` (Outputs) and
    ``totals`` (Accumulators); ``link`` is ``_decide_request``'s link
    (``warm.link``: the address it is called through); ``sc`` and
    ``snapshot`` the block's working memory as :func:`new_scratch` makes it
    (made in Python: the allocations compiled numba's ``np.zeros``/``np.full``
    overloads, about 20 of them, on a first start).

    Block ``b`` covers requests ``blocks.lo[b]..blocks.lo[b+1]`` and starts
    from its own copy of the load state (``split_states_nb``); it sweeps its
    own loads, keeps its own snapshot current (``refresh_until_nb``), decides every
    config and books the results into its own accumulators
    ``totals.acc[b]``... (merged exactly afterwards); ``totals.stats[b]`` counts
    the cache-rung and domain-rung evaluations it computed.  With
    ``keep``, every decision is also written to ``out.ints[O_*, i, c]`` /
    ``out.floats[F_*, i, c]`` (one contiguous array per column).  Results
    depend on nothing but (trace, config, seed), never on threads or chunking.
    ``out.fleet_min[i]``/``out.fleet_fresh[i]`` get the request's fleet
    readings as ``replay/sweep/readings.py`` defines them (smallest fresh basic
    waiting count of its fleet, -1 when none; fleet workers with one).
    """
    # numba's parfors do not see writes made through a tuple's array fields
    # inside the parallel loop: every array the loop writes is unpacked here
    block_lo = blocks.lo
    ptrs = blocks.ptrs
    tables = blocks.tables
    inflights = blocks.inflights
    out_i = out.ints
    out_f = out.floats
    fleet_min = out.fleet_min
    fleet_fresh = out.fleet_fresh
    acc = totals.acc
    hist_wait = totals.hist_wait
    hist_div = totals.hist_div
    stats = totals.stats
    n_blocks = block_lo.shape[0] - 1
    fleet_off = fleets.offsets
    n_cfg = plan.group.shape[0]
    has_selected = req.selected_worker.shape[0] > 0
    req_ts = req.ts
    req_model = req.model
    req_selected = req.selected_worker
    req_qb = req.query_blocks
    m_off = matches.offsets
    fleet_w = fleets.workers
    parent = plan.parent
    if n_blocks != 1:
        raise ValueError("run_chunk_nb replays one block per call (sc and snapshot are that block's)")
    snap, est, oldest, dirty = snapshot
    knobs_at = address_of(knobs)
    sc_at = address_of(sc)
    for b in range(n_blocks):
        table = tables[b]
        inflight = inflights[b]
        ptr = ptrs[b]
        block_totals = layout_acc(acc, hist_wait, hist_div, stats)
        s_rung = 0
        s_ladder = 0
        bound = UNKNOWN_OLDEST
        for i in range(block_lo[b], block_lo[b + 1]):
            now = req_ts[i]
            ptr = advance_dirty_nb(ptr, now, loads, dp_size, table, inflight, dirty)
            bound = refresh_until_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty, bound)
            mdl = req_model[i]
            fleet = fleet_w[fleet_off[mdl]:fleet_off[mdl + 1]]
            lo = m_off[i]
            hi = m_off[i + 1]
            n_rung, n_ladder, fleet_min[i], fleet_fresh[i] = _decide_request_at(link, (
                req.index[i], req.input_tokens[i], req.query_blocks[i], req.best_prefix_blocks[i],
                matches.worker[lo:hi], matches.blocks[lo:hi], fleets.member[mdl], fleet, fleets.plain, snap, est,
                knobs_at, plan, seed, sc_at))
            s_rung += n_rung
            s_ladder += n_ladder
            sel = req_selected[i] if has_selected else -1
            accumulate_request_nb(block_totals, b, sc.res_i, sc.res_f, sc.src_of, parent,
                                  req_qb[i], sel, sc.terms)
            if keep:
                t = 0
                while t < n_cfg:
                    end = sc.gl_end[t]
                    uniform = sc.run_slot[t]
                    for tt in range(t, end):
                        c = sc.gl_cfg[tt]
                        src = uniform if uniform >= 0 else sc.src_of[c]
                        for col in range(O_NCOLS):
                            out_i[col, i, c] = sc.res_i[src, col]
                        for col in range(F_NCOLS):
                            out_f[col, i, c] = sc.res_f[src, col]
                    t = end
        n_sel = 0
        if has_selected:
            for i in range(block_lo[b], block_lo[b + 1]):
                n_sel += req_selected[i] >= 0
        book_block_constants_nb(acc, b, parent, block_lo[b + 1] - block_lo[b], n_sel)
        stats[b, 0] += s_rung  # once per block: neighbouring blocks share a cache line
        stats[b, 1] += s_ladder
        ptrs[b] = ptr
