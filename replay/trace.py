"""Trace directories: read with polars, check, encode once into flat numpy columns.

This module is the boundary between user files and the kernels.  Everything
after ``load_trace`` sees only the :class:`Trace` below (numpy arrays and a few
Python lists of names), never polars or pyarrow objects.

Encoding contract (both ``reference.py`` and ``kernels/`` rely on it):

* Workers are integers: ``workers`` is the sorted (ascending, by Python string
  order) list of every worker URL the trace knows, and a worker's index is its
  position there, so "worker id ascending" is integer order.
* Requests and load samples are sorted by ``ts`` (stable), timestamps are int64
  nanoseconds.
* ``matches`` are CSR: request ``i``'s entries are
  ``match_worker[match_offsets[i]:match_offsets[i+1]]`` (same slice of
  ``match_blocks``), in provider order; an address that is not a known worker
  has index ``-1``.
* Missing optional integers are ``-1`` (they are all non-negative otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


from .errors import ReplayError


class TraceError(ReplayError):
    """Bad input; the message is one line naming file, column and first bad row."""


@dataclass
class Trace:
    """A loaded, checked, encoded trace directory."""

    path: str
    # --- workers (the fleet table, explicit or inferred) -------------------
    workers: list[str]                 # sorted worker URLs; index = worker id
    models: list[str]                  # model names; index = model id
    worker_model: np.ndarray           # int32[n_workers], model id
    worker_role: np.ndarray            # int8[n_workers], labels.ROLE_*
    worker_dp_size: np.ndarray         # int32[n_workers], 0 = unknown (use observed ranks)
    has_workers_table: bool            # workers.parquet was present
    # --- requests, sorted by ts (stable) -----------------------------------
    request_id: np.ndarray             # object or int64 [n_requests], original ids
    req_ts: np.ndarray                 # int64 ns
    req_model: np.ndarray              # int32 model id
    req_input_tokens: np.ndarray       # int64 (L)
    req_query_blocks: np.ndarray       # int64, 0 = no prefix signal (null read as 0)
    req_best_prefix_blocks: np.ndarray # int64 (default max of match blocks, 0 if none)
    match_offsets: np.ndarray          # int64[n_requests + 1]
    match_worker: np.ndarray           # int32, worker id or -1 (unknown address)
    match_blocks: np.ndarray           # int64
    req_selected_worker: np.ndarray | None  # int32, -1 = null / unknown; None = no column
    # --- load samples, sorted by ts (stable) -------------------------------
    load_ts: np.ndarray                # int64 ns
    load_worker: np.ndarray            # int32 worker id
    load_rank: np.ndarray              # int32 dp rank (>= 0)
    load_running: np.ndarray           # int64 num_running_reqs
    load_waiting: np.ndarray           # int64 num_waiting_reqs
    load_num_tokens: np.ndarray        # int64 num_tokens (used KV)
    load_max_total: np.ndarray         # int64 max_total_num_tokens (0 = unknown)
    load_has_tail: np.ndarray          # bool: all five native tail fields present
    load_waiting_uncached: np.ndarray  # int64 (0 where no tail)
    load_total_tokens: np.ndarray      # int64 num_total_tokens (0 where no tail)
    load_max_running: np.ndarray       # int64 max_running_requests (0 where no tail)
    load_prefill_tokens: np.ndarray    # int64 total_prefill_uncached_tokens (0 where no tail)
    load_prefill_busy_us: np.ndarray   # int64 total_prefill_busy_us (0 where no tail)
    load_router_inflight: np.ndarray   # int64, -1 = null or no column
    # --- provenance ----------------------------------------------------------
    files: dict[str, dict] = field(default_factory=dict)  # name -> {path, bytes, sha256}
    facts: dict = field(default_factory=dict)               # validate-style data facts
    # --- additions (load_trace) ---------------------------------------------
    # Position of each request in the time-sorted *whole* trace (the
    # ``request_index`` of docs/replay-model.md); differs from arange only when
    # ``load_trace(model=...)`` kept the requests of one model.  None -> arange.
    req_index: np.ndarray | None = None
    # With a workers table: True for workers listed in it.  Workers seen only
    # in loads.parquet get worker_model == -1 and role decode (never a fleet
    # member).  Without a table: all True.
    worker_listed: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.req_index is None:
            self.req_index = np.arange(self.req_ts.shape[0], dtype=np.int64)
        if self.worker_listed is None:
            self.worker_listed = np.ones(len(self.workers), dtype=bool)

    @property
    def n_requests(self) -> int:
        return int(self.req_ts.shape[0])

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    def fleet_dp_sizes(self) -> dict[int, int]:
        """dp_size of every fleet worker (any model), by worker id: the workers
        table's, else the ranks observed in the load trace (0 when none)."""
        def top_rank(w: int) -> int:
            ranks = self.load_rank[self.load_worker == w]
            return int(ranks.max()) if ranks.size else -1

        return fleet_dp_sizes(self, self.worker_dp_size, top_rank)

    def fleet(self, model: int) -> np.ndarray:
        """Routable prefill fleet of a model: worker ids, ascending (section 0, items 9 and 11).

        With a workers table: workers of that model whose role is prefill or
        plain.  Without one: every worker (one model, all plain).
        """
        return fleet_members(self.has_workers_table, self.worker_model, self.worker_role, model)


