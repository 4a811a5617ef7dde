"""Reading finished runs: compare two runs, gate a run against a baseline, recommend a config.

Three questions asked of run directories written by :func:`replay.run_sweep`:

* :func:`compare_runs` - two runs of the same trace (two router versions, or two
  settings): per-config metric deltas, configs matched by their knob values
  (never by ``config_id``), and, when both runs kept ``decisions.parquet``, the
  requests whose worker or label changed with counts by (old label -> new label).
* :func:`make_baseline` / :func:`check_run` - the benchmark-CI gate: store the
  chosen metrics of a run with tolerances, then hold a new run to them
  (Markdown for a pull-request comment, JUnit XML, exit code 0/1/2).
* :func:`recommend` - the config with the best hit rate whose p99 queue at the
  chosen worker stays within a bound, per dp_size.

Every metric is derived from ``summary.parquet`` (see :data:`METRICS`).  Rates
and shares are fractions in 0..1; differences of rates are reported in
*points* (percentage points: 0.5 pt = 0.005).  Unusable input raises
:class:`replay.errors.ReplayError` with one line of text.
"""

from __future__ import annotations

import json
import math
import os
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from replay import __version__
from replay.analysis import decision_gate, ranking
from replay.analysis import waterfall as wf
from replay.config import GATE_KNOBS, KNOB_NAMES, KNOB_SHORT, KNOBS, RouterConfig
from replay.errors import ParamError, ParamsError, ReplayError
from replay.runs import decisions as decision_store
from replay.runs import rundir
from replay.runs.metrics import (
    COMPARE_METRICS,
    DEFAULT_CHECK_METRICS,
    DEFAULT_TOLERANCES,
    LABEL_SHARES,
    METRICS,
    RECOMMEND_EVIDENCE,
    Metric,
    knob_text,
    metric,
    metric_table,
)
from replay.runs.rundir import DECISIONS, Run, load_run, trace_hashes
from replay.runs.rundir import first_line as _first_line

__all__ = ["COMPARE_METRICS", "DEFAULT_CHECK_METRICS", "DEFAULT_TOLERANCES", "LABEL_SHARES", "METRICS",
           "RECOMMEND_EVIDENCE", "Metric", "metric", "metric_table", "Run", "load_run", "trace_hashes",
           "compare_runs", "write_comparison", "format_comparison", "make_baseline", "write_baseline",
           "load_baseline", "check_run", "recommend", "format_recommendations"]

# ---------------------------------------------------------------------------
# Metrics: the one table lives in replay/runs/metrics.py

LABEL_COLUMNS = ("decision", "policy_reason", "reason")
"""decisions.parquet columns usable as the transition label in :func:`compare_runs`."""

def trace_difference(a: Mapping[str, str], b: Mapping[str, str]) -> str | None:
    """A short description of how two trace-hash records differ, or None if they are equal."""
    if dict(a) == dict(b):
        return None
    for name in sorted(set(a) | set(b)):
        if name not in a:
            return f"{name} only in the second"
        if name not in b:
            return f"{name} only in the first"
        if a[name] != b[name]:
            return f"{name} sha256 {a[name][:12]}... vs {b[name][:12]}..."
    return "trace files differ"  # pragma: no cover


def config_label(row: Mapping[str, Any], knobs: Sequence[str]) -> str:
    """``limit=2 floor=none`` style label of a config from the given knob columns."""
    return " ".join(f"{KNOB_SHORT.get(k, k)}={knob_text(row.get(k))}" for k in knobs)


def varying_knobs(*tables: pl.DataFrame | Sequence[Mapping[str, Any]]) -> list[str]:
    """Limit and floor, plus every other knob whose value varies across the given
    tables (DataFrames or lists of row dicts)."""
    out = []
    for k in KNOB_NAMES:
        vals = set()
        for t in tables:
            if isinstance(t, pl.DataFrame):
                if k in t.columns:
                    vals.update(t.get_column(k).to_list())
            else:
                vals.update(r[k] for r in t if k in r)
        if k in GATE_KNOBS or len(vals) > 1:
            out.append(k)
    return out


def _knob_key(row: Mapping[str, Any], knobs: Sequence[str]) -> tuple:
    return tuple((k, None if row.get(k) is None else (float(row[k]) if KNOBS[k].kind == "float"
                                                      else row[k])) for k in knobs)


# ---------------------------------------------------------------------------
# Formatting helpers


def fmt_value(name: str, v: float | None) -> str:
    """A metric value for humans: rates in percent, counts as integers, pressures to 2 decimals."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    kind = METRICS[name].kind
    if kind == "rate":
        return f"{100 * v:.2f}%"
    if kind == "count" or float(v).is_integer():
        return f"{int(round(v)):,}"
    return f"{v:.2f}"


def fmt_change(name: str, a: float | None, b: float | None) -> str:
    """``b - a`` for humans: points for rates, signed numbers (with percent) otherwise."""
    if a is None or b is None:
        return "-"
    d = b - a
    if METRICS[name].kind == "rate":
        return f"{100 * d:+.2f} pt"
    rel = f" ({100 * d / abs(a):+.1f}%)" if a else ""
    if METRICS[name].kind == "count" or (float(a).is_integer() and float(b).is_integer()):
        return f"{int(round(d)):+,}{rel}"
    return f"{d:+.2f}{rel}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int = 100,
           shrink: int = 0, sep: str = "  ") -> list[str]:
    """Right-aligned plain-text table; column ``shrink`` (left-aligned) is cut to fit ``width``."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    total = sum(widths) + len(sep) * (len(widths) - 1)
    if total > width:
        widths[shrink] = max(8, widths[shrink] - (total - width))

    def cut(s: str, w: int) -> str:
        return s if len(s) <= w else s[: w - 1] + "~"

    def line(cells):
        out = []
        for i, (c, w) in enumerate(zip(cells, widths, strict=False)):
            c = cut(c, w)
            out.append(c.ljust(w) if i == shrink else c.rjust(w))
        return sep.join(out).rstrip()

    return [line(headers), *(line(r) for r in rows)]


# ---------------------------------------------------------------------------
# compare


@dataclass
class Comparison:
    """What :func:`compare_runs` found.

    ``deltas``: long table, one row per matched config and metric, with the
    config's knob values, ``config_id_a``, ``config_id_b``, ``config``
    (label), ``metric``, ``a``, ``b``, ``delta`` (b - a; fractions for
    rates) and ``rel_delta`` (delta / |a|, null when a is 0 or null).
    ``pairs``: one row per matched config (knobs, ids, label).
    ``transitions``: per matched config, counts of changed requests by
    (old label -> new label) with how many of them changed worker (None
    without decisions in both runs).  ``changed``: a lazy frame of the
    changed requests themselves.
    """

    a: Run
    b: Run
    knobs: list[str]
    label_column: str
    pairs: pl.DataFrame
    deltas: pl.DataFrame
    only_a: list[str]
    only_b: list[str]
    transitions: pl.DataFrame | None = None
    changed: pl.LazyFrame | None = None
    decisions_note: str | None = None
    setting_changes: list[str] = field(default_factory=list)
    across_variants: bool = False  # matched by the router's knobs: the runs differ in a variant_* knob


def check_same_trace(a: Run, b: Run) -> None:
    """Raise :class:`ReplayError` unless both runs replayed the same trace files (sha256) and model."""
    diff = trace_difference(a.trace_hashes, b.trace_hashes)
    if diff is not None:
        raise ReplayError(f"{b.path} did not replay the same trace as {a.path} ({diff})")
    if a.meta.get("model") != b.meta.get("model"):
        raise ReplayError(f"{b.path} replayed model {b.meta.get('model')!r}, {a.path} model "
                          f"{a.meta.get('model')!r}: not the same requests")


