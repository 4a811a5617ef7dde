"""numba options decided in one place.

``cache=True`` keeps the compiled kernels on disk so a second start of the CLI
does not compile again.  No fastmath: the kernels must reproduce the
pure-Python reference bit for bit, including float comparisons.
"""

from __future__ import annotations

import numba

JIT = dict(cache=True, nogil=True, boundscheck=False)

njit = numba.njit(**JIT)
njit_parallel = numba.njit(parallel=True, **JIT)
