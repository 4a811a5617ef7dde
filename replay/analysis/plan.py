"""A capacity plan read back and answered: the smallest fleet per traffic level under a p99 bound."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from replay.errors import ReplayError
from replay.runs import rundir
from replay.runs.names import BOUND_METRICS, FLEET_COLS, PLAN_TABLE


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


def bound_column(t: pl.DataFrame, metric: str) -> str:
    """The column a bound is checked on: the upper 95% bound when seeds ran."""
    base = BOUND_METRICS[metric]
    return f"{base}_hi" if f"{base}_hi" in t.columns else base


def plan(t: pl.DataFrame, metric: str, bound_ms: float) -> list[LevelAnswer]:
    """Per traffic level: the smallest fleet (fewest ranks, then fewest workers) with a
    config whose bounded metric is <= ``bound_ms``, that fleet's best config (lowest
    value, then best hit rate, then lowest id), and its best value at the next level."""
    col = bound_column(t, metric)
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


def format_plan(answers: Sequence[LevelAnswer], metric: str, bound_ms: float, col: str) -> str:
    what = f"{BOUND_METRICS[metric]} <= {bound_ms:g} ms (checked on {col})"
    lines = [f"capacity plan: {what}"]
    for a in answers:
        head = f"traffic x{a.load_scale:g}: "
        if a.row is None:
            m = a.best_miss
            mv = "no value" if m is None or m["_v"] is None else f"{m['_v']:.1f} ms"
            lines.append(head + "NO fleet in the grid meets the bound (closest: "
                         + (f"{m['workers']} workers x dp {m['dp_size']}, config {m['config_id']}, "
                            if m else "") + f"{mv}); add larger fleets")
            continue
        r = a.row
        lim, flo = r.get("worker_queue_limit"), r.get("saturation_queue_floor")
        s = (f"{r['workers']} workers x dp {r['dp_size']} ({r['ranks']} ranks), config "
             f"{r['config_id']} (--worker-queue-limit {_knob(lim)} --saturation-queue-floor "
             f"{_knob(flo)}): {a.value:.1f} ms")
        lo, hi = r.get(col.replace("_hi", "_lo")), r.get(col)
        if col.endswith("_hi") and lo is not None:
            base = BOUND_METRICS[metric]
            s += f" (mean {r[base]:.1f}, 95% {lo:.1f}..{hi:.1f} over {len(r.get('seeds') or [])} seeds)"
        if r.get("stable") is False:
            s += f" [seeds {','.join(map(str, r.get('unstable_seeds') or []))} disagree: run more seeds]"
        if a.next_level is None:
            s += "; no higher traffic level in the grid"
        elif a.next_value is None:
            s += f"; at x{a.next_level:g}: not run"
        else:
            room = bound_ms - a.next_value
            s += (f"; at x{a.next_level:g} the same fleet gives {a.next_value:.1f} ms, "
                  + (f"headroom {room:.1f} ms" if room >= 0 else f"over the bound by {-room:.1f} ms"))
        lines.append(head + s)
    return "\n".join(lines)


def recommend_plan(run_dir, ttft_ms: float | None, wait_ms: float | None, echo) -> int:
    """``recommend --plan``: print the plan; 0 when every level has a fleet, 1 when one has none."""
    if (ttft_ms is None) == (wait_ms is None):
        raise ReplayError("--plan needs exactly one of --max-ttft-p99-ms and --max-queue-wait-p99-ms")
    metric, bound_ms = ("ttft", ttft_ms) if ttft_ms is not None else ("queue_wait", wait_ms)
    t = read_plan(run_dir)
    col = bound_column(t, metric)
    if col not in t.columns:
        raise ReplayError(f"{Path(run_dir) / PLAN_TABLE}: column {col} missing")
    answers = plan(t, metric, float(bound_ms))
    echo(format_plan(answers, metric, float(bound_ms), col))
    return 0 if all(a.row is not None for a in answers) else 1


def _knob(v) -> str:
    return "none" if v is None else str(v)


# -- the frontier figure -----------------------------------------------------------------
