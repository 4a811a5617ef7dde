"""Every module the package, the tests or the benches import is declared in pyproject.toml.

A fresh machine has only what pyproject.toml declares (``.ci/run`` builds a new environment
from the lock on every run), so an import that works here only because a package happened
to be installed is a failure waiting for the next machine. The checks:

- each import under ``replay/`` comes from the standard library, the package itself, a
  runtime dependency, or an extra (``ray``, ``record``);
- each import under ``tests/`` and ``benches/`` from those or the ``test`` extra;
- what only an extra brings is never needed by the default path: the README's first command
  (``pip install -e .`` then a sweep of the bundled sample) runs with those modules refused;
- the lock pins every declared distribution.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert m, f"pyproject.toml: cannot read the requirement {req!r}"
    return canonical(m.group(1))


def declared(*extras: str) -> set[str]:
    """The distributions the runtime dependencies and ``extras`` bring, self-references
    (``router-replay[ray,record]``) followed."""
    out = {requirement_name(r) for r in PROJECT["dependencies"]}
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in EXTRAS[extra]:
            name = requirement_name(req)
            if name == canonical(PROJECT["name"]):
                todo.extend(x.strip() for x in req[req.index("[") + 1:req.index("]")].split(","))
            else:
                out.add(name)
    return out


def imported_modules(source: str) -> set[str]:
    """The top-level names of every absolute import in ``source``, wherever it stands."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def local_modules(folder: Path) -> set[str]:
    """Modules a folder imports from itself (tests import their helpers by bare name)."""
    return {p.stem for p in folder.rglob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}


def undeclared(files: list[Path], allowed: set[str], local: set[str]) -> list[str]:
    """``file: module`` for each import that no allowed distribution provides."""
    provides = md.packages_distributions()
    bad = []
    for f in files:
        for mod in sorted(imported_modules(f.read_text())):
            if mod in sys.stdlib_module_names or mod in local or mod == "replay":
                continue
            dists = {canonical(d) for d in provides.get(mod, [])}
            if not dists:
                bad.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {mod} (not installed)")
            elif not dists & allowed:
                bad.append(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {mod} "
                           f"(from {', '.join(sorted(dists))}, not declared)")
    return bad


def py_files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_the_package_imports_only_declared_modules():
    allowed = declared("ray", "record")
    assert undeclared(py_files("replay"), allowed, set()) == []


@pytest.mark.parametrize("folder", ["tests", "benches"])
def test_tests_and_benches_import_only_declared_modules(folder):
    allowed = declared("test")
    assert undeclared(py_files(folder), allowed, local_modules(ROOT / folder)) == []


def test_the_check_finds_an_undeclared_import(tmp_path):
    """The checker itself: an installed but undeclared distribution, a module nothing provides,
    and a declared one, in a file of their own."""
    f = tmp_path / "mod.py"
    f.write_text("import json\nimport numpy as np\n\ndef later():\n    import pytest\n"
                 "    from no_such_module_anywhere import x\n")
    bad = undeclared([f], declared(), set())
    assert any(": pytest (from pytest, not declared)" in b for b in bad), bad
    assert any(": no_such_module_anywhere (not installed)" in b for b in bad), bad
    assert not any("numpy" in b or "json" in b for b in bad), bad
    assert undeclared([f], declared("test") | {"no-such-module-anywhere"}, {"no_such_module_anywhere"}) == []


def test_extras_are_not_needed_by_the_default_path(tmp_path):
    """With ray, zmq, msgpack and the Prometheus parser refused at import, the README's first
    command (a sweep of the bundled sample, report included) and validate still run."""
    only_extras = declared("ray", "record") - declared()
    provides = md.packages_distributions()
    refused = sorted(mod for mod, dists in provides.items()
                     if {canonical(d) for d in dists} & only_extras and not mod.startswith("_"))
    assert {"ray", "zmq", "msgpack", "prometheus_client"} <= set(refused)
    code = (
        "import sys, importlib.abc\n"
        f"REFUSED = {refused!r}\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in REFUSED:\n"
        "            raise ImportError(f'{name} is refused: only an extra brings it')\n"
        "        return None\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from replay.cli import main\n"
        "sys.argv = ['router-replay'] + sys.argv[1:]\n"
        "main()\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "sample"
    sweep = subprocess.run([sys.executable, "-c", code, "sweep", str(ROOT / "traces" / "sample"), "--out", str(out),
                            "--worker-queue-limit", "none,2,4,8", "--saturation-queue-floor", "none,1..4"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    assert (out / "report.html").is_file() and (out / "summary.parquet").is_file()
    check = subprocess.run([sys.executable, "-c", code, "validate", str(ROOT / "traces" / "sample")],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert check.returncode == 0, check.stderr[-3000:]
    # and the finder does refuse: a command that needs an extra says so
    probe = subprocess.run([sys.executable, "-c", code.replace("from replay.cli import main", "import zmq")],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert probe.returncode != 0 and "refused" in probe.stderr


def test_the_lock_pins_every_declared_distribution():
    """uv.lock (refreshed with ``uv lock``, CONTRIBUTING.md) holds a version of everything the
    extras declare, and was made from this pyproject.toml's requirements."""
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    pinned = {canonical(p["name"]) for p in lock["package"] if "version" in p}
    wanted = declared(*EXTRAS)
    assert wanted - pinned == set(), "uv.lock lacks these: run `uv lock`"
    me = next(p for p in lock["package"] if canonical(p["name"]) == canonical(PROJECT["name"]))
    locked_reqs = {canonical(r["name"]) for r in me["metadata"]["requires-dist"]}
    assert {requirement_name(r) for r in PROJECT["dependencies"]} <= locked_reqs, \
        "uv.lock was made from another pyproject.toml: run `uv lock`"
