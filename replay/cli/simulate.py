"""``router-replay simulate LOG --fleet FLEET --out DIR [knobs]``: the fleet simulator."""

from __future__ import annotations

import contextlib
import math

import click

from replay.cli.app import user_errors
from replay.cli.limits import check_fleet_sizes, check_seeds
from replay.cli.progress import Progress
from replay.cli.sweep import _knob_options
from replay.config import KNOB_SHORT, KNOBS, Grid

_EXAMPLE = """
LOG is a request log: Mooncake (JSONL or Parquet: timestamp ms, input_length,
output_length, hash_ids), kv-cache-tester session files (a folder or one file;
sessions start at --session-rate, --sessions N), Azure LLM 2023/2024 or BurstGPT
CSV and SGLang bench_serving --output-details output (synthetic prefixes,
seeded), a Dynamo request trace; or a trace directory with requests.parquet
hash_ids and output_tokens (the block size is the trace's page_size). The
format is detected (--format names it); traces/README.md shows each.
--forced-placement sends each request of a trace directory to the worker that
production chose (selected_worker) instead of asking the router.
Router knobs take the values `sweep` takes; one config writes the trace into
DIR, a grid writes DIR/config-<id>/ per config and DIR/closed_loop_summary.parquet.

\b
Example:
  router-replay simulate traces/sample-log/requests.jsonl \\
      --fleet traces/sample-fleet.toml --out traces/sample --force \\
      --worker-queue-limit 8
"""


BIG_INTERVAL_ROWS = 20_000_000  # about 2 GiB of rows before compression


@click.command(epilog=_EXAMPLE)
@click.argument("log", type=click.Path(path_type=str))
@click.option("--fleet", "fleet_path", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="Fleet file (TOML, or JSON by suffix); flags below override it.")
@click.option("--out", "out", required=True, type=click.Path(path_type=str),
              help="Directory to write (trace, outcomes, or one directory per config).")
@_knob_options
@click.option("--workers", "workers_text", default=None, metavar="N[,N...]",
              help="Prefill workers; a list runs a capacity plan over fleets (docs/capacity.md).")
@click.option("--dp-size", "dp_text", default=None, metavar="N[,N...]",
              help="Data-parallel ranks per worker (per-rank rates kept); a list plans over it.")
@click.option("--load-scale", "scale_text", default=None, metavar="X[,X...]",
              help="Traffic levels, x the log (replicated with fresh prefix namespaces).")
@click.option("--per-dp-rank", is_flag=True,
              help="--worker-queue-limit / --saturation-queue-floor values are per rank (x dp_size).")
@click.option("--prefill-tokens-per-s", type=float, default=None, help="Per rank.")
@click.option("--decode-tokens-per-s", type=float, default=None, help="Per rank (decode steps/s).")
@click.option("--max-running-requests", type=int, default=None, help="Per rank.")
@click.option("--max-total-num-tokens", type=int, default=None, help="Per rank KV capacity.")
@click.option("--decode-peers", type=int, default=None, help="Decode workers listed in workers.parquet.")
@click.option("--format", "fmt", default="auto", show_default=True,
              type=click.Choice(["auto", "mooncake", "kv-cache-tester", "azure", "burstgpt", "bench-serving",
                                 "dynamo"]),
              help="Log format (auto: detected from the file; traces/README.md lists each with an example).")
@click.option("--block-size", type=click.IntRange(min=1), default=None,
              help="Tokens per hash_ids block (default: the log's own where it says, else 512; a trace "
                   "directory's page_size).")
@click.option("--sessions", type=click.IntRange(min=1), default=None,
              help="kv-cache-tester: session instances to start (default: one per session file).")
@click.option("--session-rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="kv-cache-tester: sessions started per second (Poisson, seeded by --seed; default 0.05).")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=None,
              help="Simulate only the first N requests of the log.")
@click.option("--publish-interval-ms", type=int, default=None,
              help="Interval publishing: ms between samples (default: the fleet's, else 100).")
@click.option("--forced-placement", is_flag=True,
              help="Trace directory LOG only: place requests where production did.")
@click.option("--index-lag-ms", type=int, default=0, show_default=True)
@click.option("--freshness-ms", type=int, default=5000, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True)
@click.option("--seeds", "seeds_text", default=None, metavar="N|S1,S2,...",
              help="Run every config under N seeds (--seed, --seed+1, ...) or the listed ones: "
                   "means, 95% intervals and a stable verdict per config.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Parallel simulations for a grid.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Run a grid's simulations in local threads or as Ray tasks (same results).")
