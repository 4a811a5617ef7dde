"""The ranking core the three recommendations share (replay/analysis/ranking.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from replay.analysis import ranking

row = st.fixed_dictionaries({
    "v": st.one_of(st.none(), st.floats(0, 10, allow_nan=False), st.just(math.nan)),
    "hit": st.floats(0, 1, allow_nan=False),
    "stable": st.booleans(),
})


@given(st.lists(row, max_size=12), st.one_of(st.none(), st.floats(0, 10, allow_nan=False)))
def test_every_row_lands_once_and_the_qualifying_rows_are_ordered(rows, bound):
    rows = [dict(r, config_id=i) for i, r in enumerate(rows)]
    got = ranking.rank(rows, value=lambda r: r["v"], bound=bound,
                       order=lambda r: (-r["hit"], r["config_id"]),
                       checks=[("unstable", lambda r: not r["stable"])])
    assert list(got.excluded) == ["unstable", "over_bound", "unknown"]
    placed = sorted(r["config_id"] for part in (got.ranked, *got.excluded.values()) for r in part)
    assert placed == list(range(len(rows)))
    for r in rows:
        if r["v"] is None:
            want = "unknown"
        elif not r["stable"]:
            want = "unstable"
        elif bound is not None and not r["v"] <= bound:   # NaN never meets a bound
            want = "over_bound"
        else:
            want = "ranked"
        where = "ranked" if r in got.ranked else next(k for k, v in got.excluded.items() if r in v)
        assert where == want, r
    assert got.ranked == sorted(got.ranked, key=lambda r: (-r["hit"], r["config_id"]))


def test_flags_of_a_config_row():
    gated = {"worker_queue_limit": 2, "saturation_queue_floor": None, "pressure_guard": False}
    assert ranking.router_flags(gated) == "--worker-queue-limit 2 --disable-pressure-guard"
    assert ranking.deploy_flags(gated) == "--worker-queue-limit 2 --disable-pressure-guard"
    none = {"worker_queue_limit": None, "saturation_queue_floor": None}
    assert ranking.router_flags(none) == "(router defaults: no gate)"
    assert ranking.deploy_flags(none) == ""
    variant = {"worker_queue_limit": 2, "variant_pin_order": "locality"}
    assert "replay-only policy variant --pin-order locality" in ranking.router_flags(variant)
    assert ranking.deploy_flags(variant) is None
    assert ranking.deploy_flags(None) is None
