"""The one source of truth for every label string and enum code.

Kernels and the reference work with the small integer codes defined here;
only the edges (``results.py``, the CLI, reports) turn them into strings.
The strings are the router's own (ROUTER_SEMANTICS.md section 5).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------
# DecisionReason (section 5.1).  NO_REASON marks a failed selection.
NO_REASON = -1
PRIMARY = 0
CACHE_CANDIDATE = 1
BACKUP_PRIMARY_ADMISSION = 2
BACKUP_PRESSURE_GUARD = 3
RANGE_FALLBACK = 4
CAPACITY_FALLBACK_POWER_OF_TWO = 5
SATURATION_PIN = 6

REASONS = (
    "Primary",
    "CacheCandidate",
    "BackupPrimaryAdmission",
    "BackupPressureGuard",
    "RangeFallback",
    "CapacityFallbackPowerOfTwo",
    "SaturationPin",
)

# ---------------------------------------------------------------------------
# prefill_policy_reason for policy_kind == cache_aware (section 5.2).
NO_POLICY_REASON = -1
PR_CACHE_CANDIDATE = 0
PR_SATURATION_PIN = 1
PR_NO_CACHE_CANDIDATE = 2
PR_ADMISSION_BACKUP = 3
PR_PRESSURE_BACKUP = 4
PR_RANGE_FALLBACK = 5
PR_CAPACITY_FALLBACK = 6

POLICY_REASONS = (
    "cache_candidate",
    "saturation_pin",
    "no_cache_candidate",
    "no_cache_candidate_admission_backup",
    "no_cache_candidate_pressure_backup",
    "no_cache_candidate_range_fallback",
    "no_cache_candidate_capacity_fallback_power_of_two",
)

# ---------------------------------------------------------------------------
# CacheAwareDecision (section 5.3); NO_DECISION on a failed selection.
NO_DECISION = -1
CACHE_HIT = 0
CACHE_MISS = 1
CACHE_WORKER_QUEUED = 2
ALL_QUEUED = 3

DECISIONS = ("cache_hit", "cache_miss", "cache_worker_queued", "all_queued")

# ---------------------------------------------------------------------------
# sgl_router_policy_selection_failures_total reasons (section 5.5).
NO_FAILURE = -1
FAIL_PREFILL_ADMISSION_EXHAUSTED = 0
FAIL_CACHE_CANDIDATES_EXHAUSTED = 1
FAIL_PROPOSAL_EMPTY = 2

FAILURES = (
    "prefill_admission_exhausted",
    "cache_candidates_exhausted",
    "proposal_empty",
)

# ---------------------------------------------------------------------------
# Outcomes of the reorg engine (ROUTER_REORG.md sections 2, 3 and 5).  The reorg
# engine books no router label at all: these are the replay's own names for
# what happened to a request, so a reorg run can be read beside legacy's labels
# (docs/replay-model.md, "The reorg engine").  NO_REORG_OUTCOME on a legacy decision.
NO_REORG_OUTCOME = -1
REORG_CACHE_WIN = 0         # Pick.reason cache_candidate: a cache candidate won the tournament
REORG_SATURATION_PIN = 1    # Pick.reason saturation_pin: the saturated tier or the floor pin
REORG_MISS_FALLBACK = 2     # Pick.reason no_cache_candidate (a miss, or an unavailable indexer)
REORG_NO_ADMISSIBLE = 3     # 503 policy_selection_failed: a hard rejection, never a cold worker
REORG_NO_WORKERS = 4        # 503 no_healthy_workers / no_prefill_workers_available
REORG_INDEXER_REJECTED = 5  # 500 internal_error: the indexer rejected the query

REORG_OUTCOMES = ("cache_win", "saturation_pin", "miss_fallback", "no_admissible_engine",
                  "no_workers", "indexer_rejected")

# ---------------------------------------------------------------------------
# prefill_pressure_source of a cache resolution (section 3.7); NO_SOURCE when
# no resolution ran.
NO_SOURCE = -1
SRC_ESTIMATED_MS = 0
SRC_NATIVE_TOKENS = 1
SRC_ROUTER_LOCAL = 2

PRESSURE_SOURCES = ("estimated_prefill_queue_ms", "native_queue_tokens", "router_local")

# ---------------------------------------------------------------------------
# The locality waterfall (docs/replay-model.md "Where locality goes"): the
# steps of a decision that can give matched blocks away, in chain order.
# A decision's ``lost_to`` is the first step that lost any; NO_LOSS otherwise.
NO_LOSS = -1
LOST_CANDIDATES = 0
LOST_QUEUE_GATE = 1
LOST_CAPACITY = 2
LOST_PIN = 3
LOST_TOURNAMENT = 4
LOST_FALLBACK = 5

LOSS_STEPS = ("candidates", "queue_gate", "capacity", "pin", "tournament", "fallback")

# ---------------------------------------------------------------------------
# Worker roles in workers.parquet.
ROLE_PLAIN = 0
ROLE_PREFILL = 1
ROLE_DECODE = 2
ROLES = ("plain", "prefill", "decode")

# ---------------------------------------------------------------------------
# sgl_router_diverted_overlap_blocks bucket upper bounds (value <= bound);
# a final +Inf bucket follows them.
DIVERTED_BUCKETS = tuple(2**i for i in range(14))  # 1, 2, 4, ..., 8192


def name_or_none(table: tuple[str, ...], code: int) -> str | None:
    """Map a code to its label string; negative codes (the "none" codes) map to None."""
    return None if code < 0 else table[code]


def reason_to_policy_reason(reason: int) -> int:
    """prefill_policy_reason of a cache_aware selection (section 5.2, first arm wins).

    Cache-rung decisions carry CacheCandidate or SaturationPin; every other
    reason comes from the power-of-k pair of the domain rungs.
    """
    if reason == CACHE_CANDIDATE:
        return PR_CACHE_CANDIDATE
    if reason == SATURATION_PIN:
        return PR_SATURATION_PIN
    if reason == PRIMARY:
        return PR_NO_CACHE_CANDIDATE
    if reason == BACKUP_PRIMARY_ADMISSION:
        return PR_ADMISSION_BACKUP
    if reason == BACKUP_PRESSURE_GUARD:
        return PR_PRESSURE_BACKUP
    if reason == RANGE_FALLBACK:
        return PR_RANGE_FALLBACK
    if reason == CAPACITY_FALLBACK_POWER_OF_TWO:
        return PR_CAPACITY_FALLBACK
    return NO_POLICY_REASON