@click.option("--ray-address", default=None, help="Ray cluster to join (default: start a local Ray).")
@click.option("--ray-cpus", type=click.IntRange(min=1), default=None,
              help="CPUs of the local Ray (default: all).")
@click.option("--ray-retries", type=click.IntRange(min=0), default=None,
              help="Times a failed Ray task is retried (default 2).")
@click.option("--resume", is_flag=True,
              help="A grid or plan: go on from an interrupted run into the same --out, skipping the "
                   "simulations it finished (same bytes as an uninterrupted run).")
@click.option("--capture-out", "capture_out", type=click.Path(path_type=str), default=None,
              help="Also write the run as a live fleet would have left it (KV events, LoadStat rows, a router "
                   "token export, engine request exports: docs/capture.md), for `router-replay import`. "
                   "One config only.")
@click.option("--force", is_flag=True, help="Replace a non-empty DIR.")
@click.option("--quiet", "-q", is_flag=True)
@user_errors
def simulate(log, fleet_path, out, workers_text, dp_text, scale_text, per_dp_rank,
             prefill_tokens_per_s, decode_tokens_per_s,
             max_running_requests, max_total_num_tokens, decode_peers, fmt, block_size, sessions,
             session_rate, limit,
             publish_interval_ms, forced_placement, index_lag_ms, freshness_ms, seed, seeds_text,
             threads, executor, ray_address, ray_cpus, ray_retries, resume, capture_out, force, quiet, **knobs):
    """Simulate a fleet serving LOG; write a router-replay trace plus ground-truth outcomes."""

    from replay.runs.names import LOADS, SIM_JSON  # lazy: loaded when the command runs
    from replay.simulate.plan import parse_list  # lazy: loaded when the command runs
    from replay.simulate.sim import interval_rows  # lazy: loaded when the command runs
    from replay.simulate.workflows import simulate_log  # lazy: loaded when the command runs

    workers_l = parse_list(workers_text, "--workers", int, -math.inf)
    dp_l = parse_list(dp_text, "--dp-size", int, -math.inf)
    check_fleet_sizes(workers_l, dp_l)
    check_seeds(seeds_text)
    scales = parse_list(scale_text, "--load-scale", float, 1e-9)
    texts = {KNOBS[k[len("knob_"):]].flag: v for k, v in knobs.items() if v is not None}
    grid = Grid.from_texts(texts)
    if grid.warning_line() and not quiet:
        click.echo(f"warning: {grid.warning_line(SIM_JSON)}", err=True)
        for line in grid.skipped_lines():
            click.echo(line, err=True)

    def warn(req_log, fleet) -> None:
        if quiet:
            return
        if req_log.partial_blocks_added:
            click.echo(f"{req_log.partial_blocks_added:,} of {req_log.n_requests:,} requests list their full "
                       "blocks only: each partial last block got a fresh id that matches nothing", err=True)
        rows = interval_rows(req_log, fleet, publish_interval_ms)
        if rows > BIG_INTERVAL_ROWS:
            click.echo(f"warning: interval publishing will write {rows:,} load rows (about "
                       f"{rows * 104 / 2**30:.1f} GiB before compression, streamed to {LOADS} "
                       "in bounded memory) for a log spanning "
                       f"{(req_log.ts_ns[-1] - req_log.ts_ns[0]) / 3.6e12:.1f} h; "
                       "publish_policy = \"on_change\" in the fleet file costs no rows for idle time",
                       err=True)

    fleet_kw = dict(prefill_tokens_per_s=prefill_tokens_per_s, decode_tokens_per_s=decode_tokens_per_s,
                    max_running_requests=max_running_requests, max_total_num_tokens=max_total_num_tokens,
                    decode_peers=decode_peers)
    done = simulate_log(log, out, grid, fleet_path=fleet_path, workers=workers_l, dp_sizes=dp_l, scales=scales,
                        per_dp_rank=per_dp_rank, fleet_overrides=fleet_kw, fmt=fmt, block_size=block_size,
                        sessions=sessions, session_rate=session_rate, limit=limit,
                        publish_interval_ms=publish_interval_ms, forced_placement=forced_placement,
                        index_lag_ms=index_lag_ms, freshness_ms=freshness_ms, seed=seed, seeds=seeds_text,
                        threads=threads, executor=executor, ray_address=ray_address, ray_cpus=ray_cpus,
                        ray_retries=ray_retries, resume=resume, capture_out=capture_out, force=force, on_log=warn,
                        progress=lambda n, label: grid_progress(n, quiet, label))
    if quiet:
        return
    seeds = done.seeds
    if done.kind == "plan":
        assert done.table is not None
        click.echo(f"planned {len(done.points)} fleet x traffic points x {len(done.grid.configs)} configs"
                   + (f" x {len(seeds)} seeds" if seeds else "") + f" ({done.table.height} rows) -> {out}")
        click.echo(f"next: router-replay recommend {out} --plan --max-ttft-p99-ms MS")
    elif done.kind == "one":
        assert done.result is not None
        if done.capture_out is not None:
            click.echo(f"capture formats -> {capture_out} (import them with `router-replay import`: "
                       "docs/capture.md)")
        s = done.result.summary
        click.echo(f"simulated {s['requests']:,} requests on {len(done.fleet.prefill)} workers in "
                   f"{done.result.seconds:.2f} s -> {out}")
        click.echo(f"true hit rate (served) {100 * s['true_hit_rate']:.2f}%, TTFT p50 {s['ttft_ms_p50']:.1f} ms "
                   f"p99 {s['ttft_ms_p99']:.1f} ms, queue wait mean {s['queue_wait_ms_mean']:.1f} ms")
    else:
        assert done.table is not None
        n_seeds = f" x {len(seeds)} seeds" if seeds else ""
        click.echo(f"simulated {done.log.n_requests:,} requests x {done.table.height} configs{n_seeds} "
                   f"-> {out}")
        for line in grid_table(done.table, done.grid):
            click.echo(line)


