"""Fixtures of the speed benchmarks (the first speed floors).

Not part of the normal test run (``testpaths = ["tests"]`` and
``--benchmark-disable`` in pyproject); run on purpose with::

    python -m pytest benches --benchmark-enable

The 1M-request bench trace is generated once into
``$ROUTER_REPLAY_BENCH_DIR`` (default ``~/.cache/router-replay``) and reused.
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _support as S  # noqa: E402 - importable once sys.path holds benches/


@pytest.fixture(scope="session")
def bench_trace_dir() -> Path:
    return S.ensure_trace(log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="session")
def warmed() -> float:
    """Kernels compiled (or loaded from numba's cache) on the small sample trace."""
    return S.warm_up(S.grid("mixed").configs)


@pytest.fixture(scope="session")
def bench_trace(bench_trace_dir, warmed):
    from replay.trace import load_trace

    tr = load_trace(bench_trace_dir)
    yield tr
    del tr
    gc.collect()


@pytest.fixture(scope="session")
def subtraces(bench_trace) -> dict:
    return S.subtraces(bench_trace)


@pytest.fixture(scope="session")
def work_dir():
    S.bench_root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-work-", dir=S.bench_root()) as d:
        yield Path(d)


def stat(benchmark, name: str = "min") -> float | None:
    """A timing statistic of a finished benchmark (None when benchmarks are disabled)."""
    st = getattr(benchmark, "stats", None)
    if st is None:
        return None
    return getattr(st.stats, name, None) if hasattr(st, "stats") else st.get(name)


@pytest.fixture
def report(request, benchmark):
    """``report(**figures)``: record figures in ``benchmark.extra_info`` (kept by
    ``--benchmark-json``) and in the summary printed at the end of the run."""

    def add(**figures):
        benchmark.extra_info.update(figures)
        S.REPORT.setdefault(request.node.name, {}).update(figures)

    return add


def _fmt(v):
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


def pytest_terminal_summary(terminalreporter):
    if not S.REPORT:
        return
    tr = terminalreporter
    tr.section("router-replay bench figures (extra_info)")
    for name, figures in S.REPORT.items():
        tr.write_line(name)
        for k, v in figures.items():
            tr.write_line(f"    {k}: {_fmt(v)}")
