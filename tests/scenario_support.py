"""Parse the router's unit-test scenarios (tests/fixtures/scenarios.json) into
plain objects that drive the reference (and, for teammates, the kernels).

The fixture is ``../shared/spec/scenarios.json`` (schema: ROUTER_SEMANTICS.md
section 7) with every original key kept, plus:

* ``runs``: the structured form of each expectation (much of it transcribed
  from the free-text ``expected.other``), one dict per check, keyed by
  ``kind`` (see ``tests/test_reference_scenarios.py`` for the meaning of each);
* textual match lists (``"w00..w63 with blocks = index+1"``) expanded into
  entries (the original text is kept as ``original_matches_text``);
* p2-01's fleet loads materialised from its description.

Parsed form (:class:`ParsedScenario`): workers are their names (strings);
"worker id ascending" is string order of the names, "fleet order" is the
listed order.  Per-worker loads are the JSON dicts unchanged (``None`` = no
fresh sample).  The config is a ``RouterConfig``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from dataclasses import fields as dc_fields
from pathlib import Path

from replay import reference as ref
from replay.config import RouterConfig

FIXTURE = Path(__file__).parent / "fixtures" / "scenarios.json"

_KNOBS = {f.name for f in dc_fields(RouterConfig)}


@dataclass
class ParsedScenario:
    id: str
    category: str
    unit: str
    config_defaults: str
    config: RouterConfig                 # config_defaults applied (see config_of)
    policy_kind: str | None           # "cache_aware" / "power_of_two" / None
    workers: list                        # every listed worker name, listed order
    fleet: list                          # names with in_fleet true, listed order
    loads: dict                          # name -> load dict (section 7 schema) or None
    inflight: dict                       # name -> router_inflight
    input_tokens: int | None          # L
    signal: ref.PrefixSignal | None   # matches as (address name, blocks)
    candidates: list                     # [ref.Candidate], seed order
    proposal: ref.Proposal | None
    range: ref.PrefillRange | None
    expected: dict
    runs: list                           # structured checks (dicts)
    raw: dict = field(repr=False)


def config_of(raw_config: dict, defaults: str) -> RouterConfig:
    """``proposal_default`` -> RouterConfig.proposal_default(**overrides);
    ``affinity_default`` (and ``n/a``) -> RouterConfig(**overrides).

    Only RouterConfig knobs are applied; ``policy_kind`` and non-integer
    placeholders (p2-01's list of k values, which lives in its runs) are not.
    """
    overrides = {}
    for k, v in (raw_config or {}).items():
        if k not in _KNOBS or isinstance(v, str):
            continue
        overrides[k] = v
    if defaults == "proposal_default":
        return RouterConfig.proposal_default(**overrides)
    return RouterConfig(**overrides)


def signal_of(raw_signal: dict | None) -> ref.PrefixSignal | None:
    if raw_signal is None:
        return None
    matches = [(m["address"], int(m["blocks"])) for m in raw_signal.get("matches") or []]
    return ref.PrefixSignal(
        query_blocks=int(raw_signal["query_blocks"]),
        matches=matches,
        best_prefix_blocks=raw_signal.get("best_prefix_blocks"),
        outcome=raw_signal.get("outcome"),
    )


def parse_scenario(raw: dict) -> ParsedScenario:
    cfg_raw = raw.get("config") or {}
    fleet_raw = raw.get("fleet") or []
    req = raw.get("request") or {}
    cands = [
        ref.Candidate(
            worker=c["worker"],
            matched_tokens=int(c["matched_prefix_tokens"]),
            uncached_tokens=int(c["uncached_tokens"]),
            matched_blocks=int(c["matched_prefix_blocks"]),
            max_pending_prefill_tokens=c.get("max_pending_prefill_tokens"),
        )
        for c in raw.get("candidates") or []
    ]
    prop = raw.get("proposal")
    rng = raw.get("range")
    return ParsedScenario(
        id=raw["id"],
        category=raw["category"],
        unit=raw["unit"],
        config_defaults=raw["config_defaults"],
        config=config_of(cfg_raw, raw["config_defaults"]),
        policy_kind=cfg_raw.get("policy_kind"),
        workers=[w["worker"] for w in fleet_raw],
        fleet=[w["worker"] for w in fleet_raw if w.get("in_fleet", True)],
        loads={w["worker"]: w.get("load") for w in fleet_raw},
        inflight={w["worker"]: int(w.get("router_inflight") or 0) for w in fleet_raw},
        input_tokens=req.get("input_tokens"),
        signal=signal_of(req.get("prefix_signal")),
        candidates=cands,
        proposal=None if prop is None else ref.Proposal(
            primary=prop["primary"], backup=prop.get("backup"), eligible=prop.get("eligible")
        ),
        range=None if rng is None else ref.PrefillRange(
            id=rng["id"], workers=list(rng["workers"]),
            max_pending_prefill_tokens=rng.get("max_pending_prefill_tokens"),
        ),
        expected=raw["expected"],
        runs=list(raw.get("runs") or []),
        raw=raw,
    )


def load_raw() -> list:
    with open(FIXTURE) as fh:
        return json.load(fh)


def load_scenarios() -> list:
    return [parse_scenario(r) for r in load_raw()]


# --- building reference objects from the parsed form -------------------------


def native_of(load: dict | None) -> ref.NativeLoad | None:
    """A section 7 load dict -> the native aggregate (None unless fresh and native)."""
    if load is None or not load.get("fresh", True) or not load.get("native", False):
        return None
    return ref.NativeLoad(
        running=load["running"],
        waiting=load["waiting"],
        waiting_uncached=load["waiting_uncached"],
        used_tokens=load["used_tokens"],
        total_tokens=load["total_tokens"],
        max_total_tokens=load["max_total_tokens"],
        max_running_requests=load["max_running_requests"],
        prefill_throughput_tokens_per_s=None,
        estimated_prefill_queue_ms=load.get("estimated_prefill_queue_ms"),
    )


def basic_of(load: dict | None) -> ref.BasicLoad | None:
    """Fixture convention (section 7): the basic sample is derived from the
    native one (``num_tokens = used``)."""
    if load is None or not load.get("fresh", True) or not load.get("basic", True):
        return None
    return ref.BasicLoad(
        running=load["running"],
        waiting=load["waiting"],
        num_tokens=load["used_tokens"],
        max_total_num_tokens=load["max_total_tokens"],
        captured_at=0,
    )


def snapshot_of(sc: ParsedScenario, load_overrides: dict | None = None) -> ref.Snapshot:
    """The scenario's load table as a snapshot (every listed worker, in or out of the fleet)."""
    loads = dict(sc.loads)
    loads.update(load_overrides or {})
    snap = ref.Snapshot(inflight=dict(sc.inflight))
    for name, load in loads.items():
        b = basic_of(load)
        if b is not None:
            snap.basic[name] = b
        n = native_of(load)
        if n is not None:
            snap.native[name] = n
    return snap


def rank_sample_of(s: dict) -> ref.RankSample:
    """A ``load_snapshot`` run's sample dict -> RankSample."""
    t = s.get("native")
    return ref.RankSample(
        running=s["running"],
        waiting=s["waiting"],
        num_tokens=s["num_tokens"],
        max_total_num_tokens=s["max_total_num_tokens"],
        native=None if t is None else ref.NativeTail(**t),
    )
