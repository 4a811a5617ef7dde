"""Plotly figures as plain dicts: the JSON plotly.js reads, built without plotly's graph_objects.

``plotly.graph_objects`` validates every property as it is set and deep-copies
layouts and templates on every update; for the report's nine figures that was
most of a sample sweep's wall time (about 1.8 s of 3.3 s).  plotly.js needs only
the JSON, so the report builds each figure as a dict through :class:`Fig`, a
small stand-in for the part of ``go.Figure``'s API the report uses
(``add_trace``, ``update_layout``, ``update_xaxes``/``update_yaxes`` with
``row``/``col``, ``add_vline``), with :func:`grid` writing the axis layout that
``plotly.subplots.make_subplots`` would (same domains, anchors, shared-axis
``matches`` and subplot-title annotations).

Properties are given nested (``title=dict(text=...)``, never plotly's
``title_text`` shorthand).  ``go.Figure(fig.to_dict())`` is the validated
figure (``replay.report.run_page.figures`` returns those), and the page's JSON is what
plotly's own ``to_html`` writes for it: :func:`to_html` writes numpy arrays as
the same typed arrays and encodes with the same orjson options and escapes,
without importing plotly's graph objects or validators (about 0.1 s more).
``tests/test_report_figspec.py`` holds all of it equal to plotly's.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from _plotly_utils.colors import diverging
from plotly.io.json import to_json_plotly


def merge(dst: dict, src: dict) -> dict:
    """``src`` merged into ``dst`` the way plotly's ``update`` does: nested dicts merge, anything
    else (lists, scalars) replaces; returns ``dst``."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            merge(dst[k], v)
        elif isinstance(v, dict):
            dst[k] = merge({}, v)
        else:
            dst[k] = v
    return dst


@functools.cache
def _package_data() -> Path:
    """plotly's ``package_data`` folder, found without importing plotly (its ``__init__`` asks
    ``importlib.metadata`` for its own version, about 0.1 s)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:  # pragma: no cover - plotly is a dependency
        raise ModuleNotFoundError("plotly")
    return Path(spec.origin).parent / "package_data"


@functools.cache
def plotlyjs() -> str:
    """The plotly.js bundle, as ``plotly.offline.get_plotlyjs()`` returns it (the same file, bytes)."""
    return (_package_data() / "plotly.min.js").read_bytes().decode("utf-8")


@functools.cache
def _template_json(name: str) -> str:
    return (_package_data() / "templates" / f"{name}.json").read_bytes().decode("utf-8")


def template(name: str) -> dict:
    """A plotly template as the figure's ``layout.template`` holds it (a fresh copy)."""
    return json.loads(_template_json(name))


def colorscale(name: str) -> list:
    """A named diverging plotly colorscale (``"RdYlGn"``; ``"RdYlGn_r"`` reversed) as the
    ``[[stop, colour], ...]`` list plotly's validation turns the name into."""

    base = name[:-2] if name.endswith("_r") else name
    colors = list(getattr(diverging, base))
    if base != name:
        colors.reverse()
    d = len(colors) - 1
    return [[i / d, c] for i, c in enumerate(colors)]


def trace(kind: str, **props: Any) -> dict:
    """One trace: ``trace("scatter", x=..., y=...)`` is ``go.Scatter(x=..., y=...)`` as a dict."""
    return {"type": kind, **props}


class Fig:
    """A figure under construction; ``to_dict()`` is the plotly figure dict.

    Without a grid it is a plain figure (one ``xaxis``/``yaxis``); with ``grid(...)``'s
    layout and axis references, ``row``/``col`` place traces and pick axes as in a
    ``make_subplots`` figure.
    """

    def __init__(self, grid_layout: dict | None = None, refs: dict | None = None):
        self.data: list[dict] = []
        self.layout: dict = merge({}, grid_layout or {})
        self.refs: dict[tuple[int, int], tuple[str, str]] = refs or {}

    def add_trace(self, tr: dict, row: int | None = None, col: int | None = None) -> Fig:
        if row is not None or col is not None:
            tr["xaxis"], tr["yaxis"] = self.refs[(row or 1, col or 1)]
        self.data.append(tr)
        return self

    def update_layout(self, **props: Any) -> Fig:
        merge(self.layout, props)
        return self

    def _axes(self, letter: str, row: int | None, col: int | None) -> list[str]:
        if not self.refs:
            return [f"{letter}axis"]
        i = "xy".index(letter)
        return [f"{letter}axis{ref[i][1:]}" for (r, c), ref in sorted(self.refs.items())
                if (row is None or r == row) and (col is None or c == col)]

    def update_xaxes(self, row: int | None = None, col: int | None = None, **props: Any) -> Fig:
        for name in self._axes("x", row, col):
            merge(self.layout.setdefault(name, {}), props)
        return self

    def update_yaxes(self, row: int | None = None, col: int | None = None, **props: Any) -> Fig:
        for name in self._axes("y", row, col):
            merge(self.layout.setdefault(name, {}), props)
        return self

    def add_vline(self, x: Any, *, row: int, col: int, line: dict, annotation_text: str,
                  annotation_position: str = "top left") -> Fig:
        """A vertical line across one subplot with its label at the top left, as ``go.Figure.add_vline``
        writes it (a line shape in data x and the subplot's y domain, and an annotation)."""
        if annotation_position != "top left":
            raise ValueError(f"annotation_position {annotation_position!r}: only 'top left' is drawn")
        xref, yref = self.refs.get((row, col), ("x", "y"))
        self.layout.setdefault("shapes", []).append(
            {"line": merge({}, line), "type": "line", "x0": x, "x1": x, "xref": xref, "y0": 0, "y1": 1,
             "yref": f"{yref} domain"})
        self.layout.setdefault("annotations", []).append(
            {"showarrow": False, "text": annotation_text, "x": x, "xanchor": "right", "xref": xref,
             "y": 1, "yanchor": "top", "yref": f"{yref} domain"})
        return self

    def to_dict(self) -> dict:
        return {"data": self.data, "layout": self.layout}


