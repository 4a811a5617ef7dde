"""Nothing lost: no command destroys or corrupts what it reads, --force included.

Every case runs the real CLI (click's CliRunner) on real files and checks, besides the
one-line error and exit code 2, that every input is byte for byte what it was.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner
from conftest import tree_digest

from replay.cli import main

REPO = Path(__file__).resolve().parents[1]
LOG = REPO / "traces" / "sample-log" / "requests.jsonl"
FLEET = REPO / "traces" / "sample-fleet.toml"
SMALL = ["--worker-queue-limit", "2,4", "--no-report", "-q"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res.stdout


def refused(res, *needles):
    """Exit 2 with one ``error:`` line holding every needle, and no traceback."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def digest_tree(d: Path) -> dict:
    """``{relative path: bytes}`` of every file below ``d`` (symlinks read through)."""
    out = {}
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = Path(root) / f
            out[str(p.relative_to(d))] = p.read_bytes()
    return out


@pytest.fixture()
def trace(gen_trace, tmp_path):
    t = tmp_path / "data" / "trace"
    shutil.copytree(gen_trace, t)
    return t


@pytest.fixture(scope="module")
def trace_set(tmp_path_factory):
    d = tmp_path_factory.mktemp("set") / "ts"
    ok(invoke("generate", d, "--requests", "1200", "--workers", "4", "--rate", "40", "--partition-s", "10"))
    return d


