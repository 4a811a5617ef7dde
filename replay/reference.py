"""Pure-Python reference (oracle) of the router's prefill decision logic.

This module is deliberately slow and literal.  It follows
``ROUTER_SEMANTICS.md`` (the spec) section by section; every function cites
the section it implements.  The numba kernels in ``replay/kernels`` are held
equal to it by the test suite, so nothing here uses numpy tricks: the logic
runs on plain Python objects (dataclasses, dicts, lists).

Workers are opaque, hashable, ordered keys: integer worker ids in
:func:`replay` (the trace encoding makes integer order == "worker id
ascending"), worker names (strings) in the scenario tests.  "Worker id
ascending" is always ``<`` on these keys; "fleet order" / "list order" is the
order of the list passed in.

Comparators return ``-1`` (Less), ``0`` (Equal) or ``1`` (Greater).

Modelling choices that the spec leaves open are marked ``# REPLAY CHOICE:``
and documented in ``docs/replay-model.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cmp_to_key

from replay import fields as _fields
from replay import labels
from replay.config import RouterConfig

Worker = Hashable

DEFAULT_FRESHNESS_NS = 5_000_000_000
GLOBAL_RANGE = "global"

# Proposal kinds (section 5.2 distinguishes them for the policy reason).
KIND_POWER_OF_TWO = "PowerOfTwo"
KIND_CACHE_AFFINITY = "CacheAffinity"


def _cmp(a, b) -> int:
    """Three-way comparison of two orderable values."""
    if a < b:
        return -1
    if a > b:
        return 1
    return 0


# =============================================================================
# Section 1: load snapshot model
# =============================================================================


@dataclass(frozen=True)
class NativeTail:
    """Section 1.1: the optional native tail of a LoadStat (all-or-nothing)."""

    waiting_uncached: int          # num_waiting_uncached_tokens
    total_tokens: int              # num_total_tokens
    max_running_requests: int
    prefill_tokens: int            # total_prefill_uncached_tokens (monotonic)
    prefill_busy_us: int           # total_prefill_busy_us (monotonic)


@dataclass(frozen=True)
class RankSample:
    """Section 1.1: one LoadStat of one ``(worker, dp_rank)`` publisher."""

    running: int
    waiting: int
    num_tokens: int                # used KV
    max_total_num_tokens: int      # 0 = capacity unknown
    native: NativeTail | None = None


@dataclass(frozen=True)
class BasicLoad:
    """Section 1.3: ``fresh_load_for_url`` (sums over the required ranks)."""

    running: int
    waiting: int
    num_tokens: int
    max_total_num_tokens: int
    captured_at: int               # oldest rank timestamp
    ranks: int = 1                 # required ranks summed (the per-worker floor-scaling variant)


@dataclass(frozen=True)
class NativeLoad:
    """Section 1.3: ``fresh_native_cache_load_for_url`` (sums over the required ranks)."""

    running: int
    waiting: int
    waiting_uncached: int
    used_tokens: int
    total_tokens: int
    max_total_tokens: int
    max_running_requests: int
    prefill_throughput_tokens_per_s: float | None = None
    estimated_prefill_queue_ms: float | None = None
    captured_at: int = 0


@dataclass
class Snapshot:
    """An immutable per-request load snapshot (section 1.3) plus the
    router-local in-flight counts (section 4.3 / section 0 item 3).

    ``basic`` / ``native`` hold only the workers whose aggregate is present;
    a missing key means "no fresh sample" (never zero).  ``inflight`` of a
    worker that is not listed reads 0.
    """

    basic: dict = field(default_factory=dict)
    native: dict = field(default_factory=dict)
    inflight: dict = field(default_factory=dict)
    version: int = 0

    def basic_of(self, w: Worker) -> BasicLoad | None:
        return self.basic.get(w)

    def native_of(self, w: Worker) -> NativeLoad | None:
        return self.native.get(w)

    def inflight_of(self, w: Worker) -> int:
        return self.inflight.get(w, 0)


@dataclass
class _RankEntry:
    """Section 1.2: per ``(worker, rank)``: latest sample, previous native tail, arrival time."""

    sample: RankSample
    prev_native: NativeTail | None
    at: int


def rank_prefill_rate(entry: _RankEntry) -> float | None:
    """Section 1.3 'Prefill throughput' of one rank, tokens/s, or None."""
    cur = entry.sample.native
    prev = entry.prev_native
    if cur is None or prev is None:
        return None
    d_tokens = cur.prefill_tokens - prev.prefill_tokens
    d_busy = cur.prefill_busy_us - prev.prefill_busy_us
    if d_tokens <= 0 or d_busy <= 0:
        return None
    rate = 1e6 * d_tokens / d_busy
    if not math.isfinite(rate) or rate <= 0.0:
        return None
    return rate


class LoadTable:
    """Section 1.2: ``EngineReportedLoadTable`` (per-rank table) with ``capture(now)`` (1.3).

    Times are integers in any unit, as long as ``freshness`` uses the same
    unit (the replay uses nanoseconds).
    """

    def __init__(self, freshness: int = DEFAULT_FRESHNESS_NS):
        self.freshness = freshness
        self.ranks: dict = {}       # worker -> {rank: _RankEntry}
        self.expected: dict = {}    # worker -> set of ranks
        self.version = 0

    def expect(self, worker: Worker, ranks: Iterable[int]) -> None:
        """Register advertised ranks (section 1.2 'expected set'); bumps the version."""
        s = self.expected.setdefault(worker, set())
        for r in ranks:
            if r not in s:
                s.add(r)
                self.version += 1

    def set(self, worker: Worker, rank: int, sample: RankSample, at: int) -> None:
        """Section 1.2: last value wins; keep the previous sample's native tail."""
        per = self.ranks.setdefault(worker, {})
        old = per.get(rank)
        # "the previous sample's native tail (whatever was stored before this set,
        # regardless of its age)".
        # REPLAY CHOICE: it is the tail of the *immediately* previous sample of
        # this rank, so a tail-less sample in between leaves no previous tail
        # (throughput None at the next sample); we do not skip back to an older one.
        prev_native = old.sample.native if old is not None else None
        per[rank] = _RankEntry(sample=sample, prev_native=prev_native, at=at)
        self.version += 1

    def forget_worker(self, worker: Worker) -> None:
        self.ranks.pop(worker, None)
        self.expected.pop(worker, None)
        self.version += 1

    def required_ranks(self, worker: Worker) -> list[int]:
        """Section 1.3: the expected ranks if any, else all observed ranks (ascending)."""
        exp = self.expected.get(worker)
        if exp:
            return sorted(exp)
        return sorted(self.ranks.get(worker, {}))

    def _fresh(self, entry: _RankEntry, now: int) -> bool:
        # Section 1.2: fresh iff now - at <= window (inclusive).
        return now - entry.at <= self.freshness

    def _fresh_entries(self, worker: Worker, now: int) -> list | None:
        """Every required rank's entry, in rank order, when all are observed and
        fresh (and there is at least one); else None."""
        per = self.ranks.get(worker, {})
        entries = []
        for r in self.required_ranks(worker):
            e = per.get(r)
            if e is None or not self._fresh(e, now):
                return None
            entries.append(e)
        return entries or None

    def fresh_load(self, worker: Worker, now: int) -> BasicLoad | None:
        """Section 1.3 basic aggregate: every required rank observed and fresh."""
        entries = self._fresh_entries(worker, now)
        if entries is None:
            return None
        return BasicLoad(
            running=sum(e.sample.running for e in entries),
            waiting=sum(e.sample.waiting for e in entries),
            num_tokens=sum(e.sample.num_tokens for e in entries),
            max_total_num_tokens=sum(e.sample.max_total_num_tokens for e in entries),
            captured_at=min(e.at for e in entries),
            ranks=len(entries),
        )

    def fresh_native_load(self, worker: Worker, now: int) -> NativeLoad | None:
        """Section 1.3 native aggregate (stricter than basic), with throughput and est ms."""
        entries = self._fresh_entries(worker, now)
        if entries is None:
            return None
        for e in entries:
            s = e.sample
            # Section 0 item 12: the native condition is checked per rank.
            if s.native is None or s.max_total_num_tokens == 0 or s.native.max_running_requests == 0:
                return None
        waiting_uncached = sum(e.sample.native.waiting_uncached for e in entries)
        # Throughput: Σ rate_r, None if any required rank lacks a valid rate.
        # REPLAY CHOICE: the float sum runs over ranks in ascending order, starting
        # from 0.0 (fixes the rounding the kernels must reproduce).
        throughput: float | None = 0.0
        for e in entries:
            rate = rank_prefill_rate(e)
            if rate is None:
                throughput = None
                break
            throughput += rate
        est_ms = None
        if throughput is not None:
            est_ms = 1000.0 * waiting_uncached / throughput
        return NativeLoad(
            running=sum(e.sample.running for e in entries),
            waiting=sum(e.sample.waiting for e in entries),
            waiting_uncached=waiting_uncached,
            used_tokens=sum(e.sample.num_tokens for e in entries),
            total_tokens=sum(e.sample.native.total_tokens for e in entries),
            max_total_tokens=sum(e.sample.max_total_num_tokens for e in entries),
            max_running_requests=sum(e.sample.native.max_running_requests for e in entries),
            prefill_throughput_tokens_per_s=throughput,
            estimated_prefill_queue_ms=est_ms,
            captured_at=min(e.at for e in entries),
        )

    def capture(self, now: int, inflight: dict | None = None) -> Snapshot:
        """Section 1.3 ``capture_snapshot(now)``: for each URL with an observed rank."""
        snap = Snapshot(inflight=dict(inflight or {}), version=self.version)
        for w, per in self.ranks.items():
            if not per:
                continue
            b = self.fresh_load(w, now)
            if b is None:
                continue
            snap.basic[w] = b
            n = self.fresh_native_load(w, now)
            if n is not None:
                snap.native[w] = n
        return snap


