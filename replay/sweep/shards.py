"""Sharded sweeps on Ray (``--executor ray``; the optional extra ``router-replay[ray]``).

The trace set is cut into time windows (``TraceSet.window_bounds``) and the
grid, optionally, into blocks of configs; each (window, block) pair is one Ray
task.  The driver makes one pass over the load samples to find the carry at
every window start (``TraceSet.carries``) and counts the requests before it
(the request index of the window's first request), so every task is
independent and decides exactly what the in-memory sweep decides.

Every metric is a count, a sum or a fixed-bucket histogram
(``engine.Totals``), so the driver adds the tasks' integer arrays and gets the
local result bit for bit.  Each task writes its own decisions file into the
run directory (``decisions/part-WWWWW-BBB.parquet``, listed in ``run.json``);
the first block of each window returns its fleet readings as Parquet bytes,
which the driver joins into ``fleet.parquet`` in time order.  The run
directory must therefore be on storage every Ray node can write when
decisions are kept (not otherwise), and the trace on storage every node can read.

The tasks run in a :class:`replay.sweep.pool.RayPool` (the one executor interface).
A task that raises is retried (``retries`` times, Ray's own retry); a shard
that still fails is reported with its time range and config block, and the
run is not written.  Bad input found by a task is reported at once (it would
fail again).  ``ROUTER_REPLAY_FAULT_SHARDS`` injects failures for tests and
drills: ``"3"`` fails window 3's first attempt, ``"3:always"`` every attempt.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import os
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow.parquet as pq

from replay.errors import ReplayError
from replay.runs.names import DECISIONS_DIR, FLEET, FLEET_PARTS
from replay.sweep import engine
from replay.sweep import readings as fleet_mod
from replay.sweep.jobs import Done, Job
from replay.sweep.pool import RayPool
from replay.sweep.results import DecisionWriter
from replay.trace import NS, TraceError, TraceSet

FAULT_ENV = "ROUTER_REPLAY_FAULT_SHARDS"


class InjectedFault(RuntimeError):
    """A failure asked for through ROUTER_REPLAY_FAULT_SHARDS."""


def iso(t_ns: int) -> str:
    return _dt.datetime.fromtimestamp(t_ns / NS, tz=_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def config_blocks(n_configs: int, per_task: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` config ranges of at most ``per_task`` configs (one block by default)."""
    size = n_configs if not per_task else max(1, int(per_task))
    return [(lo, min(n_configs, lo + size)) for lo in range(0, max(n_configs, 1), size)] if n_configs else []


@dataclass
class ShardSpec:
    window: int               # index of the time window
    block: int                # index of the config block
    t0: int
    t1: int
    cfg_lo: int
    cfg_hi: int
    first_request: int

    def describe(self, n_blocks: int) -> str:
        where = f"window {self.window} ({iso(self.t0)} to {iso(self.t1)})"
        if n_blocks > 1:
            where += f", configs {self.cfg_lo}..{self.cfg_hi - 1}"
        return where


def _maybe_fail(spec: ShardSpec, fault: str | None, marks: str | None) -> None:
    if not fault:
        return
    for item in fault.split(","):
        w, _, mode = item.strip().partition(":")
        if not w.strip().isdigit() or int(w) != spec.window:
            continue
        mark = os.path.join(marks or tempfile.gettempdir(), f"fault-{spec.window}-{spec.block}")
        if mode == "always" or not os.path.exists(mark):
            Path(mark).touch()
            raise InjectedFault(f"injected failure of window {spec.window} ({FAULT_ENV})")


