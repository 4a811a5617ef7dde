"""The locality waterfall read back: figures, the drill-down table and the changed terms.

The summary's integer columns (docs/replay-model.md, "Where locality goes")
split the blocks a config could have reused into what each decision step gave
away::

    matched_blocks - (lost_candidates + ... + lost_fallback) = selected_blocks

This module draws that per config (a menu picks the config) and side by side
for two configs, lists the requests that lost most (from ``decisions.parquet``)
and computes the terms that changed between two configs for ``compare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replay import labels
from replay.report import figspec as fs

TERMS = tuple(f"lost_{s}" for s in labels.LOSS_STEPS)
"""The six loss columns in chain order."""
STEP_TEXT = {f"lost_{s}": s.replace("_", " ") for s in labels.LOSS_STEPS}
COLUMNS = ("matched_blocks", *TERMS, "selected_blocks")
MENU_MAX = 40
"""Most configs the per-config menu holds (the page stays small; the rest by --config)."""
DRILL_COLUMNS = ("request_id", "worker", "decision", "reason", "lost_to", "matched_blocks",
                 "selected_blocks", "blocks_lost", "lost_candidates", "lost_queue_gate", "lost_capacity")


def has_waterfall(columns: Sequence[str]) -> bool:
    """Whether a summary carries the waterfall columns (runs before issue 11 do not)."""
    return all(c in columns for c in COLUMNS)


def terms(row: Mapping[str, Any]) -> dict[str, int]:
    """``matched_blocks``, the six terms and ``selected_blocks`` of a summary row, as ints."""
    return {c: int(row.get(c) or 0) for c in COLUMNS}


def changed_terms(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, int]:
    """The waterfall columns whose value differs from ``a`` to ``b``: ``{column: b - a}``."""
    ta, tb = terms(a), terms(b)
    return {c: tb[c] - ta[c] for c in COLUMNS if tb[c] != ta[c]}


def _trace(row: Mapping[str, Any], name: str, visible: bool = True, showlegend: bool = False) -> dict:
    t = terms(row)
    m = t["matched_blocks"] or 1
    x = ["matched (ceiling)", *(f"lost: {STEP_TEXT[c]}" for c in TERMS), "selected"]
    y = [t["matched_blocks"], *(-t[c] for c in TERMS), t["selected_blocks"]]
    text = [f"{t['matched_blocks']:,}", *(f"-{t[c]:,} ({100 * t[c] / m:.1f}%)" if t[c] else "0" for c in TERMS),
            f"{t['selected_blocks']:,} ({100 * t['selected_blocks'] / m:.1f}%)"]
    return fs.trace("waterfall", x=x, y=y, measure=["absolute", *["relative"] * len(TERMS), "total"], text=text,
                    textposition="outside", name=name, visible=visible, showlegend=showlegend,
                    connector=dict(line=dict(color="#9aa5b1", width=1)),
                    decreasing=dict(marker=dict(color="#d62728")),
                    increasing=dict(marker=dict(color="#2ca02c")),
                    totals=dict(marker=dict(color="#1f77b4")),
                    hovertemplate="%{x}: %{text}<extra>" + name.replace("<", "&lt;") + "</extra>")


def fig_menu(rows: Sequence[Mapping[str, Any]], label, first_id: int) -> dict:
    """One waterfall per config of ``rows`` (at most :data:`MENU_MAX`), a menu switching between them;
    ``first_id`` is shown first.  ``label(row)`` names a config.  A plotly figure dict
    (``replay/report/figspec.py``; ``go.Figure(d)`` validates it)."""
    rows = list(rows)[:MENU_MAX]
    ids = [r["config_id"] for r in rows]
    first = ids.index(first_id) if first_id in ids else 0
    fig = fs.Fig()
    for i, r in enumerate(rows):
        fig.add_trace(_trace(r, f"config {r['config_id']}", visible=i == first))
    buttons = [dict(label=f"config {r['config_id']}: {label(r)}", method="update",
                    args=[{"visible": [j == i for j in range(len(rows))]},
                          {"title.text": f"where locality goes: config {r['config_id']} ({label(r)})"}])
               for i, r in enumerate(rows)]
    fig.update_layout(updatemenus=[dict(buttons=buttons, direction="down", active=first, x=1.0, xanchor="right",
                                        y=1.18, yanchor="top", showactive=True)],
                      title=dict(text=f"where locality goes: config {rows[first]['config_id']} "
                                      f"({label(rows[first])})", x=0.01, font=dict(size=14)),
                      height=440, margin=dict(t=90, l=70, r=20, b=60), yaxis=dict(title=dict(text="blocks")),
                      font=dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12),
                      paper_bgcolor="white", plot_bgcolor="white", template=fs.template("plotly"))
    return fig.to_dict()


def fig_pair(a: Mapping[str, Any], b: Mapping[str, Any], label) -> dict:
    """The waterfalls of two configs side by side, on one block axis (a plotly figure dict)."""
    fig = fs.grid(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                  subplot_titles=[f"config {r['config_id']}: {label(r)}" for r in (a, b)])
    fig.add_trace(_trace(a, f"config {a['config_id']}"), row=1, col=1)
    fig.add_trace(_trace(b, f"config {b['config_id']}"), row=1, col=2)
    fig.update_layout(height=440, margin=dict(t=60, l=70, r=20, b=60), showlegend=False,
                      font=dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12),
                      paper_bgcolor="white", plot_bgcolor="white", template=fs.template("plotly"))
    fig.update_yaxes(title=dict(text="blocks"), row=1, col=1)
    return fig.to_dict()


def drilldown(files: Sequence[Path] | None, config_id: int, n: int = 20) -> pl.DataFrame | None:
    """The ``n`` requests of ``config_id`` that lost the most blocks, with their labels (None
    without decisions files or without the waterfall columns in them)."""
    if not files:
        return None
    from replay.runs import decisions as decision_store

    names = set(decision_store.columns_of(files[0]))
    if "blocks_lost" not in names:
        return None
    cols = [c for c in DRILL_COLUMNS if c in names]
    lf = pl.concat([decision_store.scan_file(f, ["config_id", *cols]) for f in files], how="vertical_relaxed")
    top = (lf.filter((pl.col("config_id") == config_id) & (pl.col("blocks_lost") > 0))
           .sort(["blocks_lost", "request_id"], descending=[True, False]).head(n).drop("config_id").collect())
    if "worker" in top.columns and top.schema["worker"] == pl.String:
        # a worker is named by host:port: the page references no address it could fetch
        top = top.with_columns(pl.col("worker").str.replace(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", ""))
    return top