# =============================================================================
# Section 3.1 / 3.2: queue gate
# =============================================================================


@dataclass(frozen=True)
class PerRank:
    """A limit or floor under the ``--floor-scaling per-worker`` policy variant
    (docs/replay-model.md, "Policy variants"; not router behaviour): a per-rank
    value, each worker's bound being ``value x its dp_size`` (its required ranks)."""

    value: int


def threshold_for(bound, basic: BasicLoad) -> int:
    """The bound a worker's fresh waiting count is compared with: the router's
    fleet value, or a :class:`PerRank` value times the worker's own ranks."""
    return bound.value * basic.ranks if isinstance(bound, PerRank) else bound


def gate_bounds(cfg: RouterConfig) -> tuple:
    """(limit, floor) of a config as the gate and the pin compare them."""
    limit, floor = cfg.worker_queue_limit, cfg.saturation_queue_floor
    if cfg.variant_floor_scaling == "per-worker":
        return (None if limit is None else PerRank(limit)), (None if floor is None else PerRank(floor))
    return limit, floor


def queue_gate_admits(snapshot: Snapshot | None, worker: Worker, limit) -> bool:
    """Section 3.1: admit iff no limit, no fresh basic sample (fail-open), or waiting < limit."""
    if limit is None:
        return True
    basic = snapshot.basic_of(worker) if snapshot is not None else None
    if basic is None:
        return True
    return basic.waiting < threshold_for(limit, basic)


def fleet_is_all_queued(snapshot: Snapshot | None, fleet: Sequence[Worker], limit: int | None) -> bool:
    """Section 3.2."""
    return limit is not None and len(fleet) > 0 and all(
        not queue_gate_admits(snapshot, w, limit) for w in fleet
    )


def any_fresh_queue_below(snapshot: Snapshot | None, fleet: Sequence[Worker], floor: int) -> bool:
    """Section 3.6: some fleet worker with a fresh basic sample has waiting < floor."""
    if snapshot is None:
        return False
    for w in fleet:
        b = snapshot.basic_of(w)
        if b is not None and b.waiting < threshold_for(floor, b):
            return True
    return False


# =============================================================================
# Section 3.5: capacity admission
# =============================================================================


def has_kv_capacity(native: NativeLoad | None, tokens: int) -> bool:
    """Section 3.5: running + 1 <= max_running and total + tokens <= max_total."""
    if native is None:
        return True
    return (
        native.running + 1 <= native.max_running_requests
        and native.total_tokens + tokens <= native.max_total_tokens
    )


# =============================================================================
# Section 3.7: pressure comparison
# =============================================================================


def compare_prefill_load(a: NativeLoad, b: NativeLoad, use_ms: bool | None = None) -> int:
    """Section 3.7 ``compare_prefill_load``.

    ``use_ms=None`` is the pairwise rule as written (ms when both have one).
    ``use_ms=True/False`` forces the set-wide choice of section 0 item 7 (used
    only when sorting).
    """
    if use_ms is None:
        use_ms = a.estimated_prefill_queue_ms is not None and b.estimated_prefill_queue_ms is not None
    if use_ms:
        c = _cmp(a.estimated_prefill_queue_ms, b.estimated_prefill_queue_ms)
        if c != 0:
            return c
    return _cmp(
        (a.waiting_uncached, a.waiting, a.running),
        (b.waiting_uncached, b.waiting, b.running),
    )


def compare_prefill_pressure(a: Worker, b: Worker, snapshot: Snapshot | None) -> int:
    """Section 3.7 free function (the sampler's comparator): native for both ⇒
    ``compare_prefill_load`` then router in-flight; otherwise router in-flight only.
    No worker-id tie-break."""
    na = snapshot.native_of(a) if snapshot is not None else None
    nb = snapshot.native_of(b) if snapshot is not None else None
    la = snapshot.inflight_of(a) if snapshot is not None else 0
    lb = snapshot.inflight_of(b) if snapshot is not None else 0
    if na is not None and nb is not None:
        c = compare_prefill_load(na, nb)
        if c != 0:
            return c
    return _cmp(la, lb)


class CandidateLoads:
    """Section 3.7 ``CandidateLoads(snapshot, workers)`` (old name ``FreshLoadLookup``)."""

    def __init__(self, snapshot: Snapshot | None, workers: Iterable[Worker]):
        self.workers = list(workers)
        self.local_active: dict = {}
        self.native: dict = {}
        for w in self.workers:
            self.local_active[w] = snapshot.inflight_of(w) if snapshot is not None else 0
            n = snapshot.native_of(w) if snapshot is not None else None
            if n is not None:
                self.native[w] = n
        self.compare_engine = len(self.workers) > 0 and all(w in self.native for w in self.workers)
        # Section 0 item 7: the set-wide ms rule for sorts.
        self.all_have_ms = self.compare_engine and all(
            self.native[w].estimated_prefill_queue_ms is not None for w in self.workers
        )

    def get(self, w: Worker) -> NativeLoad | None:
        return self.native.get(w)

    def local(self, w: Worker) -> float:
        return self.local_active.get(w, math.inf)

    def comparable_get(self, w: Worker) -> NativeLoad | None:
        return self.native.get(w) if self.compare_engine else None

    def compare_prefill_pressure(self, a: Worker, b: Worker) -> int:
        """Pairwise rule as written (tournament, pin, range fallback)."""
        na, nb = self.comparable_get(a), self.comparable_get(b)
        if na is not None and nb is not None:
            c = compare_prefill_load(na, nb)
            if c != 0:
                return c
        return _cmp(self.local(a), self.local(b))

    def compare_prefill_pressure_total(self, a: Worker, b: Worker) -> int:
        """Section 0 item 7: the sort key (seed order): ms only when every worker
        of the set has one, else the tuple; then router-local."""
        na, nb = self.comparable_get(a), self.comparable_get(b)
        if na is not None and nb is not None:
            c = compare_prefill_load(na, nb, use_ms=self.all_have_ms)
            if c != 0:
                return c
        return _cmp(self.local(a), self.local(b))

    def prefill_pressure_source(self) -> int:
        if self.compare_engine and all(
            n.estimated_prefill_queue_ms is not None for n in self.native.values()
        ):
            return labels.SRC_ESTIMATED_MS
        if self.compare_engine:
            return labels.SRC_NATIVE_TOKENS
        return labels.SRC_ROUTER_LOCAL


