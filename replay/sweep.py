"""The grid sweep: a trace directory and a grid in, a run directory out.

A run directory holds ``summary.parquet`` / ``summary.csv`` (one row per
config), ``decisions.parquet`` (one row per request and config, optional),
``fleet.parquet`` (one row per request: time and the fleet's smallest fresh
queue reading, see ``replay/fleet.py``), ``run.json`` (provenance) and
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

import numba
import numpy as np
import polars as pl

from . import __version__, engine
from . import fleet as fleet_mod
from .config import Grid, fleet_dp_size
from .errors import ReplayError
from .outdir import move_into_place, partial_beside, refuse_existing
from .results import Accumulator, DecisionWriter
from .trace import Trace, load_trace

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
    trace: Trace
    timings: dict[str, float] = field(default_factory=dict)


def check_run_dir(out: Path, force: bool) -> None:
    """Refuse an existing non-empty RUN_DIR unless ``force``; refuse a file in its place."""
    refuse_existing(out, force, "run directory")


def fleet_dp(trace: Trace) -> int:
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
) -> SweepResult:
    """Replay a trace under every config of a grid in one pass.

    ``trace`` is a loaded :class:`Trace` or a trace directory; ``grid`` a
    :class:`Grid` or the knob values to build one from (see :class:`Grid`).
    With ``out``, the run directory is written (atomically); without it only
    the summary is computed.  ``per_dp_rank`` reads limit and floor values as
    per-rank numbers and scales them by the fleet's dp_size.  With ``out`` and
    ``report``, ``report.html`` is built in the run directory too; a report
    that fails to build does not fail the sweep (``run["report_error"]`` says why).
    """
    t0 = time.perf_counter()
    if not 0 <= int(seed) <= MAX_SEED:
        raise ReplayError(f"--seed must be in 0..{MAX_SEED}, got {seed}")
    if int(freshness_ms) < 0:
        raise ReplayError(f"--freshness-ms must be >= 0, got {freshness_ms}")
    out_path = Path(out) if out is not None else None
    if out_path is not None:
        check_run_dir(out_path, force)
    if not isinstance(trace, Trace):
        trace = load_trace(trace, model=model)
    t_load = time.perf_counter()
    if isinstance(grid, Grid):
        if per_dp_rank and grid.dp_size is None:
            grid = grid.scaled_per_dp_rank(fleet_dp(trace))
    else:
        grid = Grid(grid or {}, dp_size=fleet_dp(trace) if per_dp_rank else None)
    configs = grid.configs
    totals = engine.new_totals(len(configs), threads=threads)
    tmp_dir: Path | None = None
    writer = None
    if out_path is not None:
        tmp_dir = partial_beside(out_path)
    try:
        if tmp_dir is not None and decisions:
            writer = DecisionWriter(str(tmp_dir / DECISIONS), trace, grid.config_ids)
        if on_start is not None:
            on_start(trace.n_requests)
        t_kernel = 0.0
        t_write = 0.0
        # Chunk k is written on a background thread while the kernels (which
        # release the GIL) replay chunk k+1; at most one write is in flight.
        pending = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="decisions") as pool:
            mark = time.perf_counter()
            for chunk in engine.iter_chunks(trace, configs, seed=seed,
                                            freshness_ns=int(freshness_ms) * 1_000_000,
                                            threads=threads, keep=writer is not None,
                                            totals=totals, progress=progress):
                now = time.perf_counter()
                t_kernel += now - mark
                if writer is not None:
                    if pending is not None:
                        pending.result()
                    pending = pool.submit(writer.write, chunk)
                mark = time.perf_counter()
                t_write += mark - now
            now = time.perf_counter()
            if pending is not None:
                pending.result()
            if writer is not None:
                writer.close()
            t_write += time.perf_counter() - now
        summary = Accumulator(len(configs), totals).summary(_config_rows(grid), has_selected=trace.req_selected_worker is not None)
        min_waiting, fresh_workers = fleet_mod.fleet_readings(trace, int(freshness_ms) * 1_000_000)
        timings = {
            "load_s": round(t_load - t0, 4),
            "replay_s": round(t_kernel, 4),
            "accumulate_and_write_s": round(t_write, 4),
            "total_s": round(time.perf_counter() - t0, 4),
        }
        run = _run_record(trace, grid, seed=seed, freshness_ms=freshness_ms, model=model,
                          decisions=decisions, per_dp_rank=per_dp_rank, timings=timings)
        run["trace"]["facts"] = fleet_mod.trace_facts(trace, min_waiting, fresh_workers,
                                                      int(freshness_ms) * 1_000_000)
        run["fleet"] = FLEET if out_path is not None else None
        run["report"] = REPORT if out_path is not None and report else None
        if tmp_dir is not None and out_path is not None:
            summary.write_parquet(tmp_dir / SUMMARY)
            summary.write_csv(tmp_dir / SUMMARY_CSV)
            fleet_mod.fleet_table(trace, min_waiting, fresh_workers).write_parquet(tmp_dir / FLEET)
            (tmp_dir / RUN_JSON).write_text(json.dumps(run, indent=2, allow_nan=False) + "\n")
            if report:
                _write_report(tmp_dir, run)
            move_into_place(tmp_dir, out_path)
            tmp_dir = None
        return SweepResult(summary, out_path, run, grid, trace, timings)
    finally:
        if writer is not None:
            writer.close()
        if tmp_dir is not None:
            shutil.rmtree(tmp_dir, ignore_errors=True)


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


def _run_record(trace: Trace, grid: Grid, **kw) -> dict:
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
        "decisions": DECISIONS if kw["decisions"] else None,
        "timings": kw["timings"],
        "machine": {
            "python": platform.python_version(),
            "numba": numba.__version__,
            "numpy": np.__version__,
            "polars": pl.__version__,
            "threads": numba.get_num_threads(),
        },
    }