def fleet_dp_sizes(trace, worker_dp: np.ndarray, top_rank) -> dict[int, int]:
    """dp_size of every fleet worker of a Trace or TraceSet (``trace.models``,
    ``trace.fleet``): ``worker_dp[w]`` when known, else ``top_rank(w) + 1``
    (the highest rank observed, -1 when none)."""
    out: dict[int, int] = {}
    for m in range(max(len(trace.models), 1)):
        for w in trace.fleet(m):
            w = int(w)
            if w not in out:
                dp = int(worker_dp[w])
                out[w] = dp if dp > 0 else top_rank(w) + 1
    return out


def fleet_members(has_table: bool, worker_model: np.ndarray, worker_role: np.ndarray, model: int) -> np.ndarray:
    """Worker ids of a model's routable prefill fleet (see :meth:`Trace.fleet`)."""
    from . import labels

    if not has_table:
        return np.arange(worker_model.shape[0], dtype=np.int32)
    mask = (worker_model == model) & (worker_role != labels.ROLE_DECODE)
    return np.nonzero(mask)[0].astype(np.int32)


# ===========================================================================
# Loading
# ===========================================================================

import hashlib  # noqa: E402
import os  # noqa: E402

import polars as pl  # noqa: E402

from . import labels  # noqa: E402

REQUESTS = "requests.parquet"
LOADS = "loads.parquet"
WORKERS = "workers.parquet"

DEFAULT_MODEL = "default"
MAX_VALUE = 2**53 - 1          # counts must be < 2**53
MAX_INT32 = 2**31 - 1
TAIL_COLUMNS = (
    "num_waiting_uncached_tokens",
    "num_total_tokens",
    "max_running_requests",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
)
LOAD_REQUIRED = ("num_running_reqs", "num_waiting_reqs", "num_tokens", "max_total_num_tokens")
FRESHNESS_NS = 5_000_000_000


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= 300 else text[:297] + "..."


