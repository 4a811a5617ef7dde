"""``router-replay record``: a live fleet's LoadStat and KV-event streams to a trace set."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click

from replay.cli.app import user_errors
from replay.cli.limits import MAX_PAGE_SIZE, MAX_PORT, check_rank_ports
from replay.cli.progress import PipedStatus
from replay.errors import ReplayError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_seconds(text: str, flag: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhd]?)", str(text).strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ReplayError(f"{flag} must be a positive duration like 30s, 15m, 1h, 1d; got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _check_port(url: str, where: str) -> None:
    """A worker URL's port must be a port: ``:99999`` was asked for /server_info and reported as
    "Connection refused"."""
    try:
        port = urlsplit(url).port
    except ValueError:          # urllib: "Port out of range 0-65535", or not a number
        port = -1
    if port is not None and not 1 <= port <= MAX_PORT:
        raise ReplayError(f"{where}: {url!r}: its port is not a port (1..{MAX_PORT})")


def _urls(workers, workers_file) -> list[str]:
    urls = list(workers)
    for url in urls:
        _check_port(url, "--worker")
    if workers_file:
        p = Path(workers_file)
        try:
            lines = p.read_text().splitlines()
        except OSError as err:
            raise ReplayError(f"{p}: cannot read ({err.strerror})") from None
        for i, line in enumerate(lines):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not re.match(r"^https?://[^/\s]+", line):
                raise ReplayError(f"{p}: line {i + 1}: not a worker URL: {line!r}")
            _check_port(line, f"{p}: line {i + 1}")
            urls.append(line)
    return urls


@click.command("record")
@click.option("--worker", "workers", multiple=True, metavar="URL", help="An engine's URL (repeat).")
@click.option("--workers-file", type=click.Path(dir_okay=False), help="A file of engine URLs, one a line.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The trace set to write.")
@click.option("--duration", default=None, help="Stop after this long (30s, 15m, 1h); default: until SIGINT/SIGTERM.")
@click.option("--flush-interval", default="10s", show_default=True,
              help="Buffered rows are written every this long: the most a kill -9 can lose.")
@click.option("--rotate", type=click.Choice(["hour", "day"]), default="hour", show_default=True,
              help="Partition (date=/hour=) of the written parts.")
@click.option("--dp-size", type=click.IntRange(1),
              help="Override the publishing ranks (advertised: kv_events.dp_size).")
@click.option("--page-size", type=click.IntRange(1, MAX_PAGE_SIZE),
              help="Override the hashing block size (advertised: kv_events.block_size).")
@click.option("--load-port-base", type=click.IntRange(1, 65535), help="LoadStat PUB port of rank 0.")
@click.option("--kv-port-base", type=click.IntRange(1, 65535), help="KV-event PUB port of rank 0.")
@click.option("--replay-port-base", type=click.IntRange(1, 65535), help="KV-event replay port of rank 0.")
@click.option("--kv-topic", default=None, help="KV-event topic to subscribe (default: advertised, else all).")
@click.option("--retry", "retry", default="10s", show_default=True,
              help="Ask an engine that did not answer /server_info again after this long.")
@click.option("--replay-timeout", default="5s", show_default=True,
              help="How long to wait for a replay socket's answer before the range is a gap.")
@click.option("--kv-format", type=click.Choice(["default", "dynamo"]), default=None,
              help="The engines' --kv-events-config \"format\" (not advertised by /server_info; "
                   "default: unknown, and salted requests' matches are then not called exact).")
@click.option("--router-flags", default=None, metavar="'FLAGS'",
              help="The production router's knob flags, e.g. '--worker-queue-limit 8' (kept for import).")
@click.option("--force", is_flag=True, help="Replace an existing output of this tool.")
@user_errors
def record(workers, workers_file, out, duration, flush_interval, rotate, dp_size, page_size, load_port_base,
           kv_port_base, replay_port_base, kv_topic, retry, replay_timeout, kv_format, router_flags, force):
    """Record every rank's LoadStat and KV-event streams of a live fleet into a trace set.

    \b
    Example:
      router-replay record --worker http://10.0.0.1:30000 --worker http://10.0.0.2:30000 \\
          --out traces/fleet-week --flush-interval 10s

    Writes OUT/loads/, OUT/kv_events/, OUT/gaps/ (hive-partitioned Parquet
    parts), OUT/workers.parquet and OUT/record.json (streams, gaps, restarts,
    malformed frames, unreachable engines; "complete": true after a clean stop).
    """
    from replay.capture import outguard  # lazy: loaded when the command runs
    from replay.capture.recorder import (  # lazy: loaded when the command runs
        Overrides,
        Recorder,
        StatusLine,
        install_signal_handlers,
    )
    from replay.config import parse_router_command_line  # lazy: loaded when the command runs
    from replay.runs import rundir  # lazy: loaded when the command runs

    urls = _urls(workers, workers_file)
    flags = parse_router_command_line(router_flags) if router_flags is not None else None
    dur = parse_seconds(duration, "--duration") if duration is not None else None
    flush = parse_seconds(flush_interval, "--flush-interval")
    retry_s = parse_seconds(retry, "--retry")
    replay_timeout_s = parse_seconds(replay_timeout, "--replay-timeout")
    check_rank_ports(dp_size, {"--load-port-base": load_port_base, "--kv-port-base": kv_port_base,
                               "--replay-port-base": replay_port_base})
    rundir.guard([(out, outguard.RECORDING)], force=force)
    outguard.clear(Path(out))
    ov = Overrides(dp_size=dp_size, page_size=page_size, load_port_base=load_port_base,
                   kv_port_base=kv_port_base, replay_port_base=replay_port_base, kv_topic=kv_topic,
                   kv_format=kv_format)
    status = StatusLine() if sys.stderr.isatty() else PipedStatus()   # piped: the status every ~10 s
    rec = Recorder(urls, Path(out), overrides=ov, flush_s=flush, rotate_s=3600 if rotate == "hour" else 86400,
                   retry_s=retry_s, replay_timeout_s=replay_timeout_s, status=status, router_flags=flags)
    install_signal_handlers(rec)
    facts = rec.run(dur)
    click.echo(f"recorded {facts['rows']['loads']:,} load rows and {facts['rows']['kv_events']:,} KV events "
               f"from {len(facts['workers'])} workers ({len(facts['streams'])} streams) into {out}; "
               f"{facts['gaps']} gaps, {facts['restarts']} restarts, {facts['malformed_frames']} malformed frames"
               + (f"; unreachable: {', '.join(facts['unreachable'])}" if facts["unreachable"] else ""))


COMMANDS = [record]
