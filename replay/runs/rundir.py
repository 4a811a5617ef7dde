"""What the commands write, and the one rule that keeps what a user gave safe.

Every command that writes calls :func:`guard` before any work::

    from replay.runs import rundir
    outs = rundir.guard([(out, "run")], inputs=[trace_dir], force=force)

The rule, for every output of a command:

* it may never be, contain, or lie inside any input of the same command
  (trace directory, trace files, log, fleet file, run directories, baseline),
  compared after resolving symlinks; an input directory counts with every
  file below it and every symlink target it holds;
* an existing output is replaced only with ``force``, and ``force`` replaces
  only what router-replay wrote there before: a directory it recognises by its
  own record and names (a run's ``run.json``, a simulation's ``sim.json``, ...;
  see :data:`KINDS`), or a file it recognises by its own marker.  Anything
  else - an arbitrary directory, a foreign file, a user's extra file inside a
  run directory - is refused, ``force`` or not;
* the output path itself must be writable: not under a regular file, not a
  dangling symlink, not the current directory (or one above it).

Directory outputs are built in a hidden sibling (:func:`partial_beside`, named
``.<name>.partial-<pid>-<random>``) and swapped into place when complete
(:func:`move_into_place`: one atomic exchange where the file system has it, so
there is no moment without a run; else two renames, recoverable).  The next
:func:`guard` on that output cleans what a killed run left there (its
partial folders; an ``.old-*`` copy left between two renames is put back when
the output itself is missing) and says so.  File outputs are written with
:func:`write_text_atomic` (a temporary beside the file, then a rename).  A
full disk becomes "no space left on device writing PATH" with the partial
output removed (:func:`writing`).

An ``--out`` that is a symlink to a directory is kept: the run is written to
the link's target.  The kinds of output named in :data:`KINDS` are this
module's; a command writing another kind declares its :class:`Kind` beside
its writer and passes it to :func:`guard` (``[(out, PLAN_KIND)]``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from replay.config import KNOB_NAMES
from replay.errors import NeedsForce, ReplayError
from replay.runs import decisions as decision_store
from replay.runs import metrics
from replay.runs.decisions import decision_files
from replay.runs.names import (
    CLOSED_LOOP,
    CLOSED_LOOP_CSV,
    CLOSED_LOOP_SEEDS,
    DECISIONS,
    DECISIONS_DIR,
    FLEET,
    LOADS,
    OUTCOMES,
    REPORT,
    REQUESTS,
    RUN_JSON,
    SIM_JSON,
    SIM_TOOL,
    SUMMARY,
    SUMMARY_CSV,
    TOOL,
    TRACE_JSON,
    WORKERS,
)

RUN_FILES = frozenset({RUN_JSON, SUMMARY, SUMMARY_CSV, DECISIONS, DECISIONS_DIR, FLEET, REPORT})
"""Every name ``sweep`` writes into a run directory (and ``report`` writes by default)."""


def run_inputs(run_dir: str | os.PathLike) -> list[Path]:
    """The files of a run directory a reader uses (for :func:`guard`'s ``inputs``
    when an output may sit inside the run, as ``report.html`` does)."""
    p = Path(run_dir)
    names = [RUN_JSON, SUMMARY, SUMMARY_CSV, FLEET, CLOSED_LOOP, DECISIONS, DECISIONS_DIR]
    return [p / n for n in names if (p / n).exists()] + list(decision_files(p) or [])


# ---------------------------------------------------------------------------
# reading a run back

SUMMARY_COLUMNS = ("config_id", "worker_queue_limit", "saturation_queue_floor", "requests", "hit_rate",
                   "selected_waiting_p99")
"""Summary columns every reader relies on."""
DECISION_COLUMNS = ("request_id", "config_id", "worker", "decision", "policy_reason", "reason", "failure")
"""decisions.parquet columns every reader relies on."""


@dataclass
class Run:
    """A finished run directory read back: ``run.json`` (``meta``), the summary, where
    its decisions are (one file, or one per shard; None without), ``fleet.parquet``
    scanned lazily (one row per request: never read whole), and a closed-loop
    simulator's ``closed_loop_summary.parquet`` when one was put beside it."""

    path: Path
    meta: dict
    summary: pl.DataFrame
    decisions: list[Path] | None
    fleet: pl.LazyFrame | pl.DataFrame | None = None
    closed_loop: pl.DataFrame | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def trace_hashes(self) -> dict[str, str]:
        """``{trace file name: sha256}`` from ``run.json`` (one-line error if absent)."""
        return trace_hashes(self.meta, self.path / RUN_JSON)

    @property
    def knobs(self) -> list[str]:
        """The knob columns of the summary, in ``KNOB_NAMES`` order."""

        return [k for k in KNOB_NAMES if k in self.summary.columns]

    def metrics(self, names: Iterable[str] | None = None) -> pl.DataFrame:
        """``config_id``, the knob columns (and ``dp_size``, per-rank values when present),
        then one Float64 column per metric of ``names`` (default: the compare set; see
        :mod:`replay.runs.metrics`), null where unknown."""

        return metrics.metric_table(self.summary, names if names is not None else metrics.COMPARE_METRICS)


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def unreadable(path: str | os.PathLike, err: BaseException) -> ReplayError:
    """The one-line error for a Parquet file a reader cannot read."""
    msg = " ".join(str(err).split())[:200]
    return ReplayError(f"{path}: unreadable Parquet ({type(err).__name__}: {msg})")


