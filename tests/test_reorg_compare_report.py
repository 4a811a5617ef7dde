"""A legacy run against a reorg run of the same trace (``compare``), and one report page
for a grid holding both engines: the real CLI on the bundled sample trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import polars as pl
import pytest
from test_closed_loop_answer import run

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "traces" / "sample"
GRID = ["--worker-queue-limit", "none,4", "--saturation-queue-floor", "none,2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("engines")
    run("sweep", SAMPLE, "--out", d / "legacy", *GRID, "-q")
    run("sweep", SAMPLE, "--out", d / "reorg", *GRID, "--chat-routing", "reorg", "-q")
    run("sweep", SAMPLE, "--out", d / "both", *GRID, "--chat-routing", "legacy,reorg", "-q")
    return d


def test_compare_a_legacy_run_with_a_reorg_run(runs, tmp_path):
    text = run("compare", runs / "legacy", runs / "reorg", "--out", tmp_path / "cmp").output
    assert "matched by the knobs both engines share (A routes with legacy, B with reorg" in text
    deltas = pl.read_parquet(tmp_path / "cmp" / "deltas.parquet")
    assert deltas["config_id_a"].n_unique() == 3   # none/none, 4/none, 4/2 in both runs
    win = deltas.filter(pl.col("metric") == "share_reorg_cache_win")
    assert (win["a"] == 0).all() and (win["b"] > 0).all()
    hit = deltas.filter(pl.col("metric") == "share_cache_hit")
    assert (hit["a"] > 0).all() and (hit["b"] == 0).all()
    assert {"hit_rate", "share_failed", "selected_waiting_p99"} <= set(deltas["metric"])
    # the requests whose worker changed, each with both engines' labels
    changed = pl.read_parquet(tmp_path / "cmp" / "changed_requests.parquet")
    moved = changed.filter(pl.col("worker_changed"))
    assert moved.height > 0
    assert moved["label_b"].str.starts_with("reorg:").all()
    assert set(moved["label_a"]) <= {"cache_hit", "cache_miss", "cache_worker_queued", "all_queued"}
    # the sums agree with the two runs' own decisions
    a = pl.read_parquet(runs / "legacy" / "decisions.parquet")
    b = pl.read_parquet(runs / "reorg" / "decisions.parquet")
    ids = json.loads((runs / "legacy" / "run.json").read_text())["grid"]["config_ids"]
    ca, cb = ids[0], json.loads((runs / "reorg" / "run.json").read_text())["grid"]["config_ids"][0]
    j = a.filter(pl.col("config_id") == ca).join(b.filter(pl.col("config_id") == cb), on="request_id")
    n_moved = j.filter(pl.col("worker").ne_missing(pl.col("worker_right"))).height
    assert moved.filter(pl.col("config_id_a") == ca).height == n_moved


def test_one_report_page_shows_both_engines(runs):
    out = runs / "both.html"
    run("report", runs / "both", "--out", out, "--force")
    page = out.read_text()
    assert "reorg cache_win (ours)" in page
    # the decision-mix figure: the same slice under each engine, side by side
    labels = [json.loads(f'"{m}"') for m in re.findall(r'"((?:legacy|reorg) [^"]*)"', page)]
    assert {"legacy none/none", "reorg none/none", "reorg 4/2"} <= set(labels), labels[:10]


def test_the_waterfall_pair_draws_the_other_engine(runs):
    from replay.report import run_page

    figs = run_page.figure_dicts(runs / "both")
    ids = [int(str(t.get("name")).removeprefix("config ")) for t in figs["waterfall_pair"]["data"]]
    s = pl.read_parquet(runs / "both" / "summary.parquet").filter(pl.col("config_id").is_in(ids))
    assert sorted(s["chat_routing"]) == ["legacy", "reorg"], ids
    assert s["worker_queue_limit"].n_unique() == 1 and s["saturation_queue_floor"].n_unique() == 1
