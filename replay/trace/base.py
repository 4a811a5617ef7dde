"""Names every part of the trace package shares: file names, limits, the error type."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from replay.errors import ReplayError

A = TypeVar("A")
B = TypeVar("B")

REQUESTS = "requests.parquet"
LOADS = "loads.parquet"
WORKERS = "workers.parquet"
TRACE_JSON = "trace.json"
KINDS = {"requests": REQUESTS, "loads": LOADS}

NS = 1_000_000_000
DEFAULT_MODEL = "default"
MAX_VALUE = 2**53 - 1          # counts must be < 2**53
MAX_INT32 = 2**31 - 1
# A worker's dp_size, given in workers.parquet or set by the ranks it publishes
# from, is at most this: the replay keeps a state row per (worker, rank), so the
# limit keeps that table small (a data-parallel engine has one rank per GPU).
# REPLAY CHOICE: the spec bounds neither (the router keys samples by any u32
# rank); 1024 is far above any engine's attention-DP size and keeps the
# per-rank table of 64 workers under 10 MB.
MAX_DP_SIZE = 1024
FRESHNESS_NS = 5_000_000_000

TAIL_COLUMNS = (
    "num_waiting_uncached_tokens",
    "num_total_tokens",
    "max_running_requests",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
)
LOAD_REQUIRED = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens")

# Load columns of a Trace, in ``engine.load_columns`` order.
LOAD_FIELDS = ("load_ts", "load_worker", "load_rank", "load_running", "load_waiting",
               "load_num_tokens", "load_max_total", "load_has_tail", "load_waiting_uncached",
               "load_total_tokens", "load_max_running", "load_prefill_tokens",
               "load_prefill_busy_us", "load_router_inflight")


class TraceError(ReplayError):
    """Bad input; the message is one line naming file, column and first bad row."""


# frames smaller than this are encoded in one thread (a thread costs more than it saves)
PARALLEL_ROWS = 200_000


def run_both(first: Callable[[], A], second: Callable[[], B], *, parallel: bool = True) -> tuple[A, B]:
    """``(first(), second())``, ``second`` in a thread of its own when ``parallel``.
    Both always finish; an error of ``first`` wins over one of ``second``, so the
    error a user sees is the one the sequential order would give."""
    if not parallel:
        return first(), second()
    box: dict = {}

    def work() -> None:
        try:
            box["value"] = second()
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            box["error"] = err

    t = threading.Thread(target=work, name="trace-encode", daemon=True)
    t.start()
    try:
        a = first()
    finally:
        t.join()
    if "error" in box:
        raise box["error"]
    return a, box["value"]


def one_line(text: object) -> str:
    """``text`` squeezed onto one line of at most 300 characters."""
    out = " ".join(str(text).split())
    return out if len(out) <= 300 else out[:297] + "..."
