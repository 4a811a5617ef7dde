"""``router-replay recommend DIR``: the capacity-planning answer, closed loop or open loop."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import click

from replay.cli.app import user_errors
from replay.cli.limits import finite

_EPILOG = """
DIR is a closed-loop grid (a `simulate` grid directory, or a `calibrate
--validate` directory holding prediction/) or an open-loop run directory
(`sweep`).

\b
Closed loop (the answer): among the configs that are stable over the seeds
and whose TTFT p99 (--max-ttft-p99-ms) or queue wait p99
(--max-queue-wait-p99-ms) meets the bound, the best mean true (served) hit
rate; says when the best two cannot be told apart within their intervals,
and the model's fidelity (fidelity.json) before any prediction. With seeds
the bound is checked on the upper end of the 95% interval of the mean
(--bound mean, where the average lies) or on the worst seed (--bound
seed-range, what one day may look like).

\b
Open loop (an estimate): among the configs whose p99 of num_waiting_reqs at
the chosen worker (selected_waiting_p99) is at most --max-p99-waiting, the
best decision-time hit rate (ties: lower p99, then lower mean waiting), one
answer per dp_size with --per-dp-rank runs. The recorded loads do not react to
the replayed decisions, so this ranking favours the no-gate config by
construction; the output says so and names the closed-loop command.

\b
Exit codes:
  0  a config meets the bound (for every dp_size)
  1  no config meets the bound (for at least one dp_size)
  2  unusable input (missing or corrupt directory, bad or missing bound)

\b
Example:
  router-replay recommend runs/fit/prediction --max-ttft-p99-ms 2000
  router-replay recommend reports/sample --max-p99-waiting 8

--json prints the answer as one JSON object (per dp_size for open-loop
runs; per traffic level with --plan). --emit-flags FILE writes the
recommended router flags per dp_size as a shell fragment a deployment can
include (`. FILE`: ROUTER_FLAGS_DP<N>, and ROUTER_FLAGS when every dp_size
shares one answer); a dp_size with no answer gets no variable.

