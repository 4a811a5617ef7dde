"""Load-snapshot kernels (ROUTER_SEMANTICS.md section 1).

The per-rank table is a set of 2-D arrays indexed ``[worker, rank]`` that a
sweep updates in time order (``advance_nb``); ``capture_nb`` then builds the
per-worker fresh aggregates a request sees.  Snapshot rows are int64 vectors
indexed by the ``S_*`` column constants below plus one float64 estimate.
"""

from __future__ import annotations

import math

import numpy as np

from replay.kernels._jit import njit

# Columns of a captured snapshot row (int64), one row per worker.
S_BASIC = 0      # 1 when the basic aggregate is present
S_WAITING = 1    # sum of num_waiting_reqs over required ranks
S_NATIVE = 2     # 1 when the native aggregate is present
S_RUNNING = 3    # sum of num_running_reqs
S_WU = 4         # sum of num_waiting_uncached_tokens
S_TOTAL = 5      # sum of num_total_tokens
S_MAXTOT = 6     # sum of max_total_num_tokens
S_MAXRUN = 7     # sum of max_running_requests
S_INFLIGHT = 8   # router-local in-flight count (section 0, items 3 and 15)
S_WAITING_PER_RANK = 9  # S_WAITING // required ranks (the per-worker floor-scaling variant's gate)
S_NCOLS = 10

# Columns of the per-rank table (int64), indexed [worker, rank, column].
R_HAS = 0
R_AT = 1
R_RUNNING = 2
R_WAITING = 3
R_TOKENS = 4
R_MAXTOT = 5
R_TAIL = 6
R_WU = 7
R_TOTAL = 8
R_MAXRUN = 9
R_PTOK = 10
R_PBUSY = 11
R_PREV_OK = 12   # previous stored sample had a native tail
R_PREV_PTOK = 13
R_PREV_PBUSY = 14
R_NCOLS = 15


