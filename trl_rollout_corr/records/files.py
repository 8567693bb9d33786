"""The writer's file operations: a rank's step files, free names, write-once files (``records``)."""

from __future__ import annotations

import os
from pathlib import Path

from .schema import RecordsError


def _rank_files(folder: Path, pattern, rank: int, k: int) -> tuple[list, list]:
    """``rank``'s files in ``folder`` whose names match ``pattern`` (step number, rank), as sorted (step, path) lists:
    those at or before step ``k`` and those after it."""
    at_or_before, after = [], []
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        match = pattern.match(p.name)
        if match and int(match.group(2)) == rank:
            (at_or_before if int(match.group(1)) <= k else after).append((int(match.group(1)), p))
    return at_or_before, after


def _free_name(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... where it exists (a second resume at the same step)."""
    n, out = 0, path
    while out.exists():
        n += 1
        out = path.with_name(f"{path.name}.{n}")
    return out


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file; refuse to replace an existing file."""
    if path.exists():
        raise RecordsError(f"{path} already exists; records are never overwritten. Choose another rollout_dump_dir.")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
