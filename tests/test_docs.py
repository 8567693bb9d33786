"""The documentation stays true to the code: the generated tables are in their pages, the README is a front page
(its first screen: what it is, install, the first run, the mode chooser), every line of the README and ``docs/`` is
at most 120 characters (the exceptions listed, which may only shrink), and every relative link points at a file that
exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import trl_features
from trl_rollout_corr.config import markdown_table
from trl_rollout_corr.docgen import batch_key_table, cli_reference, hook_table, main, role_table

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINE_CAP = 120
# page -> its lines over LINE_CAP on 2026-12-07: Markdown table rows (a row cannot wrap), a few long commands, and the
# pages other work was editing that day (explanation/architecture.md, reference/known-limits.md, how-to/policy-lag.md:
# left unwrapped so their merges stay easy). May only shrink: a page over its allowance fails, and a page under it
# fails too until its number here is lowered (or its line deleted).
LONG_LINE_EXCEPTIONS = {
    "docs/explanation/architecture.md": 31,
    "docs/how-to/policy-lag.md": 9,
    "docs/how-to/read-the-metrics.md": 22,
    "docs/how-to/rollout-records.md": 6,
    "docs/how-to/routing-replay.md": 2,
    "docs/how-to/run-sharded.md": 12,
    "docs/how-to/support-matching.md": 4,
    "docs/reference/combinations.md": 22,
    "docs/reference/configuration.md": 11,
    "docs/reference/known-limits.md": 4,
    "docs/reference/trl-options.md": 35,
    "docs/tutorial/first-run.md": 2,
}


def test_generated_tables_are_in_their_pages():
    assert markdown_table() in (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert trl_features.markdown_table() in (ROOT / "docs" / "reference" / "trl-options.md").read_text()
    architecture = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    assert hook_table() in architecture
    assert batch_key_table() in architecture and role_table() in architecture
    assert cli_reference() in (ROOT / "docs" / "reference" / "cli.md").read_text()


def test_hook_table_lists_exactly_the_overriding_features():
    rows = {line.split("|")[1].strip(" `"): line.split("|")[4].strip() for line in hook_table().splitlines()[2:]}
    assert rows["forward"] == "RoutingReplay, SupportMatching"  # around: list order
    assert rows["after_generate"] == "RoutingReplay, PolicyLag, BehaviourLogProbs"  # after: reverse order
    assert rows["after_log"] == "RolloutRecords" and rows["before_loss"] == "PolicyLag, LagSplit"


def test_docgen_prints_each_table(capsys):
    assert main(["--hook-table"]) == 0 and capsys.readouterr().out.strip() == hook_table()
    assert main(["--config-table"]) == 0 and capsys.readouterr().out.strip() == markdown_table()
    assert main(["--batch-key-table"]) == 0 and capsys.readouterr().out.strip() == batch_key_table()
    assert main(["--role-table"]) == 0 and capsys.readouterr().out.strip() == role_table()
    assert main(["--cli"]) == 0 and capsys.readouterr().out.strip() == cli_reference()
    with pytest.raises(SystemExit):
        main([])


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    first = "\n".join(text.splitlines()[:40])
    for heading in ("## Install", "## A first run", "## Choosing a mode"):
        assert heading in first, f"the README's first 40 lines lack {heading!r}"
    assert "make install" in first and "make demo" in first
    assert "CI" not in first, "CI timings belong lower in the README or in docs/"
    assert "## Status / measured results" in text and "benchmarks/RESULTS.md" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_lines_within_the_cap(page):
    rel = str(page.relative_to(ROOT))
    long = [i for i, line in enumerate(page.read_text().splitlines(), 1) if len(line) > LINE_CAP]
    allowed = LONG_LINE_EXCEPTIONS.get(rel, 0)
    assert len(long) <= allowed, f"{rel}: {len(long)} lines over {LINE_CAP} (allowed {allowed}): {long[:10]}"
    assert len(long) == allowed, f"{rel}: {len(long)} long lines, fewer than its exception: lower it to {len(long)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_readme_trainer_snippet_trains(tmp_path, monkeypatch):
    """The README's trainer snippet, as printed, on the tiny model instead of SmolLM2: it must run as written and
    log the correction's metrics (a snippet that leaves names undefined, or passes a field TRL no longer takes, fails
    here)."""
    import torch

    from tiny_model import make_tiny_model_dir

    text = (ROOT / "README.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "RolloutCorrGRPOTrainer(" in b]
    assert len(blocks) == 1, "README: expected one python block that builds the trainer"
    model_line = 'model = "models/SmolLM2-135M-Instruct"'
    assert model_line in blocks[0]
    tiny = make_tiny_model_dir(str(tmp_path / "model"), "llama", seed=0)
    code = blocks[0].replace(model_line, f"model = {tiny!r}")
    monkeypatch.chdir(tmp_path)  # output_dir="outputs/quickstart" lands in tmp_path
    torch.set_num_threads(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    history = scope["trainer"].state.log_history
    assert scope["trainer"].state.global_step == 2
    assert any("rollout_corr/kl" in h for h in history)
