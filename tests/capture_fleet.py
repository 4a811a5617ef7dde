"""A fake SGLang engine for the capture tests, written from CAPTURE.md alone.

It serves ``GET /server_info`` over HTTP on loopback and, per data-parallel
rank, binds real ZMQ sockets: an XPUB for LoadStat (topic ``b"load"``), an XPUB
for KV events, and a ROUTER replay socket.  XPUB is wire-compatible with PUB;
it lets the engine wait until a subscriber is connected before it publishes,
so a test never races the slow-joiner window.

Frames are built here with ``struct`` and ``msgpack`` directly (not with
``replay.capture.wire``): the recorder is tested against an independent
encoder.  Every message sent is logged in ``self.sent`` (kind, rank, seq and
what the payload said), which the tests compare with the recorded rows.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgpack
import zmq


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def free_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports."""
    for _ in range(200):
        base = free_ports(1)[0]
        if base + n > 65000:
            continue
        try:
            held = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                held.append(s)
            for s in held:
                s.close()
            return base
        except OSError:
            for s in held:
                s.close()
    raise RuntimeError("no block of free ports")


def seq_frame(seq: int) -> bytes:
    """8-byte big-endian unsigned; -1 is the all-0xFF marker."""
    return struct.pack(">Q", seq % (1 << 64))


def loadstat_payload(running, waiting, tokens, max_total, rank, tail=None, extra=()) -> bytes:
    arr = ["LoadStat", running, waiting, tokens, max_total, rank]
    if tail is not None:
        arr += list(tail) + list(extra)
    return msgpack.packb(arr)


def stored(hashes, parent, ntok, block_size, *, as_map, medium=None, lora=None):
    if as_map:
        ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
              "token_ids": list(range(ntok)), "block_size": block_size}
        if lora is not None:
            ev["lora_id"] = lora
        if medium is not None:
            ev["medium"] = medium
        return ev
    return ["BlockStored", list(hashes), parent, list(range(ntok)), block_size, lora, medium]


def removed(hashes, *, as_map, medium=None):
    if as_map:
        ev = {"type": "BlockRemoved", "block_hashes": list(hashes)}
        if medium is not None:
            ev["medium"] = medium
        return ev
    return ["BlockRemoved", list(hashes)] + ([medium] if medium is not None else [])


def cleared(*, as_map):
    return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]


def batch_payload(ts: float, events: list, rank) -> bytes:
    return msgpack.packb([ts, events, rank])