def new_rank_table(n_workers: int, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty per-rank table and per-worker in-flight vector."""
    return (
        np.zeros((n_workers, max(n_ranks, 1), R_NCOLS), dtype=np.int64),
        np.zeros(n_workers, dtype=np.int64),
    )


@njit
def advance_nb(ptr, upto_ts, loads, dp_size, table, inflight):
    """Apply every load sample (``layout.LoadColumns``) with ``ts <= upto_ts`` from
    ``ptr`` on; return the new pointer."""
    return advance_dirty_nb(ptr, upto_ts, loads, dp_size, table, inflight,
                            np.zeros(inflight.shape[0], dtype=np.bool_))


@njit(allocates=False)
def advance_dirty_nb(ptr, upto_ts, loads, dp_size, table, inflight, dirty):
    """``advance_nb`` that also marks every worker a sample touched in ``dirty``.

    Last value wins per (worker, rank); the previous sample's native tail is
    kept for throughput deltas whatever its age (section 1.2).  Samples of a
    rank outside ``0..dp_size-1`` are ignored for loads, but their
    ``router_inflight`` still counts (section 0, item 15: any rank).
    """
    n = loads.ts.shape[0]
    while ptr < n and loads.ts[ptr] <= upto_ts:
        w = loads.worker[ptr]
        r = loads.rank[ptr]
        dirty[w] = True
        if loads.router_inflight[ptr] >= 0:
            inflight[w] = loads.router_inflight[ptr]
        dp = dp_size[w]
        if dp > 0 and r >= dp:
            ptr += 1
            continue
        row = table[w, r]
        if row[R_HAS] == 1 and row[R_TAIL] == 1:
            row[R_PREV_OK] = 1
            row[R_PREV_PTOK] = row[R_PTOK]
            row[R_PREV_PBUSY] = row[R_PBUSY]
        else:
            row[R_PREV_OK] = 0
        row[R_HAS] = 1
        row[R_AT] = loads.ts[ptr]
        row[R_RUNNING] = loads.running[ptr]
        row[R_WAITING] = loads.waiting[ptr]
        row[R_TOKENS] = loads.num_tokens[ptr]
        row[R_MAXTOT] = loads.max_total[ptr]
        if loads.has_tail[ptr]:
            row[R_TAIL] = 1
            row[R_WU] = loads.waiting_uncached[ptr]
            row[R_TOTAL] = loads.total_tokens[ptr]
            row[R_MAXRUN] = loads.max_running[ptr]
            row[R_PTOK] = loads.prefill_tokens[ptr]
            row[R_PBUSY] = loads.prefill_busy_us[ptr]
        else:
            row[R_TAIL] = 0
        ptr += 1
    return ptr


@njit(allocates=False, inline=True)
def capture_worker_nb(table, inflight, dp_size, w, now, freshness, out, out_est):
    """Fill snapshot row ``out`` (and ``out_est[0]``) for worker ``w`` at time ``now``.

    Basic: every required rank observed and fresh (inclusive window); sums.
    Native: additionally every rank has the tail, max_total_num_tokens != 0 and
    max_running_requests != 0.  Estimate: every rank has a valid rate.
    Returns the oldest rank timestamp (``captured_at``) when basic is present.
    """
    for j in range(S_NCOLS):
        out[j] = 0
    out[S_INFLIGHT] = inflight[w]
    out_est[0] = np.nan
    dp = dp_size[w]
    n_ranks = dp if dp > 0 else table.shape[1]
    count = 0
    native = True
    rates_ok = True
    rate_sum = 0.0
    oldest = now
    waiting = 0
    running = 0
    wu = 0
    total = 0
    maxtot = 0
    maxrun = 0
    for r in range(n_ranks):
        row = table[w, r]
        if row[R_HAS] == 0:
            if dp > 0:
                return oldest
            continue
        if now - row[R_AT] > freshness:
            return oldest
        if row[R_AT] < oldest:
            oldest = row[R_AT]
        count += 1
        waiting += row[R_WAITING]
        running += row[R_RUNNING]
        maxtot += row[R_MAXTOT]
        if row[R_TAIL] == 1 and row[R_MAXTOT] != 0 and row[R_MAXRUN] != 0:
            wu += row[R_WU]
            total += row[R_TOTAL]
            maxrun += row[R_MAXRUN]
            dtok = row[R_PTOK] - row[R_PREV_PTOK]
            dbusy = row[R_PBUSY] - row[R_PREV_PBUSY]
            if row[R_PREV_OK] == 1 and dtok > 0 and dbusy > 0:
                rate = 1e6 * dtok / dbusy
                if math.isfinite(rate) and rate > 0.0:
                    rate_sum += rate
                else:
                    rates_ok = False
            else:
                rates_ok = False
        else:
            native = False
    if count == 0:
        return oldest
    out[S_BASIC] = 1
    out[S_WAITING] = waiting
    # count = the worker's required ranks (its dp_size, else the ranks observed)
    out[S_WAITING_PER_RANK] = waiting // count
    if native:
        out[S_NATIVE] = 1
        out[S_RUNNING] = running
        out[S_WU] = wu
        out[S_TOTAL] = total
        out[S_MAXTOT] = maxtot
        out[S_MAXRUN] = maxrun
        if rates_ok:
            out_est[0] = 1000.0 * wu / rate_sum
    return oldest


@njit
def capture_all_nb(table, inflight, dp_size, now, freshness, snap, est):
    """Capture every worker at ``now`` into ``snap[w]`` / ``est[w]``."""
    for w in range(snap.shape[0]):
        capture_worker_nb(table, inflight, dp_size, w, now, freshness, snap[w], est[w:w + 1])


# ``refresh_until_nb``'s bound before a snapshot's first refresh (or when it is
# not kept): every fresh worker is checked for its age
UNKNOWN_OLDEST = np.int64(-(1 << 63))
_NO_FRESH = np.int64((1 << 63) - 1)


@njit(allocates=False)
def refresh_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty):
    """Bring a running snapshot to time ``now``: recapture the workers a sample
    touched since the last call, and drop the ones whose oldest rank has aged
    out of the window (time only moves forward, so a dropped worker comes back
    only through a new sample, which marks it dirty).  Equal to
    ``capture_all_nb(now)`` whenever every worker was dirty or captured before.
    """
    refresh_until_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty, UNKNOWN_OLDEST)


@njit(allocates=False, inline=True)
def refresh_until_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty, bound):
    """``refresh_nb`` given ``bound``, what the previous call on this snapshot
    returned: no fresh worker's ``oldest`` is below it.  While ``now - bound``
    is within the window no fresh worker can have aged out, so only the
    touched workers are visited (the grid pass refreshes once per request, and
    a worker ages out about once per window at most).  Returns the bound for
    the next call (``UNKNOWN_OLDEST`` makes this call check every worker).
    """
    check_age = bound == UNKNOWN_OLDEST or now - bound > freshness
    low = _NO_FRESH if check_age else bound
    for w in range(snap.shape[0]):
        if dirty[w]:
            dirty[w] = False
            oldest[w] = capture_worker_nb(table, inflight, dp_size, w, now, freshness, snap[w], est[w:w + 1])
            if snap[w, S_BASIC] == 1 and oldest[w] < low:
                low = oldest[w]
        elif check_age and snap[w, S_BASIC] == 1:
            if now - oldest[w] > freshness:
                for j in range(S_NCOLS):
                    snap[w, j] = 0
                snap[w, S_INFLIGHT] = inflight[w]
                est[w] = np.nan
            elif oldest[w] < low:
                low = oldest[w]
    return low


@njit
def carry_mask_nb(load_worker, load_rank, load_inflight, n_ranks, keep):
    """Mark in ``keep`` the samples the per-rank table and the in-flight counts
    still depend on after the last of them (samples in time order): each
    (worker, rank)'s last two samples (the latest, and the previous one whose
    native tail feeds the throughput delta) and each worker's last sample with
    a ``router_inflight`` value.  Ranks are ``0..n_ranks-1``."""
    n_w = 0
    for i in range(load_worker.shape[0]):
        if load_worker[i] + 1 > n_w:
            n_w = load_worker[i] + 1
    seen = np.zeros(n_w * n_ranks, dtype=np.int8)
    seen_inf = np.zeros(n_w, dtype=np.bool_)
    for i in range(load_worker.shape[0] - 1, -1, -1):
        w = load_worker[i]
        k = w * n_ranks + load_rank[i]
        if seen[k] < 2:
            seen[k] += 1
            keep[i] = True
        if load_inflight[i] >= 0 and not seen_inf[w]:
            seen_inf[w] = True
            keep[i] = True


@njit(allocates=False)
def fleet_reading_nb(snap, fleet):
    """``(smallest fresh basic waiting count, fresh workers)`` over the worker ids
    ``fleet`` of a captured snapshot; -1 as the count when none is fresh."""
    best = -1
    n_fresh = 0
    for j in range(fleet.shape[0]):
        w = fleet[j]
        if snap[w, S_BASIC] == 1:
            n_fresh += 1
            if best < 0 or snap[w, S_WAITING] < best:
                best = snap[w, S_WAITING]
    return best, n_fresh


@njit
def fleet_readings_nb(req_ts, req_model, loads, dp_size, table, inflight, fleets, freshness,
                      out_min, out_fresh):
    """The replay's own snapshot per request (``req_ts`` ascending), reduced by
    ``fleet_reading_nb`` over the request's fleet (``layout.Fleets``) into
    ``out_min[i]``/``out_fresh[i]``: the grid pass's fleet readings as a pass of
    their own, for traces replayed otherwise."""
    n_w = inflight.shape[0]
    snap = np.zeros((n_w, S_NCOLS), dtype=np.int64)
    est = np.full(n_w, np.nan)
    oldest = np.zeros(n_w, dtype=np.int64)
    dirty = np.ones(n_w, dtype=np.bool_)
    ptr = 0
    for i in range(req_ts.shape[0]):
        now = req_ts[i]
        ptr = advance_dirty_nb(ptr, now, loads, dp_size, table, inflight, dirty)
        refresh_nb(table, inflight, dp_size, now, freshness, snap, est, oldest, dirty)
        m = req_model[i]
        out_min[i], out_fresh[i] = fleet_reading_nb(
            snap, fleets.workers[fleets.offsets[m]:fleets.offsets[m + 1]])
