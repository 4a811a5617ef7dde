"""The package's layers (docs/architecture.md): imports point down, no circles, no hidden imports.

Every module's imports are read with ``ast`` (nothing is imported):

* a module imports only from its own layer or a lower one;
* the module-level imports between ``replay`` modules form no circle, counting the package
  ``__init__`` modules Python runs first (``import replay.a.b`` runs ``replay/a/__init__.py``);
* no module imports by a name in a string (``__import__("replay.x")``, ``importlib.import_module``
  of a literal), which would hide the import from these checks;
* an import inside a function is allowed only in ``cli/`` (kept lazy for the
  start-up time of ``--help``), in ``kernels/_jit.py`` (numba's internals, on
  numba's schedule), polars in ``runs/metrics.py`` (for ``check --help``) and for an optional dependency (ray, zmq,
  msgpack, prometheus_client, orjson), and each says so in a comment on its
  line (``lazy: ...`` or ``optional: ...`` in a comment).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "replay"

LAYERS = ("vocabulary", "kernels", "trace", "runs", "sweep", "simulate", "analysis", "report", "api", "cli")
"""Lowest first; a module may import from its own layer and those before it."""
RANK = {name: i for i, name in enumerate(LAYERS)}
PACKAGE_LAYER = {"kernels": "kernels", "trace": "trace", "runs": "runs", "sweep": "sweep", "simulate": "simulate",
                 "capture": "simulate", "analysis": "analysis", "report": "report", "cli": "cli"}
"""``capture/`` sits beside ``simulate/``: both turn something into a trace directory."""
OPTIONAL = ("ray", "zmq", "msgpack", "prometheus_client", "orjson")
LAZY_MODULES = ("replay.kernels._jit", "replay.runs.metrics")
"""Besides ``cli/``: the numba configuration module, which imports numba's internals when numba
would (a cached start of the kernels imports none of them), and the metrics table, whose names
``check --help`` lists without importing polars."""


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def layer_of(module: str) -> str:
    parts = module.split(".")
    if module in ("replay", "replay.api"):
        return "api"
    if module == "replay.__main__":
        return "cli"
    if len(parts) == 2 and parts[1] not in PACKAGE_LAYER:
        return "vocabulary"
    return PACKAGE_LAYER[parts[1]]


def _targets(module: str, node: ast.ImportFrom | ast.Import, mods: dict[str, Path] = MODULES) -> list[str]:
    """The replay modules (or packages) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "replay"]
    if node.level:
        base = module.split(".") if mods[module].name == "__init__.py" else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
        source = ".".join(base)
    else:
        source = node.module or ""
    if source.split(".")[0] != "replay":
        return []
    # the version string is written once, in replay/__init__.py (pyproject reads it there): vocabulary
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names
            if (source, a.name) != ("replay", "__version__")]


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str, mods: dict[str, Path] = MODULES) -> list[tuple[ast.stmt, bool, bool]]:
    """Every import statement of ``module``: (node, inside a function, under TYPE_CHECKING)."""
    tree = ast.parse(mods[module].read_text())
    found = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, in_function, typing_only))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, True, typing_only)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                visit(child, in_function, True)
            else:
                visit(child, in_function, typing_only)

    visit(tree, False, False)
    return found


def test_imports_point_down():
    upward = []
    for module in MODULES:
        mine = RANK[layer_of(module)]
        for node, _, _ in imports(module):
            for target in _targets(module, node):
                if target in MODULES and RANK[layer_of(target)] > mine:
                    upward.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert upward == []


def import_graph(mods: dict[str, Path] = MODULES) -> dict[str, set[str]]:
    """module -> the modules its module-level imports run: each module named and, before it, the
    ``__init__`` of every package on its path (not the importer's own packages, already running)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for module in mods:
        for node, in_function, typing_only in imports(module, mods):
            if in_function or typing_only:
                continue
            for target in _targets(module, node, mods):
                parts = target.split(".")
                for run in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
                    if run in mods and run != module and not module.startswith(run + "."):
                        graph[module].add(run)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_circles():
    assert circles(import_graph()) == []


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / "replay" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(root / "replay")


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """``replay.a.x`` imports ``replay.b.y``, which runs ``replay/b/__init__.py``, which imports
    ``replay.a.x``: no module names its importer, yet the start-up runs in a circle."""
    mods = _package(tmp_path, {
        "__init__.py": "", "a/__init__.py": "", "a/x.py": "from replay.b.y import f\n",
        "b/__init__.py": "from replay.a import x\n", "b/y.py": "def f(): pass\n"})
    assert circles(import_graph(mods)) == [["replay.a.x", "replay.b"]]
    (tmp_path / "replay" / "b" / "__init__.py").write_text("")
    assert circles(import_graph(mods)) == []


def _string_imports(path: Path) -> list[int]:
    """Lines calling ``__import__`` or ``import_module`` with a literal module name."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in ("__import__", "import_module"):
                lines.append(node.lineno)
    return lines


def test_no_import_by_a_name_in_a_string(tmp_path):
    hidden = [f"{module}:{line}" for module, path in MODULES.items() for line in _string_imports(path)]
    assert hidden == []
    probe = tmp_path / "probe.py"
    probe.write_text('import importlib\nx = __import__("replay.config")\ny = importlib.import_module("replay.api")\n'
                     'z = importlib.import_module(f".{x}", __name__)\n')
    assert _string_imports(probe) == [2, 3]


def test_imports_inside_functions_are_marked_and_allowed():
    hidden = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node, in_function, _ in imports(module):
            if not in_function:
                continue
            line = lines[node.lineno - 1]
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            comment = line.partition("#")[2]
            optional = all(n.split(".")[0] in OPTIONAL for n in names) and "optional" in comment
            lazy = (layer_of(module) == "cli" or module in LAZY_MODULES) and "lazy" in comment
            if not (optional or lazy):
                hidden.append(f"{module}:{node.lineno}: {line.strip()}")
    assert hidden == []
