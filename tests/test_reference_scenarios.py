"""The router's own unit tests (ROUTER_SEMANTICS.md section 7) against replay/reference.py.

Every scenario in tests/fixtures/scenarios.json is either run here (it has
structured ``runs``) or listed in ``EXCLUDED`` with a reason; a test checks
that nothing drops silently.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from scenario_support import load_raw, load_scenarios, rank_sample_of, snapshot_of

from replay import labels
from replay import reference as ref

SCENARIOS = load_scenarios()
BY_ID = {s.id: s for s in SCENARIOS}

# Scenarios whose unit a trace cannot reach.  One line each.
EXCLUDED = {
    "prs-04": "decode pressure (compare_decode_pressure): decode selection is out of scope (section 0 item 8)",
    "loc-05": "selected owner tier 'unknown' / block0 presence need the router's tree view (section 0 item 16)",
    "loc-06": "selected owner tiers need the router's tree view (section 0 item 16)",
    "sel-08": "session_aware policy reason strings: sessions are out of scope (section 0 item 8)",
    "sel-09": "session_aware policy reason strings: sessions are out of scope (section 0 item 8)",
    "cli-01": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
    "cli-02": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
    "cli-03": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
    "cli-04": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
    "cli-05": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
    "cli-06": "router CLI parsing (Cli::into_config): owned by the CLI/config module, not the decision logic",
}

RUN_IDS = [s.id for s in SCENARIOS if s.runs]

REASON_CODE = {name: i for i, name in enumerate(labels.REASONS)}
DECISION_CODE = {name: i for i, name in enumerate(labels.DECISIONS)}
POLICY_CODE = {name: i for i, name in enumerate(labels.POLICY_REASONS)}
FAILURE_CODE = {name: i for i, name in enumerate(labels.FAILURES)}
SOURCE_CODE = {name: i for i, name in enumerate(labels.PRESSURE_SOURCES)}


def test_every_scenario_is_run_or_excluded():
    ids = [r["id"] for r in load_raw()]
    assert len(ids) == len(set(ids)), "duplicate scenario ids"
    run, excluded = set(RUN_IDS), set(EXCLUDED)
    assert not (run & excluded), f"both run and excluded: {sorted(run & excluded)}"
    missing = set(ids) - run - excluded
    assert not missing, f"scenarios neither run nor excluded: {sorted(missing)}"
    assert excluded <= set(ids), f"excluded ids not in the fixture: {sorted(excluded - set(ids))}"
    assert len(run) == 63 and len(excluded) == 11


def test_fixture_keeps_the_spec_schema():
    required = {"id", "rust_test", "source", "category", "unit", "config", "config_defaults",
                "request", "fleet", "candidates", "proposal", "range", "cases", "expected"}
    for raw in load_raw():
        assert required <= set(raw), raw["id"]


# --- helpers -----------------------------------------------------------------


def _matches(expected, actual) -> bool:
    if isinstance(expected, dict) and "one_of" in expected:
        return actual in expected["one_of"]
    return expected == actual


def _reason_name(code):
    return None if code is None or code < 0 else labels.REASONS[code]


def _check_audit(expected_audit: dict, res: ref.CacheResolution):
    for key, want in expected_audit.items():
        got = getattr(res, key)
        if key == "prefill_pressure_source":
            got = labels.PRESSURE_SOURCES[got]
        assert got == want, f"audit {key}: got {got!r}, want {want!r}"


def _config(sc, run):
    cfg = sc.config
    if run.get("config_overrides"):
        cfg = dataclasses.replace(cfg, **run["config_overrides"])
    return cfg


# --- run kinds ---------------------------------------------------------------


def run_resolve_cache_candidates(sc, run):
    cfg = _config(sc, run)
    snap = snapshot_of(sc, run.get("load_overrides"))
    fleet = run["fleet"] if "fleet" in run else sc.fleet
    L = sc.input_tokens
    res = ref.resolve_cache_candidates(sc.candidates, L, snap, fleet, cfg)
    exp = run["expect"]
    d = res.decision
    assert (d.selected if d else None) == exp["selected"]
    assert (_reason_name(d.reason) if d else None) == exp["reason"]
    if "primary" in exp:
        assert d.primary == exp["primary"]
    if "backup" in exp:
        assert d.backup == exp["backup"]
    if "audit" in exp:
        _check_audit(exp["audit"], res)
    if "label" in exp:
        if d is not None:
            label = ref.cache_rung_decision_label(d.reason, res.queue_gate_fell_back)
        else:
            rejected, evaluated, all_q, _ = res.audit
            label = ref.cache_aware_fallback_decision(rejected, evaluated, all_q)
        assert labels.DECISIONS[label] == exp["label"]
    if "diverted_overlap_blocks" in exp:
        assert d is None and res.queue_gate_best_rejected_blocks == exp["diverted_overlap_blocks"]
    if "policy_reason" in exp:
        pr = ref.prefill_policy_reason(d.reason, ref.KIND_CACHE_AFFINITY)
        assert labels.POLICY_REASONS[pr] == exp["policy_reason"]


def _run_prefill(sc, run, strict: bool):
    cfg = _config(sc, run)
    snap = snapshot_of(sc, run.get("load_overrides"))
    outcomes = Counter()
    for rep in range(run.get("repetitions", 8)):
        rng = ref.DrawStream(1234, rep)
        if strict:
            d = ref.resolve_prefill_admitted(sc.range, sc.proposal, sc.input_tokens, snap, cfg.worker_queue_limit)
        else:
            d = ref.resolve_prefill(sc.range, sc.proposal, sc.input_tokens, snap, cfg.worker_queue_limit,
                                    cfg.min_load_choices, rng)
        exp = run["expect"]
        assert d is not None
        assert _matches(exp["selected"], d.selected), (d.selected, exp["selected"])
        assert _matches(exp["reason"], _reason_name(d.reason))
        outcomes[d.selected] += 1
    return outcomes


def run_resolve_prefill(sc, run):
    _run_prefill(sc, run, strict=False)


def run_resolve_prefill_admitted(sc, run):
    _run_prefill(sc, run, strict=True)


def run_compare_prefill_pressure(sc, run):
    snap = snapshot_of(sc)
    assert ref.compare_prefill_pressure(run["a"], run["b"], snap) == run["expect"]
    assert ref.compare_prefill_pressure(run["b"], run["a"], snap) == -run["expect"]


def run_candidate_loads(sc, run):
    loads = ref.CandidateLoads(snapshot_of(sc), run["set"])
    for w in run["present"]:
        assert loads.get(w) is not None
    for w in run["absent"]:
        assert loads.get(w) is None
    assert not loads.compare_engine
    for a, b, want in run["compare"]:
        assert loads.compare_prefill_pressure(a, b) == want
    assert labels.PRESSURE_SOURCES[loads.prefill_pressure_source()] == run["expect_source"]


def run_estimate_matched_prefix_tokens(sc, run):
    for L, q, m, want in run["cases"]:
        assert ref.estimate_matched_prefix_tokens(L, q, m) == want


def run_cap_matched_prefix_blocks(sc, run):
    for q, m, want in run["cases"]:
        assert ref.cap_matched_prefix_blocks(q, m) == want


def run_prepare_candidates(sc, run):
    cands = ref.prepare_candidates(sc.input_tokens, sc.signal, sc.fleet, snapshot_of(sc), _config(sc, run))
    exp = run["expect"]
    if exp.get("none"):
        assert cands is None
        return
    assert cands
    if "first" in exp:
        assert cands[0].worker == exp["first"]
    if "workers" in exp:
        assert [c.worker for c in cands] == exp["workers"]
    if "matched_tokens" in exp:
        assert [c.matched_tokens for c in cands] == exp["matched_tokens"]
    if "candidates" in exp:
        assert [[c.worker, c.matched_tokens, c.uncached_tokens] for c in cands] == exp["candidates"]
    for c in cands:
        assert c.range_id == "global" and c.max_pending_prefill_tokens is None


def run_select_prefill(sc, run):
    cfg = _config(sc, run)
    snap = snapshot_of(sc)
    signal = sc.signal
    if "request_overrides" in run and "prefix_signal" in run["request_overrides"]:
        assert run["request_overrides"]["prefix_signal"] is None
        signal = None
    exp = run["expect"]
    for rep in range(run.get("repetitions", 8)):
        sel = ref.select_prefill(sc.input_tokens, signal, sc.fleet, snap, cfg, ref.DrawStream(99, rep))
        if "selected" in exp:
            assert _matches(exp["selected"], sel.worker), (sel.worker, exp["selected"])
        if "reason" in exp:
            assert _matches(exp["reason"], _reason_name(sel.reason))
        if "failure" in exp:
            want = exp["failure"]
            assert sel.failure == (labels.NO_FAILURE if want is None else FAILURE_CODE[want])
        if "label" in exp:
            want = exp["label"]
            assert sel.decision == (labels.NO_DECISION if want is None else DECISION_CODE[want])
        if "policy_reason" in exp:
            assert labels.POLICY_REASONS[sel.policy_reason] == exp["policy_reason"]
        if "proposal_kind" in exp:
            assert sel.proposal_kind == exp["proposal_kind"]
        if "audit" in exp:
            assert sel.resolution is not None
            _check_audit(exp["audit"], sel.resolution)
        if "locality" in exp:
            triple = ref.locality_triple(signal, sel.worker)
            if exp["locality"] is None:
                assert triple is None
            else:
                assert list(triple) == exp["locality"][sel.worker]


def run_locality(sc, run):
    assert list(ref.locality_triple(sc.signal, run["selected"])) == run["expect"]


def run_propose(sc, run):
    snap = snapshot_of(sc)
    exp = run["expect"]
    seen = Counter()
    for rep in range(run.get("repetitions", 4)):
        p = ref.propose_k_with_snapshot(sc.fleet, snap, run["k"], run["limit"], ref.DrawStream(7, rep))
        s = ref.select_k_with_snapshot(sc.fleet, snap, run["k"], run["limit"], ref.DrawStream(7, rep))
        assert p is not None and p.primary == s, "propose and select agree on the sample minimum"
        assert p.kind == ref.KIND_POWER_OF_TWO
        if "has_backup" in exp:
            assert (p.backup is not None) == exp["has_backup"]
        if exp.get("distinct_backup"):
            assert p.backup != p.primary
        if "primary" in exp:
            assert p.primary == exp["primary"]
        if "backup" in exp:
            assert p.backup == exp["backup"]
        if "select" in exp:
            assert _matches(exp["select"], s)
        seen[s] += 1
    for w in exp.get("must_appear", []):
        assert seen[w] > 0, f"{w} never drawn in {sum(seen.values())} draws: {seen}"


def run_prefill_policy_reason(sc, run):
    for kind, reason, want in run["cases"]:
        assert labels.POLICY_REASONS[ref.prefill_policy_reason(REASON_CODE[reason], kind)] == want


def run_cache_aware_fallback_decision(sc, run):
    for rejected, evaluated, all_q, want in run["cases"]:
        assert labels.DECISIONS[ref.cache_aware_fallback_decision(rejected, evaluated, all_q)] == want


def run_load_snapshot(sc, run):
    ms = 1_000_000  # times in ns, like the replay
    table = ref.LoadTable(freshness=run["freshness_ms"] * ms)
    for w, ranks in (run.get("expected_ranks") or {}).items():
        table.expect(w, ranks)
    for s in run["samples"]:
        table.set(s["worker"], s["rank"], rank_sample_of(s), s["at_ms"] * ms)
    snap = table.capture(run["now_ms"] * ms)
    for w, exp in run["expect"].items():
        for part, getter in (("basic", snap.basic_of), ("native", snap.native_of)):
            if part not in exp:
                continue
            got = getter(w)
            if exp[part] is None:
                assert got is None, f"{part} of {w} should be absent"
                continue
            assert got is not None, f"{part} of {w} missing"
            for key, want in exp[part].items():
                if key == "captured_at_ms":
                    assert got.captured_at == want * ms
                elif isinstance(want, float):
                    assert getattr(got, key) == pytest.approx(want, rel=1e-12)
                else:
                    assert getattr(got, key) == want


RUNNERS = {name[4:]: fn for name, fn in globals().items() if name.startswith("run_")}


@pytest.mark.parametrize("scenario_id", RUN_IDS)
def test_scenario(scenario_id):
    sc = BY_ID[scenario_id]
    for run in sc.runs:
        RUNNERS[run["kind"]](sc, run)


def test_scenario_run_kinds_are_known():
    for sc in SCENARIOS:
        for run in sc.runs:
            assert run["kind"] in RUNNERS, (sc.id, run["kind"])


def test_eng06_spec_example_value():
    # Section 1.3: 12,000 tokens over 2,000,000 us -> 6,000 tok/s; 4,000 waiting -> 666.67 ms.
    sc = BY_ID["eng-06"]
    run = sc.runs[0]
    table = ref.LoadTable(freshness=5_000)
    for s in run["samples"]:
        table.set("w", 0, rank_sample_of(s), s["at_ms"])
    n = table.capture(1000).native_of("w")
    assert n.prefill_throughput_tokens_per_s == 6000.0
    assert round(n.estimated_prefill_queue_ms, 2) == 666.67
