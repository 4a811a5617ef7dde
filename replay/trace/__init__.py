"""Trace input: user files in, checked flat numpy columns out (see ``traces/README.md``).

This package is the boundary between user files and the engines.  Everything
after :func:`load_trace` sees only a :class:`Trace` (numpy arrays and a few
Python lists of names), never polars or pyarrow objects.  Its parts, in the
order data flows through them (each imports only those before it):

* ``base``      file names, limits, :class:`TraceError`
* ``columns``   checked column readers (one error line: file, column, row)
* ``files``     which Parquet files make a trace (single files, ``requests/``
                folders, hive partitions) and reading them; :func:`row_counts`
* ``workers``   ``workers.parquet``, the worker/model universe, fleets
* ``info``      ``trace.json`` (:class:`TraceInfo`: production's router flags)
* ``facts``     :class:`TraceFacts`, the typed data facts
* ``core``      :class:`Trace`, the encoded form
* ``encode``    requests, matches, closed-loop columns, loads; ids; sorting
* ``load``      :func:`load_trace` (``build_trace``: the steps above in order,
                then the model filter)
* ``log``       :func:`request_log`, a trace as a request log
* ``carry``     the load samples a window inherits from before it
* ``sets``      :class:`TraceSet`: the index and window-by-window reading
* ``windows``   ``--window`` lengths
* ``validate``  :func:`validate_trace` (in memory or window by window)
"""

from __future__ import annotations

from replay.trace.base import (
                   DEFAULT_MODEL,
                   FRESHNESS_NS,
                   LOAD_FIELDS,
                   LOADS,
                   MAX_DP_SIZE,
                   NS,
                   REQUESTS,
                   TRACE_JSON,
                   WORKERS,
                   TraceError,
)
from replay.trace.core import Trace
from replay.trace.facts import TraceFacts
from replay.trace.files import Frames, read_frames, row_counts
from replay.trace.info import TraceInfo, read_trace_info
from replay.trace.load import build_trace, load_trace
from replay.trace.log import request_log, trace_request_log
from replay.trace.sets import TraceSet, Window
from replay.trace.validate import fresh_fleet_sample_mask, validate_trace, validate_windows
from replay.trace.windows import auto_window, format_window, parse_window

__all__ = [
    "DEFAULT_MODEL", "FRESHNESS_NS", "LOADS", "LOAD_FIELDS", "MAX_DP_SIZE", "NS", "REQUESTS", "TRACE_JSON",
    "WORKERS", "Frames", "Trace", "TraceError", "TraceFacts", "TraceInfo", "TraceSet", "Window",
    "auto_window", "build_trace", "format_window", "fresh_fleet_sample_mask", "load_trace",
    "parse_window", "read_frames", "read_trace_info", "request_log", "row_counts", "trace_request_log",
    "validate_trace", "validate_windows",
]
