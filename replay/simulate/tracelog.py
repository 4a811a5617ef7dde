"""A recorded trace directory as the simulator's input.

:func:`read_trace_log` reads a router-replay trace's requests through the
trace reader (:func:`replay.trace.load_trace` and
:func:`~replay.trace.trace_request_log`: every check it makes, the block-count
rule included), ``workers.parquet`` and ``loads.parquet`` (or a ``loads/``
folder of parts: trace sets, as ``record`` and ``import`` write them, are read
wherever a trace directory is) for the fleet and the samples, and returns a
:class:`RecordedTrace`: the :class:`RequestLog` the simulator consumes
(arrivals, ``input_tokens``, ``output_tokens``, ``hash_ids`` with the trace's
page size as block size), where production placed every request, what it
observed (``cached_tokens``, ``ttft_ms``, ``latency_ms``) and its load samples.

Worker ``k`` of a simulated fleet stands for the ``k``-th prefill (or plain)
worker of the trace in URL order; that is how forced placement and the
comparisons map the two.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.simulate.logs import LogError, RequestLog
from replay.trace import load_trace, trace_request_log
from replay.trace.base import TraceError
from replay.trace.files import list_parts

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
    return p.is_dir() and ((p / "requests.parquet").is_file() or (p / "requests").is_dir())


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


def read_trace_info(path: str | os.PathLike) -> dict[str, Any]:
    """``trace.json`` of a trace directory ({} without one); one line on a bad file."""
    p = Path(path) / "trace.json"
    if not p.is_file():
        return {}
    try:
        info = json.loads(p.read_text())
    except ValueError as err:
        raise LogError(f"{p}: cannot parse: {str(err).splitlines()[0]}") from None
    if not isinstance(info, dict):
        raise LogError(f"{p}: expected a JSON object")
    if not isinstance(info.get("router", {}), dict):
        raise LogError(f"{p}: key 'router': must be an object of router flags")
    return info


def read_trace_log(path: str | os.PathLike, *, block_size: int | None = None,
                   limit: int | None = None) -> RecordedTrace:
    """Read a trace directory as a request log plus what production recorded.

    The block size is ``trace.json``'s ``page_size``, else the workers'
    ``page_size``, else ``block_size``; with none of them the trace is refused.
    """
    d = Path(path)
    wk_path = d / "workers.parquet"
    info = read_trace_info(d)
    rq_path = d / "requests.parquet"
    if not rq_path.is_file():
        rq_path = d / "requests"
        if not rq_path.is_dir():
            raise LogError(f"{d / 'requests.parquet'}: file not found (nor a requests/ folder)")
    # the requests through the trace reader: every check load_trace makes, the block-count
    # rule included (full-blocks-only lists completed), in time order
    tr = load_trace(d)
    for c, col in (("hash_ids", tr.hash_offsets), ("output_tokens", tr.req_output_tokens)):
        if col is None:
            raise LogError(f"{rq_path}: missing column {c!r} (a trace used as a request log needs "
                           f"{', '.join(REQUIRED)})")
    req = trace_request_log(tr)
    if req["model"].n_unique() > 1:
        names = sorted(req["model"].unique().to_list())
        raise LogError(f"{rq_path}: column 'model': {len(names)} models ({', '.join(map(str, names[:3]))}"
                       f"{', ...' if len(names) > 3 else ''}); the simulator models one fleet of one model")
    if limit is not None:
        req = req.head(int(limit))
    workers = _read(wk_path)
    for c in ("worker", "dp_size"):
        if c not in workers.columns:
            raise LogError(f"{wk_path}: missing column {c!r}")
    pages = req["page_size"].drop_nulls().unique().to_list()
    page = int(pages[0]) if pages else block_size
    if page is None:
        raise LogError(f"{d}: page size unknown (no trace.json page_size, no workers.parquet "
                       "page_size): pass --block-size")
    for c in ("hash_ids", "output_tokens"):
        if req[c].null_count():
            raise LogError(f"{rq_path}: column {c!r}: {req[c].null_count()} requests have none (a request "
                           "log needs every request's block hashes and output length)")
    ts = req["ts"].to_numpy()
    L = req["input_tokens"].to_numpy()
    out = req["output_tokens"].to_numpy()
    hashes = req["hash_ids"]
    sizes = hashes.list.len().to_numpy().astype(np.int64)
    flat = (hashes.explode().drop_nulls().to_numpy().astype(np.int64) if sizes.sum()
            else np.zeros(0, np.int64))
    off = np.zeros(req.height + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    t0 = int(ts.min()) if ts.size else 0
    # (with the page from --block-size, the rule is applied by RequestLog itself)
    log = RequestLog(ts - t0, L, out, off, flat, np.arange(req.height, dtype=np.int64), page, str(d))
    log.partial_blocks_added += int(tr.facts.hash_ids_full_blocks_only or 0)
    order = log.request_id  # time-order row of each log position (the identity: already sorted)

    roles = (workers["role"].to_list() if "role" in workers.columns
             else ["plain"] * workers.height)
    urls_all = workers["worker"].to_list()
    dps = _int_column(workers, "dp_size", wk_path).tolist()
    pre = sorted((u, dp) for u, dp, r in zip(urls_all, dps, roles, strict=True) if r != "decode")
    if not pre:
        raise LogError(f"{wk_path}: no prefill or plain worker")
    urls = [u for u, _ in pre]
    index = {u: k for k, u in enumerate(urls)}
    sel = req["selected_worker"].to_list()
    placement = np.array([index.get(w, -1) if w is not None else -1 for w in sel], dtype=np.int64)[order]
    cached = req["cached_tokens"].fill_null(-1).to_numpy().astype(np.int64)[order]
    ttft = req["ttft_ms"].fill_null(np.nan).to_numpy().astype(np.float64)[order]
    lat = req["latency_ms"].fill_null(np.nan).to_numpy().astype(np.float64)[order]
    loads, _ld_path = _table(d, "loads")
    model = str(req["model"][0]) if req.height else None
    return RecordedTrace(d, log, urls, [int(dp) for _, dp in pre],
                         sum(1 for r in roles if r == "decode"), placement, cached, ttft, lat, t0,
                         loads, info, model)
