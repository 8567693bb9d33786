"""The tests' layout (issue 48): every test file sits in a tier directory, ``tests/<tier>/`` with ``<tier>`` one of
``conftest.TIERS`` (unit, features, trainer, e2e); the tier marker comes from that directory (``conftest.py``'s
``pytest_collection_modifyitems``), never from the file; helpers live in ``tests/helpers/`` only.

Where a new test file goes: ``unit/`` when every test in it is fast and trains nothing (``make test-fast`` runs all of
``unit/``); ``features/`` for one feature of the trainer or one tool (lag, routing replay, support matching, the
asynchronous pipeline, ``analyze``/``suggest``/``probe``); ``trainer/`` for the trainer as a whole (modes, golden runs,
TRL's options, feature combinations); ``e2e/`` for the recipe, several ranks or processes, or real vLLM.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import TESTS_DIR, TIERS, tier_of

# Files of other tiers with tests marked ``unit`` by hand (fast tests next to slower ones; ``make test-fast`` runs
# them). May only shrink: a new fast test goes into a file of tests/unit/.
UNIT_MARKED_ELSEWHERE = {
    "features/test_analyze.py", "features/test_async_pipeline.py", "features/test_features_order.py",
    "features/test_probe.py", "features/test_suggest.py", "trainer/test_batch_schema.py",
    "trainer/test_trl_compat.py", "e2e/test_sharded.py", "e2e/test_trl_vllm_colocate.py",
}


def _test_files() -> list[Path]:
    return sorted(TESTS_DIR.rglob("test_*.py"))


def _tier_marks(path: Path) -> list[tuple[int, str]]:
    """(line, tier) of every ``pytest.mark.<tier>`` the file names (``pytestmark``, decorators, ``pytest.param``)."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in TIERS and isinstance(node.value, ast.Attribute)
            and node.value.attr == "mark"]


def test_every_test_file_sits_in_a_tier_directory():
    outside = [str(p.relative_to(TESTS_DIR)) for p in _test_files() if tier_of(p) is None]
    assert not outside, f"test files outside tests/<tier>/ (tiers: {TIERS}; see this module's docstring): {outside}"


def test_tier_directories_hold_only_tests_and_helpers_hold_none():
    for tier in TIERS:
        others = [p.name for p in (TESTS_DIR / tier).rglob("*.py") if not p.name.startswith("test_")]
        assert not others, f"tests/{tier}/ holds non-test modules {others}: move them to tests/helpers/"
    assert not list((TESTS_DIR / "helpers").rglob("test_*.py")), "tests/helpers/ holds a test file"
    loose = sorted(p.name for p in TESTS_DIR.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"modules at tests/ root {loose}: tests go into tests/<tier>/, helpers into tests/helpers/"


def test_no_file_sets_a_tier_marker_against_its_directory():
    wrong = []
    for path in _test_files():
        rel, tier = str(path.relative_to(TESTS_DIR)), tier_of(path)
        for line, mark in _tier_marks(path):
            if mark == "unit" and rel in UNIT_MARKED_ELSEWHERE:
                continue
            why = "redundant (the directory sets it)" if mark == tier else f"contradicts its directory ({tier})"
            wrong.append(f"{rel}:{line}: pytest.mark.{mark} {why}")
    assert not wrong, "\n".join(wrong)


def test_unit_marked_elsewhere_only_shrinks():
    stale = [rel for rel in sorted(UNIT_MARKED_ELSEWHERE) if not (TESTS_DIR / rel).exists()
             or not any(mark == "unit" for _, mark in _tier_marks(TESTS_DIR / rel))]
    assert not stale, f"UNIT_MARKED_ELSEWHERE lists files with no unit mark (remove them): {stale}"


def test_every_collected_test_carries_its_directory_tier(request):
    """The hook ran before ``-m`` selection: each collected test has its directory's tier marker, and no other tier
    marker except a hand-set ``unit`` in a file of ``UNIT_MARKED_ELSEWHERE``."""
    assert request.node.get_closest_marker("unit") is not None
    for item in request.session.items:
        tier = tier_of(item.path)
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        extra = tiers - {tier}
        if str(Path(item.path).relative_to(TESTS_DIR)) in UNIT_MARKED_ELSEWHERE:
            extra -= {"unit"}
        assert tier in tiers and not extra, f"{item.nodeid}: tier markers {sorted(tiers)}, directory {tier}"


@pytest.mark.parametrize("path, tier", [("unit/test_x.py", "unit"), ("e2e/sub/test_x.py", "e2e"),
                                        ("test_x.py", None), ("helpers/tiny_model.py", None)])
def test_tier_of(path, tier):
    assert tier_of(TESTS_DIR / path) == tier
