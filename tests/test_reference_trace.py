"""End-to-end tests of reference.replay() on tiny Trace objects built in Python."""

from __future__ import annotations

import math

import numpy as np
import pytest

from replay import fields, labels
from replay import reference as ref
from replay.config import RouterConfig
from replay.trace import Trace

S = 1_000_000_000  # ns per second


def make_trace(workers, requests, loads, *, dp=None, roles=None, models=None, worker_model=None,
               has_table=False, req_index=None):
    """workers: sorted URLs.  requests: dicts {ts (s), L, q, best?, matches [(worker id|-1, blocks)], model?}.
    loads: dicts {ts (s), w, rank?, running, waiting, used?, max_total?, wu? (None = no native tail),
    total?, max_running?, ptok?, pbusy?, inflight?}."""
    n_w = len(workers)
    assert workers == sorted(workers)
    requests = sorted(requests, key=lambda r: r["ts"])
    loads = sorted(loads, key=lambda r: r["ts"])
    offsets = [0]
    m_w, m_b = [], []
    for r in requests:
        for w, b in r.get("matches", []):
            m_w.append(w)
            m_b.append(b)
        offsets.append(len(m_w))

    def col(key, default, dtype=np.int64, src=loads):
        return np.array([row.get(key, default) if row.get(key, default) is not None else default
                         for row in src], dtype=dtype)

    has_tail = np.array([r.get("wu") is not None for r in loads], dtype=bool)
    best = [r.get("best", max([b for _, b in r.get("matches", [])], default=0)) for r in requests]
    return Trace(
        path="<memory>",
        workers=list(workers),
        models=list(models or ["m"]),
        worker_model=np.array(worker_model or [0] * n_w, dtype=np.int32),
        worker_role=np.array(roles or [labels.ROLE_PLAIN] * n_w, dtype=np.int8),
        worker_dp_size=np.array(dp or [0] * n_w, dtype=np.int32),
        has_workers_table=has_table,
        request_id=np.arange(len(requests), dtype=np.int64),
        req_ts=np.array([int(r["ts"] * S) for r in requests], dtype=np.int64),
        req_model=np.array([r.get("model", 0) for r in requests], dtype=np.int32),
        req_input_tokens=np.array([r["L"] for r in requests], dtype=np.int64),
        req_query_blocks=np.array([r.get("q", 0) for r in requests], dtype=np.int64),
        req_best_prefix_blocks=np.array(best, dtype=np.int64),
        match_offsets=np.array(offsets, dtype=np.int64),
        match_worker=np.array(m_w, dtype=np.int32),
        match_blocks=np.array(m_b, dtype=np.int64),
        req_selected_worker=None,
        load_ts=np.array([int(r["ts"] * S) for r in loads], dtype=np.int64),
        load_worker=col("w", 0, np.int32),
        load_rank=col("rank", 0, np.int32),
        load_running=col("running", 0),
        load_waiting=col("waiting", 0),
        load_num_tokens=col("used", 0),
        load_max_total=col("max_total", 100_000),
        load_has_tail=has_tail,
        load_waiting_uncached=col("wu", 0),
        load_total_tokens=np.array([r.get("total", r.get("used", 0)) if r.get("wu") is not None else 0
                                    for r in loads], dtype=np.int64),
        load_max_running=np.array([r.get("max_running", 64) if r.get("wu") is not None else 0
                                   for r in loads], dtype=np.int64),
        load_prefill_tokens=col("ptok", 0),
        load_prefill_busy_us=col("pbusy", 0),
        load_router_inflight=col("inflight", -1),
        req_index=None if req_index is None else np.array(req_index, dtype=np.int64),
    )


def native(ts, w, waiting, *, rank=0, used=10, **kw):
    row = dict(ts=ts, w=w, rank=rank, running=1, waiting=waiting, wu=waiting, used=used)
    row.update(kw)
    return row


