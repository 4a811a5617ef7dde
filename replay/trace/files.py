"""Files and partitions: which Parquet files make a trace, and reading them as polars frames.

A table (requests, loads) is one ``requests.parquet`` or a ``requests/`` folder
of Parquet files at any depth, optionally hive-partitioned
(``requests/date=2026-11-01/part-0.parquet``).  The files of a folder are taken
in path order (component by component; hidden ``.`` and ``_`` entries skipped)
and concatenated; a hive ``key=value`` segment becomes a string column ``key``
unless the file has a column of that name.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.trace.base import KINDS, LOADS, REQUESTS, WORKERS, TraceError, one_line, run_both
from replay.trace.columns import Locate


def _leaves(col: pa.Field, prefix: str = "") -> list[tuple[str, pa.DataType]]:
    """The Parquet leaf columns of ``col`` (``matches.list.element.worker``) and their types."""
    name, t = prefix + col.name, col.type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _leaves(t.value_field, name + ".list.")
    if pa.types.is_struct(t):
        return [leaf for f in t for leaf in _leaves(f, name + ".")]
    return [(name, t)]


def write_options(schema: pa.Schema) -> dict[str, Any]:
    """How the simulator writes a trace table of ``schema`` (``pq.write_table``'s options).

    zstd; dictionary pages only for strings and booleans (worker names, reasons: the
    fast loader reads names as codes from them); every integer column, nested ones
    included, as DELTA_BINARY_PACKED.  Timestamps, block ids and counters are runs
    of near or equal values: on a Mooncake simulation this writes the three tables
    in about half the encoder's time of the default (dictionary pages tried on every
    column, then given up on the high-cardinality ones) and 40% fewer bytes, and any
    Parquet reader reads it back as the same table.  Statistics are written only for
    the top-level columns: those of a list's leaves (``hash_ids``, ``matches``) cost a
    third of ``requests.parquet``'s write and no reader of ours filters on them."""
    dictionary: list[str] = []
    encoding: dict[str, str] = {}
    stats: list[str] = []
    for top in schema:
        for name, t in _leaves(top):
            if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_boolean(t):
                dictionary.append(name)
            elif pa.types.is_integer(t):
                encoding[name] = "DELTA_BINARY_PACKED"
            if name == top.name:
                stats.append(name)
    return {"compression": "zstd", "use_dictionary": dictionary, "column_encoding": encoding,
            "write_statistics": stats}


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


@dataclass
class Frames:
    """A trace's rows as polars frames, with the names that error messages use
    and where each row came from."""

    path: str
    requests: pl.DataFrame
    loads: pl.DataFrame
    workers: pl.DataFrame | None
    files: dict[str, dict]
    req_name: str = REQUESTS
    load_name: str = LOADS
    # row -> (file name, row in that file); None: the frame is one whole file
    req_locate: Locate | None = None
    load_locate: Locate | None = None


# ---------------------------------------------------------------------------
# listing
# ---------------------------------------------------------------------------
def hive_keys(rel: str) -> dict[str, str]:
    """``key=value`` folder segments of a path relative to its table folder."""
    out: dict[str, str] = {}
    for seg in rel.split("/")[:-1]:
        if "=" in seg:
            k, v = seg.split("=", 1)
            if k:
                out[k] = unquote(v)
    return out


def _dangling(path: str, name: str) -> None:
    if os.path.islink(path) and not os.path.exists(path):
        raise TraceError(f"{name}: broken symbolic link (its target {os.readlink(path)} does not exist)")


def list_parts(dirpath: str, kind: str) -> list[Part]:
    """The Parquet files of ``kind`` ("requests" / "loads"): ``kind.parquet`` or
    the files under ``kind/``, in path order; [] when neither exists."""
    single = os.path.join(dirpath, KINDS[kind])
    folder = os.path.join(dirpath, kind)
    _dangling(single, KINDS[kind])
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
            _dangling(full, rel)
            if not os.path.isfile(full):
                raise TraceError(f"{rel}: not a regular file: {full}")
            found.append((tuple(rel.split("/")), Part(os.path.abspath(full), rel,
                                                      hive_keys(os.path.relpath(full, folder)))))
    if not found:
        raise TraceError(f"{kind}/: no .parquet files under {folder}")
    found.sort(key=lambda t: t[0])
    return [p for _k, p in found]