class _File:
    """Error helpers bound to one file name (messages: file, column, row)."""

    def __init__(self, name: str, df: pl.DataFrame, locate=None):
        self.name = name
        self.df = df
        # locate(row) -> (file name, row in that file) for frames made of
        # several files or of a window of rows (replay/traceset.py)
        self.locate = locate

    def where(self, row: int) -> tuple[str, int]:
        return self.locate(int(row)) if self.locate is not None else (self.name, int(row))

    def fail(self, col: str, msg: str, row: int | None = None):
        name = self.name
        if row is not None:
            name, row = self.where(row)
        where = f"column '{col}'" + (f" row {row}" if row is not None else "")
        raise TraceError(f"{name}: {where}: {msg}")

    def has(self, col: str) -> bool:
        return col in self.df.columns

    def require(self, col: str) -> pl.Series:
        if col not in self.df.columns:
            self.fail(col, "missing (required column)")
        return self.df.get_column(col)

    # -- typed column readers ------------------------------------------------
    def ints(self, col: str, *, nullable: bool, fill: int = -1, lo: int = 0,
             hi: int = MAX_VALUE, s: pl.Series | None = None) -> np.ndarray:
        """Integer column -> int64 numpy (nulls -> ``fill``), checked lo <= v <= hi."""
        s = self.require(col) if s is None else s
        dtype = s.dtype
        if not dtype.is_integer():
            self.fail(col, f"wrong type {dtype}, expected an integer type")
        if not nullable and s.null_count():
            self.fail(col, "null value in a required integer column", int(s.is_null().arg_max()))
        row = _first_out_of_range(s, lo, hi)
        if row is not None:
            v = s[row]
            msg = f"must be >= {lo}, got {v}" if v < lo else f"must be <= {hi}, got {v}"
            if hi == MAX_VALUE and v > hi:
                msg = f"must be < 2**53, got {v}"
            self.fail(col, msg, row)
        return s.cast(pl.Int64).fill_null(fill).to_numpy()

    def strings(self, col: str, *, nullable: bool, s: pl.Series | None = None) -> pl.Series:
        s = self.require(col) if s is None else s
        if isinstance(s.dtype, (pl.Categorical, pl.Enum)):
            s = s.cast(pl.String)
        if s.dtype != pl.String:
            self.fail(col, f"wrong type {s.dtype}, expected a string type")
        if not nullable and s.null_count():
            self.fail(col, "null value in a required string column", int(s.is_null().arg_max()))
        return s

    def timestamps(self, col: str = "ts") -> np.ndarray:
        s = self.require(col)
        if isinstance(s.dtype, pl.Datetime):
            if s.null_count():
                self.fail(col, "null timestamp", int(s.is_null().arg_max()))
            return s.dt.epoch("ns").cast(pl.Int64).to_numpy()
        if s.dtype.is_integer():
            return self.ints(col, nullable=False, lo=-(2**63), hi=2**63 - 1, s=s)
        self.fail(col, f"wrong type {s.dtype}, expected int64 nanoseconds or a Datetime")


def _first_out_of_range(s: pl.Series, lo: int, hi: int) -> int | None:
    """First row (0-based) of an integer series outside [lo, hi], or None."""
    mn, mx = s.min(), s.max()
    if mn is None or (lo <= mn and mx <= hi):
        return None
    wide = s.cast(pl.Int128)
    return int(((wide < lo) | (wide > hi)).fill_null(False).arg_max())


