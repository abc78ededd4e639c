"""The packages' layering, read from the source with `ast` (every import, also inside functions):
data < models < serving_integration, and no import cycle among the project's modules."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("data", "models", "serving_integration")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """The project modules a file imports (absolute imports; `from pkg import mod` names pkg.mod)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in PACKAGES}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for package in PACKAGES for p in (REPO / package).rglob("*.py")}
    return {name: {n for n in imported(path) if n in files and n != name} for name, path in files.items()}


def test_no_package_imports_a_package_above_it():
    rank = {package: i for i, package in enumerate(PACKAGES)}
    upward = sorted(f"{module} imports {target}" for module, targets in graph().items() for target in targets
                    if rank[target.split(".")[0]] > rank[module.split(".")[0]])
    assert upward == []


def test_data_imports_no_models_and_nothing_below_reaches_serving():
    for module, targets in graph().items():
        if module.startswith("data"):
            assert not {t for t in targets if t.split(".")[0] != "data"}, module
        if module.startswith("models"):
            assert not {t for t in targets if t.startswith("serving_integration")}, module


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_the_graph_sees_imports_inside_functions():
    assert "data.config" in graph()["data.store"]  # data.store.build imports it when called
