"""Per-request fleet readings and trace facts for reports (not used by the decision engine).

For every request: the fleet's *smallest fresh queue reading* (the minimum,
over the request's fleet, of each worker's fresh ``num_waiting_reqs`` summed
over its required ranks; spec section 1.3 basic aggregate) and how many fleet
workers had such a reading.  The saturation pin can fire only when no fresh
fleet worker reads below the floor (section 3.6), i.e. when this minimum is
``>= floor``; the report plots it beside the pin share over time.

It is the replay's own snapshot (``kernels/snapshot.py``), reduced per
request (``kernels/snapshot.fleet_reading_nb``).  A sweep takes the readings from the grid
kernel, which computes them as it replays (``Chunk.fleet_min``);
:func:`fleet_readings` is the same reduction as a pass of its own
(``snapshot.fleet_readings_nb``), for
traces replayed otherwise.  ``tests/test_report.py`` holds the kernel's
readings equal to this pass and this pass equal to the reference's snapshot;
:class:`FleetFacts` merges the facts exactly across windows and shards.
"""

from __future__ import annotations

import numpy as np
import polars as pl

from replay.kernels.snapshot import fleet_readings_nb, new_rank_table
from replay.sweep.engine import dp_sizes, fleet_tables, frozen, load_columns, n_rank_slots, readonly
from replay.trace import Trace

NO_READING = -1

SATURATED_DEFINITION = (
    "the fleet's smallest fresh queue reading is ≥ 1: every fleet worker with a fresh "
    "load sample has requests waiting (requests whose fleet has no fresh sample do not count)"
)


def fleet_readings(trace: Trace, freshness_ns: int = 5_000_000_000) -> tuple[np.ndarray, np.ndarray]:
    """Per request (trace order): ``(min_waiting, fresh_workers)``.

    ``min_waiting`` is the smallest fresh summed ``num_waiting_reqs`` of the
    request's fleet, ``-1`` when no fleet worker has a fresh reading;
    ``fresh_workers`` counts the fleet workers with a fresh reading.
    """
    n = trace.n_requests
    out_min = np.full(n, NO_READING, dtype=np.int64)
    out_fresh = np.zeros(n, dtype=np.int32)
    if n == 0:
        return out_min, out_fresh
    table, inflight = new_rank_table(max(trace.n_workers, 1), n_rank_slots(trace))
    # inputs read-only whatever the loader gave (one specialization for every trace)
    fleet_readings_nb(readonly(np.ascontiguousarray(trace.req_ts, dtype=np.int64)),
                      readonly(np.ascontiguousarray(trace.req_model, dtype=np.int64)),
                      frozen(load_columns(trace)), readonly(dp_sizes(trace)), table, inflight,
                      frozen(fleet_tables(trace)),
                      int(freshness_ns), out_min, out_fresh)
    return out_min, out_fresh


def fleet_table(trace: Trace, min_waiting: np.ndarray, fresh_workers: np.ndarray) -> pl.DataFrame:
    """The ``fleet.parquet`` table: one row per request, trace (time) order."""
    ids = trace.request_id
    rid = (pl.Series("request_id", ids.tolist(), dtype=pl.String) if ids.dtype == object
           else pl.Series("request_id", np.asarray(ids, dtype=np.int64)))
    models = np.asarray(trace.models, dtype=object)
    return pl.DataFrame({
        "request_id": rid,
        "ts": pl.Series("ts", trace.req_ts, dtype=pl.Int64),
        "model": pl.Series("model", models[trace.req_model].tolist() if trace.n_requests else [],
                           dtype=pl.String),
        "fleet_min_waiting": pl.Series("fleet_min_waiting",
                                       np.where(min_waiting < 0, None, min_waiting).tolist(),
                                       dtype=pl.Int64),
        "fleet_fresh_workers": pl.Series("fleet_fresh_workers", fresh_workers, dtype=pl.Int32),
    })


def empty_fleet_table() -> pl.DataFrame:
    """``fleet.parquet`` of a run without requests."""
    return pl.DataFrame(schema={"request_id": pl.String, "ts": pl.Int64, "model": pl.String,
                                "fleet_min_waiting": pl.Int64, "fleet_fresh_workers": pl.Int32})


def _fleet_dp_sizes(trace) -> dict[str, int]:
    """dp_size -> number of fleet workers (workers table, else ranks observed)."""
    sizes: dict[int, int] = {}
    for dp in trace.fleet_dp_sizes().values():
        sizes[dp] = sizes.get(dp, 0) + 1
    return {str(k): v for k, v in sorted(sizes.items())}


