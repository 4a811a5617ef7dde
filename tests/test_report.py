"""report.html end to end: real sweeps of generated traces, the real CLI, and a real headless Chromium.

Covers the run-directory additions the report needs (``fleet.parquet`` and
``run.json["trace"]["facts"]``, held to the reference's snapshot), the
analysis behind the headline (pressure bound, best configs, baselines, Pareto
front), every figure, the page's self-containment, the ``report`` command's
errors, and that the page renders in Chromium without console errors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner
from conftest import tree_digest

from replay import reference, run_sweep
from replay.cli import main
from replay.report.run_page import HEATMAP_METRICS, figures, headline, load_run, pareto_front
from replay.trace import load_trace
from replay.trace.synthetic import generate_trace

GRID = {"worker_queue_limit": "none,2,4,8", "saturation_queue_floor": "none,1..4"}
ARTIFACTS = Path(__file__).parent / "artifacts"
ALL_FIGURES = {"heatmaps", "decision_mix", "reason_mix", "waterfall", "waterfall_pair", "over_time", "floor_vs_dp",
               "tradeoff"}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rep") / "trace"
    generate_trace(d, n_requests=2000, n_workers=6, dp_size=2, sample_interval_ms=100, max_matches=6,
                   seed=5)
    return d


@pytest.fixture(scope="module")
def run_dir(trace_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("rep_run") / "run"
    run_sweep(trace_dir, GRID, out=out)
    return out


@pytest.fixture(scope="module")
def page(run_dir):
    return (run_dir / "report.html").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------
# what the sweep writes for the report


def test_sweep_writes_report_and_fleet(run_dir):
    run = json.loads((run_dir / "run.json").read_text())
    assert run["report"] == "report.html" and "report_error" not in run
    assert run["fleet"] == "fleet.parquet"
    assert (run_dir / "report.html").stat().st_size > 3_000_000  # plotly.js inline
    assert not [e for e in os.listdir(run_dir.parent) if e.startswith(".run.")]  # nothing left aside
    fl = pl.read_parquet(run_dir / "fleet.parquet")
    assert fl.columns == ["request_id", "ts", "model", "fleet_min_waiting", "fleet_fresh_workers"]
    assert fl.height == 2000 and fl["ts"].is_sorted()


def _reference_fleet_min(trace, freshness_ns=5_000_000_000):
    """The fleet's smallest fresh basic ``waiting`` per request, from reference.LoadTable."""
    table = reference.LoadTable(freshness=freshness_ns)
    for w in range(trace.n_workers):
        if trace.worker_dp_size[w] > 0:
            table.expect(w, range(int(trace.worker_dp_size[w])))
    out, fresh, j = [], [], 0
    for i in range(trace.n_requests):
        ts = int(trace.req_ts[i])
        while j < trace.load_ts.shape[0] and int(trace.load_ts[j]) <= ts:
            w, r = int(trace.load_worker[j]), int(trace.load_rank[j])
            dp = int(trace.worker_dp_size[w])
            if not (dp > 0 and r >= dp):
                table.set(w, r, reference._rank_sample(trace, j), int(trace.load_ts[j]))
            j += 1
        snap = table.capture(ts)
        vals = [snap.basic[w].waiting for w in trace.fleet(int(trace.req_model[i])) if int(w) in snap.basic]
        out.append(min(vals) if vals else None)
        fresh.append(len(vals))
    return out, fresh


def test_fleet_readings_equal_reference_snapshot(run_dir, trace_dir):
    trace = load_trace(trace_dir)
    want_min, want_fresh = _reference_fleet_min(trace)
    fl = pl.read_parquet(run_dir / "fleet.parquet")
    assert fl["fleet_min_waiting"].to_list() == want_min
    assert fl["fleet_fresh_workers"].to_list() == want_fresh
    assert fl["request_id"].to_list() == list(trace.request_id)
    # the generator's bursts and its fleet-wide publisher pause are both visible
    assert max(v for v in want_min if v is not None) >= 4
    assert any(v is None for v in want_min)


def test_fleet_readings_freshness_and_models(models_trace, tmp_path):
    """A multi-model trace (with a model that has no fleet), and a freshness window of 0."""
    trace = load_trace(models_trace)
    for fresh_ms in (0, 5000):
        out = tmp_path / f"m{fresh_ms}"
        run_sweep(models_trace, {"worker_queue_limit": "1,2"}, out=out, freshness_ms=fresh_ms)
        want, _ = _reference_fleet_min(trace, fresh_ms * 1_000_000)
        assert pl.read_parquet(out / "fleet.parquet")["fleet_min_waiting"].to_list() == want
        assert (out / "report.html").is_file()


