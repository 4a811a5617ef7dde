"""``_jit.njit(allocates=False)``: kernels compiled without numba's reference counting.

The grid pass's hot kernels are compiled that way (the counting was
about 45% of the 152-config grid's time).  Held here, on real compiled kernels
in a process of their own (fresh numba cache): such a kernel reads and writes
its caller's arrays and views as usual and leaves Python's reference counts as
they were; one that allocates is refused when it compiles, never run; and a
kernel with counting may call one without, whatever was compiled first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CODE = r"""
import sys
import numpy as np
import numba
from replay.kernels._jit import njit

@njit(allocates=False)
def add_rows(a, out, lo, hi):
    # a view of each row, passed on to another kernel
    for i in range(lo, hi):
        scale_into(a[i], out[i:i + 1])
    return hi - lo

@njit(allocates=False)
def scale_into(row, dst):
    s = 0.0
    for x in row:
        s += x
    dst[0] = s * 2.0

@njit
def counted_caller(a):
    out = np.zeros(a.shape[0])          # this one allocates: it keeps the counting
    add_rows(a, out, 0, a.shape[0])
    return out

@njit(allocates=False)
def allocates_anyway(n):
    return np.zeros(n)

a = np.arange(12.0).reshape(4, 3)
out = np.zeros(4)
before = (sys.getrefcount(a), sys.getrefcount(out))
for _ in range(1000):
    assert add_rows(a, out, 1, 3) == 2
assert (sys.getrefcount(a), sys.getrefcount(out)) == before, "reference counts moved"
assert out.tolist() == [0.0, 24.0, 42.0, 0.0], out.tolist()
got = counted_caller(a)
assert got.tolist() == [6.0, 24.0, 42.0, 60.0], got.tolist()
del got
try:
    allocates_anyway(3)
except numba.core.errors.NumbaError as err:
    print("refused:", type(err).__name__)
else:
    raise AssertionError("a kernel marked allocates=False allocated")
"""


def test_kernels_without_reference_counting(tmp_path):
    script = tmp_path / "kernels_without_counting.py"     # numba caches kernels of a real file only
    script.write_text(_CODE)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(tmp_path / "numba")},
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().startswith("refused:"), p.stdout
