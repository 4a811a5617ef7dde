"""Output directories written atomically, shared by sweep, simulate and compare.

A command refuses an existing non-empty output directory unless ``--force``,
builds its output in a hidden sibling folder, and moves it into place only
when complete; an old directory is removed only after the new one is in
place, so a failed run never leaves a half-written directory that looks
finished and never loses the previous one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import ReplayError


def refuse_existing(out: str | os.PathLike, force: bool, what: str = "output directory") -> None:
    """Refuse a file in place of ``out``, or an existing non-empty ``out`` unless ``force``."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReplayError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ReplayError(f"{out}: {what} exists and is not empty (use --force to replace it)")


def partial_beside(out: str | os.PathLike) -> Path:
    """A new hidden sibling folder of ``out`` to build in, with ordinary permissions
    (``mkdtemp`` alone would leave the finished directory readable by its owner only)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def move_into_place(tmp: Path, out: str | os.PathLike) -> None:
    """Replace ``out`` by the finished ``tmp``; the old ``out`` is removed only after."""
    out = Path(out)
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
