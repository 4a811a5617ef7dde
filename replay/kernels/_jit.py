"""numba options decided in one place.

``cache=True`` keeps the compiled kernels on disk so a second start of the CLI
does not compile again.  No fastmath: the kernels must reproduce the
pure-Python reference bit for bit, including float comparisons.

numba's on-disk cache only notices edits to the file a function lives in, not
to the kernels it calls from other files, so a stale kernel could survive an
edit.  The cache therefore lives in a folder named after a hash of every
kernel source (and the label codes and decision columns they freeze): any edit starts a fresh
cache.  A user's ``NUMBA_CACHE_DIR`` says where that folder goes: it is the
parent of the hash folder, never the cache itself (one cache folder kept
across edits once ran a stale kernel and crashed the process).

What a first start compiles (issue 13): every kernel is plain ``njit``; the
engine runs a chunk's blocks on its own threads (``engine.run_blocks``; the
kernels release the GIL) instead of numba's ``parallel=True``, whose parfor
passes made the grid kernel's compile about a quarter longer; and a kernel
calling another compiles one specialization per argument type, never one per
constant value (:class:`_Dispatcher`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba
from numba.core import types as _types
from numba.core.registry import CPUDispatcher as _CPUDispatcher

_HERE = Path(__file__).resolve().parent


def _source_hash() -> str:
    h = hashlib.sha256()
    kernels = [p for p in sorted(_HERE.glob("*.py")) if p.name != "warm.py"]   # warm.py: orchestration only
    for path in kernels + [_HERE.parent / "labels.py", _HERE.parent / "fields.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(numba.__version__.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the compiled kernels are cached: a folder per kernel-source hash,
    under ``NUMBA_CACHE_DIR`` when it is set, else under the user's cache folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / _source_hash()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "router-replay" / "numba" / _source_hash()


numba.config.CACHE_DIR = str(cache_dir())


def _arraymath_without_scipy() -> None:
    """Import numba's ``np`` function registry without importing scipy.

    numba imports ``numba.np.arraymath`` on its first compile or cache load,
    and that module asks once whether BLAS is there by importing
    ``scipy.linalg`` (about 0.4 s of a 1.9 s cached start).  The answer is used
    only to pick the inner product of ``np.correlate``/``np.convolve`` (which
    no kernel calls); ``np.dot`` and ``np.linalg`` check BLAS again, and import
    scipy, when a kernel uses them.  So the module is imported here with that
    one check answering "no BLAS".
    """
    import sys

    if "numba.np.arraymath" in sys.modules or numba.config.DISABLE_JIT:
        return
    from numba.np import linalg

    real = getattr(linalg, "ensure_blas", None)
    if real is None:        # another numba: leave its import alone (the probe only costs time)
        return

    def no_blas():
        raise ImportError("not asked: see replay/kernels/_jit.py")

    linalg.ensure_blas = no_blas
    try:
        from numba.np import arraymath
    finally:
        linalg.ensure_blas = real
    arraymath.ensure_blas = real


_arraymath_without_scipy()

JIT = dict(cache=True, nogil=True, boundscheck=False)

# ``{id(dispatcher): wait}``: called once, before a kernel's call to that
# dispatcher is typed (``warm.py``: the first start's other process compiles it
# into the on-disk cache; numba then loads it from there instead of compiling it
# a second time here)
BEFORE_TYPING: dict = {}

class _Dispatcher(_CPUDispatcher):
    """numba's dispatcher, except that a call from another kernel compiles one
    specialization per argument *type*, not per constant value.

    numba types a constant argument (``f(x, 0)``, ``f(a, True)``) as a literal
    and compiles the callee again for each value: the sweep's kernels had 27
    such extra specializations (``cmp_tuple_nb(.., -1)``, ``_tournament_cmp(..,
    True)``, ...), each a full compile.  A kernel's result never depends on
    being specialized (LLVM still propagates the constant when it inlines the
    callee); only compile time does.
    """

    def get_call_template(self, args, kws):
        if BEFORE_TYPING:
            wait = BEFORE_TYPING.pop(id(self), None)
            if wait is not None:
                wait()
        return super().get_call_template(tuple(_types.unliteral(a) for a in args),
                                         {k: _types.unliteral(v) for k, v in kws.items()})


def njit(fn):
    """``numba.njit`` with the options above and :class:`_Dispatcher`."""
    dispatcher = numba.njit(**JIT)(fn)
    if isinstance(dispatcher, _CPUDispatcher):   # not under NUMBA_DISABLE_JIT=1 (the plain-Python runs)
        dispatcher.__class__ = _Dispatcher
    return dispatcher


class _InnerDispatcher(_Dispatcher):
    """A kernel compiled without the wrappers that let Python call it: only
    other kernels call it.  A Python call is a TypeError (numba would call a
    missing wrapper and crash), so no overload goes into the table Python
    calls are matched against."""

    def add_overload(self, cres):
        self.overloads[tuple(cres.signature.args)] = cres

    def _compile_for_args(self, *args, **kws):
        raise TypeError(f"{self.py_func.__name__} is compiled for calls from other kernels only "
                        "(replay/kernels/_jit.py: njit_inner)")


def njit_inner(fn):
    """``njit`` for a kernel that only other kernels call: numba generates no
    Python or C-callable wrapper for it (the largest helpers take named tuples
    of a dozen arrays, whose unboxing code was compiled and optimised for
    nothing)."""
    dispatcher = numba.njit(no_cpython_wrapper=True, no_cfunc_wrapper=True, **JIT)(fn)
    if isinstance(dispatcher, _CPUDispatcher):   # not under NUMBA_DISABLE_JIT=1
        dispatcher.__class__ = _InnerDispatcher
    return dispatcher
