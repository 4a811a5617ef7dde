"""``router-replay compare``, ``check`` and ``recommend`` on real runs.

Real generated traces on disk, real sweeps (``run_sweep``), the real CLI
(``CliRunner`` over ``replay.cli.main``); expected values are recomputed here
independently from the runs' summary and decisions files with polars.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import xml.etree.ElementTree as ET

import polars as pl
import pytest
from click.testing import CliRunner

from replay import run_sweep
from replay.analysis import runs as analysis
from replay.cli import main
from replay.errors import ReplayError
from replay.trace.synthetic import generate_trace

GRID = {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"}
KNOBS = ["worker_queue_limit", "saturation_queue_floor"]
SHARES = {"share_cache_hit": "cache_hit", "share_cache_miss": "cache_miss",
          "share_cache_worker_queued": "cache_worker_queued", "share_all_queued": "all_queued"}
# no report.html for these runs when the sweep can build one (not what these tests are about)
NO_REPORT = {"report": False} if "report" in inspect.signature(run_sweep).parameters else {}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(res, code=0):
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    return res.stdout


def one_line_error(res, *needles):
    """Exit 2, nothing on stdout, exactly one ``error: ...`` line on stderr naming every needle."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Real runs of two generated traces.

    * ``a``: trace T, GRID, seed 0 (freshness 5000 ms)
    * ``b``: trace T, GRID, seed 1 and freshness 300 ms: other decisions for the same configs
    * ``c``: trace T, floors none,1,2,3 (same seed as a): other config ids for the same
      knobs, identical results for them, and one extra config (limit 4, floor 3)

    GRID has 7 valid configs (a floor without a limit is refused).
    * ``nodec``: as ``a`` without decisions.parquet
    * ``u``: another trace, GRID (trace hash mismatch)
    * ``p``: trace T, --per-dp-rank (dp_size 2)
    """
    root = tmp_path_factory.mktemp("ccr")
    t, u = root / "trace_t", root / "trace_u"
    generate_trace(t, n_requests=700, n_workers=4, dp_size=2, seed=5)
    generate_trace(u, n_requests=300, n_workers=4, dp_size=2, seed=6)
    out = {}
    for name, trace, grid, kw in (
        ("a", t, GRID, {}),
        ("b", t, GRID, {"seed": 1, "freshness_ms": 300}),
        ("c", t, {**GRID, "saturation_queue_floor": "none,1,2,3"}, {}),
        ("nodec", t, GRID, {"decisions": False}),
        ("u", u, GRID, {}),
        ("p", t, {"worker_queue_limit": "none,1,2", "saturation_queue_floor": "none,1"}, {"per_dp_rank": True}),
    ):
        run_sweep(trace, grid, out=root / name, **kw, **NO_REPORT)
        out[name] = root / name
    out["root"] = root
    return out


def summary(run) -> pl.DataFrame:
    return pl.read_parquet(run / "summary.parquet")


def expected_metric(s: pl.DataFrame, name: str) -> pl.Series:
    """A few metrics recomputed from the summary's own columns."""
    if name in SHARES:
        return s[SHARES[name]] / s["requests"]
    return s[name].cast(pl.Float64)


# ---------------------------------------------------------------------------
# compare


def test_compare_terminal_and_parquet_outputs(runs, tmp_path):
    out = tmp_path / "diff"
    text = ok(invoke("compare", runs["a"], runs["b"], "--out", out, "--limit", "4"))
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines  # a path is as long as it is
               if str(runs["root"]) not in line and str(tmp_path) not in line), max(lines, key=len)
    assert "settings that differ: seed 0 -> 1; freshness_ms 5000 -> 300" in text
    assert "7 configs matched by knob values" in text
    assert "4 of 7" in text
    assert sorted(p.name for p in out.iterdir()) == ["changed_requests.parquet", "deltas.parquet",
                                                     "transitions.parquet"]
    deltas = pl.read_parquet(out / "deltas.parquet")
    sa, sb = summary(runs["a"]), summary(runs["b"])
    assert deltas.height == 7 * len(analysis.COMPARE_METRICS)
    for m in ("hit_rate", "owner_rate", "selected_waiting_p99", "share_cache_hit", "share_all_queued", "pinned"):
        ea = sa.select("config_id", *KNOBS, expected_metric(sa, m).alias("ea"))
        eb = sb.select(*KNOBS, expected_metric(sb, m).alias("eb"))
        want = ea.join(eb, on=KNOBS, nulls_equal=True)
        got = deltas.filter(pl.col("metric") == m).join(want, left_on="config_id_a", right_on="config_id")
        assert got.height == 7
        for r in got.iter_rows(named=True):
            assert r["a"] == pytest.approx(r["ea"]) and r["b"] == pytest.approx(r["eb"]), (m, r)
            assert r["delta"] == pytest.approx(r["eb"] - r["ea"])
    # the printed hit rate of the first row is the config with the largest |delta hit rate|
    hr = deltas.filter(pl.col("metric") == "hit_rate").with_columns(pl.col("delta").abs().alias("k"))
    top = hr.sort("k", "config_id_a", descending=[True, False]).row(0, named=True)
    table_start = next(i for i, line in enumerate(lines) if line.startswith("config "))
    first = lines[table_start + 1]
    assert first.startswith(top["config"]) and f"{100 * top['a']:.2f}%" in first