def grid(rows: int = 1, cols: int = 1, *, shared_xaxes: bool = False, shared_yaxes: bool = False,
         horizontal_spacing: float | None = None, vertical_spacing: float | None = None,
         row_heights: list[float] | None = None, subplot_titles: list[str] | None = None) -> Fig:
    """An empty figure with the subplot grid ``plotly.subplots.make_subplots`` lays out for the same
    arguments (cells top-left first, ``xy`` subplots only): every axis's domain and anchor, the
    shared axes' ``matches`` and hidden tick labels, and the subplot titles as annotations."""
    if horizontal_spacing is None:
        horizontal_spacing = 0.2 / cols
    if vertical_spacing is None:
        vertical_spacing = 0.5 / rows if subplot_titles is not None else 0.3 / rows
    titles = subplot_titles if subplot_titles is not None else [""] * rows * cols
    # the same arithmetic, in the same order, as plotly's make_subplots (the domains are bit-equal)
    widths = [(1.0 - horizontal_spacing * (cols - 1)) / cols] * cols
    if row_heights is None:
        heights = [(1.0 - vertical_spacing * (rows - 1)) / rows] * rows
    else:
        total = float(sum(row_heights))
        heights = list(reversed([(1.0 - vertical_spacing * (rows - 1)) * (h / total) for h in row_heights]))
    row_seq = range(rows)[::-1]
    starts = [[(sum(widths[:c]) + c * horizontal_spacing, sum(heights[:r]) + r * vertical_spacing)
               for c in range(cols)] for r in row_seq]
    layout: dict[str, Any] = {}
    refs: dict[tuple[int, int], tuple[str, str]] = {}
    domains: list[list[float]] = []
    n = 0
    for r in range(rows):
        for c in range(cols):
            n += 1
            x_dom = [starts[r][c][0], starts[r][c][0] + widths[c]]
            y_dom = [_clamp(starts[r][c][1]), _clamp(starts[r][c][1] + heights[-1 - r])]
            suffix = str(n) if n > 1 else ""
            layout[f"xaxis{suffix}"] = {"domain": x_dom, "anchor": f"y{suffix}"}
            layout[f"yaxis{suffix}"] = {"domain": y_dom, "anchor": f"x{suffix}"}
            refs[(r + 1, c + 1)] = (f"x{suffix}", f"y{suffix}")
            domains += [x_dom, y_dom]
    if shared_xaxes:        # per column, every axis matches the bottom row's; only the bottom shows ticks
        for c in range(1, cols + 1):
            first = refs[(rows, c)][0]
            for r in range(rows - 1, 0, -1):
                ax = layout[f"xaxis{refs[(r, c)][0][1:]}"]
                ax["matches"], ax["showticklabels"] = first, False
    if shared_yaxes:        # per row, every axis matches the first column's, which alone shows ticks
        for r in range(rows, 0, -1):
            first = refs[(r, 1)][1]
            for c in range(2, cols + 1):
                ax = layout[f"yaxis{refs[(r, c)][1][1:]}"]
                ax["matches"], ax["showticklabels"] = first, False
    annotations = [
        {"y": y_dom[1], "xref": "paper", "x": sum(x_dom) / 2.0, "yref": "paper", "text": text,
         "showarrow": False, "font": {"size": 16}, "xanchor": "center", "yanchor": "bottom"}
        for text, x_dom, y_dom in zip(titles, domains[::2], domains[1::2], strict=False) if text]
    if annotations:
        layout["annotations"] = annotations
    return Fig(layout, refs)


