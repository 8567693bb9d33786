"""The rollout records reader: a dump opened and validated, its windows, rows and padded tensors (``records``)."""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from .routes import _ROUTE_ENCODINGS, routes_layout
from .schema import (
    _META_SCHEMA,
    _META_VERSION,
    _STEP_FILE,
    COLUMNS_BY_NAME,
    LOGS_FILE,
    PER_TOKEN_COLUMNS,
    REQUIRED_COLUMNS,
    RUN_FILE,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    STEPS_DIR,
    RecordsError,
    _pa,
    arrow_type,
)

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

    from ..config import RolloutCorrectionConfig



# ---------------------------------------------------------------------------------------------- the reader
@dataclass(frozen=True)
class Window:
    """One logged step of a dump: the steps ``first_step..logged_step`` and what was logged for them.

    Attributes:
        logged_step: the optimizer step that was logged. first_step: the first step of its window.
        metrics: every numeric value logged at that step (``rollout_corr/*``, ``loss``, ...).
        dumped: whether its rows were kept (``rollout_dump_every``).
        files: its step files (one per rank that trained rows).
        writer: the main process's writer cost up to this step (``seconds``, ``cpu_seconds``, ``bytes``, ``rows``,
            cumulative), when recorded.
        resumed_at_step: k for the first window of a run resumed from ``checkpoint-k`` (else None): its rows are
            those of steps ``first_step..logged_step``, its logged values those of ``k + 1..logged_step`` only
            (``logged_first_step``; the interrupted run logged nothing for the steps before k).
    """

    logged_step: int
    first_step: int
    metrics: dict[str, float]
    dumped: bool
    files: tuple[Path, ...]
    writer: dict = field(default_factory=dict)
    resumed_at_step: Optional[int] = None

    def contains(self, step_of_update: int) -> bool:
        """Whether the optimizer update number ``step_of_update`` (1-based) falls in this window."""
        return self.first_step <= step_of_update <= self.logged_step

    @property
    def logged_first_step(self) -> int:
        """The first update (1-based) the logged values cover: ``first_step``, or ``resumed_at_step + 1``."""
        return self.first_step if self.resumed_at_step is None else max(self.first_step, self.resumed_at_step + 1)

    def logged_values_cover(self, step_of_update: int) -> bool:
        """Whether the logged values of this window count the update ``step_of_update`` (1-based)."""
        return self.logged_first_step <= step_of_update <= self.logged_step


def _version_tuple(text: Any, where: Path) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise RecordsError(f"{where}: schema_version {text!r} is not 'major.minor'; the file is not a rollout dump "
                           "written by trl-rollout-corr (or it was edited).")
    return int(match.group(1)), int(match.group(2))


def check_schema_version(version: Any, where: Path) -> None:
    """Accept this major version (any minor: a newer minor only adds optional columns, read or ignored).

    Raises:
        RecordsError: another major version, naming the file and the fix.
    """
    major, minor = _version_tuple(version, where)
    ours_major, ours_minor = _version_tuple(SCHEMA_VERSION, where)
    if major != ours_major:
        raise RecordsError(
            f"{where}: rollout records schema {version}, but this trl-rollout-corr reads schema {SCHEMA_VERSION} "
            f"(major {ours_major}) only. Read the dump with the trl-rollout-corr release that wrote it (run.json: "
            "versions), or re-record it with this one."
        )
    if minor > ours_minor:
        warnings.warn(f"{where}: schema {version} is newer than {SCHEMA_VERSION}; columns this version does not know "
                      "are ignored.", stacklevel=3)


