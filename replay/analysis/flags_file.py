"""``recommend --emit-flags FILE``: the recommended router flags, per dp_size, as a file a
deployment can include.

The file is a POSIX shell fragment (``. FILE`` in a start script, or ``source``):
one variable per dp_size, ``ROUTER_FLAGS_DP<N>``, and ``ROUTER_FLAGS`` when the
whole fleet shares one answer, each a single-quoted string of router flags::

    # router-replay recommend: router flags per dp_size
    # source: reports/sample (open loop, selected_waiting_p99 <= 8)
    ROUTER_FLAGS_DP2='--worker-queue-limit 4 --saturation-queue-floor 2'
    ROUTER_FLAGS='--worker-queue-limit 4 --saturation-queue-floor 2'

A dp_size with no config meeting the bound gets no variable (a comment says
so), so a deployment that includes the file fails loudly instead of starting
an unbounded router.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from replay.runs import rundir

MARKER = "# router-replay recommend: router flags per dp_size"


FLAGS_KIND = rundir.Kind("flags", "flags file", False, rundir.marked_file(
    MARKER, "not a flags file written by router-replay recommend", at_start=True))
"""The output kind of a flags file, for :func:`replay.runs.rundir.guard`."""


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def render(per_dp: Mapping[int | None, str | None], source: str) -> str:
    """The file's text: ``per_dp`` maps a dp_size (None: the run's single fleet) to the
    flags, or to None when no config met the bound there."""
    lines = [MARKER, f"# source: {source}"]
    answers = {d: f for d, f in per_dp.items()}
    for d, f in sorted(answers.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        name = "ROUTER_FLAGS" if d is None else f"ROUTER_FLAGS_DP{d}"
        if f is None:
            lines.append(f"# {name}: no config meets the bound (nothing to deploy)")
        else:
            lines.append(f"{name}={_quote(f)}")
    given = {f for f in answers.values() if f is not None}
    if None not in answers and len(given) == 1 and all(f is not None for f in answers.values()):
        lines.append(f"ROUTER_FLAGS={_quote(given.pop())}")
    return "\n".join(lines) + "\n"


def guard(path: str | os.PathLike | None, *, inputs: list, force: bool = False) -> None:
    """Refuse ``path`` before any work (exists without ``force``, not a flags file, or an input)."""
    rundir.guard([(path, FLAGS_KIND)], inputs=inputs, force=force)


def write(path: str | os.PathLike, per_dp: Mapping[int | None, str | None], source: str, *,
          inputs: list, force: bool = False) -> None:
    """Write :func:`render` to ``path`` (refused if it exists and is not one, or without ``force``)."""
    rundir.guard([(path, FLAGS_KIND)], inputs=inputs, force=force)
    rundir.write_text_atomic(Path(path), render(per_dp, source))
