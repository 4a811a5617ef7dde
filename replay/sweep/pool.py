"""The one executor interface: independent tasks in, their results out as they finish.

A :class:`Pool` runs calls of one function in local threads (:class:`ThreadPool`; the
kernels release the GIL) or as Ray tasks (:class:`RayPool`: a local Ray, or a cluster
joined at an address), and yields ``(index, result)`` in the order the calls finish, so a
caller streams each result to its files at once and no call waits for another.  The
sweep's Ray shards, a simulate grid and a capacity plan all run through it; :func:`pool`
builds one by name (``--executor``).

Failures: a local call's exception is raised as it is (after the calls not yet started are
cancelled); a Ray call is retried ``retries`` times (Ray's own retry, also when its worker
process dies) and then raised as :class:`TaskFailed`, naming the call.

``ROUTER_REPLAY_FAULT_TASKS`` injects failures for tests and drills, by call index:
``"3"`` raises in call 3's first attempt, ``"3:exit"`` ends the worker process running
it (first attempt), ``"3:always"`` raises in every attempt.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from replay.errors import ParamError, ParamsError, ReplayError

FAULT_ENV = "ROUTER_REPLAY_FAULT_TASKS"

Call = tuple[tuple, dict]
"""One call of a pool's function: ``(args, kwargs)``."""


class TaskFailed(ReplayError):
    """A task that still failed after its retries; what finished before it is kept
    (a journaled grid or plan resumes from there)."""


class InjectedFault(RuntimeError):
    """A failure asked for through ``ROUTER_REPLAY_FAULT_TASKS``."""


def require_ray():
    """Ray's module, or a one-line error saying how to install it."""
    try:
        import ray  # optional: an extra dependency
    except ImportError:
        raise ParamError("executor", "ray needs Ray: pip install 'router-replay[ray]'") from None
    return ray


RAY_PROBE_S = 5.0
"""How long the Ray address is given to accept a connection before the run gives up (Ray's own
client waits for its GCS without end)."""


def probe_ray_address(address: str, timeout: float = RAY_PROBE_S) -> None:
    """Fail in bounded time, in one line, when nothing listens at a Ray ``address``
    (``HOST:PORT`` of the cluster's GCS, or ``ray://HOST:PORT`` of its client server);
    ``auto``, ``local`` and other forms are left to Ray."""
    text = address.strip()
    body = text[len("ray://"):] if text.startswith("ray://") else text
    host, sep, port_text = body.rpartition(":")
    if not sep or not port_text.isdigit():
        return
    port = int(port_text)
    host = host.strip("[]") or "127.0.0.1"
    if not 0 < port < 65536:
        raise ParamError("address", f"{address}: port {port} is not in 1..65535", flag="--ray-address")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except TimeoutError:
        raise ParamsError("{address} {given}: no answer within {timeout} s (is a Ray cluster running there? "
                          "start one with `ray start --head`, or drop {address} for a local Ray)",
                          ("address", "--ray-address"), given=address, timeout=f"{timeout:g}") from None
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ParamsError("{address} {given}: nothing listens there ({why}; start a cluster with `ray start "
                          "--head`, or drop {address} for a local Ray)", ("address", "--ray-address"),
                          given=address, why=why) from None


def _fault_mode(index: int, fault: str | None) -> str | None:
    """The injected fault of call ``index`` ("raise", "exit" or "always"), None for none."""
    for item in (fault or "").split(","):
        at, _, mode = item.strip().partition(":")
        if at.strip().isdigit() and int(at) == index:
            return mode.strip() or "raise"
    return None


def faulty(task_index: int, fault_spec: str | None, fault_marks: str | None, task_fn: Callable, *args,
           **kwargs):
    """``task_fn(*args, **kwargs)``, first failing as ``fault_spec`` asks for call ``task_index``
    (a mark file in ``fault_marks`` records the first attempt, so a retry on any node of one
    machine sees it)."""
    mode = _fault_mode(task_index, fault_spec)
    if mode is not None:
        mark = Path(fault_marks or tempfile.gettempdir()) / f"fault-task-{task_index}"
        first = not mark.exists()
        if first or mode == "always":
            mark.touch()
            if mode == "exit":
                os._exit(17)
            raise InjectedFault(f"injected failure of task {task_index} ({FAULT_ENV})")
    return task_fn(*args, **kwargs)


def cause(err: BaseException) -> str:
    """A task's error as one short line (Ray wraps the task's own exception)."""
    inner = getattr(err, "cause", None) or err
    text = " ".join(f"{type(inner).__name__}: {inner}".split())
    return text if len(text) <= 300 else text[:297] + "..."


class Pool:
    """Runs calls of one function; a context manager (the session: Ray's start and stop)."""

    name = "pool"
    retries = 0
    in_process = False
    """Whether the calls run in this process (what they are given is not copied: work the
    caller has done once may be handed to every call; to Ray it would be sent per call)."""

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def share(self, obj: Any) -> Any:
        """``obj`` as the calls should receive it (Ray: put in the object store once)."""
        return obj

    def run(self, fn: Callable, calls: Sequence[Call], *, cpus: int = 1,
            describe: Callable[[int], str] | None = None) -> Generator[tuple[int, Any], None, None]:
        """``(i, fn(*args_i, **kwargs_i))`` for every call, in the order they finish.  ``cpus``:
        the cores one call uses; ``describe(i)`` names call ``i`` in an error."""
        raise NotImplementedError


