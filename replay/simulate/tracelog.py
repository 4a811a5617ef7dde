"""A recorded trace directory as the simulator's input.

:func:`read_trace_log` reads ``requests.parquet`` / ``workers.parquet`` /
``loads.parquet`` / ``trace.json`` of a router-replay trace with polars (a
``requests/`` or ``loads/`` folder of parts too: trace sets, as ``record`` and
``import`` write them; the parts are listed by :func:`replay.trace.files.list_parts`)
and checks each request's block ids against its length with the one block-count
rule (:mod:`replay.trace.blocks`). It needs only the columns a request log
needs, not the router-side columns a sweep replays, and returns a
:class:`RecordedTrace`: the :class:`RequestLog` the simulator consumes
(arrivals, ``input_tokens``, ``output_tokens``, ``hash_ids`` with the trace's
page size as block size), where production placed every request, what it
observed (``cached_tokens``, ``ttft_ms``, ``latency_ms``) and its load samples.

Worker ``k`` of a simulated fleet stands for the ``k``-th prefill (or plain)
worker of the trace in URL order; that is how forced placement and the
comparisons map the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay import labels
from replay.errors import ParamsError
from replay.runs.names import REQUESTS, TRACE_JSON, WORKERS
from replay.simulate.logs import LogError, RequestLog
from replay.trace.base import TraceError
from replay.trace.blocks import check_block_counts
from replay.trace.columns import Columns
from replay.trace.encode import ClosedLoopColumns, load_specs, read_closed_loop, unique_request_ids
from replay.trace.files import list_parts
from replay.trace.info import read_trace_info as read_checked_trace_info
from replay.trace.workers import parse_workers_table

REQUIRED = ("ts", "input_tokens", "hash_ids", "output_tokens")


@dataclass
class RecordedTrace:
    """A trace directory read for calibration, validation and simulation.

    Per-request arrays are in the log's (arrival) order: ``placement[i]`` is
    the index of the prefill worker production chose for request ``i`` (-1:
    none recorded or not routed); ``cached_tokens`` -1, ``ttft_ms`` /
    ``latency_ms`` NaN where not recorded.  ``t0_ns`` is the trace time of the
    log's zero.
    """

    path: Path
    log: RequestLog
    urls: list[str]
    dp_sizes: list[int]
    decode_peers: int
    placement: np.ndarray
    cached_tokens: np.ndarray
    ttft_ms: np.ndarray
    latency_ms: np.ndarray
    t0_ns: int
    loads: pl.DataFrame | None
    info: dict[str, Any] = field(default_factory=dict)
    model: str | None = None

    @property
    def router_flags(self) -> dict[str, Any]:
        return dict(self.info.get("router") or {})

    @property
    def has_outcomes(self) -> dict[str, bool]:
        return {"cached_tokens": bool((self.cached_tokens >= 0).any()),
                "ttft_ms": bool(np.isfinite(self.ttft_ms).any()),
                "latency_ms": bool(np.isfinite(self.latency_ms).any()),
                "selected_worker": bool((self.placement >= 0).any())}


def is_trace_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / REQUESTS).is_file() or (p / "requests").is_dir())


def _table(d: Path, kind: str) -> tuple[pl.DataFrame | None, Path]:
    """Table ``kind`` of trace directory ``d``, one file or a folder of parts (concatenated in
    path order; rows are numbered through the concatenation), and the path errors name."""
    try:
        parts = list_parts(str(d), kind)
    except TraceError as err:
        raise LogError(str(err)) from None
    if not parts:
        return None, d / f"{kind}.parquet"
    if len(parts) == 1 and parts[0].name == f"{kind}.parquet":
        return _read(Path(parts[0].path)), Path(parts[0].path)
    frames = []
    for part in parts:
        try:
            frames.append(pl.read_parquet(part.path, hive_partitioning=False))
        except Exception as err:  # noqa: BLE001 - polars/pyarrow raise many kinds; one line for the user
            raise LogError(f"{part.path}: cannot read: {str(err).splitlines()[0]}") from None
    try:
        return pl.concat(frames, how="diagonal_relaxed"), d / kind
    except Exception as err:  # noqa: BLE001 - parts whose columns cannot be put together
        raise LogError(f"{d / kind}: parts do not fit together: {str(err).splitlines()[0]}") from None


def _read(p: Path) -> pl.DataFrame:
    if not p.is_file():
        raise LogError(f"{p}: file not found")
    try:
        return pl.read_parquet(p)
    except Exception as err:  # noqa: BLE001 - polars/pyarrow raise many kinds; one line for the user
        raise LogError(f"{p}: cannot read: {str(err).splitlines()[0]}") from None


def _request_columns(R: Columns) -> tuple[np.ndarray, np.ndarray, ClosedLoopColumns]:
    """``ts``, ``input_tokens`` and the closed-loop columns of a request frame, checked by the
    trace reader's own column rules (:func:`replay.trace.encode.read_closed_loop`: cached above
    input, ttft above latency, NaN, hash ids that are not int64, counts past 2**53), plus what a
    request log needs besides: every request's ``output_tokens`` and ``hash_ids``."""
    for c in REQUIRED:
        if not R.has(c):
            raise LogError(f"{R.name}: missing column {c!r} (a trace used as a request log needs "
                           f"{', '.join(REQUIRED)})")
    ts = R.timestamps("ts")
    L = R.ints("input_tokens", nullable=False)
    cl = read_closed_loop(R, L)
    assert cl.output_tokens is not None and cl.hash_known is not None   # REQUIRED columns
    if (cl.output_tokens < 0).any():
        R.fail("output_tokens", "null (a request log needs every request's output length)",
               int(np.argmax(cl.output_tokens < 0)))
    if not cl.hash_known.all():
        R.fail("hash_ids", "null (a request log needs every request's block hashes)",
               int(np.argmin(cl.hash_known)))
    if R.has("selected_worker"):
        R.strings("selected_worker", nullable=True)
    if R.has("request_id"):
        unique_request_ids(R)
    return ts, L, cl