def test_output_contract_shapes_and_dtypes():
    tr = make_trace(["a", "b"], [dict(ts=10, L=100)], [native(9, 0, 0), native(9, 1, 0)])
    out = ref.replay(tr, [RouterConfig(), RouterConfig(worker_queue_limit=4)])
    assert set(out) == set(fields.FIELD_NAMES)
    for name, dtype, _null, _ in fields.DECISION_FIELDS:
        assert out[name].shape == (1, 2) and out[name].dtype == dtype, name
    # No prefix signal -> no cache rung; the k=2 pair over an equal fleet keeps
    # pool order -> worker 0, Primary, cache_miss, full L uncached.
    assert out["worker"].tolist() == [[0, 0]]
    assert out["reason"].tolist() == [[labels.PRIMARY] * 2]
    assert out["decision"].tolist() == [[labels.CACHE_MISS] * 2]
    assert out["policy_reason"].tolist() == [[labels.PR_NO_CACHE_CANDIDATE] * 2]
    assert out["uncached_tokens"].tolist() == [[100, 100]]
    assert out["pressure_source"].tolist() == [[-1, -1]]
    assert out["selected_waiting"].tolist() == [[0, 0]]


def _gate_trace(sample_age_s):
    # owner (id 0) holds 9 of 10 blocks but queues 9 deep; other (id 1) is idle.
    reqs = [dict(ts=100, L=10_000, q=10, matches=[(0, 9)])]
    loads = [native(100 - sample_age_s, 0, 9), native(100, 1, 0)]
    return make_trace(["a-owner", "b-other"], reqs, loads)


def test_stale_sample_makes_the_gate_fail_open():
    cfg = RouterConfig(worker_queue_limit=4)
    out = ref.replay(_gate_trace(6), [cfg])  # 6 s > 5 s: owner has no fresh sample
    assert out["worker"][0, 0] == 0
    assert out["reason"][0, 0] == labels.CACHE_CANDIDATE
    assert out["decision"][0, 0] == labels.CACHE_HIT
    assert out["gate_rejected"][0, 0] == 0
    assert out["selected_waiting"][0, 0] == -1            # absent, not zero
    assert out["selected_waiting_uncached"][0, 0] == -1
    assert math.isnan(out["selected_queue_ms"][0, 0])
    # Native coverage of the evaluated set is incomplete -> router_local.
    assert out["pressure_source"][0, 0] == labels.SRC_ROUTER_LOCAL
    assert (out["matched_blocks"][0, 0], out["selected_blocks"][0, 0]) == (9, 9)
    assert out["uncached_tokens"][0, 0] == 1_000


def test_sample_exactly_at_the_window_is_fresh_and_gates():
    cfg = RouterConfig(worker_queue_limit=4)
    out = ref.replay(_gate_trace(5), [cfg])  # 5 s: inclusive -> fresh, waiting 9 >= 4
    assert out["worker"][0, 0] == 1
    assert out["reason"][0, 0] == labels.PRIMARY
    assert out["decision"][0, 0] == labels.CACHE_WORKER_QUEUED
    assert out["gate_rejected"][0, 0] == 1
    assert out["best_rejected_blocks"][0, 0] == 9
    assert out["admission_evaluated"][0, 0] == 0
    assert not out["fleet_all_queued"][0, 0]
    assert out["selected_blocks"][0, 0] == 0 and out["matched_blocks"][0, 0] == 9
    assert out["uncached_tokens"][0, 0] == 10_000
    assert out["selected_waiting"][0, 0] == 0
    # The same trace without a limit keeps the owner.
    out = ref.replay(_gate_trace(5), [RouterConfig()])
    assert out["worker"][0, 0] == 0 and out["decision"][0, 0] == labels.CACHE_HIT


def test_a_missing_rank_omits_the_worker():
    # a (id 0) has dp_size 2 but only rank 0 publishes; b (id 1) has both ranks.
    reqs = [dict(ts=10, L=10_000, q=10, matches=[(0, 9), (1, 2)])]
    loads = [
        native(9, 0, 9, rank=0),
        native(9, 1, 1, rank=0), native(9, 1, 1, rank=1),
        native(9, 1, 100, rank=2),   # rank outside 0..dp-1: ignored
    ]
    tr = make_trace(["a", "b"], reqs, loads, dp=[2, 2], has_table=True)
    snap_cfg = RouterConfig(worker_queue_limit=4, cache_affinity_min_matched_tokens=0)
    out = ref.replay(tr, [snap_cfg])
    # a is omitted (not zero): the gate fails open for it and it keeps its prefix.
    assert out["worker"][0, 0] == 0
    assert out["gate_rejected"][0, 0] == 0
    assert out["selected_waiting"][0, 0] == -1
    # b is present with the sum over ranks 0 and 1 only (rank 2 ignored).
    low = RouterConfig(worker_queue_limit=4, cache_affinity_min_matched_tokens=0,
                       cache_switch_margin_tokens=100_000, pressure_guard=False)
    tr2 = make_trace(["a", "b"], [dict(ts=10, L=10_000, q=10, matches=[(1, 2)])], loads, dp=[2, 2],
                     has_table=True)
    out2 = ref.replay(tr2, [low])
    assert out2["worker"][0, 0] == 1
    assert out2["selected_waiting"][0, 0] == 2
    assert out2["selected_waiting_uncached"][0, 0] == 2


