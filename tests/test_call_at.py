"""A kernel calling another through its address (the first start).

The grid kernel calls ``_decide_request`` through ``_jit.call_at`` instead of
linking it into its own module, so the two compile independently (on a first
start, in two processes).  Held here, with real compiled kernels: the call
gives the callee's result and passes its exceptions on; a link made for
another signature raises instead of calling with the wrong layout; a warm
start finds ``_decide_request``'s argument types beside the cache, and one
whose file there is unreadable builds them and decides the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numba
import numpy as np
import polars as pl
import pytest
from numba.core import types

from replay.kernels import _jit

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "sample"

pytestmark = pytest.mark.skipif(numba.config.DISABLE_JIT, reason="links compiled kernels")


@numba.njit
def _scaled_sum(values, scale):
    if scale < 0:
        raise ValueError("negative scale")
    total = 0.0
    for v in values:
        total += v * scale
    return total


_SCALED_SUM_AT = _jit.call_at("_scaled_sum", _scaled_sum, types.float64)


@numba.njit
def _twice(link, values, scale):
    return _SCALED_SUM_AT(link, (values, scale)) + _SCALED_SUM_AT(link, (values, scale))


_ARGS = (types.Array(types.float64, 1, "C"), types.int64)


def test_the_call_gives_the_callees_result():
    link = _jit.link_to(_scaled_sum, _ARGS)
    values = np.array([1.5, 2.0, -0.25])
    assert _twice(link, values, 3) == 2 * _scaled_sum(values, 3)


def test_the_callees_exception_reaches_the_caller():
    link = _jit.link_to(_scaled_sum, _ARGS)
    with pytest.raises(ValueError, match="negative scale"):
        _twice(link, np.ones(2), -1)


def test_a_link_for_another_signature_raises():
    """The callee compiled for int64 scale, the caller passes float64: the
    fingerprint differs, and the call raises rather than crash."""
    link = _jit.link_to(_scaled_sum, (types.Array(types.float64, 1, "C"), types.float64))
    with pytest.raises(RuntimeError, match="another signature"):
        _twice(link, np.ones(2), 2)


Pair = namedtuple("Pair", ("a", "b"))


@_jit.njit(allocates=False)
def _dot_at(pair_at, i):
    pair = pair_at[0]
    return pair.a[i] * pair.b[i]


_DOT_AT = _jit.call_at("_dot_at", _dot_at, types.float64)


@_jit.njit(allocates=False)
def _dot(link, pair):
    at = _jit.address_of(pair)        # once, then every call passes the address
    total = 0.0
    for i in range(pair.a.shape[0]):
        total += _DOT_AT(link, (at, i))
    return total


def test_a_tuple_of_arrays_passed_through_its_address():
    pair = Pair(np.array([1.0, 2.0, 3.0]), np.array([4.0, -5.0, 0.5]))
    link = _jit.link_to(_dot_at, (types.CPointer(numba.typeof(pair)), types.int64))
    assert _dot(link, pair) == float(np.dot(pair.a, pair.b))


def test_only_a_tuple_of_arrays_has_an_address():
    """A boolean's layout in memory differs from its value's: such a tuple is refused when typed."""
    @_jit.njit(allocates=False)
    def boxed(t):
        return _jit.address_of(t)[0][0]

    with pytest.raises(numba.core.errors.TypingError):
        boxed((np.zeros(2), True))


_SWEEP = r"""
import json, sys
from replay.kernels import one_pass
from replay import run_sweep
run_sweep(sys.argv[1], {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"},
          out=sys.argv[2])
d = one_pass._decide_request
print(json.dumps({"decide": [sum(d.stats.cache_hits.values()), sum(d.stats.cache_misses.values())]}))
"""


def _sweep(cache: Path, out: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", _SWEEP, str(SAMPLE), str(out)], cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(cache),
                            "ROUTER_REPLAY_COMPILE_CHILD": "0"},
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_warm_start_reads_or_builds_the_signature(tmp_path):
    cache = tmp_path / "numba"
    cold = _sweep(cache, tmp_path / "cold")
    assert cold["decide"] == [0, 1]                      # compiled here, once
    files = list(cache.rglob("call_at-_decide_request-*.pkl"))
    assert len(files) == 1
    warm = _sweep(cache, tmp_path / "warm")
    assert warm["decide"] == [1, 0]                      # loaded for the types in the file
    files[0].write_bytes(b"not a pickle")                # unreadable: the types are built instead
    built = _sweep(cache, tmp_path / "built")
    assert built["decide"] == [1, 0]
    first = pl.read_parquet(tmp_path / "cold" / "decisions.parquet")
    for run in ("warm", "built"):
        assert pl.read_parquet(tmp_path / run / "decisions.parquet").equals(first)
