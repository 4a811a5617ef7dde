"""Grids and plans on a Ray cluster: a real two-node cluster (``ray.cluster_utils.Cluster``).

``simulate --executor ray --ray-address`` joins it as a user joins an existing cluster; the
output is byte for byte the local run's.  Failures are real: ``ROUTER_REPLAY_FAULT_TASKS``
(read by the pool in the driver) makes one task raise and another end its worker process
on their first attempt, and Ray's retries must recover both; a task that fails every attempt
ends the run in one line, and ``--resume`` then goes on from what finished.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_plan import fleet_file, periodic_log
from test_resume import tree

from replay.sweep.pool import FAULT_ENV

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT)          # the nodes' workers import this checkout
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def cli(args, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    e.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "replay", *map(str, args)], env=e, capture_output=True,
                          text=True, timeout=900)


def test_grid_and_plan_on_a_two_node_cluster_equal_the_local_run(tmp_path, cluster):
    assert len(cluster.list_all_nodes()) == 2
    periodic_log(tmp_path / "log.jsonl", 200, 20.0)
    fleet_file(tmp_path / "fleet.toml", 40960.0, workers=2)
    base = ["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "-q",
            "--worker-queue-limit", "none,4"]
    plan = [*base, "--workers", "1,2", "--load-scale", "1,1.5", "--seeds", "2"]
    ray = ["--executor", "ray", "--ray-address", cluster.address]

    r = cli([*plan, "--out", tmp_path / "local", "--threads", "2"])
    assert r.returncode == 0, r.stderr
    # task 1 raises once, task 2's worker process dies once: both retried by Ray
    r = cli([*plan, "--out", tmp_path / "ray", *ray], **{FAULT_ENV: "1,2:exit"})
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "ray") == tree(tmp_path / "local")

    r = cli([*base, "--seeds", "0,3", "--out", tmp_path / "grid-local"])
    assert r.returncode == 0, r.stderr
    r = cli([*base, "--seeds", "0,3", "--out", tmp_path / "grid-ray", *ray], **{FAULT_ENV: "0"})
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "grid-ray") == tree(tmp_path / "grid-local")
    # the same worker death without a retry fails: the fault is real, and the retry is what saved it
    r = cli([*base, "--seeds", "0,3", "--out", tmp_path / "no-retry", *ray, "--ray-retries", "0"],
            **{FAULT_ENV: "1:exit"})
    assert r.returncode == 2 and "config 0 seed 3 failed after 1 attempt(s)" in r.stderr, r.stderr


def test_a_task_failing_every_retry_ends_the_plan_in_one_line_and_resume_finishes_it(tmp_path, cluster):
    periodic_log(tmp_path / "log.jsonl", 120, 20.0)
    fleet_file(tmp_path / "fleet.toml", 40960.0)
    plan = ["simulate", tmp_path / "log.jsonl", "--fleet", tmp_path / "fleet.toml", "-q",
            "--worker-queue-limit", "none,4", "--workers", "1,2", "--seeds", "2",
            "--executor", "ray", "--ray-address", cluster.address]
    r = cli([*plan, "--out", tmp_path / "whole"])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan"
    r = cli([*plan, "--out", out, "--ray-retries", "1"], **{FAULT_ENV: "5:always"})
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert "x1-w2-dp1: config 0 seed 1 failed after 2 attempt(s)" in line and "--resume" in line, line
    assert not out.exists() and (tmp_path / ".plan.resume").is_dir()
    r = cli([*plan, "--out", out, "--resume"])
    assert r.returncode == 0, r.stderr
    assert tree(out) == tree(tmp_path / "whole")
