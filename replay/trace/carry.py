"""The carry: the few load samples before a window that the router's state at
the window's start still depends on (for every rank its latest two samples, for
every worker its latest ``router_inflight``; ``kernels.snapshot.carry_mask_nb``).
They determine the snapshot state at the window's start exactly, so a window
decides every request as the whole trace does."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from replay.kernels.snapshot import carry_mask_nb
from replay.trace.base import LOAD_FIELDS
from replay.trace.core import Trace


def carry_of_columns(cols: dict | None) -> dict | None:
    """The rows of ``cols`` (load columns in time order, ``LOAD_FIELDS``) that the
    snapshot state after them depends on."""
    if cols is None or cols["load_ts"].shape[0] == 0:
        return cols
    w = cols["load_worker"].astype(np.int64)
    r = cols["load_rank"].astype(np.int64)
    n_w, n_r = int(w.max()) + 1, int(r.max()) + 1
    if n_w * n_r > 50_000_000:          # stray huge ranks: number the ranks seen instead
        _u, r = np.unique(r, return_inverse=True)
        n_r = int(r.max()) + 1
    keep = np.zeros(w.shape[0], dtype=np.bool_)
    carry_mask_nb(w, r.astype(np.int64), cols["load_router_inflight"].astype(np.int64), n_r, keep)
    return {f: cols[f][keep] for f in LOAD_FIELDS}


def carry_of(trace: Trace) -> dict | None:
    return carry_of_columns({f: getattr(trace, f) for f in LOAD_FIELDS})


def concat_columns(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {f: np.concatenate([a[f], b[f]]) for f in LOAD_FIELDS}


def with_carry(trace: Trace, carry: dict | None) -> Trace:
    """The trace with the carried samples (all before its window) put first."""
    if carry is None or carry["load_ts"].shape[0] == 0:
        return trace
    cols: dict[str, Any] = {f: np.ascontiguousarray(np.concatenate([carry[f], getattr(trace, f)]))
                            for f in LOAD_FIELDS}
    return dataclasses.replace(trace, **cols)
