"""A numba typed list a kernel filled, as an array.

``np.asarray`` of a typed list reads it item by item through Python (about a
microsecond an item); a kernel copies it at memory speed.
"""

from __future__ import annotations

import numpy as np

from replay.kernels._jit import njit


@njit
def int64_array_nb(items):
    """The typed list of int64 ``items`` as an int64 array (same order)."""
    out = np.empty(len(items), dtype=np.int64)
    for i in range(len(items)):
        out[i] = items[i]
    return out
