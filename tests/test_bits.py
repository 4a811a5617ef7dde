"""The bit-set helpers of the grid pass's sampler tier (``_jit.popcount``,
``_jit.trailing_zeros``, ``decide.select_bit_nb``), compiled, against plain
Python's count of the bits of the same 64-bit words."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.kernels import decide
from replay.kernels._jit import njit, popcount, trailing_zeros


@njit
def _bits_of(x, out):
    """popcount, trailing zeros and every select of ``x``, compiled (``out`` >= 66 long)."""
    n = popcount(x)
    out[0] = n
    out[1] = trailing_zeros(x) if x != 0 else -1
    for t in range(n):
        out[2 + t] = decide.select_bit_nb(x, t)
    return n


words = st.one_of(st.integers(-(2**63), 2**63 - 1),
                  st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63), 0xFFFFFFFF, 1 << 32, 0xFF00FF00FF00FF00 - 2**64]),
                  st.lists(st.integers(0, 63), max_size=8).map(lambda bs: sum({1 << b for b in bs}) - (
                      2**64 if 63 in bs else 0)))


@settings(deadline=None)  # the first example compiles
@given(words)
def test_bit_helpers_equal_plain_python(x):
    u = x & (2**64 - 1)
    positions = [b for b in range(64) if u >> b & 1]
    out = np.full(66, -7, dtype=np.int64)
    n = _bits_of(np.int64(x), out)
    assert n == len(positions)
    assert out[1] == (positions[0] if positions else -1)
    assert out[2:2 + n].tolist() == positions
