"""The package's import graph has no cycle (issue 20: ``cli`` <-> ``probe`` and ``engines.vllm_cpu`` <->
``engines.vllm_cpu_rollout`` were two).

Every ``import`` / ``from ... import`` of a ``trl_rollout_corr`` module counts, at module level or inside a function
(a deferred import still ties the two modules together), except those under ``if TYPE_CHECKING:`` (never run).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1] / "trl_rollout_corr"
PACKAGE = ROOT.name


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """``{module: {package modules it imports}}`` for every module of the package."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name.split(".") if is_package else name.split(".")[:-1]
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # ``import pkg.mod.attr`` -> the deepest module
                    target = target.rpartition(".")[0]
                if target.startswith(PACKAGE) and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]):
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_graph_sees_deferred_and_relative_imports():
    graph = import_graph()
    assert f"{PACKAGE}.cli" in graph and f"{PACKAGE}.console" in graph[f"{PACKAGE}.cli"]
    assert f"{PACKAGE}.probe" in graph[f"{PACKAGE}.cli"]  # ``from . import probe`` inside run_probe
    assert f"{PACKAGE}.engines.vllm_cpu" in graph[f"{PACKAGE}.engines.vllm_cpu_rollout"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
