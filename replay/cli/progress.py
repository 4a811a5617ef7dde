"""Long work's feedback, one helper for every command: a bar on a terminal, a line every
~10 s when stderr is piped (a log, CI), nothing with ``--quiet``.

:class:`Progress` counts steps (``update(n)``) or takes a position (``at(i, total)``);
:class:`PipedStatus` is the piped counterpart of a live one-line status (``show(text)``).
``ROUTER_REPLAY_PROGRESS_S`` sets the piped interval in seconds (default 10).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

import click

INTERVAL_ENV = "ROUTER_REPLAY_PROGRESS_S"


def interval_s() -> float:
    """The piped interval: ``ROUTER_REPLAY_PROGRESS_S`` when it is a number >= 0, else 10 s."""
    try:
        v = float(os.environ.get(INTERVAL_ENV, "10"))
    except ValueError:
        return 10.0
    return v if v >= 0 else 10.0


class Progress:
    """A bar (terminal) or a line every ~10 s (piped) over ``total`` steps of ``label``."""

    def __init__(self, label: str, total: int = 0, *, quiet: bool = False, stream: TextIO | None = None,
                 tty: bool | None = None):
        self.label = label
        self.total = int(total)
        self.done = 0
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every = interval_s()
        self.last = time.monotonic()
        self.bar: Any = None

    def start(self, total: int) -> None:
        """(Re)start over ``total`` steps (the sweep learns its count when the work begins)."""
        self.close()
        self.total, self.done, self.last = int(total), 0, time.monotonic()

    def update(self, n: int = 1) -> None:
        if self.quiet:
            return
        self.done += n
        if self.tty:
            if self.bar is None:
                self.bar = click.progressbar(length=max(self.total, 1), label=self.label, file=self.stream)
                self.bar.__enter__()
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
            of = f" of {self.total:,}" if self.total else ""
            click.echo(f"{self.label}: {self.done:,}{of}{share}", file=self.stream)

    def at(self, i: int, total: int) -> None:
        """Position ``i`` of ``total`` (readers that report where they are, not steps)."""
        if total != self.total:
            self.total = int(total)
            if self.bar is not None:
                self.close()
                self.done = 0
        self.update(i - self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PipedStatus:
    """A live status line's piped form: ``show(text)`` writes the text as a line at most every
    ~10 s; ``clear()`` does nothing (a log keeps its lines)."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stderr
        self.every = interval_s()
        self.last = time.monotonic()

    def show(self, text: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            click.echo(text, file=self.stream)

    def clear(self) -> None:
        return None
