"""Per-decision output columns shared by the kernels and the reference.

Both engines return a ``dict[str, np.ndarray]`` with exactly these keys, each
array of shape ``(n_requests, n_configs)`` and the dtype given here, rows in the
trace's sorted request order, columns in the grid's config order.  "None"
values use the sentinel in the third column.

The locality waterfall (docs/replay-model.md) stores three of its terms per
decision; the fourth, the step that chose the worker (``lost_pin``,
``lost_tournament`` or ``lost_fallback`` by ``reason``), is the remainder
``matched_blocks - selected_blocks - lost_candidates - lost_queue_gate -
lost_capacity`` of a routed decision (:func:`waterfall_terms`).
"""

from __future__ import annotations

import numpy as np

from replay import labels

# name, dtype, null sentinel, meaning
DECISION_FIELDS: tuple[tuple[str, type, object, str], ...] = (
    ("worker", np.int32, -1, "selected worker id; -1 when the selection failed"),
    ("reason", np.int8, -1, "labels.REASONS code; -1 on failure"),
    ("policy_reason", np.int8, -1, "labels.POLICY_REASONS code; -1 on failure"),
    ("decision", np.int8, -1, "labels.DECISIONS code; -1 on failure (503 books nothing)"),
    ("failure", np.int8, -1, "labels.FAILURES code; -1 when a worker was selected"),
    ("matched_blocks", np.int64, 0, "min(best_prefix_blocks, query_blocks); 0 without a signal"),
    ("selected_blocks", np.int64, 0, "min(first match entry blocks of the chosen worker, matched)"),
    ("uncached_tokens", np.int64, -1, "L - H for the chosen worker (section 0 item 16); -1 on failure"),
    ("gate_rejected", np.int32, 0, "queue_gate_rejected_candidates (0 when no resolution ran)"),
    ("admission_evaluated", np.int32, 0, "admission_evaluated_candidates"),
    ("admission_rejected", np.int32, 0, "admission_rejected_candidates"),
    ("best_rejected_blocks", np.int64, 0, "queue_gate_best_rejected_blocks"),
    ("fleet_all_queued", np.bool_, False, "fleet_is_all_queued of the resolution"),
    ("fell_back", np.bool_, False, "queue_gate_fell_back of the resolution"),
    ("guard_compared", np.int32, 0, "pressure_guard_compared_pairs"),
    ("guard_overrides", np.int32, 0, "pressure_guard_overrides"),
    ("pressure_source", np.int8, -1, "labels.PRESSURE_SOURCES code of the resolution; -1 when none ran"),
    ("selected_waiting", np.int64, -1, "fresh basic num_waiting_reqs (summed) of the chosen worker; -1 if none"),
    ("selected_waiting_uncached", np.int64, -1, "fresh native waiting_uncached of the chosen worker; -1 if none"),
    ("lost_candidates", np.int64, 0, "matched blocks lost before the gate: deepest owner not a candidate (waterfall)"),
    ("lost_queue_gate", np.int64, 0, "matched blocks lost to queue-gate diversion (waterfall)"),
    ("lost_capacity", np.int64, 0, "matched blocks lost to capacity admission (waterfall)"),
    ("lost_to", np.int8, -1, "labels.LOSS_STEPS code of the first step that lost blocks; -1 if none or failed"),
    ("reorg_outcome", np.int8, -1, "labels.REORG_OUTCOMES code (the replay's own) of a reorg decision; -1 if legacy"),
    ("selected_queue_ms", np.float64, np.nan, "estimated_prefill_queue_ms of the chosen worker; NaN if none"),
)

FIELD_NAMES = tuple(f[0] for f in DECISION_FIELDS)


def empty_decisions(n_requests: int, n_configs: int) -> dict[str, np.ndarray]:
    """Arrays for every decision field, filled with their null sentinel."""
    return {
        name: np.full((n_requests, n_configs), null, dtype=dtype)
        for name, dtype, null, _ in DECISION_FIELDS
    }


def waterfall_terms(dec: dict) -> dict[str, np.ndarray]:
    """The six waterfall terms of every decision, from the fields above, as int64
    arrays (0 for failed decisions and decisions without matched blocks):
    ``matched_blocks - sum(terms) == selected_blocks`` for every routed decision."""

    routed = dec["worker"] >= 0
    out = {f"lost_{s}": np.zeros(dec["worker"].shape, dtype=np.int64) for s in labels.LOSS_STEPS}
    for s in ("candidates", "queue_gate", "capacity"):
        out[f"lost_{s}"] = np.where(routed, dec[f"lost_{s}"], 0).astype(np.int64)
    rest = np.where(routed, dec["matched_blocks"].astype(np.int64) - dec["selected_blocks"]
                    - out["lost_candidates"] - out["lost_queue_gate"] - out["lost_capacity"], 0)
    reason = dec["reason"]
    out["lost_pin"] = np.where(reason == labels.SATURATION_PIN, rest, 0)
    out["lost_tournament"] = np.where(reason == labels.CACHE_CANDIDATE, rest, 0)
    out["lost_fallback"] = np.where((reason != labels.SATURATION_PIN)
                                    & (reason != labels.CACHE_CANDIDATE), rest, 0)
    return out