def run_shard(tset: TraceSet, configs: list, config_ids: list[int], spec: ShardSpec, carry: dict | None, *,
              seed: int, freshness_ns: int, model: str | None, out_dir: str | None, decisions: bool,
              fleet: bool, threads: int, fault: str | None = None, marks: str | None = None,
              decisions_layout: str = "long") -> dict:
    """Replay one window under one block of configs; return its absolute totals
    (and, with ``fleet``, its fleet facts).  Runs inside a Ray task, or here."""
    _maybe_fail(spec, fault, marks)
    t_start = time.perf_counter()
    try:
        win = next(tset.iter_windows(spec.t1 - spec.t0, model=model, bounds=[(spec.t0, spec.t1)],
                                     carry=carry, first_request=spec.first_request))
    except TraceError as err:
        return {"input_error": str(err)}
    trace = win.trace
    totals = engine.new_totals(len(configs), threads=threads)
    name = f"{DECISIONS_DIR}/part-{spec.window:05d}-{spec.block:03d}.parquet"
    writer = (DecisionWriter(os.path.join(out_dir, name), tset, config_ids, layout=decisions_layout)
              if decisions and out_dir is not None and trace.n_requests else None)
    mins: list[np.ndarray] = []
    fresh_parts: list[np.ndarray] = []
    for chunk in engine.iter_chunks(trace, configs, seed=seed, freshness_ns=freshness_ns, threads=threads,
                                    keep=writer is not None, totals=totals):
        mins.append(chunk.fleet_min)
        fresh_parts.append(chunk.fleet_fresh)
        if writer is not None:
            writer.write(chunk, trace)
    if writer is not None:
        writer.close()
    m = totals.merged()
    out = {"acc": m.acc[0], "hist_wait": m.hist_wait[0], "hist_div": m.hist_div[0], "stats": m.stats[0],
           "requests": trace.n_requests, "decisions": name if writer is not None else None,
           "rows": writer.rows if writer is not None else 0,
           "has_selected": trace.req_selected_worker is not None}
    if fleet:
        min_waiting, fresh = engine.chunk_readings(mins, fresh_parts)
        out["facts"] = fleet_mod.FleetFacts().add(trace.req_ts, min_waiting)
        if out_dir is not None and trace.n_requests:
            # sent back as Parquet bytes: the driver writes them, so a run
            # without decisions needs no run directory shared with the workers
            buf = io.BytesIO()
            fleet_mod.fleet_table(trace, min_waiting, fresh).write_parquet(buf, compression="zstd")
            out["fleet_bytes"] = buf.getvalue()
    out["seconds"] = time.perf_counter() - t_start
    # the worker process's peak so far (workers are reused: an upper bound for this task)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _join_fleet(out_dir: Path, parts: list[str]) -> None:
    """fleet.parquet from the windows' parts, in time order (streamed, then the parts go)."""
    path = out_dir / FLEET
    writer = None
    for part in parts:
        pf = pq.ParquetFile(str(out_dir / part))
        for i in range(pf.metadata.num_row_groups):
            table = pf.read_row_group(i)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema, compression="zstd")
            writer.write_table(table.cast(writer.schema))
    if writer is not None:
        writer.close()
    else:
        fleet_mod.empty_fleet_table().write_parquet(path)
    shutil.rmtree(out_dir / FLEET_PARTS, ignore_errors=True)


