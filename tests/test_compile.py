"""What a sweep compiles (the first start): one specialization per kernel.

numba compiles a kernel again for every new combination of argument types,
and a read-only array is another type than a writable one.  The loader hands
over some columns zero-copy (read-only) and converts others, differently from
trace to trace, so the engine passes every input read-only
(``engine.frozen``).  These tests replay two real traces whose loaded columns
differ in that way and hold the grid kernels to the one signature
``engine.kernel_signatures`` builds without a trace (the signature a sweep
compiles in the background while it reads the trace).
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.config import Grid
from replay.kernels import one_pass
from replay.sweep import engine
from replay.trace import load_trace
from replay.trace.synthetic import generate_trace

SAMPLE = "traces/sample"


def _writable(trace) -> tuple[bool, ...]:
    return tuple(bool(c.flags.writeable) for c in engine.load_columns(trace))


def _replay(trace) -> None:
    grid = Grid({"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"})
    configs = grid.resolve(list(trace.fleet_dp_sizes().values())).configs
    for _ in engine.iter_chunks(trace, configs, keep=True, totals=engine.new_totals(len(configs))):
        pass


def test_two_trace_layouts_compile_one_signature(tmp_path):
    generate_trace(tmp_path / "gen", n_requests=300, n_workers=4, dp_size=2, seed=3)
    # files of many row groups (as a large trace has) load as converted, writable columns
    for name in ("requests.parquet", "loads.parquet"):
        path = tmp_path / "gen" / name
        pq.write_table(pq.read_table(path), path, row_group_size=50)
    sample, generated = load_trace(SAMPLE), load_trace(tmp_path / "gen")
    # the premise: the loader's read-only columns differ between the two traces
    assert _writable(sample) != _writable(generated)
    _replay(sample)
    _replay(generated)
    for kernel, sig in engine.kernel_signatures().items():
        assert kernel.signatures == [sig], kernel.py_func.__name__


def test_kernel_inputs_are_read_only_views():
    trace = load_trace(SAMPLE)
    cols = engine.load_columns(trace)
    frozen = engine.frozen(cols)
    assert type(frozen) is type(cols)
    for before, after in zip(cols, frozen, strict=True):
        assert not after.flags.writeable
        assert np.shares_memory(before, after) or before.size == 0   # a view, not a copy
        assert np.array_equal(before, after)


def test_compile_in_background_then_sweep(tmp_path):
    """The sweep's background compile and the replay's own call meet on one
    specialization (the replay waits for the compile, never makes a second)."""
    thread = engine.compile_in_background()
    assert isinstance(thread, threading.Thread)
    result = CliRunner().invoke(main, ["sweep", SAMPLE, "--out", str(tmp_path / "run"), "-q",
                                       "--worker-queue-limit", "none,4", "--no-report"])
    assert result.exit_code == 0, result.output
    thread.join()
    for kernel, sig in engine.kernel_signatures().items():
        assert kernel.signatures == [sig], kernel.py_func.__name__


def test_inner_kernel_refuses_a_python_call():
    """A kernel compiled without its Python wrapper (``_jit.njit_inner``) is a
    TypeError when called from Python, before and after the grid kernel used it."""
    for _ in range(2):
        with pytest.raises(TypeError, match="other kernels only"):
            one_pass._decide_request(*([0] * 15))
        _replay(load_trace(SAMPLE))
