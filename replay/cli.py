"""The ``router-replay`` command line: thin click commands over the library.

Every command turns a :class:`replay.errors.ReplayError` into one line on
stderr and exit code 2; nothing a user gave us is modified.
"""

from __future__ import annotations

import functools
import sys

import click

from . import __version__
from .errors import ReplayError


class InputError(click.ClickException):
    """One-line error for bad input; exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # one line, no "Usage:" block
        click.echo(f"error: {self.format_message()}", err=True, file=file or sys.stderr)


def user_errors(fn):
    """Decorator: library ReplayErrors become one-line InputErrors (exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ReplayError as err:
            raise InputError(str(err)) from None

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="router-replay")
def main() -> None:
    """Replay request and load traces through SGLang's cache-aware routing logic."""


def _register() -> None:
    # Each command lives in its own module under replay/commands/ and is added here.
    import importlib
    import pkgutil

    from . import commands

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        for cmd in getattr(module, "COMMANDS", ()):
            main.add_command(cmd)


_register()
