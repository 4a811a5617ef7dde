"""Grids and plans as one journaled pool: an interrupted run goes on with --resume.

A real plan process is stopped by a signal once it has journaled a few simulations; the
same command with ``--resume`` skips them (their files are not rewritten) and the output
is byte for byte the one an uninterrupted run writes.  A grid stopped by a real failure
(``ROUTER_REPLAY_FAULT_TASKS``, read from the environment by the pool) resumes the same way.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_plan import fleet_file, periodic_log

from replay.config import Grid, RouterConfig
from replay.simulate import load_fleet, read_log, simulate_grid
from replay.simulate.batch import JOURNAL, log_digest, task_key
from replay.sweep.pool import FAULT_ENV, InjectedFault

ROOT = Path(__file__).resolve().parents[1]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too) by relative path: its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def stamps(root: Path, subs: list[str]) -> dict[str, tuple[int, int]]:
    return {s: ((root / s / "requests.parquet").stat().st_ino, (root / s / "requests.parquet").stat().st_mtime_ns)
            for s in subs}


def journal_subs(path: Path) -> list[str]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["sub"])
        except ValueError:
            pass
    return out


def plan_cmd(tmp: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "replay", "simulate", str(tmp / "log.jsonl"), "--fleet", str(tmp / "fleet.toml"),
            "--out", str(out), "--workers", "1,2", "--load-scale", "1,2", "--seeds", "2", "--threads", "1",
            "--worker-queue-limit", "none,4", "-q"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_plan_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, sig):
    periodic_log(tmp_path / "log.jsonl", 1500, 40.0)
    fleet_file(tmp_path / "fleet.toml", 40960.0)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    whole = tmp_path / "whole"
    subprocess.run(plan_cmd(tmp_path, whole), env=env, check=True, timeout=900)
    out = tmp_path / "plan"
    work = tmp_path / ".plan.resume"
    p = subprocess.Popen(plan_cmd(tmp_path, out), env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(journal_subs(work / JOURNAL)) < 3 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "the plan ended before it could be interrupted"
    p.send_signal(sig)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert not out.exists()                     # nothing that looks complete
    done = journal_subs(work / JOURNAL)
    n_jobs = 2 * 2 * 2 * 2
    assert 3 <= len(done) < n_jobs
    before = stamps(work, done)

    res = subprocess.run(plan_cmd(tmp_path, out) + ["--resume"], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr
    assert not work.exists()
    assert stamps(out, done) == before          # the journaled simulations were not run again
    assert tree(out) == tree(whole)


def test_without_resume_a_plan_starts_over_and_resume_needs_matching_inputs(tmp_path):
    periodic_log(tmp_path / "log.jsonl", 60, 10.0)
    fleet_file(tmp_path / "fleet.toml", 40960.0)
    log = read_log(tmp_path / "log.jsonl")
    fleet = load_fleet(tmp_path / "fleet.toml")
    kw = dict(publish_interval_ms=10, index_lag_ms=0, freshness_ms=5000)
    h = log_digest(log)
    base = task_key(h, fleet, RouterConfig(), 0, "config-0", kw)
    assert base == task_key(log_digest(read_log(tmp_path / "log.jsonl")), fleet, RouterConfig(), 0, "config-0", kw)
    other_log = read_log(tmp_path / "log.jsonl", limit=59)
    assert len({base,
                task_key(h, fleet, RouterConfig(), 1, "config-0", kw),
                task_key(h, fleet, RouterConfig(worker_queue_limit=4), 0, "config-0", kw),
                task_key(h, load_fleet(tmp_path / "fleet.toml", workers=2, resize=True), RouterConfig(), 0,
                         "config-0", kw),
                task_key(h, fleet, RouterConfig(), 0, "config-0", dict(kw, freshness_ms=100)),
                task_key(log_digest(other_log), fleet, RouterConfig(), 0, "config-0", kw)}) == 6


def test_a_grid_stopped_by_a_failed_simulation_resumes(tmp_path, monkeypatch):
    periodic_log(tmp_path / "log.jsonl", 300, 20.0)
    fleet_file(tmp_path / "fleet.toml", 40960.0, workers=2)
    log = read_log(tmp_path / "log.jsonl")
    fleet = load_fleet(tmp_path / "fleet.toml")
    grid = Grid({"worker_queue_limit": [None, 2, 4]})
    whole = simulate_grid(log, fleet, grid, tmp_path / "whole", seeds=[0, 5], threads=1)
    out = tmp_path / "grid"
    monkeypatch.setenv(FAULT_ENV, "3:always")   # the fourth simulation fails, every time
    with pytest.raises(InjectedFault):
        simulate_grid(log, fleet, grid, out, seeds=[0, 5], threads=1)
    work = tmp_path / ".grid.resume"
    done = journal_subs(work / JOURNAL)
    assert done == ["config-0/seed-0", "config-0/seed-5", "config-1/seed-0"] and not out.exists()
    before = stamps(work, done)
    monkeypatch.delenv(FAULT_ENV)
    again = simulate_grid(log, fleet, grid, out, seeds=[0, 5], threads=2, resume=True)
    assert again.equals(whole)
    assert stamps(out, done) == before
    assert tree(out) == tree(tmp_path / "whole")
    # without resume the next run starts over: the journal of a stopped run is dropped
    monkeypatch.setenv(FAULT_ENV, "0:always")
    with pytest.raises(InjectedFault):
        simulate_grid(log, fleet, grid, tmp_path / "g2", seeds=[0], threads=1)
    monkeypatch.delenv(FAULT_ENV)
    simulate_grid(log, fleet, grid, tmp_path / "g2", seeds=[0], threads=1)
    assert not (tmp_path / ".g2.resume").exists() and (tmp_path / "g2" / "closed_loop_summary.parquet").is_file()
