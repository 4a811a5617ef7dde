"""The decisions files of a run, in either layout, read back as one long table.

``decisions.parquet`` (and a sharded run's ``decisions/part-*.parquet``) come in
two layouts; ``run.json``'s ``decisions_layout`` says which a run has, and every
file says so itself in its Parquet key-value metadata (a file without the key,
as every earlier version wrote, is ``long``):

``long``
    one row per (request, config): :data:`LONG_COLUMNS`, request-major (the
    trace's order), configs in grid order inside each request.
``outcomes``
    one row per request: ``request_id``, ``query_blocks``, ``config_outcome``
    (a list with one entry per config, in grid order: the index of that
    config's outcome among the request's distinct outcomes) and every other
    long column as a list of the request's distinct outcomes' values.  The
    grid's config ids are in the metadata.  Most configs share a request's
    outcome, so the file holds a few outcomes a request instead of one row
    per config (:mod:`replay.kernels.outcomes`).

:func:`scan_decisions` reads either as the long table, exactly (same columns,
dtypes, values and row order); every reader of decisions goes through it:

    >>> import replay
    >>> replay.read_decisions("runs/x")            # polars DataFrame, one row per (request, config)
    >>> replay.read_decisions("runs/x", lazy=True).filter(pl.col("config_id") == 7)
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, overload

import numpy as np
import polars as pl
import pyarrow.parquet as pq
from polars.io.plugins import register_io_source

from replay.errors import ReplayError
from replay.kernels import outcomes
from replay.runs.names import DECISIONS, RUN_JSON

LONG = "long"
OUTCOMES = "outcomes"
LAYOUTS = (LONG, OUTCOMES)
"""The layouts ``sweep --decisions-layout`` writes (the first is the default)."""

LAYOUT_KEY = "router_replay.decisions_layout"
CONFIG_IDS_KEY = "router_replay.config_ids"
CODE_COLUMN = "config_outcome"
PER_REQUEST = ("request_id", "query_blocks")

BEFORE_QUERY_BLOCKS = ("worker", "reason", "policy_reason", "decision", "failure")
LONG_COLUMNS = (
    "request_id", "config_id", *BEFORE_QUERY_BLOCKS, "query_blocks", "matched_blocks", "selected_blocks",
    "uncached_tokens", "gate_rejected", "admission_evaluated", "admission_rejected", "best_rejected_blocks",
    "fleet_all_queued", "fell_back", "selected_waiting", "selected_waiting_uncached", "selected_queue_ms",
    "pressure_source", "guard_compared", "guard_overrides", "blocks_lost", "lost_to", "lost_candidates",
    "lost_queue_gate", "lost_capacity", "reorg_outcome",
)
"""The long table's columns, in order (a file from an earlier version may lack some)."""


def decision_files(run_dir: str | os.PathLike, run: Mapping | None = None) -> list[Path] | None:
    """The decisions files of a run: ``run.json``'s ``decisions`` (one file, or
    the list a sharded sweep writes), else ``decisions.parquet`` if present;
    None when the run kept no decisions (or a listed file is gone)."""
    p = Path(run_dir)
    if run is None:
        try:
            run = json.loads((p / RUN_JSON).read_text())
        except (OSError, ValueError):
            run = {}
    listed = run.get("decisions", DECISIONS) if isinstance(run, Mapping) else DECISIONS
    if not listed:
        return None
    files = [p / f for f in ([listed] if isinstance(listed, str) else listed)]
    return files if all(f.is_file() for f in files) else None


def outcomes_metadata(config_ids: Sequence[int]) -> dict[str, str]:
    """The key-value metadata of an ``outcomes`` file."""
    return {LAYOUT_KEY: OUTCOMES, CONFIG_IDS_KEY: json.dumps([int(c) for c in config_ids])}


def _meta(path: str | os.PathLike) -> tuple[pq.FileMetaData, str, list[int] | None]:
    md = pq.read_metadata(path)
    kv = md.metadata or {}
    layout = kv.get(LAYOUT_KEY.encode(), LONG.encode()).decode()
    if layout not in LAYOUTS:
        raise ValueError(f"decisions layout {layout!r} is not one this version reads ({', '.join(LAYOUTS)})")
    ids = json.loads(kv[CONFIG_IDS_KEY.encode()]) if layout == OUTCOMES else None
    return md, layout, ids


