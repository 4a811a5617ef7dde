"""Closed-loop workflows as one call each: what ``calibrate`` and ``simulate`` do, without the CLI.

The command parses its flags, calls one function here and prints what it returns; the hooks
(``on_fit``, ``on_fidelity``, ``progress``) let it print while the work goes on.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.capture.from_sim import write_capture
from replay.capture.outguard import CAPTURE
from replay.config import Grid, fleet_dp_size
from replay.errors import ParamError, ParamsError
from replay.runs import names, rundir
from replay.simulate.batch import check_simulations, simulate_grid
from replay.simulate.calibrate import Calibration, refine_decode
from replay.simulate.calibrate import calibrate as fit_fleet
from replay.simulate.fidelity import FIDELITY_JSON, FIDELITY_TOOL, FLEET_MARKER, Fidelity, recorded_seed
from replay.simulate.fidelity import validate as validate_fleet
from replay.simulate.fleet import Fleet, load_fleet
from replay.simulate.formats import read_log
from replay.simulate.logs import RequestLog
from replay.simulate.plan import PLAN_KIND, FleetPoint, fleet_points, plan_grid
from replay.simulate.seeds import parse_seeds
from replay.simulate.sim import SimResult, simulate
from replay.simulate.tracelog import RecordedTrace, is_trace_dir, read_trace_log
from replay.trace.base import TraceError
from replay.trace.files import parts_or_fail

# -- calibrate: a recorded trace -> a fitted fleet file, its fidelity, a prediction grid ---------------

@dataclass
class Calibrated:
    """What :func:`calibrate` made: the fit, the fleet file it wrote, and with ``validate_dir`` the
    fidelity of that fleet against the recording and the closed-loop prediction grid."""

    recorded: RecordedTrace
    calibration: Calibration
    fleet_path: Path
    fleet: Fleet
    refined: list[str] = field(default_factory=list)
    validate_dir: Path | None = None
    fidelity: Fidelity | None = None
    prediction: pl.DataFrame | None = None


def _fidelity_dir(path: Path) -> str | None:
    rec = rundir.read_json(path / FIDELITY_JSON)
    if rec is None or rec.get("tool") != FIDELITY_TOOL:
        return rundir.unmarked(path, FIDELITY_JSON)
    extra = sorted(n for n in path.iterdir() if n.name not in
                   {FIDELITY_JSON, names.FORCED_RUN, names.ROUTER_RUN, names.PREDICTION}
                   and not re.fullmatch(r"\.?.*\.partial-.*", n.name))
    return f"{extra[0]} was not written by router-replay" if extra else None


# calibrate's outputs: ``force`` replaces only a validation directory or fleet file calibrate wrote
FIDELITY_KIND = rundir.Kind("fidelity", "validation directory", True, _fidelity_dir)
FLEET_KIND = rundir.Kind("fleet", "fitted fleet file", False, rundir.marked_file(
    FLEET_MARKER, "not a fleet file written by router-replay calibrate", at_start=True))


Progress = Callable[[int, str], AbstractContextManager[Callable[[int], None] | None]]
"""``progress(n, label)``: a context giving a ``step(k)`` callable (or None) over ``n`` simulations."""


def _no_progress(n: int, label: str) -> AbstractContextManager[None]:
    return contextlib.nullcontext()


def calibrate_trace(trace_dir: str | os.PathLike, out: str | os.PathLike, *,
              validate_dir: str | os.PathLike | None = None, grid: Grid | None = None,
              seeds: str | None = None, decode_model: str = "auto", refine: bool = False,
              block_size: int | None = None, seed: int | None = None, freshness_ms: int | None = None,
              threads: int | None = None, force: bool = False, progress: Progress | None = None,
              on_fit: Callable[[Calibrated], None] | None = None,
              on_fidelity: Callable[[Fidelity], None] | None = None) -> Calibrated:
    """Fit a simulator fleet to the recorded trace ``trace_dir`` and write it to the fleet file
    ``out``; with ``validate_dir``, replay the recording through it (forced placement and the router
    in the loop), score the fit (``fidelity.json``) and, with ``grid``, predict that closed-loop grid
    (under ``seeds``: a count or a comma list) into ``validate_dir/prediction``.

    ``on_fit`` is called once the fleet file is written, ``on_fidelity`` once the fit is scored
    (before the prediction runs): the command prints there.  ``freshness_ms`` defaults to the
    trace's ``extra.freshness_ms``, else 5000; ``seed`` to its ``extra.seed``, else 0."""
    progress = progress or _no_progress
    fleet_path = Path(out)
    if fleet_path.exists() and Path(trace_dir).resolve() in fleet_path.resolve().parents:
        raise ParamError("out", f"{out}: is a file of the trace {trace_dir}; write the fleet file elsewhere")
    if validate_dir is not None:
        v, t = Path(validate_dir).resolve(), Path(trace_dir).resolve()
        if v == t or v in t.parents or t in v.parents:
            raise ParamError("validate_dir", f"{validate_dir}: overlaps the trace {trace_dir}; "
                             "give a directory outside it", flag="--validate")
        if v == fleet_path.resolve().parent or v in fleet_path.resolve().parents:
            raise ParamError("validate_dir", f"{validate_dir}: would hold the fleet file {out}; "
                             "write the fleet file elsewhere", flag="--validate")
    rundir.guard([(out, FLEET_KIND), (validate_dir, FIDELITY_KIND)], inputs=[trace_dir], force=force)
    n_seeds = len(parse_seeds(seeds, 0) or [])     # refused now, not after the fit and the validation
    if grid is not None:
        check_simulations(len(grid.configs), n_seeds, 1)
    rec = read_trace_log(trace_dir, block_size=block_size)
    if rec.loads is None:   # the fit reads the load samples: refused as validate refuses such a trace
        parts_or_fail(str(trace_dir), "loads")
    if rec.log.ts_ns.shape[0] == 0:     # nothing to fit the speeds to, nor to validate them against
        held = Path(trace_dir) / names.REQUESTS
        raise TraceError(f"{held if held.exists() else held.with_suffix('')}: no requests; calibrate "
                         "fits decode speed and rank dispatch to the recorded requests and validates by "
                         "replaying them: the load samples alone fit only part of a fleet")
    cal = fit_fleet(rec, decode_model=decode_model)
    # checked before anything is written: a fit the simulator cannot run blames the trace's counters
    cal.to_fleet(where=f"{trace_dir}: the fleet fitted from its loads.parquet counters cannot be simulated")
    extra = (rec.info.get("extra") or {})
    if freshness_ms is None:
        got = extra.get("freshness_ms")
        freshness_ms = got if isinstance(got, int) and not isinstance(got, bool) and got >= 0 else 5000
    refined = []
    if refine:
        refined = refine_decode(rec, cal, seed=recorded_seed(rec) if seed is None else seed,
                                freshness_ms=freshness_ms)
    # the fleet file is written aside and swapped in only when everything below succeeded: a failed
    # or interrupted validation leaves the previous fleet file exactly as it was
    with rundir.file_aside(fleet_path) as fleet_tmp:
        with rundir.writing(fleet_path):
            fleet_tmp.write_text(cal.to_toml(str(trace_dir)))
        fleet = load_fleet(fleet_tmp)  # what simulate will read: the file round-trips
        done = Calibrated(rec, cal, fleet_path, fleet, refined)
        if on_fit is not None:
            on_fit(done)
        if validate_dir is None:
            return done
        vdir = Path(validate_dir)
        tmp: Path | None = rundir.partial_beside(vdir)
        try:
            with progress(3, "validating") as step:
                fid = validate_fleet(rec, fleet, seed=seed, freshness_ms=freshness_ms, out_dir=tmp, force=True,
                                     progress=step)
            fid.write(tmp)
            if on_fidelity is not None:
                on_fidelity(fid)
            table = None
            if grid is not None:
                seed_list = parse_seeds(seeds, fid.seed)
                n = len(grid.configs) * (len(seed_list) if seed_list else 1)
                with progress(n, "simulating") as step:
                    table = simulate_grid(rec.log, fleet, grid, tmp / names.PREDICTION, seed=fid.seed,
                                          freshness_ms=freshness_ms, threads=threads,
                                          progress=step, seeds=seed_list)
            rundir.move_into_place(tmp, vdir)
            tmp = None
        finally:
            if tmp is not None:
                rundir.discard(tmp)
    done.validate_dir, done.fidelity, done.prediction = vdir, fid, table
    return done