def _label(prefix):
    return pl.coalesce(pl.col("decision"), pl.lit("failed:") + pl.col("failure"), pl.lit("failed")).alias(prefix)


def test_compare_transitions_recomputed_from_both_decision_files(runs, tmp_path):
    out = tmp_path / "diff"
    ok(invoke("compare", runs["a"], runs["b"], "--out", out))
    # configs matched independently, by knobs in the two summaries
    ids = summary(runs["a"]).select(*KNOBS, pl.col("config_id").alias("cid_a")).join(
        summary(runs["b"]).select(*KNOBS, pl.col("config_id").alias("cid_b")), on=KNOBS, nulls_equal=True)
    da = pl.read_parquet(runs["a"] / "decisions.parquet").select(
        "request_id", pl.col("config_id").cast(pl.Int64).alias("cid_a"), pl.col("worker").alias("wa"), _label("la"))
    db = pl.read_parquet(runs["b"] / "decisions.parquet").select(
        "request_id", pl.col("config_id").cast(pl.Int64).alias("cid_b"), pl.col("worker").alias("wb"), _label("lb"))
    both = da.join(ids, on="cid_a").join(db, on=["cid_b", "request_id"])
    assert both.height == 700 * 7
    changed = both.filter(pl.col("wa").ne_missing(pl.col("wb")) | (pl.col("la") != pl.col("lb")))
    want = (changed.group_by("cid_a", "la", "lb").agg(pl.len().cast(pl.Int64).alias("n"))
            .sort("cid_a", "la", "lb"))
    got = (pl.read_parquet(out / "transitions.parquet")
           .select(pl.col("config_id_a").cast(pl.Int64).alias("cid_a"), pl.col("label_a").alias("la"),
                   pl.col("label_b").alias("lb"), pl.col("requests").alias("n"))
           .sort("cid_a", "la", "lb"))
    assert got.height > 0 and (got["la"] != got["lb"]).any(), "the two runs should differ in labels"
    assert got.to_dicts() == want.to_dicts()
    cr = pl.read_parquet(out / "changed_requests.parquet")
    assert cr.height == changed.height
    assert set(zip(cr["config_id_a"].to_list(), cr["request_id"].to_list(), strict=True)) == \
        set(zip(changed["cid_a"].to_list(), changed["request_id"].to_list(), strict=True))


def test_compare_matches_configs_by_knobs_not_ids(runs, tmp_path):
    # c has the same knobs under other config ids (and 1 extra config); same seed and trace
    cmp = analysis.compare_runs(runs["a"], runs["c"])
    assert cmp.pairs.height == 7 and len(cmp.only_b) == 1 and not cmp.only_a
    assert (cmp.pairs["config_id_a"] != cmp.pairs["config_id_b"]).any()
    assert all(r["delta"] in (0.0, None) for r in cmp.deltas.iter_rows(named=True))
    text = ok(invoke("compare", runs["a"], runs["c"]))
    assert "1 only in B" in text and "floor=3" in text
    assert "requests whose worker or decision changed: 0 request-config pairs" in text


