"""A trace directory as a request log: what a closed-loop simulation or a
calibration reads (arrivals, lengths, block hashes, production's outcomes)."""

from __future__ import annotations

import os

import numpy as np
import polars as pl
import pyarrow as pa

from replay.trace.core import Trace
from replay.trace.load import load_trace

LOG_SCHEMA = {
    "ts": pl.Int64, "request_id": None, "model": pl.String, "input_tokens": pl.Int64,
    "output_tokens": pl.Int64, "hash_ids": pl.List(pl.Int64), "page_size": pl.Int64,
    "selected_worker": pl.String, "cached_tokens": pl.Int64, "ttft_ms": pl.Float64,
    "latency_ms": pl.Float64,
}
"""The columns of :func:`request_log`, in order (``request_id``: string or
int64, as in the files)."""


def _ints(a: np.ndarray | None, n: int) -> pl.Series:
    """int64 column with -1 as null (all null when the column is absent)."""
    if a is None:
        return pl.Series(values=[None] * n, dtype=pl.Int64)
    return pl.Series(pa.array(np.asarray(a, dtype=np.int64), mask=np.asarray(a) < 0))


def _floats(a: np.ndarray | None, n: int) -> pl.Series:
    """float64 column with NaN as null."""
    if a is None:
        return pl.Series(values=[None] * n, dtype=pl.Float64)
    return pl.Series(values=a, dtype=pl.Float64, nan_to_null=True)


def trace_request_log(trace: Trace) -> pl.DataFrame:
    """:func:`request_log` of a loaded :class:`Trace` (its requests, in its order)."""
    n = trace.n_requests
    if trace.hash_offsets is not None:
        lists = pa.LargeListArray.from_arrays(pa.array(trace.hash_offsets, type=pa.int64()),
                                              pa.array(trace.hash_values, type=pa.int64()),
                                              mask=pa.array(~trace.req_hash_known))
        hash_ids = pl.Series("hash_ids", lists).cast(pl.List(pl.Int64))
    else:
        hash_ids = pl.Series("hash_ids", [None] * n, dtype=pl.List(pl.Int64))
    sel = trace.req_selected_worker
    workers = np.array(trace.workers + [None], dtype=object)
    models = np.array(trace.models, dtype=object)
    page = trace.req_page_size
    return pl.DataFrame([
        pl.Series("ts", trace.req_ts, dtype=pl.Int64),
        pl.Series("request_id", trace.request_id.tolist() if trace.request_id.dtype == object
                  else trace.request_id),
        pl.Series("model", models[trace.req_model].tolist(), dtype=pl.String),
        pl.Series("input_tokens", trace.req_input_tokens, dtype=pl.Int64),
        _ints(trace.req_output_tokens, n).alias("output_tokens"),
        hash_ids,
        _ints(page, n).alias("page_size"),
        (pl.Series("selected_worker", workers[sel].tolist(), dtype=pl.String) if sel is not None
         else pl.Series("selected_worker", [None] * n, dtype=pl.String)),
        _ints(trace.req_cached_tokens, n).alias("cached_tokens"),
        _floats(trace.req_ttft_ms, n).alias("ttft_ms"),
        _floats(trace.req_latency_ms, n).alias("latency_ms"),
    ])


def request_log(path: str | os.PathLike, *, model: str | None = None) -> pl.DataFrame:
    """The trace directory ``path`` as a request log, one row per request in
    time order (stable by ``ts``), with every check :func:`load_trace` makes.

    Columns (always all of them; a column the files lack is all null):
    ``ts`` (int64 ns), ``request_id``, ``model``, ``input_tokens``,
    ``output_tokens``, ``hash_ids`` (list of int64), ``page_size`` (the block
    size of ``hash_ids``), ``selected_worker`` (string; null where unknown or
    not a known worker), ``cached_tokens``, ``ttft_ms``, ``latency_ms``.
    With ``model``, only that model's requests.  The production router flags
    are ``load_trace(path).info`` (``trace.json``).
    """
    return trace_request_log(load_trace(path, model=model))
