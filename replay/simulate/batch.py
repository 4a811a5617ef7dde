"""Many simulations as one pool, journaled and resumable: what a grid and a capacity plan run.

A batch is a list of :class:`SimTask` (a log, a fleet, a config, a seed, and where its trace
goes).  :func:`run_batch` hands every task not yet done to one
:class:`replay.sweep.pool.Pool` at once (no barrier between the fleets or traffic levels of a
plan) and, as each finishes, appends its summary to the journal of the :class:`WorkDir` the
output is built in.

The work directory is a hidden sibling of the output (``.<name>.resume``), kept when a run is
interrupted (a signal, a crash, a task that failed after its retries) and removed when it
fails on bad input.  A run with ``resume`` reads the journal and skips every task whose key
(:func:`task_key`: a hash of everything the simulation reads) is there and whose directory is
complete; the output is then byte for byte what an uninterrupted run writes.  A run without
``resume`` starts over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay import __version__
from replay.config import Grid, RouterConfig
from replay.errors import ParamsError, ReplayError
from replay.runs import rundir
from replay.runs.names import SIM_JSON, SIM_TOOL
from replay.simulate.fleet import Fleet
from replay.simulate.logs import RequestLog
from replay.simulate.seeds import aggregate
from replay.simulate.sim import SEEDS_TABLE, SUMMARY, _json, grid_task, kernel_inputs, summary_json, write_summary
from replay.sweep.pool import Call, Pool, TaskFailed, pool
from replay.trace.files import log_identity

MAX_SIMULATIONS = 10_000
"""Most simulations one ``simulate`` runs (configs x seeds x fleet and traffic points): each writes
a trace directory of its own (40 KB for 100 requests of the sample log, more for a longer log),
and 100,000 configs of ``--worker-queue-limit 1..100000`` ran for hours filling the disk."""


def check_simulations(configs: int, seeds: int, points: int) -> None:
    """Refuse a simulate grid or plan of more than :data:`MAX_SIMULATIONS` runs before any work."""
    n = configs * max(seeds, 1) * max(points, 1)
    if n > MAX_SIMULATIONS:
        parts = [f"{configs:,} config(s)"] + ([f"{seeds:,} seeds"] if seeds else []) + (
            [f"{points:,} fleet x traffic points"] if points > 1 else [])
        raise ReplayError(f"{' x '.join(parts)} = {n:,} simulations, more than the {MAX_SIMULATIONS:,} one simulate "
                          "runs (each writes a trace directory of its own); split the grid")


JOURNAL = "journal.jsonl"
OWNER = "owner"


def log_digest(log: RequestLog) -> str:
    """A hash of everything of a request log the simulator reads."""
    h = hashlib.sha256()
    for a in (log.ts_ns, log.input_tokens, log.output_tokens, log.hash_off, log.hash_ids,
              log.block_parent, log.block_tokens, log.block_key):
        arr = np.ascontiguousarray(a)
        h.update(str((arr.dtype.str, arr.shape)).encode())
        h.update(arr.tobytes())
    h.update(str(log.block_size).encode())
    return h.hexdigest()


def task_key(log_hash: str, fleet: Fleet, config: RouterConfig, seed: int, sub: str, kw: dict) -> str:
    """The identity of one simulation: its inputs (log, fleet, config, seed, options), where its
    trace goes, and the version that simulates it."""
    text = json.dumps({"version": __version__, "log": log_hash, "fleet": fleet.describe(),
                       "config": config.as_dict(), "seed": int(seed), "sub": sub, "options": kw},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class SimTask:
    """One simulation of a batch: indexes into the batch's logs and fleets, and ``sub``, the
    directory of its trace under the output (None: nothing written)."""

    log: int
    fleet: int
    config: RouterConfig
    seed: int
    sub: str | None
    label: str = ""          # names it in an error: ``config 3`` (a plan: with its fleet point)
    key: str = ""


class WorkDir:
    """The hidden sibling ``.<name>.resume`` a grid or plan is built in, with its journal."""

    def __init__(self, out: Path, *, resume: bool = False):
        self.out = out
        self.path = out.parent / f".{out.name}.resume"
        self.done: dict[str, dict] = {}
        me = f"{os.getpid()}@{rundir._HOST}"
        if self.path.exists():
            owner = _read(self.path / OWNER)
            pid, _, host = owner.partition("@")
            if (owner != me and host == rundir._HOST and pid.isdigit()
                    and rundir._pid_alive(int(pid))):
                raise ReplayError(f"{out}: another run (pid {pid}) is writing it")
            if resume:
                self.done = _read_journal(self.path / JOURNAL)
                _drop_debris(self.path)
            else:
                shutil.rmtree(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / OWNER).write_text(me)
            self._journal = open(self.path / JOURNAL, "a", encoding="utf-8")  # noqa: SIM115 - closed by finish/close
        except OSError as err:
            raise rundir.write_error(err, out) from None

    def complete(self, task: SimTask) -> bool:
        """Whether ``task`` finished in an earlier run (journaled, its directory whole)."""
        if task.key not in self.done:
            return False
        return task.sub is None or (self.path / task.sub / SIM_JSON).is_file()

    def record(self, key: str, summary: dict, sub: str | None = None) -> None:
        """Journal one finished simulation (flushed and synced before the next is taken)."""
        self._journal.write(json.dumps({"key": key, "sub": sub, "summary": summary}, allow_nan=True) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self.done[key] = summary

    def close(self) -> None:
        if not self._journal.closed:
            self._journal.close()

    def finish(self) -> None:
        """Drop the journal and swap the finished directory in as the output."""
        self.close()
        (self.path / JOURNAL).unlink(missing_ok=True)
        (self.path / OWNER).unlink(missing_ok=True)
        rundir.move_into_place(self.path, self.out)

    def discard(self) -> None:
        self.close()
        shutil.rmtree(self.path, ignore_errors=True)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _read_journal(path: Path) -> dict[str, dict]:
    done: dict[str, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return done
    for line in lines:
        try:
            rec = json.loads(line)
            done[rec["key"]] = rec["summary"]
        except (ValueError, KeyError, TypeError):
            continue          # a line cut short by the interruption: that simulation runs again
    return done


def _drop_debris(root: Path) -> None:
    """What a killed simulation left (its hidden partial folders) anywhere under ``root``."""
    for p in sorted(root.rglob(".*"), reverse=True):
        if not rundir._PARTIAL.fullmatch(p.name):
            continue
        if p.is_dir():
            rundir.discard(p)
        else:
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def work_dir(out: Path | None, *, resume: bool = False) -> Iterator[WorkDir | None]:
    """A :class:`WorkDir` for ``out`` (None: nothing written), swapped in when the block
    completes; kept for ``resume`` when it is interrupted or a task fails, removed on bad input."""
    if out is None:
        yield None
        return
    work = WorkDir(out, resume=resume)
    try:
        yield work
    except ReplayError as err:
        if isinstance(err, TaskFailed):
            work.close()
            raise GridFailed("{err}; {n} finished simulation(s) are kept: run again with {resume} to go on from "
                             "them", "resume", err=err, n=len(work.done)) from None
        work.discard()
        raise
    except BaseException:
        work.close()
        rundir.KEPT.append(work.path)
        raise
    work.finish()


def run_batch(tasks: Sequence[SimTask], logs: Sequence[RequestLog], fleets: Sequence[Fleet], kw: dict,
              pool: Pool, work: WorkDir | None, *,
              progress: Callable[[int], None] | None = None,
              on_result: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every task's summary, in task order: the journaled ones read back, the others run on
    ``pool`` all at once and journaled as they finish.  ``kw``: :func:`simulate`'s options.
    ``on_result(i, summary)`` is called once per task as its summary is known (the journaled
    ones first, in task order; the others as they finish), so a caller writes what depends
    on a group of tasks as soon as the group is whole."""
    hashes = [log_digest(lg) for lg in logs] if work is not None else []
    for t in tasks:
        if work is not None:
            t.key = task_key(hashes[t.log], fleets[t.fleet], t.config, t.seed, t.sub or "", kw)
    done: dict[int, dict] = {}
    todo = []
    for i, t in enumerate(tasks):
        if work is not None and work.complete(t):
            done[i] = work.done[t.key]
        else:
            todo.append(i)
            if work is not None and t.sub is not None and (work.path / t.sub).exists():
                rundir.discard(work.path / t.sub)      # what an interrupted run left of it
    if progress is not None and done:
        progress(len(done))
    if on_result is not None:
        for i in sorted(done):
            on_result(i, done[i])
    if not todo:
        return [done[i] for i in range(len(tasks))]
    with pool:
        # the kernel's inputs, made once per (log, fleet, seed) for calls in this process; a
        # Ray task makes its own (cheaper than sending a copy of the log's arrays with each)
        inputs: dict[tuple[int, int, int], Any] = {}
        for i in todo:
            t = tasks[i]
            k = (t.log, t.fleet, t.seed)
            if k not in inputs:
                inputs[k] = (kernel_inputs(logs[t.log], fleets[t.fleet], kw["publish_interval_ms"], t.seed)
                             if pool.in_process else None)
        shared_logs = {j: pool.share(logs[j]) for j in sorted({tasks[i].log for i in todo})}
        shared_fleets = {j: pool.share(fleets[j]) for j in sorted({tasks[i].fleet for i in todo})}
        calls: list[Call] = []
        for i in todo:
            t = tasks[i]
            sub = None if work is None or t.sub is None else str(work.path / t.sub)
            calls.append(((shared_logs[t.log], shared_fleets[t.fleet], t.config, sub, int(t.seed), kw,
                           inputs[(t.log, t.fleet, t.seed)]), {}))

        def name(n: int) -> str:
            return f"{tasks[todo[n]].label} seed {tasks[todo[n]].seed}"

        with contextlib.closing(pool.run(grid_task, calls, describe=name)) as results:
            for n, summary in results:
                i = todo[n]
                summary = summary_json(summary)
                if work is not None:
                    work.record(tasks[i].key, summary, tasks[i].sub)
                done[i] = summary
                if progress is not None:
                    progress(1)
                if on_result is not None:
                    on_result(i, summary)
    return [done[i] for i in range(len(tasks))]


