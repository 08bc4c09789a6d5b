"""The package's layout as a picture of its architecture: folders by role, few modules in the root, modules
small enough to read, and no import cycle between two parts of the root (a root module or a folder is one part),
counting every import: at module level, in functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "clusterrun"
MAX_ROOT_MODULES = 12
MAX_LINES = 600


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imported(path: Path, name: str) -> set[str]:
    """Every ``clusterrun`` module ``path`` imports, wherever the import stands; ``from P import m`` counts as
    an import of ``P.m`` when ``P.m`` is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return {n for n in found if n == "clusterrun" or n.startswith("clusterrun.")}


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in PACKAGE.rglob("*.py")}


def part(name: str) -> str:
    """The part of the root a module belongs to: its folder, or itself for a module in the root."""
    return name.split(".")[1] if name.count(".") >= 1 else name


def part_graph() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if name == "clusterrun":
            continue
        for target in imported(path, name) & known.keys():
            if target != "clusterrun" and part(target) != part(name):
                graph.setdefault(part(name), set()).add(part(target))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_few_modules_stand_in_the_package_root() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_module_is_over_600_lines() -> None:
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_import_cycle_between_parts_of_the_root() -> None:
    assert cycles(part_graph()) == []


def test_the_cycle_check_sees_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    module = tmp_path / "clusterrun" / "run" / "x.py"
    module.parent.mkdir(parents=True)
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from clusterrun.life import y\n"
                      "def f():\n    from ..store.jobs import JobStore\n")
    assert imported(module, "clusterrun.run.x") >= {"clusterrun.life.y", "clusterrun.store.jobs"}
