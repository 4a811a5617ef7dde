"""Closed-loop answers, open-loop labels, the waterfall drawn, new-user trips.

A "production" trace is simulated from a fleet whose parameters only the
fixture knows (drawn from a seeded generator); the code under test sees the
trace directory alone and goes the user's way: ``calibrate --validate`` (a
fidelity score and a closed-loop prediction grid), ``sweep`` (the open loop),
``recommend`` and ``report`` (rendered in a real headless Chromium).  Real
files, the real CLI, no mocks.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from replay import ParamsError, recommend_dir
from replay.cli import main
from replay.config import RouterConfig
from replay.simulate import FleetSpec, build_fleet, generate_log, simulate

PROD_CONFIG = RouterConfig(worker_queue_limit=4)
PROD_SEED = 7
LIMITS = "none,1,2,4,8"


def run(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == code, (r.exit_code, r.output, r.exception)
    return r


def _production(d: Path, seed: int, rate: float, **engine) -> Path:
    rng = np.random.default_rng(seed)
    per = {i: dict(prefill_tokens_per_s=float(rng.uniform(5500, 9500)),
                   decode_tokens_per_s=float(rng.uniform(30, 55)),
                   max_running_requests=int(rng.integers(8, 15)),
                   max_total_num_tokens=int(rng.integers(45_000, 70_000))) for i in range(4)}
    fleet = build_fleet(FleetSpec(workers=4, dp_size=2, publish_policy="on_change", **engine), per)
    simulate(generate_log(1500, seed=seed, rate_per_s=rate), fleet, PROD_CONFIG, d / "trace", seed=PROD_SEED)
    return d / "trace"


def _user_path(d: Path, trace: Path, *extra) -> str:
    """calibrate --validate with a prediction grid, then the open-loop sweep beside it."""
    r = run("calibrate", trace, "--out", d / "fleet.toml", "--validate", d / "fit", "--worker-queue-limit",
            LIMITS, "--seeds", "4", *extra)
    run("sweep", trace, "--out", d / "run", "--worker-queue-limit", LIMITS, "--seed", PROD_SEED, "-q")
    return r.output


def _scenario(factory, name: str, rate: float) -> Path:
    d = factory.mktemp(name)
    _user_path(d, _production(d, 101, rate))
    return d


@pytest.fixture(scope="module")
def saturated(tmp_path_factory):
    """A fleet near saturation: the seeds disagree for some configs."""
    return _scenario(tmp_path_factory, "sat", 20.0)


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """A lightly loaded fleet: every gate that never fires is the same config."""
    return _scenario(tmp_path_factory, "light", 2.0)


def _summary(d: Path) -> pl.DataFrame:
    return pl.read_parquet(d / "fit" / "prediction" / "closed_loop_summary.parquet")


def _seeds_disagree_on_answer(r: dict, bound_ms: float) -> bool:
    # a config whose seeds disagree stays in only when every seed meets the bound and the
    # seeds' served hit rates lie within 2 points of each other
    if r["stable"]:
        return False
    return not (r["ttft_ms_p99_max"] <= bound_ms and r["true_hit_rate_max"] - r["true_hit_rate_min"] <= 0.02)


def _independent_pick(s: pl.DataFrame, bound_ms: float) -> dict | None:
    rows = [r for r in s.iter_rows(named=True)
            if r["ttft_ms_p99_hi"] <= bound_ms and not _seeds_disagree_on_answer(r, bound_ms)]
    rows.sort(key=lambda r: (-r["true_hit_rate"], r["ttft_ms_p99"], r["config_id"]))
    return rows[0] if rows else None


def _limit_text(v) -> str:
    return "none" if v is None else str(v)


# ---------------------------------------------------------------------------
# recommend


def test_closed_loop_answer_differs_from_the_open_loop_pick(saturated):
    s = _summary(saturated)
    no_gate = s.filter(pl.col("worker_queue_limit").is_null()).row(0, named=True)
    # a bound the no-gate config's upper TTFT p99 misses by 1 ms
    bound = no_gate["ttft_ms_p99_hi"] - 1.0
    want = _independent_pick(s, bound)
    assert want is not None and want["worker_queue_limit"] is not None, s
    text = run("recommend", saturated / "fit", "--max-ttft-p99-ms", bound).output
    lines = text.splitlines()
    assert lines[0].startswith("model fidelity GOOD"), text
    assert f"recommended: limit={_limit_text(want['worker_queue_limit'])} " \
           f"(config {want['config_id']})" in text
    assert f"router flags: --worker-queue-limit {want['worker_queue_limit']}" in text
    assert "deploy per dp_size: dp_size 2 (4 workers)" in text
    unstable = sum(_seeds_disagree_on_answer(r, bound) for r in s.iter_rows(named=True))
    assert f"({unstable} unstable" in text
    # the report of the run gives the same answer first, and the open-loop headline the no-gate config
    out = saturated / "bound.html"
    run("report", saturated / "run", "--out", out, "--max-ttft-p99-ms", bound, "--force")
    page = out.read_text()
    s0 = _text(page[page.index('<section id="s0">'):page.index('<section id="s1">')])
    assert f"recommended: limit={want['worker_queue_limit']} (config {want['config_id']})" in s0
    s1 = _text(page[page.index('<section id="s1">'):page.index('<section id="s2">')])
    assert "Highest decision-time hit rate under the bound, on the recorded load: config 0 (limit none" in s1
    # the open loop ranks the no-gate config first, and says what that ranking is
    ol = run("recommend", saturated / "run", "--max-p99-waiting", 10**6).output
    assert "fleet: recommended limit=none" in ol
    flat = " ".join(ol.split())
    assert "open-loop estimate" in flat and "no-gate config ranks first by construction" in flat
    assert f"router-replay recommend {saturated / 'fit' / 'prediction'}" in flat


def test_closed_loop_json_and_flags_file(saturated, tmp_path):
    s = _summary(saturated)
    no_gate = s.filter(pl.col("worker_queue_limit").is_null()).row(0, named=True)
    bound = no_gate["ttft_ms_p99_hi"] - 1.0
    want = _independent_pick(s, bound)
    flags = tmp_path / "flags.sh"
    r = run("recommend", saturated / "fit", "--max-ttft-p99-ms", bound, "--json", "--emit-flags", flags)
    rec = json.loads(r.stdout)
    assert rec["fidelity"]["good"] is True and rec["bound"]["max_ms"] == bound
    assert rec["recommended"]["config_id"] == want["config_id"]
    v = rec["recommended"]["values"]["ttft_ms_p99"]
    assert v["mean_95_hi"] == pytest.approx(want["ttft_ms_p99_hi"]) and v["mean_95_hi"] <= bound
    assert rec["router_flags"].startswith(f"--worker-queue-limit {want['worker_queue_limit']}")
    assert rec["router_flags_per_dp_size"] == {"2": rec["router_flags"]}
    text = flags.read_text()
    assert f"ROUTER_FLAGS_DP2='{rec['router_flags']}'" in text.splitlines()


def test_two_best_within_their_intervals_are_said_to_be_indistinguishable(light):
    s = _summary(light)
    want = _independent_pick(s, 10**9)
    text = run("recommend", light / "fit" / "prediction", "--max-queue-wait-p99-ms", 10**9).output
    assert f"(config {want['config_id']})" in text
    rows = sorted((r for r in s.iter_rows(named=True) if r["stable"]),
                  key=lambda r: (-r["true_hit_rate"], r["ttft_ms_p99"], r["config_id"]))
    assert rows[1]["true_hit_rate_hi"] >= rows[0]["true_hit_rate_lo"]  # they overlap
    assert "NOT DISTINGUISHABLE from the next best within their 95% intervals" in text
    assert f"(config {rows[1]['config_id']})" in text


def test_no_config_qualifies_exit_1(saturated):
    text = run("recommend", saturated / "fit", "--max-ttft-p99-ms", 1, code=1).output
    assert "NO CONFIG QUALIFIES" in text


@pytest.mark.parametrize("args, needle", [
    (["--max-p99-waiting", "8"], "not --max-p99-waiting"),
    ([], "needs a bound"),
    (["--max-ttft-p99-ms", "1", "--max-queue-wait-p99-ms", "1"], "give one of"),
])
def test_closed_loop_bound_errors_are_one_line(light, args, needle):
    r = run("recommend", light / "fit", *args, code=2)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1 and needle in r.stderr


def test_open_loop_run_refuses_a_ttft_bound(light):
    r = run("recommend", light / "run", "--max-ttft-p99-ms", "5", code=2)
    assert "open-loop run has no TTFT" in r.stderr


def test_the_library_answer_is_the_commands_and_its_refusals_name_parameters(light):
    grid = recommend_dir(light / "fit", max_ttft_p99_ms=2000)
    assert grid.kind == "closed loop" and grid.flags
    cli = run("recommend", light / "fit", "--max-ttft-p99-ms", 2000, code=0 if grid.met else 1).stdout
    assert "\n".join(grid.lines) + "\n" == cli and grid.met == ("NO CONFIG QUALIFIES" not in cli)
    assert recommend_dir(light / "run", max_p99_waiting=8).kind == "open loop"
    with pytest.raises(ParamsError) as err:
        recommend_dir(light / "fit")
    assert str(err.value) == (f"{light / 'fit'}: a closed-loop grid needs a bound: max_ttft_p99_ms=MS or "
                              "max_queue_wait_p99_ms=MS")
    assert run("recommend", light / "fit", code=2).stderr == f"error: {err.value.cli_text()}\n"
    assert err.value.cli_text() == (f"{light / 'fit'}: a closed-loop grid needs a bound: --max-ttft-p99-ms MS "
                                    "or --max-queue-wait-p99-ms MS")
    with pytest.raises(ParamsError, match="^an open-loop run needs max_p99_waiting=N$"):
        recommend_dir(light / "run")


@pytest.fixture(scope="module")
def poor(tmp_path_factory):
    """Production decodes slower with a fuller batch; a constant-step model cannot follow."""
    d = tmp_path_factory.mktemp("poor")
    trace = _production(d, 202, 12.0, decode_step_ms_per_request=1.2)
    out = _user_path(d, trace, "--decode-model", "constant")
    return d, out


def test_poor_fidelity_is_said_first(poor):
    d, _ = poor
    fid = json.loads((d / "fit" / "fidelity.json").read_text())
    assert not fid["good"]
    # exit 0 with a pick, 1 when no stable config qualifies: either way the warning comes first
    code = 0 if _independent_pick(_summary(d), 10**9) is not None else 1
    text = run("recommend", d / "fit", "--max-ttft-p99-ms", 10**9, code=code).output
    first = text.splitlines()[0]
    assert first.startswith("WARNING: model fidelity POOR") and fid["failing"][0] in first
    page = (d / "run" / "report.html").read_text()
    s0 = page.index('<section id="s0">')
    poor_at = page.index("WARNING: model fidelity POOR", s0)
    assert poor_at < page.index('<table class="closed">', s0) < page.index('<section id="s1">')


# ---------------------------------------------------------------------------
# the report


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def test_report_finds_the_grid_and_shows_it_first(saturated):
    page = (saturated / "run" / "report.html").read_text()   # written by sweep, found beside it
    assert page.index('<section id="s0">') < page.index('<section id="s1">')
    s0 = page[page.index('<section id="s0">'):page.index('<section id="s1">')]
    t = _text(s0)
    assert "model fidelity GOOD" in t and "matched to this run's trace by sha256" in t.replace("&#x27;", "'")
    s = _summary(saturated)
    for r in s.iter_rows(named=True):
        lo, hi = 100 * r["true_hit_rate_lo"], 100 * r["true_hit_rate_hi"]
        assert f"{100 * r['true_hit_rate']:.2f}% [{lo:.2f}%..{hi:.2f}%]" in t
        if not r["stable"]:
            assert "NO (seeds " + ",".join(map(str, r["unstable_seeds"])) + " disagree)" in t
    assert "decision-time" in t and "served" in t
    # the open-loop headline and heatmaps carry the label
    rest = page[page.index('<section id="s1">'):page.index('<section id="s3">')]
    assert rest.count("Open-loop estimate.") == 2 and "ranks first by construction" in rest


def test_report_closed_loop_option_and_a_foreign_grid(saturated, light, tmp_path):
    out = tmp_path / "r.html"
    run("report", light / "run", "--out", out, "--closed-loop", saturated / "fit")
    t = _text(out.read_text()).replace("&#x27;", "'")
    assert "given with --closed-loop; WARNING: not recorded as produced from this run's trace" in t
    r = run("report", light / "run", "--out", tmp_path / "x.html", "--closed-loop", light / "run", code=2)
    assert "not a closed-loop grid" in r.stderr and len(r.stderr.splitlines()) == 1


def test_report_without_a_grid_has_no_closed_loop_section(tmp_path, light):
    trace = tmp_path / "t"
    shutil.copytree(light / "trace", trace)
    run("sweep", trace, "--out", tmp_path / "run", "--worker-queue-limit", "none,4", "-q")
    page = (tmp_path / "run" / "report.html").read_text()
    s0 = _text(page[page.index('<section id="s0">'):page.index('<section id="s1">')])
    assert "Closed-loop answer" not in s0 and "No closed-loop answer yet" in s0
    assert "Open-loop estimate." in page


def test_waterfall_per_config_side_by_side_and_drilldown(saturated):
    from replay.report.run_page import figures, load_run

    run_ = load_run(saturated / "run")
    s = run_.summary
    figs = figures(run_)
    menu = figs["waterfall"]
    assert len(menu.data) == s.height  # one trace per config, one visible
    assert sum(bool(t.visible) for t in menu.data) == 1
    buttons = menu.layout.updatemenus[0].buttons
    assert len(buttons) == s.height
    for t in menu.data:
        cid = int(t.name.split()[1])
        row = s.filter(pl.col("config_id") == cid).row(0, named=True)
        y = list(t.y)
        assert y[0] == row["matched_blocks"] and y[-1] == row["selected_blocks"]
        assert y[0] + sum(y[1:-1]) == y[-1]  # the losses take matched down to selected
    pair = figs["waterfall_pair"]
    assert len(pair.data) == 2 and pair.data[0].name != pair.data[1].name
    page = (saturated / "run" / "report.html").read_text()
    table = page[page.index('<table id="drilldown">'):]
    table = table[:table.index("</table>")]
    dec = pl.concat([pl.read_parquet(f) for f in run_.decisions])
    shown = [int(x) for x in re.findall(r"<tr><td>(\d+)</td>", table)]
    cid = int(re.search(r"The \d+ requests of config (\d+)", page).group(1))
    top = (dec.filter((pl.col("config_id") == cid) & (pl.col("blocks_lost") > 0))
           .sort(["blocks_lost", "request_id"], descending=[True, False]).head(20))
    assert shown == top["request_id"].to_list()
    assert "lost to" in table and top["lost_to"][0] in table


def test_compare_shows_changed_waterfall_terms(saturated, tmp_path):
    trace = saturated / "trace"
    run("sweep", trace, "--out", tmp_path / "b", "--worker-queue-limit", LIMITS, "--seed", PROD_SEED,
        "--saturation-queue-floor", "1", "-q")
    run("sweep", trace, "--out", tmp_path / "a", "--worker-queue-limit", LIMITS, "--seed", PROD_SEED,
        "--saturation-queue-floor", "1", "--freshness-ms", "200", "-q")
    text = run("compare", tmp_path / "a", tmp_path / "b").output
    assert "locality waterfall, B - A in blocks" in text
    a = pl.read_parquet(tmp_path / "a" / "summary.parquet").sort("config_id")
    b = pl.read_parquet(tmp_path / "b" / "summary.parquet").sort("config_id")
    body = text[text.index("locality waterfall"):]
    some_change = False
    for ra, rb in zip(a.iter_rows(named=True), b.iter_rows(named=True), strict=True):
        for c in ("lost_queue_gate", "lost_capacity", "lost_pin", "lost_tournament", "lost_fallback"):
            if rb[c] != ra[c]:
                some_change = True
                assert f"{c.removeprefix('lost_')} {rb[c] - ra[c]:+,}" in body
    assert some_change


def _chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser")) if p), None)


def test_closed_loop_report_renders_in_chromium(saturated):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not found on PATH")
    url = (saturated / "run" / "report.html").resolve().as_uri()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=20000", "--dump-dom"]
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as prof:
        res = subprocess.run([exe, *flags, f"--user-data-dir={prof}", url], capture_output=True, text=True,
                             timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln] == []
    dom = res.stdout
    for key in ("answer", "waterfall", "waterfall_pair", "closed_loop"):
        m = re.search(rf'<div id="fig-{key}"[^>]*class="[^"]*js-plotly-plot', dom)
        assert m, key
        chunk = dom[m.start():dom.find('<div class="fig">', m.start())]
        assert 'class="main-svg"' in chunk, key
    assert "updatemenu" in dom[dom.find('id="fig-waterfall"'):dom.find('id="fig-waterfall_pair"')]
    assert dom.index('id="s0"') < dom.index('id="s1"')


# ---------------------------------------------------------------------------
# section 4: what a new user tripped over


def test_sweep_prints_agreement_and_names_what_differs(light, tmp_path):
    trace = light / "trace"
    r = run("sweep", trace, "--out", tmp_path / "ok", "--worker-queue-limit", "none,4", "--seed", PROD_SEED)
    assert "agreement with the trace's selected_worker: best 1.00000" in r.output
    assert "config 1 is the recorded config (trace.json): agreement 1.00000" in r.output
    r = run("sweep", trace, "--out", tmp_path / "seed", "--worker-queue-limit", "none,4", "--seed", 3)
    assert f"produced with seed {PROD_SEED} (trace.json); this sweep used --seed 3" in r.output
    ag = pl.read_parquet(tmp_path / "seed" / "summary.parquet")["agreement"].to_list()
    assert f"config 1 is the recorded config (trace.json): agreement {ag[1]:.5f}" in r.output
    r = run("sweep", trace, "--out", tmp_path / "knob", "--worker-queue-limit", "none,2", "--seed", PROD_SEED)
    assert "no config of this grid is the recorded config (trace.json): it differs in " \
           "--worker-queue-limit 4 (this grid: 2,none)" in r.output
    assert "hit_rate: decision-time" in r.output


def test_sweep_of_a_grid_dir_names_its_config_dirs(light, tmp_path):
    r = run("sweep", light / "fit" / "prediction", "--out", tmp_path / "x", code=2)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert "a closed-loop simulator grid, not a trace: it holds config-0/, config-1/" in r.stderr
    assert "config-0/seed-" in r.stderr
    r = run("sweep", light / "fit", "--out", tmp_path / "x", code=2)
    assert "a calibrate --validate directory" in r.stderr and not (tmp_path / "x").exists()


def test_simulate_lists_skipped_combinations_in_sim_json(light, tmp_path):
    out = tmp_path / "g"
    r = run("simulate", light / "trace", "--fleet", light / "fleet.toml", "--out", out, "--requests", 200,
            "--worker-queue-limit", "none,2", "--saturation-queue-floor", "none,1,2")
    assert "(and 1 more, listed in sim.json)" in r.stderr
    skipped = json.loads((out / "sim.json").read_text())["grid"]["skipped"]
    assert len(skipped) == 2
    for s in skipped:
        assert f"skipped: --worker-queue-limit none --saturation-queue-floor " \
               f"{s['knobs']['saturation_queue_floor']}: {s['error']}" in r.stderr
    assert "run.json" not in r.stderr


def test_simulate_grid_table_is_readable(light, tmp_path):
    r = run("simulate", light / "trace", "--fleet", light / "fleet.toml", "--out", tmp_path / "g",
            "--requests", 300, "--worker-queue-limit", "none,2,4", "--saturation-queue-floor", "none,1",
            "--seeds", 2)
    lines = r.stdout.splitlines()
    table = lines[1:-1]
    assert table[0].split()[:4] == ["config", "limit", "floor", "served"]
    assert all(len(x) <= 100 for x in lines[1:]), max(map(len, lines[1:]))
    assert not re.search(r"\d\.\d{3,}", "\n".join(table))   # seconds and % at 1-2 decimals
    assert len({len(x) for x in table}) == 1                 # aligned columns, no wrapping
    assert "true_hit_rate" in lines[-1] and "decision-time" in lines[-1]


def test_force_replaces_a_seeded_grid(light, tmp_path):
    """A seeded grid (closed_loop_seeds.parquet, config-<id>/seed-<s>/) is the simulator's own output."""
    args = ["simulate", light / "trace", "--fleet", light / "fleet.toml", "--out", tmp_path / "g",
            "--requests", 100, "--worker-queue-limit", "none,2", "--seeds", 2, "-q"]
    run(*args)
    run(*args, "--force")
    assert (tmp_path / "g" / "closed_loop_seeds.parquet").is_file()
    r = run(*args, code=2)
    assert "--force" in r.stderr


