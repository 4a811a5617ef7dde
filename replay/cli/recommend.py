"""``router-replay recommend DIR``: the capacity-planning answer, closed loop or open loop."""

from __future__ import annotations

import sys

import click

from replay.cli.app import user_errors
from replay.cli.limits import finite

_EPILOG = """
DIR is a closed-loop grid (a `simulate` grid directory, or a `calibrate
--validate` directory holding prediction/) or an open-loop run directory
(`sweep`).

\b
Closed loop (the answer): among the configs whose TTFT p99
(--max-ttft-p99-ms) or queue wait p99 (--max-queue-wait-p99-ms) meets the
bound and whose seeds agree on that verdict and on hit rate, the best mean
true (served) hit rate; says when the best two cannot be told apart within their intervals,
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

    from replay.analysis import flags_file  # lazy: loaded when the command runs
    from replay.analysis.recommend import recommend_dir  # lazy: loaded when the command runs

    flags_file.guard(emit_flags, inputs=[run_dir], force=force)  # before any output: refused, nothing printed
    answer = recommend_dir(run_dir, max_p99_waiting=bound, max_ttft_p99_ms=ttft_ms, max_queue_wait_p99_ms=wait_ms,
                           plan=plan_mode, bound_kind=bound_kind, as_json=as_json,
                           emit_flags=emit_flags is not None)
    for line in answer.lines:
        click.echo(line)
    if emit_flags is not None and answer.kind != "plan":
        flags_file.write(emit_flags, answer.flags, answer.flags_source, inputs=[run_dir], force=force)
        if not as_json:
            click.echo(f"router flags -> {emit_flags}")
    sys.exit(0 if answer.met else 1)


COMMANDS = [recommend]