class FleetFacts:
    """Mergeable per-request fleet statistics (exact integer sums and counts), fed
    in time order window by window or shard by shard; :func:`trace_facts` reads them.

    Each gap between consecutive requests carries the state read at its first
    request, including the gap that crosses from one window to the next.
    """

    def __init__(self):
        self.n = 0
        self.first_ts: int | None = None
        self.last_ts: int | None = None
        self.last_sat = False
        self.first_sat = False
        self.span_ns = 0          # sum of gaps
        self.sat_ns = 0           # sum of gaps that start at a saturated request
        self.sat = 0              # saturated requests
        self.no_reading = 0       # requests whose fleet had no fresh reading
        self.values = np.zeros(0, dtype=np.int64)   # distinct known min_waiting values
        self.counts = np.zeros(0, dtype=np.int64)

    def add(self, req_ts: np.ndarray, min_waiting: np.ndarray) -> FleetFacts:
        """Book the requests of the next window (``req_ts`` ascending, after all earlier ones)."""
        part = FleetFacts()
        n = int(req_ts.shape[0])
        if n:
            ts = np.asarray(req_ts, dtype=np.int64)
            sat = np.asarray(min_waiting) >= 1
            gaps = np.diff(ts)
            part.n = n
            part.first_ts, part.last_ts = int(ts[0]), int(ts[-1])
            part.first_sat, part.last_sat = bool(sat[0]), bool(sat[-1])
            part.span_ns = int(gaps.sum())
            part.sat_ns = int(gaps[sat[:-1]].sum())
            part.sat = int(sat.sum())
            part.no_reading = int((np.asarray(min_waiting) < 0).sum())
            known = np.asarray(min_waiting)[np.asarray(min_waiting) >= 0]
            part.values, part.counts = np.unique(known, return_counts=True)
        return self.merge(part)

    def merge(self, later: FleetFacts) -> FleetFacts:
        """Fold in the facts of requests that all come after this one's."""
        if later.n == 0:
            return self
        if self.n:
            gap = later.first_ts - self.last_ts
            self.span_ns += gap
            self.sat_ns += gap if self.last_sat else 0
        else:
            self.first_ts, self.first_sat = later.first_ts, later.first_sat
        self.n += later.n
        self.last_ts, self.last_sat = later.last_ts, later.last_sat
        self.span_ns += later.span_ns
        self.sat_ns += later.sat_ns
        self.sat += later.sat
        self.no_reading += later.no_reading
        v = np.concatenate([self.values, later.values])
        c = np.concatenate([self.counts, later.counts])
        self.values, inv = np.unique(v, return_inverse=True)
        self.counts = np.bincount(inv, weights=c, minlength=self.values.shape[0]).astype(np.int64)
        return self

    def quantile(self, q: float) -> int:
        """numpy's ``inverted_cdf`` quantile of the known readings."""
        total = int(self.counts.sum())
        k = max(1, int(np.ceil(total * q)))
        return int(self.values[int(np.searchsorted(np.cumsum(self.counts), k, side="left"))])


def trace_facts(trace, min_waiting: np.ndarray | None, fresh_workers: np.ndarray | None,
                freshness_ns: int, merged: FleetFacts | None = None) -> dict:
    """Config-independent facts of the replayed trace, for ``run.json["trace"]["facts"]``.

    ``trace`` is a Trace (with its per-request readings) or, with ``merged``
    (the FleetFacts of every window), a TraceSet.
    """
    ff = merged if merged is not None else FleetFacts().add(trace.req_ts, min_waiting)
    n = ff.n
    facts: dict = {
        "requests": n,
        "span_start_ns": ff.first_ts,
        "span_end_ns": ff.last_ts,
        "span_s": (ff.last_ts - ff.first_ts) / 1e9 if n else 0.0,
        "fleet_workers": {mname: int(trace.fleet(i).shape[0]) for i, mname in enumerate(trace.models)},
        "dp_sizes": _fleet_dp_sizes(trace),
        "freshness_ms": int(freshness_ns) // 1_000_000,
        "saturated_definition": SATURATED_DEFINITION,
    }
    if n == 0:
        facts.update(saturated_share_time=None, saturated_share_requests=None,
                     no_fresh_fleet_reading_share=None, fleet_min_waiting={})
        return facts
    # each inter-request gap carries the state read at its first request
    facts["saturated_share_time"] = (ff.sat_ns / ff.span_ns if ff.span_ns > 0 else float(ff.first_sat))
    facts["saturated_share_requests"] = ff.sat / n
    facts["no_fresh_fleet_reading_share"] = ff.no_reading / n
    facts["fleet_min_waiting"] = (
        {"p50": ff.quantile(0.5), "p90": ff.quantile(0.9), "p99": ff.quantile(0.99),
         "max": int(ff.values[-1])} if ff.values.size else {})
    return facts
