"""Long commands show progress: a line every ~10 s when stderr is piped, a bar on a terminal.

The commands run as a user runs them, in a subprocess whose stderr is a pipe; the
interval is set to 0 s (``ROUTER_REPLAY_PROGRESS_S``) so that every step prints.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from replay.capture.from_sim import engine_dirs
from replay.cli import main
from replay.cli.progress import INTERVAL_ENV, PipedStatus, Progress

ROOT = Path(__file__).resolve().parents[1]
LOG = ROOT / "traces" / "sample-log" / "requests.jsonl"
FLEET = ROOT / "traces" / "sample-fleet.toml"


def cli(*args, every="0") -> subprocess.CompletedProcess:
    env = {**os.environ, INTERVAL_ENV: every}
    p = subprocess.run([sys.executable, "-m", "replay", *map(str, args)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return p


def lines(stderr: str, label: str) -> list[tuple[int, int]]:
    return [(int(a.replace(",", "")), int(b.replace(",", "")))
            for a, b in re.findall(rf"^{label}: ([\d,]+) of ([\d,]+) \(\d+%\)$", stderr, flags=re.M)]


def test_progress_helper_lines_bar_and_quiet(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    out = io.StringIO()
    with Progress("work", 4, stream=out, tty=False) as p:
        for _ in range(4):
            p.update()
    assert out.getvalue().splitlines() == [f"work: {i} of 4 ({25 * i}%)" for i in range(1, 5)]
    out = io.StringIO()
    with Progress("work", 4, stream=out, tty=False, quiet=True) as p:
        p.update(4)
    assert out.getvalue() == ""
    monkeypatch.setenv(INTERVAL_ENV, "3600")        # piped, slower than the work: no line at all
    out = io.StringIO()
    with Progress("work", 4, stream=out, tty=False) as p:
        p.update(4)
    assert out.getvalue() == ""
    out = io.StringIO()
    with Progress("work", 10, stream=out, tty=True) as p:   # a terminal: click's bar
        p.at(5, 10)
        p.at(10, 10)
    # click's bar (it draws only on a real terminal, so a StringIO gets its label): no piped lines
    assert out.getvalue().startswith("work") and " of " not in out.getvalue()
    monkeypatch.setenv(INTERVAL_ENV, "0")
    out = io.StringIO()
    s = PipedStatus(out)
    s.show("recording: 10 rows")
    s.clear()
    assert out.getvalue() == "recording: 10 rows\n"


def test_simulate_grid_and_plan_print_lines_when_piped(tmp_path):
    p = cli("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out", tmp_path / "g",
            "--worker-queue-limit", "none,2,4")
    n = pl.read_parquet(tmp_path / "g" / "closed_loop_summary.parquet").height
    got = lines(p.stderr, "simulating")
    assert got and got[-1] == (n, n) and [a for a, _ in got] == sorted(a for a, _ in got), p.stderr
    p = cli("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out", tmp_path / "plan",
            "--workers", "2,4", "--worker-queue-limit", "none,4")
    got = lines(p.stderr, "planning")
    assert got and got[-1][0] == got[-1][1] == 4, p.stderr
    # the default interval: a short job prints no progress line at all
    p = cli("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out", tmp_path / "g2",
            "--worker-queue-limit", "none,2", every="10")
    assert not lines(p.stderr, "simulating"), p.stderr


def test_calibrate_validate_and_sweep_print_lines_when_piped(tmp_path):
    p = cli("calibrate", ROOT / "traces" / "sample", "--out", tmp_path / "fleet.toml", "--validate",
            tmp_path / "fit", "--worker-queue-limit", "none,4")
    # forced placement, the router in the loop, and the loop nudged (agreement's own drift)
    assert lines(p.stderr, "validating")[-1] == (3, 3), p.stderr
    assert lines(p.stderr, "simulating")[-1] == (2, 2), p.stderr
    p = cli("sweep", ROOT / "traces" / "sample", "--out", tmp_path / "run", "--worker-queue-limit", "none,4",
            "--no-report")
    got = lines(p.stderr, "replaying")
    assert got and got[-1][0] == got[-1][1], p.stderr


def test_simulate_capture_out_prints_lines_when_piped(tmp_path):
    cap = tmp_path / "cap"
    p = cli("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out", tmp_path / "sim", "--capture-out", cap,
            "--worker-queue-limit", 4)
    got = lines(p.stderr, "capture formats")
    assert got and got[-1] == (300, 300), p.stderr[-1500:]
    assert (cap / "trace.json").is_file()
    # and nothing when the interval is longer than the run
    q = cli("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out", tmp_path / "sim2", "--capture-out",
            tmp_path / "cap2", "--worker-queue-limit", 4, every="3600")
    assert not lines(q.stderr, "capture formats"), q.stderr[-1500:]


def test_import_prints_lines_when_piped(tmp_path):
    cap = tmp_path / "cap"
    # written in-process: a fresh `router-replay simulate --capture-out` does not know the capture output
    # kind (its registration is imported with replay.capture, which this module imports)
    r = CliRunner().invoke(main, [str(a) for a in ("simulate", LOG, "--fleet", FLEET, "--requests", 300, "--out",
                                                   tmp_path / "sim", "--capture-out", cap, "--worker-queue-limit", 4)])
    assert r.exit_code == 0, r.output
    args = ["import", "--out", tmp_path / "imp", "--token-export", cap / "token_export", "--recorded",
            cap / "recorded", "--router-inflight", "derived"]
    for url, d in engine_dirs(cap):
        args += ["--engine-export", f"{url}={d}"]
    p = cli(*args)
    found = re.findall(r"^([a-z][\w .-]*): [\d,]+ of [\d,]+ \(\d+%\)$", p.stderr, flags=re.M)
    if not found:
        pytest.fail(f"no progress line from import: {p.stderr[-1500:]}")
