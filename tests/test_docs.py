"""The docs a newcomer enters by stay true: the modules docs/architecture.md names exist, docs/index.md
lists every page, and no doc, module or test names a tracker's issue number instead of the feature."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# `replay/sweep/run.py`, `replay/kernels/`, or a file of a layer named after it (`run.py` under a
# `replay/sweep/` row or paragraph is not checked: only paths written out from `replay/`)
PATH = re.compile(r"\breplay/[\w/]*\w(?:\.py)?/?")


def named_paths(text: str) -> set[str]:
    return {m.group(0) for m in PATH.finditer(text)}


def test_architecture_names_only_modules_that_exist():
    text = (DOCS / "architecture.md").read_text()
    paths = named_paths(text)
    assert len(paths) > 40, "the page names the modules of every layer and flow"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_architecture_names_every_layer_package():
    """Every package under replay/ is on the page, so a new layer cannot be left out of it."""
    text = (DOCS / "architecture.md").read_text()
    packages = sorted(p.parent.name for p in (ROOT / "replay").glob("*/__init__.py"))
    assert packages, "replay/ has layer packages"
    unnamed = [p for p in packages if f"replay/{p}/" not in text]
    assert not unnamed, f"layer packages missing from docs/architecture.md: {unnamed}"


def test_named_path_pattern_catches_a_wrong_name():
    """The check above can fail: a module that is not there is reported."""
    paths = named_paths("see `replay/sweep/run.py` and `replay/sweep/nowhere.py`.")
    assert paths == {"replay/sweep/run.py", "replay/sweep/nowhere.py"}
    assert not (ROOT / "replay/sweep/nowhere.py").exists()


def test_index_lists_every_page_once():
    index = (DOCS / "index.md").read_text()
    listed = re.findall(r"^- \[[^\]]+\]\(([^)]+)\)", index, flags=re.M)
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert sorted(listed) == pages, "docs/index.md: one line per page in docs/, none twice, none missing"


def test_relative_links_in_docs_and_readme_resolve():
    broken = []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_no_issue_numbers_in_code_docs_or_tests():
    """Features are named, not tracker numbers (a reader of the tree cannot see the tracker)."""
    pattern = "[Ii]ssues? #?[0-9]+"
    if not (ROOT / ".git").exists():
        files = [p for d in ("replay", "docs", "tests", "benches") for p in (ROOT / d).rglob("*")
                 if p.suffix in (".py", ".md")] + [ROOT / "README.md"]
        hits = [f"{p}: {m}" for p in files for m in re.findall(pattern, p.read_text())]
    else:
        out = subprocess.run(["git", "grep", "--untracked", "-nE", pattern, "--", "replay", "docs", "README.md",
                              "tests", "benches"], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode in (0, 1), out.stderr
        hits = out.stdout.splitlines()
    assert not hits, "name the feature, not the issue:\n" + "\n".join(hits)


def test_every_public_name_imports_and_is_documented():
    """replay.__all__ is the public API: each name resolves (lazily, from its layer) and docs/api.md
    lists it as ``replay.NAME``; and the page lists no public name that does not exist."""
    import replay

    api = (DOCS / "api.md").read_text()
    assert len(replay.__all__) >= 30
    missing = [n for n in replay.__all__ if getattr(replay, n, None) is None]
    assert not missing, f"public names that do not import: {missing}"
    undocumented = [n for n in replay.__all__ if f"`replay.{n}" not in api]
    assert not undocumented, f"public names missing from docs/api.md: {undocumented}"
    stale = set(re.findall(r"`replay\.([A-Za-z]\w*)", api)) - set(replay.__all__)
    assert not stale, f"docs/api.md names what replay does not export: {sorted(stale)}"
