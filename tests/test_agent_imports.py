"""How the agent's modules import each other: no cycle between them, and no private name
(``_name``) taken from another one. A name another module needs is public where it lives, and
a module needs only those below it (read from the sources with ``ast``: function-level and
``TYPE_CHECKING`` imports count as much as the others)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layout import cycles

AGENT = Path(__file__).resolve().parent.parent / "clusterrun" / "agent"
PACKAGE = "clusterrun.agent"


def _imports(path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, name, line)`` of every import of an agent module in ``path``: ``name`` is the name
    taken from it (``from .mod import name``), None for the module itself (``from . import mod``,
    ``import clusterrun.agent.mod``); ``module`` is ``""`` for the package's ``__init__``."""
    modules = {p.stem for p in AGENT.glob("*.py")} - {"__init__"}
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name.removeprefix(PACKAGE).lstrip("."), None, node.lineno)
                      for alias in node.names if alias.name == PACKAGE or alias.name.startswith(PACKAGE + ".")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module or ""
            elif node.level == 0 and node.module and (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
                base = node.module.removeprefix(PACKAGE).lstrip(".")
            else:
                continue
            for alias in node.names:
                if not base and alias.name in modules:  # from . import mod
                    found.append((alias.name, None, node.lineno))
                else:
                    found.append((base, alias.name, node.lineno))
    return sorted(found, key=lambda item: item[2])


def _graph() -> dict[str, dict[str, int]]:
    """Each agent module -> the agent modules it imports (with the line of the first such import)."""
    graph: dict[str, dict[str, int]] = {}
    for path in sorted(AGENT.glob("*.py")):
        name = "" if path.stem == "__init__" else path.stem
        edges = graph.setdefault(name, {})
        for module, _, line in _imports(path):
            if module != name:
                edges.setdefault(module, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (the layout test's search)."""
    return cycles({module: set(imports) for module, imports in graph.items()})


def test_the_agent_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    assert {"serve", "monitor", "survivor", "wire"} <= set(graph)  # the parse saw the package
    cycles = _cycles(graph)
    detail = [", ".join(f"{m or '__init__'}.py:{graph[m][n]} imports {n or '__init__'}"
                        for m in c for n in sorted(graph[m]) if n in c) for c in cycles]
    assert not cycles, detail


def test_no_agent_module_imports_a_private_name_of_another() -> None:
    private = []
    for path in sorted(AGENT.glob("*.py")):
        own = "" if path.stem == "__init__" else path.stem
        private += [f"{path.name}:{line}: from .{module} import {name}"
                    for module, name, line in _imports(path)
                    if name is not None and name.startswith("_") and module != own]
    assert not private, "\n".join(private)


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    """The two checks above, held to a package that breaks both rules."""
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    source = tmp_path / "x.py"
    source.write_text("def f():\n    from .records import _boot_id\n    from clusterrun.agent import monitor\n"
                      "if TYPE_CHECKING:\n    from clusterrun.agent.wire import Request\n")
    assert _imports(source) == [("records", "_boot_id", 2), ("monitor", None, 3), ("wire", "Request", 5)]
