"""Window lengths: ``--window`` parsing, the automatic choice, display."""

from __future__ import annotations

import math
import re

from replay.errors import ParamError
from replay.trace.base import NS

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# auto: replay in memory up to these sizes, else windows of about this many rows
AUTO_IN_MEMORY_REQUESTS = 4_000_000
AUTO_IN_MEMORY_LOAD_ROWS = 16_000_000
AUTO_WINDOW_REQUESTS = 1_000_000
AUTO_WINDOW_LOAD_ROWS = 2_000_000
# auto windows are rounded down to one of these lengths (seconds)
NICE_WINDOWS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                  86400)


def parse_window(text: str) -> int | None:
    """``--window``: ``auto`` (None here), ``none``/``0`` (in memory, 0) or a
    duration such as ``90s``, ``15m``, ``1h``, ``1d``, ``3600`` (seconds)."""
    t = str(text).strip().lower()
    if t == "auto":
        return None
    if t in ("none", "0", "off"):
        return 0
    m = re.fullmatch(r"(\d+)\s*([smhd]?)", t)
    if not m or int(m.group(1)) == 0:
        raise ParamError("window", f"must be auto, none or a whole number of seconds like 90s, 15m, "
                         f"1h, 1d; got {text!r}")
    return int(m.group(1)) * WINDOW_UNITS[m.group(2) or "s"] * NS


def auto_window(tset) -> int:
    """0 (replay in memory) for a :class:`TraceSet` that fits comfortably, else a
    window of about AUTO_WINDOW_REQUESTS requests and AUTO_WINDOW_LOAD_ROWS samples."""
    if tset.n_requests <= AUTO_IN_MEMORY_REQUESTS and tset.n_load_rows <= AUTO_IN_MEMORY_LOAD_ROWS:
        return 0
    span_s = max(1.0, (tset.ts_max - tset.ts_min) / NS)
    seconds_with_rows = getattr(tset, "row_seconds", None)
    if seconds_with_rows is not None and seconds_with_rows.size:
        # rows per second of data, not of span: an outlier ts must not make windows huge
        span_s = max(1.0, min(span_s, float(seconds_with_rows.size)))
    per_s = max(tset.n_requests / AUTO_WINDOW_REQUESTS, tset.n_load_rows / AUTO_WINDOW_LOAD_ROWS) / span_s
    seconds = max(1, int(math.floor(1.0 / per_s))) if per_s > 0 else int(span_s) + 1
    nice = [s for s in NICE_WINDOWS_S if s <= seconds]
    return (nice[-1] if nice else seconds) * NS


def format_window(window_ns: int) -> str:
    s = window_ns // NS
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"
