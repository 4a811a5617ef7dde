"""``router-replay check RUN_DIR --baseline FILE``: the benchmark-CI gate (and ``--write-baseline``)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import click

from replay.cli.app import user_errors
from replay.runs import metrics

_EPILOG = """
Write a baseline once from a trusted run, then check every new run of the same
trace against it. Tolerances: --tolerance METRIC=VALUE (repeatable) with VALUE
in points for rates (0.5pt), relative (10%) or absolute for counts and queue
readings (2); the three shortcut flags set the usual ones. Tolerances given
with --write-baseline are stored in the file; given with --baseline they
override the file's. Defaults: hit_rate 0.5pt, selected_waiting_p99 10%,
decision-label shares 1pt. Only a move in a metric's bad direction beyond its
tolerance fails; improvements never fail.

A replay is deterministic, so the baseline also stores every decision (per
config and request: worker, label, pin, divert, 503) and any change fails,
with counts and the first changed requests; --allow-decision-drift reports
the changes and leaves the verdict to the tolerances (given with
--write-baseline, the file remembers it). Replay settings that differ from
the baseline's run (freshness, seed, per-rank) are named first. A pass prints
one line (--verbose: every check).

\b
""" + textwrap.fill(f"Metrics: {metrics.help_list()}.", 80) + """

\b
Exit codes:
  0  every checked metric within tolerance and no decision changed
     (or the baseline was written)
  1  a changed decision or a regression (each named in the output)
  2  unusable input: missing or corrupt run or baseline, a trace hash that
     differs from the baseline's, baseline configs missing from the run,
     an output file that exists without --force

\b
Example:
  router-replay check reports/main --write-baseline ci/baseline.json
  router-replay check reports/pr --baseline ci/baseline.json \\
      --max-hit-rate-drop 0.5 --junit reports/check.xml
"""


def _tolerances(tolerance, hit_drop, p99_rise, label_share, stored):
    from replay.analysis import runs as analysis  # lazy: loaded when the command runs

    tol = {}
    if hit_drop is not None:
        tol["hit_rate"] = f"{hit_drop}pt"
    if p99_rise is not None:
        tol["selected_waiting_p99"] = f"{p99_rise}%"
    if label_share is not None:
        for s in analysis.LABEL_SHARES:
            if stored is None or s in stored:
                tol[s] = f"{label_share}pt"
    if stored is not None:
        tol = {k: v for k, v in tol.items() if k in stored}
    tol.update({k: v.text for k, v in analysis.parse_tolerance_args(tolerance).items()})
    return tol


@click.command(epilog=_EPILOG)
@click.argument("run_dir", type=click.Path(path_type=str))
@click.option("--baseline", "baseline", default=None, type=click.Path(path_type=str),
              help="Baseline JSON to check RUN_DIR against.")
@click.option("--write-baseline", "write_baseline", default=None, type=click.Path(path_type=str),
              help="Write RUN_DIR's metrics and the tolerances as a baseline JSON instead of checking.")
@click.option("--metric", "metrics", multiple=True, metavar="NAME",
              help="With --write-baseline: a metric to store (repeatable; default hit_rate, "
                   "selected_waiting_p99 and the four decision-label shares).")
@click.option("--tolerance", "tolerance", multiple=True, metavar="METRIC=VALUE",
              help="Tolerance of one metric: 0.5pt, 10% or an absolute number (repeatable).")
@click.option("--max-hit-rate-drop", type=click.FloatRange(min=0), default=None, metavar="POINTS",
              help="hit_rate may drop this many percentage points (default 0.5).")
@click.option("--max-p99-rise", type=click.FloatRange(min=0), default=None, metavar="PERCENT",
              help="selected_waiting_p99 may rise this many percent (default 10).")
@click.option("--max-label-share-change", type=click.FloatRange(min=0), default=None, metavar="POINTS",
              help="Decision-label shares may move this many points the bad way (default 1).")
@click.option("--junit", "junit", default=None, type=click.Path(path_type=str),
              help="Also write JUnit XML (one testcase per config x metric).")
@click.option("--markdown", "markdown", default=None, type=click.Path(path_type=str),
              help="Also write the Markdown report to this file.")
@click.option("--allow-decision-drift", "allow_drift", is_flag=True, default=None,
              help="Report changed decisions without failing on them (the tolerances decide).")
@click.option("--verbose", "-v", is_flag=True, help="Print every check, also on a pass.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object instead.")
@click.option("--force", is_flag=True, help="Replace existing --write-baseline, --junit or --markdown files.")
@user_errors
def check(run_dir, baseline, write_baseline, metrics, tolerance, max_hit_rate_drop, max_p99_rise,
          max_label_share_change, junit, markdown, allow_drift, verbose, as_json, force):
    """Check RUN_DIR against a baseline under tolerances; exit 0 (ok), 1 (regression), 2 (bad input)."""

    from replay.analysis import runs as analysis  # lazy: loaded when the command runs
    from replay.errors import ReplayError  # lazy: loaded when the command runs
    from replay.runs import rundir  # lazy: loaded when the command runs

    if (baseline is None) == (write_baseline is None):
        raise ReplayError("give exactly one of --baseline FILE (check) or --write-baseline FILE")
    rundir.guard([(write_baseline, "baseline"), (junit, "junit"), (markdown, "markdown")],
                 inputs=[run_dir, baseline], force=force)
    if write_baseline is not None:
        if junit or markdown:
            raise ReplayError("--junit and --markdown apply to checking (--baseline), not --write-baseline")
        tol = _tolerances(tolerance, max_hit_rate_drop, max_p99_rise, max_label_share_change,
                          set(metrics) if metrics else None)
        rec = analysis.write_baseline(run_dir, write_baseline, force=force, metrics=list(metrics) or None,
                                      tolerances=tol, allow_decision_drift=bool(allow_drift))
        dec = rec.get("decisions")
        held = (f"; decisions of {dec['requests']:,} requests per config"
                + (" (changes reported, not failed)" if rec["allow_decision_drift"] else "")
                if dec else "; no decisions (the run kept none): metrics only")
        if as_json:
            click.echo(json.dumps({"baseline": write_baseline, "configs": len(rec["configs"]),
                                   "metrics": rec["metrics"], "tolerances": rec["tolerances"],
                                   "decisions_requests": dec["requests"] if dec else None,
                                   "allow_decision_drift": rec["allow_decision_drift"]}))
            return 0
        click.echo(f"wrote baseline {write_baseline}: {len(rec['configs'])} configs x "
                   f"{len(rec['metrics'])} metrics ({', '.join(f'{k} {v}' for k, v in rec['tolerances'].items())})"
                   + held)
        return 0
    if metrics:
        raise ReplayError("--metric applies to --write-baseline; a check uses the metrics the baseline stores")
    base = analysis.load_baseline(baseline)
    tol = _tolerances(tolerance, max_hit_rate_drop, max_p99_rise, max_label_share_change, set(base["metrics"]))
    res = analysis.check_run(run_dir, base, tolerances=tol, allow_decision_drift=allow_drift)
    if as_json:
        click.echo(json.dumps(res.to_json(), default=str))
    else:
        click.echo(res.text(verbose), nl=False)
    if junit is not None:
        rundir.write_text_atomic(Path(junit), res.junit_xml())
    if markdown is not None:
        rundir.write_text_atomic(Path(markdown), res.markdown())
    if res.exit_code:
        click.echo(f"check failed: {res.verdict()[len('FAIL: '):]}", err=True)
    sys.exit(res.exit_code)


COMMANDS = [check]
