"""What the closed-loop answer and the waterfall add to a report.

A 300,000-request generated trace swept over 12 configs with decisions (3.6 M
decision rows): the drill-down query and the waterfall figures timed alone,
then the whole report page; the trace's identity (sha256 of its files, what
``simulate`` records so the report can find its grid) is timed alone.
"""

from __future__ import annotations

import time

import pytest

N_REQUESTS = 300_000


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    from replay import run_sweep
    from replay.config import Grid
    from replay.trace.synthetic import generate_trace

    d = tmp_path_factory.mktemp("cl-bench")
    generate_trace(d / "trace", n_requests=N_REQUESTS, n_workers=16, dp_size=2, seed=3)
    grid = Grid.from_texts({"--worker-queue-limit": "none,2,4,8", "--saturation-queue-floor": "none,1,2,4"})
    run_sweep(d / "trace", grid, out=d / "run", report=False)
    return d


def test_report_with_waterfall(benchmark, report, big_run):
    from replay.analysis import waterfall as wf
    from replay.report import run_page as rep
    from replay.report import sections as rs
    from replay.runs.rundir import load_run

    benchmark.group = "closed-loop-report"
    run = load_run(big_run / "run")
    view = rep.ReportView(run)
    t0 = time.perf_counter()
    wf.drilldown(run.decisions, view.chosen["config_id"])
    drill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rs.waterfall_figures(view)
    figs_s = time.perf_counter() - t0
    page = benchmark.pedantic(rep.render_html, args=(big_run / "run",), rounds=1, iterations=1)
    report(requests=N_REQUESTS, configs=run.summary.height, drilldown_s=round(drill_s, 3),
           waterfall_figures_s=round(figs_s, 3), page_bytes=len(page))


def test_trace_identity(benchmark, report, big_run):
    from replay.trace.files import log_identity

    benchmark.group = "closed-loop-report"
    ident = benchmark.pedantic(log_identity, args=(big_run / "trace",), rounds=1, iterations=1)
    report(files=len(ident["files"]), bytes=sum(f["bytes"] for f in ident["files"].values()))
