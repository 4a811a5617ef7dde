"""The public API's functions that join layers: what a command does, as one call.

A layer below never imports one above it; where a workflow needs both (a
sweep that also writes its report page) the joining is done here, at the top,
by passing the upper layer's function down.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from replay.config import Grid
from replay.report.run_page import build_report
from replay.runs import rundir
from replay.runs.names import TRACE_JSON
from replay.sweep import run as _sweep
from replay.trace import Trace
from replay.trace.synthetic import generate_trace, generate_trace_set


def run_sweep(trace: Trace | str | os.PathLike, grid: Grid | Mapping[str, Any] | None = None, *,
              report: bool = True, **options: Any) -> _sweep.SweepResult:
    """Replay ``trace`` under every config of ``grid``; with ``out``, write the run directory
    and (unless ``report=False``) its ``report.html``.  The other options are those of
    :func:`replay.sweep.run.run_sweep`."""
    return _sweep.run_sweep(trace, grid, report=build_report if report else None, **options)


def generate_trace_dir(out_dir: str | os.PathLike, *, n_requests: int = 3000, n_workers: int = 8, dp_size: int = 2,
                       sample_interval_ms: int = 100, max_matches: int = 8, seed: int = 0,
                       rate_per_s: float | None = None, router_inflight: bool = True,
                       partition_s: int | None = None, force: bool = False,
                       progress: Callable[[int], None] | None = None) -> dict:
    """What ``router-replay generate`` does: a seeded synthetic trace (with ``partition_s``, a trace
    set of that many seconds per file, ``progress`` told the partitions done) built beside
    ``out_dir``, marked in ``trace.json`` as generated (the only trace ``force`` replaces) and
    swapped in whole, so an interrupted or failed run leaves the old trace as it was.  Returns
    the generator's facts."""
    rundir.guard([(out_dir, "trace")], force=force)
    params: dict[str, Any] = dict(n_requests=n_requests, n_workers=n_workers, dp_size=dp_size,
                                  sample_interval_ms=sample_interval_ms, max_matches=max_matches, seed=seed,
                                  rate_per_s=rate_per_s, router_inflight=router_inflight)
    tmp = rundir.partial_beside(out_dir)
    try:
        with rundir.writing(out_dir):
            if partition_s is not None:
                info = generate_trace_set(tmp, partition_s=partition_s, progress=progress, **params)
            else:
                info = generate_trace(tmp, **params)
            marker = {"source": f"{rundir.GENERATE_SOURCE} (synthetic, seed {seed})",
                      "extra": {"requests": n_requests, "workers": n_workers, "dp_size": dp_size,
                                "sample_interval_ms": sample_interval_ms, "max_matches": max_matches,
                                "seed": seed}}
            (Path(tmp) / TRACE_JSON).write_text(json.dumps(marker, indent=2) + "\n")
            rundir.move_into_place(tmp, out_dir)
        tmp = None
    finally:
        rundir.discard(tmp)
    return info
