"""A first start's compile on both cores.

numba compiles one function at a time in a process (its compiler lock), so a
cold start used one core for half a minute.  With an empty cache, the engine's
:func:`both_cores` starts a second Python process that compiles part of the
kernel tree into the same on-disk cache (``cache=True``, the folder
``_jit.cache_dir()`` names) while this process compiles the rest; when this
process's kernel then calls a function the other one compiled, numba finds it
in the cache and loads it instead of compiling it again (``dispatcher.stats``
counts a cache hit).  The grid kernel ``run_chunk_nb`` calls
``_decide_request`` through its address (``_jit.call_at``, the ``link``
argument :func:`link` makes), not linked into its own module, so the two
compile independently: neither process waits for the other's kernel while
it compiles its own.  The split (measured per function with numba's
``numba:compile`` events, nested compiles subtracted, on the sample sweep):

* the other process: ``one_pass._decide_request`` and its helpers, except
  ``cache_rung_with_nb``;
* this process, first: ``decide.cache_rung_with_nb`` (about 4 s; the other
  process waits for it when its ``_decide_request`` reaches the call) and
  ``accumulate_request_nb``; then the grid kernel (with ``refresh_until_nb``)
  and ``split_states_nb``, then ``_decide_request`` from the cache
  (:func:`wait_for` waits for the other process's part first), whose address
  :func:`link` hands the grid kernel.

  (Measured on the merged fourth round, sample sweep, load about 1.5: with
  ``split_states_nb`` in the other process instead of ``refresh_nb``, this one
  waited 2.7-3.9 s for it, 15.3-15.9 s wall to the first decision; with neither,
  this one did 15.2 CPU s against the other's 12; that split: 12.3 / 13.3 s.
  Seventh round: the sampler's helpers are inlined (``_jit.njit(inline=True)``),
  which made the other process the longer one by 0.6-0.9 CPU s, so
  ``refresh_until_nb`` moved to this one: 7.6-7.7 s wall to the first decision
  against 8.2 with it in the other process, on a fast VM phase.)

The helpers' argument types are built here (:func:`inner_signatures`) the
way ``run_chunk_nb`` passes them, its per-block scratch from
``one_pass.SCRATCH_TYPES``; ``tests/test_compile_child.py`` holds them to what
a sweep compiles.  If they drift (a kernel body passes other types), nothing
breaks: the other process compiles a specialization nobody uses and this one
compiles the right one itself (the first start is then one core's again):
:func:`link` takes ``_decide_request``'s argument types from the grid kernel's
own typing (or, on a warm start, from the file the compiling process wrote
beside the cache), and the grid kernel checks the signature's fingerprint at
each call.

Only on a cold cache (the grid kernel's cache index missing or stale), never
under ``NUMBA_DISABLE_JIT``, never when ``ROUTER_REPLAY_COMPILE_CHILD=0``.
The other process reads its orders from its stdin, a pipe this process holds:
when this process ends (or is killed), the pipe closes and the other process
exits at once.  Whatever happens to it (it fails, is killed, says nothing),
this process goes on and compiles what is missing itself.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numba
import numpy as np
from numba.core import types

from replay.kernels import _jit, accumulate, decide, one_pass

ENV_SWITCH = "ROUTER_REPLAY_COMPILE_CHILD"
# what the last both_cores() did, for tests and benches: "child" (a child compiled
# its part), "child-failed", "warm" (cache filled: no child), "off" (switched off,
# or no jit), "in-process" (a child could not be started)
LAST: dict = {}
_ONCE = threading.Lock()
_STARTED = False
# ``{id(dispatcher): wait}``: called once before this process compiles or loads
# that kernel itself (:func:`wait_for`; the other process compiles it into the cache)
_WAITS: dict = {}
_LINKS: dict = {}
_LINK_LOCK = threading.Lock()


def _arr(dtype, ndim: int, readonly: bool = False):
    return types.Array(dtype, ndim, "C", readonly=readonly)


def inner_signatures(run_sig: tuple) -> dict:
    """``{name: (dispatcher, argument types)}`` of the helpers split between the
    two processes, built from the grid kernel's own signature ``run_sig``
    (``engine.kernel_signatures()[run_chunk_nb]``) the way ``run_chunk_nb``
    and ``_decide_request`` call them."""

    i8, f8, b1 = types.int64, types.float64, types.boolean
    knobs_t, plan_t, totals_t = run_sig[7], run_sig[8], run_sig[13]
    ro_i8 = _arr(i8, 1, True)
    scratch_t = numba.typeof(one_pass.Scratch(*(np.zeros((1,) * ndim, dtype=dtype)
                                                 for dtype, ndim in (one_pass.SCRATCH_TYPES[f]
                                                                     for f in one_pass.Scratch._fields))))
    decide_sig = (i8, i8, i8, i8, ro_i8, ro_i8, _arr(b1, 1, True), ro_i8, _arr(b1, 1, True), _arr(i8, 2), _arr(f8, 1),
                  types.CPointer(knobs_t), plan_t, i8, types.CPointer(scratch_t))
    rung_sig = (i8, _arr(i8, 2), i8, _arr(i8, 2), _arr(f8, 1), i8, i8, i8, b1, i8, f8, f8,
                _arr(i8, 1), _arr(i8, 2), b1, b1, i8, b1)
    acc_sig = (totals_t, i8, _arr(i8, 2), _arr(f8, 2), _arr(i8, 1), ro_i8, i8, i8, _arr(i8, 2))
    return {"_decide_request": (one_pass._decide_request, decide_sig),
            "cache_rung_with_nb": (decide.cache_rung_with_nb, rung_sig),
            "accumulate_request_nb": (accumulate.accumulate_request_nb, acc_sig)}


# the split: the child compiles these, in this order ...
CHILD = ("_decide_request",)
# ... this process compiles these first (the child waits for the ones it calls)
PARENT_FIRST = ("cache_rung_with_nb", "accumulate_request_nb")


def cache_is_cold(dispatcher) -> bool:
    """True when ``dispatcher``'s on-disk cache index is missing or stale (numba
    would compile it); False when it holds something, or cannot be read."""
    try:
        return not dispatcher._cache._cache_file._load_index()
    except Exception:  # noqa: BLE001 - numba internals: when in doubt, behave as before (no child)
        return False


def _name(dispatcher) -> tuple[str, str]:
    return dispatcher.py_func.__module__, dispatcher.py_func.__name__


class _Child:
    """The other process and its two pipes (its stdin: orders and "done" notes
    from here; its stdout: "done NAME" or "fail NAME ..." lines)."""

    def __init__(self, compile_jobs: list, wait_for: list):
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from replay.kernels.warm import child_main; child_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            close_fds=True)
        self.done: dict[str, threading.Event] = {n: threading.Event() for n, _, _ in compile_jobs}
        self.failed: set[str] = set()
        self.ended = threading.Event()
        self._lock = threading.Lock()
        self.send({"cache_dir": numba.config.CACHE_DIR, "compile": compile_jobs, "wait_for": wait_for})
        threading.Thread(target=self._read, name="compile-child-reader", daemon=True).start()

    def send(self, obj) -> None:
        with self._lock:
            try:
                pickle.dump(obj, self.proc.stdin)
                self.proc.stdin.flush()
            except (OSError, ValueError):   # the child is gone: nothing to tell it
                pass

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                word, _, rest = line.decode(errors="replace").strip().partition(" ")
                name, _, detail = rest.partition(" ")
                if word == "done":
                    LAST[f"child_{name}_cpu_s"] = detail
                if word == "fail":
                    self.failed.add(name)
                if name in self.done:
                    self.done[name].set()
        finally:
            self.ended.set()
            for ev in self.done.values():
                ev.set()

    def wait(self, name: str) -> None:
        t0 = time.perf_counter()
        LAST.setdefault("cpu_s_at_wait", round(time.process_time(), 2))
        self.done[name].wait()
        LAST["waited_s"] = round(LAST.get("waited_s", 0.0) + time.perf_counter() - t0, 3)

    def close(self) -> None:
        """Close its stdin (it exits at once, done or not) and reap it."""
        with self._lock:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        LAST["child_returncode"] = self.proc.returncode


@contextlib.contextmanager
def both_cores(kernel_sigs: dict) -> Iterator[list]:
    """Around the engine's compile of ``kernel_sigs`` (``{dispatcher: types}``):
    on a cold cache, start the other process and yield what this process
    compiles first (``[(dispatcher, types)]``); else yield ``[]`` and do nothing."""
    global _STARTED

    run_sig = kernel_sigs.get(one_pass.run_chunk_nb)
    with _ONCE:
        first = not _STARTED
        _STARTED = True
    if not first:            # a later compile in this process: the first one decided
        yield []
        return
    if numba.config.DISABLE_JIT or os.environ.get(ENV_SWITCH, "1") == "0" or run_sig is None:
        LAST.update(mode="off")
        yield []
        return
    if not cache_is_cold(one_pass.run_chunk_nb):
        LAST.update(mode="warm")
        yield []
        return
    try:
        inner = inner_signatures(run_sig)
    except Exception:  # noqa: BLE001 - a layout the table does not know: compile in-process
        LAST.update(mode="in-process")
        yield []
        return
    jobs = [(n, _name(inner[n][0]), inner[n][1]) for n in CHILD]
    try:
        child = _Child(jobs, [_name(inner[n][0]) for n in PARENT_FIRST])
    except OSError:
        LAST.update(mode="in-process")
        yield []
        return
    LAST.update(mode="child", child_pid=child.proc.pid)
    # this process waits for the child's part before it compiles (or types a call to) any of it
    waits = {id(inner[n][0]): n for n in CHILD}
    for key, n in waits.items():
        _jit.BEFORE_TYPING[key] = _WAITS[key] = (lambda n=n: child.wait(n))

    def parent_done(dispatcher) -> None:
        child.send(("done", _name(dispatcher)))

    try:
        yield [(inner[n][0], inner[n][1], parent_done) for n in PARENT_FIRST]
    finally:
        for key in waits:
            _jit.BEFORE_TYPING.pop(key, None)
            _WAITS.pop(key, None)
        child.close()
        if child.failed or child.proc.returncode not in (0, None):
            LAST.update(mode="child-failed")


def wait_for(dispatcher) -> None:
    """On a first start with the other process: wait until it has compiled
    ``dispatcher`` into the cache, if that is its part (else return at once)."""
    wait = _WAITS.pop(id(dispatcher), None)
    if wait is not None:
        wait()


def _signature_file(run_sig: tuple) -> Path:
    """Where the process that typed the grid kernel for ``run_sig`` keeps the
    argument types it calls ``_decide_request`` with: beside the cache, whose
    folder is named after the kernels' sources."""
    key = _jit.fingerprint(tuple(run_sig))
    return Path(numba.config.CACHE_DIR) / f"call_at-_decide_request-{key:08x}.pkl"


