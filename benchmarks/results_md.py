"""Write one script's generated section of benchmarks/RESULTS.md (between its BEGIN/END markers), keeping the rest."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def replace_section(text: str, begin: str, end: str, path: Path = RESULTS) -> None:
    """Replace the text between ``begin`` and ``end`` (both included in ``text``) or append ``text``."""
    current = path.read_text() if path.exists() else ""
    if begin in current and end in current:
        current = current[:current.index(begin)] + text + current[current.index(end) + len(end):]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(current)
