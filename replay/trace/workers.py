"""The fleet: ``workers.parquet``, the worker and model universe, fleet membership.

Worker ids are positions in the sorted (Python string order) list of every
worker URL the trace knows; model ids positions in the sorted model names.
A trace set fixes this universe once, so every window encodes alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from replay import labels
from replay.trace.base import DEFAULT_MODEL, MAX_DP_SIZE, MAX_INT32, TRACE_JSON, WORKERS, TraceError
from replay.trace.columns import Columns


@dataclass
class WorkersTable:
    """``workers.parquet``, checked: one entry per row."""

    names: list[str]
    models: list[str]
    roles: np.ndarray          # int8, labels.ROLE_*
    dp_sizes: np.ndarray       # int64, 0 = unknown
    page_sizes: np.ndarray     # int64, 0 = unknown


@dataclass
class Universe:
    """Worker ids and models of a whole trace: fixed once, so every window of
    a trace set encodes workers and models exactly as the whole trace would."""

    workers: list[str]
    models: list[str]
    worker_model: np.ndarray
    worker_role: np.ndarray
    worker_dp: np.ndarray
    worker_listed: np.ndarray
    has_table: bool
    non_fleet_load: list[str]
    worker_page: np.ndarray | None = None     # int32 per worker, 0 = unknown
    model_page: np.ndarray | None = None      # int64 per model: block size of hash_ids, -1 = unknown

    def __post_init__(self) -> None:
        if self.worker_page is None:
            self.worker_page = np.zeros(len(self.workers), dtype=np.int32)
        if self.model_page is None:
            self.model_page = np.full(len(self.models), -1, dtype=np.int64)


def parse_workers_table(wk_df: pl.DataFrame) -> WorkersTable:
    """Check ``workers.parquet`` (one error line on the first bad row)."""
    W = Columns(WORKERS, wk_df)
    t_name = W.strings("worker", nullable=False)
    dup = ~t_name.is_first_distinct()
    if dup.any():
        row = int(dup.arg_max())
        W.fail("worker", f"duplicate worker {t_name[row]!r}", row)
    t_model = (W.strings("model", nullable=True).fill_null(DEFAULT_MODEL) if W.has("model")
               else pl.Series([DEFAULT_MODEL] * wk_df.height, dtype=pl.String))
    if W.has("role"):
        roles = W.strings("role", nullable=True).fill_null("plain")
        bad = ~roles.is_in(list(labels.ROLES))
        if bad.any():
            row = int(bad.arg_max())
            W.fail("role", f"must be one of prefill|decode|plain, got {roles[row]!r}", row)
        t_role = roles.replace_strict(list(labels.ROLES), [labels.ROLES.index(r) for r in labels.ROLES],
                                      return_dtype=pl.Int8).to_numpy()
    else:
        t_role = np.full(wk_df.height, labels.ROLE_PLAIN, dtype=np.int8)
    t_dp = (W.ints("dp_size", nullable=True, fill=0, lo=1, hi=MAX_DP_SIZE) if W.has("dp_size")
            else np.zeros(wk_df.height, dtype=np.int64))
    t_page = (W.ints("page_size", nullable=True, fill=0, lo=1, hi=MAX_INT32) if W.has("page_size")
              else np.zeros(wk_df.height, dtype=np.int64))
    models = t_model.to_list()
    # REPLAY CHOICE: the router hashes a request with one block size, but the spec
    # does not say which when a model's engines advertise different page sizes
    # (/server_info is per engine); such a table is refused rather than guessed.
    seen: dict[str, int] = {}
    for row in np.nonzero((t_page > 0) & (t_role != labels.ROLE_DECODE))[0].tolist():
        first = seen.setdefault(models[row], int(row))
        if t_page[row] != t_page[first]:
            W.fail("page_size", f"{t_page[row]} differs from {t_page[first]} (row {first}) for model "
                   f"{models[row]!r}; a model's requests are hashed with one block size", int(row))
    return WorkersTable(t_name.to_list(), models, t_role, t_dp, t_page)


def make_universe(table: WorkersTable | None, load_names, match_names, req_models,
                  page_size: int | None = None) -> Universe:
    """Worker ids and models from the workers table (or None) and the distinct
    load workers, match addresses and request models of the whole trace;
    ``page_size`` is ``trace.json``'s (it must agree with the table's)."""
    load_names = set(load_names)
    if table is None:
        workers = sorted(load_names | set(match_names))
        models = sorted(set(req_models)) or [DEFAULT_MODEL]
        n = len(workers)
        return Universe(workers, models, np.zeros(n, dtype=np.int32),
                        np.full(n, labels.ROLE_PLAIN, dtype=np.int8), np.zeros(n, dtype=np.int32),
                        np.ones(n, dtype=bool), False, [],
                        model_page=np.full(len(models), -1 if page_size is None else page_size,
                                           dtype=np.int64))
    listed = set(table.names)
    non_fleet_load = sorted(load_names - listed)
    workers = sorted(listed | set(non_fleet_load))
    models = sorted(set(table.models) | set(req_models))
    pos = {w: i for i, w in enumerate(workers)}
    mid = {m: i for i, m in enumerate(models)}
    n = len(workers)
    worker_model = np.full(n, -1, dtype=np.int32)
    worker_role = np.full(n, labels.ROLE_DECODE, dtype=np.int8)
    worker_dp = np.zeros(n, dtype=np.int32)
    worker_page = np.zeros(n, dtype=np.int32)
    worker_listed = np.zeros(n, dtype=bool)
    idx = np.array([pos[w] for w in table.names], dtype=np.int64)
    if idx.size:
        worker_model[idx] = [mid[m] for m in table.models]
        worker_role[idx] = table.roles
        worker_dp[idx] = table.dp_sizes
        worker_page[idx] = table.page_sizes
        worker_listed[idx] = True
    model_page = np.full(len(models), -1 if page_size is None else page_size, dtype=np.int64)
    for row in np.nonzero((table.page_sizes > 0) & (table.roles != labels.ROLE_DECODE))[0]:
        m = mid[table.models[row]]
        if page_size is not None and table.page_sizes[row] != page_size:
            raise TraceError(f"{TRACE_JSON}: key 'page_size': {page_size} differs from {WORKERS} "
                             f"page_size {table.page_sizes[row]} (row {row}, model {table.models[row]!r})")
        model_page[m] = table.page_sizes[row]
    return Universe(workers, models, worker_model, worker_role, worker_dp, worker_listed, True,
                    non_fleet_load, worker_page, model_page)


def fleet_members(has_table: bool, worker_model: np.ndarray, worker_role: np.ndarray, model: int) -> np.ndarray:
    """Worker ids of a model's routable prefill fleet (see :meth:`Trace.fleet`)."""
    if not has_table:
        return np.arange(worker_model.shape[0], dtype=np.int32)
    mask = (worker_model == model) & (worker_role != labels.ROLE_DECODE)
    return np.nonzero(mask)[0].astype(np.int32)


def fleet_dp_sizes(trace, worker_dp: np.ndarray, top_rank) -> dict[int, int]:
    """dp_size of every fleet worker of a Trace or TraceSet (``trace.models``,
    ``trace.fleet``): ``worker_dp[w]`` when known, else ``top_rank(w) + 1``
    (the highest rank observed, -1 when none)."""
    out: dict[int, int] = {}
    for m in range(max(len(trace.models), 1)):
        for w in trace.fleet(m):
            w = int(w)
            if w not in out:
                dp = int(worker_dp[w])
                out[w] = dp if dp > 0 else top_rank(w) + 1
    return out
