"""Capacity planning in the closed loop: fleets x traffic levels x router configs.

:func:`scale_log` grows the recorded traffic; :func:`plan_grid` runs the
closed-loop grid (:func:`replay.simulate.simulate_grid`) for every fleet
(workers x dp_size) and traffic level, as one pool of simulations, and writes ``plan_summary.parquet``;
:func:`plan` answers, per traffic level, the smallest fleet and its limit and
floor meeting a TTFT p99 or queue-wait p99 bound (upper 95% bound over the
seeds when several ran); :func:`fig_frontier` draws that answer.
docs/capacity.md has the choices and their reasons.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.config import Grid
from replay.errors import ParamError, ReplayError
from replay.runs import rundir
from replay.runs.names import BOUND_METRICS, FLEET_COLS, PLAN_CSV, PLAN_JSON, PLAN_TABLE, PLAN_TOOL  # noqa: F401 - re-exported
from replay.simulate.batch import SimTask, grid_table, grid_tasks, run_batch, work_dir, write_grid
from replay.simulate.logs import RequestLog
from replay.simulate.sim import write_summary
from replay.sweep.pool import Pool, pool

POINT_DIR = re.compile(r"x[0-9.e+-]+-w\d+-dp\d+")
MAX_SCALE = 64.0


# -- value lists -------------------------------------------------------------------------

def parse_list(text: str | None, flag: str, kind: type, lo: float) -> list | None:
    """A fleet knob's comma list (``--workers 4,6,8``); None when not given."""
    if text is None:
        return None
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            v = kind(part)
        except ValueError:
            raise ReplayError(f"{flag}: {part!r} is not a{'n integer' if kind is int else ' number'} "
                              f"(a comma list, e.g. {flag} 2,4)") from None
        if not (math.isfinite(v) and v >= lo) or (kind is float and v > MAX_SCALE):
            raise ReplayError(f"{flag}: {part} is out of range (>= {lo:g}"
                              + (f", <= {MAX_SCALE:g})" if kind is float else ")"))
        out.append(v)
    if len(set(out)) != len(out):
        raise ReplayError(f"{flag}: a value is listed twice in {text!r}")
    return sorted(out)


PLAN_KIND = rundir.Kind("plan", "capacity-plan directory", True, rundir.record_dir(
    PLAN_JSON, PLAN_TOOL, lambda n: n in {PLAN_TABLE, PLAN_CSV, PLAN_JSON, rundir.REPORT}
    or POINT_DIR.fullmatch(n) is not None))
"""A plan directory: an output `simulate --force` may replace (replay.runs.rundir's rule)."""


# -- traffic growth ----------------------------------------------------------------------

def _unit(keys: np.ndarray, copy: int, seed: int) -> np.ndarray:
    """A deterministic uniform in [0, 1) per (key, copy, seed): splitmix64 of the three."""
    with np.errstate(over="ignore"):
        z = (keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + np.uint64((copy * 0xBF58476D1CE4E5B9 + seed * 0x94D049BB133111EB) % 2**64))
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)).astype(np.float64) / float(2**53)