def test_compare_without_decisions_and_refusals(runs, tmp_path):
    out = tmp_path / "d"
    text = ok(invoke("compare", runs["nodec"], runs["b"], "--out", out))
    assert "request-level changes skipped: no decisions.parquet in" in text
    assert [p.name for p in out.iterdir()] == ["deltas.parquet"]
    before = (out / "deltas.parquet").read_bytes()
    one_line_error(invoke("compare", runs["a"], runs["b"], "--out", out), "not empty", "--force")
    assert [p.name for p in out.iterdir()] == ["deltas.parquet"]
    assert (out / "deltas.parquet").read_bytes() == before
    ok(invoke("compare", runs["a"], runs["b"], "--out", out, "--force"))
    assert len(list(out.iterdir())) == 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_compare_of_runs_differing_in_an_unswept_knob_says_how(runs, tmp_path):
    other = tmp_path / "mlc"
    run_sweep(runs["root"] / "trace_t", {**GRID, "min_load_choices": "3"}, out=other, **NO_REPORT)
    line = one_line_error(invoke("compare", runs["a"], other), "no config in common")
    assert "they differ in min_load_choices 2 vs 3, which neither run sweeps" in line
    assert "--min-load-choices 2,3 --worker-queue-limit none,2,4 --saturation-queue-floor none,1,2" in line


def test_compare_bad_input(runs, tmp_path):
    one_line_error(invoke("compare", runs["a"], runs["u"]), "same trace", "sha256")
    one_line_error(invoke("compare", runs["a"], tmp_path / "nope"), "no such run directory")
    trace_dir = runs["root"] / "trace_t"
    one_line_error(invoke("compare", trace_dir, runs["a"]), "not a run directory")
    bad = tmp_path / "bad"
    shutil.copytree(runs["a"], bad)
    (bad / "summary.parquet").write_bytes(b"not parquet at all")
    one_line_error(invoke("compare", runs["a"], bad), "summary.parquet", "unreadable Parquet")
    shutil.copy(runs["a"] / "summary.parquet", bad / "summary.parquet")
    (bad / "decisions.parquet").write_bytes((runs["a"] / "decisions.parquet").read_bytes()[:200])
    one_line_error(invoke("compare", runs["a"], bad), "decisions.parquet")
    (bad / "run.json").write_text("{ broken")
    one_line_error(invoke("compare", runs["a"], bad), "run.json")
    one_line_error(invoke("compare", runs["a"], runs["b"], "--label", "bogus"), "--label")


# ---------------------------------------------------------------------------
# check


def _baseline(runs, tmp_path, run="a", *extra):
    path = tmp_path / f"base_{run}.json"
    out = ok(invoke("check", runs[run], "--write-baseline", path, *extra))
    assert "wrote baseline" in out
    return path


def test_write_baseline_contents_and_overwrite(runs, tmp_path):
    path = _baseline(runs, tmp_path)
    rec = json.loads(path.read_text())
    run = json.loads((runs["a"] / "run.json").read_text())
    assert rec["version"] and rec["kind"] == "baseline"
    assert {k: v["sha256"] for k, v in rec["trace"]["files"].items()} == \
        {k: v["sha256"] for k, v in run["trace"]["files"].items()}
    assert rec["tolerances"] == {"hit_rate": "0.5pt", "selected_waiting_p99": "10%", "share_cache_hit": "1pt",
                                 "share_cache_miss": "1pt", "share_cache_worker_queued": "1pt",
                                 "share_all_queued": "1pt"}
    s = summary(runs["a"])
    assert len(rec["configs"]) == s.height == 7
    by_id = {r["config_id"]: r for r in s.iter_rows(named=True)}
    for c in rec["configs"]:
        r = by_id[c["config_id"]]
        assert all(c["knobs"][k] == r[k] for k in KNOBS)
        assert c["metrics"]["hit_rate"] == pytest.approx(r["hit_rate"])
        assert c["metrics"]["share_all_queued"] == pytest.approx(r["all_queued"] / r["requests"])
    before = path.read_bytes()
    one_line_error(invoke("check", runs["b"], "--write-baseline", path), "exists", "--force")
    assert path.read_bytes() == before
    ok(invoke("check", runs["b"], "--write-baseline", path, "--force", "--max-hit-rate-drop", "0.25",
              "--metric", "hit_rate", "--metric", "owner_rate", "--tolerance", "owner_rate=2pt"))
    rec = json.loads(path.read_text())
    assert rec["metrics"] == ["hit_rate", "owner_rate"]
    assert rec["tolerances"] == {"hit_rate": "0.25pt", "owner_rate": "2pt"}


