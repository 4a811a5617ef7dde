"""Atomic output directories (replay/runs/rundir.py), shared by sweep, simulate and compare."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from replay import run_sweep
from replay.errors import ReplayError
from replay.runs.rundir import Kind, guard, move_into_place, partial_beside

SAMPLE = Path(__file__).resolve().parents[1] / "traces" / "sample"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_refuses_non_empty_and_files_but_not_empty_dirs(tmp_path):
    """A kind declared by its writer and passed to the guard: nothing registered anywhere."""
    mine = Kind("mine", "test directory", True,
                lambda p: None if (p / "mine.json").is_file() else "no mine.json")
    (tmp_path / "empty").mkdir()
    guard([(tmp_path / "empty", mine)], force=False)
    guard([(tmp_path / "missing", mine)], force=False)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    with pytest.raises(ReplayError, match="test directory exists and is not empty.*force=True"):
        guard([(full, mine)], force=False)
    with pytest.raises(ReplayError, match="replaces only a test directory router-replay wrote.*no mine.json"):
        guard([(full, mine)], force=True)
    (full / "mine.json").write_text("{}")
    guard([(full, mine)], force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ReplayError, match="not a directory"):
        guard([(tmp_path / "file", mine)], force=True)
    with pytest.raises(ValueError, match="unknown output kind 'mine'"):
        guard([(full, "mine")], force=True)
    assert (full / "x").read_text() == "keep me"


def test_move_into_place_replaces_only_after_the_new_one_is_complete(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "old").write_text("old")
    tmp = partial_beside(out)
    assert tmp.parent == tmp_path and tmp.name.startswith(".run.partial-")
    (tmp / "new").write_text("new")
    move_into_place(tmp, out)
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no hidden leftovers


def test_a_sweep_run_directory_has_ordinary_permissions(tmp_path):
    out = tmp_path / "run"
    run_sweep(SAMPLE, {"worker_queue_limit": "4"}, out=out, decisions=False, report=False)
    mode = stat.S_IMODE(out.stat().st_mode)
    assert mode == 0o777 & ~_umask(), oct(mode)
