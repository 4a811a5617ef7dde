"""``report.html``: one self-contained page that answers "which floor and limit?".

The page is built from a run directory (``summary.parquet``, ``run.json``,
and where present ``decisions.parquet``, ``fleet.parquet`` and a closed-loop
simulator's ``closed_loop_summary.parquet``).  plotly.js is embedded inline
once, so the file opens offline.  Sections:

1. headline: trace facts and the best configs by hit rate under a bound on
   ``selected_waiting_p99``, with deltas against the no-gate baseline;
2. heatmaps over floor x limit; 3. decision-label and policy-reason mix;
4. one config over time beside the fleet's smallest fresh queue reading;
5. floor against dp_size; 6. the hit-rate / pressure trade-off with its
   Pareto front; 7. closed-loop results (when present); 8. provenance.

A closed-loop grid of the run's trace, when one is found or given, comes
before all of them (``replay/report/sections.py``), and a "Where locality
goes" section (the waterfall) follows the mix.

From Python (notebooks): :func:`figures` returns the plotly figures,
:func:`headline` the facts and best-config table, :func:`build_report`
writes the page.

The figures are built as plain plotly figure dicts (``replay/report/figspec.py``,
:func:`figure_dicts`) and the page is written from them without plotly's
graph objects, whose validation was most of a sample sweep's time;
:func:`figures` validates the same dicts into ``go.Figure`` objects.
"""

from __future__ import annotations

import datetime as _dt
import html
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
import polars as pl

from replay import __version__, labels
from replay.analysis import closed_loop as cl
from replay.analysis import waterfall as wf
from replay.config import GATE_KNOBS, KNOB_SHORT, KNOBS, RouterConfig
from replay.errors import NeedsForce, ParamError, ParamsError, ReplayError
from replay.report import figspec as fs
from replay.report import sections as rs
from replay.report.html import CSS as _CSS
from replay.report.html import FONT
from replay.report.html import esc as _e
from replay.report.html import fig_html as _fig_html
from replay.report.plan_page import render_plan_html
from replay.report.sections import waterfall_figures
from replay.runs import decisions as decision_store
from replay.runs import metrics as metrics_mod
from replay.runs import rundir
from replay.runs.metrics import flag_text, knob_text
from replay.runs.names import PLAN_TABLE
from replay.runs.rundir import CLOSED_LOOP, FLEET, REPORT, Run, load_run  # noqa: F401 - names of the run's files, re-exported
from replay.runs.rundir import unreadable as _unreadable

LIMIT, FLOOR = GATE_KNOBS
TOP_N = 5
TARGET_BINS = 120

FAILED = "failed"
DECISION_COLORS = {
    "cache_hit": "#2ca02c", "cache_miss": "#9aa5b1", "cache_worker_queued": "#ff7f0e",
    "all_queued": "#d62728", FAILED: "#222222",
}
REORG_ROUTED = ("cache_win", "saturation_pin", "miss_fallback")
REORG_COLORS = {"cache_win": "#98df8a", "saturation_pin": "#c5b0d5", "miss_fallback": "#c7c7c7"}
REASON_COLORS = {
    "cache_candidate": "#2ca02c", "saturation_pin": "#9467bd", "no_cache_candidate": "#9aa5b1",
    "no_cache_candidate_admission_backup": "#8c564b", "no_cache_candidate_pressure_backup": "#e377c2",
    "no_cache_candidate_range_fallback": "#bcbd22",
    "no_cache_candidate_capacity_fallback_power_of_two": "#17becf", FAILED: "#222222",
}



# the heatmap metrics, in page order (rows of the one metrics table, replay/runs/metrics.py)
HEATMAP_METRICS = tuple(metrics_mod.METRICS[n] for n in metrics_mod.HEATMAP)
# everything a hover shows about one config (labelled by ``hover_label``)
HOVER_METRICS = tuple(metrics_mod.METRICS[n] for n in metrics_mod.HOVER)


def _fmt(v: Any, fmt: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if fmt == "pct":
        return f"{100 * v:.1f}%"
    if fmt == "int":
        return f"{int(v):,}"
    if fmt == "f2":
        return f"{v:.2f}"
    if fmt == "si":
        v = float(v)
        for div, suf in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= div:
                return f"{v / div:#.3g}".rstrip(".") + suf  # 3 significant digits, zeros kept
        return f"{v:.3g}"
    return str(v)


def _num_key(v: Any) -> tuple:
    """Sort knob values with ``none`` first, then ascending."""
    return (0, 0) if v is None else (1, v)


# ---------------------------------------------------------------------------
# loading: one reader of run directories, replay/runs/rundir.py

# ---------------------------------------------------------------------------
# the analysis shared by figures, headline and page
class ReportView:
    """Derived columns, the slice shown in the grid figures, the best configs and baselines."""

    beside: int | None = None    # set by build_report: the config drawn beside the followed one

    def __init__(self, data: Run, *, config_id: int | None = None,
                 max_p99_waiting: float | None = None):
        self.data = data
        self.meta = data.meta
        s = data.summary
        s = s.with_columns(metrics_mod.METRICS[n].expr(s.columns).alias(n) for n in metrics_mod.DERIVED
                           if metrics_mod.METRICS[n].expr(s.columns) is not None)
        if "agreement" not in s.columns:
            s = s.with_columns(agreement=pl.lit(None, dtype=pl.Float64))
        self.per_rank = "per_rank_floor" in s.columns
        self.knobs = [k for k in KNOBS if k in s.columns]
        self.other_varying = [k for k in self.knobs if k not in (LIMIT, FLOOR)
                              and s.get_column(k).n_unique() > 1]
        self.summary = s.sort("config_id")
        self.rows = {r["config_id"]: r for r in self.summary.iter_rows(named=True)}
        # the pressure bound and the best configs under it
        p99 = [v for v in self.summary.get_column("selected_waiting_p99").to_list() if v is not None]
        if max_p99_waiting is not None:
            if not math.isfinite(float(max_p99_waiting)):
                raise ParamError("max_p99_waiting", f"must be a finite number, got {max_p99_waiting!r}")
            self.bound = float(max_p99_waiting)
            self.bound_note = f"p99 waiting at the chosen worker ≤ {knob_text(self.bound)} (given)"
        elif p99:
            self.bound = float(np.quantile(np.asarray(p99, dtype=float), 0.5, method="inverted_cdf"))
            self.bound_note = (f"p99 waiting at the chosen worker ≤ {knob_text(self.bound)} "
                               "(default: the median p99 over the grid's configs; "
                               "set it with --max-p99-waiting)")
        else:
            self.bound = math.inf
            self.bound_note = "no config has a known p99 waiting: no bound applied"
        ranked = sorted(
            (r for r in self.rows.values() if r["hit_rate"] is not None
             and (r["selected_waiting_p99"] is None and not p99
                  or r["selected_waiting_p99"] is not None and r["selected_waiting_p99"] <= self.bound)),
            key=lambda r: (-r["hit_rate"], r["selected_waiting_mean"] if r["selected_waiting_mean"]
                           is not None else math.inf, r["config_id"]))
        self.best_rows = ranked[:TOP_N]
        self.best = self.best_rows[0] if self.best_rows else None
        # the slice of the other knobs the grid figures show
        self.slice_note = ""
        if self.other_varying:
            default = RouterConfig()
            want = {k: getattr(default, k) for k in self.other_varying}
            match = [r for r in self.rows.values() if all(_same(r[k], v) for k, v in want.items())]
            if match:
                self.slice = want
                why = "the router's defaults"
            else:
                pick = self.best or self.rows[min(self.rows)]
                self.slice = {k: pick[k] for k in self.other_varying}
                why = "the best config's values"
            vals = ", ".join(f"{KNOBS[k].flag} {flag_text(k, v)}" for k, v in self.slice.items())
            listed = ", ".join(KNOBS[k].flag + ("" if KNOBS[k].router else " (a replay-only policy variant, "
                                                                         "not a router flag)")
                               for k in self.other_varying)
            self.slice_note = (f"Other knobs vary in this grid ({listed}); "
                               f"the grid figures show the slice {vals} ({why}). "
                               "The trade-off plot shows every config.")
        else:
            self.slice = {}
        self.slice_rows = [r for r in self.rows.values()
                           if all(_same(r[k], v) for k, v in self.slice.items())]
        # the config followed over time
        if config_id is not None:
            if config_id not in self.rows:
                raise ParamError("config_id", f"{config_id}: no such config_id in this run "
                                 f"(ids: {_id_list(self.rows)})", flag="--config")
            self.chosen = self.rows[config_id]
            self.chosen_note = f"config {config_id} (given)"
        elif self.best is not None:
            self.chosen = self.best
            self.chosen_note = f"config {self.best['config_id']} (the best under the pressure bound)"
        else:
            self.chosen = self.rows[min(self.rows)] if self.rows else None
            self.chosen_note = "the first config (no config met the pressure bound)"

    # -- config helpers -------------------------------------------------------
    def baseline_for(self, row: dict) -> dict | None:
        """The no-gate config (limit none) with the same other knobs, if the grid has it."""
        for r in self.rows.values():
            if r[LIMIT] is None and all(_same(r[k], row[k]) for k in self.knobs if k not in (LIMIT, FLOOR)):
                return r
        return None

    def label(self, row: dict, *, short: bool = False) -> str:
        lim, fl = knob_text(row[LIMIT]), knob_text(row[FLOOR])
        if short:
            text = f"{lim}/{fl}"
        else:
            text = f"limit {lim} · floor {fl}"
            if self.per_rank and row.get("per_rank_limit") is not None:
                text += f" (per rank {knob_text(row['per_rank_limit'])}/{knob_text(row.get('per_rank_floor'))})"
        extra = [f"{KNOBS[k].flag.lstrip('-')} {flag_text(k, row[k])}" for k in self.other_varying]
        if extra and not short:
            text += " · " + ", ".join(extra)
        return text

    def hover(self, row: dict) -> str:
        lines = [f"<b>config {row['config_id']}</b>: {html.escape(self.label(row))}"]
        for m in HOVER_METRICS:
            v = row.get(m.name)
            if v is None and m.name in ("agreement", "selected_queue_ms_mean", "selected_waiting_uncached_mean"):
                continue
            lines.append(f"{m.hover_label}: {_fmt(v, m.fmt)}")
        lines.append(f"routed {row['routed']:,} of {row['requests']:,} requests")
        return "<br>".join(lines)


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0) or (
            math.isnan(float(a)) and math.isnan(float(b)))
    return a == b


