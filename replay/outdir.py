"""Moved to :mod:`replay.rundir` (the one module owning outputs); these names stay for callers."""

from __future__ import annotations

from .rundir import move_into_place, partial_beside, refuse_existing

__all__ = ["move_into_place", "partial_beside", "refuse_existing"]
