"""The one executor interface, local side: results as they finish, errors as raised, options checked."""

from __future__ import annotations

import threading
import time

import pytest

from replay.errors import ParamError
from replay.sweep.pool import FAULT_ENV, InjectedFault, RayPool, ThreadPool, pool


def slow_square(x: int, delay: float, seen: list, gate: threading.Event | None = None) -> int:
    if gate is not None:
        gate.wait(10)
    time.sleep(delay)
    seen.append(x)
    return x * x


def test_results_come_as_calls_finish_with_their_index():
    seen: list = []
    gate = threading.Event()
    calls = [((0, 0.0, seen, gate), {}), ((1, 0.0, seen), {}), ((2, 0.0, seen), {})]
    got = []
    with ThreadPool(3) as p:
        for i, value in p.run(slow_square, calls):
            got.append((i, value))
            if len(got) == 2:
                gate.set()              # call 0 finishes only once the other two are in
    assert sorted(got[:2]) == [(1, 1), (2, 4)] and got[2] == (0, 0)


def test_a_failed_call_is_raised_and_calls_not_started_never_run(monkeypatch):
    seen: list = []
    monkeypatch.setenv(FAULT_ENV, "1:always")
    calls = [((k, 0.01, seen), {}) for k in range(8)]
    with pytest.raises(InjectedFault, match="task 1"):
        list(ThreadPool(1).run(slow_square, calls))
    assert 0 in seen and 1 not in seen and len(seen) < 7   # call 1 failed; the queue was cancelled


def test_options_are_checked_by_name():
    with pytest.raises(ParamError) as err:
        pool("local", address="127.0.0.1:6379")
    assert err.value.flag == "--ray-address"
    with pytest.raises(ParamError, match="executor must be one of local, ray"):
        pool("dask")
    with pytest.raises(ParamError, match="threads must be >= 1"):
        pool("local", threads=0)
    assert isinstance(pool("ray", address="127.0.0.1:1", retries=0), RayPool)
