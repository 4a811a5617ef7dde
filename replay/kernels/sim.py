"""The simulator's numba event loop (docs/simulator.md describes the model).

One call of :func:`simulate_nb` runs one closed-loop simulation: requests
arrive, the router decides with the sweep's own kernels
(``replay.kernels.decide.select_prefill_nb`` on a snapshot kept by
``replay.kernels.snapshot.advance_dirty_nb`` / ``refresh_nb`` over the very
load samples the simulation writes), ranks queue, prefill, decode and cache,
and every rank publishes a LoadStat sample every publish interval.

Events at one timestamp are handled in a fixed order: step ends (rank by
rank), then samples (rank by rank), then arrivals (log order).  So a request
at ``t`` sees every sample stamped ``<= t`` and nothing later, exactly the
replay's visibility rule; and since the router reads loads only through the
samples it wrote, ``sweep`` on the written trace reproduces every decision.

State lives in flat arrays: per-rank scalars ``rs[r, RS_*]``, per-request
``st[i, ST_*]`` and outputs ``rq[i, RQ_*]``, per-(rank, block) cache arrays,
a per-rank LRU heap of evictable leaf blocks (lazy deletion, rebuilt when
full), and a per-(worker, block) KV index fed through a lag queue.
"""

from __future__ import annotations

import numba
import numpy as np

from replay.kernels._jit import JIT, njit
from replay.kernels.decide import A_NCOLS, C_NCOLS, select_prefill_nb
from replay.kernels.layout import LoadColumns
from replay.kernels.reorg import REORG, select_reorg_nb
from replay.kernels.rng import draw_nb
from replay.kernels.snapshot import (
    R_AT,
    R_HAS,
    R_MAXRUN,
    R_MAXTOT,
    R_NCOLS,
    R_PBUSY,
    R_PREV_OK,
    R_PREV_PBUSY,
    R_PREV_PTOK,
    R_PTOK,
    R_RUNNING,
    R_TAIL,
    R_TOKENS,
    R_TOTAL,
    R_WAITING,
    R_WU,
    S_NCOLS,
    advance_dirty_nb,
    refresh_nb,
)

INF = np.int64(1) << 62

# the smallest helpers of the hot loops are inlined (no call, no reference counting of
# their array arguments); inlining the larger ones doubled the compile time for 15%
inline = numba.njit(inline="always", **JIT)

# per-rank scalars
RS_WORKER = 0
RS_LOCAL = 1          # rank number inside its worker
RS_CAP = 2            # max_total_num_tokens
RS_MAXRUN = 3
RS_DECODE_NS = 4      # one decode step
RS_USED = 5           # KV tokens in use: every cached block + running requests' private tokens
RS_EVICTABLE = 6      # tokens of cached blocks no running request holds
RS_QHEAD = 7
RS_QTAIL = 8
RS_QLEN = 9
RS_QWU = 10           # sum of waiting requests' uncached estimates
RS_QTOK = 11          # sum of waiting requests' input tokens
RS_RUN_N = 12
RS_KIND = 13          # 0 idle, 1 prefill step, 2 decode step
RS_END = 14           # end of the current step (INF when idle)
RS_STEP_TOK = 15
RS_STEP_DUR = 16
RS_PTOK = 17          # total_prefill_uncached_tokens (monotonic)
RS_PBUSY_NS = 18      # prefill busy time (ns; published in us)
RS_NEXT_SAMPLE = 19
RS_HN = 20            # LRU heap size
RS_MAX_USED = 21      # largest RS_USED seen
RS_MAX_QLEN = 22
RS_STEP_START = 23    # start of the current step
RS_STEP_K = 24        # decode steps the current step stands for (see _start_step)
RS_DECODE_SLOPE = 25  # ns a decode step grows by per running request beyond the first
RS_CHUNK = 26         # chunked_prefill_size (0: off)
RS_CHUNK_REQ = 27     # request whose prefill continues in the next step (-1: none)
RS_POLICY = 28        # waiting-queue order: POLICY_FCFS or POLICY_LPM
RS_PUB_DELAY = 29     # on-change publishing: delay from a change to its sample (0: interval mode)
RS_PUB_IDLE = 30      # on-change publishing: heartbeat after this long without a change
RS_DUE_KIND = 31      # what RS_NEXT_SAMPLE is: DUE_CHANGE or DUE_HEARTBEAT
RS_HB_PENDING = 32    # time of a heartbeat not yet written (-1: none; see _flush_heartbeats)
RS_HB_INF = 33        # router_inflight when that heartbeat was due
RS_LAST_ROW = 34      # index of the rank's latest written sample (-1: none)
RS_MAXPF = 35         # max_prefill_tokens: prompt tokens one prefill step may admit
RS_DEC_COUNT = 36     # decode steps run so far (the engine's load snapshot: every 15th)
RS_DS_TS = 37         # the engine's latest load snapshot for its DP controller: stamp,
RS_DS_REQ = 38        # running + waiting requests,
RS_DS_TOK = 39        # KV tokens in use + waiting requests' tokens
RS_BUD_TS = 40        # the DP controller's view of the rank: stamp of the snapshot applied,
RS_BUD_REQ = 41       # requests (+1 per dispatch since),
RS_BUD_TOK = 42       # tokens (+prompt per dispatch since)
RS_NO_DECAY = 43      # the current decode step retracted: the ratio does not decay
RS_RATIO = 44         # new_token_ratio, in units of 1e-9 (integer: the same in jit and plain Python)
RS_NR_INIT = 45       # its initial value, floor and decay per decode step (1e-9 units)
RS_NR_MIN = 46
RS_NR_DECAY = 47
RS_MIXED = 48         # enable_mixed_chunk
RS_STEP_MIX = 49      # the current prefill step carries the running decodes (mixed chunk)
RS_NCOLS = 50

# in-worker data-parallel dispatch (the fleet's load_balance_method)
LB_ROUND_ROBIN = 0
LB_TOTAL_REQUESTS = 1
LB_TOTAL_TOKENS = 2
LB_BOOTSTRAP_ROOM = 3   # a seeded draw per request
LB_ROUTER = 4           # the router picks the rank from its own per-rank view
LB_PREFIX_AFFINITY = 5  # the rank holding the longest cached prefix, then the least loaded
DPC_REFRESH_NS = 20_000_000   # the controller re-reads the ranks' snapshots at most this often
SNAPSHOT_DECODE_STEPS = 15    # a rank writes its snapshot after every 15th decode step
CLIP_MAX_NEW = 4096           # the new-token reservation is clipped at this many tokens
BOOTSTRAP_DRAW = 1 << 40      # the draw index of follow_bootstrap_room's per-request room
RETRACT_DECODE_STEPS = 20     # the ratio after a retraction counts this many steps per request
RATIO_ONE = 1_000_000_000     # new_token_ratio 1.0 in RS_RATIO units
# columns of the per-rank engine options ``rank_eng``
EN_MAXPF = 0
EN_NR_INIT = 1
EN_NR_MIN = 2
EN_NR_DECAY = 3
EN_MIXED = 4
EN_NCOLS = 5

POLICY_FCFS = 0
POLICY_LPM = 1
LPM_MAX_QUEUE = 128   # SGLang falls back to FCFS order above this many waiting requests
DUE_CHANGE = 0
DUE_HEARTBEAT = 1

# per-request state
ST_STATUS = 0         # 0 not arrived, 1 waiting, 2 prefilling, 3 decoding, 4 done
ST_QNEXT = 1
ST_REMAIN = 2
ST_PRIVATE = 3        # tokens outside cacheable blocks (partial tail + output), reserved on admission
ST_UNC_ENQ = 4        # uncached estimate when queued (num_waiting_uncached_tokens)
ST_PF_LEFT = 5        # prompt tokens still to compute (chunked prefill)
ST_FULL = 6           # leading blocks the cache may hold: the full ones (CAPTURE.md s.2: full pages only)
ST_OUT = 7            # output tokens produced so far (a retracted request recomputes them)
ST_GENKV = 8          # KV tokens held for output (one per decode step; freed on retraction)
ST_SEQ = 9            # tokens when queued (prompt + output so far: num_total_tokens' share)
ST_NCOLS = 10

