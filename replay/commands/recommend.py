"""``router-replay recommend RUN_DIR --max-p99-waiting N``: the capacity-planning answer."""

from __future__ import annotations

import sys

import click

from ..cli import user_errors

_EPILOG = """
Picks, among the configs whose p99 of num_waiting_reqs at the chosen worker
(selected_waiting_p99, summed over dp ranks) is at most N, the one with the
best hit rate (ties: lower p99, then lower mean waiting). Runs with several
dp_sizes (--per-dp-rank) get one answer per dp_size. Printed with the router
flags to set, the margin over the next best config, how many configs met the
bound, and its metrics beside the no-gate config (no limit, no floor).

\b
Exit codes:
  0  a config meets the bound (for every dp_size)
  1  no config meets the bound (for at least one dp_size)
  2  unusable input (missing or corrupt run directory, bad N)

\b
Example:
  router-replay recommend reports/sample --max-p99-waiting 8

--plan reads a capacity plan (simulate with --workers/--dp-size/--load-scale
lists) and prints, per traffic level, the smallest fleet with its limit and
floor meeting --ttft-p99-ms or --queue-wait-p99-ms (exit 1 if a level has
none); docs/capacity.md.
"""


@click.command(epilog=_EPILOG)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--max-p99-waiting", "bound", type=click.FloatRange(min=0), metavar="N",
              help="Bound on selected_waiting_p99 (queued requests at the chosen worker).")
@click.option("--plan", "plan_mode", is_flag=True,
              help="RUN_DIR is a capacity plan (simulate with fleet lists): the smallest fleet per "
                   "traffic level meeting --ttft-p99-ms or --queue-wait-p99-ms (docs/capacity.md).")
@click.option("--ttft-p99-ms", type=click.FloatRange(min=0), default=None, metavar="MS",
              help="--plan: bound on TTFT p99 (the seeds' upper 95% bound when several ran).")
@click.option("--queue-wait-p99-ms", type=click.FloatRange(min=0), default=None, metavar="MS",
              help="--plan: bound on queue-wait p99 instead.")
@user_errors
def recommend(run_dir, bound, plan_mode, ttft_p99_ms, queue_wait_p99_ms):
    """Recommend the config with the best hit rate whose p99 queue stays within N."""
    from .. import analysis
    from ..errors import ReplayError

    if plan_mode:
        from ..plan import recommend_plan

        sys.exit(recommend_plan(run_dir, ttft_p99_ms, queue_wait_p99_ms, click.echo))
    if bound is None:
        raise ReplayError("--max-p99-waiting is required (or --plan with --ttft-p99-ms)")

    run = analysis.load_run(run_dir)
    recs = analysis.recommend(run, bound)
    click.echo(analysis.format_recommendations(recs, run))
    sys.exit(0 if all(r.best is not None for r in recs) else 1)


COMMANDS = [recommend]
