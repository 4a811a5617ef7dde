"""router-replay: offline trace replay of SGLang's cache-aware prefill routing.

The library the commands are built on: each command parses its flags, calls
these and prints (docs/api.md lists every name with the command it serves).

* Traces: :func:`load_trace`, :func:`validate_trace`, :func:`read_trace_info`,
  :func:`request_log`, :func:`generate_trace`.
* Sweeps: :class:`RouterConfig`, :class:`Grid`, :func:`run_sweep` (a
  :class:`SweepResult`), :func:`decide_all`, :func:`iter_chunks`.
* Runs and answers: :func:`load_run`, :func:`read_decisions`,
  :func:`compare_runs`, :func:`write_comparison`, :func:`make_baseline`,
  :func:`write_baseline`, :func:`load_baseline`, :func:`check_run`,
  :func:`recommend`, :func:`load_closed_loop`, :func:`recommend_closed_loop`,
  :func:`read_plan`, :func:`answer_plan`, :func:`recommend_dir` (any of the three, told apart).
* Closed loop: :func:`load_fleet`, :func:`read_log`, :func:`read_simulation_log`,
  :func:`simulate`, :func:`simulate_grid`, :func:`simulate_log`, :func:`calibrate_trace`, :func:`plan_fleets`.
* Capture: :class:`Recorder`, :class:`ImportSpec`, :func:`import_capture`.
* Errors: :class:`ReplayError` (one line), :class:`ParamError` (names the
  parameter), :class:`ParamsError` (names several), :class:`ConfigError`, :class:`TraceError`.

The names are imported on first use (PEP 562), so ``import replay`` (and every
CLI start, ``--help`` included) does not import numba, polars or the engine
until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# the one place the version is written (pyproject.toml reads it)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from replay.analysis.closed_loop import load_grid as load_closed_loop
    from replay.analysis.closed_loop import recommend as recommend_closed_loop
    from replay.analysis.plan import plan as answer_plan
    from replay.analysis.plan import read_plan
    from replay.analysis.recommend import recommend_dir
    from replay.analysis.runs import (
        check_run,
        compare_runs,
        load_baseline,
        make_baseline,
        recommend,
        write_baseline,
        write_comparison,
    )
    from replay.api import generate_trace_dir, run_sweep
    from replay.capture.importer import ImportSpec, import_capture
    from replay.capture.recorder import Recorder
    from replay.config import Grid, RouterConfig
    from replay.errors import ConfigError, ParamError, ParamsError, ReplayError
    from replay.report.run_page import write_report
    from replay.runs.decisions import read_decisions
    from replay.runs.rundir import load_run
    from replay.simulate import load_fleet, read_log, simulate, simulate_grid
    from replay.simulate.workflows import calibrate_trace, plan_fleets, read_simulation_log, simulate_log
    from replay.sweep.engine import decide_all, iter_chunks
    from replay.sweep.run import SweepResult
    from replay.trace import Trace, TraceError, load_trace, read_trace_info, request_log, validate_trace
    from replay.trace.synthetic import generate_trace

# public name -> the module that defines it ("module:attribute" where the public name differs)
_LAZY = {
    "Grid": "config", "RouterConfig": "config",
    "ConfigError": "errors", "ParamError": "errors", "ParamsError": "errors",
    "ReplayError": "errors",
    "Trace": "trace", "TraceError": "trace", "load_trace": "trace", "validate_trace": "trace",
    "read_trace_info": "trace", "request_log": "trace", "generate_trace": "trace.synthetic",
    "decide_all": "sweep.engine", "iter_chunks": "sweep.engine",
    "SweepResult": "sweep.run", "run_sweep": "api", "generate_trace_dir": "api", "write_report": "report.run_page",
    "load_run": "runs.rundir", "read_decisions": "runs.decisions",
    "compare_runs": "analysis.runs", "write_comparison": "analysis.runs", "make_baseline": "analysis.runs",
    "write_baseline": "analysis.runs", "load_baseline": "analysis.runs", "check_run": "analysis.runs",
    "recommend": "analysis.runs",
    "load_closed_loop": "analysis.closed_loop:load_grid",
    "recommend_closed_loop": "analysis.closed_loop:recommend",
    "read_plan": "analysis.plan", "answer_plan": "analysis.plan:plan", "recommend_dir": "analysis.recommend",
    "load_fleet": "simulate", "read_log": "simulate", "simulate": "simulate", "simulate_grid": "simulate",
    "read_simulation_log": "simulate.workflows", "calibrate_trace": "simulate.workflows",
    "plan_fleets": "simulate.workflows", "simulate_log": "simulate.workflows",
    "Recorder": "capture.recorder", "ImportSpec": "capture.importer", "import_capture": "capture.importer",
}

__all__ = [
    "ConfigError", "Grid", "ImportSpec", "ParamError", "ParamsError", "Recorder", "ReplayError", "RouterConfig",
    "SweepResult", "Trace", "TraceError", "answer_plan", "calibrate_trace", "check_run", "compare_runs",
    "decide_all", "generate_trace", "generate_trace_dir", "import_capture", "iter_chunks", "load_baseline",
    "load_closed_loop",
    "load_fleet", "load_run", "load_trace", "make_baseline", "plan_fleets", "read_decisions", "read_log",
    "read_plan", "read_simulation_log", "read_trace_info", "recommend", "recommend_closed_loop", "recommend_dir",
    "request_log", "run_sweep", "simulate", "simulate_grid", "simulate_log", "validate_trace", "write_baseline",
    "write_comparison", "write_report",
]


def __getattr__(name: str) -> Any:
    """The public names on first use; ``replay.sweep.engine`` and the other submodules too."""
    where = _LAZY.get(name)
    if where is not None:
        mod, _, attr = where.partition(":")
        value = getattr(importlib.import_module(f".{mod}", __name__), attr or name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
