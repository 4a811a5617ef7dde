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

from replay.analysis.plan import bound_column, format_plan, plan, read_plan
from replay.report.html import CSS as _CSS
from replay.report.html import esc as _e
from replay.report.html import fig_html as _fig_html


def fig_frontier(t: pl.DataFrame, metric: str = "ttft", bound_ms: float | None = None):
    """Fleet size (ranks) against traffic level, one marker per fleet, coloured by
    whether its best config meets the bound; the chosen fleet per level is
    circled.  Without ``bound_ms`` the median of the bounded metric is used."""

    col = bound_column(t, metric)
    best = (t.with_columns(pl.col(col).fill_nan(None))
            .group_by(["load_scale", "workers", "dp_size", "ranks"])
            .agg(pl.col(col).min().alias("v")).sort(["load_scale", "ranks", "workers"]))
    if bound_ms is None:
        vals = [v for v in best["v"].to_list() if v is not None]
        bound_ms = float(np.median(vals)) if vals else 0.0
    rows = best.to_dicts()
    fig = go.Figure()
    for met, colour, name in ((True, "#2ca02c", "meets the bound"), (False, "#d62728", "violates it")):
        sel = [r for r in rows if (r["v"] is not None and r["v"] <= bound_ms) == met]
        fig.add_trace(go.Scatter(
            x=[r["load_scale"] for r in sel], y=[r["ranks"] for r in sel], mode="markers",
            name=name, marker={"color": colour, "size": 11},
            text=[f"{r['workers']} workers x dp {r['dp_size']}: {col} "
                  + ("-" if r["v"] is None else f"{r['v']:.1f} ms") for r in sel],
            hoverinfo="text"))
    chosen = [a.row for a in plan(t, metric, bound_ms) if a.row is not None]
    fig.add_trace(go.Scatter(x=[r["load_scale"] for r in chosen], y=[r["ranks"] for r in chosen],
                             mode="lines+markers", name="smallest fleet meeting it",
                             marker={"symbol": "circle-open", "size": 18, "color": "black"},
                             line={"color": "black", "dash": "dot"}))
    fig.update_layout(title=f"Capacity frontier: {col} <= {bound_ms:g} ms",
                      xaxis_title="traffic (x recorded)", yaxis_title="fleet size (workers x dp ranks)",
                      height=420, template="plotly_white")
    return fig


def render_plan_html(run_dir: str | os.PathLike, metric: str = "ttft",
                     bound_ms: float | None = None) -> str:
    """The report page of a plan directory: the frontier and the plan as text (plotly inline)."""

    t = read_plan(run_dir)
    col = bound_column(t, metric)
    if bound_ms is None:
        vals = [v for v in t[col].drop_nulls().to_list() if math.isfinite(v)]
        bound_ms = float(np.median(vals)) if vals else 0.0
    text = format_plan(plan(t, metric, bound_ms), metric, bound_ms, col)
    title = f"router-replay report: capacity plan {Path(run_dir).resolve().name}"  # rundir marker
    body = (f"<section><h2>Capacity frontier</h2><p class=\"note\">Bound: {_e(col)} &lt;= "
            f"{bound_ms:g} ms (the median over the plan unless given; "
            "<code>router-replay recommend DIR --plan --max-ttft-p99-ms MS</code> answers for any "
            "bound).</p>" + _fig_html(fig_frontier(t, metric, bound_ms), "frontier")
            + f"<pre>{_e(text)}</pre></section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{_e(title)}</title>\n<style>{_CSS}</style>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script>\n</head>\n<body>\n<main>\n"
            f"<header><h1>{_e(title)}</h1></header>\n{body}\n</main>\n</body>\n</html>\n")
