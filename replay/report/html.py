"""What every page of the report shares: its style sheet, escaping and a figure's ``<div>``."""

from __future__ import annotations

import html
from typing import Any

import plotly.io as pio

from replay.report import figspec as fs

PLOT_CONFIG = {"displaylogo": False, "responsive": True,
               "modeBarButtonsToRemove": ["select2d", "lasso2d"]}
FONT = dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12)

CSS = """
:root { --fg:#1d2430; --muted:#5b6675; --line:#dde2e8; --bg:#f6f8fa; --accent:#1f6feb; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif; color:var(--fg); background:#fff; }
main { max-width: 1320px; margin: 0 auto; padding: 18px 24px 60px; }
header h1 { font-size: 22px; margin: 4px 0 2px; }
header .sub { color: var(--muted); }
h2 { font-size: 17px; margin: 30px 0 8px; padding-top: 10px; border-top: 1px solid var(--line); }
.note { color: var(--muted); font-size: 13px; margin: 4px 0 8px; }
.cards { display:flex; flex-wrap:wrap; gap:10px; margin: 12px 0; }
.card { background: var(--bg); border:1px solid var(--line); border-radius:8px; padding:8px 14px; min-width: 150px; }
.card .v { font-size: 19px; font-weight: 600; }
.card .k { color: var(--muted); font-size: 12px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0 10px; }
th, td { border-bottom: 1px solid var(--line); padding: 4px 10px; text-align: right; white-space: nowrap; }
th { background: var(--bg); font-weight: 600; }
td.l, th.l { text-align: left; }
td.wrap { white-space: normal; word-break: break-all; text-align:left; }
.pos { color: #1a7f37; } .neg { color: #cf222e; }
.fig { width: 100%; margin: 4px 0 8px; }
.verdict.poor { background:#fdecea; border-color:#f5b5ae; }
pre.answer { background:#f6f8fa; border:1px solid #dde2e8; border-radius:8px; padding:8px 14px; white-space:pre-wrap; }
.verdict { background:#eef6ee; border:1px solid #b7dfb9; border-radius:8px; padding:8px 14px; margin: 10px 0; }
nav a { margin-right: 12px; color: var(--accent); text-decoration:none; font-size:13px; }
code { background: var(--bg); padding: 0 4px; border-radius: 4px; }
"""  # noqa: E501 - one CSS rule a line, written as is into report.html


def esc(x: Any) -> str:
    return html.escape(str(x))


def fig_html(fig, key: str) -> str:
    """One figure's ``<div>``: a figure dict (``replay/report/figspec.py``) or a plotly figure."""
    if isinstance(fig, dict):
        return ('<div class="fig">' + fs.to_html(fig, div_id=f"fig-{key}", config=PLOT_CONFIG,
                                                 default_height=f"{fig['layout'].get('height') or 450}px")
                + "</div>")

    return ('<div class="fig">' + pio.to_html(fig, include_plotlyjs=False, full_html=False,
                                                div_id=f"fig-{key}", config=PLOT_CONFIG,
                                                default_height=f"{fig.layout.height or 450}px")
            + "</div>")