def read_parquet(path: Path) -> pl.DataFrame:
    """A small table of a run, read whole (one-line error if unreadable)."""
    try:
        return pl.read_parquet(path)
    except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
        raise unreadable(path, err) from None


def scan_parquet(path: Path) -> pl.LazyFrame:
    """A lazy scan of a (possibly request-sized) table; its footer is read now, so a file
    that is not Parquet fails here rather than halfway through a report."""
    try:
        lf = pl.scan_parquet(path)
        lf.collect_schema()
    except Exception as err:  # noqa: BLE001 - polars / arrow raise many kinds
        raise unreadable(path, err) from None
    return lf


def trace_hashes(meta: Mapping, where: object = RUN_JSON) -> dict[str, str]:
    """``{file name: sha256}`` of the trace files recorded in a run or baseline record."""
    files = (meta.get("trace") or {}).get("files") if isinstance(meta.get("trace"), dict) else None
    if not isinstance(files, dict) or not files:
        raise ReplayError(f"{where}: no trace file hashes recorded")
    out = {}
    for name, info in files.items():
        sha = info.get("sha256") if isinstance(info, dict) else info
        if not isinstance(sha, str):
            raise ReplayError(f"{where}: no sha256 for trace file {name!r}")
        out[name] = sha
    return out


def load_run(path: str | os.PathLike | Run) -> Run:
    """Open a run directory written by ``router-replay sweep`` (a :class:`Run` passes through).

    Checks that the directory holds a readable ``run.json`` with router-replay's
    marker and a ``summary.parquet`` with :data:`SUMMARY_COLUMNS` and at least one
    config; decisions, ``fleet.parquet`` and ``closed_loop_summary.parquet`` are
    optional, but when present they must be readable (decisions with
    :data:`DECISION_COLUMNS`).  Raises :class:`ReplayError` (one line) otherwise.
    """
    if isinstance(path, Run):
        return path
    p = Path(path)
    if not p.exists():
        raise ReplayError(f"{p}: no such run directory")
    if not p.is_dir():
        raise ReplayError(f"{p}: not a directory (expected a run directory written by router-replay sweep)")
    rj, sm = p / RUN_JSON, p / SUMMARY
    if not rj.is_file() or not sm.is_file():
        raise ReplayError(f"{p}: not a run directory (no {RUN_JSON} and {SUMMARY}; "
                          f"write one with router-replay sweep)")
    try:
        meta = json.loads(rj.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ReplayError(f"{rj}: unreadable run record ({first_line(err)})") from None
    if not isinstance(meta, dict) or meta.get("tool") != TOOL:
        raise ReplayError(f"{rj}: not a router-replay run record")
    summary = read_parquet(sm)
    for col in SUMMARY_COLUMNS:
        if col not in summary.columns:
            raise ReplayError(f"{sm}: column '{col}': missing (not a router-replay summary)")
    if summary.height == 0:
        raise ReplayError(f"{sm}: no configs")
    decisions = decision_files(p, meta)
    for dp in decisions or []:
        try:

            names = set(decision_store.columns_of(dp))
        except Exception as err:  # noqa: BLE001 - any reader error is unusable input
            raise unreadable(dp, err) from None
        absent = [c for c in DECISION_COLUMNS if c not in names]
        if absent:
            raise ReplayError(f"{dp}: column '{absent[0]}': missing (not router-replay decisions)")
    fleet = scan_parquet(p / FLEET) if (p / FLEET).is_file() else None
    closed = read_parquet(p / CLOSED_LOOP) if (p / CLOSED_LOOP).is_file() else None
    return Run(p, meta, summary, decisions, fleet, closed)


# ---------------------------------------------------------------------------
# output kinds: what router-replay recognises as its own


@dataclass(frozen=True)
class Kind:
    """One kind of output: ``what`` names it in messages, ``is_dir`` says whether
    it is a directory, ``recognise(path)`` returns None when the existing
    ``path`` is router-replay's own output of this kind (so ``--force`` may
    replace it), else the reason it is not."""

    name: str
    what: str
    is_dir: bool
    recognise: Callable[[Path], str | None]


def _read_json(path: Path) -> dict | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _foreign_entries(path: Path, allowed: Callable[[str], bool]) -> str | None:
    extra = sorted(n for n in os.listdir(path) if not allowed(n))
    if extra:
        return f"{path / extra[0]} was not written by router-replay"
    return None


def unmarked(path: Path, record: str) -> str:
    """Why ``path`` (a folder without router-replay's ``record`` in it) is not the tool's own:
    the reason names the file it would have destroyed, as the refusal promises."""
    if (path / record).exists():
        return f"{path / record} was not written by router-replay (no marker of router-replay's in it)"
    try:
        first = sorted(os.listdir(path))[0]
    except (OSError, IndexError):
        return f"no {record} of router-replay's in it"
    return f"no {record} of router-replay's in it; {path / first} was not written by router-replay"


def record_dir(record: str, marker: str, allowed: Callable[[str], bool]) -> Callable[[Path], str | None]:
    def recognise(path: Path) -> str | None:
        rec = _read_json(path / record)
        if rec is None or rec.get("tool") != marker or rec.get("kind") is not None:
            return unmarked(path, record)
        return _foreign_entries(path, allowed)
    return recognise


def _names_dir(required: str, names: frozenset[str], what: str) -> Callable[[Path], str | None]:
    def recognise(path: Path) -> str | None:
        if not (path / required).exists():
            return f"{unmarked(path, required)} ({what})"
        return _foreign_entries(path, names.__contains__)
    return recognise


GENERATE_SOURCE = "router-replay generate"
"""The ``source`` of the trace.json ``generate`` writes: its marker (a trace's tables alone are any
trace's, a user's hand-made one included)."""


def _trace_dir(path: Path) -> str | None:
    """A trace ``generate`` wrote: its trace.json (marked), tables and ``requests/``/``loads/``
    folders of Parquet files only."""
    names = {REQUESTS, LOADS, WORKERS, TRACE_JSON, "requests", "loads"}
    why = _foreign_entries(path, names.__contains__)
    if why:
        return why
    info = _read_json(path / TRACE_JSON)
    if info is None or not str(info.get("source", "")).startswith(GENERATE_SOURCE):
        return unmarked(path, TRACE_JSON)
    return foreign_below(path, ("requests", "loads"))


def foreign_below(path: Path, subs: Iterable[str], suffix: str = ".parquet") -> str | None:
    """The first file in folders ``subs`` of ``path`` that the tool does not write there
    (anything but ``suffix`` files), named; None when there is none."""
    for sub in subs:
        for root, _dirs, files in os.walk(path / sub):
            for f in sorted(files):
                if not f.endswith(suffix):
                    return f"{Path(root) / f} was not written by router-replay"
    return None


def marked_file(marker: str, refusal: str, *, at_start: bool = False) -> Callable[[Path], str | None]:
    """A ``recognise`` for a file router-replay marks with ``marker`` (ASCII) in its first
    bytes (``at_start``: as its very beginning, else anywhere in the first 4 KiB); ``refusal``
    is the reason given for any other file."""
    raw = marker.encode()

    def recognise(path: Path) -> str | None:
        try:
            with open(path, "rb") as fh:
                head = fh.read(4096)
        except OSError as err:
            return f"unreadable ({err.strerror})"
        return None if (head.startswith(raw) if at_start else raw in head) else refusal
    return recognise


def _baseline_file(path: Path) -> str | None:
    rec = _read_json(path)
    if rec is None or rec.get("tool") != TOOL or rec.get("kind") != "baseline":
        return "not a baseline written by router-replay"
    return None


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("run", "run directory", True, record_dir(RUN_JSON, TOOL, RUN_FILES.__contains__)),
    Kind("sim", "simulation directory", True, record_dir(
        SIM_JSON, SIM_TOOL,
        lambda n: n in {REQUESTS, LOADS, WORKERS, OUTCOMES, SIM_JSON,
                        CLOSED_LOOP, CLOSED_LOOP_CSV, TRACE_JSON, CLOSED_LOOP_SEEDS}
        or re.fullmatch(r"config-\d+", n) is not None)),
    Kind("compare", "comparison directory", True, _names_dir(
        "deltas.parquet", frozenset({"deltas.parquet", "transitions.parquet", "changed_requests.parquet"}),
        "not a comparison written by router-replay compare")),
    Kind("trace", "trace directory", True, _trace_dir),
    Kind("report", "report file", False, marked_file("<title>router-replay report", "not a report written by "
                                                     "router-replay")),
    Kind("baseline", "baseline file", False, _baseline_file),
    Kind("junit", "JUnit file", False, marked_file('<testsuites name="router-replay"',
                                                   "not a JUnit report written by router-replay")),
    Kind("markdown", "Markdown file", False, marked_file("### router-replay check",
                                                         "not a check report written by router-replay")),
)}
"""The output kinds of the sweep and the analysis commands, by name.  A command whose output
is of another kind (a recording, a capacity plan, a fitted fleet file...) declares its
:class:`Kind` beside its writer and passes it to :func:`guard` itself: no kind is added to a
table by importing a module, so a guard can never miss one."""


