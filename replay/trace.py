"""Trace directories: read with polars, check, encode once into flat numpy columns.

This module is the boundary between user files and the kernels.  Everything
after ``load_trace`` sees only the :class:`Trace` below (numpy arrays and a few
Python lists of names), never polars or pyarrow objects.

Encoding contract (both ``reference.py`` and ``kernels/`` rely on it):

* Workers are integers: ``workers`` is the sorted (ascending, by Python string
  order) list of every worker URL the trace knows, and a worker's index is its
  position there, so "worker id ascending" is integer order.
* Requests and load samples are sorted by ``ts`` (stable), timestamps are int64
  nanoseconds.
* ``matches`` are CSR: request ``i``'s entries are
  ``match_worker[match_offsets[i]:match_offsets[i+1]]`` (same slice of
  ``match_blocks``), in provider order; an address that is not a known worker
  has index ``-1``.
* Missing optional integers are ``-1`` (they are all non-negative otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


from .errors import ReplayError


class TraceError(ReplayError):
    """Bad input; the message is one line naming file, column and first bad row."""


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
    facts: dict = field(default_factory=dict)               # validate-style data facts

    @property
    def n_requests(self) -> int:
        return int(self.req_ts.shape[0])

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    def fleet(self, model: int) -> np.ndarray:
        """Routable prefill fleet of a model: worker ids, ascending (section 0, items 9 and 11).

        With a workers table: workers of that model whose role is prefill or
        plain.  Without one: every worker (one model, all plain).
        """
        from . import labels

        if not self.has_workers_table:
            return np.arange(self.n_workers, dtype=np.int32)
        mask = (self.worker_model == model) & (self.worker_role != labels.ROLE_DECODE)
        return np.nonzero(mask)[0].astype(np.int32)
