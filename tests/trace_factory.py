"""Small random traces built directly as ``Trace`` objects (no Parquet), for engine tests.

Value ranges are deliberately tiny so that ties, stale samples, missing and
extra ranks, absent native tails, zero capacities, unknown match addresses,
zero-block and duplicate match entries, decode peers and empty fleets all
occur often.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay.trace import Trace


@dataclass(frozen=True)
class Shape:
    n_requests: int = 120
    n_workers: int = 5
    n_ranks: int = 2
    n_loads: int = 400
    span_s: float = 20.0
    workers_table: bool = True
    dp_known: bool = True
    n_models: int = 1
    decode_share: float = 0.2
    tail_share: float = 0.8
    max_matches: int = 4
    queue_max: int = 6
    inflight: bool = True
    selected: bool = True


def random_trace(seed: int, shape: Shape | None = None) -> Trace:
    rng = np.random.default_rng(seed)
    s = shape if shape is not None else Shape()
    n_w = s.n_workers
    span = int(s.span_s * 1e9)
    workers = [f"http://w{i:02d}" for i in range(n_w)]
    n_req = s.n_requests
    req_ts = np.sort(rng.integers(0, span, n_req)).astype(np.int64)
    L = rng.integers(0, 4000, n_req).astype(np.int64)
    qb = np.where(rng.random(n_req) < 0.85, (L + 255) // 256, 0).astype(np.int64)
    offs = [0]
    mw: list[int] = []
    mb: list[int] = []
    for i in range(n_req):
        for _ in range(int(rng.integers(0, s.max_matches + 1))):
            mw.append(int(rng.integers(-1, n_w)) if n_w else -1)
            mb.append(int(rng.integers(0, qb[i] + 3)))
        offs.append(len(mw))
    best = np.array([max(mb[offs[i]:offs[i + 1]], default=0) for i in range(n_req)], dtype=np.int64)
    # occasionally a provider-reported best that disagrees with the entries
    odd = rng.random(n_req) < 0.1
    best[odd] = rng.integers(0, 40, int(odd.sum()))
    n_l = s.n_loads if n_w else 0
    lts = np.sort(rng.integers(-3 * 10**9, span, n_l)).astype(np.int64)
    # equal timestamps happen in real traces: round some of them
    lts = np.where(rng.random(n_l) < 0.2, (lts // 10**9) * 10**9, lts)
    lts = np.sort(lts)
    lw = rng.integers(0, max(n_w, 1), n_l).astype(np.int32)
    lr = rng.integers(0, s.n_ranks + 1, n_l).astype(np.int32)  # one rank past dp_size
    tail = rng.random(n_l) < s.tail_share

    def ri(a, b):
        return rng.integers(a, b, n_l).astype(np.int64)

    models = [f"m{i}" for i in range(s.n_models)]
    if s.workers_table:
        worker_model = rng.integers(0, s.n_models, n_w).astype(np.int32)
        worker_role = np.where(rng.random(n_w) < s.decode_share, 2,
                               rng.integers(0, 2, n_w)).astype(np.int8)
        dp = np.full(n_w, s.n_ranks if s.dp_known else 0, dtype=np.int32)
    else:
        worker_model = np.zeros(n_w, dtype=np.int32)
        worker_role = np.zeros(n_w, dtype=np.int8)
        dp = np.zeros(n_w, dtype=np.int32)
    sel = None
    if s.selected:
        sel = rng.integers(-1, max(n_w, 1), n_req).astype(np.int32) if n_w else np.full(n_req, -1, np.int32)
    return Trace(
        path=f"memory:{seed}", workers=workers, models=models, worker_model=worker_model,
        worker_role=worker_role, worker_dp_size=dp, has_workers_table=s.workers_table,
        request_id=np.arange(n_req, dtype=np.int64) * 7 + 3, req_ts=req_ts,
        req_model=rng.integers(0, s.n_models, n_req).astype(np.int32), req_input_tokens=L,
        req_query_blocks=qb, req_best_prefix_blocks=best,
        match_offsets=np.array(offs, dtype=np.int64), match_worker=np.array(mw, dtype=np.int32),
        match_blocks=np.array(mb, dtype=np.int64), req_selected_worker=sel,
        load_ts=lts, load_worker=lw, load_rank=lr, load_running=ri(0, 5),
        load_waiting=ri(0, s.queue_max + 1), load_num_tokens=ri(0, 3000),
        load_max_total=np.where(rng.random(n_l) < 0.95, 4000, 0).astype(np.int64),
        load_has_tail=tail, load_waiting_uncached=np.where(tail, ri(0, 3) * 1000, 0),
        load_total_tokens=np.where(tail, ri(0, 4000), 0),
        load_max_running=np.where(tail, ri(0, 6), 0),
        load_prefill_tokens=np.where(tail, np.cumsum(ri(0, 1000)), 0),
        load_prefill_busy_us=np.where(tail, np.cumsum(ri(0, 100_000)), 0),
        load_router_inflight=(np.where(rng.random(n_l) < 0.5, ri(0, 3), -1) if s.inflight
                              else np.full(n_l, -1, dtype=np.int64)),
    )


def shape_strategy(*, max_requests: int, max_workers: int, max_loads: int, spans: list[float],
                   max_matches: int, queue_max: list[int]):
    """A hypothesis strategy of :class:`Shape` (booleans and shares over their
    whole range; sizes bounded by the arguments)."""
    from hypothesis import strategies as st

    return st.builds(
        Shape,
        n_requests=st.integers(0, max_requests),
        n_workers=st.integers(0, max_workers),
        n_ranks=st.integers(1, 3),
        n_loads=st.integers(0, max_loads),
        span_s=st.sampled_from(spans),
        workers_table=st.booleans(),
        dp_known=st.booleans(),
        n_models=st.integers(1, 2),
        decode_share=st.sampled_from([0.0, 0.3]),
        tail_share=st.sampled_from([0.0, 0.7, 1.0]),
        max_matches=st.integers(0, max_matches),
        queue_max=st.sampled_from(queue_max),
        inflight=st.booleans(),
        selected=st.booleans(),
    )
