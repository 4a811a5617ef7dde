"""Trace sets: traces split into many Parquet files, read whole or window by window.

A trace directory holds its requests either as one ``requests.parquet`` or as a
``requests/`` folder of Parquet files (any depth, optionally hive-partitioned:
``requests/date=2026-11-01/part-0.parquet``); the same for loads.  The files
of a folder are taken in path order (component by component, hidden ``.``
and ``_`` entries skipped) and concatenated, then stable-sorted by ``ts``, so
a set replays exactly like the one file it could have been.  A hive
``key=value`` path segment becomes a string column ``key`` for the rows of
that file, unless the file has a column of that name.

:class:`TraceSet` is the lazy form.  ``TraceSet.open`` reads only the ``ts``
column (and the few columns that fix worker ids and models) once, building an
index of row groups, per-second request counts and the trace's worker
universe.  ``iter_windows`` then yields each time window ``[t0, t1)`` as an
ordinary :class:`~replay.trace.Trace` holding the window's requests, the
window's load samples, and the *carry*: the few earlier samples the router's
state still depends on (for every rank its latest two samples, for every
worker its latest ``router_inflight``).  Those determine the snapshot state
at ``t0`` exactly (``kernels/snapshot.py`` keeps nothing else), so a window
decides every request exactly as the whole trace does, while memory is bound
by the window.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from .kernels.snapshot import carry_mask_nb
from .trace import (DEFAULT_MODEL, LOADS, REQUESTS, fleet_dp_sizes, fleet_members, WORKERS, Frames, Trace, TraceError, Universe, _File, _one_line,
                    _read, build_trace, make_universe, parse_workers_table)

NS = 1_000_000_000
KINDS = {"requests": REQUESTS, "loads": LOADS}

# Load columns of a Trace, in ``engine.load_columns`` order.
LOAD_FIELDS = ("load_ts", "load_worker", "load_rank", "load_running", "load_waiting",
               "load_num_tokens", "load_max_total", "load_has_tail", "load_waiting_uncached",
               "load_total_tokens", "load_max_running", "load_prefill_tokens",
               "load_prefill_busy_us", "load_router_inflight")


@dataclass
class Group:
    """One Parquet row group: first row in its file, rows, ts range (ns, inclusive)."""

    offset: int
    rows: int
    ts_min: int
    ts_max: int
    last: int = 0             # ts of the group's last row
    index: int = 0            # the Parquet row group's number in its file


@dataclass
class Part:
    """One Parquet file of a trace."""

    path: str                       # absolute
    name: str                       # as error messages name it: relative to the trace dir
    hive: dict[str, str] = field(default_factory=dict)
    rows: int = 0
    groups: list[Group] = field(default_factory=list)
    sorted: bool = True             # ts non-decreasing through the whole file


# ---------------------------------------------------------------------------
# listing and reading files
# ---------------------------------------------------------------------------
def _hive_keys(rel: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for seg in rel.split("/")[:-1]:
        if "=" in seg:
            k, v = seg.split("=", 1)
            if k:
                out[k] = unquote(v)
    return out


def list_parts(dirpath: str, kind: str) -> list[Part]:
    """The Parquet files of ``kind`` ("requests" / "loads"): ``kind.parquet`` or
    the files under ``kind/``, in path order; [] when neither exists."""
    single = os.path.join(dirpath, KINDS[kind])
    folder = os.path.join(dirpath, kind)
    if os.path.exists(single) and os.path.isdir(folder):
        raise TraceError(f"{KINDS[kind]}: both {KINDS[kind]} and {kind}/ are in {dirpath}; keep one")
    if os.path.exists(single):
        if not os.path.isfile(single):
            raise TraceError(f"{KINDS[kind]}: not a regular file: {single}")
        return [Part(os.path.abspath(single), KINDS[kind])]
    if not os.path.isdir(folder):
        return []
    found: list[tuple[tuple[str, ...], Part]] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_"))]
        for f in files:
            if f.startswith((".", "_")) or not f.endswith(".parquet"):
                continue
            full = os.path.join(root, f)
            rel = os.path.relpath(full, dirpath).replace(os.sep, "/")
            found.append((tuple(rel.split("/")), Part(os.path.abspath(full), rel,
                                                      _hive_keys(os.path.relpath(full, folder)))))
    if not found:
        raise TraceError(f"{kind}/: no .parquet files under {folder}")
    found.sort(key=lambda t: t[0])
    return [p for _k, p in found]


def _open(part: Part) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(part.path)
    except Exception as err:  # pyarrow raises many kinds
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {_one_line(err)})") from None


def _epoch_ns(part: Part, df: pl.DataFrame, offset: int) -> pl.DataFrame:
    """A Datetime ``ts`` (any unit, any zone; naive read as UTC) as int64 epoch
    nanoseconds, so files with different units concatenate and compare alike."""
    t = df.schema.get("ts")
    if not isinstance(t, pl.Datetime):
        return df
    raw = df.get_column("ts").dt.epoch(t.time_unit)
    factor = {"ns": 1, "us": 1_000, "ms": 1_000_000}[t.time_unit]
    if factor > 1:
        bad = (raw.abs() > (2**63 - 1) // factor).fill_null(False)
        if bad.any():
            row = offset + int(bad.arg_max())
            raise TraceError(f"{part.name}: column 'ts' row {row}: datetime outside the int64 "
                             f"nanosecond range (years 1678..2262)")
        raw = raw * factor
    return df.with_columns(raw.cast(pl.Int64).alias("ts"))


def _to_frame(part: Part, table, offset: int = 0) -> pl.DataFrame:
    try:
        df = pl.from_arrow(table)
    except Exception as err:
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {_one_line(err)})") from None
    if isinstance(df, pl.Series):
        df = df.to_frame()
    casts = [pl.col(c).cast(pl.String) for c, t in df.schema.items()
             if isinstance(t, (pl.Categorical, pl.Enum))]
    if casts:
        df = df.with_columns(casts)
    extra = [pl.lit(v, dtype=pl.String).alias(k) for k, v in part.hive.items() if k not in df.columns]
    if extra:
        df = df.with_columns(extra)
    return _canonical(_epoch_ns(part, df, offset))


MATCHES_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))


def _canonical(df: pl.DataFrame) -> pl.DataFrame:
    """Types that may legitimately differ between the files of a set, made one:
    ``matches`` as list<struct{worker: string, blocks: int64}> (any integer
    width, categorical workers, fixed-size lists, extra fields dropped)."""
    fixes = []
    m = df.schema.get("matches")
    if m is not None and m != MATCHES_T and isinstance(m, (pl.List, pl.Array)):
        inner = m.inner
        names = {f.name: f.dtype for f in inner.fields} if isinstance(inner, pl.Struct) else {}
        w, b = names.get("worker"), names.get("blocks")
        if (w is not None and b is not None and b.is_integer()
                and (w == pl.String or isinstance(w, (pl.Categorical, pl.Enum)))):
            col = pl.col("matches").cast(pl.List(inner)) if isinstance(m, pl.Array) else pl.col("matches")
            fixes.append(col.list.eval(pl.struct(pl.element().struct.field("worker").cast(pl.String),
                                                 pl.element().struct.field("blocks").cast(pl.Int64))))
    if not fixes:
        return df
    try:
        return df.with_columns(fixes)
    except Exception:   # out-of-range values: left as they are, the checks name the row
        return df


def read_part(part: Part, groups: list[int] | None = None, offset: int = 0) -> pl.DataFrame:
    """A file (or some of its row groups, the first at row ``offset``) as a
    polars frame with its hive columns."""
    pf = _open(part)
    try:
        table = pf.read() if groups is None else pf.read_row_groups(groups)
    except Exception as err:
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {_one_line(err)})") from None
    return _to_frame(part, table, offset)


def _kind_of(dtype) -> str:
    if dtype.is_integer():
        return "integer"
    if dtype in (pl.String, pl.Null):
        return "string" if dtype == pl.String else "null"
    return str(dtype)


def _concat(parts: list[Part], dfs: list[pl.DataFrame]) -> pl.DataFrame:
    """Concatenate the frames of several files; a column whose kind of type
    differs between files is an error naming the file."""
    first: dict[str, tuple[str, str, object]] = {}
    for part, df in zip(parts, dfs):
        for col, dtype in df.schema.items():
            kind = _kind_of(dtype)
            if kind == "null":
                continue
            if col not in first:
                first[col] = (kind, part.name, dtype)
            elif first[col][0] != kind and not (kind == "integer" and first[col][0] == "integer"):
                raise TraceError(f"{part.name}: column '{col}': type {dtype} differs from "
                                 f"{first[col][2]} in {first[col][1]}")
    if len(dfs) == 1:
        return dfs[0]
    try:
        return pl.concat(dfs, how="diagonal_relaxed")
    except Exception as err:
        raise TraceError(f"{parts[0].name}: files do not concatenate ({type(err).__name__}: "
                         f"{_one_line(err)})") from None


def _locator(names: list[str], part_idx: np.ndarray, row_in_part: np.ndarray):
    def locate(row: int) -> tuple[str, int]:
        return names[int(part_idx[row])], int(row_in_part[row])
    return locate


def _file_info(path: str) -> dict:
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"path": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": digest}


def _require_dir(dirpath: str) -> None:
    if not os.path.isdir(dirpath):
        raise TraceError(f"{dirpath}: not a trace directory (expected {REQUESTS}, {LOADS})")


def _parts_or_fail(dirpath: str, kind: str) -> list[Part]:
    parts = list_parts(dirpath, kind)
    if not parts:
        raise TraceError(f"{KINDS[kind]}: file not found in {dirpath} (nor a {kind}/ folder)")
    return parts


def _whole(parts: list[Part]) -> tuple[pl.DataFrame, str, object]:
    dfs = [read_part(p) for p in parts]
    df = _concat(parts, dfs)
    if len(parts) == 1 and parts[0].name in KINDS.values():
        return df, parts[0].name, None
    sizes = np.array([d.height for d in dfs], dtype=np.int64)
    part_idx = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    row_in = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
    return df, parts[0].name, _locator([p.name for p in parts], part_idx, row_in)


def read_frames(path: str | os.PathLike) -> Frames:
    """Every row of a trace directory (either layout) as polars frames."""
    dirpath = os.fspath(path)
    _require_dir(dirpath)
    req_parts = _parts_or_fail(dirpath, "requests")
    load_parts = _parts_or_fail(dirpath, "loads")
    wk_df, wk_info = _read(dirpath, WORKERS, required=False)
    files = {p.name: _file_info(p.path) for p in (*req_parts, *load_parts)}
    if wk_df is not None:
        files[WORKERS] = wk_info
    req_df, req_name, req_loc = _whole(req_parts)
    load_df, load_name, load_loc = _whole(load_parts)
    return Frames(os.path.abspath(dirpath), req_df, load_df, wk_df, files, req_name, load_name,
                  req_loc, load_loc)


def _ts_ns(part: Part, df: pl.DataFrame, offset: int) -> np.ndarray:
    return _File(part.name, df, lambda r: (part.name, offset + r)).timestamps("ts")


def _scan(part: Part, cols: list[str]):
    """Yield ``(frame of cols + ts, ts in ns)`` per row group of a file, filling
    ``part.rows`` and ``part.groups`` (the index) as it goes."""
    pf = _open(part)
    if "ts" not in pf.schema_arrow.names:
        raise TraceError(f"{part.name}: column 'ts': missing (required column)")
    for g in range(pf.metadata.num_row_groups):
        df = _to_frame(part, pf.read_row_group(g, columns=["ts", *cols]), part.rows)
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

    # -- opening --------------------------------------------------------------
    @classmethod
    def open(cls, path: str | os.PathLike, *, hash_files: bool = True) -> "TraceSet":
        """Index a trace directory: one pass over ``ts`` and the columns that
        fix worker ids and models; nothing else is read."""
        dirpath = os.fspath(path)
        _require_dir(dirpath)
        req_parts = _parts_or_fail(dirpath, "requests")
        load_parts = _parts_or_fail(dirpath, "loads")
        wk_df, wk_info = _read(dirpath, WORKERS, required=False)
        table = parse_workers_table(wk_df) if wk_df is not None else None
        files = {}
        for p in (*req_parts, *load_parts):
            files[p.name] = (_file_info(p.path) if hash_files
                             else {"path": p.path, "bytes": os.path.getsize(p.path)})
        if wk_df is not None:
            files[WORKERS] = wk_info
        seconds: list[np.ndarray] = []
        counts: list[np.ndarray] = []
        models: dict[str, int] = {}
        match_names: set[str] = set()
        n_req = 0
        has_selected = False
        for part in req_parts:
            names = _open(part).schema_arrow.names
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
                    except Exception:
                        pass  # a malformed column is reported when its window is read
            n_req += part.rows
        load_names: set[str] = set()
        ranks: dict[str, int] = {}
        n_load = 0
        for part in load_parts:
            names = _open(part).schema_arrow.names
            if "worker" not in names and "worker" not in part.hive:
                raise TraceError(f"{part.name}: column 'worker': missing (required column)")
            for df, ts in _scan(part, [c for c in ("worker", "dp_rank") if c in names]):
                if not ts.size:
                    continue
                rk = pl.col("dp_rank").fill_null(0) if "dp_rank" in df.columns else pl.lit(0)
                for w, r in df.group_by("worker").agg(rk.max().alias("r")).iter_rows():
                    if w is None:
                        continue
                    load_names.add(w)
                    ranks[w] = max(ranks.get(w, -1), -1 if r is None else int(r))
            n_load += part.rows
        lo = [g.ts_min for p in (*req_parts, *load_parts) for g in p.groups]
        hi = [g.ts_max for p in (*req_parts, *load_parts) for g in p.groups]
        universe = make_universe(table, load_names, match_names, list(models))
        pos = {w: i for i, w in enumerate(universe.workers)}
        if seconds:
            s_all = np.concatenate(seconds)
            c_all = np.concatenate(counts)
            req_seconds, inv = np.unique(s_all, return_inverse=True)
            req_counts = np.bincount(inv, weights=c_all).astype(np.int64)
        else:
            req_seconds = req_counts = np.zeros(0, dtype=np.int64)
        return cls(os.path.abspath(dirpath), req_parts, load_parts, wk_df, universe, files, n_req, n_load,
                   min(lo) if lo else None, max(hi) if hi else None, req_seconds, req_counts,
                   max(ranks.values(), default=-1), {pos[w]: r for w, r in ranks.items()},
                   {m: models[m] for m in sorted(models)}, has_selected)

    def hashed_files(self) -> dict[str, dict]:
        """``files`` with every file's sha256 (provenance; reads every byte once)."""
        return {name: (info if "sha256" in info else _file_info(info["path"]))
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
        sample; windows without any row are left out."""
        if window_ns < NS or window_ns % NS:
            raise ValueError("the window must be a whole number of seconds (>= 1 s)")
        if self.ts_min is None:
            return []
        groups = [g for p in (*self.requests, *self.loads) for g in p.groups]
        k0 = self.ts_min // window_ns
        k1 = self.ts_max // window_ns
        if k1 - k0 + 1 <= 4 * len(groups) + 1024:
            used = np.zeros(k1 - k0 + 1, dtype=bool)
            for g in groups:
                used[g.ts_min // window_ns - k0: g.ts_max // window_ns - k0 + 1] = True
            ks = k0 + np.nonzero(used)[0]
        else:
            ks = np.arange(k0, k1 + 1)
        return [(int(k) * window_ns, (int(k) + 1) * window_ns) for k in ks]

    def read_window(self, t0: int, t1: int, *, cache: "_GroupCache | None" = None) -> Frames:
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
            return df, parts[0].name, _locator(names, np.zeros(0, np.int64), np.zeros(0, np.int64))
        used = [parts[int(p[0])] for p in pidx]
        # errors without a row name the window's first file (type errors that
        # differ between files name the later one, in _concat)
        return (_concat(used, dfs), used[0].name,
                _locator(names, np.concatenate(pidx), np.concatenate(rows)))

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
                             strict_model=False, facts=facts)
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
            carry = carry_of_columns(_concat_cols(carry, loads))
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


# ---------------------------------------------------------------------------
# the carry
# ---------------------------------------------------------------------------
def carry_of_columns(cols: dict | None) -> dict | None:
    """The rows of ``cols`` (load columns in time order, ``LOAD_FIELDS``) that the
    snapshot state after them depends on: each (worker, rank)'s last two
    samples and each worker's last sample with a ``router_inflight`` value
    (``kernels.snapshot.carry_mask_nb``)."""
    if cols is None or cols["load_ts"].shape[0] == 0:
        return cols
    w = cols["load_worker"].astype(np.int64)
    r = cols["load_rank"].astype(np.int64)
    n_w, n_r = int(w.max()) + 1, int(r.max()) + 1
    if n_w * n_r > 50_000_000:          # stray huge ranks: number the ranks seen instead
        _u, r = np.unique(r, return_inverse=True)
        n_r = int(r.max()) + 1
    keep = np.zeros(w.shape[0], dtype=np.bool_)
    carry_mask_nb(w, r.astype(np.int64), cols["load_router_inflight"].astype(np.int64), n_r, keep)
    return {f: cols[f][keep] for f in LOAD_FIELDS}


def carry_of(trace: Trace) -> dict | None:
    return carry_of_columns({f: getattr(trace, f) for f in LOAD_FIELDS})


def _concat_cols(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {f: np.concatenate([a[f], b[f]]) for f in LOAD_FIELDS}


def with_carry(trace: Trace, carry: dict | None) -> Trace:
    """The trace with the carried samples (all before its window) put first."""
    if carry is None or carry["load_ts"].shape[0] == 0:
        return trace
    return dataclasses.replace(trace, **{f: np.ascontiguousarray(np.concatenate([carry[f], getattr(trace, f)]))
                                         for f in LOAD_FIELDS})


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


# facts summed over windows; the others are merged below
_SUMMED = ("requests", "requests_with_matches", "requests_without_prefix_signal", "match_entries",
           "unknown_match_entries", "load_rows", "load_rows_with_tail", "load_rows_partial_tail",
           "load_rows_without_tail", "ignored_rank_rows", "query_blocks_null", "selected_worker_null",
           "selected_worker_unknown", "requests_without_fresh_fleet_sample")


def validate_windows(tset: TraceSet, window_ns: int, freshness_ns: int, progress=None) -> dict:
    """``validate_trace``'s facts for a trace checked window by window (every
    row is checked exactly as in memory; ``request_id`` uniqueness within each
    window only)."""
    from . import labels
    from .trace import fresh_fleet_sample_mask

    facts: dict = {k: 0 for k in _SUMMED}
    unknown: set[str] = set()
    ranks: dict[str, set[int]] = {}
    has_inflight = False
    span = [None, None]
    windows = 0
    for win in tset.iter_windows(window_ns, facts=True):
        windows += 1
        tr = win.trace
        f = tr.facts
        for k in _SUMMED[:-1]:
            facts[k] += int(f.get(k, 0))
        facts["requests_without_fresh_fleet_sample"] += int((~fresh_fleet_sample_mask(tr, freshness_ns)).sum())
        unknown.update(f.get("unknown_match_address_examples_all", []))
        for w, rs in f.get("ranks_per_worker", {}).items():
            ranks.setdefault(w, set()).update(rs)
        has_inflight |= bool(f.get("has_router_inflight"))
        if tr.n_requests:
            a, b = int(tr.req_ts[0]), int(tr.req_ts[-1])
            span = [a if span[0] is None else min(span[0], a), b if span[1] is None else max(span[1], b)]
        if progress is not None:
            progress(tr.n_requests)
    n = facts["requests"]
    u = tset.universe
    names = sorted(unknown)
    facts.update(
        unknown_match_addresses=len(names), unknown_match_address_examples=names[:5],
        requests_sorted_on_disk=sorted_on_disk(tset.requests), loads_sorted_on_disk=sorted_on_disk(tset.loads),
        workers=tset.n_workers, models=dict(tset.model_counts), has_workers_table=u.has_table,
        non_fleet_load_workers=list(u.non_fleet_load), has_router_inflight=has_inflight,
        ranks_per_worker={w: sorted(r) for w, r in sorted(ranks.items())},
        has_selected_worker=tset.has_selected,
        freshness_ms=int(freshness_ns) // 1_000_000,
        share_without_fresh_fleet_sample=facts["requests_without_fresh_fleet_sample"] / n if n else 0.0,
        fleet_workers={m: int(tset.fleet(i).shape[0]) for i, m in enumerate(tset.models)},
        roles={r: int((u.worker_role == i).sum()) for i, r in enumerate(labels.ROLES)},
        files=tset.hashed_files(), path=tset.path, window_s=window_ns // NS, windows=windows,
        request_id_unique="within each window",
    )
    facts["workers_without_samples"] = sorted(set(tset.workers) - set(ranks))
    if n:
        facts.update(span_start_ns=span[0], span_end_ns=span[1], span_s=(span[1] - span[0]) / 1e9)
    return facts


# ---------------------------------------------------------------------------
# window sizes
# ---------------------------------------------------------------------------
WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# auto: replay in memory up to these sizes, else windows of about this many rows
AUTO_IN_MEMORY_REQUESTS = 4_000_000
AUTO_IN_MEMORY_LOAD_ROWS = 16_000_000
AUTO_WINDOW_REQUESTS = 1_000_000
AUTO_WINDOW_LOAD_ROWS = 2_000_000


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
        raise ValueError(f"--window must be auto, none or a whole number of seconds like 90s, 15m, "
                         f"1h, 1d; got {text!r}")
    return int(m.group(1)) * WINDOW_UNITS[m.group(2) or "s"] * NS


def auto_window(tset: TraceSet) -> int:
    """0 (replay in memory) for traces that fit comfortably, else a window of
    about AUTO_WINDOW_REQUESTS requests and AUTO_WINDOW_LOAD_ROWS samples."""
    if tset.n_requests <= AUTO_IN_MEMORY_REQUESTS and tset.n_load_rows <= AUTO_IN_MEMORY_LOAD_ROWS:
        return 0
    span_s = max(1.0, (tset.ts_max - tset.ts_min) / NS)
    per_s = max(tset.n_requests / AUTO_WINDOW_REQUESTS, tset.n_load_rows / AUTO_WINDOW_LOAD_ROWS) / span_s
    seconds = max(1, int(math.floor(1.0 / per_s))) if per_s > 0 else int(span_s) + 1
    nice = [s for s in NICE_WINDOWS_S if s <= seconds]
    return (nice[-1] if nice else seconds) * NS


# auto windows are rounded down to one of these lengths (seconds)
NICE_WINDOWS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200,
                  86400)


def format_window(window_ns: int) -> str:
    s = window_ns // NS
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s % size == 0:
            return f"{s // size}{unit}"
    return f"{s}s"
