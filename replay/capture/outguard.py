"""Where capture commands may write: never inside an input, never over a user's folder.

REPLAY CHOICE: house's ``replay/rundir.py`` guard had not landed when this was
written; until it does, ``record`` and ``import`` refuse an existing
non-empty ``--out`` unless ``--force``, and ``--force`` only replaces a folder
this tool wrote (it holds ``record.json`` or ``trace.json``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import ReplayError

OURS = ("record.json", "trace.json")


def check_out(out: Path, force: bool, inputs: list[Path] = ()) -> None:
    out = Path(out).resolve()
    for inp in inputs:
        p = Path(inp).resolve()
        if out == p or p in out.parents:
            raise ReplayError(f"--out {out} is inside the input {p}; write somewhere else")
        if out in p.parents:
            raise ReplayError(f"--out {out} holds the input {p}; write somewhere else")
    if out.exists() and not out.is_dir():
        raise ReplayError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ReplayError(f"{out}: output directory exists and is not empty (use --force to replace it)")
        if not any((out / name).is_file() for name in OURS):
            raise ReplayError(f"{out}: not written by router-replay (no {' or '.join(OURS)}); "
                              f"--force only replaces this tool's output")


def clear(out: Path) -> None:
    """Remove a previous output of ours (check_out has verified it is ours)."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        shutil.rmtree(out)
