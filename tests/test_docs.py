"""The documentation stays true to the code: the generated tables are in their pages, the README is a front page,
and every relative link of the README and ``docs/`` points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import trl_features
from trl_rollout_corr.config import markdown_table
from trl_rollout_corr.docgen import hook_table, main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_generated_tables_are_in_their_pages():
    assert markdown_table() in (ROOT / "docs" / "configuration.md").read_text()
    assert trl_features.markdown_table() in (ROOT / "docs" / "trl-options.md").read_text()
    assert hook_table() in (ROOT / "docs" / "architecture.md").read_text()


def test_hook_table_lists_exactly_the_overriding_features():
    rows = {line.split("|")[1].strip(" `"): line.split("|")[4].strip() for line in hook_table().splitlines()[2:]}
    assert rows["forward"] == "RoutingReplay, SupportMatching"  # around: list order
    assert rows["after_generate"] == "RoutingReplay, PolicyLag, BehaviourLogProbs"  # after: reverse order
    assert rows["after_log"] == "RolloutRecords" and rows["before_loss"] == "PolicyLag"


def test_docgen_prints_each_table(capsys):
    assert main(["--hook-table"]) == 0 and capsys.readouterr().out.strip() == hook_table()
    assert main(["--config-table"]) == 0 and capsys.readouterr().out.strip() == markdown_table()
    with pytest.raises(SystemExit):
        main([])


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for heading in ("## The two commands", "## A first run", "## Choosing a mode", "## Status / measured results"):
        assert heading in text
    assert "benchmarks/RESULTS.md" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
