"""A small fixture fleet on disk, in the capture formats, with its truth kept aside.

Three workers (dp 2, 1, 2; page size 4), requests over shared prompts, KV
events per rank (stores in several tiers, tier-specific and tier-less
removals, clears), written the way the fleet would leave them: the router's
token export as gzip NDJSON (``slug=/date=`` folders, a few ``extend``
records), one JSONL request export per engine (a request missing, an orphan
record), and the recorder's ``kv_events/``, ``loads/`` and
``workers.parquet`` through the recorder's own writer.
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

from replay.capture.store import (
    KV_SCHEMA,
    LOADS_SCHEMA,
    WORKERS_SCHEMA,
    PartWriter,
    write_atomic_table,
)

NS = 1_000_000_000
T0 = 1_764_604_800 * NS      # 2025-12-01T16:00:00Z
PAGE = 4


def spec_hashes(tokens, B, salt=None):
    """CAPTURE.md s.3 from the prose: prior digest (or the salt prior), then each token as <I;
    the first 8 digest bytes as >q."""
    prev = hashlib.sha256(b"sglang-cache-salt-v1\x00" + salt.encode()).digest() if salt else None
    out = []
    for i in range(0, len(tokens), B):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        for t in tokens[i:i + B]:
            h.update(struct.pack("<I", t))
        prev = h.digest()
        out.append(struct.unpack(">q", prev[:8])[0])
    return out


def rfc3339(ns: int) -> str:
    t = dt.datetime.fromtimestamp(ns // NS, tz=dt.UTC)
    return t.strftime("%Y-%m-%dT%H:%M:%S") + f".{ns % NS:09d}Z"


@dataclass
class Fixture:
    root: Path
    workers: list = field(default_factory=list)          # (url, dp)
    requests: list = field(default_factory=list)         # dict(ts, rid, tokens, salt, worker or None)
    events: list = field(default_factory=list)           # dict(ts, worker, rank, seq, idx, type, hashes, medium)
    token_dir: Path | None = None
    engine_dirs: dict = field(default_factory=dict)
    recorded: Path | None = None


def build(root: Path, n_requests=240, seed=3, kv_parts=2) -> Fixture:
    """The fixture fleet; ``kv_parts > 2`` writes the KV events as that many parts of rows in
    random order (overlapping time ranges, as replayed batches make them)."""
    rng = random.Random(seed)
    fx = Fixture(root)
    fx.workers = [("http://10.0.0.1:30000", 2), ("http://10.0.0.2:30000", 1), ("http://10.0.0.10:30000", 2)]
    prompts = [[rng.randrange(1, 50_000) for _ in range(rng.choice([4, 8, 12, 13]))] for _ in range(6)]
    t = T0 + NS
    for i in range(n_requests):
        t += rng.randrange(1, 400) * 1_000_000
        p = prompts[rng.randrange(len(prompts))]
        tokens = p + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 10))]
        salt = "tenant-b" if rng.random() < 0.1 else None
        w = rng.randrange(len(fx.workers)) if rng.random() < 0.92 else None
        fx.requests.append({"ts": t, "rid": f"router-{i:05d}", "tokens": tokens, "salt": salt, "worker": w,
                            "out": rng.randrange(1, 300), "cached": rng.randrange(0, len(tokens) + 1)})
    # events: each served request stores its full pages on a rank of its worker shortly after arrival
    seqs = {}
    for r in fx.requests:
        if r["worker"] is None:
            continue
        url, dp = fx.workers[r["worker"]]
        rank = rng.randrange(dp)
        hs = spec_hashes(r["tokens"], PAGE, r["salt"])
        full = len(r["tokens"]) // PAGE
        ts = r["ts"] + rng.choice([0, 1, 5, 30]) * 1_000_000
        key = (url, rank)
        seq = seqs.get(key, 0)
        evs = []
        if full:
            medium = rng.choice([None, None, "GPU", "CPU_PINNED"])
            evs.append({"type": "BlockStored", "hashes": hs[:full], "medium": medium})
        roll = rng.random()
        if roll < 0.15 and full:
            evs.append({"type": "BlockRemoved", "hashes": [hs[full - 1]], "medium": rng.choice([None, "GPU", "DISK"])})
        elif roll < 0.18:
            evs.append({"type": "AllBlocksCleared", "hashes": None, "medium": None})
        elif roll < 0.25:
            evs.append({"type": "BlockRemoved", "hashes": [rng.randrange(-2**63, 2**63)], "medium": None})
        if not evs:
            continue
        for j, e in enumerate(evs):
            fx.events.append({"ts": ts, "worker": url, "rank": rank, "seq": seq, "idx": j, **e})
        seqs[key] = seq + 1
    _write(fx, rng, kv_parts)
    return fx


def _write(fx: Fixture, rng: random.Random, kv_parts: int) -> None:
    root = fx.root
    # --- token export: two pods, files by date, a few extend records
    fx.token_dir = root / "export"
    by_file = {}
    for k, r in enumerate(fx.requests):
        day = dt.datetime.fromtimestamp(r["ts"] // NS, tz=dt.UTC).strftime("%Y-%m-%d")
        name = f"pod-{k % 2}-{T0 + (k % 2)}-{k // 100:04d}.ndjson.gz"
        rec = {"kind": "ingest", "request_id": r["rid"], "slug": "chat", "model": "m1", "input_ids": r["tokens"],
               "prompt_len": len(r["tokens"]), "ts": rfc3339(r["ts"]), "choice_index": 0, "choice_count": 1}
        if r["salt"]:
            rec["cache_salt"] = r["salt"]
        by_file.setdefault(f"slug=chat/date={day}/{name}", []).append(rec)
        if k % 37 == 0:
            by_file[f"slug=chat/date={day}/{name}"].append({"kind": "extend", "request_id": r["rid"],
                                                             "slug": "chat", "model": "m1", "output_tokens": 5,
                                                             "ts": rfc3339(r["ts"] + NS)})
    for rel, recs in by_file.items():
        p = fx.token_dir / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(p, "wt") as fh:
            for rec in recs:
                fh.write(json.dumps(rec) + "\n")
    # --- engine exports: one folder per engine, hourly files; one request left out, one orphan
    for w, (url, _dp) in enumerate(fx.workers):
        d = root / "metrics" / f"engine-{w}"
        d.mkdir(parents=True)
        fx.engine_dirs[url] = d
        lines = []
        for r in fx.requests:
            if r["worker"] != w or r["rid"] == "router-00007":
                continue
            lines.append({"request_parameters": json.dumps({"rid": r["rid"], "sampling_params": {}}),
                          "id": r["rid"], "finish_reason": {"type": "stop"}, "prompt_tokens": len(r["tokens"]),
                          "completion_tokens": r["out"], "cached_tokens": r["cached"],
                          "e2e_latency": 0.25 + r["out"] / 100, "dp_rank": 0})
        if w == 1:
            lines.append({"request_parameters": "{}", "id": "router-orphan", "prompt_tokens": 3,
                          "completion_tokens": 1, "cached_tokens": 0, "e2e_latency": 0.1})
        (d / "sglang-request-metrics-20251201_16.log").write_text("".join(json.dumps(x) + "\n" for x in lines))
    # --- the recording
    rec = root / "recorded"
    fx.recorded = rec
    kv = PartWriter(rec, "kv_events", KV_SCHEMA, 3600)
    for e in fx.events:
        kv.append({"ts": e["ts"], "worker": e["worker"], "dp_rank": e["rank"], "seq": e["seq"], "event_index": e["idx"],
                   "engine_ts": e["ts"], "replayed": False, "type": e["type"], "block_hashes": e["hashes"],
                   "parent_block_hash": None, "n_tokens": None if e["hashes"] is None else PAGE * len(e["hashes"]),
                   "block_size": PAGE if e["type"] == "BlockStored" else None, "lora_id": None, "medium": e["medium"]})
    t = kv.take()
    if kv_parts <= 2:  # two flushes, as the recorder would
        half = t.num_rows // 2
        kv.write(t.slice(0, half))
        kv.write(t.slice(half))
    else:
        perm = list(range(t.num_rows))
        rng.shuffle(perm)
        t = t.take(perm)
        step = -(-t.num_rows // kv_parts)
        for a in range(0, t.num_rows, step):
            kv.write(t.slice(a, step))
    loads = PartWriter(rec, "loads", LOADS_SCHEMA, 3600)
    end = fx.requests[-1]["ts"] + NS
    for url, dp in fx.workers:
        for rank in range(dp):
            seq = 0
            for ts in range(T0, end, 200_000_000):
                loads.append({"ts": ts + rank, "worker": url, "dp_rank": rank, "seq": seq,
                              "num_running_reqs": rng.randrange(0, 4), "num_waiting_reqs": rng.randrange(0, 4),
                              "num_tokens": rng.randrange(0, 500), "max_total_num_tokens": 4000,
                              "num_waiting_uncached_tokens": 0, "num_total_tokens": 10, "max_running_requests": 16,
                              "total_prefill_uncached_tokens": seq, "total_prefill_busy_us": seq})
                seq += 1
    loads.write(loads.take())
    import pyarrow as pa

    write_atomic_table(rec / "workers.parquet", pa.table(
        {"worker": [u for u, _ in fx.workers], "model": ["/models/m1"] * 3, "role": ["plain"] * 3,
         "dp_size": [d for _, d in fx.workers], "page_size": [PAGE] * 3}, schema=WORKERS_SCHEMA))
    # recorded with --kv-format default: salted requests' hashes are then reproducible exactly
    (rec / "record.json").write_text(json.dumps({"tool": "router-replay record", "complete": True, "gaps": 0,
                                                 "restarts": 0, "malformed_frames": 0, "unreachable": {},
                                                 "kv_format": "default"}))


def slow_matches(fx: Fixture, lag_ns: int = 0) -> dict[str, list[tuple[str, int]]]:
    """At every request, from scratch: apply every event with ts + lag <= arrival in (ts, seq)
    order to per-(worker, rank) {hash: set of tiers}; then per worker, URL order, the deepest
    leading run on any rank."""
    urls = sorted(u for u, _ in fx.workers)
    ordered = sorted(fx.events, key=lambda e: (e["ts"], e["worker"], e["rank"], e["seq"], e["idx"]))
    out = {}
    for r in fx.requests:
        state: dict = {}
        for e in ordered:
            if e["ts"] + lag_ns > r["ts"]:
                break
            held = state.setdefault((e["worker"], e["rank"]), {})
            if e["type"] == "AllBlocksCleared":
                held.clear()
            elif e["type"] == "BlockStored":
                for h in e["hashes"]:
                    held.setdefault(h, set()).add(e["medium"] or "GPU")
            else:
                for h in e["hashes"]:
                    if e["medium"] is None:
                        held.pop(h, None)
                    elif h in held:
                        held[h].discard(e["medium"])
                        if not held[h]:
                            del held[h]
        hs = spec_hashes(r["tokens"], PAGE, r["salt"])
        ans = []
        for u in urls:
            best = 0
            for (wu, _rank), held in state.items():
                if wu != u:
                    continue
                d = 0
                while d < len(hs) and hs[d] in held:
                    d += 1
                best = max(best, d)
            if best:
                ans.append((u, best))
        out[r["rid"]] = ans
    return out