# =============================================================================
# Section 2: cache candidate preparation
# =============================================================================


@dataclass
class PrefixSignal:
    """Section 2 prefix signal.  ``matches`` are ``(address, blocks)`` in provider
    order; an address is a worker key, or None for an unknown address."""

    query_blocks: int
    matches: list = field(default_factory=list)
    best_prefix_blocks: int | None = None
    outcome: str | None = None      # "Matched" | "Empty"; None = derived

    @property
    def is_matched(self) -> bool:
        if self.outcome is not None:
            return self.outcome == "Matched"
        # Replay rule (brief): Matched iff at least one match entry.
        return len(self.matches) > 0

    @property
    def best(self) -> int:
        if self.best_prefix_blocks is not None:
            return self.best_prefix_blocks
        return max((b for _, b in self.matches), default=0)


@dataclass
class Candidate:
    """Section 2 step 5: a prepared cache candidate."""

    worker: Worker
    matched_tokens: int                 # H
    uncached_tokens: int                # E
    matched_blocks: int                 # capped blocks
    max_pending_prefill_tokens: int | None = None
    range_id: str = GLOBAL_RANGE


def cap_matched_prefix_blocks(query_blocks: int, matched_prefix_blocks: int) -> int:
    """Section 2 step 2: ``min(matched, query)``."""
    return min(matched_prefix_blocks, query_blocks)


def estimate_matched_prefix_tokens(input_tokens: int, query_blocks: int, matched_prefix_blocks: int) -> int:
    """Section 2 steps 2-3: ``floor(L * min(blocks, query) / max(query, 1))``."""
    blocks = cap_matched_prefix_blocks(query_blocks, matched_prefix_blocks)
    return (input_tokens * blocks) // max(query_blocks, 1)


def candidate_limit(n_fleet: int, cfg: RouterConfig) -> int:
    """Section 2 step 7."""
    ratio = min(max(float(cfg.cache_candidate_ratio), 0.0), 1.0)
    by_ratio = math.ceil(ratio * n_fleet)
    return min(n_fleet, cfg.cache_candidate_max_workers, max(cfg.cache_candidate_min_workers, by_ratio))


def passes_cache_gate(h: int, L: int, cfg: RouterConfig) -> bool:
    """Section 2 step 4 (both bounds inclusive)."""
    if cfg.cache_affinity_min_matched_tokens is not None and not h >= cfg.cache_affinity_min_matched_tokens:
        return False
    if cfg.cache_affinity_min_match_ratio is not None:
        if not (L > 0 and h / L >= cfg.cache_affinity_min_match_ratio):
            return False
    return True


def prepare_candidates(
    L: int | None,
    signal: PrefixSignal | None,
    fleet: Sequence[Worker],
    snapshot: Snapshot | None,
    cfg: RouterConfig,
    *,
    lookup_enabled: bool = True,
) -> list | None:
    """Section 2 ``cache_candidate_proposal``: the candidates in seed order, or
    None for "no proposal" (the caller then uses the power-of-k pair)."""
    if not lookup_enabled or L is None or signal is None:
        return None
    if not signal.is_matched or signal.query_blocks == 0:
        return None
    if len(fleet) == 0:
        return None
    fleet_set = set(fleet)
    q = signal.query_blocks
    seen: set = set()
    prepared: list[Candidate] = []
    # Step 1: provider order, exact address match, skip unknown / zero / repeats.
    for address, blocks in signal.matches:
        # REPLAY CHOICE: a known worker outside this request's fleet (decode peer,
        # other model) is matched like an unknown address: skipped, not marked seen.
        if address is None or address not in fleet_set:
            continue
        if blocks == 0:
            # Section 0 item 13: skipped without marking the worker as seen.
            continue
        if address in seen:
            continue
        seen.add(address)  # marked even if the gates below reject it (item 13)
        capped = cap_matched_prefix_blocks(q, blocks)                     # step 2
        h = (L * capped) // max(q, 1)                                     # step 3
        if not passes_cache_gate(h, L, cfg):                               # step 4
            continue
        e = max(L - h, 0)                                                  # step 5
        # Step 6: no bucket configuration -> identity (section 0 item 8).
        prepared.append(Candidate(address, h, e, capped, None, GLOBAL_RANGE))
    k = candidate_limit(len(fleet), cfg)                                   # step 7
    if k == 0 or not prepared:
        return None
    # Step 8: seed order over CandidateLoads built on all prepared candidates.
    loads = CandidateLoads(snapshot, [c.worker for c in prepared])

    def seed_cmp(a: Candidate, b: Candidate) -> int:
        c = _cmp(b.matched_tokens, a.matched_tokens)  # H descending
        if c != 0:
            return c
        c = loads.compare_prefill_pressure_total(a.worker, b.worker)
        if c != 0:
            return c
        return _cmp(a.worker, b.worker)

    ordered = sorted(prepared, key=cmp_to_key(seed_cmp))
    return ordered[:k]


# =============================================================================
# Section 3: cache resolution
# =============================================================================


@dataclass
class Decision:
    """A prefill decision (sections 3.6, 3.8, 4.1, 4.2)."""

    selected: Worker
    reason: int                      # labels.REASONS code
    primary: Worker | None = None
    backup: Worker | None = None
    range_id: str = GLOBAL_RANGE


@dataclass
class CacheResolution:
    """Section 3.9 resolution audit record."""

    decision: Decision | None
    prefill_pressure_source: int
    admission_evaluated_candidates: int = 0
    admission_rejected_candidates: int = 0
    queue_gate_rejected_candidates: int = 0
    queue_gate_best_rejected_blocks: int = 0
    queue_gate_fell_back: bool = False
    fleet_all_queued: bool = False
    pressure_guard_compared_pairs: int = 0
    pressure_guard_overrides: int = 0
    # replay-only (the locality waterfall): capped matched blocks of the deepest
    # candidate of each set; "pin_pool" only when the pin ran
    depths: dict = field(default_factory=lambda: dict.fromkeys(
        ("prepared", "evaluated", "admitted", "pin_pool"), 0))

    @property
    def audit(self) -> tuple:
        """The ladder's audit tuple (section 4, step 1)."""
        return (
            self.queue_gate_rejected_candidates,
            self.admission_evaluated_candidates,
            self.fleet_all_queued,
            self.queue_gate_best_rejected_blocks,
        )


def is_cache_candidate_admitted(c: Candidate, L: int, snapshot: Snapshot | None) -> bool:
    """Section 3.5."""
    native = snapshot.native_of(c.worker) if snapshot is not None else None
    if native is None:
        return True
    if not has_kv_capacity(native, L):
        return False
    if c.max_pending_prefill_tokens is not None:
        return native.waiting_uncached + c.uncached_tokens <= c.max_pending_prefill_tokens
    return True


def materially_more_pressured(x: Worker, y: Worker, loads: CandidateLoads, cfg: RouterConfig) -> bool:
    """Section 3.8."""
    nx, ny = loads.comparable_get(x), loads.comparable_get(y)
    if nx is None or ny is None:
        return False
    abs_ms = cfg.pressure_abs_threshold_ms
    rel = cfg.pressure_rel_threshold
    if (
        abs_ms is not None
        and nx.estimated_prefill_queue_ms is not None
        and ny.estimated_prefill_queue_ms is not None
    ):
        x_ms, y_ms = nx.estimated_prefill_queue_ms, ny.estimated_prefill_queue_ms
        return x_ms - y_ms > abs_ms and x_ms > y_ms * rel
    diff = max(nx.waiting_uncached - ny.waiting_uncached, 0)  # saturating sub
    return diff > cfg.pressure_abs_threshold_tokens and nx.waiting_uncached > ny.waiting_uncached * rel


