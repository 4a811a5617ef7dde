"""``router-replay report RUN_DIR``: (re)build the self-contained report.html of a run."""

from __future__ import annotations

import click

from replay.cli.app import outputs_closed, user_errors
from replay.cli.limits import finite

_EXAMPLE = """
The page embeds plotly.js, so it opens offline. `router-replay sweep` writes
RUN_DIR/report.html already; `report RUN_DIR` rebuilds it in place (no
--force needed for the run's own report) after changing the pressure bound or
the config followed over time; --out elsewhere is not replaced without --force.

A closed-loop grid of the run's trace (a `simulate` grid or a `calibrate
--validate` directory, found inside or beside the run or the trace, matched
by the trace files' sha256; or given with --closed-loop DIR) is shown first:
the model's fidelity, the configs ranked by mean served hit rate with 95%
intervals and the stable verdict, the open-loop figures after it, labelled.

\b
Example:
  router-replay report reports/sample --max-p99-waiting 8 --config 16
"""


@click.command(epilog=_EXAMPLE)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--out", "out", default=None, type=click.Path(path_type=str),
              help="HTML file to write (default: RUN_DIR/report.html).")
@click.option("--max-p99-waiting", default=None, type=click.FloatRange(min=0),
              help="Pressure bound for the best configs: p99 waiting at the chosen worker "
                   "(default: the median p99 over the grid).")
@click.option("--config", "config_id", default=None, type=click.IntRange(min=0),
              help="config_id to follow over time (default: the best under the bound).")
@click.option("--beside", "beside", default=None, type=click.IntRange(min=0), metavar="ID",
              help="config_id drawn beside the followed config in the waterfall (default: its no-gate baseline).")
@click.option("--closed-loop", "closed_loop", default=None, type=click.Path(path_type=str),
              help="Closed-loop grid to show first (default: one found beside the run or its trace).")
@click.option("--max-ttft-p99-ms", default=None, type=click.FloatRange(min=0), callback=finite, metavar="MS",
              help="Bound for the closed-loop answer: upper 95% bound of TTFT p99 (ms).")
@click.option("--max-queue-wait-p99-ms", default=None, type=click.FloatRange(min=0), callback=finite, metavar="MS",
              help="Bound for the closed-loop answer on queue wait p99 instead (ms).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@user_errors
def report(run_dir, out, max_p99_waiting, config_id, beside, closed_loop, max_ttft_p99_ms, max_queue_wait_p99_ms,
           force, quiet):
    """Write RUN_DIR's report: one self-contained HTML page of figures and provenance."""

    from replay import write_report  # lazy: loaded when the command runs

    path = write_report(run_dir, out, force=force, config_id=config_id, max_p99_waiting=max_p99_waiting,
                        closed_loop=closed_loop, max_ttft_p99_ms=max_ttft_p99_ms, beside=beside,
                        max_queue_wait_p99_ms=max_queue_wait_p99_ms)
    if not quiet:
        click.echo(f"wrote {path}")
    outputs_closed()


COMMANDS = [report]
