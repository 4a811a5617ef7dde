"""Tie and boundary rules of the reference that the router scenarios do not pin down."""

from __future__ import annotations

from replay import labels
from replay import reference as ref
from replay.config import RouterConfig


def nat(waiting_uncached, *, waiting=None, running=0, total=0, max_total=10_000, max_running=64, ms=None):
    return ref.NativeLoad(
        running=running, waiting=waiting_uncached if waiting is None else waiting,
        waiting_uncached=waiting_uncached, used_tokens=total, total_tokens=total,
        max_total_tokens=max_total, max_running_requests=max_running, estimated_prefill_queue_ms=ms,
    )


def snap(natives: dict, inflight=None) -> ref.Snapshot:
    s = ref.Snapshot(inflight=dict(inflight or {}))
    for w, n in natives.items():
        s.native[w] = n
        s.basic[w] = ref.BasicLoad(n.running, n.waiting, n.used_tokens, n.max_total_tokens, 0)
    return s


def test_range_fallback_ties_keep_list_order_not_worker_id():
    s = snap({"p": nat(0, total=10_000), "z": nat(5), "a": nat(5)})
    rng_ = ref.PrefillRange("global", ["p", "z", "a"])
    d = ref.resolve_prefill_admitted(rng_, ref.Proposal("p"), 32, s, None)
    assert d.selected == "z" and d.reason == labels.RANGE_FALLBACK


def test_sampler_ties_keep_pool_order_and_runner_up():
    s = snap({"b": nat(3), "a": nat(3), "c": nat(3)})
    p = ref.propose_k_with_snapshot(["b", "a", "c"], s, 3, None, ref.DrawStream(0, 0))
    assert (p.primary, p.backup) == ("b", "a")


def test_sampler_partial_fisher_yates_draws():
    pool = [f"w{i}" for i in range(7)]
    rng = ref.DrawStream(5, 17)
    got = ref.sample_indices(7, 3, rng)
    idx = list(range(7))
    for i in range(3):
        j = i + ref.draw(5, 17, i) % (7 - i)
        idx[i], idx[j] = idx[j], idx[i]
    assert got == idx[:3] and rng.count == 3
    assert ref.sample_indices(7, 7, ref.DrawStream(5, 17)) == list(range(7))
    one = ref.DrawStream(5, 17)
    assert ref.sample_indices(7, 1, one) == [ref.draw(5, 17, 0) % 7] and one.count == 1
    assert len(pool) == 7


def test_seed_order_with_mixed_estimates_uses_the_tuple_for_the_whole_set():
    # 'a' has the lower ms but the higher waiting_uncached; 'c' has no estimate, so
    # the sort compares tuples everywhere (section 0 item 7): b (1) < a (5) < c (9).
    s = snap({"a": nat(5, ms=1.0), "b": nat(1, ms=50.0), "c": nat(9)})
    sig = ref.PrefixSignal(query_blocks=10, matches=[("a", 9), ("b", 9), ("c", 9)])
    cfg = RouterConfig(cache_affinity_min_matched_tokens=0)
    cands = ref.prepare_candidates(10_000, sig, ["a", "b", "c"], s, cfg)
    assert [c.worker for c in cands] == ["b", "a", "c"]
    # With estimates on every worker, ms decides: a (1.0) < b (50.0).
    s2 = snap({"a": nat(5, ms=1.0), "b": nat(1, ms=50.0), "c": nat(9, ms=99.0)})
    cands = ref.prepare_candidates(10_000, sig, ["a", "b", "c"], s2, cfg)
    assert [c.worker for c in cands] == ["a", "b", "c"]


def test_candidate_limit_and_gates():
    cfg = RouterConfig()
    assert ref.candidate_limit(3, cfg) == 3
    assert ref.candidate_limit(1000, cfg) == 32
    assert ref.candidate_limit(200, cfg) == 10
    assert ref.candidate_limit(100, RouterConfig(cache_candidate_min_workers=1, cache_candidate_ratio=0.0)) == 1
    ratio = RouterConfig(cache_affinity_min_matched_tokens=None, cache_affinity_min_match_ratio=0.5)
    assert ref.passes_cache_gate(50, 100, ratio) and not ref.passes_cache_gate(49, 100, ratio)
    assert not ref.passes_cache_gate(0, 0, ratio)
    assert ref.passes_cache_gate(1024, 2000, cfg) and not ref.passes_cache_gate(1023, 2000, cfg)