def tournament_compare(l: Candidate, r: Candidate, guard: bool, loads: CandidateLoads,  # noqa: E741 - l/r: left, right
                       cfg: RouterConfig) -> int:
    """Section 3.8 ``compare(l, r, guard)``."""

    def tail() -> int:
        c = _cmp(l.uncached_tokens, r.uncached_tokens)
        if c != 0:
            return c
        c = loads.compare_prefill_pressure(l.worker, r.worker)
        if c != 0:
            return c
        return _cmp(l.worker, r.worker)

    if abs(l.uncached_tokens - r.uncached_tokens) > cfg.cache_switch_margin_tokens:
        return tail()
    if guard:
        if materially_more_pressured(l.worker, r.worker, loads, cfg):
            return 1
        if materially_more_pressured(r.worker, l.worker, loads, cfg):
            return -1
    return tail()


def resolve_cache_candidates(
    candidates: Sequence[Candidate],
    L: int,
    snapshot: Snapshot | None,
    fleet: Sequence[Worker],
    cfg: RouterConfig,
) -> CacheResolution:
    """Section 3: gate pass, fell-back tier, admission, pin, tournament."""
    limit, floor = gate_bounds(cfg)
    # 3.2: computed once per resolution.
    all_queued = fleet_is_all_queued(snapshot, fleet, limit)
    # 3.3: gate pass in seed order.
    evaluated = [c for c in candidates if queue_gate_admits(snapshot, c.worker, limit)]
    rejected = [c for c in candidates if not queue_gate_admits(snapshot, c.worker, limit)]
    gate_rejected = len(rejected)
    best_rejected_blocks = max((c.matched_blocks for c in rejected), default=0)
    # 3.4: fleet-saturation fallback tier.
    fell_back = len(evaluated) == 0 and len(rejected) > 0 and all_queued and floor is None
    if fell_back:
        evaluated = list(candidates)
    # 3.5: hard admission over the evaluated set.
    loads = CandidateLoads(snapshot, [c.worker for c in evaluated])
    admitted = [c for c in evaluated if is_cache_candidate_admitted(c, L, snapshot)]
    res = CacheResolution(
        decision=None,
        prefill_pressure_source=loads.prefill_pressure_source(),
        admission_evaluated_candidates=len(evaluated),
        admission_rejected_candidates=len(evaluated) - len(admitted),
        queue_gate_rejected_candidates=gate_rejected,
        queue_gate_best_rejected_blocks=best_rejected_blocks,
        queue_gate_fell_back=fell_back,
        fleet_all_queued=all_queued,
    )
    res.depths["prepared"] = max((c.matched_blocks for c in candidates), default=0)
    res.depths["evaluated"] = max((c.matched_blocks for c in evaluated), default=0)
    res.depths["admitted"] = max((c.matched_blocks for c in admitted), default=0)
    # 3.6: work floor = first admitted candidate with minimal E.
    work_floor: Candidate | None = None
    for c in admitted:
        if work_floor is None or c.uncached_tokens < work_floor.uncached_tokens:
            work_floor = c
    if work_floor is None:
        if rejected and floor is not None and not any_fresh_queue_below(snapshot, fleet, floor):
            pin_loads = CandidateLoads(snapshot, [c.worker for c in rejected])
            res.depths["pin_pool"] = max((c.matched_blocks for c in rejected
                                          if is_cache_candidate_admitted(c, L, snapshot)), default=0)
            target: Candidate | None = None
            for c in rejected:
                if not is_cache_candidate_admitted(c, L, snapshot):
                    continue
                if target is None:
                    target = c
                    continue
                # min by pressure then worker id.
                # REPLAY CHOICE: scanned in rejected (seed) order like Rust's min_by:
                # the current target is replaced only when it compares Greater.
                k = pin_loads.compare_prefill_pressure(target.worker, c.worker)
                if k == 0:
                    k = _cmp(target.worker, c.worker)
                if cfg.variant_pin_order == "locality":
                    # policy variant (not router behaviour): deepest match first,
                    # then the order above
                    k = _cmp(c.matched_blocks, target.matched_blocks) or k
                if k > 0:
                    target = c
            if target is not None:
                res.decision = Decision(
                    selected=target.worker,
                    reason=labels.SATURATION_PIN,
                    primary=target.worker,
                    backup=None,
                    range_id=target.range_id,
                )
        return res
    # 3.8: tournament (order-dependent, not a sort).
    ceiling = work_floor.uncached_tokens + cfg.cache_switch_margin_tokens
    winner = work_floor
    compared = overrides = 0
    for c in admitted:
        if c is winner or c.uncached_tokens > ceiling:
            continue
        baseline = tournament_compare(winner, c, False, loads, cfg)
        if (
            cfg.pressure_guard
            and loads.comparable_get(winner.worker) is not None
            and loads.comparable_get(c.worker) is not None
        ):
            compared += 1
            guarded = tournament_compare(winner, c, True, loads, cfg)
            if guarded != baseline:
                overrides += 1
            result = guarded
        else:
            result = baseline
        if result > 0:
            winner = c
    res.pressure_guard_compared_pairs = compared
    res.pressure_guard_overrides = overrides
    res.decision = Decision(
        selected=winner.worker,
        reason=labels.CACHE_CANDIDATE,
        primary=winner.worker,
        backup=None,
        range_id=winner.range_id,
    )
    return res


# =============================================================================
# Randomness (section 0 item 4; docs/replay-model.md "Randomness")
# =============================================================================

_M64 = (1 << 64) - 1


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw(seed: int, request_index: int, draw_index: int) -> int:
    """``mix64(mix64(mix64(seed) ^ request_index) ^ draw_index)``."""
    return mix64(mix64(mix64(seed & _M64) ^ (request_index & _M64)) ^ (draw_index & _M64))


class DrawStream:
    """The random numbers of one (request, config) decision; the draw counter starts at 0."""

    def __init__(self, seed: int, request_index: int):
        self.seed = seed
        self.request_index = request_index
        self.count = 0

    def next(self) -> int:
        v = draw(self.seed, self.request_index, self.count)
        self.count += 1
        return v


# =============================================================================
# Section 4.2: the min-load (power-of-k) sampler
# =============================================================================


@dataclass
class Proposal:
    """A prefill proposal: primary, optional backup, optional eligible list."""

    primary: Worker
    backup: Worker | None = None
    eligible: list | None = None
    kind: str = KIND_POWER_OF_TWO


def sample_pool(workers: Sequence[Worker], snapshot: Snapshot | None, limit: int | None) -> list:
    """Section 4.2 ``sample_pool``: the gate-admitted tier, else the whole list."""
    if snapshot is not None and limit is not None:
        tier = [w for w in workers if queue_gate_admits(snapshot, w, limit)]
        if tier:
            return tier
    return list(workers)


def sample_indices(n: int, k: int, rng: DrawStream) -> list:
    """Section 4.2 / docs 'Randomness': which pool indices are scanned, in scan order."""
    k = max(k, 1)
    if k >= n:
        return list(range(n))
    if k == 1:
        return [rng.next() % n]
    idx = list(range(n))
    for i in range(k):
        j = i + rng.next() % (n - i)
        idx[i], idx[j] = idx[j], idx[i]
    return idx[:k]


def best_two_of_sample(
    pool: Sequence[Worker], k: int, snapshot: Snapshot | None, rng: DrawStream
) -> tuple:
    """Section 4.2 ``best_two_of_sample``: (best, runner_up) by a linear scan, or (None, None)."""
    if not pool:
        return None, None
    best = runner = None
    for i in sample_indices(len(pool), k, rng):
        w = pool[i]
        if best is None:
            best = w
        elif compare_prefill_pressure(w, best, snapshot) < 0:
            runner = best
            best = w
        elif runner is None or compare_prefill_pressure(w, runner, snapshot) < 0:
            runner = w
    return best, runner


def select_k_with_snapshot(
    workers: Sequence[Worker], snapshot: Snapshot | None, k: int, limit: int | None, rng: DrawStream
) -> Worker | None:
    """Section 4.2 ``select``: the sample's best."""
    best, _ = best_two_of_sample(sample_pool(workers, snapshot, limit), k, snapshot, rng)
    return best


