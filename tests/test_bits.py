"""The sampler's tier as a bit set: the bit helpers (``_jit.popcount``,
``_jit.trailing_zeros``, ``decide.select_bit_nb``), compiled, against plain
Python's count of the bits of the same 64-bit words; the sampler over it
against the reference's sampler over its tier list."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import reference
from replay.kernels import decide
from replay.kernels._jit import njit, popcount, trailing_zeros
from replay.kernels.snapshot import S_BASIC, S_INFLIGHT, S_NCOLS, S_WAITING


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


@settings(deadline=None, max_examples=60)
@given(n=st.sampled_from([1, 63, 64, 65, 130, 200]), seed=st.integers(0, 2**32 - 1),
       limit=st.sampled_from([None, 1, 3, 9]), k=st.sampled_from([1, 2, 5, 70, 300]),
       req=st.integers(0, 10**6))
def test_sampler_over_a_bit_set_equals_the_reference(n, seed, limit, k, req):
    """The per-config sampler (``sample_pair_nb``: the gate tier as a bit set over
    the fleet, 64 workers a word) draws the pair the reference draws from its
    tier list, on fleets at and across word boundaries, in a shuffled fleet
    order (fleet order, not id order, numbers the tier)."""
    rng = np.random.default_rng(seed)
    fleet = rng.permutation(n)
    fresh = rng.random(n) < 0.8
    waiting = rng.integers(0, 10, n)
    inflight = rng.integers(0, 4, n)
    snap = np.zeros((n, S_NCOLS), dtype=np.int64)
    snap[:, S_BASIC] = fresh
    snap[:, S_WAITING] = np.where(fresh, waiting, 0)
    snap[:, S_INFLIGHT] = inflight
    est = np.full(n, np.nan)
    snapshot = reference.Snapshot(
        basic={w: reference.BasicLoad(running=0, waiting=int(waiting[w]), num_tokens=0, max_total_num_tokens=0,
                                      captured_at=0) for w in range(n) if fresh[w]},
        inflight={w: int(inflight[w]) for w in range(n)})
    pool = np.zeros(n + 1, dtype=np.int64)
    idx = np.zeros(n + 1, dtype=np.int64)
    best, runner, after = decide.sample_pair_nb(snap, est, fleet, k, -1 if limit is None else limit, S_WAITING,
                                                seed, req, 0, pool, idx)
    draws = reference.DrawStream(seed, req)
    want = reference.propose_k_with_snapshot([int(w) for w in fleet], snapshot, k, limit, draws)
    assert (int(best), int(runner)) == (want.primary, -1 if want.backup is None else want.backup)
    assert after == draws.count
