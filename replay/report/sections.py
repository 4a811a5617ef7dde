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
from replay.config import KNOB_SHORT, RouterConfig
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
                        knobs: list[str], *, bound_ms: float | None, on: str = "ttft", fig_html) -> str:
    """The closed-loop answer: fidelity first, the recommendation, the ranked table."""
    rec = cl.recommend(grid, bound_ms=bound_ms, on=on)
    fid = grid.fidelity_line()
    poor = grid.fidelity is not None and not grid.fidelity.get("good")
    parts = [f'<p class="verdict{" poor" if poor else ""}" id="fidelity">{_e(fid)}</p>']
    parts += [f'<p class="note">{_e(n)}.</p>' for n in notes]
    parts.append(answer_html(rec))
    parts.append(fig_html(fig_answer(rec), "answer"))
    col = rec.bound_col
    label = cl.BOUNDS[on][1]
    ranked = sorted(grid.summary.iter_rows(named=True),
                    key=lambda r: (-(cl.num(r.get("true_hit_rate")) or -1.0), r["config_id"]))
    head = ["#", "config", *[KNOB_SHORT.get(k, k.replace("_", " ")) for k in rec.knobs], "served hit rate [95%]",
            f"{label} [95%]", f"{label}, per-seed range", "TTFT p50", "queue wait p99", "stable over the seeds",
            "qualifies",
            "open loop: decision-time hit rate"]
    ok_ids = {r["config_id"] for r in rec.ranked}
    trs = ["<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for i, r in enumerate(ranked, 1):
        key = tuple(r.get(k) for k in knobs)
        o = open_rows.get(key)
        stable = r.get("stable")
        st = ("yes" if stable else "–" if stable is None else
              "NO (seeds " + ",".join(map(str, r.get("unstable_seeds") or [])) + " disagree)")
        cells = [i, r["config_id"], *["none" if r.get(k) is None else r.get(k) for k in rec.knobs],
                 cl.interval(r, "true_hit_rate"), cl.interval(r, col, cl.seconds),
                 cl.seed_range(r, col, cl.seconds).removeprefix("seeds ") or "–",
                 cl.interval(r, "ttft_ms_p50", cl.seconds),
                 cl.interval(r, "queue_wait_ms_p99", cl.seconds), st, "yes" if r["config_id"] in ok_ids else "no",
                 cl.pct(o.get("hit_rate")) + f" (config {o['config_id']})" if o else "not in this run"]
        trs.append("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>")
    parts.append('<table class="closed">' + "".join(trs) + "</table>")
    parts.append(f'<p class="note">{_e(cl.HIT_NAMES)}: they differ even when the replay agrees with '
                 "production (see docs/closed-loop.md). Ranked by mean true hit rate over the seeds; "
                 f"{_e(cl.interval_names(grid.n_seeds))}.</p>")
    return "\n".join(parts)


ANSWER_COLORS = {"qualifies": "#1f77b4", "over the bound": "#e8a09a", "unstable": "#9aa5b1",
                 "pick": "#2ca02c", "runner-up": "#ff7f0e"}


def _s(ms: float) -> str:
    """A bound in ms as seconds, without trailing zeros (26.15, 10)."""
    return f"{ms / 1000:.2f}".rstrip("0").rstrip(".")


def _stability(rec: cl.ClosedLoopRecommendation) -> str:
    """The stability verdict in one sentence: how many configs hold across the seeds, the pick
    against the runner-up."""
    g = rec.grid
    if not g.seeded:
        return ("One seed per config: no interval and no stability verdict "
                "(simulate with --seeds 5 for an answer that holds across seeds).")
    unstable = [r for r in g.summary.iter_rows(named=True) if r.get("stable") is not True]
    out = f"Stable over {g.n_seeds} seeds: {g.summary.height - len(unstable)} of {g.summary.height} configs"
    if unstable:
        out += " (unstable: " + "; ".join(
            f"config {u['config_id']}, seeds {','.join(map(str, u.get('unstable_seeds') or []))} disagree"
            for u in unstable[:4]) + ("; ..." if len(unstable) > 4 else "") + ")"
        left = len(rec.excluded["unstable"])
        out += (f"; {left} left out because their seeds disagree on the SLO verdict or by more than "
                f"{2 * cl.HIT_POINTS:g} points of hit rate" if left else
                "; none left out for it: their seeds agree on the SLO verdict and within "
                f"{2 * cl.HIT_POINTS:g} points of hit rate")
    d = rec.distinguishable
    if d is True:
        out += "; the pick is better than the runner-up beyond their 95% intervals of the mean."
    elif d is False:
        out += ("; the pick and the runner-up cannot be told apart within their 95% intervals of the mean: "
                "either is as good on this evidence.")
    else:
        out += "."
    return out


def answer_html(rec: cl.ClosedLoopRecommendation) -> str:
    """The closed-loop answer as sentences: the pick with its flags, the runner-up, the verdict."""
    g = rec.grid
    label = cl.BOUNDS["ttft" if rec.bound_col == "ttft_ms_p99" else "queue_wait"][1]
    if rec.bound_ms is None:
        slo = (f"no SLO given (the pick has the highest served hit rate at any {label}; "
               f"<code>--max-ttft-p99-ms MS</code> sets one)")
    else:
        slo = (f"SLO: {_e(label)} ≤ {_s(rec.bound_ms)} s, checked on the "
               + ("upper end of the 95% interval of the mean" if g.seeded else "point value"))
    b = rec.best
    if b is None:
        ex = rec.excluded
        return (f'<p class="verdict" id="answer">No config qualifies ({slo}): {len(ex["unstable"])} unstable, '
                f'{len(ex["over_bound"])} over the SLO, {len(ex["unknown"])} without a value. '
                f"{_e(_stability(rec))}</p>")
    flags = rec.flags() or "(the router's defaults)"
    text = (f'<p class="verdict" id="answer"><b>recommended: {_e(b["config"])} (config {b["config_id"]})</b>, '
            f"router flags <code>{_e(flags)}</code>: served hit rate {_e(cl.interval(b, 'true_hit_rate'))}, "
            f"{_e(label)} {_e(cl.interval(b, rec.bound_col, cl.seconds))}; {slo}.")
    r = rec.runner_up
    if r is not None:
        text += (f" Runner-up: {_e(r['config'])} (config {r['config_id']}), served hit rate "
                 f"{_e(cl.interval(r, 'true_hit_rate'))}, {_e(label)} {_e(cl.interval(r, rec.bound_col, cl.seconds))}.")
    else:
        text += " It is the only config that qualifies."
    u = max(rec.excluded["unstable"], key=lambda x: (cl.num(x.get("true_hit_rate")) or 0.0, -x["config_id"]),
            default=None)
    if u is not None and (cl.num(u.get("true_hit_rate")) or 0.0) > (cl.num(b.get("true_hit_rate")) or 0.0):
        gain = 100 * ((cl.num(u["true_hit_rate"]) or 0.0) - (cl.num(b["true_hit_rate"]) or 0.0))
        text += (f" Not chosen: {_e(cl.config_text(u, rec.knobs))} (config {u['config_id']}) has a mean served hit "
                 f"rate {gain:.2f} pts higher ({_e(cl.interval(u, 'true_hit_rate'))}), but its seeds "
                 f"{','.join(map(str, u.get('unstable_seeds') or []))} disagree with the others: on this load one "
                 "day may look very different from the next (more seeds or a lighter load settle it).")
    return text + f" {_e(_stability(rec))}</p>"


def fig_answer(rec: cl.ClosedLoopRecommendation) -> dict:
    """The closed-loop answer drawn: served hit rate against the bounded p99 per config, 95% intervals
    of the mean as bars on both axes, the SLO line, the pick and the runner-up marked."""
    g = rec.grid
    col = rec.bound_col
    label = cl.BOUNDS["ttft" if col == "ttft_ms_p99" else "queue_wait"][1]
    best = rec.best["config_id"] if rec.best else None
    second = rec.runner_up["config_id"] if rec.runner_up else None
    kind = {r["config_id"]: "qualifies" for r in rec.ranked}
    kind.update({r["config_id"]: "unstable" for r in rec.excluded["unstable"]})
    kind.update({r["config_id"]: "over the bound" for r in rec.excluded["over_bound"]})
    if best is not None:
        kind[best] = "pick"
    if second is not None:
        kind[second] = "runner-up"
    rows = {r["config_id"]: dict(r, config=cl.config_text(r, rec.knobs)) for r in g.summary.iter_rows(named=True)}
    fig = fs.Fig()
    for k in ("qualifies", "over the bound", "unstable", "runner-up", "pick"):
        pts = [rows[i] for i in sorted(rows) if kind.get(i) == k and cl.num(rows[i].get(col)) is not None
               and cl.num(rows[i].get("true_hit_rate")) is not None]
        if not pts:
            continue

        def err(c: str, scale: float, pts=pts) -> dict:
            if not g.seeded:
                return dict(visible=False)
            v = [cl.num(p.get(c)) for p in pts]
            hi = [cl.num(p.get(f"{c}_hi")) for p in pts]
            lo = [cl.num(p.get(f"{c}_lo")) for p in pts]
            return dict(type="data", symmetric=False, thickness=1.2, width=3,
                        array=[(h - x) * scale if h is not None and x is not None else 0
                               for h, x in zip(hi, v, strict=True)],
                        arrayminus=[(x - lo_) * scale if lo_ is not None and x is not None else 0
                                    for lo_, x in zip(lo, v, strict=True)])
        name = {"pick": f"pick: {pts[0]['config']}", "runner-up": f"runner-up: {pts[0]['config']}"}.get(k, k)
        big = k in ("pick", "runner-up")
        fig.add_trace(fs.trace(
            "scatter", mode="markers+text" if big else "markers", name=name,
            x=[cl.num(p[col]) / 1000 for p in pts], y=[100 * cl.num(p["true_hit_rate"]) for p in pts],
            error_x=err(col, 1 / 1000), error_y=err("true_hit_rate", 100),
            text=[k if big else "" for _ in pts], textposition="top center",
            customdata=[f"config {p['config_id']}: {p['config']}<br>served hit rate "
                        f"{cl.interval(p, 'true_hit_rate')}<br>{label} {cl.interval(p, col, cl.seconds)}"
                        for p in pts],
            hovertemplate="%{customdata}<extra>" + k + "</extra>",
            marker=dict(color=ANSWER_COLORS[k], size=18 if k == "pick" else 14 if big else 9,
                        symbol="star" if k == "pick" else "diamond" if big else "circle-open"
                        if k == "unstable" else "circle", line=dict(width=1.5, color=ANSWER_COLORS[k]))))
    title = f"Served hit rate against {label}, per config"
    if g.seeded:
        title += f" (bars: 95% interval of the mean over {g.n_seeds} seeds)"
    fig.update_layout(height=460, font=dict(family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif",
                                            size=12),
                      template=fs.template("plotly_white"), margin=dict(l=70, r=30, t=60, b=60),
                      title=dict(text=title, x=0.01, xanchor="left", font=dict(size=15)),
                      legend=dict(orientation="h", y=-0.18, x=0),
                      xaxis=dict(title=dict(text=f"{label} (s)")),
                      yaxis=dict(title=dict(text="served (true) hit rate (%)"), ticksuffix="%"))
    if rec.bound_ms is not None:
        fig.add_vline(rec.bound_ms / 1000, row=1, col=1, line=dict(color="#d62728", dash="dash", width=2),
                      annotation_text=f"SLO: {label} ≤ {_s(rec.bound_ms)} s")
    else:
        fig.update_layout(annotations=[dict(text="no SLO line: none given (--max-ttft-p99-ms MS)",
                                            showarrow=False, x=1, xref="paper", xanchor="right", y=1,
                                            yref="paper", yanchor="bottom")])
    return fig.to_dict()


def no_grid_html(trace_path: str | None, run_path: str) -> str:
    """The headline of a run without a closed-loop grid: how to get one in one command."""
    t = trace_path or "TRACE"
    cmd = (f"router-replay calibrate {t} --out {run_path}/fleet.toml --validate {run_path}/closed-loop "
           "--seeds 5 --worker-queue-limit none,2,4,8")
    return ('<p class="verdict" id="answer">No closed-loop answer yet: the decisions below are on the recorded '
            "load, which does not react to them. One command simulates the fleet under every config and "
            f"answers which limit and floor: <code>{_e(cmd)}</code> (add the sweep's other knob values); "
            f"then <code>router-replay report {_e(run_path)}</code> rebuilds this page with the answer "
            "first.</p>")


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
    b = _other_engine(view, a) or view.baseline_for(a)
    if b is None or b["config_id"] == a["config_id"]:
        b = next((r for r in rows if r["config_id"] != a["config_id"]), None)
    return a, b


_ENGINE_ONLY = ("chat_routing", "power_of_n_choices", "max_in_flight", "variant_reorg_ranking",
                "variant_pin_order", "variant_floor_scaling")


def _other_engine(view, a: Mapping[str, Any]) -> dict | None:
    """In a grid holding both routing engines: ``a``'s limit, floor and shared knobs under the
    other engine (its own knobs at their defaults), drawn beside ``a``."""
    if "chat_routing" not in getattr(view, "other_varying", ()):
        return None
    default = RouterConfig()
    for r in view.rows.values():
        if r["chat_routing"] != a["chat_routing"] \
                and all(r[k] == a[k] for k in view.knobs if k not in _ENGINE_ONLY) \
                and all(r[k] == getattr(default, k) for k in _ENGINE_ONLY if k != "chat_routing" and k in r):
            return r
    return None


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
