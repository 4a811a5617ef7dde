"""The grid pass's running snapshot equals a full capture at every request.

``refresh_until_nb`` visits only the workers a sample touched, and
checks the others' age only when the oldest fresh sample it knows of can have
left the freshness window.  Held here, on random load streams with short
windows (workers age out and come back, ranks go missing, dp sizes differ):
after each request's advance, its snapshot and estimates are exactly those
``capture_all_nb`` computes from scratch, and those of ``refresh_nb`` (which
checks every worker each time).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.kernels.layout import LoadColumns
from replay.kernels.snapshot import (
    S_NCOLS,
    UNKNOWN_OLDEST,
    advance_dirty_nb,
    capture_all_nb,
    new_rank_table,
    refresh_nb,
    refresh_until_nb,
)

N_WORKERS = 5
N_RANKS = 2

sample = st.tuples(
    st.integers(0, 400),                  # time step since the previous sample (ns)
    st.integers(0, N_WORKERS - 1),        # worker
    st.integers(0, N_RANKS),              # rank (N_RANKS: outside a dp-2 worker's ranks)
    st.integers(0, 9),                    # waiting
    st.booleans(),                        # has the native tail
    st.integers(0, 50),                   # prefill token counter step
    st.integers(-1, 3),                   # router in-flight (-1: none)
)


def _loads(samples) -> LoadColumns:
    ts = np.cumsum([s[0] for s in samples]).astype(np.int64)
    n = len(samples)
    col = np.array
    return LoadColumns(
        ts=ts, worker=col([s[1] for s in samples], dtype=np.int64), rank=col([s[2] for s in samples], dtype=np.int64),
        running=col([s[3] % 4 for s in samples], dtype=np.int64), waiting=col([s[3] for s in samples], dtype=np.int64),
        num_tokens=col([100 * s[3] for s in samples], dtype=np.int64), max_total=np.full(n, 10_000, dtype=np.int64),
        has_tail=col([s[4] for s in samples], dtype=np.bool_),
        waiting_uncached=col([7 * s[3] for s in samples], dtype=np.int64),
        total_tokens=col([90 * s[3] for s in samples], dtype=np.int64), max_running=np.full(n, 16, dtype=np.int64),
        prefill_tokens=np.cumsum([s[5] for s in samples]).astype(np.int64),
        prefill_busy_us=np.cumsum([1 + s[5] // 3 for s in samples]).astype(np.int64),
        router_inflight=col([s[6] for s in samples], dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(samples=st.lists(sample, min_size=1, max_size=120),
       request_steps=st.lists(st.integers(0, 700), min_size=1, max_size=60),
       freshness=st.integers(0, 900),
       dp=st.lists(st.integers(0, N_RANKS), min_size=N_WORKERS, max_size=N_WORKERS))
def test_running_snapshot_is_a_full_capture(samples, request_steps, freshness, dp):
    loads = _loads(samples)
    dp_size = np.array(dp, dtype=np.int64)
    runs = {}
    for name in ("until", "every"):
        table, inflight = new_rank_table(N_WORKERS, N_RANKS + 1)   # a slot for every rank a sample names
        runs[name] = dict(table=table, inflight=inflight, ptr=0,
                          snap=np.zeros((N_WORKERS, S_NCOLS), dtype=np.int64), est=np.full(N_WORKERS, np.nan),
                          oldest=np.zeros(N_WORKERS, dtype=np.int64), dirty=np.ones(N_WORKERS, dtype=np.bool_))
    bound = UNKNOWN_OLDEST
    now = 0
    for step in request_steps:
        now += step
        for r in runs.values():
            r["ptr"] = advance_dirty_nb(r["ptr"], now, loads, dp_size, r["table"], r["inflight"], r["dirty"])
        u, e = runs["until"], runs["every"]
        bound = refresh_until_nb(u["table"], u["inflight"], dp_size, now, freshness, u["snap"], u["est"],
                                 u["oldest"], u["dirty"], bound)
        refresh_nb(e["table"], e["inflight"], dp_size, now, freshness, e["snap"], e["est"], e["oldest"], e["dirty"])
        full = np.zeros((N_WORKERS, S_NCOLS), dtype=np.int64)
        full_est = np.full(N_WORKERS, np.nan)
        capture_all_nb(u["table"], u["inflight"], dp_size, now, freshness, full, full_est)
        for r in (u, e):
            assert np.array_equal(r["snap"], full), (now, r["snap"], full)
            assert np.array_equal(r["est"], full_est, equal_nan=True)