# -- simulate: a request log (or a trace directory) on a fleet --------------------------------------------

def read_simulation_log(log: str | os.PathLike, fleet: Fleet, *, fmt: str = "auto",
                        block_size: int | None = None, limit: int | None = None, seed: int = 0,
                        forced_placement: bool = False, sessions: int | None = None,
                        session_rate: float | None = None) -> tuple[RequestLog, np.ndarray | None]:
    """The request log ``simulate`` serves: a trace directory (its requests in arrival order) or a
    request log of any format :func:`replay.simulate.formats.read_log` reads (``fmt``; ``sessions``
    and ``session_rate`` for agentic sessions), and with ``forced_placement`` (a trace directory only) each request's
    prefill worker of ``fleet`` where production placed it (-1: the router decides)."""
    if is_trace_dir(log):
        rec = read_trace_log(log, block_size=block_size, limit=limit)
        if not forced_placement:
            return rec.log, None
        if len(rec.urls) != len(fleet.prefill):
            raise ParamError("forced_placement", "needs a fleet of the trace's prefill workers: the trace has "
                             f"{len(rec.urls)} prefill workers, the fleet {len(fleet.prefill)}")
        if not (rec.placement >= 0).any():
            raise ParamError("forced_placement", f"needs the trace's selected_worker: {log} records none")
        return rec.log, np.where(rec.placement >= 0, np.array(fleet.prefill)[rec.placement], -1)
    if forced_placement:
        raise ParamError("forced_placement", "needs a trace directory as LOG")
    return read_log(log, fmt=fmt, seed=seed, block_size=block_size, limit=limit, sessions=sessions,
                    session_rate=session_rate), None


