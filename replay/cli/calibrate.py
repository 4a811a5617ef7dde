"""``router-replay calibrate TRACE_DIR --out FLEET.toml [--validate DIR] [knobs]``.

Fit the simulator's fleet to a recorded trace, optionally check the fit
against the recording (fidelity), and predict a closed-loop grid from it.
"""

from __future__ import annotations

import json
import os

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

TRACE_DIR may also be the per-request file of SGLang's bench_serving
(--output-details): only the prefill and decode speeds are fitted from it, and
the command says what the file cannot tell (docs/calibration.md).

\b
Example:
  router-replay calibrate traces/sample --out runs/fleet.toml \\
      --validate runs/fit --worker-queue-limit 2,4,8 --saturation-queue-floor none,1,2
  router-replay calibrate bench_results.jsonl --out runs/bench-fleet.toml
"""


@click.command(epilog=_EXAMPLE)
@click.argument("trace_dir", type=click.Path(path_type=str))
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
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object instead (fitted values, fidelity parts, the prediction grid).")
@user_errors
def calibrate(trace_dir, out, validate_dir, decode_model, refine, block_size, seed, freshness_ms,
              threads, seeds_text, force, quiet, as_json, **knobs):
    """Fit a simulator fleet to TRACE_DIR; optionally validate it and predict a grid."""

    from replay.errors import ReplayError  # lazy: loaded when the command runs
    from replay.runs import names  # lazy: loaded when the command runs
    from replay.simulate.workflows import calibrate_trace  # lazy: loaded when the command runs

    texts = {KNOBS[k[len("knob_"):]].flag: v for k, v in knobs.items() if v is not None}
    if os.path.isfile(trace_dir):
        _bench_file(trace_dir, out, force, quiet, as_json, validate_dir=validate_dir, refine=refine,
                    seeds=seeds_text, knobs={k[len("knob_"):]: v for k, v in knobs.items() if v is not None})
        return
    if texts and validate_dir is None:
        raise ReplayError("router knobs make a prediction grid: give --validate DIR for it")
    if seeds_text is not None and not texts:
        raise ReplayError("--seeds applies to the prediction grid: give router knobs and --validate")
    check_seeds(seeds_text)
    grid = Grid.from_texts(texts) if texts else None
    if as_json:
        quiet = True

    def fitted(done):
        if quiet:
            return
        cal = done.calibration
        click.echo(f"calibrated {len(cal.urls)} workers from {done.recorded.log.n_requests:,} requests "
                   f"-> {done.fleet_path}")
        for line in cal.lines():
            click.echo(line)
        missing = cal.not_fitted()
        if missing:
            click.echo(f"not fitted from this trace ({len(missing)}): "
                       + "; ".join(f"{m.name}" + (f" (worker {m.worker})" if m.worker is not None else "")
                                   + f" = {m.value} [{m.how}]" for m in missing))
        click.echo(cal.unfitted_line())
        if done.refined:
            click.echo("decode speed refined by forced-placement replays:")
            for line in done.refined:
                click.echo(line)

    def scored(fid):
        if not quiet or not fid.good:
            for line in fid.lines():
                click.echo(line)

    done = calibrate_trace(trace_dir, out, validate_dir=validate_dir, grid=grid, seeds=seeds_text,
                           decode_model=decode_model, refine=refine, block_size=block_size, seed=seed,
                           freshness_ms=freshness_ms, threads=threads, force=force,
                           progress=lambda n, label: grid_progress(n, quiet, label),
                           on_fit=fitted, on_fidelity=scored)
    if as_json:
        click.echo(json.dumps(_report(done), default=str))
        return
    if done.validate_dir is None or quiet:
        return
    vdir, fid, table = done.validate_dir, done.fidelity, done.prediction
    click.echo(f"validation -> {vdir / names.FIDELITY_JSON}")
    if table is not None:
        if not fid.good:
            click.echo(f"WARNING: {fid.verdict()}; the prediction below comes from that model")
        click.echo(f"closed-loop prediction, {table.height} configs -> {vdir / names.PREDICTION}")
        for line in grid_table(table, grid):
            click.echo(line)


def _bench_file(path, out, force, quiet, as_json, **given) -> None:
    """calibrate on a bench_serving per-request file: the two speeds it supports."""
    from replay.simulate.benchfit import calibrate_bench_file  # lazy: loaded when the command runs

    fit = calibrate_bench_file(path, out, force=force, **given)
    if as_json:
        click.echo(json.dumps({"fleet": str(out), "requests": fit.requests, "source": "bench_serving",
                               "fitted": [s.__dict__ for s in fit.speeds]}))
    elif not quiet:
        click.echo(f"-> {out}")
        for line in fit.lines():
            click.echo(line)


def _report(done) -> dict:
    """``calibrate --json``: the fleet file, the fitted values, the fidelity parts and the prediction."""
    cal = done.calibration
    out = {"fleet": str(done.fleet_path), "requests": done.recorded.log.n_requests, "workers": cal.urls,
           "fitted": [{"name": f.name, "worker": f.worker,
                       "url": None if f.worker is None else cal.urls[f.worker], "value": f.value,
                       "fitted": f.fitted, "how": f.how, "samples": f.samples, "residual": f.residual}
                      for f in cal.fitted],
           "refined": done.refined, "fidelity": None, "prediction": None}
    if done.validate_dir is not None:
        out["validation"] = str(done.validate_dir)
        out["fidelity"] = done.fidelity.as_dict()
        out["prediction"] = None if done.prediction is None else done.prediction.to_dicts()
    return out


COMMANDS = [calibrate]
