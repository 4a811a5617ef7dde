"""The recorder's trace set on disk: every file written aside, then renamed.

A table (``loads``, ``kv_events``, ``gaps``) is a folder of Parquet parts,
hive-partitioned by the UTC date and the rotation period of each row's
receive time (``loads/date=2026-12-01/hour=16/part-000042.parquet`` with the
default hourly rotation).  Every flush writes one new part per period it has
rows for, as a hidden ``.part-*.tmp`` file that is renamed into place only
when complete, so a reader (and ``router-replay import``) never sees a
half-written file, and a ``kill -9`` loses at most the rows of the flush in
progress.  Names starting with ``.`` are skipped by every reader of trace
sets (traces/README.md), so a leftover temporary file is harmless.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

NS = 1_000_000_000
SEAL_ROWS = 2048

LOADS_SCHEMA = pa.schema([
    ("ts", pa.int64()), ("worker", pa.string()), ("dp_rank", pa.int64()), ("seq", pa.int64()),
    ("num_running_reqs", pa.int64()), ("num_waiting_reqs", pa.int64()), ("num_tokens", pa.int64()),
    ("max_total_num_tokens", pa.int64()), ("num_waiting_uncached_tokens", pa.int64()),
    ("num_total_tokens", pa.int64()), ("max_running_requests", pa.int64()),
    ("total_prefill_uncached_tokens", pa.int64()), ("total_prefill_busy_us", pa.int64()),
    ("attn_dp_rank", pa.int64()),
])

KV_SCHEMA = pa.schema([
    ("ts", pa.int64()),              # receive time (ns); for a replayed batch, see `replayed`
    # the publisher's sequence (unsigned on the wire, the same 8 bytes signed here); -1 with
    # event_index -1: an AllBlocksCleared the recorder wrote for a publisher reset (a live
    # all-0xFF frame, or the sequence going back), ordered before the new publisher's batches
    ("worker", pa.string()), ("dp_rank", pa.int64()), ("seq", pa.int64()),
    ("event_index", pa.int32()),     # position inside the batch (-1: the recorder's reset row)
    ("engine_ts", pa.int64()),       # the batch's own ts, ns (engine clock)
    ("replayed", pa.bool_()),        # recovered from the replay socket after a gap
    ("type", pa.string()), ("block_hashes", pa.list_(pa.int64())),
    ("parent_block_hash", pa.int64()), ("n_tokens", pa.int64()), ("block_size", pa.int64()),
    ("lora_id", pa.int64()), ("medium", pa.string()),
    # BlockStored keys of sglang 0.5.23 (null when absent)
    ("cache_salt", pa.string()), ("session_id", pa.string()), ("lora_name", pa.string()),
    ("wide_tokens", pa.bool_()),     # token ids above 2**32 - 1 or bigram pairs: hashed in another form
])

GAPS_SCHEMA = pa.schema([
    ("ts", pa.int64()),              # when the recorder learned of it
    ("worker", pa.string()), ("dp_rank", pa.int64()), ("stream", pa.string()),   # load | kv
    ("kind", pa.string()),           # gap | restart | malformed
    ("from_seq", pa.int64()), ("to_seq", pa.int64()),
    ("from_ts", pa.int64()), ("to_ts", pa.int64()),   # the time range the lost messages fall in
    ("reason", pa.string()),
])

# dp_size: the publishing ranks (kv_events.dp_size = dp_size x attention-DP size); page_size: the
# size the block hashes are computed with (kv_events.block_size = page_size x DCP size)
WORKERS_SCHEMA = pa.schema([
    ("worker", pa.string()), ("model", pa.string()), ("role", pa.string()),
    ("dp_size", pa.int64()), ("page_size", pa.int64()),
])


def _aside(path: Path, write) -> None:
    """``write(tmp)`` into a hidden sibling, fsync, rename over ``path``; a failed write leaves
    ``path`` as it was and removes the temporary file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic_bytes(path: Path, data: bytes) -> None:
    _aside(path, lambda tmp: tmp.write_bytes(data))


def write_atomic_json(path: Path, obj) -> None:
    write_atomic_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_atomic_table(path: Path, table: pa.Table) -> None:
    _aside(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def period_folder(ts_ns: int, rotate_s: int) -> str:
    """The hive folder of a row stamped ``ts_ns``: ``date=YYYY-MM-DD/hour=HH`` hourly,
    ``date=YYYY-MM-DD`` daily, ``date=.../start=HHMMSS`` for other periods."""
    start = (ts_ns // NS) // rotate_s * rotate_s
    t = dt.datetime.fromtimestamp(start, tz=dt.UTC)
    day = f"date={t:%Y-%m-%d}"
    if rotate_s == 3600:
        return f"{day}/hour={t:%H}"
    if rotate_s == 86400:
        return day
    return f"{day}/start={t:%H%M%S}"


class PartWriter:
    """Column buffers of one table, written as one part per rotation period at each flush."""

    def __init__(self, root: Path, name: str, schema: pa.Schema, rotate_s: int):
        self.root = root / name
        self.schema = schema
        self.rotate_s = int(rotate_s)
        self.cols: dict[str, list] = {f.name: [] for f in schema}
        self.sealed: list[pa.RecordBatch] = []
        self.n_sealed = 0
        self.parts = 0
        self.rows_written = 0   # rows in parts renamed into place
        self.rows_taken = 0     # rows handed to the writer (written or about to be)

    def __len__(self) -> int:
        return self.n_sealed + len(self.cols["ts"])

    def append(self, row: dict) -> None:
        for k, v in self.cols.items():
            v.append(row.get(k))
        if len(self.cols["ts"]) >= SEAL_ROWS:
            self._seal()

    def _seal(self) -> None:
        # Python lists become Arrow a few thousand rows at a time: the conversion holds the
        # GIL, so one big conversion at flush time would stall the receive loop (and its stamps)
        n = len(self.cols["ts"])
        if n:
            self.sealed.append(pa.record_batch([pa.array(self.cols[f.name], type=f.type) for f in self.schema],
                                               schema=self.schema))
            self.n_sealed += n
            self.cols = {f.name: [] for f in self.schema}

    def take(self) -> pa.Table | None:
        """The buffered rows as a table (buffers emptied), or None."""
        self._seal()
        if not self.sealed:
            return None
        table = pa.Table.from_batches(self.sealed, schema=self.schema).combine_chunks()
        self.sealed, self.n_sealed = [], 0
        self.rows_taken += table.num_rows
        return table

    def write(self, table: pa.Table) -> list[Path]:
        """Write ``table`` as parts (one per period), each aside then renamed; returns the paths."""

        ts = table.column("ts")
        period = pc.divide(ts, pa.scalar(self.rotate_s * NS, pa.int64()))
        out = []
        for p in pc.unique(period).to_pylist():
            sub = table.filter(pc.equal(period, p)) if len(pc.unique(period)) > 1 else table
            folder = self.root / period_folder(int(p) * self.rotate_s * NS, self.rotate_s)
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"part-{self.parts:06d}.parquet"
            write_atomic_table(path, sub)
            self.parts += 1
            self.rows_written += sub.num_rows
            out.append(path)
        return out
