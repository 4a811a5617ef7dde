"""The ``router-replay`` command line: thin click commands over the library.

Every command turns a :class:`replay.errors.ReplayError` into one line on
stderr and exit code 2; nothing a user gave us is modified.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import signal
import sys
import threading

import click

from replay import __version__
from replay.errors import ReplayError


class InputError(click.ClickException):
    """One-line error for bad input; exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # one line, no "Usage:" block
        click.echo(f"error: {self.format_message()}", err=True, file=file or sys.stderr)


class _Notes(logging.Handler):
    """The library's warnings (logger ``replay``) as ``note: ...`` lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"note: {record.getMessage()}", err=True)


@contextlib.contextmanager
def _library_notes():
    """While a command runs, the library's warnings are printed as notes (once: not
    passed on to a root handler as well)."""
    log = logging.getLogger("replay")
    handler, propagate = _Notes(), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def user_errors(fn):
    """Decorator: library ReplayErrors become one-line InputErrors (exit 2)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with _library_notes():
                return fn(*args, **kwargs)
        except ReplayError as err:          # the library names a parameter, the CLI its flag
            raise InputError(err.cli_text() + _kept_note()) from None
        except OSError as err:              # a full disk, a read-only file system, a permission
            from replay.runs.rundir import write_error  # lazy: rundir pulls in polars and pyarrow

            written = next((kwargs[k] for k in ("validate_dir", "out") if kwargs.get(k)), None)
            mapped = write_error(err, err.filename or written or "the output")
            if mapped is err:
                raise
            raise InputError(str(mapped) + _kept_note()) from None

    return wrapper


def _kept() -> str | None:
    """The work folder this run kept for ``--resume`` (``rundir.KEPT``), if any."""
    rd = sys.modules.get("replay.runs.rundir")
    kept = getattr(rd, "KEPT", None)
    return str(kept[-1]) if kept else None


def _kept_note() -> str:
    kept = _kept()
    return f"; what finished is kept in {kept}: run again with --resume to go on from it" if kept else ""


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so every ``finally`` cleans up on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_ONE_SIGNAL = False
"""In a real process (not click's CliRunner): the first stop signal ends the command and the
ones after it are ignored, so none lands in the clean-up (a generator's ``finally``, the removal
of a partial folder) and prints a traceback."""


def _raise_interrupted(signum, _frame):
    jit = sys.modules.get("replay.kernels._jit")
    if jit is not None and jit.holding_signals_now():   # raised again when the kernel returns
        jit.HELD_SIGNALS.append(signum)
        return
    if _ONE_SIGNAL:
        _ignore_stops()
        rd = sys.modules.get("replay.runs.rundir")
        placed = getattr(rd, "PLACED", None)
        if placed:      # an output is already in place: stopping now would keep it and say nothing was kept
            click.echo(f"note: {signal.Signals(signum).name} after {placed[-1]} was written: the command "
                       "finishes", err=True)
            return
    raise Interrupted(signum)


def _handle_signals(real_process: bool = False) -> None:
    """SIGTERM and SIGHUP end a command the way SIGINT does (clean up, exit 128 + signal); in a
    real process SIGINT goes through the same handler, and only the first signal counts."""

    global _ONE_SIGNAL
    if threading.current_thread() is not threading.main_thread():
        return
    _ONE_SIGNAL = _ONE_SIGNAL or real_process
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _raise_interrupted)
    if real_process and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _raise_interrupted)


def _ignore_stops() -> None:
    """On the way out after a signal: further Ctrl-C, SIGTERM or SIGHUP are ignored, so a
    repeated signal cannot break the one-line exit or the removal of unfinished outputs
    (``atexit``, :mod:`replay.runs.rundir`)."""

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)


def _interrupted_exit(err: BaseException) -> int:
    """128 + the signal that stopped the command (SIGINT 130, SIGTERM 143, SIGHUP 129):
    distinct from ``check``'s regression code 1 and the bad-input code 2."""

    found = [e for e in (err, err.__cause__, err.__context__) if isinstance(e, Interrupted)]
    signum = found[0].signum if found else int(signal.SIGINT)
    tail = ("nothing complete was written" + _kept_note()) if _kept() else "nothing of this run was kept"
    click.echo(f"interrupted ({signal.Signals(signum).name}): {tail}", err=True)
    return 128 + signum


_DONE = False


def outputs_closed() -> None:
    """Called by a command once everything it wrote is closed and on disk (its run directory
    swapped into place, its report renamed): the process may then end without the
    interpreter's teardown.  See :func:`_exit_now`."""
    global _DONE
    _DONE = True


def _exit_now(code: int):
    """End the process without tearing the interpreter down.

    After a sweep, Python's finalization (freeing numba's compiled code and every module's
    objects) cost about 0.5 CPU s, a sixth of the cached start.  Only a command that
    said :func:`outputs_closed` and returned normally, in a real process (``main()`` reading
    ``sys.argv``, not click's CliRunner or a caller passing ``args``), with no other thread
    running, ends this way: stdout and stderr are flushed and every ``atexit`` handler runs
    (logging, weakref finalizers, Ray's shutdown) exactly as at a normal exit; only the
    teardown after them is skipped."""

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    atexit._run_exitfuncs()
    os._exit(code)


class _OneLineErrors(click.Group):
    """A group whose usage errors (bad option values, unknown flags) print one line, exit 2."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        _handle_signals(real_process=args is None)
        rd = sys.modules.get("replay.runs.rundir")
        if rd is not None:          # a command before this one in the process (click's CliRunner)
            rd.KEPT.clear()
            rd.PLACED.clear()
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if args is None:        # done: a signal now would only kill the interpreter's teardown
                _ignore_stops()     # (whose own handlers are the default ones: exit -15, not 0)
        except click.UsageError as err:
            if args is None:
                _ignore_stops()
            hint = f" (see '{err.ctx.command_path} --help')" if err.ctx is not None else ""
            click.echo(f"error: {err.format_message()}{hint}", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            if args is None:
                _ignore_stops()
            err.show()
            sys.exit(err.exit_code)
        except click.exceptions.Abort as err:
            if isinstance(err.__cause__ or err.__context__, KeyboardInterrupt):
                if args is None:
                    _ignore_stops()
                sys.exit(_interrupted_exit(err))
            click.echo("aborted", err=True)
            sys.exit(1)
        except KeyboardInterrupt as err:     # raised outside click's own handler
            if args is None:
                _ignore_stops()
            sys.exit(_interrupted_exit(err))
        code = rv if isinstance(rv, int) else 0
        if args is None and _DONE:

            if "replay.sweep.engine" in sys.modules:
                sys.modules["replay.sweep.engine"].close_block_pool()

            if threading.active_count() == 1:
                _exit_now(code)
        sys.exit(code)


@click.group(cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="router-replay")
def main() -> None:
    """Replay request and load traces through SGLang's cache-aware routing logic."""
