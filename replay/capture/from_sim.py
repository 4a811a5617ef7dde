"""A simulator run written in the capture formats, for the round trip.

:func:`write_capture` takes a :class:`replay.simulate.SimResult` made with
``cache_log=True`` and writes what a real fleet running that simulation would
have left behind:

* ``recorded/``: the trace set ``router-replay record`` writes: ``loads/``
  (every LoadStat sample as a receive-stamped row with its per-rank sequence
  number), ``kv_events/`` (one ``BlockStored`` / ``BlockRemoved`` batch per cache
  store / eviction of each rank, stamped at the engine's publish time, the
  block hash the engine would publish), ``workers.parquet``, ``record.json``;
* ``token_export/``: the router's token export (gzip NDJSON, ``kind: ingest``)
  with deterministic synthetic token ids per block (``synthetic_tokens``);
* ``engines/<n>/``: one request export per engine (``id``, ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``e2e_latency``, ``dp_rank``).

``router-replay import`` of that capture (``--index-lag-ms`` = the simulation's
lag, ``--router-inflight derived``) rebuilds the simulator's matches and
in-flight counts exactly, so ``sweep`` under the simulated config agrees with
every placement.

The capture publishes what the simulated cache holds: a request's full blocks
only, as a real engine with page size > 1 does (CAPTURE.md s.2; the simulator
never caches a partial last block), so the round trip is exact.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from isal import igzip

from replay.capture import outguard
from replay.capture.store import (
    KV_SCHEMA,
    LOADS_SCHEMA,
    WORKERS_SCHEMA,
    PartWriter,
    write_atomic_table,
)
from replay.errors import ReplayError
from replay.kernels._jit import njit
from replay.runs import names, rundir
from replay.trace.blocks import check_block_counts

NS = 1_000_000_000


VOCAB = 151_936
_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def block_token_rows(blocks: np.ndarray, width: int) -> np.ndarray:
    """The synthetic token ids of dense blocks ``blocks`` (one row of ``width`` uint32 each, a
    block's first ``block_tokens[b]`` of them used): the first is ``block + 1`` (so no two
    blocks share their tokens), the rest a splitmix64 stream of ``(block, position)`` taken
    modulo VOCAB (ids of a real vocabulary's size: half the digits of a 32-bit id in the
    token export's JSON).  The numpy reference of :func:`token_rows_nb`."""
    b = np.asarray(blocks, dtype=np.uint64)[:, None]
    with np.errstate(over="ignore"):
        z = b * np.uint64(1 << 20) + np.arange(width, dtype=np.uint64)[None, :] + _MIX[0]
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        z = z ^ (z >> np.uint64(31))
    out = (z % np.uint64(VOCAB)).astype(np.uint32)
    if width:
        out[:, 0] = (np.asarray(blocks, dtype=np.int64) + 1).astype(np.uint32)
    return out


@njit(inline=True)
def _token_nb(block, pos):
    """Token ``pos`` of dense block ``block`` (:func:`block_token_rows`), as an int64."""
    if pos == 0:
        return np.int64(np.uint32(block + 1))
    z = np.uint64(block) * np.uint64(1 << 20) + np.uint64(pos) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return np.int64(z % np.uint64(VOCAB))


@njit
def token_rows_nb(blocks, width):
    """:func:`block_token_rows`, compiled: uint32 rows of ``width`` tokens of ``blocks``."""
    out = np.empty((blocks.shape[0], width), dtype=np.uint32)
    for i in range(blocks.shape[0]):
        for p in range(width):
            out[i, p] = np.uint32(_token_nb(blocks[i], p))
    return out


@njit(inline=True)
def _put_uint_nb(out, pos, v):
    """Write the decimal digits of ``v >= 0`` at ``out[pos:]``; returns the position after them."""
    n = 1
    t = v
    while t >= 10:
        t //= 10
        n += 1
    for k in range(n - 1, -1, -1):
        out[pos + k] = 48 + v % 10
        v //= 10
    return pos + n


@njit
def ingest_lines_nb(blocks, ntok, req_off, first_id, head, mid, stamps, tail, out):
    """The token export's NDJSON lines of ``req_off.size - 1`` requests into ``out`` (uint8, large
    enough: :func:`ingest_lines_bound`); returns the bytes written.  Request ``r``'s line is
    ``head``, its id ``first_id + r``, ``mid``, its tokens (blocks ``blocks[req_off[r]:req_off[r+1]]``,
    the first ``ntok[j]`` tokens of ``blocks[j]``) comma-separated, ``stamps[r]`` and ``tail``."""
    pos = 0
    for r in range(req_off.shape[0] - 1):
        for c in range(head.shape[0]):
            out[pos + c] = head[c]
        pos = _put_uint_nb(out, pos + head.shape[0], first_id + r)
        for c in range(mid.shape[0]):
            out[pos + c] = mid[c]
        pos += mid.shape[0]
        sep = False
        for j in range(req_off[r], req_off[r + 1]):
            b = blocks[j]
            for p in range(ntok[j]):
                if sep:
                    out[pos] = 44
                    pos += 1
                sep = True
                pos = _put_uint_nb(out, pos, _token_nb(b, p))
        for c in range(stamps.shape[1]):
            out[pos + c] = stamps[r, c]
        pos += stamps.shape[1]
        for c in range(tail.shape[0]):
            out[pos + c] = tail[c]
        pos += tail.shape[0]
    return pos


def ingest_lines_bound(n_requests: int, n_blocks: int, n_tokens: int, fixed: int, last_id: int) -> int:
    """Bytes :func:`ingest_lines_nb` writes at most: ``fixed`` bytes of head, mid, stamp and tail
    a request, a request id of at most ``last_id``'s digits, 7 bytes a token below VOCAB (its
    digits and a comma) and 11 for a block's first (a uint32)."""
    return n_requests * (fixed + len(str(max(last_id, 0)))) + 7 * n_tokens + 4 * n_blocks


def synthetic_tokens(block: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids of dense block ``block`` (see :func:`block_token_rows`)."""
    return block_token_rows(np.array([block]), n)[0].astype(np.int64)


def _chain_hashes(log) -> np.ndarray:
    """The published hash of every dense block: SHA-256 over the parent's digest and the
    block's synthetic tokens (CAPTURE.md s.3), computed parent first."""
    nb = log.n_blocks
    digest: list[bytes] = [b""] * nb
    out = np.zeros(nb, dtype=np.int64)
    parent = log.block_parent.tolist()
    # blocks are visited in request order; a block's parent always comes before it there
    order = pl.Series(log.hash_ids).unique(maintain_order=True).to_numpy().astype(np.int64)
    width = int(log.block_size)
    ntok = log.block_tokens.tolist()
    sha = hashlib.sha256
    for k in range(0, order.size, 4096):
        chunk = order[k:k + 4096]
        rows = token_rows_nb(chunk, width).astype("<u4", copy=False)
        for j, b in enumerate(chunk.tolist()):
            p = parent[b]
            d = sha((digest[p] if p >= 0 else b"") + rows[j, :ntok[b]].tobytes()).digest()
            digest[b] = d
            out[b] = int.from_bytes(d[:8], "big", signed=True)
    return out


def _check_exportable(log) -> None:
    sizes = np.diff(log.hash_off)
    L = log.input_tokens.astype(np.int64)
    counts = check_block_counts(sizes, L, log.block_size, full_only_ok=False, length_name="input_length",
                                block_name="block_size")
    if counts.bad is not None:
        raise ReplayError(f"request {counts.bad}: hash_ids {counts.message}: its token ids cannot be made "
                          "to hash to them")
    pos = np.arange(log.hash_ids.size) - np.repeat(log.hash_off[:-1], sizes)
    tok = np.minimum(np.repeat(L, sizes) - pos * log.block_size, log.block_size)
    off = np.nonzero(log.block_tokens[log.hash_ids] != tok)[0]
    if off.size:
        j = int(off[0])
        i = int(np.searchsorted(log.hash_off, j, side="right") - 1)
        raise ReplayError(f"request {i}: block {int(log.hash_ids[j])} holds {int(tok[j])} of its tokens here "
                          f"and {int(log.block_tokens[log.hash_ids[j]])} elsewhere: one block id, two token runs")


def write_capture(res, log, fleet, out, *, index_lag_ms: int = 0, force: bool = False,
                  progress=None) -> Path:
    """Write ``res`` (a ``simulate(..., cache_log=True)`` result on ``log`` and ``fleet``) in the
    capture formats under ``out``; returns ``out``.  ``progress(n)``, when given, is called as
    the token export's requests are written (the long part)."""
    if "cache_log" not in res.extra:
        raise ReplayError("the simulation kept no cache log: run simulate(..., cache_log=True)")
    _check_exportable(log)
    out = Path(out)
    rundir.guard([(out, outguard.CAPTURE)], force=force)
    with rundir.building(out) as tmp:
        _write(res, log, fleet, tmp, index_lag_ms, progress)
        (tmp / names.TRACE_JSON).write_text(json.dumps({"source": outguard.CAPTURE_SOURCE}) + "\n")
    return out


def _write(res, log, fleet, root: Path, index_lag_ms: int, progress=None) -> None:
    urls = fleet.urls
    page = int(log.block_size)
    rec = root / names.RECORDED
    rec.mkdir(parents=True)
    hashes = _chain_hashes(log)
    # --- loads: rows as record writes them (per-rank sequence numbers)
    ld = res.loads.with_columns(pl.int_range(pl.len()).over("worker", "dp_rank").alias("seq"),
                                pl.col("dp_rank").alias("attn_dp_rank"))
    if ld.height:
        PartWriter(rec, names.LOADS_DIR, LOADS_SCHEMA, 3600).write(_table(LOADS_SCHEMA, ld.height, {
            c: ld[c].to_arrow() for c in ld.columns}))
    # --- kv events: one batch per store / eviction, at the engine's publish time
    cl = res.extra["cache_log"]
    if len(cl):
        n = len(cl)
        ts = cl[:, 0] - int(index_lag_ms) * 1_000_000
        w, blk, sr = cl[:, 1], cl[:, 2], cl[:, 3]
        rank = np.abs(sr) - 1
        stored = sr > 0
        key = w * (int(rank.max()) + 1) + rank
        order = np.argsort(key, kind="stable")
        ks = key[order]
        first = np.r_[0, np.nonzero(np.diff(ks))[0] + 1]
        seq = np.empty(n, dtype=np.int64)
        seq[order] = np.arange(n) - np.repeat(first, np.diff(np.r_[first, n]))
        par = log.block_parent[blk]
        has_parent = stored & (par >= 0)
        PartWriter(rec, names.KV_EVENTS_DIR, KV_SCHEMA, 3600).write(_table(KV_SCHEMA, n, {
            "ts": ts, "worker": np.asarray(urls, dtype=object)[w], "dp_rank": rank, "seq": seq,
            "event_index": np.zeros(n, np.int32), "engine_ts": ts, "replayed": np.zeros(n, bool),
            "type": np.where(stored, "BlockStored", "BlockRemoved").astype(object),
            "block_hashes": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)),
                                                     pa.array(hashes[blk])),
            "parent_block_hash": pa.array(hashes[np.maximum(par, 0)], mask=~has_parent),
            "n_tokens": pa.array(log.block_tokens[blk].astype(np.int64), mask=~stored),
            "block_size": pa.array(np.full(n, page, np.int64), mask=~stored),
            "medium": pa.array(np.full(n, "GPU", dtype=object), mask=~stored)}))
    write_atomic_table(rec / names.WORKERS, pa.table(
        {"worker": urls, "model": [w.model for w in fleet.workers], "role": [w.role for w in fleet.workers],
         "dp_size": [w.dp_size for w in fleet.workers], "page_size": [page] * len(urls)}, schema=WORKERS_SCHEMA))
    (rec / names.RECORD_JSON).write_text(json.dumps({"tool": "router-replay simulate (capture formats)",
                                                 "complete": True, "gaps": 0, "restarts": 0,
                                                 "malformed_frames": 0, "unreachable": {}}) + "\n")
    # --- the router's token export
    _write_token_export(res, log, fleet, root / names.TOKEN_EXPORT / "slug=sim", progress)
    # --- engine request exports
    o = res.outcomes
    eng = root / names.ENGINES
    for w, url in enumerate(urls):
        mine = o.filter(o["worker"] == url)
        d = eng / f"{w:03d}"
        d.mkdir(parents=True)
        lines = []
        for r in mine.iter_rows(named=True):
            lat_s = (r["completion_ts"] - r["arrival_ts"]) / 1e9
            lines.append(json.dumps({"request_parameters": json.dumps({"rid": str(r["request_id"])}),
                                     "id": str(r["request_id"]), "finish_reason": {"type": "length"},
                                     "prompt_tokens": r["input_tokens"], "completion_tokens": r["output_tokens"],
                                     "cached_tokens": r["cached_tokens"], "e2e_latency": lat_s,
                                     "dp_rank": r["dp_rank"]}))
        (d / "sglang-request-metrics-sim.log").write_text("".join(x + "\n" for x in lines))


