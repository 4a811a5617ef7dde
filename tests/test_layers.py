"""The package's layers (docs/architecture.md): imports point down, no circles, no hidden imports.

Every module's imports are read with ``ast`` (nothing is imported):

* a module imports only from its own layer or a lower one;
* the module-level imports between ``replay`` modules form no circle;
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


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
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


def _targets(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The replay modules (or packages) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "replay"]
    if node.level:
        base = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
        source = ".".join(base)
    else:
        source = node.module or ""
    if source.split(".")[0] != "replay":
        return []
    # the version string is written once, in replay/__init__.py (pyproject reads it there): vocabulary
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names
            if (source, a.name) != ("replay", "__version__")]


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str) -> list[tuple[ast.stmt, bool, bool]]:
    """Every import statement of ``module``: (node, inside a function, under TYPE_CHECKING)."""
    tree = ast.parse(MODULES[module].read_text())
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


def test_no_import_circles():
    graph = {m: set() for m in MODULES}
    for module in MODULES:
        for node, in_function, typing_only in imports(module):
            if not in_function and not typing_only:
                graph[module].update(t for t in _targets(module, node) if t in MODULES and t != module)
    # a package's __init__ importing its own submodules, imported back by one of them, is a circle too
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

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
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert circles == []


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
