"""Output safety (output paths, full disk, concurrency, knob overflow, huge grids),
signals and debris, and the report's bound: real child processes, real signals, a real
small tmpfs where this machine lets us mount one (skipped otherwise)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from replay.cli import main
from replay.runs import rundir

GRID = ["--worker-queue-limit", "none,1..8", "--saturation-queue-floor", "none,1..4"]


def invoke(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


def ok(res):
    assert res.exit_code == 0, (res.output, res.exception)
    return res


def refused(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def cli(*args) -> subprocess.Popen:
    """``python3 -m replay ARGS`` as a child process (its own session, so signals reach only it)."""
    return subprocess.Popen([sys.executable, "-m", "replay", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def hidden(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def wait_for_partial(parent: Path, proc: subprocess.Popen, timeout: float = 120.0) -> Path:
    """The child's ``.<out>.partial-*`` folder, once its replay is writing decisions into it."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for n in hidden(parent):
            p = parent / n
            if ".partial-" in n and (p / "decisions.parquet").exists():
                return p
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the child never started writing")


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A trace whose 35-config sweep takes seconds, so a signal lands mid-replay."""
    d = tmp_path_factory.mktemp("big") / "trace"
    ok(invoke("generate", d, "--requests", "300000", "--workers", "16"))
    return d


# ---------------------------------------------------------------------------
# C: signals and debris


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_cleans_up_and_keeps_the_old_run(big, gen_trace, tmp_path, sig, code):
    out = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "2", "--no-report", "-q"))
    old = {n: (out / n).read_bytes() for n in os.listdir(out)}
    # --force over a run of another trace is allowed: it is a run sweep wrote
    proc = cli("sweep", big, "--out", out, "--force", *GRID, "--no-report", "-q")
    wait_for_partial(tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"interrupted ({signal.Signals(sig).name})" in err and "Traceback" not in err
    assert hidden(tmp_path) == []                       # no partial left
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == old


def test_repeated_sighup_at_random_moments_leaves_nothing(big, gen_trace, tmp_path):
    """SIGHUP, then more SIGHUPs a few milliseconds apart, at random moments of a sweep (before
    its partial folder exists, while it writes, while it cleans up after the first one): every
    run ends with exit 129 and one line (or finishes whole), never a partial folder left
    behind, and the previous run stays as it was.  Seeded, a bounded number of runs."""
    import random
    rng = random.Random(20261207)
    out = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "2", "--no-report", "-q"))

    def state():
        return {n: (out / n).read_bytes() for n in sorted(os.listdir(out)) if (out / n).is_file()}

    old = state()
    for i in range(8):
        proc = cli("sweep", big, "--out", out, "--force", *GRID, "--no-report", "-q")
        if i % 2:                                           # while it writes its partial folder
            wait_for_partial(tmp_path, proc)
            time.sleep(rng.uniform(0.0, 0.5))
        else:                                               # any moment from its start on
            time.sleep(rng.uniform(0.0, 3.0))
        for _ in range(rng.randint(2, 6)):
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGHUP)
            time.sleep(rng.uniform(0.0, 0.03))
        _, err = proc.communicate(timeout=180)
        assert hidden(tmp_path) == [], (i, err)
        assert "Traceback" not in err, (i, err)
        if proc.returncode == 0:                            # it finished before the first signal
            old = state()
            continue
        if proc.returncode == -signal.SIGHUP:               # before the command began: nothing done
            assert err == "" and state() == old, (i, err)
            continue
        assert proc.returncode == 129, (i, proc.returncode, err)
        assert err.strip().splitlines() == ["interrupted (SIGHUP): nothing of this run was kept"], (i, err)
        assert state() == old, i


def test_sigint_exit_differs_from_checks_regression_code(big, tmp_path):
    proc = cli("sweep", big, "--out", tmp_path / "run", *GRID, "--no-report", "-q")
    wait_for_partial(tmp_path, proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130 and proc.returncode not in (0, 1, 2)
    assert os.listdir(tmp_path) == []


def test_the_next_run_removes_what_a_killed_run_left(big, tmp_path):
    out = tmp_path / "run"
    proc = cli("sweep", big, "--out", out, *GRID, "--no-report", "-q")
    partial = wait_for_partial(tmp_path, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert partial.is_dir()                             # kill -9 cannot be cleaned up after
    res = ok(invoke("sweep", big, "--out", out, "--worker-queue-limit", "4", "--no-report", "--no-decisions"))
    assert f"removed 1 unfinished folder(s) left by killed runs ({partial.name})" in res.stderr
    assert os.listdir(tmp_path) == ["run"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_swap_killed_between_its_renames_is_undone(gen_trace, tmp_path):
    """Where the file system cannot exchange two folders, the old run is renamed aside before
    the new one moves in; a kill in between leaves the old run aside and no run in place.
    The next command on that output puts the old run back and removes the unfinished one."""
    out = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "2", "--no-report", "-q"))
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    host = format(zlib.crc32(socket.gethostname().encode()) & 0xFFFFFF, "06x")
    pid = _dead_pid()
    out.rename(tmp_path / f".run.old-{pid}@{host}-abc123")
    (tmp_path / f".run.partial-{pid}@{host}-xyz").mkdir()
    # the next command writing that output puts the old run back (and says so), then, without
    # --force, refuses to replace it
    res = invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "4", "--no-report")
    refused(res, "not empty", "--force")
    assert "put back the previous output from .run.old-" in res.stderr
    assert "removed 1 unfinished folder(s)" in res.stderr
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert hidden(tmp_path) == []


def test_the_library_tells_its_notes_to_the_logger_not_stderr(tmp_path, capfd):
    """Library code prints nothing itself: what ``recover`` did goes to the ``replay`` logger
    (the command prints it as ``note: ...``, above) and back to the caller."""
    host = format(zlib.crc32(socket.gethostname().encode()) & 0xFFFFFF, "06x")
    pid = _dead_pid()
    (tmp_path / f".run.old-{pid}@{host}-abc123").mkdir()
    (tmp_path / f".run.old-{pid}@{host}-abc123" / "summary.parquet").write_bytes(b"old run")
    (tmp_path / f".run.partial-{pid}@{host}-xyz").mkdir()
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("replay")
    log.addHandler(handler)
    try:
        lines = rundir.recover(tmp_path / "run")
    finally:
        log.removeHandler(handler)
    assert capfd.readouterr().err == ""
    assert heard == lines and len(lines) == 2
    assert "put back the previous output from .run.old-" in lines[0] and "removed 1 unfinished" in lines[1]
    assert (tmp_path / "run" / "summary.parquet").read_bytes() == b"old run"
    assert hidden(tmp_path) == []


def test_debris_of_a_live_run_is_left_alone(gen_trace, tmp_path):
    host = format(zlib.crc32(socket.gethostname().encode()) & 0xFFFFFF, "06x")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = tmp_path / f".run.partial-{live.pid}@{host}-abc"
        mine.mkdir()
        ok(invoke("sweep", gen_trace, "--out", tmp_path / "run", "--worker-queue-limit", "2", "--no-report",
                  "-q"))
        assert mine.is_dir()
    finally:
        live.kill()
        live.wait()


# ---------------------------------------------------------------------------
# B: concurrency


def test_two_forced_sweeps_into_one_out_the_later_wins_and_says_so(big, gen_trace, tmp_path):
    out = tmp_path / "run"
    ok(invoke("sweep", gen_trace, "--out", out, "--worker-queue-limit", "2", "--no-report", "-q"))
    a = cli("sweep", big, "--out", out, "--force", "--worker-queue-limit", "4,8", "--no-report", "-q")
    b = cli("sweep", big, "--out", out, "--force", "--worker-queue-limit", "5,6,7", "--no-report", "-q")
    ea, eb = a.communicate(timeout=300)[1], b.communicate(timeout=300)[1]
    assert a.returncode == 0 and b.returncode == 0, (ea, eb)
    won = [e for e in (ea, eb) if "this run finished later and replaces it" in e]
    assert len(won) == 1, (ea, eb)
    limits = pl.read_parquet(out / "summary.parquet")["worker_queue_limit"].to_list()
    assert limits == ([4, 8] if won[0] is ea else [5, 6, 7])
    assert hidden(tmp_path) == []


def test_two_sweeps_into_a_new_out_without_force_the_first_wins(big, tmp_path):
    out = tmp_path / "run"
    a = cli("sweep", big, "--out", out, "--worker-queue-limit", "4,8", "--no-report", "-q")
    b = cli("sweep", big, "--out", out, "--worker-queue-limit", "5,6,7", "--no-report", "-q")
    ea, eb = a.communicate(timeout=300)[1], b.communicate(timeout=300)[1]
    codes = sorted((a.returncode, b.returncode))
    assert codes == [0, 2], (ea, eb)
    loser = ea if a.returncode == 2 else eb
    assert "another run wrote it while this one ran" in loser and "the other run won" in loser
    limits = pl.read_parquet(out / "summary.parquet")["worker_queue_limit"].to_list()
    assert limits == ([4, 8] if a.returncode == 0 else [5, 6, 7])
    assert hidden(tmp_path) == []


# ---------------------------------------------------------------------------
# B: output paths


def test_bad_output_paths_get_one_line(gen_trace, tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    refused(invoke("sweep", gen_trace, "--out", f / "run", "-q"), "is a file, not a directory")
    refused(invoke("report", tmp_path / "nope", "--out", f / "r.html"), "is a file, not a directory")
    link = tmp_path / "dangling"
    os.symlink(tmp_path / "gone", link)
    refused(invoke("sweep", gen_trace, "--out", link, "-q"), "a symlink to", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    refused(invoke("sweep", gen_trace, "--out", ".", "-q"), "is the current directory")
    refused(invoke("generate", ".", "--requests", "10"), "is the current directory")
    refused(invoke("sweep", gen_trace, "--out", "..", "-q", "--force"), "current directory or above it")
    assert os.listdir(empty) == [] and sorted(os.listdir(tmp_path)) == ["dangling", "empty", "file"]


@contextlib.contextmanager
def _tmpfs(d: Path, opts: str):
    d.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()})")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture()
def small_disk(tmp_path):
    with _tmpfs(tmp_path / "disk", "size=256k") as d:
        yield d


@pytest.fixture()
def read_only(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as d:
        yield d


@pytest.fixture(scope="module")
def run_dir(gen_trace, tmp_path_factory):
    out = tmp_path_factory.mktemp("r") / "run"
    ok(invoke("sweep", gen_trace, "--out", out, *GRID, "-q"))
    return out


def test_a_read_only_parent_is_one_line(gen_trace, run_dir, read_only):
    refused(invoke("sweep", gen_trace, "--out", read_only / "run", "-q"), "cannot write into", str(read_only))
    refused(invoke("report", run_dir, "--out", read_only / "r.html"), "cannot write into")
    refused(invoke("check", run_dir, "--write-baseline", read_only / "b.json"), "cannot write into")
    refused(invoke("compare", run_dir, run_dir, "--out", read_only / "d"), "cannot write into")


def _fill(disk: Path) -> None:
    """Fill the tmpfs to the last byte."""
    with open(disk / "filler", "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_full_disk_is_one_line_and_leaves_nothing(gen_trace, run_dir, small_disk):
    out = small_disk / "run"
    refused(invoke("sweep", gen_trace, "--out", out, *GRID, "-q"), "no space left on device writing", str(out))
    assert os.listdir(small_disk) == []
    refused(invoke("report", run_dir, "--out", small_disk / "r.html"), "no space left on device writing")
    assert os.listdir(small_disk) == []
    _fill(small_disk)
    refused(invoke("compare", run_dir, run_dir, "--out", small_disk / "d"), "no space left on device writing")
    refused(invoke("check", run_dir, "--write-baseline", small_disk / "b.json"),
            "no space left on device writing", "b.json")
    refused(invoke("generate", small_disk / "t", "--requests", "2000"), "no space left on device writing")
    assert os.listdir(small_disk) == ["filler"]         # no partial folder, no 0-byte temporary


# ---------------------------------------------------------------------------
# B: knobs and grids the kernels cannot hold; D: report's bound


@pytest.mark.parametrize("args, needles", [
    (["--worker-queue-limit", str(2**63)], ["--worker-queue-limit", str(2**63), "2**63-1"]),
    (["--worker-queue-limit", str(2**64 + 5)], ["--worker-queue-limit", "2**63-1"]),
    (["--per-dp-rank", "--worker-queue-limit", str(2**62)], ["per rank x dp_size 2", "2**63-1"]),
    (["--freshness-ms", str(2**62)], ["--freshness-ms", "0..9223372036854"]),
    (["--worker-queue-limit", "1..100000"], ["100,000 configs", "10,000", "GiB", "split it"]),
    (["--worker-queue-limit", "1..200", "--saturation-queue-floor", "1..200"], ["configs", "10,000"]),
])
def test_knobs_and_grids_the_kernels_cannot_hold_are_refused_up_front(gen_trace, tmp_path, args, needles):
    t0 = time.perf_counter()
    refused(invoke("sweep", gen_trace, "--out", tmp_path / "run", *args, "-q"), *needles)
    assert os.listdir(tmp_path) == []
    assert time.perf_counter() - t0 < 60


def test_generate_refuses_a_fleet_it_cannot_hold(tmp_path):
    """generate bounds what one file holds (replay/trace/synthetic.py): --workers 10**7 is one line,
    exit 2, nothing written, before any allocation."""
    t0 = time.perf_counter()
    refused(invoke("generate", tmp_path / "t", "--workers", str(10**7)), "load rows in one file")
    assert os.listdir(tmp_path) == [] and time.perf_counter() - t0 < 10


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_report_refuses_a_bound_that_is_not_a_number(run_dir, tmp_path, value):
    refused(invoke("report", run_dir, "--out", tmp_path / "r.html", "--max-p99-waiting", value),
            "--max-p99-waiting must be a finite number")
    refused(invoke("recommend", run_dir, "--max-p99-waiting", value), "--max-p99-waiting must be a finite")
    assert os.listdir(tmp_path) == []


def test_debris_without_a_checkable_pid_goes_after_an_hour_untouched(gen_trace, tmp_path):
    """A partial folder of an older version (no pid in its name) or of another host: removed when
    nothing in it changed for an hour, kept while something did (a live run appends to it)."""
    old = tmp_path / ".run.partial-k2j4h5g6"
    old.mkdir()
    (old / "decisions.parquet").write_bytes(b"x")
    recent = tmp_path / ".run.partial-9@abcdef-zzz"          # another host's, still written to
    recent.mkdir()
    (recent / "decisions.parquet").write_bytes(b"x")
    hour_ago = time.time() - 3700
    for p in (old, old / "decisions.parquet", recent):
        os.utime(p, (hour_ago, hour_ago))
    res = ok(invoke("sweep", gen_trace, "--out", tmp_path / "run", "--worker-queue-limit", "2", "--no-report"))
    assert "removed 1 unfinished folder(s) left by killed runs (.run.partial-k2j4h5g6)" in res.stderr
    assert hidden(tmp_path) == [recent.name]


def test_a_full_disk_under_simulate_and_calibrate_is_one_line(small_disk):
    """The closed-loop commands map a full disk like the others: one line naming the output, exit 2,
    and no hidden partial folder is left (the fleet file calibrate finished before may stay)."""
    root = Path(__file__).resolve().parents[1]
    refused(invoke("simulate", root / "traces" / "sample-log" / "requests.jsonl", "--fleet",
                   root / "traces" / "sample-fleet.toml", "--publish-interval-ms", "10",  # about 620 KiB
                   "--out", small_disk / "sim", "-q"),
            "no space left on device writing")
    assert os.listdir(small_disk) == []
    refused(invoke("calibrate", root / "traces" / "sample", "--out", small_disk / "f.toml",
                   "--validate", small_disk / "v", "-q"), "no space left on device writing", str(small_disk / "v"))
    assert [n for n in os.listdir(small_disk) if n != "f.toml"] == []


@pytest.fixture()
def disk_2m(tmp_path):
    with _tmpfs(tmp_path / "disk2m", "size=2m") as d:
        yield d


def _fill_leaving(disk: Path, kib: int) -> None:
    """Fill the tmpfs so that about ``kib`` KiB stay free."""
    (disk / "filler").unlink(missing_ok=True)
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - kib * 1024))


@pytest.mark.parametrize("kib", [1, 8, 64, 400])
def test_a_nearly_full_disk_is_no_space_left_whichever_writer_hits_it(gen_trace, run_dir, disk_2m, kib):
    """polars' Parquet writer hides the os error of a failed write ("Invalid thrift: transport
    error"): on a nearly full disk sweep, compare and report still say "no space left" in one line,
    exit 2, and keep nothing partial; what fits is written whole."""
    other = disk_2m.parent / "other"
    if not other.exists():
        ok(invoke("sweep", gen_trace, "--out", other, "--worker-queue-limit", "3,5", "-q"))
    cases = [("run", ["sweep", gen_trace, "--out", disk_2m / "run", *GRID, "-q"]),
             ("d", ["compare", run_dir, other, "--out", disk_2m / "d"]),
             ("r.html", ["report", run_dir, "--out", disk_2m / "r.html"])]
    for name, args in cases:
        _fill_leaving(disk_2m, kib)
        res = invoke(*args)
        if res.exit_code == 0:
            assert (disk_2m / name).exists()
            shutil.rmtree(disk_2m / name) if (disk_2m / name).is_dir() else (disk_2m / name).unlink()
        else:
            refused(res, "no space left on device writing", str(disk_2m / name))
        assert os.listdir(disk_2m) == ["filler"], (args[0], os.listdir(disk_2m))


SAMPLE_LOG = Path(__file__).resolve().parents[1] / "traces" / "sample-log" / "requests.jsonl"
SAMPLE_FLEET = Path(__file__).resolve().parents[1] / "traces" / "sample-fleet.toml"
SAMPLE_TRACE = Path(__file__).resolve().parents[1] / "traces" / "sample"


@pytest.mark.parametrize("args, needles", [
    (["--seeds", str(2**63)], ["--seeds", "10,000", "TiB"]),
    (["--seeds", str(10**12)], ["--seeds", "1,000,000,000,000", "TiB"]),
    (["--dp-size", "1,100000"], ["--dp-size", "100,000", "1,024"]),
    (["--workers", "0"], ["--workers", "0", ">= 1"]),
    (["--workers", "0,4"], ["--workers", ">= 1"]),
])
def test_simulate_refuses_counts_it_cannot_hold_naming_the_option(tmp_path, args, needles):
    t0 = time.perf_counter()
    line = refused(invoke("simulate", SAMPLE_LOG, "--fleet", SAMPLE_FLEET, "--out", tmp_path / "sim",
                          "--requests", "50", "-q", *args), *needles)
    assert "sample-fleet.toml" not in line          # the option is to blame, not the fleet file
    assert os.listdir(tmp_path) == [] and time.perf_counter() - t0 < 30


@pytest.mark.parametrize("seeds, needles", [(str(2**63), ["--seeds", "TiB"]), (str(10**12), ["--seeds", "TiB"]),
                                            ("0", ["--seeds", "count >= 1"])])
def test_calibrate_refuses_seeds_before_the_fit(tmp_path, seeds, needles):
    t0 = time.perf_counter()
    refused(invoke("calibrate", SAMPLE_TRACE, "--out", tmp_path / "f.toml", "--validate", tmp_path / "v",
                   "--worker-queue-limit", "2", "--seeds", seeds, "-q"), *needles)
    assert os.listdir(tmp_path) == [] and time.perf_counter() - t0 < 30


@pytest.mark.parametrize("lag", ["nan", "inf"])
def test_import_refuses_a_lag_that_is_not_a_number(tmp_path, lag):
    log = tmp_path / "log.jsonl"
    log.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n')
    refused(invoke("import", "--out", tmp_path / "t", "--mooncake", log, "--index-lag-ms", lag),
            "--index-lag-ms", "finite" if lag == "nan" else "0<=x<=1000000000")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]


def test_record_refuses_ports_past_65535_and_ranks_it_cannot_open(tmp_path):
    pytest.importorskip("zmq")
    pytest.importorskip("msgpack")
    out = tmp_path / "rec"
    refused(invoke("record", "--worker", "http://127.0.0.1:9", "--out", out, "--load-port-base", "65535",
                   "--kv-port-base", "65530", "--dp-size", "8", "--page-size", "16", "--duration", "1s"),
            "--load-port-base 65535", "65,542", "above 65535")
    assert not out.exists()
    info = {"dp_size": 10**7, "page_size": 16,
            "kv_events": {"dp_size": 10**7, "block_size": 16, "endpoint_port_base": 5557,
                          "load_endpoint_port_base": 5600, "load_topic": ""}}
    from capture_fleet import free_ports, serve_server_info  # needs msgpack, as record does

    port = free_ports(1)[0]
    server = serve_server_info(port, lambda: info)
    try:
        url = f"http://127.0.0.1:{port}"
        line = refused(invoke("record", "--worker", url, "--out", out, "--duration", "1s"), url, "10,000,000 ranks")
    finally:
        server.shutdown()
        server.server_close()
    assert "Too many open files" not in line and not out.exists()


def test_an_empty_recording_is_never_complete(tmp_path):
    """A recording that received nothing (the engine's publishers never sent) says complete: false."""
    pytest.importorskip("zmq")
    import json
    out = tmp_path / "rec"
    with socket.socket() as s1, socket.socket() as s2:
        s1.bind(("127.0.0.1", 0))
        s2.bind(("127.0.0.1", 0))
        p1, p2 = s1.getsockname()[1], s2.getsockname()[1]
    ok(invoke("record", "--worker", "http://127.0.0.1:9", "--out", out, "--load-port-base", p1,
              "--kv-port-base", p2, "--dp-size", "1", "--page-size", "16", "--duration", "1s"))
    assert json.loads((out / "record.json").read_text())["complete"] is False


FLEET = Path(__file__).resolve().parents[1] / "traces" / "sample-fleet.toml"


def _signal_once_written(proc: subprocess.Popen, written: Path, sig: int) -> tuple[int, str]:
    """Send ``sig`` as soon as ``written`` is in place (polled every few ms)."""
    t0 = time.monotonic()
    while not written.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 300, "never written"
        time.sleep(0.002)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_after_the_output_is_in_place_lets_the_command_finish(tmp_path, sig):
    """A stop signal landing once the output was swapped in (while the command printed, or during
    the interpreter's teardown, whose handlers are the default ones) killed the process (exit -15)
    or said "nothing of this run was kept" beside a complete new output.  Now the command finishes:
    exit 0, the output whole, and with two outputs (calibrate's validation folder, then its fleet
    file) both from this run."""
    out = tmp_path / "sim"
    code, err = _signal_once_written(cli("simulate", SAMPLE_LOG, "--fleet", FLEET, "--out", out,
                                         "--requests", "100", "-q"), out, sig)
    assert code == 0, (code, err)
    assert "nothing of this run was kept" not in err and "Traceback" not in err, err
    assert pl.read_parquet(out / "requests.parquet").height == 100 and hidden(tmp_path) == []
    sample = Path(__file__).resolve().parents[1] / "traces" / "sample"
    fleet, vdir = tmp_path / "fleet.toml", tmp_path / "v"
    code, err = _signal_once_written(cli("calibrate", sample, "--out", fleet, "--validate", vdir, "-q"), vdir, sig)
    assert code == 0, (code, err)
    assert "nothing of this run was kept" not in err and "Traceback" not in err, err
    assert fleet.is_file() and (vdir / "fidelity.json").is_file() and hidden(tmp_path) == []


def test_an_interrupted_grid_says_what_it_kept_for_resume(tmp_path):
    """A closed-loop grid keeps its finished simulations for --resume when interrupted, and said
    "nothing of this run was kept" beside them.  The line names the folder and --resume; the
    resumed run completes and leaves nothing hidden."""
    out = tmp_path / "grid"
    args = ["simulate", SAMPLE_LOG, "--fleet", FLEET, "--out", out, "--worker-queue-limit", "1..12", "--seeds", "3",
            "--requests", "1000", "-q"]
    proc = cli(*args)
    work = tmp_path / ".grid.resume"
    t0 = time.monotonic()
    while not (work / "config-0").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 300
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, err)
    assert err.strip().splitlines() == [f"interrupted (SIGTERM): nothing complete was written; what finished is kept "
                                        f"in {work}: run again with --resume to go on from it"], err
    assert not out.exists() and work.is_dir()
    ok(invoke(*args, "--resume"))
    assert (out / "closed_loop_summary.parquet").is_file() and hidden(tmp_path) == []


def test_a_grid_on_a_full_disk_says_what_it_kept_for_resume(small_disk):
    line = refused(invoke("simulate", SAMPLE_LOG, "--fleet", FLEET, "--out", small_disk / "grid",
                          "--worker-queue-limit", "2,4", "--requests", "1000", "--publish-interval-ms", "10", "-q"),
                   "no space left on device writing")
    assert (small_disk / ".grid.resume").is_dir()       # kept, as an interrupted grid keeps it
    assert line.endswith(f"what finished is kept in {small_disk / '.grid.resume'}: run again with --resume "
                         "to go on from it"), line
