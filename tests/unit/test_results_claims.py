"""The README and every page under ``docs/`` quote only what ``benchmarks/RESULTS.md`` holds (issue 47), and the
claims table at the top of RESULTS.md quotes only what its generated tables (or, for runs no script writes a table
for, LOG.md) hold.

The rule for the pages (README.md and ``docs/**/*.md``):

* A *block* is a table row, a list item (``*``, ``-`` or ``1.``) with its continuation lines, or a paragraph; code
  fences are skipped.
* A block is *checked* when it states a measured result: it cites the evidence (names ``RESULTS.md``, ``LOG.md`` or a
  claim: ``claim D1``, ``claims L1-L13``), or it says it is a measurement (the word ``measured`` or ``measurement``),
  or it states a speed (``faster``, ``slower``, ``cheaper``, a ratio such as ``0.88x``), or it names an experiment's
  cell or arm (``trl_is_k32_s1``, ``bypass_k8``), or it sits under a heading that says ``measured``, ``results`` or
  ``evidence`` (the README's "Status / measured results"). A table is checked when the block just above it is.
* In a checked block every number must appear, as a number, in RESULTS.md (its claims table or the generated tables
  below it; a leading ``+`` is ignored on both sides), every 95 % interval ``[lo, hi]`` as written, and every claim id
  it names must be a row of the claims table. A number is a decimal literal with its sign (``-22.7``, ``0.663``,
  ``2.4e-07``, the ``0.60`` of ``0.60x``, both ends of a range ``15-40``); digits inside names (``k3``,
  ``bypass_k32``, ``SmolLM2-135M``), version strings (``0.9.1``) and commit hashes are not numbers.
* Not numbers of a measurement, so not checked: inline code (`` `max_policy_lag=4` ``: configuration, code), link
  targets, identifiers (``issue 47``, ``section 7``, ``round 8``, ``#6280``, ``et al., 2025``) and the version after a
  package name (``TRL 1.16``, ``vLLM 0.32``, ``transformers 5.19``).
* Any other number of a checked block that is not a measurement (a default, a threshold, arithmetic, an example) is
  marked in that block, explicitly and narrowly: ``<!-- not a measurement: 14, 1.75 (why) -->`` exempts the numbers
  it lists in that block only, and each must occur in the block (a stale marker fails).
* A number found only in LOG.md is not enough: quote a claim of RESULTS.md, add a claim row, or point at LOG.md
  without the number.

The rule for RESULTS.md's claims part (everything above "## Generated tables"): at most 200 lines, and every number of
a claim row (its statement and value) is in the generated tables, or, for a row whose command writes no generated
table (``GENERATED_CMDS``) or that names LOG.md, in the generated tables or LOG.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a signed decimal (thousands with commas: 4,096), not inside a word or a version; a range's right end (the 40 of
# ``15-40``, a hyphen right after a digit) is a number too; an ``x`` suffix (``0.60x``) is allowed
NUMBER = re.compile(r"(?:(?<![\w.+-])|(?<=\d-))(?<!\d,)[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[+-]?\d+)?"
                    r"(?!\.?\d)(?!(?!x\b)\w)")
INTERVAL = re.compile(r"\[[+-]?\d[^\[\]]*?, [+-]?\d[^\[\]]*?\]")
CLAIM_ROW = re.compile(r"^\| ([A-Z]{1,2}\d+[a-z]?) \|", re.M)
CLAIM_ID = re.compile(r"\b([A-Z]{1,2}\d+[a-z]?)\b")
# what makes a block one that states a measured result
CITES = re.compile(r"RESULTS\.md|LOG\.md|\bclaims? [A-Z]{1,2}\d")
SAYS_MEASURED = re.compile(r"\bmeasured\b|\bmeasurements?\b|\bfaster\b|\bslower\b|\bcheaper\b|\d(?:\.\d+)?x\b", re.I)
# an experiment's cell or arm (``trl_is_k32_s1``, ``bypass_k8``): what the block says of it was measured
CELL = re.compile(r"\b(?:trl|bypass|tis|decoupled|direct_gate|rs_engine|rs_direct|f32_rs_engine|f32_rs_direct"
                  r"|topp_[a-z]+|trl_[a-z0-9]+)_k(?:1|8|32)(?:_s\d|\b)")
RESULTS_HEADING = re.compile(r"measured|results|evidence", re.I)
MARKER = re.compile(r"<!-- not a measurement: (.*?) -->", re.S)
# not numbers of a measurement: inline code, link targets, identifiers, a package's version
NOT_MEASUREMENTS = re.compile(
    r"`[^`]*`|\]\([^)]*\)|#\d+|\bet al\., \d{4}"
    r"|\b(?:issues?|section|round|spec section) \d+(?:(?:, | and )\d+)*"
    r"|\b(?:TRL|vLLM|transformers|torch|Python|verl|accelerate|DeepSpeed|reasoning-gym) \d+(?:\.\d+)+")


def numbers(text: str) -> list[str]:
    """The numbers of ``text`` as written, without a leading ``+``."""
    return [m.group(0).lstrip("+") for m in NUMBER.finditer(text)]


def sectioned_blocks(markdown: str) -> list[tuple[str, str]]:
    """(the headings above it joined by " / ", block) for every table row, list item (with its indented continuation
    lines) and paragraph outside code fences."""
    out: list[tuple[str, str]] = []
    current: list[str] = []
    headings: dict[int, str] = {}
    fenced = False

    def flush() -> None:
        if current:
            out.append((" / ".join(headings[k] for k in sorted(headings)), "\n".join(current)))
            current.clear()

    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced:
            continue
        heading = re.match(r"(#+) (.*)", line)
        if heading:
            flush()
            level = len(heading.group(1))
            headings = {k: v for k, v in headings.items() if k < level}
            headings[level] = heading.group(2)
        elif not line.strip():
            flush()
        elif line.startswith("|"):
            flush()
            out.append((" / ".join(headings[k] for k in sorted(headings)), line))
        elif re.match(r"[*-] |\d+\. ", line):
            flush()
            current.append(line)
        else:
            current.append(line)
    flush()
    return out


def blocks(markdown: str) -> list[str]:
    """Table rows, list items (with their indented continuation lines) and paragraphs, outside code fences."""
    return [block for _, block in sectioned_blocks(markdown)]


def is_checked(heading: str, block: str) -> bool:
    """Whether ``block`` (under ``heading``) states a measured result (the module docstring's rule)."""
    prose = MARKER.sub("", block)
    return bool(CITES.search(prose) or SAYS_MEASURED.search(prose) or CELL.search(prose)
                or RESULTS_HEADING.search(heading))


def unsupported(page: str, results: str) -> list[str]:
    """What the checked blocks of ``page`` quote that ``results`` does not hold (empty: all held)."""
    held_numbers = set(numbers(results))
    held_intervals = {iv.replace("+", "") for iv in INTERVAL.findall(results)}
    claim_ids = set(CLAIM_ROW.findall(results))
    prefixes = {re.match(r"[A-Z]+", c).group(0) for c in claim_ids}
    missing = []
    lead_in_checked = False  # a table is checked when the block just above it (its lead-in) is
    for heading, block in sectioned_blocks(page):
        checked = is_checked(heading, block) or (block.startswith("|") and lead_in_checked)
        if not block.startswith("|"):
            lead_in_checked = checked
        if not checked:
            continue
        exempt = [n for marker in MARKER.findall(block) for n in numbers(marker)]
        prose = NOT_MEASUREMENTS.sub(" ", MARKER.sub(" ", block))
        missing += [f"stale marker number {n}" for n in exempt if n not in numbers(prose)]
        missing += [f"number {n}" for n in numbers(prose) if n not in held_numbers and n not in exempt]
        missing += [f"interval {iv}" for iv in INTERVAL.findall(prose) if iv.replace("+", "") not in held_intervals]
        if CITES.search(prose):
            for cid in CLAIM_ID.findall(prose):
                if re.match(r"[A-Z]+", cid).group(0) in prefixes and cid not in claim_ids:
                    missing.append(f"claim {cid}")
    return missing


def claims_and_generated(results: str) -> tuple[str, str]:
    """RESULTS.md split at its "## Generated tables" heading: (the claims part, the generated tables)."""
    claims, sep, generated = results.partition("\n## Generated tables\n")
    assert sep, "RESULTS.md lost its '## Generated tables' heading"
    return claims, generated


# the commands (the claims table's cmd column) whose numbers a script writes into the generated tables; the others
# (E, V, Y, SH, Q) ran as LOG.md records them, and their rows may quote LOG.md, as may a row that names LOG.md
GENERATED_CMDS = {"P", "PI", "D", "M", "S", "C", "T", "AS"}


def unsupported_claim_rows(claims: str, generated: str, log: str) -> list[str]:
    """Each claim row's numbers (statement and value) that the generated tables do not hold (nor LOG.md, for a row
    whose command writes no generated table or that names LOG.md for the number): ``"ID: number N"`` per miss."""
    held = set(numbers(generated))
    held_log = held | set(numbers(log))
    missing = []
    for line in claims.splitlines():
        row = CLAIM_ROW.match(line)
        if not row:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        cmds = {c.strip() for c in cells[-1].split(",")}
        pool = held if cmds <= GENERATED_CMDS and "LOG.md" not in line else held_log
        text = NOT_MEASUREMENTS.sub(" ", " | ".join(cells[1:-1]))
        missing += [f"{row.group(1)}: number {n}" for n in numbers(text) if n not in pool]
    return missing


def test_number_extraction_by_hand():
    text = ("bypass_k32 ended +25.3 [+13.2, +37.4] (n = 4) on SmolLM2-135M, verl 0.9.1 at 78501de, 0.60x, "
            "2.4e-07, k3 19/128 -> 56/128, lags 0-31, 4,096 tokens, ended 0.863.")
    assert numbers(text) == ["25.3", "13.2", "37.4", "4", "0.60", "2.4e-07", "19", "128", "56", "128", "0", "31",
                             "4,096", "0.863"]
    assert INTERVAL.findall(text) == ["[+13.2, +37.4]"]


def test_a_ranges_right_end_is_a_number():
    """``15-40 minutes`` states two numbers: the right end of a range of numbers is checked as the left end is (a
    hyphen after a letter is no range: ``SmolLM2-135M``, ``x-1``)."""
    assert numbers("a 15-40 minute rebuild, 0.8-1.0 MB, lags 0-31, steps 2-4") == [
        "15", "40", "0.8", "1.0", "0", "31", "2", "4"]
    assert numbers("SmolLM2-135M, k3-kl, x-1") == []
    results = "| L1 | a claim | 15 minutes |\n"
    assert unsupported("Measured: a 15-40 minute rebuild.", results) == ["number 40"]


def test_blocks_split_rows_items_paragraphs_and_skip_code():
    md = "intro line\nsecond line\n\n* item one\n  more\n- item two\n\n| a | b |\n```\n9.99 RESULTS.md\n```\n"
    assert blocks(md) == ["intro line\nsecond line", "* item one\n  more", "- item two", "| a | b |"]


def test_blocks_carry_their_headings():
    md = "# Page\n\nintro\n\n## Status / measured results\n\n* a\n\n### Sub\n\nb\n\n## Other\n\nc\n"
    assert sectioned_blocks(md) == [("Page", "intro"), ("Page / Status / measured results", "* a"),
                                    ("Page / Status / measured results / Sub", "b"), ("Page / Other", "c")]


def test_a_number_the_results_do_not_hold_is_reported():
    results = "| L1 | a claim | -22.7 [-37.5, -7.8] | 4 (3) |\n"
    assert unsupported("Plain TRL lost -22.7 [-37.5, -7.8] (RESULTS.md L1).", results) == []
    assert unsupported("Plain TRL lost -22.6 [-37.5, -7.9] (RESULTS.md L1).", results) == [
        "number -22.6", "number -7.9", "interval [-37.5, -7.9]"]
    assert unsupported("Plain TRL lost -22.7 (RESULTS.md L2).", results) == ["claim L2"]
    assert unsupported("Plain TRL lost 99.9 (no citation).", results) == []  # states no measured result


def test_which_blocks_are_checked():
    results = "| L1 | a claim | -22.7 |\n"
    assert unsupported("Plain TRL lost 99.9 (LOG.md).", results) == ["number 99.9"]
    assert unsupported("It lost 99.9, claim L1.", results) == ["number 99.9"]
    assert unsupported("Measured: 99.9 s.", results) == ["number 99.9"]
    assert unsupported("The scorer is 99.9x faster.", results) == ["number 99.9"]
    assert unsupported("The step read 0.88x the other.", results) == ["number 0.88"]
    assert unsupported("`trl_is_k32_s1` ended at 99.9.", results) == ["number 99.9"]
    assert unsupported("# Status / measured results\n\nIt lost 99.9.", results) == ["number 99.9"]
    assert unsupported("# Usage\n\nSet it to 99.9.", results) == []


def test_configuration_identifiers_and_marked_numbers_are_not_checked():
    results = "| L1 | a claim | -22.7 |\n"
    page = ("Measured with `max_policy_lag=99` (issue 47, section 7, round 8, verl#6280, TRL 1.16, vLLM 0.32, "
            "[link](a/b-3.md)): -22.7.")
    assert unsupported(page, results) == []
    marked = "Measured: 14 GB on 8 ranks is 1.75 GB a rank. <!-- not a measurement: 14, 8, 1.75 (arithmetic) -->"
    assert unsupported(marked, results) == []
    assert unsupported(marked.replace("1.75 GB", "1.8 GB"), results) == ["stale marker number 1.75", "number 1.8"]
    assert unsupported("Measured 14 GB. <!-- not a measurement: 8 (elsewhere) -->", results) == [
        "stale marker number 8", "number 14"]


def test_a_claim_row_must_quote_its_generated_table():
    claims = ("| id | claim | value | cmd |\n|---|---|---|---|\n"
              "| L1 | plain TRL at k = 32 | -22.7 [-37.5, -7.8] | P |\n"
              "| S4 | the demo's step line | 69.3 vs 75.5 s | E |\n")
    generated = "| trl_k32 - trl_k1 | 4 (3) | -22.7 [-37.5, -7.8] | k = 32 |\n"
    assert unsupported_claim_rows(claims, generated, "steps 2-4: 69.3 vs 75.5 s") == []
    assert unsupported_claim_rows(claims, generated, "") == ["S4: number 69.3", "S4: number 75.5"]
    assert unsupported_claim_rows(claims.replace("-22.7", "-22.6"), generated, "69.3 75.5") == ["L1: number -22.6"]
    # a row of a generated-table command may quote LOG.md only where it names LOG.md
    assert unsupported_claim_rows(claims.replace("| E |", "| S |"), generated, "69.3 75.5") == [
        "S4: number 69.3", "S4: number 75.5"]
    named = claims.replace("| E |", "| S |").replace("step line |", "step line (LOG.md) |")
    assert unsupported_claim_rows(named, generated, "69.3 75.5") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_page_quotes_only_what_results_md_holds(page):
    assert unsupported(page.read_text(), RESULTS.read_text()) == []


def test_the_pages_that_quote_evidence_are_checked():
    """The README's status bullets and the mode guide cite RESULTS.md, so the rule reaches them."""
    checked = {str(p.relative_to(ROOT)): sum(is_checked(h, b) for h, b in sectioned_blocks(p.read_text()))
               for p in PAGES}
    assert checked["README.md"] >= 8 and checked["docs/how-to/choose-a-mode.md"] >= 4


def test_the_claims_part_is_short_and_quotes_the_generated_tables():
    claims, generated = claims_and_generated(RESULTS.read_text())
    assert len(claims.splitlines()) <= 200, "the claims part of RESULTS.md is meant to be read in one sitting"
    assert len(CLAIM_ROW.findall(claims)) >= 40
    log = (ROOT / "benchmarks" / "LOG.md").read_text()
    assert unsupported_claim_rows(claims, generated, log) == []
