"""``router-replay calibrate TRACE_DIR --out FLEET.toml [--validate DIR] [knobs]``.

Fit the simulator's fleet to a recorded trace, optionally check the fit
against the recording (fidelity), and predict a closed-loop grid from it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import click

from replay.cli.app import user_errors
from replay.cli.limits import check_seeds
from replay.cli.simulate import grid_progress, grid_table
from replay.cli.sweep import _knob_options
from replay.config import KNOBS, Grid

_EXAMPLE = """
TRACE_DIR is a router-replay trace with load samples (native counters) and,
for decode speed, requests.parquet output_tokens, ttft_ms and latency_ms.
FLEET.toml is an ordinary fleet file (`simulate --fleet` reads it).

--validate DIR replays the recorded requests through the fitted fleet with
forced placement and with the router in the loop under trace.json's router
flags, and writes DIR/fidelity.json (score, parts, per-rank figures).  Router
knobs given with --validate (values as for `sweep`) add a closed-loop
prediction grid in DIR/prediction/, printed after the fidelity verdict.

\b
Example:
  router-replay calibrate traces/sample --out runs/fleet.toml \\
      --validate runs/fit --worker-queue-limit 2,4,8 --saturation-queue-floor none,1,2
"""


@click.command(epilog=_EXAMPLE)
@click.argument("trace_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False, path_type=str),
              help="Fleet file to write (TOML).")
@click.option("--validate", "validate_dir", type=click.Path(file_okay=False, path_type=str),
              default=None, help="Check the fitted fleet against the recording; write DIR.")
@click.option("--decode-model", type=click.Choice(["auto", "constant", "linear"]), default="auto",
              show_default=True,
              help="Decode step time: fit a batch-size slope when it matters (auto), never, always.")
@click.option("--refine", is_flag=True,
              help="Refine each worker's decode speed by forced-placement replays (about 50 "
                   "replays of the trace; needs selected_worker and latency_ms).")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="Tokens per hash_ids block when the trace does not say (page_size).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Sampler seed for the router in the loop (default: trace.json extra.seed, else 0).")
@click.option("--freshness-ms", type=click.IntRange(0, 10**9), default=None,
              help="Router load freshness for the replays (default: trace.json extra.freshness_ms, "
                   "else 5000).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Parallel simulations for the prediction grid.")
@click.option("--seeds", "seeds_text", default=None, metavar="N|S1,S2,...",
              help="Prediction grid under several seeds: means, 95% intervals, stable verdicts.")
@_knob_options
@click.option("--force", is_flag=True, help="Replace an existing FLEET.toml / non-empty DIR.")
@click.option("--quiet", "-q", is_flag=True)
@user_errors
def calibrate(trace_dir, out, validate_dir, decode_model, refine, block_size, seed, freshness_ms,
              threads, seeds_text, force, quiet, **knobs):
    """Fit a simulator fleet to TRACE_DIR; optionally validate it and predict a grid."""

    from replay.errors import ReplayError  # lazy: loaded when the command runs
    from replay.runs import rundir  # lazy: loaded when the command runs
    from replay.runs.rundir import (  # lazy: loaded when the command runs
        move_into_place,
        partial_beside,
        refuse_existing,
    )
    from replay.simulate import load_fleet, simulate_grid  # lazy: loaded when the command runs
    from replay.simulate.calibrate import calibrate as fit  # lazy: loaded when the command runs
    from replay.simulate.calibrate import refine_decode  # lazy: loaded when the command runs
    from replay.simulate.fidelity import recorded_seed, validate  # lazy: loaded when the command runs
    from replay.simulate.seeds import parse_seeds  # lazy: loaded when the command runs
    from replay.simulate.tracelog import read_trace_log  # lazy: loaded when the command runs

    fleet_path = Path(out)
    if fleet_path.exists() and Path(trace_dir).resolve() in fleet_path.resolve().parents:
        raise ReplayError(f"--out {out}: is a file of the trace {trace_dir}; write the fleet "
                          "file elsewhere")
    if fleet_path.exists() and not force:
        raise ReplayError(f"{fleet_path}: exists (use --force to replace it)")
    if validate_dir is not None:
        v, t = Path(validate_dir).resolve(), Path(trace_dir).resolve()
        if v == t or v in t.parents or t in v.parents:
            raise ReplayError(f"--validate {validate_dir}: overlaps the trace {trace_dir}; "
                              "give a directory outside it")
        if v == fleet_path.resolve().parent or v in fleet_path.resolve().parents:
            raise ReplayError(f"--validate {validate_dir}: would hold the fleet file {out}; "
                              "write the fleet file elsewhere")
        refuse_existing(Path(validate_dir), force, "validation directory")
    _register_outputs()
    rundir.guard([(out, "fleet"), (validate_dir, "fidelity")], inputs=[trace_dir], force=force)
    texts = {KNOBS[k[len("knob_"):]].flag: v for k, v in knobs.items() if v is not None}
    if texts and validate_dir is None:
        raise ReplayError("router knobs make a prediction grid: give --validate DIR for it")
    grid = Grid.from_texts(texts) if texts else None
    if seeds_text is not None and grid is None:
        raise ReplayError("--seeds applies to the prediction grid: give router knobs and --validate")
    check_seeds(seeds_text)
    try:
        parse_seeds(seeds_text, 0)     # refused now, not after the fit and the validation
    except ValueError as err:
        raise ReplayError(str(err)) from None
    rec = read_trace_log(trace_dir, block_size=block_size)
    cal = fit(rec, decode_model=decode_model)
    extra = (rec.info.get("extra") or {})
    if freshness_ms is None:
        got = extra.get("freshness_ms")
        freshness_ms = got if isinstance(got, int) and not isinstance(got, bool) and got >= 0 else 5000
    refined = []
    if refine:
        refined = refine_decode(rec, cal, seed=recorded_seed(rec) if seed is None else seed,
                                freshness_ms=freshness_ms)
    # the fleet file is written aside and swapped in only when everything below succeeded: a failed
    # or interrupted validation leaves the previous fleet file exactly as it was
    with rundir.file_aside(fleet_path) as fleet_tmp:
        with rundir.writing(fleet_path):
            fleet_tmp.write_text(cal.to_toml(str(trace_dir)))
        fleet = load_fleet(fleet_tmp)  # what simulate will read: the file round-trips
        if not quiet:
            click.echo(f"calibrated {len(cal.urls)} workers from {rec.log.n_requests:,} requests "
                       f"-> {fleet_path}")
            for line in cal.lines():
                click.echo(line)
            missing = cal.not_fitted()
            if missing:
                click.echo(f"not fitted from this trace ({len(missing)}): "
                           + "; ".join(f"{m.name}" + (f" (worker {m.worker})" if m.worker is not None else "")
                                       + f" = {m.value} [{m.how}]" for m in missing))
            click.echo("not fitted (not in any trace): chunked_prefill_size = 0, schedule_policy = fcfs")
            if refined:
                click.echo("decode speed refined by forced-placement replays:")
                for line in refined:
                    click.echo(line)
        if validate_dir is None:
            return
        vdir = Path(validate_dir)
        tmp = partial_beside(vdir)
        try:
            with grid_progress(2, quiet, "validating") as progress:
                fid = validate(rec, fleet, seed=seed, freshness_ms=freshness_ms, out_dir=tmp, force=True,
                               progress=progress)
            fid.write(tmp)
            if not quiet or not fid.good:
                for line in fid.lines():
                    click.echo(line)
            table = None
            if grid is not None:
                try:
                    seeds = parse_seeds(seeds_text, fid.seed)
                except ValueError as err:
                    raise ReplayError(str(err)) from None
                n = len(grid.configs) * (len(seeds) if seeds else 1)
                with grid_progress(n, quiet) as progress:
                    table = simulate_grid(rec.log, fleet, grid, tmp / "prediction", seed=fid.seed,
                                          freshness_ms=freshness_ms, threads=threads,
                                          progress=progress, seeds=seeds)
            move_into_place(tmp, vdir)
            tmp = None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        click.echo(f"validation -> {vdir / 'fidelity.json'}")
    if table is not None and not quiet:
        if not fid.good:
            click.echo(f"WARNING: {fid.verdict()}; the prediction below comes from that model")
        click.echo(f"closed-loop prediction, {table.height} configs -> {vdir / 'prediction'}")
        for line in grid_table(table, grid):
            click.echo(line)


def _register_outputs() -> None:
    """Teach rundir.guard this command's outputs, so --force replaces only what it wrote (called by
    the command, not at import: it imports the simulator, which every CLI start would pay for)."""

    from replay.runs import rundir  # lazy: loaded when the command runs
    from replay.simulate.fidelity import (  # lazy: loaded when the command runs
        FIDELITY_JSON,
        FIDELITY_TOOL,
        FLEET_MARKER,
    )

    def fidelity_dir(path):
        rec = rundir.read_json(path / FIDELITY_JSON)
        if rec is None or rec.get("tool") != FIDELITY_TOOL:
            return rundir.unmarked(path, FIDELITY_JSON)
        extra = sorted(n for n in path.iterdir() if n.name not in
                       {FIDELITY_JSON, "forced", "router", "prediction"}
                       and not re.fullmatch(r"\.?.*\.partial-.*", n.name))
        return f"{extra[0]} was not written by router-replay" if extra else None

    def fleet_file(path):
        try:
            head = path.read_bytes()[:200].decode("utf-8", "replace")
        except OSError as err:
            return f"unreadable ({err.strerror})"
        return None if head.startswith(FLEET_MARKER) else "not a fleet file written by router-replay calibrate"

    rundir.register_kind("fidelity", "validation directory", is_dir=True, recognise=fidelity_dir)
    rundir.register_kind("fleet", "fitted fleet file", is_dir=False, recognise=fleet_file)


COMMANDS = [calibrate]
