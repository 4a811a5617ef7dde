"""A load publisher for the record bench: W workers x D ranks of LoadStat (and KV events) on loopback.

Worker ``i`` binds ``tcp://127.0.0.<i + 2>:<base + rank>`` (every 127/8 address is loopback on
Linux), so one set of port bases serves the whole fleet.  It waits until every socket has a
subscriber (XPUB), publishes one LoadStat per rank every ``interval_ms`` and one KV batch per
rank every ``kv_every`` ticks for ``duration_s``, then prints what it sent as JSON.

    python3 benches/_capture_pub.py WORKERS DP INTERVAL_MS DURATION_S LOAD_BASE KV_BASE [KV_EVERY]
"""

from __future__ import annotations

import json
import struct
import sys
import time

import msgpack
import zmq


def main() -> None:
    W, D, interval_ms, duration_s, load_base, kv_base = (int(float(x)) for x in sys.argv[1:7])
    kv_every = int(sys.argv[7]) if len(sys.argv) > 7 else 10
    ctx = zmq.Context()
    loads, kvs = [], []
    for i in range(W):
        for r in range(D):
            for lst, base in ((loads, load_base), (kvs, kv_base)):
                s = ctx.socket(zmq.XPUB)
                s.setsockopt(zmq.SNDHWM, 1_000_000)
                s.bind(f"tcp://127.0.0.{i + 2}:{base + r}")
                lst.append(s)
    pending = set(range(len(loads) + len(kvs)))
    socks = loads + kvs
    deadline = time.monotonic() + 120
    while pending and time.monotonic() < deadline:
        for j in list(pending):
            if socks[j].poll(0):
                if socks[j].recv()[:1] == b"\x01":
                    pending.discard(j)
        time.sleep(0.001)
    if pending:
        print(json.dumps({"error": f"{len(pending)} sockets without subscriber"}), flush=True)
        sys.exit(1)
    print(json.dumps({"ready": True}), flush=True)
    n = len(loads)
    seq = [0] * n
    kseq = [0] * n
    pack = struct.Struct(">q").pack
    t0 = time.monotonic()
    ticks = int(duration_s * 1000 / interval_ms)
    late = 0
    for k in range(ticks):
        due = t0 + k * interval_ms / 1000
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        elif now - due > interval_ms / 1000:
            late += 1
        for j in range(n):
            payload = msgpack.packb(["LoadStat", k % 5, (k + j) % 7, 1000 + k, 200_000, j % D, 10, 20, 32, k, k])
            loads[j].send_multipart([b"load", pack(seq[j]), payload])
            seq[j] += 1
            if k % kv_every == 0:
                ev = [{"type": "BlockStored", "block_hashes": [k * 1000 + j, k * 1000 + j + 1],
                       "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16}]
                kvs[j].send_multipart([b"", pack(kseq[j]), msgpack.packb([time.time(), ev, j % D])])
                kseq[j] += 1
    wall = time.monotonic() - t0
    print(json.dumps({"loads": sum(seq), "kv": sum(kseq), "wall_s": wall, "late_ticks": late,
                      "per_stream_loads": seq[:3]}), flush=True)
    time.sleep(1.0)
    ctx.destroy(linger=2000)


if __name__ == "__main__":
    main()
