"""Adapters from the parsed router scenarios (tests/scenario_support.py) to the
numba kernel units of replay/kernels (decide.py, snapshot.py, one_pass.py).

The kernels see integer worker ids whose ascending order is the router's
"worker id ascending" order; scenario_support defines that order as string
order of the worker names, so a scenario's names map to ids by ``sorted``.
List orders (fleet order, legal order, candidate seed order) are passed as
explicit int64 arrays in the scenario's listed order.  None-valued knobs
become -1 (integers) or NaN (floats), as in replay/sweep/engine.py.

Nothing here decides anything: it only encodes scenario inputs into kernel
arrays and decodes kernel outputs back into names and label strings.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from scenario_support import ParsedScenario, basic_of, native_of

from replay import labels
from replay.config import RouterConfig
from replay.kernels import decide as kd
from replay.kernels.layout import KnobArrays, LoadColumns, knob_arrays
from replay.kernels.snapshot import (
    S_BASIC,
    S_INFLIGHT,
    S_MAXRUN,
    S_MAXTOT,
    S_NATIVE,
    S_NCOLS,
    S_RUNNING,
    S_TOTAL,
    S_WAITING,
    S_WU,
)

REASON_CODE = {name: i for i, name in enumerate(labels.REASONS)}
DECISION_CODE = {name: i for i, name in enumerate(labels.DECISIONS)}
FAILURE_CODE = {name: i for i, name in enumerate(labels.FAILURES)}

# CacheResolution field (section 3.9) -> (audit column, decoder)
AUDIT_COLUMN = {
    "admission_evaluated_candidates": (kd.A_EVALUATED, int),
    "admission_rejected_candidates": (kd.A_ADM_REJECTED, int),
    "queue_gate_rejected_candidates": (kd.A_GATE_REJECTED, int),
    "queue_gate_best_rejected_blocks": (kd.A_BEST_REJECTED, int),
    "queue_gate_fell_back": (kd.A_FELL_BACK, bool),
    "fleet_all_queued": (kd.A_ALL_QUEUED, bool),
    "pressure_guard_compared_pairs": (kd.A_COMPARED, int),
    "pressure_guard_overrides": (kd.A_OVERRIDES, int),
    "prefill_pressure_source": (kd.A_SOURCE, lambda c: labels.PRESSURE_SOURCES[c]),
}


class Unrepresentable(Exception):
    """A scenario input the kernels cannot be given (never produced from a trace)."""


# --- worker ids ---------------------------------------------------------------


@dataclass
class World:
    """Worker names <-> kernel ids (ids ascending = names in string order)."""

    names: list

    @classmethod
    def of(cls, names: Iterable) -> World:
        return cls(sorted({n for n in names if n is not None}))

    def __post_init__(self):
        self.id_of = {n: i for i, n in enumerate(self.names)}

    @property
    def n(self) -> int:
        return len(self.names)

    def id(self, name) -> int:
        """The id of a known worker; -1 for None / an unknown address."""
        return self.id_of.get(name, -1)

    def ids(self, names: Iterable) -> np.ndarray:
        return np.array([self.id(n) for n in names], dtype=np.int64)

    def name(self, wid: int):
        return None if wid < 0 else self.names[wid]


def scenario_world(sc: ParsedScenario, extra: Iterable = ()) -> World:
    """Every worker a scenario lists (fleet table, candidates, proposal, range)."""
    names = list(sc.workers) + [c.worker for c in sc.candidates] + list(extra)
    if sc.proposal is not None:
        names += [sc.proposal.primary, sc.proposal.backup] + list(sc.proposal.eligible or [])
    if sc.range is not None:
        names += list(sc.range.workers)
    return World.of(names)


# --- snapshot -------------------------------------------------------------------


def snapshot_arrays(sc: ParsedScenario, world: World, load_overrides: dict | None = None):
    """``(snap int64[n, S_NCOLS], est float64[n])`` from the scenario's load dicts.

    Reads a load dict exactly like scenario_support.basic_of / native_of:
    None or not fresh / not basic = no basic aggregate; the native aggregate
    needs the ``native`` flag; the native waiting count is the basic one.
    """
    loads = dict(sc.loads)
    loads.update(load_overrides or {})
    snap = np.zeros((world.n, S_NCOLS), dtype=np.int64)
    est = np.full(world.n, np.nan, dtype=np.float64)
    for name, count in sc.inflight.items():
        snap[world.id(name), S_INFLIGHT] = count
    for name, load in loads.items():
        w = world.id(name)
        b, nat = basic_of(load), native_of(load)
        if nat is not None and b is None:
            raise Unrepresentable(f"{name}: native aggregate without a basic one (capture never makes it)")
        if b is not None:
            snap[w, S_BASIC] = 1
            snap[w, S_WAITING] = b.waiting
        if nat is not None:
            if nat.waiting != b.waiting:
                raise Unrepresentable(f"{name}: native waiting differs from basic waiting")
            snap[w, S_NATIVE] = 1
            snap[w, S_RUNNING] = nat.running
            snap[w, S_WU] = nat.waiting_uncached
            snap[w, S_TOTAL] = nat.total_tokens
            snap[w, S_MAXTOT] = nat.max_total_tokens
            snap[w, S_MAXRUN] = nat.max_running_requests
            if nat.estimated_prefill_queue_ms is not None:
                est[w] = float(nat.estimated_prefill_queue_ms)
    return snap, est


# --- config knobs -----------------------------------------------------------------


def _i(v) -> int:
    return -1 if v is None else int(v)


@dataclass
class Knobs:
    limit: int
    floor: int
    k: int
    margin: int
    guard: bool
    abs_tokens: int
    abs_ms: float
    rel: float
    min_tokens: int
    min_ratio: float
    cmin: int
    cratio: float
    cmax: int
    arrays: KnobArrays | None = None  # the config as the engine encodes it (one config)

    @classmethod
    def of(cls, cfg: RouterConfig) -> Knobs:
        a = knob_arrays([cfg.as_dict()])
        return cls(
            limit=int(a.worker_queue_limit[0]), floor=int(a.saturation_queue_floor[0]),
            k=int(a.min_load_choices[0]), margin=int(a.cache_switch_margin_tokens[0]),
            guard=bool(a.pressure_guard[0]), abs_tokens=int(a.pressure_abs_threshold_tokens[0]),
            abs_ms=float(a.pressure_abs_threshold_ms[0]), rel=float(a.pressure_rel_threshold[0]),
            min_tokens=int(a.cache_affinity_min_matched_tokens[0]),
            min_ratio=float(a.cache_affinity_min_match_ratio[0]),
            cmin=int(a.cache_candidate_min_workers[0]), cratio=float(a.cache_candidate_ratio[0]),
            cmax=int(a.cache_candidate_max_workers[0]), arrays=a,
        )


# --- prefix signal ------------------------------------------------------------------


@dataclass
class SignalArrays:
    qb: int              # query blocks (0 = no signal)
    best: int            # best_prefix_blocks
    m_worker: np.ndarray  # int64, -1 = unknown address
    m_blocks: np.ndarray  # int64


def signal_arrays(signal, world: World) -> SignalArrays:
    """A PrefixSignal as the trace's columns.  A trace derives Matched from "has
    match entries" (reference.PrefixSignal.is_matched); an explicit outcome that
    contradicts that cannot come from a trace."""
    if signal is None:
        e = np.zeros(0, dtype=np.int64)
        return SignalArrays(0, 0, e, e.copy())
    if signal.outcome is not None and (signal.outcome == "Matched") != (len(signal.matches) > 0):
        raise Unrepresentable(f"outcome {signal.outcome!r} with {len(signal.matches)} match entries")
    return SignalArrays(
        qb=int(signal.query_blocks), best=int(signal.best),
        m_worker=world.ids(a for a, _ in signal.matches),
        m_blocks=np.array([b for _, b in signal.matches], dtype=np.int64),
    )


def fleet_arrays(fleet: list, world: World):
    """(fleet ids in listed order, in_fleet bool[n_workers])."""
    ids = world.ids(fleet)
    assert (ids >= 0).all()
    in_fleet = np.zeros(world.n, dtype=np.bool_)
    in_fleet[ids] = True
    return ids, in_fleet


# --- kernel calls ---------------------------------------------------------------------


def prepare(L: int, sig: SignalArrays, fleet_ids, in_fleet, snap, est, kn: Knobs) -> np.ndarray:
    """prepare_candidates_nb; returns the kept rows of the candidate table."""
    n_m = sig.m_worker.shape[0]
    cand = np.full((max(n_m, 1), kd.C_NCOLS), -7, dtype=np.int64)
    seen = np.zeros(max(snap.shape[0], 1), dtype=np.bool_)
    tmp = np.zeros(max(n_m, 1), dtype=np.int64)
    n = kd.prepare_candidates_nb(
        int(L), int(sig.qb), sig.m_worker, sig.m_blocks, in_fleet, int(fleet_ids.shape[0]), snap, est,
        kn.min_tokens, kn.min_ratio, kn.cmin, kn.cratio, kn.cmax, seen, cand, tmp)
    assert not seen.any(), "prepare_candidates_nb must leave `seen` all-False"
    return cand[:n].copy()


def candidate_table(cands, world: World) -> np.ndarray:
    """Scenario candidates (seed order) as candidate-table rows."""
    cand = np.zeros((max(len(cands), 1), kd.C_NCOLS), dtype=np.int64)
    for i, c in enumerate(cands):
        cand[i, kd.C_WORKER] = world.id(c.worker)
        cand[i, kd.C_H] = c.matched_tokens
        cand[i, kd.C_E] = c.uncached_tokens
        cand[i, kd.C_BLOCKS] = c.matched_blocks
        cand[i, kd.C_BUDGET] = _i(c.max_pending_prefill_tokens)
    return cand


def resolve_cache(cand, n: int, L: int, snap, est, fleet_ids, kn: Knobs):
    """resolve_cache_nb -> (selected id or -1, audit vector)."""
    audit = np.zeros(kd.A_NCOLS, dtype=np.int64)
    m = max(n, 1)
    ev, rj, adm, tmp = (np.zeros(m, dtype=np.int64) for _ in range(4))
    w = kd.resolve_cache_nb(cand, int(n), int(L), snap, est, fleet_ids, kn.limit, kn.floor, kn.margin,
                            kn.guard, kn.abs_tokens, kn.abs_ms, kn.rel, audit, ev, rj, adm, tmp, S_WAITING, False)
    assert w == audit[kd.A_SELECTED]
    return int(w), audit


def cache_rung_label(reason: int, fell_back: bool) -> int:
    """The label of a cache-rung decision, as select_prefill_nb assigns it."""
    return labels.ALL_QUEUED if reason == labels.SATURATION_PIN or fell_back else labels.CACHE_HIT


def sample_pair(snap, est, workers, k: int, limit: int, seed: int, req_index: int, draw: int = 0):
    """sample_pair_nb -> (best, runner, next_draw)."""
    m = max(snap.shape[0], workers.shape[0], 1)
    pool = np.zeros(m, dtype=np.int64)
    idx = np.zeros(m, dtype=np.int64)
    b, r, d = kd.sample_pair_nb(snap, est, workers, int(k), int(limit), S_WAITING, int(seed), int(req_index),
                                int(draw), pool, idx)
    return int(b), int(r), int(d)


def resolve_admitted(snap, est, primary: int, backup: int, legal, L: int, limit: int):
    """resolve_admitted_nb -> (worker, reason) or (-1, -1)."""
    pool = np.zeros(max(snap.shape[0], legal.shape[0], 1), dtype=np.int64)
    w, r = kd.resolve_admitted_nb(snap, est, int(primary), int(backup), legal, int(L), int(limit),
                                  S_WAITING, pool)
    return int(w), int(r)


def select_prefill(L: int, sig: SignalArrays, fleet_ids, in_fleet, snap, est, kn: Knobs,
                   seed: int, req_index: int):
    """select_prefill_nb -> (worker, reason, decision, failure, audit)."""
    n_m = sig.m_worker.shape[0]
    width = max(snap.shape[0], n_m, 1) + 1
    scratch = np.zeros((7, width), dtype=np.int64)
    cand = np.zeros((max(n_m, 1), kd.C_NCOLS), dtype=np.int64)
    seen = np.zeros(max(snap.shape[0], 1), dtype=np.bool_)
    audit = np.zeros(kd.A_NCOLS, dtype=np.int64)
    w, reason, decision, failure = kd.select_prefill_nb(
        int(L), int(sig.qb), sig.m_worker, sig.m_blocks, in_fleet, fleet_ids, snap, est,
        kn.arrays, 0, int(seed), int(req_index), audit, scratch, cand, seen)
    return int(w), int(reason), int(decision), int(failure), audit


def locality(L: int, sig: SignalArrays, w: int):
    """locality_nb -> (query, matched, selected, uncached)."""
    return tuple(int(x) for x in kd.locality_nb(int(L), int(sig.qb), int(sig.best), sig.m_worker,
                                                 sig.m_blocks, int(w)))


# --- load snapshot ------------------------------------------------------------------------

MS = 1_000_000  # scenario times are ms; the replay's are ns


def load_arrays(samples: list, world: World, now_ns: int):
    """A ``load_snapshot`` run's samples as the trace's load columns, sorted by time.

    The reference applies samples in listed order ("last set wins"); a trace
    applies them in time order and only those at or before the request.  The
    two agree when each (worker, rank) is listed in time order and no sample
    is after ``now``: anything else cannot come from a trace.
    """
    last: dict = {}
    for s in samples:
        key = (s["worker"], s["rank"])
        if s["at_ms"] < last.get(key, -math.inf):
            raise Unrepresentable(f"samples of {key} not listed in time order")
        last[key] = s["at_ms"]
        if s["at_ms"] * MS > now_ns:
            raise Unrepresentable("a sample after the capture time is invisible to a trace's request")
    order = sorted(range(len(samples)), key=lambda i: samples[i]["at_ms"])  # stable
    rows = [samples[i] for i in order]

    def col(fn, dtype=np.int64):
        return np.array([fn(s) for s in rows], dtype=dtype)


    def tail(s, k):
        return 0 if s.get("native") is None else s["native"][k]

    return LoadColumns(
        col(lambda s: s["at_ms"] * MS), col(lambda s: world.id(s["worker"])), col(lambda s: s["rank"]),
        col(lambda s: s["running"]), col(lambda s: s["waiting"]), col(lambda s: s["num_tokens"]),
        col(lambda s: s["max_total_num_tokens"]), col(lambda s: s.get("native") is not None, np.bool_),
        col(lambda s: tail(s, "waiting_uncached")), col(lambda s: tail(s, "total_tokens")),
        col(lambda s: tail(s, "max_running_requests")), col(lambda s: tail(s, "prefill_tokens")),
        col(lambda s: tail(s, "prefill_busy_us")),
        col(lambda s: -1),  # no router_inflight column
    )


def dp_sizes(expected_ranks: dict | None, world: World) -> np.ndarray:
    """Expected rank sets -> dp_size per worker (0 = "the ranks observed so far").

    The kernel knows expected ranks only as ``0..dp_size-1`` (section 0 item 2);
    any other expected set cannot come from a fleet table.
    """
    dp = np.zeros(max(world.n, 1), dtype=np.int64)
    for name, ranks in (expected_ranks or {}).items():
        rs = sorted(set(ranks))
        if rs != list(range(len(rs))):
            raise Unrepresentable(f"expected ranks {rs} of {name} are not 0..n-1")
        dp[world.id(name)] = len(rs)
    return dp