def require_dir(dirpath: str) -> None:
    if not os.path.isdir(dirpath):
        raise TraceError(f"{dirpath}: not a trace directory (expected {REQUESTS}, {LOADS})")


def parts_or_fail(dirpath: str, kind: str) -> list[Part]:
    parts = list_parts(dirpath, kind)
    if not parts:
        raise TraceError(f"{KINDS[kind]}: file not found in {dirpath} (nor a {kind}/ folder)")
    return parts


def file_info(path: str, *, digest: bool = True) -> dict:
    """Provenance of one file: absolute path, bytes and (with ``digest``) sha256."""
    info: dict = {"path": os.path.abspath(path), "bytes": os.path.getsize(path)}
    if digest:
        with open(path, "rb") as fh:
            info["sha256"] = hashlib.file_digest(fh, "sha256").hexdigest()
    return info


def row_counts(path: str | os.PathLike) -> dict[str, int]:
    """Rows of the requests and loads tables from the Parquet footers alone
    (no data is read): ``{"requests": n, "loads": m}``."""
    dirpath = os.fspath(path)
    require_dir(dirpath)
    out = {}
    for kind in KINDS:
        out[kind] = sum(open_parquet(p).metadata.num_rows for p in parts_or_fail(dirpath, kind))
    return out


# ---------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------
def open_parquet(part: Part) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(part.path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {one_line(err)})") from None


def read_table_file(dirpath: str, name: str) -> tuple[pl.DataFrame | None, dict | None]:
    """An optional single-file table (``workers.parquet``) and its provenance."""
    path = os.path.join(dirpath, name)
    _dangling(path, name)
    if not os.path.exists(path):
        return None, None
    if not os.path.isfile(path):
        raise TraceError(f"{name}: not a regular file: {path}")
    try:
        df = pl.read_parquet(path)
    except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
        raise TraceError(f"{name}: unreadable Parquet ({type(err).__name__}: {one_line(err)})") from None
    return df, file_info(path)


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


def to_frame(part: Part, table, offset: int = 0) -> pl.DataFrame:
    """An arrow table of one file (or some row groups, the first at row
    ``offset``) as a polars frame: categoricals as strings, hive columns added,
    ``ts`` in epoch ns, ``matches`` and ``hash_ids`` in their canonical types."""
    try:
        df = pl.from_arrow(table)
    except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {one_line(err)})") from None
    if isinstance(df, pl.Series):
        df = df.to_frame()
    return finish_frame(part, df, offset)


def finish_frame(part: Part, df: pl.DataFrame, offset: int = 0) -> pl.DataFrame:
    casts = [pl.col(c).cast(pl.String) for c, t in df.schema.items()
             if isinstance(t, (pl.Categorical, pl.Enum))]
    if casts:
        df = df.with_columns(casts)
    extra = [pl.lit(v, dtype=pl.String).alias(k) for k, v in part.hive.items() if k not in df.columns]
    if extra:
        df = df.with_columns(extra)
    return _canonical(_epoch_ns(part, df, offset))


MATCHES_T = pl.List(pl.Struct({"worker": pl.String, "blocks": pl.Int64}))
HASH_IDS_T = pl.List(pl.Int64)


def _canonical(df: pl.DataFrame) -> pl.DataFrame:
    """Types that may legitimately differ between the files of a set, made one:
    ``matches`` as list<struct{worker: string, blocks: int64}> (any integer
    width, categorical workers, fixed-size lists, extra fields dropped) and
    ``hash_ids`` as list<int64> (any integer width, fixed-size lists)."""
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
    h = df.schema.get("hash_ids")
    if (h is not None and h != HASH_IDS_T and isinstance(h, (pl.List, pl.Array))
            and h.inner.is_integer()):
        fixes.append(pl.col("hash_ids").cast(HASH_IDS_T))
    if not fixes:
        return df
    try:
        return df.with_columns(fixes)
    except Exception:  # noqa: BLE001 - out-of-range values: left as they are, the checks name the row
        return df


