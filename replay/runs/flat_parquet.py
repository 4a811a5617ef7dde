"""A small Parquet writer for flat tables whose columns come in runs.

``decisions.parquet`` in the ``long`` layout is one row per (request, config):
a request's query blocks repeat once per config, and neighbouring configs of a
request mostly decide alike, so every column is a few runs of equal values.
pyarrow's writer hashes each of the 28 columns' values one by one (about 8 ns
a value, 2.3 of the 3.3 CPU s per 6M rows); this writer takes each column as
its runs instead (numpy finds them, a few vectorised passes per column) and
writes them as they are:

* one row group per :meth:`FlatParquetWriter.write_row_group` call, one
  dictionary page and one data page (v1) per column chunk, zstd;
* every column ``OPTIONAL`` (as pyarrow writes an Arrow field), its definition
  levels and dictionary indices in the RLE/bit-packed hybrid encoding as RLE
  runs (a run of length 1 costs two or three bytes; zstd takes the rest), or,
  where most runs are one row long (``config_id``), as one bit-packed run,
  which readers decode far faster than a million runs;
* dictionaries: integer and float columns' distinct non-null values (sorted),
  string columns a given table of labels (a code indexes it; codes a run never
  uses stay in the page, unread);
* booleans ``PLAIN`` (bit-packed);
* statistics (``min``/``max`` and ``null_count``) on integer columns only, from
  the dictionary; strings, floats and booleans keep a null count.

What readers see is what pyarrow wrote for the same Arrow table with
``store_schema=False``: ``pl.read_parquet``, pyarrow and
:mod:`replay.runs.decisions` read the same values and dtypes
(``tests/test_decisions_writer.py`` holds the two files equal).  The Thrift
metadata is encoded here with the compact protocol (the few structs of
``parquet.thrift`` a flat file needs).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

# parquet.thrift enums
BOOLEAN, INT32, INT64, DOUBLE, BYTE_ARRAY = 0, 1, 2, 5, 6
_PLAIN, _RLE, _RLE_DICTIONARY = 0, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE = 0, 2
_OPTIONAL = 1
_UTF8 = 0
_ZSTD = 6
_MAGIC = b"PAR1"
KINDS = {"bool": BOOLEAN, "int32": INT32, "int64": INT64, "float64": DOUBLE, "string": BYTE_ARRAY}
"""Column kinds this writer takes -> their Parquet physical type."""

_DIRECT_RANGE = 1 << 20   # a dictionary of values spanning at most this many integers is built by a table


# ---------------------------------------------------------------------------
# Thrift compact protocol (only what the footer and page headers use)

_I32, _I64, _BIN, _LIST, _STRUCT = 5, 6, 8, 9, 12
_T = {"i32": _I32, "i64": _I64, "bin": _BIN, "list": _LIST, "struct": _STRUCT, "raw": _STRUCT}


def _varint(x: int) -> bytes:
    out = bytearray()
    while x >= 0x80:
        out.append((x & 0x7F) | 0x80)
        x >>= 7
    out.append(x)
    return bytes(out)


def _zigzag(x: int) -> int:
    return (x << 1) ^ (x >> 63)


def _value(kind: str, v) -> bytes:
    if kind in ("i32", "i64"):
        return _varint(_zigzag(int(v)))
    if kind == "bin":
        b = v.encode() if isinstance(v, str) else bytes(v)
        return _varint(len(b)) + b
    if kind == "struct":
        return thrift_struct(v)
    if kind == "raw":           # a struct encoded already
        return bytes(v)
    if kind == "list":
        elem, items = v
        n = len(items)
        head = bytes([(n << 4) | _T[elem]]) if n < 15 else bytes([0xF0 | _T[elem]]) + _varint(n)
        return head + b"".join(_value(elem, it) for it in items)
    raise ValueError(kind)


def thrift_struct(fields: Sequence[tuple[int, str, object]]) -> bytes:
    """A Thrift struct in the compact protocol: ``(field id, kind, value)`` in increasing
    id order (kind ``i32``/``i64``/``bin``/``struct``/``list``; ``list`` values are
    ``(element kind, items)``); fields whose value is None are left out."""
    out = bytearray()
    last = 0
    for fid, kind, v in fields:
        if v is None:
            continue
        delta = fid - last
        if 0 < delta <= 15:
            out.append((delta << 4) | _T[kind])
        else:
            out.append(_T[kind])
            out += _varint(_zigzag(fid))
        last = fid
        out += _value(kind, v)
    out.append(0)
    return bytes(out)


# ---------------------------------------------------------------------------
# runs


@dataclass
class Runs:
    """A column as runs: run ``i`` is ``lengths[i]`` rows of ``values[i]`` (null where
    ``null[i]``; None: no nulls).  ``values`` are int64 (float64 bits for a float column,
    codes into the dictionary for a string column)."""

    values: np.ndarray
    lengths: np.ndarray
    null: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())


def runs_of(flat: np.ndarray, null: np.ndarray | None = None, null_changes: np.ndarray | None = None) -> Runs:
    """The runs of a 1-D int64 array; ``null`` marks null rows (their values are ignored).
    ``null_changes`` (``null[1:] != null[:-1]``) may be passed when several columns share ``null``."""
    n = len(flat)
    if n == 0:
        return Runs(np.zeros(0, np.int64), np.zeros(0, np.int64), None if null is None else np.zeros(0, bool))
    change = flat[1:] != flat[:-1]
    if null is not None:
        change |= null[1:] != null[:-1] if null_changes is None else null_changes
    starts = np.flatnonzero(change)
    starts += 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(starts, append=n)
    return Runs(flat[starts], lengths, None if null is None else null[starts])


def _rle(values: np.ndarray, lengths: np.ndarray, bit_width: int) -> np.ndarray:
    """The RLE/bit-packed hybrid encoding of runs (``values[i]`` repeated ``lengths[i]``
    times) as RLE runs only: a ULEB128 header ``length << 1`` then the value in
    ``ceil(bit_width / 8)`` little-endian bytes."""
    h = lengths.astype(np.uint64) << np.uint64(1)
    vw = (bit_width + 7) // 8
    n_head = max(1, (int(h.max()).bit_length() + 6) // 7) if len(h) else 1
    # one row per run: its header's bytes (as many as the longest run needs) then the value's;
    # the header bytes a run does not need are dropped at the end, in row order
    m = np.empty((len(h), n_head + vw), np.uint8)
    keep = np.ones(m.shape, bool) if n_head > 1 else None
    for k in range(n_head):
        part = h >> np.uint64(7 * k)
        m[:, k] = (part & np.uint64(0x7F)) | ((part >= np.uint64(0x80)).astype(np.uint64) << np.uint64(7))
        if k and keep is not None:
            keep[:, k] = part > 0
    v = values.astype(np.uint64)
    for k in range(vw):
        m[:, n_head + k] = (v >> np.uint64(8 * k)) & np.uint64(0xFF)
    return m.reshape(-1) if keep is None else m[keep]


def _bitpacked(values: np.ndarray, bit_width: int) -> np.ndarray:
    """The values as one bit-packed run of the hybrid encoding: a ULEB128 header
    ``groups << 1 | 1``, then groups of 8 values of ``bit_width`` bits each, packed
    from the least significant bit (the last group padded with zeros)."""
    n = len(values)
    groups = -(-n // 8)
    v = np.zeros(groups * 8, np.uint64)
    v[:n] = values
    bits = np.empty((len(v), bit_width), np.uint8)
    for k in range(bit_width):
        bits[:, k] = (v >> np.uint64(k)) & np.uint64(1)
    head = np.frombuffer(_varint((groups << 1) | 1), np.uint8)
    return np.concatenate((head, np.packbits(bits.reshape(-1), bitorder="little")))


def _dense_rank(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each value's index among them)."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < _DIRECT_RANGE:
        seen = np.zeros(hi - lo + 1, np.int64)
        off = values - lo
        seen[off] = 1
        rank = np.cumsum(seen)
        rank -= 1
        return np.flatnonzero(seen) + lo, rank[off]
    uniq, inv = np.unique(values, return_inverse=True)
    return uniq, inv.reshape(-1)


def _byte_arrays(strings: pa.Array) -> bytes:
    """PLAIN BYTE_ARRAYs (4-byte little-endian length, then the bytes) of a string array
    without nulls."""
    if strings.type != pa.string():       # (a cast's first use imports pyarrow.compute: 0.1 s)
        strings = strings.cast(pa.string())
    offsets = np.frombuffer(strings.buffers()[1], np.int32)[strings.offset:strings.offset + len(strings) + 1]
    data = np.frombuffer(strings.buffers()[2], np.uint8) if strings.buffers()[2] is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    out = np.empty(4 * len(lengths) + int(lengths.sum()), np.uint8)
    starts = np.arange(len(lengths)) * 4 + (offsets[:-1] - offsets[0])
    lb = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)
    for k in range(4):
        out[starts + k] = lb[:, k]
    # the strings' bytes: every byte that is not a length prefix, in order
    body = np.ones(len(out), bool)
    for k in range(4):
        body[starts + k] = False
    out[body] = data[offsets[0]:offsets[-1]]
    return out.tobytes()


# ---------------------------------------------------------------------------


@dataclass
class Column:
    name: str
    kind: str                          # KINDS
    labels: pa.Array | None = None     # string columns with a fixed dictionary: the labels codes index


class FlatParquetWriter:
    """Writes a Parquet file of flat ``OPTIONAL`` columns, a row group at a time.

    ``columns`` name the file's columns in order.  Each row group is given as a
    dict name -> :class:`Runs` (``int32``/``int64``/``float64``/``string``
    columns) or a bool ndarray (``bool`` columns).  A string column either has
    fixed ``labels`` (its runs' values are codes into them) or is given per row
    group as ``(Runs of codes, pa string array of the dictionary)``.
    """

    def __init__(self, path: str, columns: Sequence[Column], *, level: int = 1,
                 key_value_metadata: dict[str, str] | None = None):
        for c in columns:
            if c.kind not in KINDS:
                raise ValueError(f"column {c.name!r}: kind {c.kind!r} is not one of {', '.join(KINDS)}")
        self.path = path
        self.columns = list(columns)
        self.codec = pa.Codec("zstd", compression_level=level)
        self.kv = key_value_metadata
        self.row_groups: list[bytes] = []
        self.num_rows = 0
        self._label_pages: dict[str, tuple[bytes, int, int]] = {}
        self._memo: dict[str, tuple] = {}
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(_MAGIC)
        self.offset = len(_MAGIC)
        self.closed = False

    # pages -----------------------------------------------------------------
    def _page(self, header: list, body: bytes | np.ndarray) -> tuple[bytes, int, int]:
        """(header + compressed body, uncompressed size, compressed size), headers included."""
        raw = body.tobytes() if isinstance(body, np.ndarray) else body
        comp = self.codec.compress(raw, asbytes=True)
        head = thrift_struct([(1, "i32", header[0]), (2, "i32", len(raw)), (3, "i32", len(comp)), *header[1:]])
        return head + comp, len(head) + len(raw), len(head) + len(comp)

    def _dictionary_page(self, plain: bytes, n: int) -> tuple[bytes, int, int]:
        return self._page([_DICTIONARY_PAGE, (7, "struct", [(1, "i32", n), (2, "i32", _PLAIN)])], plain)

    def _data_page(self, n_rows: int, encoding: int, defs: np.ndarray, values: bytes | np.ndarray):
        body = struct.pack("<I", len(defs)) + defs.tobytes() + (
            values.tobytes() if isinstance(values, np.ndarray) else values)
        return self._page([_DATA_PAGE, (5, "struct", [(1, "i32", n_rows), (2, "i32", encoding),
                                                      (3, "i32", _RLE), (4, "i32", _RLE)])], body)

    @staticmethod
    def _def_levels(runs: Runs) -> tuple[np.ndarray, int]:
        """The definition levels (1 bit: 1 = a value) of a column's runs, and its null count."""
        if runs.null is None or not runs.null.any():
            return _rle(np.ones(1, np.int64), np.array([runs.rows], np.int64), 1), 0
        valid = ~runs.null
        cut = np.flatnonzero(valid[1:] != valid[:-1]) + 1
        starts = np.concatenate(([0], cut))
        lens = np.add.reduceat(runs.lengths, starts)
        return _rle(valid[starts].astype(np.int64), lens, 1), int(runs.lengths[runs.null].sum())

    # one column chunk --------------------------------------------------------
    def _chunk(self, col: Column, data, n_rows: int) -> tuple[bytes, dict]:
        memo = self._memo.get(col.name)
        if memo is not None and memo[0] is data:    # the same column data as the last row group's
            pages, encodings, stats = memo[1:]
        else:
            pages, encodings, stats = self._encode(col, data, n_rows)
            self._memo[col.name] = (data, pages, encodings, stats)
        start = self.offset
        blob = b"".join(p[0] for p in pages)
        dict_page = pages[0] if len(pages) == 2 else None
        meta = {
            "type": KINDS[col.kind], "encodings": encodings, "name": col.name, "num_values": n_rows,
            "uncompressed": sum(p[1] for p in pages), "compressed": sum(p[2] for p in pages),
            "data_page_offset": start + (len(dict_page[0]) if dict_page is not None else 0),
            "dictionary_page_offset": start if dict_page is not None else None,
            "statistics": stats, "file_offset": start,
        }
        self.offset += len(blob)
        return blob, meta

    def _encode(self, col: Column, data, n_rows: int) -> tuple[list, list[int], list]:
        """(pages, encodings, statistics fields) of one column chunk."""
        ptype = KINDS[col.kind]
        bounds: tuple[bytes, bytes] | None = None    # (min, max) of an integer column, plain-encoded
        nulls = 0
        dict_page = None
        if col.kind == "bool":
            flat = np.asarray(data, dtype=bool)
            defs = _rle(np.ones(1, np.int64), np.array([n_rows], np.int64), 1)
            data_page = self._data_page(n_rows, _PLAIN, defs, np.packbits(flat, bitorder="little"))
            encodings = [_PLAIN, _RLE]
        else:
            table = col.labels
            if col.kind == "string" and table is None:
                data, table = data
            runs: Runs = data
            defs, nulls = self._def_levels(runs)
            keep = slice(None) if runs.null is None else ~runs.null
            vals, lens = runs.values[keep], runs.lengths[keep]
            if len(vals) == 0:          # all null: levels only
                data_page = self._data_page(n_rows, _PLAIN, defs, b"")
                encodings = [_PLAIN, _RLE]
            else:
                if col.kind == "string":
                    idx = vals
                    n_dict = len(table)
                    if col.labels is not None and col.name in self._label_pages:
                        dict_page = self._label_pages[col.name]
                    else:
                        dict_page = self._dictionary_page(_byte_arrays(table), n_dict)
                        if col.labels is not None:
                            self._label_pages[col.name] = dict_page
                else:
                    uniq, idx = _dense_rank(vals)
                    n_dict = len(uniq)
                    plain = {INT32: "<i4", INT64: "<i8", DOUBLE: "<i8"}[ptype]
                    values = uniq.astype(plain)
                    dict_page = self._dictionary_page(values.tobytes(), n_dict)
                    if ptype in (INT32, INT64):   # int32: the order after the cast
                        bounds = (values.min().tobytes(), values.max().tobytes())
                bw = max(1, int(n_dict - 1).bit_length())
                if len(lens) * 4 > n_rows:   # mostly single rows (config_id): bit-packed reads faster
                    coded = _bitpacked(np.repeat(idx, lens), bw)
                else:
                    coded = _rle(idx, lens, bw)
                data_page = self._data_page(n_rows, _RLE_DICTIONARY, defs, bytes([bw]) + coded.tobytes())
                encodings = [_PLAIN, _RLE, _RLE_DICTIONARY]
        stats: list = [(3, "i64", nulls)]
        if bounds is not None:
            lo, hi = bounds
            stats = [(1, "bin", hi), (2, "bin", lo), (3, "i64", nulls), (5, "bin", hi), (6, "bin", lo)]
        return [p for p in (dict_page, data_page) if p is not None], encodings, stats

    def write_row_group(self, n_rows: int, data: dict) -> None:
        """Append one row group of ``n_rows`` rows (nothing for 0 rows).  A column of
        another length is a ValueError naming it; after any error the file is closed
        without its footer (no reader takes it for a complete file)."""
        if self.closed:
            raise ValueError(f"{self.path}: the writer is closed")
        if n_rows == 0:
            return
        try:
            self._write_row_group(n_rows, data)
        except BaseException:
            self.abort()
            raise

    def _write_row_group(self, n_rows: int, data: dict) -> None:
        for col in self.columns:
            d = data[col.name]
            d = d[0] if isinstance(d, tuple) else d
            got = d.rows if isinstance(d, Runs) else len(d)
            if got != n_rows:
                raise ValueError(f"{self.path}: column '{col.name}' has {got} rows, the row group {n_rows}")
        metas = []
        for col in self.columns:
            blob, meta = self._chunk(col, data[col.name], n_rows)
            self._file.write(blob)
            metas.append(meta)
        chunks = []
        for m in metas:
            cmd = [(1, "i32", m["type"]), (2, "list", ("i32", m["encodings"])), (3, "list", ("bin", [m["name"]])),
                   (4, "i32", _ZSTD), (5, "i64", m["num_values"]), (6, "i64", m["uncompressed"]),
                   (7, "i64", m["compressed"]), (9, "i64", m["data_page_offset"]),
                   (11, "i64", m["dictionary_page_offset"]), (12, "struct", m["statistics"])]
            chunks.append([(2, "i64", m["file_offset"]), (3, "struct", cmd)])
        total = sum(m["uncompressed"] for m in metas)
        self.row_groups.append(thrift_struct([
            (1, "list", ("struct", chunks)), (2, "i64", total), (3, "i64", n_rows),
            (5, "i64", metas[0]["file_offset"]), (6, "i64", sum(m["compressed"] for m in metas))]))
        self.num_rows += n_rows

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            schema = [[(4, "bin", "schema"), (5, "i32", len(self.columns))]]
            for c in self.columns:
                el = [(1, "i32", KINDS[c.kind]), (3, "i32", _OPTIONAL), (4, "bin", c.name)]
                if c.kind == "string":
                    el += [(6, "i32", _UTF8), (10, "struct", [(1, "struct", [])])]
                schema.append(el)
            kv = None if not self.kv else [[(1, "bin", k), (2, "bin", v)] for k, v in self.kv.items()]
            footer = thrift_struct([
                (1, "i32", 2), (2, "list", ("struct", schema)), (3, "i64", self.num_rows),
                (4, "list", ("raw", self.row_groups)), (5, "list", ("struct", kv)) if kv else (5, "list", None),
                (6, "bin", "router-replay flat_parquet"),
                (7, "list", ("struct", [[(1, "struct", [])] for _ in self.columns])),
            ])
            self._file.write(footer + struct.pack("<I", len(footer)) + _MAGIC)
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close the file without a footer (it is then no Parquet file)."""
        self.closed = True
        self._file.close()
