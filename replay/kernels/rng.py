"""The counter-based generator of docs/replay-model.md ("Randomness")."""

from __future__ import annotations

import numpy as np

from replay.kernels._jit import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)


@njit
def mix64_nb(z):
    """splitmix64's finaliser on a uint64 (wrapping arithmetic)."""
    z = np.uint64(z) + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit
def draw_key_nb(seed, req_index):
    """The part of ``draw`` that depends on (seed, request) only: a request's
    draws are ``draw_at_nb(key, 0)``, ``draw_at_nb(key, 1)``, ..."""
    return mix64_nb(mix64_nb(np.uint64(seed)) ^ np.uint64(req_index))


@njit
def draw_at_nb(key, draw_index):
    """draw(seed, request_index, draw_index) as a uint64, given ``draw_key_nb(seed, request_index)``."""
    return mix64_nb(key ^ np.uint64(draw_index))


@njit
def draw_nb(seed, req_index, draw_index):
    """draw(seed, request_index, draw_index) as a uint64."""
    return draw_at_nb(draw_key_nb(seed, req_index), draw_index)