def test_report_beside_picks_the_second_waterfall(saturated, tmp_path):
    out = tmp_path / "b.html"
    run("report", saturated / "run", "--out", out, "--config", 1, "--beside", 3)
    t = _text(out.read_text())
    a = pl.read_parquet(saturated / "run" / "summary.parquet").sort("config_id")
    r1, r3 = a.row(1, named=True), a.row(3, named=True)
    assert "Side by side: config 1 (" in t and ") and config 3 (" in t
    from replay.analysis.waterfall import STEP_TEXT, changed_terms

    for c, v in changed_terms(r3, r1).items():
        assert f"{STEP_TEXT.get(c, c.replace('_', ' '))} {v:+,}" in t
    r = run("report", saturated / "run", "--out", tmp_path / "c.html", "--beside", 99, code=2)
    assert "--beside 99: no such config_id" in r.stderr


def test_report_finds_the_grid_beside_the_trace(light, tmp_path):
    """The run lives elsewhere; the grid sits beside the trace it was produced from."""
    run("sweep", light / "trace", "--out", tmp_path / "elsewhere", "--worker-queue-limit", LIMITS, "-q")
    t = _text((tmp_path / "elsewhere" / "report.html").read_text()).replace("&#x27;", "'")
    assert f"closed-loop grid {light / 'fit' / 'prediction'} (matched to this run's trace by sha256)" in t


