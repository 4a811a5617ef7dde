"""How a sweep's replay runs: a :class:`Job` in, a :class:`Done` out, by an :class:`Executor`.

Two executors implement one interface: :class:`LocalExecutor` replays the
trace in memory or window by window in this process (the next window is read
on a background thread while the current one replays, and decisions are
written on another); :class:`RayExecutor` runs windows and config blocks as
Ray tasks (``replay/sweep/shards.py``).  ``run_sweep`` asks :func:`executor` for one
by name and never branches on which it got.  Both use the pieces here: the
job, the result, the fleet table sink and the background helpers.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from replay.errors import ParamError
from replay.runs.names import DECISIONS, FLEET
from replay.sweep import engine, shards
from replay.sweep import readings as fleet_mod
from replay.sweep.jobs import Done, Job
from replay.sweep.pool import probe_ray_address, require_ray
from replay.sweep.results import DecisionWriter
from replay.trace import NS, Trace, TraceSet


class Background:
    """``fn()`` on a daemon thread (a failed sweep does not wait for it at exit)."""

    def __init__(self, fn):

        self._out: dict = {}

        def run():
            try:
                self._out["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - raised by result()
                self._out["error"] = err

        self._thread = threading.Thread(target=run, name="background", daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]


def shard_window(tset: TraceSet, shards: int = 8) -> int:
    """The Ray executor's default window for a trace that fits in memory: the
    span cut into about ``shards`` whole-second pieces."""
    if tset.ts_min is None:
        return NS
    span_s = (tset.ts_max - tset.ts_min) / NS
    return max(1, int(math.ceil((span_s + 1) / shards))) * NS


class FleetSink:
    """fleet.parquet, appended window by window (nothing when there is no run dir)."""

    def __init__(self, out_dir: Path | None):
        self.path = None if out_dir is None else out_dir / FLEET
        self.writer: pq.ParquetWriter | None = None
        self.empty: pa.Table | None = None

    def write(self, trace: Trace, min_waiting, fresh) -> None:
        if self.path is None:
            return
        table = fleet_mod.fleet_table(trace, min_waiting, fresh).to_arrow()
        if trace.n_requests == 0:
            self.empty = self.empty or table
            return
        if self.writer is None:
            self.writer = pq.ParquetWriter(str(self.path), table.schema, compression="zstd")
        elif table.schema != self.writer.schema:
            table = table.cast(self.writer.schema)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.path is None:
            return
        if self.writer is None:
            empty = self.empty if self.empty is not None else fleet_mod.empty_fleet_table().to_arrow()
            pq.write_table(empty, str(self.path))
        else:
            self.writer.close()
            self.writer = None


def _replay_one(job: Job, trace: Trace, totals: engine.Totals, writer: DecisionWriter | None,
                fleet_sink: FleetSink, facts: fleet_mod.FleetFacts, pool: ThreadPoolExecutor,
                pending: list, clock: dict) -> None:
    """Replay one Trace (the whole trace or a window) into the shared totals,
    decisions writer, fleet table and facts."""
    mark = time.perf_counter()
    mins: list[np.ndarray] = []
    fresh_parts: list[np.ndarray] = []
    for chunk in engine.iter_chunks(trace, job.configs, seed=job.seed, freshness_ns=job.freshness_ns,
                                    threads=job.threads, keep=writer is not None, totals=totals,
                                    progress=job.progress):
        now = time.perf_counter()
        clock["kernel"] += now - mark
        mins.append(chunk.fleet_min)
        fresh_parts.append(chunk.fleet_fresh)
        if writer is not None:
            # chunk k is written on a background thread while the kernels
            # (which release the GIL) replay chunk k+1; one write in flight
            if pending:
                pending.pop().result()
            pending.append(pool.submit(writer.write, chunk, trace))
        mark = time.perf_counter()
        clock["write"] += mark - now
    now = time.perf_counter()
    min_waiting, fresh = engine.chunk_readings(mins, fresh_parts)
    facts.add(trace.req_ts, min_waiting)
    fleet_sink.write(trace, min_waiting, fresh)
    clock["write"] += time.perf_counter() - now


def _replay_local(job: Job, traces) -> Done:
    totals = engine.new_totals(len(job.configs), threads=job.threads)
    facts = fleet_mod.FleetFacts()
    writer = (DecisionWriter(str(job.out_dir / DECISIONS), job.source, job.grid.config_ids,
                             layout=job.decisions_layout)
              if job.decisions else None)
    fleet_sink = FleetSink(job.out_dir)
    clock = {"kernel": 0.0, "write": 0.0}
    pending: list = []
    n = 0
    has_selected = False
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="decisions") as pool:
            for trace in traces:
                n += 1
                has_selected |= trace.req_selected_worker is not None
                _replay_one(job, trace, totals, writer, fleet_sink, facts, pool, pending, clock)
                if pending:             # the writer still reads this window's ids
                    pending.pop().result()
                del trace               # let the window go before the next is read
            now = time.perf_counter()
            if pending:
                pending.pop().result()
            if writer is not None:
                writer.close()
            fleet_sink.close()
            clock["write"] += time.perf_counter() - now
    finally:
        if writer is not None:
            writer.close()
    return Done(totals, facts, has_selected, DECISIONS, n, clock["kernel"], clock["write"])



def prefetched(windows, depth: int = 1):
    """Yield the windows' traces, reading (and encoding) the next window on a
    background thread while the current one is replayed: Parquet decoding and
    the kernels both release the GIL.  At most ``depth`` windows wait; an
    error while reading is raised here, in order."""

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    END = object()

    def produce():
        try:
            for win in windows:
                trace = win.trace
                del win
                while not stop.is_set():
                    try:
                        q.put((trace, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                del trace
                if stop.is_set():
                    return
            q.put((END, None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            q.put((None, err))

    thread = threading.Thread(target=produce, name="window-reader", daemon=True)
    thread.start()
    try:
        while True:
            trace, err = q.get()
            if err is not None:
                raise err
            if trace is END:
                return
            yield trace
            del trace
    finally:
        stop.set()
        while thread.is_alive():      # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=0.1)


class Executor:
    """Runs a :class:`Job`.  ``needs_windows``: it cannot replay a whole trace in memory
    (a trace that fits is still cut, by :meth:`default_window`)."""

    name = "executor"
    needs_windows = False

    def prepare(self) -> None:
        """Fail early (before any index pass) when the executor cannot run here."""

    def warm(self) -> None:
        """Get ready to replay, in the background: called once the trace is in memory, or
        before a windowed sweep's index pass (which then overlaps it)."""

    def default_window(self, tset: TraceSet) -> int:
        """The window for a trace that would fit in memory (0: replay it whole)."""
        return 0

    def replay(self, job: Job, window_ns: int) -> Done:
        raise NotImplementedError