# ---------------------------------------------------------------------------
# the rule


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.fspath(p))))


def _inside(child: Path, parent: Path) -> bool:
    return child != parent and parent in child.parents


def _input_paths(inputs: Iterable[str | os.PathLike | None]) -> list[tuple[Path, str]]:
    """(real path, as given) of every input, with, for a directory, every symlink
    below it resolved (a trace file linked in from elsewhere is an input too)."""
    out = []
    for given in inputs:
        if given is None:
            continue
        real = _real(given)
        out.append((real, os.fspath(given)))
        if real.is_dir():
            for root, dirs, files in os.walk(real):
                for n in (*dirs, *files):
                    p = os.path.join(root, n)
                    if os.path.islink(p):
                        out.append((_real(p), p))
    return out


def _check_path(out: Path, given: str) -> None:
    """The output path itself can be written: no dangling link, nothing under a file,
    not the current directory."""
    raw = Path(os.path.abspath(given))
    if raw.is_symlink() and not raw.exists():
        raise ReplayError(f"{given}: a symlink to {os.readlink(raw)}, which does not exist; "
                          f"remove the link or create its target")
    for anc in [out, *out.parents]:
        if anc.exists():
            if not anc.is_dir() and anc != out:
                raise ReplayError(f"{given}: {anc} is a file, not a directory")
            break
    cwd = _real(os.getcwd())
    if out == cwd or _inside(cwd, out):
        raise ReplayError(f"{given}: is the current directory{'' if out == cwd else ' or above it'}; "
                          f"give a new directory name (e.g. {given.rstrip('/') or '.'}/run)")


