"""The package's import graph has no cycle (issue 20: ``cli`` <-> ``probe`` and ``engines.vllm_cpu`` <->
``engines.vllm_cpu_rollout`` were two).

Every ``import`` / ``from ... import`` of a ``trl_rollout_corr`` module counts, at module level or inside a function
(a deferred import still ties the two modules together), except those under ``if TYPE_CHECKING:`` (never run).
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "trl_rollout_corr"
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


# ---------------------------------------------------------------------------------------------- layering (issue 48)
# The pure packages: math, data and formats with no trainer: they import none of the trainer's layer (the trainer,
# its config, the hook protocol, the features, the modes) and, directly or through any package module they import,
# neither TRL nor transformers.
PURE = ("config", "correction", "losses", "accumulator", "sketch", "lag", "support", "routing", "records", "analyze",
        "suggest", "console", "engines.alignment")
TRAINER_LAYER = ("trainer", "trainer_config", "hooks", "features", "modes")
THIRD_PARTY_FORBIDDEN = ("trl", "transformers")

# Known leaks, each with why it is still there. This allowlist may only shrink: remove an entry when its edge goes.
LAYERING_ALLOWLIST = {
    # analyze --what-if mirrors the trainer's group baseline, TRL 1.16's lone-survivor rule
    # (trl_compat.advantages.lone_survivors, a pure function kept beside the TRL formulas it mirrors); that module
    # imports trl (and importing it runs trl_compat/__init__.py, which imports every trl_compat module)
    ("trl_rollout_corr.analyze.recompute", "trl_rollout_corr.trl_compat.advantages"),
}


def _third_party(name: str, path: Path) -> set[str]:
    """The top-level names of the non-package modules ``name`` imports (deferred imports included, TYPE_CHECKING
    blocks not)."""
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out - {PACKAGE}


def _packages_run(importer: str, target: str, graph: dict[str, set[str]]) -> set[str]:
    """``target`` and the package ``__init__`` modules importing it runs first: its parent packages (in ``graph``)
    that are not the importer's own (those are being imported already)."""
    own = set(_parents(importer)) | {importer}
    return {target} | {pkg for pkg in _parents(target) if pkg in graph and pkg not in own}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _in(module: str, packages) -> bool:
    return any(module == f"{PACKAGE}.{p}" or module.startswith(f"{PACKAGE}.{p}.") for p in packages)


def layering_violations(graph: dict[str, set[str]], third_party: dict[str, set[str]]) -> list[str]:
    """Every layering rule broken, as ``"importer -> imported: rule"`` lines (``LAYERING_ALLOWLIST`` edges skipped):

    * a pure module imports, directly or through other package modules (an imported submodule's package
      ``__init__`` included: ``_packages_run``), the trainer's layer, or TRL / transformers;
    * a feature module imports another feature module or a mode (``features/__init__.py`` is the container: it
      imports them all);
    * a mode module imports a feature module.
    """
    out = []
    for name in sorted(graph):
        edges = {e for e in graph[name] if (name, e) not in LAYERING_ALLOWLIST}
        if _in(name, PURE):
            seen, stack = set(), [d for e in edges for d in _packages_run(name, e, graph)]
            while stack:
                dep = stack.pop()
                if dep in seen:
                    continue
                seen.add(dep)
                if _in(dep, TRAINER_LAYER):
                    out.append(f"{name} -> {dep}: a pure module imports the trainer's layer")
                    continue
                bad = third_party.get(dep, set()) & set(THIRD_PARTY_FORBIDDEN)
                if bad:
                    out.append(f"{name} -> {dep}: a pure module imports {sorted(bad)} through {dep}")
                stack.extend(d for e in graph.get(dep, ()) if (dep, e) not in LAYERING_ALLOWLIST
                             for d in _packages_run(dep, e, graph))
            bad = third_party.get(name, set()) & set(THIRD_PARTY_FORBIDDEN)
            if bad:
                out.append(f"{name} -> {sorted(bad)}: a pure module imports TRL / transformers")
        if name.startswith(f"{PACKAGE}.features."):
            out += [f"{name} -> {e}: a feature imports another feature or a mode" for e in sorted(edges)
                    if _in(e, ("features", "modes"))]
        if name == f"{PACKAGE}.modes" or name.startswith(f"{PACKAGE}.modes."):
            out += [f"{name} -> {e}: a mode imports a feature" for e in sorted(edges) if _in(e, ("features",))]
    return out