# per-request outputs
RQ_WORKER = 0
RQ_RANK = 1
RQ_REASON = 2
RQ_DECISION = 3
RQ_FAILURE = 4
RQ_CACHED_TOKENS = 5
RQ_CACHED_BLOCKS = 6
RQ_ADMIT = 7
RQ_FIRST = 8
RQ_DONE = 9
RQ_BEST = 10
RQ_COMPLETIONS = 11   # times the request completed (conservation: exactly 1)
RQ_REORG_OUTCOME = 12  # labels.REORG_OUTCOMES code under --chat-routing reorg, else -1
RQ_NCOLS = 13

# load sample columns (the loads.parquet columns, in order)
LD_TS = 0
LD_WORKER = 1
LD_RANK = 2
LD_RUNNING = 3
LD_WAITING = 4
LD_TOKENS = 5
LD_MAXTOT = 6
LD_WU = 7
LD_TOTAL = 8
LD_MAXRUN = 9
LD_PTOK = 10
LD_PBUSY = 11
LD_INFLIGHT = 12
LD_NCOLS = 13

# run statistics
SS_EVENTS = 0
SS_STEPS = 1
SS_EVICTIONS = 2
SS_REBUILDS = 3
SS_KV_OVER = 4        # max(used - capacity) over ranks and time (<= 0 when the cap holds)
SS_NEG_QUEUE = 5      # times a queue length went negative (must stay 0)
SS_INDEX_EVENTS = 6
SS_RETRACTIONS = 7    # running requests retracted because decode ran out of KV
SS_CHUNKED = 8        # prefill steps that cut a prompt (chunked prefill)
SS_RECOMPUTED = 9     # tokens retracted requests computed again (prompt + output so far)
SS_NCOLS = 10


@inline
def _grow2(a, need):
    cap = a.shape[1]
    if need <= cap:
        return a
    new = max(cap * 2, 16)
    while new < need:
        new *= 2
    b = np.empty((a.shape[0], new), dtype=a.dtype)  # no zero fill: fresh pages are costly here
    b[:, :cap] = a
    return b


@inline
def _grow1(a, need):
    cap = a.shape[0]
    if need <= cap:
        return a
    new = max(cap * 2, 16)
    while new < need:
        new *= 2
    b = np.empty(new, dtype=a.dtype)
    b[:cap] = a
    return b


# ---------------------------------------------------------------------------
# LRU heap of evictable leaves: (last_use, block) min-heap per rank
@inline
def _before(k1, b1, k2, b2):
    return k1 < k2 or (k1 == k2 and b1 < b2)


@inline
def _heap_push(hk, hb, rs, r, key, blk):
    i = rs[r, RS_HN]
    rs[r, RS_HN] = i + 1
    while i > 0:
        p = (i - 1) // 2
        if not _before(key, blk, hk[r, p], hb[r, p]):
            break
        hk[r, i] = hk[r, p]
        hb[r, i] = hb[r, p]
        i = p
    hk[r, i] = key
    hb[r, i] = blk


@inline
def _heap_pop(hk, hb, rs, r):
    key = hk[r, 0]
    blk = hb[r, 0]
    n = rs[r, RS_HN] - 1
    rs[r, RS_HN] = n
    if n > 0:
        lk = hk[r, n]
        lb = hb[r, n]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            if c + 1 < n and _before(hk[r, c + 1], hb[r, c + 1], hk[r, c], hb[r, c]):
                c += 1
            if _before(hk[r, c], hb[r, c], lk, lb):
                hk[r, i] = hk[r, c]
                hb[r, i] = hb[r, c]
                i = c
            else:
                break
        hk[r, i] = lk
        hb[r, i] = lb
    return key, blk


@inline
def _evictable_leaf(present, lock, nchild, r, b):
    return present[r, b] == 1 and lock[r, b] == 0 and nchild[r, b] == 0


@inline
def _push_leaf(hk, hb, rs, r, b, present, lock, nchild, last_use, stats):
    """Offer block ``b`` to rank ``r``'s LRU heap; rebuild the heap from the cache when full."""
    if rs[r, RS_HN] >= hk.shape[1]:
        stats[SS_REBUILDS] += 1
        rs[r, RS_HN] = 0
        for x in range(present.shape[1]):
            if _evictable_leaf(present, lock, nchild, r, x):
                _heap_push(hk, hb, rs, r, last_use[r, x], x)
        return  # b, if evictable, is in the rebuilt heap
    _heap_push(hk, hb, rs, r, last_use[r, b], b)


@inline
def _evict_one(r, hk, hb, rs, present, lock, nchild, last_use, parent, btok, ev, t, lag, w,
               stats):
    """Evict rank ``r``'s least recently used evictable leaf; False when there is none."""
    while rs[r, RS_HN] > 0:
        key, b = _heap_pop(hk, hb, rs, r)
        if not _evictable_leaf(present, lock, nchild, r, b) or last_use[r, b] != key:
            continue  # stale entry
        present[r, b] = 0
        rs[r, RS_USED] -= btok[b]
        rs[r, RS_EVICTABLE] -= btok[b]
        stats[SS_EVICTIONS] += 1
        _ev_push(ev, t + lag, w, b, -1 - rs[r, RS_LOCAL])  # sign: evicted; magnitude: local rank + 1
        p = parent[b]
        if p >= 0:
            nchild[r, p] -= 1
            if _evictable_leaf(present, lock, nchild, r, p):
                _push_leaf(hk, hb, rs, r, p, present, lock, nchild, last_use, stats)
        return True
    return False


@inline
def _ev_push(ev, a, b, c, d):
    """Append one KV-index event to the lag queue ``ev`` (``ev[0]`` values held, from ``ev[1]``)."""
    n = ev[0]
    ev[n + 1] = a
    ev[n + 2] = b
    ev[n + 3] = c
    ev[n + 4] = d
    ev[0] = n + 4


@inline
def _lock(r, b, lock, rs, btok):
    if lock[r, b] == 0:
        rs[r, RS_EVICTABLE] -= btok[b]
    lock[r, b] += 1


@inline
def _unlock(r, b, lock, rs, btok):
    lock[r, b] -= 1
    if lock[r, b] == 0:
        rs[r, RS_EVICTABLE] += btok[b]


@njit
def _try_admit(r, i, t, req_L, req_out, h_off, h_ids, btok, parent, st, rq, rs, present, lock,
               nchild, last_use, hk, hb, ev, lag, stats, chunking, rem_chunk, rem_input, offset,
               first):
    """SGLang's prefill admission of waiting request ``i`` on rank ``r``.

    Its longest cached run of full blocks is its prefix; ``extend`` = its
    tokens (prompt, plus output so far after a retraction) beyond it.  With
    ``chunking`` on, a request longer than the chunk budget
    left is cut to it and reserves no output; otherwise it reserves
    ``min(output left, 4096)`` tokens.  Without chunking, a request that is not
    the first of the batch must fit the ``max_prefill_tokens`` budget left.  It
    is admitted iff ``take + reserve + 1 < free + evictable - offset`` (offset:
    the running decodes' reservation through new_token_ratio plus this
    batch's admissions) and its KV can be allocated (evicting LRU leaves).
    The whole prompt is allocated on admission (its blocks are stored, locked,
    so a later request of the same step shares them).  Returns ``(take,
    reserve)``; ``take`` < 0 when not admitted."""
    lo = h_off[i]
    n = st[i, ST_FULL]
    d = 0
    while d < n and present[r, h_ids[lo + d]] == 1:
        d += 1
    cached = 0
    for j in range(d):
        b = h_ids[lo + j]
        _lock(r, b, lock, rs, btok)
        cached += btok[b]
    extend = max(req_L[i] + st[i, ST_OUT] - cached, 1)
    take = extend
    reserve = min(req_out[i] - st[i, ST_OUT], CLIP_MAX_NEW)
    ok = True
    if chunking:
        if extend > rem_chunk:
            take = rem_chunk
            reserve = 0
    elif not first and extend >= rem_input:
        ok = False
    room = rs[r, RS_CAP] - rs[r, RS_USED] + rs[r, RS_EVICTABLE]
    if ok and not float(take + reserve + 1) < float(room) - offset:
        ok = False
    new_tok = 0
    for j in range(d, n):
        new_tok += btok[h_ids[lo + j]]
    need = new_tok + st[i, ST_PRIVATE] + st[i, ST_OUT]
    w = rs[r, RS_WORKER]
    if ok:
        while rs[r, RS_CAP] - rs[r, RS_USED] < need:
            if not _evict_one(r, hk, hb, rs, present, lock, nchild, last_use, parent, btok, ev, t,
                              lag, w, stats):
                break
        ok = rs[r, RS_CAP] - rs[r, RS_USED] >= need
    if not ok:
        for j in range(d):
            b = h_ids[lo + j]
            _unlock(r, b, lock, rs, btok)
        if d > 0:
            b = h_ids[lo + d - 1]
            if _evictable_leaf(present, lock, nchild, r, b):
                _push_leaf(hk, hb, rs, r, b, present, lock, nchild, last_use, stats)
        return -1, 0
    for j in range(d):
        last_use[r, h_ids[lo + j]] = t
    for j in range(d, n):
        b = h_ids[lo + j]
        present[r, b] = 1
        lock[r, b] = 1
        nchild[r, b] = 0
        last_use[r, b] = t
        rs[r, RS_USED] += btok[b]
        if j > 0:
            nchild[r, h_ids[lo + j - 1]] += 1
        _ev_push(ev, t + lag, w, b, 1 + rs[r, RS_LOCAL])  # sign: stored; magnitude: local rank + 1
    rs[r, RS_USED] += st[i, ST_PRIVATE] + st[i, ST_OUT]
    st[i, ST_GENKV] = st[i, ST_OUT]
    if rs[r, RS_USED] > rs[r, RS_MAX_USED]:
        rs[r, RS_MAX_USED] = rs[r, RS_USED]
    over = rs[r, RS_USED] - rs[r, RS_CAP]
    if over > stats[SS_KV_OVER]:
        stats[SS_KV_OVER] = over
    if rq[i, RQ_ADMIT] < 0:  # a retracted request keeps the prefix it was first served
        rq[i, RQ_CACHED_TOKENS] = cached
        rq[i, RQ_CACHED_BLOCKS] = d
    else:
        stats[SS_RECOMPUTED] += extend
    st[i, ST_PF_LEFT] = extend - take
    return take, reserve


