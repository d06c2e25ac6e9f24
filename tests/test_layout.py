"""The rules of the package layout, checked from the source (README, "Layout")."""

from __future__ import annotations

import ast
import pathlib

import fastpersist

PACKAGE = pathlib.Path(fastpersist.__file__).parent
TOOLS = "fastpersist.tools"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> package modules it imports anywhere (function-level and TYPE_CHECKING included)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        here = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fastpersist"):
                base = node.module or ""
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in mods or alias.name == "_core" else base
                if target in mods and target != mod:
                    edges[mod].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    assert _cycles(_imports(_modules())) == []


def test_the_library_never_imports_the_tools() -> None:
    edges = _imports(_modules())
    bad = {
        m: sorted(t for t in targets if t.startswith(TOOLS))
        for m, targets in edges.items()
        if not m.startswith(TOOLS) and m != "fastpersist.__main__"
    }
    assert {m: t for m, t in bad.items() if t} == {}


def test_files_and_functions_stay_small() -> None:
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.name}:{node.name}: {length} lines")
    assert too_long == []
