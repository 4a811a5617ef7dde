"""``router-replay sweep TRACE_DIR --out RUN_DIR [knobs]``: the grid replay."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import click

from replay.cli.app import outputs_closed, user_errors
from replay.cli.progress import Progress
from replay.config import KNOBS, Grid, RouterConfig

_EXAMPLE = """
Every router knob takes one value, a comma list, an inclusive range a..b, or
`none` where the router allows unset; the grid is their cartesian product.
Combinations the router would refuse are skipped (listed in run.json).

\b
Example:
  router-replay sweep traces/sample --out reports/sample \\
      --worker-queue-limit none,2,4,8 --saturation-queue-floor none,1..4
"""


def _knob_options(fn):
    for name in reversed(list(KNOBS)):
        spec = KNOBS[name]
        if spec.kind == "bool":
            fn = click.option(
                spec.flag, f"knob_{name}", default=None, is_flag=False, flag_value="true",
                metavar="[BOOL,...]",
                help="Disable the pressure guard; `true,false` sweeps both (router default: enabled).",
            )(fn)
        elif not spec.router:
            fn = click.option(
                spec.flag, f"knob_{name}", default=None, metavar="|".join(spec.choices),
                help=(f"Replay-only policy variant, not a router flag: {' or '.join(spec.choices)}; "
                      f"a comma list sweeps both (default: {spec.choices[0]}, the router's behaviour; "
                      "docs/replay-model.md)."),
            )(fn)
        else:
            default = getattr(RouterConfig(), name)
            fn = click.option(
                spec.flag, f"knob_{name}", default=None, metavar="VALUES",
                help=f"Values for {spec.flag} (router default: {'none' if default is None else default}).",
            )(fn)
    return fn


@click.command(epilog=_EXAMPLE)
@click.argument("trace_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--out", "out", required=True, type=click.Path(path_type=str),
              help="Run directory to write (summary, decisions, run.json).")
@_knob_options
@click.option("--freshness-ms", default=5000, show_default=True, type=click.IntRange(min=0),
              help="Load-sample freshness window (inclusive).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1),
              help="Seed of the power-of-k sampler's draws.")
@click.option("--model", default=None, help="Replay only the requests of this model.")
@click.option("--decisions/--no-decisions", default=True, show_default=True,
              help="Write decisions.parquet (one row per request and config).")
@click.option("--decisions-layout", type=click.Choice(["long", "outcomes"]), default="long", show_default=True,
              help="long: one row per request and config; outcomes: one row per request, its distinct outcomes "
                   "once and each config's index into them (smaller, several times faster to write; "
                   "replay.read_decisions reads either as the long table).")
@click.option("--report/--no-report", default=True, show_default=True,
              help="Write report.html (see `router-replay report`).")
@click.option("--per-dp-rank", is_flag=True,
              help="Read limit and floor values per rank and multiply them by the fleet's dp_size.")
@click.option("--threads", default=None, type=click.IntRange(min=1),
              help="Kernel threads (results never depend on it).")
@click.option("--window", default="auto", show_default=True, metavar="auto|none|DURATION",
              help="Replay the trace in time windows of this length (90s, 15m, 1h, 1d) so memory is "
                   "bound by a window; auto: in memory when the trace is small. Results never depend on it.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="ray: run the windows (and config blocks) as Ray tasks; needs router-replay[ray].")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="Ray cluster to join (e.g. ray://head:10001 or auto); default: start a local Ray.")
@click.option("--ray-cpus", default=None, type=click.IntRange(min=1),
              help="CPUs of the local Ray started without --ray-address (default: all).")
@click.option("--configs-per-task", default=None, type=click.IntRange(min=1),
              help="With --executor ray: split the grid into blocks of this many configs per task.")
@click.option("--ray-retries", default=2, show_default=True, type=click.IntRange(min=0),
              help="With --executor ray: retries of a failed task before the sweep fails.")
@click.option("--force", is_flag=True, help="Replace an existing non-empty RUN_DIR.")
@click.option("--quiet", "-q", is_flag=True, help="Print nothing but errors.")
@user_errors
def sweep(trace_dir, out, freshness_ms, seed, model, decisions, decisions_layout, report, per_dp_rank, threads, window,
          executor, ray_address, ray_cpus, configs_per_task, ray_retries, force, quiet, **knobs):
    """Replay TRACE_DIR under every config of a grid of router knobs, in one pass."""
    from replay import run_sweep  # lazy: loaded when the command runs
    from replay.analysis.recorded import grid_dir_error  # lazy: loaded when the command runs
    from replay.errors import ReplayError  # lazy: loaded when the command runs
    from replay.runs import rundir  # lazy: loaded when the command runs
    from replay.sweep.run import check_grid  # lazy: loaded when the command runs
    from replay.trace import NS, format_window, parse_window  # lazy: loaded when the command runs

    not_a_trace = grid_dir_error(trace_dir)
    if not_a_trace:
        raise ReplayError(not_a_trace)
    rundir.guard([(out, "run")], inputs=[trace_dir], force=force, say=None if not quiet else (lambda _t: None))
    window_ns = parse_window(window)    # a ParamError: user_errors names the flag
    for flag, value in (("--ray-address", ray_address), ("--ray-cpus", ray_cpus),
                        ("--configs-per-task", configs_per_task)):
        if value is not None and executor != "ray":
            raise ReplayError(f"{flag} needs --executor ray")
    texts = {KNOBS[k[len("knob_"):]].flag: v for k, v in knobs.items() if v is not None}
    grid = Grid.from_texts(texts, per_dp_rank=per_dp_rank)   # scaled by the fleet's dp_size in run_sweep
    check_grid(grid, threads)
    if not per_dp_rank and grid.warning_line() and not quiet:
        click.echo(f"warning: {grid.warning_line()}", err=True)
    show_bar = not quiet and sys.stderr.isatty()
    if not quiet and executor == "local":
        from replay.sweep import engine  # lazy: loaded when the command runs

        if engine.kernels_cold():
            click.echo("compiling kernels (first run, about 20 s; later runs load them from the cache)", err=True)
    bar = Progress("replaying", quiet=quiet)   # a bar on a terminal, a line every ~10 s when piped

    def on_start(n):
        bar.start(n)

    def progress(n):
        bar.update(n)

    def status(text):
        if show_bar:
            click.echo(text, err=True)

    try:
        result = run_sweep(trace_dir, grid, out=out, seed=seed, freshness_ms=freshness_ms,
                           model=model, decisions=decisions, decisions_layout=decisions_layout, force=force,
                           report=report,
                           threads=threads, progress=progress, on_start=on_start, status=status, window=window_ns,
                           executor=executor, ray_address=ray_address, ray_cpus=ray_cpus,
                           configs_per_task=configs_per_task,
                           ray_retries=ray_retries if executor == "ray" else None)
    finally:
        bar.close()
    if per_dp_rank and result.grid.warning_line() and not quiet:
        click.echo(f"warning: {result.grid.warning_line()}", err=True)
    if result.run.get("report_error") and not quiet:
        click.echo(f"warning: report.html not written ({result.run['report_error']}); "
                   f"retry with `router-replay report {out}`", err=True)
    if not quiet:
        s = result.summary
        t = result.timings
        n_req = int(result.run["trace"]["requests"])
        n_dec = n_req * s.height
        ex = result.run.get("execution", {})
        how = ""
        if ex.get("window_s"):
            how = f" ({ex['windows']} windows of {format_window(ex['window_s'] * NS)}"
            how += f", {ex['tasks']} Ray tasks)" if ex.get("executor") == "ray" else ")"
        click.echo(f"replayed {n_req:,} requests x {s.height} configs "
                   f"= {n_dec:,} decisions in {t['total_s']:.2f} s{how} -> {out}")
        _print_top(s)

        from replay.analysis.closed_loop import open_loop_line  # lazy: loaded when the command runs
        from replay.analysis.recorded import agreement_lines, read_recorded  # lazy: loaded when the command runs

        click.echo(textwrap.fill(f"note: {open_loop_line(trace_dir)}", width=100, subsequent_indent="  ",
                                 break_on_hyphens=False))
        for line in agreement_lines(s, read_recorded(trace_dir), seed=seed, freshness_ms=freshness_ms):
            click.echo(line)
        report = Path(out) / rundir.REPORT
        if report.is_file():
            click.echo(f"report: {report} (open it in a browser)")
    outputs_closed()   # run_sweep has swapped the finished run directory into place


def _print_top(s) -> None:
    cols = [c for c in ("config_id", "worker_queue_limit", "saturation_queue_floor", "hit_rate",
                        "owner_rate", "pinned", "diverted", "selected_waiting_p99") if c in s.columns]
    head = s.select(cols).sort("hit_rate", descending=True, nulls_last=True).head(5)
    click.echo("best configs by hit rate: (hit_rate: decision-time, the blocks the chosen worker held "
               "when the router decided / query blocks)")
    click.echo("  " + "  ".join(f"{c:>22}" for c in cols))
    for row in head.iter_rows():
        cells = []
        for v in row:
            if isinstance(v, float):
                cells.append(f"{v:>22.4f}")
            else:
                cells.append(f"{'none' if v is None else v!s:>22}")
        click.echo("  " + "  ".join(cells))


COMMANDS = [sweep]
