"""Capacity planning in the closed loop (issue 16): fleets x traffic levels x router configs.

:func:`scale_log` grows the recorded traffic; :func:`plan_grid` runs the
closed-loop grid (:func:`replay.simulate.simulate_grid`) for every fleet
(workers x dp_size) and traffic level and writes ``plan_summary.parquet``;
:func:`plan` answers, per traffic level, the smallest fleet and its limit and
floor meeting a TTFT p99 or queue-wait p99 bound (upper 95% bound over the
seeds when several ran); :func:`fig_frontier` draws that answer.
docs/capacity.md has the choices and their reasons.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay.config import Grid
from replay.errors import ReplayError
from replay.runs import rundir
from replay.runs.rundir import building
from replay.simulate.logs import RequestLog
from replay.simulate.sim import _check_out, ray_session, simulate_grid, write_summary

PLAN_TABLE = "plan_summary.parquet"
PLAN_JSON = "plan.json"
PLAN_TOOL = "router-replay simulate (plan)"  # plan.json's "tool" marker
POINT_DIR = re.compile(r"x[0-9.e+-]+-w\d+-dp\d+")
BOUND_METRICS = {"ttft": "ttft_ms_p99", "queue_wait": "queue_wait_ms_p99"}
FLEET_COLS = ("load_scale", "workers", "dp_size", "ranks")
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


# a plan directory is an output `simulate --force` may replace (replay.runs.rundir's rule)
rundir.register_kind("plan", "capacity-plan directory", is_dir=True, recognise=rundir._record_dir(
    PLAN_JSON, PLAN_TOOL, lambda n: n in {PLAN_TABLE, "plan_summary.csv", PLAN_JSON, rundir.REPORT}
    or POINT_DIR.fullmatch(n) is not None))


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
        raise ReplayError(f"--load-scale must be in (0, {MAX_SCALE:g}], got {factor}")
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
              executor: str = "local", ray_address: str | None = None, ray_cpus: int | None = None,
              **grid_kw: Any) -> pl.DataFrame:
    """The closed-loop grid of ``grid`` on every fleet point; one summary row per
    (point, config), written to ``out_dir/plan_summary.parquet`` (and ``.csv``).

    ``make_fleet(workers, dp_size)`` builds a fleet (the calibrated one resized).
    ``per_dp_rank`` reads the grid's limit and floor values per rank and scales
    them by each fleet's dp_size.  Each point's grid goes to
    ``out_dir/<label>/`` as :func:`simulate_grid` writes it.  Points x configs
    x seeds run in parallel: ``threads`` local threads shared between points
    running at once and their simulations, or (``executor="ray"``) one Ray
    session with every point's tasks in flight.  The table is in point order,
    whatever finished first; the directory appears complete or not at all.
    """

    out = Path(out_dir)
    _check_out(out, force)
    n_threads = threads or os.cpu_count() or 1
    at_once = len(points) if executor == "ray" else max(1, min(len(points), n_threads))
    inner = max(1, n_threads // at_once)
    logs = {s: scale_log(log, s, seed=seed) for s in sorted({p.load_scale for p in points})}
    lock = threading.Lock()

    def tick(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    def one(p: FleetPoint) -> pl.DataFrame:
        g = grid.scaled_per_dp_rank(p.dp_size) if per_dp_rank else grid
        t = simulate_grid(logs[p.load_scale], make_fleet(p.workers, p.dp_size), g, tmp / p.label,
                          seed=seed, seeds=seeds, progress=tick, threads=inner, executor=executor,
                          ray_address=ray_address, ray_cpus=ray_cpus, **grid_kw)
        lead = {"load_scale": p.load_scale, "workers": p.workers, "dp_size": p.dp_size,
                "ranks": p.workers * p.dp_size, "fleet": p.label,
                "offered_req_s": _rate(logs[p.load_scale])}
        # the grid's own dp_size column (per-rank grids) is the fleet's: one column
        return t.select([pl.lit(v).alias(k) for k, v in lead.items()]
                        + [c for c in t.columns if c not in lead])

    with building(out) as tmp:
        with contextlib.ExitStack() as stack:
            if executor == "ray":
                stack.enter_context(ray_session(ray_address, ray_cpus))
            with ThreadPoolExecutor(max_workers=at_once) as ex:
                frames = list(ex.map(one, points))
        table = pl.concat(frames, how="diagonal_relaxed")
        write_summary(table, tmp / PLAN_TABLE)
        meta = {"tool": PLAN_TOOL, "log": log.source,
                "requests": log.n_requests, "seed": int(seed),
                "seeds": None if seeds is None else [int(s) for s in seeds],
                "per_dp_rank": bool(per_dp_rank), "grid": grid.describe(),
                "points": [p.label for p in points],
                "load_scale_method": "replication with fresh prefix namespaces (docs/capacity.md)"}
        (tmp / PLAN_JSON).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return table


def _rate(log) -> float | None:
    span = (int(log.ts_ns[-1]) - int(log.ts_ns[0])) / 1e9 if log.n_requests > 1 else 0.0
    return log.n_requests / span if span > 0 else None


# -- the answer --------------------------------------------------------------------------

@dataclass
class LevelAnswer:
    load_scale: float
    row: dict | None          # the chosen (fleet, config) row, None when nothing meets the bound
    value: float | None       # its bounded metric (upper 95% bound when seeded)
    best_miss: dict | None    # the closest row when nothing meets the bound
    next_level: float | None
    next_value: float | None  # the chosen fleet's best value at the next traffic level


def read_plan(run_dir: str | os.PathLike) -> pl.DataFrame:
    p = Path(run_dir) / PLAN_TABLE
    if not p.is_file():
        raise ReplayError(f"{run_dir}: no {PLAN_TABLE} (run `simulate` with --workers/--dp-size/"
                          "--load-scale lists first)")
    t = rundir.read_parquet(p)  # a truncated or foreign file: one line
    for c in (*FLEET_COLS, "config_id"):
        if c not in t.columns:
            raise ReplayError(f"{p}: column {c} missing")
    return t


def bound_column(t: pl.DataFrame, metric: str, kind: str = "mean") -> str:
    """The column a bound is checked on: when seeds ran, the upper end of the 95% interval of
    the mean (``kind="mean"``) or the worst seed (``kind="seed-range"``); else the one value."""
    base = BOUND_METRICS[metric]
    if f"{base}_hi" not in t.columns:
        return base
    if kind == "seed-range":
        if f"{base}_max" not in t.columns:
            raise ReplayError(f"{PLAN_TABLE}: column {base}_max missing (a plan written before the per-seed "
                              "range was kept; re-run simulate with --seeds N, or use --bound mean)")
        return f"{base}_max"
    return f"{base}_hi"


def plan(t: pl.DataFrame, metric: str, bound_ms: float, kind: str = "mean") -> list[LevelAnswer]:
    """Per traffic level: the smallest fleet (fewest ranks, then fewest workers) with a
    config whose bounded metric is <= ``bound_ms``, that fleet's best config (lowest
    value, then best hit rate, then lowest id), and its best value at the next level; ``kind``:
    :func:`bound_column`'s."""
    col = bound_column(t, metric, kind)
    rows = t.with_columns(pl.col(col).fill_nan(None).alias("_v")).to_dicts()
    levels = sorted({r["load_scale"] for r in rows})
    inf = float("inf")

    def key(r):
        v = r["_v"] if r["_v"] is not None else inf
        return (v, -(r.get("true_hit_rate") or 0.0), r["config_id"])

    out = []
    for i, lv in enumerate(levels):
        here = [r for r in rows if r["load_scale"] == lv]
        ok = [r for r in here if r["_v"] is not None and r["_v"] <= bound_ms]
        nxt = levels[i + 1] if i + 1 < len(levels) else None
        if not ok:
            out.append(LevelAnswer(lv, None, None, min(here, key=key), nxt, None))
            continue
        size = min((r["ranks"], r["workers"]) for r in ok)
        best = min((r for r in ok if (r["ranks"], r["workers"]) == size), key=key)
        nv = None
        if nxt is not None:
            same = [r for r in rows if r["load_scale"] == nxt and r["workers"] == best["workers"]
                    and r["dp_size"] == best["dp_size"]]
            if same:
                nv = min(same, key=key)["_v"]
        out.append(LevelAnswer(lv, best, best["_v"], None, nxt, nv))
    return out