def test_trace_facts(run_dir, trace_dir):
    run = json.loads((run_dir / "run.json").read_text())
    f = run["trace"]["facts"]
    trace = load_trace(trace_dir)
    assert f["requests"] == 2000
    assert f["span_s"] == pytest.approx((trace.req_ts.max() - trace.req_ts.min()) / 1e9)
    assert f["fleet_workers"] == {"default": 6} and f["dp_sizes"] == {"2": 6}
    mins, _ = _reference_fleet_min(trace)
    sat = np.array([m is not None and m >= 1 for m in mins])
    assert f["saturated_share_requests"] == pytest.approx(sat.mean())
    gaps = np.diff(trace.req_ts).astype(float)
    assert f["saturated_share_time"] == pytest.approx(gaps[sat[:-1]].sum() / gaps.sum())
    assert 0.05 < f["saturated_share_time"] < 0.95  # bursts saturate the fleet part of the time
    assert f["no_fresh_fleet_reading_share"] == pytest.approx(np.mean([m is None for m in mins]))


def test_sweep_no_report_flag(trace_dir, tmp_path):
    out = tmp_path / "nr"
    res = invoke("sweep", trace_dir, "--out", out, "--worker-queue-limit", "2,4", "--no-report")
    assert res.exit_code == 0, res.output
    assert not (out / "report.html").exists()
    assert json.loads((out / "run.json").read_text())["report"] is None
    # and `report` builds it afterwards
    res = invoke("report", out)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"wrote {out / 'report.html'}"
    assert (out / "report.html").is_file()


# ---------------------------------------------------------------------------
# the analysis


def test_pareto_front():
    pts = [(1, 0.30, 1), (1, 0.35, 2), (2, 0.35, 3), (3, 0.50, 4), (5, 0.45, 5), (0, 0.10, 6)]
    assert pareto_front(pts) == [6, 2, 4]
    assert pareto_front([]) == []


def test_pareto_front_on_run(run_dir):
    s = pl.read_parquet(run_dir / "summary.parquet").drop_nulls(["hit_rate", "selected_waiting_mean"])
    rows = list(zip(s["selected_waiting_mean"], s["hit_rate"], s["config_id"], strict=True))
    front = set(pareto_front(rows))
    for x, y, i in rows:  # brute force: on the front iff nobody dominates it
        dominated = any((x2 <= x and y2 >= y) and (x2 < x or y2 > y) for x2, y2, _ in rows)
        assert (i in front) == (not dominated), i


