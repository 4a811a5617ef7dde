"""Checked column readers: a polars column in, a numpy array out, or one error line
naming the file, the column and the first bad row (as the row is in the file)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, NoReturn

import numpy as np
import polars as pl
import pyarrow as pa

from replay.trace.base import MAX_VALUE, TraceError

# row of a frame -> (file name, row in that file)
Locate = Callable[[int], tuple[str, int]]


class IntSpec(NamedTuple):
    """One integer column for :meth:`Columns.int_columns` (as :meth:`Columns.ints`'s arguments)."""

    col: str
    nullable: bool
    fill: int = -1
    lo: int = 0
    hi: int = MAX_VALUE
    dtype: type[pl.DataType] = pl.Int64     # the numpy array's type (values are checked to fit)


class Columns:
    """The columns of one frame (one file, or the rows of several files of a set)
    with error helpers that name the file and row each bad value came from."""

    def __init__(self, name: str, df: pl.DataFrame, locate: Locate | None = None):
        self.name = name
        self.df = df
        self.locate = locate

    def where(self, row: int) -> tuple[str, int]:
        return self.locate(int(row)) if self.locate is not None else (self.name, int(row))

    def fail(self, col: str, msg: str, row: int | None = None) -> NoReturn:
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

    def ints(self, col: str, *, nullable: bool, fill: int = -1, lo: int = 0,
             hi: int = MAX_VALUE, s: pl.Series | None = None) -> np.ndarray:
        """Integer column -> int64 numpy (nulls -> ``fill``), checked lo <= v <= hi."""
        s = self.require(col) if s is None else s
        dtype = s.dtype
        if not dtype.is_integer():
            self.fail(col, f"wrong type {dtype}, expected an integer type")
        if not nullable and s.null_count():
            self.fail(col, "null value in a required integer column", int(s.is_null().arg_max()))
        full = dtype == pl.Int64 and lo <= -(2**63) and hi >= 2**63 - 1     # nothing to check
        row = None if full else first_out_of_range(s, lo, hi)
        if row is not None:
            v = s[row]
            msg = f"must be >= {lo}, got {v}" if v < lo else f"must be <= {hi}, got {v}"
            if hi == MAX_VALUE and v > hi:
                msg = f"must be < 2**53, got {v}"
            self.fail(col, msg, row)
        return dense_ints(s, fill, np.int64)

    def int_columns(self, specs: list[IntSpec]) -> dict[str, np.ndarray]:
        """:meth:`ints` of several columns at once: the checks' statistics in one
        parallel pass, the conversion in another.  The first failing column, in
        ``specs`` order, raises exactly the error :meth:`ints` gives it; an
        absent column of a nullable spec is left out of the result."""
        present = [sp for sp in specs if sp.col in self.df.columns and self.df.schema[sp.col].is_integer()]
        stats = {}
        if present:
            row = self.df.select(
                [e for sp in present for e in (pl.col(sp.col).min().cast(pl.Int128).alias(f"lo:{sp.col}"),
                                                pl.col(sp.col).max().cast(pl.Int128).alias(f"hi:{sp.col}"),
                                                pl.col(sp.col).null_count().alias(f"nul:{sp.col}"))]).row(0)
            for i, sp in enumerate(present):
                stats[sp.col] = row[3 * i: 3 * i + 3]
        for sp in specs:
            if sp.col not in self.df.columns:
                if not sp.nullable:
                    self.fail(sp.col, "missing (required column)")
                continue
            st = stats.get(sp.col)
            bad = (st is None or (st[2] and not sp.nullable)
                   or (st[0] is not None and (st[0] < sp.lo or st[1] > sp.hi)))
            if bad:
                self.ints(sp.col, nullable=sp.nullable, fill=sp.fill, lo=sp.lo, hi=sp.hi)  # raises
        # each column copied once into its own numpy array, nulls filled where there are any
        return {sp.col: dense_ints(self.df.get_column(sp.col), sp.fill, _NP[sp.dtype])
                for sp in specs if sp.col in stats}

    def floats(self, col: str) -> np.ndarray:
        """Nullable non-negative finite number column (integer or float) -> float64,
        NaN for null."""
        s = self.require(col)
        if not (s.dtype.is_integer() or s.dtype.is_float() or s.dtype == pl.Null):
            self.fail(col, f"wrong type {s.dtype}, expected a number")
        v = s.cast(pl.Float64).to_numpy()
        bad = ~np.isnan(v) & ~((v >= 0) & np.isfinite(v))
        if s.dtype.is_float():
            bad |= np.isnan(v) & s.is_not_null().to_numpy()    # a NaN value, not a null
        if bad.any():
            row = int(np.argmax(bad))
            self.fail(col, f"must be finite and >= 0, got {s[row]}", row)
        return v

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
            ns = s.dt.epoch("ns")
            if ns.null_count():      # beyond int64 nanoseconds (years before 1677 or after 2262)
                row = int(ns.is_null().arg_max())
                self.fail(col, "datetime outside the int64 nanosecond range (years 1678..2262)", row)
            return ns.cast(pl.Int64).to_numpy()
        if s.dtype.is_integer():
            return self.ints(col, nullable=False, lo=-(2**63), hi=2**63 - 1, s=s)
        self.fail(col, f"wrong type {s.dtype}, expected int64 nanoseconds or a Datetime")


_NP = {pl.Int64: np.int64, pl.Int32: np.int32}


def int_dtype(t: pa.DataType) -> np.dtype:
    """The numpy dtype of an Arrow integer type, read without pandas (pyarrow's
    ``to_pandas_dtype`` imports pandas before pyarrow 19, and pandas is not a dependency)."""
    if not pa.types.is_integer(t):
        raise TypeError(f"not an integer type: {t}")
    return np.dtype(str(t))


def pool_empty(n: int, dtype) -> np.ndarray:
    """``np.empty(n, dtype)``, writeable and contiguous, for the big columns of a trace.

    Large arrays come from Arrow's system memory pool (``malloc``: ordinary
    4 KiB pages), not numpy's allocator nor Arrow's default pool: both ask the
    kernel for transparent huge pages on large blocks (numpy's ``madvise``,
    mimalloc's segments), and a fresh huge page is zeroed (and, where the
    kernel defragments for it, compacted) at first touch.  Measured on the
    1M bench trace's load columns (about 0.47 GB): 0.4-0.6 s less system time
    per load, the same user time.  The array's base holds the buffer."""
    dt = np.dtype(dtype)
    if n * dt.itemsize < 1 << 20:
        return np.empty(n, dtype=dt)
    return np.frombuffer(pa.allocate_buffer(n * dt.itemsize, memory_pool=_SYSTEM_POOL), dtype=dt, count=n)


_SYSTEM_POOL = pa.system_memory_pool()


def dense_ints(s: pl.Series, fill: int, dtype) -> np.ndarray:
    """An integer series (values checked to fit ``dtype``) as one contiguous
    numpy array, nulls as ``fill``, read-only exactly when polars' own
    ``fill_null(fill).cast(dtype).to_numpy()`` would give a read-only view
    (one chunk): the chunks (one per row group) copied once, without the
    intermediate column that ``fill_null`` and ``cast`` allocate."""
    chunks = s.get_chunks()
    if len(chunks) == 1 and s.null_count() == 0:
        view = s.to_numpy()
        if view.dtype == np.dtype(dtype):
            return view                            # a view of polars' memory, as before
    out = pool_empty(len(s), dtype)
    at = 0
    for ch in chunks:
        put_ints(out[at:at + len(ch)], ch, fill)
        at += len(ch)
    if len(chunks) == 1:
        out.flags.writeable = False
    return out


def take_by_blocks(table: np.ndarray, codes: np.ndarray, out: np.ndarray, block: int = 1 << 16) -> np.ndarray:
    """``np.take(table, codes, out=out)`` a block of rows at a time: numpy casts int32 codes
    to intp indices first, and for a column of millions of rows that cast is a fresh
    array twice the codes' size; a block's cast is small and its memory reused."""
    for at in range(0, codes.shape[0], block):
        np.take(table, codes[at:at + block], out=out[at:at + block])
    return out


def all_distinct(s: pl.Series) -> bool:
    """Whether no value of ``s`` repeats.  Distinct hashes prove distinct values (equal
    values hash alike), and counting 64-bit hashes is about 3x cheaper than counting
    strings; only when two hashes meet are the values themselves counted."""
    n = len(s)
    return s.hash().n_unique() == n or s.n_unique() == n


def valid_rows(arr: pa.Array) -> np.ndarray:
    """The rows of ``arr`` that are not null (its validity bitmap, offset applied), as bools."""
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(arr.buffers()[0], dtype=np.uint8), bitorder="little")
    return bits[arr.offset:arr.offset + len(arr)].view(np.bool_)