def propose_k_with_snapshot(
    workers: Sequence[Worker], snapshot: Snapshot | None, k: int, limit: int | None, rng: DrawStream
) -> Proposal | None:
    """Section 4.2 ``propose``: (best, runner-up) with kind PowerOfTwo; None on an empty list."""
    best, runner = best_two_of_sample(sample_pool(workers, snapshot, limit), k, snapshot, rng)
    if best is None:
        return None
    return Proposal(primary=best, backup=runner, eligible=None, kind=KIND_POWER_OF_TWO)


# =============================================================================
# Section 4.1: strict admission with range fallback
# =============================================================================


@dataclass
class PrefillRange:
    """A prefill domain / range (no bucket config: one ``global`` range = the fleet)."""

    id: str
    workers: list
    max_pending_prefill_tokens: int | None = None


def is_prefill_admitted(rng_: PrefillRange, w: Worker, L: int, snapshot: Snapshot | None) -> bool:
    """Section 4.1 ``is_prefill_admitted`` (capacity only)."""
    native = snapshot.native_of(w) if snapshot is not None else None
    if native is None:
        return True
    if not has_kv_capacity(native, L):
        return False
    if rng_.max_pending_prefill_tokens is not None:
        return native.waiting_uncached + L <= rng_.max_pending_prefill_tokens
    return True


def legal_workers(range_: PrefillRange, proposal: Proposal) -> list:
    """Section 4.1: the proposal's eligible list (or the range workers) ∩ range, in that order."""
    in_range = set(range_.workers)
    src = proposal.eligible if proposal.eligible is not None else range_.workers
    return [w for w in src if w in in_range]


def range_fallback(
    range_: PrefillRange, proposal: Proposal, L: int, snapshot: Snapshot | None, queue_limit: int | None
) -> Decision | None:
    """Section 4.1 range fallback (two tiers)."""
    legal = legal_workers(range_, proposal)
    pool0 = [w for w in legal if is_prefill_admitted(range_, w, L, snapshot)]
    tier = pool0
    if queue_limit is not None:
        tier1 = [w for w in pool0 if queue_gate_admits(snapshot, w, queue_limit)]
        tier = tier1 if tier1 else pool0
    if not tier:
        return None
    loads = CandidateLoads(snapshot, tier)
    best = tier[0]
    for w in tier[1:]:
        if loads.compare_prefill_pressure(w, best) < 0:  # only strictly smaller replaces
            best = w
    return Decision(selected=best, reason=labels.RANGE_FALLBACK, primary=proposal.primary,
                    backup=proposal.backup, range_id=range_.id)


def resolve_prefill_admitted(
    range_: PrefillRange, proposal: Proposal, L: int, snapshot: Snapshot | None, queue_limit: int | None
) -> Decision | None:
    """Section 4.1 (strict)."""
    in_range = set(range_.workers)
    primary = proposal.primary
    if primary not in in_range:
        return None
    backup = proposal.backup if proposal.backup in in_range else None

    def eligible(w: Worker) -> bool:
        return proposal.eligible is None or w in proposal.eligible

    def admitted(w: Worker) -> bool:
        return (
            eligible(w)
            and is_prefill_admitted(range_, w, L, snapshot)
            and queue_gate_admits(snapshot, w, queue_limit)
        )

    p_ok = admitted(primary)
    b_ok = backup is not None and admitted(backup)
    # Both admitted: the pressure guard could prefer the backup only with guard
    # hints, which cache-aware pairs never carry (section 4.1) -> Primary.
    if p_ok:
        return Decision(selected=primary, reason=labels.PRIMARY, primary=primary, backup=backup, range_id=range_.id)
    if b_ok:
        return Decision(selected=backup, reason=labels.BACKUP_PRIMARY_ADMISSION, primary=primary,
                        backup=backup, range_id=range_.id)
    return range_fallback(range_, proposal, L, snapshot, queue_limit)


def resolve_prefill(
    range_: PrefillRange,
    proposal: Proposal,
    L: int,
    snapshot: Snapshot | None,
    queue_limit: int | None,
    min_load_choices: int,
    rng: DrawStream,
) -> Decision | None:
    """Section 4.2: strict, then the capacity fallback (power-of-k over the legal list)."""
    d = resolve_prefill_admitted(range_, proposal, L, snapshot, queue_limit)
    if d is not None:
        return d
    if proposal.primary not in set(range_.workers):
        return None
    legal = legal_workers(range_, proposal)
    sel = select_k_with_snapshot(legal, snapshot, min_load_choices, queue_limit, rng)
    if sel is None:
        return None
    return Decision(selected=sel, reason=labels.CAPACITY_FALLBACK_POWER_OF_TWO, primary=proposal.primary,
                    backup=proposal.backup, range_id=range_.id)


# =============================================================================
# Section 5: labels and locality
# =============================================================================


def prefill_policy_reason(reason: int, proposal_kind: str = KIND_POWER_OF_TWO) -> int:
    """Section 5.2, cache_aware arms (first matching arm wins)."""
    if reason == labels.CACHE_CANDIDATE or (proposal_kind == KIND_CACHE_AFFINITY and reason == labels.PRIMARY):
        return labels.PR_CACHE_CANDIDATE
    return labels.reason_to_policy_reason(reason)


def cache_aware_fallback_decision(rejected: int, evaluated: int, fleet_all_queued: bool) -> int:
    """Section 5.3 ``cache_aware_fallback_decision``."""
    if rejected == 0:
        return labels.CACHE_MISS
    if fleet_all_queued:
        return labels.ALL_QUEUED
    if evaluated > 0:
        return labels.CACHE_MISS
    return labels.CACHE_WORKER_QUEUED


def cache_rung_decision_label(reason: int, fell_back: bool) -> int:
    """Section 5.3: the label of a decision produced by the cache rung."""
    if reason == labels.SATURATION_PIN or fell_back:
        return labels.ALL_QUEUED
    return labels.CACHE_HIT


def diverted_overlap_bucket(blocks: int) -> int:
    """Section 5.3: index of the ``sgl_router_diverted_overlap_blocks`` bucket
    (``value <= bound``); ``len(DIVERTED_BUCKETS)`` is +Inf."""
    for i, bound in enumerate(labels.DIVERTED_BUCKETS):
        if blocks <= bound:
            return i
    return len(labels.DIVERTED_BUCKETS)


def first_entry_blocks(signal: PrefixSignal | None, worker: Worker) -> int:
    """Section 0 item 13: a worker's blocks are those of its first entry in ``matches`` (0 if none)."""
    if signal is None:
        return 0
    for address, blocks in signal.matches:
        if address is not None and address == worker:
            return blocks
    return 0


def worker_blocks(signal: PrefixSignal | None, worker: Worker, merged: bool = False) -> int:
    """A worker's matched blocks: its first entry's (legacy, section 0 item 13), or
    with ``merged`` its deepest entry's (the reorg's merge, ROUTER_REORG.md 3.3)."""
    if not merged:
        return first_entry_blocks(signal, worker)
    return merged_depths(signal).get(worker, 0)


def locality_triple(signal: PrefixSignal | None, selected: Worker | None, merged: bool = False) -> tuple | None:
    """Section 5.4 (and section 0 items 10, 13, 16): ``(query, matched, selected)``
    blocks, or None when there is no prefix signal (nothing is booked).

    REPLAY CHOICE: a reorg decision (``merged``) books nothing; its selected
    blocks are the chosen worker's deepest entry, the depth the reorg itself
    reads (docs/replay-model.md, "The reorg engine")."""
    if signal is None or signal.query_blocks <= 0:
        return None
    query = signal.query_blocks
    matched = min(signal.best, query) if signal.is_matched else 0
    sel = min(worker_blocks(signal, selected, merged), matched) if selected is not None else 0
    return (query, matched, sel)


def selected_uncached_tokens(L: int, signal: PrefixSignal | None, selected: Worker, merged: bool = False) -> int:
    """Section 0 item 16: ``L - H`` for the chosen worker, H by the section 2 estimate."""
    if signal is None or signal.query_blocks <= 0:
        return L
    # REPLAY CHOICE: H uses the worker's *first* entry in matches (item 13's
    # definition of "a worker's blocks"), even if that entry has 0 blocks
    # (a reorg decision: its deepest entry, as locality_triple).
    h = estimate_matched_prefix_tokens(L, signal.query_blocks, worker_blocks(signal, selected, merged))
    return max(L - h, 0)