def _expected_regressions(base_run, new_run, tol):
    """(config knobs, metric) pairs that worsen beyond ``tol`` = {metric: (allowed, relative?)}."""
    sa, sb = summary(base_run), summary(new_run)
    out = set()
    for m, (allowed, rel) in tol.items():
        j = sa.select(*KNOBS, expected_metric(sa, m).alias("x")).join(
            sb.select(*KNOBS, expected_metric(sb, m).alias("y")), on=KNOBS, nulls_equal=True)
        worse_is_up = m in ("selected_waiting_p99", "share_cache_miss", "share_cache_worker_queued",
                            "share_all_queued")
        for r in j.iter_rows(named=True):
            worsening = (r["y"] - r["x"]) if worse_is_up else (r["x"] - r["y"])
            limit = allowed * abs(r["x"]) if rel else allowed
            if worsening > limit + 1e-12:
                out.add((r["worker_queue_limit"], r["saturation_queue_floor"], m))
    return out


def _parse_rows(md: str):
    """The rows of the metrics table (the decisions table, above it, is not one)."""
    md = md[md.index("| config | metric |"):]
    rows = [line for line in md.splitlines() if line.startswith("| `")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


def test_check_within_tolerance_exit_0(runs, tmp_path):
    base = _baseline(runs, tmp_path)
    junit = tmp_path / "j.xml"
    line = ok(invoke("check", runs["a"], "--baseline", base))
    assert line.startswith("router-replay check: PASS") and line.count("\n") == 1, line
    assert "decisions identical (7 configs x 700 requests)" in line
    md = ok(invoke("check", runs["a"], "--baseline", base, "--junit", junit, "--verbose"))
    assert md.startswith("### router-replay check: PASS")
    rows = _parse_rows(md)
    assert len(rows) == 7 * 6 and {r[-1] for r in rows} == {"ok"}
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "49" and suite.get("failures") == "0"  # 7 configs x (6 metrics + decisions)
    assert len(suite.findall("testcase")) == 49 and not suite.findall("testcase/failure")
    # c holds every baseline config (plus one it does not check): identical results
    md = ok(invoke("check", runs["c"], "--baseline", base, "--verbose"))
    assert len(_parse_rows(md)) == 42 and "1 config of the run not in the baseline" in md


def test_check_regressions_exit_1_named_in_markdown_and_junit(runs, tmp_path):
    base = _baseline(runs, tmp_path, "b")
    want = _expected_regressions(runs["b"], runs["a"], {
        "hit_rate": (0.005, False), "selected_waiting_p99": (0.10, True),
        **{s: (0.01, False) for s in SHARES}})
    assert want, "run a should regress against run b somewhere"
    junit = tmp_path / "j.xml"
    # other seed and freshness: other decisions, which fail by default; the drift allowed, the tolerances decide
    res = invoke("check", runs["a"], "--baseline", base, "--junit", junit, "--verbose", "--allow-decision-drift")
    md = ok(res, 1)
    assert md.startswith(f"### router-replay check: FAIL: {len(want)} regression")
    rows = _parse_rows(md)
    assert len(rows) == 42
    failing = {(r[0].strip("`"), r[1]) for r in rows if r[-1].startswith("**REGRESSION**")}
    fmt = analysis.config_label
    assert failing == {(fmt({"worker_queue_limit": lim, "saturation_queue_floor": fl}, KNOBS), m)
                       for lim, fl, m in want}
    regress_lines = [line for line in md[md.index("**Regressions:**"):].splitlines() if line.startswith("- ")]
    assert len(regress_lines) == len(want)
    for cfg, m in failing:
        assert any(line.startswith(f"- {cfg}: {m} ") for line in regress_lines)
    suite = ET.parse(junit).getroot().find("testsuite")
    fails = [tc for tc in suite.findall("testcase") if tc.find("failure") is not None]
    assert suite.get("failures") == str(len(want)) == str(len(fails))
    assert all(tc.get("name").endswith(" :: decisions") for tc in suite.findall("testcase")
               if tc.get("classname") == "router-replay.check.decisions")
    assert {tc.get("name") for tc in fails} == {f"{c} :: {m}" for c, m in failing}
    assert all(tc.find("failure").get("message").startswith("regression: ") for tc in fails)
    # the JUnit file is not replaced without --force
    one_line_error(invoke("check", runs["a"], "--baseline", base, "--junit", junit), "exists")
    # looser tolerances as flags: the same run passes
    ok(invoke("check", runs["a"], "--baseline", base, "--max-hit-rate-drop", "100", "--max-p99-rise", "1000",
              "--max-label-share-change", "100", "--allow-decision-drift"))
    # ... and without --allow-decision-drift the changed decisions still fail
    out = ok(invoke("check", runs["a"], "--baseline", base, "--max-hit-rate-drop", "100", "--max-p99-rise", "1000",
                    "--max-label-share-change", "100"), 1)
    assert out.startswith("router-replay check: FAIL: ") and "changed decision" in out.splitlines()[0]
    assert "seed 1 -> 0" in out and "freshness_ms 300 -> 5000" in out


def test_check_improvements_never_fail(runs, tmp_path):
    zero = ["--tolerance", "hit_rate=0pt", "--tolerance", "selected_waiting_p99=0%",
            *sum((["--tolerance", f"{s}=0pt"] for s in SHARES), [])]
    base = _baseline(runs, tmp_path, "a", *zero)
    assert json.loads(base.read_text())["tolerances"]["hit_rate"] == "0pt"
    want = _expected_regressions(runs["a"], runs["b"], {
        "hit_rate": (0.0, False), "selected_waiting_p99": (0.0, True), **{s: (0.0, False) for s in SHARES}})
    res = invoke("check", runs["b"], "--baseline", base, "--verbose", "--allow-decision-drift")
    md = ok(res, 1 if want else 0)
    rows = _parse_rows(md)
    improved = [r for r in rows if r[-1] == "improved"]
    assert improved, "run b should improve on run a somewhere"
    failing = {(r[0].strip("`"), r[1]) for r in rows if r[-1].startswith("**REGRESSION**")}
    assert len(failing) == len(want)
    for r in improved:  # every improved row moved in its good direction
        change = float(r[4].split()[0].split("(")[0].replace(",", ""))
        assert change > 0 if r[1] in ("hit_rate", "share_cache_hit") else change < 0, r


def test_check_unusable_input_exit_2(runs, tmp_path):
    base = _baseline(runs, tmp_path)
    one_line_error(invoke("check", runs["u"], "--baseline", base), "baseline's trace", "sha256")
    base_c = _baseline(runs, tmp_path, "c")
    one_line_error(invoke("check", runs["a"], "--baseline", base_c), "1 baseline config missing", "floor=3")
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[1, 2")
    one_line_error(invoke("check", runs["a"], "--baseline", garbage), "unreadable baseline")
    one_line_error(invoke("check", runs["a"], "--baseline", tmp_path / "none.json"), "no such baseline")
    one_line_error(invoke("check", runs["a"], "--baseline", base, "--tolerance", "hit_rate=abc"), "hit_rate")
    one_line_error(invoke("check", runs["a"], "--baseline", base, "--tolerance", "hit_rate=0.5"), "points")
    one_line_error(invoke("check", runs["a"], "--baseline", base, "--tolerance", "owner_rate=1pt"),
                   "owner_rate", "does not store")
    one_line_error(invoke("check", runs["a"]), "--baseline", "--write-baseline")
    one_line_error(invoke("check", runs["a"], "--baseline", base, "--write-baseline", tmp_path / "x.json"))
    one_line_error(invoke("check", tmp_path / "missing", "--baseline", base), "no such run directory")


# ---------------------------------------------------------------------------
# recommend


def _best(s: pl.DataFrame, bound: float):
    ok_ = s.filter(pl.col("selected_waiting_p99") <= bound).sort(
        ["hit_rate", "selected_waiting_p99", "selected_waiting_mean", "config_id"],
        descending=[True, False, False, False])
    return ok_


def test_recommend_best_under_bound(runs):
    s = summary(runs["a"])
    p99 = sorted(set(s["selected_waiting_p99"].to_list()))
    bound = p99[-1]
    cands = _best(s, bound)
    best, nxt = cands.row(0, named=True), cands.row(1, named=True)
    text = ok(invoke("recommend", runs["a"], "--max-p99-waiting", bound))
    label = analysis.config_label(best, KNOBS)
    assert f"fleet: recommended {label} (config {best['config_id']})" in text
    assert f"hit rate {100 * best['hit_rate']:.2f}%" in text
    margin = 100 * (best["hit_rate"] - nxt["hit_rate"])
    assert f"margin: {margin:+.2f} pt hit rate over the next best, {analysis.config_label(nxt, KNOBS)}" in text
    assert f"{cands.height} of 7 configs meet the bound" in text
    assert "reference: no-gate config limit=none floor=none" in text
    # a bound only some configs meet
    mid = p99[0]
    cands = _best(s, mid)
    best = cands.row(0, named=True)
    text = ok(invoke("recommend", runs["a"], "--max-p99-waiting", mid))
    assert f"recommended {analysis.config_label(best, KNOBS)} " in text
    assert f"{cands.height} of 7 configs meet the bound ({7 - cands.height} exceed it)" in text
    assert all(len(line) <= 100 for line in text.splitlines()[1:])


def test_recommend_none_meets_bound_exit_1(runs):
    s = summary(runs["a"])
    low = min(s["selected_waiting_p99"].to_list()) - 1
    assert low >= 0
    text = ok(invoke("recommend", runs["a"], "--max-p99-waiting", low), 1)
    assert "NO CONFIG MEETS THE BOUND" in text and "none of 7 configs" in text
    assert f"lowest p99 in this run: {low + 1}" in text


def test_recommend_per_dp_size(runs):
    s = summary(runs["p"])
    bound = max(s["selected_waiting_p99"].to_list())
    best = _best(s, bound).row(0, named=True)
    text = ok(invoke("recommend", runs["p"], "--max-p99-waiting", bound))
    assert f"dp_size 2: recommended {analysis.config_label(best, KNOBS)}" in text
    assert "per rank: limit" in text


def test_recommend_json_and_emit_flags_per_dp_size(runs, tmp_path):
    s = summary(runs["p"])
    bound = max(s["selected_waiting_p99"].to_list())
    best = _best(s, bound).row(0, named=True)
    rec = json.loads(ok(invoke("recommend", runs["p"], "--max-p99-waiting", bound, "--json")))
    (answer,) = rec["answers"]
    assert answer["dp_size"] == 2 and answer["recommended"]["config_id"] == best["config_id"]
    assert answer["recommended"]["metrics"]["hit_rate"] == pytest.approx(best["hit_rate"])
    want = " ".join(f"--{k.replace('_', '-')} {best[k]}" for k in KNOBS if best[k] is not None)
    assert answer["router_flags"] == want
    flags = tmp_path / "router.env"
    ok(invoke("recommend", runs["p"], "--max-p99-waiting", bound, "--emit-flags", flags))
    # the file is what a start script includes: sourcing it gives the flags
    import subprocess
    got = subprocess.run(["sh", "-c", f'. "{flags}"; printf "%s|%s" "$ROUTER_FLAGS_DP2" "$ROUTER_FLAGS"'],
                         capture_output=True, text=True, check=True).stdout
    assert got == f"{want}|{want}"
    one_line_error(invoke("recommend", runs["p"], "--max-p99-waiting", bound, "--emit-flags", flags), "exists")
    # no config meets the bound: no variable, a comment says why
    low = min(s["selected_waiting_p99"].to_list()) - 1
    ok(invoke("recommend", runs["p"], "--max-p99-waiting", low, "--emit-flags", flags, "--force"), 1)
    text = flags.read_text()
    assert "ROUTER_FLAGS_DP2=" not in text and "# ROUTER_FLAGS_DP2: no config meets the bound" in text
    # a summary holding two dp sizes gets one answer each (library level, real rows relabelled)
    run = analysis.load_run(runs["p"])
    run.summary = pl.concat([run.summary, run.summary.with_columns(
        pl.lit(4, pl.Int64).alias("dp_size"), (pl.col("config_id") + 100).alias("config_id"),
        (pl.col("selected_waiting_p99") + 1000).alias("selected_waiting_p99"))])
    recs = analysis.recommend(run, bound)
    assert [r.dp_size for r in recs] == [2, 4]
    assert recs[0].best["config_id"] == best["config_id"] and recs[1].best is None


def test_recommend_bad_input(runs, tmp_path):
    one_line_error(invoke("recommend", tmp_path / "nope", "--max-p99-waiting", "5"), "no such run directory")
    res = invoke("recommend", runs["a"], "--max-p99-waiting", "-1")
    assert res.exit_code == 2 and "Traceback" not in res.output
    res = invoke("recommend", runs["a"])
    assert res.exit_code == 2 and "--max-p99-waiting" in res.output
    with pytest.raises(ReplayError):
        analysis.recommend(runs["a"], math.inf)


@pytest.mark.parametrize("cmd", ["compare", "check", "recommend"])
def test_help_has_example_and_exit_codes(cmd):
    text = ok(invoke(cmd, "--help"))
    assert "Example:" in text and f"router-replay {cmd} " in text
    assert "Exit codes" in text or "Exit codes:" in text or "exit codes" in text.lower()