def _id_list(rows: dict) -> str:
    ids = sorted(rows)
    text = ", ".join(str(i) for i in ids[:20])
    return text + (", ..." if len(ids) > 20 else "")


# ---------------------------------------------------------------------------
# figures
def _base_layout(fig: fs.Fig, *, height: int, title: str | None = None, **kw) -> None:
    fig.update_layout(height=height, font=FONT, template=fs.template("plotly_white"),
                      margin=dict(l=70, r=30, t=70 if title else 40, b=50),
                      hoverlabel=dict(align="left", font=dict(size=12)), **kw)
    if title:
        fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=15)))


def fig_heatmaps(a: ReportView) -> dict:
    """One heatmap per metric over floor (x) x limit (y); ``none`` is its own row/column."""
    rows = a.slice_rows
    limits = sorted({r[LIMIT] for r in rows}, key=_num_key)
    floors = sorted({r[FLOOR] for r in rows}, key=_num_key)
    xs = [knob_text(f) for f in floors]
    ys = [knob_text(v) for v in limits]
    if a.per_rank:
        pr_l = {r[LIMIT]: r.get("per_rank_limit") for r in rows}
        pr_f = {r[FLOOR]: r.get("per_rank_floor") for r in rows}
        xs = [f"{knob_text(f)} ({knob_text(pr_f.get(f))}/rank)" if f is not None else "none" for f in floors]
        ys = [f"{knob_text(v)} ({knob_text(pr_l.get(v))}/rank)" if v is not None else "none" for v in limits]
    cell = {(r[LIMIT], r[FLOOR]): r for r in rows}
    ncols = 2
    nrows = -(-len(HEATMAP_METRICS) // ncols)
    ranges = {m.name: colour_range([r.get(m.name) for r in rows], m.fmt) for m in HEATMAP_METRICS}
    fig = fs.grid(rows=nrows, cols=ncols, subplot_titles=[f"{m.label}: {ranges[m.name][2]}" for m in HEATMAP_METRICS],
                  shared_xaxes=True, shared_yaxes=True, horizontal_spacing=0.06,
                  vertical_spacing=0.36 / nrows)
    hover = [[a.hover(cell[(lv, fv)]) if (lv, fv) in cell else
              f"limit {knob_text(lv)} · floor {knob_text(fv)}: not a valid router config (skipped)"
              for fv in floors] for lv in limits]
    for i, m in enumerate(HEATMAP_METRICS):
        z = [[(cell[(lv, fv)].get(m.name) if (lv, fv) in cell else None) for fv in floors] for lv in limits]
        txt = [[(_fmt(v, m.fmt) if v is not None else "") for v in zrow] for zrow in z]
        # colours: greener is better for every metric
        scale = "RdYlGn" if m.better == "higher" else "RdYlGn_r"
        fig.add_trace(fs.trace(
            "heatmap", z=z, x=xs, y=ys, customdata=hover, text=txt, texttemplate="%{text}",
            hovertemplate="%{customdata}<extra></extra>", colorscale=fs.colorscale(scale), showscale=False,
            zmin=ranges[m.name][0], zmax=ranges[m.name][1],
            xgap=2, ygap=2, name=m.label, hoverongaps=False,
        ), row=i // ncols + 1, col=i % ncols + 1)
    per_panel = max(170, 34 * len(ys) + 90)
    _base_layout(fig, height=nrows * per_panel + 80)
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category", autorange="reversed")
    for c in range(1, ncols + 1):
        fig.update_xaxes(title=dict(text="saturation queue floor"), row=nrows, col=c, showticklabels=True)
    for r in range(1, nrows + 1):
        fig.update_yaxes(title=dict(text="queue limit"), row=r, col=1)
    fig.update_xaxes(showticklabels=True)
    return fig.to_dict()


MIN_COLOUR_SPAN = {"pct": 0.02}
"""The smallest difference a heatmap colours from red to green, by format: 2 points for rates;
other metrics 20% of their largest magnitude (at least 1).  A narrower spread is drawn in the
middle of the scale, so that noise is not painted as a verdict."""


def colour_range(values, fmt: str) -> tuple[float | None, float | None, str]:
    """A heatmap's ``zmin``, ``zmax`` and the range said in its title (the values' own range; the
    colour span widened around its middle to the metric's minimum meaningful span)."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None, None, "no values"
    lo, hi = min(vals), max(vals)
    need = MIN_COLOUR_SPAN.get(fmt, max(0.2 * max(abs(lo), abs(hi)), 1.0))
    text = f"{_fmt(lo, fmt)} – {_fmt(hi, fmt)}" if hi > lo else f"all {_fmt(lo, fmt)}"
    if hi - lo >= need:
        return lo, hi, text
    mid = (lo + hi) / 2
    return mid - need / 2, mid + need / 2, text + " (narrow: muted)"


def _int_axis(values) -> dict:
    """Axis settings for integer counts: whole-number ticks only."""
    vals = [v for v in values if v is not None]
    span = (max(vals) - min(vals)) if vals else 0
    return dict(tickformat=",d", dtick=max(1, math.ceil(span / 6)))


def _ordered_configs(a: ReportView) -> list[dict]:
    return sorted(a.slice_rows, key=lambda r: (_num_key(r[LIMIT]), _num_key(r[FLOOR]), r["config_id"]))


def _mix_rows(a: ReportView) -> tuple[list[dict], list[str]]:
    """The configs of the mix figures and their x labels: the grid's slice, or, when
    the grid holds both routing engines, that slice under each engine side by side."""
    if "chat_routing" not in a.other_varying:
        rows = _ordered_configs(a)
        return rows, [a.label(r, short=True) for r in rows]
    keep = {k: v for k, v in a.slice.items() if k != "chat_routing"}
    rows = sorted((r for r in a.rows.values() if all(_same(r[k], v) for k, v in keep.items())),
                  key=lambda r: (r["chat_routing"], _num_key(r[LIMIT]), _num_key(r[FLOOR]), r["config_id"]))
    return rows, [f"{r['chat_routing']} {a.label(r, short=True)}" for r in rows]


def fig_mix(a: ReportView, kind: str) -> dict:
    """Stacked shares per config: decision labels (``kind="decision"``; a reorg config's
    own outcome labels beside legacy's, docs/replay-model.md) or policy reasons."""
    rows, x = _mix_rows(a)
    if kind == "decision":
        cats = [(d, d, DECISION_COLORS[d]) for d in labels.DECISIONS]
        # the reorg books no label: its routed outcomes (its 503s are in "failed")
        cats += [(f"reorg_{o}", f"reorg {o} (ours)", REORG_COLORS[o]) for o in REORG_ROUTED
                 if f"reorg_{o}" in rows[0]] if rows else []
        title = "Decision labels per config (share of requests; reorg: the replay's own outcome labels)"
    else:
        cats = [(f"policy_{p}", p, REASON_COLORS[p]) for p in labels.POLICY_REASONS]
        title = "Policy reasons per config (share of requests)"
    cats.append((FAILED, "failed (503)", DECISION_COLORS[FAILED]))
    fig = fs.Fig()
    for col, name, color in cats:
        y = [(r[col] / r["requests"]) if r["requests"] else None for r in rows]
        if not any(v for v in y if v):
            continue
        fig.add_trace(fs.trace(
            "bar", x=x, y=y, name=name, marker=dict(color=color), customdata=[a.hover(r) for r in rows],
            hovertemplate=f"<b>{name}</b>: %{{y:.1%}}<br>%{{customdata}}<extra></extra>"))
    _base_layout(fig, height=380, title=title, barmode="stack",
                 legend=dict(orientation="h", y=-0.28, x=0, traceorder="normal"))
    fig.update_yaxes(tickformat=".0%", range=[0, 1], title=dict(text="share"))
    fig.update_xaxes(type="category", title=dict(text="limit / floor"), tickangle=-45 if len(x) > 24 else 0)
    fig.update_layout(margin=dict(b=110))
    return fig.to_dict()


def _nice_interval_ns(span_ns: int) -> int:
    steps_s = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 21600, 43200, 86400]
    want = span_ns / TARGET_BINS / 1e9
    for s in steps_s:
        if s >= want:
            return s * 1_000_000_000
    return int(math.ceil(want / 86400)) * 86400 * 1_000_000_000


def _interval_text(ns: int) -> str:
    s = ns // 1_000_000_000
    if s % 3600 == 0:
        return f"{s // 3600} h"
    if s % 60 == 0:
        return f"{s // 60} min"
    return f"{s} s"


# Over time.  fleet.parquet holds one row per request and the decisions one per
# request and config (hundreds of millions of rows on a long trace), while the
# figure needs a few numbers per interval.  Neither is ever read whole: the
# fleet's readings are counted per (interval, reading) in polars' streaming
# engine, and the decisions of the configs shown are streamed beside the fleet's
# rows and counted per (config, interval) batch by batch, so memory is bounded
# by the number of intervals and configs, not by the number of requests.
BATCH = 1 << 18  # rows read at a time from fleet.parquet and from a decisions file
COUNTS = ("requests", *labels.DECISIONS, FAILED, "pinned", "gate_rejected")
FLEET_STATS = ("fleet_min_p50", "fleet_min_min", "fleet_min_max")


@dataclass
class FleetBins:
    """fleet.parquet per interval: the bins, and its readings counted per bin."""

    t0: int               # first request's ts; bin b covers [t0 + b*step, t0 + (b+1)*step)
    step: int             # interval, ns (``_nice_interval_ns`` over the ts span)
    rows: int             # fleet rows (requests)
    hist: pl.DataFrame    # bin, w (fleet_min_waiting, null: no fresh reading), n (requests)
    stats: pl.DataFrame   # bin, fleet_min_p50, fleet_min_min, fleet_min_max (every bin)

    def bin_expr(self) -> pl.Expr:
        return ((pl.col("ts") - self.t0) // self.step).alias("bin")

    def at_or_above(self, floor: Any) -> pl.DataFrame:
        """Per bin: requests with no fresh reading below ``floor`` (the pin's precondition)."""
        if floor is None:
            return self.stats.select("bin", reading_at_or_above_floor=pl.lit(None, dtype=pl.get_index_type()))
        allowed = (pl.col("w") >= floor) | pl.col("w").is_null()
        return (self.hist.group_by("bin")
                .agg(reading_at_or_above_floor=pl.col("n").filter(allowed).sum()
                     .cast(pl.get_index_type())))


def fleet_bins(fleet: pl.LazyFrame | pl.DataFrame) -> FleetBins | None:
    """The over-time bins of a fleet table and its readings per bin (None: no rows), with
    two streaming passes: the ts span, then counts per (bin, reading)."""
    lf = fleet.lazy()
    span = (lf.select(t0=pl.col("ts").min(), t1=pl.col("ts").max(), n=pl.len())
            .collect(engine="streaming").row(0, named=True))
    if not span["n"] or span["t0"] is None:
        return None
    t0 = int(span["t0"])
    step = _nice_interval_ns(max(int(span["t1"]) - t0, 1))
    bins = FleetBins(t0, step, int(span["n"]), pl.DataFrame(), pl.DataFrame())
    bins.hist = (lf.group_by(bins.bin_expr(), pl.col("fleet_min_waiting").alias("w"))
                 .agg(n=pl.len().cast(pl.Int64)).collect(engine="streaming")
                 .sort("bin", "w", nulls_last=True))
    # median, min and max of the known readings per bin, from the counts: the value at
    # 0-based rank k is the smallest reading whose cumulative count exceeds k
    known = (bins.hist.drop_nulls("w")
             .with_columns(cum=pl.col("n").cum_sum().over("bin"), tot=pl.col("n").sum().over("bin")))
    stats = known.group_by("bin").agg(
        lo=pl.col("w").filter(pl.col("cum") > (pl.col("tot") - 1) // 2).min(),
        hi=pl.col("w").filter(pl.col("cum") > pl.col("tot") // 2).min(),
        fleet_min_min=pl.col("w").min(), fleet_min_max=pl.col("w").max())
    bins.stats = (bins.hist.select(pl.col("bin").unique()).join(stats, on="bin", how="left")
                  .select("bin", ((pl.col("lo") + pl.col("hi")) / 2).alias("fleet_min_p50"),
                          "fleet_min_min", "fleet_min_max")
                  .sort("bin"))
    return bins


def _label_counts() -> list[pl.Expr]:
    return [pl.len().alias("requests"),
            *[(pl.col("decision") == d).sum().alias(d) for d in labels.DECISIONS],
            pl.col("decision").is_null().sum().alias(FAILED),
            (pl.col("policy_reason") == "saturation_pin").sum().alias("pinned"),
            (pl.col("gate_rejected") > 0).sum().alias("gate_rejected")]


def _add_counts(parts: list[pl.DataFrame]) -> pl.DataFrame:
    """Partial per (config_id, bin) counts added up."""
    return (pl.concat([p.with_columns(pl.col(c).cast(pl.Int64) for c in COUNTS) for p in parts])
            .group_by("config_id", "bin").agg(pl.col(c).sum() for c in COUNTS))


def _file_groups(files: list[Path], ids: list[int]) -> list[tuple[list[tuple[Path, int]], list[int]]]:
    """The configs grouped by the decisions files that hold them (with each file's rows),
    from the files' config_id statistics: a sharded run writes one file per window and
    block of configs, and the configs of one block are streamed together."""
    info = []
    for f in files:
        try:
            info.append((f, *decision_store.file_info(f)))   # either decisions layout
        except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
            raise _unreadable(f, err) from None
    groups: dict[tuple[int, ...], list[int]] = {}
    for c in ids:
        key = tuple(i for i, (_f, _n, lo, hi) in enumerate(info) if lo <= c <= hi)
        groups.setdefault(key, []).append(c)
    return [([info[i][:2] for i in key], cs) for key, cs in groups.items()]


def _decision_scan(files: list[Path], ids: list[int], key_dtype: pl.DataType,
                   rows: slice | None = None) -> pl.LazyFrame:
    """The columns the over-time figure counts, of the configs ``ids`` (``rows``: a slice
    of the files' rows, taken before the filter so that the reader decodes only it)."""
    dec = (decision_store.scan_file(files[0], rows=rows) if rows is not None
           else decision_store.scan_decisions(files))
    dec = dec.filter(pl.col("config_id").is_in(ids))
    rid = pl.col("request_id")
    if dec.collect_schema()["request_id"] != key_dtype:
        rid = rid.cast(key_dtype)
    return dec.select("config_id", rid, "decision", "policy_reason", "gate_rejected")


def _aligned_counts(files: list[tuple[Path, int]], ids: list[int], fleet: pl.LazyFrame,
                    bins: FleetBins) -> pl.DataFrame | None:
    """Per (config_id, bin) label counts, matching decisions to fleet rows by position.

    A sweep writes fleet.parquet and the decisions in the same (trace) order, so the
    k-th decision row of a config is the fleet's k-th row.  Both are read in slices
    of ``BATCH`` rows (the Parquet reader decodes only the slice); a buffer holds the
    fleet rows between the configs' positions (about one slice, the configs of one
    file advance together).  Every row's request_id is checked against its fleet row:
    None when they differ or the counts do not match (the caller then joins on it).
    """
    key = fleet.collect_schema()["request_id"]
    fl = fleet.select(pl.col("request_id").alias("fleet_request_id"), bins.bin_expr())
    buf = pl.DataFrame(schema=fl.collect_schema())
    start = 0                       # fleet position of buf's first row
    read = 0                        # fleet rows read so far
    seen = dict.fromkeys(ids, 0)    # decision rows of each config so far
    parts: list[pl.DataFrame] = []
    for path, n_rows in files:
        for lo in range(0, n_rows, BATCH):
            batch = _decision_scan([path], ids, key, slice(lo, min(lo + BATCH, n_rows))).collect()
            if batch.height == 0:
                continue
            at = (pl.col("config_id").replace_strict(seen, return_dtype=pl.Int64)
                  + pl.int_range(pl.len(), dtype=pl.Int64).over("config_id") - start)
            idx = batch.select(at).to_series()
            more, have = [buf], buf.height
            while have <= idx.max():    # read on until the fleet row of every position
                if read >= bins.rows:   # more decision rows than requests
                    return None
                more.append(fl.slice(read, BATCH).collect())
                read += more[-1].height
                have += more[-1].height
            if len(more) > 1:
                buf = pl.concat(more, rechunk=True)
            matched = pl.concat([batch, buf.select(pl.all().gather(idx))], how="horizontal")
            if not matched.select(pl.col("request_id").eq_missing(pl.col("fleet_request_id")).all()).item():
                return None
            parts.append(matched.group_by("config_id", "bin").agg(_label_counts()))
            if len(parts) >= 512:
                parts = [_add_counts(parts)]
            for c, n in batch.group_by("config_id").len().iter_rows():
                seen[c] += n
            low = min(seen.values())
            buf = buf.slice(low - start)
            start = low
    if not parts or any(n != bins.rows for n in seen.values()):
        return None
    return _add_counts(parts)


def _joined_counts(files: list[tuple[Path, int]], ids: list[int], fleet: pl.LazyFrame,
                   bins: FleetBins) -> pl.DataFrame:
    """Per (config_id, bin) label counts by a streaming join on request_id (decisions not in
    the fleet's order: its hash table holds the fleet's ids)."""
    dec = _decision_scan([f for f, _n in files], ids, fleet.collect_schema()["request_id"])
    parts = [fleet.select("request_id", bins.bin_expr()).join(dec, on="request_id", how="inner")
             .group_by("config_id", "bin").agg(_label_counts()).collect(engine="streaming")]
    return _add_counts(parts)


def decision_counts(files: list[Path], ids: list[int], fleet: pl.LazyFrame | pl.DataFrame,
                    bins: FleetBins) -> pl.DataFrame:
    """Per config_id and bin: requests, decision labels, failed, pinned and gate-rejected."""
    fleet = fleet.lazy()
    parts = []
    for group_files, group_ids in _file_groups(list(files), ids):
        if not group_files:
            continue
        counts = _aligned_counts(group_files, group_ids, fleet, bins)
        if counts is None:
            counts = _joined_counts(group_files, group_ids, fleet, bins)
        parts.append(counts)
    if not parts:
        return pl.DataFrame(schema={"config_id": pl.Int32, "bin": pl.Int64, **dict.fromkeys(COUNTS, pl.Int64)})
    return _add_counts(parts)


def over_time_frames(a: ReportView, config_ids: list[int]) -> dict[int, pl.DataFrame]:
    """Per config and interval: label shares, pin and gate counts, the fleet's readings."""
    data = a.data
    if data.decisions is None or data.fleet is None:
        raise ReplayError("over time: the run has no decisions.parquet or fleet.parquet")
    bins = fleet_bins(data.fleet)
    if bins is None:
        return {c: pl.DataFrame() for c in config_ids}
    counts = decision_counts(data.decisions, config_ids, data.fleet, bins)
    idx = pl.get_index_type()
    # one lazy query a config (its eager steps one by one were most of the figure's cost on a
    # small run); each result is a config's intervals, never request-sized
    stats, lazy = bins.stats.lazy(), counts.lazy()
    allowed: dict[Any, pl.LazyFrame] = {}   # the pin-allowed counts, once per floor
    out = {}
    for cid in config_ids:
        floor = a.rows[cid][FLOOR]
        if floor not in allowed:
            allowed[floor] = bins.at_or_above(floor).lazy()
        out[cid] = (lazy.filter(pl.col("config_id") == cid).drop("config_id")
                    .with_columns(pl.col(c).cast(idx) for c in COUNTS)
                    .join(stats, on="bin", how="left")
                    .join(allowed[floor], on="bin", how="left")
                    .sort("bin")
                    .select("bin", *COUNTS, *FLEET_STATS, "reading_at_or_above_floor")
                    .with_columns(t_ns=pl.col("bin") * bins.step + bins.t0 + bins.step // 2,
                                  interval_ns=pl.lit(bins.step, dtype=pl.Int64))
                    .collect())
    return out


def over_time_configs(a: ReportView) -> list[int]:
    """Configs offered over time: the chosen one first, then the best under the bound, the
    best with a floor set, and the chosen config's no-gate baseline (at most six)."""
    ids = [a.chosen["config_id"]] + [r["config_id"] for r in a.best_rows]
    floored = [r for r in a.best_rows if r[FLOOR] is not None]
    if not floored:
        cand = sorted((r for r in a.rows.values() if r[FLOOR] is not None and r["hit_rate"] is not None),
                      key=lambda r: (-r["hit_rate"], r["config_id"]))
        floored = cand[:1]
    ids += [r["config_id"] for r in floored[:1]]
    b = a.baseline_for(a.chosen)
    if b is not None:
        ids.append(b["config_id"])
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    head, rest = out[:1], out[1:]
    keep_floor = [i for i in rest if floored and i == floored[0]["config_id"]]
    keep_base = [i for i in rest if b is not None and i == b["config_id"]]
    others = [i for i in rest if i not in keep_floor and i not in keep_base]
    return head + (others[: 6 - 1 - len(keep_floor) - len(keep_base)]) + keep_floor + keep_base


def fig_over_time(a: ReportView, config_ids: list[int] | None = None) -> dict:
    """Label shares per interval, pin and gate shares, and the fleet's smallest fresh queue
    reading beside the floor; a dropdown switches between ``config_ids`` (first shown)."""
    ids = config_ids or over_time_configs(a)
    frames = over_time_frames(a, ids)
    fig = fs.grid(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.09, row_heights=[0.42, 0.22, 0.36],
                  subplot_titles=["decision labels (share of the interval's requests)",
                                  "saturation pin and queue gate (share of the interval's requests)",
                                  "fleet's smallest fresh queue reading (num_waiting_reqs, summed over ranks)"])
    first = frames[ids[0]]
    if first.height == 0:
        _base_layout(fig, height=300, title="no requests")
        return fig.to_dict()
    t = first["t_ns"].to_numpy().astype("datetime64[ns]")
    owner: list[int | None] = []  # config of each trace (None: shared by all)

    def add(tr, row, cid):
        fig.add_trace(tr, row=row, col=1)
        owner.append(cid)

    # the fleet's reading does not depend on the config
    lo = first["fleet_min_min"].to_numpy().astype(float)
    hi = first["fleet_min_max"].to_numpy().astype(float)
    known = ~np.isnan(lo)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], known.astype(np.int8), [0]])))
    for k, (a0, a1) in enumerate(zip(edges[::2], edges[1::2], strict=True)):  # one band per stretch without gaps
        xs = np.concatenate([t[a0:a1], t[a0:a1][::-1]])
        add(fs.trace("scatter", x=xs, y=np.concatenate([hi[a0:a1], lo[a0:a1][::-1]]), mode="lines", fill="toself",
                       line=dict(width=0), fillcolor="rgba(31,119,180,0.18)", hoverinfo="skip",
                       name="min..max in interval", legendgroup="band", showlegend=k == 0), 3, None)
    add(fs.trace("scatter", x=t, y=first["fleet_min_p50"].to_numpy().astype(float), mode="lines",
                   line=dict(color="#1f77b4", width=2), name="smallest fresh reading (median)",
                   hovertemplate="fleet reading median %{y}<extra></extra>"), 3, None)
    titles = {}
    for k, cid in enumerate(ids):
        row = a.rows[cid]
        df = frames[cid]
        vis = k == 0
        n_safe = np.where(df["requests"].to_numpy() > 0, df["requests"].to_numpy().astype(float), np.nan)
        for d in (*labels.DECISIONS, FAILED):
            y = df[d].to_numpy() / n_safe
            if not np.nansum(y):
                continue
            name = d if d != FAILED else "failed (503)"
            add(fs.trace("scatter", x=t, y=y, name=name, stackgroup=f"labels{cid}", mode="lines", visible=vis,
                           line=dict(width=0.5, color=DECISION_COLORS[d]), legendgroup=name,
                           hovertemplate=f"{name}: %{{y:.1%}}<extra></extra>"), 1, cid)
        add(fs.trace("scatter", x=t, y=df["pinned"].to_numpy() / n_safe, name="saturation pin", mode="lines",
                       visible=vis, line=dict(color=REASON_COLORS["saturation_pin"], width=2),
                       hovertemplate="pinned: %{y:.1%}<extra></extra>"), 2, cid)
        add(fs.trace("scatter", x=t, y=df["gate_rejected"].to_numpy() / n_safe, name="gate rejected a candidate",
                       mode="lines", visible=vis, line=dict(color="#ff7f0e", width=1.5, dash="dot"),
                       hovertemplate="gate rejected: %{y:.1%}<extra></extra>"), 2, cid)
        if row[FLOOR] is not None:
            add(fs.trace("scatter", x=t, y=df["reading_at_or_above_floor"].to_numpy() / n_safe,
                           name="no fresh reading below floor (pin allowed)", mode="lines", visible=vis,
                           line=dict(color="#555", width=1.2, dash="dash"),
                           hovertemplate="pin allowed: %{y:.1%}<extra></extra>"), 2, cid)
        for val, name, color in ((row[FLOOR], "floor", "#9467bd"), (row[LIMIT], "limit", "#d62728")):
            if val is None:
                continue
            # the ends as a datetime array, not a list of numpy scalars: a list is encoded as raw
            # nanosecond integers, which a date axis does not draw
            add(fs.trace("scatter", x=t[[0, -1]], y=[val, val], mode="lines", name=f"{name} {val}", visible=vis,
                           line=dict(color=color, width=2, dash="dash"),
                           hovertemplate=f"{name} {val}<extra></extra>"), 3, cid)
        titles[cid] = (f"Config {cid} over time ({html.escape(a.label(row))}), "
                       f"{_interval_text(int(df['interval_ns'][0]))} intervals")
    _base_layout(fig, height=700, title=titles[ids[0]], hovermode="x unified",
                 legend=dict(orientation="h", y=-0.1, x=0))
    fig.update_layout(margin=dict(t=110))
    if len(ids) > 1:
        buttons = []
        for cid in ids:
            tag = " (best)" if a.best is not None and cid == a.best["config_id"] else ""
            if a.rows[cid][LIMIT] is None:
                tag = " (no gate)"
            buttons.append(dict(
                label=f"config {cid}: {a.label(a.rows[cid])}{tag}", method="update",
                args=[{"visible": [o is None or o == cid for o in owner]}, {"title.text": titles[cid]}]))
        # below the title and the mode bar, above the first panel's title
        fig.update_layout(updatemenus=[dict(type="dropdown", buttons=buttons, active=0, x=1.0, xanchor="right",
                                            y=1.0, yanchor="bottom", pad=dict(b=48), showactive=True)])
    fig.update_yaxes(tickformat=".0%", range=[0, 1], row=1, col=1)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(rangemode="tozero", title=dict(text="waiting"), row=3, col=1)
    return fig.to_dict()


