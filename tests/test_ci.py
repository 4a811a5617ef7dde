"""The house's habits hold: CI runs what the README tells a user to run, the
lint gates come before the tests, and the version is written in one place."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import replay

ROOT = Path(__file__).resolve().parent.parent


def readme_test_block(text: str) -> list[str]:
    """The lines of the first ``sh`` block after the README's 'Run the tests' paragraph."""
    at = text.index("Run the tests")
    m = re.search(r"```sh\n(.*?)```", text[at:], re.S)
    assert m, "no sh block after 'Run the tests'"
    return [ln.strip() for ln in m.group(1).splitlines() if ln.strip()]


def ci_commands(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command_after_the_linters():
    readme = readme_test_block((ROOT / "README.md").read_text())
    assert any("pytest" in ln for ln in readme) and ".ci/browser" in readme
    ci = ci_commands((ROOT / ".ci" / "run").read_text())
    pos = [ci.index(ln) for ln in readme]           # ValueError: a README line CI does not run
    assert pos == sorted(pos), "CI runs the README's lines in another order"
    pytest_at = next(i for i, ln in enumerate(ci) if "pytest" in ln)
    assert ci.index("ruff check .") < pytest_at and ci.index("mypy") < pytest_at
    assert pytest_at == len(ci) - 1, "the tests' exit code must be the script's"


def test_readme_block_reader_is_not_fooled():
    text = "Run the tests:\n\n```sh\nmake one\nmake two\n```\n\n```sh\nother\n```\n"
    assert readme_test_block(text) == ["make one", "make two"]
    ci = ci_commands("#!/bin/sh\n# make one\nmake two\nmake one\n")
    assert ci == ["make two", "make one"]


def test_the_version_is_written_once():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "replay.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", replay.__version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {replay.__version__}" in changelog, "CHANGELOG.md has no section for this version"
