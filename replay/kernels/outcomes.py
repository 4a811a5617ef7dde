"""A chunk's decisions as each request's distinct outcomes plus a per-config code.

The configs of a grid mostly agree about a request (on a 152-config grid the
engine computes about 10 distinct outcomes a request), so the ``outcomes``
layout of ``decisions.parquet`` (:mod:`replay.runs.decisions`) stores each
distinct outcome of a request once and, per config, the index of its outcome
among them.  :func:`encode` finds them (jitted; self-contained, so numba's own
cache notices any edit of this file); :func:`encode_reference` is the plain
Python statement of the same rule the tests hold it to; :func:`decode` gathers
them back into per-(request, config) rows.

An outcome is every kernel output field of one (request, config) decision
(``out_i[:, r, c]`` and the bit patterns of ``out_f[:, r, c]``, so NaN equals
NaN); its index is the order in which the configs first show it (config 0's
outcome is 0), so the encoding is a function of the values alone.
"""

from __future__ import annotations

import numpy as np

from replay.kernels._jit import njit


@njit
def _same(oi: np.ndarray, of: np.ndarray, r: int, c: int, rc: int) -> bool:
    for f in range(oi.shape[0]):
        if oi[f, r, c] != oi[f, r, rc]:
            return False
    for f in range(of.shape[0]):
        if of[f, r, c] != of[f, r, rc]:
            return False
    return True


@njit
def _encode(oi: np.ndarray, of: np.ndarray, codes: np.ndarray, rep: np.ndarray, counts: np.ndarray) -> int:
    """``oi``: int64[F_i, n, C]; ``of``: int64[F_f, n, C] (float bits).  Fills
    ``codes[r, c]`` (outcome index of config c within request r), ``rep`` (flat
    ``r * C + c`` of each distinct outcome's first config, request by request)
    and ``counts[r]``; returns the number of distinct outcomes."""
    n = oi.shape[1]
    n_cfg = oi.shape[2]
    total = 0
    for r in range(n):
        first = r * n_cfg
        d = 0
        last = 0
        for c in range(n_cfg):
            found = -1
            # the previous config's outcome first (neighbouring configs agree most)
            if d > 0 and _same(oi, of, r, c, rep[total + last] - first):
                found = last
            else:
                for k in range(d):
                    if k != last and _same(oi, of, r, c, rep[total + k] - first):
                        found = k
                        break
            if found < 0:
                found = d
                rep[total + d] = first + c
                d += 1
            codes[r, c] = found
            last = found
        counts[r] = d
        total += d
    return total


def code_dtype(n_configs: int) -> type:
    """The narrowest unsigned integer holding an outcome index of ``n_configs`` configs."""
    return np.uint8 if n_configs <= 1 << 8 else (np.uint16 if n_configs <= 1 << 16 else np.uint32)


def encode(out_i: np.ndarray, out_f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes[n, C], rep[n_outcomes], counts[n])`` of a chunk's kernel outputs
    (``out_i`` int64[O_NCOLS, n, C], ``out_f`` float64[F_NCOLS, n, C])."""
    _n_i, n, n_cfg = out_i.shape
    codes: np.ndarray = np.empty((n, n_cfg), dtype=code_dtype(n_cfg))
    rep = np.empty(n * n_cfg, dtype=np.int64)
    counts = np.empty(n, dtype=np.int64)
    of = np.ascontiguousarray(out_f).view(np.int64)
    total = _encode(np.ascontiguousarray(out_i), of, codes, rep, counts)
    return codes, rep[:total].copy(), counts


def encode_reference(out_i: np.ndarray, out_f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`encode` in plain Python: per request, a dict from the outcome (the
    tuple of every field, floats as bit patterns) to its index, in config order."""
    _n_i, n, n_cfg = out_i.shape
    bits = np.ascontiguousarray(out_f).view(np.int64)
    codes: np.ndarray = np.zeros((n, n_cfg), dtype=code_dtype(n_cfg))
    rep: list[int] = []
    counts = np.zeros(n, dtype=np.int64)
    for r in range(n):
        seen: dict[tuple, int] = {}
        for c in range(n_cfg):
            key = tuple(out_i[:, r, c].tolist()) + tuple(bits[:, r, c].tolist())
            if key not in seen:
                seen[key] = len(seen)
                rep.append(r * n_cfg + c)
            codes[r, c] = seen[key]
        counts[r] = len(seen)
    return codes, np.asarray(rep, dtype=np.int64), counts


def decode(codes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat outcome index (into the outcomes of all requests, in order) of every
    (request, config), request-major: the gather that rebuilds the long rows."""
    n, _n_cfg = codes.shape
    starts = np.zeros(n, dtype=np.int64)
    if n:
        np.cumsum(counts[:-1], out=starts[1:])
    return (codes.astype(np.int64) + starts[:, None]).reshape(-1)