def _check_kind(out: Path, given: str, kind: Kind, force: bool) -> None:
    if not out.exists():
        return
    if kind.is_dir:
        if not out.is_dir():
            raise ReplayError(f"{given}: exists and is not a directory")
        if not any(out.iterdir()):
            return
        if not force:
            raise NeedsForce(f"{given}: {kind.what} exists and is not empty (use ", " to replace it)")
    else:
        if out.is_dir():
            raise ReplayError(f"{given}: is a directory")
        if not force:
            raise NeedsForce(f"{given}: exists (use ", " to replace it)")
    why = kind.recognise(out)
    if why is not None:
        raise NeedsForce(f"{given}: ", f" replaces only a {kind.what} router-replay wrote, and this one "
                         f"is not ({why}); move it away or choose another output")


def guard(outputs: Iterable[str | os.PathLike | tuple[str | os.PathLike | None, str | Kind] | None],
          inputs: Iterable[str | os.PathLike | None] = (), *, force: bool = False, kind: str | Kind | None = None,
          say: Callable[[str], None] | None = None) -> list[Path]:
    """Check a command's outputs against the rule (module docstring) before any work.

    ``outputs``: paths of kind ``kind``, or ``(path, kind)`` pairs, a kind being a
    :class:`Kind` or the name of one in :data:`KINDS`; None entries
    (an option not given) are skipped.  ``inputs``: every path the command
    reads (files or directories; missing ones are skipped, the command
    reports those itself).  ``force``: the user's ``--force``.  Raises
    :class:`ReplayError` (one line) on a violation; otherwise cleans what a
    killed run left beside a directory output (telling ``say``, default a
    warning on the ``replay`` logger) and returns the outputs' real paths (symlinks resolved), in order.
    """
    ins = _input_paths(inputs)
    seen: dict[Path, str] = {}
    result = []
    for item in outputs:
        if item is None:
            continue
        path, kname = item if isinstance(item, tuple) else (item, kind)
        if path is None:
            continue
        if isinstance(kname, Kind):
            k = kname
        elif kname in KINDS:
            k = KINDS[kname]
        else:
            raise ValueError(f"unknown output kind {kname!r}; known: {', '.join(KINDS)} or a Kind")
        given = os.fspath(path)
        out = _real(given)
        _check_path(out, given)
        if out in seen:
            raise ReplayError(f"{given}: given for two outputs ({seen[out]} and {given})")
        seen[out] = given
        for real, name in ins:
            if out == real:
                raise ReplayError(f"{given}: is an input of this command ({name}); choose another output")
            if _inside(real, out):
                raise ReplayError(f"{given}: contains an input of this command ({name}); choose another output")
            if _inside(out, real):
                raise ReplayError(f"{given}: lies inside an input of this command ({name}); "
                                  f"choose an output outside it")
        recover(out, say=say)
        _check_kind(out, given, k, force)
        _check_writable(out, given)
        if k.is_dir:
            _SEEN[out] = (_identity(out), force)
        result.append(out)
    return result