def read_part(part: Part, groups: list[int] | None = None, offset: int = 0) -> pl.DataFrame:
    """A file (or some of its row groups, the first at row ``offset``) as a
    polars frame with its hive columns."""
    if groups is None:
        try:    # polars' reader is several times faster than pyarrow's + from_arrow
            df = pl.read_parquet(part.path, hive_partitioning=False)
        except Exception:  # noqa: BLE001 - any failure: pyarrow below names the problem
            df = None
        if df is not None:
            return finish_frame(part, df, offset)
    pf = open_parquet(part)
    try:
        table = pf.read() if groups is None else pf.read_row_groups(groups)
    except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds
        raise TraceError(f"{part.name}: unreadable Parquet ({type(err).__name__}: {one_line(err)})") from None
    return to_frame(part, table, offset)


def _kind_of(dtype) -> str:
    if dtype.is_integer():
        return "integer"
    if dtype in (pl.String, pl.Null):
        return "string" if dtype == pl.String else "null"
    return str(dtype)


def concat(parts: list[Part], dfs: list[pl.DataFrame]) -> pl.DataFrame:
    """Concatenate the frames of several files; a column whose kind of type
    differs between files is an error naming the file."""
    first: dict[str, tuple[str, str, object]] = {}
    for part, df in zip(parts, dfs, strict=True):
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
    except Exception as err:  # noqa: BLE001 - polars raises many kinds on mismatched schemas
        raise TraceError(f"{parts[0].name}: files do not concatenate ({type(err).__name__}: "
                         f"{one_line(err)})") from None


def locator(names: list[str], part_idx: np.ndarray, row_in_part: np.ndarray) -> Locate:
    def locate(row: int) -> tuple[str, int]:
        return names[int(part_idx[row])], int(row_in_part[row])
    return locate


def read_whole(parts: list[Part]) -> tuple[pl.DataFrame, str, Locate | None]:
    """Every row of a table: the frame, the name errors use, and the locator
    (None for a single ``requests.parquet`` / ``loads.parquet``)."""
    dfs = [read_part(p) for p in parts]
    df = concat(parts, dfs)
    if len(parts) == 1 and parts[0].name in KINDS.values():
        return df, parts[0].name, None
    sizes = np.array([d.height for d in dfs], dtype=np.int64)
    part_idx = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    row_in = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
    return df, parts[0].name, locator([p.name for p in parts], part_idx, row_in)


def read_frames(path: str | os.PathLike) -> Frames:
    """Every row of a trace directory (either layout) as polars frames."""
    dirpath = os.fspath(path)
    require_dir(dirpath)
    req_parts = parts_or_fail(dirpath, "requests")
    load_parts = parts_or_fail(dirpath, "loads")
    wk_df, wk_info = read_table_file(dirpath, WORKERS)
    parts = (*req_parts, *load_parts)
    # the sha256 of every file (provenance) is computed while the files are parsed
    (req, loads), infos = run_both(lambda: (read_whole(req_parts), read_whole(load_parts)),
                                   lambda: [file_info(p.path) for p in parts])
    files = {p.name: info for p, info in zip(parts, infos, strict=True)}
    if wk_df is not None:
        files[WORKERS] = wk_info
    (req_df, req_name, req_loc), (load_df, load_name, load_loc) = req, loads
    return Frames(os.path.abspath(dirpath), req_df, load_df, wk_df, files, req_name, load_name,
                  req_loc, load_loc)


def log_identity(source: str | os.PathLike) -> dict[str, Any]:
    """What ``sim.json`` records about a trace-directory log so a run of the same trace finds
    the grid: its absolute path and each trace file's sha256 (run.json's ``trace.files``)."""
    p = Path(source)
    out: dict[str, Any] = {"path": str(p.resolve())}
    if p.is_dir():

        files = {}
        for f in sorted(p.iterdir()):
            if f.is_file() and f.suffix == ".parquet":
                info = file_info(str(f), digest=True)
                files[f.name] = {"bytes": info.get("bytes"), "sha256": info.get("sha256")}
        out["files"] = files
    return out