def test_sweep_reads_the_recorded_config_from_sim_json(light, tmp_path):
    """Without trace.json, a simulated trace's sim.json says what it was produced under."""
    trace = tmp_path / "t"
    shutil.copytree(light / "trace", trace)
    (trace / "trace.json").unlink()
    r = run("sweep", trace, "--out", tmp_path / "r", "--worker-queue-limit", "none,4", "--seed", 1)
    assert "config 1 is the recorded config (sim.json)" in r.output
    assert f"produced with seed {PROD_SEED} (sim.json); this sweep used --seed 1" in r.output
    r = run("sweep", trace, "--out", tmp_path / "r2", "--worker-queue-limit", "none,4", "--seed", PROD_SEED,
            "--freshness-ms", 1000)
    assert "produced with freshness 5000 ms (sim.json); this sweep used --freshness-ms 1000" in r.output


def test_a_corrupt_grid_is_one_line(light, tmp_path):
    bad = tmp_path / "grid"
    shutil.copytree(light / "fit" / "prediction", bad)
    (bad / "closed_loop_summary.parquet").write_bytes(b"not parquet")
    r = run("recommend", bad, "--max-ttft-p99-ms", 100, code=2)
    assert r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert "closed_loop_summary.parquet: unreadable Parquet" in r.stderr
    pl.DataFrame({"config_id": [0]}).write_parquet(bad / "closed_loop_summary.parquet")
    r = run("recommend", bad, "--max-ttft-p99-ms", 100, code=2)
    assert "column 'true_hit_rate': missing" in r.stderr
    (bad / "closed_loop_summary.parquet").unlink()
    (tmp_path / "empty").mkdir()
    r = run("report", light / "run", "--out", tmp_path / "x.html", "--closed-loop", tmp_path / "empty", code=2)
    assert "not a closed-loop grid" in r.stderr and not (tmp_path / "x.html").exists()