def put_ints(dest: np.ndarray, ch: pl.Series, fill: int) -> None:
    """One chunk of an integer series copied into ``dest``, nulls as ``fill``: the values
    buffer as it is (any value under a null), then the nulls set from the validity bitmap,
    without the filled column that ``fill_null`` would allocate first."""
    if ch.null_count() == 0:
        dest[:] = ch.to_numpy()
        return
    arr = ch.to_arrow()
    dest[:] = np.frombuffer(arr.buffers()[1], dtype=int_dtype(arr.type), count=len(arr),
                            offset=arr.offset * arr.type.bit_width // 8)
    np.putmask(dest, ~valid_rows(arr), fill)


def first_out_of_range(s: pl.Series, lo: int, hi: int) -> int | None:
    """First row (0-based) of an integer series outside [lo, hi], or None."""
    mn, mx = s.min(), s.max()
    if mn is None or (lo <= mn and mx <= hi):
        return None
    wide = s.cast(pl.Int128)
    return int(((wide < lo) | (wide > hi)).fill_null(False).arg_max())


def map_names(s: pl.Series, names: list[str]) -> np.ndarray:
    """String series -> int32 index into ``names`` (-1 for null / unknown)."""
    if len(s) == 0:
        return np.zeros(0, dtype=np.int32)
    if not names:
        return np.full(len(s), -1, dtype=np.int32)
    # an Enum of the names: its physical codes are the positions (unknown -> null)
    codes = s.cast(pl.Enum(names), strict=False).to_physical().cast(pl.Int32)
    return codes.fill_null(-1).to_numpy().astype(np.int32, copy=False)


class Coded:
    """A string column as integer codes into its distinct names (``codes[i]``
    indexes ``names``, -1 = null): Parquet's dictionary pages read as they
    are, so millions of repeated worker addresses are never made strings."""

    def __init__(self, codes: np.ndarray, names: list[str]):
        self.codes = codes
        self.names = names

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def null_count(self) -> int:
        return int((self.codes < 0).sum()) if self.codes.size else 0

    def used(self) -> list[str]:
        """The names that some row has (a dictionary may hold more)."""
        c = self.codes
        if c.size and int(c.min()) < 0:
            c = c[c >= 0]
        seen = np.bincount(c, minlength=len(self.names)) > 0
        return [n for n, s in zip(self.names, seen.tolist(), strict=True) if s]

    def ids(self, index: dict[str, int]) -> np.ndarray:
        """int32 per row: ``index[name]``, -1 for null or a name not in ``index``."""
        table = np.array([index.get(n, -1) for n in self.names] + [-1], dtype=np.int32)
        return take_by_blocks(table, self.codes, pool_empty(len(self), np.int32))

    def names_at(self, mask: np.ndarray) -> list[str]:
        """The distinct non-null names of the rows in ``mask``, sorted."""
        c = np.unique(self.codes[mask])
        return sorted(self.names[int(i)] for i in c if i >= 0)