# -- a grid: one simulation per config (and seed) on one fleet ---------------------------------------

def grid_tasks(grid: Grid, seeds: Sequence[int], seeded: bool, *, log: int = 0, fleet: int = 0,
               prefix: str | None = "") -> list[SimTask]:
    """The tasks of ``grid`` x ``seeds`` (configs outer), their traces under ``prefix``
    (``config-<id>/`` or ``config-<id>/seed-<s>/``; None: nothing written)."""
    out = []
    for cid, cfg in zip(grid.config_ids, grid.configs, strict=True):
        for s in seeds:
            sub = None
            if prefix is not None:
                sub = f"{prefix}config-{cid}" + (f"/seed-{s}" if seeded else "")
            where = f"{prefix.rstrip('/')}: " if prefix else ""
            out.append(SimTask(log, fleet, cfg, int(s), sub, f"{where}config {cid}"))
    return out


def grid_table(grid: Grid, seeds: Sequence[int], seeded: bool, summaries: Sequence[dict]) -> tuple:
    """``(table, rows)``: the closed-loop summary of a grid's summaries (in :func:`grid_tasks`'
    order) and its per-run rows."""
    rows_by_id = {r["config_id"]: r for r in grid.rows()}
    rows = []
    it = iter(summaries)
    for cid in grid.config_ids:
        for s in seeds:
            row = dict(rows_by_id[cid])
            if seeded:
                row["seed"] = int(s)
            row.update(next(it))
            rows.append(row)
    if not seeded:
        return pl.DataFrame(rows), rows
    knob_cols = [k for k in rows_by_id[grid.config_ids[0]] if k != "config_id"]
    return aggregate(rows, knob_cols), rows



