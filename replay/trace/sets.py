"""Trace sets: a trace read window by window, in memory bounded by the window.

:class:`TraceSet` is the lazy form of a trace directory (either layout, see
``files``).  ``TraceSet.open`` reads only the ``ts`` column (and the few
columns that fix worker ids and models) once, building an index of row groups,
per-second row counts and the trace's worker universe.  ``iter_windows`` then
yields each time window ``[t0, t1)`` that holds at least one row as an ordinary
:class:`Trace` holding the window's requests, the window's load samples, and
the carry (``carry``), so a window decides every request exactly as the whole
trace does while memory is bound by the window.  Windows are found from the
rows' seconds, never from the time span: one outlier timestamp costs one window.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import polars as pl

from replay.trace.base import (
    DEFAULT_MODEL,
    LOAD_FIELDS,
    MAX_DP_SIZE,
    NS,
    REQUESTS,
    WORKERS,
    TraceError,
)
from replay.trace.carry import carry_of, carry_of_columns, concat_columns, with_carry
from replay.trace.columns import Columns
from replay.trace.core import Trace
from replay.trace.files import (
    Frames,
    Group,
    Part,
    concat,
    file_info,
    locator,
    open_parquet,
    parts_or_fail,
    read_part,
    read_table_file,
    require_dir,
    to_frame,
)
from replay.trace.info import TraceInfo, read_trace_info
from replay.trace.load import build_trace
from replay.trace.workers import (
    Universe,
    fleet_dp_sizes,
    fleet_members,
    make_universe,
    parse_workers_table,
)


def _ts_ns(part: Part, df: pl.DataFrame, offset: int) -> np.ndarray:
    return Columns(part.name, df, lambda r: (part.name, offset + r)).timestamps("ts")


def _scan(part: Part, cols: list[str]):
    """Yield ``(frame of cols + ts, ts in ns)`` per row group of a file, filling
    ``part.rows`` and ``part.groups`` (the index) as it goes."""
    pf = open_parquet(part)
    if "ts" not in pf.schema_arrow.names:
        raise TraceError(f"{part.name}: column 'ts': missing (required column)")
    for g in range(pf.metadata.num_row_groups):
        df = to_frame(part, pf.read_row_group(g, columns=["ts", *cols]), part.rows)
        ts = _ts_ns(part, df, part.rows)
        if ts.size:
            if part.sorted and (bool(np.any(ts[1:] < ts[:-1]))
                                or (part.groups and int(ts[0]) < part.groups[-1].last)):
                part.sorted = False
            part.groups.append(Group(part.rows, int(ts.size), int(ts.min()), int(ts.max()), int(ts[-1]), g))
        part.rows += df.height
        yield df, ts


# ---------------------------------------------------------------------------
# the lazy trace set
# ---------------------------------------------------------------------------
@dataclass
class Window:
    """One time window of a trace set, ready for the engine."""

    index: int
    t0: int                 # ns, inclusive
    t1: int                 # ns, exclusive
    trace: Trace            # the window's requests; its loads = carry + the window's samples
    first_request: int      # request index of the window's first request (whole trace)
    carry_rows: int         # load samples carried in from before t0


@dataclass
class TraceSet:
    """A trace directory indexed for window-by-window replay (see the module doc)."""

    path: str
    requests: list[Part]
    loads: list[Part]
    workers_df: pl.DataFrame | None
    universe: Universe
    files: dict[str, dict]
    n_requests: int
    n_load_rows: int
    ts_min: int | None        # over requests and loads
    ts_max: int | None
    req_seconds: np.ndarray   # int64: distinct floor(ts / 1 s) of requests, ascending
    req_counts: np.ndarray    # int64: requests in each of those seconds
    max_rank: int             # largest dp_rank seen in loads (-1: none)
    worker_ranks: dict[int, int]  # worker id -> largest dp_rank seen
    model_counts: dict[str, int]
    has_selected: bool = False  # some requests file has a selected_worker column
    # int64: distinct floor(ts / 1 s) of every row (requests and loads), ascending:
    # the windows that hold data (``window_bounds``)
    row_seconds: np.ndarray | None = None
    info: TraceInfo | None = None   # trace.json

    # -- opening --------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, hash_files: bool = True) -> TraceSet:
        """Index a trace directory: one pass over ``ts`` and the columns that
        fix worker ids and models; nothing else is read."""
        dirpath = os.fspath(path)
        require_dir(dirpath)
        req_parts = parts_or_fail(dirpath, "requests")
        load_parts = parts_or_fail(dirpath, "loads")
        info = read_trace_info(dirpath)
        wk_df, wk_info = read_table_file(dirpath, WORKERS)
        table = parse_workers_table(wk_df) if wk_df is not None else None
        files = {}
        for p in (*req_parts, *load_parts):
            files[p.name] = (file_info(p.path, digest=hash_files))
        if wk_df is not None:
            files[WORKERS] = wk_info
        seconds: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        models: dict[str, int] = {}
        match_names: set[str] = set()
        n_req = 0
        has_selected = False
        for part in req_parts:
            names = open_parquet(part).schema_arrow.names
            has_selected |= "selected_worker" in names
            cols = [c for c in ("model",) if c in names]
            if table is None and "matches" in names:
                cols.append("matches")
            for df, ts in _scan(part, cols):
                if ts.size:
                    s, c = np.unique(np.floor_divide(ts, NS), return_counts=True)
                    seconds.append(s)
                    counts.append(c)
                if "model" in df.columns:
                    col = df.get_column("model")
                    if col.dtype not in (pl.String, pl.Null):
                        raise TraceError(f"{part.name}: column 'model': wrong type {col.dtype}, "
                                         f"expected a string type")
                    for name, c in col.cast(pl.String).fill_null(DEFAULT_MODEL).value_counts().iter_rows():
                        models[name] = models.get(name, 0) + int(c)
                else:
                    models[DEFAULT_MODEL] = models.get(DEFAULT_MODEL, 0) + df.height
                if "matches" in df.columns and df.height:
                    try:
                        ent = df.get_column("matches").explode().struct.field("worker")
                        match_names.update(x for x in ent.drop_nulls().unique().to_list())
                    except Exception:  # noqa: BLE001 - any failure here is reported when its window is read
                        pass  # a malformed column is reported when its window is read
            n_req += part.rows
        load_names: set[str] = set()
        ranks: dict[str, int] = {}
        big_rank: dict[str, tuple[str, int, int]] = {}   # worker -> first (file, row, rank) >= MAX_DP_SIZE
        load_seconds: list[np.ndarray] = []
        n_load = 0
        for part in load_parts:
            names = open_parquet(part).schema_arrow.names
            if "worker" not in names and "worker" not in part.hive:
                raise TraceError(f"{part.name}: column 'worker': missing (required column)")
            for df, ts in _scan(part, [c for c in ("worker", "dp_rank") if c in names]):
                if not ts.size:
                    continue
                load_seconds.append(np.unique(np.floor_divide(ts, NS)))
                if "dp_rank" in df.columns:
                    _note_big_ranks(part, part.rows - df.height, df, big_rank)
                rk = pl.col("dp_rank").fill_null(0) if "dp_rank" in df.columns else pl.lit(0)
                for w, r in df.group_by("worker").agg(rk.max().alias("r")).iter_rows():
                    if w is None:
                        continue
                    load_names.add(w)
                    ranks[w] = max(ranks.get(w, -1), -1 if r is None else int(r))
            n_load += part.rows
        lo = [g.ts_min for p in (*req_parts, *load_parts) for g in p.groups]
        hi = [g.ts_max for p in (*req_parts, *load_parts) for g in p.groups]
        universe = make_universe(table, load_names, match_names, list(models), info.page_size)
        pos = {w: i for i, w in enumerate(universe.workers)}
        for w, (name, row, rank) in sorted(big_rank.items(), key=lambda kv: kv[1][:2]):
            if universe.worker_dp[pos[w]] <= 0:
                raise TraceError(f"{name}: column 'dp_rank' row {row}: must be < {MAX_DP_SIZE} on a worker "
                                 f"without a dp_size in workers.parquet (its ranks set its dp_size, at most "
                                 f"{MAX_DP_SIZE}), got {rank}")
        if seconds:
            s_all = np.concatenate(seconds)
            c_all = np.concatenate(counts)
            req_seconds, inv = np.unique(s_all, return_inverse=True)
            req_counts = np.bincount(inv, weights=c_all).astype(np.int64)
        else:
            req_seconds = req_counts = np.zeros(0, dtype=np.int64)
        row_seconds = np.unique(np.concatenate([req_seconds, *load_seconds])).astype(np.int64)
        return cls(os.path.abspath(dirpath), req_parts, load_parts, wk_df, universe, files, n_req, n_load,
                   min(lo) if lo else None, max(hi) if hi else None, req_seconds, req_counts,
                   max(ranks.values(), default=-1), {pos[w]: r for w, r in ranks.items()},
                   {m: models[m] for m in sorted(models)}, has_selected, row_seconds, info)

    def hashed_files(self) -> dict[str, dict]:
        """``files`` with every file's sha256 (provenance; reads every byte once)."""
        return {name: (info if "sha256" in info else file_info(info["path"]))
                for name, info in self.files.items()}

    # -- Trace-like facts -----------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return self.universe.workers

    @property
    def models(self) -> list[str]:
        return self.universe.models

    @property
    def n_workers(self) -> int:
        return len(self.universe.workers)

    def fleet(self, model: int) -> np.ndarray:
        u = self.universe
        return fleet_members(u.has_table, u.worker_model, u.worker_role, model)

    def fleet_dp_sizes(self) -> dict[int, int]:
        """As ``Trace.fleet_dp_sizes``: the table's dp_size, else the ranks observed."""
        return fleet_dp_sizes(self, self.universe.worker_dp, lambda w: self.worker_ranks.get(w, -1))

    def requests_before(self, t_ns: int) -> int:
        """Requests with ts < ``t_ns`` (``t_ns`` a whole second)."""
        if t_ns % NS:
            raise ValueError("window boundaries are whole seconds")
        k = int(np.searchsorted(self.req_seconds, t_ns // NS, side="left"))
        return int(self.req_counts[:k].sum())

    # -- windows --------------------------------------------------------------
    def window_bounds(self, window_ns: int) -> list[tuple[int, int]]:
        """Epoch-aligned windows ``[k*w, (k+1)*w)`` covering every request and
        sample; windows without any row are left out, so the list (and the
        cost of iterating it) grows with the data, never with the time span."""
        if window_ns < NS or window_ns % NS:
            raise ValueError("the window must be a whole number of seconds (>= 1 s)")
        if self.ts_min is None:
            return []
        # floor(floor(ts / 1 s) / w_s) == floor(ts / w): the seconds index is exact
        ks = np.unique(np.floor_divide(self.row_seconds, window_ns // NS))
        return [(int(k) * window_ns, (int(k) + 1) * window_ns) for k in ks]

    def read_window(self, t0: int, t1: int, *, cache: _GroupCache | None = None) -> Frames:
        """The rows with ``t0 <= ts < t1`` of every file, in file order (a Frames)."""
        req_df, req_name, req_loc = self._read_rows(self.requests, t0, t1, cache)
        load_df, load_name, load_loc = self._read_rows(self.loads, t0, t1, cache)
        return Frames(self.path, req_df, load_df, self.workers_df, self.files, req_name, load_name,
                      req_loc, load_loc)

    def _read_rows(self, parts: list[Part], t0: int, t1: int, cache):
        dfs, pidx, rows = [], [], []
        for i, part in enumerate(parts):
            for g in part.groups:
                gi = g.index
                if g.ts_max < t0 or g.ts_min >= t1:
                    continue
                df, ts = (cache.get(part, gi, g) if cache is not None and g.ts_max >= t1
                          else cache.pop(part, gi, g) if cache is not None
                          else self._group(part, gi, g))
                keep = np.nonzero((ts >= t0) & (ts < t1))[0]
                if keep.size == 0:
                    continue
                dfs.append(df if keep.size == df.height else df[keep])
                pidx.append(np.full(keep.size, i, dtype=np.int64))
                rows.append(g.offset + keep)
        if cache is not None:
            cache.drop_before(t1)
        names = [p.name for p in parts]
        if not dfs:
            df = read_part(parts[0], [])
            return df, parts[0].name, locator(names, np.zeros(0, np.int64), np.zeros(0, np.int64))
        used = [parts[int(p[0])] for p in pidx]
        # errors without a row name the window's first file (type errors that
        # differ between files name the later one, in _concat)
        return (concat(used, dfs), used[0].name,
                locator(names, np.concatenate(pidx), np.concatenate(rows)))

    @staticmethod
    def _group(part: Part, gi: int, g: Group):
        df = read_part(part, [gi], g.offset)
        return df, _ts_ns(part, df, g.offset)

    def iter_windows(self, window_ns: int, *, model: str | None = None,
                     carry: dict | None = None, bounds: list[tuple[int, int]] | None = None,
                     first_request: int | None = None, facts: bool = False) -> Iterator[Window]:
        """Yield the windows in time order, each a Trace with its carry.

        ``bounds``/``carry``/``first_request`` start part-way (a shard): the
        carry at the first bound (from :meth:`carries`) and the request
        index of its first request.  ``facts`` computes each window's data
        facts (``validate``), which the replay does not need.
        """
        if model is not None and model not in self.model_counts:
            raise TraceError(f"{REQUESTS}: column 'model': no request has model {model!r} "
                             f"(models: {', '.join(self.models)})")
        bounds = self.window_bounds(window_ns) if bounds is None else bounds
        offset = self.requests_before(bounds[0][0]) if first_request is None and bounds else (first_request or 0)
        cache = _GroupCache()
        for k, (t0, t1) in enumerate(bounds):
            fr = self.read_window(t0, t1, cache=cache)
            n_all = fr.requests.height
            tr = build_trace(fr, model=model, universe=self.universe, index_offset=offset,
                             strict_model=False, facts=facts, info=self.info)
            del fr                      # the frames go before the window is replayed
            n_carry = 0 if carry is None else int(carry["load_ts"].shape[0])
            tr = with_carry(tr, carry)
            carry = carry_of(tr)
            win = Window(k, t0, t1, tr, offset, n_carry)
            del tr
            yield win
            del win                     # nothing of a window outlives its turn here
            offset += n_all

    def carries(self, bounds: list[tuple[int, int]]) -> list[dict | None]:
        """The carry at the start of every window of ``bounds`` (a pass over the
        load samples only): what independent shards start from."""
        out: list[dict | None] = []
        carry = None
        cache = _GroupCache()
        for t0, t1 in bounds:
            out.append(carry)
            load_df, name, locate = self._read_rows(self.loads, t0, t1, cache)
            loads = encode_loads(self, load_df, name, locate)
            carry = carry_of_columns(concat_columns(carry, loads))
        return out


class _GroupCache:
    """Decoded row groups kept while later windows still need them (windows
    come in time order, so a group is dropped once a window starts past it)."""

    MAX_ROWS = 8_000_000

    def __init__(self):
        self.items: dict[tuple[str, int], tuple[Group, pl.DataFrame, np.ndarray]] = {}
        self.rows = 0

    def get(self, part: Part, gi: int, g: Group):
        key = (part.path, gi)
        hit = self.items.get(key)
        if hit is not None:
            return hit[1], hit[2]
        df, ts = TraceSet._group(part, gi, g)
        if self.rows + df.height <= self.MAX_ROWS:
            self.items[key] = (g, df, ts)
            self.rows += df.height
        return df, ts

    def pop(self, part: Part, gi: int, g: Group):
        """A group no later window needs: taken out of the cache (or read)."""
        hit = self.items.pop((part.path, gi), None)
        if hit is None:
            return TraceSet._group(part, gi, g)
        self.rows -= hit[1].height
        return hit[1], hit[2]

    def drop_before(self, t: int) -> None:
        for key in [k for k, (g, _d, _t) in self.items.items() if g.ts_max < t]:
            self.rows -= self.items.pop(key)[1].height


def encode_loads(tset: TraceSet, load_df: pl.DataFrame, name: str, locate) -> dict:
    """Load rows alone, encoded (and checked) as a Trace would hold them."""
    empty_req = pl.DataFrame({"ts": pl.Series([], dtype=pl.Int64), "request_id": pl.Series([], dtype=pl.String),
                              "input_tokens": pl.Series([], dtype=pl.Int64),
                              "query_blocks": pl.Series([], dtype=pl.Int64),
                              "matches": pl.Series([], dtype=pl.List(pl.Struct({"worker": pl.String,
                                                                                "blocks": pl.Int64})))})
    fr = Frames(tset.path, empty_req, load_df, tset.workers_df, tset.files, REQUESTS, name, None, locate)
    tr = build_trace(fr, universe=tset.universe)
    return {f: getattr(tr, f) for f in LOAD_FIELDS}


def _note_big_ranks(part: Part, offset: int, df: pl.DataFrame, out: dict) -> None:
    """Record, per worker, the first row of ``df`` (a row group at file row
    ``offset``) whose ``dp_rank`` is at least ``MAX_DP_SIZE``."""
    r = df.get_column("dp_rank")
    if not r.dtype.is_integer() or (r.max() or 0) < MAX_DP_SIZE:
        return      # a wrong type is reported when the window is read
    big = (df.with_row_index("row").filter(pl.col("dp_rank") >= MAX_DP_SIZE)
           .group_by("worker", maintain_order=True).first())
    for w, row, rank in zip(big["worker"].to_list(), big["row"].to_list(), big["dp_rank"].to_list(), strict=True):
        if w is not None and w not in out:
            out[w] = (part.name, offset + int(row), int(rank))


def sorted_on_disk(parts: list[Part]) -> bool:
    """Rows already in ts order across the files, in file order."""
    prev = None
    for p in parts:
        if not p.sorted:
            return False
        if p.groups:
            if prev is not None and p.groups[0].ts_min < prev:
                return False
            prev = p.groups[-1].last
    return True