@pytest.fixture(scope="module")
def two_runs(gen_trace, tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    for name, limit in (("a", "2,4"), ("b", "4,8")):
        ok(invoke("sweep", gen_trace, "--out", base / name, "--worker-queue-limit", limit, "-q"))
    return base / "a", base / "b"


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------
# sweep


@pytest.mark.parametrize("how", ["itself", "dot-slash", "parent", "symlink"])
def test_sweep_never_replaces_its_trace(trace, tmp_path, how):
    before = digest_tree(trace.parent)
    out = {"itself": trace, "dot-slash": f"{trace}/./", "parent": trace.parent,
           "symlink": tmp_path / "link"}[how]
    if how == "symlink":
        os.symlink(trace, out)
    msg = refused(invoke("sweep", trace, "--out", out, "--force", *SMALL), "input of this command")
    assert ("contains" in msg) == (how == "parent")
    assert digest_tree(trace.parent) == before


def test_sweep_never_writes_inside_a_trace_set(trace_set, tmp_path):
    ts = tmp_path / "ts"
    shutil.copytree(trace_set, ts)
    before = digest_tree(ts)
    refused(invoke("sweep", ts, "--out", ts / "requests", "--force", *SMALL), "input of this command")
    refused(invoke("sweep", ts, "--out", ts / "requests" / "run", *SMALL), "lies inside an input")
    refused(invoke("sweep", ts, "--out", ts / "run", *SMALL), "lies inside an input")
    assert digest_tree(ts) == before
    ok(invoke("validate", ts))


def test_sweep_refuses_a_trace_file_linked_into_the_output(gen_trace, tmp_path):
    """A trace whose files are symlinks to elsewhere: that elsewhere is an input too."""
    store = tmp_path / "store"
    shutil.copytree(gen_trace, store)
    t = tmp_path / "t"
    t.mkdir()
    for f in os.listdir(store):
        os.symlink(store / f, t / f)
    before = digest_tree(store)
    refused(invoke("sweep", t, "--out", store, "--force", *SMALL), "input of this command")
    assert digest_tree(store) == before


def test_force_replaces_only_a_run_sweep_wrote(trace, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    refused(invoke("sweep", trace, "--out", foreign, "--force", *SMALL), "--force replaces only",
            "no run.json")
    assert os.listdir(foreign) == ["thesis.tex"]
    # a run dir with a user's file added to it: that file is not sweep's to delete
    run = tmp_path / "run"
    ok(invoke("sweep", trace, "--out", run, *SMALL))
    (run / "notes.txt").write_text("mine")
    refused(invoke("sweep", trace, "--out", run, "--force", *SMALL), "notes.txt was not written by router-replay")
    assert (run / "notes.txt").read_text() == "mine"
    # a forged run.json without the tool's marker is not a run
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "run.json").write_text(json.dumps({"tool": "something-else"}))
    refused(invoke("sweep", trace, "--out", fake, "--force", *SMALL), "--force replaces only")
    # a real run is replaced
    (run / "notes.txt").unlink()
    ok(invoke("sweep", trace, "--out", run, "--force", "--worker-queue-limit", "8", "--no-report", "-q"))
    assert pl.read_parquet(run / "summary.parquet")["worker_queue_limit"].to_list() == [8]


def test_sweep_through_a_symlinked_out_keeps_the_link(trace, tmp_path):
    real = tmp_path / "real-run"
    ok(invoke("sweep", trace, "--out", real, *SMALL))
    link = tmp_path / "latest"
    os.symlink(real, link)
    ok(invoke("sweep", trace, "--out", link, "--force", "--worker-queue-limit", "8", "--no-report", "-q"))
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert pl.read_parquet(real / "summary.parquet")["worker_queue_limit"].to_list() == [8]
    assert sorted(os.listdir(tmp_path)) == ["data", "latest", "real-run"]   # no .old-* link left


# ---------------------------------------------------------------------------
# simulate


def test_simulate_never_replaces_its_log_or_fleet(tmp_path):
    d = tmp_path / "D"
    d.mkdir()
    shutil.copy(LOG, d / "log.jsonl")
    shutil.copy(FLEET, d / "fleet.toml")
    before = tree_digest(d)
    for out in (d, tmp_path):
        refused(invoke("simulate", d / "log.jsonl", "--fleet", d / "fleet.toml", "--out", out, "--force",
                       "--requests", "50", "-q"), "input of this command")
    assert tree_digest(d) == before
    # an arbitrary directory is not a simulation's to replace
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep").write_text("x")
    refused(invoke("simulate", d / "log.jsonl", "--fleet", d / "fleet.toml", "--out", other, "--force",
                   "--requests", "50", "-q"), "--force replaces only", "no sim.json")
    assert (other / "keep").read_text() == "x"
    # its own output is replaced
    sim = tmp_path / "sim"
    ok(invoke("simulate", d / "log.jsonl", "--fleet", d / "fleet.toml", "--out", sim, "--requests", "50", "-q"))
    ok(invoke("simulate", d / "log.jsonl", "--fleet", d / "fleet.toml", "--out", sim, "--requests", "60",
              "--force", "-q"))
    assert json.loads((sim / "sim.json").read_text())["requests"] == 60


# ---------------------------------------------------------------------------
# compare, report, check


def test_compare_never_replaces_a_run_it_reads(two_runs, tmp_path):
    a = copy_run(two_runs[0], tmp_path / "a")
    b = copy_run(two_runs[1], tmp_path / "b")
    before = (digest_tree(a), digest_tree(b))
    refused(invoke("compare", a, b, "--out", b, "--force"), "is an input")
    refused(invoke("compare", a, b, "--out", a / "diff"), "lies inside an input")
    refused(invoke("compare", a, b, "--out", tmp_path, "--force"), "contains an input")
    assert (digest_tree(a), digest_tree(b)) == before
    # --force replaces a comparison, never a folder of other things
    other = tmp_path / "other"
    other.mkdir()
    (other / "x.txt").write_text("x")
    refused(invoke("compare", a, b, "--out", other, "--force"), "--force replaces only")
    diff = tmp_path / "diff"
    ok(invoke("compare", a, b, "--out", diff))
    ok(invoke("compare", a, b, "--out", diff, "--force"))
    assert "deltas.parquet" in os.listdir(diff)


def test_report_never_writes_over_a_run_file(two_runs, tmp_path):
    r = copy_run(two_runs[0], tmp_path / "r")
    before = digest_tree(r)
    for name in ("summary.parquet", "run.json", "decisions.parquet", "fleet.parquet"):
        refused(invoke("report", r, "--out", r / name, "--force", "-q"), "is an input")
    assert digest_tree(r) == before
    foreign = tmp_path / "page.html"
    foreign.write_text("<html>my page</html>")
    refused(invoke("report", r, "--out", foreign, "--force", "-q"), "--force replaces only", "not a report")
    assert foreign.read_text() == "<html>my page</html>"
    # its own page, in the run or elsewhere, is replaced
    ok(invoke("report", r, "--force", "-q"))
    ok(invoke("report", r, "--out", tmp_path / "r.html", "-q"))
    ok(invoke("report", r, "--out", tmp_path / "r.html", "--force", "-q"))


def test_check_never_writes_over_its_inputs(two_runs, tmp_path):
    r = copy_run(two_runs[0], tmp_path / "r")
    base = tmp_path / "base.json"
    ok(invoke("check", r, "--write-baseline", base))
    before = (digest_tree(r), base.read_bytes())
    refused(invoke("check", r, "--write-baseline", r / "summary.parquet", "--force"), "lies inside an input")
    refused(invoke("check", r, "--write-baseline", r / "b.json"), "lies inside an input")
    refused(invoke("check", r, "--baseline", base, "--junit", base, "--force"), "is an input")
    refused(invoke("check", r, "--baseline", base, "--markdown", r / "run.json", "--force"), "lies inside")
    j = tmp_path / "j.xml"
    refused(invoke("check", r, "--baseline", base, "--junit", j, "--markdown", j), "two outputs")
    assert (digest_tree(r), base.read_bytes()) == before
    # foreign files are not replaced by --force; the tool's own are
    for flag, kind in (("--junit", "JUnit"), ("--markdown", "check report")):
        f = tmp_path / f"foreign{flag}"
        f.write_text("someone else's")
        refused(invoke("check", r, "--baseline", base, flag, f, "--force"), "--force replaces only", kind)
        assert f.read_text() == "someone else's"
        f.unlink()
        ok(invoke("check", r, "--baseline", base, flag, f))
        ok(invoke("check", r, "--baseline", base, flag, f, "--force"))
    other = tmp_path / "other.json"
    other.write_text('{"mine": true}')
    refused(invoke("check", r, "--write-baseline", other, "--force"), "not a baseline")
    assert other.read_text() == '{"mine": true}'
    ok(invoke("check", r, "--write-baseline", base, "--force"))


@pytest.mark.parametrize("value, why", [
    ("NaN", "not a finite number"), ("Infinity", "not a finite number"), ("null", "is null"),
    ("-0.5", "negative"), ("1.5", "outside 0..1"), ('"0.9"', "not a number"), ("[0.9]", "not a number"),
    ("1" + "0" * 400, "out of range"), ("true", "not a number"),
], ids=["nan", "inf", "null", "negative", "rate-above-1", "string", "list", "10**400", "bool"])
def test_a_baseline_with_an_unusable_value_is_unusable_input(two_runs, tmp_path, value, why):
    r = two_runs[0]
    base = tmp_path / "base.json"
    ok(invoke("check", r, "--write-baseline", base))
    assert ok(invoke("check", r, "--baseline", base)).startswith("router-replay check: PASS")
    text = base.read_text()
    rec = json.loads(text)
    old = json.dumps(rec["configs"][0]["metrics"]["hit_rate"])
    marker = '"hit_rate": ' + old
    assert marker in text
    base.write_text(text.replace(marker, '"hit_rate": ' + value, 1))
    refused(invoke("check", r, "--baseline", base), "config entry 0", "hit_rate", why, "unusable")


@pytest.mark.parametrize("value", ['"4"', "[4]", str(2**64), "1.5", "{}"])
def test_a_baseline_with_a_bad_knob_value_is_unusable_input(two_runs, tmp_path, value):
    r = two_runs[0]
    base = tmp_path / "base.json"
    ok(invoke("check", r, "--write-baseline", base))
    rec = json.loads(base.read_text())
    rec["configs"][0]["knobs"]["worker_queue_limit"] = json.loads(value)
    base.write_text(json.dumps(rec))
    refused(invoke("check", r, "--baseline", base), "config entry 0", "worker_queue_limit", "unusable")


def test_a_metric_without_a_value_is_not_stored_in_a_baseline(two_runs, tmp_path):
    """A metric that is null for some config (here: agreement blanked in the summary) cannot be
    written into a baseline, which would then hold nothing to check it against."""
    r = copy_run(two_runs[0], tmp_path / "r")
    s = pl.read_parquet(r / "summary.parquet").with_columns(pl.lit(None, pl.Float64).alias("agreement"))
    s.write_parquet(r / "summary.parquet")
    refused(invoke("check", r, "--write-baseline", tmp_path / "b.json", "--metric", "agreement"),
            "agreement has no value", "--metric")
    assert not (tmp_path / "b.json").exists()


# ---------------------------------------------------------------------------
# generate


def test_generate_force_replaces_only_a_trace_it_wrote(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.csv").write_text("1,2,3")
    refused(invoke("generate", mine, "--requests", "100", "--force"), "--force replaces only")
    assert os.listdir(mine) == ["data.csv"]
    t = tmp_path / "t"
    ok(invoke("generate", t, "--requests", "100"))
    ok(invoke("generate", t, "--requests", "200", "--force"))
    ok(invoke("validate", t))
    assert sorted(os.listdir(tmp_path)) == ["mine", "t"]


def test_generate_force_refuses_a_hand_made_trace_without_its_marker(gen_trace, tmp_path):
    """A folder of trace tables is any trace's: only the trace.json generate writes marks it as
    generate's, so a hand-made trace (the tables alone, or with a trace.json of its own) is kept."""
    mine = tmp_path / "mine"
    shutil.copytree(gen_trace, mine)
    before = digest_tree(mine)
    refused(invoke("generate", mine, "--requests", "100", "--force"), "--force replaces only",
            f"no trace.json of router-replay's in it; {mine / 'loads.parquet'} was not written")
    (mine / "trace.json").write_text(json.dumps({"source": "our production fleet, Tuesday"}))
    before = digest_tree(mine)
    refused(invoke("generate", mine, "--requests", "100", "--force"),
            f"{mine / 'trace.json'} was not written by router-replay")
    assert digest_tree(mine) == before
    t = tmp_path / "t"
    ok(invoke("generate", t, "--requests", "100", "--partition-s", "10"))
    assert json.loads((t / "trace.json").read_text())["source"].startswith("router-replay generate")
    ok(invoke("generate", t, "--requests", "200", "--force"))
    assert sorted(os.listdir(t)) == ["loads.parquet", "requests.parquet", "trace.json", "workers.parquet"]
    assert sorted(os.listdir(tmp_path)) == ["mine", "t"]


def test_a_baseline_of_a_policy_variant_grid_loads_and_a_bad_choice_is_unusable(gen_trace, tmp_path):
    run = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", run, "--worker-queue-limit", "2,4", "--saturation-queue-floor", "1",
              "--pin-order", "pressure,locality", "--no-report", "-q"))
    base = tmp_path / "base.json"
    ok(invoke("check", run, "--write-baseline", base))
    assert ok(invoke("check", run, "--baseline", base)).startswith("router-replay check: PASS")
    rec = json.loads(base.read_text())
    assert {c["knobs"]["variant_pin_order"] for c in rec["configs"]} == {"pressure", "locality"}
    rec["configs"][0]["knobs"]["variant_pin_order"] = "sideways"
    base.write_text(json.dumps(rec))
    refused(invoke("check", run, "--baseline", base), "variant_pin_order", "not one of pressure, locality")


