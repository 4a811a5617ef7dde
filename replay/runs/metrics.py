"""The one table of per-config metrics that report, compare, check and recommend read.

Every metric is derived from ``summary.parquet``: a column as it is, or a count
over a denominator.  Each row says how to compute it, its kind (``rate``: a
fraction in 0..1, shown in percent, differences in points; ``count``;
``value``: a pressure reading), which way is better (``higher``, ``lower``, or
``neither`` for a mechanism such as pins), the tolerance ``check`` applies by
default, and how the report labels and formats it.

Shares, decided once:

* ``pinned_share``, ``diverted_share``, ``fell_back_share``: over *routed*
  requests (a 503 is never pinned, diverted or fallen back);
* ``share_cache_hit``, ``share_cache_miss``, ``share_cache_worker_queued``,
  ``share_all_queued``, ``share_failed``: over *all* requests, so the four
  decision-label shares and the failed share add up to 1.

The report used to call two of them ``pin_share`` and ``all_queued_share``
(the latter over routed requests) and ``failed_share``; those names still
resolve (:data:`ALIASES`), and every name a baseline file has ever stored is
a metric here, so old baselines load.

This module imports nothing heavy: ``check --help`` lists the table.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from replay.config import KNOB_NAMES, KNOBS
from replay.errors import ReplayError

HIT_POINTS = 1.0
"""A seed disagrees when its served hit rate is more than this many points from the seeds'
median (``replay.simulate.seeds``); a closed-loop answer leaves a config out when its seeds
span more than twice this (``replay.analysis.closed_loop.disagrees``)."""
P99_FACTOR = 1.25
"""...or when its TTFT p99 is more than this factor from the seeds' median."""


@dataclass(frozen=True)
class Metric:
    """One row of the metrics table (see the module docstring)."""

    name: str
    kind: str                   # "rate", "count" or "value"
    better: str                 # "higher", "lower" or "neither"
    default_tolerance: str      # check's default: "0.5pt", "10%", "2"
    description: str            # what it is, for help texts
    label: str                  # the report's label (heatmap titles)
    fmt: str                    # the report's format: "pct", "int", "f2", "si"
    column: str | None = None   # a summary column taken as it is, or
    share: tuple[str, str] | None = None   # (count column, denominator column)
    short: str | None = None    # the report's hover label, when shorter than ``label``

    @property
    def hover_label(self) -> str:
        return self.short or self.label

    def expr(self, cols: Iterable[str]):
        """The polars expression over a summary with columns ``cols`` (Float64), or None
        when the summary lacks a source column."""
        import polars as pl  # lazy: the metric names are read by `check --help`, which imports no polars

        cols = set(cols)
        if self.column is not None:
            return pl.col(self.column).cast(pl.Float64) if self.column in cols else None
        assert self.share is not None, self.name      # a metric is a column or a share
        num, den = self.share
        if num not in cols or den not in cols:
            return None
        d = pl.col(den).cast(pl.Float64)
        return pl.when(d > 0).then(pl.col(num).cast(pl.Float64) / d).otherwise(None)


def _col(name, kind, better, tol, description, label, fmt, short=None) -> Metric:
    return Metric(name, kind, better, tol, description, label, fmt, column=name, short=short)


def _share(name, num, den, better, tol, description, label) -> Metric:
    return Metric(name, "rate", better, tol, description, label, "pct", share=(num, den))


