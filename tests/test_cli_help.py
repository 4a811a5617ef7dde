"""Every command registered on the ``router-replay`` group has ``--help`` with an
``Example:`` block whose lines run that command with options it really has.

The commands are read from the group itself, so one added later is held to the
same rule without touching this file."""

from __future__ import annotations

import shlex

import click
import pytest
from click.testing import CliRunner

from replay.cli import main

COMMANDS = sorted(main.commands)


def example_lines(text: str) -> list[str]:
    """The command lines under ``Example:`` in rendered help, continuations joined."""
    lines = text.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.strip() == "Example:"), None)
    if at is None:
        return []
    out: list[str] = []
    pending = ""
    for ln in lines[at + 1:]:
        s = ln.strip()
        if not s:
            break
        pending += s[:-1].rstrip() + " " if s.endswith("\\") else s
        if not s.endswith("\\"):
            out.append(pending)
            pending = ""
    return out


def option_names(cmd: click.Command) -> set[str]:
    return {opt for p in cmd.params if isinstance(p, click.Option) for opt in (*p.opts, *p.secondary_opts)}


def test_the_group_has_the_documented_commands():
    # the README's command table; a command missing here means _register lost it
    for name in ("validate", "sweep", "report", "compare", "check", "recommend", "simulate", "record",
                 "import", "generate"):
        assert name in main.commands, name


def example_problems(name: str, help_text: str, known: set[str]) -> list[str]:
    """What is wrong with the ``Example:`` block of ``name``'s help (nothing: [])."""
    examples = example_lines(help_text)
    if not examples:
        return [f"router-replay {name} --help has no 'Example:' block"]
    problems = []
    for line in examples:
        words = shlex.split(line)
        if words[:2] != ["router-replay", name]:
            problems.append(f"example does not run {name}: {line!r}")
        flags = {w.split("=", 1)[0] for w in words[2:] if w.startswith("--")}
        if flags - known:
            problems.append(f"{name} example uses unknown options {sorted(flags - known)}: {line!r}")
    return problems


@pytest.mark.parametrize("name", COMMANDS)
def test_help_has_an_example_of_the_command(name):
    res = CliRunner().invoke(main, [name, "--help"], prog_name="router-replay")
    assert res.exit_code == 0, res.output
    assert example_problems(name, res.output, option_names(main.commands[name])) == [], res.output


def test_a_missing_stale_or_foreign_example_is_caught():
    assert example_lines("Usage: x\n\n  Check a trace.\n\nOptions:\n  --json\n") == []
    text = "Usage: x\n\n  Example:\n    router-replay sweep a \\\n        --out b --bogus=1\n\nOptions:\n"
    assert example_lines(text) == ["router-replay sweep a --out b --bogus=1"]
    assert example_problems("sweep", text, {"--out"}) == [
        "sweep example uses unknown options ['--bogus']: 'router-replay sweep a --out b --bogus=1'"]
    assert example_problems("report", text, {"--out", "--bogus"}) == [
        "example does not run report: 'router-replay sweep a --out b --bogus=1'"]
    assert example_problems("validate", "Usage: x\n", set()) == [
        "router-replay validate --help has no 'Example:' block"]
