"""The router's KV-indexer answer (``matches``) rebuilt from recorded KV events.

CAPTURE.md section 3: for a request, walk its block hashes from the root; for
each worker, count the leading blocks that worker holds on any rank in any
storage tier (ranks collapsed by max per worker URL), stopping at the first it
lacks; list the workers with at least one block, in worker-URL order.
``BlockStored`` adds its blocks to the rank's tier (``GPU`` when the event
names none); ``BlockRemoved`` takes them from the named tier, or from every
tier when it names none; ``AllBlocksCleared`` empties the rank.

An event is visible to a request when ``event ts + index lag <= request ts``
(the replay's visibility rule, ROUTER_SEMANTICS s.0.1, applied to the
indexer).  Events of one rank apply in sequence order; ranks are independent.

:func:`matches_from_events` is the numba sweep; :func:`placement_matches` is
the stated approximation used when no KV event was recorded (each worker
holds the blocks of the requests it served, least recently used evicted at
its KV capacity).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from replay.capture import wire
from replay.kernels._jit import njit

EV_STORED = 0
EV_REMOVED = 1
EV_CLEARED = 2
EV_CODES = {wire.BLOCK_STORED: EV_STORED, wire.BLOCK_REMOVED: EV_REMOVED, wire.ALL_BLOCKS_CLEARED: EV_CLEARED}
# one bit per storage tier (wire.MEDIA order); 0 in an event row means "no medium named"
TIER_BITS = {None: 0, **{m: 1 << i for i, m in enumerate(wire.MEDIA)}}


@njit
def matches_from_events_nb(held, ev_t, ev_rank, ev_kind, ev_tier, ev_block, req_t, h_off, h_ids, i0, i1,
                           rank_off, lag):
    """Answer requests ``i0..i1`` (sorted by time), applying events (sorted by time, then rank
    sequence) to ``held`` (uint8[blocks, ranks] of tier bits, updated in place) as they become
    visible.  ``held`` is laid out ``[block, rank]``: a request's walk reads every rank's
    entry of one block from one or two cache lines.  ``ev_block`` is a dense block id (-1: a block no request
    holds; only a clear needs none), ``ev_tier`` a tier bit (0 = every tier for a removal, GPU for a store).
    Workers ``w`` own ranks ``rank_off[w]..rank_off[w+1]``, numbered in URL order.

    Returns ``(events applied, counts[i1 - i0], m_worker, m_blocks)``: the events not applied
    are those after the last request's visibility time, for the caller to pass again.
    """
    n_workers = rank_off.shape[0] - 1
    n_ev = ev_t.shape[0]
    counts = np.zeros(i1 - i0, dtype=np.int64)
    cap = 1024
    m_w = np.empty(cap, dtype=np.int64)
    m_b = np.empty(cap, dtype=np.int64)
    nm = 0
    e = 0
    for i in range(i0, i1):
        t = req_t[i]
        while e < n_ev and ev_t[e] + lag <= t:
            r = ev_rank[e]
            k = ev_kind[e]
            if k == EV_CLEARED:
                held[:, r] = 0
            else:
                b = ev_block[e]
                if b >= 0:
                    if k == EV_STORED:
                        bit = ev_tier[e] if ev_tier[e] != 0 else 1
                        held[b, r] |= bit
                    else:
                        if ev_tier[e] == 0:
                            held[b, r] = 0
                        else:
                            held[b, r] &= ~np.uint8(ev_tier[e])
            e += 1
        lo = h_off[i]
        n = h_off[i + 1] - lo
        for w in range(n_workers):
            best = 0
            for r in range(rank_off[w], rank_off[w + 1]):
                d = 0
                while d < n and held[h_ids[lo + d], r] != 0:
                    d += 1
                if d > best:
                    best = d
            if best > 0:
                if nm == cap:
                    cap *= 2
                    m_w2 = np.empty(cap, dtype=np.int64)
                    m_b2 = np.empty(cap, dtype=np.int64)
                    m_w2[:nm] = m_w[:nm]
                    m_b2[:nm] = m_b[:nm]
                    m_w = m_w2
                    m_b = m_b2
                m_w[nm] = w
                m_b[nm] = best
                nm += 1
                counts[i - i0] += 1
    return e, counts, m_w[:nm].copy(), m_b[:nm].copy()


class IndexSweep:
    """The indexer's state across chunks of events: feed time-ordered events and the
    requests they can now answer, collect the CSR matches of every request in order."""

    def __init__(self, n_ranks: int, n_blocks: int, rank_off, req_t, h_off, h_ids, lag_ns: int):
        self.held = np.zeros((max(n_blocks, 1), n_ranks), dtype=np.uint8)
        self.rank_off = np.asarray(rank_off, dtype=np.int64)
        self.req_t, self.h_off, self.h_ids, self.lag = req_t, h_off, h_ids, int(lag_ns)
        self.next_req = 0
        self.counts: list[np.ndarray] = []
        self.m_w: list[np.ndarray] = []
        self.m_b: list[np.ndarray] = []

    def run(self, ev: tuple, upto: int) -> int:
        """Answer requests up to (not including) ``upto`` with events ``ev`` (five arrays:
        t, rank, kind, tier, block); returns how many events were applied."""
        e, c, w, b = matches_from_events_nb(self.held, *ev, self.req_t, self.h_off, self.h_ids, self.next_req,
                                            upto, self.rank_off, self.lag)
        self.next_req = upto
        self.counts.append(c)
        self.m_w.append(w)
        self.m_b.append(b)
        return int(e)

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = np.concatenate(self.counts) if self.counts else np.zeros(0, np.int64)
        off = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])

        def cat(xs):
            return np.concatenate(xs) if xs else np.zeros(0, np.int64)

        return off, cat(self.m_w), cat(self.m_b)


def matches_from_events(ev_t, ev_rank, ev_kind, ev_tier, ev_block, req_t, h_off, h_ids, rank_off, n_blocks,
                        lag_ns):
    """Every request's matches from one time-ordered event stream (one chunk)."""
    sweep = IndexSweep(int(rank_off[-1]), n_blocks, rank_off, req_t, h_off, h_ids, lag_ns)
    sweep.run((ev_t, ev_rank, ev_kind, ev_tier, ev_block), len(req_t))
    return sweep.result()


