"""The grid sweep: a trace directory and a grid in, a run directory out.

A run directory holds ``summary.parquet`` / ``summary.csv`` (one row per
config), ``decisions.parquet`` (one row per request and config, optional),
``fleet.parquet`` (one row per request: time and the fleet's smallest fresh
queue reading, see ``replay/readings.py``), ``run.json`` (provenance) and
``report.html`` (unless ``report=False``).  It is built in a hidden sibling folder and moved
into place only when complete, so an interrupted or failed sweep never leaves
a run that looks finished.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import math

import numba
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from . import __version__, engine
from . import readings as fleet_mod
from .config import Grid, fleet_dp_size
from .errors import ReplayError
from .outdir import move_into_place, partial_beside, refuse_existing
from .results import Accumulator, DecisionWriter
from .trace import REQUESTS, Trace, load_trace
from .trace import NS, TraceSet, auto_window, format_window, parse_window

SUMMARY = "summary.parquet"
SUMMARY_CSV = "summary.csv"
DECISIONS = "decisions.parquet"
RUN_JSON = "run.json"
FLEET = fleet_mod.FLEET
REPORT = "report.html"
MAX_SEED = 2**63 - 1


@dataclass
class SweepResult:
    """What a sweep produced: the summary table and where the run was written."""

    summary: pl.DataFrame
    run_dir: Path | None
    run: dict[str, Any]
    grid: Grid
    trace: Any                  # the Trace, or the TraceSet of a windowed sweep
    timings: dict[str, float] = field(default_factory=dict)


def decision_files(run_dir: str | os.PathLike, run: Mapping | None = None) -> list[Path] | None:
    """The decisions files of a run: ``run.json``'s ``decisions`` (one file, or
    the list a sharded sweep writes), else ``decisions.parquet`` if present;
    None when the run kept no decisions (or a listed file is gone)."""
    p = Path(run_dir)
    if run is None:
        try:
            run = json.loads((p / RUN_JSON).read_text())
        except (OSError, ValueError):
            run = {}
    listed = run.get("decisions", DECISIONS) if isinstance(run, Mapping) else DECISIONS
    if not listed:
        return None
    files = [p / f for f in ([listed] if isinstance(listed, str) else listed)]
    return files if all(f.is_file() for f in files) else None


def check_run_dir(out: Path, force: bool) -> None:
    """Refuse an existing non-empty RUN_DIR unless ``force``; refuse a file in its place."""
    refuse_existing(out, force, "run directory")


def fleet_dp(trace) -> int:
    """The single dp_size of the fleet (workers table, else ranks observed), for --per-dp-rank."""
    sizes = list(trace.fleet_dp_sizes().values())
    if not sizes:
        raise ReplayError("--per-dp-rank: the trace has no fleet workers")
    return fleet_dp_size(sizes)


def run_sweep(
    trace: Trace | str | os.PathLike,
    grid: Grid | Mapping[str, Any] | None = None,
    *,
    out: str | os.PathLike | None = None,
    seed: int = 0,
    freshness_ms: int = 5000,
    model: str | None = None,
    decisions: bool = True,
    per_dp_rank: bool = False,
    force: bool = False,
    report: bool = True,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    status: Callable[[str], None] | None = None,
    window: int | str | None = "auto",
    executor: str = "local",
    ray_address: str | None = None,
    configs_per_task: int | None = None,
    ray_retries: int = 2,
    ray_cpus: int | None = None,
) -> SweepResult:
    """Replay a trace under every config of a grid in one pass.

    ``trace`` is a loaded :class:`Trace` or a trace directory (either layout,
    see ``traces/README.md``); ``grid`` a :class:`Grid` or the knob values to
    build one from (see :class:`Grid`).  With ``out``, the run directory is
    written (atomically); without it only the summary is computed.
    ``per_dp_rank`` reads limit and floor values as per-rank numbers and
    scales them by the fleet's dp_size.  With ``out`` and ``report``,
    ``report.html`` is built in the run directory too; a report that fails to
    build does not fail the sweep (``run["report_error"]`` says why).

    ``window`` bounds memory for traces larger than it: ``"auto"`` (replay in
    memory when the trace is small, else in windows of a few million rows),
    ``0``/``"none"`` (in memory) or a window in nanoseconds or as text
    (``"1h"``); results never depend on it.  ``executor="ray"`` runs the
    windows (and blocks of ``configs_per_task`` configs) as Ray tasks
    (``replay/shards.py``; ``ray_address`` joins an existing cluster, else a
    local Ray with ``ray_cpus`` CPUs starts; a failing task is retried
    ``ray_retries`` times).  ``status(text)`` hears what a long windowed
    sweep is doing before its progress starts.
    """
    t0 = time.perf_counter()
    if not 0 <= int(seed) <= MAX_SEED:
        raise ReplayError(f"--seed must be in 0..{MAX_SEED}, got {seed}")
    if int(freshness_ms) < 0:
        raise ReplayError(f"--freshness-ms must be >= 0, got {freshness_ms}")
    if executor not in ("local", "ray"):
        raise ReplayError(f"--executor must be local or ray, got {executor!r}")
    if executor == "ray":
        from .shards import require_ray

        require_ray()           # before a long index pass, not after
    if configs_per_task is not None and int(configs_per_task) < 1:
        raise ReplayError(f"--configs-per-task must be >= 1, got {configs_per_task}")
    if isinstance(window, str):
        try:
            window = parse_window(window)
        except ValueError as err:
            raise ReplayError(str(err)) from None
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        check_run_dir(out_path, force)
    freshness_ns = int(freshness_ms) * 1_000_000
    tset: TraceSet | None = None
    hashed = None
    if isinstance(trace, Trace):
        if executor != "local" or window:
            raise ReplayError("a loaded Trace replays in memory with the local executor; "
                              "pass the trace directory to window or shard it")
        window_ns = 0
    else:
        if status is not None:
            status(f"indexing {trace}")
        tset = TraceSet.open(trace, hash_files=False)
        window_ns = auto_window(tset) if window is None else int(window)
        if executor == "ray" and window_ns == 0:
            window_ns = shard_window(tset)
        if window_ns and (window_ns < NS or window_ns % NS):
            raise ReplayError("--window must be a whole number of seconds (>= 1 s)")
        if window_ns == 0:
            trace = load_trace(trace, model=model)
            tset = None
        else:
            if model is not None and model not in tset.model_counts:
                raise ReplayError(f"{REQUESTS}: column 'model': no request has model {model!r} "
                                  f"(models: {', '.join(tset.models)})")
            if status is not None:
                status(f"{tset.n_requests:,} requests, {tset.n_load_rows:,} load rows in "
                       f"{len(tset.requests) + len(tset.loads)} files")
            # the files' sha256 (run.json) are computed while the windows replay
            hashed = _Background(tset.hashed_files)
            if status is not None:
                n_win = len(tset.window_bounds(window_ns))
                status(f"replaying in {n_win} windows of {format_window(window_ns)}"
                       + (" as Ray tasks" if executor == "ray" else ""))
    source = trace if tset is None else tset
    t_load = time.perf_counter()
    if isinstance(grid, Grid):
        if per_dp_rank and grid.dp_size is None:
            grid = grid.scaled_per_dp_rank(fleet_dp(source))
    else:
        grid = Grid(grid or {}, dp_size=fleet_dp(source) if per_dp_rank else None)
    configs = grid.configs
    tmp_dir: Path | None = None
    if out_path is not None:
        tmp_dir = partial_beside(out_path)
    try:
        n_requests = (source.n_requests if tset is None or model is None
                      else tset.model_counts.get(model, 0))
        if on_start is not None:
            on_start(n_requests)
        job = _Job(source=source, configs=configs, grid=grid, seed=int(seed), freshness_ns=freshness_ns,
                   model=model, threads=threads, progress=progress, out_dir=tmp_dir,
                   decisions=decisions and tmp_dir is not None)
        if tset is None:
            done = _replay_in_memory(job)
        elif executor == "local":
            done = _replay_windows(job, window_ns)
        else:
            from . import shards

            done = shards.run_ray(job, window_ns, address=ray_address, configs_per_task=configs_per_task,
                                  retries=ray_retries, cpus=ray_cpus)
        if hashed is not None:
            tset.files = hashed.result()
        summary = Accumulator(len(configs), done.totals).summary(
            _config_rows(grid), has_selected=done.has_selected)
        timings = {
            "load_s": round(t_load - t0, 4),
            "replay_s": round(done.t_kernel, 4),
            "accumulate_and_write_s": round(done.t_write, 4),
            "total_s": round(time.perf_counter() - t0, 4),
        }
        run = _run_record(source, grid, seed=seed, freshness_ms=freshness_ms, model=model,
                          decisions=done.decision_files if job.decisions else None,
                          per_dp_rank=per_dp_rank, timings=timings)
        run["trace"]["requests"] = n_requests if tset is not None else source.n_requests
        run["trace"]["layout"] = _layout(source)
        run["execution"] = {"executor": executor, "window_s": window_ns // NS if window_ns else None,
                            "windows": done.windows, **done.execution}
        run["trace"]["facts"] = fleet_mod.trace_facts(source, None, None, freshness_ns, merged=done.facts)
        run["fleet"] = FLEET if out_path is not None else None
        run["report"] = REPORT if out_path is not None and report else None
        if tmp_dir is not None and out_path is not None:
            summary.write_parquet(tmp_dir / SUMMARY)
            summary.write_csv(tmp_dir / SUMMARY_CSV)
            (tmp_dir / RUN_JSON).write_text(json.dumps(run, indent=2, allow_nan=False) + "\n")
            if report:
                _write_report(tmp_dir, run)
            move_into_place(tmp_dir, out_path)
            tmp_dir = None
        return SweepResult(summary, out_path, run, grid, source, timings)
    finally:
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


class _Background:
    """``fn()`` on a daemon thread (a failed sweep does not wait for it at exit)."""

    def __init__(self, fn):
        import threading

        self._out: dict = {}

        def run():
            try:
                self._out["value"] = fn()
            except BaseException as err:  # raised by result()
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


def _layout(source) -> str:
    if isinstance(source, Trace):
        names = list(source.files)
    else:
        names = [p.name for p in (*source.requests, *source.loads)]
    return "set" if any("/" in n for n in names) else "files"


@dataclass
class _Job:
    """What every executor needs to replay a trace (in memory or window by window)."""

    source: Any                      # Trace or TraceSet
    configs: list
    grid: Grid
    seed: int
    freshness_ns: int
    model: str | None
    threads: int | None
    progress: Callable[[int], None] | None
    out_dir: Path | None             # the unfinished run dir (None: nothing written)
    decisions: bool


@dataclass
class _Done:
    totals: engine.Totals
    facts: fleet_mod.FleetFacts
    has_selected: bool
    decision_files: Any = None       # DECISIONS, or a list of files (Ray)
    windows: int = 1
    t_kernel: float = 0.0
    t_write: float = 0.0
    execution: dict = field(default_factory=dict)


class _FleetSink:
    """fleet.parquet, appended window by window (nothing when there is no run dir)."""

    def __init__(self, out_dir: Path | None):
        self.path = None if out_dir is None else out_dir / FLEET
        self.writer = None
        self.empty = None

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


def _replay_one(job: _Job, trace: Trace, totals: engine.Totals, writer: DecisionWriter | None,
                fleet_sink: _FleetSink, facts: fleet_mod.FleetFacts, pool: ThreadPoolExecutor,
                pending: list, clock: dict) -> None:
    """Replay one Trace (the whole trace or a window) into the shared totals,
    decisions writer, fleet table and facts."""
    mark = time.perf_counter()
    mins, fresh = [], []
    for chunk in engine.iter_chunks(trace, job.configs, seed=job.seed, freshness_ns=job.freshness_ns,
                                    threads=job.threads, keep=writer is not None, totals=totals,
                                    progress=job.progress):
        now = time.perf_counter()
        clock["kernel"] += now - mark
        mins.append(chunk.fleet_min)
        fresh.append(chunk.fleet_fresh)
        if writer is not None:
            # chunk k is written on a background thread while the kernels
            # (which release the GIL) replay chunk k+1; one write in flight
            if pending:
                pending.pop().result()
            pending.append(pool.submit(writer.write, chunk, trace))
        mark = time.perf_counter()
        clock["write"] += mark - now
    now = time.perf_counter()
    min_waiting, fresh = engine.chunk_readings(mins, fresh)
    facts.add(trace.req_ts, min_waiting)
    fleet_sink.write(trace, min_waiting, fresh)
    clock["write"] += time.perf_counter() - now


def _replay_local(job: _Job, traces) -> _Done:
    totals = engine.new_totals(len(job.configs), threads=job.threads)
    facts = fleet_mod.FleetFacts()
    writer = (DecisionWriter(str(job.out_dir / DECISIONS), job.source, job.grid.config_ids)
              if job.decisions else None)
    fleet_sink = _FleetSink(job.out_dir)
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
    return _Done(totals, facts, has_selected, DECISIONS, n, clock["kernel"], clock["write"])


def _replay_in_memory(job: _Job) -> _Done:
    return _replay_local(job, [job.source])


def _prefetched(windows, depth: int = 1):
    """Yield the windows' traces, reading (and encoding) the next window on a
    background thread while the current one is replayed: Parquet decoding and
    the kernels both release the GIL.  At most ``depth`` windows wait; an
    error while reading is raised here, in order."""
    import queue
    import threading

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
        except BaseException as err:  # handed to the consumer, raised there
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


def _replay_windows(job: _Job, window_ns: int) -> _Done:
    tset: TraceSet = job.source
    done = _replay_local(job, _prefetched(tset.iter_windows(window_ns, model=job.model)))
    done.has_selected = tset.has_selected
    return done


def _write_report(tmp_dir: Path, run: dict) -> None:
    """Build report.html inside the unfinished run dir; on failure note it in run.json."""
    from .report import build_report

    try:
        build_report(tmp_dir, tmp_dir / REPORT)
    except Exception as err:  # the sweep's results stand without their report
        (tmp_dir / REPORT).unlink(missing_ok=True)
        run["report"] = None
        run["report_error"] = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        (tmp_dir / RUN_JSON).write_text(json.dumps(run, indent=2, allow_nan=False) + "\n")


def _config_rows(grid: Grid) -> list[dict]:
    rows = []
    extra = ("dp_size", "per_rank_limit", "per_rank_floor")
    for r in grid.rows():
        row = {k: v for k, v in r.items() if k not in extra}
        if grid.dp_size is not None:
            row.update({k: r[k] for k in extra})
        rows.append(row)
    return rows


def _run_record(trace, grid: Grid, **kw) -> dict:
    return {
        "tool": "router-replay",
        "version": __version__,
        "status": "complete",
        "created_unix": int(time.time()),
        "trace": {
            "path": str(trace.path),
            "files": trace.files,
            "requests": trace.n_requests,
            "workers": trace.n_workers,
            "models": list(trace.models),
        },
        "grid": grid.describe(),
        "config_ids": list(grid.config_ids),
        "seed": int(kw["seed"]),
        "freshness_ms": int(kw["freshness_ms"]),
        "model": kw["model"],
        "per_dp_rank": bool(kw["per_dp_rank"]),
        "dp_size": grid.dp_size,
        "decisions": kw["decisions"],
        "timings": kw["timings"],
        "machine": {
            "python": platform.python_version(),
            "numba": numba.__version__,
            "numpy": np.__version__,
            "polars": pl.__version__,
            "threads": numba.get_num_threads(),
        },
    }
