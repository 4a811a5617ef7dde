"""The Ray executor (``sweep --executor ray``, replay/sweep/shards.py) on a local Ray.

Every sharded run is held against the local in-memory sweep of the same trace
set: summary, decisions, fleet table and trace facts must be identical, for
config blocks and windows of any size.  Failures: a transient task failure is
retried and changes nothing; a permanent one names the shard's time range and
leaves no run behind; bad input found by a task names the file and row.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from replay import run_sweep
from replay.config import Grid
from replay.errors import ReplayError
from replay.sweep.run import decision_files
from replay.sweep.shards import FAULT_ENV, config_blocks, iso
from replay.trace import TraceError
from replay.trace.synthetic import generate_trace_set

ray = pytest.importorskip("ray")

NS = 1_000_000_000
GRID = {"--worker-queue-limit": "none,2,4", "--saturation-queue-floor": "none,1,2"}
KEY = ["request_id", "config_id"]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray (2 CPUs) for the in-process tests of this module."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def set_dir(tmp_path_factory):
    """A trace set: 2400 requests over 3 partitions of 20 s (requests/, loads/ folders)."""
    d = tmp_path_factory.mktemp("shards") / "set"
    generate_trace_set(d, n_requests=2400, n_workers=6, dp_size=2, max_matches=6, seed=5,
                       rate_per_s=40.0, partition_s=20)
    return d


@pytest.fixture(scope="module")
def local_run(set_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "run"
    return run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=False, window="none")


def _decisions(run_dir: Path) -> pl.DataFrame:
    files = decision_files(run_dir)
    assert files, f"no decisions in {run_dir}"
    return pl.concat([pl.read_parquet(f) for f in files]).sort(KEY)


def _assert_same_run(a, b) -> None:
    assert_frame_equal(a.summary, b.summary)
    assert_frame_equal(_decisions(a.run_dir), _decisions(b.run_dir))
    assert_frame_equal(pl.read_parquet(a.run_dir / "fleet.parquet"), pl.read_parquet(b.run_dir / "fleet.parquet"))
    assert a.run["trace"]["facts"] == b.run["trace"]["facts"]
    assert a.run["trace"]["files"] == b.run["trace"]["files"]


@pytest.mark.parametrize("window,per_task", [("7s", None), ("1s", 4), ("1h", 1)])
def test_ray_equals_local(local_ray, set_dir, local_run, tmp_path, window, per_task):
    out = tmp_path / "run"
    res = run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=False, executor="ray", window=window,
                    configs_per_task=per_task)
    _assert_same_run(local_run, res)
    ex = res.run["execution"]
    n_cfg = res.summary.height
    blocks = len(config_blocks(n_cfg, per_task))
    assert ex["executor"] == "ray" and ex["config_blocks"] == blocks
    assert ex["tasks"] == ex["windows"] * blocks
    listed = json.loads((out / "run.json").read_text())["decisions"]
    assert isinstance(listed, list) and listed and all((out / f).is_file() for f in listed)
    assert all(f.startswith("decisions/part-") for f in listed)
    assert not (out / "fleet-parts").exists()


def test_ray_default_window_shards_a_small_trace(local_ray, set_dir, local_run, tmp_path):
    res = run_sweep(set_dir, Grid.from_texts(GRID), out=tmp_path / "run", report=False, executor="ray")
    assert res.run["execution"]["windows"] > 1      # auto would replay in memory; Ray shards it
    _assert_same_run(local_run, res)


def test_transient_failure_is_retried(local_ray, set_dir, local_run, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1")              # window 1 fails on its first attempt only
    res = run_sweep(set_dir, Grid.from_texts(GRID), out=tmp_path / "run", report=False, executor="ray",
                    window="10s")
    _assert_same_run(local_run, res)


def test_permanent_failure_names_the_shard_and_writes_nothing(local_ray, set_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv(FAULT_ENV, "2:always")
    with pytest.raises(ReplayError) as err:
        run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=False, executor="ray", window="10s",
                  ray_retries=1)
    msg = str(err.value)
    from replay.trace import TraceSet

    bounds = TraceSet.open(set_dir, hash_files=False).window_bounds(10 * NS)
    t0, t1 = bounds[2]
    assert f"window 2 ({iso(t0)} to {iso(t1)})" in msg
    assert "after 2 attempt(s)" in msg and "InjectedFault" in msg
    assert "\n" not in msg
    assert list(tmp_path.iterdir()) == []           # no run, no partial run beside it


def test_failed_forced_run_keeps_the_old_run(local_ray, set_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    first = run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=False, window="none")
    before = (out / "summary.parquet").read_bytes()
    monkeypatch.setenv(FAULT_ENV, "0:always")
    with pytest.raises(ReplayError):
        run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=False, executor="ray", window="10s",
                  ray_retries=0, force=True)
    assert (out / "summary.parquet").read_bytes() == before
    assert first.run_dir == out


def test_bad_input_in_one_partition_is_reported_with_file_and_row(local_ray, set_dir, tmp_path):
    d = tmp_path / "set"
    shutil.copytree(set_dir, d)
    parts = sorted((d / "requests").rglob("*.parquet"))
    victim = parts[1]
    df = pl.read_parquet(victim)
    df = df.with_columns(pl.when(pl.int_range(pl.len()) == 17).then(-3).otherwise(pl.col("input_tokens"))
                         .alias("input_tokens"))
    df.write_parquet(victim)
    out = tmp_path / "run"
    with pytest.raises(TraceError) as err:
        run_sweep(d, Grid.from_texts(GRID), out=out, report=False, executor="ray", window="5s")
    rel = victim.relative_to(d).as_posix()
    assert str(err.value).startswith(f"{rel}: column 'input_tokens' row 17: must be >= 0, got -3")
    assert not out.exists()


def test_report_and_compare_read_sharded_decisions(local_ray, set_dir, local_run, tmp_path):
    from click.testing import CliRunner

    from replay.cli import main

    out = tmp_path / "run"
    run_sweep(set_dir, Grid.from_texts(GRID), out=out, report=True, executor="ray", window="10s",
              configs_per_task=3)
    assert (out / "report.html").is_file()
    res = CliRunner().invoke(main, ["compare", str(local_run.run_dir), str(out)])
    assert res.exit_code == 0, res.output
    assert "request-config pairs" in res.output and " 0 request-config pairs" in res.output


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "replay", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_cli_on_an_existing_cluster(set_dir, local_run, tmp_path):
    """`ray start --head` makes a cluster; the CLI joins it with --ray-address."""
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin) if ray_bin.exists() else "ray"]
    import os
    import secrets

    port = 6390 + (hash(str(tmp_path)) % 200)
    # token authentication, as a shared cluster should run (Ray >= 2.52)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    head = subprocess.Popen([*cmd, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        out = tmp_path / "run"
        res = None
        for _ in range(3):  # the head takes a few seconds to accept drivers
            import time

            time.sleep(4)
            res = _cli("sweep", str(set_dir), "--out", str(out), "--executor", "ray", "--ray-address",
                       f"127.0.0.1:{port}", "--window", "15s", "--no-report", "--force",
                       *[x for kv in GRID.items() for x in kv], env=env)
            if res.returncode == 0:
                break
        assert res.returncode == 0, res.stderr
        assert "Ray tasks)" in res.stdout
        run = json.loads((out / "run.json").read_text())
        assert run["execution"]["ray_address"] == f"127.0.0.1:{port}"
        assert_frame_equal(pl.read_parquet(out / "summary.parquet"), local_run.summary)
    finally:
        import signal

        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def test_cli_failure_is_one_line_exit_2(set_dir, tmp_path):
    import os

    env = dict(os.environ, **{FAULT_ENV: "0:always"})
    out = tmp_path / "run"
    res = _cli("sweep", str(set_dir), "--out", str(out), "--executor", "ray", "--ray-cpus", "2",
               "--ray-retries", "0", "--window", "30s", "--no-report", *[x for kv in GRID.items() for x in kv],
               env=env)
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "window 0 (" in lines[0] and "Traceback" not in res.stderr
    assert not out.exists()


def test_a_ray_address_where_nothing_listens_fails_fast_in_one_line(set_dir, tmp_path):
    """Ray's client waits for a cluster's GCS without end: the sweep gives up in bounded time, one
    line naming --ray-address, exit 2, nothing written (a real child process, no Ray started)."""
    import os
    import socket
    import time

    with socket.socket() as s:          # a port nothing listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "replay", "sweep", str(set_dir), "--out", str(out),
                          "--worker-queue-limit", "2", "--executor", "ray", "--ray-address", f"127.0.0.1:{port}",
                          "-q"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --ray-address 127.0.0.1:{port}: nothing listens"), lines
    assert time.monotonic() - t0 < 60
    assert os.listdir(tmp_path) == []