def _dp_lines(a: ReportView) -> tuple[list[dict], str]:
    """Points for the floor-vs-dp figure and the note on where dp_size came from."""
    rows = [r for r in a.slice_rows if r[FLOOR] is not None and r[LIMIT] is not None]
    pts = []
    if a.per_rank:
        for r in rows:
            pts.append(dict(dp=int(r["dp_size"]), limit=r[LIMIT], per_rank_limit=r["per_rank_limit"],
                            per_rank_floor=r["per_rank_floor"], row=r))
        sizes = sorted({p["dp"] for p in pts})
        src = "per-rank values from this --per-dp-rank run"
    else:
        dps = (a.meta.get("trace", {}).get("facts", {}) or {}).get("dp_sizes") or {}
        sizes = sorted(int(k) for k in dps if int(k) > 0) or [1]
        for dp in sizes:
            for r in rows:
                pts.append(dict(dp=dp, limit=r[LIMIT], per_rank_limit=r[LIMIT] / dp,
                                per_rank_floor=r[FLOOR] / dp, row=r))
        src = ("fleet-wide limit and floor divided by each dp_size of the fleet "
               "(a --per-dp-rank sweep gives exact per-rank grids)")
    if len(sizes) == 1:
        note = (f"This run has one dp_size ({sizes[0]}), so there is one line per queue limit; "
                f"runs of fleets with other dp sizes add their own lines. Source: {src}.")
    else:
        note = (f"dp sizes present: {', '.join(map(str, sizes))}; the metrics are fleet-wide, "
                f"so lines of a mixed fleet differ only in the per-rank scale. Source: {src}.")
    return pts, note


