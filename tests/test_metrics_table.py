"""One metrics table (replay/runs/metrics.py) read by report, compare, check and
recommend; check --help's list comes from it; the shares have one name and denominator."""

from __future__ import annotations

import json
import re

import polars as pl
import pytest
from click.testing import CliRunner

from replay import run_sweep
from replay.analysis import runs as analysis
from replay.cli import main
from replay.report.run_page import HEATMAP_METRICS, HOVER_METRICS, figures
from replay.runs import metrics
from replay.runs.rundir import load_run

# every metric name a baseline written by router-replay before the table existed could store
# (the check --help list of that version)
OLD_BASELINE_NAMES = (
    "hit_rate", "matched_rate", "owner_rate", "share_cache_hit", "share_cache_miss",
    "share_cache_worker_queued", "share_all_queued", "share_failed", "pinned_share", "diverted_share",
    "pinned", "diverted", "selected_waiting_p50", "selected_waiting_p99", "selected_waiting_mean",
    "selected_queue_ms_mean", "cold_prefill_tokens", "agreement",
)


@pytest.fixture(scope="module")
def failing_run(models_trace, tmp_path_factory):
    """A run whose model-c requests fail under every config (no fleet worker), so routed < requests."""
    out = tmp_path_factory.mktemp("m") / "run"
    run_sweep(models_trace, {"worker_queue_limit": "none,1,2", "saturation_queue_floor": "none,1"}, out=out)
    return out


def test_check_help_lists_the_tables_checkable_metrics():
    res = CliRunner().invoke(main, ["check", "--help"])
    assert res.exit_code == 0
    text = " ".join(res.stdout.split())
    listed = re.search(r"Metrics: (.*?)\. Exit codes", text).group(1).split(", ")
    assert listed == list(metrics.CHECKED)
    assert all(n in metrics.METRICS for n in listed)


def test_every_name_an_old_baseline_stores_is_in_the_table():
    for n in OLD_BASELINE_NAMES:
        assert metrics.metric(n).name == n
    assert set(metrics.DEFAULT_CHECK_METRICS) <= set(OLD_BASELINE_NAMES)
    # the report's former names resolve to the one metric each
    assert metrics.metric("pin_share").name == "pinned_share"
    assert metrics.metric("all_queued_share").name == "share_all_queued"
    assert metrics.metric("failed_share").name == "share_failed"
    with pytest.raises(Exception, match="unknown metric 'pin_shares'"):
        metrics.metric("pin_shares")


def test_label_shares_and_failed_share_partition_the_requests(failing_run):
    s = pl.read_parquet(failing_run / "summary.parquet")
    assert (s["failed"] > 0).all() and (s["routed"] < s["requests"]).all()
    t = load_run(failing_run).metrics([*metrics.LABEL_SHARES, "share_failed", "pinned_share"])
    total = t.select(sum(pl.col(n) for n in (*metrics.LABEL_SHARES, "share_failed"))).to_series()
    assert total.to_list() == pytest.approx([1.0] * t.height)
    joined = t.join(s, on="config_id")
    for r in joined.iter_rows(named=True):
        assert r["share_all_queued"] == pytest.approx(r["all_queued"] / r["requests"])
        assert r["pinned_share"] == (pytest.approx(r["pinned"] / r["routed"]) if r["routed"] else None)


def test_the_report_and_compare_show_the_same_share(failing_run, tmp_path):
    """The report's all_queued heatmap and compare's share read one definition (over requests;
    the report used to divide by routed requests)."""
    heat = figures(failing_run)["heatmaps"]
    names = [m.name for m in HEATMAP_METRICS]
    cells = heat.data[names.index("share_all_queued")]
    s = pl.read_parquet(failing_run / "summary.parquet")
    cfg = s.filter(pl.col("worker_queue_limit") == 2).filter(pl.col("saturation_queue_floor") == 1).row(
        0, named=True)
    limits = list(cells.y)
    floors = list(cells.x)
    assert cells.z[limits.index("2")][floors.index("1")] == pytest.approx(cfg["all_queued"] / cfg["requests"])
    cmp = analysis.compare_runs(failing_run, failing_run)
    row = cmp.deltas.filter((pl.col("metric") == "share_all_queued") & (pl.col("config_id_a") == cfg["config_id"]))
    assert row["a"][0] == pytest.approx(cfg["all_queued"] / cfg["requests"])
    assert {m.name for m in HOVER_METRICS} <= set(metrics.METRICS)


def test_a_baseline_of_the_old_names_checks_a_new_run(failing_run, tmp_path):
    """A baseline file as the version before the table wrote it (same names and format) loads
    and passes against the run it came from."""
    base = tmp_path / "b.json"
    res = CliRunner().invoke(main, ["check", str(failing_run), "--write-baseline", str(base),
                                    *[f"--metric={m}" for m in ("hit_rate", "share_all_queued", "pinned_share",
                                                                 "share_failed", "diverted")]])
    assert res.exit_code == 0, res.output
    rec = json.loads(base.read_text())
    assert rec["metrics"] == ["hit_rate", "share_all_queued", "pinned_share", "share_failed", "diverted"]
    res = CliRunner().invoke(main, ["check", str(failing_run), "--baseline", str(base)])
    assert res.exit_code == 0 and "PASS" in res.stdout
    # and a stored value moved the bad way beyond its tolerance fails: the table's direction is used
    rec["configs"][0]["metrics"]["share_failed"] = max(0.0, rec["configs"][0]["metrics"]["share_failed"] - 0.01)
    base.write_text(json.dumps(rec))
    res = CliRunner().invoke(main, ["check", str(failing_run), "--baseline", str(base)])
    assert res.exit_code == 1 and "share_failed" in res.stdout


def test_every_row_of_the_table_is_complete():
    for m in metrics.METRICS.values():
        assert (m.column is None) != (m.share is None), m.name
        assert m.kind in ("rate", "count", "value") and m.better in ("higher", "lower", "neither"), m.name
        assert m.fmt in ("pct", "int", "f2", "si") and m.label and m.description, m.name
        assert analysis.parse_tolerance(m.name, m.default_tolerance).text == m.default_tolerance
        assert (m.kind == "rate") == (m.fmt == "pct"), m.name
    for old, new in metrics.ALIASES.items():
        assert old not in metrics.METRICS and new in metrics.METRICS
