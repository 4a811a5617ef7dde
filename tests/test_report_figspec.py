"""The report's figures as plain dicts (replay/report/figspec.py) are plotly's figures.

The page is written from figure dicts built without plotly's graph objects
(they were most of a sample sweep's time).  These tests hold the
dicts to plotly itself: the subplot grid to ``make_subplots``, the helpers to
``go.Figure``'s methods, and every figure of real runs (real sweeps, real
Parquet) to its validated form, as the page carries it; and (the CLI's start: tests/test_cli_start.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
from plotly.subplots import make_subplots

from replay import run_sweep
from replay.report import figspec as fs
from replay.report.run_page import figure_dicts, figures, render_html
from replay.trace.synthetic import generate_trace


def _layout(fig) -> dict:
    """A figure's layout as plotly's JSON, without the template (make_subplots adds the default)."""
    lay = json.loads(pio.to_json(fig))["layout"]
    lay.pop("template", None)
    return lay


GRIDS = [  # the report's subplot grids, and a few more shapes
    dict(rows=4, cols=2, subplot_titles=list("abcdefgh"), shared_xaxes=True, shared_yaxes=True,
         horizontal_spacing=0.06, vertical_spacing=0.09),
    dict(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.09, row_heights=[0.42, 0.22, 0.36],
         subplot_titles=["one", "two", "three"]),
    dict(rows=1, cols=3, subplot_titles=["a", "b", "c"], horizontal_spacing=0.07),
    dict(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.05, subplot_titles=["p99", "mean"]),
    dict(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=["hit", "ttft"]),
    dict(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04, subplot_titles=["left", ""]),
    dict(rows=2, cols=3),
    dict(rows=3, cols=2, subplot_titles=["x", "", "z"], row_heights=[1, 2, 3], shared_xaxes=True),
    dict(rows=5, cols=1, shared_yaxes=True),
]


@pytest.mark.parametrize("kw", GRIDS)
def test_grid_is_make_subplots(kw):
    """Domains (bit for bit), anchors, shared axes and subplot titles equal plotly's."""
    assert fs.grid(**kw).to_dict()["layout"] == _layout(make_subplots(**kw))


def test_fig_methods_are_go_figure_methods():
    """Traces placed by row/col, axes updated by row/col and all at once, nested layout updates
    merged, a vertical line with its label: the same figure as go.Figure's methods make."""
    kw = dict(rows=2, cols=2, shared_yaxes=True, subplot_titles=["a", "b", "c", "d"])
    ours, theirs = fs.grid(**kw), make_subplots(**kw)
    for r, c in ((1, 1), (1, 2), (2, 1), (2, 2)):
        ours.add_trace(fs.trace("scatter", x=[1, 2], y=[r, c], name=f"{r}{c}", line=dict(width=2)), row=r, col=c)
        theirs.add_trace(go.Scatter(x=[1, 2], y=[r, c], name=f"{r}{c}", line=dict(width=2)), row=r, col=c)
    for fig in (ours, theirs):
        fig.update_layout(height=400, margin=dict(l=70, r=30, t=40, b=50), legend=dict(orientation="h"))
        fig.update_layout(margin=dict(b=110))
        fig.update_xaxes(type="category")
        fig.update_yaxes(tickformat=".0%", row=2, col=1)
        fig.update_xaxes(title=dict(text="x"), row=2)
        fig.update_yaxes(title=dict(text="y"), col=1)
        fig.add_vline(x=1.5, line=dict(color="#555", dash="dash", width=1), row=1, col=1,
                      annotation_text="bound 1.5", annotation_position="top left")
    assert json.loads(pio.to_json(go.Figure(ours.to_dict()))) == json.loads(pio.to_json(theirs))
    plain, fig = fs.Fig(), go.Figure()
    for f in (plain, fig):
        f.update_yaxes(range=[0, 1], title=dict(text="share"))
        f.update_xaxes(tickangle=-45)
    plain.add_trace(fs.trace("bar", x=["a"], y=[1.0], marker=dict(color="#111")))
    fig.add_trace(go.Bar(x=["a"], y=[1.0], marker=dict(color="#111")))
    assert json.loads(pio.to_json(go.Figure(plain.to_dict()))) == json.loads(pio.to_json(fig))