def layout_of(path: str | os.PathLike) -> str:
    """``long`` or ``outcomes``: the layout of one decisions file."""
    return _meta(path)[1]


def columns_of(path: str | os.PathLike) -> list[str]:
    """The long-table columns a decisions file holds, in order (either layout)."""
    md, layout, _ids = _meta(path)
    names = list(md.schema.to_arrow_schema().names)
    if layout == LONG:
        return names
    fields = [c for c in names if c not in (*PER_REQUEST, CODE_COLUMN)]
    return _long_order(["request_id", "config_id", "query_blocks", *fields])


def _long_order(names: Sequence[str]) -> list[str]:
    known = [c for c in LONG_COLUMNS if c in names]
    return known + [c for c in names if c not in known]


def file_info(path: str | os.PathLike) -> tuple[int, float, float]:
    """``(rows, smallest config_id, largest config_id)`` of one decisions file, from its
    footer (rows of the long table; ``-inf, inf`` when a long file keeps no statistics)."""
    md, layout, ids = _meta(path)
    if layout == OUTCOMES:
        assert ids is not None
        rows = md.num_rows * len(ids)
        return rows, (min(ids) if ids and rows else math.inf), (max(ids) if ids and rows else -math.inf)
    lo, hi = math.inf, -math.inf
    names = md.schema.names
    j = names.index("config_id") if "config_id" in names else None
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        st = rg.column(j).statistics if j is not None else None
        if rg.num_rows and (st is None or not st.has_min_max):  # no statistics: any config
            return md.num_rows, -math.inf, math.inf
        if rg.num_rows:
            lo, hi = min(lo, st.min), max(hi, st.max)
    return md.num_rows, lo, hi


def scan_file(path: str | os.PathLike, columns: Sequence[str] | None = None,
              rows: slice | None = None) -> pl.LazyFrame:
    """One decisions file as the long table (lazy): ``columns`` (default: all, in the
    long order), ``rows`` a slice of its long rows (read without decoding the rest)."""
    md, layout, ids = _meta(path)
    if layout == LONG:
        lf = pl.scan_parquet(path)
        if rows is not None:
            lf = lf.slice(rows.start, max(0, rows.stop - rows.start))
        return lf if columns is None else lf.select(columns)
    assert ids is not None
    schema = _outcomes_schema(path)
    want = list(schema) if columns is None else list(columns)
    missing = [c for c in want if c not in schema]
    if missing:
        raise pl.exceptions.ColumnNotFoundError(f"{path}: column '{missing[0]}' not in the decisions")
    span = None if rows is None else (max(0, rows.start), max(0, rows.stop))

    def source(with_columns, predicate, n_rows, _batch_size):
        cols = want if with_columns is None else [c for c in want if c in with_columns]
        need = cols if predicate is None else list(dict.fromkeys(
            [*cols, *[c for c in predicate.meta.root_names() if c in schema]]))
        left = n_rows
        for df in _decode(path, ids, need, span, md.num_rows):
            if predicate is not None:
                df = df.filter(predicate)
            df = df.select(cols)
            if left is not None:
                if left <= 0:
                    return
                df = df.head(left)
                left -= df.height
            yield df

    lf = register_io_source(source, schema={c: schema[c] for c in want}, is_pure=True,
                            explain_name="router-replay decisions (outcomes)", explain_detail=str(path))
    return lf


def _outcomes_schema(path: str | os.PathLike) -> dict[str, pl.DataType]:
    """The long table's schema of an ``outcomes`` file."""
    raw = pl.scan_parquet(path).collect_schema()
    out: dict[str, pl.DataType] = {}
    for name, dtype in raw.items():
        if name == CODE_COLUMN:
            continue
        out[name] = dtype if name in PER_REQUEST else dtype.inner  # type: ignore[attr-defined]
    out["config_id"] = pl.Int32()
    return {c: out[c] for c in _long_order(list(out))}