@contextlib.contextmanager
def grid_progress(n: int, quiet: bool, label: str = "simulating"):
    """Progress over ``n`` simulations (replay/cli/progress.py): a bar on a terminal, a line
    every ~10 s when piped, nothing with --quiet."""
    with Progress(label, n, quiet=quiet) as p:
        yield p.update


def grid_table(table, grid) -> list[str]:
    """The closed-loop summary as a readable table (no wider than the knobs need): knobs, served
    hit rate (true_hit_rate, %), TTFT and queue wait (s), with the 95% interval and the stable
    verdict when several seeds ran."""
    knobs = [k for k in KNOBS if k in table.columns and len(grid.values[k]) > 1]
    seeded = "stable" in table.columns

    def cell(v, scale=1.0, digits=1):
        return "-" if v is None else f"{v * scale:.{digits}f}"

    def span(r, col, scale, digits):
        return f"{cell(r[col + '_lo'], scale, digits)}..{cell(r[col + '_hi'], scale, digits)}"

    head = ["config"] + [KNOB_SHORT.get(k, KNOBS[k].flag.lstrip("-")) for k in knobs]
    head += ["served hit %" + (" [95%]" if seeded else ""), "TTFT p50 s",
             "TTFT p99 s" + (" [95%]" if seeded else ""), "wait mean s"]
    if seeded:
        head += ["stable"]
    rows = [head]
    for r in table.iter_rows(named=True):
        row = [str(r["config_id"])] + ["none" if r[k] is None else str(r[k]) for k in knobs]
        hit, p99 = cell(r["true_hit_rate"], 100, 2), cell(r["ttft_ms_p99"], 1e-3, 2)
        if seeded:
            hit += f" [{span(r, 'true_hit_rate', 100, 1)}]"
            p99 += f" [{span(r, 'ttft_ms_p99', 1e-3, 1)}]"
        row += [hit, cell(r["ttft_ms_p50"], 1e-3, 2), p99, cell(r["queue_wait_ms_mean"], 1e-3, 2)]
        if seeded:
            row += ["yes" if r["stable"] else ("?" if r["stable"] is None else
                                               "NO (seeds " + ",".join(map(str, r["unstable_seeds"])) + " disagree)")]
        rows.append(row)
    widths = [max(len(x[i]) for x in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=False)) for row in rows]
    return [*lines, "served hit % = true_hit_rate (tokens found cached when served); sweep's hit_rate is "
                    "decision-time"]


COMMANDS = [simulate]
