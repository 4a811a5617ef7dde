"""Closed-loop workflows as one call each: what ``calibrate`` and ``simulate`` do, without the CLI.

The command parses its flags, calls one function here and prints what it returns; the hooks
(``on_fit``, ``on_fidelity``, ``progress``) let it print while the work goes on.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.config import Grid
from replay.errors import ParamError, ReplayError
from replay.runs import rundir
from replay.simulate.calibrate import Calibration, refine_decode
from replay.simulate.calibrate import calibrate as fit_fleet
from replay.simulate.fidelity import FIDELITY_JSON, FIDELITY_TOOL, FLEET_MARKER, Fidelity, recorded_seed
from replay.simulate.fidelity import validate as validate_fleet
from replay.simulate.fleet import Fleet, load_fleet
from replay.simulate.formats import read_log
from replay.simulate.logs import RequestLog
from replay.simulate.plan import FleetPoint, fleet_points, plan_grid
from replay.simulate.seeds import parse_seeds
from replay.simulate.sim import simulate_grid
from replay.simulate.tracelog import RecordedTrace, is_trace_dir, read_trace_log

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


def _register_calibrate_outputs() -> None:
    """The output kinds of :func:`calibrate`, registered with the guard before it is asked, so
    ``force`` replaces only a validation directory or fleet file calibrate wrote."""

    def fidelity_dir(path: Path) -> str | None:
        rec = rundir.read_json(path / FIDELITY_JSON)
        if rec is None or rec.get("tool") != FIDELITY_TOOL:
            return rundir.unmarked(path, FIDELITY_JSON)
        extra = sorted(n for n in path.iterdir() if n.name not in
                       {FIDELITY_JSON, "forced", "router", "prediction"}
                       and not re.fullmatch(r"\.?.*\.partial-.*", n.name))
        return f"{extra[0]} was not written by router-replay" if extra else None

    def fleet_file(path: Path) -> str | None:
        try:
            head = path.read_bytes()[:200].decode("utf-8", "replace")
        except OSError as err:
            return f"unreadable ({err.strerror})"
        return None if head.startswith(FLEET_MARKER) else "not a fleet file written by router-replay calibrate"

    rundir.register_kind("fidelity", "validation directory", is_dir=True, recognise=fidelity_dir)
    rundir.register_kind("fleet", "fitted fleet file", is_dir=False, recognise=fleet_file)


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
    if fleet_path.exists() and not force:
        raise ReplayError(f"{fleet_path}: exists (use --force to replace it)")
    if validate_dir is not None:
        v, t = Path(validate_dir).resolve(), Path(trace_dir).resolve()
        if v == t or v in t.parents or t in v.parents:
            raise ParamError("validate_dir", f"{validate_dir}: overlaps the trace {trace_dir}; "
                             "give a directory outside it", flag="--validate")
        if v == fleet_path.resolve().parent or v in fleet_path.resolve().parents:
            raise ParamError("validate_dir", f"{validate_dir}: would hold the fleet file {out}; "
                             "write the fleet file elsewhere", flag="--validate")
        rundir.refuse_existing(Path(validate_dir), force, "validation directory")
    _register_calibrate_outputs()
    rundir.guard([(out, "fleet"), (validate_dir, "fidelity")], inputs=[trace_dir], force=force)
    try:
        parse_seeds(seeds, 0)     # refused now, not after the fit and the validation
    except ValueError as err:
        raise ReplayError(str(err)) from None
    rec = read_trace_log(trace_dir, block_size=block_size)
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
            with progress(2, "validating") as step:
                fid = validate_fleet(rec, fleet, seed=seed, freshness_ms=freshness_ms, out_dir=tmp, force=True,
                                     progress=step)
            fid.write(tmp)
            if on_fidelity is not None:
                on_fidelity(fid)
            table = None
            if grid is not None:
                try:
                    seed_list = parse_seeds(seeds, fid.seed)
                except ValueError as err:
                    raise ReplayError(str(err)) from None
                n = len(grid.configs) * (len(seed_list) if seed_list else 1)
                with progress(n, "simulating") as step:
                    table = simulate_grid(rec.log, fleet, grid, tmp / "prediction", seed=fid.seed,
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