def run_ray(job: Job, window_ns: int, *, address: str | None = None, configs_per_task: int | None = None,
            retries: int = 2, cpus: int | None = None):
    """Replay ``job`` (an ``executors.Job``) as Ray tasks of a :class:`replay.sweep.pool.RayPool`;
    return an ``executors.Done``."""
    tset = cast(TraceSet, job.source)     # shards are cut only from a TraceSet
    bounds = tset.window_bounds(window_ns)
    firsts = [tset.requests_before(t0) for t0, _t1 in bounds]
    blocks = config_blocks(len(job.configs), configs_per_task)
    ids = list(job.grid.config_ids)
    # the carries (one pass over the load samples) are found while Ray starts
    plan: dict = {}

    def find_carries():
        t = time.perf_counter()
        try:
            plan["carries"] = tset.carries(bounds)
        except BaseException as err:  # noqa: BLE001 - raised in the driver below
            plan["error"] = err
        plan["seconds"] = time.perf_counter() - t

    planner = threading.Thread(target=find_carries, name="carries", daemon=True)
    planner.start()
    out_dir = str(job.out_dir) if job.out_dir is not None else None
    if out_dir is not None:
        os.makedirs(os.path.join(out_dir, DECISIONS_DIR), exist_ok=True)
        os.makedirs(os.path.join(out_dir, FLEET_PARTS), exist_ok=True)
    fault = os.environ.get(FAULT_ENV) or None
    marks = tempfile.mkdtemp(prefix="router-replay-faults-") if fault else None
    threads = max(1, int(job.threads or 1))
    t0 = time.perf_counter()
    try:
        with RayPool(address=address, cpus=cpus, retries=retries) as rp:
            ray_start_s = rp.start_s
            planner.join()
            if "error" in plan:
                raise plan["error"]
            carries = plan["carries"]
            plan_s = plan["seconds"]
            t_ready = time.perf_counter()
            tset_ref = rp.share(tset)
            specs: dict[tuple[int, int], ShardSpec] = {}
            calls = []
            for w, ((a, b), first) in enumerate(zip(bounds, firsts, strict=True)):
                carry_ref = rp.share(carries[w])
                for k, (lo, hi) in enumerate(blocks):
                    spec = ShardSpec(w, k, a, b, lo, hi, first)
                    specs[(w, k)] = spec
                    calls.append(((tset_ref, job.configs[lo:hi], ids[lo:hi], spec, carry_ref),
                                  dict(seed=job.seed, freshness_ns=job.freshness_ns, model=job.model,
                                       out_dir=out_dir, decisions=job.decisions, fleet=k == 0,
                                       threads=threads, fault=fault, marks=marks,
                                       decisions_layout=job.decisions_layout)))
            order = list(specs.values())
            results: dict[tuple[int, int], dict] = {}
            n_cfg = max(len(job.configs), 1)
            credit = 0.0
            with contextlib.closing(rp.run(run_shard, calls, cpus=threads,
                                           describe=lambda i: f"shard {order[i].describe(len(blocks))}")) as done:
                for i, res in done:
                    spec = order[i]
                    if "input_error" in res:
                        raise TraceError(res["input_error"])
                    if res.get("fleet_bytes") is not None and out_dir is not None:
                        part = f"{FLEET_PARTS}/part-{spec.window:05d}.parquet"
                        with open(os.path.join(out_dir, part), "wb") as fh:
                            fh.write(res.pop("fleet_bytes"))
                        res["fleet"] = part
                    results[(spec.window, spec.block)] = res
                    if job.progress is not None:
                        credit += res["requests"] * (spec.cfg_hi - spec.cfg_lo) / n_cfg
                        step = int(credit)
                        if step:
                            job.progress(step)
                            credit -= step
            t_done = time.perf_counter()
    finally:
        if marks:
            shutil.rmtree(marks, ignore_errors=True)
    missing = [s for key, s in specs.items() if key not in results]
    if missing:  # never write a run with a hole in it
        raise ReplayError(f"shard {missing[0].describe(len(blocks))} returned no result")
    totals = engine.Totals(1, len(job.configs))
    facts = fleet_mod.FleetFacts()
    files, fleet_parts = [], []
    task_s = []
    task_rss = []
    for (w, k), res in sorted(results.items()):
        spec = specs[(w, k)]
        sl = slice(spec.cfg_lo, spec.cfg_hi)
        totals.acc[0][:, sl] += res["acc"]
        totals.hist_wait[0][:, sl] += res["hist_wait"]
        totals.hist_div[0][:, sl] += res["hist_div"]
        totals.stats[0] += res["stats"]
        task_s.append(res["seconds"])
        task_rss.append(res.get("peak_rss_bytes", 0))
        if res["decisions"]:
            files.append(res["decisions"])
        if k == 0:
            facts.merge(res["facts"])
            if res.get("fleet"):
                fleet_parts.append(res["fleet"])
    t_join = time.perf_counter()
    if job.out_dir is not None:
        _join_fleet(Path(job.out_dir), fleet_parts)
        if not files:
            shutil.rmtree(Path(job.out_dir) / DECISIONS_DIR, ignore_errors=True)
    t_end = time.perf_counter()
    execution = {
        "ray_address": address, "tasks": len(results), "config_blocks": len(blocks),
        "retries": retries, "plan_s": round(plan_s, 4), "ray_start_s": round(ray_start_s, 4),
        "plan_and_start_s": round(t_ready - t0, 4),
        "tasks_wall_s": round(t_done - t_ready, 4), "task_s_sum": round(float(np.sum(task_s)), 4),
        "join_s": round(t_end - t_join, 4),
        "task_peak_rss_bytes": int(max(task_rss, default=0)),
    }
    has_selected = tset.has_selected
    return Done(totals, facts, has_selected, files if job.decisions else None, len(bounds),
                 t_done - t_ready, t_end - t_join, execution)