def service_floor_ms(run_dir: str | os.PathLike, fleet_label: str) -> float | None:
    """The TTFT p99 no fleet of this shape can go below on this traffic: the p99 over requests of
    each one's uncached prefill time on the fastest rank ((input - cached tokens) / prefill
    tokens per s), the lowest over the fleet's configs and seeds.  A request's TTFT is at least
    its own uncached prefill, so the TTFT p99 is at least this p99 whatever the fleet size;
    None when the fleet directory keeps no outcomes."""
    d = Path(run_dir) / fleet_label
    try:
        meta = json.loads((d / "sim.json").read_text())
    except (OSError, ValueError):
        return None
    rates = [w.get("prefill_tokens_per_s") for w in (meta.get("fleet") or {}).get("workers") or []
             if isinstance(w, dict) and w.get("role", "plain") != "decode"]
    rate = max((float(r) for r in rates if isinstance(r, (int, float)) and r > 0), default=None)
    if rate is None:
        return None
    floors = []
    for f in sorted(d.glob("**/outcomes.parquet")):
        o = pl.read_parquet(f, columns=["input_tokens", "cached_tokens"])
        if o.height:
            q = o.select(((pl.col("input_tokens") - pl.col("cached_tokens").fill_null(0)).clip(0)
                          * 1000.0 / rate).quantile(0.99, "linear")).item()
            floors.append(float(q))
    return min(floors) if floors else None


