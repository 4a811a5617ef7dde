"""router-replay: offline trace replay of SGLang's cache-aware prefill routing.

The library API (the CLI is a thin layer over it):

* :func:`load_trace` / :func:`validate_trace` - read and check a trace directory.
* :class:`RouterConfig`, :class:`Grid` - one router configuration, a grid of them.
* :func:`run_sweep` - replay a trace under every config of a grid; returns a
  :class:`SweepResult` (summary table, and the run directory when written).
* :func:`decide_all` - every decision as ``(requests x configs)`` arrays.
* :func:`generate_trace` - a seeded synthetic trace directory.
* :func:`read_decisions` - a run's decisions (either layout) as one row per (request, config).

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
    from replay.api import run_sweep
    from replay.config import Grid, RouterConfig
    from replay.errors import ConfigError, ParamError, ReplayError
    from replay.runs.decisions import read_decisions
    from replay.sweep.engine import decide_all, iter_chunks
    from replay.sweep.run import SweepResult
    from replay.trace import Trace, TraceError, load_trace, validate_trace
    from replay.trace.synthetic import generate_trace

# public name -> the module that defines it
_LAZY = {
    "Grid": "config", "RouterConfig": "config",
    "read_decisions": "runs.decisions",
    "decide_all": "sweep.engine", "iter_chunks": "sweep.engine",
    "ConfigError": "errors", "ParamError": "errors", "ReplayError": "errors",
    "generate_trace": "trace.synthetic",
    "SweepResult": "sweep.run", "run_sweep": "api",
    "Trace": "trace", "TraceError": "trace", "load_trace": "trace", "validate_trace": "trace",
}

__all__ = [
    "ConfigError", "Grid", "ParamError", "ReplayError", "RouterConfig", "SweepResult", "Trace", "TraceError",
    "decide_all", "generate_trace", "iter_chunks", "load_trace", "read_decisions", "run_sweep",
    "validate_trace",
]


def __getattr__(name: str) -> Any:
    """The public names on first use; ``replay.sweep.engine`` and the other submodules too."""
    mod = _LAZY.get(name)
    if mod is not None:
        value = getattr(importlib.import_module(f".{mod}", __name__), name)
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