# =============================================================================
# Section 4 / section 8: the selection ladder
# =============================================================================


@dataclass
class Selection:
    """Outcome of :func:`select_prefill` for one request under one config."""

    worker: Worker | None
    reason: int = labels.NO_REASON
    proposal_kind: str | None = None
    decision: int = labels.NO_DECISION            # CacheAwareDecision label code
    failure: int = labels.NO_FAILURE
    resolution: CacheResolution | None = None
    diverted_overlap_blocks: int | None = None  # observed into the histogram (5.3 arm 4)
    reorg_outcome: int = labels.NO_REORG_OUTCOME  # labels.REORG_OUTCOMES code of a reorg selection

    @property
    def policy_reason(self) -> int:
        if self.worker is None:
            return labels.NO_POLICY_REASON
        return prefill_policy_reason(self.reason, self.proposal_kind or KIND_POWER_OF_TWO)


def prefill_domains(fleet: Sequence[Worker]) -> list:
    """Section 4 step 2: no bucket config -> one ``global`` domain = all fleet workers."""
    return [PrefillRange(GLOBAL_RANGE, list(fleet), None)]


def select_prefill(
    L: int,
    signal: PrefixSignal | None,
    fleet: Sequence[Worker],
    snapshot: Snapshot | None,
    cfg: RouterConfig,
    rng: DrawStream,
) -> Selection:
    """Section 8 pseudo-code / section 4: ``select_prefill_worker`` for policy_kind cache_aware."""
    failure = labels.FAIL_PROPOSAL_EMPTY
    audit: tuple | None = None
    resolution: CacheResolution | None = None
    # 4.1 step 1: the cache rung.
    cands = prepare_candidates(L, signal, fleet, snapshot, cfg)
    if cands:
        resolution = resolve_cache_candidates(cands, L, snapshot, fleet, cfg)
        d = resolution.decision
        if d is not None:
            return Selection(
                worker=d.selected,
                reason=d.reason,
                proposal_kind=KIND_CACHE_AFFINITY,
                decision=cache_rung_decision_label(d.reason, resolution.queue_gate_fell_back),
                resolution=resolution,
            )
        audit = resolution.audit
        failure = labels.FAIL_CACHE_CANDIDATES_EXHAUSTED
    # Step 2: domain rungs, two passes (affinity lookup disabled -> pair proposals).
    k = cfg.min_load_choices
    limit, _floor = gate_bounds(cfg)
    for allow_capacity in (False, True):
        for dom in prefill_domains(fleet):
            pair = propose_k_with_snapshot(dom.workers, snapshot, k, limit, rng)
            if pair is None:
                continue
            if allow_capacity:
                d = resolve_prefill(dom, pair, L, snapshot, limit, k, rng)
            else:
                d = resolve_prefill_admitted(dom, pair, L, snapshot, limit)
            if d is not None:
                rejected, evaluated, all_q, best_blocks = audit or (0, 0, False, 0)
                label = cache_aware_fallback_decision(rejected, evaluated, all_q)
                return Selection(
                    worker=d.selected,
                    reason=d.reason,
                    proposal_kind=KIND_POWER_OF_TWO,
                    decision=label,
                    resolution=resolution,
                    diverted_overlap_blocks=best_blocks if label == labels.CACHE_WORKER_QUEUED else None,
                )
            failure = labels.FAIL_PREFILL_ADMISSION_EXHAUSTED
    # Step 3: no worker -> failure, no cache-aware label.
    return Selection(worker=None, failure=failure, resolution=resolution)


# =============================================================================
# The reorg engine (ROUTER_REORG.md, line A): --chat-routing reorg
# =============================================================================

REORG_DEFAULT_CHOICES = 2
"""``power_of_n_choices`` when the flag is not given (ROUTER_REORG.md 1.1)."""


class NoAdmissible(Exception):
    """ROUTER_REORG.md 3.8 / 4 step 6: ``NoAdmissibleEngine`` / ``AdmissionRejected``:
    the bucket fails with these (engine, reason) rejections."""

    def __init__(self, rejections: list):
        super().__init__(rejections)
        self.rejections = rejections


def reorg_admits(snapshot: Snapshot | None, worker: Worker, cfg: RouterConfig) -> bool:
    """ROUTER_REORG.md 3.5: line A's only cap, ``max_inflight_requests`` (``--max-in-flight``):
    admit unless the router-local in-flight count reaches it.  The request's size
    plays no part and KV capacity is not checked."""
    cap = cfg.max_in_flight
    if cap is None:
        return True
    inflight = snapshot.inflight_of(worker) if snapshot is not None else 0
    return not inflight >= cap


def reorg_draw(n: int, cfg: RouterConfig, rng: DrawStream) -> list:
    """ROUTER_REORG.md 4 step 3: the sampled positions of a pool of ``n >= 1``, in sample order.

    power-of-n (both A2 revisions): ``min(N, n)`` distinct positions, uniformly, in
    uniformly random order, as a partial Fisher-Yates over the pool order
    (decision 3; ``N >= n`` still shuffles).  power-of-two (A1): ``i``, then ``j``
    over the other ``n - 1``; a pool of one needs no draw.
    """
    if cfg.variant_reorg_ranking == "power-of-two":
        if n == 1:
            return [0]
        i = rng.next() % n
        j = rng.next() % (n - 1)
        if j >= i:
            j += 1
        return [i, j]
    m = min(cfg.power_of_n_choices or REORG_DEFAULT_CHOICES, n)
    idx = list(range(n))
    for i in range(m):
        j = i + rng.next() % (n - i)
        idx[i], idx[j] = idx[j], idx[i]
    return idx[:m]


def reorg_least_pressure(sample: Sequence[Worker], snapshot: Snapshot | None, cfg: RouterConfig) -> Worker:
    """ROUTER_REORG.md 4 step 5: the winner of a sample (prefill stages)."""
    if cfg.variant_reorg_ranking == "power-of-n":
        # 3b33a3d2's least_prefill_pressure: the whole sample ranked at once; engine
        # loads only if every sampled engine has a native aggregate, queue time only
        # if every one has an estimate; ties keep the earliest sampled.
        loads = CandidateLoads(snapshot, sample)
        best = sample[0]
        for w in sample[1:]:
            if loads.compare_prefill_pressure_total(w, best) < 0:
                best = w
        return best
    # 03473357's fold and A1's pair: the running winner is replaced only when it
    # compares Greater under the pairwise free function.
    best = sample[0]
    for w in sample[1:]:
        if compare_prefill_pressure(best, w, snapshot) > 0:
            best = w
    return best


def reorg_load_pick(pool: Sequence[Worker], snapshot: Snapshot | None, cfg: RouterConfig,
                    rng: DrawStream) -> Worker:
    """ROUTER_REORG.md 4: ``PowerOfNPolicy`` / ``PowerOfTwoPolicy`` over a non-empty pool, no caps."""
    return reorg_least_pressure([pool[i] for i in reorg_draw(len(pool), cfg, rng)], snapshot, cfg)


def merged_depths(signal: PrefixSignal | None) -> dict:
    """ROUTER_REORG.md 3.3 step 1: ``depth[address]`` = the deepest of its entries
    (an entry with 0 blocks creates the key)."""
    depth: dict = {}
    if signal is None:
        return depth
    for address, blocks in signal.matches:
        if address is None:
            continue
        depth[address] = max(depth.get(address, 0), blocks)
    return depth


