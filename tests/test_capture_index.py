"""The numba index sweep against a from-scratch plain-Python replay, on random event streams."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.capture.index import (
    EV_CLEARED,
    EV_REMOVED,
    EV_STORED,
    IndexSweep,
    matches_from_events,
    placement_matches,
)

TIERS = [0, 1, 2, 4, 8]


@st.composite
def streams(draw):
    dps = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    n_blocks = draw(st.integers(1, 8))
    n_ev = draw(st.integers(0, 40))
    ranks = sum(dps)
    ev = []
    for _ in range(n_ev):
        ev.append((draw(st.integers(0, 50)), draw(st.integers(0, ranks - 1)),
                   draw(st.sampled_from([EV_STORED, EV_STORED, EV_REMOVED, EV_CLEARED])),
                   draw(st.sampled_from(TIERS)), draw(st.integers(-1, n_blocks - 1))))
    ev.sort(key=lambda e: e[0])
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        blocks = draw(st.lists(st.integers(0, n_blocks - 1), max_size=5))
        reqs.append((draw(st.integers(0, 60)), blocks))
    reqs.sort(key=lambda r: r[0])
    lag = draw(st.integers(0, 5))
    return dps, n_blocks, ev, reqs, lag


def slow(dps, ev, reqs, lag):
    rank_worker = [w for w, d in enumerate(dps) for _ in range(d)]
    out = []
    for t, blocks in reqs:
        held = [dict() for _ in rank_worker]          # block -> set of tiers
        for te, r, k, tier, b in ev:
            if te + lag > t:
                break
            if k == EV_CLEARED:
                held[r].clear()
            elif b < 0:
                continue
            elif k == EV_STORED:
                held[r].setdefault(b, set()).add(tier or 1)
            elif tier == 0:
                held[r].pop(b, None)
            elif b in held[r]:
                held[r][b].discard(tier)
                if not held[r][b]:
                    del held[r][b]
        ans = []
        for w in range(len(dps)):
            best = 0
            for r, rw in enumerate(rank_worker):
                if rw != w:
                    continue
                d = 0
                while d < len(blocks) and blocks[d] in held[r]:
                    d += 1
                best = max(best, d)
            if best:
                ans.append((w, best))
        out.append(ans)
    return out


@settings(max_examples=150, deadline=None)
@given(streams())
def test_kernel_equals_plain_replay(case):
    dps, n_blocks, ev, reqs, lag = case
    a = lambda i: np.array([e[i] for e in ev], dtype=np.int64)
    rank_off = np.concatenate([[0], np.cumsum(dps)]).astype(np.int64)
    h_off = np.concatenate([[0], np.cumsum([len(b) for _, b in reqs])]).astype(np.int64)
    h_ids = np.array([x for _, b in reqs for x in b], dtype=np.int64)
    req_t = np.array([t for t, _ in reqs], dtype=np.int64)
    m_off, m_w, m_b = matches_from_events(a(0), a(1), a(2), a(3), a(4), req_t, h_off, h_ids, rank_off, n_blocks, lag)
    got = [list(zip(m_w[m_off[i]:m_off[i + 1]].tolist(), m_b[m_off[i]:m_off[i + 1]].tolist()))
           for i in range(len(reqs))]
    truth = slow(dps, ev, reqs, lag)
    assert got == truth
    # in chunks, as import feeds it file by file: events cut at random horizons, requests
    # answered once every event they can see has arrived, leftovers passed again
    cuts = sorted({e[0] for e in ev[::3]}) + [10**9]
    sweep = IndexSweep(int(rank_off[-1]), n_blocks, rank_off, req_t, h_off, h_ids, lag)
    buf = np.zeros((5, 0), dtype=np.int64)
    k = 0
    for horizon in cuts:
        while k < len(ev) and ev[k][0] < horizon:
            buf = np.concatenate([buf, np.array(ev[k], dtype=np.int64).reshape(5, 1)], axis=1)
            k += 1
        upto = int(np.searchsorted(req_t - lag, horizon, "left"))
        used = sweep.run(tuple(np.ascontiguousarray(x) for x in buf), upto)
        buf = buf[:, used:]
    m_off, m_w, m_b = sweep.result()
    got = [list(zip(m_w[m_off[i]:m_off[i + 1]].tolist(), m_b[m_off[i]:m_off[i + 1]].tolist()))
           for i in range(len(reqs))]
    assert got == truth


def test_placement_model_lru():
    """Worker 0 holds 2 blocks: a third evicts the least recently used; a request never sees its own."""
    ts = np.array([0, 10, 20, 30, 40], dtype=np.int64)
    done = ts + 1
    blocks = [[1, 2], [3], [1], [1, 2], [3]]
    off = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
    ids = np.array([x for b in blocks for x in b], dtype=np.int64)
    worker = np.zeros(5, dtype=np.int64)
    m_off, m_w, m_b = placement_matches(ts, done, off, ids, worker, np.array([2]))
    got = [m_b[m_off[i]:m_off[i + 1]].tolist() for i in range(5)]
    # r0 stores 1,2; r1 stores 3 (evicts 1); r2 asks 1: gone, stores 1 (evicts 2); r3 asks 1,2: 1; r4 asks 3: gone
    assert got == [[], [], [], [1], []]