# ---------------------------------------------------------------------------
# import and calibrate: --force replaces only what they wrote; the fleet file is swapped in last


def _mooncake(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    log = d / "log.jsonl"
    log.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": 3,
                                       "hash_ids": [0, i + 1]}) + "\n" for i in range(20)))
    return log


def test_import_force_replaces_only_a_trace_import_wrote(gen_trace, tmp_path):
    """A folder holding a trace.json is not proof it is import's: a user's hand-made trace (its own
    trace.json, tables and a file of theirs in loads/) is refused under --force, naming the file."""
    log = _mooncake(tmp_path / "src")
    mine = tmp_path / "mine"
    shutil.copytree(gen_trace, mine)
    (mine / "trace.json").write_text(json.dumps({"source": "hand-made from our fleet", "page_size": 16}))
    before = digest_tree(mine)
    refused(invoke("import", "--out", mine, "--mooncake", log, "--force"), "--force replaces only",
            f"{mine / 'trace.json'} was not written by router-replay")
    assert digest_tree(mine) == before
    # an imported trace with a user's file put in its loads/ folder: that file is not import's to delete
    imp = tmp_path / "imp"
    ok(invoke("import", "--out", imp, "--mooncake", log))
    (imp / "loads").mkdir(exist_ok=True)
    (imp / "loads" / "notes.txt").write_text("mine")
    before = digest_tree(imp)
    refused(invoke("import", "--out", imp, "--mooncake", log, "--force"),
            f"{imp / 'loads' / 'notes.txt'} was not written by router-replay")
    assert digest_tree(imp) == before
    # what import wrote is replaced
    (imp / "loads" / "notes.txt").unlink()
    ok(invoke("import", "--out", imp, "--mooncake", log, "--force"))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []


def test_force_refusals_name_the_foreign_file(trace, tmp_path):
    """docs/outputs.md: a folder of anything else is refused with --force, naming its first foreign entry."""
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    for args in (["sweep", trace, "--out", foreign, *SMALL], ["generate", foreign, "--requests", "50"],
                 ["import", "--out", foreign, "--mooncake", _mooncake(tmp_path / "src")]):
        refused(invoke(*args, "--force"), "--force replaces only", f"{foreign / 'thesis.tex'} was not written")
    assert digest_tree(foreign) == {"thesis.tex": b"years of work"}


SAMPLE = REPO / "traces" / "sample"


def _fleet_fixture(tmp_path):
    fleet = tmp_path / "fleet.toml"
    ok(invoke("calibrate", SAMPLE, "--out", fleet, "-q"))
    with open(fleet, "a") as fh:         # still calibrate's file, but not what this fit writes again
        fh.write("# the previous fit\n")
    return fleet, fleet.read_bytes()


def test_a_refused_calibrate_leaves_the_old_fleet_file(tmp_path):
    """calibrate --force writes the fleet aside: a run refused after the fit (--seeds 0) keeps the
    previous fleet file byte for byte and leaves no temporary beside it."""
    fleet, old = _fleet_fixture(tmp_path)
    refused(invoke("calibrate", SAMPLE, "--out", fleet, "--validate", tmp_path / "v", "--force", "-q",
                   "--worker-queue-limit", "2", "--seeds", "0"), "seeds")
    assert fleet.read_bytes() == old
    assert os.listdir(tmp_path) == ["fleet.toml"]


