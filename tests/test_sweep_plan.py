"""run_sweep's plan step (memory or windows from file metadata), the executor
interface, and the Grid that resolves --per-dp-rank itself.  Real traces on disk, real sweeps."""

from __future__ import annotations

import shutil

import pytest
from polars.testing import assert_frame_equal

from replay import run_sweep
from replay.config import ConfigError, Grid
from replay.errors import ReplayError
from replay.sweep import executors
from replay.sweep.run import plan
from replay.trace import NS
from replay.trace import windows as trace_windows

GRID = {"worker_queue_limit": "none,2,4", "saturation_queue_floor": "none,1,2"}


def test_a_small_trace_replays_in_memory_without_an_index(gen_trace):
    p = plan(gen_trace, None, executors.LocalExecutor())
    assert p.window_ns == 0 and p.tset is None
    assert p.why.startswith("1,500 requests and ")
    assert "fit in memory" in p.why


def test_a_trace_over_the_metadata_limit_is_indexed_and_windowed(gen_trace, monkeypatch):
    monkeypatch.setattr(trace_windows, "AUTO_IN_MEMORY_REQUESTS", 1000)
    monkeypatch.setattr(trace_windows, "AUTO_WINDOW_REQUESTS", 300)
    p = plan(gen_trace, None, executors.LocalExecutor())
    assert p.tset is not None and p.window_ns >= NS and p.window_ns % NS == 0
    assert p.tset.n_requests == 1500


def test_explicit_windows_and_executors_that_need_them(gen_trace):
    assert plan(gen_trace, 0, executors.LocalExecutor()).tset is None
    p = plan(gen_trace, 2 * NS, executors.LocalExecutor())
    assert p.window_ns == 2 * NS and p.tset is not None
    ray = executors.RayExecutor()
    p = plan(gen_trace, 0, ray)                  # a Ray sweep is always cut, even --window none
    assert p.tset is not None and p.window_ns == executors.shard_window(p.tset)
    with pytest.raises(ReplayError, match="window must be a whole number of seconds"):
        plan(gen_trace, NS // 2, executors.LocalExecutor())


def test_a_footer_the_plan_cannot_read_is_named_by_the_index_pass(gen_trace, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(gen_trace, bad)
    (bad / "loads.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ReplayError, match="loads.parquet: unreadable Parquet"):
        plan(bad, None, executors.LocalExecutor())


def test_the_executor_interface(gen_trace):
    with pytest.raises(ReplayError, match="executor must be one of local, ray, got 'dask'"):
        executors.executor("dask")
    with pytest.raises(ReplayError, match="retries applies to the ray executor, not local"):
        executors.executor("local", retries=3)
    with pytest.raises(ReplayError, match="configs_per_task must be >= 1"):
        executors.executor("ray", configs_per_task=0)
    assert isinstance(executors.executor("ray", address="auto"), executors.RayExecutor)
    # an Executor instance is accepted where the name is; the windowed and whole replays agree
    by_name = run_sweep(gen_trace, GRID, window=0)
    by_object = run_sweep(gen_trace, GRID, window=3 * NS, executor=executors.LocalExecutor())
    assert by_object.run["execution"]["executor"] == "local" and by_object.run["execution"]["windows"] > 1
    assert_frame_equal(by_name.summary, by_object.summary)


def test_the_grid_resolves_per_dp_rank_itself(gen_trace):
    per = Grid.from_texts({"--worker-queue-limit": "1,2", "--saturation-queue-floor": "none,1"}, per_dp_rank=True)
    assert per.per_dp_rank and per.dp_size is None
    scaled = per.resolve([2, 2, 2])
    assert scaled.dp_size == 2 and [c.worker_queue_limit for c in scaled.configs] == [2, 2, 4, 4]
    assert scaled.resolve([2]) is scaled                        # already resolved
    plain = Grid(GRID)
    assert plain.resolve([1, 2]) is plain                       # not per rank: nothing to resolve
    with pytest.raises(ConfigError, match="one dp_size across the fleet, found 1, 2"):
        per.resolve([1, 2])
    # the sweep resolves it against the trace's fleet (dp_size 2 in gen_trace)
    res = run_sweep(gen_trace, per, window=0)
    assert res.grid.dp_size == 2 and res.run["per_dp_rank"] is True
    assert res.summary["worker_queue_limit"].to_list() == [2, 2, 4, 4]
    assert res.summary["per_rank_limit"].to_list() == [1, 1, 2, 2]


def test_library_errors_name_parameters_and_the_cli_names_flags(gen_trace, tmp_path):
    """run_sweep says ``seed``/``freshness_ms`` (its parameters); the CLI says ``--seed`` /
    ``--freshness-ms`` for the same mistake."""
    from click.testing import CliRunner

    from replay.cli import main
    from replay.errors import ParamError

    with pytest.raises(ParamError, match=r"^seed must be in 0\.\.") as err:
        run_sweep(gen_trace, GRID, seed=-1)
    assert err.value.param == "seed" and err.value.flag == "--seed"
    with pytest.raises(ParamError, match=r"^freshness_ms must be in 0\.\."):
        run_sweep(gen_trace, GRID, freshness_ms=2**62)
    with pytest.raises(ParamError, match=r"^retries applies to the ray executor") as err:
        run_sweep(gen_trace, GRID, ray_retries=1)
    assert err.value.flag == "--ray-retries"
    res = CliRunner().invoke(main, ["sweep", str(gen_trace), "--out", str(tmp_path / "r"),
                                    "--freshness-ms", str(2**62), "-q"])
    assert res.exit_code == 2 and res.stderr.startswith("error: --freshness-ms must be in 0..")