METRICS: dict[str, Metric] = {m.name: m for m in (
    _col("hit_rate", "rate", "higher", "0.5pt", "selected / query blocks over routed requests", "hit rate", "pct"),
    _col("matched_rate", "rate", "neither", "0.5pt", "matched / query blocks (the fleet's ceiling)",
         "matched rate (ceiling)", "pct"),
    _col("owner_rate", "rate", "higher", "0.5pt", "matched requests landing on a prefix owner", "owner rate", "pct"),
    _share("share_cache_hit", "cache_hit", "requests", "higher", "1pt", "cache_hit label / requests",
           "cache_hit share"),
    _share("share_cache_miss", "cache_miss", "requests", "lower", "1pt", "cache_miss label / requests",
           "cache_miss share"),
    _share("share_cache_worker_queued", "cache_worker_queued", "requests", "lower", "1pt",
           "cache_worker_queued label / requests", "cache_worker_queued share"),
    _share("share_all_queued", "all_queued", "requests", "lower", "1pt", "all_queued label / requests",
           "all_queued share"),
    _share("share_failed", "failed", "requests", "lower", "0.1pt", "failed (503) / requests", "failed share"),
    _share("pinned_share", "pinned", "routed", "neither", "1pt", "saturation pins / routed requests", "pin share"),
    _share("diverted_share", "diverted", "routed", "neither", "1pt", "diverted / routed requests",
           "diverted share"),
    _share("fell_back_share", "fell_back", "routed", "neither", "1pt", "fell-back tier / routed requests",
           "fell-back share"),
    _col("pinned", "count", "neither", "10%", "saturation pins", "pins", "int"),
    _col("diverted", "count", "neither", "10%", "requests diverted by the queue gate", "diverted", "int"),
    _col("selected_waiting_p50", "value", "lower", "10%", "p50 num_waiting_reqs of the chosen worker",
         "p50 waiting at chosen worker", "int", short="p50 waiting"),
    _col("selected_waiting_p99", "value", "lower", "10%", "p99 num_waiting_reqs of the chosen worker",
         "p99 waiting at chosen worker", "int", short="p99 waiting"),
    _col("selected_waiting_mean", "value", "lower", "10%", "mean num_waiting_reqs of the chosen worker",
         "mean waiting at chosen worker", "f2", short="mean waiting"),
    _col("selected_waiting_uncached_mean", "value", "lower", "10%",
         "mean uncached tokens waiting at the chosen worker", "mean waiting uncached tokens", "si"),
    _col("selected_queue_ms_mean", "value", "lower", "10%", "mean estimated queue ms of the chosen worker",
         "mean est. queue ms", "f2"),
    _col("cold_prefill_tokens", "count", "lower", "2%", "uncached tokens prefilled at the chosen workers",
         "cold prefill tokens", "si"),
    _col("agreement", "rate", "neither", "1pt", "replayed worker == the trace's selected_worker",
         "agreement with production", "pct"),
    # the reorg engine's own outcome labels (docs/replay-model.md, "The reorg engine"); 0 under legacy
    *(_share(f"share_reorg_{o}", f"reorg_{o}", "requests", better, "1pt",
             f"reorg {o.replace('_', ' ')} (the replay's own label) / requests", f"reorg {o.replace('_', ' ')} share")
      for o, better in (("cache_win", "higher"), ("saturation_pin", "neither"), ("miss_fallback", "lower"),
                        ("no_admissible_engine", "lower"), ("no_workers", "lower"))),
    # the locality waterfall (docs/replay-model.md): matched blocks each step gave away
    *(_col(f"lost_{step}", "count", "lower", "10%", f"matched blocks lost to {step.replace('_', ' ')}",
           f"blocks lost to {step.replace('_', ' ')}", "si")
      for step in ("candidates", "queue_gate", "capacity", "pin", "tournament", "fallback")),
)}
"""Every metric, by name."""

ALIASES = {"pin_share": "pinned_share", "all_queued_share": "share_all_queued", "failed_share": "share_failed"}
"""Names an earlier version used for a metric of this table (the report's in-memory columns)."""

LABEL_SHARES = ("share_cache_hit", "share_cache_miss", "share_cache_worker_queued", "share_all_queued")
"""The cache-aware decision-label shares (label count / requests)."""

REORG_SHARES = ("share_reorg_cache_win", "share_reorg_saturation_pin", "share_reorg_miss_fallback",
                "share_reorg_no_admissible_engine", "share_reorg_no_workers")
"""The reorg engine's outcome shares (the replay's own labels, 0 under legacy): beside legacy's in ``compare``."""

CHECKED = ("hit_rate", "matched_rate", "owner_rate", *LABEL_SHARES, "share_failed", "pinned_share",
           "diverted_share", "pinned", "diverted", "selected_waiting_p50", "selected_waiting_p99",
           "selected_waiting_mean", "selected_queue_ms_mean", "cold_prefill_tokens", "agreement")
"""Metrics ``check`` can store in a baseline (``check --help`` lists them)."""