def plan_fleets(req_log: RequestLog, fleet: Fleet, fleet_path: str | os.PathLike | None,
                fleet_overrides: dict[str, Any], grid: Grid, workers: Sequence[int] | None,
                dp_sizes: Sequence[int] | None, scales: Sequence[float] | None, out: str | os.PathLike, *,
                per_dp_rank: bool = False, seeds: Sequence[int] | None = None,
                progress: Progress | None = None, **grid_kw: Any) -> tuple[list[FleetPoint], pl.DataFrame]:
    """A capacity plan: ``grid`` on the fleet of ``fleet_path`` resized to every (workers, dp_size)
    and traffic level (``scales``; ``None`` lists take ``fleet``'s own), into ``out``.  Every fleet
    is built (and a bad one refused) before the first simulation.  Returns the points and the plan
    table."""
    progress = progress or _no_progress
    base_dp = sorted({w.dp_size for w in fleet.workers if w.role != "decode"})
    points = fleet_points(workers or [len(fleet.prefill)], dp_sizes or base_dp[:1], scales or [1.0])

    def make_fleet(w: int, d: int) -> Fleet:
        return load_fleet(fleet_path, workers=w, dp_size=d, resize=True, **fleet_overrides)

    for p in points:  # refuse a bad fleet before the first simulation
        make_fleet(p.workers, p.dp_size)
    n_jobs = len(points) * len(grid.configs) * (len(seeds) if seeds else 1)
    with progress(n_jobs, "planning") as step:
        table = plan_grid(req_log, make_fleet, grid, points, out, per_dp_rank=per_dp_rank,
                          seeds=seeds, progress=step, **grid_kw)
    return points, table


@dataclass
class Simulated:
    """What :func:`simulate_log` made: ``kind`` is ``"plan"`` (a capacity plan: ``points`` and
    the plan ``table``), ``"one"`` (one config: ``result``, and the capture formats in
    ``capture_out`` when asked) or ``"grid"`` (a grid of configs: the summary ``table``)."""

    kind: str
    log: RequestLog
    fleet: Fleet
    grid: Grid
    seeds: list[int] | None
    out: Path
    table: pl.DataFrame | None = None
    points: list[FleetPoint] = field(default_factory=list)
    result: SimResult | None = None
    capture_out: Path | None = None