def _cli(*args):
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-m", "replay", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_calibrate_interrupted_during_validation_keeps_the_old_fleet_file(tmp_path, sig):
    import signal
    import time
    fleet, old = _fleet_fixture(tmp_path)
    proc = _cli("calibrate", SAMPLE, "--out", fleet, "--validate", tmp_path / "v", "--force", "-q",
                "--worker-queue-limit", "1..8")
    t0 = time.monotonic()
    while not any(n.startswith(".v.partial-") for n in os.listdir(tmp_path)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 300
        time.sleep(0.05)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert fleet.read_bytes() == old
    if sig == "SIGTERM":
        assert proc.returncode == 143 and "Traceback" not in err, err
        assert os.listdir(tmp_path) == ["fleet.toml"]
        return
    # kill -9 cannot be cleaned up after: the next calibrate into that fleet file removes its debris
    assert any(n.startswith(".fleet.toml.partial-") for n in os.listdir(tmp_path))
    res = invoke("calibrate", SAMPLE, "--out", fleet, "--force", "-q")
    ok(res)
    assert "removed 1 unfinished folder(s) left by killed runs (.fleet.toml.partial-" in res.stderr
    assert [n for n in os.listdir(tmp_path) if "fleet" in n] == ["fleet.toml"] and fleet.read_bytes() != b""