def _read(dirpath: str, name: str, *, required: bool) -> tuple[pl.DataFrame | None, dict | None]:
    path = os.path.join(dirpath, name)
    if not os.path.exists(path):
        if required:
            raise TraceError(f"{name}: file not found in {dirpath}")
        return None, None
    if not os.path.isfile(path):
        raise TraceError(f"{name}: not a regular file: {path}")
    try:
        df = pl.read_parquet(path)
    except Exception as err:  # polars / arrow raise many kinds
        raise TraceError(f"{name}: unreadable Parquet ({type(err).__name__}: {_one_line(err)})") from None
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    info = {"path": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": digest}
    return df, info


def _map_names(s: pl.Series, names: list[str]) -> np.ndarray:
    """String series -> int32 index into ``names`` (-1 for null / unknown)."""
    if len(s) == 0:
        return np.zeros(0, dtype=np.int32)
    out = s.replace_strict(names, list(range(len(names))), default=-1, return_dtype=pl.Int32)
    return out.fill_null(-1).to_numpy().astype(np.int32, copy=False)


def _stable_order(ts: np.ndarray) -> np.ndarray | None:
    """Stable argsort by ts, or None when already sorted."""
    if ts.shape[0] < 2 or bool(np.all(ts[1:] >= ts[:-1])):
        return None
    return np.argsort(ts, kind="stable")


def _permute_csr(offsets: np.ndarray, perm: np.ndarray, *cols: np.ndarray):
    lens = np.diff(offsets)[perm]
    new_off = np.zeros(perm.shape[0] + 1, dtype=np.int64)
    np.cumsum(lens, out=new_off[1:])
    total = int(new_off[-1])
    gather = np.repeat(offsets[:-1][perm] - new_off[:-1], lens) + np.arange(total, dtype=np.int64)
    return new_off, [c[gather] for c in cols]


def _segment_max(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-row max of a CSR column (0 for empty rows)."""
    n = offsets.shape[0] - 1
    out = np.zeros(n, dtype=np.int64)
    lens = np.diff(offsets)
    nz = np.nonzero(lens > 0)[0]
    if nz.shape[0]:
        out[nz] = np.maximum.reduceat(values, offsets[nz])
    return out


@dataclass
class Frames:
    """A trace's rows as polars frames (``replay/traceset.py`` reads them), with
    the names that error messages use and where each row came from."""

    path: str
    requests: pl.DataFrame
    loads: pl.DataFrame
    workers: pl.DataFrame | None
    files: dict[str, dict]
    req_name: str = REQUESTS
    load_name: str = LOADS
    # row -> (file name, row in that file); None: the frame is one whole file
    req_locate: object = None
    load_locate: object = None


@dataclass
class Universe:
    """Worker ids and models of a whole trace: fixed once, so every window of
    a trace set encodes workers and models exactly as the whole trace would."""

    workers: list[str]
    models: list[str]
    worker_model: np.ndarray
    worker_role: np.ndarray
    worker_dp: np.ndarray
    worker_listed: np.ndarray
    has_table: bool
    non_fleet_load: list[str]


def parse_workers_table(wk_df: pl.DataFrame):
    """Check ``workers.parquet``; return ``(names, models, roles, dp_sizes)``."""
    W = _File(WORKERS, wk_df)
    t_name = W.strings("worker", nullable=False)
    dup = ~t_name.is_first_distinct()
    if dup.any():
        row = int(dup.arg_max())
        W.fail("worker", f"duplicate worker {t_name[row]!r}", row)
    t_model = (W.strings("model", nullable=True).fill_null(DEFAULT_MODEL) if W.has("model")
               else pl.Series([DEFAULT_MODEL] * wk_df.height, dtype=pl.String))
    if W.has("role"):
        roles = W.strings("role", nullable=True).fill_null("plain")
        bad = ~roles.is_in(list(labels.ROLES))
        if bad.any():
            row = int(bad.arg_max())
            W.fail("role", f"must be one of prefill|decode|plain, got {roles[row]!r}", row)
        t_role = roles.replace_strict(list(labels.ROLES), [labels.ROLES.index(r) for r in labels.ROLES],
                                      return_dtype=pl.Int8).to_numpy()
    else:
        t_role = np.full(wk_df.height, labels.ROLE_PLAIN, dtype=np.int8)
    t_dp = (W.ints("dp_size", nullable=True, fill=0, lo=1, hi=MAX_INT32) if W.has("dp_size")
            else np.zeros(wk_df.height, dtype=np.int64))
    return t_name.to_list(), t_model.to_list(), t_role, t_dp


def make_universe(table, load_names, match_names, req_models) -> Universe:
    """Worker ids and models from the workers table (or None) and the distinct
    load workers, match addresses and request models of the whole trace."""
    load_names = set(load_names)
    if table is None:
        workers = sorted(load_names | set(match_names))
        models = sorted(set(req_models)) or [DEFAULT_MODEL]
        n = len(workers)
        return Universe(workers, models, np.zeros(n, dtype=np.int32),
                        np.full(n, labels.ROLE_PLAIN, dtype=np.int8), np.zeros(n, dtype=np.int32),
                        np.ones(n, dtype=bool), False, [])
    t_name, t_model, t_role, t_dp = table
    listed = set(t_name)
    non_fleet_load = sorted(load_names - listed)
    workers = sorted(listed | set(non_fleet_load))
    models = sorted(set(t_model) | set(req_models))
    pos = {w: i for i, w in enumerate(workers)}
    mid = {m: i for i, m in enumerate(models)}
    n = len(workers)
    worker_model = np.full(n, -1, dtype=np.int32)
    worker_role = np.full(n, labels.ROLE_DECODE, dtype=np.int8)
    worker_dp = np.zeros(n, dtype=np.int32)
    worker_listed = np.zeros(n, dtype=bool)
    idx = np.array([pos[w] for w in t_name], dtype=np.int64)
    if idx.size:
        worker_model[idx] = [mid[m] for m in t_model]
        worker_role[idx] = t_role
        worker_dp[idx] = t_dp
        worker_listed[idx] = True
    return Universe(workers, models, worker_model, worker_role, worker_dp, worker_listed, True,
                    non_fleet_load)


def load_trace(path: str | os.PathLike, *, model: str | None = None) -> Trace:
    """Read, check and encode a trace directory (see ``traces/README.md``).

    ``path`` holds ``requests.parquet`` (or a ``requests/`` folder of Parquet
    files, optionally hive-partitioned), ``loads.parquet`` (or ``loads/``)
    and optionally ``workers.parquet``.  Rows are sorted by ``ts`` (stable)
    in memory; the files are never modified.  With ``model``, only that
    model's requests are kept (``Trace.req_index`` keeps their position in
    the whole time-sorted trace); an unknown model is an error.

    Raises :class:`TraceError` (one line: file, column, first bad row,
    0-based in the file as given) on any bad input.  Traces larger than
    memory are replayed window by window instead (``replay.traceset``).
    """
    from .traceset import read_frames

    return build_trace(read_frames(path), model=model)


def build_trace(fr: Frames, *, model: str | None = None, universe: Universe | None = None,
                index_offset: int = 0, strict_model: bool = True, facts: bool = True) -> Trace:
    """Check and encode frames into a :class:`Trace`.

    With ``universe`` (a window of a trace set), worker ids and models are the
    whole set's, and request ``i`` of the frame has request index
    ``index_offset + i`` (after the stable sort by ts).  ``strict_model=False``
    accepts a ``model`` that has no request in these frames (a window);
    ``facts=False`` skips the data facts that cost memory (per-worker ranks,
    unknown address names), which a window does not need.
    """
    want_facts = facts
    req_df, load_df, wk_df, files = fr.requests, fr.loads, fr.workers, fr.files
    facts: dict = {}
    R = _File(fr.req_name, req_df, fr.req_locate)
    L = _File(fr.load_name, load_df, fr.load_locate)
    table = parse_workers_table(wk_df) if wk_df is not None and universe is None else None

    # ---------------- requests.parquet: columns ----------------
    req_ts = R.timestamps("ts")
    rid_s = R.require("request_id")
    if rid_s.dtype.is_integer():
        request_id = R.ints("request_id", nullable=False, lo=-(2**63), hi=2**63 - 1, s=rid_s)
    else:
        rid_s = R.strings("request_id", nullable=False, s=rid_s)
        request_id = None
    dup = ~rid_s.is_first_distinct()
    if dup.any():
        row = int(dup.arg_max())
        first_name, first = R.where(int((rid_s == rid_s[row]).arg_max()))
        at = f"row {first}" if first_name == R.where(row)[0] else f"{first_name} row {first}"
        R.fail("request_id", f"duplicate request_id {rid_s[row]!r} (first at {at})", row)
    if request_id is None:
        request_id = rid_s.to_numpy()
    req_model_s = (R.strings("model", nullable=True).fill_null(DEFAULT_MODEL) if R.has("model")
                   else pl.Series("model", [DEFAULT_MODEL] * req_df.height, dtype=pl.String))
    input_tokens = R.ints("input_tokens", nullable=False)
    qb_s = R.require("query_blocks")
    query_blocks = R.ints("query_blocks", nullable=True, fill=0, s=qb_s)
    facts["query_blocks_null"] = int(qb_s.null_count())

    # matches: list<struct{worker, blocks}>
    m_s = R.require("matches")
    if isinstance(m_s.dtype, pl.Array):
        m_s = m_s.cast(pl.List(m_s.dtype.inner))
    inner = m_s.dtype.inner if isinstance(m_s.dtype, pl.List) else None
    fields = {f.name: f.dtype for f in inner.fields} if isinstance(inner, pl.Struct) else None
    if (fields is None or "worker" not in fields or "blocks" not in fields):
        R.fail("matches", f"wrong type {m_s.dtype}, expected list<struct{{worker: string, blocks: integer}}>")
    m_len = m_s.list.len().fill_null(0).cast(pl.Int64).to_numpy()
    m_off = np.zeros(req_df.height + 1, dtype=np.int64)
    np.cumsum(m_len, out=m_off[1:])
    ex = (pl.DataFrame({"row": np.arange(req_df.height, dtype=np.int64), "m": m_s})
          .filter(pl.Series(m_len > 0)).explode("m"))
    ent = ex.get_column("m")
    ent_row = ex.get_column("row").to_numpy()
    if ent.null_count():
        i = int(ent.is_null().arg_max())
        R.fail("matches", f"entry {i - m_off[ent_row[i]]} is null", int(ent_row[i]))
    ent_worker = ent.struct.field("worker")
    ent_blocks = ent.struct.field("blocks")
    for name, col, kind in (("worker", ent_worker, "string"), ("blocks", ent_blocks, "int")):
        ok = (col.dtype.is_integer() if kind == "int"
              else col.dtype == pl.String or isinstance(col.dtype, (pl.Categorical, pl.Enum)))
        if not ok:
            R.fail("matches", f"wrong type {m_s.dtype}, expected list<struct{{worker: string, blocks: integer}}>")
        if col.null_count():
            i = int(col.is_null().arg_max())
            R.fail("matches", f"entry {i - m_off[ent_row[i]]} has a null {name}", int(ent_row[i]))
    ent_worker = ent_worker.cast(pl.String)
    i = _first_out_of_range(ent_blocks, 0, MAX_VALUE)
    if i is not None:
        v = ent_blocks[i]
        R.fail("matches", f"entry {i - m_off[ent_row[i]]} blocks must be "
               + (f">= 0, got {v}" if v < 0 else f"< 2**53, got {v}"), int(ent_row[i]))
    match_blocks = ent_blocks.cast(pl.Int64).to_numpy()

    if R.has("best_prefix_blocks"):
        best_prefix = R.ints("best_prefix_blocks", nullable=True, fill=-1)
    else:
        best_prefix = None
    sel_s = R.strings("selected_worker", nullable=True) if R.has("selected_worker") else None

    # ---------------- loads.parquet: columns ----------------
    load_ts = L.timestamps("ts")
    lw_s = L.strings("worker", nullable=False)
    load_rank = (L.ints("dp_rank", nullable=True, fill=0, hi=MAX_INT32) if L.has("dp_rank")
                 else np.zeros(load_df.height, dtype=np.int64))
    load_req = [L.ints(c, nullable=False) for c in LOAD_REQUIRED]
    tails = []
    tail_valid = np.ones(load_df.height, dtype=bool)
    tail_any = np.zeros(load_df.height, dtype=bool)
    for c in TAIL_COLUMNS:
        if L.has(c):
            v = L.ints(c, nullable=True, fill=-1)
            tail_valid &= v >= 0
            tail_any |= v >= 0
        else:
            v = np.full(load_df.height, -1, dtype=np.int64)
            tail_valid[:] = False
        tails.append(v)
    tails = [np.where(tail_valid, v, 0) for v in tails]
    inflight = (L.ints("router_inflight", nullable=True, fill=-1) if L.has("router_inflight")
                else np.full(load_df.height, -1, dtype=np.int64))

    # ---------------- worker universe ----------------
    if universe is None:
        universe = make_universe(table, lw_s.unique().to_list(),
                                 ent_worker.unique().to_list(), req_model_s.unique().to_list())
    workers, models = universe.workers, universe.models
    worker_model, worker_role = universe.worker_model, universe.worker_role
    worker_dp, worker_listed = universe.worker_dp, universe.worker_listed
    non_fleet_load = universe.non_fleet_load
    has_table = universe.has_table
    # match addresses: with a table only listed workers are known
    if has_table:
        known_ids = np.nonzero(worker_listed)[0].astype(np.int32)
        # index into the listed workers, then to worker ids; -1 (unknown) picks the appended -1
        lookup = np.append(known_ids, np.int32(-1))
        match_worker = lookup[_map_names(ent_worker, [workers[i] for i in known_ids])]
    else:
        match_worker = _map_names(ent_worker, workers)
    load_worker = _map_names(lw_s, workers)
    req_model = _map_names(req_model_s, models)
    if load_worker.size and (load_worker < 0).any():   # only with a fixed universe
        row = int(np.argmax(load_worker < 0))
        L.fail("worker", f"worker {lw_s[row]!r} is not in the trace's worker index", row)
    if req_model.size and (req_model < 0).any():
        row = int(np.argmax(req_model < 0))
        R.fail("model", f"model {req_model_s[row]!r} is not in the trace's model index", row)
    if sel_s is not None:
        sel = _map_names(sel_s, workers)
        facts["selected_worker_null"] = int(sel_s.null_count())
        facts["selected_worker_unknown"] = int(((sel < 0) & sel_s.is_not_null().to_numpy()).sum())
    else:
        sel = None

    # best_prefix default: max of match blocks (0 if none)
    if best_prefix is None or (best_prefix < 0).any():
        dflt = _segment_max(match_blocks, m_off)
        best_prefix = dflt if best_prefix is None else np.where(best_prefix < 0, dflt, best_prefix)

    # ---------------- data facts (whole trace, before any model filter) ----
    unknown = match_worker < 0
    facts["requests"] = int(req_df.height)
    facts["requests_with_matches"] = int((m_len > 0).sum())
    facts["requests_without_prefix_signal"] = int(((m_len == 0) | (query_blocks == 0)).sum())
    facts["match_entries"] = int(match_worker.shape[0])
    facts["unknown_match_entries"] = int(unknown.sum())
    unk_names = (ent_worker.filter(pl.Series(unknown)).unique().sort().to_list()
                 if want_facts and unknown.any() else [])
    facts["unknown_match_addresses"] = len(unk_names)
    facts["unknown_match_address_examples"] = unk_names[:5]
    facts["unknown_match_address_examples_all"] = unk_names if len(unk_names) <= 1000 else unk_names[:1000]
    if req_df.height:
        facts["span_start_ns"] = int(req_ts.min())
        facts["span_end_ns"] = int(req_ts.max())
        facts["span_s"] = (facts["span_end_ns"] - facts["span_start_ns"]) / 1e9
    facts["requests_sorted_on_disk"] = _stable_order(req_ts) is None
    facts["load_rows"] = int(load_df.height)
    facts["loads_sorted_on_disk"] = _stable_order(load_ts) is None
    facts["workers"] = len(workers)
    facts["models"] = {m: int(c) for m, c in zip(models, np.bincount(req_model, minlength=len(models)))}
    facts["has_workers_table"] = has_table
    facts["non_fleet_load_workers"] = non_fleet_load
    facts["load_rows_with_tail"] = int(tail_valid.sum())
    facts["load_rows_partial_tail"] = int((tail_any & ~tail_valid).sum())
    facts["load_rows_without_tail"] = int((~tail_any).sum())
    facts["has_router_inflight"] = L.has("router_inflight")
    dp_of_row = worker_dp[load_worker] if load_worker.size else np.zeros(0, dtype=np.int32)
    ignored = (dp_of_row > 0) & (load_rank >= dp_of_row)
    facts["ignored_rank_rows"] = int(ignored.sum())
    if load_df.height and want_facts:
        rk = (pl.DataFrame({"w": load_worker, "r": load_rank}).unique()
              .group_by("w").agg(pl.col("r").sort()).sort("w"))
        facts["ranks_per_worker"] = {workers[w]: [int(x) for x in r]
                                     for w, r in zip(rk["w"].to_list(), rk["r"].to_list())}
    else:
        facts["ranks_per_worker"] = {}
    facts["workers_without_samples"] = sorted(set(workers) - set(facts["ranks_per_worker"]))
    facts["has_selected_worker"] = sel is not None

    # ---------------- sort (stable, in memory) ----------------
    perm = _stable_order(req_ts)
    if perm is not None:
        req_ts = req_ts[perm]
        request_id = request_id[perm]
        req_model = req_model[perm]
        input_tokens = input_tokens[perm]
        query_blocks = query_blocks[perm]
        best_prefix = best_prefix[perm]
        if sel is not None:
            sel = sel[perm]
        m_off, (match_worker, match_blocks) = _permute_csr(m_off, perm, match_worker, match_blocks)
    lperm = _stable_order(load_ts)
    load_cols = [load_ts, load_worker, load_rank, *load_req, tail_valid, *tails, inflight]
    if lperm is not None:
        load_cols = [c[lperm] for c in load_cols]
    (load_ts, load_worker, load_rank, l_run, l_wait, l_tok, l_max, tail_valid,
     t_wu, t_tot, t_mr, t_pt, t_pb, inflight) = load_cols

    req_index = (None if index_offset == 0
                 else np.arange(index_offset, index_offset + req_ts.shape[0], dtype=np.int64))
    if model is not None:
        if model not in models or (strict_model and facts["models"].get(model, 0) == 0):
            raise TraceError(f"{REQUESTS}: column 'model': no request has model {model!r} "
                             f"(models: {', '.join(models)})")
        keep = np.nonzero(req_model == models.index(model))[0]
        facts["model_filter"] = model
        facts["requests_kept"] = int(keep.shape[0])
        req_index = keep.astype(np.int64) + int(index_offset)
        m_off, (match_worker, match_blocks) = _permute_csr(m_off, keep, match_worker, match_blocks)
        req_ts, request_id, req_model = req_ts[keep], request_id[keep], req_model[keep]
        input_tokens, query_blocks, best_prefix = input_tokens[keep], query_blocks[keep], best_prefix[keep]
        if sel is not None:
            sel = sel[keep]

    i32 = lambda a: np.ascontiguousarray(a, dtype=np.int32)  # noqa: E731
    i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
    return Trace(
        path=fr.path,
        workers=workers,
        models=models,
        worker_model=i32(worker_model),
        worker_role=np.ascontiguousarray(worker_role, dtype=np.int8),
        worker_dp_size=i32(worker_dp),
        has_workers_table=has_table,
        request_id=request_id,
        req_ts=i64(req_ts),
        req_model=i32(req_model),
        req_input_tokens=i64(input_tokens),
        req_query_blocks=i64(query_blocks),
        req_best_prefix_blocks=i64(best_prefix),
        match_offsets=i64(m_off),
        match_worker=i32(match_worker),
        match_blocks=i64(match_blocks),
        req_selected_worker=None if sel is None else i32(sel),
        load_ts=i64(load_ts),
        load_worker=i32(load_worker),
        load_rank=i32(load_rank),
        load_running=i64(l_run),
        load_waiting=i64(l_wait),
        load_num_tokens=i64(l_tok),
        load_max_total=i64(l_max),
        load_has_tail=np.ascontiguousarray(tail_valid, dtype=bool),
        load_waiting_uncached=i64(t_wu),
        load_total_tokens=i64(t_tot),
        load_max_running=i64(t_mr),
        load_prefill_tokens=i64(t_pt),
        load_prefill_busy_us=i64(t_pb),
        load_router_inflight=i64(inflight),
        files=files,
        facts=facts,
        req_index=req_index,
        worker_listed=worker_listed,
    )


def fresh_fleet_sample_mask(trace: Trace, freshness_ns: int = FRESHNESS_NS) -> np.ndarray:
    """Per request: True when *some* fleet worker of its model has a load sample
    (of a counted rank) with ``0 <= request_ts - sample_ts <= freshness``.

    Not the rank-exact all-ranks rule of the snapshot: a cheap, vectorised
    data fact ("no fresh sample from any fleet worker" is its negation).
    """
    out = np.zeros(trace.n_requests, dtype=bool)
    dp = trace.worker_dp_size[trace.load_worker] if trace.load_ts.size else np.zeros(0, np.int32)
    counted = (dp == 0) | (trace.load_rank < dp)
    for m in np.unique(trace.req_model):          # loop over models, not rows
        in_fleet = np.zeros(trace.n_workers, dtype=bool)
        in_fleet[trace.fleet(int(m))] = True
        fts = trace.load_ts[counted & in_fleet[trace.load_worker]]   # already sorted
        sel = np.nonzero(trace.req_model == m)[0]
        if fts.size == 0:
            continue
        rts = trace.req_ts[sel]
        idx = np.searchsorted(fts, rts, side="right") - 1
        ok = idx >= 0
        out[sel[ok]] = (rts[ok] - fts[idx[ok]]) <= freshness_ns
    return out


def validate_trace(path: str | os.PathLike, *, freshness_ms: int = 5000, window: int | None = 0,
                   progress=None) -> dict:
    """Load a trace (raising :class:`TraceError` on bad input) and return its data facts.

    Adds to ``Trace.facts``: ``requests_without_fresh_fleet_sample`` (and its
    ``share``), the freshness used, the fleet size per model and the files.
    ``window`` (ns; None = auto, as ``sweep --window``) checks a trace larger
    than memory window by window (``replay.traceset.validate_windows``).
    """
    if window != 0:
        from .traceset import TraceSet, auto_window, validate_windows

        tset = TraceSet.open(path, hash_files=False)
        w = auto_window(tset) if window is None else int(window)
        if w:
            return validate_windows(tset, w, int(freshness_ms) * 1_000_000, progress)
    trace = load_trace(path)
    facts = dict(trace.facts)
    facts.pop("unknown_match_address_examples_all", None)
    fresh = fresh_fleet_sample_mask(trace, int(freshness_ms) * 1_000_000)
    stale = int((~fresh).sum())
    facts["freshness_ms"] = int(freshness_ms)
    facts["requests_without_fresh_fleet_sample"] = stale
    facts["share_without_fresh_fleet_sample"] = stale / trace.n_requests if trace.n_requests else 0.0
    facts["fleet_workers"] = {m: int(trace.fleet(i).shape[0]) for i, m in enumerate(trace.models)}
    facts["roles"] = {r: int((trace.worker_role == i).sum()) for i, r in enumerate(labels.ROLES)}
    facts["files"] = trace.files
    facts["path"] = trace.path
    return facts
