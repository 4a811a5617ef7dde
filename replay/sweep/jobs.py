"""What an executor is given and gives back: a :class:`Job` in, a :class:`Done` out.

Below both executors (:mod:`replay.sweep.executors` for threads in this process,
:mod:`replay.sweep.shards` for Ray tasks), so neither imports the other's module
to name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from replay.config import Grid
from replay.sweep import engine
from replay.sweep import readings as fleet_mod
from replay.trace import Trace, TraceSet


@dataclass
class Job:
    """What every executor needs to replay a trace (in memory or window by window)."""

    source: Trace | TraceSet
    configs: list
    grid: Grid
    seed: int
    freshness_ns: int
    model: str | None
    threads: int | None
    progress: Callable[[int], None] | None
    out_dir: Path | None             # the unfinished run dir (None: nothing written)
    decisions: bool
    decisions_layout: str = "long"   # decision_store.LAYOUTS


@dataclass
class Done:
    totals: engine.Totals
    facts: fleet_mod.FleetFacts
    has_selected: bool
    decision_files: str | list[str] | None = None   # DECISIONS, or the shards' files (Ray)
    windows: int = 1
    t_kernel: float = 0.0
    t_write: float = 0.0
    execution: dict = field(default_factory=dict)
