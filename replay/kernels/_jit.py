"""numba options decided in one place.

``cache=True`` keeps the compiled kernels on disk so a second start of the CLI
does not compile again.  No fastmath: the kernels must reproduce the
pure-Python reference bit for bit, including float comparisons.

numba's on-disk cache only notices edits to the file a function lives in, not
to the kernels it calls from other files, so a stale kernel could survive an
edit.  The cache therefore lives in a folder named after a hash of every
kernel source (and the label codes and decision columns they freeze): any edit starts a fresh
cache.  ``NUMBA_CACHE_DIR`` still wins when a user sets it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba

_HERE = Path(__file__).resolve().parent


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(_HERE.glob("*.py")) + [_HERE.parent / "labels.py", _HERE.parent / "fields.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(numba.__version__.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the compiled kernels are cached."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "router-replay" / "numba" / _source_hash()


if not os.environ.get("NUMBA_CACHE_DIR"):
    numba.config.CACHE_DIR = str(cache_dir())

JIT = dict(cache=True, nogil=True, boundscheck=False)

njit = numba.njit(**JIT)
njit_parallel = numba.njit(parallel=True, **JIT)