def duration(ms: float | None) -> str:
    """A duration for people: ms below a second, s below ten minutes, min above."""
    if ms is None or not math.isfinite(ms):
        return "no value"
    if abs(ms) < 1000:
        return f"{ms:.0f} ms"
    if abs(ms) < 600_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms / 60_000:.1f} min"


def format_plan(answers: Sequence[LevelAnswer], metric: str, bound_ms: float, col: str,
                floors: dict[float, float | None] | None = None) -> str:
    checked = ("the upper end of the 95% interval of the mean over the seeds" if col.endswith("_hi")
               else "the worst seed (the per-seed range: what one day may look like)" if col.endswith("_max")
               else "the single seed's value")
    what = f"{BOUND_METRICS[metric]} <= {duration(bound_ms)} (checked on {checked})"
    lines = [f"capacity plan: {what}"]
    for a in answers:
        head = f"traffic x{a.load_scale:g}: "
        if a.row is None:
            m = a.best_miss
            mv = "no value" if m is None or m["_v"] is None else duration(m["_v"])
            floor = (floors or {}).get(a.load_scale)
            below = metric == "ttft" and floor is not None and bound_ms < floor
            lines.append(head + "NO fleet in the grid meets the bound (closest: "
                         + (f"{m['workers']} workers x dp {m['dp_size']}, config {m['config_id']}, "
                            if m else "") + f"{mv}); "
                         + (f"the bound is below the service-time floor of the longest prompts: 1% of "
                            f"requests need at least {duration(floor)} of prefill on the fastest rank even "
                            "with their cached prefix, so TTFT p99 stays above it on any fleet size; raise "
                            "the bound, or make prefill faster (faster ranks, fewer uncached tokens)"
                            if below else "add larger fleets"))
            continue
        r = a.row
        lim, flo = r.get("worker_queue_limit"), r.get("saturation_queue_floor")
        s = (f"{r['workers']} workers x dp {r['dp_size']} ({r['ranks']} ranks), config "
             f"{r['config_id']} (--worker-queue-limit {_knob(lim)} --saturation-queue-floor "
             f"{_knob(flo)}): {duration(a.value)}")
        base = BOUND_METRICS[metric]
        lo, hi = r.get(f"{base}_lo"), r.get(f"{base}_hi")
        if col != base and lo is not None and hi is not None:
            s += (f" (mean {duration(r[base])}, 95% interval of the mean over {len(r.get('seeds') or [])} "
                  f"seeds {duration(lo)}..{duration(hi)}")
            if r.get(f"{base}_min") is not None and r.get(f"{base}_max") is not None:
                s += f", per-seed range {duration(r[f'{base}_min'])}..{duration(r[f'{base}_max'])}"
            s += ")"
        if r.get("stable") is False:
            s += f" [seeds {','.join(map(str, r.get('unstable_seeds') or []))} disagree: run more seeds]"
        if a.next_level is None:
            s += "; no higher traffic level in the grid"
        elif a.next_value is None:
            s += f"; at x{a.next_level:g}: not run"
        else:
            room = bound_ms - a.next_value
            s += (f"; at x{a.next_level:g} the same fleet gives {duration(a.next_value)}, "
                  + (f"headroom {duration(room)}" if room >= 0 else f"over the bound by {duration(-room)}"))
        lines.append(head + s)
    return "\n".join(lines)


