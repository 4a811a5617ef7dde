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
import pyarrow as pa
import pyarrow.parquet as pq

from replay.capture import outguard as _kinds  # noqa: F401 - registers the capture output kinds
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


def synthetic_tokens(block: int, n: int) -> np.ndarray:
    """``n`` deterministic token ids of dense block ``block``: the first is ``block + 1`` (so no
    two blocks share their tokens), the rest a SHA-256 stream of the block id."""
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    out[0] = block + 1
    stream = b""
    k = 0
    while len(stream) < 4 * (n - 1):
        stream += hashlib.sha256(f"{block}:{k}".encode()).digest()
        k += 1
    if n > 1:
        out[1:] = np.frombuffer(stream[:4 * (n - 1)], dtype="<u4")
    return out


def _chain_hashes(log) -> np.ndarray:
    """The published hash of every dense block: SHA-256 over the parent's digest and the
    block's synthetic tokens (CAPTURE.md s.3), computed parent first."""
    nb = log.n_blocks
    digest: list[bytes | None] = [None] * nb
    out = np.zeros(nb, dtype=np.int64)
    parent = log.block_parent
    order = []
    # blocks are visited in request order; a block's parent always comes before it there
    seen = np.zeros(nb, dtype=bool)
    for b in log.hash_ids.tolist():
        if not seen[b]:
            seen[b] = True
            order.append(b)
    for b in order:
        p = parent[b]
        prior = digest[p] if p >= 0 else b""
        d = hashlib.sha256(prior + synthetic_tokens(b, int(log.block_tokens[b])).astype("<u4").tobytes()).digest()
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


def _rfc3339(ns: int) -> str:
    t = dt.datetime.fromtimestamp(ns // NS, tz=dt.UTC)
    return f"{t:%Y-%m-%dT%H:%M:%S}.{ns % NS:09d}Z"


def write_capture(res, log, fleet, out, *, index_lag_ms: int = 0, force: bool = False) -> Path:
    """Write ``res`` (a ``simulate(..., cache_log=True)`` result on ``log`` and ``fleet``) in the
    capture formats under ``out``; returns ``out``."""
    if "cache_log" not in res.extra:
        raise ReplayError("the simulation kept no cache log: run simulate(..., cache_log=True)")
    _check_exportable(log)
    out = Path(out)
    rundir.guard([(out, "capture")], force=force)
    with rundir.building(out) as tmp:
        _write(res, log, fleet, tmp, index_lag_ms)
        (tmp / names.TRACE_JSON).write_text(json.dumps({"source": "router-replay simulate -> capture formats"}) + "\n")
    return out


def _write(res, log, fleet, root: Path, index_lag_ms: int) -> None:
    urls = fleet.urls
    page = int(log.block_size)
    rec = root / "recorded"
    rec.mkdir(parents=True)
    hashes = _chain_hashes(log)
    # --- loads: rows as record writes them (per-rank sequence numbers)
    ld = res.loads
    lw = PartWriter(rec, "loads", LOADS_SCHEMA, 3600)
    seqs: dict = {}
    cols = {c: ld[c].to_list() for c in ld.columns}
    for k in range(ld.height):
        key = (cols["worker"][k], cols["dp_rank"][k])
        s = seqs.get(key, 0)
        seqs[key] = s + 1
        row = {c: cols[c][k] for c in cols if c != "router_inflight"}
        row["seq"] = s
        row["attn_dp_rank"] = row["dp_rank"]
        lw.append(row)
    t = lw.take()
    if t is not None:
        lw.write(t)
    # --- kv events: one batch per store / eviction, at the engine's publish time
    cl = res.extra["cache_log"]
    lag = int(index_lag_ms) * 1_000_000
    kw = PartWriter(rec, "kv_events", KV_SCHEMA, 3600)
    kseq: dict = {}
    parent = log.block_parent
    for ts, w, b, sr in cl.tolist():
        rank = abs(sr) - 1
        key = (w, rank)
        s = kseq.get(key, 0)
        kseq[key] = s + 1
        stored = sr > 0
        p = int(parent[b])
        kw.append({"ts": ts - lag, "worker": urls[w], "dp_rank": rank, "seq": s, "event_index": 0,
                   "engine_ts": ts - lag, "replayed": False,
                   "type": "BlockStored" if stored else "BlockRemoved", "block_hashes": [int(hashes[b])],
                   "parent_block_hash": (int(hashes[p]) if p >= 0 else None) if stored else None,
                   "n_tokens": int(log.block_tokens[b]) if stored else None,
                   "block_size": page if stored else None, "lora_id": None, "medium": "GPU" if stored else None})
    t = kw.take()
    if t is not None:
        kw.write(t)
    write_atomic_table(rec / names.WORKERS, pa.table(
        {"worker": urls, "model": [w.model for w in fleet.workers], "role": [w.role for w in fleet.workers],
         "dp_size": [w.dp_size for w in fleet.workers], "page_size": [page] * len(urls)}, schema=WORKERS_SCHEMA))
    (rec / "record.json").write_text(json.dumps({"tool": "router-replay simulate (capture formats)",
                                                 "complete": True, "gaps": 0, "restarts": 0,
                                                 "malformed_frames": 0, "unreachable": {}}) + "\n")
    # --- the router's token export
    req = res.requests
    te = root / "token_export" / "slug=sim"
    ts_all = req["ts"].to_list()
    off, ids, L = log.hash_off, log.hash_ids, log.input_tokens
    by_day: dict[str, list] = {}
    for i in range(req.height):
        toks = [synthetic_tokens(int(b), int(log.block_tokens[b])) for b in ids[off[i]:off[i + 1]].tolist()]
        input_ids = np.concatenate(toks).tolist() if toks else []
        assert len(input_ids) == int(L[i])
        day = dt.datetime.fromtimestamp(ts_all[i] // NS, tz=dt.UTC).strftime("%Y-%m-%d")
        by_day.setdefault(day, []).append(json.dumps(
            {"kind": "ingest", "request_id": str(i), "slug": "sim", "model": fleet.spec.model,
             "input_ids": input_ids, "ts": _rfc3339(ts_all[i]), "choice_index": 0, "choice_count": 1}))
    for day, lines in by_day.items():
        d = te / f"date={day}"
        d.mkdir(parents=True)
        with gzip.open(d / "router-0-0-0.ndjson.gz", "wt") as fh:
            fh.write("\n".join(lines) + "\n")
    # --- engine request exports
    o = res.outcomes
    eng = root / "engines"
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


def engine_dirs(out) -> list[tuple[str, Path]]:
    """``(worker URL, export folder)`` of a written capture, for ``import --engine-export``."""
    out = Path(out)

    urls = pq.read_table(out / "recorded" / names.WORKERS)["worker"].to_pylist()
    return [(u, out / "engines" / f"{w:03d}") for w, u in enumerate(urls)]