@inline
def _release(r, i, t, h_off, h_ids, btok, st, rs, lock, present, nchild, last_use, hk, hb, stats):
    """Request ``i`` leaves rank ``r``'s batch at ``t``: its blocks are unlocked (stamped
    ``t``; the deepest offered to the LRU heap) and its private and output KV freed."""
    lo = h_off[i]
    n = st[i, ST_FULL]
    for j in range(n):
        b = h_ids[lo + j]
        _unlock(r, b, lock, rs, btok)
        last_use[r, b] = t
    if n > 0:
        b = h_ids[lo + n - 1]
        if _evictable_leaf(present, lock, nchild, r, b):
            _push_leaf(hk, hb, rs, r, b, present, lock, nchild, last_use, stats)
    rs[r, RS_USED] -= st[i, ST_PRIVATE] + st[i, ST_GENKV]
    st[i, ST_GENKV] = 0


@inline
def _cached_on(r, i, h_off, h_ids, btok, st, present):
    """Tokens of request ``i``'s longest cached run of full blocks on rank ``r``."""
    lo = h_off[i]
    n = st[i, ST_FULL]
    c = 0
    d = 0
    while d < n and present[r, h_ids[lo + d]] == 1:
        c += btok[h_ids[lo + d]]
        d += 1
    return c


@inline
def _enqueue(r, i, st, rs):
    """Append request ``i`` (``ST_SEQ`` and ``ST_UNC_ENQ`` set) to rank ``r``'s waiting queue."""
    st[i, ST_STATUS] = 1
    st[i, ST_QNEXT] = -1
    if rs[r, RS_QTAIL] >= 0:
        st[rs[r, RS_QTAIL], ST_QNEXT] = i
    else:
        rs[r, RS_QHEAD] = i
    rs[r, RS_QTAIL] = i
    rs[r, RS_QLEN] += 1
    if rs[r, RS_QLEN] > rs[r, RS_MAX_QLEN]:
        rs[r, RS_MAX_QLEN] = rs[r, RS_QLEN]
    rs[r, RS_QWU] += st[i, ST_UNC_ENQ]
    rs[r, RS_QTOK] += st[i, ST_SEQ]


@njit
def _retract(r, t, req_L, req_out, h_off, h_ids, btok, st, rs, run_ids, present, lock, nchild,
             last_use, hk, hb, stats):
    """Decode ran out of KV on rank ``r``: retract one running request (SGLang's
    ``length`` order: the fewest output tokens, then the longest prompt, then
    the latest arrival), free its private KV and unlock its prefix, and queue
    it at the tail to recompute its prompt and output so far."""
    best = -1
    bx = -1
    for x in range(rs[r, RS_RUN_N]):
        i = run_ids[r, x]
        if best < 0 or st[i, ST_OUT] < st[best, ST_OUT] or (
                st[i, ST_OUT] == st[best, ST_OUT] and (req_L[i] > req_L[best] or (
                    req_L[i] == req_L[best] and i > best))):
            best = i
            bx = x
    i = best
    last = rs[r, RS_RUN_N] - 1
    run_ids[r, bx] = run_ids[r, last]
    rs[r, RS_RUN_N] = last
    _release(r, i, t, h_off, h_ids, btok, st, rs, lock, present, nchild, last_use, hk, hb, stats)
    st[i, ST_SEQ] = req_L[i] + st[i, ST_OUT]
    st[i, ST_UNC_ENQ] = max(st[i, ST_SEQ] - _cached_on(r, i, h_off, h_ids, btok, st, present), 0)
    _enqueue(r, i, st, rs)
    stats[SS_RETRACTIONS] += 1


@inline
def _changed(r, t, rs):
    """Rank ``r``'s published load changed at ``t``: with on-change publishing,
    a sample is due ``RS_PUB_DELAY`` later (several changes inside that delay
    share one sample, as SGLang's throttle does)."""
    delay = rs[r, RS_PUB_DELAY]
    if delay > 0:
        due = t + delay
        if rs[r, RS_DUE_KIND] == DUE_HEARTBEAT or rs[r, RS_NEXT_SAMPLE] > due:
            rs[r, RS_NEXT_SAMPLE] = due
            rs[r, RS_DUE_KIND] = DUE_CHANGE


@njit
def _lpm_order(r, h_off, h_ids, btok, st, rs, present):
    """Reorder rank ``r``'s waiting queue by longest cached prefix on the rank
    (ties: arrival order), SGLang's ``lpm`` policy; above ``LPM_MAX_QUEUE``
    waiting requests the order is left alone (SGLang's fallback to FCFS)."""
    n = rs[r, RS_QLEN]
    if n < 2 or n > LPM_MAX_QUEUE:
        return
    ids = np.empty(n, dtype=np.int64)
    key = np.empty(n, dtype=np.int64)
    i = rs[r, RS_QHEAD]
    k = 0
    while i >= 0 and k < n:
        lo = h_off[i]
        m = st[i, ST_FULL]
        d = 0
        c = 0
        while d < m and present[r, h_ids[lo + d]] == 1:
            c += btok[h_ids[lo + d]]
            d += 1
        # insertion: descending cached tokens, then ascending request index
        x = k
        while x > 0 and (key[x - 1] < c or (key[x - 1] == c and ids[x - 1] > i)):
            key[x] = key[x - 1]
            ids[x] = ids[x - 1]
            x -= 1
        key[x] = c
        ids[x] = i
        k += 1
        i = st[i, ST_QNEXT]
    rs[r, RS_QHEAD] = ids[0]
    for x in range(k - 1):
        st[ids[x], ST_QNEXT] = ids[x + 1]
    st[ids[k - 1], ST_QNEXT] = -1
    rs[r, RS_QTAIL] = ids[k - 1]


