"""The grid sweep: a trace directory and a grid in, a run directory out.

A run directory holds ``summary.parquet`` / ``summary.csv`` (one row per
config), ``decisions.parquet`` (one row per request and config, optional),
``fleet.parquet`` (one row per request: time and the fleet's smallest fresh
queue reading, see ``replay/sweep/readings.py``), ``run.json`` (provenance) and
``report.html`` (when given a ``report`` writer).  It is built in a hidden sibling folder and moved
into place only when complete, so an interrupted or failed sweep never leaves
a run that looks finished (``replay/runs/rundir.py`` owns the directory and its rule).

:func:`run_sweep` checks the arguments, asks :func:`plan` whether the trace
replays whole or window by window, hands a :class:`replay.sweep.executors.Job` to an
executor (local or Ray), and writes what comes back.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np
import polars as pl

from replay import __version__
from replay.config import KNOBS, Grid
from replay.errors import ConfigError, ParamError, ReplayError
from replay.kernels import layout as kacc
from replay.runs import decisions as decision_store
from replay.runs import rundir
from replay.runs.rundir import (  # noqa: F401 - re-exported: their home was here
    DECISIONS,
    FLEET,
    REPORT,
    RUN_JSON,
    SUMMARY,
    SUMMARY_CSV,
    decision_files,
)
from replay.sweep import executors
from replay.sweep import readings as fleet_mod
from replay.sweep.engine import blocks_per_thread, kernel_threads
from replay.sweep.executors import shard_window  # noqa: F401 - re-exported: its home was here
from replay.sweep.results import Accumulator
from replay.trace import (
    NS,
    REQUESTS,
    Trace,
    TraceSet,
    auto_window,
    format_window,
    load_trace,
    parse_window,
    row_counts,
)
from replay.trace import windows as trace_windows
from replay.trace.validate import check_freshness_ms

MAX_SEED = 2**63 - 1
MAX_INT_KNOB = 2**63 - 1
"""Largest integer knob value the replay holds (its kernels count in int64; the router takes
u64, but no queue or token count comes near 2**63)."""
MAX_CONFIGS = 10_000
"""Most configs one sweep replays: each keeps its counters and a 4096-bucket queue histogram per
thread block (about 33 KB x 2 blocks per thread for grids this large, ``engine.blocks_per_thread``),
so memory grows with configs x threads."""


def check_grid(grid: Grid, threads: int | None = None) -> None:
    """Refuse, before any trace work, a grid the kernels cannot hold: an integer knob above
    :data:`MAX_INT_KNOB`, or more than :data:`MAX_CONFIGS` configs (one line, the limit and why)."""

    n = len(grid.configs)
    if n > MAX_CONFIGS:

        blocks = blocks_per_thread(n) * kernel_threads(threads)
        per = 8 * (kacc.N_ACC + kacc.WAIT_HIST + kacc.N_DIV) * blocks
        raise ConfigError(f"the grid has {n:,} configs, more than the {MAX_CONFIGS:,} one sweep takes: each "
                          f"config keeps {per // 1024:,} KiB of counters here ({blocks} thread blocks), "
                          f"{n * per / 2**30:.1f} GiB for this grid; split it into several sweeps")
    for name, spec in KNOBS.items():
        if spec.kind != "int":
            continue
        for cfg in grid.configs:
            v = getattr(cfg, name)
            if v is not None and v > MAX_INT_KNOB:
                scaled = f" ({v // grid.dp_size} per rank x dp_size {grid.dp_size})" if grid.dp_size else ""
                raise ConfigError(f"{spec.flag}: {v}{scaled} is above {MAX_INT_KNOB} (2**63-1), the largest value the "
                                  f"replay's 64-bit counters hold (no queue comes near it; "
                                  f"{'use none for no limit' if spec.nullable else 'give a smaller value'})")


@dataclass
class SweepResult:
    """What a sweep produced: the summary table and where the run was written."""

    summary: pl.DataFrame
    run_dir: Path | None
    run: dict[str, Any]
    grid: Grid
    trace: Trace | TraceSet     # the Trace, or the TraceSet of a windowed sweep
    timings: dict[str, float] = field(default_factory=dict)


def run_sweep(
    trace: Trace | str | os.PathLike,
    grid: Grid | Mapping[str, Any] | None = None,
    *,
    out: str | os.PathLike | None = None,
    seed: int = 0,
    freshness_ms: int = 5000,
    model: str | None = None,
    decisions: bool = True,
    decisions_layout: str = "long",
    per_dp_rank: bool = False,
    force: bool = False,
    report: Callable[..., Any] | None = None,
    threads: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_start: Callable[[int], None] | None = None,
    status: Callable[[str], None] | None = None,
    window: int | str | None = "auto",
    executor: str | executors.Executor = "local",
    ray_address: str | None = None,
    configs_per_task: int | None = None,
    ray_retries: int | None = None,
    ray_cpus: int | None = None,
) -> SweepResult:
    """Replay a trace under every config of a grid in one pass.

    ``trace`` is a loaded :class:`Trace` or a trace directory (either layout,
    see ``traces/README.md``); ``grid`` a :class:`Grid` or the knob values to
    build one from (see :class:`Grid`).  With ``out``, the run directory is
    written (atomically); without it only the summary is computed.
    ``per_dp_rank`` reads limit and floor values as per-rank numbers and
    scales them by the fleet's dp_size.  With ``out`` and a ``report`` writer (``(run_dir, html_path)``),
    ``report.html`` is built in the run directory too; a report that fails to
    build does not fail the sweep (``run["report_error"]`` says why).

    ``window`` bounds memory for traces larger than it: ``"auto"`` (replay in
    memory when the trace is small, else in windows of a few million rows),
    ``0``/``"none"`` (in memory) or a window in nanoseconds or as text
    (``"1h"``); results never depend on it.  ``executor="ray"`` runs the
    windows (and blocks of ``configs_per_task`` configs) as Ray tasks
    (``replay/sweep/shards.py``; ``ray_address`` joins an existing cluster, else a
    local Ray with ``ray_cpus`` CPUs starts; a failing task is retried
    ``ray_retries`` times, default 2); an :class:`replay.sweep.executors.Executor` may be given
    instead.  ``status(text)`` hears what a long windowed sweep is doing before its progress starts.
    """
    t0 = time.perf_counter()
    if not 0 <= int(seed) <= MAX_SEED:
        raise ParamError("seed", f"must be in 0..{MAX_SEED}, got {seed}")
    check_freshness_ms(freshness_ms)
    if decisions_layout not in decision_store.LAYOUTS:
        raise ParamError("decisions_layout", f"must be one of {', '.join(decision_store.LAYOUTS)}, "
                         f"got {decisions_layout!r}")
    if not isinstance(grid, Grid):
        grid = Grid(grid or {}, per_dp_rank=per_dp_rank)
    elif per_dp_rank and not grid.per_dp_rank:
        grid = grid.as_per_rank()
    check_grid(grid, threads)
    ex = executors.executor(executor, address=ray_address, configs_per_task=configs_per_task,
                            retries=ray_retries, cpus=ray_cpus)
    ex.prepare()                # fail before a long index pass, not after
    if isinstance(window, str):
        window = parse_window(window)
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        rundir.guard([(out_path, "run")], inputs=[trace.path if isinstance(trace, Trace) else trace],
                     force=force, say=status)
    freshness_ns = int(freshness_ms) * 1_000_000
    if isinstance(trace, Trace):
        if ex.needs_windows or window:
            raise ReplayError("a loaded Trace replays in memory with the local executor; "
                              "pass the trace directory to window or shard it")
        the_plan = Plan(0, None, "a loaded trace")
    else:
        the_plan = plan(trace, window, ex, status=status)
    tset = the_plan.tset
    hashed = None
    if tset is None:
        source: Trace | TraceSet = trace if isinstance(trace, Trace) else load_trace(trace, model=model)
        ex.warm()               # after the load, not competing with it (executors.LocalExecutor.warm)
    else:
        source = tset
        if model is not None and model not in tset.model_counts:
            raise ReplayError(f"{REQUESTS}: column 'model': no request has model {model!r} "
                              f"(models: {', '.join(tset.models)})")
        if status is not None:
            status(f"{tset.n_requests:,} requests, {tset.n_load_rows:,} load rows in "
                   f"{len(tset.requests) + len(tset.loads)} files")
        # the files' sha256 (run.json) are computed while the windows replay
        hashed = executors.Background(tset.hashed_files)
        if status is not None:
            status(f"replaying in {len(tset.window_bounds(the_plan.window_ns))} windows of "
                   f"{format_window(the_plan.window_ns)}" + (" as Ray tasks" if ex.name == "ray" else ""))
    window_ns = the_plan.window_ns
    t_load = time.perf_counter()
    grid = grid.resolve(list(source.fleet_dp_sizes().values()))
    check_grid(grid, threads)         # again: --per-dp-rank scaling may overflow
    configs = grid.configs
    tmp_dir: Path | None = None
    if out_path is not None:
        tmp_dir = rundir.partial_beside(out_path)
    try:
        n_requests = (source.n_requests if tset is None or model is None
                      else tset.model_counts.get(model, 0))
        if on_start is not None:
            on_start(n_requests)
        job = executors.Job(source=source, configs=configs, grid=grid, seed=int(seed), freshness_ns=freshness_ns,
                            model=model, threads=threads, progress=progress, out_dir=tmp_dir,
                            decisions=decisions and tmp_dir is not None, decisions_layout=decisions_layout)
        done = ex.replay(job, window_ns)
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
        run = run_record(source, grid, seed=seed, freshness_ms=freshness_ms, model=model,
                          decisions=done.decision_files if job.decisions else None,
                          decisions_layout=decisions_layout if job.decisions else None,
                          per_dp_rank=grid.per_dp_rank, timings=timings)
        run["trace"]["requests"] = n_requests if tset is not None else source.n_requests
        run["trace"]["layout"] = _layout(source)
        run["execution"] = {"executor": ex.name, "window_s": window_ns // NS if window_ns else None,
                            "windows": done.windows, **done.execution}
        run["trace"]["facts"] = fleet_mod.trace_facts(source, None, None, freshness_ns, merged=done.facts)
        run["fleet"] = FLEET if out_path is not None else None
        run["report"] = REPORT if out_path is not None and report else None
        if tmp_dir is not None and out_path is not None:
            with rundir.writing(out_path):
                summary.write_parquet(tmp_dir / SUMMARY)
                summary.write_csv(tmp_dir / SUMMARY_CSV)
                (tmp_dir / RUN_JSON).write_text(json.dumps(run, indent=2, allow_nan=False) + "\n")
                if report:
                    _write_report(report, tmp_dir, run)
                rundir.move_into_place(tmp_dir, out_path)
            tmp_dir = None
        return SweepResult(summary, out_path, run, grid, source, timings)
    except (OSError, pl.exceptions.PolarsError, RuntimeError) as err:
        if tmp_dir is None or not rundir.no_space(err, out_path):   # the decisions writer ran out of disk
            raise
        raise rundir.write_error(err, out_path) from None
    finally:
        rundir.discard(tmp_dir)


@dataclass
class Plan:
    """How a sweep reads its trace: whole, in memory (``window_ns`` 0, no index), or window
    by window from the index ``tset``.  ``why`` says which rule decided."""

    window_ns: int
    tset: TraceSet | None
    why: str


def _row_counts(trace_dir) -> tuple[int, int] | None:
    """(request rows, load rows) from the Parquet footers alone; None where a file cannot be
    listed or opened (the index pass then names the problem)."""
    try:
        counts = row_counts(trace_dir)
    except ReplayError:
        return None
    return counts["requests"], counts["loads"]


def plan(trace_dir: str | os.PathLike, window: int | None, ex: executors.Executor, *,
         status: Callable[[str], None] | None = None) -> Plan:
    """Decide memory or windows for a sweep of ``trace_dir``.

    ``window`` None (auto): a trace whose files' metadata says it fits
    (``AUTO_IN_MEMORY_REQUESTS`` requests and ``AUTO_IN_MEMORY_LOAD_ROWS`` load
    rows) replays in memory without an index pass; a larger one is indexed and
    cut into windows of a few million rows.  ``0``: in memory.  A positive
    window: indexed and cut into windows of that length.  An executor that
    needs windows (Ray) always gets them.
    """
    if window and (window < NS or window % NS):
        raise ParamError("window", "must be a whole number of seconds (>= 1 s)")
    if not ex.needs_windows:
        if window == 0:
            return Plan(0, None, "--window none")
        if window is None:
            counts = _row_counts(trace_dir)
            if (counts and counts[0] <= trace_windows.AUTO_IN_MEMORY_REQUESTS
                    and counts[1] <= trace_windows.AUTO_IN_MEMORY_LOAD_ROWS):
                return Plan(0, None, f"{counts[0]:,} requests and {counts[1]:,} load rows fit in memory")
    if status is not None:
        status(f"indexing {trace_dir}")
    ex.warm()                   # the kernels get ready while the index is read
    tset = TraceSet.open(trace_dir, hash_files=False)
    window_ns = auto_window(tset) if window is None else int(window)
    if window_ns == 0:
        window_ns = ex.default_window(tset)
    if window_ns == 0:
        return Plan(0, None, "the index says it fits in memory")
    return Plan(window_ns, tset, "windows")


def _layout(source) -> str:
    if isinstance(source, Trace):
        names = list(source.files)
    else:
        names = [p.name for p in (*source.requests, *source.loads)]
    return "set" if any("/" in n for n in names) else "files"


def _write_report(build_report: Callable[..., Any], tmp_dir: Path, run: dict) -> None:
    """Build report.html inside the unfinished run dir; on failure note it in run.json."""

    try:
        build_report(tmp_dir, tmp_dir / REPORT)
    except Exception as err:  # the sweep's results stand without their report
        if rundir.no_space(err, tmp_dir):
            raise
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


def run_record(trace, grid, *, seed: int, freshness_ms: int, model: str | None, per_dp_rank: bool,
               decisions: str | list[str] | None, timings: Mapping[str, float],
               decisions_layout: str | None = None) -> dict:
    """``run.json``: the tool's marker, version, the trace (path, files with sha256, size),
    the grid, the settings, where the decisions are, timings and the machine.  ``sweep``
    adds the execution, the trace's facts and the fleet/report names."""

    return {
        "tool": rundir.TOOL,
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
        "seed": int(seed),
        "freshness_ms": int(freshness_ms),
        "model": model,
        "per_dp_rank": bool(per_dp_rank),
        "dp_size": grid.dp_size,
        "decisions": decisions,
        # decision_store.LAYOUTS (None without decisions; runs before the key: "long")
        "decisions_layout": decisions_layout if decisions else None,
        "timings": dict(timings),
        "machine": {
            "python": platform.python_version(),
            "numba": numba.__version__,
            "numpy": np.__version__,
            "polars": pl.__version__,
            "threads": numba.get_num_threads(),
        },
    }