def _setting_changes(a: Run, b: Run) -> list[str]:
    out = []
    for key in ("version", "seed", "freshness_ms", "per_dp_rank", "dp_size"):
        va, vb = a.meta.get(key), b.meta.get(key)
        if va != vb:
            out.append(f"{key} {va} -> {vb}")
    return out


def match_configs(a: pl.DataFrame, b: pl.DataFrame, knobs: Sequence[str]) -> pl.DataFrame:
    """Pairs of configs with equal knob values (null equals null): knob columns,
    ``config_id_a``, ``config_id_b``."""
    left = a.select(*knobs, pl.col("config_id").alias("config_id_a"))
    right = b.select(*knobs, pl.col("config_id").alias("config_id_b"))
    right = right.cast({k: left.schema[k] for k in knobs}, strict=False)
    return left.join(right, on=list(knobs), how="inner", nulls_equal=True).sort("config_id_a")


def _match_across_variants(a: pl.DataFrame, b: pl.DataFrame, knobs: Sequence[str]) -> pl.DataFrame:
    """Pairs matched by the router's knobs alone, for two runs of one trace that
    differ only in replay-only policy variants (``variant_*``): a
    variant against the router's behaviour.  Empty unless each run holds one
    config per router setting (so every pair is unambiguous)."""
    router = [k for k in knobs if KNOBS[k].router]
    if not router or any(t.select(router).is_duplicated().any() for t in (a, b)):
        return match_configs(a, b, knobs).head(0)
    return match_configs(a, b, router)


def _unswept_hint(a: Run, b: Run, ma: pl.DataFrame, mb: pl.DataFrame, knobs: Sequence[str]) -> str:
    """When the runs differ in knobs each holds at one value (not swept), how to compare them."""
    fixed = [k for k in knobs if ma[k].n_unique() == 1 and mb[k].n_unique() == 1
             and ma[k][0] != mb[k][0]]
    if not fixed:
        return ""
    what = ", ".join(f"{k} {knob_text(ma[k][0])} vs {knob_text(mb[k][0])}" for k in fixed)
    trace = (a.meta.get("trace") or {}).get("path") or "TRACE"
    swept = " ".join(f"{KNOBS[k].flag} {','.join(knob_text(v) for v in ma[k].unique(maintain_order=True))}"
                     for k in knobs if ma[k].n_unique() > 1)
    both = " ".join(f"{KNOBS[k].flag} {knob_text(ma[k][0])},{knob_text(mb[k][0])}" for k in fixed)
    return (f"; they differ in {what}, which neither run sweeps: sweep both values in one run and "
            f"read its report, e.g. router-replay sweep {trace} --out RUN {both}"
            + (f" {swept}" if swept else ""))


def _label_expr(col: str, suffix: str, reorg: bool = False) -> pl.Expr:
    """The transition label: the label column, or ``failed:<failure>`` on a failed request;
    a reorg decision (no router label) reads ``reorg:<its outcome>``."""
    own = [pl.lit("reorg:") + pl.col("reorg_outcome")] if reorg else []
    return pl.coalesce(pl.col(col), *own, pl.lit("failed:") + pl.col("failure"),
                       pl.lit("failed")).alias(f"label_{suffix}")


_ENGINE_KNOBS = ("chat_routing", "power_of_n_choices", "max_in_flight", "variant_reorg_ranking",
                 "variant_pin_order", "variant_floor_scaling")


def _across_text(cmp: Comparison) -> str:
    ea = set(cmp.a.summary["chat_routing"].to_list()) if "chat_routing" in cmp.a.summary.columns else set()
    eb = set(cmp.b.summary["chat_routing"].to_list()) if "chat_routing" in cmp.b.summary.columns else set()
    if ea and eb and ea != eb:
        return (f"the knobs both engines share (A routes with {', '.join(sorted(ea))}, B with "
                f"{', '.join(sorted(eb))}: a reorg decision reads reorg:<outcome>, the replay's own label)")
    return "the router's knobs (the runs differ in a replay-only policy variant)"


def _match_across_engines(a: pl.DataFrame, b: pl.DataFrame, knobs: Sequence[str]) -> pl.DataFrame:
    """Pairs of a legacy run and a reorg run of one trace (each one engine): matched by
    the knobs both engines share (limit, floor, candidate and guard knobs), when each
    run holds one config per such setting."""
    if "chat_routing" not in knobs or a["chat_routing"].n_unique() != 1 or b["chat_routing"].n_unique() != 1 \
            or a["chat_routing"][0] == b["chat_routing"][0]:
        return match_configs(a, b, knobs).head(0)
    shared = [k for k in knobs if k not in _ENGINE_KNOBS]
    if any(t.select(shared).is_duplicated().any() for t in (a, b)):
        return match_configs(a, b, knobs).head(0)
    return match_configs(a, b, shared)


def compare_runs(a: Run | str | os.PathLike, b: Run | str | os.PathLike, *,
                 label: str = "decision", metrics: Sequence[str] = COMPARE_METRICS) -> Comparison:
    """Compare run ``b`` with run ``a`` (deltas are b - a).

    Both must have replayed the same trace files (sha256 in ``run.json``) for
    the same model.  Configs are matched by every knob value (two runs that
    differ only in replay-only policy variants, each with one config per
    router setting, are matched by the router's knobs: a variant against the
    router's behaviour); configs present in one run only are listed, not compared.  ``label`` is the
    decisions.parquet column whose changes are counted (``decision``,
    ``policy_reason`` or ``reason``; a failed request reads
    ``failed:<failure reason>``).  Request-level results need
    decisions.parquet in both runs.
    """
    if label not in LABEL_COLUMNS:
        raise ParamError("label", f"must be one of {', '.join(LABEL_COLUMNS)}, got {label!r}")
    a = a if isinstance(a, Run) else load_run(a)
    b = b if isinstance(b, Run) else load_run(b)
    check_same_trace(a, b)
    ma, mb = a.metrics(metrics), b.metrics(metrics)
    knobs = [k for k in a.knobs if k in b.knobs]
    pairs = match_configs(ma, mb, knobs)
    shown = varying_knobs(ma, mb)
    across = False
    if pairs.height == 0:
        pairs = _match_across_variants(ma, mb, knobs)
        shown = [k for k in shown if k in pairs.columns]
        across = pairs.height > 0
    if pairs.height == 0:
        pairs = _match_across_engines(ma, mb, knobs)
        shown = [k for k in shown if k in pairs.columns]
        across = pairs.height > 0
    if pairs.height == 0:
        raise ReplayError(f"{a.path} and {b.path} have no config in common (configs are matched by knob values)"
                          + _unswept_hint(a, b, ma, mb, knobs))
    pairs = pairs.with_columns(pl.Series("config", [config_label(r, shown) for r in pairs.iter_rows(named=True)]))
    matched_a = set(pairs["config_id_a"].to_list())
    matched_b = set(pairs["config_id_b"].to_list())
    only_a = [config_label(r, shown) for r in ma.iter_rows(named=True) if r["config_id"] not in matched_a]
    only_b = [config_label(r, shown) for r in mb.iter_rows(named=True) if r["config_id"] not in matched_b]

    va = ma.select(pl.col("config_id").alias("config_id_a"), *metrics).unpivot(
        index="config_id_a", variable_name="metric", value_name="a")
    vb = mb.select(pl.col("config_id").alias("config_id_b"), *metrics).unpivot(
        index="config_id_b", variable_name="metric", value_name="b")
    order = {m: i for i, m in enumerate(metrics)}
    deltas = (pairs.join(va, on="config_id_a").join(vb, on=["config_id_b", "metric"])
              .with_columns((pl.col("b") - pl.col("a")).alias("delta"))
              .with_columns(pl.when(pl.col("a") != 0).then(pl.col("delta") / pl.col("a").abs())
                            .otherwise(None).alias("rel_delta"))
              .with_columns(pl.col("metric").replace_strict(order, return_dtype=pl.Int32).alias("_o"))
              .sort("config_id_a", "_o").drop("_o"))
    cmp = Comparison(a, b, shown, label, pairs, deltas, only_a, only_b,
                     setting_changes=_setting_changes(a, b), across_variants=across)
    missing = [str(r.path) for r in (a, b) if r.decisions is None]
    if missing:
        cmp.decisions_note = f"request-level changes skipped: no {DECISIONS} in {', '.join(missing)}"
        return cmp
    cmp.changed = _changed_requests(a, b, pairs, label)
    return cmp