def reorg_candidates(L: int, signal: PrefixSignal | None, group: Sequence[Worker],
                     snapshot: Snapshot | None, cfg: RouterConfig) -> list:
    """ROUTER_REORG.md 3.3: the first K candidates in sort order (empty: a miss)."""
    if signal is None or signal.query_blocks <= 0 or not signal.is_matched:
        return []
    q = signal.query_blocks
    depth = merged_depths(signal)
    prepared = []
    for w in group:                      # group order; addresses outside it never count
        if w not in depth:
            continue
        blocks = min(depth[w], q)
        h = (L * blocks) // q
        if blocks <= 0:
            continue
        if cfg.cache_affinity_min_matched_tokens is not None and h < cfg.cache_affinity_min_matched_tokens:
            continue
        if cfg.cache_affinity_min_match_ratio is not None and h / max(L, 1) < cfg.cache_affinity_min_match_ratio:
            continue
        prepared.append(Candidate(w, h, L - h, blocks))
    if not prepared:
        return []
    k = candidate_limit(len(group), cfg)
    loads = CandidateLoads(snapshot, [c.worker for c in prepared])

    def key(a: Candidate, b: Candidate) -> int:
        # REPLAY CHOICE: the sort's pressure key is legacy decision 7's set-wide
        # rule (ROUTER_REORG.md 9.4), as in the legacy seed order
        return (_cmp(a.uncached_tokens, b.uncached_tokens)
                or loads.compare_prefill_pressure_total(a.worker, b.worker) or _cmp(a.worker, b.worker))

    return sorted(prepared, key=cmp_to_key(key))[:k]


def reorg_cache_pick(L: int, signal: PrefixSignal | None, group: Sequence[Worker],
                     snapshot: Snapshot | None, cfg: RouterConfig, rng: DrawStream,
                     admits: Callable | None = None) -> Selection:
    """ROUTER_REORG.md 3 (``CacheAwarePolicy::pick``) over one non-empty group.

    Returns the pick (worker, reorg outcome, the resolution as the legacy audit
    fields read it); raises :class:`NoAdmissible` when the bucket fails.
    ``admits(snapshot, worker, cfg)`` is the hard admission (default
    :func:`reorg_admits`; the router's own tests use stubs)."""
    admit = admits or reorg_admits
    limit, floor = gate_bounds(cfg)
    cands = reorg_candidates(L, signal, group, snapshot, cfg)
    res: CacheResolution | None = None
    rejections: list = []
    if cands:
        all_queued = fleet_is_all_queued(snapshot, group, limit)
        evaluated = [c for c in cands if queue_gate_admits(snapshot, c.worker, limit)]
        gated = [c for c in cands if not queue_gate_admits(snapshot, c.worker, limit)]
        saturated = not evaluated and bool(gated) and all_queued and floor is None
        if saturated:
            evaluated = list(gated)
        loads = CandidateLoads(snapshot, [c.worker for c in evaluated])
        admitted = []
        for c in evaluated:                                              # 3.5
            if admit(snapshot, c.worker, cfg):
                admitted.append(c)
            else:
                rejections.append(c.worker)
        res = CacheResolution(
            decision=None, prefill_pressure_source=loads.prefill_pressure_source(),
            admission_evaluated_candidates=len(evaluated), admission_rejected_candidates=len(rejections),
            queue_gate_rejected_candidates=len(gated),
            queue_gate_best_rejected_blocks=max((c.matched_blocks for c in gated), default=0),
            queue_gate_fell_back=saturated, fleet_all_queued=all_queued)
        res.depths["prepared"] = max(c.matched_blocks for c in cands)
        res.depths["evaluated"] = max((c.matched_blocks for c in evaluated), default=0)
        res.depths["admitted"] = max((c.matched_blocks for c in admitted), default=0)
        if admitted:                                                     # 3.6
            least = admitted[0]
            for c in admitted:
                if c.uncached_tokens < least.uncached_tokens:
                    least = c
            ceiling = least.uncached_tokens + cfg.cache_switch_margin_tokens
            winner = least
            guarded = cfg.pressure_guard and loads.compare_engine
            compared = overrides = 0
            for c in admitted:
                if c is winner or c.uncached_tokens > ceiling:
                    continue
                baseline = tournament_compare(winner, c, False, loads, cfg)
                result = baseline
                if guarded:
                    compared += 1
                    result = tournament_compare(winner, c, True, loads, cfg)
                    overrides += result != baseline
                if result > 0:
                    winner = c
            res.pressure_guard_compared_pairs = compared
            res.pressure_guard_overrides = overrides
            # Pick.reason is saturation_pin in the saturated tier; the reason column keeps
            # legacy's DecisionReason of the same tier (CacheCandidate, as the waterfall reads it)
            outcome = labels.REORG_SATURATION_PIN if saturated else labels.REORG_CACHE_WIN
            res.decision = Decision(winner.worker, labels.CACHE_CANDIDATE)
            return Selection(worker=winner.worker, reason=labels.CACHE_CANDIDATE, resolution=res,
                             reorg_outcome=outcome)
        if floor is not None and not any_fresh_queue_below(snapshot, group, floor):   # 3.7
            pin_loads = CandidateLoads(snapshot, [c.worker for c in gated])
            ok = []
            for c in gated:
                if admit(snapshot, c.worker, cfg):
                    ok.append(c)
                else:
                    rejections.append(c.worker)
            res.depths["pin_pool"] = max((c.matched_blocks for c in ok), default=0)
            if ok:
                target = ok[0]
                for c in ok[1:]:
                    if (pin_loads.compare_prefill_pressure(c.worker, target.worker)
                            or _cmp(c.worker, target.worker)) < 0:
                        target = c
                res.decision = Decision(target.worker, labels.SATURATION_PIN)
                return Selection(worker=target.worker, reason=labels.SATURATION_PIN, resolution=res,
                                 reorg_outcome=labels.REORG_SATURATION_PIN)
        if rejections:                                                   # 3.8
            raise NoAdmissible(rejections)
    # 3.9: the miss fallback over the unqueued tier, its own draw, then this policy's caps
    pool = [w for w in group if queue_gate_admits(snapshot, w, limit)] or list(group)
    w = reorg_load_pick(pool, snapshot, cfg, rng)
    if not admit(snapshot, w, cfg):
        raise NoAdmissible([w])
    return Selection(worker=w, reason=labels.NO_REASON, resolution=res, reorg_outcome=labels.REORG_MISS_FALLBACK)


def reorg_groups(fleet: Sequence[Worker], plain: Sequence[bool]) -> list:
    """ROUTER_REORG.md 1.4 / 2: the factory buckets' groups in rank order: the plain
    engines (bucket ``plain``), then the prefill engines (bucket ``pd``), each in
    id order; ``plain[i]`` tells whether ``fleet[i]`` is a plain engine."""
    return [sorted(w for w, p in zip(fleet, plain, strict=True) if p),
            sorted(w for w, p in zip(fleet, plain, strict=True) if not p)]


def select_reorg(L: int, signal: PrefixSignal | None, fleet: Sequence[Worker], plain: Sequence[bool],
                 snapshot: Snapshot | None, cfg: RouterConfig, rng: DrawStream,
                 indexer_rejected: bool = False, admits: Callable | None = None) -> Selection:
    """ROUTER_REORG.md section 8 ``reorg_select`` (policy cache_aware): the buckets in
    order; a bucket without engines or failing with rejections passes to the next.

    REPLAY CHOICE: the draws of every bucket attempt continue one stream (the
    router's draws are independent per call; so are these)."""
    rejected = False
    for group in reorg_groups(fleet, plain):
        if not group:
            continue
        if indexer_rejected:          # 3.2: InvalidSignal stops the route at once (500)
            return Selection(worker=None, reorg_outcome=labels.REORG_INDEXER_REJECTED)
        try:
            return reorg_cache_pick(L, signal, group, snapshot, cfg, rng, admits)
        except NoAdmissible:
            rejected = True
    return Selection(worker=None, reorg_outcome=labels.REORG_NO_ADMISSIBLE if rejected else labels.REORG_NO_WORKERS)


# =============================================================================
# End to end: replay a Trace under a grid of configs
# =============================================================================


def _request_signal(trace, i: int) -> PrefixSignal | None:
    """A request's prefix signal: present iff query_blocks > 0; Matched iff it has a match entry."""
    q = int(trace.req_query_blocks[i])
    if q <= 0:
        return None
    lo, hi = int(trace.match_offsets[i]), int(trace.match_offsets[i + 1])
    matches = []
    for j in range(lo, hi):
        w = int(trace.match_worker[j])
        matches.append((None if w < 0 else w, int(trace.match_blocks[j])))
    return PrefixSignal(
        query_blocks=q,
        matches=matches,
        best_prefix_blocks=int(trace.req_best_prefix_blocks[i]),
        outcome="Matched" if matches else "Empty",
    )