@njit
def _start_step(r, t, req_L, req_out, prefill_tps, h_off, h_ids, btok, parent, st, rq, rs, run_ids,
                present, lock, nchild, last_use, hk, hb, ev, lag, stats):
    """Start rank ``r``'s next step at ``t``, SGLang's scheduler (docs/simulator.md):
    a prefill step if any prompt tokens are to compute (an unfinished chunked
    prompt first, then admissions in queue order while the chunk and
    ``max_prefill_tokens`` budgets, the running cap and the KV reservation
    allow), else a decode step if anything runs (retracting when its KV does
    not fit), else idle (new_token_ratio back to its initial value)."""
    tokens = 0
    admitted = 0
    chunking = rs[r, RS_CHUNK] > 0
    rem_chunk = rs[r, RS_CHUNK] if chunking else INF
    rem_input = rs[r, RS_MAXPF]
    n_dec = 0
    res = 0
    for x in range(rs[r, RS_RUN_N]):
        i = run_ids[r, x]
        if st[i, ST_STATUS] == 3:
            n_dec += 1
            res += min(st[i, ST_REMAIN], CLIP_MAX_NEW)
    mixed = rs[r, RS_MIXED] == 1 and chunking and n_dec > 0
    if mixed:  # the running decodes ride in the prefill step, one token each
        rem_chunk -= n_dec
        rem_input -= n_dec
    # the running decodes' KV reservation: min(output left, 4096) x new_token_ratio each
    offset = float(res) * float(rs[r, RS_RATIO]) * 1e-9
    if mixed:
        offset += n_dec
    c = rs[r, RS_CHUNK_REQ]
    if c >= 0:
        take = min(st[c, ST_PF_LEFT], rem_chunk) if rem_chunk > 0 else min(st[c, ST_PF_LEFT], 1)
        st[c, ST_PF_LEFT] -= take
        tokens += take
        rem_chunk -= take
        rem_input -= take
        if st[c, ST_PF_LEFT] == 0:
            rs[r, RS_CHUNK_REQ] = -1
    if rs[r, RS_POLICY] == POLICY_LPM and rem_chunk > 0 and rem_input > 0:
        _lpm_order(r, h_off, h_ids, btok, st, rs, present)
    while (rem_chunk > 0 and rem_input > 0 and rs[r, RS_QHEAD] >= 0
           and rs[r, RS_RUN_N] < rs[r, RS_MAXRUN]):
        i = rs[r, RS_QHEAD]
        take, reserve = _try_admit(r, i, t, req_L, req_out, h_off, h_ids, btok, parent, st, rq, rs,
                                   present, lock, nchild, last_use, hk, hb, ev, lag, stats,
                                   chunking, rem_chunk, rem_input, offset, admitted == 0)
        if take < 0:
            break
        rs[r, RS_QHEAD] = st[i, ST_QNEXT]
        if rs[r, RS_QHEAD] < 0:
            rs[r, RS_QTAIL] = -1
        rs[r, RS_QLEN] -= 1
        if rs[r, RS_QLEN] < 0:
            stats[SS_NEG_QUEUE] += 1
        rs[r, RS_QWU] -= st[i, ST_UNC_ENQ]
        rs[r, RS_QTOK] -= st[i, ST_SEQ]
        st[i, ST_STATUS] = 2
        if rq[i, RQ_ADMIT] < 0:
            rq[i, RQ_ADMIT] = t
        run_ids[r, rs[r, RS_RUN_N]] = i
        rs[r, RS_RUN_N] += 1
        offset += 1 + reserve
        if st[i, ST_PF_LEFT] > 0:
            rs[r, RS_CHUNK_REQ] = i
            stats[SS_CHUNKED] += 1
        tokens += take
        rem_chunk -= take
        rem_input -= take
        admitted += 1
    if admitted > 0:
        _changed(r, t, rs)
    if tokens > 0:
        rs[r, RS_NO_DECAY] = 0
        rs[r, RS_STEP_MIX] = 0
        if mixed:
            # REPLAY CHOICE: a mixed step costs its prompt tokens plus one token per decode at
            # the prefill rate, and only when the decodes' next KV token fits without eviction
            if rs[r, RS_CAP] - rs[r, RS_USED] >= n_dec:
                tokens += n_dec
                rs[r, RS_STEP_MIX] = 1
        dur = np.int64(np.ceil(tokens * 1e9 / prefill_tps[r]))
        dur = max(dur, np.int64(1))
        rs[r, RS_KIND] = 1
        rs[r, RS_STEP_TOK] = tokens
        rs[r, RS_STEP_DUR] = dur
        rs[r, RS_END] = t + dur
    elif rs[r, RS_RUN_N] > 0:
        # Decode.  Every step needs one KV token per running request: when they do
        # not fit, LRU leaves are evicted, then requests retracted (SGLang's decode
        # check).  With nothing waiting, the next steps up to the first completion
        # (and while their KV fits without eviction) change nothing a decision can
        # see but the KV in use (published as of the event's end, as SGLang
        # publishes only every 15th decode step), so they run as one event of k
        # steps; an arrival on this rank cuts it back to the step boundary after
        # it (_cut_decode), so no admission is ever delayed.
        rs[r, RS_NO_DECAY] = 0
        n = rs[r, RS_RUN_N]
        w = rs[r, RS_WORKER]
        if rs[r, RS_CAP] - rs[r, RS_USED] < n:
            while rs[r, RS_CAP] - rs[r, RS_USED] < n:
                if not _evict_one(r, hk, hb, rs, present, lock, nchild, last_use, parent, btok, ev,
                                  t, lag, w, stats):
                    break
            retracted = False
            while rs[r, RS_CAP] - rs[r, RS_USED] < rs[r, RS_RUN_N] and rs[r, RS_RUN_N] > 1:
                _retract(r, t, req_L, req_out, h_off, h_ids, btok, st, rs, run_ids, present, lock,
                         nchild, last_use, hk, hb, stats)
                retracted = True
            if retracted:
                _changed(r, t, rs)
                num = 0
                den = 1
                for x in range(rs[r, RS_RUN_N]):
                    i = run_ids[r, x]
                    num += st[i, ST_OUT]
                    den += req_out[i]
                num += RETRACT_DECODE_STEPS * rs[r, RS_RUN_N]
                rs[r, RS_RATIO] = min(RATIO_ONE, (num * RATIO_ONE) // den)
                rs[r, RS_NO_DECAY] = 1
        k = 1
        n = rs[r, RS_RUN_N]
        if rs[r, RS_QHEAD] < 0:
            k = st[run_ids[r, 0], ST_REMAIN]
            for x in range(1, n):
                k = min(k, st[run_ids[r, x], ST_REMAIN])
            k = max(k, 1)
            k = max(min(k, (rs[r, RS_CAP] - rs[r, RS_USED]) // n), 1)
        dur = rs[r, RS_DECODE_NS] + rs[r, RS_DECODE_SLOPE] * (n - 1)
        rs[r, RS_KIND] = 2
        rs[r, RS_STEP_DUR] = dur
        rs[r, RS_STEP_START] = t
        rs[r, RS_STEP_K] = k
        rs[r, RS_END] = t + k * dur
    else:
        rs[r, RS_KIND] = 0
        rs[r, RS_END] = INF
        if rs[r, RS_QLEN] == 0:
            rs[r, RS_RATIO] = rs[r, RS_NR_INIT]
    stats[SS_STEPS] += 1


@inline
def _cut_decode(r, t, rs):
    """A request was queued on rank ``r`` at ``t``: a multi-step decode event ends
    at the first step boundary the one-step-at-a-time model would admit it at
    (a boundary at exactly ``t`` has already passed: step ends come first)."""
    if rs[r, RS_KIND] == 2 and rs[r, RS_STEP_K] > 1:
        d = rs[r, RS_STEP_DUR]
        m = (t - rs[r, RS_STEP_START]) // d + 1
        if m < rs[r, RS_STEP_K]:
            rs[r, RS_STEP_K] = m
            rs[r, RS_END] = rs[r, RS_STEP_START] + m * d


@inline
def _complete(r, i, t, h_off, h_ids, btok, st, rq, rs, lock, present, nchild, last_use, hk, hb,
              rinf, stats):
    _release(r, i, t, h_off, h_ids, btok, st, rs, lock, present, nchild, last_use, hk, hb, stats)
    st[i, ST_STATUS] = 4
    rq[i, RQ_DONE] = t
    rq[i, RQ_COMPLETIONS] += 1
    rinf[rq[i, RQ_WORKER]] -= 1


@inline
def _snapshot(r, t, rs):
    """Rank ``r`` writes its load snapshot for its worker's DP controller at ``t``."""
    rs[r, RS_DS_TS] = t
    rs[r, RS_DS_REQ] = rs[r, RS_RUN_N] + rs[r, RS_QLEN]
    rs[r, RS_DS_TOK] = rs[r, RS_USED] - rs[r, RS_EVICTABLE] + rs[r, RS_QTOK]


@njit
def _end_step(r, t, req_L, req_out, prefill_tps, h_off, h_ids, btok, parent, st, rq, rs, run_ids,
              present, lock, nchild, last_use, hk, hb, ev, lag, rinf, stats):
    """Finish rank ``r``'s step at ``t`` (first tokens, decode tokens and their KV,
    completions, the load snapshot), start the next."""
    kind = rs[r, RS_KIND]
    if kind == 1:
        rs[r, RS_PTOK] += rs[r, RS_STEP_TOK]
        rs[r, RS_PBUSY_NS] += rs[r, RS_STEP_DUR]
    dec_k = rs[r, RS_STEP_K] if kind == 2 else (1 if rs[r, RS_STEP_MIX] == 1 else 0)
    done = 0
    k = 0
    while k < rs[r, RS_RUN_N]:
        i = run_ids[r, k]
        finished = False
        if kind == 1 and st[i, ST_STATUS] == 2 and st[i, ST_PF_LEFT] == 0:
            if st[i, ST_OUT] == 0:
                rq[i, RQ_FIRST] = t
            st[i, ST_STATUS] = 3
            st[i, ST_OUT] += 1
            st[i, ST_REMAIN] = req_out[i] - st[i, ST_OUT]
            finished = st[i, ST_REMAIN] <= 0
        elif dec_k > 0 and st[i, ST_STATUS] == 3:
            st[i, ST_REMAIN] -= dec_k
            st[i, ST_OUT] += dec_k
            st[i, ST_GENKV] += dec_k
            rs[r, RS_USED] += dec_k
            finished = st[i, ST_REMAIN] <= 0
        if finished:
            _complete(r, i, t, h_off, h_ids, btok, st, rq, rs, lock, present, nchild, last_use, hk,
                      hb, rinf, stats)
            done += 1
            last = rs[r, RS_RUN_N] - 1
            run_ids[r, k] = run_ids[r, last]
            rs[r, RS_RUN_N] = last
        else:
            k += 1
    if dec_k > 0:
        if rs[r, RS_USED] > rs[r, RS_MAX_USED]:
            rs[r, RS_MAX_USED] = rs[r, RS_USED]
        over = rs[r, RS_USED] - rs[r, RS_CAP]
        if over > stats[SS_KV_OVER]:
            stats[SS_KV_OVER] = over
    if kind == 2:
        if rs[r, RS_NO_DECAY] == 0:
            rs[r, RS_RATIO] = max(rs[r, RS_RATIO] - dec_k * rs[r, RS_NR_DECAY], rs[r, RS_NR_MIN])
        before = rs[r, RS_DEC_COUNT]
        rs[r, RS_DEC_COUNT] = before + dec_k
        if rs[r, RS_DEC_COUNT] // SNAPSHOT_DECODE_STEPS > before // SNAPSHOT_DECODE_STEPS:
            _snapshot(r, t, rs)   # REPLAY CHOICE: stamped at the event's end (see _start_step)
    if kind == 1 or done > 0:
        _changed(r, t, rs)
    if kind == 1:
        _snapshot(r, t, rs)
    _start_step(r, t, req_L, req_out, prefill_tps, h_off, h_ids, btok, parent, st, rq, rs, run_ids,
                present, lock, nchild, last_use, hk, hb, ev, lag, stats)
    return done


@inline
def _write_sample(loads, tail, nl, t, r, rs, rinf):
    """Write rank ``r``'s current load as sample ``nl`` stamped ``t``."""
    w = rs[r, RS_WORKER]
    loads[LD_TS, nl] = t
    loads[LD_WORKER, nl] = w
    loads[LD_RANK, nl] = rs[r, RS_LOCAL]
    loads[LD_RUNNING, nl] = rs[r, RS_RUN_N]
    loads[LD_WAITING, nl] = rs[r, RS_QLEN]
    busy = rs[r, RS_USED] - rs[r, RS_EVICTABLE]
    loads[LD_TOKENS, nl] = busy
    loads[LD_MAXTOT, nl] = rs[r, RS_CAP]
    loads[LD_WU, nl] = rs[r, RS_QWU]
    loads[LD_TOTAL, nl] = busy + rs[r, RS_QTOK]
    loads[LD_MAXRUN, nl] = rs[r, RS_MAXRUN]
    loads[LD_PTOK, nl] = rs[r, RS_PTOK]
    loads[LD_PBUSY, nl] = rs[r, RS_PBUSY_NS] // 1000
    loads[LD_INFLIGHT, nl] = rinf[w]
    tail[nl] = True
    rs[r, RS_LAST_ROW] = nl


@inline
def _interval_sample(g, t, r, rs, rinf, cur, recs, nr, table, view_inflight, dirty):
    """Interval publishing: rank ``r``'s sample number ``g`` (of the whole run, in
    written order) stamped ``t``.  It is applied to the router's rank table as
    ``kernels.snapshot.advance_dirty_nb`` applies a written sample (every simulated
    sample has the native tail and a rank inside its worker's dp_size), and
    recorded in ``recs`` only when its values differ from the rank's previous
    sample: the rows are expanded from these records afterwards
    (:func:`expand_interval_nb`), so memory grows with the changes, not with the
    span.  Returns the new record count."""
    w = rs[r, RS_WORKER]
    loc = rs[r, RS_LOCAL]
    busy = rs[r, RS_USED] - rs[r, RS_EVICTABLE]
    running = rs[r, RS_RUN_N]
    waiting = rs[r, RS_QLEN]
    maxtot = rs[r, RS_CAP]
    wu = rs[r, RS_QWU]
    total = busy + rs[r, RS_QTOK]
    maxrun = rs[r, RS_MAXRUN]
    ptok = rs[r, RS_PTOK]
    pbusy = rs[r, RS_PBUSY_NS] // 1000
    inf = rinf[w]
    if not (cur[r, LD_TS] >= 0 and cur[r, LD_RUNNING] == running and cur[r, LD_WAITING] == waiting
            and cur[r, LD_TOKENS] == busy and cur[r, LD_MAXTOT] == maxtot and cur[r, LD_WU] == wu
            and cur[r, LD_TOTAL] == total and cur[r, LD_MAXRUN] == maxrun
            and cur[r, LD_PTOK] == ptok and cur[r, LD_PBUSY] == pbusy
            and cur[r, LD_INFLIGHT] == inf):
        cur[r, LD_TS] = g
        cur[r, LD_RUNNING] = running
        cur[r, LD_WAITING] = waiting
        cur[r, LD_TOKENS] = busy
        cur[r, LD_MAXTOT] = maxtot
        cur[r, LD_WU] = wu
        cur[r, LD_TOTAL] = total
        cur[r, LD_MAXRUN] = maxrun
        cur[r, LD_PTOK] = ptok
        cur[r, LD_PBUSY] = pbusy
        cur[r, LD_INFLIGHT] = inf
        recs[LD_TS, nr] = g
        recs[LD_WORKER, nr] = r   # the rank (global); the rows name its worker and local rank
        recs[LD_RANK, nr] = loc
        recs[LD_RUNNING, nr] = running
        recs[LD_WAITING, nr] = waiting
        recs[LD_TOKENS, nr] = busy
        recs[LD_MAXTOT, nr] = maxtot
        recs[LD_WU, nr] = wu
        recs[LD_TOTAL, nr] = total
        recs[LD_MAXRUN, nr] = maxrun
        recs[LD_PTOK, nr] = ptok
        recs[LD_PBUSY, nr] = pbusy
        recs[LD_INFLIGHT, nr] = inf
        nr += 1
    dirty[w] = True
    if inf >= 0:
        view_inflight[w] = inf
    if table[w, loc, R_HAS] == 1 and table[w, loc, R_TAIL] == 1:
        table[w, loc, R_PREV_OK] = 1
        table[w, loc, R_PREV_PTOK] = table[w, loc, R_PTOK]
        table[w, loc, R_PREV_PBUSY] = table[w, loc, R_PBUSY]
    else:
        table[w, loc, R_PREV_OK] = 0
    table[w, loc, R_HAS] = 1
    table[w, loc, R_AT] = t
    table[w, loc, R_RUNNING] = running
    table[w, loc, R_WAITING] = waiting
    table[w, loc, R_TOKENS] = busy
    table[w, loc, R_MAXTOT] = maxtot
    table[w, loc, R_TAIL] = 1
    table[w, loc, R_WU] = wu
    table[w, loc, R_TOTAL] = total
    table[w, loc, R_MAXRUN] = maxrun
    table[w, loc, R_PTOK] = ptok
    table[w, loc, R_PBUSY] = pbusy
    return nr


@njit
def expand_interval_nb(recs, order, phs, t0, publish_ns, rank_worker, rank_local, g_lo, g_hi,
                       cur_rec, p, out):
    """Interval publishing's load rows ``g_lo..g_hi-1`` (in written order) into
    ``out[:, :g_hi - g_lo]`` from the change records of :func:`simulate_nb`:
    row ``g`` is rank ``order[g % R]``'s sample ``g // R``, stamped ``t0 + phs[g % R]
    + (g // R) * publish_ns``, with the values of that rank's latest record at or
    before ``g``.  ``cur_rec[r]`` (each rank's record in effect) and ``p`` (the next
    record) carry over from one call to the next; returns the new ``p``."""
    R = order.shape[0]
    n_rec = recs.shape[1]
    for g in range(g_lo, g_hi):
        while p < n_rec and recs[LD_TS, p] <= g:
            cur_rec[recs[LD_WORKER, p]] = p
            p += 1
        j = g % R
        r = order[j]
        q = cur_rec[r]
        x = g - g_lo
        out[LD_TS, x] = t0 + phs[j] + (g // R) * publish_ns
        out[LD_WORKER, x] = rank_worker[r]
        out[LD_RANK, x] = rank_local[r]
        for c in range(LD_RUNNING, LD_NCOLS):
            out[c, x] = recs[c, q]
    return p


@njit
def _flush_heartbeats(loads, tail, nl, t, rs, R):
    """Write the pending heartbeats stamped ``<= t`` in (time, rank) order; return the new count.

    On-change publishing: a heartbeat repeats the rank's previous sample but
    for its stamp and ``router_inflight``.  It is held back until something
    happens after it (another sample or an arrival); a heartbeat superseded by
    the rank's next heartbeat before anything happened is not written, since no
    decision could see it (the rank table keeps the latest sample per rank, and
    its throughput delta is zero either way).  So idle time costs no rows.
    """
    while True:
        best = -1
        for r in range(R):
            p = rs[r, RS_HB_PENDING]
            if p >= 0 and p <= t and (best < 0 or p < rs[best, RS_HB_PENDING]):
                best = r
        if best < 0:
            return nl
        src = rs[best, RS_LAST_ROW]
        for c in range(LD_NCOLS):
            loads[c, nl] = loads[c, src]
        loads[LD_TS, nl] = rs[best, RS_HB_PENDING]
        loads[LD_INFLIGHT, nl] = rs[best, RS_HB_INF]
        tail[nl] = True
        rs[best, RS_LAST_ROW] = nl
        rs[best, RS_HB_PENDING] = -1
        nl += 1


@njit
def _dispatch(method, w, i, t, n, lo, req_L, h_ids, rank_off, rs, present, rr, dpc_last, idxr,
              table, seed):
    """The rank of worker ``w`` that request ``i`` goes to (the worker's DP controller,
    or the router for ``LB_ROUTER``); docs/simulator.md, "Data-parallel dispatch"."""
    r0 = rank_off[w]
    nr = rank_off[w + 1] - r0
    if nr <= 1:
        return r0
    if method == LB_ROUND_ROBIN:
        r = r0 + rr[w] % nr
        rr[w] += 1
        return r
    if method == LB_BOOTSTRAP_ROOM:
        return r0 + np.int64(draw_nb(seed, i, BOOTSTRAP_DRAW) % np.uint64(nr))
    if method == LB_TOTAL_REQUESTS or method == LB_TOTAL_TOKENS:
        if t - dpc_last[w] >= DPC_REFRESH_NS:
            dpc_last[w] = t
            for r in range(r0, r0 + nr):
                if rs[r, RS_KIND] == 0 and rs[r, RS_QLEN] == 0 and rs[r, RS_RUN_N] == 0:
                    _snapshot(r, t, rs)   # an idle rank writes its snapshot on every idle loop
                if rs[r, RS_DS_TS] != rs[r, RS_BUD_TS]:
                    rs[r, RS_BUD_TS] = rs[r, RS_DS_TS]
                    rs[r, RS_BUD_REQ] = rs[r, RS_DS_REQ]
                    rs[r, RS_BUD_TOK] = rs[r, RS_DS_TOK]
        best = r0
        for r in range(r0 + 1, r0 + nr):
            if method == LB_TOTAL_REQUESTS:
                if rs[r, RS_BUD_REQ] < rs[best, RS_BUD_REQ]:
                    best = r
            elif rs[r, RS_BUD_TOK] < rs[best, RS_BUD_TOK] or (
                    rs[r, RS_BUD_TOK] == rs[best, RS_BUD_TOK]
                    and rs[r, RS_BUD_REQ] < rs[best, RS_BUD_REQ]):
                best = r
        rs[best, RS_BUD_REQ] += 1
        if method == LB_TOTAL_TOKENS:
            rs[best, RS_BUD_TOK] += req_L[i]
        return best
    # LB_ROUTER: the deepest prefix in the router's per-rank index, then the least
    # waiting + running in its rank table (the published samples), then the lowest rank;
    # LB_PREFIX_AFFINITY: the same on the ranks' true caches and queues
    best = r0
    bd = -1
    bl = 0
    for r in range(r0, r0 + nr):
        d = 0
        if method == LB_ROUTER:
            while d < n and idxr[h_ids[lo + d], r] > 0:
                d += 1
            loc = r - r0
            ld = table[w, loc, R_WAITING] + table[w, loc, R_RUNNING] if table[w, loc, R_HAS] == 1 else 0
        else:
            while d < n and present[r, h_ids[lo + d]] == 1:
                d += 1
            ld = rs[r, RS_QLEN] + rs[r, RS_RUN_N]
        if d > bd or (d == bd and ld < bl):
            best = r
            bd = d
            bl = ld
    return best


@njit
def simulate_nb(req_ts, req_L, req_out, req_private, req_full, h_off, h_ids, btok, parent,
                n_workers, fleet, in_fleet, dp_size, rank_off, prefill_tps, rank_decode_ns,
                rank_maxrun, rank_cap, rank_phase, knobs, seed, freshness, publish_ns,
                lag_ns, heap_cap, rank_decode_slope, rank_chunk, rank_policy, pub_delay, pub_idle,
                forced, rank_eng, dispatch, cache_log=None):
    """Run one closed-loop simulation.

    Requests (sorted by ``req_ts``, ns) hold CSR prefix blocks ``h_ids`` (dense,
    ``btok`` tokens each, ``parent`` ids); ``req_full`` = how many leading
    blocks are full (only those are cached, published and matched; the router
    still counts every block as queried); ``req_private`` = tokens outside
    those blocks (a partial last block, input beyond the hashed blocks, output).
    Workers ``0..n_workers-1`` (replay ids), ``fleet`` the routable ones; ranks
    of worker ``w`` are ``rank_off[w]..rank_off[w+1]``.  ``knobs`` is the
    ``kernels.layout.KnobArrays`` of one config (``replay.sweep.engine.encode_configs``).
    Engine options per rank:
    ``rank_decode_slope`` (ns per extra running request in a decode step),
    ``rank_chunk`` (chunked_prefill_size, 0 off), ``rank_policy`` (POLICY_*),
    ``rank_eng[r, EN_*]`` (max_prefill_tokens, new_token_ratio's initial value,
    floor and decay per decode step in 1e-9 units, enable_mixed_chunk);
    ``dispatch`` (LB_*) picks the rank inside a worker.
    ``pub_delay`` > 0 selects on-change publishing (a sample ``pub_delay`` after
    a change, a heartbeat after ``pub_idle`` without one) instead of one sample
    every ``publish_ns``.  ``forced[i] >= 0`` places request ``i`` on that
    worker without asking the router (validation against a recording).

    Returns ``(rq, m_off, m_worker, m_blocks, loads, n_loads, stats, rs)``.

    ``cache_log`` (optional, a typed list of int64): every cache store and
    eviction is appended as four values ``(ts + index lag, worker, block,
    +/-(local rank + 1))``, + for a store, - for an eviction, in the order the
    KV index applies them (``replay.capture.from_sim`` turns them into KV events).
    """
    N = req_ts.shape[0]
    R = rank_off[n_workers]
    B = btok.shape[0]
    nf = fleet.shape[0]
    # --- state
    rs = np.zeros((R, RS_NCOLS), dtype=np.int64)
    max_run = 1
    max_dp = 1
    for w in range(n_workers):
        max_dp = max(max_dp, rank_off[w + 1] - rank_off[w])
        for r in range(rank_off[w], rank_off[w + 1]):
            rs[r, RS_WORKER] = w
            rs[r, RS_LOCAL] = r - rank_off[w]
    for r in range(R):
        rs[r, RS_CAP] = rank_cap[r]
        rs[r, RS_MAXRUN] = rank_maxrun[r]
        rs[r, RS_DECODE_NS] = rank_decode_ns[r]
        rs[r, RS_QHEAD] = -1
        rs[r, RS_QTAIL] = -1
        rs[r, RS_END] = INF
        rs[r, RS_DECODE_SLOPE] = rank_decode_slope[r]
        rs[r, RS_CHUNK] = rank_chunk[r]
        rs[r, RS_CHUNK_REQ] = -1
        rs[r, RS_POLICY] = rank_policy[r]
        rs[r, RS_PUB_DELAY] = pub_delay
        rs[r, RS_PUB_IDLE] = pub_idle
        rs[r, RS_HB_PENDING] = -1
        rs[r, RS_LAST_ROW] = -1
        rs[r, RS_MAXPF] = rank_eng[r, EN_MAXPF]
        rs[r, RS_NR_INIT] = rank_eng[r, EN_NR_INIT]
        rs[r, RS_RATIO] = rank_eng[r, EN_NR_INIT]
        rs[r, RS_NR_MIN] = rank_eng[r, EN_NR_MIN]
        rs[r, RS_NR_DECAY] = rank_eng[r, EN_NR_DECAY]
        rs[r, RS_MIXED] = rank_eng[r, EN_MIXED]
        rs[r, RS_DS_TS] = -1
        rs[r, RS_BUD_TS] = -2
        max_run = max(max_run, rank_maxrun[r])
    st = np.zeros((N, ST_NCOLS), dtype=np.int64)
    rq = np.full((N, RQ_NCOLS), -1, dtype=np.int64)
    rq[:, RQ_COMPLETIONS] = 0
    for i in range(N):
        st[i, ST_PRIVATE] = req_private[i]
        st[i, ST_FULL] = req_full[i]
        st[i, ST_QNEXT] = -1
        st[i, ST_SEQ] = req_L[i]
    run_ids = np.zeros((R, max_run), dtype=np.int64)
    # the DP controllers: round-robin counters and last snapshot refresh, per worker
    rr = np.zeros(n_workers, dtype=np.int64)
    dpc_last = np.full(n_workers, -INF, dtype=np.int64)
    # the router's per-rank KV index (dispatch "router" only)
    idxr = np.zeros((B, R) if dispatch == LB_ROUTER else (1, 1), dtype=np.int32)
    present = np.zeros((R, B), dtype=np.int8)
    # lock, nchild and last_use are written when a block is stored on a rank and read only
    # while it is present there; the heaps only below their sizes: no zero fill (about
    # 100 MB of memset per run on the Mooncake log)
    lock = np.empty((R, B), dtype=np.int32)
    nchild = np.empty((R, B), dtype=np.int32)
    last_use = np.empty((R, B), dtype=np.int64)
    hk = np.empty((R, heap_cap), dtype=np.int64)
    hb = np.empty((R, heap_cap), dtype=np.int64)
    # block-major, so one block's holders are one cache line (the matches walk below)
    idx = np.zeros((B, n_workers), dtype=np.int32)
    depth = np.zeros(max(nf, 1), dtype=np.int64)
    # the KV index's lag queue: 4 values per event from ev[1], ev[0] values held.  Every
    # store is one block of an admitted request (each request is admitted once) and every
    # eviction undoes a store, so 8 values per prefix block bound it; np.empty touches only
    # the pages used (the queue restarts at 0 whenever the index has caught up)
    ev = np.empty(1 + 8 * h_ids.shape[0] + 8, dtype=np.int64)
    ev[0] = 0
    ev_head = 0
    rinf = np.zeros(n_workers, dtype=np.int64)      # the router's live in-flight counts
    stats = np.zeros(SS_NCOLS, dtype=np.int64)
    # --- outputs
    # sized for the samples up to the last arrival, plus a quarter (it grows if
    # the drain takes longer): growing by doubling touches far more memory
    on_change = pub_delay > 0
    # (interval publishing: the change records of _interval_sample, bounded by the events)
    n_samples = 1024 + 2 * R + 6 * N  # about four changes per request; grows if needed
    loads = np.empty((LD_NCOLS, n_samples), dtype=np.int64)
    tail = np.ones(n_samples if on_change else 1, dtype=np.bool_)
    cur = np.full((R, LD_NCOLS), -1, dtype=np.int64)  # interval: each rank's latest record
    nl = 0
    m_off = np.zeros(N + 1, dtype=np.int64)
    m_worker = np.zeros(1024, dtype=np.int64)
    m_blocks = np.zeros(1024, dtype=np.int64)
    nm = 0
    # --- the router's view: the sweep's rank table over the written samples
    table = np.zeros((n_workers, max_dp, R_NCOLS), dtype=np.int64)
    view_inflight = np.zeros(n_workers, dtype=np.int64)
    snap = np.zeros((n_workers, S_NCOLS), dtype=np.int64)
    est = np.full(n_workers, np.nan)
    oldest = np.zeros(n_workers, dtype=np.int64)
    dirty = np.ones(n_workers, dtype=np.bool_)
    ptr = 0
    audit = np.zeros(A_NCOLS, dtype=np.int64)
    scratch_i = np.zeros((13, n_workers + 2), dtype=np.int64)  # 13 rows: kernels/reorg.py
    cand = np.zeros((n_workers + 1, C_NCOLS), dtype=np.int64)
    seen = np.zeros(n_workers, dtype=np.bool_)
    tmp_w = np.zeros(max(nf, 1), dtype=np.int64)
    tmp_d = np.zeros(max(nf, 1), dtype=np.int64)
    # --- clocks
    if N > 0 and on_change:
        for r in range(R):  # every rank publishes once just before the first request
            rs[r, RS_NEXT_SAMPLE] = req_ts[0] - pub_delay
            rs[r, RS_DUE_KIND] = DUE_CHANGE
    next_req = 0
    n_done = 0
    # Interval publishing: every rank publishes every publish_ns from its own
    # phase (its first sample one interval before the first request plus the
    # phase), so the ranks sample in one fixed cyclic order (phase, then rank):
    # sample g is rank order[g % R]'s number g // R, and its time needs no scan.
    # Step ends change only when a step starts (after a step end or an
    # arrival), so their minimum is recomputed only then.
    order = np.argsort(rank_phase[:R], kind="mergesort")
    phs = np.empty(R, dtype=np.int64)
    for j in range(R):
        phs[j] = rank_phase[order[j]]
    t0 = req_ts[0] - publish_ns if N > 0 else 0
    g_next = 0  # interval: samples written so far; sample g is rank order[g % R]'s number g // R
    steps_changed = True
    t_step = INF
    while n_done < N:
        stats[SS_EVENTS] += 1
        if steps_changed:
            t_step = INF
            for r in range(R):
                if rs[r, RS_END] < t_step:
                    t_step = rs[r, RS_END]
            steps_changed = False
        if on_change:
            t_samp = INF
            for r in range(R):
                if rs[r, RS_NEXT_SAMPLE] < t_samp:
                    t_samp = rs[r, RS_NEXT_SAMPLE]
        else:
            t_samp = t0 + phs[g_next % R] + (g_next // R) * publish_ns if R > 0 else INF
        t_arr = req_ts[next_req] if next_req < N else INF
        if t_step <= t_samp and t_step <= t_arr:
            steps_changed = True
            t = t_step
            for r in range(R):
                if rs[r, RS_END] == t:
                    n_done += _end_step(r, t, req_L, req_out, prefill_tps, h_off, h_ids, btok,
                                        parent, st, rq, rs, run_ids, present, lock, nchild,
                                        last_use, hk, hb, ev, lag_ns, rinf, stats)
        elif t_samp <= t_arr and on_change:
            t = t_samp
            loads = _grow2(loads, nl + 2 * R)
            tail = _grow1(tail, nl + 2 * R)
            for r in range(R):
                if rs[r, RS_NEXT_SAMPLE] != t:
                    continue
                if rs[r, RS_DUE_KIND] == DUE_HEARTBEAT:
                    rs[r, RS_HB_PENDING] = t   # a pending one it supersedes is dropped
                    rs[r, RS_HB_INF] = rinf[rs[r, RS_WORKER]]
                else:
                    nl = _flush_heartbeats(loads, tail, nl, t, rs, R)
                    _write_sample(loads, tail, nl, t, r, rs, rinf)
                    nl += 1
                rs[r, RS_NEXT_SAMPLE] = t + rs[r, RS_PUB_IDLE]
                rs[r, RS_DUE_KIND] = DUE_HEARTBEAT
        elif t_samp <= t_arr:
            # every sample due before the next step end and up to the next arrival, in one go
            # (nothing else happens in between, so the event order is unchanged).  Their
            # values cannot change inside the run, so past each rank's first two samples
            # only its last one matters (the rank table keeps the latest and the previous
            # sample): a long run (idle time) skips to its last R samples.
            limit = min(t_step, t_arr + 1)
            loads = _grow2(loads, nl + R)
            g = g_next
            cnt = 0
            while True:
                j = g % R
                t = t0 + phs[j] + (g // R) * publish_ns
                if t >= limit:
                    break
                nl = _interval_sample(g, t, order[j], rs, rinf, cur, loads, nl, table,
                                      view_inflight, dirty)
                g += 1
                cnt += 1
                if cnt == 2 * R:
                    g_end = 0  # samples stamped before the limit: sum over ranks
                    for jj in range(R):
                        span = limit - t0 - phs[jj]
                        if span > 0:
                            g_end += (span + publish_ns - 1) // publish_ns
                    if g_end - R > g:
                        g = g_end - R
            g_next = g
        else:
            t = t_arr
            i = next_req
            next_req += 1
            steps_changed = True
            if on_change:
                loads = _grow2(loads, nl + R)
                tail = _grow1(tail, nl + R)
                nl = _flush_heartbeats(loads, tail, nl, t, rs, R)
            # the KV index as the router sees it (events lagged by lag_ns)
            ne = ev[0]
            while ev_head < ne and ev[ev_head + 1] <= t:
                idx[ev[ev_head + 3], ev[ev_head + 2]] += 1 if ev[ev_head + 4] > 0 else -1
                if dispatch == LB_ROUTER:
                    sgn = ev[ev_head + 4]
                    rr_ = rank_off[ev[ev_head + 2]] + (sgn if sgn > 0 else -sgn) - 1
                    idxr[ev[ev_head + 3], rr_] += 1 if sgn > 0 else -1
                if cache_log is not None:
                    for x in range(4):
                        cache_log.append(ev[ev_head + 1 + x])
                ev_head += 4
                stats[SS_INDEX_EVENTS] += 1
            if ev_head == ne and ne > 0:
                ev[0] = 0
                ev_head = 0
            # matches: one entry per fleet worker holding >= 1 leading block,
            # deepest first, then worker id
            lo = h_off[i]
            n = h_off[i + 1] - lo
            # depth[j]: leading blocks fleet worker j holds (walked block by block)
            alive = nf
            for j in range(nf):
                depth[j] = 0
            d = 0
            while d < n and alive > 0:
                b = h_ids[lo + d]
                alive = 0
                for j in range(nf):
                    if depth[j] == d and idx[b, fleet[j]] > 0:
                        depth[j] = d + 1
                        alive += 1
                d += 1
            cnt = 0
            for j in range(nf):
                w = fleet[j]
                d = depth[j]
                if d > 0:
                    x = cnt
                    while x > 0 and tmp_d[x - 1] < d:
                        tmp_d[x] = tmp_d[x - 1]
                        tmp_w[x] = tmp_w[x - 1]
                        x -= 1
                    tmp_d[x] = d
                    tmp_w[x] = w
                    cnt += 1
            m_worker = _grow1(m_worker, nm + cnt)
            m_blocks = _grow1(m_blocks, nm + cnt)
            for x in range(cnt):
                m_worker[nm + x] = tmp_w[x]
                m_blocks[nm + x] = tmp_d[x]
            m0 = nm
            nm += cnt
            m_off[i + 1] = nm
            rq[i, RQ_BEST] = tmp_d[0] if cnt > 0 else 0
            # the load snapshot: exactly the samples written so far
            # (interval publishing applied its samples to the rank table as it wrote them)
            if on_change:
                written = LoadColumns(loads[LD_TS, :nl], loads[LD_WORKER, :nl],
                                      loads[LD_RANK, :nl], loads[LD_RUNNING, :nl],
                                      loads[LD_WAITING, :nl], loads[LD_TOKENS, :nl],
                                      loads[LD_MAXTOT, :nl], tail[:nl], loads[LD_WU, :nl],
                                      loads[LD_TOTAL, :nl], loads[LD_MAXRUN, :nl],
                                      loads[LD_PTOK, :nl], loads[LD_PBUSY, :nl],
                                      loads[LD_INFLIGHT, :nl])
                ptr = advance_dirty_nb(ptr, t, written, dp_size, table, view_inflight, dirty)
            refresh_nb(table, view_inflight, dp_size, t, freshness, snap, est, oldest, dirty)
            if knobs.chat_routing[0] == REORG:
                # the reorg engine; the simulated fleet is one group (its members as plain engines)
                w, reason, rq[i, RQ_REORG_OUTCOME] = select_reorg_nb(
                    req_L[i], n, m_worker[m0:nm], m_blocks[m0:nm], fleet, in_fleet, snap, est,
                    knobs, 0, seed, i, audit, scratch_i, cand)
                decision, failure = -1, -1
            else:
                w, reason, decision, failure = select_prefill_nb(
                    req_L[i], n, m_worker[m0:nm], m_blocks[m0:nm], in_fleet, fleet, snap, est,
                    knobs, 0, seed, i, audit, scratch_i, cand, seen)
            if forced[i] >= 0:  # validation: the worker production chose, not the router's pick
                w, reason, decision, failure = forced[i], -1, -1, -1
            rq[i, RQ_WORKER] = w
            rq[i, RQ_REASON] = reason
            rq[i, RQ_DECISION] = decision
            rq[i, RQ_FAILURE] = failure
            if w < 0:
                st[i, ST_STATUS] = 4
                rq[i, RQ_DONE] = t
                rq[i, RQ_COMPLETIONS] += 1
                n_done += 1
                continue
            rinf[w] += 1
            r = _dispatch(dispatch, w, i, t, n, lo, req_L, h_ids, rank_off, rs, present, rr,
                          dpc_last, idxr, table, seed)
            cached = _cached_on(r, i, h_off, h_ids, btok, st, present)
            rq[i, RQ_RANK] = r
            st[i, ST_UNC_ENQ] = max(req_L[i] - cached, 0)
            if rs[r, RS_KIND] == 0 and rs[r, RS_QLEN] == 0 and rs[r, RS_RUN_N] == 0:
                _snapshot(r, t, rs)   # an idle rank's last snapshot: the moment work arrives
            _enqueue(r, i, st, rs)
            _changed(r, t, rs)
            if rs[r, RS_KIND] == 0:
                _start_step(r, t, req_L, req_out, prefill_tps, h_off, h_ids, btok, parent, st, rq, rs,
                            run_ids, present, lock, nchild, last_use, hk, hb, ev, lag_ns, stats)
            else:
                _cut_decode(r, t, rs)
    if cache_log is not None:
        for x in range(ev_head, ev[0]):
            cache_log.append(ev[x + 1])
    n_rows = nl if on_change else g_next
    return (rq, m_off, m_worker[:nm].copy(), m_blocks[:nm].copy(), loads[:, :nl], n_rows, stats, rs,
            order, phs, t0)
