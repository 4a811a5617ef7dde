"""``router-replay compare RUN_A RUN_B``: per-config deltas and changed requests between two runs."""

from __future__ import annotations

import click

from replay.cli.app import user_errors

_EPILOG = """
Both runs must have replayed the same trace (same file sha256s in run.json) for
the same model. Configs are matched by their knob values, not by config_id;
deltas are B - A, rates in percentage points. With decisions.parquet in both
runs, the requests whose worker or label changed are counted by
(old label -> new label). Exit codes: 0 done, 2 unusable input (missing or
corrupt run, different trace, no config in common, --out exists).

\b
With --out DIR: deltas.parquet (one row per config and metric),
transitions.parquet (counts per config and label pair) and
changed_requests.parquet (one row per changed request and config).

\b
Example:
  router-replay compare reports/before reports/after --out reports/diff --limit 10
"""


@click.command(epilog=_EPILOG)
@click.argument("run_a", type=click.Path(path_type=str))
@click.argument("run_b", type=click.Path(path_type=str))
@click.option("--out", "out", default=None, type=click.Path(path_type=str),
              help="Directory to write deltas.parquet, transitions.parquet, changed_requests.parquet.")
@click.option("--label", "label", default="decision", show_default=True,
              type=click.Choice(["decision", "policy_reason", "reason"]),
              help="decisions.parquet label whose transitions are counted.")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1),
              help="Rows of each terminal table.")
@click.option("--force", is_flag=True, help="Replace an existing non-empty --out directory.")
@user_errors
def compare(run_a, run_b, out, label, limit, force):
    """Compare run RUN_B with run RUN_A of the same trace, config by config."""
    from replay.analysis import runs as analysis  # lazy: loaded when the command runs
    from replay.runs import rundir  # lazy: loaded when the command runs

    rundir.guard([(out, "compare")], inputs=[run_a, run_b], force=force)  # refuse before any work
    cmp = analysis.compare_runs(run_a, run_b, label=label)
    written = analysis.write_comparison(cmp, out, force=force) if out is not None else []
    click.echo(analysis.format_comparison(cmp, limit=limit))
    if written:
        click.echo(f"\nwrote {', '.join(p.name for p in written)} -> {out}")


COMMANDS = [compare]
