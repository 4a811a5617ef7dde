"""The fast path of :func:`~replay.trace.load_trace`: one ``requests.parquet`` and
one ``loads.parquet`` whose name columns are plain strings (the layout every
writer of ours and the capture produce).

What differs from the full path (:func:`~replay.trace.load.build_trace`) is
only how the name columns are read: ``loads.worker``, ``requests.model``,
``requests.selected_worker`` and the ``matches`` entries' ``worker`` come out
of Parquet's dictionary pages as codes into a few distinct names
(:class:`~replay.trace.columns.Coded`) instead of millions of strings that
are then hashed twice (distinct names, then ids); ``matches`` is taken apart
through its Arrow buffers.  Every other column is read by polars and checked
by the same code as in the full path, and every step after names are ids is
the same function (:func:`~replay.trace.load.finish_trace`).

Every check is still made, but the fast path only tests that the data pass;
the one-line error is the full path's: on any failing check (or any layout,
type or reader problem the fast path does not handle) :class:`Fallback` is
raised and :func:`load_fast` returns None, and ``load_trace`` loads the
trace the full way, which names the file, column and row exactly as before.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.trace.assemble import RankTable, finish_trace
from replay.trace.base import DEFAULT_MODEL, KINDS, LOADS, MAX_VALUE, REQUESTS, WORKERS, run_both
from replay.trace.columns import (
    Coded,
    Columns,
    all_distinct,
    int_dtype,
    pool_empty,
    put_ints,
    take_by_blocks,
    valid_rows,
)
from replay.trace.core import Trace
from replay.trace.encode import (
    ClosedLoopColumns,
    MatchColumns,
    RequestColumns,
    load_specs,
    load_tails,
    loads_from_columns,
    read_closed_loop,
    read_loads,
    request_id_column,
    tail_flags,
)
from replay.trace.files import Frames, Part, file_info, finish_frame, list_parts, read_table_file, require_dir
from replay.trace.info import TraceInfo
from replay.trace.workers import Universe, make_universe, parse_workers_table


class Fallback(Exception):
    """The fast path does not apply (or a check fails): load the full way."""


def load_fast(path: str | os.PathLike, *, model: str | None, info: TraceInfo) -> Trace | None:
    """The trace as :func:`~replay.trace.load.build_trace` would encode it, or
    None when the full path must decide (another layout, other types, or a
    check that fails: the full path then raises its one-line error)."""
    try:
        return _load(os.fspath(path), model, info)
    except Exception:  # noqa: BLE001 - anything unexpected: the full path reads, checks and names it
        return None


def _is_str(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _single(dirpath: str, kind: str) -> Part:
    parts = list_parts(dirpath, kind)
    if len(parts) != 1 or parts[0].name != KINDS[kind]:
        raise Fallback(f"{kind}: not one {KINDS[kind]}")
    return parts[0]


def _leaf_path(pf: pq.ParquetFile, top: str, leaf: str) -> str:
    """The Parquet column path of ``top``'s nested field ``leaf`` (writers name
    the list levels differently)."""
    sch = pf.schema
    found = [p for p in (sch.column(i).path for i in range(len(sch)))
             if p.split(".")[0] == top and p.split(".")[-1] == leaf]
    if len(found) != 1:
        raise Fallback(f"{top}.{leaf}: no single leaf")
    return found[0]


def list_entries(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """A list array's entry counts per row (int64, 0 for a null list) and its entries: those
    of the non-null lists, in row order, as ``arr.flatten()`` gives them.  Taken from the
    offsets and a slice of the values wherever no null list holds entries (
    ``flatten``'s first call imports ``pyarrow.compute``)."""
    bounds = arr.offsets.to_numpy()
    lens = np.diff(bounds).astype(np.int64)
    if arr.null_count:
        lens[~valid_rows(arr)] = 0
    first, last = int(bounds[0]), int(bounds[-1])
    if int(lens.sum()) != last - first:          # a null list over entries: flatten skips them
        return lens, arr.flatten()
    return lens, arr.values.slice(first, last - first)


def _read_columns(part: Part, columns: list[str], dictionary: list[str]) -> pa.Table:
    """``columns`` of one file through pyarrow, ``dictionary`` (names or leaf paths) as
    dictionary arrays, one chunk per row group.  Not ``pq.read_table``: it goes through
    ``pyarrow.dataset``, whose first use in a process imports it and ``pyarrow.compute``
    (0.1-0.3 s of a fresh sweep's load), and cuts a row group into chunks that
    ``matches`` then had to be copied out of.  (``ParquetFile.read``, and batches that
    span row groups, refuse a nested dictionary column of several row groups.)"""
    pf = pq.ParquetFile(part.path, read_dictionary=dictionary)
    meta = pf.metadata
    batches = [b for g in range(meta.num_row_groups)     # one batch (and dictionary) per row group
               for b in pf.iter_batches(batch_size=max(1, meta.row_group(g).num_rows), row_groups=[g],
                                        columns=columns)]
    if not batches:
        raise Fallback(f"{part.name}: no rows")
    return pa.Table.from_batches(batches)


def coded(col: pa.ChunkedArray) -> Coded:
    """A dictionary-encoded string column (chunks may have their own
    dictionaries) as codes into one list of distinct names."""
    pos: dict[str, int] = {}
    parts = []
    for ch in col.chunks:
        if not (pa.types.is_dictionary(ch.type) and _is_str(ch.type.value_type)):
            raise Fallback("not a dictionary of strings")
        values = ch.dictionary.to_pylist()
        remap = np.empty(len(values) + 1, dtype=np.int32)
        for i, v in enumerate(values):
            remap[i] = -1 if v is None else pos.setdefault(v, len(pos))
        remap[len(values)] = -1                       # a null row
        idx = ch.indices
        rows: np.ndarray = idx.to_numpy() if not idx.null_count else np.where(   # null -> the last slot
            valid_rows(idx), np.frombuffer(idx.buffers()[1], dtype=int_dtype(idx.type))[
                idx.offset:idx.offset + len(idx)], len(values))
        parts.append((remap, rows))
    codes = pool_empty(sum(len(r) for _m, r in parts), np.int32)
    at = 0
    for remap, r in parts:
        take_by_blocks(remap, r, codes[at:at + len(r)])
        at += len(r)
    return Coded(codes, list(pos))


def _read_polars(part: Part, columns: list[str], rows: int) -> pl.DataFrame:
    df = finish_frame(part, pl.read_parquet(part.path, columns=columns, hive_partitioning=False))
    if df.height != rows:
        raise Fallback("row count")
    return df


def _matches(arr: pa.ChunkedArray) -> MatchColumns:
    """``matches`` (list<struct{worker: dictionary<string>, blocks: int64}>) as
    CSR, every entry checked as :func:`~replay.trace.encode.read_matches` does;
    chunk by chunk (one per row group), not copied into one first."""
    lens_parts, workers, blocks_parts = [], [], []
    for lst in arr.chunks:
        if not _is_list(lst.type):
            raise Fallback("matches: not a list")
        lens, ent = list_entries(lst)
        if ent.null_count or len(ent) != int(lens.sum()):
            raise Fallback("matches: a null entry")
        fields = dict(zip([f.name for f in ent.type], ent.flatten(), strict=True))
        worker, blocks = fields["worker"], fields["blocks"]
        if worker.null_count or blocks.null_count or blocks.type != pa.int64():
            raise Fallback("matches: a null field")
        lens_parts.append(lens)
        workers.append(worker)
        blocks_parts.append(blocks.to_numpy())
    lens = lens_parts[0] if len(lens_parts) == 1 else np.concatenate(lens_parts)
    b = blocks_parts[0] if len(blocks_parts) == 1 else np.concatenate(blocks_parts)
    b.flags.writeable = False                 # as the full path's (a view of Arrow memory there)
    off = np.zeros(lens.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=off[1:])
    if b.size and (int(b.min()) < 0 or int(b.max()) > MAX_VALUE):
        raise Fallback("matches: blocks out of range")
    return MatchColumns(lens, off, coded(pa.chunked_array(workers, workers[0].type)), b)


def _requests_side(part: Part):
    pf = pq.ParquetFile(part.path)
    sch = pf.schema_arrow
    names = sch.names
    rows = pf.metadata.num_rows
    if len(set(names)) != len(names) or rows == 0 or "matches" not in names:
        raise Fallback("requests: columns")
    m = sch.field("matches").type
    if not (_is_list(m) and pa.types.is_struct(m.value_type)
            and sorted(f.name for f in m.value_type) == ["blocks", "worker"]
            and _is_str(m.value_type.field("worker").type) and m.value_type.field("blocks").type == pa.int64()):
        raise Fallback("requests: matches type")
    dict_cols = [c for c in ("model", "selected_worker") if c in names]
    if not all(_is_str(sch.field(c).type) for c in dict_cols):
        raise Fallback("requests: name column types")
    tab = _read_columns(part, ["matches", *dict_cols], [_leaf_path(pf, "matches", "worker"), *dict_cols])
    df = _read_polars(part, [c for c in names if c not in ("matches", *dict_cols)], rows)
    R = Columns(REQUESTS, df)

    # read_requests' checks and conversions (the name columns coded)
    ts = R.timestamps("ts")
    rid_s, request_id = request_id_column(R)
    if len(rid_s) != rows or not all_distinct(rid_s):
        raise Fallback("requests: duplicate request_id")
    if request_id is None:
        request_id = rid_s.to_numpy()
    if "model" in dict_cols:
        model = coded(tab.column("model"))
        if model.null_count():                   # null -> the default model
            if DEFAULT_MODEL not in model.names:
                model.names.append(DEFAULT_MODEL)
            model.codes[model.codes < 0] = model.names.index(DEFAULT_MODEL)
    else:
        model = Coded(np.zeros(rows, dtype=np.int32), [DEFAULT_MODEL])
    input_tokens = R.ints("input_tokens", nullable=False)
    qb_s = R.require("query_blocks")
    query_blocks = R.ints("query_blocks", nullable=True, fill=0, s=qb_s)
    best = R.ints("best_prefix_blocks", nullable=True, fill=-1) if R.has("best_prefix_blocks") else None
    sel = coded(tab.column("selected_worker")) if "selected_worker" in dict_cols else None
    rq = RequestColumns(ts, request_id, model, input_tokens, query_blocks, int(qb_s.null_count()), best, sel)
    mt = _matches(tab.column("matches"))
    cl: ClosedLoopColumns = read_closed_loop(R, rq.input_tokens)
    return R, df, rq, mt, cl


def _loads_file(part: Part) -> tuple[pq.ParquetFile, bool]:
    """``loads.parquet``'s footer checked; True when its integer columns are read row group
    by row group (:func:`_ints_by_group`), with the worker column read apart."""
    pf = pq.ParquetFile(part.path)
    sch = pf.schema_arrow
    names = sch.names
    if (len(set(names)) != len(names) or pf.metadata.num_rows == 0 or "worker" not in names
            or not _is_str(sch.field("worker").type)):
        raise Fallback("loads: columns")
    return pf, pf.metadata.num_row_groups > 1 and _plain_ints(sch)


def _load_workers(part: Part) -> Coded:
    worker = coded(_read_columns(part, ["worker"], ["worker"]).column("worker"))
    if worker.null_count():
        raise Fallback("loads: null worker")
    return worker


def _loads_side(part: Part, pf: pq.ParquetFile, grouped: _Groups | None):
    """The loads without their worker column when ``grouped`` (``(rows, ts, columns)``),
    else the whole loads side (``(Columns, frame, LoadColumns)``)."""
    others = [c for c in pf.schema_arrow.names if c != "worker"]
    rows = pf.metadata.num_rows
    if grouped is not None:
        try:
            ts, cols = _ints_by_group(part, others, pf.metadata, grouped)
        finally:
            grouped.end()
        return rows, ts, cols
    worker = _load_workers(part)
    df = _read_polars(part, others, rows)
    L = Columns(LOADS, df)
    return L, df, read_loads(L, worker)


def _plain_ints(sch: pa.Schema) -> bool:
    """Every load column that :func:`~replay.trace.encode.read_loads` reads (``ts`` and the
    integer columns) is a signed integer where present: :func:`_ints_by_group` applies."""
    want = {"ts", *(sp.col for sp in load_specs())}
    return all(pa.types.is_signed_integer(sch.field(c).type) for c in sch.names if c in want)


class _Groups:
    """How far :func:`_ints_by_group` is: the rows copied so far (whole row groups, in file
    order) and the arrays they are copied into, for a thread that works on the rows already
    in while the next groups are read (:meth:`follow`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.rows = 0
        self.over = False
        self.arrays: dict[str, np.ndarray] = {}

    def publish(self, rows: int) -> None:
        with self._cond:
            self.rows = rows
            self._cond.notify_all()

    def end(self) -> None:
        """No more rows will come (the reading finished, or failed)."""
        with self._cond:
            self.over = True
            self._cond.notify_all()

    def follow(self):
        """``(start, stop)`` of each new run of copied rows, as they come, until :meth:`end`."""
        done = 0
        while True:
            with self._cond:
                while self.rows == done and not self.over:
                    self._cond.wait()
                rows = self.rows
            if rows == done:
                return
            yield done, rows
            done = rows


def _ints_by_group(part: Part, columns: list[str], meta,
                   groups: _Groups | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``ts`` and the integer load columns of a file of several row groups, each read
    straight into one contiguous array, as :meth:`~replay.trace.columns.Columns.int_columns`
    returns them (nulls filled, writeable, as the full path's copies of chunked columns).

    Polars reads the file row group by row group (the other columns too, as the full path
    reads them), and each group's values are copied into the arrays: one group's decoded
    columns are in memory at a time, where reading the whole file and then copying every
    column out of its chunks touched twice the memory (fresh pages cost more
    than the decoding on this machine).  The checks are the full path's, made on the
    groups' statistics (min, max, nulls): any failure is a :class:`Fallback`.  ``groups``
    hears of the arrays and of each group copied."""
    specs = [sp for sp in load_specs() if sp.col in columns]
    if "ts" not in columns or any(not sp.nullable for sp in load_specs() if sp.col not in columns):
        raise Fallback("loads: a required column is missing")
    rows = meta.num_rows
    lo_hi = {"ts": (-(2**63), 2**63 - 1), **{sp.col: (sp.lo, sp.hi) for sp in specs}}
    nullable = {"ts": False, **{sp.col: sp.nullable for sp in specs}}
    fill = {sp.col: sp.fill for sp in specs}
    out = {"ts": pool_empty(rows, np.int64),
           **{sp.col: pool_empty(rows, np.int32 if sp.dtype == pl.Int32 else np.int64) for sp in specs}}
    if groups is not None:
        groups.arrays = out
    scan = pl.scan_parquet(part.path, hive_partitioning=False).select(columns)

    def copy(df: pl.DataFrame, at: int) -> None:
        for c, dest in out.items():      # nulls filled in the copy (not by a filled column first)
            pos = at
            for ch in df.get_column(c).get_chunks():
                put_ints(dest[pos:pos + len(ch)], ch, fill.get(c, 0))
                pos += len(ch)
        if groups is not None:
            groups.publish(at + df.height)

    # a group is copied (one thread, mostly page faults) while the next is read (polars' own
    # threads): at most two groups' frames in memory at a time
    at, copying = 0, None
    with ThreadPoolExecutor(1, thread_name_prefix="trace-copy") as copier:
        for g in range(meta.num_row_groups):
            k = meta.row_group(g).num_rows
            df = scan.slice(at, k).collect()
            if df.height != k:
                raise Fallback("loads: row group size")
            stats = df.select([e for c in out for e in (pl.col(c).min().cast(pl.Int128).alias(f"lo:{c}"),
                                                         pl.col(c).max().cast(pl.Int128).alias(f"hi:{c}"),
                                                         pl.col(c).null_count().alias(f"nul:{c}"))]).row(0)
            for i, c in enumerate(out):
                mn, mx, nul = stats[3 * i: 3 * i + 3]
                lo, hi = lo_hi[c]
                if (nul and not nullable[c]) or (mn is not None and (mn < lo or mx > hi)):
                    raise Fallback(f"loads: column {c}")
            if copying is not None:
                copying.result()
            copying = copier.submit(copy, df, at)
            at += k
            del df
        if copying is not None:
            copying.result()
    if at != rows:
        raise Fallback("loads: row count")
    return out.pop("ts"), out


def _load(dirpath: str, model: str | None, info: TraceInfo) -> Trace:

    require_dir(dirpath)
    req_part, load_part = _single(dirpath, "requests"), _single(dirpath, "loads")
    wk_df, wk_info = read_table_file(dirpath, WORKERS)
    table = parse_workers_table(wk_df) if wk_df is not None else None
    pf, by_groups = _loads_file(load_part)
    grouped = _Groups() if by_groups else None

    def requests_task():
        # when the loads are read by row groups, the requests side finishes well before the
        # loads' integer columns are in: it reads the loads' worker column too,
        # maps every name to its id, and gathers the ranks per worker (facts) of each row
        # group as it comes in, so that only the loads' tails and flags are left after both
        req_out = _requests_side(req_part)
        if grouped is None:
            return req_out, None, None, (None, None)
        worker = _load_workers(load_part)
        named = _names(table, info, req_out[2], req_out[3], worker)
        return req_out, worker, named, _follow_loads(grouped, named[1][1], len(named[0].workers))

    # requests | loads in two threads, the files' sha256 (provenance) in a third
    ((req_out, worker, named, (ranks, tails_done)), load_out), infos = run_both(
        lambda: run_both(requests_task, lambda: _loads_side(load_part, pf, grouped)),
        lambda: [file_info(p.path) for p in (req_part, load_part)])
    R, req_df, rq, mt, cl = req_out
    if grouped is not None:
        rows, ts, cols = load_out
        load_df = pl.DataFrame()        # nothing reads the frame after the checks; errors name the file
        universe, (req_model, load_worker, match_worker), sel = named
        ranks = ranks.result(universe.workers)
        L, ld = Columns(LOADS, load_df), loads_from_columns(rows, ts, worker, cols, tails_done)
    else:
        L, load_df, ld = load_out
        assert isinstance(ld.worker, Coded)
        universe, (req_model, load_worker, match_worker), sel = _names(table, info, rq, mt, ld.worker)
    files = {REQUESTS: infos[0], LOADS: infos[1]}
    if wk_df is not None:
        files[WORKERS] = wk_info
    fr = Frames(os.path.abspath(dirpath), req_df, load_df, wk_df, files)
    return finish_trace(fr, universe, R, L, rq, mt, cl, ld, req_model, load_worker, match_worker, sel,
                        model=model, strict_model=True, index_offset=0, facts=True, info=info, ranks=ranks)


def _follow_loads(groups: _Groups, load_worker: np.ndarray, n_workers: int):
    """The loads' steps that need no other row group, each group's as it comes in (in the
    requests' thread, while the loads' thread reads the next): the ranks per worker (facts)
    and the tails and their flags (:func:`~replay.trace.encode.tail_flags`)."""

    ranks = RankTable(n_workers)
    rows = load_worker.shape[0]
    tails: list[np.ndarray] = []
    tail_valid, tail_any = pool_empty(rows, np.bool_), pool_empty(rows, np.bool_)
    for start, stop in groups.follow():
        if not tails:
            tails = load_tails(rows, groups.arrays)
        rank = groups.arrays.get("dp_rank")
        ranks.add(load_worker[start:stop],
                  rank[start:stop] if rank is not None else np.zeros(stop - start, dtype=np.int32))
        tail_flags(tails, tail_valid, tail_any, start, stop)
    return ranks, (tails, tail_valid, tail_any)


def _names(table, info: TraceInfo, rq: RequestColumns, mt: MatchColumns, load_worker: Coded):
    """The universe from the coded names, every name column as ids, and the selected
    workers' ids with their null and unknown counts (as :func:`~replay.trace.load.build_trace`)."""
    assert isinstance(rq.model, Coded) and isinstance(mt.worker, Coded)
    universe = make_universe(table, load_worker.used(), mt.worker.used(), rq.model.used(), info.page_size)
    ids = _ids(universe, rq.model, load_worker, mt.worker)
    selected = sel_null = sel_unknown = None
    if isinstance(rq.selected, Coded):
        selected = rq.selected.ids({w: i for i, w in enumerate(universe.workers)})
        sel_null = rq.selected.null_count()
        sel_unknown = int(((selected < 0) & (rq.selected.codes >= 0)).sum())
        selected.flags.writeable = False          # as the full path's
    return universe, ids, (selected, sel_null, sel_unknown)


def _ids(universe: Universe, model: Coded, load_worker: Coded,
         match_worker: Coded) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """As :func:`~replay.trace.encode.to_ids`: with a workers table only its
    listed workers are match addresses (-1 otherwise)."""
    workers = universe.workers
    listed = universe.worker_listed if universe.has_table else np.ones(len(workers), dtype=bool)
    req_model = model.ids({m: i for i, m in enumerate(universe.models)})
    lw = load_worker.ids({w: i for i, w in enumerate(workers)})
    mw = match_worker.ids({w: i for i, w in enumerate(workers) if listed[i]})
    if (req_model.size and int(req_model.min()) < 0) or (lw.size and int(lw.min()) < 0):
        raise Fallback("a name outside the universe")
    # read-only where the full path's arrays are (views of polars memory there)
    for a in (req_model, lw) if universe.has_table else (req_model, lw, mw):
        a.flags.writeable = False
    return req_model, lw, mw