def test_observed_ranks_are_required_without_dp_size():
    # No dp_size: rank 1 seen once, now stale -> the worker is omitted entirely.
    reqs = [dict(ts=20, L=100)]
    loads = [native(10, 0, 0, rank=1), native(19, 0, 0, rank=0), native(19, 1, 7)]
    out = ref.replay(make_trace(["a", "b"], reqs, loads), [RouterConfig()])
    # Pair (a, b): a has no native -> in-flight compare only (tie) -> a primary.
    assert out["worker"][0, 0] == 0
    assert out["selected_waiting"][0, 0] == -1


def _saturated_trace():
    # Both owners queue at/over the limit 4; owner (id 0) deeper prefix, calm (id 1) shallower.
    reqs = [dict(ts=10, L=10_000, q=10, matches=[(0, 9), (1, 4)])]
    loads = [native(9, 0, 9), native(9, 1, 5)]
    return make_trace(["a-owner", "b-calm"], reqs, loads)


def test_floor_pins_while_no_floor_falls_back():
    no_floor = RouterConfig(worker_queue_limit=4)
    floor = RouterConfig(worker_queue_limit=4, saturation_queue_floor=2)
    out = ref.replay(_saturated_trace(), [no_floor, floor])
    # No floor: fleet all queued -> the gate is dropped -> the deepest owner wins.
    assert out["worker"][0, 0] == 0
    assert out["reason"][0, 0] == labels.CACHE_CANDIDATE
    assert out["decision"][0, 0] == labels.ALL_QUEUED
    assert out["fell_back"][0, 0] and out["fleet_all_queued"][0, 0]
    assert out["admission_evaluated"][0, 0] == 2 and out["gate_rejected"][0, 0] == 2
    assert out["policy_reason"][0, 0] == labels.PR_CACHE_CANDIDATE
    # Floor: the pin picks the least pressured rejected owner (5 < 9), ignoring uncached work.
    assert out["worker"][0, 1] == 1
    assert out["reason"][0, 1] == labels.SATURATION_PIN
    assert out["decision"][0, 1] == labels.ALL_QUEUED
    assert out["policy_reason"][0, 1] == labels.PR_SATURATION_PIN
    assert not out["fell_back"][0, 1] and out["fleet_all_queued"][0, 1]
    assert out["admission_evaluated"][0, 1] == 0
    assert out["pressure_source"][0, 1] == labels.SRC_ROUTER_LOCAL  # evaluated set is empty
    assert out["selected_blocks"][0, 1] == 4
    assert out["uncached_tokens"][0, 1] == 6_000


def test_floor_yields_to_a_worker_below_it():
    reqs = [dict(ts=10, L=10_000, q=10, matches=[(0, 9)])]
    loads = [native(9, 0, 9), native(9, 1, 1)]
    out = ref.replay(make_trace(["a-owner", "b-idle"], reqs, loads),
                     [RouterConfig(worker_queue_limit=4, saturation_queue_floor=2)])
    assert out["worker"][0, 0] == 1
    assert out["decision"][0, 0] == labels.CACHE_WORKER_QUEUED


def _idle_fleet(n_workers=6, n_requests=40):
    workers = [f"w{i}" for i in range(n_workers)]
    reqs = [dict(ts=10 + i * 0.001, L=100) for i in range(n_requests)]
    loads = [native(9, w, 0) for w in range(n_workers)]
    return make_trace(workers, reqs, loads)


