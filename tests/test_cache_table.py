"""The simulator's per-rank cache table (``kernels/sim.py``: block id -> slot, linear
probing, backward-shift deletion), compiled and as plain Python, against a dict under
random stores, evictions and lookups; and its size, set by the fleet's KV capacity,
not by the trace's blocks."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.kernels import sim as ks
from replay.kernels._jit import njit

STORE, EVICT, LOOKUP = 0, 1, 2
Tables = namedtuple("Tables", ("ck", "cl", "cn", "cu"))


@njit
def _apply(c, r, ops, out):
    """Run ``ops[k] = (kind, block, value)`` on rank ``r``'s table; ``out[k]``: the value a
    lookup found (-1: absent), or 1/0 whether a store or eviction found the block."""
    for k in range(ops.shape[0]):
        kind, b, val = ops[k, 0], ops[k, 1], ops[k, 2]
        h = ks._probe(c, r, b)
        found = c.ck[r, h] == b
        if kind == STORE:
            c.ck[r, h] = b
            c.cu[r, h] = val
            out[k] = 1 if found else 0
        elif kind == EVICT:
            if found:
                ks._remove(c, r, h)
            out[k] = 1 if found else 0
        else:
            f = ks._find(c, r, b)
            out[k] = c.cu[r, f] if f >= 0 else -1


def _table(slots: int) -> Tables:
    return Tables(*ks.cache_tables(2, slots))


def _expected(ops: list[tuple[int, int, int]]) -> tuple[list[int], dict[int, int]]:
    held: dict[int, int] = {}
    out = []
    for kind, b, val in ops:
        if kind == STORE:
            out.append(int(b in held))
            held[b] = val
        elif kind == EVICT:
            out.append(int(held.pop(b, None) is not None))
        else:
            out.append(held.get(b, -1))
    return out, held


op = st.tuples(st.sampled_from([STORE, EVICT, LOOKUP, LOOKUP]), st.integers(0, 300),
               st.integers(0, 10**12))


def _bounded(ops, most):
    """Drop the stores that would hold more than ``most`` blocks (the simulator's bound)."""
    held: set[int] = set()
    kept = []
    for kind, b, val in ops:
        if kind == STORE and b not in held and len(held) >= most:
            continue
        if kind == STORE:
            held.add(b)
        elif kind == EVICT:
            held.discard(b)
        kept.append((kind, b, val))
    return kept


@settings(deadline=None, max_examples=300)  # the first example compiles
@given(st.lists(op, max_size=400), st.sampled_from([16, 32, 64]))
def test_table_equals_dict(ops, slots):
    ops = _bounded(ops, slots // 4 - 1)
    want, held = _expected(ops)
    arr = np.array(ops, dtype=np.int64).reshape(-1, 3)
    for run in (_apply, _apply.py_func):
        ct = _table(slots)
        out = np.full(len(ops), -9, dtype=np.int64)
        run(ct, 1, arr, out)
        assert out.tolist() == want
        keys = ct.ck[1]
        assert sorted(keys[keys >= 0].tolist()) == sorted(held)  # no copies, nothing lost
        for b, val in held.items():  # every block held is reachable from its home
            assert ct.cu[1, ks._find(ct, 1, b)] == val
        assert (ct.ck[0] == -1).all()  # the other rank's table is untouched


def test_full_run_wraps_and_shifts_back():
    """Blocks sharing one home fill a run that wraps past the table's end; evicting its head
    shifts the rest back so each is still found (a tombstone-free delete)."""
    mask = 15
    same = [b for b in range(5000) if ks._home(b, mask) == mask][:5]
    assert len(same) == 5
    ops = [(STORE, b, 100 + x) for x, b in enumerate(same)] + [(EVICT, same[0], 0)]
    ops += [(LOOKUP, b, 0) for b in same]
    arr = np.array(ops, dtype=np.int64)
    ct = _table(16)
    out = np.zeros(len(ops), dtype=np.int64)
    _apply(ct, 0, arr, out)
    assert out[-5:].tolist() == [-1, 101, 102, 103, 104]
    assert ct.ck[0, mask] == same[1]  # moved back into the freed home slot


def test_slots_follow_capacity_not_trace_blocks():
    """Doubling the trace's distinct blocks leaves the tables' size alone; doubling the KV
    capacity doubles it; a tiny trace gets a table of its own blocks."""
    from replay.simulate import FleetSpec, build_fleet, generate_log
    from replay.simulate.sim import kernel_inputs

    fleet = build_fleet(FleetSpec(workers=2, dp_size=2, max_total_num_tokens=60_000))
    short = kernel_inputs(generate_log(2_000, seed=3), fleet, 100, 0)["req"]
    long = kernel_inputs(generate_log(8_000, seed=3), fleet, 100, 0)["req"]
    assert long.btok.shape[0] > 2 * short.btok.shape[0]
    cap = kernel_inputs(generate_log(2_000, seed=3), fleet, 100, 0)["fleet"].capacity
    n = ks.cache_slots(short, cap)
    assert ks.cache_slots(long, cap) == n
    assert ks.cache_slots(short, cap * 2) == 2 * n
    tiny = kernel_inputs(generate_log(3, seed=3), fleet, 100, 0)["req"]
    assert ks.cache_slots(tiny, cap) < n
