"""What the console commands (``cli.py``, ``probe.py``) share: exit codes, output checks and text tables.

A leaf module (it imports nothing of this package), so ``cli.py`` and ``probe.py`` both import it and neither
imports the other.

Exit codes: ``EXIT_OK`` (0) success; ``EXIT_CHECK_FAILED`` (1) a check failed; ``EXIT_BAD_INPUT`` (2) bad input (the
message names the file and the fix; nothing is written or overwritten).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

EXIT_OK, EXIT_CHECK_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class OutputExists(ValueError):
    """An output file exists and ``--overwrite`` was not given."""


class UsageError(ValueError):
    """A flag's value cannot be parsed; the message names the flag and an example."""


def check_outputs(out: Path, names: Sequence[str], overwrite: bool) -> None:
    """Refuse when one of ``names`` already exists in ``out`` and ``overwrite`` is False (checked before any work;
    the folder is created only when the results are written).

    Raises:
        OutputExists: naming the file and the fix: ``out`` itself (or a folder above it) is an existing file, not a
            folder (``--overwrite`` never replaces a file by a folder), or one of ``names`` exists in it.
    """
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                raise OutputExists(f"--out {out}: {folder} is an existing file, not a folder; nothing was written. "
                                   "Name a folder (new or existing) for --out.")
            break
    existing = [out / n for n in names if (out / n).exists()]
    if existing and not overwrite:
        raise OutputExists(f"{existing[0]} already exists; nothing was written. Pass --overwrite to replace it, or "
                           "choose another --out.")


def format_value(value: Optional[float], kind: str = "g") -> str:
    """A number for a console table: ``"n/a"`` for None / NaN; ``kind`` ``"%"`` (percent, 1 decimal), ``"f"``
    (3 decimals) or ``"g"`` (3 significant digits, scientific below 1e-3)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if kind == "%":
        return f"{100.0 * value:.1f}%"
    if kind == "f":
        return f"{value:.3f}"
    return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width text table (first column left-aligned, the others right-aligned)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])