class RolloutDump:
    """A rollout dump opened for reading; everything is validated before it is used.

    Args:
        path: the dump folder (a ``rollout_dump_dir``).

    Attributes:
        path, metadata (``run.json``), windows (one ``Window`` per ``logs.jsonl`` line, in step order; step files
        that no line claims, from a run that stopped before logging them, become windows without logged values,
        with a warning).

    Raises:
        RecordsError: not a dump, unreadable or invalid ``run.json`` / ``logs.jsonl``, or another schema major
            version (each message names the file and the fix).
    """

    def __init__(self, path: os.PathLike | str) -> None:
        self.path = Path(path)
        run_file = self.path / RUN_FILE
        if not self.path.is_dir():
            raise RecordsError(f"{self.path}: no such folder. Pass the rollout_dump_dir of a run trained with "
                               "rollout_dump_dir set.")
        if not run_file.is_file():
            raise RecordsError(f"{self.path} is not a rollout dump (no {RUN_FILE}). Pass the rollout_dump_dir of a "
                               "run trained with rollout_dump_dir set.")
        self.metadata = _read_json(run_file)
        if self.metadata.get("schema") != SCHEMA_NAME:
            raise RecordsError(f"{run_file}: schema {self.metadata.get('schema')!r} is not {SCHEMA_NAME!r}; this is "
                               "not a trl-rollout-corr rollout dump.")
        check_schema_version(self.metadata.get("schema_version"), run_file)
        self.windows = self._read_windows()

    def _read_windows(self) -> list[Window]:
        logs_file = self.path / LOGS_FILE
        files: dict[int, list[Path]] = {}
        steps_dir = self.path / STEPS_DIR
        for p in sorted(steps_dir.iterdir()) if steps_dir.is_dir() else ():
            match = _STEP_FILE.match(p.name)
            if match:
                files.setdefault(int(match.group(1)), []).append(p)
        windows = []
        if logs_file.is_file():
            for lineno, line in enumerate(logs_file.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    step = int(entry["logged_step"])
                    resumed = entry.get("resumed_at_step")
                    windows.append(Window(step, int(entry["first_step"]), dict(entry.get("metrics", {})),
                                          bool(entry.get("dumped", True)), tuple(files.pop(step, ())),
                                          dict(entry.get("writer", {})), None if resumed is None else int(resumed)))
                except (ValueError, KeyError, TypeError) as e:
                    raise RecordsError(f"{logs_file}:{lineno}: not a logs.jsonl line of a rollout dump ({e}). Restore "
                                       "the line from the run or delete it (that step is then not analysed).") from e
        for step in sorted(files):  # rows written but never logged (the run stopped in between): not checkable
            warnings.warn(f"{files[step][0]}: no line of {logs_file} claims logged step {step} (the run stopped "
                          "before logging it?); its rows are read, but there are no logged values to check.",
                          stacklevel=3)
            previous = max((w.logged_step for w in windows if w.logged_step < step), default=0)
            windows.append(Window(step, previous + 1, {}, True, tuple(files[step])))
        return sorted(windows, key=lambda w: w.logged_step)

    # ------------------------------------------------------------------ reading rows
    def read_table(self, windows: Optional[Iterable[Window]] = None) -> "pa.Table":
        """The rows of ``windows`` (default: all), every file validated, as one Arrow table.

        Raises:
            RecordsError: a file that is not readable Parquet (truncated, corrupt), of another schema version, with
                a required column missing, a column of the wrong type, or a per-token list whose length differs from
                its completion (the message names the file, the column or row, and the fix).
        """
        pa = _pa()
        tables = [read_step_file(p) for w in (self.windows if windows is None else windows) for p in w.files]
        if not tables:
            return pa.table({c: pa.array([], arrow_type(COLUMNS_BY_NAME[c].type)) for c in REQUIRED_COLUMNS})
        return pa.concat_tables(tables, promote_options="default")

    def to_dataset(self, windows: Optional[Iterable[Window]] = None):
        """The rows as a ``datasets.Dataset`` (Arrow-backed, no copy), for browsing and filtering."""
        import datasets

        return datasets.Dataset(self.read_table(windows))

    def correction_config(self) -> "RolloutCorrectionConfig":
        """The ``RolloutCorrectionConfig`` the run trained with (``run.json: correction``).

        Raises:
            RecordsError: ``run.json`` has no valid correction config.
        """
        from ..config import CORRECTION_FIELDS, RolloutCorrectionConfig, unset_inert_settings

        stored = self.metadata.get("correction") or {}
        try:  # a dump written before the core config refused inert settings may hold a switched-off preset's
            return RolloutCorrectionConfig(**unset_inert_settings({k: stored[k] for k in CORRECTION_FIELDS
                                                                    if k in stored}))
        except (TypeError, ValueError) as e:
            raise RecordsError(f"{self.path / RUN_FILE}: the stored correction config is invalid ({e}).") from e

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """The response-length slice edges the trainer's metrics used (``run.json: correction.length_buckets``)."""
        from ..correction import DEFAULT_LENGTH_BUCKETS

        return tuple(self.metadata.get("correction", {}).get("length_buckets", DEFAULT_LENGTH_BUCKETS))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecordsError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); the file is truncated or was "
                           "edited. Restore it from the run.") from e
    if not isinstance(data, dict):
        raise RecordsError(f"{path}: expected a JSON object.")
    return data


