"""Moved to :mod:`replay.rundir` (the one module owning outputs); these names stay for the
simulator's writer until it calls :func:`replay.rundir.guard` itself."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ReplayError
from .rundir import move_into_place, partial_beside

__all__ = ["move_into_place", "partial_beside", "refuse_existing"]


def refuse_existing(out: str | os.PathLike, force: bool, what: str = "output directory") -> None:
    """Refuse a file in place of ``out``, or an existing non-empty ``out`` unless ``force``
    (only the emptiness half of :func:`replay.rundir.guard`'s rule)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReplayError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ReplayError(f"{out}: {what} exists and is not empty (use --force to replace it)")
