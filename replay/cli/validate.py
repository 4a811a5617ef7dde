"""``router-replay validate TRACE_DIR``: schema check and data facts."""

from __future__ import annotations

import collections
import datetime as _dt
import json
import sys
from typing import TYPE_CHECKING

import click

from replay.cli.app import user_errors

if TYPE_CHECKING:  # imported for the annotation only: replay.trace brings polars and numba
    from replay.trace.facts import TraceFacts


def _ts(ns: int) -> str:
    return _dt.datetime.fromtimestamp(ns / 1e9, tz=_dt.UTC).isoformat(timespec="milliseconds")


def format_report(facts: TraceFacts) -> str:
    """Human-readable lines for a ``validate_trace`` report."""
    f = facts
    n = f.requests
    lines = [f"trace {f.path}: OK"]
    if f.windows:
        lines[0] += (f" (checked in {f.windows} windows of {f.window_s} s; request_id "
                     f"uniqueness checked within each window)")
    for name, info in f.files.items():
        lines.append(f"  {name}: {info['bytes']:,} bytes, sha256 {info['sha256'][:16]}...")
    lines.append(f"requests: {n:,} ({f.requests_with_matches:,} with matches, "
                 f"{f.requests_without_prefix_signal:,} without a prefix signal)")
    if n:
        lines.append(f"time span: {f.span_s:.3f} s ({_ts(f.span_start_ns)} .. {_ts(f.span_end_ns)})")
    lines.append("models: " + ", ".join(f"{m} ({c:,} requests, {f.fleet_workers[m]} fleet workers)"
                                        for m, c in f.models.items()))
    lines.append(f"workers: {f.workers} known ({', '.join(f'{c} {r}' for r, c in f.roles.items() if c)}); "
                 f"workers table: {'yes' if f.has_workers_table else 'no (fleet inferred: all plain)'}")
    if f.non_fleet_load_workers:
        lines.append(f"load workers not in workers.parquet (never fleet members): "
                     f"{len(f.non_fleet_load_workers)}: {', '.join(f.non_fleet_load_workers[:5])}")
    if f.workers_without_samples:
        lines.append(f"workers without any load sample: {len(f.workers_without_samples)}")
    dist = collections.Counter(len(r) for r in f.ranks_per_worker.values())
    lines.append("ranks per worker (observed, ignored ranks included): " + ", ".join(
        f"{k} rank{'s' if k != 1 else ''}: {v} worker{'s' if v != 1 else ''}" for k, v in sorted(dist.items())))
    lines.append(f"load rows: {f.load_rows:,} ({f.load_rows_with_tail:,} with native tail, "
                 f"{f.load_rows_without_tail:,} without, {f.load_rows_partial_tail:,} with a partial "
                 f"tail, counted as no tail)")
    lines.append(f"ignored rank rows (dp_rank >= dp_size): {f.ignored_rank_rows:,}")
    share = f.share_without_fresh_fleet_sample
    lines.append(f"requests with no fresh sample from any fleet worker ({f.freshness_ms} ms): "
                 f"{f.requests_without_fresh_fleet_sample:,} ({100 * share:.2f}%)")
    ex = f.unknown_match_address_examples
    lines.append(f"unknown match addresses: {f.unknown_match_addresses} "
                 f"({f.unknown_match_entries:,} entries of {f.match_entries:,})"
                 + (f", e.g. {', '.join(ex)}" if ex else ""))
    if f.has_selected_worker:
        lines.append(f"selected_worker: {n - f.selected_worker_null:,} set, "
                     f"{f.selected_worker_unknown:,} naming an unknown worker")
    lines.append(f"router_inflight column: {'yes' if f.has_router_inflight else 'no (replay uses 0)'}")
    if f.closed_loop_columns:
        lines.append("closed-loop columns (rows with a value): " + ", ".join(
            f"{c} {k:,}" for c, k in f.closed_loop_columns.items()))
    if f.hash_ids_full_blocks_only:
        lines.append(f"hash_ids with full blocks only: {f.hash_ids_full_blocks_only:,} requests (their "
                     "partial last block read as a fresh id that matches nothing)")
    if f.log_hash_ids_full_blocks_only:
        lines.append(f"simulated from a log whose hash_ids held full blocks only for "
                     f"{f.log_hash_ids_full_blocks_only:,} requests (each partial last block got a fresh id)")
    if f.page_sizes:
        lines.append("page size (block size of hash_ids): " + ", ".join(
            f"{m} {p}" for m, p in f.page_sizes.items()))
    if f.trace_json is not None:
        from replay.runs.rundir import GENERATE_SOURCE  # lazy: loaded when the command runs

        router = f.trace_json["router"]
        synthetic = not router and str(f.trace_json["source"] or "").startswith(GENERATE_SOURCE)
        lines.append("trace.json: " + ("synthetic, no production router recorded" if synthetic else
                                       "production router "
                                       + (", ".join(f"{k}={v}" for k, v in router.items()) if router
                                          else "defaults"))
                     + (" (per dp rank)" if f.trace_json["per_dp_rank"] else "")
                     + (f"; source: {f.trace_json['source']}" if f.trace_json["source"] else ""))
        cm = f.trace_json.get("capture_matches") or {}
        if cm.get("matches_source"):
            approx = cm.get("matches_approximate") or {}
            lines.append(f"matches (import): {cm['matches_source']}, "
                         + ("exact" if cm.get("matches_exact") else
                            f"approximate for {approx.get('requests', 'all'):,} requests"
                            if approx else "approximate")
                         + (f" ({'; '.join(approx['reasons'])})" if approx.get("reasons") else ""))
    unsorted = [name for name, ok in (("requests", f.requests_sorted_on_disk), ("loads", f.loads_sorted_on_disk))
                if not ok]
    if unsorted:
        lines.append(f"not sorted by ts on disk (sorted in memory, files untouched): {', '.join(unsorted)}")
    return "\n".join(lines)


