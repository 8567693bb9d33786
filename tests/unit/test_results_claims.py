"""The README (and the mode guide, docs/how-to/choose-a-mode.md) quote only what ``benchmarks/RESULTS.md`` holds
(issue 47).

Which numbers are checked: every number in a README block that cites ``RESULTS.md`` (a block is a table row,
a list item with its continuation lines, or a paragraph; code blocks are skipped). A number is a decimal literal with
its sign (``-22.7``, ``0.663``, ``2.4e-07``, the ``0.60`` of ``0.60x``); digits inside names (``k3``, ``bypass_k32``,
``SmolLM2-135M``), version strings (``0.9.1``) and commit hashes are not numbers. Each must appear, as a number, in
RESULTS.md (its claims table or the generated tables below it; a leading ``+`` is ignored on both sides), each
95 % interval ``[lo, hi]`` as written, and each claim id the block names (``L4``, ``S1-S6``) must be a row of the
claims table.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a signed decimal (thousands with commas: 4,096), not inside a word, a version or a range's right end; an ``x``
# suffix (``0.60x``) is allowed
NUMBER = re.compile(r"(?<![\w.+-])(?<!\d,)[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?(?![.\d])"
                    r"(?!(?!x\b)\w)")
INTERVAL = re.compile(r"\[[+-]?\d[^\[\]]*?, [+-]?\d[^\[\]]*?\]")
CLAIM_ROW = re.compile(r"^\| ([A-Z]{1,2}\d+[a-z]?) \|", re.M)


def numbers(text: str) -> list[str]:
    """The numbers of ``text`` as written, without a leading ``+``."""
    return [m.group(0).lstrip("+") for m in NUMBER.finditer(text)]


def blocks(markdown: str) -> list[str]:
    """Table rows, list items (with their indented continuation lines) and paragraphs, outside code fences."""
    out: list[str] = []
    current: list[str] = []
    fenced = False

    def flush() -> None:
        if current:
            out.append("\n".join(current))
            current.clear()

    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith("#"):
            flush()
        elif line.startswith("|"):
            flush()
            out.append(line)
        elif re.match(r"\* |\d+\. ", line):
            flush()
            current.append(line)
        else:
            current.append(line)
    flush()
    return out


def unsupported(readme: str, results: str) -> list[str]:
    """What the RESULTS.md-citing blocks of ``readme`` quote that ``results`` does not hold (empty: all held)."""
    held_numbers = set(numbers(results))
    held_intervals = {iv.replace("+", "") for iv in INTERVAL.findall(results)}
    claim_ids = set(CLAIM_ROW.findall(results))
    prefixes = {re.match(r"[A-Z]+", c).group(0) for c in claim_ids}
    missing = []
    for block in blocks(readme):
        if "RESULTS.md" not in block:
            continue
        missing += [f"number {n}" for n in numbers(block) if n not in held_numbers]
        missing += [f"interval {iv}" for iv in INTERVAL.findall(block) if iv.replace("+", "") not in held_intervals]
        for cid in re.findall(r"\b([A-Z]{1,2}\d+[a-z]?)\b", block):
            if re.match(r"[A-Z]+", cid).group(0) in prefixes and cid not in claim_ids:
                missing.append(f"claim {cid}")
    return missing


def test_number_extraction_by_hand():
    text = ("bypass_k32 ended +25.3 [+13.2, +37.4] (n = 4) on SmolLM2-135M, verl 0.9.1 at 78501de, 0.60x, "
            "2.4e-07, k3 19/128 -> 56/128, lags 0-31, 4,096 tokens.")
    assert numbers(text) == ["25.3", "13.2", "37.4", "4", "0.60", "2.4e-07", "19", "128", "56", "128", "0", "4,096"]
    assert INTERVAL.findall(text) == ["[+13.2, +37.4]"]


def test_blocks_split_rows_items_paragraphs_and_skip_code():
    md = "intro line\nsecond line\n\n* item one\n  more\n* item two\n\n| a | b |\n```\n9.99 RESULTS.md\n```\n"
    assert blocks(md) == ["intro line\nsecond line", "* item one\n  more", "* item two", "| a | b |"]


def test_a_number_the_results_do_not_hold_is_reported():
    results = "| L1 | a claim | -22.7 [-37.5, -7.8] | 4 (3) |\n"
    assert unsupported("Plain TRL lost -22.7 [-37.5, -7.8] (RESULTS.md L1).", results) == []
    assert unsupported("Plain TRL lost -22.6 [-37.5, -7.9] (RESULTS.md L1).", results) == [
        "number -22.6", "number -7.9", "interval [-37.5, -7.9]"]
    assert unsupported("Plain TRL lost -22.7 (RESULTS.md L2).", results) == ["claim L2"]
    assert unsupported("Plain TRL lost 99.9 (no citation).", results) == []  # only blocks citing RESULTS.md


def test_readme_quotes_only_what_results_md_holds():
    readme = (ROOT / "README.md").read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert sum("RESULTS.md" in b for b in blocks(readme)) >= 4  # the status bullets cite it
    assert unsupported(readme, results) == []


def test_the_mode_guide_quotes_only_what_results_md_holds():
    """The how-to that recommends a mode quotes the evidence under the same rule as the README."""
    guide = (ROOT / "docs" / "how-to" / "choose-a-mode.md").read_text()
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert sum("RESULTS.md" in b for b in blocks(guide)) >= 2
    assert unsupported(guide, results) == []
