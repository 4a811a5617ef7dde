"""The encoded trace the engines read: flat numpy columns and a few name lists.

Encoding contract (both ``reference.py`` and ``kernels/`` rely on it):

* Workers are integers: ``workers`` is the sorted (ascending, by Python string
  order) list of every worker URL the trace knows, and a worker's index is its
  position there, so "worker id ascending" is integer order.
* Requests and load samples are sorted by ``ts`` (stable), timestamps are int64
  nanoseconds.
* ``matches`` are CSR: request ``i``'s entries are
  ``match_worker[match_offsets[i]:match_offsets[i+1]]`` (same slice of
  ``match_blocks``), in provider order; an address that is not a known worker
  has index ``-1``.  ``hash_ids`` are CSR the same way (``hash_offsets``,
  ``hash_values``).
* Missing optional integers are ``-1`` (they are all non-negative otherwise);
  missing optional times are NaN; a column the files do not have is None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from replay.trace.facts import TraceFacts
from replay.trace.info import TraceInfo
from replay.trace.workers import fleet_dp_sizes, fleet_members


@dataclass
class Trace:
    """A loaded, checked, encoded trace directory."""

    path: str
    # --- workers (the fleet table, explicit or inferred) -------------------
    workers: list[str]                 # sorted worker URLs; index = worker id
    models: list[str]                  # model names; index = model id
    worker_model: np.ndarray           # int32[n_workers], model id
    worker_role: np.ndarray            # int8[n_workers], labels.ROLE_*
    worker_dp_size: np.ndarray         # int32[n_workers], 0 = unknown (use observed ranks)
    has_workers_table: bool            # workers.parquet was present
    # --- requests, sorted by ts (stable) -----------------------------------
    request_id: np.ndarray             # object or int64 [n_requests], original ids
    req_ts: np.ndarray                 # int64 ns
    req_model: np.ndarray              # int32 model id
    req_input_tokens: np.ndarray       # int64 (L)
    req_query_blocks: np.ndarray       # int64, 0 = no prefix signal (null read as 0)
    req_best_prefix_blocks: np.ndarray # int64 (default max of match blocks, 0 if none)
    match_offsets: np.ndarray          # int64[n_requests + 1]
    match_worker: np.ndarray           # int32, worker id or -1 (unknown address)
    match_blocks: np.ndarray           # int64
    req_selected_worker: np.ndarray | None  # int32, -1 = null / unknown; None = no column
    # --- load samples, sorted by ts (stable) -------------------------------
    load_ts: np.ndarray                # int64 ns
    load_worker: np.ndarray            # int32 worker id
    load_rank: np.ndarray              # int32 dp rank (>= 0)
    load_running: np.ndarray           # int64 num_running_reqs
    load_waiting: np.ndarray           # int64 num_waiting_reqs
    load_num_tokens: np.ndarray        # int64 num_tokens (used KV)
    load_max_total: np.ndarray         # int64 max_total_num_tokens (0 = unknown)
    load_has_tail: np.ndarray          # bool: all five native tail fields present
    load_waiting_uncached: np.ndarray  # int64 (0 where no tail)
    load_total_tokens: np.ndarray      # int64 num_total_tokens (0 where no tail)
    load_max_running: np.ndarray       # int64 max_running_requests (0 where no tail)
    load_prefill_tokens: np.ndarray    # int64 total_prefill_uncached_tokens (0 where no tail)
    load_prefill_busy_us: np.ndarray   # int64 total_prefill_busy_us (0 where no tail)
    load_router_inflight: np.ndarray   # int64, -1 = null or no column
    # --- provenance ----------------------------------------------------------
    files: dict[str, dict] = field(default_factory=dict)  # name -> {path, bytes, sha256}
    facts: TraceFacts = field(default_factory=TraceFacts)  # validate-style data facts
    # --- additions (load_trace) ---------------------------------------------
    # Position of each request in the time-sorted *whole* trace (the
    # ``request_index`` of docs/replay-model.md); differs from arange only when
    # ``load_trace(model=...)`` kept the requests of one model.  None -> arange.
    req_index: np.ndarray | None = None
    # With a workers table: True for workers listed in it.  Workers seen only
    # in loads.parquet get worker_model == -1 and role decode (never a fleet
    # member).  Without a table: all True.
    worker_listed: np.ndarray | None = None
    # --- closed-loop columns (traces/README.md; None = the files lack the column)
    info: TraceInfo | None = None                 # trace.json; empty TraceInfo when absent
    req_output_tokens: np.ndarray | None = None   # int64, -1 = null
    req_cached_tokens: np.ndarray | None = None   # int64, -1 = null
    req_ttft_ms: np.ndarray | None = None         # float64, NaN = null
    req_latency_ms: np.ndarray | None = None      # float64, NaN = null
    hash_offsets: np.ndarray | None = None        # int64[n_requests + 1], CSR of hash_ids
    hash_values: np.ndarray | None = None         # int64 block hashes
    req_hash_known: np.ndarray | None = None      # bool: hash_ids not null
    worker_page_size: np.ndarray | None = None    # int32 per worker, 0 = unknown
    model_page_size: np.ndarray | None = None     # int64 per model: block size of hash_ids, -1 = unknown

    def __post_init__(self) -> None:
        if self.req_index is None:
            self.req_index = np.arange(self.req_ts.shape[0], dtype=np.int64)
        if self.worker_listed is None:
            self.worker_listed = np.ones(len(self.workers), dtype=bool)
        if self.info is None:
            self.info = TraceInfo()
        if self.worker_page_size is None:
            self.worker_page_size = np.zeros(len(self.workers), dtype=np.int32)
        if self.model_page_size is None:
            self.model_page_size = np.full(max(len(self.models), 1), -1, dtype=np.int64)

    @property
    def n_requests(self) -> int:
        return int(self.req_ts.shape[0])

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def req_page_size(self) -> np.ndarray:
        """int64 per request: the block size of its ``hash_ids`` (-1 = unknown)."""
        return self.model_page_size[self.req_model]

    def fleet_dp_sizes(self) -> dict[int, int]:
        """dp_size of every fleet worker (any model), by worker id: the workers
        table's, else the ranks observed in the load trace (0 when none)."""
        def top_rank(w: int) -> int:
            ranks = self.load_rank[self.load_worker == w]
            return int(ranks.max()) if ranks.size else -1

        return fleet_dp_sizes(self, self.worker_dp_size, top_rank)

    def fleet(self, model: int) -> np.ndarray:
        """Routable prefill fleet of a model: worker ids, ascending (section 0, items 9 and 11).

        With a workers table: workers of that model whose role is prefill or
        plain.  Without one: every worker (one model, all plain).
        """
        return fleet_members(self.has_workers_table, self.worker_model, self.worker_role, model)