@click.command("validate")
@click.argument("trace_dir", type=click.Path(file_okay=False, dir_okay=True))
@click.option("--freshness-ms", type=click.IntRange(min=0), default=5000, show_default=True,
              help="Freshness window for the no-fresh-sample fact.")
@click.option("--json", "as_json", is_flag=True, help="Print the facts as JSON.")
@click.option("--window", default="auto", show_default=True, metavar="auto|none|DURATION",
              help="Check a trace larger than memory in time windows (as sweep --window).")
@user_errors
def validate(trace_dir: str, freshness_ms: int, as_json: bool, window: str) -> None:
    """Check a trace directory's schema and invariants and print its data facts.

    Exit 0 when the trace is valid; on bad input print one line naming file,
    column and first bad row (0-based, in the file as given) and exit 2.

    \b
    Example:
      router-replay validate traces/sample --json
    """

    from replay.trace import parse_window, validate_trace  # lazy: loaded when the command runs

    window_ns = parse_window(window)    # a ParamError: user_errors names the flag
    bar = None

    def progress(n):
        nonlocal bar
        if bar is None and sys.stderr.isatty() and not as_json:
            bar = click.progressbar(length=None, label="checking", file=sys.stderr)
        if bar is not None:
            bar.update(n)

    facts = validate_trace(trace_dir, freshness_ms=freshness_ms, window=window_ns, progress=progress)
    if bar is not None:
        bar.render_finish()
    from replay.capture.summary import capture_facts, capture_lines  # lazy: loaded when the command runs

    cap = capture_facts(trace_dir)  # an imported trace's capture facts (docs/capture.md)
    if as_json:

        click.echo(json.dumps({**facts.as_dict(), **({"capture": cap} if cap else {})}, indent=2, sort_keys=True))
    else:
        click.echo(format_report(facts))
        if cap:
            click.echo("\n".join(capture_lines(cap)))


COMMANDS = [validate]
