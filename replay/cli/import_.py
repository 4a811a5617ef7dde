"""``router-replay import``: request sources, engine exports and a recording -> a trace directory."""

from __future__ import annotations

from pathlib import Path

import click

from replay.cli.app import user_errors
from replay.cli.limits import MAX_LAG_MS, MAX_PAGE_SIZE, MAX_TOKENS, finite
from replay.cli.progress import Progress
from replay.errors import ReplayError


def _pairs(values, flag: str) -> list[tuple[str, str]]:
    out = []
    for v in values:
        url, sep, path = v.rpartition("=")
        if not sep or not url or not path or "://" not in url:
            raise ReplayError(f"{flag} takes URL=PATH (the engine's worker URL, then its file or folder); "
                              f"got {v!r}")
        out.append((url, path))
    return out


@click.command("import")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The trace directory to write.")
@click.option("--token-export", multiple=True, type=click.Path(exists=True),
              help="Router token export: *.ndjson.gz files or their folder (repeat).")
@click.option("--dynamo-trace", multiple=True, type=click.Path(exists=True),
              help="Dynamo request trace (*.jsonl.gz) as the request source instead.")
@click.option("--mooncake", multiple=True, type=click.Path(exists=True),
              help="A Mooncake-format log (*.jsonl) as the request source instead.")
@click.option("--engine-export", multiple=True, metavar="URL=PATH",
              help="An engine's request export (file or folder) and the worker URL that served it (repeat).")
@click.option("--recorded", type=click.Path(exists=True, file_okay=False),
              help="The output of `router-replay record` (loads/, kv_events/, workers.parquet).")
@click.option("--v1-loads", multiple=True, metavar="URL=PATH", help="Polled /v1/loads answers, one JSON a line.")
@click.option("--prometheus", multiple=True, metavar="URL=PATH", help="Prometheus text scrapes of an engine.")
@click.option("--page-size", type=click.IntRange(1, MAX_PAGE_SIZE), help="Block size to hash with (default: recorded).")
@click.option("--index-lag-ms", type=click.FloatRange(0, MAX_LAG_MS), default=0.0, show_default=True, callback=finite,
              help="The router's KV-event processing delay: an event counts from ts + lag.")
@click.option("--matches", type=click.Choice(["auto", "events", "placement", "none"]), default="auto",
              show_default=True, help="Where matches come from (auto: KV events, else the placement model).")
@click.option("--kv-capacity-tokens", type=click.IntRange(1, MAX_TOKENS),
              help="Per-worker KV capacity for the placement model (default: recorded max_total_num_tokens).")
@click.option("--dynamo-worker", multiple=True, metavar="ID=URL", help="Map a Dynamo prefill_worker_id to a URL.")
@click.option("--router-inflight", type=click.Choice(["none", "derived"]), default="none", show_default=True,
              help="derived: loads carry each worker's in-flight count from the served requests (one router).")
@click.option("--router-flags", default=None, metavar="'FLAGS'",
              help="The production router's knob flags, e.g. '--worker-queue-limit 8 --saturation-queue-floor 2': "
                   "checked like the router's CLI, written to trace.json's router (default: record's).")
@click.option("--kv-format", type=click.Choice(["default", "dynamo"]), default=None,
              help="The engines' KV-event hash format (default: what record was told, else unknown).")
@click.option("--skip-bad-lines", is_flag=True, help="Count and skip malformed JSON lines instead of refusing.")
@click.option("--force", is_flag=True, help="Replace an existing output of this tool.")
@user_errors
def import_(out, token_export, dynamo_trace, mooncake, engine_export, recorded, v1_loads, prometheus, page_size,
            index_lag_ms, matches, kv_capacity_tokens, dynamo_worker, router_inflight, router_flags, kv_format,
            skip_bad_lines, force):
    """Build a replayable trace from what a fleet left on disk.

    \b
    Example:
      router-replay import --token-export exports/slug=chat \\
          --engine-export http://10.0.0.1:30000=metrics/a --engine-export http://10.0.0.2:30000=metrics/b \\
          --recorded traces/fleet-week --out traces/week

    Writes requests.parquet (with matches rebuilt as the router's KV indexer
    answered at each request's arrival), loads/, workers.parquet and
    trace.json (what was joined, what was missing: extra.capture).
    """
    from replay.capture.importer import ImportSpec, import_capture  # lazy: loaded when the command runs
    from replay.config import parse_router_command_line  # lazy: loaded when the command runs

    dyn = {}
    for v in dynamo_worker:
        wid, sep, url = v.partition("=")
        if not sep or "://" not in url:
            raise ReplayError(f"--dynamo-worker takes ID=URL; got {v!r}")
        dyn[wid] = url
    spec = ImportSpec(out=Path(out), token_export=list(token_export), dynamo=list(dynamo_trace),
                      mooncake=list(mooncake), engine_exports=_pairs(engine_export, "--engine-export"),
                      recorded=Path(recorded) if recorded else None, v1_loads=_pairs(v1_loads, "--v1-loads"),
                      prometheus=_pairs(prometheus, "--prometheus"), page_size=page_size,
                      index_lag_ms=index_lag_ms, matches=matches, kv_capacity_tokens=kv_capacity_tokens,
                      dynamo_workers=dyn, skip_bad_lines=skip_bad_lines,
                      router_inflight=router_inflight, force=force, kv_format=kv_format,
                      router_flags=parse_router_command_line(router_flags) if router_flags is not None else None)
    bar: dict[str, Progress] = {}

    def progress(label, i, n):   # a bar per stage on a terminal, a line every ~10 s when piped
        if label not in bar:
            bar[label] = Progress(label, n)
        bar[label].at(i, n)

    try:
        res = import_capture(spec, progress)
    finally:
        for b in bar.values():
            b.close()
    f = res.facts
    click.echo(f"imported {f['requests']:,} requests ({f['requests_source']}), {f['load_rows']:,} load rows, "
               f"{f['workers']} workers into {res.out}; matches: {f['matches_source']}")
    if res.warnings:
        click.echo("warning: " + "; ".join(res.warnings), err=True)


COMMANDS = [import_]
