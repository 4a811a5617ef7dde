"""The block-count rule: a request's block ids and its input length agree.

A request of ``L`` input tokens hashed in blocks of ``B`` tokens has one id
per block.  Two conventions are in use, and both are read:

* **with a partial last block** (the router's own hashes, CAPTURE.md section
  3, and Mooncake's FAST'25 files): ``len == ceil(L / B)``;
* **full blocks only** (kv-cache-tester sessions and other logs that drop the
  trailing partial block): ``len == floor(L / B)``.

Everything downstream (the trace's ``hash_ids`` column, the simulator, the
capture writer) holds the first form.  A full-blocks-only list is completed
on reading: its partial last block gets a *fresh* id, one no other request
uses, so it matches nothing (an engine with page size > 1 never caches a
partial page either).  When ``L`` is a multiple of ``B`` both forms are the
same list.  Any other length is an error, reported for the first bad row.

This module is the one place the rule is written: every reader (trace
directories, request logs of every format) and every writer (the simulator's
trace, the capture formats, ``import``) calls it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT64_MIN = -(2**63)


@dataclass
class BlockCounts:
    """The rule checked over many requests.

    ``full_only``: requests whose list holds their full blocks only (a partial
    block exists and has no id); ``bad``: the first request that breaks the
    rule (None when none does) and ``message`` says what was expected there.
    """

    full_only: np.ndarray
    bad: int | None = None
    message: str = ""

    @property
    def n_full_only(self) -> int:
        return int(self.full_only.sum())


def expected_message(n_ids: int, length: int, block: int, *, length_name: str = "input_tokens",
                     block_name: str = "page_size", partial_only: bool = False) -> str:
    """What a request of ``length`` tokens should have held, in one phrase."""
    want = -(-length // block)
    text = f"has {n_ids} hashes, expected ceil({length_name} {length} / {block_name} {block}) = {want}"
    if not partial_only and length % block:
        text += f" (or {length // block}, its full blocks only)"
    return text


def check_block_counts(sizes: np.ndarray, input_tokens: np.ndarray, block: int | np.ndarray, *,
                       known: np.ndarray | None = None, full_only_ok: bool = True,
                       length_name: str = "input_tokens", block_name: str = "page_size") -> BlockCounts:
    """Check ``sizes[i]`` (ids of request ``i``) against ``input_tokens[i]`` and the block size.

    ``block`` is one size or one per request (< 1: unknown, not checked);
    ``known`` masks the requests whose list is known (others are not checked).
    ``full_only_ok=False`` is the writers' form: only complete lists pass.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    L = np.asarray(input_tokens, dtype=np.int64)
    B = np.broadcast_to(np.asarray(block, dtype=np.int64), L.shape)
    check = B > 0
    if known is not None:
        check = check & known
    Bs = np.where(check, B, 1)
    ceil = -(-L // Bs)
    floor = L // Bs
    full_only = check & (sizes == floor) & (floor != ceil) & full_only_ok
    bad = check & (sizes != ceil) & ~full_only
    if not bad.any():
        return BlockCounts(full_only)
    row = int(np.argmax(bad))
    return BlockCounts(full_only, row, expected_message(int(sizes[row]), int(L[row]), int(B[row]),
                                                        length_name=length_name, block_name=block_name,
                                                        partial_only=not full_only_ok))


def fresh_ids(used: np.ndarray, k: int) -> np.ndarray:
    """``k`` distinct int64 ids none of ``used`` holds: the smallest such values
    (``-2**63`` upward), so they are the same for the same input."""
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    u = np.unique(np.asarray(used, dtype=np.int64))
    lo = u[(u >= INT64_MIN) & (u < INT64_MIN + k + u.size)]
    cand = INT64_MIN + np.arange(k + lo.size, dtype=np.int64)
    return cand[~np.isin(cand, lo)][:k]


def complete_partial_blocks(off: np.ndarray, values: np.ndarray,
                            full_only: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR lists with one fresh id appended to every ``full_only`` request."""
    add = np.asarray(full_only, dtype=np.int64)
    k = int(add.sum())
    if k == 0:
        return off, values
    values = np.asarray(values, dtype=np.int64)
    sizes = np.diff(off)
    new_off = np.zeros_like(off)
    np.cumsum(sizes + add, out=new_off[1:])
    out = np.empty(int(new_off[-1]), dtype=np.int64)
    # old entries shift by the number of appended ids before their request
    shift = np.repeat(new_off[:-1] - off[:-1], sizes)
    out[np.arange(values.size, dtype=np.int64) + shift] = values
    out[new_off[1:][add.astype(bool)] - 1] = fresh_ids(values, k)
    return new_off, out


def conform_blocks(off: np.ndarray, values: np.ndarray, input_tokens: np.ndarray, block: int | np.ndarray,
                   *, known: np.ndarray | None = None, length_name: str = "input_tokens",
                   block_name: str = "page_size") -> tuple[np.ndarray, np.ndarray, BlockCounts]:
    """Check CSR lists by the rule and complete the full-blocks-only ones.

    Returns the (possibly new) offsets and values and the :class:`BlockCounts`;
    the caller raises its own one-line error when ``counts.bad`` is set (it
    knows the file and how rows are named).
    """
    counts = check_block_counts(np.diff(off), input_tokens, block, known=known,
                                length_name=length_name, block_name=block_name)
    if counts.bad is not None:
        return off, values, counts
    off, values = complete_partial_blocks(off, values, counts.full_only)
    return off, values, counts