def fig_floor_vs_dp(a: ReportView) -> dict:
    """Metrics against the per-rank floor, one line per (dp_size, limit)."""
    pts, _note = _dp_lines(a)
    metrics = (HEATMAP_METRICS[0], HEATMAP_METRICS[2], HEATMAP_METRICS[5])
    fig = fs.grid(rows=1, cols=3, subplot_titles=[m.label for m in metrics], horizontal_spacing=0.07)
    groups: dict[tuple, list[dict]] = {}
    for p in pts:
        groups.setdefault((p["dp"], p["limit"]), []).append(p)
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
               "#7f7f7f", "#bcbd22", "#17becf"]
    dashes = ["solid", "dash", "dot", "dashdot"]
    dp_sizes = sorted({k[0] for k in groups})
    for gi, ((dp, lim), ps) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1]))):
        ps = sorted(ps, key=lambda p: p["per_rank_floor"])
        name = f"dp {dp} · limit {knob_text(lim)} ({knob_text(round(ps[0]['per_rank_limit'], 3))}/rank)"
        color = palette[gi % len(palette)]
        for ci, m in enumerate(metrics):
            fig.add_trace(fs.trace(
                "scatter", x=[p["per_rank_floor"] for p in ps], y=[p["row"][m.name] for p in ps],
                mode="lines+markers", name=name, legendgroup=name, showlegend=ci == 0,
                line=dict(color=color, dash=dashes[dp_sizes.index(dp) % len(dashes)]),
                customdata=[a.hover(p["row"]) for p in ps],
                hovertemplate="%{customdata}<extra>" + html.escape(name) + "</extra>"), row=1, col=ci + 1)
    _base_layout(fig, height=420, legend=dict(orientation="h", y=-0.22, x=0))
    fig.update_layout(margin=dict(b=110))
    fig.update_xaxes(title=dict(text="floor per rank"))
    fig.update_yaxes(**_int_axis(p["row"][metrics[2].name] for p in pts), row=1, col=3)
    fig.update_yaxes(tickformat=".1%", row=1, col=1)
    fig.update_yaxes(tickformat=".1%", row=1, col=2)
    return fig.to_dict()