class GridFailed(TaskFailed, ParamsError):
    """A grid or plan stopped by a failed simulation; the ones that finished are journaled, and
    ``resume`` goes on from them."""


def write_grid(where: Path, table: pl.DataFrame, rows: list[dict], log: RequestLog, fleet: Fleet,
               grid: Grid, seed: int, seeds: Sequence[int] | None, kw: dict) -> None:
    """A grid's own files in ``where``: the closed-loop summary, the per-seed rows, sim.json."""
    write_summary(table, where / SUMMARY)
    if seeds is not None:
        pl.DataFrame(rows).write_parquet(where / SEEDS_TABLE)
    meta = {"tool": SIM_TOOL, "version": __version__, "log": log.source,
            "requests": log.n_requests, "seed": int(seed), "grid": grid.describe(),
            "publish_interval_ms": int(kw["publish_interval_ms"]), "index_lag_ms": int(kw["index_lag_ms"]),
            "freshness_ms": int(kw["freshness_ms"]), "fleet": fleet.describe()}
    if seeds is not None:
        meta["seeds"] = [int(s) for s in seeds]
    if log.source and Path(log.source).is_dir():
        meta["log_identity"] = log_identity(log.source)
    (where / SIM_JSON).write_text(json.dumps(meta, indent=2, default=_json) + "\n")


