"""router-replay: offline trace replay of SGLang's cache-aware prefill routing.

The library API (the CLI is a thin layer over it):

* :func:`load_trace` / :func:`validate_trace` - read and check a trace directory.
* :class:`RouterConfig`, :class:`Grid` - one router configuration, a grid of them.
* :func:`run_sweep` - replay a trace under every config of a grid; returns a
  :class:`SweepResult` (summary table, and the run directory when written).
* :func:`decide_all` - every decision as ``(requests x configs)`` arrays.
* :func:`generate_trace` - a seeded synthetic trace directory.
* :func:`read_decisions` - a run's decisions (either layout) as one row per (request, config).
"""

# the one place the version is written (pyproject.toml reads it); set before the imports below,
# whose modules import it
__version__ = "0.1.0"

from .config import Grid, RouterConfig  # noqa: E402 - after __version__
from .decision_store import read_decisions  # noqa: E402 - after __version__
from .engine import decide_all, iter_chunks  # noqa: E402 - after __version__
from .errors import ConfigError, ReplayError  # noqa: E402 - after __version__
from .generate import generate_trace  # noqa: E402 - after __version__
from .sweep import SweepResult, run_sweep  # noqa: E402 - after __version__
from .trace import Trace, TraceError, load_trace, validate_trace  # noqa: E402 - after __version__

__all__ = [
    "ConfigError", "Grid", "ReplayError", "RouterConfig", "SweepResult", "Trace", "TraceError",
    "decide_all", "generate_trace", "iter_chunks", "load_trace", "read_decisions", "run_sweep",
    "validate_trace",
]