def _changed_requests(a: Run, b: Run, pairs: pl.DataFrame, label: str) -> pl.LazyFrame:
    ids = pairs.select("config_id_a", "config_id_b", "config").lazy()
    cols = ["request_id", "config_id", "worker", label, "failure", "selected_blocks"]

    def side(run: Run, s: str) -> pl.LazyFrame:
        reorg = "reorg_outcome" in decision_store.columns_of(run.decisions[0])
        lf = decision_store.scan_decisions(run.decisions, [c for c in cols if c != "selected_blocks"]
                                           + ["selected_blocks"] + (["reorg_outcome"] if reorg else []))
        lf = lf.with_columns(pl.col("config_id").cast(pl.Int64), _label_expr(label, s, reorg))
        key = f"config_id_{s}"
        lf = lf.rename({"config_id": key, "worker": f"worker_{s}",
                        "selected_blocks": f"selected_blocks_{s}"})
        return lf.drop(label, "failure", *(["reorg_outcome"] if reorg else []))

    la = side(a, "a").join(ids.select("config_id_a", "config_id_b", "config"), on="config_id_a")
    lb = side(b, "b")
    joined = la.join(lb, on=["config_id_b", "request_id"], how="inner")
    return (joined
            .with_columns(pl.col("worker_a").ne_missing(pl.col("worker_b")).alias("worker_changed"),
                          (pl.col("label_a") != pl.col("label_b")).alias("label_changed"))
            .filter(pl.col("worker_changed") | pl.col("label_changed"))
            .select("config_id_a", "config_id_b", "config", "request_id", "worker_a", "worker_b",
                    "label_a", "label_b", "selected_blocks_a", "selected_blocks_b",
                    "worker_changed", "label_changed"))


