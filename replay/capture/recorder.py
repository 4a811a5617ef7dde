"""``router-replay record``: a live fleet's LoadStat and KV-event streams to a trace set.

One thread polls every subscribed socket (one SUB per rank and stream, one
DEALER per rank's KV replay socket), stamps each message with the receive
time, checks its sequence number and buffers the decoded rows; every flush
interval the buffers become Parquet parts (written by a second thread, aside
then renamed, :mod:`.store`) and ``record.json`` is rewritten with the facts
so far.  What can go wrong in a week of production, and what happens:

* **publisher restart** (sequence goes back): counted as a ``restart`` row in
  ``gaps/`` and in the facts; recording continues from the new sequence.
* **sequence gap**: on a KV stream the replay socket is asked for the missing
  range; batches it still holds are recorded (``replayed = true``), the rest,
  and every LoadStat gap (LoadStat has no replay socket), become ``gap`` rows
  with their sequence and time range.
* **malformed frame**: counted per stream and skipped, the first example kept
  in the facts; a malformed KV batch is also a ``gap`` row (its events are lost).
* **an engine that never answers** ``/server_info``: named in the facts and on
  stderr; the others are recorded; discovery is retried every ``retry_s``.
* **SIGINT / SIGTERM / --duration**: a last flush, every file closed,
  ``record.json`` says ``"complete": true``.  After ``kill -9`` it says
  false and at most the last flush interval of rows is missing.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa

from replay import __version__
from replay.capture import wire
from replay.capture.store import (
    GAPS_SCHEMA,
    KV_SCHEMA,
    LOADS_SCHEMA,
    WORKERS_SCHEMA,
    PartWriter,
    write_atomic_json,
    write_atomic_table,
)
from replay.errors import ParamsError, ReplayError
from replay.runs import names
from replay.runs.names import WORKERS

LOAD = "load"
KV = "kv"
MAX_EXAMPLES = 20


class RecordError(ReplayError):
    """Bad record input (no worker, an unusable flag); one line."""


@dataclass
class Overrides:
    """Flags that override (or stand in for) what ``/server_info`` advertises."""

    dp_size: int | None = None
    page_size: int | None = None
    load_port_base: int | None = None
    kv_port_base: int | None = None
    replay_port_base: int | None = None
    kv_topic: str | None = None
    kv_format: str | None = None       # default | dynamo: not advertised, only a flag can say


@dataclass
class Engine:
    url: str
    host: str
    dp_size: int = 1                   # publishing ranks
    page_size: int | None = None       # the hashing block size
    model: str | None = None
    load_port_base: int | None = None
    kv_port_base: int | None = None
    replay_port_base: int | None = None
    kv_topic: str = ""
    load_topic: str = "load"
    source: str = "server_info"
    notes: list = field(default_factory=list)


def _port(endpoint) -> int | None:
    if endpoint is None:
        return None
    if isinstance(endpoint, int):
        return endpoint
    try:
        return urlparse(str(endpoint)).port
    except ValueError:
        return None


def _kv_config(info: dict) -> tuple[dict, bool]:
    """The ``kv_events`` block (advertised: True) or, from engines that only echo it,
    the ``kv_events_config`` JSON string (False)."""
    cfg = info.get("kv_events")
    if isinstance(cfg, dict):
        return cfg, True
    cfg = info.get("kv_events_config") or {}
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except ValueError:
            cfg = {}
    return (cfg if isinstance(cfg, dict) else {}), False


def _positive(v, what: str, url: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RecordError(f"worker {url}: /server_info {what} is {v!r}, expected an integer >= 1")
    return v


def engine_from_info(url: str, info: dict, ov: Overrides) -> Engine:
    """An :class:`Engine` from a ``/server_info`` answer and the override flags.

    The ``kv_events`` block is the authority (CAPTURE.md section 1, key names
    as sglang 0.5.23 writes them): ``dp_size`` is the number of publishing
    ranks (dp_size x attention-DP size; the top-level ``dp_size`` reads 1
    under attention DP), ``block_size`` the hashing size (page_size x DCP
    size), ``endpoint_port_base`` / ``replay_endpoint_port_base`` /
    ``load_endpoint_port_base`` the port bases (rank ``r`` binds ``base + r``;
    the bases are read, never derived), ``topic`` the KV topic and
    ``load_topic`` the load topic.  The load stream is subscribed only when
    both ``load_endpoint_port_base`` and ``load_topic`` are advertised (or
    ``--load-port-base`` is given).  ``endpoint_host`` may be a wildcard: the
    worker URL's host is dialled.  Engines without a ``kv_events`` block
    (their ``--kv-events-config`` echoed as a string, a top-level
    ``load_publish_endpoint``) are read from the top-level ``dp_size`` x
    ``attn_dp_size`` and ``page_size`` x ``dcp_size``; the facts say so.
    """
    host = urlparse(url).hostname
    if not host:
        raise RecordError(f"worker {url!r}: not a URL with a host")
    kv, advertised = _kv_config(info)
    e = Engine(url=url, host=host)
    top_dp = (_positive(info.get("dp_size"), "dp_size", url) or 1) * \
        (_positive(info.get("attn_dp_size"), "attn_dp_size", url) or 1)
    kv_dp = _positive(kv.get("dp_size"), "kv_events.dp_size", url) if advertised else None
    e.dp_size = int(ov.dp_size or kv_dp or top_dp)
    top_page = _positive(info.get("page_size"), "page_size", url)
    dcp = _positive(info.get("dcp_size"), "dcp_size", url) or 1
    kv_block = _positive(kv.get("block_size"), "kv_events.block_size", url) if advertised else None
    e.page_size = ov.page_size or kv_block or (top_page * dcp if top_page else None)
    if not ov.dp_size and kv_dp is None:
        e.notes.append("ranks from the top-level dp_size x attn_dp_size (no kv_events.dp_size advertised)")
    if not ov.page_size and kv_block is None and e.page_size is not None:
        e.notes.append("block size from the top-level page_size x dcp_size (no kv_events.block_size advertised)")
    e.model = info.get("served_model_name") or info.get("model_path")
    e.kv_port_base = ov.kv_port_base or kv.get("endpoint_port_base") or _port(kv.get("endpoint"))
    e.replay_port_base = (ov.replay_port_base or kv.get("replay_endpoint_port_base")
                          or _port(kv.get("replay_endpoint")))
    if ov.load_port_base:
        e.load_port_base = ov.load_port_base
    elif advertised:
        # the router subscribes only when both are advertised; so does the recorder
        if kv.get("load_endpoint_port_base") and kv.get("load_topic") is not None:
            e.load_port_base = kv.get("load_endpoint_port_base")
            e.load_topic = str(kv.get("load_topic"))
    else:
        e.load_port_base = _port(kv.get("load_endpoint")) or _port(info.get("load_publish_endpoint"))
    topic = ov.kv_topic if ov.kv_topic is not None else kv.get("topic", "")
    e.kv_topic = topic or ""
    if e.dp_size < 1:
        raise RecordError(f"worker {url}: dp_size {e.dp_size} < 1")
    check_ranks(e)
    return e


MAX_PORT = 65535


def check_ranks(e: Engine) -> None:
    """Refuse, in one line and before any socket opens, an engine whose ranks' ports (base + rank)
    run past 65535, or whose ranks need more sockets than this process may open (a server_info
    advertising 10**7 ranks ended in 'Too many open files')."""
    bases = {"load port base": e.load_port_base, "KV-event port base": e.kv_port_base,
             "KV-event replay port base": e.replay_port_base}
    for what, base in bases.items():
        if base is None:
            continue
        if isinstance(base, bool) or not isinstance(base, int) or not 1 <= base <= MAX_PORT:
            raise RecordError(f"worker {e.url}: {what} {base!r} is not a port (1..{MAX_PORT})")
        if base + e.dp_size - 1 > MAX_PORT:
            raise RecordError(f"worker {e.url}: {what} {base} + {e.dp_size:,} ranks reaches port "
                              f"{base + e.dp_size - 1:,}, above {MAX_PORT}")
    sockets = e.dp_size * max(1, sum(b is not None for b in bases.values()))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and sockets > soft - 64:
        raise RecordError(f"worker {e.url}: {e.dp_size:,} ranks need {sockets:,} sockets, more than this "
                          f"process may open ({soft:,}: ulimit -n)")


def discover(url: str, ov: Overrides, timeout_s: float = 3.0) -> Engine:
    """Ask ``url/server_info``; when every port is given by flags, no request is needed."""
    if ov.load_port_base and ov.kv_port_base and ov.dp_size and ov.page_size:
        e = engine_from_info(url, {}, ov)
        e.source = "flags"
        return e
    req = urllib.request.Request(url.rstrip("/") + "/server_info", headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        info = json.loads(resp.read().decode())
    if not isinstance(info, dict):
        raise ValueError("server_info is not a JSON object")
    return engine_from_info(url, info, ov)


@dataclass
class Stream:
    """One rank's publisher of one kind, with its sequence bookkeeping."""

    engine: Engine
    rank: int
    kind: str                     # LOAD or KV
    endpoint: str
    last_seq: int | None = None
    last_ts: int | None = None
    messages: int = 0
    malformed: int = 0
    restarts: int = 0
    gaps: int = 0
    lost: int = 0
    replayed: int = 0
    unverified: int = 0            # gaps whose replay answer could not show the same publisher sent it
    last_payload: bytes | None = None   # the last live KV batch's bytes (the replay probe compares them)
    replay: Any = None             # zmq DEALER socket of the rank's replay endpoint (zmq imported lazily)
    replay_endpoint: str = ""
    # [start, end, from_ts, to_ts, got(set), deadline, probe]: probe (seq, bytes) is the last live batch
    # before the gap, asked again with the range and compared (a different batch: the publisher restarted)
    pending: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.engine.url} rank {self.rank} {self.kind}"