def _decide_signature(run_sig: tuple) -> tuple:
    """``_decide_request``'s argument types as the grid kernel calls it: as its
    call was typed in this process (the grid kernel compiled here), else as
    the process that compiled it wrote them beside the cache, else built
    (:func:`inner_signatures`)."""
    typed = _jit.CALL_AT_TYPED.get("_decide_request")
    path = _signature_file(run_sig)
    if typed is not None:
        args = tuple(typed.args)
        with contextlib.suppress(OSError):
            tmp = path.with_name(f"{path.name}.{os.getpid()}")
            tmp.write_bytes(pickle.dumps(args))
            os.replace(tmp, path)
        return args
    with contextlib.suppress(Exception):  # missing, or unreadable: build them
        args = pickle.loads(path.read_bytes())
        if isinstance(args, tuple) and all(isinstance(a, types.Type) for a in args):
            return args
    return tuple(inner_signatures(run_sig)["_decide_request"][1])


def link(run_sig: tuple) -> np.ndarray:
    """The grid kernel's ``link`` argument (``_jit.call_at``): the address of
    ``_decide_request`` compiled (or loaded from the cache) for the argument
    types the grid kernel ``run_chunk_nb`` (signature ``run_sig``) passes,
    and the fingerprint of that signature.  On a first start with the other
    process, waits for it to have compiled ``_decide_request`` into the cache."""

    dispatcher = one_pass._decide_request
    if numba.config.DISABLE_JIT:
        return np.zeros(2, dtype=np.int64)
    with _LINK_LOCK:
        if run_sig in _LINKS:
            return _LINKS[run_sig]
        one_pass.run_chunk_nb.compile(run_sig)
        args = _decide_signature(run_sig)
        wait_for(dispatcher)
        _LINKS[run_sig] = _jit.link_to(dispatcher, args)
        return _LINKS[run_sig]


