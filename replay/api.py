"""The public API's functions that join layers: what a command does, as one call.

A layer below never imports one above it; where a workflow needs both (a
sweep that also writes its report page) the joining is done here, at the top,
by passing the upper layer's function down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from replay.config import Grid
from replay.report.run_page import build_report
from replay.sweep import run as _sweep
from replay.trace import Trace


def run_sweep(trace: Trace | str | os.PathLike, grid: Grid | Mapping[str, Any] | None = None, *,
              report: bool = True, **options: Any) -> _sweep.SweepResult:
    """Replay ``trace`` under every config of ``grid``; with ``out``, write the run directory
    and (unless ``report=False``) its ``report.html``.  The other options are those of
    :func:`replay.sweep.run.run_sweep`."""
    return _sweep.run_sweep(trace, grid, report=build_report if report else None, **options)