def _dial(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class Recorder:
    def __init__(self, urls: list[str], out: Path, *, overrides: Overrides | None = None,
                 flush_s: float = 10.0, rotate_s: int = 3600, retry_s: float = 10.0,
                 replay_timeout_s: float = 5.0, status=None, now_ns=time.time_ns,
                 router_flags: dict | None = None):
        if not urls:
            raise ParamsError("no worker given (use {urls})", ("urls", "--worker URL or --workers-file FILE"))
        self.urls = list(dict.fromkeys(urls))
        self.out = Path(out)
        self.ov = overrides or Overrides()
        self.router_flags = dict(router_flags or {})
        self.flush_s = float(flush_s)
        self.retry_s = float(retry_s)
        self.replay_timeout_s = float(replay_timeout_s)
        self.status = status
        self.now_ns = now_ns
        self.loads = PartWriter(self.out, names.LOADS_DIR, LOADS_SCHEMA, rotate_s)
        self.kv = PartWriter(self.out, names.KV_EVENTS_DIR, KV_SCHEMA, rotate_s)
        self.gaps = PartWriter(self.out, names.GAPS_DIR, GAPS_SCHEMA, rotate_s)
        self.engines: dict[str, Engine] = {}
        self.unreachable: dict[str, str] = {}
        self.streams: list[Stream] = []
        self.examples: list[dict] = []
        self.started_ns = now_ns()
        self.stop = threading.Event()
        self._writes: queue.Queue = queue.Queue()
        self._writer_error: list[BaseException] = []
        self._discovered: queue.Queue = queue.Queue()
        self.rows_total = 0

    # ------------------------------------------------------------------ setup
    def _discover_all(self, urls: list[str]) -> None:
        results: dict[str, Engine | str | RecordError] = {}

        def one(u):
            try:
                results[u] = discover(u, self.ov)
            except RecordError as err:      # an engine this recorder refuses: raised by the main loop
                results[u] = err
            except (OSError, ValueError, urllib.error.URLError) as err:
                reason = getattr(err, "reason", None) or err
                results[u] = f"{type(err).__name__}: {str(reason).splitlines()[0] if str(reason) else ''}"

        threads = [threading.Thread(target=one, args=(u,), daemon=True) for u in urls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for u in urls:
            r = results.get(u, "no answer")
            self._discovered.put((u, r))

    def _retry_loop(self) -> None:
        while not self.stop.wait(self.retry_s):
            missing = [u for u in self.urls if u in self.unreachable]
            if missing:
                self._discover_all(missing)

    def _take_discovered(self, ctx, poller) -> None:
        import zmq  # optional: an extra dependency

        while True:
            try:
                url, r = self._discovered.get_nowait()
            except queue.Empty:
                return
            if url in self.engines:
                continue
            if isinstance(r, RecordError):
                raise r
            if isinstance(r, str):
                if url not in self.unreachable:
                    self._warn(f"warning: {url}: no /server_info answer ({r}); still recording the others")
                self.unreachable[url] = r
                continue
            self.unreachable.pop(url, None)
            e = r
            if e.load_port_base is None and e.kv_port_base is None:
                self.unreachable[url] = "server_info advertises no LoadStat or KV-event port"
                self._warn(f"warning: {url}: {self.unreachable[url]} (give --load-port-base / --kv-port-base)")
                continue
            self.engines[url] = e
            for rank in range(e.dp_size):
                for kind, base, topic in ((LOAD, e.load_port_base, e.load_topic), (KV, e.kv_port_base, e.kv_topic)):
                    if base is None:
                        continue
                    ep = f"tcp://{_dial(e.host)}:{base + rank}"
                    s = Stream(e, rank, kind, ep)
                    sock = ctx.socket(zmq.SUB)
                    if ":" in e.host:
                        sock.setsockopt(zmq.IPV6, 1)
                    sock.setsockopt(zmq.RCVHWM, 1_000_000)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
                    sock.connect(ep)
                    self._sockets[sock] = s
                    poller.register(sock, zmq.POLLIN)
                    if kind == KV and e.replay_port_base is not None:
                        s.replay_endpoint = f"tcp://{_dial(e.host)}:{e.replay_port_base + rank}"
                        self._open_replay(s)
                    self.streams.append(s)
            self._write_workers()

    def _open_replay(self, s: Stream) -> None:
        """(Re)open the rank's replay DEALER; a new socket has a new identity, so the answer to
        a request that timed out can never be taken for the answer to the next one."""
        import zmq  # optional: an extra dependency

        if s.replay is not None:
            self._poller.unregister(s.replay)
            del self._sockets[s.replay]
            s.replay.close(linger=0)
        rep = self._ctx.socket(zmq.DEALER)
        rep.setsockopt(zmq.LINGER, 0)
        if ":" in s.engine.host:
            rep.setsockopt(zmq.IPV6, 1)
        rep.connect(s.replay_endpoint)
        s.replay = rep
        self._sockets[rep] = s
        self._poller.register(rep, zmq.POLLIN)

    def _warn(self, text: str) -> None:
        if self.status is not None:
            self.status.clear()
        print(text, file=sys.stderr, flush=True)

    # ---------------------------------------------------------- frame handling
    def _example(self, s: Stream, reason: str, frames: list[bytes]) -> None:
        if len([x for x in self.examples if x["stream"] == s.name]) == 0 and len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"stream": s.name, "reason": reason,
                                  "frames_hex": [f[:64].hex() for f in frames[:4]],
                                  "frame_bytes": [len(f) for f in frames[:4]]})

    def _gap(self, s: Stream, kind: str, a: int | None, b: int | None, t0, t1, reason: str, now: int) -> None:
        if kind == "gap":
            s.gaps += 1
            if a is not None and b is not None:
                s.lost += b - a + 1
        self.gaps.append({"ts": now, "worker": s.engine.url, "dp_rank": s.rank, "stream": s.kind,
                          "kind": kind, "from_seq": None if a is None else wire.stored_seq(a),
                          "to_seq": None if b is None else wire.stored_seq(b), "from_ts": t0, "to_ts": t1,
                          "reason": reason})

    def _reset(self, s: Stream, now: int, why: str, old: int | None, new: int | None) -> None:
        """A publisher reset: ranges still asked of the old publisher's replay buffer are lost
        with it (the new one answers with its own, unrelated sequence numbers), a ``restart``
        row says when, and on the KV stream an AllBlocksCleared row (seq -1, event_index -1)
        empties the rank before the new publisher's first batch, as the router does."""
        while s.pending:
            self._finish_replay(s, now, "the publisher restarted before its replay socket answered",
                                ask_next=False)
        s.restarts += 1
        self._gap(s, "restart", None if new is None else wire.stored_seq(new),
                  None if old is None else wire.stored_seq(old), s.last_ts, now, why, now)
        if s.kind == KV:
            self.kv.append({"ts": now, "worker": s.engine.url, "dp_rank": s.rank, "seq": -1, "event_index": -1,
                            "engine_ts": None, "replayed": False, "type": wire.ALL_BLOCKS_CLEARED})
            self.rows_total += 1

    def _sequence(self, s: Stream, seq: int, now: int) -> None:
        """Bookkeeping of a live message's sequence number (restart, gap)."""
        last = s.last_seq
        if last is not None and seq <= last:
            # REPLAY CHOICE: any decrease is a restart (0.5.23 sends no reset frame; a
            # subscriber that stays connected may first see seq 1 or 3 of the new publisher)
            self._reset(s, now, f"sequence went back from {last} to {seq} (publisher restart)", last, seq)
            # what the new publisher sent before this frame (its AllBlocksCleared at seq 0 among
            # them) is asked of its replay buffer like any gap
            last = -1
            s.last_ts = now
        if last is not None and seq > last + 1:
            a, b = last + 1, seq - 1
            if s.kind == KV and s.replay is not None:
                probe = (last, s.last_payload) if last >= 0 and s.last_payload is not None else None
                s.pending.append([a, b, s.last_ts, now, set(), None, probe])
                if len(s.pending) == 1:
                    self._ask_replay(s)
            else:
                # REPLAY CHOICE: LoadStat gaps are normal (the engine's PUB high-water mark is 8
                # messages, each sample a gauge superseded by the next): reported, never chased
                why = ("LoadStat has no replay socket (a gauge: the next sample supersedes it)"
                       if s.kind == LOAD else "no replay endpoint")
                self._gap(s, "gap", a, b, s.last_ts, now, why, now)
        s.last_seq = seq
        s.last_ts = now

    def _ask_replay(self, s: Stream) -> None:
        p = s.pending[0]
        p[5] = time.monotonic() + self.replay_timeout_s
        s.replay.send_multipart([b"", wire.pack_seq(p[0] - 1 if p[6] is not None else p[0])])

    def _overtaken(self, s: Stream, now: int, old: int) -> None:
        """The replay buffer's batch ``old`` is not the one received live: a new publisher, whose
        sequence passed the old one before this recorder saw any of its batches.  The rank is
        cleared just after the old publisher's last batch, and the new publisher's batches from 0
        are asked of its replay buffer (on a new socket: the answer under way is to the probe)."""
        p = s.pending[0]
        t0 = p[2] + 1
        s.restarts += 1
        self._gap(s, "restart", p[1] + 1, old, p[2], p[3],
                  f"the replay buffer's batch {old} differs from the one received: the publisher restarted "
                  "and its new sequence passed the old one before this recorder saw it", now)
        self.kv.append({"ts": t0, "worker": s.engine.url, "dp_rank": s.rank, "seq": -1, "event_index": -1,
                        "engine_ts": None, "replayed": False, "type": wire.ALL_BLOCKS_CLEARED})
        self.rows_total += 1
        p[0], p[2], p[4], p[6] = 0, t0, set(), None
        self._open_replay(s)
        self._ask_replay(s)

    def _finish_replay(self, s: Stream, now: int, why: str, ask_next: bool = True) -> None:
        a, b, t0, t1, got = s.pending.pop(0)[:5]
        run = None
        for q in range(a, b + 2):
            if q <= b and q not in got:
                run = q if run is None else run
            elif run is not None:
                self._gap(s, "gap", run, q - 1, t0, t1, why, now)
                run = None
        if s.pending and ask_next:
            self._ask_replay(s)

    def _on_replay(self, s: Stream, frames: list[bytes], now: int) -> None:
        if not s.pending:
            return  # a late answer after a timeout
        try:
            ans = wire.split_replay(frames)
        except wire.FrameError as err:
            s.malformed += 1
            self._example(s, f"replay: {err}", frames)
            return
        p = s.pending[0]
        if ans is not None and p[6] is not None and ans[0] == p[6][0]:
            probe, p[6] = p[6], None
            if ans[1] != probe[1]:
                self._overtaken(s, now, probe[0])
            return            # the same batch: the same publisher (it is recorded already)
        if p[6] is not None:
            # REPLAY CHOICE: the buffer no longer holds the last batch seen, so a restart whose
            # sequence passed the old one cannot be told from a gap (counted, docs/capture.md)
            p[6] = None
            s.unverified += 1
        if ans is None:       # the end marker: what did not come is no longer in the buffer
            self._finish_replay(s, now, "not in the replay buffer any more")
            return
        seq, payload = ans
        if p[0] <= seq <= p[1] and seq not in p[4]:
            if self._kv_rows(s, seq, payload, now, replayed=True, lo=p[2], hi=p[3]):
                p[4].add(seq)
                s.replayed += 1

    def _kv_rows(self, s: Stream, seq: int, payload: bytes, now: int, *, replayed: bool,
                 lo=None, hi=None) -> bool:
        try:
            ts_s, _rank, events = wire.decode_batch(payload)
        except wire.FrameError as err:
            s.malformed += 1
            self._example(s, str(err), [payload])
            self._gap(s, "malformed", seq, seq, s.last_ts, now, f"malformed batch: {err}", now)
            return False
        engine_ns = None if ts_s is None else int(round(ts_s * 1e9))
        ts = now
        if replayed:
            # REPLAY CHOICE: a batch recovered after a gap was published between
            # the messages around the gap; its engine time, clamped into that
            # range, estimates when the router saw it.
            ts = hi if engine_ns is None else min(max(engine_ns, lo if lo is not None else engine_ns), hi)
        for j, ev in enumerate(events):
            ev.update(ts=ts, worker=s.engine.url, dp_rank=s.rank, seq=wire.stored_seq(seq), event_index=j,
                      engine_ts=engine_ns, replayed=replayed)
            self.kv.append(ev)
        self.rows_total += len(events)
        return True

    def _on_message(self, s: Stream, frames: list[bytes], now: int) -> None:
        try:
            topic, seq, payload = wire.split(frames)
        except wire.FrameError as err:
            s.malformed += 1
            self._example(s, str(err), frames)
            return
        s.messages += 1
        if seq == wire.RESET_SEQ and s.kind == KV:
            # a newer engine's reset frame: that rank is cleared, its next batches start at 0
            self._reset(s, now, "reset frame (sequence -1) on the live KV topic", s.last_seq, None)
            s.last_seq = None
            s.last_ts = now
            return
        self._sequence(s, seq, now)
        if s.kind == LOAD:
            try:
                row = wire.decode_loadstat(payload)
            except wire.FrameError as err:
                s.malformed += 1
                self._example(s, str(err), frames)
                return
            row.update(ts=now, worker=s.engine.url, dp_rank=s.rank, seq=wire.stored_seq(seq))
            self.loads.append(row)
            self.rows_total += 1
        else:
            s.last_payload = payload
            self._kv_rows(s, seq, payload, now, replayed=False)

    # ---------------------------------------------------------------- output
    def _write_workers(self) -> None:

        es = [self.engines[u] for u in sorted(self.engines)]
        t = pa.table({"worker": [e.url for e in es], "model": [e.model for e in es],
                      "role": ["plain"] * len(es), "dp_size": [e.dp_size for e in es],
                      "page_size": [e.page_size for e in es]}, schema=WORKERS_SCHEMA)
        self._writes.put(("workers", t))

    def facts(self, complete: bool) -> dict:
        now = self.now_ns()
        return {
            "tool": "router-replay record", "version": __version__, "complete": complete,
            "started_ns": self.started_ns, "updated_ns": now,
            "flush_interval_s": self.flush_s, "rotate_s": self.loads.rotate_s,
            "workers": {u: {"dp_size": e.dp_size, "page_size": e.page_size, "model": e.model,
                            "discovered_from": e.source, "load_port_base": e.load_port_base,
                            "load_topic": e.load_topic if e.load_port_base is not None else None,
                            "kv_port_base": e.kv_port_base, "kv_topic": e.kv_topic,
                            "replay_port_base": e.replay_port_base, "notes": e.notes}
                        for u, e in sorted(self.engines.items())},
            # the hash namespace ("format" of --kv-events-config) is not advertised: only --kv-format says
            "kv_format": self.ov.kv_format or "unknown (not advertised by /server_info; give --kv-format)",
            **({"router": self.router_flags} if self.router_flags else {}),
            "unreachable": dict(sorted(self.unreachable.items())),
            "streams": [{"stream": s.name, "worker": s.engine.url, "dp_rank": s.rank, "kind": s.kind,
                         "endpoint": s.endpoint, "messages": s.messages, "malformed": s.malformed,
                         "restarts": s.restarts, "gaps": s.gaps, "lost_messages": s.lost,
                         "replayed_messages": s.replayed, "unverified_gaps": s.unverified,
                         "last_seq": s.last_seq}
                        for s in self.streams],
            "silent_streams": [s.name for s in self.streams if s.messages == 0],
            "malformed_frames": sum(s.malformed for s in self.streams),
            "malformed_examples": self.examples,
            "gaps": sum(s.gaps for s in self.streams), "restarts": sum(s.restarts for s in self.streams),
            # KV gaps whose replay could not show that the same publisher sent them (its buffer had
            # dropped the last batch seen): a restart in between would read as a gap
            "unverified_gaps": sum(s.unverified for s in self.streams),
            # rows received so far (at a clean stop: every one of them is in a part on disk)
            "rows": {"loads": self.loads.rows_taken + len(self.loads),
                     "kv_events": self.kv.rows_taken + len(self.kv),
                     "gaps": self.gaps.rows_taken + len(self.gaps)},
        }

    def _flush(self, complete: bool = False) -> None:
        for w in (self.loads, self.kv, self.gaps):
            t = w.take()
            if t is not None:
                self._writes.put((w, t))
        self._writes.put(("facts", self.facts(complete)))

    def _writer(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            what, payload = item
            try:
                if what == "workers":
                    write_atomic_table(self.out / WORKERS, payload)
                elif what == "facts":
                    write_atomic_json(self.out / names.RECORD_JSON, payload)
                else:
                    what.write(payload)
            except BaseException as err:  # noqa: BLE001 - disk full and the like: stop recording, say so
                self._writer_error.append(err)
                self.stop.set()
                return

    # ------------------------------------------------------------------ run
    def run(self, duration_s: float | None = None) -> dict:
        import zmq  # optional: an extra dependency

        self._discover_all(self.urls)
        refused = [r for _u, r in list(self._discovered.queue) if isinstance(r, RecordError)]
        if refused:             # an engine this recorder cannot follow: refused before anything is written
            raise refused[0]
        self.out.mkdir(parents=True, exist_ok=True)
        ctx = zmq.Context()
        poller = zmq.Poller()
        self._ctx, self._poller = ctx, poller
        self._sockets: dict = {}
        writer = threading.Thread(target=self._writer, name="record-writer", daemon=True)
        writer.start()
        self._writes.put(("facts", self.facts(False)))
        self._take_discovered(ctx, poller)
        retry = threading.Thread(target=self._retry_loop, daemon=True)
        retry.start()
        t_end = None if duration_s is None else time.monotonic() + duration_s
        next_flush = time.monotonic() + self.flush_s
        next_status = time.monotonic() + 1.0
        rows_at_status = 0
        try:
            while not self.stop.is_set():
                now_m = time.monotonic()
                if t_end is not None and now_m >= t_end:
                    break
                for sock, _ev in poller.poll(50):
                    s = self._sockets[sock]
                    for _ in range(10_000):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        now = self.now_ns()
                        if sock is s.replay:
                            self._on_replay(s, frames, now)
                            if sock is not s.replay:    # reopened (a restart the probe found): done with it
                                break
                        else:
                            self._on_message(s, frames, now)
                now_m = time.monotonic()
                for s in self.streams:
                    if s.pending and s.pending[0][5] is not None and now_m > s.pending[0][5]:
                        self._open_replay(s)
                        self._finish_replay(s, self.now_ns(), "the replay socket did not answer in time")
                self._take_discovered(ctx, poller)
                if now_m >= next_flush:
                    self._flush()
                    next_flush = now_m + self.flush_s
                if now_m >= next_status:
                    if self.status is not None:
                        rate = (self.rows_total - rows_at_status) / max(now_m - next_status + 1.0, 1e-9)
                        self.status.show(self._status_text(rate))
                    rows_at_status = self.rows_total
                    next_status = now_m + 1.0
        finally:
            now = self.now_ns()
            for s in self.streams:
                while s.pending:
                    self._finish_replay(s, now, "recording stopped before the replay socket answered",
                                        ask_next=False)
            # an empty recording (nothing received) is never complete
            self._flush(complete=not self._writer_error and bool(self.engines) and self.rows_total > 0)
            self._writes.put(None)
            writer.join()
            self.stop.set()
            if self.status is not None:
                self.status.clear()
            ctx.destroy(linger=0)
        if not self.engines:
            raise RecordError("no worker answered /server_info: " + "; ".join(
                f"{u}: {r}" for u, r in sorted(self.unreachable.items())))
        if self._writer_error:
            err = self._writer_error[0]
            why = (f"OSError: [Errno {err.errno}] {os.strerror(err.errno)}" if isinstance(err, OSError) and err.errno
                   else f"{type(err).__name__}: {str(err).splitlines()[0]}")
            raise RecordError(f"{self.out}: cannot write ({why}); "
                              f"the files already renamed into place are complete, record.json says "
                              f"complete: false")
        return self.facts(self.rows_total > 0)

    def _status_text(self, rate: float) -> str:
        live = sum(1 for s in self.streams if s.messages)
        return (f"recording {len(self.engines)}/{len(self.urls)} workers, {live}/{len(self.streams)} streams "
                f"live, {rate:,.0f} rows/s, {sum(s.gaps for s in self.streams)} gaps, "
                f"{sum(s.restarts for s in self.streams)} restarts, "
                f"{sum(s.malformed for s in self.streams)} malformed")


class StatusLine:
    """A one-line live status on a terminal (carriage return), nothing when piped."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.width = 0

    def show(self, text: str) -> None:
        self.stream.write("\r" + text.ljust(self.width))
        self.stream.flush()
        self.width = len(text)

    def clear(self) -> None:
        if self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


def install_signal_handlers(rec: Recorder) -> None:
    """SIGINT and SIGTERM end the run cleanly (last flush, files closed)."""
    def handler(signum, _frame):
        rec.stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