def _decode(path: str | os.PathLike, ids: list[int], cols: Sequence[str], span: tuple[int, int] | None,
            n_requests: int):
    """The long rows of an ``outcomes`` file, a row group at a time (only ``cols``; only
    the long rows ``span`` when given)."""

    n_cfg = len(ids)
    pf = pq.ParquetFile(path)
    listed = [c for c in cols if c not in (*PER_REQUEST, "config_id")]
    # the outcome counts come from any list column (every one holds a request's outcomes)
    counter = listed[0] if listed else next(c for c in pf.schema_arrow.names
                                            if c not in (*PER_REQUEST, CODE_COLUMN))
    read = list(dict.fromkeys([c for c in cols if c in PER_REQUEST] + [CODE_COLUMN, counter, *listed]))
    ids_pl = pl.Series("config_id", ids, dtype=pl.Int32)
    first = 0                                    # request index of the row group's first row
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        lo, hi = first * n_cfg, (first + n) * n_cfg
        first += n
        if span is not None and (span[1] <= lo or span[0] >= hi):
            continue
        raw = pl.from_arrow(pf.read_row_group(g, columns=read))
        assert isinstance(raw, pl.DataFrame)
        skip = 0
        if span is not None and n_cfg:          # decode only the requests the span touches
            r0 = max(span[0] - lo, 0) // n_cfg
            r1 = -(-(min(span[1], hi) - lo) // n_cfg)
            raw = raw.slice(r0, r1 - r0)
            lo, n = lo + r0 * n_cfg, r1 - r0
            skip = max(span[0] - lo, 0)
        codes = raw[CODE_COLUMN].explode().to_numpy().astype(np.int64)
        counts = raw[counter].list.len().to_numpy().astype(np.int64)
        gidx = pl.Series(outcomes.decode(codes.reshape(n, n_cfg), counts))
        per_req = np.repeat(np.arange(n, dtype=np.int64), n_cfg)
        out: dict[str, pl.Series] = {}
        for c in cols:
            if c == "config_id":
                out[c] = ids_pl.gather(np.tile(np.arange(n_cfg, dtype=np.int64), n))
            elif c in PER_REQUEST:
                out[c] = raw[c].gather(per_req)
            else:
                out[c] = raw[c].explode().gather(gidx)
        df = pl.DataFrame(out, height=n * n_cfg)
        if span is not None:
            df = df.slice(skip, max(0, min(span[1], lo + n * n_cfg) - lo - skip))
        yield df


def scan_decisions(files: Sequence[str | os.PathLike], columns: Sequence[str] | None = None) -> pl.LazyFrame:
    """Decisions files (a run's, in order) as one long table (lazy), whatever their layout."""
    files = list(files)
    if all(layout_of(f) == LONG for f in files):   # as every reader did before the outcomes layout
        lf = pl.scan_parquet(files)
        return lf if columns is None else lf.select(columns)
    parts = [scan_file(f, columns) for f in files]
    if len(parts) == 1:
        return parts[0]
    return pl.concat(parts, how="vertical_relaxed")


@overload
def read_decisions(run_dir: str | os.PathLike, columns: Sequence[str] | None = None, *,
                   lazy: Literal[False] = False) -> pl.DataFrame: ...
@overload
def read_decisions(run_dir: str | os.PathLike, columns: Sequence[str] | None = None, *,
                   lazy: Literal[True]) -> pl.LazyFrame: ...
def read_decisions(run_dir: str | os.PathLike, columns: Sequence[str] | None = None, *,
                   lazy: bool = False) -> pl.DataFrame | pl.LazyFrame:
    """A run's decisions as one polars DataFrame (``lazy``: a LazyFrame), one row per
    (request, config) in the trace's order (either layout; the same frame
    ``pl.read_parquet`` gives of a ``long`` file).  Raises
    :class:`replay.errors.ReplayError` when the run kept none."""

    files = decision_files(Path(run_dir))
    if not files:
        raise ReplayError(f"{run_dir}: the run kept no decisions (swept with --no-decisions)")
    lf = scan_decisions(files, columns)
    return lf if lazy else lf.collect()