def _third_party_map() -> dict[str, set[str]]:
    return {name: _third_party(name, path) for name, path in _modules().items()}


def test_layering():
    """The pure packages, the features and the modes keep to their layers (``layering_violations``)."""
    violations = layering_violations(import_graph(), _third_party_map())
    assert not violations, "layering broken:\n" + "\n".join(violations)


def test_layering_allowlist_only_holds_real_edges():
    """Every allowlisted edge still exists (remove it when it goes: the list may only shrink)."""
    graph = import_graph()
    assert all(b in graph[a] for a, b in LAYERING_ALLOWLIST), LAYERING_ALLOWLIST


def test_layering_catches_each_rule():
    """The checker on a hand-made graph: each kind of leak is reported, a clean graph is not."""
    p = PACKAGE
    graph = {f"{p}.lag": {f"{p}.helper"}, f"{p}.helper": {f"{p}.hooks"}, f"{p}.hooks": set(),
             f"{p}.sketch": {f"{p}.glue"}, f"{p}.glue": set(),
             f"{p}.features.a": {f"{p}.features.b", f"{p}.hooks"}, f"{p}.features.b": {f"{p}.modes.x"},
             f"{p}.modes.x": {f"{p}.features.a", f"{p}.modes.common"}, f"{p}.modes.common": set(),
             f"{p}.features": {f"{p}.features.a", f"{p}.features.b"}}
    third = {f"{p}.glue": {"trl", "torch"}, f"{p}.correction.api": {"torch"}}
    found = layering_violations(graph, third)
    assert found == [
        f"{p}.features.a -> {p}.features.b: a feature imports another feature or a mode",
        f"{p}.features.b -> {p}.modes.x: a feature imports another feature or a mode",
        f"{p}.lag -> {p}.hooks: a pure module imports the trainer's layer",
        f"{p}.modes.x -> {p}.features.a: a mode imports a feature",
        f"{p}.sketch -> {p}.glue: a pure module imports ['trl'] through {p}.glue",
    ]
    assert layering_violations({f"{p}.lag": set(), f"{p}.modes.x": {f"{p}.hooks"}}, {f"{p}.lag": {"torch"}}) == []


def test_layering_sees_the_package_init_a_submodule_import_runs():
    """Importing ``trl_compat.sampling`` runs ``trl_compat/__init__.py`` first, which imports every ``trl_compat``
    module (``advantages`` imports trl): a pure module importing any ``trl_compat`` submodule imports trl. The
    package's own ``__init__`` of the importer (already running) is no such edge."""
    p = PACKAGE
    graph = {f"{p}.analyze.x": {f"{p}.trl_compat.sampling"}, f"{p}.trl_compat.sampling": set(),
             f"{p}.trl_compat": {f"{p}.trl_compat.advantages", f"{p}.trl_compat.sampling"},
             f"{p}.trl_compat.advantages": set(), f"{p}.analyze": {f"{p}.analyze.x"}, f"{p}.analyze.y": set()}
    third = {f"{p}.trl_compat.advantages": {"trl", "torch"}}
    assert layering_violations(graph, third) == [
        f"{p}.{m} -> {p}.trl_compat.advantages: a pure module imports ['trl'] through {p}.trl_compat.advantages"
        for m in ("analyze", "analyze.x")]  # analyze/__init__.py imports analyze.x
    # a sibling import (analyze.y -> analyze.x) does not re-run analyze/__init__.py's imports as a new edge
    graph[f"{p}.analyze.y"] = {f"{p}.analyze.x"}
    graph[f"{p}.analyze"] = {f"{p}.analyze.x", f"{p}.hooks"}
    graph[f"{p}.hooks"] = set()
    found = layering_violations(graph, third)
    assert f"{p}.analyze.y -> {p}.hooks: a pure module imports the trainer's layer" not in found
