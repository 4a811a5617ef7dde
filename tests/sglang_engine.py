"""The released engine's own publishers (``sglang==0.5.23``), loaded without torch.

Installed by the ``sglang-engine`` extra (the package without its dependencies,
plus what its capture modules import: msgspec, pydantic, psutil, pyzmq; pybind11
to build its block-hash binding).  Not part of ``test``: without it the tests
that use this module skip, saying why.

How the modules load without torch (docs/capture.md, "Testing against the
released engine"):

* ``sglang/__init__.py`` and ``sglang/srt/utils/__init__.py`` import torch; two
  bare package objects carrying the real ``__path__`` stand in their place, so
  the real submodules are found and run;
* the modules that import torch only to be importable get a stand-in holding
  the few names the capture modules take from them (``managers.io_struct``:
  ``hook_custom_types``, ``sock_send``; the Triton MLA kernels ``mem_cache/utils``
  re-exports; the torch extension loader, replaced by a g++ build of the
  package's own ``hash_binding.cpp``; ``arg_groups.overrides``: the identity
  view and block size = page_size x dcp_size, for ``/server_info``);
* the loader refuses to go on if torch was imported anyway.

:class:`RealEngine` is one engine: ``ranks`` publishers (the real
``SchedulerKvEventsPublisher`` with its ``ZmqEventPublisher`` and replay
buffer, the real ``SchedulerLoadPublisher``), a real ``KVCacheEventRecorder``
per rank, and ``/server_info`` whose ``kv_events`` block is the real
``describe_kv_events_publisher``'s.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from types import SimpleNamespace

from capture_fleet import free_block, free_ports, serve_server_info

SGLANG_VERSION = "0.5.23"
BUILD_DIR = os.path.join(tempfile.gettempdir(), f"router-replay-sglang-{SGLANG_VERSION}-hash")
_MLA_NAMES = ("get_mla_kv_buffer_kernel", "get_mla_kv_buffer_triton", "set_mla_kv_buffer_dcp_sharded_triton",
              "set_mla_kv_buffer_fp8_quant_kernel", "set_mla_kv_buffer_kernel", "set_mla_kv_buffer_triton",
              "set_mla_kv_buffer_triton_fp8_quant", "set_mla_kv_scale_buffer_kernel",
              "set_mla_kv_scale_buffer_triton")


class Unavailable(Exception):
    """Why the released engine cannot be loaded here (the tests skip with this text)."""


_state: dict = {}


def missing() -> str | None:
    """None when the released engine's capture modules can be loaded, else why not."""
    try:
        load()
    except Unavailable as err:
        return str(err)
    return None


def _package_dir() -> str:
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("sglang is not installed (install the sglang-engine extra: uv sync --all-extras)")
    from importlib.metadata import version

    if version("sglang") != SGLANG_VERSION:
        raise Unavailable(f"sglang {version('sglang')} is installed, these tests read {SGLANG_VERSION}")
    return list(spec.submodule_search_locations)[0]


def _bare(name: str, path: str | None = None) -> None:
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [path]
    sys.modules[name] = mod


def _stand_in(name: str, **names) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(names)
    mod.__stand_in__ = True
    sys.modules[name] = mod


def _build_hash(name, sources, extra_cflags=(), extra_ldflags=(), **_ignored):
    """The engine's ``load_extension_with_recovery``, without torch: the same source and flags,
    compiled by g++ once into BUILD_DIR (the tests that need it skip when g++, pybind11 or
    OpenSSL's headers are missing)."""
    if not glob.glob(os.path.join(BUILD_DIR, name + "*.so")):
        if shutil.which("g++") is None:
            raise Unavailable("g++ is not installed: the engine's hash binding cannot be built")
        try:
            pybind11 = importlib.import_module("pybind11")
        except ImportError:
            raise Unavailable("pybind11 is not installed: the engine's hash binding cannot be built") from None
        os.makedirs(BUILD_DIR, exist_ok=True)
        out = os.path.join(BUILD_DIR, name + sysconfig.get_config_var("EXT_SUFFIX"))
        cflags = [f for f in extra_cflags if f != "-mavx2" or _has_avx2()]
        cmd = ["g++", "-shared", "-fPIC", *cflags, f"-I{pybind11.get_include()}",
               f"-I{sysconfig.get_paths()['include']}", f"-DTORCH_EXTENSION_NAME={name}", *sources,
               "-o", out + ".tmp", *extra_ldflags]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            why = "OpenSSL headers missing (apt install libssl-dev)" if "openssl" in run.stderr else \
                run.stderr.strip().splitlines()[-1:] or ["g++ failed"]
            raise Unavailable(f"the engine's hash binding did not build: {why}")
        os.replace(out + ".tmp", out)
    if BUILD_DIR not in sys.path:
        sys.path.insert(0, BUILD_DIR)
    return importlib.import_module(name)


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as fh:
            return " avx2" in fh.read()
    except OSError:
        return False