def pareto_front(points: list[tuple[float, float, int]]) -> list[int]:
    """Ids of the points no other point beats: pressure ``x`` lower-or-equal and hit ``y``
    higher-or-equal, one of them strictly.  ``points`` are ``(x, y, id)``."""
    front = []
    best_y = -math.inf
    for _x, y, i in sorted(points, key=lambda p: (p[0], -p[1], p[2])):
        if y > best_y:
            front.append(i)
            best_y = y
    return front


VARIANT_SYMBOLS = ("circle", "triangle-up", "square", "x", "triangle-down", "cross")
VARIANT_COLORS = ("#9aa5b1", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def variant_series(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """``rows`` split by their replay-only policy variants (a variant is drawn as its own
    series): ``("", rows under the router's own rules)`` first, then one ``(label, rows)`` per
    variant setting, labelled as not a router flag.  A grid without variants is one series."""
    keys = [k for k, spec in KNOBS.items() if not spec.router]

    def tag(r: dict) -> str:
        parts = [f"{KNOBS[k].flag} {r[k]}" for k in keys
                 if r.get(k) is not None and r[k] != KNOBS[k].choices[0]]
        return f"variant {', '.join(parts)} (not a router flag)" if parts else ""

    groups: dict[str, list[dict]] = {"": []}
    for r in rows:
        groups.setdefault(tag(r), []).append(r)
    return [(t, g) for t, g in groups.items() if g or t == ""]


def fig_tradeoff(a: ReportView) -> dict:
    """Hit rate against pressure (p99 and mean waiting), every config; Pareto fronts highlighted."""
    rows = [r for r in a.rows.values() if r["hit_rate"] is not None]
    fig = fs.grid(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05,
                  subplot_titles=["against p99 waiting at the chosen worker",
                                  "against mean waiting at the chosen worker"])
    for ci, key in enumerate(("selected_waiting_p99", "selected_waiting_mean")):
        pts = [r for r in rows if r[key] is not None]
        front = set(pareto_front([(float(r[key]), float(r["hit_rate"]), r["config_id"]) for r in pts]))
        others = [r for r in pts if r["config_id"] not in front]
        on = sorted((r for r in pts if r["config_id"] in front), key=lambda r: r[key])
        show = ci == 0
        for si, (tag, group) in enumerate(variant_series(others)):
            fig.add_trace(fs.trace(
                "scatter", x=[r[key] for r in group], y=[r["hit_rate"] for r in group], mode="markers",
                name=tag or "config", legendgroup=tag or "config", showlegend=show,
                marker=dict(size=9, color="#9aa5b1", opacity=0.75, line=dict(width=0.5, color="#555"))
                if not tag else dict(size=10, symbol=VARIANT_SYMBOLS[si % len(VARIANT_SYMBOLS)],
                                     color=VARIANT_COLORS[si % len(VARIANT_COLORS)], opacity=0.85,
                                     line=dict(width=0.5, color="#555")),
                customdata=[a.hover(r) for r in group], hovertemplate="%{customdata}<extra></extra>"),
                row=1, col=ci + 1)
        fig.add_trace(fs.trace(
            "scatter", x=[r[key] for r in on], y=[r["hit_rate"] for r in on], mode="lines+markers",
            name="Pareto front", legendgroup="front", showlegend=show,
            marker=dict(size=11, color="#d62728"), line=dict(color="#d62728", width=2),
            customdata=[a.hover(r) for r in on], hovertemplate="<b>Pareto</b> %{customdata}<extra></extra>"),
            row=1, col=ci + 1)
        for tag, r, sym, color in (("highest hit rate under bound", a.best, "star", "#2ca02c"),
                                   ("no-gate baseline", a.baseline_for(a.best) if a.best else None,
                                    "diamond-open", "#111")):
            if r is None or r[key] is None:
                continue
            fig.add_trace(fs.trace(
                "scatter", x=[r[key]], y=[r["hit_rate"]], mode="markers", name=tag, legendgroup=tag,
                showlegend=show,
                marker=dict(size=17 if sym == "star" else 15, symbol=sym, color=color,
                            line=dict(width=1.5, color=color)),
                customdata=[a.hover(r)], hovertemplate=f"<b>{tag}</b> %{{customdata}}<extra></extra>"),
                row=1, col=ci + 1)
        if ci == 0 and math.isfinite(a.bound):
            fig.add_vline(x=a.bound, line=dict(color="#555", dash="dash", width=1), row=1, col=1,
                          annotation_text=f"bound {knob_text(a.bound)}", annotation_position="top left")
    _base_layout(fig, height=460, legend=dict(orientation="h", y=-0.2, x=0))
    fig.update_layout(margin=dict(b=100))
    fig.update_yaxes(tickformat=".1%", title=dict(text="hit rate"), row=1, col=1)
    fig.update_xaxes(title=dict(text="p99 waiting (requests)"), row=1, col=1,
                     **_int_axis(r["selected_waiting_p99"] for r in rows))
    fig.update_xaxes(title=dict(text="mean waiting (requests)"), row=1, col=2)
    return fig.to_dict()


def _closed_loop_join(a: ReportView) -> tuple[pl.DataFrame | None, str]:
    """The closed-loop table with this run's open-loop estimate of the same configs.

    Configs are matched on the knob columns both tables have (config ids are
    positions in a grid, so they agree only between identical grids); a table
    without knob columns is matched on ``config_id``.
    """
    cl = a.data.closed_loop
    if cl is None:
        return None, "no closed_loop_summary.parquet in this run directory"
    keys = [k for k in a.knobs if k in cl.columns]
    if not keys and "config_id" in cl.columns:
        keys = ["config_id"]
    if not keys:
        return None, "closed_loop_summary.parquet has no knob or config_id column to match configs by"
    right = a.summary.select(
        *[pl.col(k) for k in keys],
        *([] if keys == ["config_id"] else [pl.col("config_id").alias("open_loop_config_id")]),
        pl.col("hit_rate").alias("open_loop_hit_rate"),
        pl.col("selected_waiting_p99").alias("open_loop_selected_waiting_p99"))
    try:
        # a table built from Python rows types an all-None knob column as Null: align the keys
        cl = cl.with_columns(*[pl.col(k).cast(right.schema[k], strict=False) for k in keys])
        joined = cl.join(right, on=keys, how="left", nulls_equal=True, maintain_order="left")
    except Exception as err:  # noqa: BLE001 - mismatched key types
        return None, (f"closed_loop_summary.parquet: cannot match configs on {', '.join(keys)} "
                      f"({type(err).__name__})")
    matched = joined["open_loop_hit_rate"].is_not_null().sum()
    how = "config_id" if keys == ["config_id"] else "the knob values"
    return joined, f"{matched} of {joined.height} configs matched to this run on {how}"


def _closed_hit_col(df: pl.DataFrame) -> str | None:
    for c in ("true_hit_rate", "closed_loop_hit_rate", "hit_rate"):
        if c in df.columns and df.schema[c].is_numeric():
            return c
    return None


def fig_closed_loop(a: ReportView) -> dict:
    """Closed-loop hit rate and TTFT beside the open-loop estimate, per config."""
    df, note = _closed_loop_join(a)
    if df is None:
        raise ReplayError(f"closed loop: {note}")
    ttft = [c for c in df.columns if "ttft" in c.lower() and df.schema[c].is_numeric() and not _bound_col(c)]
    hit = _closed_hit_col(df)
    fig = fs.grid(rows=1, cols=2, horizontal_spacing=0.08,
                  subplot_titles=["hit rate: closed loop vs open-loop estimate", "TTFT (closed loop)"])
    if LIMIT in df.columns and FLOOR in df.columns:
        x = [f"{knob_text(lim)}/{knob_text(f)}"
             for lim, f in zip(df[LIMIT].to_list(), df[FLOOR].to_list(), strict=True)]
        if len(set(x)) < len(x) and "config_id" in df.columns:  # other knobs vary too
            x = [f"{v} (#{i})" for v, i in zip(x, df["config_id"].to_list(), strict=True)]
        x_title = "limit / floor"
    else:
        x = [str(i) for i in df["config_id"].to_list()]
        x_title = "config"
    if hit is not None:
        fig.add_trace(fs.trace("bar", x=x, y=df[hit].to_list(), name=f"closed loop: {_cl_label(hit)}",
                               marker=dict(color="#1f77b4"), error_y=_error_bars(df, hit)),
                      row=1, col=1)
    if "open_loop_hit_rate" in df.columns:
        fig.add_trace(fs.trace("bar", x=x, y=df["open_loop_hit_rate"].to_list(), name="open-loop estimate (this run)",
                               marker=dict(color="#9aa5b1")), row=1, col=1)
    for i, c in enumerate(ttft):
        fig.add_trace(fs.trace("bar", x=x, y=[None if v is None else v / 1000 for v in df[c].to_list()],
                               name=_cl_label(c), error_y=_error_bars(df, c, 1 / 1000),
                               marker=dict(color=["#ff7f0e", "#d62728", "#8c564b", "#e377c2"][i % 4])),
                      row=1, col=2)
    _base_layout(fig, height=400, barmode="group", legend=dict(orientation="h", y=-0.25, x=0))
    fig.update_xaxes(type="category", title=dict(text=x_title))
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title=dict(text="seconds"), row=1, col=2)
    return fig.to_dict()


_BOUND_SUFFIXES = ("_lo", "_hi", "_min", "_max")


def _bound_col(c: str) -> bool:
    """Whether a summary column is an interval's or a range's end (drawn as bars, never as a value)."""
    return c.endswith(_BOUND_SUFFIXES)


def _error_bars(df: pl.DataFrame, col: str, scale: float = 1.0) -> dict:
    """The 95% interval of the mean of ``col`` as plotly error bars (hidden without one)."""
    if f"{col}_lo" not in df.columns or f"{col}_hi" not in df.columns:
        return dict(visible=False)
    v, lo, hi = (df[c].to_list() for c in (col, f"{col}_lo", f"{col}_hi"))
    return dict(type="data", symmetric=False, thickness=1.2, width=3,
                array=[(h - x) * scale if h is not None and x is not None else 0 for h, x in zip(hi, v, strict=True)],
                arrayminus=[(x - lw) * scale if lw is not None and x is not None else 0
                            for lw, x in zip(lo, v, strict=True)])


CL_LABELS = {"true_hit_rate": "served hit rate", "closed_loop_hit_rate": "served hit rate",
             "hit_rate": "hit rate", "block_hit_rate": "served block hit rate",
             "open_loop_hit_rate": "open loop: decision-time hit rate",
             "open_loop_selected_waiting_p99": "open loop: p99 waiting (requests)",
             "throughput_req_s": "throughput (requests/s)", "failed": "failed (503)"}


def _cl_label(c: str) -> str:
    """A closed-loop summary column as a reader names it, with its unit (ms columns shown in s)."""
    if c in CL_LABELS:
        return CL_LABELS[c]
    for metric, text in (("ttft", "TTFT"), ("queue_wait", "queue wait")):
        if c.startswith(f"{metric}_ms_"):
            return f"{text} {c.removeprefix(f'{metric}_ms_')} (s)"
    return c.replace("_", " ")


# ---------------------------------------------------------------------------
def figures(run_dir: str | os.PathLike | Run, *, config_id: int | None = None,
            max_p99_waiting: float | None = None) -> dict[str, Any]:
    """The report's plotly figures for a run directory, by name.

    Keys: ``heatmaps``, ``decision_mix``, ``reason_mix``, ``waterfall`` and
    ``waterfall_pair`` (runs with the waterfall columns), ``over_time`` (when the
    run kept decisions), ``floor_vs_dp``, ``tradeoff``, ``closed_loop`` (when a
    ``closed_loop_summary.parquet`` is present).  ``config_id`` picks the
    config shown over time (default: the best under the pressure bound);
    ``max_p99_waiting`` sets that bound (default: the median p99 of the grid).
    """

    data = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    specs = _figures(ReportView(data, config_id=config_id, max_p99_waiting=max_p99_waiting))
    return {k: go.Figure(spec) for k, spec in specs.items()}


def figure_dicts(run_dir: str | os.PathLike | Run, *, config_id: int | None = None,
                 max_p99_waiting: float | None = None) -> dict[str, dict]:
    """The figures of :func:`figures` as the plain plotly figure dicts the page is written from
    (``replay/report/figspec.py``; numpy arrays where the data are numpy arrays)."""
    data = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    return _figures(ReportView(data, config_id=config_id, max_p99_waiting=max_p99_waiting))


def _figures(a: ReportView) -> dict[str, dict]:

    out = {"heatmaps": fig_heatmaps(a), "decision_mix": fig_mix(a, "decision"),
           "reason_mix": fig_mix(a, "policy")}
    if wf.has_waterfall(a.summary.columns):

        out.update(waterfall_figures(a))
    if a.data.decisions is not None and a.data.fleet is not None and a.chosen is not None:
        out["over_time"] = fig_over_time(a)
    out["floor_vs_dp"] = fig_floor_vs_dp(a)
    out["tradeoff"] = fig_tradeoff(a)
    if _closed_loop_join(a)[0] is not None:
        out["closed_loop"] = fig_closed_loop(a)
    return out


def headline(run_dir: str | os.PathLike | Run, *, max_p99_waiting: float | None = None) -> dict:
    """Trace facts, the pressure bound and the best configs (with deltas vs the no-gate baseline)."""
    data = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    a = ReportView(data, max_p99_waiting=max_p99_waiting)
    return {"facts": _facts(a), "bound": a.bound, "bound_note": a.bound_note, "best": _best_table(a)}


def _facts(a: ReportView) -> dict:
    tr = a.meta.get("trace", {})
    f = tr.get("facts") or {}
    return {
        "requests": f.get("requests", tr.get("requests")),
        "span_s": f.get("span_s"),
        "span_start_ns": f.get("span_start_ns"),
        "fleet_workers": f.get("fleet_workers"),
        "dp_sizes": f.get("dp_sizes"),
        "saturated_share_time": f.get("saturated_share_time"),
        "saturated_share_requests": f.get("saturated_share_requests"),
        "saturated_definition": f.get("saturated_definition"),
        "no_fresh_fleet_reading_share": f.get("no_fresh_fleet_reading_share"),
        "configs": a.summary.height,
    }


DELTA_METRICS = (("hit_rate", "pts"), ("owner_rate", "pts"), ("pinned_share", "pts"),
                 ("selected_waiting_p99", "abs"), ("selected_waiting_mean", "abs"),
                 ("cold_prefill_tokens", "rel"))


def _best_table(a: ReportView) -> pl.DataFrame:
    recs = []
    for rank, r in enumerate(a.best_rows, 1):
        b = a.baseline_for(r)
        rec = {"rank": rank, "config_id": r["config_id"], LIMIT: r[LIMIT], FLOOR: r[FLOOR],
               "baseline_config_id": b["config_id"] if b else None}
        for k, kind in DELTA_METRICS:
            rec[k] = r[k]
            d = None
            if b is not None and r[k] is not None and b[k] is not None:
                if kind == "pts":
                    d = 100.0 * (r[k] - b[k])
                elif kind == "abs":
                    d = float(r[k] - b[k])
                elif b[k]:
                    d = 100.0 * (r[k] - b[k]) / b[k]
            rec[f"{k}_delta" + {"pts": "_pts", "abs": "", "rel": "_pct"}[kind]] = d
        recs.append(rec)
    return pl.DataFrame(recs) if recs else pl.DataFrame()


# ---------------------------------------------------------------------------
# the page
_ERROR_HOOK = """
window.__reportErrors = [];
window.addEventListener('error', function (e) {
  window.__reportErrors.push(String(e.message || e));
  document.documentElement.setAttribute('data-report-errors', String(window.__reportErrors.length));
});
"""


def _delta_html(v: float | None, unit: str, better: str) -> str:
    if v is None:
        return ""
    if abs(v) < 1e-12:
        return '<span class="note">±0</span>'
    good = (v > 0) == (better == "high")
    if unit == "":
        txt = f"{int(v):+d}" if float(v).is_integer() else f"{v:+.2f}"
    else:
        txt = f"{v:+.1f}{unit}"
    return f' <span class="{"pos" if good else "neg"}">({_e(txt)})</span>'


def _headline_html(a: ReportView) -> str:
    f = _facts(a)
    cards = []

    def card(k, v):
        cards.append(f'<div class="card"><div class="v">{_e(v)}</div><div class="k">{_e(k)}</div></div>')

    span = f.get("span_s")
    card("requests", f"{f['requests']:,}" if f.get("requests") is not None else "–")
    if span is not None:
        card("trace span", _duration(span))
    if f.get("span_start_ns") is not None:
        start = _dt.datetime.fromtimestamp(f["span_start_ns"] / 1e9, tz=_dt.UTC)
        card("trace start (UTC)", start.strftime("%Y-%m-%d %H:%M:%S"))
    fw = f.get("fleet_workers") or {}
    if fw:
        card("fleet (prefill workers)", ", ".join(f"{n}" if len(fw) == 1 else f"{m}: {n}" for m, n in fw.items()))
    dps = f.get("dp_sizes") or {}
    if dps:
        card("dp sizes (workers)", ", ".join(f"dp {k} ×{v}" for k, v in dps.items()))
    if f.get("saturated_share_time") is not None:
        card("fleet saturated (share of time)", f"{100 * f['saturated_share_time']:.1f}%")
    card("configs replayed", f"{f['configs']:,}")
    parts = ['<div class="cards">' + "".join(cards) + "</div>"]
    if f.get("saturated_definition"):
        extra = ""
        if f.get("saturated_share_requests") is not None:
            extra = f" {100 * f['saturated_share_requests']:.1f}% of requests arrived in such a state"
            if f.get("no_fresh_fleet_reading_share"):
                extra += f"; {100 * f['no_fresh_fleet_reading_share']:.1f}% saw no fresh fleet reading"
            extra += "."
        parts.append(f'<p class="note">Saturated: {_e(f["saturated_definition"])}.{_e(extra)}</p>')
    else:
        parts.append('<p class="note">This run predates run.json trace facts; re-run the sweep for '
                     "fleet saturation figures.</p>")
    parts.append(f'<p class="note">Pressure bound: {_e(a.bound_note)}.</p>')
    if a.best is None:
        parts.append('<p class="verdict">No config meets the pressure bound.</p>')
        return "\n".join(parts)
    b = a.baseline_for(a.best)
    r = a.best
    verdict = (f"Highest decision-time hit rate under the bound, on the recorded load: "
               f"<b>config {r['config_id']}</b> ({_e(a.label(r))}): "
               f"hit rate {_fmt(r['hit_rate'], 'pct')}, p99 waiting {_fmt(r['selected_waiting_p99'], 'int')}, "
               f"mean waiting {_fmt(r['selected_waiting_mean'], 'f2')}")
    if b is not None and b["config_id"] != r["config_id"] and b["hit_rate"] is not None and r["hit_rate"] is not None:
        verdict += (f"; against the no-gate baseline (config {b['config_id']}): "
                    f"{100 * (r['hit_rate'] - b['hit_rate']):+.1f} pts hit rate")
        if b["selected_waiting_p99"] is not None and r["selected_waiting_p99"] is not None:
            verdict += f", {r['selected_waiting_p99'] - b['selected_waiting_p99']:+d} p99 waiting"
    elif b is not None and b["config_id"] == r["config_id"]:
        verdict += "; this is the no-gate baseline itself"
    else:
        verdict += "; the grid has no no-gate baseline (limit none) to compare with"
    parts.append(f'<p class="verdict">{verdict}.</p>')
    head = ["#", "config", KNOB_SHORT[LIMIT], KNOB_SHORT[FLOOR], "hit rate", "owner rate", "pin share", "p99 waiting",
            "mean waiting", "cold prefill tokens"]
    trs = ["<tr>" + "".join(f'<th class="{"l" if i < 1 else ""}">{_e(h)}</th>' for i, h in enumerate(head)) + "</tr>"]
    for rank, r in enumerate(a.best_rows, 1):
        b = a.baseline_for(r)
        d = lambda k: (r[k] - b[k]) if (b is not None and r[k] is not None and b[k] is not None) else None  # noqa: E731, B023 - this iteration
        pct = lambda k: (100 * d(k)) if d(k) is not None else None  # noqa: E731, B023 - this iteration only
        rel = (100 * d("cold_prefill_tokens") / b["cold_prefill_tokens"]
               if d("cold_prefill_tokens") is not None and b["cold_prefill_tokens"] else None)
        cells = [
            f'<td class="l">{rank}</td>', f"<td>{r['config_id']}</td>",
            f"<td>{_e(knob_text(r[LIMIT]))}</td>", f"<td>{_e(knob_text(r[FLOOR]))}</td>",
            f"<td>{_fmt(r['hit_rate'], 'pct')}{_delta_html(pct('hit_rate'), ' pts', 'high')}</td>",
            f"<td>{_fmt(r['owner_rate'], 'pct')}{_delta_html(pct('owner_rate'), ' pts', 'high')}</td>",
            f"<td>{_fmt(r['pinned_share'], 'pct')}</td>",
            f"<td>{_fmt(r['selected_waiting_p99'], 'int')}{_delta_html(d('selected_waiting_p99'), '', 'low')}</td>",
            f"<td>{_fmt(r['selected_waiting_mean'], 'f2')}{_delta_html(d('selected_waiting_mean'), '', 'low')}</td>",
            f"<td>{_fmt(r['cold_prefill_tokens'], 'si')}{_delta_html(rel, '%', 'low')}</td>",
        ]
        trs.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("<table>" + "".join(trs) + "</table>")
    parts.append('<p class="note">In brackets: change against the no-gate baseline with the same other knobs '
                 "(hit and owner rate in percentage points; cold prefill tokens in percent).</p>")
    return "\n".join(parts)


def _duration(s: float) -> str:
    s = float(s)
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s"


def _provenance_html(a: ReportView) -> str:
    run = a.meta
    tr = run.get("trace", {})
    rows = [("tool", f"{run.get('tool', '')} {run.get('version', '')}"),
            ("report built by", f"router-replay {__version__}"),
            ("run created", _dt.datetime.fromtimestamp(run["created_unix"], tz=_dt.UTC)
             .strftime("%Y-%m-%d %H:%M:%S UTC") if run.get("created_unix") else "–"),
            ("trace", tr.get("path", "–")),
            ("seed", run.get("seed")), ("freshness", f"{run.get('freshness_ms')} ms"),
            ("model filter", run.get("model") or "none"),
            ("per dp rank", f"yes (dp_size {run.get('dp_size')})" if run.get("per_dp_rank") else "no"),
            ("decisions", run.get("decisions") or "not written (--no-decisions)")]
    t = run.get("timings") or {}
    if t:
        rows.append(("timings", ", ".join(f"{k} {v}" for k, v in t.items())))
    m = run.get("machine") or {}
    if m:
        rows.append(("machine", ", ".join(f"{k} {v}" for k, v in m.items())))
    out = ["<table>" + "".join(f'<tr><th class="l">{_e(k)}</th><td class="wrap">{_e(v)}</td></tr>' for k, v in rows)
           + "</table>"]
    files = tr.get("files") or {}
    if files:
        out.append("<table><tr><th class=\"l\">trace file</th><th>bytes</th><th class=\"l\">sha256</th></tr>"
                   + "".join(f'<tr><td class="l">{_e(n)}</td><td>{i.get("bytes", 0):,}</td>'
                             f'<td class="l"><code>{_e(i.get("sha256", ""))}</code></td></tr>'
                             for n, i in files.items()) + "</table>")
    g = run.get("grid") or {}
    vals = g.get("values") or {}
    flags = g.get("flags") or {}
    if vals:
        out.append("<table><tr><th class=\"l\">knob</th><th class=\"l\">values</th></tr>"
                   + "".join(f'<tr><td class="l"><code>{_e(flags.get(k, k))}</code></td>'
                             f'<td class="l">{_e(", ".join(flag_text(k, v) for v in vs))}</td></tr>'
                             for k, vs in vals.items()) + "</table>")
    skipped = g.get("skipped") or []
    out.append(f'<p class="note">{g.get("n_configs", a.summary.height)} configs of '
               f'{g.get("n_combinations", "?")} combinations; {len(skipped)} skipped as the router '
               "would refuse them" + (":" if skipped else ".") + "</p>")
    if skipped:
        errs: dict[str, int] = {}
        for s in skipped:
            errs[s.get("error", "")] = errs.get(s.get("error", ""), 0) + 1
        out.append("<ul class=\"note\">" + "".join(f"<li>{n} × {_e(e)}</li>" for e, n in errs.items()) + "</ul>")
    return "\n".join(out)


def _closed_loop_html(a: ReportView) -> tuple[str, bool]:
    df, note = _closed_loop_join(a)
    if df is None:
        return f'<p class="note">No closed-loop results: {_e(note)}.</p>', False
    # the knobs that tell its configs apart, then the outcomes beside this run's estimate
    knobs = [k for k in a.knobs if k in df.columns and (k in (LIMIT, FLOOR) or df[k].n_unique() > 1)]
    hit = _closed_hit_col(df)
    wanted = [hit, "open_loop_hit_rate", "open_loop_selected_waiting_p99",
              *[c for c in df.columns if ("ttft" in c.lower() or "queue_wait" in c.lower())
                and df.schema[c].is_numeric() and not _bound_col(c)],
              "throughput_req_s", "failed"]
    metrics = [c for c in dict.fromkeys(wanted) if c is not None and c in df.columns]
    cols = knobs + metrics or [c for c in df.columns if not _bound_col(c)][:12]
    short = {LIMIT: "queue limit", FLOOR: "saturation floor"}
    head = "".join(f"<th>{_e(short.get(c) or (KNOBS[c].flag if c in KNOBS else _cl_label(c)))}</th>"
                   for c in cols)

    def cell(c: str, r: dict) -> str:
        if c.endswith("hit_rate"):
            return cl.interval(r, c, lambda v: "–" if v is None else _fmt(v, "pct"))
        if "_ms_" in c:
            return cl.interval(r, c, lambda v: "–" if v is None else f"{v / 1000:,.2f}")
        return cl.interval(r, c, _cell) if c not in knobs else knob_text(r[c])
    body = "".join("<tr>" + "".join(f"<td>{_e(cell(c, r))}</td>" for c in cols) + "</tr>"
                   for r in df.head(60).iter_rows(named=True))
    more = f" (first 60 of {df.height})" if df.height > 60 else ""
    seeded = any(f"{c}_lo" in df.columns for c in metrics)
    return (f'<p class="note">From closed_loop_summary.parquet: {_e(note)}. Columns starting '
            f"“open loop” are this run's estimates of the same configs{more}"
            + ("; in brackets the 95% interval of the mean over the seeds" if seeded else "") + ".</p>"
            f"<table><tr>{head}</tr>{body}</table>"), True


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"   # never 1.684e+04
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "none" if v is None else str(v)


FIGURE_KEYS = ("heatmaps", "decision_mix", "reason_mix", "waterfall", "waterfall_pair", "over_time", "floor_vs_dp",
               "tradeoff", "closed_loop")


def _final_path(path: Path) -> Path:
    """The run directory's own name while the sweep still builds it in a hidden partial folder."""
    m = re.fullmatch(r"\.(.+)\.partial-.*", path.name)
    return path.parent / m.group(1) if m else path


def closed_loop_for(data: Run, given: str | os.PathLike | None = None):
    """The closed-loop grid the report shows first: ``given`` (``report --closed-loop DIR``), else
    one found beside the run or its trace (:func:`replay.analysis.closed_loop.find_for_run`); with notes."""

    if given is not None:
        grid = cl.load_grid(given)
        how = cl.grid_matches_run(grid, data.meta)
        notes = [f"closed-loop grid {grid.path} (given with --closed-loop"
                 + (f"; matched to this run's trace by {how})" if how else
                    "; WARNING: not recorded as produced from this run's trace)")]
        return grid, notes
    return cl.find_for_run(data.path, data.meta)


def render_html(run_dir: str | os.PathLike | Run, *, config_id: int | None = None,
                max_p99_waiting: float | None = None, closed_loop: str | os.PathLike | None = None,
                max_ttft_p99_ms: float | None = None, beside: int | None = None,
                max_queue_wait_p99_ms: float | None = None) -> str:
    """The whole report page as one string (plotly.js inline).  A closed-loop grid of the run's
    trace (``closed_loop``, else found beside the run or the trace) is shown first."""

    data = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    grid, grid_notes = closed_loop_for(data, closed_loop)
    if grid is not None and data.closed_loop is None:
        data.closed_loop = grid.summary
    a = ReportView(data, config_id=config_id, max_p99_waiting=max_p99_waiting)
    a.beside = beside   # the config drawn beside the followed one in the waterfall pair
    figs = _figures(a)
    run = a.meta
    title = f"router-replay report: {Path(run.get('trace', {}).get('path', str(data.path))).name}"
    trace_path = (run.get("trace") or {}).get("path")
    ol_note = rs.open_loop_note_html(trace_path)
    sec: list[str] = []
    if grid is not None:
        gk = [k for k in a.knobs if k in grid.summary.columns]
        open_rows = {tuple(r.get(k) for k in gk): r for r in a.rows.values()}
        sec.append('<section id="s0"><h2>Closed-loop answer</h2>'
                   + rs.closed_loop_section(grid, grid_notes, open_rows, gk,
                                          bound_ms=max_ttft_p99_ms if max_queue_wait_p99_ms is None
                                          else max_queue_wait_p99_ms,
                                          on="ttft" if max_queue_wait_p99_ms is None else "queue_wait",
                                          fig_html=_fig_html)
                   + "</section>")
    else:
        sec.append('<section id="s0"><h2>Which limit and floor?</h2>'
                   + rs.no_grid_html(trace_path, str(_final_path(data.path))) + "</section>")
    sec.append('<section id="s1"><h2>1. Decisions on the recorded load (open loop)</h2>'
               f"{ol_note}{_headline_html(a)}</section>")
    slice_note = f'<p class="note">{_e(a.slice_note)}</p>' if a.slice_note else ""
    sec.append('<section id="s2"><h2>2. Floor × limit</h2>'
               '<p class="note">One panel per metric; rows are queue limits, columns saturation floors, '
               "<code>none</code> is its own row and column; greener is better; each panel's title gives its "
               "range; a spread narrower than a meaningful difference (2 points for a rate, 20% otherwise) "
               "is drawn in muted colours; "
               "blank cells are "
               "combinations the router refuses. Hover a cell for every metric of that config.</p>"
               + ol_note + slice_note + _fig_html(figs["heatmaps"], "heatmaps") + "</section>")
    sec.append('<section id="s3"><h2>3. Label and reason mix</h2>'
               '<p class="note">Bars are configs, labelled limit/floor.</p>' + slice_note
               + _fig_html(figs["decision_mix"], "decision_mix")
               + _fig_html(figs["reason_mix"], "reason_mix") + "</section>")
    sec.append('<section id="s3w"><h2>Where locality goes</h2>' + rs.waterfall_section(a, figs, _fig_html)
               + "</section>")
    if "over_time" in figs:
        body = (f'<p class="note">Showing {_e(a.chosen_note)}; the menu at the top right switches to '
                "other top configs, <code>router-replay report RUN_DIR --config ID</code> picks any. "
                "The pin fires when the queue gate "
                "rejects an owner and no fresh fleet worker reads below the floor, i.e. when the bottom "
                "panel's reading is at or above the floor (or no fleet worker has a fresh reading): the "
                "dashed grey line in the middle panel.</p>" + _fig_html(figs["over_time"], "over_time"))
    elif data.decisions is None:
        body = ('<p class="note">This run was written with <code>--no-decisions</code>, so per-request '
                "labels over time are not available; re-run the sweep with decisions to see them.</p>")
    else:
        body = ('<p class="note">This run has no fleet.parquet (it predates it); re-run the sweep to '
                "see labels over time.</p>")
    sec.append(f'<section id="s4"><h2>4. Over time</h2>{body}</section>')
    _pts, dp_note = _dp_lines(a)
    sec.append('<section id="s5"><h2>5. Floor against dp_size</h2>'
               f'<p class="note">{_e(dp_note)} The no-floor configs are not drawn (no per-rank floor).</p>'
               + slice_note + _fig_html(figs["floor_vs_dp"], "floor_vs_dp") + "</section>")
    sec.append('<section id="s6"><h2>6. Hit rate against pressure</h2>'
               '<p class="note">Every config is a point; red points are the Pareto front (no other config '
               "has a higher hit rate at no more pressure). The dashed line is the pressure bound.</p>"
               + _fig_html(figs["tradeoff"], "tradeoff")
               + "</section>")
    cl_html, has_cl = _closed_loop_html(a)
    sec.append('<section id="s7"><h2>7. Closed loop</h2>' + cl_html
               + (_fig_html(figs["closed_loop"], "closed_loop") if has_cl and "closed_loop" in figs else "")
               + "</section>")
    sec.append(f'<section id="s8"><h2>8. Provenance</h2>{_provenance_html(a)}</section>')
    links = [("s1", "headline"), ("s2", "floor × limit"), ("s3", "mix"), ("s3w", "waterfall"), ("s4", "over time"),
             ("s5", "dp_size"), ("s6", "trade-off"), ("s7", "closed loop"), ("s8", "provenance")]
    links.insert(0, ("s0", "closed-loop answer" if grid is not None else "answer"))
    nav = "".join(f'<a href="#{i}">{_e(n)}</a>' for i, n in links)

    sub = f"{data.summary.height} configs · seed {run.get('seed')} · router-replay {run.get('version')}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n"
        f"<script type=\"text/javascript\">{_ERROR_HOOK}</script>\n"
        f"<script type=\"text/javascript\">{fs.plotlyjs()}</script>\n</head>\n<body>\n<main>\n"
        f"<header><h1>{_e(title)}</h1><div class=\"sub\">{_e(sub)}</div><nav>{nav}</nav></header>\n"
        + "\n".join(sec) + "\n</main>\n</body>\n</html>\n")