def test_headline_best_under_bound(run_dir):
    s = pl.read_parquet(run_dir / "summary.parquet")
    h = headline(run_dir)
    p99 = sorted(s["selected_waiting_p99"].drop_nulls().to_list())
    assert h["bound"] == p99[(len(p99) + 1) // 2 - 1]  # the median (lower) p99 of the grid
    ok = s.filter(pl.col("selected_waiting_p99") <= h["bound"]).sort(
        ["hit_rate", "selected_waiting_mean", "config_id"], descending=[True, False, False])
    best = h["best"]
    assert best["config_id"].to_list() == ok["config_id"].head(5).to_list()
    base = s.filter(pl.col("worker_queue_limit").is_null()).row(0, named=True)
    for r in best.iter_rows(named=True):
        cfg = s.filter(pl.col("config_id") == r["config_id"]).row(0, named=True)
        assert r["baseline_config_id"] == base["config_id"]
        assert r["hit_rate_delta_pts"] == pytest.approx(100 * (cfg["hit_rate"] - base["hit_rate"]))
        assert r["selected_waiting_p99_delta"] == cfg["selected_waiting_p99"] - base["selected_waiting_p99"]
    tight = headline(run_dir, max_p99_waiting=p99[0])
    assert all(v <= p99[0] for v in s.filter(pl.col("config_id").is_in(tight["best"]["config_id"].to_list()))
               ["selected_waiting_p99"])
    assert headline(run_dir, max_p99_waiting=-1)["best"].height == 0
    facts = h["facts"]
    assert facts["requests"] == 2000 and facts["configs"] == s.height


# ---------------------------------------------------------------------------
# figures and page


def test_figures_from_library(run_dir):
    figs = figures(run_dir)
    assert set(figs) == ALL_FIGURES
    import plotly.graph_objects as go

    assert all(isinstance(f, go.Figure) for f in figs.values())
    heat = figs["heatmaps"]
    assert len(heat.data) == len(HEATMAP_METRICS) == 8
    s = pl.read_parquet(run_dir / "summary.parquet")
    hr = heat.data[0]
    assert list(hr.x) == ["none", "1", "2", "3", "4"] and list(hr.y) == ["none", "2", "4", "8"]
    # cell (limit 4, floor 2) holds config 12's hit rate; (none, 1) is a refused combination
    cfg = s.filter((pl.col("worker_queue_limit") == 4) & (pl.col("saturation_queue_floor") == 2)).row(0, named=True)
    assert hr.z[2][2] == pytest.approx(cfg["hit_rate"])
    assert hr.z[0][1] is None
    assert f"config {cfg['config_id']}" in hr.customdata[2][2] and "owner rate" in hr.customdata[2][2]
    pin = heat.data[2]
    assert pin.z[2][2] == pytest.approx(cfg["pinned"] / cfg["routed"])
    # the trade-off plot's front is the Pareto front of the run
    front = [t for t in figs["tradeoff"].data if t.name == "Pareto front"]
    assert len(front) == 2 and len(front[0].x) >= 1
    # over time: a dropdown over several configs, the first of them shown
    ot = figs["over_time"]
    menu = ot.layout.updatemenus[0]
    assert len(menu.buttons) >= 2
    assert all(len(b.args[0]["visible"]) == len(ot.data) for b in menu.buttons)
    assert sum(1 for t in ot.data if t.visible is not False) < len(ot.data)


def test_over_time_counts(run_dir):
    """Per-interval counts of the over-time figure add up to the config's summary."""
    from replay.report.run_page import ReportView, over_time_frames

    a = ReportView(load_run(run_dir))
    s = pl.read_parquet(run_dir / "summary.parquet")
    pinned = s.filter(pl.col("pinned") > 0)["config_id"][0]
    frames = over_time_frames(a, [pinned])[pinned]
    row = s.filter(pl.col("config_id") == pinned).row(0, named=True)
    assert frames["requests"].sum() == row["requests"]
    assert frames["pinned"].sum() == row["pinned"]
    for d in ("cache_hit", "cache_miss", "cache_worker_queued", "all_queued"):
        assert frames[d].sum() == row[d]


def test_pins_only_where_no_fresh_reading_is_below_the_floor(run_dir):
    """The engine pins a request only when fleet.parquet shows no fresh reading below the floor
    (spec 3.6), and the over-time figure's 'pin allowed' counts are exactly those requests."""
    from replay.report.run_page import ReportView, over_time_frames

    s = pl.read_parquet(run_dir / "summary.parquet").filter(pl.col("pinned") > 0)
    fl = pl.read_parquet(run_dir / "fleet.parquet")
    dec = pl.read_parquet(run_dir / "decisions.parquet", columns=["request_id", "config_id", "policy_reason"])
    a = ReportView(load_run(run_dir))
    frames = over_time_frames(a, s["config_id"].to_list())
    for cid, floor in zip(s["config_id"], s["saturation_queue_floor"], strict=True):
        d = dec.filter(pl.col("config_id") == cid).join(fl, on="request_id", maintain_order="left")
        allowed = (pl.col("fleet_min_waiting") >= floor) | pl.col("fleet_min_waiting").is_null()
        pinned = d.filter(pl.col("policy_reason") == "saturation_pin")
        assert pinned.height > 0 and pinned.filter(~allowed).height == 0, cid
        assert frames[cid]["reading_at_or_above_floor"].sum() == d.filter(allowed).height
        # and the floor matters: some requests saw a fresh reading below it
        assert d.filter(~allowed).height > 0


def test_page_is_self_contained(page):
    import plotly.offline

    bundle = plotly.offline.get_plotlyjs()
    assert page.startswith("<!DOCTYPE html>")
    assert page.count(bundle) == 1  # plotly.js itself, once, inline
    assert "plotly.js v" in bundle
    # the page around the bundle loads nothing: no script src, no stylesheet, no remote reference
    # (the bundle's own strings mention map tile servers and plotly.com; they are never fetched)
    rest = page.replace(bundle, "")
    assert not re.search(r"<script[^>]*\bsrc\s*=", rest, re.I)
    assert not re.search(r"<link\b|@import|url\(", rest, re.I)
    assert not re.search(r"https?://|//cdn", rest, re.I)
    assert "Plotly.newPlot" in rest


def test_page_has_every_section_and_figure(page, run_dir):
    for n in range(1, 9):
        assert f'id="s{n}"' in page
    for key in ALL_FIGURES:
        assert page.count(f'id="fig-{key}"') == 1, key
    assert 'id="fig-closed_loop"' not in page
    assert "No closed-loop results: no closed_loop_summary.parquet" in page
    run = json.loads((run_dir / "run.json").read_text())
    for info in run["trace"]["files"].values():
        assert info["sha256"] in page
    assert "Pressure bound: p99 waiting at the chosen worker" in page
    assert "This run has one dp_size (2)" in page
    assert "Highest decision-time hit rate under the bound" in page and "Best under" not in page


def test_no_decisions_run_shows_note(trace_dir, tmp_path):
    out = tmp_path / "nd"
    run_sweep(trace_dir, GRID, out=out, decisions=False)
    page = (out / "report.html").read_text()
    assert "--no-decisions</code>, so per-request labels over time are not available" in page
    assert 'id="fig-over_time"' not in page
    assert set(figures(out)) == ALL_FIGURES - {"over_time"}


def test_other_knobs_vary_default_slice(trace_dir, tmp_path):
    out = tmp_path / "k"
    run_sweep(trace_dir, {**GRID, "min_load_choices": "2,3"}, out=out)
    page = (out / "report.html").read_text()
    assert "Other knobs vary in this grid (--min-load-choices)" in page
    assert "slice --min-load-choices 2 (the router&#x27;s defaults)" in page
    heat = figures(out)["heatmaps"].data[0]
    s = pl.read_parquet(out / "summary.parquet")
    cfg = s.filter((pl.col("worker_queue_limit") == 8) & (pl.col("saturation_queue_floor") == 1)
                   & (pl.col("min_load_choices") == 2)).row(0, named=True)
    assert heat.z[3][1] == pytest.approx(cfg["hit_rate"])


def test_per_dp_rank_floor_vs_dp(trace_dir, tmp_path):
    out = tmp_path / "pr"
    run_sweep(trace_dir, {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"},
              out=out, per_dp_rank=True)
    figs = figures(out)
    lines = [t for t in figs["floor_vs_dp"].data if t.showlegend]
    assert {t.name for t in lines} == {"dp 2 · limit 4 (2/rank)", "dp 2 · limit 8 (4/rank)"}
    lim8 = next(t for t in lines if "limit 8" in t.name)
    assert list(lim8.x) == [1, 2]  # per-rank floors
    s = pl.read_parquet(out / "summary.parquet").filter(pl.col("worker_queue_limit") == 8).sort("per_rank_floor")
    assert list(lim8.y) == pytest.approx(s.drop_nulls("per_rank_floor")["hit_rate"].to_list())
    assert "8 (4/rank)" in figs["heatmaps"].data[0].y


def test_closed_loop_section(run_dir, tmp_path):
    """A closed-loop table shaped like the simulator's (knob columns, its own config ids, true hit
    rate, TTFT) is matched to this run's configs by knob values."""
    copy = tmp_path / "cl"
    shutil.copytree(run_dir, copy)
    s = pl.read_parquet(copy / "summary.parquet")
    knobs = [c for c in s.columns[:s.columns.index("requests")] if c != "config_id"]
    sub = s.filter(pl.col("worker_queue_limit").is_null() | (pl.col("worker_queue_limit") == 8))
    cl = sub.select(pl.int_range(pl.len()).alias("config_id"), *knobs,
                    (pl.col("hit_rate") * 0.9).alias("true_hit_rate"),
                    pl.lit(120.0).alias("ttft_ms_p50"), pl.lit(900.0).alias("ttft_ms_p99"))
    # built from Python rows, as the simulator does: all-None knob columns come out typed Null
    cl = pl.DataFrame(cl.to_dicts())
    assert cl.schema["pressure_abs_threshold_ms"] == pl.Null
    cl.write_parquet(copy / "closed_loop_summary.parquet")
    res = invoke("report", copy, "--out", copy / "with_cl.html")
    assert res.exit_code == 0, res.output
    page = (copy / "with_cl.html").read_text()
    assert 'id="fig-closed_loop"' in page and "6 of 6 configs matched to this run on the knob values" in page
    assert "<th>served hit rate</th><th>open loop: decision-time hit rate</th>" in page
    fig = figures(copy)["closed_loop"]
    assert [t.name for t in fig.data] == ["closed loop: served hit rate", "open-loop estimate (this run)",
                                          "TTFT p50 (s)", "TTFT p99 (s)"]
    assert list(fig.data[3].y) == pytest.approx([0.9] * 6)   # drawn in seconds
    assert list(fig.data[0].x) == ["none/none", "8/none", "8/1", "8/2", "8/3", "8/4"]
    assert list(fig.data[1].y) == pytest.approx(sub["hit_rate"].to_list())
    assert list(fig.data[0].y) == pytest.approx((sub["hit_rate"] * 0.9).to_list())


# ---------------------------------------------------------------------------
# the report command


def test_report_command_errors(run_dir, trace_dir, tmp_path):
    one_line_error(invoke("report", tmp_path / "missing"), "no such run directory")  # one reader, one message
    one_line_error(invoke("report", trace_dir), "not a run directory")
    f = tmp_path / "file.txt"
    f.write_text("x")
    one_line_error(invoke("report", f), "not a directory")
    one_line_error(invoke("report", run_dir, "--out", tmp_path / "nodir" / "r.html"), "directory not found")
    one_line_error(invoke("report", run_dir, "--out", tmp_path / "x.html", "--config", 999),
                   "--config 999: no such config_id")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.json").write_text("{not json")
    (bad / "summary.parquet").write_text("nope")
    one_line_error(invoke("report", bad), "unreadable run record")
    (bad / "run.json").write_text(json.dumps({"tool": "router-replay"}))
    one_line_error(invoke("report", bad), "summary.parquet: unreadable Parquet")
    assert not (tmp_path / "x.html").exists()
    assert sorted(os.listdir(tmp_path)) == ["bad", "file.txt"]


def test_report_command_leaves_run_untouched(run_dir, tmp_path):
    before = tree_digest(run_dir)
    out = tmp_path / "r.html"
    res = invoke("report", run_dir, "--out", out, "--max-p99-waiting", 5)
    assert res.exit_code == 0, res.output
    assert tree_digest(run_dir) == before
    assert "p99 waiting at the chosen worker ≤ 5 (given)" in out.read_text()
    # an existing output needs --force, and --force replaces it in place
    one_line_error(invoke("report", run_dir, "--out", out), "exists")
    os.utime(out, (0, 0))
    res = invoke("report", run_dir, "--out", out, "--force", "--config", 0, "-q")
    assert res.exit_code == 0 and res.output == ""
    assert out.stat().st_mtime > 0 and "Showing config 0 (given)" in out.read_text()
    assert sorted(os.listdir(tmp_path)) == ["r.html"]


def test_report_help_has_example():
    res = invoke("report", "--help")
    assert res.exit_code == 0 and "router-replay report reports/sample" in res.output


# ---------------------------------------------------------------------------
# a real browser


NO_BROWSER = ("NO BROWSER: chromium is not on PATH, so report.html was not rendered in a browser; "
              "run .ci/browser (Debian's chromium) to bring it")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars"]


def _run_chromium(exe: str, url: str, *extra: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as prof:
        return subprocess.run([exe, *CHROME_FLAGS, f"--user-data-dir={prof}", "--enable-logging=stderr",
                               "--v=0", "--virtual-time-budget=20000", *extra, url],
                              capture_output=True, text=True, timeout=180)


def _console_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_report_renders_in_chromium(run_dir):
    exe = _chromium()
    if exe is None:
        pytest.skip(NO_BROWSER)
    url = (run_dir / "report.html").resolve().as_uri()
    dom = _run_chromium(exe, url, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console_messages(dom.stderr) == []  # the page logs nothing: no errors, no warnings
    html = dom.stdout
    assert "data-report-errors" not in html.split(">", 2)[1]
    for key in ALL_FIGURES:
        m = re.search(rf'<div id="fig-{key}"[^>]*class="[^"]*js-plotly-plot', html)
        assert m, f"figure {key} was not drawn by plotly.js"
        start = m.start()
        nxt = html.find('<div class="fig">', start)
        chunk = html[start:nxt if nxt > 0 else len(html)]
        assert 'class="main-svg"' in chunk, key
    heat = html[html.find('id="fig-heatmaps"'):html.find('id="fig-decision_mix"')]
    assert "heatmaplayer" in heat
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report.png"
    shot.unlink(missing_ok=True)
    res = _run_chromium(exe, url, f"--screenshot={shot}", "--window-size=1400,4000")
    assert res.returncode == 0, res.stderr[-2000:]
    assert _console_messages(res.stderr) == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 4000)
    assert len(data) > 100_000  # not a blank page


# Run inside the page once plotly.js has drawn it: every floor and limit line of the over-time
# figure is made visible, then its x values, its axis type and the drawn path are read back.
LINE_PROBE = """<script>
window.addEventListener("load", function () { setTimeout(function () {
  var gd = document.getElementById("fig-over_time"), idx = [];
  gd._fullData.forEach(function (t, i) { if (/^(floor|limit) /.test(t.name)) idx.push(i); });
  Plotly.restyle(gd, {visible: true}, idx).then(function () {
    var out = idx.map(function (i) {
      var t = gd._fullData[i], ax = gd._fullLayout[t.xaxis.replace("x", "xaxis")];
      var g = gd.querySelector(".scatterlayer .trace" + t.uid), path = g && g.querySelector("path.js-line");
      return {name: t.name, x: Array.from(t.x).map(String), axis: ax.type,
              d: path ? path.getAttribute("d") : null};
    });
    document.body.setAttribute("data-probe", JSON.stringify(out));
  });
}, 500); });
</script>"""


# the report command with orjson refused at import: the page's JSON then comes from plotly's own encoder
WITHOUT_ORJSON = (
    "import sys, importlib.abc\n"
    "class Refuse(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] == 'orjson':\n"
    "            raise ImportError('orjson refused')\n"
    "sys.meta_path.insert(0, Refuse())\n"
    "from replay.cli import main\n"
    "sys.argv = ['router-replay'] + sys.argv[1:]\n"
    "main()\n")


@pytest.mark.parametrize("encoder", ["orjson", "plotly"])
def test_over_time_floor_and_limit_lines_are_drawn(run_dir, tmp_path, encoder):
    """The floor and limit lines of the over-time chart are drawn on its date axis: their x values
    are dates (not raw nanosecond integers, which a date axis reads far from the data) and each has
    a path across the chart; with the page's JSON written by orjson and by plotly's own encoder
    (what the page falls back to without orjson)."""
    exe = _chromium()
    if exe is None:
        pytest.skip(NO_BROWSER)
    if encoder == "orjson":
        page = (run_dir / "report.html").read_text(encoding="utf-8")
    else:
        out = tmp_path / "plotly-encoded.html"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        res = subprocess.run([sys.executable, "-c", WITHOUT_ORJSON, "report", str(run_dir), "--out", str(out), "-q"],
                             capture_output=True, text=True, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        page = out.read_text(encoding="utf-8")
    probe = tmp_path / "report.html"
    probe.write_text(page.replace("</body>", LINE_PROBE + "</body>"), encoding="utf-8")
    dom = _run_chromium(exe, probe.resolve().as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<body[^>]*data-probe="([^"]*)"', dom.stdout)
    assert m, "the probe did not run: " + dom.stderr[-2000:]
    lines = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    names = {ln["name"].split()[0] for ln in lines}
    assert names == {"floor", "limit"}, lines
    for ln in lines:
        assert ln["axis"] == "date", ln
        assert len(ln["x"]) == 2 and all(re.match(r"\d{4}-\d\d-\d\d", x) for x in ln["x"]), ln
        xs = [float(v) for v in re.findall(r"[ML]\s*(-?[\d.]+)", ln["d"] or "")]
        assert len(xs) >= 2 and max(xs) - min(xs) > 100, ln   # a line across the chart, in pixels


def test_console_check_catches_errors(tmp_path):
    """The browser check itself fails on a broken page (so a pass above means something)."""
    exe = _chromium()
    if exe is None:
        pytest.skip(NO_BROWSER)
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><head><script>window.addEventListener("error",function(e){'
                   'document.documentElement.setAttribute("data-report-errors","1")});</script></head>'
                   '<body><div id="fig-x"></div><script>console.error("boom"); notDefined();</script></body></html>')
    res = _run_chromium(exe, bad.resolve().as_uri(), "--dump-dom")
    msgs = _console_messages(res.stderr)
    assert any("boom" in m for m in msgs) and any("notDefined" in m for m in msgs)
    assert 'data-report-errors="1"' in res.stdout


# ---------------------------------------------------------------------------
# over time, streamed: fleet.parquet and the decisions are request-sized (hundreds of
# millions of rows on a long trace) and are never read whole


def _over_time_reference(run_dir: Path, floors: dict) -> dict[int, list[dict]]:
    """The over-time numbers by brute force: every table read whole, one dict entry per request."""
    import statistics
    from collections import defaultdict

    from replay.labels import DECISIONS
    from replay.report.run_page import _nice_interval_ns
    from replay.sweep.run import decision_files

    fl = pl.read_parquet(run_dir / "fleet.parquet")
    assert fl["request_id"].is_unique().all()
    ts = fl["ts"].to_list()
    t0 = min(ts)
    step = _nice_interval_ns(max(max(ts) - t0, 1))
    req = {rid: ((t - t0) // step, w)
           for rid, t, w in zip(fl["request_id"].to_list(), ts, fl["fleet_min_waiting"].to_list(), strict=True)}
    per = {c: defaultdict(list) for c in floors}
    for f in decision_files(run_dir):
        dec = pl.read_parquet(f, columns=["request_id", "config_id", "decision", "policy_reason", "gate_rejected"])
        for rid, cid, d, p, g in dec.iter_rows():
            if cid in per:
                b, w = req[rid]
                per[cid][b].append((d, p, g, w))
    out = {}
    for cid, by_bin in per.items():
        floor, rows = floors[cid], []
        for b in sorted(by_bin):
            xs = by_bin[b]
            known = [x[3] for x in xs if x[3] is not None]
            rows.append({
                "bin": b, "requests": len(xs), **{d: sum(x[0] == d for x in xs) for d in DECISIONS},
                "failed": sum(x[0] is None for x in xs),
                "pinned": sum(x[1] == "saturation_pin" for x in xs),
                "gate_rejected": sum(x[2] > 0 for x in xs),
                "fleet_min_p50": float(statistics.median(known)) if known else None,
                "fleet_min_min": min(known, default=None), "fleet_min_max": max(known, default=None),
                "reading_at_or_above_floor": (None if floor is None else
                                              sum(x[3] is None or x[3] >= floor for x in xs)),
                "t_ns": b * step + t0 + step // 2, "interval_ns": step})
        out[cid] = rows
    return out


def _check_over_time(run_dir: Path, monkeypatch, *, batch: int | None = None, joins: int = 0) -> None:
    """Every config's over-time frame equals the brute-force numbers; ``joins``: how many
    config groups must take the join on request_id (0: all matched by position)."""
    from replay.report import run_page as report
    from replay.report.run_page import ReportView, over_time_frames

    calls = []
    joined = report._joined_counts
    monkeypatch.setattr(report, "_joined_counts", lambda *a, **k: calls.append(1) or joined(*a, **k))
    if batch is not None:
        monkeypatch.setattr(report, "BATCH", batch)
    a = ReportView(load_run(run_dir))
    ids = sorted(a.rows)
    want = _over_time_reference(run_dir, {c: a.rows[c]["saturation_queue_floor"] for c in ids})
    frames = over_time_frames(a, ids)
    for c in ids:
        assert frames[c].to_dicts() == want[c], c
    assert sum(r["requests"] for r in want[ids[0]]) == pl.scan_parquet(run_dir / "fleet.parquet").select(
        pl.len()).collect().item()
    assert len(calls) == joins


@pytest.mark.parametrize("batch", [None, 97])
def test_over_time_equals_in_memory_reference(run_dir, monkeypatch, batch):
    """Per interval and config, every count and fleet reading of the over-time figure equals a
    brute-force computation from the whole tables (97-row slices: requests split across slices)."""
    _check_over_time(run_dir, monkeypatch, batch=batch)


def test_over_time_reads_nothing_request_sized(run_dir, monkeypatch):
    """No frame as large as the fleet table is ever materialized for the over-time figure: every
    collect returns at most a slice or a per-interval table, and nothing is read whole."""
    from replay.report import run_page as report
    from replay.report.run_page import ReportView, over_time_frames

    n = pl.read_parquet(run_dir / "fleet.parquet").height
    heights = []
    collect = pl.LazyFrame.collect

    def spy(self, *args, **kw):
        out = collect(self, *args, **kw)
        heights.append(out.height)
        return out

    def no_read(*args, **kw):
        raise AssertionError("read_parquet: a whole table read")

    data = load_run(run_dir)
    assert isinstance(data.fleet, pl.LazyFrame)
    a = ReportView(data)
    monkeypatch.setattr(report, "BATCH", 97)
    monkeypatch.setattr(pl.LazyFrame, "collect", spy)
    monkeypatch.setattr(pl, "read_parquet", no_read)
    frames = over_time_frames(a, sorted(a.rows))
    assert sum(frames[min(a.rows)]["requests"]) == n == 2000
    assert heights and max(heights) < n / 4, max(heights)


def test_over_time_out_of_order_decisions(run_dir, tmp_path, monkeypatch):
    """Decisions not in the fleet's order are joined on request_id instead, to the same numbers."""
    copy = tmp_path / "shuffled"
    shutil.copytree(run_dir, copy)
    dec = pl.read_parquet(copy / "decisions.parquet")
    dec.sample(fraction=1.0, shuffle=True, seed=3).write_parquet(copy / "decisions.parquet")
    _check_over_time(copy, monkeypatch, joins=1)


def test_over_time_from_a_collected_fleet(run_dir):
    """load_run scans fleet.parquet lazily; a RunData holding the table itself (a notebook's
    DataFrame) draws the same over-time figure."""
    from dataclasses import replace

    data = load_run(run_dir)
    assert isinstance(data.fleet, pl.LazyFrame)
    eager = replace(data, fleet=data.fleet.collect())
    assert isinstance(eager.fleet, pl.DataFrame)
    assert figures(eager)["over_time"].to_json() == figures(data)["over_time"].to_json()


def test_fleet_bins_median_equals_polars():
    """The per-interval median, min and max come from counts per reading; they equal polars'
    own on the rows (odd and even counts, nulls, intervals without a known reading)."""
    from replay.report.run_page import fleet_bins

    rng = np.random.default_rng(7)
    n = 5000
    w = rng.integers(0, 9, n)
    ts = np.sort(rng.integers(0, 600 * 10**9, n))
    df = pl.DataFrame({"request_id": [f"r{i}" for i in range(n)], "ts": ts,
                       "fleet_min_waiting": pl.Series(np.where(rng.random(n) < 0.2, None, w).tolist(),
                                                      dtype=pl.Int64)})
    df = df.with_columns(pl.when((pl.col("ts") // 10**11) == 3).then(None)
                         .otherwise(pl.col("fleet_min_waiting")).alias("fleet_min_waiting"))
    bins = fleet_bins(df)
    want = (df.group_by(((pl.col("ts") - int(ts.min())) // bins.step).alias("bin"))
            .agg(pl.col("fleet_min_waiting").median().alias("fleet_min_p50"),
                 pl.col("fleet_min_waiting").min().alias("fleet_min_min"),
                 pl.col("fleet_min_waiting").max().alias("fleet_min_max")).sort("bin"))
    from polars.testing import assert_frame_equal

    assert_frame_equal(bins.stats, want)
    assert bins.stats["fleet_min_p50"].null_count() >= 1 and bins.rows == n
    assert fleet_bins(df.head(0)) is None


def test_unreadable_fleet_is_one_line_error(run_dir, tmp_path):
    copy = tmp_path / "badfleet"
    shutil.copytree(run_dir, copy)
    (copy / "fleet.parquet").write_text("not parquet")
    one_line_error(invoke("report", copy, "--out", tmp_path / "r.html"), "fleet.parquet: unreadable Parquet")


# a trace set (requests/ and loads/ partitions) replayed window by window, and on Ray

SET_GRID = {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"}


@pytest.fixture(scope="module")
def set_dir(tmp_path_factory):
    from replay.trace.synthetic import generate_trace_set

    d = tmp_path_factory.mktemp("rep_set") / "set"
    generate_trace_set(d, n_requests=2000, n_workers=6, dp_size=2, rate_per_s=40.0, partition_s=20)
    return d


@pytest.mark.parametrize("batch", [None, 61])
def test_over_time_windowed_run(set_dir, tmp_path, monkeypatch, batch):
    """A trace set swept in 5 s windows: one decisions.parquet and a fleet.parquet written window
    by window; the page has the over-time figure and its numbers equal the brute force."""
    import pyarrow.parquet as pq

    out = tmp_path / "run"
    run_sweep(set_dir, SET_GRID, out=out, executor="local", window="5s")
    run = json.loads((out / "run.json").read_text())
    assert run["decisions"] == "decisions.parquet"
    assert pq.ParquetFile(out / "fleet.parquet").metadata.num_row_groups > 1  # one per window
    assert 'id="fig-over_time"' in (out / "report.html").read_text()
    _check_over_time(out, monkeypatch, batch=batch)


def test_over_time_ray_decision_files(set_dir, tmp_path, monkeypatch):
    """A Ray run: one decisions file per (window, block of configs); the configs are streamed per
    block, each beside the fleet's rows, to the brute-force numbers."""
    pytest.importorskip("ray")
    from replay.report import run_page as report

    out = tmp_path / "run"
    run_sweep(set_dir, SET_GRID, out=out, executor="ray", window="10s", configs_per_task=3)
    listed = json.loads((out / "run.json").read_text())["decisions"]
    assert isinstance(listed, list) and len(listed) > 3
    assert 'id="fig-over_time"' in (out / "report.html").read_text()
    data = load_run(out)
    ids = pl.read_parquet(out / "summary.parquet")["config_id"].to_list()
    groups = report._file_groups(data.decisions, ids)
    assert len(groups) == 3 and sorted(c for _f, cs in groups for c in cs) == sorted(ids)
    assert all(len(files) == len(listed) // 3 for files, _cs in groups)
    _check_over_time(out, monkeypatch)
    _check_over_time(out, monkeypatch, batch=61)


@pytest.mark.parametrize("blocks,chunk", [(1, 1 << 20), (3, 97), (7, 1000)])
def test_kernel_fleet_readings_equal_the_snapshot_pass(gen_trace, blocks, chunk):
    """The grid kernel's per-request fleet readings (what sweep writes to
    fleet.parquet) equal replay/sweep/readings.py's own snapshot pass, for any block
    and chunk layout, at two freshness windows."""
    from replay.config import RouterConfig
    from replay.sweep import engine
    from replay.sweep.readings import fleet_readings

    tr = load_trace(gen_trace)
    for fresh_ns in (5_000_000_000, 150_000_000):
        mins, fresh = [], []
        for ch in engine.iter_chunks(tr, [RouterConfig(worker_queue_limit=4)], keep=True,
                                     freshness_ns=fresh_ns, blocks=blocks, chunk_decisions=chunk):
            mins.append(ch.fleet_min)
            fresh.append(ch.fleet_fresh)
        got_min, got_fresh = engine.chunk_readings(mins, fresh)
        want_min, want_fresh = fleet_readings(tr, fresh_ns)
        np.testing.assert_array_equal(got_min, want_min)
        np.testing.assert_array_equal(got_fresh, want_fresh)
        assert (want_min < 0).any() and (want_min > 0).any()   # both cases occur