def serve_server_info(port: int, info) -> ThreadingHTTPServer:
    """``GET /server_info`` on loopback ``port``, answering ``info()`` as JSON (a thread)."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/server_info":
                self.send_error(404)
                return
            body = json.dumps(info()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class FakeEngine:
    """One engine: HTTP /server_info plus dp_size ranks of (LoadStat XPUB, KV XPUB, replay ROUTER)."""

    def __init__(self, dp_size=2, page_size=4, model="fake-model", *, info_style="kv_events",
                 kv_topic="", replay_keep=1000, answer_http=True, attn_dp_size=1, dcp_size=1):
        """``dp_size`` x ``attn_dp_size`` ranks publish; hashes use ``page_size`` x ``dcp_size``
        tokens a block (the top-level keys of /server_info then read ``dp_size`` and
        ``page_size``, as the released engine's do)."""
        self.top_dp_size = dp_size
        self.top_page_size = page_size
        self.attn_dp_size = attn_dp_size
        self.dcp_size = dcp_size
        dp_size = dp_size * attn_dp_size
        self.dp_size = dp_size
        self.page_size = page_size * dcp_size
        self.model = model
        self.replay_keep = replay_keep
        self.http_port, = free_ports(1)
        self.load_base = free_block(dp_size)
        self.kv_base = free_block(dp_size)
        self.replay_base = free_block(dp_size)
        self.kv_topic = kv_topic
        self.info_style = info_style
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.ctx = zmq.Context()
        self.load = []
        self.kv = []
        self.replay = []
        self.lock = threading.Lock()
        for r in range(dp_size):
            for lst, base in ((self.load, self.load_base), (self.kv, self.kv_base)):
                s = self.ctx.socket(zmq.XPUB)
                s.setsockopt(zmq.LINGER, 1000)
                s.setsockopt(zmq.SNDHWM, 1_000_000)
                s.bind(f"tcp://127.0.0.1:{base + r}")
                lst.append(s)
            rs = self.ctx.socket(zmq.ROUTER)
            rs.setsockopt(zmq.LINGER, 0)
            rs.bind(f"tcp://127.0.0.1:{self.replay_base + r}")
            self.replay.append(rs)
        self.buffer = [dict() for _ in range(dp_size)]     # rank -> {seq: payload}
        self.load_seq = [0] * dp_size
        self.kv_seq = [0] * dp_size
        self.sent: list[dict] = []
        self.replay_requests: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._http = None
        if answer_http:
            self._start_http()
        self._replayer = threading.Thread(target=self._serve_replay, daemon=True)
        self._replayer.start()

    # -- /server_info
    def server_info(self) -> dict:
        info = {"model_path": self.model, "dp_size": self.top_dp_size, "page_size": self.top_page_size,
                "attn_dp_size": self.attn_dp_size, "dcp_size": self.dcp_size}
        if self.info_style == "kv_events":
            # the released engine's kv_events block (CAPTURE.md section 1, its key names)
            info["kv_events"] = {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": self.kv_base,
                                 "topic": self.kv_topic, "block_size": self.page_size, "dp_size": self.dp_size,
                                 "load_endpoint_port_base": self.load_base, "load_topic": "load",
                                 "replay_endpoint_port_base": self.replay_base}
        else:  # an engine echoing its --kv-events-config JSON string, load endpoint apart
            info["kv_events_config"] = json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{self.kv_base}",
                                                   "replay_endpoint": f"tcp://*:{self.replay_base}",
                                                   "topic": self.kv_topic})
            info["load_publish_endpoint"] = f"tcp://*:{self.load_base}"
        return info

    def _start_http(self) -> None:
        self._http = serve_server_info(self.http_port, self.server_info)

    # -- waiting for the recorder
    def wait_subscribed(self, timeout=60.0) -> None:
        """Block until every XPUB socket has seen a subscription."""
        pending = set(range(2 * self.dp_size))
        socks = self.load + self.kv
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url}: no subscriber on {len(pending)} sockets")
            for i in list(pending):
                with self.lock:
                    if socks[i].poll(10):
                        msg = socks[i].recv()
                        if msg[:1] == b"\x01":
                            pending.discard(i)

    # -- publishing
    def send_load(self, rank, running, waiting, tokens, max_total, tail=None, extra=(), *, skip=0,
                  seq=None):
        self.load_seq[rank] += skip
        s = self.load_seq[rank] if seq is None else seq
        payload = loadstat_payload(running, waiting, tokens, max_total, rank, tail, extra)
        with self.lock:
            self.load[rank].send_multipart([b"load", seq_frame(s), payload])
        self.sent.append({"kind": "load", "rank": rank, "seq": s, "running": running, "waiting": waiting,
                          "tokens": tokens, "max_total": max_total,
                          "tail": list(tail) if tail is not None else None})
        self.load_seq[rank] = s + 1

    def send_kv(self, rank, events, ts=None, *, skip=0, publish=True, keep=True, seq=None):
        """One EventBatch; ``publish=False`` leaves it out of the live stream (a gap) and
        ``keep=False`` out of the replay buffer (unrecoverable)."""
        self.kv_seq[rank] += skip
        s = self.kv_seq[rank] if seq is None else seq
        ts = time.time() if ts is None else ts
        payload = batch_payload(ts, events, rank)
        if keep:
            with self.lock:
                self.buffer[rank][s] = payload
                while len(self.buffer[rank]) > self.replay_keep:
                    self.buffer[rank].pop(min(self.buffer[rank]))
        if publish:
            with self.lock:
                self.kv[rank].send_multipart([self.kv_topic.encode(), seq_frame(s), payload])
        self.sent.append({"kind": "kv", "rank": rank, "seq": s, "ts": ts, "events": events,
                          "published": publish, "kept": keep})
        self.kv_seq[rank] = s + 1

    def send_raw(self, kind, rank, frames):
        with self.lock:
            (self.load if kind == "load" else self.kv)[rank].send_multipart(frames)
        self.sent.append({"kind": "raw", "stream": kind, "rank": rank, "frames": len(frames)})

    def restart(self, rank=None):
        """A publisher restart: sequences start over at 0, the replay buffer is empty."""
        for r in range(self.dp_size) if rank is None else [rank]:
            self.load_seq[r] = 0
            self.kv_seq[r] = 0
            with self.lock:
                self.buffer[r].clear()

    def _serve_replay(self) -> None:
        poller = zmq.Poller()
        for s in self.replay:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(20):
                r = self.replay.index(sock)
                with self.lock:
                    ident, empty, start = sock.recv_multipart()
                    start_seq = int.from_bytes(start, "big")
                    self.replay_requests.append((r, start_seq))
                    topic = self.kv_topic.encode()
                    for seq in sorted(self.buffer[r]):
                        if seq >= start_seq:
                            sock.send_multipart([ident, b"", topic, seq_frame(seq), self.buffer[r][seq]])
                    sock.send_multipart([ident, b"", b"", seq_frame(-1), b""])

    def close(self) -> None:
        self._stop.set()
        self._replayer.join(timeout=2)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.ctx.destroy(linger=500)


def _serve(argv: list[str]) -> None:
    """``python3 tests/capture_fleet.py HTTP LOAD KV REPLAY COUNT FIRST``: an engine process on
    those ports (dp 1) that waits for a subscriber, prints ``ready``, publishes COUNT LoadStat
    samples (``num_running_reqs`` = FIRST, FIRST+1, ...) 5 ms apart, prints ``done`` and idles
    until killed."""
    http, load, kv, replay, count, first = (int(x) for x in argv)
    it = iter([load, kv, replay])
    global free_ports, free_block

    def free_ports(n):
        return [http]

    def free_block(n):
        return next(it)

    e = FakeEngine(dp_size=1)
    e.wait_subscribed()
    print("ready", flush=True)
    for i in range(count):
        e.send_load(0, first + i, 0, 0, 100)
        time.sleep(0.005)
    print("done", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    import sys

    _serve(sys.argv[1:])