def level_floors(run_dir: str | os.PathLike, answers: Sequence[LevelAnswer]) -> dict[float, float | None]:
    """:func:`service_floor_ms` of the closest fleet of every level no fleet meets."""
    return {a.load_scale: service_floor_ms(run_dir, a.best_miss["fleet"])
            for a in answers if a.row is None and a.best_miss is not None and a.best_miss.get("fleet")}


def plan_json(answers: Sequence[LevelAnswer], metric: str, bound_ms: float, col: str,
              floors: dict[float, float | None] | None = None) -> dict:
    """The plan as JSON (``recommend --plan --json``): per traffic level the fleet, its config and flags."""
    def fleet(r: dict | None, value: float | None) -> dict | None:
        if r is None:
            return None
        lim, flo = r.get("worker_queue_limit"), r.get("saturation_queue_floor")
        return {"workers": r["workers"], "dp_size": r["dp_size"], "ranks": r["ranks"], "config_id": r["config_id"],
                "worker_queue_limit": lim, "saturation_queue_floor": flo,
                "router_flags": f"--worker-queue-limit {_knob(lim)} --saturation-queue-floor {_knob(flo)}",
                "value_ms": value, "true_hit_rate": r.get("true_hit_rate"), "stable": r.get("stable")}
    return {"bound": {"metric": BOUND_METRICS[metric], "max_ms": bound_ms, "checked_on": col},
            "levels": [{"load_scale": a.load_scale, "fleet": fleet(a.row, a.value),
                        "closest_miss": fleet(a.best_miss, a.best_miss["_v"] if a.best_miss else None),
                        "next_level": a.next_level, "next_value_ms": a.next_value,
                        "service_floor_ms": (floors or {}).get(a.load_scale)} for a in answers]}


def recommend_plan(run_dir, ttft_ms: float | None, wait_ms: float | None, echo, *, as_json: bool = False,
                   bound_kind: str = "mean") -> int:
    """``recommend --plan``: print the plan; 0 when every level has a fleet, 1 when one has none.
    ``bound_kind``: check the bound on the mean's 95% interval (``mean``) or the worst seed (``seed-range``)."""
    if (ttft_ms is None) == (wait_ms is None):
        raise ReplayError("--plan needs exactly one of --max-ttft-p99-ms and --max-queue-wait-p99-ms")
    metric, bound_ms = ("ttft", ttft_ms) if ttft_ms is not None else ("queue_wait", wait_ms)
    t = read_plan(run_dir)
    col = bound_column(t, metric, bound_kind)
    if col not in t.columns:
        raise ReplayError(f"{Path(run_dir) / PLAN_TABLE}: column {col} missing")
    answers = plan(t, metric, float(bound_ms), bound_kind)
    floors = level_floors(run_dir, answers)
    if as_json:
        echo(json.dumps(plan_json(answers, metric, float(bound_ms), col, floors), default=str))
    else:
        echo(format_plan(answers, metric, float(bound_ms), col, floors))
    return 0 if all(a.row is not None for a in answers) else 1


def _knob(v) -> str:
    return "none" if v is None else str(v)


# -- the frontier figure -----------------------------------------------------------------
