"""``router-replay generate OUT_DIR``: write a seeded synthetic trace (or trace set)."""

from __future__ import annotations

import contextlib
import sys

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
    from replay import generate_trace_dir  # lazy: loaded when the command runs

    with _partitions_bar(n_requests, rate_per_s, partition_s) as progress:
        info = generate_trace_dir(out_dir, n_requests=n_requests, n_workers=n_workers, dp_size=dp_size,
                                  sample_interval_ms=sample_interval_ms, max_matches=max_matches, seed=seed,
                                  rate_per_s=rate_per_s, router_inflight=not no_router_inflight,
                                  partition_s=partition_s, force=force, progress=progress)
    if partition_s is not None:
        click.echo(f"wrote {out_dir}: {info['requests']:,} requests, {info['load_rows']:,} load rows in "
                   f"{info['partitions']} partition(s) of {info['partition_s']} s ({info['files']} files), "
                   f"{info['workers']} workers x dp {info['dp_size']} + {info['decode_peers']} decode peer(s), "
                   f"{info['span_s']} s")
        return
    click.echo(f"wrote {out_dir}: {info['requests']:,} requests, {info['load_rows']:,} load rows, "
               f"{info['workers']} workers x dp {info['dp_size']} + {info['decode_peers']} decode peer(s), "
               f"{info['span_s']} s")


@contextlib.contextmanager
def _partitions_bar(n_requests: int, rate_per_s: float | None, partition_s: int | None):
    """A trace set's partitions as a bar on a terminal (nothing when piped or for one file)."""
    from replay.trace.synthetic import plan_trace_set  # lazy: loaded when the command runs

    if partition_s is None or not sys.stderr.isatty():
        yield None
        return
    n = len(plan_trace_set(n_requests, rate_per_s=rate_per_s, partition_s=partition_s))
    with click.progressbar(length=n, label="partitions", file=sys.stderr) as bar:
        yield lambda k: bar.update(k - bar.pos)


COMMANDS = [generate]
