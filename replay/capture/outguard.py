"""Output kinds the capture commands write, passed to :func:`replay.runs.rundir.guard`.

``record``, ``import`` and the simulator's capture writer protect their
``--out`` with :func:`replay.runs.rundir.guard` (an output is never, contains or
lies inside an input; ``--force`` replaces only what router-replay wrote).
These are the capture outputs it recognises as its own:

* a recording (``record``): ``record.json`` whose ``tool`` names router-replay,
  beside ``loads/``, ``kv_events/``, ``gaps/`` and ``workers.parquet``;
* an imported trace (``import``): ``trace.json`` whose ``source`` names
  ``router-replay import``, beside the trace tables and ``loads/`` (Parquet files only);
* a simulator run in capture formats: ``trace.json`` (its ``source`` names the
  simulator's capture writer) beside ``recorded/``,
  ``token_export/`` and ``engines/``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from replay.runs import names, rundir

RECORDING_NAMES = frozenset({names.RECORD_JSON, names.LOADS_DIR, names.KV_EVENTS_DIR, names.GAPS_DIR,
                             names.WORKERS})
IMPORTED_NAMES = frozenset({names.TRACE_JSON, names.REQUESTS, names.LOADS, names.WORKERS,
                            names.REQUESTS_DIR, names.LOADS_DIR})


def _recording(path: Path) -> str | None:
    rec = rundir.read_json(path / names.RECORD_JSON)
    if rec is None or not str(rec.get("tool", "")).startswith(rundir.TOOL):
        return f"no {names.RECORD_JSON} with router-replay's marker in it"
    return rundir.foreign_entries(path, RECORDING_NAMES.__contains__)


IMPORT_SOURCE = "router-replay import "
"""How the ``source`` of a trace.json ``import`` wrote begins: its marker (a trace.json alone is
any trace's, a user's hand-made one included)."""
CAPTURE_SOURCE = "router-replay simulate -> capture formats"
"""The ``source`` of the trace.json the simulator's capture writer puts beside its formats."""


def _with_trace_json(allowed: frozenset[str], source: str, parquet_dirs: tuple[str, ...] = ()):
    def recognise(path: Path) -> str | None:
        info = rundir.read_json(path / names.TRACE_JSON)
        if info is None or not str(info.get("source", "")).startswith(source):
            return rundir.unmarked(path, names.TRACE_JSON)
        return (rundir.foreign_entries(path, allowed.__contains__)
                or rundir.foreign_below(path, parquet_dirs))
    return recognise


RECORDING = rundir.Kind("recording", "recording directory", True, _recording)
IMPORTED = rundir.Kind("imported", "imported trace directory", True,
                       _with_trace_json(IMPORTED_NAMES, IMPORT_SOURCE, (names.REQUESTS_DIR, names.LOADS_DIR)))
CAPTURE = rundir.Kind("capture", "capture directory", True, _with_trace_json(
    frozenset({names.TRACE_JSON, names.RECORDED, names.TOKEN_EXPORT, names.ENGINES}), CAPTURE_SOURCE))


def clear(out: Path) -> None:
    """Empty a previous recording before ``record`` writes into ``out`` in place
    (a live recording cannot be built aside: what it wrote before a kill must
    stay readable where it is).  Call only after :func:`rundir.guard` accepted
    ``out`` as a recording router-replay wrote, or as new."""
    if out.is_dir():
        for entry in out.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