DEFAULT_CHECK_METRICS = ("hit_rate", "selected_waiting_p99", *LABEL_SHARES)
"""Metrics a baseline stores when none are chosen."""

DEFAULT_TOLERANCES = {"hit_rate": "0.5pt", "selected_waiting_p99": "10%", **{s: "1pt" for s in LABEL_SHARES}}
"""The gate's defaults: hit rate may drop 0.5 points, p99 pressure rise 10%, label shares move 1 point."""

COMPARE_METRICS = (
    "hit_rate", "matched_rate", "owner_rate", *LABEL_SHARES, *REORG_SHARES, "share_failed", "pinned", "diverted",
    "pinned_share", "diverted_share", "selected_waiting_p50", "selected_waiting_p99", "selected_waiting_mean",
    "selected_queue_ms_mean", "cold_prefill_tokens", "agreement",
    "lost_candidates", "lost_queue_gate", "lost_capacity", "lost_pin", "lost_tournament", "lost_fallback",
)
"""Metrics ``compare`` reports deltas for (the waterfall's terms last)."""

RECOMMEND_EVIDENCE = ("hit_rate", "owner_rate", "matched_rate", *LABEL_SHARES, "pinned_share", "diverted_share",
                      "selected_waiting_p50", "selected_waiting_p99", "selected_waiting_mean",
                      "cold_prefill_tokens")
"""Metrics shown as the evidence of a recommendation."""

HEATMAP = ("hit_rate", "owner_rate", "pinned_share", "share_all_queued", "diverted_share",
           "selected_waiting_p99", "selected_waiting_mean", "cold_prefill_tokens")
"""The report's heatmaps over floor x limit, in page order."""

HOVER = ("hit_rate", "matched_rate", "owner_rate", "pinned_share", "share_all_queued", "diverted_share",
         "fell_back_share", "share_failed", "selected_waiting_p50", "selected_waiting_p99", "selected_waiting_mean",
         "selected_waiting_uncached_mean", "selected_queue_ms_mean", "cold_prefill_tokens", "agreement")
"""Everything the report's hover shows about one config."""

DERIVED = ("pinned_share", "share_all_queued", "diverted_share", "fell_back_share", "share_failed")
"""The shares the report adds to the summary table it draws from."""


def knob_text(v: Any) -> str:
    """A knob value (or a bound) as every table and label writes it: ``none``, a whole
    number without its ``.0``, else the value as Python reads it back (exact)."""
    if v is None:
        return "none"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def flag_text(knob: str, v: Any) -> str:
    """A knob value as its router flag reads it (``--disable-pressure-guard`` inverts
    ``pressure_guard``; booleans as ``true``/``false``)."""

    spec = KNOBS.get(knob)
    if spec is not None and spec.inverted and isinstance(v, bool):
        return "true" if not v else "false"
    if isinstance(v, bool):
        return "true" if v else "false"
    return knob_text(v)


def metric(name: str) -> Metric:
    """The :class:`Metric` called ``name`` (or an old name of it); one-line :class:`ReplayError` if unknown."""
    try:
        return METRICS[ALIASES.get(name, name)]
    except KeyError:
        raise ReplayError(f"unknown metric {name!r}; known: {', '.join(METRICS)}") from None


def help_list(names: Iterable[str] = CHECKED) -> str:
    """The metric names as the help text lists them."""
    return ", ".join(names)


def metric_table(summary: Any, names: Iterable[str] = COMPARE_METRICS):
    """Per-config metrics from a summary table: id and knob columns (and ``dp_size``,
    per-rank values when present), then one Float64 column per metric of ``names``
    (null where the summary lacks its source columns)."""
    import polars as pl  # lazy: the metric names are read by `check --help`, which imports no polars

    cols = set(summary.columns)
    keep = ["config_id", *[k for k in KNOB_NAMES if k in cols],
            *[c for c in ("dp_size", "per_rank_limit", "per_rank_floor") if c in cols]]
    exprs = []
    for n in names:
        e = metric(n).expr(cols)
        exprs.append((e if e is not None else pl.lit(None, pl.Float64)).alias(n))
    return summary.select(*keep, *exprs)