def child_main() -> None:
    """The other process: read orders from stdin, compile, say "done NAME" on stdout.

    stdin's end (the first start's process ended or closed it) ends this
    process at once, wherever it is in a compile."""
    stdin = sys.stdin.buffer
    orders = pickle.load(stdin)
    numba.config.CACHE_DIR = orders["cache_dir"]
    waits: dict[tuple, threading.Event] = {tuple(k): threading.Event() for k in orders["wait_for"]}

    def listen() -> None:
        try:
            while True:
                msg = pickle.load(stdin)
                if isinstance(msg, tuple) and msg[0] == "done" and tuple(msg[1]) in waits:
                    waits[tuple(msg[1])].set()
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        os._exit(0)

    threading.Thread(target=listen, name="orders", daemon=True).start()
    for (module, name), ev in waits.items():
        dispatcher = getattr(importlib.import_module(module), name)
        _jit.BEFORE_TYPING[id(dispatcher)] = ev.wait
    for short, (module, name), sig in orders["compile"]:
        try:
            getattr(importlib.import_module(module), name).compile(sig)
        except Exception as exc:  # noqa: BLE001 - any failure: the parent compiles it itself
            print(f"fail {short} {type(exc).__name__}", flush=True)
        else:
            print(f"done {short} {time.process_time():.2f}", flush=True)
    sys.stdout.flush()
    os._exit(0)
