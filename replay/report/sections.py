"""The report's closed-loop answer and locality-waterfall sections.

Kept apart from ``replay/report/run_page.py`` (the page and its open-loop figures):
:func:`closed_loop_section` is the page's first section whenever a closed-loop
grid of the run's trace exists (fidelity said before any prediction, configs
ranked by mean served hit rate with 95% intervals and the stable verdict,
this run's open-loop decision-time hit rate beside them, labelled), and
:func:`waterfall_section` draws the waterfall per config, two configs side
by side, and the requests that lost most.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

from replay.analysis import closed_loop as cl
from replay.analysis import waterfall as wf
from replay.errors import ParamError
from replay.report import figspec as fs


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def open_loop_note_html(trace_path: str | None) -> str:
    """The one line an open-loop ranking carries, as a page note."""
    return (f'<p class="note open-loop"><b>Open-loop estimate.</b> {_e(cl.OPEN_LOOP_NOTE.split(": ", 1)[1])} '
            '(hit rates in this section are decision-time, <code>hit_rate</code>). '
            f"Closed-loop answer: <code>{_e(cl.closed_loop_command(trace_path))}</code> "
            "(then <code>router-replay report RUN --closed-loop DIR</code>, or put the grid beside the run).</p>")


def closed_loop_section(grid: cl.ClosedLoopGrid, notes: list[str], open_rows: dict[tuple, dict],
                        knobs: list[str], *, bound_ms: float | None, on: str = "ttft") -> str:
    """The closed-loop answer: fidelity first, the recommendation, the ranked table."""
    rec = cl.recommend(grid, bound_ms=bound_ms, on=on)
    fid = grid.fidelity_line()
    poor = grid.fidelity is not None and not grid.fidelity.get("good")
    parts = [f'<p class="verdict{" poor" if poor else ""}" id="fidelity">{_e(fid)}</p>']
    parts += [f'<p class="note">{_e(n)}.</p>' for n in notes]
    answer = cl.format_recommendation(rec).splitlines()[1:]  # the fidelity line is above
    parts.append('<pre class="answer">' + _e("\n".join(answer)) + "</pre>")
    col = rec.bound_col
    label = cl.BOUNDS[on][1]
    ranked = sorted(grid.summary.iter_rows(named=True),
                    key=lambda r: (-(cl.num(r.get("true_hit_rate")) or -1.0), r["config_id"]))
    short = {"worker_queue_limit": "limit", "saturation_queue_floor": "floor"}
    head = ["#", "config", *[short.get(k, k.replace("_", " ")) for k in rec.knobs], "served hit rate [95%]",
            f"{label} [95%]", "TTFT p50", "queue wait p99", "stable", "qualifies",
            "open loop: decision-time hit rate"]
    ok_ids = {r["config_id"] for r in rec.ranked}
    trs = ["<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(ranked, 1):
        key = tuple(r.get(k) for k in knobs)
        o = open_rows.get(key)
        stable = r.get("stable")
        st = ("yes" if stable else "–" if stable is None else
              "NO (seeds " + ",".join(map(str, r.get("unstable_seeds") or [])) + ")")
        cells = [i, r["config_id"], *["none" if r.get(k) is None else r.get(k) for k in rec.knobs],
                 cl.interval(r, "true_hit_rate"), cl.interval(r, col, cl.seconds),
                 cl.interval(r, "ttft_ms_p50", cl.seconds),
                 cl.interval(r, "queue_wait_ms_p99", cl.seconds), st, "yes" if r["config_id"] in ok_ids else "no",
                 cl.pct(o.get("hit_rate")) + f" (config {o['config_id']})" if o else "not in this run"]
        trs.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    parts.append('<table class="closed">' + "".join(trs) + "</table>")
    parts.append(f'<p class="note">{_e(cl.HIT_NAMES)}: they differ even when the replay agrees with '
                 "production (see docs/closed-loop.md). Ranked by mean true hit rate over the seeds; "
                 "an interval is the 95% Student-t interval of the mean.</p>")
    return "\n".join(parts)


def _pair(view) -> tuple[dict, dict | None]:
    """The two configs drawn side by side: the config followed (the best under the bound, or
    --config) and its no-gate baseline (else the next config of the menu)."""
    rows = _menu_rows(view)
    a = view.chosen or rows[0]
    beside = getattr(view, "beside", None)
    if beside is not None:
        if beside not in view.rows:

            raise ParamError("beside", f"{beside}: no such config_id in this run")
        return a, view.rows[beside]
    b = view.baseline_for(a)
    if b is None or b["config_id"] == a["config_id"]:
        b = next((r for r in rows if r["config_id"] != a["config_id"]), None)
    return a, b


def waterfall_figures(view) -> dict[str, Any]:
    """``waterfall`` (one config at a time, a menu) and ``waterfall_pair`` (two side by side)."""
    a, b = _pair(view)
    out = {"waterfall": fig_menu(_menu_rows(view), view.label, a["config_id"])}
    if b is not None:
        out["waterfall_pair"] = fig_pair(a, b, view.label)
    return out


def waterfall_section(view, figs: dict[str, Any], fig_html) -> str:
    """Per-config waterfall (menu), two configs side by side, the requests that lost most."""
    s = view.summary
    if "waterfall" not in figs:
        return ('<p class="note">This run has no waterfall columns (written before they existed); '
                "re-run the sweep to see where locality goes.</p>")
    rows = _menu_rows(view)
    label = view.label
    parts = ['<p class="note">Per config: the blocks the fleet could have reused (matched, the ceiling), '
             "what each decision step gave away, and what the chosen workers held (selected = matched − "
             "the losses; integer sums over routed requests). The menu at the top right switches config"
             + (f" ({len(rows)} of {s.height} configs: the best, the baselines, then by id; "
                "<code>--config ID</code> picks any)" if len(rows) < s.height else "") + ".</p>",
             fig_html(figs["waterfall"], "waterfall")]
    a, b = _pair(view)
    if b is not None:
        ch = wf.changed_terms(b, a)
        txt = ", ".join(f"{wf.STEP_TEXT.get(c, c.replace('_', ' '))} {v:+,}" for c, v in ch.items()) or "none"
        parts.append(f'<p class="note">Side by side: config {a["config_id"]} ({_e(label(a))}) and config '
                     f'{b["config_id"]} ({_e(label(b))}). Changed terms, left − right: {_e(txt)}.</p>')
        parts.append(fig_html(figs["waterfall_pair"], "waterfall_pair"))
    drill = wf.drilldown(view.data.decisions, a["config_id"])
    if drill is None:
        parts.append('<p class="note">No per-request losses: the run kept no decisions with waterfall '
                     "columns (sweep without <code>--no-decisions</code>).</p>")
    elif drill.height == 0:
        parts.append(f'<p class="note">No request of config {a["config_id"]} lost a block.</p>')
    else:
        head = "".join(f"<th>{_e(c.replace('_', ' '))}</th>" for c in drill.columns)
        body = "".join("<tr>" + "".join(f"<td>{_e('–' if v is None else v)}</td>" for v in row) + "</tr>"
                       for row in drill.iter_rows())
        parts.append(f'<p class="note">The {drill.height} requests of config {a["config_id"]} that lost the most '
                     "blocks, with their labels (from decisions.parquet; lost to = the first step that lost "
                     "any; the choosing step's term is blocks lost minus the three shown).</p>"
                     f'<table id="drilldown"><tr>{head}</tr>{body}</table>')
    return "\n".join(parts)


def _menu_rows(view) -> list[dict]:
    order: list[int] = []
    for r in view.best_rows:
        order.append(r["config_id"])
        b = view.baseline_for(r)
        if b is not None:
            order.append(b["config_id"])
    if view.chosen is not None:
        order.insert(0, view.chosen["config_id"])
    order += sorted(view.rows)
    seen: list[int] = []
    for i in order:
        if i not in seen:
            seen.append(i)
    return [view.rows[i] for i in seen[:wf.MENU_MAX]]


def _waterfall_trace(row: Mapping[str, Any], name: str, visible: bool = True, showlegend: bool = False) -> dict:
    t = wf.terms(row)
    m = t["matched_blocks"] or 1
    x = ["matched (ceiling)", *(f"lost: {wf.STEP_TEXT[c]}" for c in wf.TERMS), "selected"]
    y = [t["matched_blocks"], *(-t[c] for c in wf.TERMS), t["selected_blocks"]]
    text = [f"{t['matched_blocks']:,}", *(f"-{t[c]:,} ({100 * t[c] / m:.1f}%)" if t[c] else "0" for c in wf.TERMS),
            f"{t['selected_blocks']:,} ({100 * t['selected_blocks'] / m:.1f}%)"]
    return fs.trace("waterfall", x=x, y=y, measure=["absolute", *["relative"] * len(wf.TERMS), "total"], text=text,
                    textposition="outside", name=name, visible=visible, showlegend=showlegend,
                    connector=dict(line=dict(color="#9aa5b1", width=1)),
                    decreasing=dict(marker=dict(color="#d62728")),
                    increasing=dict(marker=dict(color="#2ca02c")),
                    totals=dict(marker=dict(color="#1f77b4")),
                    hovertemplate="%{x}: %{text}<extra>" + name.replace("<", "&lt;") + "</extra>")


def fig_menu(rows: Sequence[Mapping[str, Any]], label, first_id: int) -> dict:
    """One waterfall per config of ``rows`` (at most :data:`wf.MENU_MAX`), a menu switching between them;
    ``first_id`` is shown first.  ``label(row)`` names a config.  A plotly figure dict
    (``replay/report/figspec.py``; ``go.Figure(d)`` validates it)."""
    rows = list(rows)[:wf.MENU_MAX]
    ids = [r["config_id"] for r in rows]
    first = ids.index(first_id) if first_id in ids else 0
    fig = fs.Fig()
    for i, r in enumerate(rows):
        fig.add_trace(_waterfall_trace(r, f"config {r['config_id']}", visible=i == first))
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
    fig.add_trace(_waterfall_trace(a, f"config {a['config_id']}"), row=1, col=1)
    fig.add_trace(_waterfall_trace(b, f"config {b['config_id']}"), row=1, col=2)
    fig.update_layout(height=440, margin=dict(t=60, l=70, r=20, b=60), showlegend=False,
                      font=dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=12),
                      paper_bgcolor="white", plot_bgcolor="white", template=fs.template("plotly"))
    fig.update_yaxes(title=dict(text="blocks"), row=1, col=1)
    return fig.to_dict()