def simulate_log(log: str | os.PathLike, out: str | os.PathLike, grid: Grid, *,
                 fleet_path: str | os.PathLike | None = None, workers: Sequence[int] | None = None,
                 dp_sizes: Sequence[int] | None = None, scales: Sequence[float] | None = None,
                 per_dp_rank: bool = False, fleet_overrides: dict[str, Any] | None = None,
                 fmt: str = "auto", block_size: int | None = None, sessions: int | None = None,
                 session_rate: float | None = None, limit: int | None = None,
                 publish_interval_ms: int | None = None, forced_placement: bool = False,
                 index_lag_ms: int = 0, freshness_ms: int = 5000, seed: int = 0, seeds: str | None = None,
                 threads: int | None = None, executor: str = "local", ray_address: str | None = None,
                 ray_cpus: int | None = None, ray_retries: int = 2, resume: bool = False,
                 capture_out: str | os.PathLike | None = None,
                 force: bool = False, progress: Progress | None = None,
                 on_log: Callable[[RequestLog, Fleet], None] | None = None) -> Simulated:
    """What ``simulate`` does: serve the request log (or trace directory) ``log`` on the fleet
    of ``fleet_path`` (``fleet_overrides``: per-rank rates and sizes that override it) under
    ``grid`` into ``out``.

    Lists of ``workers`` / ``dp_sizes`` (more than one value) or any ``scales`` make a
    capacity plan (:func:`plan_fleets`); otherwise one config writes one simulated trace
    (with ``capture_out``, also the capture formats ``import`` reads) and several write a
    closed-loop grid, each config under ``seeds`` (a count or a comma list) when given.
    Grids and plans run on one pool (``executor`` local or ray, ``ray_retries`` per task) and
    ``resume`` goes on from an interrupted one (:mod:`replay.simulate.batch`).
    ``on_log`` is called once the log is read, before any simulation (the command warns there)."""
    progress = progress or _no_progress
    overrides = dict(fleet_overrides or {})
    planning = scales is not None or any(v is not None and len(v) > 1 for v in (workers, dp_sizes))
    rundir.guard([(out, PLAN_KIND if planning else "sim"),
                  *([(capture_out, CAPTURE)] if capture_out else [])],
                 inputs=[log, fleet_path], force=force)
    seed_list = parse_seeds(seeds, seed)
    check_simulations(len(grid.configs), len(seed_list or []),
                      math.prod(len(v or [1]) for v in (workers, dp_sizes, scales)) if planning else 1)
    fleet = load_fleet(fleet_path, workers=workers[0] if workers else None,
                       dp_size=dp_sizes[0] if dp_sizes else None, resize=planning, **overrides)
    if per_dp_rank and not planning:
        grid = grid.scaled_per_dp_rank(fleet_dp_size([w.dp_size for w in fleet.workers if w.role != "decode"]))
    req_log, placement = read_simulation_log(log, fleet, fmt=fmt, block_size=block_size, limit=limit,
                                             seed=seed, forced_placement=forced_placement, sessions=sessions,
                                             session_rate=session_rate)
    if on_log is not None:
        on_log(req_log, fleet)
    kw: dict[str, Any] = dict(seed=seed, publish_interval_ms=publish_interval_ms, index_lag_ms=index_lag_ms,
                              freshness_ms=freshness_ms, force=force)
    done = Simulated("plan" if planning else "one", req_log, fleet, grid, seed_list, Path(out))
    if planning:
        if placement is not None:
            raise ParamError("forced_placement", "runs the recorded fleet, not a capacity plan")
        if capture_out:
            raise ParamError("capture_out", "writes one simulated run, not a capacity plan")
        done.points, done.table = plan_fleets(req_log, fleet, fleet_path, overrides, grid, workers, dp_sizes,
                                              scales, out, per_dp_rank=per_dp_rank, seeds=seed_list,
                                              progress=progress, threads=threads, executor=executor,
                                              ray_address=ray_address, ray_cpus=ray_cpus,
                                              ray_retries=ray_retries, resume=resume, **kw)
        return done
    if capture_out and (len(grid.configs) != 1 or seed_list is not None):
        raise ParamsError("{capture_out} writes one simulated run: give one config and no {seeds}",
                          "capture_out", "seeds")
    if len(grid.configs) == 1 and seed_list is None:
        if resume:
            raise ParamError("resume", "goes on with a grid or a plan, not one simulation")
        done.result = simulate(req_log, fleet, grid.configs[0], out, placement=placement, grid=grid,
                               cache_log=capture_out is not None, **kw)
        if capture_out:
            with rundir.writing(capture_out), progress(req_log.n_requests, "capture formats") as step:
                write_capture(done.result, req_log, fleet, capture_out, index_lag_ms=index_lag_ms, force=force,
                              progress=step)
            done.capture_out = Path(capture_out)
        return done
    if placement is not None:
        raise ParamError("forced_placement", "runs one config, not a grid")
    done.kind = "grid"
    with progress(len(grid.configs) * (len(seed_list) if seed_list else 1), "simulating") as step:
        done.table = simulate_grid(req_log, fleet, grid, out, threads=threads, seeds=seed_list, progress=step,
                                   executor=executor, ray_address=ray_address, ray_cpus=ray_cpus,
                                   ray_retries=ray_retries, resume=resume, **kw)
    return done
