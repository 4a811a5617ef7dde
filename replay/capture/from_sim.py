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
import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from replay.capture import outguard
from replay.capture.store import (
    KV_SCHEMA,
    LOADS_SCHEMA,
    WORKERS_SCHEMA,
    PartWriter,
    write_atomic_table,
)
from replay.errors import ReplayError
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
    token export's JSON)."""
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


def synthetic_tokens(block: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids of dense block ``block`` (see :func:`block_token_rows`)."""
    return block_token_rows(np.array([block]), n)[0].astype(np.int64)


def _chain_hashes(log) -> np.ndarray:
    """The published hash of every dense block: SHA-256 over the parent's digest and the
    block's synthetic tokens (CAPTURE.md s.3), computed parent first."""
    nb = log.n_blocks
    digest: list[bytes] = [b""] * nb
    out = np.zeros(nb, dtype=np.int64)
    parent = log.block_parent
    # blocks are visited in request order; a block's parent always comes before it there
    order = np.asarray(list(dict.fromkeys(log.hash_ids.tolist())), dtype=np.int64)
    width = int(log.block_size)
    sha = hashlib.sha256
    for k in range(0, order.size, 4096):
        chunk = order[k:k + 4096]
        rows = block_token_rows(chunk, width).astype("<u4")
        for j, b in enumerate(chunk.tolist()):
            p = parent[b]
            d = sha((digest[p] if p >= 0 else b"") + rows[j, :int(log.block_tokens[b])].tobytes()).digest()
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


def _write_token_export(res, log, fleet, te: Path, progress=None) -> None:
    """gzip NDJSON files of a few million token ids each (in day folders, as the router rotates
    them): each request's ``input_ids`` are its blocks' synthetic tokens, built with numpy and
    encoded by polars."""
    req = res.requests
    n = req.height
    ts_all = req["ts"].to_numpy()
    off, ids, L = log.hash_off, log.hash_ids, log.input_tokens.astype(np.int64)
    width = int(log.block_size)
    days = ts_all // (86_400 * NS)
    cum = np.cumsum(L)
    i = seq = 0
    while i < n:
        base = int(cum[i - 1]) if i else 0
        j = min(n, max(i + 1, int(np.searchsorted(cum, base + TOKENS_PER_CHUNK, side="right"))))
        other = np.nonzero(days[i:j] != days[i])[0]
        if other.size:                       # a chunk never spans two days
            j = i + int(other[0])
        blocks = ids[off[i]:off[j]]
        used = np.arange(width)[None, :] < log.block_tokens[blocks][:, None]
        values = block_token_rows(blocks, width)[used].astype(np.int64)
        lens = L[i:j]
        offsets = np.r_[0, np.cumsum(lens)].astype(np.int64)
        input_ids = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
        stamp = pl.Series(ts_all[i:j]).cast(pl.Datetime("ns", "UTC")).dt.to_string("%Y-%m-%dT%H:%M:%S%.9fZ")
        k = j - i
        df = pl.DataFrame({"kind": ["ingest"] * k, "request_id": [str(x) for x in range(i, j)],
                           "slug": ["sim"] * k, "model": [fleet.spec.model] * k,
                           "input_ids": pl.Series(input_ids), "ts": stamp,
                           "choice_index": np.zeros(k, np.int64), "choice_count": np.ones(k, np.int64)})
        # one file per chunk, named as the router names its rotated files: an importer holds a
        # file at a time, so files of a few million tokens keep its memory bounded
        name = dt.datetime.fromtimestamp(int(days[i]) * 86_400, tz=dt.UTC).strftime("%Y-%m-%d")
        folder = te / f"date={name}"
        folder.mkdir(parents=True, exist_ok=True)
        with gzip.open(folder / f"router-0-{int(ts_all[i])}-{seq}.ndjson.gz", "wb", compresslevel=1) as fh:
            df.write_ndjson(fh)
        seq += 1
        if progress is not None:
            progress(k)
        i = j


def engine_dirs(out) -> list[tuple[str, Path]]:
    """``(worker URL, export folder)`` of a written capture, for ``import --engine-export``."""
    out = Path(out)

    urls = pq.read_table(out / names.RECORDED / names.WORKERS)["worker"].to_pylist()
    return [(u, out / names.ENGINES / f"{w:03d}") for w, u in enumerate(urls)]