def read_step_file(path: Path) -> "pa.Table":
    """One step file, validated (see ``RolloutDump.read_table`` for the errors)."""
    pa = _pa()
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
        meta = parquet.schema_arrow.metadata or {}
        table = parquet.read()
    except (pa.ArrowException, OSError) as e:
        raise RecordsError(
            f"{path}: not a readable Parquet file ({e}); it is truncated or corrupt (an interrupted copy?). Restore "
            "it from the run, or delete it to analyse the other steps (its step is then reported as missing)."
        ) from e
    if meta.get(_META_SCHEMA) != SCHEMA_NAME.encode():
        raise RecordsError(f"{path}: no {SCHEMA_NAME} schema tag in its Parquet metadata; not a rollout records file.")
    check_schema_version(meta.get(_META_VERSION, b"").decode(), path)
    for name in REQUIRED_COLUMNS:
        if name not in table.column_names:
            raise RecordsError(f"{path}: required column {name!r} is missing (schema {SCHEMA_VERSION}); the file was "
                               "not written by this schema version's writer.")
    for name in table.column_names:
        column = COLUMNS_BY_NAME.get(name)
        if column is None:
            continue  # a newer minor version's optional column: ignored
        expected = arrow_type(column.type)
        if not table.schema.field(name).type.equals(expected) and not pa.types.is_null(table.schema.field(name).type):
            raise RecordsError(f"{path}: column {name!r} has type {table.schema.field(name).type}, expected "
                               f"{expected} (schema {SCHEMA_VERSION}).")
    n_tokens = pc.list_value_length(table.column("completion_ids"))
    for name in PER_TOKEN_COLUMNS:
        if name not in table.column_names:
            continue
        lengths = pc.list_value_length(table.column(name))
        bad = pc.and_(pc.is_valid(lengths), pc.not_equal(lengths, n_tokens))
        if pc.any(bad).as_py():
            row = pc.index(bad, True).as_py()
            raise RecordsError(f"{path}: row {row}: column {name!r} has {lengths[row]} entries for "
                               f"{n_tokens[row]} completion tokens (per-token columns are never padded).")
    _check_routes(table, path)
    known = [n for n in table.column_names if n in COLUMNS_BY_NAME]
    return table.select(known)


def _check_routes(table: "pa.Table", path: Path) -> None:
    """``routes_packed``: a layout in the field's metadata and L*k ids per prompt and completion token of each row."""
    import pyarrow.compute as pc

    if "routes_packed" not in table.column_names or table.column("routes_packed").null_count == table.num_rows:
        return
    try:
        layout = routes_layout(table)
        size = int(layout["layers"]) * int(layout["top_k"]) * _ROUTE_ENCODINGS[layout["encoding"]][0].itemsize
    except (TypeError, KeyError, ValueError) as e:
        raise RecordsError(f"{path}: column 'routes_packed' has no valid layout metadata ({e!r}); the file was not "
                           "written by this schema version's writer.") from e
    positions = pc.add(pc.list_value_length(table.column("prompt_ids")),
                       pc.list_value_length(table.column("completion_ids")))
    lengths = pc.binary_length(table.column("routes_packed"))
    bad = pc.and_(pc.is_valid(lengths), pc.not_equal(lengths, pc.multiply(positions, size)))
    if pc.any(bad).as_py():
        row = pc.index(bad, True).as_py()
        raise RecordsError(f"{path}: row {row}: column 'routes_packed' has {lengths[row]} bytes for {positions[row]} "
                           f"tokens x {size} bytes ({layout}); the file is corrupt.")


def open_dump(path: os.PathLike | str) -> RolloutDump:
    """``RolloutDump(path)``: open and validate a dump's ``run.json`` and ``logs.jsonl``."""
    return RolloutDump(path)


# ---------------------------------------------------------------------------------------------- padded tensors
def padded(table: "pa.Table", name: str, *, fill: float = 0.0, dtype: torch.dtype = torch.float32,
           width: Optional[int] = None) -> torch.Tensor:
    """A list column as a right-padded ``(N, width)`` tensor (``fill`` after each row's end; null rows all ``fill``).

    Args:
        table: rows of a dump. name: a list column (per-token or ``prompt_ids`` / ``rewards``).
        width: the padded width; default the longest row.
    """
    import pyarrow.compute as pc

    column = table.column(name).combine_chunks()
    n = len(column)
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    width = int(lengths_t.max()) if width is None and n else (width or 0)
    out = torch.full((n, width), fill, dtype=dtype)
    if n and width:
        values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
        mask = torch.arange(width).expand(n, width) < lengths_t.unsqueeze(1)
        out[mask] = torch.tensor(values).to(dtype)
    return out
