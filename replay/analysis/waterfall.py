"""The locality waterfall read back: its terms, the drill-down table and the changed terms.

The summary's integer columns (docs/replay-model.md, "Where locality goes")
split the blocks a config could have reused into what each decision step gave
away::

    matched_blocks - (lost_candidates + ... + lost_fallback) = selected_blocks

The report draws that per config and side by side for two configs
(:mod:`replay.report.sections`); this module lists the requests that lost most (from ``decisions.parquet``)
and computes the terms that changed between two configs for ``compare``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from replay import labels
from replay.runs import decisions as decision_store

TERMS = tuple(f"lost_{s}" for s in labels.LOSS_STEPS)
"""The six loss columns in chain order."""
STEP_TEXT = {f"lost_{s}": s.replace("_", " ") for s in labels.LOSS_STEPS}
COLUMNS = ("matched_blocks", *TERMS, "selected_blocks")
MENU_MAX = 40
"""Most configs the per-config menu holds (the page stays small; the rest by --config)."""
DRILL_COLUMNS = ("request_id", "worker", "decision", "reason", "lost_to", "matched_blocks",
                 "selected_blocks", "blocks_lost", "lost_candidates", "lost_queue_gate", "lost_capacity")


def has_waterfall(columns: Sequence[str]) -> bool:
    """Whether a summary carries the waterfall columns (runs older than the waterfall do not)."""
    return all(c in columns for c in COLUMNS)


def terms(row: Mapping[str, Any]) -> dict[str, int]:
    """``matched_blocks``, the six terms and ``selected_blocks`` of a summary row, as ints."""
    return {c: int(row.get(c) or 0) for c in COLUMNS}


def changed_terms(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, int]:
    """The waterfall columns whose value differs from ``a`` to ``b``: ``{column: b - a}``."""
    ta, tb = terms(a), terms(b)
    return {c: tb[c] - ta[c] for c in COLUMNS if tb[c] != ta[c]}


def drilldown(files: Sequence[Path] | None, config_id: int, n: int = 20) -> pl.DataFrame | None:
    """The ``n`` requests of ``config_id`` that lost the most blocks, with their labels (None
    without decisions files or without the waterfall columns in them)."""
    if not files:
        return None

    names = set(decision_store.columns_of(files[0]))
    if "blocks_lost" not in names:
        return None
    cols = [c for c in DRILL_COLUMNS if c in names]
    lf = pl.concat([decision_store.scan_file(f, ["config_id", *cols]) for f in files], how="vertical_relaxed")
    top = (lf.filter((pl.col("config_id") == config_id) & (pl.col("blocks_lost") > 0))
           .sort(["blocks_lost", "request_id"], descending=[True, False]).head(n).drop("config_id").collect())
    if "worker" in top.columns and top.schema["worker"] == pl.String:
        # a worker is named by host:port: the page references no address it could fetch
        top = top.with_columns(pl.col("worker").str.replace(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", ""))
    return top