def placement_matches(req_t: np.ndarray, done_t: np.ndarray, h_off: np.ndarray, h_ids: np.ndarray,
                      worker: np.ndarray, cap_blocks: np.ndarray):
    """The placement model: worker ``w`` holds the blocks of the requests it served,
    from each one's completion (``done_t``) on, least recently used first out
    beyond ``cap_blocks[w]`` blocks; a served request touches its blocks again.
    ``worker`` is -1 where unknown (that request stores nothing).  Requests are
    in time order; ``h_ids`` dense or raw ids (any hashable int).  Returns CSR matches
    in worker order, like :func:`matches_from_events_nb`."""
    n_w = cap_blocks.shape[0]
    lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_w)]
    order = np.argsort(done_t, kind="stable")
    j = 0
    m_off = [0]
    m_w: list[int] = []
    m_b: list[int] = []
    for i in range(len(req_t)):
        t = req_t[i]
        while j < len(order) and done_t[order[j]] <= t:
            k = order[j]
            j += 1
            w = worker[k]
            if w < 0:
                continue
            cache = lru[w]
            for b in h_ids[h_off[k]:h_off[k + 1]].tolist():
                cache[b] = None
                cache.move_to_end(b)
            while len(cache) > cap_blocks[w]:
                cache.popitem(last=False)
        blocks = h_ids[h_off[i]:h_off[i + 1]].tolist()
        for w in range(n_w):
            cache = lru[w]
            d = 0
            for b in blocks:
                if b not in cache:
                    break
                d += 1
            if d:
                m_w.append(w)
                m_b.append(d)
        m_off.append(len(m_w))
    return (np.array(m_off, dtype=np.int64), np.array(m_w, dtype=np.int64), np.array(m_b, dtype=np.int64))