@pytest.mark.parametrize("name", ["RdYlGn", "RdYlGn_r"])
def test_colorscale_is_plotlys(name):
    ours = json.loads(pio.to_json(go.Figure(go.Heatmap(z=[[1]], colorscale=fs.colorscale(name)))))
    theirs = json.loads(pio.to_json(go.Figure(go.Heatmap(z=[[1]], colorscale=name))))
    assert ours == theirs


def test_templates_and_bundle_are_plotlys():
    import plotly.offline

    assert fs.plotlyjs() == plotly.offline.get_plotlyjs()
    for name in ("plotly", "plotly_white"):
        want = json.loads(pio.to_json(go.Figure(layout=dict(template=name))))["layout"]["template"]
        assert fs.template(name) == want


def test_typed_arrays_and_json_are_plotlys():
    """numpy arrays become the typed arrays go.Figure.to_dict writes (64-bit integers narrowed,
    NaN kept, datetimes as ISO strings) and the JSON is plotly's, script-safe."""
    t = (np.arange(5, dtype=np.int64) * 1_500_000_000 + 1_767_225_600_123_456_789).astype("datetime64[ns]")
    spec = {"data": [fs.trace("scatter", x=t, y=np.array([0.5, np.nan, 1.0, 2.0, 3.0]),
                              customdata=np.array([1, 2, 300, 4, 70_000], dtype=np.int64),
                              hovertemplate="%{y}<extra></extra>", name="a/b \u2028")],
            "layout": {"xaxis": {"range": np.array([0.0, 1.0])}, "template": fs.template("plotly")}}
    want = json.loads(pio.to_json(go.Figure(spec)))
    html = fs.to_html(spec, div_id="fig-t", config={"displaylogo": False}, default_height="450px")
    assert "</extra>" not in html.split("<script>", 1)[1].rsplit("</script>", 1)[0]
    data, layout, config = _newplot_args(html, "fig-t")
    assert data == want["data"] and layout == want["layout"]
    assert config == {"displaylogo": False, "responsive": True}
    assert data[0]["y"]["dtype"] == "f8" and data[0]["customdata"]["dtype"] == "i4"
    assert data[0]["x"][0].startswith("2026-01-01T00:00:00.123456")


def _newplot_args(page: str, div_id: str) -> list:
    """The three JSON arguments after ``div_id`` of the page's ``Plotly.newPlot`` call."""
    m = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', page)
    assert m, div_id
    dec, i, out = json.JSONDecoder(), m.end(), []
    for _ in range(3):
        v, i = dec.raw_decode(page, i)
        out.append(v)
        while page[i] in " \n,":
            i += 1
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("figspec")
    trace = root / "trace"
    generate_trace(trace, n_requests=1500, n_workers=6, dp_size=2, sample_interval_ms=100, max_matches=6, seed=11)
    grid = {"worker_queue_limit": "none,2,4,8", "saturation_queue_floor": "none,1..4"}
    out = {"plain": root / "plain", "variants": root / "variants", "per_rank": root / "per_rank"}
    run_sweep(trace, grid, out=out["plain"])
    run_sweep(trace, {**grid, "pin_order": "pressure,locality"}, out=out["variants"], decisions=False)
    run_sweep(trace, {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"},
              out=out["per_rank"], per_dp_rank=True)
    return out


@pytest.mark.parametrize("name", ["plain", "variants", "per_rank"])
def test_page_figures_are_the_validated_figures(runs, name):
    """Every figure on the page is, to the last number, plotly's validated figure of the same dict
    (so validation would change nothing), and figures() returns those validated figures."""
    page = render_html(runs[name])
    specs = figure_dicts(runs[name])
    figs = figures(runs[name])
    assert set(specs) == set(figs) and "heatmaps" in specs and "tradeoff" in specs
    assert ("over_time" in specs) == (name != "variants")
    for key, spec in specs.items():
        want = json.loads(pio.to_json(go.Figure(spec)))
        assert json.loads(pio.to_json(figs[key])) == want, key
        data, layout, _config = _newplot_args(page, f"fig-{key}")
        assert data == want["data"], key
        assert layout == want["layout"], key
    assert page.count(fs.plotlyjs()) == 1