def load() -> SimpleNamespace:
    """The released engine's capture modules (cached); raises :class:`Unavailable`."""
    if "mods" in _state:
        return _state["mods"]
    if "why" in _state:
        raise Unavailable(_state["why"])
    try:
        _state["mods"] = _load()
    except Unavailable as err:
        _state["why"] = str(err)
        raise
    return _state["mods"]


def _load() -> SimpleNamespace:
    if "torch" in sys.modules:
        raise Unavailable("torch is already imported in this process: refusing to load the engine beside it")
    pkg = _package_dir()
    try:
        msgspec = importlib.import_module("msgspec")
        for dep in ("pydantic", "psutil", "zmq"):
            importlib.import_module(dep)
    except ImportError as err:
        raise Unavailable(f"{err.name} is not installed (the sglang-engine extra brings it)") from None
    _bare("sglang", pkg)
    _bare("sglang.srt.utils", os.path.join(pkg, "srt", "utils"))
    enc = msgspec.msgpack.Encoder()
    _stand_in("sglang.srt.managers.io_struct", hook_custom_types=lambda *a: None,
              sock_send=lambda sock, obj, flags=0: sock.send(enc.encode(obj), flags=flags))
    for parent in ("sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.kvcache"):
        sys.modules.setdefault(parent, types.ModuleType(parent))
    _stand_in("sglang.kernels.ops.kvcache.mla_buffer", **dict.fromkeys(_MLA_NAMES))
    _stand_in("sglang.srt.utils.cpp_extension_loader", load_extension_with_recovery=_build_hash)
    _stand_in("sglang.srt.arg_groups.overrides", resolving_view=lambda args: args,
              kv_event_block_size_of=lambda args: args.page_size * args.dcp_size)
    m = SimpleNamespace()
    m.kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
    m.load_snapshot = importlib.import_module("sglang.srt.managers.load_snapshot")
    m.load_publisher = importlib.import_module("sglang.srt.managers.scheduler_components.load_publisher")
    m.kv_publisher = importlib.import_module("sglang.srt.managers.scheduler_components.kv_events_publisher")
    m.events = importlib.import_module("sglang.srt.mem_cache.events")
    m.runtime = importlib.import_module("sglang.srt.runtime_context")
    if "torch" in sys.modules:
        raise RuntimeError("loading the engine's capture modules imported torch: the stand-ins are out of date")
    # the load socket may only name a wildcard host (resolve_load_pub_range); the tests bind
    # loopback through the module's own socket-opening seam
    real_open = m.load_publisher._open_pub_socket
    m.load_publisher._open_pub_socket = lambda ep: real_open(ep.replace("tcp://*:", "tcp://127.0.0.1:"))
    return m


def engine_hashes(token_ids: list[int], page_size: int, cache_salt: str | None = None) -> list[int]:
    """The engine's published hashes of a prompt's full pages (its native binding, through
    ``mem_cache.utils``); raises :class:`Unavailable` when the binding cannot be built."""
    load()
    utils = importlib.import_module("sglang.srt.mem_cache.utils")
    rec = _state["mods"].events.KVCacheEventRecorder(enabled=True, page_size=page_size)
    root = Node(None, Key([]))
    node = Node(root, Key(token_ids, cache_salt=cache_salt))
    rec.record_store(node)
    out: list[int] = []
    for ev in rec.take():
        out.extend(ev.block_hashes)
    assert utils is not None
    return out


class _DropNextSend:
    """The PUB socket, except that the next message sent is lost on the way (the engine's
    own code still numbers it and keeps it in its replay buffer)."""

    def __init__(self, sock):
        self._sock = sock
        self._armed = True

    def send_multipart(self, frames, *a, **kw):
        if self._armed:
            self._armed = False
            return None
        return self._sock.send_multipart(frames, *a, **kw)

    def __getattr__(self, name):
        return getattr(self._sock, name)


