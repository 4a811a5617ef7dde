"""The data facts of a trace (``Trace.facts``, ``router-replay validate``), typed.

``as_dict`` is the JSON form ``validate --json`` prints: every field, except
the optional ones (``None``) and the internal ones, under its own name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class TraceFacts:
    """What ``validate`` reports about a trace.  Counts are over the whole trace
    (before any model filter); ``None`` marks a fact that does not apply."""

    # --- requests -------------------------------------------------------------
    requests: int = 0
    requests_with_matches: int = 0
    requests_without_prefix_signal: int = 0   # no matches or query_blocks 0
    query_blocks_null: int = 0
    match_entries: int = 0
    unknown_match_entries: int = 0
    unknown_match_addresses: int = 0
    unknown_match_address_examples: list[str] = field(default_factory=list)
    has_selected_worker: bool = False
    selected_worker_null: int | None = None       # with a selected_worker column
    selected_worker_unknown: int | None = None
    span_start_ns: int | None = None              # with at least one request
    span_end_ns: int | None = None
    span_s: float | None = None
    requests_sorted_on_disk: bool = True
    # --- loads ----------------------------------------------------------------
    load_rows: int = 0
    loads_sorted_on_disk: bool = True
    load_rows_with_tail: int = 0
    load_rows_partial_tail: int = 0
    load_rows_without_tail: int = 0
    has_router_inflight: bool = False
    ignored_rank_rows: int = 0
    ranks_per_worker: dict[str, list[int]] = field(default_factory=dict)
    # --- fleet ----------------------------------------------------------------
    workers: int = 0
    models: dict[str, int] = field(default_factory=dict)   # model -> requests
    has_workers_table: bool = False
    non_fleet_load_workers: list[str] = field(default_factory=list)
    workers_without_samples: list[str] = field(default_factory=list)
    # --- load_trace(model=...) --------------------------------------------------
    model_filter: str | None = None
    requests_kept: int | None = None
    # --- closed-loop columns (only when the trace has them) -----------------------
    closed_loop_columns: dict[str, int] | None = None   # column -> rows with a value
    page_sizes: dict[str, int] | None = None            # model -> block size of hash_ids, where known
    hash_ids_full_blocks_only: int | None = None        # lists given a fresh id for their partial block
    log_hash_ids_full_blocks_only: int | None = None    # the same, done by the simulate that wrote the trace
    trace_json: dict | None = None                      # trace.json as read, when present
    # --- validate -----------------------------------------------------------------
    freshness_ms: int | None = None
    requests_without_fresh_fleet_sample: int | None = None
    share_without_fresh_fleet_sample: float | None = None
    fleet_workers: dict[str, int] | None = None    # model -> fleet size
    roles: dict[str, int] | None = None
    files: dict[str, dict] | None = None
    path: str | None = None
    # --- validate, window by window ------------------------------------------------
    window_s: int | None = None
    windows: int | None = None
    request_id_unique: str | None = None
    # --- internal: not in as_dict -----------------------------------------------------
    unknown_addresses: list[str] = field(default_factory=list, repr=False)  # up to 1000 names

    def as_dict(self) -> dict:
        """The facts as the JSON object ``validate --json`` prints."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in _INTERNAL:
                continue
            v = getattr(self, f.name)
            if v is None and f.name in _OPTIONAL:
                continue
            out[f.name] = v
        return out


_INTERNAL = frozenset({"unknown_addresses"})
_OPTIONAL = frozenset(f.name for f in dataclasses.fields(TraceFacts) if f.default is None)