def _clamp(y: float) -> float:
    """make_subplots' rounding of a y domain end just outside [0, 1] onto it."""
    if -0.01 < y < 0.0:
        return 0.0
    if 1.0 < y < 1.01:
        return 1.0
    return y


# numpy dtypes plotly.js reads as typed arrays, by their short names
_TYPED = {"int8": "i1", "uint8": "u1", "int16": "i2", "uint16": "u2", "int32": "i4", "uint32": "u4",
          "float32": "f4", "float64": "f8"}
_NARROW = {"int64": ("int8", "int16", "int32"), "uint64": ("uint8", "uint16", "uint32")}
_UNTYPED_KEYS = frozenset(("geojson", "layer", "layers", "range"))


def _typed(v: Any) -> Any:
    """A numpy array as plotly.js's typed-array spec (``{"dtype": "f8", "bdata": base64}``), 64-bit
    integers narrowed to the smallest type that holds them, as ``go.Figure.to_dict`` writes it; an
    empty array, or one of another dtype (datetimes), stays an array for the JSON encoder."""

    if v.size == 0:
        return v
    v = np.ascontiguousarray(v)
    for narrow in _NARROW.get(str(v.dtype), ()):
        info = np.iinfo(narrow)
        if v.min() >= info.min and v.max() <= info.max:
            v = v.astype(narrow)
            break
    short = _TYPED.get(str(v.dtype))
    if short is None:
        return v
    spec = {"dtype": short, "bdata": base64.b64encode(v).decode("ascii")}
    if v.ndim > 1:
        spec["shape"] = str(v.shape)[1:-1]
    return spec


def typed_arrays(obj: Any) -> None:
    """Every numpy array in a figure dict replaced, in place, by its typed-array spec, when the
    bundled plotly.js reads them (2.28 and later; plotly >= 6 validates arrays into them too).
    A ``template`` is not walked: it comes from JSON (:func:`template`) and holds no arrays."""
    if not _typed_arrays_supported():
        return

    stack = [obj]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(v, np.ndarray):
                if not (k in _UNTYPED_KEYS and isinstance(node, dict)):
                    node[k] = _typed(v)
            elif isinstance(v, dict | list) and k != "template":
                stack.append(v)


@functools.cache
def _typed_arrays_supported() -> bool:
    m = re.search(r"plotly\.js v(\d+)\.(\d+)", plotlyjs()[:400])
    return m is not None and (int(m.group(1)), int(m.group(2))) >= (2, 28)


# characters a JSON text inside a <script> element must not carry as they are
_SCRIPT_SAFE = (("<", "\\u003c"), (">", "\\u003e"), ("/", "\\u002f"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def to_json(obj: Any) -> str:
    """JSON of a figure's data or layout, safe inside ``<script>``: what plotly's own encoder
    (``plotly.io.json.to_json_plotly``, its orjson engine) writes; plotly's encoder itself when
    orjson is missing or the object holds something orjson does not encode."""
    try:
        import orjson  # optional: an extra dependency
    except ImportError:
        orjson = None
    if orjson is not None:
        try:
            text = orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY).decode("utf-8")
        except TypeError:
            pass
        else:
            for raw, safe in _SCRIPT_SAFE:
                text = text.replace(raw, safe)
            return text

    return to_json_plotly(obj)


def to_html(fig: dict, *, div_id: str, config: dict, default_height: str) -> str:
    """The ``<div>`` and ``Plotly.newPlot`` script of one figure dict: the markup
    ``plotly.io.to_html(..., include_plotlyjs=False, full_html=False)`` writes, with the JSON of the
    validated figure (numpy arrays as typed arrays, as ``go.Figure.to_dict`` does; ``fig`` is
    converted in place) as plotly's own encoder writes it, without importing plotly's graph objects
    or its validators."""
    typed_arrays(fig)
    layout = fig.get("layout", {})
    height = layout.get("height", layout.get("template", {}).get("layout", {}).get("height", default_height))
    if isinstance(height, int | float):
        height = f"{height}px"
    cfg = dict(config)
    cfg.setdefault("responsive", True)
    ident = json.dumps(div_id)
    return (f'<div style="height:{height}; width:100%;">'
            f'<div id={ident} class="plotly-graph-div" style="height:100%; width:100%;"></div>'
            "<script>window.PLOTLYENV=window.PLOTLYENV || {};"
            f"if (document.getElementById({ident})) {{Plotly.newPlot({ident}, "
            f"{to_json(fig.get('data', []))}, {to_json(layout)}, {json.dumps(cfg)})}};"
            "</script></div>")