def simulate_grid(log: RequestLog, fleet: Fleet, grid: Grid | Mapping[str, Any],
                  out_dir: str | os.PathLike | None = None, *, seed: int = 0,
                  publish_interval_ms: int | None = None, index_lag_ms: int = 0,
                  freshness_ms: int = 5000, force: bool = False,
                  threads: int | None = None, seeds: Sequence[int] | None = None,
                  progress: Callable[[int], None] | None = None, executor: str | Pool = "local",
                  ray_address: str | None = None, ray_cpus: int | None = None,
                  ray_retries: int | None = None, resume: bool = False) -> pl.DataFrame:
    """One closed-loop simulation per config of ``grid``; returns the summary table.

    With ``out_dir``, each config's trace goes to ``out_dir/config-<id>/`` and
    the table to ``out_dir/closed_loop_summary.parquet`` (and ``.csv``).
    With ``seeds``, every config runs once per seed (into
    ``config-<id>/seed-<s>/``), ``closed_loop_seeds.parquet`` has one row per
    run, and the summary one row per config: means, 95% intervals and the
    ``stable`` verdict of :func:`replay.simulate.seeds.aggregate`.
    ``progress(k)`` is called as simulations finish (from the driver).  The
    simulations run on one pool (:func:`replay.sweep.pool.pool`: ``threads``
    local threads, or ``executor="ray"`` as Ray tasks on the cluster at
    ``ray_address``, else a local Ray with ``ray_cpus`` CPUs; the output directory
    must then be on storage the tasks share); the results are identical either
    way.  ``resume`` goes on from an interrupted run into the same ``out_dir``
    (:class:`WorkDir`).
    """
    runner = pool(executor, threads=threads, address=ray_address, cpus=ray_cpus, retries=ray_retries)
    if not isinstance(grid, Grid):
        grid = Grid(grid)
    if not grid.configs:
        raise ReplayError("the grid has no valid config")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        rundir.guard([(out, "sim")], force=force)
    if publish_interval_ms is None:
        publish_interval_ms = fleet.publish_interval_ms
    kw = dict(publish_interval_ms=publish_interval_ms, index_lag_ms=index_lag_ms, freshness_ms=freshness_ms)
    run_seeds = list(seeds) if seeds is not None else [seed]
    tasks = grid_tasks(grid, run_seeds, seeds is not None, prefix=None if out is None else "")
    with work_dir(out, resume=resume) as work:
        summaries = run_batch(tasks, [log], [fleet], kw, runner, work, progress=progress)
        table, rows = grid_table(grid, run_seeds, seeds is not None, summaries)
        if work is not None:
            write_grid(work.path, table, rows, log, fleet, grid, seed, seeds, kw)
    return table