def test_sampler_is_deterministic_and_independent_of_config_order():
    tr = _idle_fleet()
    c1 = RouterConfig(min_load_choices=2)
    c2 = RouterConfig(min_load_choices=3)
    c3 = RouterConfig(min_load_choices=2, worker_queue_limit=100)  # gate never bites
    fwd = ref.replay(tr, [c1, c2, c3], seed=11)
    rev = ref.replay(tr, [c3, c2, c1], seed=11)
    for name in fields.FIELD_NAMES:
        np.testing.assert_array_equal(fwd[name], rev[name][:, ::-1], err_msg=name)
    again = ref.replay(tr, [c1, c2, c3], seed=11)
    np.testing.assert_array_equal(fwd["worker"], again["worker"])
    # Common random numbers: c1 and c3 reach the same sampler call.
    np.testing.assert_array_equal(fwd["worker"][:, 0], fwd["worker"][:, 2])
    # Equal loads: the primary is the first drawn index of the partial Fisher-Yates.
    expect = [ref.draw(11, i, 0) % 6 for i in range(tr.n_requests)]
    assert fwd["worker"][:, 0].tolist() == expect
    assert len(set(expect)) > 1
    other_seed = ref.replay(tr, [c1], seed=12)
    assert other_seed["worker"][:, 0].tolist() != expect


def test_rng_request_index_follows_trace_req_index():
    tr = _idle_fleet(n_requests=3)
    tr.req_index = np.array([5, 9, 40], dtype=np.int64)
    out = ref.replay(tr, [RouterConfig()], seed=3)
    assert out["worker"][:, 0].tolist() == [ref.draw(3, i, 0) % 6 for i in (5, 9, 40)]


def test_mix64_reference_values():
    # splitmix64 finaliser of 0 (the first output of splitmix64 seeded with 0).
    assert ref.mix64(0) == 0xE220A8397B1DCDAF
    assert ref.draw(0, 0, 0) == ref.mix64(ref.mix64(ref.mix64(0)))


def test_throughput_and_queue_ms_from_previous_sample():
    reqs = [dict(ts=10, L=100)]
    loads = [
        native(8, 0, 3000, ptok=10_000, pbusy=2_000_000),
        native(9, 0, 4000, ptok=22_000, pbusy=4_000_000),
    ]
    out = ref.replay(make_trace(["a"], reqs, loads), [RouterConfig()])
    assert out["worker"][0, 0] == 0
    assert out["selected_queue_ms"][0, 0] == pytest.approx(4000 * 1000 / 6000)
    assert out["selected_waiting_uncached"][0, 0] == 4000


def test_router_inflight_breaks_ties_and_unknown_matches_are_skipped():
    # No native tail anywhere: pressure = router in-flight; a (id 0) has 3 in flight.
    reqs = [dict(ts=10, L=100)]
    loads = [dict(ts=9, w=0, running=0, waiting=0, inflight=3), dict(ts=9, w=1, running=0, waiting=0)]
    out = ref.replay(make_trace(["a", "b"], reqs, loads), [RouterConfig()])
    assert out["worker"][0, 0] == 1
    # An unknown address (-1) never becomes a candidate.
    reqs = [dict(ts=10, L=10_000, q=10, matches=[(-1, 10), (1, 9)])]
    out = ref.replay(make_trace(["a", "b"], reqs, loads), [RouterConfig()])
    assert out["worker"][0, 0] == 1 and out["reason"][0, 0] == labels.CACHE_CANDIDATE
    assert out["matched_blocks"][0, 0] == 10 and out["selected_blocks"][0, 0] == 9


def test_empty_fleet_fails_with_proposal_empty():
    # Worker 0 is a decode worker: the model's prefill fleet is empty.
    tr = make_trace(["d"], [dict(ts=10, L=100, q=4, matches=[(0, 4)])], [native(9, 0, 0)],
                    roles=[labels.ROLE_DECODE], has_table=True)
    out = ref.replay(tr, [RouterConfig()])
    assert out["worker"][0, 0] == -1
    assert out["failure"][0, 0] == labels.FAIL_PROPOSAL_EMPTY
    assert out["decision"][0, 0] == labels.NO_DECISION
    assert out["uncached_tokens"][0, 0] == -1
    # matched_blocks is a request property (kept on a failure); nothing was selected.
    assert out["matched_blocks"][0, 0] == 4
    assert out["selected_blocks"][0, 0] == 0
