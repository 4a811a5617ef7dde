"""``check``'s default gate catches a changed decision, on the bundled sample.

The fault is real: a copy of the package (kernel and reference) with the
pin's floor comparison made off by one (``fmin <= floor`` instead of ``<``),
run as its own process on the bundled sample, against a baseline written from
a run of the real package.  The expected counts are recomputed here from both
runs' decisions files with polars.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

import replay
from replay import run_sweep
from replay.cli import main

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "traces" / "sample"
GRID = {"worker_queue_limit": "none,2,4,8", "saturation_queue_floor": "none,1..4"}
ARGS = ["--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1..4"]

# the off-by-one, in the grid kernel, the per-request kernel and the reference
OFF_BY_ONE = (("kernels/one_pass.py", "2 if fmin < fl else 1", "2 if fmin <= fl else 1"),
              ("kernels/decide.py", "snap[w, wcol] < floor", "snap[w, wcol] <= floor"),
              ("reference.py", "b.waiting < threshold_for(floor, b)", "b.waiting <= threshold_for(floor, b)"))

_RUN_COPY = """
import sys
sys.path.insert(0, sys.argv[1])
import replay
assert replay.__file__.startswith(sys.argv[1]), replay.__file__
from replay.cli import main
main(sys.argv[2:])
"""


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    run_sweep(replay.load_trace(SAMPLE), GRID, out=root / "good", report=False)
    copy = root / "copy"
    shutil.copytree(Path(replay.__file__).parent, copy / "replay",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for rel, old, new in OFF_BY_ONE:
        f = copy / "replay" / rel
        text = f.read_text()
        assert text.count(old) == 1, (rel, old)
        f.write_text(text.replace(old, new))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(root / "numba")}
    p = subprocess.run([sys.executable, "-c", _RUN_COPY, str(copy), "sweep", str(SAMPLE), "--out",
                        str(root / "bug"), "--no-report", *ARGS], capture_output=True, text=True, env=env,
                       cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    # a fresh numba cache: the first run says it compiles
    assert "compiling kernels (first run, about 20 s" in p.stderr, p.stderr[-2000:]
    res = invoke("check", root / "good", "--write-baseline", root / "base.json")
    assert res.exit_code == 0, res.output
    return root


def _pins(run: Path) -> pl.DataFrame:
    d = pl.read_parquet(run / "decisions.parquet", columns=["request_id", "config_id", "worker", "reason"])
    return d.with_columns((pl.col("reason").cast(pl.Utf8) == "SaturationPin").fill_null(False).alias("pin"))


@pytest.mark.slow
def test_off_by_one_pin_fails_the_default_gate(runs):
    good, bug = _pins(runs / "good"), _pins(runs / "bug")
    j = good.join(bug, on=["config_id", "request_id"], suffix="_bug")
    assert j.height == good.height
    pins_good, pins_bug = int(good["pin"].sum()), int(bug["pin"].sum())
    assert pins_good != pins_bug, "the off-by-one should move pins on the sample"
    junit, md = runs / "check.xml", runs / "check.md"
    res = invoke("check", runs / "bug", "--baseline", runs / "base.json", "--junit", junit, "--markdown", md)
    assert res.exit_code == 1, res.output
    first = res.stdout.splitlines()[0]
    assert first.startswith("router-replay check: FAIL: ") and "changed decision" in first, first
    assert f"pins {pins_good:,} -> {pins_bug:,}" in res.stdout
    # the first changed request named is the first in trace order whose worker or pin moved
    changed = j.filter(pl.col("worker").ne_missing(pl.col("worker_bug")) | (pl.col("pin") != pl.col("pin_bug")))
    order = {r: i for i, r in enumerate(pl.read_parquet(SAMPLE / "requests.parquet")["request_id"].to_list())}
    first_id = min(changed["request_id"].to_list(), key=lambda r: order[r])
    assert f"request {first_id} " in res.stdout.split("first changed requests:")[1].splitlines()[1]
    # Markdown and JUnit carry it
    text = md.read_text()
    assert text.startswith("### router-replay check: FAIL") and "**Decisions:" in text
    suite = ET.parse(junit).getroot().find("testsuite")
    dec_fail = [tc for tc in suite.findall("testcase")
                if tc.get("name").endswith(":: decisions") and tc.find("failure") is not None]
    per_config = changed.group_by("config_id").len()
    assert len(dec_fail) >= per_config.height > 0
    # --json says the same
    res = invoke("check", runs / "bug", "--baseline", runs / "base.json", "--json")
    assert res.exit_code == 1
    rec = json.loads(res.stdout)
    assert rec["exit_code"] == 1 and rec["decisions"]["changed"] > 0
    assert rec["decisions"]["totals"]["pinned"] == {"baseline": pins_good, "run": pins_bug}


@pytest.mark.slow
def test_drift_allowed_leaves_it_to_the_tolerances(runs):
    res = invoke("check", runs / "bug", "--baseline", runs / "base.json", "--allow-decision-drift", "--verbose")
    md = res.stdout
    table = md[md.index("| config | metric |"):]
    regressions = [line for line in table.splitlines() if "**REGRESSION**" in line]
    assert res.exit_code == (1 if regressions else 0), md
    assert "allowed by --allow-decision-drift" in md
    # a zero hit-rate tolerance: the lost hits fail even with the drift allowed
    res = invoke("check", runs / "bug", "--baseline", runs / "base.json", "--allow-decision-drift",
                 "--max-hit-rate-drop", "0")
    assert res.exit_code == 1 and "hit_rate" in res.stdout


def test_report_rebuilds_its_own_page_without_force(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs / "good", run)
    res = invoke("report", run)
    assert res.exit_code == 0 and (run / "report.html").is_file(), res.output
    first = (run / "report.html").stat().st_mtime_ns
    res = invoke("report", run, "--max-p99-waiting", "8")
    assert res.exit_code == 0, res.output
    assert (run / "report.html").stat().st_mtime_ns > first
    # a file it did not write is still refused, and an --out elsewhere still needs --force
    (tmp_path / "other.html").write_text("<p>mine</p>")
    res = invoke("report", run, "--out", tmp_path / "other.html")
    assert res.exit_code == 2 and (tmp_path / "other.html").read_text() == "<p>mine</p>"
    (run / "report.html").write_text("<p>mine</p>")
    res = invoke("report", run)
    assert res.exit_code == 2 and "not a report written by router-replay" in res.output


@pytest.mark.slow
def test_identical_run_passes_in_one_line_and_settings_are_named_first(runs, tmp_path):
    res = invoke("check", runs / "good", "--baseline", runs / "base.json")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("\n") == 1 and res.stdout.startswith("router-replay check: PASS")
    assert "decisions identical (14 configs x 3,000 requests)" in res.stdout
    run_sweep(replay.load_trace(SAMPLE), GRID, out=tmp_path / "fresh", report=False, freshness_ms=200)
    res = invoke("check", tmp_path / "fresh", "--baseline", runs / "base.json")
    lines = res.stdout.splitlines()
    assert lines[2] == "replay settings differ from the baseline's run: freshness_ms 5000 -> 200", lines