--plan reads a capacity plan (simulate with --workers/--dp-size/--load-scale
lists) and prints, per traffic level, the smallest fleet with its limit and
floor meeting --max-ttft-p99-ms or --max-queue-wait-p99-ms (exit 1 if a
level has none); a directory with plan_summary.parquet is read so without
--plan too; docs/capacity.md.
"""


@click.command(epilog=_EPILOG)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--max-p99-waiting", "bound", default=None, type=click.FloatRange(min=0), metavar="N",
              help="Open-loop run: bound on selected_waiting_p99 (queued requests at the chosen worker).")
@click.option("--max-ttft-p99-ms", "ttft_ms", default=None, type=click.FloatRange(min=0), callback=finite,
              metavar="MS",
              help="Closed-loop grid or plan: bound on TTFT p99 (ms; --bound says which end).")
@click.option("--max-queue-wait-p99-ms", "wait_ms", default=None, type=click.FloatRange(min=0), callback=finite,
              metavar="MS",
              help="Closed-loop grid or plan: bound on queue wait p99 (ms; --bound says which end).")
@click.option("--plan", "plan_mode", is_flag=True,
              help="RUN_DIR is a capacity plan (simulate with fleet lists): the smallest fleet per "
                   "traffic level meeting --max-ttft-p99-ms or --max-queue-wait-p99-ms "
                   "(docs/capacity.md).")
@click.option("--bound", "bound_kind", type=click.Choice(["mean", "seed-range"]), default="mean", show_default=True,
              help="With seeds, check the TTFT / queue wait bound on the upper end of the 95% interval of the "
                   "mean (mean) or on the worst seed (seed-range: what one day may look like).")
@click.option("--json", "as_json", is_flag=True, help="Print the answer as one JSON object.")
@click.option("--emit-flags", "emit_flags", default=None, type=click.Path(dir_okay=False, path_type=str),
              metavar="FILE", help="Write the recommended router flags per dp_size to FILE (a shell fragment).")
@click.option("--force", is_flag=True, help="Replace an existing --emit-flags FILE.")
@user_errors
def recommend(run_dir, bound, ttft_ms, wait_ms, plan_mode, bound_kind, as_json, emit_flags, force):
    """Recommend a config: from a closed-loop grid (with intervals), or an open-loop run (labelled)."""

    from replay.analysis import closed_loop, flags_file, ranking  # lazy: loaded when the command runs
    from replay.analysis import runs as analysis  # lazy: loaded when the command runs
    from replay.analysis.plan import PLAN_TABLE, recommend_plan  # lazy: loaded when the command runs
    from replay.errors import ReplayError  # lazy: loaded when the command runs

    flags_file.guard(emit_flags, inputs=[run_dir], force=force)  # before any output: refused, nothing printed

    def emit(per_dp, source):
        if emit_flags is not None:
            flags_file.write(emit_flags, per_dp, source, inputs=[run_dir], force=force)
            if not as_json:
                click.echo(f"router flags -> {emit_flags}")

    if plan_mode or (Path(run_dir) / PLAN_TABLE).is_file():  # a capacity plan (docs/capacity.md)
        if bound is not None:
            raise ReplayError("--plan bounds TTFT p99 (--max-ttft-p99-ms) or queue wait p99 "
                              "(--max-queue-wait-p99-ms), not --max-p99-waiting")
        if emit_flags is not None:
            raise ReplayError("--emit-flags applies to a config recommendation, not --plan (a plan "
                              "answers per traffic level; its flags are in --json)")
        sys.exit(recommend_plan(run_dir, ttft_ms, wait_ms, click.echo, as_json=as_json, bound_kind=bound_kind))
    if closed_loop.is_grid(run_dir) and not (Path(run_dir) / analysis.rundir.RUN_JSON).is_file():
        if bound is not None:
            raise ReplayError(f"{run_dir}: a closed-loop grid: bound TTFT p99 (--max-ttft-p99-ms) or queue "
                              "wait p99 (--max-queue-wait-p99-ms), not --max-p99-waiting (an open-loop metric)")
        if ttft_ms is not None and wait_ms is not None:
            raise ReplayError("give one of --max-ttft-p99-ms and --max-queue-wait-p99-ms")
        if ttft_ms is None and wait_ms is None:
            raise ReplayError(f"{run_dir}: a closed-loop grid needs a bound: --max-ttft-p99-ms MS or "
                              "--max-queue-wait-p99-ms MS")
        grid = closed_loop.load_grid(run_dir)
        rec = closed_loop.recommend(grid, bound_ms=ttft_ms if ttft_ms is not None else wait_ms,
                                    on="ttft" if ttft_ms is not None else "queue_wait", bound_kind=bound_kind)
        if as_json:
            click.echo(json.dumps(rec.to_json(), default=str))
        else:
            click.echo(closed_loop.format_recommendation(rec))
        flags = ranking.deploy_flags(rec.best)
        sizes = closed_loop.dp_sizes(grid) or {None: 0}
        emit({d: flags for d in sizes}, f"{run_dir} (closed loop, {rec.bound_col} <= "
                                        f"{rec.bound_ms:g} ms)")
        sys.exit(0 if rec.best is not None else 1)
    if ttft_ms is not None or wait_ms is not None:
        raise ReplayError(f"{run_dir}: an open-loop run has no TTFT or queue wait; bound it with "
                          "--max-p99-waiting N, or give a closed-loop grid (simulate / calibrate --validate)")
    if bound is None:
        raise ReplayError("an open-loop run needs --max-p99-waiting N")
    run = analysis.load_run(run_dir)
    recs = analysis.recommend(run, bound)

    trace = (run.meta.get("trace") or {}).get("path")
    notes = [closed_loop.open_loop_line(trace)]
    found, _notes = closed_loop.find_for_run(run.path, run.meta)
    if found is not None:
        notes.append(f"a closed-loop grid of this trace exists: router-replay recommend {found.path} "
                     "--max-ttft-p99-ms MS")
    if as_json:
        click.echo(json.dumps({"run": str(run.path), "kind": "open loop", "answers": [r.to_json() for r in recs],
                               "notes": notes}, default=str))
    else:
        click.echo(analysis.format_recommendations(recs, run))
        for n in notes:
            click.echo(textwrap.fill(f"note: {n}", width=100, subsequent_indent="  ", break_on_hyphens=False))
    dp = run.meta.get("dp_size")
    emit({(r.dp_size if r.dp_size is not None else (dp if isinstance(dp, int) else None)): r.deploy_flags()
          for r in recs}, f"{run.path} (open loop, selected_waiting_p99 <= {bound:g})")
    sys.exit(0 if all(r.best is not None for r in recs) else 1)


COMMANDS = [recommend]
