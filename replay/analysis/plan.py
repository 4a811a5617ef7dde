"""A capacity plan read back and answered: the smallest fleet per traffic level under a p99 bound."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from replay.analysis import ranking
from replay.analysis.closed_loop import check_numeric
from replay.errors import ParamsError, ReplayError
from replay.runs import rundir
from replay.runs.names import BOUND_METRICS, FLEET_COLS, OUTCOMES, PLAN_TABLE, SIM_JSON


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
    if t.height == 0:
        raise ReplayError(f"{p}: no fleets planned (an empty plan answers nothing)")
    check_numeric(t, p)
    return t


def bound_column(t: pl.DataFrame, metric: str, kind: str = "mean") -> str:
    """The column a bound is checked on: when seeds ran, the upper end of the 95% interval of
    the mean (``kind="mean"``) or the worst seed (``kind="seed-range"``); else the one value."""
    base = BOUND_METRICS[metric]
    if f"{base}_hi" not in t.columns:
        return base
    if kind == "seed-range":
        if f"{base}_max" not in t.columns:
            raise ParamsError("{table}: column {base}_max missing (a plan written before the per-seed range was "
                              "kept; re-run simulate with --seeds N, or use {kind:mean})", ("kind", "--bound"),
                              table=PLAN_TABLE, base=base)
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
        ranked = ranking.rank(here, value=lambda r: r["_v"], bound=bound_ms,
                              order=lambda r: ((r["ranks"], r["workers"]), key(r)))
        nxt = levels[i + 1] if i + 1 < len(levels) else None
        if not ranked.ranked:
            out.append(LevelAnswer(lv, None, None, min(here, key=key), nxt, None))
            continue
        best = ranked.ranked[0]
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
        meta = json.loads((d / SIM_JSON).read_text())
    except (OSError, ValueError):
        return None
    rates = [w.get("prefill_tokens_per_s") for w in (meta.get("fleet") or {}).get("workers") or []
             if isinstance(w, dict) and w.get("role", "plain") != "decode"]
    rate = max((float(r) for r in rates if isinstance(r, (int, float)) and r > 0), default=None)
    if rate is None:
        return None
    floors = []
    for f in sorted(d.glob(f"**/{OUTCOMES}")):
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
        raise ReplayError("recommend_plan needs exactly one of ttft_ms and wait_ms")
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