def _check_writable(out: Path, given: str) -> None:
    anc = next(a for a in out.parents if a.exists())
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ReplayError(f"{given}: cannot write into {anc} (permission denied)")


# ---------------------------------------------------------------------------
# building a directory aside, swapping it in, and cleaning up after dead runs

_PARTIAL = re.compile(r"\.(?P<name>.+)\.(?P<what>partial|old)-"
                      r"(?:(?P<pid>\d+)@(?P<host>[0-9a-f]{6})-[^.]*|(?P<legacy>\d+)|[^.]*)")
_HOST = format(zlib.crc32(socket.gethostname().encode()) & 0xFFFFFF, "06x")
_SEEN: dict[Path, tuple[tuple[int, int] | None, bool]] = {}   # out -> (identity at guard time, force)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _parent_lock(parent: Path) -> Iterator[None]:
    """Exclusive lock on the output's parent folder while a swap or a clean-up runs
    there, so two runs into one output never interleave their renames."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:     # a file system without flock on folders: the exchange is still atomic
            pass
        yield
    finally:
        os.close(fd)


def _debris(out: Path) -> list[tuple[Path, str, int | None]]:
    """(path, "partial"|"old", pid or None) of every sibling a run on ``out`` leaves while it
    works; the pid is None where it cannot be checked (another host, an older version)."""
    found: list[tuple[Path, str, int | None]] = []
    try:
        entries = os.listdir(out.parent)
    except OSError:
        return found
    for n in entries:
        m = _PARTIAL.fullmatch(n)
        if m and m["name"] == out.name:
            pid = (int(m["pid"]) if m["pid"] and m["host"] == _HOST
                   else int(m["legacy"]) if m["legacy"] else None)
            found.append((out.parent / n, m["what"], pid))
    return found


def _dead(path: Path, pid: int | None, now: float) -> bool:
    if pid is not None:
        return pid != os.getpid() and not _pid_alive(pid)
    # another host's, or written by a version without pids in the name: dead when nothing in it
    # changed for an hour (a live run appends to its decisions files)
    try:
        newest = path.stat().st_mtime
        for root, _dirs, files in os.walk(path):
            for f in files:
                newest = max(newest, os.stat(os.path.join(root, f)).st_mtime)
    except OSError:
        return False
    return now - newest > 3600


_log = logging.getLogger(__name__)


def _note(text: str) -> None:
    """What this module tells the user: a warning on the ``replay`` logger (the CLI prints
    it as ``note: ...`` on stderr; a library caller sees it as its logging is set up)."""
    _log.warning(text)


def recover(out: str | os.PathLike, *, say: Callable[[str], None] | None = None) -> list[str]:
    """Clean what killed runs left beside directory output ``out`` and say what was done.

    A dead run's ``.partial-*`` folder is removed.  An ``.old-*`` folder is a
    previous run moved aside for a swap that was killed half-way: when ``out``
    is missing it is put back (the newest, if several), else removed.  Folders
    of live runs are left alone.  Returns the lines said.
    """
    out = _real(out)
    say = say or _note
    lines: list[str] = []
    if not out.parent.is_dir():
        return lines
    found = [d for d in _debris(out) if _dead(d[0], d[2], time.time())]
    if not found:
        return lines
    with _parent_lock(out.parent):
        found = [d for d in _debris(out) if _dead(d[0], d[2], time.time())]
        olds = sorted((d for d in found if d[1] == "old"), key=lambda d: d[0].stat().st_mtime, reverse=True)
        if olds and not out.exists():
            olds[0][0].rename(out)
            lines.append(f"{out}: put back the previous output from {olds[0][0].name}, "
                         f"left by a run killed while swapping in its result")
            olds = olds[1:]
        gone = [d[0] for d in found if d[1] == "partial"] + [d[0] for d in olds]
        for p in gone:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:                       # a file output's temporary (:func:`file_aside`)
                p.unlink(missing_ok=True)
        if gone:
            lines.append(f"{out}: removed {len(gone)} unfinished folder(s) left by killed runs "
                         f"({', '.join(p.name for p in gone[:3])}{' ...' if len(gone) > 3 else ''})")
    for line in lines:
        say(line)
    return lines


_STOPS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
_LIVE: dict[Path, int] = {}
"""This process's unfinished outputs (partial folders, file temporaries) -> the pid that made them:
removed at exit whatever ended the command (:func:`_discard_live`)."""
KEPT: list[Path] = []
"""Work folders this process keeps on a failure or a signal so that a rerun can go on from them
(a grid's ``.<name>.resume``): the command's last line names them, not "nothing was kept"."""
PLACED: list[Path] = []
"""This process's outputs swapped into place, in order: a stop signal after the first no longer
means "nothing of this run was kept", so the command finishes (replay/cli/app.py)."""


@contextlib.contextmanager
def uninterrupted(reraise: bool = True) -> Iterator[None]:
    """Hold off Ctrl-C, SIGTERM and SIGHUP while the block runs (creating, swapping or removing
    an unfinished output: a signal in the middle would leave it half done); a signal that
    arrived meanwhile is delivered when the block ends (dropped with ``reraise=False``).
    Outside the main thread (where handlers cannot change) the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    try:
        before = {sig: signal.signal(sig, lambda signum, _frame: got.append(signum)) for sig in _STOPS}
    except ValueError:          # not the main interpreter: signals cannot be held off here
        yield
        return
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if got and reraise:
            signal.raise_signal(got[0])


def _discard_live() -> None:
    with uninterrupted(reraise=False):
        for path, pid in list(_LIVE.items()):
            if pid == os.getpid():
                _remove(path)
            _LIVE.pop(path, None)


atexit.register(_discard_live)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def partial_beside(out: str | os.PathLike) -> Path:
    """A new hidden sibling folder of ``out`` to build in, named with this process's
    pid (so a later run can tell a dead run's folder from a live one), with
    ordinary permissions (``mkdtemp`` alone leaves it readable by its owner only).
    Until :func:`move_into_place` or :func:`discard` it is this process's to remove
    at exit, so a signal landing before the caller holds it loses nothing."""
    out = _real(out)
    with uninterrupted():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-{_tag()}-", dir=out.parent))
        except OSError as err:
            raise write_error(err, out) from None
        _LIVE[tmp] = os.getpid()
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


def _tag() -> str:
    return f"{os.getpid()}@{_HOST}"


def _identity(out: Path) -> tuple[int, int] | None:
    try:
        st = out.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def move_into_place(tmp: Path, out: str | os.PathLike) -> None:
    """Replace ``out`` by the finished ``tmp``; there is always a complete ``out``.

    With an existing ``out`` the two are exchanged in one step and the old one,
    now at ``tmp``, is removed; where the file system cannot exchange, ``out``
    is renamed aside to ``.<name>.old-<pid>-*`` first (a kill between the two
    renames is undone by the next :func:`recover`).
    """
    out = _real(out)
    with uninterrupted(), _parent_lock(out.parent):
        _check_unchanged(out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            if _exchange(tmp, out):
                _placed(out)
                shutil.rmtree(tmp, ignore_errors=True)
                _LIVE.pop(tmp, None)
                return
            old = out.parent / f".{out.name}.old-{_tag()}-{os.urandom(3).hex()}"
            out.rename(old)
            try:
                tmp.rename(out)
            except BaseException:       # an error or a signal between the renames: the old run goes back
                if not out.exists():
                    old.rename(out)
                raise
            _placed(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out.is_dir():
                out.rmdir()
            tmp.rename(out)
            _placed(out)
        _LIVE.pop(tmp, None)


def _placed(out: Path) -> None:
    """Note a command's output as in place (:data:`PLACED`), unless it is a part of a larger
    output still being built (a grid's config folder in its partial or ``.resume`` folder)."""
    if not any(p in _LIVE or (p.name.startswith(".") and p.name.endswith(".resume")) for p in out.parents):
        PLACED.append(out)


def _check_unchanged(out: Path) -> None:
    """Two runs into one output: the one that swaps in last wins, and says so; without
    ``--force`` it may not replace what another run wrote while it ran."""
    if out not in _SEEN:
        return
    before, force = _SEEN.pop(out)
    now = _identity(out)
    if now == before or (now is not None and out.is_dir() and not any(out.iterdir())):
        return
    if not force:
        raise NeedsForce(f"{out}: another run wrote it while this one ran, and it is not replaced "
                         "without ", " (the other run won)")
    _note(f"{out}: another run wrote it while this one ran; this run finished later and replaces it")


@contextlib.contextmanager
def building(out: str | os.PathLike) -> Iterator[Path]:
    """Build a directory output aside: yields the hidden folder to write into
    (:func:`partial_beside`); when the block completes it is swapped into place
    (:func:`move_into_place`), on any failure it is removed."""
    tmp: Path | None = partial_beside(out)
    try:
        assert tmp is not None
        yield tmp
        move_into_place(tmp, out)
        tmp = None
    finally:
        discard(tmp)


@contextlib.contextmanager
def file_aside(out: str | os.PathLike) -> Iterator[Path]:
    """Write a file output aside and swap it in only at the end: yields a new temporary
    path beside ``out`` (``.<name>.partial-<pid>@<host>-<random>``, so the next
    :func:`guard` removes it if this process is killed); when the block completes the
    temporary replaces ``out`` in one rename, on any failure or signal it is removed and
    ``out`` is left exactly as it was."""
    out = _real(out)
    tmp = out.parent / f".{out.name}.partial-{_tag()}-{os.urandom(3).hex()}"
    _LIVE[tmp] = os.getpid()
    try:
        with writing(out):
            out.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        with writing(out), uninterrupted():
            os.replace(tmp, out)
            _placed(out)
            _LIVE.pop(tmp, None)
    finally:
        with uninterrupted():
            tmp.unlink(missing_ok=True)
            _LIVE.pop(tmp, None)


def discard(tmp: Path | None) -> None:
    """Remove an unfinished output folder (a failed or interrupted run); a signal arriving
    meanwhile waits until it is gone."""
    if tmp is not None:
        with uninterrupted():
            shutil.rmtree(tmp, ignore_errors=True)
            _LIVE.pop(tmp, None)


# ---------------------------------------------------------------------------
# errors while writing

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


_WRITE_FAILED = ("Invalid thrift: transport error",)
"""What polars' Parquet writer says when a write below it failed: it drops the os error (a full
disk among them), so the file system is asked instead (:func:`_disk_full`)."""


def _disk_full(where: str | os.PathLike | None) -> bool:
    """Whether the file system holding ``where`` (or its nearest existing parent) is out of
    space or inodes for this user: under 1 MiB left (a failed write fills it to the last block)."""
    if where is None:
        return True     # nothing to ask: a write that failed below the writer is taken for the disk
    p = _real(where)
    anc = next((a for a in (p, *p.parents) if a.exists()), None)
    if anc is None:
        return False
    try:
        st = os.statvfs(anc)
    except OSError:
        return False
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    blocks, files = (st.f_bfree, st.f_ffree) if root else (st.f_bavail, st.f_favail)
    return blocks * st.f_frsize < (1 << 20) or (st.f_files > 0 and files == 0)


def _errno_of(err: BaseException, where: str | os.PathLike | None = None) -> int | None:
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    text = str(err)
    if "No space left on device" in text or "os error 28" in text:
        return errno.ENOSPC
    if any(m in text for m in _WRITE_FAILED):
        return errno.ENOSPC if _disk_full(where) else errno.EIO
    if "Read-only file system" in text or "os error 30" in text:
        return errno.EROFS
    if "Permission denied" in text or "os error 13" in text:
        return errno.EACCES
    return None


class NoSpace(ReplayError):
    """The disk (or quota) filled up while writing an output."""


def no_space(err: BaseException, where: str | os.PathLike | None = None) -> bool:
    """Whether ``err`` is a full disk (or quota), whatever library raised it; ``where``, the
    output being written, lets a writer's error that hides the os error be checked against
    its file system."""
    return isinstance(err, NoSpace) or (not isinstance(err, ReplayError) and _errno_of(err, where) in _NO_SPACE)


def write_error(err: BaseException, path: str | os.PathLike) -> BaseException:
    """A :class:`ReplayError` for a file-system failure while writing ``path``
    (full disk, read-only file system, permission, a failed write); ``err`` itself otherwise."""
    code = _errno_of(err, path)
    if code in _NO_SPACE:
        return NoSpace(f"no space left on device writing {path}")
    if code == errno.EROFS:
        return ReplayError(f"{path}: cannot write (read-only file system)")
    if code in (errno.EACCES, errno.EPERM):
        return ReplayError(f"{path}: cannot write (permission denied)")
    if code == errno.EIO and not isinstance(err, OSError):
        return ReplayError(f"{path}: cannot write ({first_line(err)})")
    return err


@contextlib.contextmanager
def writing(out: str | os.PathLike) -> Iterator[None]:
    """Turn file-system failures inside the block into :func:`write_error` lines naming ``out``."""
    try:
        yield
    except NoSpace:
        raise NoSpace(f"no space left on device writing {out}") from None
    except ReplayError:
        raise
    except Exception as err:  # polars, pyarrow and the os raise different types for one errno
        mapped = write_error(err, out)
        if mapped is err:
            raise
        raise mapped from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file beside it and a rename; a
    failure (a full disk) removes the temporary and leaves ``path`` as it was."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# for the modules that declare their own output kinds (replay/capture/outguard.py)
read_json = _read_json
foreign_entries = _foreign_entries
