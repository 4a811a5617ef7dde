"""``router-replay generate OUT_DIR``: write a seeded synthetic trace (or trace set)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from replay.cli.app import user_errors
from replay.cli.limits import finite


@click.command("generate")
@click.argument("out_dir", type=click.Path(file_okay=False, dir_okay=True))
@click.option("--requests", "n_requests", type=click.IntRange(min=0), default=3000, show_default=True)
@click.option("--workers", "n_workers", type=click.IntRange(min=1), default=8, show_default=True,
              help="Prefill fleet size (decode peers are added on top).")
@click.option("--dp-size", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--sample-interval-ms", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--max-matches", type=click.IntRange(min=0), default=8, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--rate", "rate_per_s", type=click.FloatRange(min=0, min_open=True), default=None, callback=finite,
              help="Mean requests per second (default: ~280/s, span >= 60 s).")
@click.option("--no-router-inflight", is_flag=True, help="Omit the router_inflight column.")
@click.option("--partition-s", type=click.IntRange(min=1), default=None, metavar="SECONDS",
              help="Write a trace set instead: requests/ and loads/ folders with one Parquet file "
                   "per SECONDS of trace time, generated one at a time (bounded memory), named "
                   "date=YYYY-MM-DD/part-HH.parquet for --partition-s 3600.")
@click.option("--force", is_flag=True, help="Replace a trace OUT_DIR written by generate before.")
@user_errors
def generate(out_dir, n_requests, n_workers, dp_size, sample_interval_ms, max_matches, seed,
             rate_per_s, no_router_inflight, partition_s, force) -> None:
    """Write a synthetic trace directory (requests, loads, workers Parquet).

    \b
    Example:
      router-replay generate traces/generated --requests 3000 --seed 7

    \b
    100M requests at 1000/s (~28 h) as hourly partitions:
      router-replay generate big --requests 100000000 --workers 64 --dp-size 2 \\
          --rate 1000 --partition-s 3600
    """
    from replay.runs import rundir  # lazy: loaded when the command runs
    from replay.trace.synthetic import generate_trace  # lazy: loaded when the command runs

    rundir.guard([(out_dir, "trace")], force=force)
    # built aside and swapped in whole: an interrupted or failed run leaves the old trace as it was
    tmp = rundir.partial_beside(out_dir)
    try:
        with rundir.writing(out_dir):
            if partition_s is not None:
                info = _generate_set(tmp, n_requests=n_requests, n_workers=n_workers, dp_size=dp_size,
                                     sample_interval_ms=sample_interval_ms, max_matches=max_matches, seed=seed,
                                     rate_per_s=rate_per_s, partition_s=partition_s,
                                     router_inflight=not no_router_inflight)
            else:
                info = generate_trace(tmp, n_requests=n_requests, n_workers=n_workers, dp_size=dp_size,
                                      sample_interval_ms=sample_interval_ms, max_matches=max_matches,
                                      seed=seed, rate_per_s=rate_per_s, router_inflight=not no_router_inflight)
            marker = {"source": f"{rundir.GENERATE_SOURCE} (synthetic, seed {seed})",   # what --force may replace
                      "extra": {"requests": n_requests, "workers": n_workers, "dp_size": dp_size,
                                "sample_interval_ms": sample_interval_ms, "max_matches": max_matches,
                                "seed": seed}}
            (Path(tmp) / "trace.json").write_text(json.dumps(marker, indent=2) + "\n")
            rundir.move_into_place(tmp, out_dir)
        tmp = None
    finally:
        rundir.discard(tmp)
    if partition_s is not None:
        click.echo(f"wrote {out_dir}: {info['requests']:,} requests, {info['load_rows']:,} load rows in "
                   f"{info['partitions']} partition(s) of {info['partition_s']} s ({info['files']} files), "
                   f"{info['workers']} workers x dp {info['dp_size']} + {info['decode_peers']} decode peer(s), "
                   f"{info['span_s']} s")
        return
    click.echo(f"wrote {out_dir}: {info['requests']:,} requests, {info['load_rows']:,} load rows, "
               f"{info['workers']} workers x dp {info['dp_size']} + {info['decode_peers']} decode peer(s), "
               f"{info['span_s']} s")


def _generate_set(tmp, **kwargs) -> dict:
    from replay.trace.synthetic import generate_trace_set, plan_trace_set  # lazy: loaded when the command runs

    bar = None
    if sys.stderr.isatty():
        n = len(plan_trace_set(kwargs["n_requests"], rate_per_s=kwargs["rate_per_s"],
                               partition_s=kwargs["partition_s"]))
        bar = click.progressbar(length=n, label="partitions", file=sys.stderr)
        bar.__enter__()

    def progress(k):
        if bar is not None:
            bar.update(k - bar.pos)

    try:
        return generate_trace_set(tmp, progress=progress, **kwargs)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)


COMMANDS = [generate]
