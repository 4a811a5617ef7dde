"""The reorg engine against upstream's own unit tests (../shared/spec/scenarios_reorg.json).

Every decision scenario runs twice:

* **unit level**, through the plain-Python reference (``reference.select_reorg``)
  on the scenario's snapshot, with its admission stub where it has one;
* **as a trace** (loads, in-flight counts and one request, the way
  ``tests/test_reference_trace.py`` builds traces), through the reference's
  ``replay()`` and the numba engine: the two must agree with the scenario and
  with each other.

What a trace cannot encode is listed in ``NOT_AS_TRACE`` with the reason, and
what the replay does not model at all in ``NOT_MODELLED``; the construction and
CLI scenarios are checked in ``tests/test_reorg_config.py`` and below.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scenario_support import basic_of, native_of
from test_reference_trace import make_trace

from replay import labels
from replay import reference as ref
from replay.config import RouterConfig
from replay.errors import ConfigError
from replay.sweep import engine

SPEC = Path(__file__).resolve().parents[1] / ".." / "shared" / "spec" / "scenarios_reorg.json"
RAW = {s["id"]: s for s in json.loads(SPEC.read_text())}

# construction, CLI and alternative-design scenarios: not routing decisions
NOT_DECISIONS = {"rg-ca-11", "rg-pn-07z", "rg-cli-01", "rg-cli-02", "rg-cli-03", "rg-cli-04"}
NOT_MODELLED = {
    # decode ordering: the replay decides prefill only (ROUTER_REORG.md decision 6)
    "rg-pn-04a": "decode stage", "rg-pn-04b": "decode stage", "rg-pn-04c": "decode stage",
    "rg-pn-04d": "decode stage",
}
NOT_AS_TRACE = {
    # a trace records the indexer's answer, not its errors (ROUTER_REORG.md section 7 item 3)
    "rg-ca-05a": "an unavailable indexer is not recorded in traces",
    "rg-ca-05b": "a rejected indexer query is not recorded in traces",
    # the stub rejects the fallback's winner, chosen by its lower in-flight count: as an
    # in-flight cap it would no longer be the winner
    "rg-ca-08c": "the admission stub cannot be a cap on in-flight without changing the pressure order",
}
DECISIONS = sorted(set(RAW) - NOT_DECISIONS - set(NOT_MODELLED))
SEEDS = range(400)
STAGE_ROLE = {"plain": labels.ROLE_PLAIN, "prefill": labels.ROLE_PREFILL}
OUTCOME_OF_REASON = {"cache_candidate": labels.REORG_CACHE_WIN, "saturation_pin": labels.REORG_SATURATION_PIN,
                     "no_cache_candidate": labels.REORG_MISS_FALLBACK, "power_of_n": labels.REORG_MISS_FALLBACK}
OUTCOME_OF_FAILURE = {"NoAdmissibleEngine": labels.REORG_NO_ADMISSIBLE,
                      "AdmissionRejected": labels.REORG_NO_ADMISSIBLE,
                      "InvalidSignal": labels.REORG_INDEXER_REJECTED}


def _config(raw: dict, ranking: str = "power-of-n") -> RouterConfig:
    knobs = {k: v for k, v in raw["config"].items() if k != "admission_stub"}
    if raw["config_defaults"] == "reorg_test_config":   # the tests' config() helper
        knobs = {"cache_affinity_min_matched_tokens": 1, "cache_switch_margin_tokens": 0, **knobs}
    return RouterConfig(chat_routing="reorg", variant_reorg_ranking=ranking, **knobs)


def _worker(address: str) -> str:
    return address[len("http://"):] if address.startswith("http://") else address


def _stages(raw: dict) -> list[str]:
    req = raw["request"]
    return [s for s in [req.get("stage", "plain"), *req.get("also_stages", [])] if s in STAGE_ROLE]


def _expected(raw: dict, ranking: str) -> tuple[set, int]:
    """(the workers the scenario allows, the outcome code); an empty set for a failure."""
    exp = raw["expected"]
    variant = exp.get("variant_03473357") if ranking == "power-of-n-fold" else None
    sel = variant if variant is not None else exp["selected"]
    if sel is None:
        return set(), OUTCOME_OF_FAILURE[exp["failure"]]
    allowed = set(sel["one_of"]) if isinstance(sel, dict) else {sel}
    return allowed, OUTCOME_OF_REASON[exp["reason"]]


def _rankings(raw: dict) -> list[str]:
    return ["power-of-n", "power-of-n-fold"] if raw["expected"].get("variant_03473357") else ["power-of-n"]


# ---------------------------------------------------------------------------------------
# unit level: the reference on the scenario's snapshot


def _unit_pick(raw: dict, cfg: RouterConfig, seed: int) -> ref.Selection:
    fleet = raw["fleet"]
    snap = ref.Snapshot(inflight={w["worker"]: int(w.get("router_inflight") or 0) for w in fleet})
    for w in fleet:
        b, n = basic_of(w["load"]), native_of(w["load"])
        if b is not None:
            snap.basic[w["worker"]] = b
        if n is not None:
            snap.native[w["worker"]] = n
    req = raw["request"]
    sig = req.get("prefix_signal")
    signal = None if sig is None else ref.PrefixSignal(
        query_blocks=sig["query_blocks"], best_prefix_blocks=sig["best_prefix_blocks"], outcome=sig["outcome"],
        matches=[(_worker(m["address"]), m["blocks"]) for m in sig["matches"]])
    group = sorted(w["worker"] for w in fleet if w["in_fleet"])
    stub = raw["config"].get("admission_stub")
    admits = None if stub is None else (lambda _s, w, _c: w not in stub["reject"])
    return ref.select_reorg(req["input_tokens"], signal, group, [True] * len(group), snap, cfg,
                            ref.DrawStream(seed, 0), indexer_rejected=req.get("prefix_error") == "rejected",
                            admits=admits)


@pytest.mark.parametrize("sid", DECISIONS)
def test_scenario_in_the_reference(sid):
    raw = RAW[sid]
    for ranking in _rankings(raw):
        allowed, outcome = _expected(raw, ranking)
        seen = set()
        for seed in SEEDS:
            sel = _unit_pick(raw, _config(raw, ranking), seed)
            assert sel.reorg_outcome == outcome, (sid, ranking, seed, sel)
            if allowed:
                assert sel.worker in allowed, (sid, ranking, seed, sel.worker)
                seen.add(sel.worker)
            else:
                assert sel.worker is None
        assert seen == allowed, (sid, ranking, "every allowed winner occurs over the seeds", seen)


# ---------------------------------------------------------------------------------------
# as a trace: the reference's replay() and the numba engine

S_NS = 1_000_000_000


def _trace(raw: dict, stage: str):
    """One request at t=2 s over the scenario's fleet; ``outside`` workers in another model.

    Loads at t=1 s (a stale one at -10 s); an estimate as two samples whose
    prefill counters give the rate ``1000 * waiting_uncached / ms`` tokens/s;
    an admission stub as the in-flight cap (the rejected engines' counts raised to it)."""
    fleet = sorted(raw["fleet"], key=lambda w: w["worker"])
    names = [w["worker"] for w in fleet]
    ids = {n: i for i, n in enumerate(names)}
    stub = raw["config"].get("admission_stub")
    inflight = {w["worker"]: int(w.get("router_inflight") or 0) for w in fleet}
    cap = None
    if stub is not None:
        cap = 1 + max((v for k, v in inflight.items() if k not in stub["reject"]), default=0)
        for k in stub["reject"]:
            inflight[k] = max(inflight[k], cap)
    loads = []
    for w in fleet:
        i, ld = ids[w["worker"]], w["load"]
        if ld is None:   # only the router's in-flight count, on a rank the dp_size ignores
            loads.append(dict(ts=1, w=i, rank=1, running=0, waiting=0, inflight=inflight[w["worker"]]))
            continue
        ts = 1 if ld.get("fresh", True) else -10
        row = dict(ts=ts, w=i, running=ld["running"], waiting=ld["waiting"], used=ld["used_tokens"],
                   max_total=ld["max_total_tokens"], inflight=inflight[w["worker"]])
        if ld.get("native", False):
            row.update(wu=ld["waiting_uncached"], total=ld["total_tokens"], max_running=ld["max_running_requests"])
            ms = ld.get("estimated_prefill_queue_ms")
            if ms is not None:
                rate = 1000.0 * ld["waiting_uncached"] / ms
                assert rate == int(rate)
                loads.append({**row, "ts": ts - 0.5, "ptok": 0, "pbusy": 0})
                row.update(ptok=int(rate), pbusy=1_000_000)
        loads.append(row)
    req = raw["request"]
    sig = req.get("prefix_signal")
    matches = [] if sig is None else [(ids.get(_worker(m["address"]), -1), m["blocks"]) for m in sig["matches"]]
    request = dict(ts=2, L=req["input_tokens"], q=0 if sig is None else sig["query_blocks"], matches=matches)
    if sig is not None:
        request["best"] = sig["best_prefix_blocks"]
    role = STAGE_ROLE[stage]
    trace = make_trace(names, [request], loads, dp=[1] * len(names), roles=[role] * len(names),
                       models=["m", "other"], worker_model=[0 if w["in_fleet"] else 1 for w in fleet],
                       has_table=True)
    return trace, names, cap


TRACE_SCENARIOS = [(sid, stage) for sid in DECISIONS if sid not in NOT_AS_TRACE for stage in _stages(RAW[sid])]


@pytest.mark.parametrize("sid,stage", TRACE_SCENARIOS)
def test_scenario_as_a_trace_in_both_engines(sid, stage):
    raw = RAW[sid]
    for ranking in _rankings(raw):
        trace, names, cap = _trace(raw, stage)
        cfg = RouterConfig(**{**_config(raw, ranking).as_dict(), "max_in_flight": cap})
        allowed, outcome = _expected(raw, ranking)
        seen = set()
        for seed in SEEDS[:120]:
            a = ref.replay(trace, [cfg], seed=seed)
            b = engine.decide_all(trace, [cfg], seed=seed)
            for name in a:
                assert np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f"), (sid, seed, name)
            assert int(a["reorg_outcome"][0, 0]) == outcome, (sid, stage, ranking, seed)
            w = int(a["worker"][0, 0])
            if allowed:
                assert names[w] in allowed, (sid, stage, ranking, seed, names[w])
                seen.add(names[w])
            else:
                assert w == -1
        if len(allowed) <= 2:   # a few seeds draw every winner of a small set
            assert seen == allowed, (sid, ranking, seen)


def test_encodable_and_not_encodable_scenarios_are_listed():
    """Which scenarios run where (the count the docs quote)."""
    as_trace = {sid for sid, _ in TRACE_SCENARIOS}
    assert len(DECISIONS) == 26 and len(as_trace) == 23
    assert sorted(set(RAW) - as_trace - NOT_DECISIONS) == sorted({*NOT_AS_TRACE, *NOT_MODELLED})


def test_a_wrong_expectation_fails():
    """The checks above can fail: the reorg's answer differs from legacy's on a scenario
    where the two engines disagree (a hard rejection is a 503, never a cold worker)."""
    raw = RAW["rg-ca-08a"]
    trace, names, cap = _trace(raw, "plain")
    reorg = RouterConfig(**{**_config(raw).as_dict(), "max_in_flight": cap})
    legacy = RouterConfig(cache_affinity_min_matched_tokens=1, cache_switch_margin_tokens=0, worker_queue_limit=4)
    out = ref.replay(trace, [reorg, legacy], seed=0)
    assert out["worker"][0, 0] == -1 and out["reorg_outcome"][0, 0] == labels.REORG_NO_ADMISSIBLE
    assert out["worker"][0, 1] >= 0 and out["reorg_outcome"][0, 1] == -1


def test_power_of_n_choices_zero_is_refused():
    case = RAW["rg-pn-07z"]["cases"][0]
    assert case["config"] == {"power_of_n_choices": 0} and not case["ok"]
    with pytest.raises(ConfigError, match="power-of-n-choices"):
        RouterConfig(chat_routing="reorg", power_of_n_choices=0).validate()
