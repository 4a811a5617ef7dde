"""``router-replay report RUN_DIR``: (re)build the self-contained report.html of a run."""

from __future__ import annotations

import click

from ..cli import user_errors

_EXAMPLE = """
The page embeds plotly.js, so it opens offline. `router-replay sweep` writes
RUN_DIR/report.html already; rebuild it (with --force) after changing the
pressure bound or the config followed over time.

\b
Example:
  router-replay report reports/sample --force --max-p99-waiting 8 --config 16
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
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@user_errors
def report(run_dir, out, max_p99_waiting, config_id, force, quiet):
    """Write RUN_DIR's report: one self-contained HTML page of figures and provenance."""
    import math
    from pathlib import Path

    from .. import rundir
    from ..errors import ReplayError
    from ..report import build_report

    if max_p99_waiting is not None and not math.isfinite(max_p99_waiting):
        raise ReplayError(f"--max-p99-waiting must be a finite number >= 0, got {max_p99_waiting!r}")
    target = out if out is not None else Path(run_dir) / rundir.REPORT
    rundir.guard([(target, "report")], inputs=rundir.run_inputs(run_dir), force=force)
    path = build_report(run_dir, out, force=force, config_id=config_id, max_p99_waiting=max_p99_waiting)
    if not quiet:
        click.echo(f"wrote {path}")


COMMANDS = [report]