def _checked_loads(loads: pl.DataFrame | None, where: Path) -> pl.DataFrame | None:
    """The load samples checked by the trace reader's rules for them (a ``dp_rank`` column is
    optional: rank 0, as the trace reader takes it), ``ts`` as int64 nanoseconds."""
    if loads is None:
        return None
    L = Columns(str(where), loads)
    ts = L.timestamps("ts")
    L.strings("worker", nullable=False)
    L.int_columns(load_specs())
    loads = loads.with_columns(pl.Series("ts", ts, dtype=pl.Int64))
    if "dp_rank" not in loads.columns:
        loads = loads.with_columns(pl.lit(0, dtype=pl.Int64).alias("dp_rank"))
    return loads


def read_trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """``trace.json`` of a trace directory as a plain dict ({} without one), read and checked by the
    one reader of that file, :func:`replay.trace.info.read_trace_info` (router flags by knob name)."""
    info = read_checked_trace_info(path)
    if info.path is None:
        return {}
    out: dict[str, Any] = {"router": dict(info.router), "per_dp_rank": info.per_dp_rank, "extra": dict(info.extra)}
    if info.page_size is not None:
        out["page_size"] = info.page_size
    if info.source is not None:
        out["source"] = info.source
    return out


def read_trace_log(path: str | os.PathLike, *, block_size: int | None = None,
                   limit: int | None = None) -> RecordedTrace:
    """Read a trace directory as a request log plus what production recorded.

    Every column present is checked by the trace reader's rules (``validate``'s), without
    requiring the router-side columns.  The block size is ``trace.json``'s ``page_size``, else
    the workers' ``page_size``, else ``block_size``; with none of them the trace is refused.
    """
    d = Path(path)
    wk_path = d / WORKERS
    info = read_trace_info(d)
    req, rq_path = _table(d, "requests")
    if req is None:
        raise LogError(f"{rq_path}: file not found (nor a requests/ folder)")
    R = Columns(str(rq_path), req)
    ts, L, cl = _request_columns(R)
    if "model" in req.columns:
        models = R.strings("model", nullable=True).drop_nulls()
        if models.n_unique() > 1:
            names = sorted(models.unique().to_list())
            R.fail("model", f"{len(names)} models ({', '.join(map(str, names[:3]))}"
                   f"{', ...' if len(names) > 3 else ''}); the simulator models one fleet of one model")
    if limit is not None and int(limit) < req.height:
        req = req.with_columns(pl.Series("ts", ts, dtype=pl.Int64)).sort("ts", maintain_order=True)
        req = req.head(int(limit))
        R = Columns(str(rq_path), req)
        ts, L, cl = _request_columns(R)
    workers = _read(wk_path)
    for c in ("worker", "dp_size"):
        if c not in workers.columns:
            raise LogError(f"{wk_path}: missing column {c!r}")
    table = parse_workers_table(workers)
    unknown_dp = np.nonzero(table.dp_sizes <= 0)[0]
    if unknown_dp.size:
        raise LogError(f"{wk_path}: column 'dp_size' row {int(unknown_dp[0])}: null (a simulated fleet needs "
                       "each worker's dp_size)")
    page = info.get("page_size")
    prefill = table.roles != labels.ROLE_DECODE
    pages = sorted(set(table.page_sizes[prefill & (table.page_sizes > 0)].tolist()))
    if len(pages) > 1:
        raise LogError(f"{wk_path}: column 'page_size': workers disagree ({pages}); "
                       "one block size per trace is needed")
    if pages and page is not None and pages[0] != page:
        raise LogError(f"{d / TRACE_JSON}: key 'page_size': {page!r} disagrees with "
                       f"workers.parquet page_size {pages[0]}")
    if pages and page is None:
        page = pages[0]
    if page is None:
        page = block_size
    if page is None:
        raise ParamsError("{d}: page size unknown (no trace.json page_size, no workers.parquet page_size): "
                          "pass {block_size}", "block_size", d=d)

    assert cl.hash_offsets is not None and cl.hash_values is not None and cl.output_tokens is not None
    sizes = np.diff(cl.hash_offsets)
    counts = check_block_counts(sizes, L, page)
    if counts.bad is not None:
        R.fail("hash_ids", counts.message, counts.bad)
    t0 = int(ts.min()) if ts.size else 0
    log = RequestLog(ts - t0, L, cl.output_tokens, cl.hash_offsets, cl.hash_values,
                     np.arange(req.height, dtype=np.int64), page, str(d))
    order = log.request_id  # trace row of each log position

    pre = sorted((u, int(dp)) for u, dp, r in zip(table.names, table.dp_sizes.tolist(), prefill.tolist(),
                                                   strict=True) if r)
    if not pre:
        raise LogError(f"{wk_path}: no prefill or plain worker")
    urls = [u for u, _ in pre]
    index = {u: k for k, u in enumerate(urls)}
    if "selected_worker" in req.columns:
        sel = req["selected_worker"].cast(pl.String).to_list()
        placement = np.array([index.get(s, -1) if s is not None else -1 for s in sel],
                             dtype=np.int64)[order]
    else:
        placement = np.full(req.height, -1, dtype=np.int64)
    n = req.height
    cached = (cl.cached_tokens if cl.cached_tokens is not None else np.full(n, -1, dtype=np.int64))[order]
    ttft = (cl.ttft_ms if cl.ttft_ms is not None else np.full(n, np.nan))[order]
    lat = (cl.latency_ms if cl.latency_ms is not None else np.full(n, np.nan))[order]
    loads, ld_path = _table(d, "loads")
    loads = _checked_loads(loads, ld_path)
    model = None
    if "model" in req.columns and req["model"].drop_nulls().len():
        model = str(req["model"].drop_nulls()[0])
    return RecordedTrace(d, log, urls, [dp for _, dp in pre], int((~prefill).sum()), placement, cached, ttft,
                         lat, t0, loads, info, model)