def scale_log(log, factor: float, *, seed: int = 0):
    """``log`` with ``factor`` times its traffic, by replication with fresh prefix namespaces.

    Copy ``k`` (k = 0 .. ceil(factor) - 1) of every request keeps its
    arrival time shifted by ``k / ceil(factor)`` of the log's median
    inter-arrival gap, its lengths, and its prefix blocks renamed into a
    namespace of its own (copy 0 is the recording), so the copies' sessions
    never share cache with each other: the cache reuse of each copy is the
    recording's.  The *trunk* (:func:`trunk_and_families`: the leading blocks
    every request of the log carries, e.g. one system prompt) keeps its
    names, since new users would send it too.  A fractional last copy keeps
    the prefix families (a family: the requests that share their first
    block past the trunk) whose seeded uniform is below the fraction, so a
    conversation is kept or dropped whole.  ``factor == 1`` returns ``log``.
    """

    if not (math.isfinite(factor) and 0 < factor <= MAX_SCALE):
        raise ParamError("factor", f"must be in (0, {MAX_SCALE:g}], got {factor}", flag="--load-scale")
    if factor == 1.0:
        return log
    n = log.n_requests
    copies = math.ceil(factor)
    sizes = np.diff(log.hash_off)
    trunk, family = trunk_and_families(log)
    gaps = np.diff(log.ts_ns)
    gap = int(np.median(gaps)) if gaps.size else 0
    parts = []
    for k in range(copies):
        w = min(1.0, factor - k)
        keep = np.ones(n, dtype=bool) if w >= 1.0 else _unit(family, k, seed) < w
        idx = np.nonzero(keep)[0]
        parts.append((k, idx))
    ts, li, lo, rid, offs, ids = [], [], [], [], [], []
    for k, idx in parts:
        ts.append(log.ts_ns[idx] + (k * gap) // copies)
        li.append(log.input_tokens[idx])
        lo.append(log.output_tokens[idx])
        rid.append(idx.astype(np.int64) + k * n)  # copy k of log position i
        s = sizes[idx]
        offs.append(s)
        take = np.repeat(log.hash_off[:-1][idx], s) + (np.arange(int(s.sum())) -
                                                       np.repeat(np.cumsum(s) - s, s))
        b = log.hash_ids[take]
        ids.append(np.where(trunk[b], b, b + k * log.n_blocks))  # dense ids: namespace k
    s_all = np.concatenate(offs)
    off = np.zeros(s_all.size + 1, dtype=np.int64)
    np.cumsum(s_all, out=off[1:])
    # REPLAY CHOICE: the scaled log's block keys are dense ids per namespace, not the
    # recording's hash values; nothing downstream reads the values, only their identity
    return RequestLog(np.concatenate(ts).astype(np.int64), np.concatenate(li), np.concatenate(lo),
                      off, np.concatenate(ids).astype(np.int64), np.concatenate(rid),
                      log.block_size, f"{log.source} x{factor:g}")


def trunk_and_families(log) -> tuple[np.ndarray, np.ndarray]:
    """``(trunk, family)``: ``trunk[b]`` marks the blocks of the log's common stem (from
    the one root block, every block that is its parent's only child, up to and
    including the first block with two or more children; none when the log has
    several root blocks); ``family[i]`` is request ``i``'s first block past the
    trunk (its last block if it has none past it; ``n_blocks + i`` if it has no
    block)."""
    nb, n = log.n_blocks, log.n_requests
    parent = log.block_parent
    children = np.bincount(parent[parent >= 0], minlength=nb)
    trunk = np.zeros(nb, dtype=bool)
    roots = np.nonzero(parent == -1)[0]
    if roots.size == 1:
        child_of = np.full(nb, -1, dtype=np.int64)
        child_of[parent[parent >= 0]] = np.nonzero(parent >= 0)[0]  # the child, when only one
        b = int(roots[0])
        while True:
            trunk[b] = True
            if children[b] != 1:
                break
            b = int(child_of[b])
    sizes = np.diff(log.hash_off)
    family = log.n_blocks + np.arange(n, dtype=np.int64)
    past = ~trunk[log.hash_ids]
    # the first position past the trunk in each request (its size when none)
    pos = np.where(past, np.arange(log.hash_ids.size) - np.repeat(log.hash_off[:-1], sizes),
                   np.iinfo(np.int64).max)
    has = sizes > 0
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    if log.hash_ids.size:
        first[has] = np.minimum.reduceat(pos, log.hash_off[:-1][has])
    at = np.where(first < sizes, first, sizes - 1)
    family[has] = log.hash_ids[log.hash_off[:-1][has] + at[has]]
    return trunk, family


# -- the grid ----------------------------------------------------------------------------

@dataclass(frozen=True)
class FleetPoint:
    load_scale: float
    workers: int
    dp_size: int

    @property
    def label(self) -> str:
        return f"x{self.load_scale:g}-w{self.workers}-dp{self.dp_size}"


def fleet_points(workers: Sequence[int], dp_sizes: Sequence[int],
                 scales: Sequence[float]) -> list[FleetPoint]:
    """Every (traffic level, workers, dp_size), in that order of nesting (sorted)."""
    return [FleetPoint(float(s), int(w), int(d)) for s in sorted(scales)
            for w in sorted(workers) for d in sorted(dp_sizes)]


def plan_grid(log, make_fleet: Callable[[int, int], Any], grid: Grid, points: Sequence[FleetPoint],
              out_dir: str | os.PathLike, *, per_dp_rank: bool = False, seed: int = 0,
              seeds: Sequence[int] | None = None, force: bool = False,
              progress: Callable[[int], None] | None = None, threads: int | None = None,
              executor: str | Pool = "local", ray_address: str | None = None, ray_cpus: int | None = None,
              ray_retries: int | None = None, resume: bool = False, publish_interval_ms: int | None = None,
              index_lag_ms: int = 0, freshness_ms: int = 5000) -> pl.DataFrame:
    """The closed-loop grid of ``grid`` on every fleet point; one summary row per
    (point, config), written to ``out_dir/plan_summary.parquet`` (and ``.csv``).

    ``make_fleet(workers, dp_size)`` builds a fleet (the calibrated one resized).
    ``per_dp_rank`` reads the grid's limit and floor values per rank and scales
    them by each fleet's dp_size.  Each point's grid goes to
    ``out_dir/<label>/`` as :func:`simulate_grid` writes it.  Every simulation of
    every point (points x configs x seeds) is one task of one pool
    (:func:`replay.sweep.pool.pool`: ``threads`` local threads, or ``executor="ray"``),
    journaled as it finishes; ``resume`` goes on from an interrupted plan
    (:mod:`replay.simulate.batch`).  The table is in point order, whatever
    finished first; the directory appears complete or not at all.
    """
    runner = pool(executor, threads=threads, address=ray_address, cpus=ray_cpus, retries=ray_retries)
    out = Path(out_dir)
    rundir.guard([(out, PLAN_KIND)], force=force)
    scales = sorted({p.load_scale for p in points})
    logs = [scale_log(log, s, seed=seed) for s in scales]
    fleets = [make_fleet(p.workers, p.dp_size) for p in points]
    grids = [grid.scaled_per_dp_rank(p.dp_size) if per_dp_rank else grid for p in points]
    if publish_interval_ms is None:     # the fleets are one fleet file resized: one interval
        publish_interval_ms = fleets[0].publish_interval_ms if fleets else 100
    kw = dict(publish_interval_ms=publish_interval_ms, index_lag_ms=index_lag_ms, freshness_ms=freshness_ms)
    run_seeds = list(seeds) if seeds is not None else [seed]
    seeded = seeds is not None
    tasks: list[SimTask] = []
    first = []      # the index of each point's first task
    for i, p in enumerate(points):
        first.append(len(tasks))
        tasks += grid_tasks(grids[i], run_seeds, seeded, log=scales.index(p.load_scale), fleet=i,
                            prefix=f"{p.label}/")
    first.append(len(tasks))
    point_of = np.repeat(np.arange(len(points)), np.diff(first))
    with work_dir(out, resume=resume) as work:
        assert work is not None
        summaries: dict[int, dict] = {}
        left = np.diff(first)
        frames: list[pl.DataFrame | None] = [None] * len(points)

        def point_done(i: int) -> None:
            """Point ``i``'s grid files and summary rows, written as its last simulation ends
            (while the pool runs the other points')."""
            p = points[i]
            scaled = logs[scales.index(p.load_scale)]
            mine = [summaries.pop(j) for j in range(first[i], first[i + 1])]
            t, rows = grid_table(grids[i], run_seeds, seeded, mine)
            write_grid(work.path / p.label, t, rows, scaled, fleets[i], grids[i], seed, seeds, kw)
            lead = {"load_scale": p.load_scale, "workers": p.workers, "dp_size": p.dp_size,
                    "ranks": p.workers * p.dp_size, "fleet": p.label, "offered_req_s": _rate(scaled)}
            # the grid's own dp_size column (per-rank grids) is the fleet's: one column
            frames[i] = t.select([pl.lit(v).alias(k) for k, v in lead.items()]
                                 + [c for c in t.columns if c not in lead])

        def on_result(j: int, summary: dict) -> None:
            summaries[j] = summary
            i = int(point_of[j])
            left[i] -= 1
            if left[i] == 0:
                point_done(i)

        run_batch(tasks, logs, fleets, kw, runner, work, progress=progress, on_result=on_result)
        for i in range(len(points)):
            if frames[i] is None:      # a point with no simulation
                point_done(i)
        table = pl.concat([f for f in frames if f is not None], how="diagonal_relaxed")
        write_summary(table, work.path / PLAN_TABLE)
        meta = {"tool": PLAN_TOOL, "log": log.source,
                "requests": log.n_requests, "seed": int(seed),
                "seeds": None if seeds is None else [int(s) for s in seeds],
                "per_dp_rank": bool(per_dp_rank), "grid": grid.describe(),
                "points": [p.label for p in points],
                "load_scale_method": "replication with fresh prefix namespaces (docs/capacity.md)"}
        (work.path / PLAN_JSON).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return table


def _rate(log) -> float | None:
    span = (int(log.ts_ns[-1]) - int(log.ts_ns[0])) / 1e9 if log.n_requests > 1 else 0.0
    return log.n_requests / span if span > 0 else None


# -- the answer --------------------------------------------------------------------------