def test_duplicate_and_zero_block_entries():
    sig = ref.PrefixSignal(query_blocks=10, matches=[("a", 0), ("a", 2), ("a", 9), ("b", 5)])
    cfg = RouterConfig(cache_affinity_min_matched_tokens=3000)
    # a's first positive entry (2 blocks -> 2000 tokens) fails the gate and still
    # marks a as seen, so its 9-block entry is ignored.
    cands = ref.prepare_candidates(10_000, sig, ["a", "b"], ref.Snapshot(), cfg)
    assert [(c.worker, c.matched_tokens) for c in cands] == [("b", 5000)]
    # Locality / uncached use the first entry (0 blocks here).
    assert ref.locality_triple(sig, "a") == (10, 9, 0)
    assert ref.selected_uncached_tokens(10_000, sig, "a") == 10_000


def test_guard_uses_ms_when_configured_and_both_estimate():
    cfg = RouterConfig.proposal_default(cache_switch_margin_tokens=100, pressure_guard=True,
                                        pressure_abs_threshold_ms=10.0, pressure_rel_threshold=2.0,
                                        pressure_abs_threshold_tokens=0)
    cands = [ref.Candidate("hot", 90, 10, 9), ref.Candidate("cool", 80, 20, 8)]
    # hot: 30 ms vs cool 5 ms -> 25 > 10 and 30 > 10 -> materially more pressured.
    s = snap({"hot": nat(1, ms=30.0), "cool": nat(1000, ms=5.0)})
    res = ref.resolve_cache_candidates(cands, 100, s, ["hot", "cool"], cfg)
    assert res.decision.selected == "cool"
    assert (res.pressure_guard_compared_pairs, res.pressure_guard_overrides) == (1, 1)
    assert res.prefill_pressure_source == labels.SRC_ESTIMATED_MS
    # 12 ms vs 5 ms: 7 <= 10 -> not material; the cache gain keeps hot.
    s = snap({"hot": nat(1, ms=12.0), "cool": nat(1000, ms=5.0)})
    res = ref.resolve_cache_candidates(cands, 100, s, ["hot", "cool"], cfg)
    assert res.decision.selected == "hot" and res.pressure_guard_overrides == 0


def test_pending_budget_uses_uncached_work_and_kv_uses_full_input():
    c = ref.Candidate("w", 80, 20, 8, max_pending_prefill_tokens=25)
    assert ref.is_cache_candidate_admitted(c, 100, snap({"w": nat(5)}))
    assert not ref.is_cache_candidate_admitted(c, 100, snap({"w": nat(6)}))
    assert ref.has_kv_capacity(nat(0, total=900, max_total=1000), 100)
    assert not ref.has_kv_capacity(nat(0, total=901, max_total=1000), 100)
    assert not ref.has_kv_capacity(nat(0, running=64), 1)
    assert ref.is_prefill_admitted(ref.PrefillRange("g", ["w"], 30), "w", 25, snap({"w": nat(5)}))
    assert not ref.is_prefill_admitted(ref.PrefillRange("g", ["w"], 29), "w", 25, snap({"w": nat(5)}))


def test_load_table_native_condition_and_throughput_rules():
    t = ref.LoadTable(freshness=100)

    def tail(wu, tok, busy, mr=64):
        return ref.NativeTail(wu, 0, mr, tok, busy)

    t.set("w", 0, ref.RankSample(0, 0, 0, 1000, tail(10, 100, 1000)), 0)
    t.set("w", 0, ref.RankSample(0, 0, 0, 1000, tail(10, 100, 2000)), 1)   # no token progress
    assert t.capture(1).native_of("w").estimated_prefill_queue_ms is None
    t.set("w", 0, ref.RankSample(0, 0, 0, 1000, None), 2)                 # old publisher
    cap = t.capture(2)
    assert cap.native_of("w") is None and cap.basic_of("w") is not None
    t.set("w", 0, ref.RankSample(0, 0, 0, 1000, tail(10, 200, 3000)), 3)  # previous had no tail
    assert t.capture(3).native_of("w").prefill_throughput_tokens_per_s is None
    t.set("w", 0, ref.RankSample(0, 0, 0, 0, tail(10, 300, 4000)), 4)     # capacity unknown
    assert t.capture(4).native_of("w") is None
    t.set("w", 0, ref.RankSample(0, 0, 0, 1000, tail(10, 400, 5000, mr=0)), 5)
    assert t.capture(5).native_of("w") is None
    assert t.capture(105).basic_of("w") is not None and t.capture(106).basic_of("w") is None
