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

from replay.runs.names import REQUESTS, WORKERS
from replay.simulate.logs import LogError, RequestLog
from replay.trace.base import TraceError
from replay.trace.blocks import check_block_counts
from replay.trace.files import list_parts
from replay.trace.info import read_trace_info as read_checked_trace_info

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


def _int_column(df: pl.DataFrame, name: str, where: Path, *, nullable: bool = False) -> np.ndarray:
    col = df[name]
    if not (col.dtype.is_integer() or (nullable and col.dtype == pl.Null)):
        raise LogError(f"{where}: column {name!r}: must be an integer column, got {col.dtype}")
    if col.null_count() and not nullable:
        raise LogError(f"{where}: column {name!r} row {int(col.is_null().arg_max())}: null")
    a = col.cast(pl.Int64).fill_null(-1).to_numpy()
    bad = np.nonzero((a < 0) & col.is_not_null().to_numpy())[0]
    if bad.size:
        raise LogError(f"{where}: column {name!r} row {int(bad[0])}: must be >= 0, got {int(a[bad[0]])}")
    return a


def _float_column(df: pl.DataFrame, name: str, where: Path) -> np.ndarray:
    if name not in df.columns:
        return np.full(df.height, np.nan)
    col = df[name]
    if not (col.dtype.is_numeric() or col.dtype == pl.Null):
        raise LogError(f"{where}: column {name!r}: must be numeric, got {col.dtype}")
    a = col.cast(pl.Float64).to_numpy().astype(np.float64)
    bad = np.nonzero(~np.isnan(a) & ~((a >= 0) & np.isfinite(a)))[0]
    if bad.size:
        raise LogError(f"{where}: column {name!r} row {int(bad[0])}: must be finite and >= 0, "
                       f"got {a[bad[0]]}")
    return a


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

    The block size is ``trace.json``'s ``page_size``, else the workers'
    ``page_size``, else ``block_size``; with none of them the trace is refused.
    """
    d = Path(path)
    wk_path = d / WORKERS
    info = read_trace_info(d)
    req, rq_path = _table(d, "requests")
    if req is None:
        raise LogError(f"{rq_path}: file not found (nor a requests/ folder)")
    for c in REQUIRED:
        if c not in req.columns:
            raise LogError(f"{rq_path}: missing column {c!r} (a trace used as a request log needs "
                           f"{', '.join(REQUIRED)})")
    if "model" in req.columns and req["model"].drop_nulls().n_unique() > 1:
        names = sorted(req["model"].drop_nulls().unique().to_list())
        raise LogError(f"{rq_path}: column 'model': {len(names)} models ({', '.join(map(str, names[:3]))}"
                       f"{', ...' if len(names) > 3 else ''}); the simulator models one fleet of one model")
    if limit is not None:
        req = req.sort("ts", maintain_order=True).head(int(limit))
    workers = _read(wk_path)
    for c in ("worker", "dp_size"):
        if c not in workers.columns:
            raise LogError(f"{wk_path}: missing column {c!r}")
    page = info.get("page_size")
    if "page_size" in workers.columns and workers["page_size"].drop_nulls().len():
        pre = workers.filter(pl.col("role") != "decode") if "role" in workers.columns else workers
        pages = pre["page_size"].drop_nulls().unique().to_list()
        if len(pages) > 1:
            raise LogError(f"{wk_path}: column 'page_size': workers disagree ({sorted(pages)}); "
                           "one block size per trace is needed")
        if pages and page is not None and pages[0] != page:
            raise LogError(f"{d / 'trace.json'}: key 'page_size': {page!r} disagrees with "
                           f"workers.parquet page_size {pages[0]}")
        if pages and page is None:
            page = pages[0]
    if page is None:
        page = block_size
    if page is None:
        raise LogError(f"{d}: page size unknown (no trace.json page_size, no workers.parquet "
                       "page_size): pass --block-size")
    if not isinstance(page, int) or isinstance(page, bool) or page < 1:
        raise LogError(f"{d / 'trace.json'}: key 'page_size': must be an integer >= 1, got {page!r}")

    ts = _int_column(req, "ts", rq_path)
    L = _int_column(req, "input_tokens", rq_path)
    out = _int_column(req, "output_tokens", rq_path)
    hashes = req["hash_ids"]
    if not isinstance(hashes.dtype, (pl.List, pl.Array)):
        raise LogError(f"{rq_path}: column 'hash_ids': must be a list of int64, got {hashes.dtype}")
    if hashes.null_count():
        raise LogError(f"{rq_path}: column 'hash_ids' row {int(hashes.is_null().arg_max())}: null "
                       "(a request log needs every request's block hashes)")
    hashes = hashes.cast(pl.List(pl.Int64))
    inner_null = hashes.list.eval(pl.element().is_null().any()).list.first().fill_null(False)
    if inner_null.any():
        raise LogError(f"{rq_path}: column 'hash_ids' row {int(inner_null.arg_max())}: "
                       "null entry inside the list")
    sizes = hashes.list.len().to_numpy().astype(np.int64)
    counts = check_block_counts(sizes, L, page)
    if counts.bad is not None:
        raise LogError(f"{rq_path}: column 'hash_ids' row {counts.bad}: {counts.message}")
    flat = (hashes.explode().drop_nulls().to_numpy().astype(np.int64) if sizes.sum()
            else np.zeros(0, np.int64))
    off = np.zeros(req.height + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    t0 = int(ts.min()) if ts.size else 0
    log = RequestLog(ts - t0, L, out, off, flat, np.arange(req.height, dtype=np.int64), page, str(d))
    order = log.request_id  # trace row of each log position

    roles = (workers["role"].to_list() if "role" in workers.columns
             else ["plain"] * workers.height)
    urls_all = workers["worker"].to_list()
    dps = _int_column(workers, "dp_size", wk_path).tolist()
    pre = sorted((u, dp) for u, dp, r in zip(urls_all, dps, roles, strict=True) if r != "decode")
    if not pre:
        raise LogError(f"{wk_path}: no prefill or plain worker")
    urls = [u for u, _ in pre]
    index = {u: k for k, u in enumerate(urls)}
    if "selected_worker" in req.columns:
        sel = req["selected_worker"].to_list()
        placement = np.array([index.get(s, -1) if s is not None else -1 for s in sel],
                             dtype=np.int64)[order]
    else:
        placement = np.full(req.height, -1, dtype=np.int64)
    cached = (_int_column(req, "cached_tokens", rq_path, nullable=True)[order]
              if "cached_tokens" in req.columns else np.full(req.height, -1, dtype=np.int64))
    ttft = _float_column(req, "ttft_ms", rq_path)[order]
    lat = _float_column(req, "latency_ms", rq_path)[order]
    loads, _ld_path = _table(d, "loads")
    model = None
    if "model" in req.columns and req["model"].drop_nulls().len():
        model = str(req["model"].drop_nulls()[0])
    return RecordedTrace(d, log, urls, [int(dp) for _, dp in pre],
                         sum(1 for r in roles if r == "decode"), placement, cached, ttft, lat, t0,
                         loads, info, model)
