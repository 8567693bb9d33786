"""Size budgets as a test (issue 48; tinygrad keeps its line count in CI the same way): every module of the package,
every function and the trainer class stay within a budget, and today's exceptions are listed with their current size.
An exception may only shrink: a listed file or function that grows past its listed size fails, and one that comes back
under the budget fails too until its line is deleted here (so the list never keeps a stale allowance).

Sizes are physical lines, docstrings and comments included (what a reader has to page through).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trl_rollout_corr"
MODULE_LINES = 500
FUNCTION_LINES = 80
TRAINER_CLASS_LINES = 350
TRAINER_METHODS = 25
TRAINER_METHOD_LINES = 50

# module (relative to the package) -> its size on 2026-12-07; may only shrink
MODULE_EXCEPTIONS = {
    "probe.py": 685,
    "routing.py": 635,
    "records/writer.py": 616,
    "engines/vllm_cpu_rollout.py": 511,
}
# "module:function" -> its size on 2026-12-07; may only shrink
FUNCTION_EXCEPTIONS = {
    "records/writer.py:_continue_at": 96,
}


def _modules() -> dict[str, Path]:
    return {str(p.relative_to(PACKAGE)): p for p in sorted(PACKAGE.rglob("*.py"))}


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def _check(size: int, budget: int, allowed: int | None, what: str) -> str | None:
    if allowed is None:
        return f"{what}: {size} lines, over the budget of {budget}" if size > budget else None
    if size > allowed:
        return f"{what}: {size} lines, over its listed exception of {allowed} (exceptions may only shrink)"
    if size <= budget:
        return f"{what}: {size} lines, back within the budget of {budget}: delete its exception in this file"
    return None


def test_modules_within_budget():
    errors = [_check(len(path.read_text().splitlines()), MODULE_LINES, MODULE_EXCEPTIONS.get(name), name)
              for name, path in _modules().items()]
    assert not [e for e in errors if e], "\n".join(e for e in errors if e)
    assert set(MODULE_EXCEPTIONS) <= set(_modules()), "an exception names a module that no longer exists"


def test_functions_within_budget():
    errors, seen = [], set()
    for name, path in _modules().items():
        for func, size in _functions(path):
            key = f"{name}:{func}"
            seen.add(key)
            errors.append(_check(size, FUNCTION_LINES, FUNCTION_EXCEPTIONS.get(key), key))
    assert not [e for e in errors if e], "\n".join(e for e in errors if e)
    assert set(FUNCTION_EXCEPTIONS) <= seen, "an exception names a function that no longer exists"


def test_trainer_class_within_budget():
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutCorrGRPOTrainer")
    methods = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert cls.end_lineno - cls.lineno + 1 <= TRAINER_CLASS_LINES
    assert len(methods) <= TRAINER_METHODS, [m.name for m in methods]
    longest = max(methods, key=lambda m: m.end_lineno - m.lineno)
    assert longest.end_lineno - longest.lineno + 1 <= TRAINER_METHOD_LINES, longest.name


def test_check_reports_growth_shrinkage_and_new_offenders():
    assert _check(90, 80, None, "f") == "f: 90 lines, over the budget of 80"
    assert _check(80, 80, None, "f") is None
    assert "may only shrink" in _check(101, 80, 100, "f")
    assert _check(95, 80, 100, "f") is None
    assert "delete its exception" in _check(70, 80, 100, "f")