class LocalExecutor(Executor):
    """This process: the whole trace in memory (``window_ns`` 0), else window by window."""

    name = "local"

    def prepare(self) -> None:
        """On a cold numba cache, start compiling now: the compile (about 20 s) then overlaps
        reading the trace.  A filled cache is loaded later, by :meth:`warm`."""
        if engine.kernels_cold():
            self.warm()

    def warm(self) -> None:
        """Start compiling (or loading from numba's cache) the kernels on a background thread.

        Not during an in-memory load: loading the cached kernels is ~0.7 CPU s of
        mostly GIL-holding Python, and on two cores it slowed the load by more than it saved
        (fresh processes, load then kernels one after the other: less CPU and wall in total
        than both at once).  A first start compiles while the trace is read (:meth:`prepare`)."""
        if not getattr(self, "_warmed", False):
            self._warmed = True
            engine.compile_in_background()

    def replay(self, job: Job, window_ns: int) -> Done:
        if window_ns == 0:
            return _replay_local(job, [job.source])
        tset = cast(TraceSet, job.source)     # windows are replayed only from a TraceSet
        done = _replay_local(job, prefetched(tset.iter_windows(window_ns, model=job.model)))
        done.has_selected = tset.has_selected
        return done


class RayExecutor(Executor):
    """Ray tasks, one per window and block of ``configs_per_task`` configs (``replay/sweep/shards.py``)."""

    name = "ray"
    needs_windows = True

    def __init__(self, *, address: str | None = None, configs_per_task: int | None = None, retries: int = 2,
                 cpus: int | None = None):
        if configs_per_task is not None and int(configs_per_task) < 1:
            raise ParamError("configs_per_task", f"must be >= 1, got {configs_per_task}")
        self.address, self.configs_per_task, self.retries, self.cpus = address, configs_per_task, retries, cpus

    def prepare(self) -> None:

        require_ray()
        if self.address:
            probe_ray_address(self.address)

    def default_window(self, tset: TraceSet) -> int:
        return shard_window(tset)

    def replay(self, job: Job, window_ns: int) -> Done:

        return shards.run_ray(job, window_ns, address=self.address, configs_per_task=self.configs_per_task,
                              retries=self.retries, cpus=self.cpus)


EXECUTORS: dict[str, type[Executor]] = {"local": LocalExecutor, "ray": RayExecutor}
"""Executors by name (``--executor``)."""


def executor(name: str | Executor, **options) -> Executor:
    """The executor called ``name`` built with ``options`` (those given as None are left out;
    an option the executor does not take is a :class:`ReplayError` naming it)."""
    if isinstance(name, Executor):
        return name
    if name not in EXECUTORS:
        raise ParamError("executor", f"must be one of {', '.join(EXECUTORS)}, got {name!r}")
    given = {k: v for k, v in options.items() if v is not None}
    cls = EXECUTORS[name]
    if cls is LocalExecutor:
        if given:
            first = sorted(given)[0]
            raise ParamError(first, "applies to the ray executor, not local (executor='local')",
                             flag=f"--ray-{first}" if first != "configs_per_task" else "--configs-per-task")
        return cls()
    return cls(**given)
