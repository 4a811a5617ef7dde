"""``router-replay sweep`` end to end: real traces on disk, the real CLI (CliRunner and the
console script), real outputs read back with polars.  Summary arithmetic is checked in
``test_results.py``; here: files, provenance, determinism, grid handling, the run directory's
atomicity, --per-dp-rank, --model, progress and bad input.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time

import polars as pl
import pytest
from click.testing import CliRunner
from conftest import tree_digest

import replay
from replay import run_sweep
from replay.cli import main
from replay.errors import ReplayError

OUTPUTS = {"summary.parquet", "summary.csv", "decisions.parquet", "run.json", "fleet.parquet",
           "report.html"}
GRID = ["--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1..4"]
FLOOR_NEEDS_LIMIT = ("--saturation-queue-floor requires --worker-queue-limit "
                     "(there is no diversion to cancel without it)")
CONSOLE = shutil.which("router-replay") or os.path.join(os.path.dirname(sys.executable), "router-replay")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sweep(trace, out, *args, ok=True):
    res = invoke("sweep", trace, "--out", out, *args)
    if ok:
        assert res.exit_code == 0, (res.output, res.exception)
    return res


def read(out):
    dec = out / "decisions.parquet"
    return (pl.read_parquet(out / "summary.parquet"),
            pl.read_parquet(dec) if dec.exists() else None,
            json.loads((out / "run.json").read_text()))


def one_line_error(res, *needles, code=2):
    """Exit ``code``, exactly one stderr line ``error: ...`` containing every needle, no traceback."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def no_leftovers(parent, name):
    """Hidden partial (``.NAME.partial-*``) or old (``.NAME.old-*``) run dirs left next to RUN_DIR."""
    return [e for e in os.listdir(parent) if e.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def base(gen_trace, tmp_path_factory):
    """One sweep of the generated trace over a 4 x 5 grid (6 combinations refused)."""
    before = tree_digest(gen_trace)
    out = tmp_path_factory.mktemp("base") / "run"
    res = sweep(gen_trace, out, *GRID)
    summary, decisions, run = read(out)
    return dict(out=out, res=res, summary=summary, decisions=decisions, run=run, before=before)


# ---------------------------------------------------------------------------
# outputs and provenance


def test_writes_outputs_and_reports(base, gen_trace):
    assert set(os.listdir(base["out"])) == OUTPUTS
    assert no_leftovers(base["out"].parent, "run") == []
    res = base["res"]
    assert "replayed 1,500 requests x 14 configs = 21,000 decisions" in res.stdout
    assert "best configs by hit rate:" in res.stdout
    warn = res.stderr.splitlines()
    assert warn == [f"warning: skipped 6 of 20 configs the router would refuse: {FLOOR_NEEDS_LIMIT} "
                    "(and 5 more, listed in run.json)"]
    s = base["summary"]
    assert s.height == 14 and base["decisions"].height == 14 * 1500
    combos = set(zip(s["worker_queue_limit"], s["saturation_queue_floor"], strict=True))
    want = {(None, None)} | {(lim, fl) for lim in (2, 4, 8) for fl in (None, 1, 2, 3, 4)
                             if fl is None or fl <= lim}
    assert combos == want


def test_run_json(base, gen_trace):
    run = base["run"]
    assert run["tool"] == "router-replay"
    assert run["version"] == replay.__version__
    assert run["status"] == "complete"
    assert run["seed"] == 0 and run["freshness_ms"] == 5000 and run["model"] is None
    assert run["decisions"] == "decisions.parquet" and run["per_dp_rank"] is False
    files = run["trace"]["files"]
    assert set(files) == {"requests.parquet", "loads.parquet", "workers.parquet"}
    for name, (size, sha) in tree_digest(gen_trace).items():
        assert files[name]["bytes"] == size
        assert files[name]["sha256"] == sha
        assert os.path.samefile(files[name]["path"], gen_trace / name)
    assert run["trace"]["requests"] == 1500
    grid = run["grid"]
    assert grid["values"]["worker_queue_limit"] == [None, 2, 4, 8]
    assert grid["values"]["saturation_queue_floor"] == [None, 1, 2, 3, 4]
    assert grid["values"]["min_load_choices"] == [2]  # router default
    assert grid["n_combinations"] == 20 and grid["n_configs"] == 14
    assert run["config_ids"] == base["summary"]["config_id"].to_list()
    skipped = {(e["knobs"]["worker_queue_limit"], e["knobs"]["saturation_queue_floor"]): e["error"]
               for e in grid["skipped"]}
    assert skipped == {
        **{(None, f): FLOOR_NEEDS_LIMIT for f in (1, 2, 3, 4)},
        (2, 3): "--saturation-queue-floor (3) must be at most --worker-queue-limit (2)",
        (2, 4): "--saturation-queue-floor (4) must be at most --worker-queue-limit (2)",
    }
    t = run["timings"]
    assert set(t) >= {"load_s", "replay_s", "accumulate_and_write_s", "total_s"}
    assert all(isinstance(v, (int, float)) and v >= 0 for v in t.values())
    assert t["total_s"] >= t["replay_s"] and t["total_s"] > 0


def test_input_trace_files_untouched(base, gen_trace):
    assert tree_digest(gen_trace) == base["before"]


def test_no_decisions_same_summary(base, gen_trace, tmp_path):
    out = tmp_path / "nd"
    sweep(gen_trace, out, *GRID, "--no-decisions")
    assert set(os.listdir(out)) == OUTPUTS - {"decisions.parquet"}
    summary, decisions, run = read(out)
    assert decisions is None
    assert run["decisions"] is None
    assert summary.equals(base["summary"])


# ---------------------------------------------------------------------------
# determinism


def test_threads_do_not_change_results(base, gen_trace, tmp_path):
    for n in (1, 2):
        out = tmp_path / f"t{n}"
        sweep(gen_trace, out, *GRID, "--threads", n)
        summary, decisions, run = read(out)
        assert run["machine"]["threads"] == n
        assert summary.equals(base["summary"]), n
        assert decisions.equals(base["decisions"]), n


def test_value_order_does_not_change_results(gen_trace, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    sweep(gen_trace, a, "--worker-queue-limit", "8,2,4", "--saturation-queue-floor", "2,none,1",
          "--disable-pressure-guard", "true,false")
    sweep(gen_trace, b, "--worker-queue-limit", "2,4,8", "--saturation-queue-floor", "none,1..2",
          "--disable-pressure-guard", "false,true")
    sa, da, ra = read(a)
    sb, db, rb = read(b)
    assert sa.height == 3 * 3 * 2
    assert sa.equals(sb)
    assert da.equals(db)
    assert ra["grid"] == rb["grid"] and ra["config_ids"] == rb["config_ids"]


AUDIT = ["request_id", "config_id", "decision", "query_blocks", "matched_blocks", "gate_rejected",
         "admission_evaluated", "admission_rejected", "best_rejected_blocks", "fleet_all_queued",
         "fell_back", "guard_compared", "guard_overrides"]


def test_seed(base, gen_trace, tmp_path):
    """Same seed: identical.  Another seed: only the power-of-k sampler's draws change."""
    runs = []
    for name in ("s7a", "s7b"):
        sweep(gen_trace, tmp_path / name, *GRID, "--seed", 7)
        runs.append(read(tmp_path / name))
    assert runs[0][0].equals(runs[1][0]) and runs[0][1].equals(runs[1][1])
    assert runs[0][2]["seed"] == 7
    s0, d0 = base["summary"], base["decisions"]
    s7, d7 = runs[0][0], runs[0][1]
    assert d7.select("request_id", "config_id").equals(d0.select("request_id", "config_id"))
    # the cache rung draws nothing: its decisions, and every cache-resolution audit field, are seed-free
    assert d7.select(AUDIT).equals(d0.select(AUDIT))
    cache_rung = pl.col("reason").is_in(["CacheCandidate", "SaturationPin"])
    assert d7.filter(cache_rung).equals(d0.filter(cache_rung))
    assert (d7["reason"].is_in(["CacheCandidate", "SaturationPin"])
            == d0["reason"].is_in(["CacheCandidate", "SaturationPin"])).all()
    # ... but the sampler's picks do depend on the seed
    changed = (d7["worker"] != d0["worker"]).sum()
    assert changed > 100
    for col in ("requests", "routed", "cache_hit", "cache_miss", "cache_worker_queued", "all_queued",
                "pinned", "policy_cache_candidate", "query_blocks", "matched_blocks"):
        assert s7[col].equals(s0[col]), col


# ---------------------------------------------------------------------------
# grid handling


@pytest.mark.parametrize("args, text", [
    (["--worker-queue-limit", "0"], "--worker-queue-limit must be at least 1"),
    (["--saturation-queue-floor", "1,2"], FLOOR_NEEDS_LIMIT),
    (["--worker-queue-limit", "2", "--saturation-queue-floor", "3..5"],
     "--saturation-queue-floor (3) must be at most --worker-queue-limit (2)"),
    (["--min-load-choices", "0"], "--min-load-choices must be at least 1"),
    (["--pressure-rel-threshold", "1.0,0.5"], "--pressure-rel-threshold must be finite and greater than 1"),
    (["--cache-candidate-min-workers", "40"],
     "--cache-candidate-min-workers and --cache-candidate-max-workers must be positive "
     "and min must not exceed max"),
])
def test_no_valid_config_exits_2_with_router_text(gen_trace, tmp_path, args, text):
    out = tmp_path / "run"
    res = sweep(gen_trace, out, *args, ok=False)
    line = one_line_error(res)
    assert line == f"error: {text}"
    assert not out.exists() and os.listdir(tmp_path) == []


def test_skipped_combination_warns_once_and_runs_the_rest(gen_trace, tmp_path):
    out = tmp_path / "run"
    res = sweep(gen_trace, out, "--worker-queue-limit", "0,3")
    assert res.stderr.splitlines() == [
        "warning: skipped 1 of 2 configs the router would refuse: --worker-queue-limit must be at least 1"]
    summary, _, run = read(out)
    assert summary["worker_queue_limit"].to_list() == [3]
    assert run["grid"]["skipped"] == [
        {"knobs": {**run["grid"]["skipped"][0]["knobs"], "worker_queue_limit": 0},
         "error": "--worker-queue-limit must be at least 1"}]


@pytest.mark.parametrize("flag, value", [
    ("--worker-queue-limit", "abc"),
    ("--worker-queue-limit", "4..2"),
    ("--worker-queue-limit", "2,,4"),
    ("--saturation-queue-floor", "-1"),
    ("--min-load-choices", "none"),
    ("--cache-candidate-ratio", "x"),
    ("--pressure-abs-threshold-ms", "1ms"),
    ("--disable-pressure-guard", "maybe"),
])
def test_invalid_value_text_names_the_flag(gen_trace, tmp_path, flag, value):
    out = tmp_path / "run"
    res = sweep(gen_trace, out, flag, value, ok=False)
    line = one_line_error(res)
    assert line.startswith(f"error: {flag}: "), line
    assert not out.exists()


# ---------------------------------------------------------------------------
# the run directory


def test_existing_run_dir_refused_without_force(gen_trace, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = sweep(gen_trace, out, ok=False)
    one_line_error(res, str(out), "not empty", "--force")
    assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    # a file in RUN_DIR's place is refused too, even with --force
    f = tmp_path / "file"
    f.write_text("x")
    one_line_error(sweep(gen_trace, f, "--force", ok=False), str(f), "not a directory")
    assert f.read_text() == "x"


def test_empty_run_dir_is_used(gen_trace, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    sweep(gen_trace, out, "--worker-queue-limit", "4")
    assert set(os.listdir(out)) == OUTPUTS


def test_force_replaces_run_dir(gen_trace, tmp_path):
    # output safety: --force replaces only a run sweep wrote (a folder of foreign files is refused,
    # tests/test_nothing_lost.py), so the run replaced here is a real one
    out = tmp_path / "run"
    sweep(gen_trace, out, "--worker-queue-limit", "2")
    sweep(gen_trace, out, "--worker-queue-limit", "4", "--force")
    assert set(os.listdir(out)) == OUTPUTS
    assert read(out)[0]["worker_queue_limit"].to_list() == [4]
    assert sorted(os.listdir(tmp_path)) == ["run"]


def _broken_traces(gen_trace, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(gen_trace, corrupt)
    data = (corrupt / "requests.parquet").read_bytes()
    (corrupt / "requests.parquet").write_bytes(data[: len(data) // 2])
    missing_col = tmp_path / "nocol"
    shutil.copytree(gen_trace, missing_col)
    req = pl.read_parquet(gen_trace / "requests.parquet").drop("input_tokens")
    req.write_parquet(missing_col / "requests.parquet")
    return [(corrupt, ["requests.parquet"]), (missing_col, ["requests.parquet", "input_tokens"])]


def test_failing_sweep_leaves_nothing_and_keeps_old_run(gen_trace, tmp_path):
    for trace, needles in _broken_traces(gen_trace, tmp_path / "traces"):
        before = tree_digest(trace)
        parent = tmp_path / f"runs-{trace.name}"
        parent.mkdir()
        out = parent / "run"
        one_line_error(sweep(trace, out, ok=False), *needles)
        assert os.listdir(parent) == []
        # with --force over a finished run: the failure leaves that run intact
        sweep(gen_trace, out, "--worker-queue-limit", "2")
        old = tree_digest(out)
        one_line_error(sweep(trace, out, "--force", ok=False), *needles)
        assert tree_digest(out) == old
        assert os.listdir(parent) == ["run"]
        assert tree_digest(trace) == before


def test_interrupted_sweep_leaves_no_partial_run(gen_trace, tmp_path):
    """A sweep that dies mid-replay (after the hidden run dir exists) cleans up after itself."""

    class Stop(Exception):
        pass

    seen = []

    def progress(n):
        seen.append(n)
        assert any(e.startswith(".run.partial-") for e in os.listdir(tmp_path))
        raise Stop

    out = tmp_path / "run"
    with pytest.raises(Stop):
        run_sweep(gen_trace, {"worker_queue_limit": "2,4"}, out=out, progress=progress)
    assert seen and os.listdir(tmp_path) == []
    run_sweep(gen_trace, {"worker_queue_limit": "2"}, out=out)
    old = tree_digest(out)
    with pytest.raises(Stop):
        run_sweep(gen_trace, {"worker_queue_limit": "2,4"}, out=out, force=True, progress=progress)
    assert tree_digest(out) == old and os.listdir(tmp_path) == ["run"]
    with pytest.raises(ReplayError, match="not empty"):
        run_sweep(gen_trace, {}, out=out)


# ---------------------------------------------------------------------------
# --per-dp-rank and --model


def test_per_dp_rank_scales_limit_and_floor(gen_trace, tmp_path):
    out = tmp_path / "per"
    res = sweep(gen_trace, out, "--per-dp-rank", "--worker-queue-limit", "1,2",
                "--saturation-queue-floor", "none,1,2")
    assert res.stderr.splitlines() == [
        "warning: skipped 1 of 6 configs the router would refuse: "
        "--saturation-queue-floor (4) must be at most --worker-queue-limit (2)"]
    s, d, run = read(out)
    assert s["dp_size"].to_list() == [2] * 5
    assert s["per_rank_limit"].to_list() == [1, 1, 2, 2, 2]
    assert s["worker_queue_limit"].to_list() == [2, 2, 4, 4, 4]
    assert s["per_rank_floor"].to_list() == [None, 1, None, 1, 2]
    assert s["saturation_queue_floor"].to_list() == [None, 2, None, 2, 4]
    assert run["per_dp_rank"] is True and run["dp_size"] == 2
    assert run["grid"]["per_rank_values"]["worker_queue_limit"] == [1, 2]
    assert run["grid"]["skipped"][0]["per_rank_limit"] == 1
    assert run["grid"]["skipped"][0]["per_rank_floor"] == 2
    # the same fleet values given directly replay identically
    plain = tmp_path / "plain"
    sweep(gen_trace, plain, "--worker-queue-limit", "2,4", "--saturation-queue-floor", "none,2,4")
    ps, pd, _ = read(plain)
    assert pd.equals(d)
    assert ps.drop("config_id").equals(s.drop("config_id", "dp_size", "per_rank_limit", "per_rank_floor"))


def test_per_dp_rank_mixed_fleet_exits_2(models_trace, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(models_trace, mixed)
    w = pl.read_parquet(mixed / "workers.parquet").with_columns(dp_size=pl.Series([1, 2, 1, 1, 1]))
    w.write_parquet(mixed / "workers.parquet")
    out = tmp_path / "run"
    line = one_line_error(sweep(mixed, out, "--per-dp-rank", "--worker-queue-limit", "2", ok=False))
    assert line == "error: --per-dp-rank needs one dp_size across the fleet, found 1, 2"
    assert not out.exists()
    # without --per-dp-rank the same trace sweeps fine
    sweep(mixed, out, "--worker-queue-limit", "2")


def test_model_filter(models_trace, tmp_path):
    full, only_a = tmp_path / "full", tmp_path / "a"
    sweep(models_trace, full, "--worker-queue-limit", "none,1")
    sweep(models_trace, only_a, "--worker-queue-limit", "none,1", "--model", "a")
    req = pl.read_parquet(models_trace / "requests.parquet")
    a_ids = req.filter(pl.col("model") == "a")["request_id"].to_list()
    assert len(a_ids) == 9
    fs, fd, _ = read(full)
    s, d, run = read(only_a)
    assert s["requests"].to_list() == [9, 9] and fs["requests"].to_list() == [16, 16]
    assert s["failed"].to_list() == [0, 0] and fs["failed"].to_list() == [2, 2]
    assert run["model"] == "a" and run["trace"]["requests"] == 9
    assert sorted(d["request_id"].unique().to_list()) == sorted(a_ids)
    assert set(d["worker"]) <= {"http://a0", "http://a1", "http://a2"}
    # the filter changes nothing about model a's own decisions
    assert d.equals(fd.filter(pl.col("request_id").is_in(a_ids)))
    res = sweep(models_trace, tmp_path / "z", "--model", "zzz", ok=False)
    one_line_error(res, "requests.parquet", "'zzz'")
    assert not (tmp_path / "z").exists()


# ---------------------------------------------------------------------------
# progress and quiet


def test_no_progress_bar_when_not_a_tty(base):
    out = base["res"].output
    assert "replaying" not in out and "%" not in out and "\r" not in out


def test_quiet_prints_nothing(gen_trace, tmp_path):
    res = sweep(gen_trace, tmp_path / "q", *GRID, "--quiet")  # a grid with skipped combinations
    assert res.stdout == "" and res.stderr == ""
    assert set(os.listdir(tmp_path / "q")) == OUTPUTS
    # errors still print
    res = sweep(gen_trace, tmp_path / "q", "--quiet", ok=False)
    one_line_error(res, "not empty")


@pytest.mark.parametrize("window", ["auto", "10s"])
def test_progress_bar_on_a_terminal(gen_trace, tmp_path, window):
    """stderr on a pseudo-terminal: the console script draws the bar there, stdout
    stays clean; a windowed sweep first says what it is doing (index, windows)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([CONSOLE, "sweep", str(gen_trace), "--out", str(tmp_path / "run"),
                             "--worker-queue-limit", "2", "--window", window],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    tty = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 1.0)
        if r:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            tty += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, tty
    assert b"replaying" in tty and b"100%" in tty
    assert b"replaying" not in stdout and b"replayed 1,500 requests" in stdout
    assert (b"indexing" in tty and b"windows of 10s" in tty) == (window == "10s")


# ---------------------------------------------------------------------------
# bad inputs and the console script


def test_missing_trace_dir(tmp_path):
    missing = tmp_path / "nope"
    one_line_error(sweep(missing, tmp_path / "run", ok=False), str(missing), "requests.parquet")
    assert os.listdir(tmp_path) == []


def test_missing_requests_file(gen_trace, tmp_path):
    d = tmp_path / "trace"
    shutil.copytree(gen_trace, d)
    (d / "requests.parquet").unlink()
    one_line_error(sweep(d, tmp_path / "run", ok=False), "requests.parquet", "not found", str(d))
    assert sorted(os.listdir(tmp_path)) == ["trace"]


def test_console_script(gen_trace, tmp_path):
    out = tmp_path / "run"
    args = ["sweep", str(gen_trace), "--out", str(out), "--worker-queue-limit", "2,4",
            "--saturation-queue-floor", "none,2", "--seed", "3"]
    p = subprocess.run([CONSOLE, *args, "--quiet"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and p.stderr == ""
    s, d, run = read(out)
    # a second process (the in-process CLI) reproduces it exactly
    again = tmp_path / "again"
    sweep(gen_trace, again, *args[4:])
    s2, d2, _ = read(again)
    assert s.equals(s2) and d.equals(d2)
    assert run["seed"] == 3 and s.height == 4
    # a user error: exit 2, one line, no traceback
    p = subprocess.run([CONSOLE, "sweep", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr
    assert str(tmp_path / "missing") in p.stderr
    assert not (tmp_path / "x").exists()


def test_ray_executor_without_ray_is_one_line_exit_2(gen_trace, tmp_path):
    """Without Ray importable, --executor ray says how to get it (no traceback, no run)."""
    out = tmp_path / "run"
    code = ("import sys; sys.modules['ray'] = None; from replay.cli import main; "
            "sys.argv = ['router-replay'] + sys.argv[1:]; main()")
    res = subprocess.run([sys.executable, "-c", code, "sweep", str(gen_trace), "--out", str(out),
                          "--executor", "ray", "--worker-queue-limit", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().splitlines()[-1] == ("error: --executor ray needs Ray: "
                                                   "pip install 'router-replay[ray]'")
    assert "Traceback" not in res.stderr
    assert not out.exists()