class Key:
    """The duck type of the engine's RadixKey as the recorder reads it."""

    def __init__(self, token_ids, cache_salt=None, extra_key=None):
        self.token_ids = list(token_ids)
        self.cache_salt = cache_salt
        self.extra_key = extra_key
        self.is_bigram = False

    def __len__(self):
        return len(self.token_ids)


class Node:
    """The duck type of the engine's radix tree node as the recorder reads it."""

    def __init__(self, parent, key):
        self.parent = parent
        self.key = key
        self.hash_value = [] if parent is None else None
        self.event_hash_value = None


def _stamp(m, *, attn_dp_size: int, rank: int, ranks: int) -> None:
    """The scheduler's parallel ranks, written where ``override_permanently`` writes them
    (its validation imports server_args, which imports torch)."""
    attn = attn_dp_size > 1
    m.runtime.get_parallel()._stamp.update(
        pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, attn_dp_size=attn_dp_size,
        attn_dp_rank=rank if attn else 0, dp_rank=0 if attn else rank, num_dp_ranks=ranks)


class RealEngine:
    """One engine of ``dp_size`` x ``attn_dp_size`` publishing ranks, block size page x dcp."""

    def __init__(self, *, dp_size=1, attn_dp_size=1, page_size=4, dcp_size=1, topic="", model="real-model",
                 max_total_num_tokens=4096, max_running_requests=64, load_auto=False, buffer_steps=None):
        self.m = m = load()
        self.ranks = dp_size * attn_dp_size
        self.block = page_size * dcp_size
        self.model = model
        self.cap = max_total_num_tokens
        self.max_running = max_running_requests
        self.kv_base = free_block(self.ranks)
        self.replay_base = free_block(self.ranks)
        self.load_base = free_block(self.ranks)
        cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.kv_base}", "bind": True,
               "replay_endpoint": f"tcp://127.0.0.1:{self.replay_base}", "topic": topic}
        if buffer_steps is not None:
            cfg["buffer_steps"] = buffer_steps
        self.cfg = json.dumps(cfg)
        # what /server_info describes: the same ports under the wildcard host production binds
        wild = {**cfg, "endpoint": f"tcp://*:{self.kv_base}", "replay_endpoint": f"tcp://*:{self.replay_base}"}
        wild.pop("bind")
        wild.pop("buffer_steps", None)
        self.server_args = SimpleNamespace(
            kv_events_config=json.dumps(wild), page_size=page_size, dcp_size=dcp_size, dp_size=dp_size,
            attn_dp_size=attn_dp_size, load_publish_endpoint="auto" if load_auto else f"tcp://*:{self.load_base}")
        self.kv_events = m.runtime.describe_kv_events_publisher(self.server_args)
        self.recorders = []
        self.published: list[list] = [[] for _ in range(self.ranks)]   # per rank: each flush's events
        self.kv_pubs = []
        self.load_pubs = []
        for r in range(self.ranks):
            self._open_rank(r, attn_dp_size)
        self.attn_dp_size = attn_dp_size
        self.dp_size = dp_size
        self.page_size = page_size
        self.dcp_size = dcp_size
        self.nodes: dict = {}
        self.http_port, = free_ports(1)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self._serve_http()

    def _open_rank(self, r: int, attn_dp_size: int) -> None:
        m = self.m
        _stamp(m, attn_dp_size=attn_dp_size, rank=r, ranks=self.ranks)
        rec = m.events.KVCacheEventRecorder(enabled=True, page_size=self.block)

        def take_events(rec=rec, r=r):
            events = rec.take()
            self.published[r].append(list(events))
            return events

        tree = SimpleNamespace(take_events=take_events)
        kv = m.kv_publisher.SchedulerKvEventsPublisher(
            kv_events_config=self.cfg, tree_cache=tree, send_metrics_from_scheduler=None,
            max_running_requests=self.max_running, max_total_num_tokens=self.cap, get_stats=lambda: None)
        ld = m.load_publisher.SchedulerLoadPublisher(kv_events_config=self.cfg,
                                                     load_publish_endpoint=self.server_args.load_publish_endpoint
                                                     .replace("auto", f"tcp://*:{self.load_base}"),
                                                     publish_interval=1)
        if r < len(self.recorders):
            self.recorders[r], self.kv_pubs[r], self.load_pubs[r] = rec, kv, ld
        else:
            self.recorders.append(rec)
            self.kv_pubs.append(kv)
            self.load_pubs.append(ld)

    def server_info(self) -> dict:
        a = self.server_args
        return {"model_path": self.model, "served_model_name": self.model, "dp_size": a.dp_size,
                "attn_dp_size": a.attn_dp_size, "page_size": a.page_size, "dcp_size": a.dcp_size,
                "kv_events": self.kv_events}

    def _serve_http(self) -> None:
        self._http = serve_server_info(self.http_port, self.server_info)

    # ---------------------------------------------------------------- publishing
    def store(self, rank: int, tokens: list[int], *, cache_salt=None, session_id=None, publish=True):
        """The tree inserts a prompt's full pages (a chain sharing already-inserted prefix
        nodes, as the radix tree does) and the scheduler flushes: one EventBatch."""
        rec = self.recorders[rank]
        root = self.nodes.setdefault((rank, "root"), Node(None, Key([])))
        parent, k = root, 0
        full = len(tokens) // self.block * self.block
        while k < full:
            key = (rank, cache_salt, tuple(tokens[:k + self.block]))
            node = self.nodes.get(key)
            if node is None:
                node = Node(parent, Key(tokens[k:k + self.block], cache_salt=cache_salt))
                self.nodes[key] = node
                rec.record_store(node, session_id=session_id)
            parent, k = node, k + self.block
        if publish:
            self.flush(rank)

    def remove(self, rank: int, tokens: list[int], *, cache_salt=None, publish=True):
        """Evict the deepest page of a stored prompt (one BlockRemoved)."""
        full = len(tokens) // self.block * self.block
        key = (rank, cache_salt, tuple(tokens[:full]))
        node = self.nodes.pop(key)
        self.recorders[rank].record_remove(node)
        if publish:
            self.flush(rank)

    def clear(self, rank: int) -> None:
        self.recorders[rank].record_all_cleared()
        for k in [k for k in self.nodes if k[0] == rank and k[1] != "root"]:
            self.nodes.pop(k)
        self.flush(rank)

    def flush(self, rank: int) -> None:
        self.kv_pubs[rank].publish_kv_events()

    def lose_next_batch(self, rank: int) -> None:
        """The next batch goes into the replay buffer but not onto the wire (as when a PUB
        queue overflows or a subscriber reconnects): its sequence number is consumed."""
        pub = self.kv_pubs[rank].kv_event_publisher
        pub._pub = _DropNextSend(pub._pub)

    def load(self, rank: int, running: int, waiting: int, used: int, *, waiting_uncached=0, total=None,
             prefill_uncached=0, busy_us=0, force=True) -> None:
        m = self.m

        def snap():
            return m.load_snapshot.LoadSnapshot(
                timestamp=time.time(), dp_rank=rank, num_running_reqs=running, num_waiting_reqs=waiting,
                num_waiting_uncached_tokens=waiting_uncached, num_used_tokens=used,
                num_total_tokens=used if total is None else total, max_total_num_tokens=self.cap,
                max_running_requests=self.max_running, total_prefill_uncached_tokens=prefill_uncached,
                total_prefill_busy_us=busy_us)

        self.load_pubs[rank].publish_load_stat(snap, force=force)

    def restart(self, rank: int, lose: int = 0) -> None:
        """The rank's scheduler restarts: its publishers shut down, new ones bind the same ports
        (sequences from 0, an empty replay buffer), and the new tree's reset() queues an
        AllBlocksCleared that the first flush publishes.  The new KV publisher's first ``lose``
        batches never reach a subscriber (one that reconnects late), though its replay buffer
        keeps them."""
        self.kv_pubs[rank].kv_event_publisher.shutdown()
        self.load_pubs[rank].close()
        time.sleep(0.2)
        self._open_rank(rank, self.attn_dp_size)
        for _ in range(lose):
            self.lose_next_batch(rank)
        for k in [k for k in self.nodes if k[0] == rank]:
            self.nodes.pop(k)
        self.recorders[rank].record_all_cleared()
        self.flush(rank)

    def close(self) -> None:
        for p in self.kv_pubs:
            try:
                p.kv_event_publisher.shutdown()
            except Exception:  # noqa: BLE001 - already shut
                pass
        for p in self.load_pubs:
            p.close()
        self._http.shutdown()
        self._http.server_close()