def _rank_sample(trace, j: int) -> RankSample:
    native = None
    if bool(trace.load_has_tail[j]):
        native = NativeTail(
            waiting_uncached=int(trace.load_waiting_uncached[j]),
            total_tokens=int(trace.load_total_tokens[j]),
            max_running_requests=int(trace.load_max_running[j]),
            prefill_tokens=int(trace.load_prefill_tokens[j]),
            prefill_busy_us=int(trace.load_prefill_busy_us[j]),
        )
    return RankSample(
        running=int(trace.load_running[j]),
        waiting=int(trace.load_waiting[j]),
        num_tokens=int(trace.load_num_tokens[j]),
        max_total_num_tokens=int(trace.load_max_total[j]),
        native=native,
    )


def replay(
    trace,
    configs: Sequence[RouterConfig],
    *,
    seed: int = 0,
    freshness_ns: int = DEFAULT_FRESHNESS_NS,
) -> dict:
    """Replay every request of ``trace`` under every config (the reference engine).

    Returns the arrays of ``replay/fields.py`` with shape (n_requests, n_configs).
    """
    n_req = trace.n_requests
    n_cfg = len(configs)
    out = _fields.empty_decisions(n_req, n_cfg)
    table = LoadTable(freshness=freshness_ns)
    dp = [int(x) for x in trace.worker_dp_size]
    # Section 0 items 2 / 12: dp_size gives the expected ranks 0..dp-1.
    for w in range(trace.n_workers):
        if dp[w] > 0:
            table.expect(w, range(dp[w]))
    inflight: dict = {}
    n_loads = int(trace.load_ts.shape[0])
    j = 0
    fleets: dict = {}
    plains: dict = {}
    for i in range(n_req):
        ts = int(trace.req_ts[i])
        # Section 0 item 1: a sample with ts <= request ts is visible.
        while j < n_loads and int(trace.load_ts[j]) <= ts:
            w = int(trace.load_worker[j])
            r = int(trace.load_rank[j])
            # REPLAY CHOICE: router_inflight is a per-worker router value
            # (items 3, 15): rows of any rank count, even ranks >= dp_size.
            v = int(trace.load_router_inflight[j])
            if v >= 0:
                inflight[w] = v
            # Section 0 item 12: with a dp_size, other ranks are ignored.
            if not (dp[w] > 0 and r >= dp[w]):
                table.set(w, r, _rank_sample(trace, j), int(trace.load_ts[j]))
            j += 1
        snap = table.capture(ts, inflight)
        model = int(trace.req_model[i])
        if model not in fleets:
            fleets[model] = [int(x) for x in trace.fleet(model)]
            plains[model] = [not trace.has_workers_table or int(trace.worker_role[w]) == labels.ROLE_PLAIN
                             for w in fleets[model]]
        fleet = fleets[model]
        L = int(trace.req_input_tokens[i])
        signal = _request_signal(trace, i)
        # docs/replay-model.md: request_index = position in the time-sorted whole
        # trace (Trace.req_index; equal to the row index unless load_trace kept
        # the requests of one model).
        req_index = int(trace.req_index[i]) if getattr(trace, "req_index", None) is not None else i
        for c, cfg in enumerate(configs):
            # Section 0 item 4: the draw counter of each (request, config) starts at 0.
            rng = DrawStream(seed, req_index)
            if cfg.chat_routing == "reorg":
                sel = select_reorg(L, signal, fleet, plains[model], snap, cfg, rng)
            else:
                sel = select_prefill(L, signal, fleet, snap, cfg, rng)
            _store(out, i, c, sel, L, signal, snap)
    return out


def locality_waterfall(matched: int, selected: int, reason: int,
                       resolution: CacheResolution | None) -> dict[str, int]:
    """Where a routed decision's matched blocks went (docs/replay-model.md,
    "Where locality goes"): blocks lost per step of ``labels.LOSS_STEPS``,
    adding up to ``matched - selected``.

    The blocks walk down a chain of depths, one per step that narrows the
    owners the decision could still reach; each depth is clamped to
    [selected, the level before], and a step loses the drop it causes.
    """
    lost = dict.fromkeys(labels.LOSS_STEPS, 0)
    if matched <= 0:
        return lost
    if resolution is None:  # no proposal: the domain rungs chose
        lost["fallback"] = matched - selected
        return lost
    d = resolution.depths
    if reason == labels.SATURATION_PIN:
        # the pin considers the gated owners again: the gate loses nothing
        chain = [("candidates", d["prepared"]), ("capacity", d["pin_pool"]), ("pin", selected)]
    else:
        chooser = "tournament" if reason == labels.CACHE_CANDIDATE else "fallback"
        chain = [("candidates", d["prepared"]), ("queue_gate", d["evaluated"]),
                 ("capacity", d["admitted"]), (chooser, selected)]
    level = matched
    for step, depth in chain:
        below = min(level, max(depth, selected))
        lost[step] += level - below
        level = below
    return lost


def _store(out: dict, i: int, c: int, sel: Selection, L: int, signal: PrefixSignal | None, snap: Snapshot) -> None:
    res = sel.resolution
    if res is not None:
        out["gate_rejected"][i, c] = res.queue_gate_rejected_candidates
        out["admission_evaluated"][i, c] = res.admission_evaluated_candidates
        out["admission_rejected"][i, c] = res.admission_rejected_candidates
        out["best_rejected_blocks"][i, c] = res.queue_gate_best_rejected_blocks
        out["fleet_all_queued"][i, c] = res.fleet_all_queued
        out["fell_back"][i, c] = res.queue_gate_fell_back
        out["guard_compared"][i, c] = res.pressure_guard_compared_pairs
        out["guard_overrides"][i, c] = res.pressure_guard_overrides
        out["pressure_source"][i, c] = res.prefill_pressure_source
    # REPLAY CHOICE: matched_blocks is a property of the request (fields.py:
    # "min(best_prefix_blocks, query_blocks); 0 without a signal"), so it is
    # set even when the selection failed; selected_blocks needs a chosen worker
    # and stays 0 on a failure.  (The router books no triple on a 503: mask
    # with decision >= 0 to reproduce its counters.)
    reorg = sel.reorg_outcome != labels.NO_REORG_OUTCOME
    out["reorg_outcome"][i, c] = sel.reorg_outcome
    triple = locality_triple(signal, sel.worker, merged=reorg)
    if triple is not None:
        out["matched_blocks"][i, c] = triple[1]
    if sel.worker is None:
        out["failure"][i, c] = sel.failure
        return
    w = sel.worker
    out["worker"][i, c] = w
    out["reason"][i, c] = sel.reason
    # reorg books no policy reason and no cache-aware label (ROUTER_REORG.md section 5)
    out["policy_reason"][i, c] = labels.NO_POLICY_REASON if reorg else sel.policy_reason
    out["decision"][i, c] = sel.decision
    if triple is not None:
        out["selected_blocks"][i, c] = triple[2]
        lost = locality_waterfall(triple[1], triple[2], sel.reason, res)
        for step in ("candidates", "queue_gate", "capacity"):
            out[f"lost_{step}"][i, c] = lost[step]
        out["lost_to"][i, c] = next((k for k, step in enumerate(labels.LOSS_STEPS) if lost[step] > 0),
                                    labels.NO_LOSS)
    out["uncached_tokens"][i, c] = selected_uncached_tokens(L, signal, w, merged=reorg)
    b = snap.basic_of(w)
    if b is not None:
        out["selected_waiting"][i, c] = b.waiting
    n = snap.native_of(w)
    if n is not None:
        out["selected_waiting_uncached"][i, c] = n.waiting_uncached
        if n.estimated_prefill_queue_ms is not None:
            out["selected_queue_ms"][i, c] = n.estimated_prefill_queue_ms