def _table(schema: pa.Schema, n: int, cols: dict) -> pa.Table:
    """``cols`` as a table of ``schema`` (a column it lacks is all null)."""
    out = []
    for f in schema:
        v = cols.get(f.name)
        if v is None:
            out.append(pa.nulls(n, f.type))
        elif isinstance(v, (pa.Array, pa.ChunkedArray)):
            out.append(v.cast(f.type))
        else:
            out.append(pa.array(v, type=f.type))
    return pa.table(out, schema=schema)


TOKENS_PER_CHUNK = 4_000_000   # token ids built and written at a time
GZIP_LEVEL = 1                 # igzip's level 1: a fifth of zlib's time for a slightly larger file
STAMP_WIDTH = 30               # "2026-01-01T00:00:00.000000000Z"


def _write_token_export(res, log, fleet, te: Path, progress=None) -> None:
    """gzip NDJSON files of a few million token ids each (in day folders, as the router rotates
    them): each request's ``input_ids`` are its blocks' synthetic tokens.  A compiled kernel
    writes the lines (:func:`ingest_lines_nb`) and igzip compresses them (a gzip member,
    read by any gzip reader); a file is compressed and written on a second thread while the
    next is encoded (both release the GIL)."""
    req = res.requests
    n = req.height
    ts_all = req["ts"].to_numpy()
    off, ids, L = log.hash_off, log.hash_ids, log.input_tokens.astype(np.int64)
    days = ts_all // (86_400 * NS)
    cum = np.cumsum(L)
    head = np.frombuffer(b'{"kind":"ingest","request_id":"', np.uint8)
    mid = np.frombuffer(('","slug":"sim","model":' + json.dumps(fleet.spec.model, ensure_ascii=False)
                         + ',"input_ids":[').encode(), np.uint8)
    tail = np.frombuffer(b'","choice_index":0,"choice_count":1}\n', np.uint8)
    fixed = head.size + mid.size + len('],"ts":"') + STAMP_WIDTH + tail.size
    with ThreadPoolExecutor(1) as pool:
        pending = None
        i = seq = 0
        while i < n:
            base = int(cum[i - 1]) if i else 0
            j = min(n, max(i + 1, int(np.searchsorted(cum, base + TOKENS_PER_CHUNK, side="right"))))
            other = np.nonzero(days[i:j] != days[i])[0]
            if other.size:                       # a chunk never spans two days
                j = i + int(other[0])
            text = pl.Series(ts_all[i:j]).cast(pl.Datetime("ns", "UTC")).dt.to_string(
                '],"ts":"%Y-%m-%dT%H:%M:%S%.9fZ').str.join("").item().encode()
            stamps = np.frombuffer(text, np.uint8).reshape(j - i, -1)
            if stamps.shape[1] != len('],"ts":"') + STAMP_WIDTH:
                raise ReplayError(f"request {i}: its arrival time {int(ts_all[i])} ns is outside years 1000-9999")
            blocks = np.ascontiguousarray(ids[off[i]:off[j]], dtype=np.int64)
            ntok = log.block_tokens[blocks].astype(np.int64)
            req_off = (off[i:j + 1] - off[i]).astype(np.int64)
            buf = np.empty(ingest_lines_bound(j - i, blocks.size, int(ntok.sum()), fixed, j), np.uint8)
            size = ingest_lines_nb(blocks, ntok, req_off, i, head, mid, stamps, tail, buf)
            # one file per chunk, named as the router names its rotated files: an importer holds a
            # file at a time, so files of a few million tokens keep its memory bounded
            name = dt.datetime.fromtimestamp(int(days[i]) * 86_400, tz=dt.UTC).strftime("%Y-%m-%d")
            folder = te / f"date={name}"
            folder.mkdir(parents=True, exist_ok=True)
            if pending is not None:
                pending.result()
            pending = pool.submit(_write_gzip, folder / f"router-0-{int(ts_all[i])}-{seq}.ndjson.gz", buf[:size])
            seq += 1
            if progress is not None:
                progress(j - i)
            i = j
        if pending is not None:
            pending.result()


def _write_gzip(path: Path, data: np.ndarray) -> None:
    path.write_bytes(igzip.compress(data.data, compresslevel=GZIP_LEVEL))


def engine_dirs(out) -> list[tuple[str, Path]]:
    """``(worker URL, export folder)`` of a written capture, for ``import --engine-export``."""
    out = Path(out)

    urls = pq.read_table(out / names.RECORDED / names.WORKERS)["worker"].to_pylist()
    return [(u, out / names.ENGINES / f"{w:03d}") for w, u in enumerate(urls)]