def build_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *,
                 force: bool = False, config_id: int | None = None,
                 max_p99_waiting: float | None = None, closed_loop: str | os.PathLike | None = None,
                 max_ttft_p99_ms: float | None = None, beside: int | None = None,
                 max_queue_wait_p99_ms: float | None = None) -> Path:
    """Write the report of a run directory to ``out`` (default ``RUN_DIR/report.html``).

    An existing ``out`` is replaced only with ``force``; the file is written
    aside and renamed into place, and nothing else is touched.
    """

    plan_page = (Path(run_dir) / PLAN_TABLE).is_file()  # a capacity plan (docs/capacity.md)
    data = None if plan_page else load_run(run_dir)
    target = Path(out) if out is not None else (Path(run_dir) if plan_page else data.path) / REPORT
    if target.exists() and target.is_dir():
        raise ParamsError("{target}: is a directory (give a file name with {out})", "out", target=target)
    if target.exists() and not force:
        raise NeedsForce(f"{target}: exists (use ", " to replace it)")
    if not target.parent.is_dir():
        raise ReplayError(f"{target.parent}: directory not found")
    if plan_page:
        metric = "queue_wait" if max_queue_wait_p99_ms is not None else "ttft"
        bound = max_queue_wait_p99_ms if max_queue_wait_p99_ms is not None else max_ttft_p99_ms
        page = render_plan_html(run_dir, metric, bound)
    else:
        page = render_html(data, config_id=config_id, max_p99_waiting=max_p99_waiting,
                           closed_loop=closed_loop, max_ttft_p99_ms=max_ttft_p99_ms, beside=beside,
                           max_queue_wait_p99_ms=max_queue_wait_p99_ms)
    rundir.write_text_atomic(target, page)
    return target


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *, force: bool = False,
                 config_id: int | None = None, max_p99_waiting: float | None = None,
                 closed_loop: str | os.PathLike | None = None, max_ttft_p99_ms: float | None = None,
                 beside: int | None = None, max_queue_wait_p99_ms: float | None = None) -> Path:
    """What ``router-replay report`` does: the bounds checked, ``out`` guarded (the run's own
    ``report.html`` is rebuilt without ``force``; a file router-replay did not write is never
    replaced), then :func:`build_report`.  Returns the page's path."""
    if max_p99_waiting is not None and not math.isfinite(max_p99_waiting):
        raise ParamError("max_p99_waiting", f"must be a finite number >= 0, got {max_p99_waiting!r}")
    if max_ttft_p99_ms is not None and max_queue_wait_p99_ms is not None:
        raise ParamsError("give one of {max_ttft_p99_ms} and {max_queue_wait_p99_ms}",
                          "max_ttft_p99_ms", "max_queue_wait_p99_ms")
    own_report = Path(run_dir) / REPORT
    target = Path(out) if out is not None else own_report
    force = force or out is None or target.resolve() == own_report.resolve()
    rundir.guard([(target, "report")], inputs=rundir.run_inputs(run_dir), force=force)
    return build_report(run_dir, out, force=force, config_id=config_id, max_p99_waiting=max_p99_waiting,
                        closed_loop=closed_loop, max_ttft_p99_ms=max_ttft_p99_ms, beside=beside,
                        max_queue_wait_p99_ms=max_queue_wait_p99_ms)