class ThreadPool(Pool):
    """Calls on ``threads`` threads of this process (default: one per core)."""

    name = "local"
    in_process = True

    def __init__(self, threads: int | None = None):
        if threads is not None and int(threads) < 1:
            raise ParamError("threads", f"must be >= 1, got {threads}")
        self.threads = threads

    def run(self, fn, calls, *, cpus=1, describe=None):
        fault = os.environ.get(FAULT_ENV) or None
        marks = tempfile.mkdtemp(prefix="router-replay-faults-") if fault else None
        n = max(1, min(self.threads or os.cpu_count() or 1, len(calls) or 1))
        ex = ThreadPoolExecutor(max_workers=n, thread_name_prefix="task")
        try:
            # each call posts its index when it ends: taking the next finished one costs the
            # same with 10,000 calls pending as with 2 (waiting on the set of pending futures
            # installs a waiter on every one of them each time)
            finished: queue.SimpleQueue[int] = queue.SimpleQueue()
            futures: list[Future | None] = []
            for i, (args, kwargs) in enumerate(calls):
                f = ex.submit(faulty, i, fault, marks, fn, *args, **kwargs)
                f.add_done_callback(lambda _, i=i: finished.put(i))
                futures.append(f)
            for _ in range(len(futures)):
                i = finished.get()
                f, futures[i] = futures[i], None
                assert f is not None
                yield i, f.result()
        finally:
            # an error, an interrupt or a caller that stopped reading: nothing new starts, and the
            # calls running now end before the pool does (their kernels cannot be stopped)
            ex.shutdown(wait=True, cancel_futures=True)
            if marks:
                shutil.rmtree(marks, ignore_errors=True)


class RayPool(Pool):
    """Calls as Ray tasks: on the cluster at ``address``, else on a local Ray with ``cpus``
    CPUs (default: all) started for the session; each retried ``retries`` times."""

    name = "ray"

    def __init__(self, *, address: str | None = None, cpus: int | None = None, retries: int = 2):
        if int(retries) < 0:
            raise ParamError("retries", f"must be >= 0, got {retries}", flag="--ray-retries")
        self.address, self.cpus, self.retries = address, cpus, int(retries)
        self._started = False
        self._depth = 0
        self.ray: Any = None
        self.start_s = 0.0

    def __enter__(self) -> RayPool:
        self._depth += 1
        if self._depth > 1:
            return self
        ray = require_ray()
        if self.address:
            probe_ray_address(self.address)
        t0 = time.perf_counter()
        if not ray.is_initialized():
            opts: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False,
                                        logging_level=logging.ERROR, configure_logging=True)
            if self.address:
                ray.init(address=self.address, **opts)
            else:
                ray.init(address="local", num_cpus=self.cpus or os.cpu_count() or 1, **opts)
            self._started = True
        self.start_s = time.perf_counter() - t0
        self.ray = ray
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0 and self._started:
            self._started = False
            self.ray.shutdown()

    def share(self, obj):
        return self.ray.put(obj)

    def run(self, fn, calls, *, cpus=1, describe=None):
        if self.ray is None:
            raise ReplayError("a Ray pool runs inside its session (`with pool:`)")
        ray = self.ray
        fault = os.environ.get(FAULT_ENV) or None
        marks = tempfile.mkdtemp(prefix="router-replay-faults-") if fault else None
        task = ray.remote(num_cpus=cpus, max_retries=self.retries, retry_exceptions=True)(faulty)
        where = {task.remote(i, fault, marks, fn, *args, **kwargs): i for i, (args, kwargs) in enumerate(calls)}
        pending = list(where)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                i = where[done[0]]
                try:
                    value = ray.get(done[0])
                except Exception as err:  # noqa: BLE001 - Ray wraps the task's exception
                    what = describe(i) if describe is not None else f"task {i}"
                    raise TaskFailed(f"{what} failed after {self.retries + 1} attempt(s): "
                                     f"{cause(err)}") from None
                yield i, value
        finally:
            for other in pending:
                ray.cancel(other, force=True)
            if marks:
                shutil.rmtree(marks, ignore_errors=True)


POOLS: dict[str, type[Pool]] = {"local": ThreadPool, "ray": RayPool}
"""Pools by name (``--executor``)."""


def pool(name: str | Pool = "local", *, threads: int | None = None, address: str | None = None,
         cpus: int | None = None, retries: int | None = None) -> Pool:
    """The pool called ``name``: ``local`` takes ``threads``; ``ray`` takes ``address``, ``cpus`` and
    ``retries`` (an option given to the other one is a :class:`ParamError` naming it)."""
    if isinstance(name, Pool):
        return name
    if name not in POOLS:
        raise ParamError("executor", f"must be one of {', '.join(POOLS)}, got {name!r}")
    if name == "local":
        given = {k: v for k, v in dict(address=address, cpus=cpus).items() if v is not None}
        if given:
            first = sorted(given)[0]
            raise ParamError(first, "applies to the ray executor, not local (executor='local')",
                             flag=f"--ray-{first}")
        return ThreadPool(threads)
    return RayPool(address=address, cpus=cpus, retries=2 if retries is None else retries)
