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

State lives in flat arrays grouped into the named tuples of
``replay.kernels.layout`` (which also declares every column constant), passed
to the helpers as ``q`` (``SimRequests``), ``f`` (``SimFleet``), ``c``
(``SimCache``: per-(rank, block) cache arrays, a per-rank LRU heap of evictable
leaf blocks with lazy deletion, rebuilt when full, and the KV index's lag
queue), ``s`` (``SimState``: per-rank scalars ``rs[r, RS_*]``, per-request
``st[i, ST_*]`` and outputs ``rq[i, RQ_*]``) and ``v`` (``RouterView``: the
router's per-(block, worker) KV index and its load snapshot).
"""

from __future__ import annotations

import numba
import numpy as np

from replay.kernels._jit import JIT, njit, njit_inner
from replay.kernels.decide import A_NCOLS, C_NCOLS, select_prefill_nb
from replay.kernels.layout import (
    BOOTSTRAP_DRAW,
    CLIP_MAX_NEW,
    CT_GROUP_BITS,
    CT_HASH_MUL,
    CT_HASH_SHIFT,
    DPC_REFRESH_NS,
    DUE_CHANGE,
    DUE_HEARTBEAT,
    EN_MAXPF,
    EN_MIXED,
    EN_NR_DECAY,
    EN_NR_INIT,
    EN_NR_MIN,
    EN_PUB_SGL,
    LB_BOOTSTRAP_ROOM,
    LB_ROUND_ROBIN,
    LB_ROUTER,
    LB_TOTAL_REQUESTS,
    LB_TOTAL_TOKENS,
    LD_INFLIGHT,
    LD_MAXRUN,
    LD_MAXTOT,
    LD_NCOLS,
    LD_PBUSY,
    LD_PTOK,
    LD_RANK,
    LD_RUNNING,
    LD_TOKENS,
    LD_TOTAL,
    LD_TS,
    LD_WAITING,
    LD_WORKER,
    LD_WU,
    LPM_MAX_QUEUE,
    POLICY_LPM,
    RATIO_ONE,
    RETRACT_DECODE_STEPS,
    RQ_ADMIT,
    RQ_BEST,
    RQ_CACHED_BLOCKS,
    RQ_CACHED_TOKENS,
    RQ_COMPLETIONS,
    RQ_DECISION,
    RQ_DONE,
    RQ_FAILURE,
    RQ_FIRST,
    RQ_NCOLS,
    RQ_RANK,
    RQ_REASON,
    RQ_REORG_OUTCOME,
    RQ_WORKER,
    RS_BUD_REQ,
    RS_BUD_TOK,
    RS_BUD_TS,
    RS_CAP,
    RS_CHUNK,
    RS_CHUNK_REQ,
    RS_DEC_COUNT,
    RS_DECODE_NS,
    RS_DECODE_SLOPE,
    RS_DS_REQ,
    RS_DS_TOK,
    RS_DS_TS,
    RS_DUE_KIND,
    RS_END,
    RS_EVICTABLE,
    RS_HB_INF,
    RS_HB_PENDING,
    RS_HN,
    RS_KIND,
    RS_LAST_ROW,
    RS_LOCAL,
    RS_MAX_QLEN,
    RS_MAX_USED,
    RS_MAXPF,
    RS_MAXRUN,
    RS_MIXED,
    RS_NCOLS,
    RS_NEXT_SAMPLE,
    RS_NO_DECAY,
    RS_NR_DECAY,
    RS_NR_INIT,
    RS_NR_MIN,
    RS_PBUSY_NS,
    RS_POLICY,
    RS_PTOK,
    RS_PUB_CNT,
    RS_PUB_DELAY,
    RS_PUB_IDLE,
    RS_PUB_SGL,
    RS_QHEAD,
    RS_QLEN,
    RS_QTAIL,
    RS_QTOK,
    RS_QWU,
    RS_RATIO,
    RS_RUN_N,
    RS_STEP_DUR,
    RS_STEP_K,
    RS_STEP_MIX,
    RS_STEP_START,
    RS_STEP_TOK,
    RS_USED,
    RS_WORKER,
    SNAPSHOT_DECODE_STEPS,
    SS_CHUNKED,
    SS_EVENTS,
    SS_EVICTIONS,
    SS_INDEX_EVENTS,
    SS_KV_OVER,
    SS_NCOLS,
    SS_NEG_QUEUE,
    SS_REBUILDS,
    SS_RECOMPUTED,
    SS_RETRACTIONS,
    SS_STEPS,
    ST_FULL,
    ST_GENKV,
    ST_NCOLS,
    ST_OUT,
    ST_PF_LEFT,
    ST_PRIVATE,
    ST_QNEXT,
    ST_REMAIN,
    ST_SEQ,
    ST_STATUS,
    ST_UNC_ENQ,
    STALL_PUBLISH_NS,
    LoadColumns,
    RouterView,
    SimCache,
    SimOutputs,
    SimState,
)
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


# ---------------------------------------------------------------------------
# A rank's cache: open-addressing table of block -> slot (linear probing,
# backward-shift deletion).  Slots move only when one is deleted (an eviction).
@inline
def _home(b, mask):
    b = np.int64(b)
    return ((((b >> CT_GROUP_BITS) * CT_HASH_MUL) >> CT_HASH_SHIFT) << CT_GROUP_BITS
            | (b & ((1 << CT_GROUP_BITS) - 1))) & mask


@inline
def _probe(c, r, b):
    """The slot of block ``b`` on rank ``r``, or the empty slot where it would go
    (``c.ck[r, slot] == b`` iff ``b`` is cached there)."""
    mask = c.ck.shape[1] - 1
    h = _home(b, mask)
    while True:
        k = c.ck[r, h]
        if k == b or k < 0:
            return h
        h = (h + 1) & mask


@inline
def _find(c, r, b):
    """The slot of block ``b`` on rank ``r``; -1 when it is not cached there."""
    h = _probe(c, r, b)
    return h if c.ck[r, h] == b else -1


@inline
def _slot(c, r, b, h):
    """The slot of block ``b`` cached on rank ``r``, where ``h`` is the slot it was last found in
    (``c.hs``): the same unless an eviction moved it."""
    return h if c.ck[r, h] == b else _find(c, r, b)


@inline
def _remove(c, r, h):
    """Delete slot ``h`` of rank ``r``'s table, shifting later entries of its run back."""
    mask = c.ck.shape[1] - 1
    i = h
    j = h
    while True:
        j = (j + 1) & mask
        k = c.ck[r, j]
        if k < 0:
            break
        home = _home(k, mask)
        # the entry at j may fill the hole at i iff its home is not cyclically in (i, j]
        if (home <= i or home > j) if j > i else (home <= i and home > j):
            c.ck[r, i] = k
            c.cl[r, i] = c.cl[r, j]
            c.cn[r, i] = c.cn[r, j]
            c.cu[r, i] = c.cu[r, j]
            i = j
    c.ck[r, i] = -1


def cache_tables(ranks: int, slots: int) -> tuple:
    """Empty cache tables of ``ranks`` ranks (``layout.SimCache``'s ``ck``, ``cl``, ``cn``,
    ``cu``): only the keys are filled (-1); a slot's other fields are written when a block is
    stored in it."""
    return (np.full((ranks, slots), -1, dtype=np.int32), np.empty((ranks, slots), dtype=np.int32),
            np.empty((ranks, slots), dtype=np.int32), np.empty((ranks, slots), dtype=np.int64))


def cache_slots(q, capacity) -> int:
    """Slots per rank of the cache tables of requests ``q``: a power of two at least four times
    the most blocks a rank can hold (only full blocks are cached, and a rank's cached tokens
    never exceed its KV capacity ``capacity[r]``), and never more than twice the trace's
    blocks."""
    sizes = np.diff(q.h_off)
    pos = np.arange(q.h_ids.shape[0], dtype=np.int64) - np.repeat(q.h_off[:-1], sizes)
    cached = q.h_ids[pos < np.repeat(q.full, sizes)]  # the full blocks, the only ones stored
    most = int(q.btok.shape[0])
    if cached.size and capacity.shape[0]:
        most = min(most, int(capacity.max()) // max(int(q.btok[cached].min()), 1))
    n = 16
    while n < 4 * most + 4:
        n *= 2
    return n


@inline
def _evictable_leaf(c, r, h):
    return h >= 0 and c.cl[r, h] == 0 and c.cn[r, h] == 0


@inline
def _push_leaf(c, s, r, b, h):
    """Offer block ``b`` (slot ``h``) to rank ``r``'s LRU heap; rebuild the heap from the cache
    when full."""
    hk, hb = c.hk, c.hb
    rs, stats = s.rs, s.stats
    if rs[r, RS_HN] >= hk.shape[1]:
        stats[SS_REBUILDS] += 1
        rs[r, RS_HN] = 0
        for x in range(c.ck.shape[1]):
            if c.ck[r, x] >= 0 and _evictable_leaf(c, r, x):
                _heap_push(hk, hb, rs, r, c.cu[r, x], c.ck[r, x])
        return  # b, if evictable, is in the rebuilt heap
    _heap_push(hk, hb, rs, r, c.cu[r, h], b)


@inline
def _evict_one(q, c, s, r, t, w):
    """Evict rank ``r``'s least recently used evictable leaf; False when there is none."""
    hk, hb, ev, lag = c.hk, c.hb, c.ev, c.lag
    rs, stats, btok, parent = s.rs, s.stats, q.btok, q.parent
    while rs[r, RS_HN] > 0:
        key, b = _heap_pop(hk, hb, rs, r)
        h = _find(c, r, b)
        if not _evictable_leaf(c, r, h) or c.cu[r, h] != key:
            continue  # stale entry
        _remove(c, r, h)
        rs[r, RS_USED] -= btok[b]
        rs[r, RS_EVICTABLE] -= btok[b]
        stats[SS_EVICTIONS] += 1
        _ev_push(ev, t + lag, w, b, -1 - rs[r, RS_LOCAL])  # sign: evicted; magnitude: local rank + 1
        p = parent[b]
        if p >= 0:
            hp = _find(c, r, p)
            c.cn[r, hp] -= 1
            if _evictable_leaf(c, r, hp):
                _push_leaf(c, s, r, p, hp)
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
def _lock(c, r, h, rs, tok):
    if c.cl[r, h] == 0:
        rs[r, RS_EVICTABLE] -= tok
    c.cl[r, h] += 1


@inline
def _unlock(c, r, h, rs, tok):
    c.cl[r, h] -= 1
    if c.cl[r, h] == 0:
        rs[r, RS_EVICTABLE] += tok


@njit_inner(allocates=False)
def _try_admit(q, c, s, r, i, t, chunking, rem_chunk, rem_input, offset, first):
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
    req_L, req_out, h_off, h_ids, btok = q.input_tokens, q.output_tokens, q.h_off, q.h_ids, q.btok
    st, rq, rs, stats = s.st, s.rq, s.rs, s.stats
    ev, lag, hs = c.ev, c.lag, c.hs
    lo = h_off[i]
    n = st[i, ST_FULL]
    d = 0
    cached = 0
    while d < n:
        b = h_ids[lo + d]
        h = _find(c, r, b)
        if h < 0:
            break
        hs[lo + d] = h
        _lock(c, r, h, rs, btok[b])
        cached += btok[b]
        d += 1
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
            if not _evict_one(q, c, s, r, t, w):
                break
        ok = rs[r, RS_CAP] - rs[r, RS_USED] >= need
    if not ok:
        h = -1
        for j in range(d):  # (slots may have moved in the evictions)
            b = h_ids[lo + j]
            h = _slot(c, r, b, hs[lo + j])
            _unlock(c, r, h, rs, btok[b])
        if d > 0 and _evictable_leaf(c, r, h):
            _push_leaf(c, s, r, h_ids[lo + d - 1], h)
        return -1, 0
    # the cached blocks stay locked until _release, which stamps their last use: no stamp here
    hp = _slot(c, r, h_ids[lo + d - 1], hs[lo + d - 1]) if d > 0 else -1
    for j in range(d, n):
        b = h_ids[lo + j]
        h = _probe(c, r, b)
        hs[lo + j] = h
        c.ck[r, h] = b
        c.cl[r, h] = 1
        c.cn[r, h] = 0
        c.cu[r, h] = t
        rs[r, RS_USED] += btok[b]
        if j > 0:
            c.cn[r, hp] += 1
        hp = h
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
def _release(q, c, s, r, i, t):
    """Request ``i`` leaves rank ``r``'s batch at ``t``: its blocks are unlocked (stamped
    ``t``; the deepest offered to the LRU heap) and its private and output KV freed."""
    h_off, h_ids, btok = q.h_off, q.h_ids, q.btok
    st, rs = s.st, s.rs
    lo = h_off[i]
    n = st[i, ST_FULL]
    hs = c.hs
    h = -1
    for j in range(n):
        b = h_ids[lo + j]
        h = _slot(c, r, b, hs[lo + j])
        _unlock(c, r, h, rs, btok[b])
        c.cu[r, h] = t
    if n > 0 and _evictable_leaf(c, r, h):
        _push_leaf(c, s, r, h_ids[lo + n - 1], h)
    rs[r, RS_USED] -= st[i, ST_PRIVATE] + st[i, ST_GENKV]
    st[i, ST_GENKV] = 0


@inline
def _cached_on(q, c, s, r, i):
    """Tokens of request ``i``'s longest cached run of full blocks on rank ``r``."""
    h_off, h_ids, btok, st = q.h_off, q.h_ids, q.btok, s.st
    lo = h_off[i]
    n = st[i, ST_FULL]
    tok = 0
    d = 0
    while d < n and _find(c, r, h_ids[lo + d]) >= 0:
        tok += btok[h_ids[lo + d]]
        d += 1
    return tok


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


@njit_inner(allocates=False)
def _retract(q, c, s, r, t):
    """Decode ran out of KV on rank ``r``: retract one running request (SGLang's
    ``length`` order: the fewest output tokens, then the longest prompt, then
    the latest arrival), free its private KV and unlock its prefix, and queue
    it at the tail to recompute its prompt and output so far."""
    req_L, st, rs, run_ids, stats = q.input_tokens, s.st, s.rs, s.run_ids, s.stats
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
    _release(q, c, s, r, i, t)
    st[i, ST_SEQ] = req_L[i] + st[i, ST_OUT]
    st[i, ST_UNC_ENQ] = max(st[i, ST_SEQ] - _cached_on(q, c, s, r, i), 0)
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


@inline
def _publish_sgl(r, t, rs):
    """SGLang's LoadStat cadence: rank ``r`` publishes at ``t`` (after a prefill step,
    after its 15th decode step since the last one, or on going idle); the decode
    count restarts, as the engine's throttle counter does."""
    rs[r, RS_PUB_CNT] = 0
    _changed(r, t, rs)


@njit_inner(allocates=False)
def _lpm_order(q, c, s, r):
    """Reorder rank ``r``'s waiting queue by longest cached prefix on the rank
    (ties: arrival order), SGLang's ``lpm`` policy; above ``LPM_MAX_QUEUE``
    waiting requests the order is left alone (SGLang's fallback to FCFS)."""
    h_off, h_ids, btok, st, rs = q.h_off, q.h_ids, q.btok, s.st, s.rs
    n = rs[r, RS_QLEN]
    if n < 2 or n > LPM_MAX_QUEUE:
        return
    ids = s.lpm_ids
    key = s.lpm_key
    i = rs[r, RS_QHEAD]
    k = 0
    while i >= 0 and k < n:
        lo = h_off[i]
        m = st[i, ST_FULL]
        d = 0
        tok = 0
        while d < m and _find(c, r, h_ids[lo + d]) >= 0:
            tok += btok[h_ids[lo + d]]
            d += 1
        # insertion: descending cached tokens, then ascending request index
        x = k
        while x > 0 and (key[x - 1] < tok or (key[x - 1] == tok and ids[x - 1] > i)):
            key[x] = key[x - 1]
            ids[x] = ids[x - 1]
            x -= 1
        key[x] = tok
        ids[x] = i
        k += 1
        i = st[i, ST_QNEXT]
    rs[r, RS_QHEAD] = ids[0]
    for x in range(k - 1):
        st[ids[x], ST_QNEXT] = ids[x + 1]
    st[ids[k - 1], ST_QNEXT] = -1
    rs[r, RS_QTAIL] = ids[k - 1]


@njit_inner(allocates=False)
def _start_step(q, f, c, s, r, t):
    """Start rank ``r``'s next step at ``t``, SGLang's scheduler (docs/simulator.md):
    a prefill step if any prompt tokens are to compute (an unfinished chunked
    prompt first, then admissions in queue order while the chunk and
    ``max_prefill_tokens`` budgets, the running cap and the KV reservation
    allow), else a decode step if anything runs (retracting when its KV does
    not fit), else idle (new_token_ratio back to its initial value)."""
    req_out, prefill_tps = q.output_tokens, f.prefill_tps
    st, rq, rs, run_ids, stats = s.st, s.rq, s.rs, s.run_ids, s.stats
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
    cr = rs[r, RS_CHUNK_REQ]
    if cr >= 0:
        take = min(st[cr, ST_PF_LEFT], rem_chunk) if rem_chunk > 0 else min(st[cr, ST_PF_LEFT], 1)
        st[cr, ST_PF_LEFT] -= take
        tokens += take
        rem_chunk -= take
        rem_input -= take
        if st[cr, ST_PF_LEFT] == 0:
            rs[r, RS_CHUNK_REQ] = -1
    if rs[r, RS_POLICY] == POLICY_LPM and rem_chunk > 0 and rem_input > 0:
        _lpm_order(q, c, s, r)
    while (rem_chunk > 0 and rem_input > 0 and rs[r, RS_QHEAD] >= 0
           and rs[r, RS_RUN_N] < rs[r, RS_MAXRUN]):
        i = rs[r, RS_QHEAD]
        take, reserve = _try_admit(q, c, s, r, i, t, chunking, rem_chunk, rem_input, offset,
                                   admitted == 0)
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
    if admitted > 0 and rs[r, RS_PUB_SGL] == 0:  # sglang cadence: published at the step's end
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
                if not _evict_one(q, c, s, r, t, w):
                    break
            retracted = False
            while rs[r, RS_CAP] - rs[r, RS_USED] < rs[r, RS_RUN_N] and rs[r, RS_RUN_N] > 1:
                _retract(q, c, s, r, t)
                retracted = True
            if retracted:
                if rs[r, RS_PUB_SGL] == 0:
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
            if rs[r, RS_PUB_SGL] == 1:  # the event ends where the engine publishes
                k = max(min(k, SNAPSHOT_DECODE_STEPS - rs[r, RS_PUB_CNT]), 1)
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
def _complete(q, c, s, r, i, t):
    st, rq, rinf = s.st, s.rq, s.rinf
    _release(q, c, s, r, i, t)
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


@njit_inner(allocates=False)
def _end_step(q, f, c, s, r, t):
    """Finish rank ``r``'s step at ``t`` (first tokens, decode tokens and their KV,
    completions, the load snapshot), start the next."""
    req_out, st, rq, rs, run_ids, stats = q.output_tokens, s.st, s.rq, s.rs, s.run_ids, s.stats
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
            _complete(q, c, s, r, i, t)
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
    sgl = rs[r, RS_PUB_SGL] == 1
    if sgl:
        if kind == 2:
            rs[r, RS_PUB_CNT] += dec_k
        if kind == 1 or rs[r, RS_PUB_CNT] >= SNAPSHOT_DECODE_STEPS:
            _publish_sgl(r, t, rs)
    elif kind == 1 or done > 0:
        _changed(r, t, rs)
    if kind == 1:
        _snapshot(r, t, rs)
    _start_step(q, f, c, s, r, t)
    if sgl and rs[r, RS_KIND] == 0:
        _publish_sgl(r, t, rs)   # idle (or stalled): the idle loop publishes at once
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
def _interval_sample(s, v, g, t, r, cur, recs, nr, quiet):
    """Interval publishing: rank ``r``'s sample number ``g`` (of the whole run, in
    written order) stamped ``t``.  It is applied to the router's rank table as
    ``kernels.snapshot.advance_dirty_nb`` applies a written sample (every simulated
    sample has the native tail and a rank inside its worker's dp_size), and
    recorded in ``recs`` only when its values differ from the rank's previous
    sample: the rows are expanded from these records afterwards
    (:func:`expand_interval_nb`), so memory grows with the changes, not with the
    span.  ``quiet[r]``: the rank's last sample repeated the one before it and
    nothing touched the rank (or its worker's in-flight count) since: this one
    repeats it too, and of its application only the stamp changes anything.
    Returns the new record count."""
    rs, rinf, table, view_inflight, dirty = s.rs, s.rinf, v.table, v.inflight, v.dirty
    w = rs[r, RS_WORKER]
    loc = rs[r, RS_LOCAL]
    if quiet[r]:
        table[w, loc, R_AT] = t
        dirty[w] = True
        return nr
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
    quiet[r] = True
    if not (cur[r, LD_TS] >= 0 and cur[r, LD_RUNNING] == running and cur[r, LD_WAITING] == waiting
            and cur[r, LD_TOKENS] == busy and cur[r, LD_MAXTOT] == maxtot and cur[r, LD_WU] == wu
            and cur[r, LD_TOTAL] == total and cur[r, LD_MAXRUN] == maxrun
            and cur[r, LD_PTOK] == ptok and cur[r, LD_PBUSY] == pbusy
            and cur[r, LD_INFLIGHT] == inf):
        quiet[r] = False
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


@njit_inner(allocates=False)
def _interval_run(s, v, order, phs, t0, publish_ns, cur, recs, nr, g, limit, quiet):
    """Interval publishing: every sample from number ``g`` stamped before ``limit``
    (:func:`_interval_sample`); returns the new record count, the next sample number and
    that sample's stamp (the first at or after ``limit``)."""
    R = order.shape[0]
    cnt = 0
    j = g % R   # sample g is rank order[j]'s number k (no division per sample)
    base = t0 + (g // R) * publish_ns
    while True:
        t = base + phs[j]
        if t >= limit:
            break
        nr = _interval_sample(s, v, g, t, order[j], cur, recs, nr, quiet)
        g += 1
        j += 1
        if j == R:
            j = 0
            base += publish_ns
        cnt += 1
        if cnt == 2 * R:
            g_end = 0  # samples stamped before the limit: sum over ranks
            for jj in range(R):
                span = limit - t0 - phs[jj]
                if span > 0:
                    g_end += (span + publish_ns - 1) // publish_ns
            if g_end - R > g:
                g = g_end - R
                j = g % R
                base = t0 + (g // R) * publish_ns
    return nr, g, t


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


@njit_inner(allocates=False)
def _flush_heartbeats(loads, tail, nl, t, rs, R, due):
    """Write the pending heartbeats stamped ``<= t`` in (time, rank) order; return the new count
    and the earliest heartbeat still pending (INF: none).  ``due``: scratch of ``R`` entries.

    On-change publishing: a heartbeat repeats the rank's previous sample but
    for its stamp and ``router_inflight``.  It is held back until something
    happens after it (another sample or an arrival); a heartbeat superseded by
    the rank's next heartbeat before anything happened is not written, since no
    decision could see it (the rank table keeps the latest sample per rank, and
    its throughput delta is zero either way).  So idle time costs no rows.
    """
    n = 0
    later = INF
    for r in range(R):  # the ranks due, in (time, rank) order: one pass and an insertion sort
        p = rs[r, RS_HB_PENDING]
        if p < 0:
            continue
        if p > t:
            later = min(later, p)
            continue
        x = n
        while x > 0 and rs[due[x - 1], RS_HB_PENDING] > p:
            due[x] = due[x - 1]
            x -= 1
        due[x] = r
        n += 1
    for x in range(n):
        r = due[x]
        src = rs[r, RS_LAST_ROW]
        for c in range(LD_NCOLS):
            loads[c, nl] = loads[c, src]
        loads[LD_TS, nl] = rs[r, RS_HB_PENDING]
        loads[LD_INFLIGHT, nl] = rs[r, RS_HB_INF]
        tail[nl] = True
        rs[r, RS_LAST_ROW] = nl
        rs[r, RS_HB_PENDING] = -1
        nl += 1
    return nl, later


@njit_inner(allocates=False)
def _dispatch(q, f, c, s, v, w, i, t, n, lo, seed):
    """The rank of worker ``w`` that request ``i`` goes to (the worker's DP controller,
    or the router for ``LB_ROUTER``); docs/simulator.md, "Data-parallel dispatch"."""
    method, req_L, h_ids, rank_off = f.dispatch, q.input_tokens, q.h_ids, f.rank_off
    rs, rr, dpc_last, idxr, table = s.rs, s.rr, s.dpc_last, c.idxr, v.table
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
            while d < n and _find(c, r, h_ids[lo + d]) >= 0:
                d += 1
            ld = rs[r, RS_QLEN] + rs[r, RS_RUN_N]
        if d > bd or (d == bd and ld < bl):
            best = r
            bd = d
            bl = ld
    return best


def sim_cache(q, f, lag_ns, slots=None):
    """Empty caches and KV indexes (``layout.SimCache``) for :func:`simulate_nb` of
    requests ``q`` on fleet ``f``, the index's events due ``lag_ns`` after the change
    (``slots``: :func:`cache_slots` of ``q`` and ``f``, when the caller kept it).

    Made by numpy (plain Python).  Each rank's cache is a table of
    :func:`cache_slots` slots (its KV capacity in blocks, twice over), so its size
    follows the fleet, not the trace; only its keys need filling (a slot's other
    fields are written when a block is stored), the heaps are read only below their
    sizes, and the slot hints ``hs`` (4 bytes per prefix block of the requests) only where
    an admission wrote them: no zero fill.  The
    KV index's lag queue holds 4 values per event from ``ev[1]`` (``ev[0]`` values
    held): every store is one block of an admitted request (each request is admitted
    once) and every eviction undoes a store, so 8 values per prefix block bound it;
    the queue restarts at 0 whenever the index has caught up, so few pages are used.
    The router's index is block-major, so one block's holders are one cache line.
    """
    R = int(f.rank_off[f.n_workers])
    B = q.btok.shape[0]
    ev = np.empty(1 + 8 * q.h_ids.shape[0] + 8, dtype=np.int64)
    ev[0] = 0
    if B >= 2**31:
        raise ValueError(f"{B} distinct blocks: the cache tables hold block ids below 2**31")
    return SimCache(*cache_tables(R, cache_slots(q, f.capacity) if slots is None else slots),
                    np.empty(q.h_ids.shape[0], dtype=np.int32),
                    np.empty((R, f.heap_cap), dtype=np.int64), np.empty((R, f.heap_cap), dtype=np.int64),
                    ev, np.zeros((B, f.n_workers), dtype=np.int32),
                    np.zeros((B, R) if f.dispatch == LB_ROUTER else (1, 1), dtype=np.int32), lag_ns)


@njit_inner(allocates=False)
def _arrive(q, f, c, s, v, knobs, seed, freshness, i, t, m_worker, m_blocks, nm, m_off, loads, tail,
            nl, ptr):
    """Request ``i`` arrives at ``t`` (the KV index brought to ``t``): its matches
    (appended to ``m_worker``/``m_blocks`` from entry ``nm``, which have room for one
    per fleet worker), the router's decision on the load samples written so far
    (on-change publishing: ``loads[:, :nl]``, applied from row ``ptr``), the rank,
    the queue.  Returns ``(nm, ptr, 1 if the router failed it else 0)``."""
    req_L, h_off, h_ids, forced = q.input_tokens, q.h_off, q.h_ids, q.forced
    fleet, in_fleet, dp_size = f.fleet, f.in_fleet, f.dp_size
    st, rq, rs, rinf = s.st, s.rq, s.rs, s.rinf
    idx, table, view_inflight, snap, est = c.idx, v.table, v.inflight, v.snap, v.est
    oldest, dirty, depth, tmp_w, tmp_d = v.oldest, v.dirty, v.depth, v.tmp_w, v.tmp_d
    nf = fleet.shape[0]
    on_change = f.pub_delay > 0
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
            knobs, 0, seed, i, v.audit, v.scratch, v.cand)
        decision, failure = -1, -1
    else:
        w, reason, decision, failure = select_prefill_nb(
            req_L[i], n, m_worker[m0:nm], m_blocks[m0:nm], in_fleet, fleet, snap, est,
            knobs, 0, seed, i, v.audit, v.scratch, v.cand, v.seen)
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
        return nm, ptr, 1
    rinf[w] += 1
    r = _dispatch(q, f, c, s, v, w, i, t, n, lo, seed)
    cached = _cached_on(q, c, s, r, i)
    rq[i, RQ_RANK] = r
    st[i, ST_UNC_ENQ] = max(req_L[i] - cached, 0)
    if rs[r, RS_KIND] == 0 and rs[r, RS_QLEN] == 0 and rs[r, RS_RUN_N] == 0:
        _snapshot(r, t, rs)   # an idle rank's last snapshot: the moment work arrives
    _enqueue(r, i, st, rs)
    if rs[r, RS_PUB_SGL] == 0:
        _changed(r, t, rs)
    if rs[r, RS_KIND] == 0:
        _start_step(q, f, c, s, r, t)
        if rs[r, RS_PUB_SGL] == 1 and rs[r, RS_KIND] == 0:
            # stalled (queued, nothing admitted): SGLang's idle loop re-publishes a
            # changed load every 50 ms; the arrival shows at the next of those
            _changed(r, t + STALL_PUBLISH_NS, rs)
    else:
        _cut_decode(r, t, rs)
    return nm, ptr, 0


@njit
def simulate_nb(q, f, c, knobs, seed, freshness, cache_log=None):
    """Run one closed-loop simulation of requests ``q`` (``layout.SimRequests``) on
    fleet ``f`` (``layout.SimFleet``) with empty caches ``c`` (``layout.SimCache``, made by
    :func:`sim_cache`), the router deciding under ``knobs``, the
    ``kernels.layout.KnobArrays`` of one config (``replay.sweep.engine.encode_configs``),
    with ``seed`` and the snapshot's ``freshness`` (ns).

    Only a request's full blocks are cached, published and matched (the router
    still counts every block as queried).  ``f.pub_delay`` > 0 selects on-change
    publishing (a sample ``pub_delay`` after a change, a heartbeat after
    ``pub_idle`` without one) instead of one sample every ``publish_ns``.

    Returns a ``layout.SimOutputs``.

    ``cache_log`` (optional, a typed list of int64): every cache store and
    eviction is appended as four values ``(ts + index lag, worker, block,
    +/-(local rank + 1))``, + for a store, - for an eviction, in the order the
    KV index applies them (``replay.capture.from_sim`` turns them into KV events).
    """
    req_ts, req_L, req_private, req_full = q.ts, q.input_tokens, q.private, q.full
    n_workers, fleet, rank_off = f.n_workers, f.fleet, f.rank_off
    publish_ns, pub_delay, pub_idle, rank_phase = f.publish_ns, f.pub_delay, f.pub_idle, f.phase
    N = req_ts.shape[0]
    R = rank_off[n_workers]
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
        rs[r, RS_CAP] = f.capacity[r]
        rs[r, RS_MAXRUN] = f.max_running[r]
        rs[r, RS_DECODE_NS] = f.decode_ns[r]
        rs[r, RS_QHEAD] = -1
        rs[r, RS_QTAIL] = -1
        rs[r, RS_END] = INF
        rs[r, RS_DECODE_SLOPE] = f.decode_slope[r]
        rs[r, RS_CHUNK] = f.chunk[r]
        rs[r, RS_CHUNK_REQ] = -1
        rs[r, RS_POLICY] = f.policy[r]
        rs[r, RS_PUB_DELAY] = pub_delay
        rs[r, RS_PUB_IDLE] = pub_idle
        rs[r, RS_HB_PENDING] = -1
        rs[r, RS_LAST_ROW] = -1
        rs[r, RS_MAXPF] = f.engine[r, EN_MAXPF]
        rs[r, RS_NR_INIT] = f.engine[r, EN_NR_INIT]
        rs[r, RS_RATIO] = f.engine[r, EN_NR_INIT]
        rs[r, RS_NR_MIN] = f.engine[r, EN_NR_MIN]
        rs[r, RS_NR_DECAY] = f.engine[r, EN_NR_DECAY]
        rs[r, RS_MIXED] = f.engine[r, EN_MIXED]
        rs[r, RS_PUB_SGL] = f.engine[r, EN_PUB_SGL]
        rs[r, RS_DS_TS] = -1
        rs[r, RS_BUD_TS] = -2
        max_run = max(max_run, f.max_running[r])
    st = np.zeros((N, ST_NCOLS), dtype=np.int64)
    rq = np.full((N, RQ_NCOLS), -1, dtype=np.int64)
    rq[:, RQ_COMPLETIONS] = 0
    for i in range(N):
        st[i, ST_PRIVATE] = req_private[i]
        st[i, ST_FULL] = req_full[i]
        st[i, ST_QNEXT] = -1
        st[i, ST_SEQ] = req_L[i]
    # a rank never runs more requests than the log holds: a max_running_requests of 10**9
    # (no limit, in effect) must not size this table
    run_ids = np.zeros((R, max(1, min(max_run, N))), dtype=np.int64)
    # the DP controllers: round-robin counters and last snapshot refresh, per worker
    rr = np.zeros(n_workers, dtype=np.int64)
    dpc_last = np.full(n_workers, -INF, dtype=np.int64)
    # the caches and KV indexes come from the caller (numpy's large allocations are on
    # huge pages: numba's would fault every 4 KiB page of about 100 MB per run)
    ev, idx, idxr = c.ev, c.idx, c.idxr
    depth = np.zeros(max(nf, 1), dtype=np.int64)
    ev_head = 0
    rinf = np.zeros(n_workers, dtype=np.int64)      # the router's live in-flight counts
    stats = np.zeros(SS_NCOLS, dtype=np.int64)
    # --- outputs
    # sized for about 8 change records (interval publishing: _interval_sample's, bounded by
    # the events) or 16 written rows (on-change) per request (Mooncake's conversation trace on
    # 16 x dp 2: 6.5 and 12.8); it grows if needed, but a growth copies every row written so
    # far to fresh pages, while the pages of unused room are never touched
    on_change = pub_delay > 0
    n_samples = 1024 + 2 * R + (16 if on_change else 8) * N
    loads = np.empty((LD_NCOLS, n_samples), dtype=np.int64)
    tail = np.ones(n_samples if on_change else 1, dtype=np.bool_)
    cur = np.full((R, LD_NCOLS), -1, dtype=np.int64)  # interval: each rank's latest record
    quiet = np.zeros(R, dtype=np.bool_)  # interval: see _interval_sample
    hb_due = np.empty(max(R, 1), dtype=np.int64)  # on-change: _flush_heartbeats' scratch
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
    s = SimState(rs, st, rq, run_ids, rinf, stats, rr, dpc_last, np.empty(LPM_MAX_QUEUE, dtype=np.int64),
                 np.empty(LPM_MAX_QUEUE, dtype=np.int64))
    v = RouterView(table, view_inflight, snap, est, oldest, dirty, audit, scratch_i, cand,
                   seen, depth, tmp_w, tmp_d)
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
    # arrival), so their minimum is kept up to date then: a step end's pass
    # recomputes it, and an arrival only starts its idle rank's step or cuts
    # its decode run short (its rank's end can only come earlier).
    order = np.argsort(rank_phase[:R], kind="mergesort")
    phs = np.empty(R, dtype=np.int64)
    for j in range(R):
        phs[j] = rank_phase[order[j]]
    t0 = req_ts[0] - publish_ns if N > 0 else 0
    g_next = 0  # interval: samples written so far; sample g is rank order[g % R]'s number g // R
    t_interval = t0 + phs[0] if R > 0 else INF  # interval: sample g_next's stamp
    t_step = INF  # every rank is idle
    # on-change: the next sample or heartbeat due, kept up to date the same way (only the
    # ranks a step end, a sample or an arrival touches change theirs)
    t_pub = INF
    if on_change:
        for r in range(R):
            t_pub = min(t_pub, rs[r, RS_NEXT_SAMPLE])
    hb_next = INF  # on-change: no pending heartbeat is stamped before this (a lower bound)
    while n_done < N:
        stats[SS_EVENTS] += 1
        t_samp = t_pub if on_change else t_interval
        t_arr = req_ts[next_req] if next_req < N else INF
        if t_step <= t_samp and t_step <= t_arr:
            t = t_step
            t_step = INF  # the next step end, in the same pass (a step end changes only its rank's)
            t_pub_new = INF
            for r in range(R):
                if rs[r, RS_END] == t:
                    n_done += _end_step(q, f, c, s, r, t)
                    w = rs[r, RS_WORKER]   # the step changed the rank and its worker's in-flight count
                    quiet[rank_off[w]:rank_off[w + 1]] = False
                if rs[r, RS_END] < t_step:
                    t_step = rs[r, RS_END]
                if on_change and rs[r, RS_NEXT_SAMPLE] < t_pub_new:
                    t_pub_new = rs[r, RS_NEXT_SAMPLE]
            if on_change:
                t_pub = t_pub_new
        elif t_samp <= t_arr and on_change:
            t = t_samp
            loads = _grow2(loads, nl + 2 * R)
            tail = _grow1(tail, nl + 2 * R)
            t_pub = INF
            for r in range(R):
                if rs[r, RS_NEXT_SAMPLE] != t:
                    t_pub = min(t_pub, rs[r, RS_NEXT_SAMPLE])
                    continue
                if rs[r, RS_DUE_KIND] == DUE_HEARTBEAT and rs[r, RS_PUB_SGL] == 1 and (
                        rs[r, RS_KIND] != 0):
                    rs[r, RS_NEXT_SAMPLE] = INF  # busy: SGLang publishes at step ends only
                    continue
                if rs[r, RS_DUE_KIND] == DUE_HEARTBEAT:
                    rs[r, RS_HB_PENDING] = t   # a pending one it supersedes is dropped
                    hb_next = min(hb_next, t)
                    rs[r, RS_HB_INF] = rinf[rs[r, RS_WORKER]]
                else:
                    if hb_next <= t:
                        nl, hb_next = _flush_heartbeats(loads, tail, nl, t, rs, R, hb_due)
                    _write_sample(loads, tail, nl, t, r, rs, rinf)
                    nl += 1
                rs[r, RS_NEXT_SAMPLE] = t + rs[r, RS_PUB_IDLE]
                rs[r, RS_DUE_KIND] = DUE_HEARTBEAT
                t_pub = min(t_pub, rs[r, RS_NEXT_SAMPLE])
        elif t_samp <= t_arr:
            # every sample due before the next step end and up to the next arrival, in one go
            # (nothing else happens in between, so the event order is unchanged).  Their
            # values cannot change inside the run, so past each rank's first two samples
            # only its last one matters (the rank table keeps the latest and the previous
            # sample): a long run (idle time) skips to its last R samples.
            loads = _grow2(loads, nl + R)
            nl, g_next, t_interval = _interval_run(s, v, order, phs, t0, publish_ns, cur, loads, nl, g_next,
                                                   min(t_step, t_arr + 1), quiet)
        else:
            t = t_arr
            i = next_req
            next_req += 1
            if on_change:
                loads = _grow2(loads, nl + R)
                tail = _grow1(tail, nl + R)
                if hb_next <= t:
                    nl, hb_next = _flush_heartbeats(loads, tail, nl, t, rs, R, hb_due)
            # the KV index as the router sees it (events lagged by lag_ns)
            ne = ev[0]
            while ev_head < ne and ev[ev_head + 1] <= t:
                idx[ev[ev_head + 3], ev[ev_head + 2]] += 1 if ev[ev_head + 4] > 0 else -1
                if f.dispatch == LB_ROUTER:
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
            m_worker = _grow1(m_worker, nm + nf)
            m_blocks = _grow1(m_blocks, nm + nf)
            nm, ptr, failed = _arrive(q, f, c, s, v, knobs, seed, freshness, i, t, m_worker, m_blocks,
                                      nm, m_off, loads, tail, nl, ptr)
            n_done += failed
            w = rq[i, RQ_WORKER]   # its worker's in-flight count and the rank it queued on changed
            if w >= 0:
                quiet[rank_off[w]:rank_off[w + 1]] = False
                t_step = min(t_step, rs[rq[i, RQ_RANK], RS_END])
            if on_change:  # (a change may put a rank's next heartbeat later: no shortcut)
                t_pub = INF
                for r in range(R):
                    t_pub = min(t_pub, rs[r, RS_NEXT_SAMPLE])
    if cache_log is not None:
        for x in range(ev_head, ev[0]):
            cache_log.append(ev[x + 1])
    n_rows = nl if on_change else g_next
    return SimOutputs(rq, m_off, m_worker[:nm].copy(), m_blocks[:nm].copy(), loads[:, :nl], n_rows,
                      stats, rs, order, phs, t0)
