"""A capacity plan's page: the frontier of fleet size against traffic, self-contained HTML.

The plan is computed and read by :mod:`replay.simulate.plan`; this module only draws it,
with the run page's style and figure helpers.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.offline import get_plotlyjs

from replay.analysis.plan import bound_column, duration, format_plan, level_floors, plan, read_plan
from replay.report.html import CSS as _CSS
from replay.report.html import esc as _e
from replay.report.html import fig_html as _fig_html


def fig_frontier(t: pl.DataFrame, metric: str = "ttft", bound_ms: float | None = None):
    """Fleet shape against traffic level: one row per fleet shape (workers x dp, ordered by
    ranks, so 6 x 2 and 12 x 1 are two rows), one marker per fleet and level, green where its
    best config meets the bound; the chosen fleet per level is ringed and labelled.  Without
    ``bound_ms`` the plan's median is used and the title says it is not an SLO."""

    col = bound_column(t, metric)
    best = (t.with_columns(pl.col(col).fill_nan(None))
            .group_by(["load_scale", "workers", "dp_size", "ranks"])
            .agg(pl.col(col).min().alias("v")).sort(["load_scale", "ranks", "workers"]))
    given = bound_ms is not None
    if bound_ms is None:
        vals = [v for v in best["v"].to_list() if v is not None]
        bound_ms = float(np.median(vals)) if vals else 0.0
    rows = best.to_dicts()
    shapes = sorted({(r["ranks"], r["workers"], r["dp_size"]) for r in rows})
    order = [shape_label(w, d) for _n, w, d in shapes]
    fig = go.Figure()
    for met, colour, name in ((True, "#2ca02c", "meets the bound"), (False, "#d62728", "over the bound")):
        sel = [r for r in rows if (r["v"] is not None and r["v"] <= bound_ms) == met]
        fig.add_trace(go.Scatter(
            x=[r["load_scale"] for r in sel], y=[shape_label(r["workers"], r["dp_size"]) for r in sel],
            mode="markers", name=name, marker={"color": colour, "size": 11},
            text=[f"{r['workers']} workers x dp {r['dp_size']} ({r['ranks']} ranks): {col} "
                  + duration(r["v"]) for r in sel],
            hoverinfo="text"))
    chosen = [a.row for a in plan(t, metric, bound_ms) if a.row is not None]
    fig.add_trace(go.Scatter(x=[r["load_scale"] for r in chosen],
                             y=[shape_label(r["workers"], r["dp_size"]) for r in chosen],
                             mode="markers+text", name="chosen: the smallest fleet meeting it",
                             text=["chosen"] * len(chosen), textposition="middle right",
                             marker={"symbol": "circle-open", "size": 22, "color": "black",
                                     "line": {"width": 3}}, hoverinfo="skip"))
    label = {"ttft": "TTFT p99", "queue_wait": "queue wait p99"}.get(metric, col)
    what = f"{label} ≤ {duration(bound_ms)}" + ("" if given else " (the plan's median, not an SLO)")
    fig.update_layout(title=f"Capacity frontier: {what}",
                      xaxis_title="traffic (x recorded)", yaxis_title="fleet (workers x dp ranks)",
                      yaxis={"type": "category", "categoryorder": "array", "categoryarray": order},
                      height=max(360, 60 + 40 * len(order)), template="plotly_white")
    return fig


def shape_label(workers: int, dp_size: int) -> str:
    """A fleet shape as the frontier's rows name it: ``12 x 1 (12 ranks)``."""
    return f"{workers} x {dp_size} ({workers * dp_size} ranks)"


def render_plan_html(run_dir: str | os.PathLike, metric: str = "ttft",
                     bound_ms: float | None = None) -> str:
    """The report page of a plan directory: the frontier and the plan as text (plotly inline)."""

    t = read_plan(run_dir)
    col = bound_column(t, metric)
    given = bound_ms is not None
    if bound_ms is None:
        vals = [v for v in t[col].drop_nulls().to_list() if math.isfinite(v)]
        bound_ms = float(np.median(vals)) if vals else 0.0
    answers = plan(t, metric, bound_ms)
    text = format_plan(answers, metric, bound_ms, col, level_floors(run_dir, answers))
    name = Path(run_dir).resolve().name
    # the title starts "router-replay report" (rundir's marker); the directory name once
    title = f"router-replay report: {name}" + ("" if "plan" in name.lower() else " (capacity plan)")
    bound_note = (f"Bound: {_e(col)} &lt;= {_e(duration(bound_ms))} (given)." if given else
                  f"No bound given: the line drawn is the plan's median {_e(col)}, {_e(duration(bound_ms))}, "
                  "<b>not an SLO</b>; <code>router-replay report DIR --max-ttft-p99-ms MS</code> draws "
                  "yours.")
    body = (f"<section><h2>Capacity frontier</h2><p class=\"note\">{bound_note} One row per fleet shape "
            "(workers x dp ranks); the ring marks the fleet the plan chooses per traffic level; "
            "<code>router-replay recommend DIR --plan --max-ttft-p99-ms MS</code> answers for any "
            "bound.</p>" + _fig_html(fig_frontier(t, metric, bound_ms if given else None), "frontier")
            + f'<pre class="answer">{_e(text)}</pre></section>')
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>\n<body>\n<main>\n"
            f"<header><h1>{_e(title)}</h1></header>\n{body}\n</main>\n</body>\n</html>\n")