def transition_counts(changed: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    """Counts of changed requests by config and (old label -> new label): ``config_id_a``,
    ``config_id_b``, ``config``, ``label_a``, ``label_b``, ``requests``, ``worker_changed``."""
    lf = changed.lazy()
    return (lf.group_by("config_id_a", "config_id_b", "config", "label_a", "label_b")
            .agg(pl.len().cast(pl.Int64).alias("requests"),
                 pl.col("worker_changed").sum().cast(pl.Int64).alias("worker_changed"))
            .sort("config_id_a", "requests", "label_a", "label_b", descending=[False, True, False, False])
            .collect(engine="streaming"))


def _collect_transitions(cmp: Comparison) -> None:
    if cmp.changed is not None and cmp.transitions is None:
        try:
            cmp.transitions = transition_counts(cmp.changed)
        except (pl.exceptions.PolarsError, OSError) as err:
            raise ReplayError(f"reading {DECISIONS}: {_first_line(err)}") from None


def write_comparison(cmp: Comparison, out: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Write ``deltas.parquet`` (and, with decisions in both runs, ``transitions.parquet``
    and ``changed_requests.parquet``) into directory ``out``, built aside and moved into
    place when complete; ``out`` is held to :func:`replay.runs.rundir.guard`'s rule."""
    out = Path(out)
    rundir.guard([(out, "compare")], inputs=[cmp.a.path, cmp.b.path], force=force)
    tmp = rundir.partial_beside(out)
    try:
        with rundir.writing(out):
            cmp.deltas.write_parquet(tmp / "deltas.parquet")
            if cmp.changed is not None:
                try:
                    cmp.changed.sink_parquet(tmp / "changed_requests.parquet")
                except (pl.exceptions.PolarsError, OSError) as err:
                    if rundir.no_space(err, tmp):
                        raise
                    raise ReplayError(f"reading {DECISIONS}: {_first_line(err)}") from None
                cmp.changed = pl.scan_parquet(out / "changed_requests.parquet")
                cmp.transitions = transition_counts(pl.scan_parquet(tmp / "changed_requests.parquet"))
                cmp.transitions.write_parquet(tmp / "transitions.parquet")
            names = sorted(p.name for p in tmp.iterdir())
            rundir.move_into_place(tmp, out)
        tmp = None
        return [out / n for n in names]
    finally:
        rundir.discard(tmp)


_CMP_COLS = (  # header, metric, how
    ("hit A", "hit_rate", "a"),
    ("dHit", "hit_rate", "pt"),
    ("dOwner", "owner_rate", "pt"),
    ("dHitLbl", "share_cache_hit", "pt"),
    ("dAllQ", "share_all_queued", "pt"),
    ("dPinned", "pinned", "n"),
    ("dDivert", "diverted", "n"),
    ("p99 A>B", "selected_waiting_p99", "ab"),
    ("dCold", "cold_prefill_tokens", "rel"),
)


def format_comparison(cmp: Comparison, *, limit: int = 20, width: int = 100) -> str:
    """The terminal report: provenance, per-config deltas (largest hit-rate change first,
    ``limit`` rows) and the most frequent label transitions, in ``width`` columns."""
    _collect_transitions(cmp)
    a, b = cmp.a, cmp.b
    lines = [f"compare A={a.path}", f"     vs B={b.path}",
             f"same trace ({len(a.trace_hashes)} files, sha256 equal), "
             f"{cmp.pairs.height} configs matched by "
             + (_across_text(cmp) if cmp.across_variants else "knob values")
             + (f", {len(cmp.only_a)} only in A" if cmp.only_a else "")
             + (f", {len(cmp.only_b)} only in B" if cmp.only_b else "")]
    if cmp.setting_changes:
        lines.append("settings that differ: " + "; ".join(cmp.setting_changes))
    for tag, only in (("A", cmp.only_a), ("B", cmp.only_b)):
        if only:
            lines.append(f"only in {tag}: " + ", ".join(only[:5]) + (" ..." if len(only) > 5 else ""))
    wide = cmp.deltas.pivot(on="metric", index="config_id_a", values=["a", "b"], aggregate_function="first")
    counts = None
    if cmp.transitions is not None:
        counts = cmp.transitions.group_by("config_id_a").agg(pl.col("requests").sum().alias("changed"))
    rows_df = cmp.pairs.join(wide, on="config_id_a", how="left")
    if counts is not None:
        rows_df = rows_df.join(counts, on="config_id_a", how="left")
    rows_df = rows_df.with_columns((pl.col("b_hit_rate") - pl.col("a_hit_rate")).abs().alias("_k")).sort(
        "_k", "config_id_a", descending=[True, False], nulls_last=True)
    n = rows_df.height
    lines.append("")
    lines.append(f"per-config deltas, B - A (rates in points; largest hit-rate change first; "
                 f"{min(limit, n)} of {n}):")
    headers = ["config", *(h for h, _, _ in _CMP_COLS), "changed"]
    rows = []
    for r in rows_df.head(limit).iter_rows(named=True):
        cells = [r["config"]]
        for _, m, how in _CMP_COLS:
            va, vb = r.get(f"a_{m}"), r.get(f"b_{m}")
            if how == "a":
                cells.append(fmt_value(m, va))
            elif va is None or vb is None:
                cells.append("-")
            elif how == "pt":
                cells.append(f"{100 * (vb - va):+.2f}")
            elif how == "n":
                cells.append(f"{int(vb - va):+d}")
            elif how == "ab":
                cells.append(f"{fmt_value(m, va)}>{fmt_value(m, vb)}")
            else:
                cells.append(f"{100 * (vb - va) / va:+.1f}%" if va else "-")
        cells.append("-" if counts is None else f"{int(r.get('changed') or 0):,}")
        rows.append(cells)
    lines.extend(_table(headers, rows, width, sep=" "))
    lines.extend(_waterfall_changes(cmp, [r["config_id_a"] for r in rows_df.head(limit).iter_rows(named=True)],
                                    width))
    lines.append("")
    if cmp.transitions is None:
        lines.append(cmp.decisions_note or "request-level changes: not computed")
    else:
        t = cmp.transitions
        total = int(t["requests"].sum()) if t.height else 0
        n_req = a.meta.get("trace", {}).get("requests")
        lines.append(f"requests whose worker or {cmp.label_column} changed: {total:,} request-config pairs"
                     + (f" ({n_req:,} requests x {cmp.pairs.height} configs)" if isinstance(n_req, int) else ""))
        if t.height:
            agg = (t.group_by("label_a", "label_b")
                   .agg(pl.col("requests").sum(), pl.col("worker_changed").sum(),
                        pl.col("config_id_a").n_unique().alias("configs"))
                   .sort("requests", "label_a", "label_b", descending=[True, False, False]))
            lines.append(f"by {cmp.label_column} transition (A -> B), all configs, "
                         f"top {min(limit, agg.height)} of {agg.height}:")
            trows = [[f"{r['label_a']} -> {r['label_b']}" if r["label_a"] != r["label_b"]
                      else f"{r['label_a']} (same label, other worker)",
                      f"{r['requests']:,}", f"{r['worker_changed']:,}", str(r["configs"])]
                     for r in agg.head(limit).iter_rows(named=True)]
            lines.extend("  " + s for s in _table(["transition", "requests", "worker changed", "configs"],
                                                  trows, width - 2))
    return "\n".join(lines)


def _waterfall_changes(cmp: Comparison, ids_a: Sequence[int], width: int) -> list[str]:
    """The locality-waterfall terms that changed, B - A in blocks, for the configs shown."""

    if not (wf.has_waterfall(cmp.a.summary.columns) and wf.has_waterfall(cmp.b.summary.columns)):
        return ["", "locality waterfall: not compared (a run without the waterfall columns; re-run its sweep)"]
    ra = {r["config_id"]: r for r in cmp.a.summary.iter_rows(named=True)}
    rb = {r["config_id"]: r for r in cmp.b.summary.iter_rows(named=True)}
    by_a = {r["config_id_a"]: r for r in cmp.pairs.iter_rows(named=True)}
    rows = []
    for ia in ids_a:
        p = by_a[ia]
        ch = wf.changed_terms(ra[ia], rb[p["config_id_b"]])
        rows.append([p["config"], "; ".join(f"{c.removeprefix('lost_')} {v:+,}" for c, v in ch.items()) or "no change"])
    return ["", "locality waterfall, B - A in blocks (changed terms only: matched, lost to each step, selected):",
            *("  " + s for s in _table(["config", "changed terms"], rows, width - 2))]


# ---------------------------------------------------------------------------
# check: baselines and the CI gate


@dataclass(frozen=True)
class Tolerance:
    """How far a metric may move in its bad direction before it is a regression.

    ``unit`` is ``"pt"`` (percentage points, rate metrics only), ``"%"``
    (relative to the baseline value) or ``""`` (absolute, in the metric's own
    unit; not for rate metrics).  Text form: ``0.5pt``, ``10%``, ``2``.
    """

    metric: str
    value: float
    unit: str

    def allowed(self, base: float) -> float:
        """The largest allowed worsening from ``base``, in the metric's native units."""
        if self.unit == "pt":
            return self.value / 100.0
        if self.unit == "%":
            return self.value / 100.0 * abs(base)
        return self.value

    @property
    def text(self) -> str:
        """The text form (``0.5pt``, ``10%``, ``2``)."""
        return f"{self.value:g}{self.unit}"

    def describe(self) -> str:
        """``drop <= 0.5 pt`` / ``rise <= 10%`` / ``change <= 1 pt``."""
        better = METRICS[self.metric].better
        word = {"higher": "drop", "lower": "rise"}.get(better, "change")
        unit = {"pt": " pt", "%": "%", "": ""}[self.unit]
        return f"{word} <= {self.value:g}{unit}"


def parse_tolerance(name: str, spec: Any) -> Tolerance:
    """Read a tolerance for metric ``name``: ``"0.5pt"`` (points, rate metrics), ``"10%"``
    (relative) or a plain number (absolute, non-rate metrics).  Must be >= 0."""
    m = metric(name)
    text = str(spec).strip().replace(" ", "")
    unit = ""
    for u in ("pt", "%"):
        if text.endswith(u):
            unit, text = u, text[: -len(u)]
            break
    try:
        value = float(text)
    except ValueError:
        raise ReplayError(f"tolerance for {name}: {spec!r} is not a number with an optional unit "
                          f"(0.5pt, 10%, 2)") from None
    if not math.isfinite(value) or value < 0:
        raise ReplayError(f"tolerance for {name}: must be a finite number >= 0, got {spec!r}")
    if m.kind == "rate" and unit == "":
        raise ReplayError(f"tolerance for {name}: give a rate in points or percent (e.g. {value:g}pt or "
                          f"{value:g}%), got {spec!r}")
    if m.kind != "rate" and unit == "pt":
        raise ReplayError(f"tolerance for {name}: points apply to rates only; use a percent or an "
                          f"absolute number, got {spec!r}")
    return Tolerance(name, value, unit)


def parse_tolerance_args(items: Iterable[str]) -> dict[str, Tolerance]:
    """``METRIC=SPEC`` strings (``--tolerance``) -> ``{metric: Tolerance}``."""
    out = {}
    for item in items:
        name, sep, spec = str(item).partition("=")
        if not sep or not name.strip():
            raise ParamError("tolerance", f"expects METRIC=VALUE (e.g. hit_rate=0.5pt), got {item!r}")
        out[name.strip()] = parse_tolerance(name.strip(), spec)
    return out


BASELINE_FORMAT = 1


def make_baseline(run: Run | str | os.PathLike, *, metrics: Sequence[str] | None = None,
                  tolerances: Mapping[str, Tolerance | str] | None = None,
                  allow_decision_drift: bool = False) -> dict:
    """The baseline record of a run: tool version, trace hashes, per config its knob values
    and metric values, the tolerances (defaults, overridden by ``tolerances``), and every
    decision of the run (:mod:`replay.analysis.decision_gate`; none when the run kept none).
    ``allow_decision_drift`` stores that changed decisions are reported, not failed.

    ``metrics`` defaults to :data:`DEFAULT_CHECK_METRICS` plus any metric named in
    ``tolerances``.
    """
    run = run if isinstance(run, Run) else load_run(run)
    given: dict[str, Tolerance] = {k: (v if isinstance(v, Tolerance) else parse_tolerance(k, v))
                                   for k, v in (tolerances or {}).items()}
    names = list(dict.fromkeys(metrics if metrics else [*DEFAULT_CHECK_METRICS, *given]))
    for n in names:
        metric(n)
    extra = [k for k in given if k not in names]
    if extra:
        raise ReplayError(f"tolerance given for {extra[0]}, which is not among the stored metrics "
                          f"({', '.join(names)})")
    tol = {n: given.get(n) or parse_tolerance(n, DEFAULT_TOLERANCES.get(n, METRICS[n].default_tolerance))
           for n in names}
    table = run.metrics(names)
    for n in names:
        unknown = table.filter(pl.col(n).is_null() | pl.col(n).is_nan())
        if unknown.height:
            raise ParamsError("{path}: metric {n} has no value for {k} config(s) (first: config {first}); a "
                              "baseline holds numbers only, so leave it out ({metrics:...})", ("metrics", "--metric"),
                              path=run.path, n=n, k=unknown.height, first=unknown["config_id"][0])
    configs = []
    for r in table.iter_rows(named=True):
        configs.append({
            "config_id": r["config_id"],
            "knobs": {k: r[k] for k in run.knobs},
            "metrics": {n: (None if r[n] is None or math.isnan(r[n]) else r[n]) for n in names},
        })
    return {
        "tool": "router-replay",
        "kind": "baseline",
        "format": BASELINE_FORMAT,
        "version": __version__,
        "created_unix": int(time.time()),
        "run": {"path": str(run.path), "version": run.meta.get("version"), "seed": run.meta.get("seed"),
                "freshness_ms": run.meta.get("freshness_ms"), "model": run.meta.get("model"),
                "per_dp_rank": run.meta.get("per_dp_rank"), "dp_size": run.meta.get("dp_size")},
        "trace": {"files": {k: {"sha256": v} for k, v in run.trace_hashes.items()},
                  "requests": run.meta.get("trace", {}).get("requests")},
        "metrics": names,
        "tolerances": {n: t.text for n, t in tol.items()},
        "configs": configs,
        "allow_decision_drift": bool(allow_decision_drift),
        "decisions": (decision_gate.encode(decision_gate.outcome_frame(run)) if run.decisions is not None
                      else None),
    }


def write_baseline(run: Run | str | os.PathLike, path: str | os.PathLike, *, force: bool = False,
                   **kw) -> dict:
    """Write :func:`make_baseline` of ``run`` as JSON to ``path`` (refused if it exists
    unless ``force``); return the record."""
    path = Path(path)
    run = run if isinstance(run, Run) else load_run(run)
    rundir.guard([(path, "baseline")], inputs=[run.path], force=force)
    record = make_baseline(run, **kw)
    rundir.write_text_atomic(path, json.dumps(record, indent=2, allow_nan=False) + "\n")
    return record


def load_baseline(path: str | os.PathLike) -> dict:
    """Read and check a baseline file written by :func:`write_baseline` (one-line errors)."""
    p = Path(path)
    if not p.is_file():
        raise ReplayError(f"{p}: no such baseline file")
    try:
        rec = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReplayError(f"{p}: unreadable baseline ({_first_line(err)})") from None
    if not isinstance(rec, dict) or rec.get("kind") != "baseline" or rec.get("tool") != "router-replay":
        raise ReplayError(f"{p}: not a router-replay baseline (write one with 'check RUN --write-baseline')")
    if rec.get("format") != BASELINE_FORMAT:
        raise ReplayError(f"{p}: baseline format {rec.get('format')!r} is not supported (expected {BASELINE_FORMAT})")
    trace_hashes(rec, p)
    names = rec.get("metrics")
    configs = rec.get("configs")
    if not isinstance(names, list) or not names or not isinstance(configs, list) or not configs:
        raise ReplayError(f"{p}: baseline has no metrics or no configs")
    for n in names:
        metric(n)
    for i, c in enumerate(configs):
        if not isinstance(c, dict) or not isinstance(c.get("knobs"), dict) or not isinstance(c.get("metrics"), dict):
            raise ReplayError(f"{p}: config entry {i} lacks knobs or metrics")
        missing = [n for n in names if n not in c["metrics"]]
        if missing:
            raise ReplayError(f"{p}: config entry {i} lacks metric {missing[0]!r}")
        for n in names:
            why = _bad_value(n, c["metrics"][n])
            if why:
                raise ReplayError(f"{p}: config entry {i}: metric {n!r} {why}; the baseline is unusable")
        for k, v in c["knobs"].items():
            why = _bad_knob(k, v)
            if why:
                raise ReplayError(f"{p}: config entry {i}: knob {k!r} {why}; the baseline is unusable")
    if rec.get("decisions") is not None:
        decision_gate.check_record(rec["decisions"], p)
    tols = rec.get("tolerances") or {}
    if not isinstance(tols, dict):
        raise ReplayError(f"{p}: tolerances must be an object")
    rec["_tolerances"] = {n: parse_tolerance(n, tols.get(n, DEFAULT_TOLERANCES.get(n, METRICS[n].default_tolerance)))
                          for n in names}
    rec["_path"] = str(p)
    return rec


def _bad_value(name: str, v: Any) -> str | None:
    """Why ``v`` cannot be a stored value of metric ``name`` (None when it can)."""
    # REPLAY CHOICE: a null is refused too (not read as "nothing to hold the run to"):
    # a gate that passes because its baseline holds no number is a silent pass.
    if v is None:
        return "is null (no value to hold the run to)"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"is {type(v).__name__} {json.dumps(v)[:40]}, not a number"
    try:
        x = float(v)
    except OverflowError:
        return "is out of range"
    if not math.isfinite(x):
        return f"is {x}, not a finite number"
    if x < 0:
        return f"is negative ({x:g})"
    if METRICS[name].kind == "rate" and x > 1:
        return f"is {x:g}, outside 0..1 for a rate"
    return None


def _bad_knob(name: str, v: Any) -> str | None:
    if name not in KNOBS:
        return None           # check_run names unknown knobs
    kind = KNOBS[name].kind
    if v is None:
        return None if KNOBS[name].nullable else "is null"
    if kind == "bool":
        return None if isinstance(v, bool) else f"is {json.dumps(v)[:40]}, not true or false"
    if kind == "choice":
        choices = KNOBS[name].choices
        if v in choices and isinstance(v, str):
            return None
        return f"is {json.dumps(v)[:40]}, not one of {', '.join(choices)}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind == "int" and not isinstance(v, int)):
        return f"is {json.dumps(v)[:40]}, not {'an integer' if kind == 'int' else 'a number'}"
    if kind == "int" and not 0 <= v < 2**64:
        return f"is {v}, outside the router's unsigned 64-bit range"
    if kind == "float" and (abs(v) > 1.7976931348623157e308 or not math.isfinite(float(v))):
        return "is not a finite number"
    return None


@dataclass
class CheckResult:
    """The outcome of :func:`check_run`.

    ``rows``: one row per config and checked metric: ``config``,
    ``config_id``, ``metric``, ``baseline``, ``current``, ``tolerance``
    (text), ``allowed`` (native units), ``worsening`` (native units, > 0 is
    worse), ``status`` (``ok``, ``improved`` or ``regression``) and ``note``.
    ``decisions``: the decisions changed against the baseline's
    (:class:`replay.analysis.decision_gate.Drift`; None when not checked, and
    ``notes`` says why); any change fails unless ``decisions.allowed``.
    ``settings``: replay settings that differ between the baseline's run and this one.
    """

    run: Run
    baseline: dict
    rows: list[dict]
    extra_configs: list[str]
    notes: list[str] = field(default_factory=list)
    decisions: decision_gate.Drift | None = None
    settings: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[dict]:
        """The rows whose status is ``regression``."""
        return [r for r in self.rows if r["status"] == "regression"]

    @property
    def decisions_failed(self) -> bool:
        """Whether changed decisions fail the check (some changed, and drift is not allowed)."""
        return self.decisions is not None and self.decisions.changed > 0 and not self.decisions.allowed

    @property
    def exit_code(self) -> int:
        """0 within tolerance and no changed decision, 1 otherwise."""
        return 1 if self.regressions or self.decisions_failed else 0

    def describe(self, r: dict) -> str:
        """One line naming a checked row: config, metric, values, change and tolerance."""
        tol = Tolerance(r["metric"], *_split_tol(r["tolerance"]))
        return (f"{r['config']}: {r['metric']} {fmt_value(r['metric'], r['baseline'])} -> "
                f"{fmt_value(r['metric'], r['current'])} ({fmt_change(r['metric'], r['baseline'], r['current'])}; "
                f"allowed {tol.describe()})" + (f" [{r['note']}]" if r["note"] else ""))

    def verdict(self) -> str:
        """``PASS: ...`` or ``FAIL: ...`` with what failed."""
        reg = self.regressions
        why = []
        if self.decisions_failed:
            assert self.decisions is not None
            why.append(f"{self.decisions.changed:,} changed decision{'s' if self.decisions.changed != 1 else ''}")
        if reg:
            why.append(f"{len(reg)} regression{'s' if len(reg) != 1 else ''}")
        if why:
            return "FAIL: " + ", ".join(why)
        return "PASS: within tolerance"

    def _counts(self) -> str:
        n, reg = len(self.rows), len(self.regressions)
        imp = sum(r["status"] == "improved" for r in self.rows)
        configs = len({r["config_id"] for r in self.rows})
        return (f"{configs} configs x {len(self.baseline['metrics'])} metrics = {n} checks: "
                f"{n - reg - imp} ok, {imp} improved, {reg} regressions")

    def _preamble(self) -> list[str]:
        """Settings first, then the decisions, then notes: plain lines."""
        lines = []
        if self.settings:
            lines.append("replay settings differ from the baseline's run: " + ", ".join(self.settings))
        if self.decisions is not None:
            d = self.decisions
            lines.append(d.headline() + (" (allowed: --allow-decision-drift)" if d.changed and d.allowed else ""))
            if d.changed:
                lines.append("first changed requests:")
                lines += ["  " + x for x in d.request_lines()]
        lines += self.notes
        return lines

    def summary_line(self) -> str:
        """The one line a pass prints."""
        dec = (f"; {self.decisions.headline()}" if self.decisions is not None else "")
        return f"router-replay check: {self.verdict()} ({self._counts()}{dec})"

    def text(self, verbose: bool = False) -> str:
        """The terminal output: one line on a pass; on a failure (or ``verbose``) settings,
        decisions and regressions first, then (``verbose``) the full table."""
        if not verbose and self.exit_code == 0 and not self.settings:
            return self.summary_line() + "\n"
        if verbose:
            return self.markdown()
        lines = [f"router-replay check: {self.verdict()}", f"run {self.run.path} against baseline "
                 f"{self.baseline.get('_path', '')}: {self._counts()}"]
        lines += self._preamble()
        if self.regressions:
            lines.append("regressions:")
            lines += [f"  {self.describe(r)}" for r in self.regressions]
        lines.append("(every check: --verbose, or --markdown FILE)")
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """A Markdown report for a pull-request comment: verdict, settings, decisions, table,
        regressions named."""
        reg = self.regressions
        lines = [f"### router-replay check: {self.verdict()}", "",
                 f"Run `{self.run.path}` against baseline `{self.baseline.get('_path', '')}` "
                 f"(router-replay {self.baseline.get('version')} -> {self.run.meta.get('version')}; same trace). "
                 f"{self._counts()}.", ""]
        if self.settings:
            lines += ["**Replay settings differ from the baseline's run:** " + ", ".join(self.settings), ""]
        if self.decisions is not None:
            d = self.decisions
            mark = "**" if self.decisions_failed else ""
            lines += [f"{mark}Decisions: {d.headline()}{mark}"
                      + (" (allowed by --allow-decision-drift)" if d.changed and d.allowed else ""), ""]
            if d.changed:
                lines += ["| config | changed | worker | label | pin | divert | 503 |", "|---|--:|--:|--:|--:|--:|--:|"]
                for r in d.per_config.filter(pl.col("changed") > 0).iter_rows(named=True):
                    lines.append(f"| `{r['config']}` | {r['changed']:,} | {r['worker_changed']:,} | "
                                 f"{r['decision_changed']:,} | {r['pinned_base']:,} -> {r['pinned_run']:,} | "
                                 f"{r['diverted_base']:,} -> {r['diverted_run']:,} | "
                                 f"{r['failed_base']:,} -> {r['failed_run']:,} |")
                lines += ["", "First changed requests:", ""]
                lines += [f"- {x}" for x in d.request_lines()]
                lines.append("")
        for note in self.notes:
            lines.append(f"_{note}_")
            lines.append("")
        lines.append("| config | metric | baseline | current | change | tolerance | status |")
        lines.append("|---|---|--:|--:|--:|---|---|")
        for r in self.rows:
            tol = Tolerance(r["metric"], *_split_tol(r["tolerance"]))
            status = {"regression": "**REGRESSION**", "improved": "improved", "ok": "ok"}[r["status"]]
            if r["note"]:
                status += f" ({r['note']})"
            lines.append(f"| `{r['config']}` | {r['metric']} | {fmt_value(r['metric'], r['baseline'])} | "
                         f"{fmt_value(r['metric'], r['current'])} | "
                         f"{fmt_change(r['metric'], r['baseline'], r['current'])} | {tol.describe()} | {status} |")
        if reg:
            lines += ["", "**Regressions:**", ""]
            lines += [f"- {self.describe(r)}" for r in reg]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        """The check as one JSON object (``check --json``)."""
        return {"verdict": self.verdict(), "exit_code": self.exit_code, "run": str(self.run.path),
                "baseline": self.baseline.get("_path"), "settings_differ": self.settings,
                "decisions": self.decisions.to_json() if self.decisions is not None else None,
                "notes": self.notes, "regressions": [self.describe(r) for r in self.regressions],
                "checks": self.rows, "configs_not_in_baseline": self.extra_configs}

    def junit_xml(self) -> str:
        """JUnit XML: one testcase per config x metric, and per config one for its decisions;
        regressions and changed decisions are failures named by config."""
        drift = self.decisions.per_config.to_dicts() if self.decisions is not None else []
        failing = [r for r in drift if r["changed"] and self.decisions_failed]
        suite = ET.Element("testsuite", name="router-replay check", tests=str(len(self.rows) + len(drift)),
                           failures=str(len(self.regressions) + len(failing)), errors="0", skipped="0")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="run", value=str(self.run.path))
        ET.SubElement(props, "property", name="baseline", value=str(self.baseline.get("_path", "")))
        for s in self.settings:
            ET.SubElement(props, "property", name="settings_differ", value=s)
        for r in drift:
            case = ET.SubElement(suite, "testcase", classname="router-replay.check.decisions",
                                 name=f"{r['config']} :: decisions")
            text = (f"{r['changed']:,} of {self.decisions.requests:,} decisions changed "  # type: ignore[union-attr]
                    f"(worker {r['worker_changed']:,}, label {r['decision_changed']:,}, pins {r['pinned_base']:,}"
                    f" -> {r['pinned_run']:,}, diverts {r['diverted_base']:,} -> {r['diverted_run']:,}, "
                    f"503s {r['failed_base']:,} -> {r['failed_run']:,})")
            if r in failing:
                f = ET.SubElement(case, "failure", message=f"changed decisions: {text}", type="decisions")
                f.text = text
            else:
                ET.SubElement(case, "system-out").text = text if r["changed"] else "decisions identical"
        for r in self.rows:
            case = ET.SubElement(suite, "testcase", classname=f"router-replay.check.{r['metric']}",
                                 name=f"{r['config']} :: {r['metric']}")
            if r["status"] == "regression":
                f = ET.SubElement(case, "failure", message=f"regression: {self.describe(r)}",
                                  type="regression")
                f.text = self.describe(r)
            else:
                out = ET.SubElement(case, "system-out")
                out.text = f"{r['status']}: {self.describe(r)}"
        root = ET.Element("testsuites", name="router-replay", tests=suite.get("tests"),
                          failures=suite.get("failures"), errors="0")
        root.append(suite)
        ET.indent(root)
        return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _split_tol(text: str) -> tuple[float, str]:
    for u in ("pt", "%"):
        if text.endswith(u):
            return float(text[: -len(u)]), u
    return float(text), ""


def _judge(name: str, base: float | None, cur: float | None, tol: Tolerance) -> tuple[str, float | None, str]:
    """(status, worsening, note) of one metric value against its baseline."""
    if base is None and cur is None:
        return "ok", None, "no value in either"
    if base is None:
        return "ok", None, "no baseline value"
    if cur is None:
        return "regression", None, "value missing in the run"
    better = METRICS[name].better
    d = cur - base
    worsening = d if better == "lower" else -d if better == "higher" else abs(d)
    eps = 1e-12 * max(1.0, abs(base))
    if worsening > tol.allowed(base) + eps:
        return "regression", worsening, ""
    if better != "neither" and worsening < -eps:
        return "improved", worsening, ""
    return "ok", worsening, ""


def check_run(run: Run | str | os.PathLike, baseline: dict | str | os.PathLike, *,
              tolerances: Mapping[str, Tolerance | str] | None = None,
              allow_decision_drift: bool | None = None) -> CheckResult:
    """Hold a run to a baseline.

    The run must have replayed the same trace files as the baseline's run and
    hold every baseline config (matched by knob values); otherwise
    :class:`ReplayError` (unusable input).  Each stored metric of each config
    is judged against its tolerance: the baseline file's, overridden by
    ``tolerances``.  Only moves in a metric's bad direction can fail
    (improvements never fail; metrics with no good direction fail either way).

    Every decision the baseline stores is compared with the run's (worker,
    label, pin, divert, 503 per config and request): a replay is deterministic,
    so any change fails, unless ``allow_decision_drift`` (default: what the
    baseline file says) reports it and leaves the verdict to the tolerances.
    """
    run = run if isinstance(run, Run) else load_run(run)
    if not isinstance(baseline, dict):
        baseline = load_baseline(baseline)
    elif "_tolerances" not in baseline:      # was a TypeError from Path(dict)
        raise ReplayError("baseline: a dict must be one load_baseline returned (it has no '_tolerances')")
    where = baseline.get("_path", "baseline")
    diff = trace_difference(trace_hashes(baseline, where), run.trace_hashes)
    if diff is not None:
        raise ReplayError(f"{run.path} did not replay the baseline's trace ({diff}); "
                          f"a baseline only holds for the trace it was written from")
    if baseline.get("run", {}).get("model") != run.meta.get("model"):
        raise ReplayError(f"{run.path} replayed model {run.meta.get('model')!r}, the baseline "
                          f"{baseline.get('run', {}).get('model')!r}")
    names = list(baseline["metrics"])
    tol = dict(baseline["_tolerances"])
    for k, v in (tolerances or {}).items():
        t = v if isinstance(v, Tolerance) else parse_tolerance(k, v)
        if k not in tol:
            raise ReplayError(f"tolerance given for {k}, which the baseline does not store "
                              f"(stored: {', '.join(names)})")
        tol[k] = t
    table = run.metrics(names)
    knobs = run.knobs
    bknobs = set().union(*(c["knobs"].keys() for c in baseline["configs"]))
    unknown = sorted(bknobs - set(KNOB_NAMES))
    if unknown:
        raise ReplayError(f"{where}: unknown knob {unknown[0]!r} in the baseline")
    key_knobs = [k for k in KNOB_NAMES if k in bknobs or k in knobs]
    shown = varying_knobs(table, [c["knobs"] for c in baseline["configs"]])
    by_key = {}
    for r in table.iter_rows(named=True):
        by_key[_knob_key(r, key_knobs)] = r
    rows, missing, used = [], [], set()
    id_of, labels_of = [], []
    for c in baseline["configs"]:
        k = c["knobs"]
        full = {kn: k.get(kn, _default(kn)) for kn in key_knobs}
        key = _knob_key(full, key_knobs)
        label = config_label(full, shown)
        r = by_key.get(key)
        if r is None:
            missing.append(label)
            continue
        id_of.append(r["config_id"])
        labels_of.append(label)
        used.add(r["config_id"])
        for n in names:
            status, worse, note = _judge(n, c["metrics"].get(n), r[n], tol[n])
            rows.append({"config": label, "config_id": r["config_id"], "metric": n,
                         "baseline": c["metrics"].get(n), "current": r[n], "tolerance": tol[n].text,
                         "allowed": tol[n].allowed(c["metrics"].get(n) or 0.0), "worsening": worse,
                         "status": status, "note": note})
    if missing:
        raise ReplayError(f"{run.path}: {len(missing)} baseline config{'s' if len(missing) != 1 else ''} "
                          f"missing from the run (first: {missing[0]}); rerun the sweep with the baseline's grid")
    extra = [config_label(r, shown) for r in table.iter_rows(named=True) if r["config_id"] not in used]
    res = CheckResult(run, baseline, rows, extra, settings=_baseline_settings(baseline, run))
    allow = bool(baseline.get("allow_decision_drift")) if allow_decision_drift is None else allow_decision_drift
    stored = baseline.get("decisions")
    if stored is None:
        res.notes.append("decisions not checked: the baseline stores none (written by an earlier version, or "
                         "from a run without decisions); write it again with --write-baseline")
    elif run.decisions is None:
        if not allow:
            raise ParamsError("{path}: the run kept no decisions, and the baseline holds its decisions; rerun the "
                              "sweep with decisions, or pass {allow_decision_drift}", "allow_decision_drift",
                              path=run.path)
        res.notes.append(f"decisions not checked: {run.path} kept none")
    else:
        mapping = {c["config_id"]: id_of[i] for i, c in enumerate(baseline["configs"])}
        config_names = {id_of[i]: labels_of[i] for i in range(len(baseline["configs"]))}
        base = decision_gate.decode(stored, mapping, where)
        res.decisions = decision_gate.compare(base, decision_gate.outcome_frame(run, list(config_names)),
                                              config_names)
        res.decisions.allowed = allow
    if extra:
        res.notes.append(f"{len(extra)} config{'s' if len(extra) != 1 else ''} of the run not in the baseline "
                         f"(not checked): {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    return res


def _baseline_settings(baseline: Mapping, run: Run) -> list[str]:
    """The replay settings that differ between the baseline's run and ``run``."""
    stored = baseline.get("run") or {}
    out = []
    for key in ("freshness_ms", "seed", "per_dp_rank", "dp_size"):
        a, b = stored.get(key), run.meta.get(key)
        if key in stored and a != b:
            out.append(f"{key} {a} -> {b}")
    return out


def _default(knob: str) -> Any:
    return getattr(RouterConfig(), knob)


# ---------------------------------------------------------------------------
# recommend


@dataclass
class Recommendation:
    """The answer for one dp_size group (``dp_size`` None: the run's single fleet).

    ``best``/``runner_up``/``no_gate`` are metric rows (dicts) or None;
    ``met``, ``exceeded`` and ``unknown`` count the configs whose p99 is within
    the bound, above it, or unknown.  ``margin`` is the best hit rate minus the
    runner-up's (a fraction; None without a runner-up).
    """

    dp_size: int | None
    bound: float
    best: dict | None
    runner_up: dict | None
    no_gate: dict | None
    met: int
    exceeded: int
    unknown: int
    lowest_p99: dict | None
    knobs: list[str]

    @property
    def margin(self) -> float | None:
        """Hit-rate margin of the best over the runner-up (fraction), or None."""
        if self.best is None or self.runner_up is None:
            return None
        return (self.best["hit_rate"] or 0.0) - (self.runner_up["hit_rate"] or 0.0)

    def flags(self) -> str:
        """The router command-line flags of the recommended config (knobs that differ from the defaults)."""
        return "" if self.best is None else ranking.router_flags(self.best)

    def deploy_flags(self) -> str | None:
        """The flags as a router command line takes them ('' for the router's defaults); None
        when there is nothing to deploy (no config met the bound, or it needs a replay-only variant)."""
        return ranking.deploy_flags(self.best)

    def to_json(self) -> dict:
        """The answer as JSON (``recommend --json``): knob values, flags, evidence, margin, counts."""
        def row(r: dict | None) -> dict | None:
            if r is None:
                return None
            return {"config": r["config"], "config_id": r["config_id"],
                    "knobs": {k: r[k] for k in KNOB_NAMES if k in r},
                    "metrics": {m: r.get(m) for m in RECOMMEND_EVIDENCE}}
        return {"dp_size": self.dp_size, "bound": {"metric": "selected_waiting_p99", "max": self.bound},
                "recommended": row(self.best), "router_flags": self.deploy_flags(),
                "runner_up": row(self.runner_up), "margin_hit_rate": self.margin, "no_gate": row(self.no_gate),
                "configs_meeting_bound": self.met, "configs_over_bound": self.exceeded,
                "configs_unknown": self.unknown}


def _rank_key(r: dict) -> tuple:
    hr = r["hit_rate"]
    return (-(hr if hr is not None else -1.0), r["selected_waiting_p99"],
            r["selected_waiting_mean"] if r["selected_waiting_mean"] is not None else math.inf, r["config_id"])


def recommend(run: Run | str | os.PathLike, max_p99_waiting: float) -> list[Recommendation]:
    """For each dp_size in the run (summary column ``dp_size`` of ``--per-dp-rank``
    runs; one group otherwise): the config with the best hit rate whose
    ``selected_waiting_p99 <= max_p99_waiting``, the runner-up (margin), how
    many configs met the bound, and the no-gate config (no limit, no floor,
    other knobs as the best's) for reference.  Ties on hit rate go to the
    lower p99, then the lower mean waiting, then the lower config id.
    """
    if max_p99_waiting is None or not math.isfinite(float(max_p99_waiting)) or max_p99_waiting < 0:
        raise ParamError("max_p99_waiting", f"must be a finite number >= 0, got {max_p99_waiting!r}")
    run = run if isinstance(run, Run) else load_run(run)
    table = run.metrics(RECOMMEND_EVIDENCE)
    shown = varying_knobs(table)
    groups: list[tuple[int | None, pl.DataFrame]]
    if "dp_size" in table.columns and table["dp_size"].null_count() < table.height:
        groups = [(int(d), table.filter(pl.col("dp_size") == d))
                  for d in sorted(table["dp_size"].drop_nulls().unique().to_list())]
    else:
        groups = [(None, table)]
    out = []
    for dp, g in groups:
        rows = list(g.iter_rows(named=True))
        for r in rows:
            r["config"] = config_label(r, shown)
        ranked = ranking.rank(rows, value=lambda r: r["selected_waiting_p99"], bound=float(max_p99_waiting),
                              order=_rank_key)
        ok = ranked.ranked
        known = [r for r in rows if r["selected_waiting_p99"] is not None]
        best = ok[0] if ok else None
        lowest = min(known, key=lambda r: (r["selected_waiting_p99"], _rank_key(r))) if known else None
        no_gate = None
        ref = best or lowest
        gates = [r for r in rows if all(r[k] is None for k in GATE_KNOBS)]
        if gates:
            others = [k for k in KNOB_NAMES if k in g.columns and k not in GATE_KNOBS]
            same = [r for r in gates if ref is not None and all(r[k] == ref[k] for k in others)]
            no_gate = (same or sorted(gates, key=lambda r: r["config_id"]))[0]
        out.append(Recommendation(dp, float(max_p99_waiting), best, ok[1] if len(ok) > 1 else None, no_gate,
                                  met=len(ok), exceeded=len(ranked.excluded[ranking.OVER_BOUND]),
                                  unknown=len(ranked.excluded[ranking.UNKNOWN]), lowest_p99=lowest, knobs=shown))
    return out


def format_recommendations(recs: Sequence[Recommendation], run: Run, *, width: int = 100) -> str:
    """The terminal answer: per dp_size group, the recommended config and its flags, the margin
    to the next best, how many configs met the bound, and its metrics beside the no-gate config."""
    bound = recs[0].bound if recs else 0.0
    lines = [f"recommend: best hit rate with selected_waiting_p99 <= {bound:g} "
             f"({run.path}, {run.summary.height} configs)"]
    for rec in recs:
        lines.append("")
        head = f"dp_size {rec.dp_size}" if rec.dp_size is not None else "fleet"
        total = rec.met + rec.exceeded + rec.unknown
        if rec.best is None:
            lines.append(f"{head}: NO CONFIG MEETS THE BOUND: none of {total} configs has "
                         f"selected_waiting_p99 <= {bound:g}.")
            if rec.lowest_p99 is not None:
                lo = rec.lowest_p99
                lines.append(f"  lowest p99 in this run: "
                             f"{fmt_value('selected_waiting_p99', lo['selected_waiting_p99'])}"
                             f" ({lo['config']}, hit rate {fmt_value('hit_rate', lo['hit_rate'])}); "
                             f"raise the bound or sweep tighter limits")
            else:
                lines.append("  no config has a known p99 (no fresh queue reading at any chosen worker)")
            continue
        b = rec.best
        per_rank = ""
        if rec.dp_size is not None and "per_rank_limit" in b:
            per_rank = (f" (per rank: limit {knob_text(b.get('per_rank_limit'))}, "
                        f"floor {knob_text(b.get('per_rank_floor'))})")
        lines.append(f"{head}: recommended {b['config']} (config {b['config_id']}){per_rank}")
        lines.append(f"  router flags: {rec.flags()}")
        lines.append(f"  hit rate {fmt_value('hit_rate', b['hit_rate'])} with p99 waiting "
                     f"{fmt_value('selected_waiting_p99', b['selected_waiting_p99'])} (bound {bound:g})")
        if rec.runner_up is not None:
            r = rec.runner_up
            tie = " (tie broken by lower p99, then mean waiting)" if rec.margin == 0 else ""
            lines.append(f"  margin: {100 * rec.margin:+.2f} pt hit rate over the next best, {r['config']} "
                         f"({fmt_value('hit_rate', r['hit_rate'])}, p99 "
                         f"{fmt_value('selected_waiting_p99', r['selected_waiting_p99'])}){tie}")
        else:
            lines.append("  margin: the only config that meets the bound")
        lines.append(f"  {rec.met} of {total} configs meet the bound ({rec.exceeded} exceed it"
                     + (f", {rec.unknown} without a known p99" if rec.unknown else "") + ")")
        ng = rec.no_gate
        if ng is None:
            lines.append("  no no-gate config in this run (add `none` to --worker-queue-limit for a reference)")
            cols = ["metric", "recommended"]
        else:
            itself = " (the recommended config itself)" if ng["config_id"] == b["config_id"] else ""
            lines.append(f"  reference: no-gate config {ng['config']} (config {ng['config_id']}){itself}")
            cols = ["metric", "recommended", "no gate", "delta"]
        rows = []
        for m in RECOMMEND_EVIDENCE:
            cells = [m, fmt_value(m, b[m])]
            if ng is not None:
                cells += [fmt_value(m, ng[m]), fmt_change(m, ng[m], b[m])]
            rows.append(cells)
        lines.extend("  " + s for s in _table(cols, rows, width - 2))
    return "\n".join(lines)
