"""The rollout records writer: ``MicroBatch`` rows into Parquet, ``run.json``, ``logs.jsonl`` (``records``)."""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from .files import _free_name, _rank_files, _write_new
from .metadata import _json_safe
from .reader import _read_json
from .routes import ROUTES_FIELD_META, pack_routes, routes_encoding, routes_layout
from .schema import (
    _META_SCHEMA,
    _META_VERSION,
    _OPEN_WINDOW_FILE,
    _STEP_FILE,
    COLUMNS,
    COLUMNS_BY_NAME,
    LOGS_FILE,
    OPEN_WINDOW_DIR,
    PER_TOKEN_COLUMNS,
    RUN_FILE,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    STEPS_DIR,
    RecordsError,
    _pa,
    arrow_type,
    termination_of,
)


# ---------------------------------------------------------------------------------------------- the writer
@dataclass
class MicroBatch:
    """One trained micro-batch, padded as the trainer holds it (all tensors on any device; B local rows).

    Attributes:
        step: learner step at use. generation_step: learner step at arrival. generation_batch: the generation
            batch's index on this rank.
        prompt_ids, prompt_mask: (B, P) left-padded prompts and their 0/1 mask.
        completion_ids, completion_mask: (B, T) right-padded completions and TRL's 0/1 completion mask.
        rollout_log_probs: (B, T) mu, nats.
        advantages: (B,) float. generation_row: (B,) int, the row in the generation batch.
        rewards: (B, F) float or None. times: (B, 2) float64 unix seconds (start, end) or None.
        routes: (B, P + T, L, k) int16 expert ids aligned with ``cat(prompt_ids, completion_ids)`` (``-1`` at
            padding: ``routing.pad_routes``), or None; ``num_experts`` E with it (``pack_routes``).
        per_token: optional (B, T) columns by record name (``tool_mask``, ``old_log_probs``, ``log_probs``,
            ``ref_log_probs``, ``rollout_is_weights``, ``rollout_rs_mask``, or a reserved one); None values skipped.
    """

    step: int
    generation_step: int
    generation_batch: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    advantages: torch.Tensor
    generation_row: torch.Tensor
    rewards: Optional[torch.Tensor] = None
    times: Optional[torch.Tensor] = None
    per_token: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    policy_version: Optional[torch.Tensor] = None  # (B,) int, spec 7; None: not recorded (generation_step then)
    routes: Optional[torch.Tensor] = None  # (B, P + T, L, k) int16 MoE routes as the batch holds them (-1 padding)
    num_experts: Optional[int] = None  # E of the MoE layers (the routes' packing: uint8 when E <= 255)


_TORCH_FOR = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
              "float32": torch.float32, "float64": torch.float64}


def completion_lengths(completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                       pad_token_id: Optional[int]) -> torch.Tensor:
    """(B,) the number of generated tokens per row of right-padded completions.

    The extent of TRL's completion mask (1 for every generated token); for a row whose mask TRL zeroed (a truncated
    completion under ``mask_truncated_completions``) the row without its trailing pad tokens (such a row ends in a
    non-pad token, so nothing real is stripped).
    """
    B, T = completion_ids.shape
    positions = torch.arange(1, T + 1, device=completion_ids.device).expand(B, T)
    mask_extent = torch.where(completion_mask != 0, positions, 0).amax(dim=1) if T else completion_ids.new_zeros(B)
    if pad_token_id is None:
        return torch.where(mask_extent > 0, mask_extent, T)
    non_pad_extent = torch.where(completion_ids != pad_token_id, positions, 0).amax(dim=1) if T else mask_extent
    return torch.where(mask_extent > 0, mask_extent, non_pad_extent)


def _owned(values: torch.Tensor, value_type: str):
    """A primitive Arrow array of ``value_type`` (``int8`` ... ``float64``) holding ``values`` (any shape, any device;
    flattened in C order), copied into a buffer of Arrow's memory pool.

    Never a view of torch memory: ``pa.array`` over a CPU tensor's numpy view is zero-copy, and such an array pins the
    tensor's whole storage (a micro-batch row slice pins its generation batch's) and aliases memory the trainer still
    owns until the window is written (issue 21).
    """
    pa = _pa()
    flat = values.detach().to(_TORCH_FOR[value_type]).reshape(-1).cpu()
    buffer = pa.allocate_buffer(flat.numel() * flat.element_size())
    if flat.numel():
        host = flat.numpy()
        np.frombuffer(buffer, dtype=host.dtype)[:] = host
    return pa.Array.from_buffers(arrow_type(value_type), flat.numel(), [None, buffer])


def _list_array(padded: torch.Tensor, lengths: torch.Tensor, value_type: str, *,
                keep: Optional[torch.Tensor] = None):
    """An Arrow list array with row i = ``padded[i, :lengths[i]]``, or the entries of ``keep`` (a (B, T) bool mask
    with ``lengths`` ones per row, in row order) when given; its buffers are Arrow's own (``_owned``)."""
    pa = _pa()
    B, T = padded.shape
    if keep is None:
        keep = torch.arange(T, device=padded.device).expand(B, T) < lengths.unsqueeze(1)
    offsets = torch.zeros(B + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths.cpu().to(torch.int64), 0).to(torch.int32)
    return pa.ListArray.from_arrays(_owned(offsets, "int32"), _owned(padded[keep], value_type))


def terminations(completion_ids: torch.Tensor, lengths: torch.Tensor, max_completion_length: Optional[int],
                 eos_token_ids: Sequence[int]) -> list[str]:
    """``termination_of`` for every row of right-padded ``(B, T)`` completions with ``lengths`` generated tokens."""
    B, T = completion_ids.shape
    if T == 0:
        return [termination_of([], max_completion_length, eos_token_ids) for _ in range(B)]
    last = completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    eos = torch.tensor(list(eos_token_ids) or [-1], device=completion_ids.device)
    is_eos = (lengths > 0) & torch.isin(last, eos)
    full = lengths >= max_completion_length if max_completion_length is not None else torch.zeros_like(is_eos)
    return ["eos" if e else ("length" if f else "other") for e, f in zip(is_eos.tolist(), full.tolist())]


class RolloutRecordWriter:
    """Writes rollout records into a dump folder (see the ``records`` package docstring); one writer per rank.

    Args:
        dump_dir: the dump folder (created; must not already hold a dump).
        rank, world_size: this process and the number of processes; each rank writes its own step files.
        is_main_process: writes ``run.json`` and ``logs.jsonl``.
        every: keep one logged window in ``every`` (``rollout_dump_every``); skipped windows still get their
            ``logs.jsonl`` line (``dumped: false``).
        eos_token_ids, pad_token_id, max_completion_length: used for ``termination`` and the completion lengths.

    Attributes:
        seconds, cpu_seconds: wall and process CPU time spent in ``add`` and ``end_window`` (the writer's cost to
            the training steps; cumulative, also in each ``logs.jsonl`` line under ``writer``).
        bytes_written: bytes of Parquet written by this rank. rows_written: rows written by this rank.

    Raises:
        RecordsError: a step file would be overwritten; ``dump_dir`` already holds a dump (``run.json``) of other
            settings (``write_run_metadata``), or of which this run is no continuation (its first trained step is
            0: ``add``); a resume inside a logging window whose rows before the checkpoint are in no file of the
            dump (``add``). See the ``records`` docstring, "Writing never overwrites" and "Resuming".
    """

    def __init__(self, dump_dir: os.PathLike | str, *, rank: int = 0, world_size: int = 1,
                 is_main_process: bool = True, every: int = 1, eos_token_ids: Sequence[int] = (),
                 pad_token_id: Optional[int] = None, max_completion_length: Optional[int] = None) -> None:
        if int(every) < 1:
            raise RecordsError(f"rollout_dump_every must be >= 1 (one logged window in N is kept), got {every!r}.")
        _pa()
        self.dump_dir = Path(dump_dir)
        self.rank, self.world_size, self.is_main_process = int(rank), int(world_size), bool(is_main_process)
        self.every = int(every)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_completion_length = max_completion_length
        self._existing = self.is_main_process and (self.dump_dir / RUN_FILE).exists()  # continued or refused
        self._begun = False  # the first trained step decides: 0 a new dump, k > 0 a resumed run's continuation
        self._batch_offset = 0  # resumed: generation batches numbered after the kept ones
        self._resumed_at: Optional[int] = None
        self._restored: Optional[dict] = None  # the counts of the checkpoint resumed from (load_state_dict)
        (self.dump_dir / STEPS_DIR).mkdir(parents=True, exist_ok=True)
        self._batches: list = []
        self._routes_layout: Optional[dict] = None  # routes_packed's layout (the first batch with routes)
        self._micro_step = 0
        self._windows = 0
        self._previous_logged_step = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.bytes_written = 0
        self.rows_written = 0

    # ------------------------------------------------------------------ once per run
    def write_run_metadata(self, metadata: Mapping[str, Any]) -> None:
        """Write ``run.json`` with a new ``run_id`` (main process only; a no-op elsewhere). Where the folder already
        holds one, nothing is written: its content must be this run's (a resumed run continues the dump).

        Raises:
            RecordsError: the existing ``run.json`` is of another schema version or of other settings (names the
                first differing field and the fix).
        """
        if not self.is_main_process:
            return
        payload = {**_json_safe(dict(metadata)), "world_size": self.world_size, "rollout_dump_every": self.every}
        if self._existing:
            self._check_same_run(json.loads(json.dumps(payload, sort_keys=True)))
            return
        payload["run_id"] = payload.get("run_id") or uuid.uuid4().hex
        _write_new(self.dump_dir / RUN_FILE, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())

    def _check_same_run(self, ours: Mapping[str, Any]) -> None:
        path = self.dump_dir / RUN_FILE
        stored = _read_json(path)
        if stored.get("schema") != SCHEMA_NAME or stored.get("schema_version") != SCHEMA_VERSION:
            raise RecordsError(
                f"{path}: a dump of schema {stored.get('schema')!r} {stored.get('schema_version')!r}, this writer "
                f"writes {SCHEMA_NAME!r} {SCHEMA_VERSION!r}: a resumed run can only continue a dump of its own "
                "schema. Choose another rollout_dump_dir."
            )
        for key in _SAME_RUN_FIELDS:
            a, b = stored.get(key), ours.get(key)
            if key == "trainer" and isinstance(a, dict) and isinstance(b, dict):
                a, b = ({k: v for k, v in d.items() if k != "max_steps"} for d in (a, b))
            if a != b:
                raise RecordsError(
                    f"{path} holds the dump of a run with other settings ({key}: {_first_difference(a, b)}); records "
                    "are never overwritten and only a run resumed from its checkpoint continues a dump. Choose "
                    "another rollout_dump_dir, or move the old dump away."
                )

    def _begin(self, step: int) -> None:
        """At the first trained step ``step``: a new dump (0), or the continuation of a resumed run (k > 0: the
        windows logged after k are moved aside, the window count and generation batches continue)."""
        if self._begun:
            return
        self._begun = True
        if step <= 0:
            if self._existing:
                raise RecordsError(
                    f"{self.dump_dir} already holds a rollout dump ({RUN_FILE}) and this run starts at step 0; "
                    "records are never overwritten (only a run resumed from a checkpoint continues a dump). To "
                    "continue that run after a crash, resume it (trainer.train(resume_from_checkpoint=True), or the "
                    "recipe's --resume_from_checkpoint <output_dir>/checkpoint-<step>); to start a new run, choose "
                    "another rollout_dump_dir, or move the old dump away."
                )
            return
        self._continue_at(int(step))

    def _continue_at(self, k: int) -> None:
        """Continue the dump at checkpoint ``k`` (the resumed run's first trained step; ``records`` docstring,
        "Resuming"): the windows logged after ``k`` and this rank's step files and open-window files after ``k`` move
        to ``superseded/resume-at-<k>/``; the rows of the window still open at ``k`` (steps ``previous + 1..k``,
        trained before the checkpoint) are taken back into the buffer from the first file of the interrupted run
        that holds them (``open-window/checkpoint-<k>``, else the later step or open-window file); the window, batch
        and micro-batch counts continue from the checkpoint's (``load_state_dict``), else after the kept rows
        (``_dump_counts``). What moved and what was taken back is counted in
        ``resume.rank-<r>.json`` there.

        Raises:
            RecordsError: the open window's rows are in no file of the dump (module docstring, the fix named).
        """
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        aside = self.dump_dir / "superseded" / f"resume-at-{k:08d}"
        logs = self.dump_dir / LOGS_FILE
        lines = logs.read_text(encoding="utf-8").splitlines(keepends=True) if logs.is_file() else []
        keep, later = [], []
        previous = 0  # the last logged step at or before k: the open window is previous + 1..
        for line in lines:
            try:
                logged = int(json.loads(line)["logged_step"])
            except (ValueError, KeyError, TypeError):
                keep.append(line)  # the reader names a bad line; it is not this writer's to drop
                continue
            if logged <= k:
                keep.append(line)
                previous = max(previous, logged)
            else:
                later.append(line)
        self._windows = sum(1 for line in keep if line.strip())
        if self._restored is not None:  # the counts at the checkpoint (load_state_dict), else from the dump
            self._windows = int(self._restored["windows"])
        kept_files, later_files = _rank_files(self.dump_dir / STEPS_DIR, _STEP_FILE, self.rank, k)
        open_files = _rank_files(self.dump_dir / OPEN_WINDOW_DIR, _OPEN_WINDOW_FILE, self.rank, k - 1)[1]
        # the open window's rows (step column previous..k-1): the open-window file of checkpoint k, else the first
        # later file (a step file of the window, or an open-window file of a later checkpoint in it)
        exact = [path for step, path in open_files if step == k]
        source = exact[0] if exact else min(later_files + open_files, default=(None, None))[1]
        restored = None
        if source is not None:
            table = pq.read_table(source)
            steps = table.column("step")
            restored = table.filter(pc.and_(pc.greater_equal(steps, previous), pc.less(steps, k)))
        window_kept = self._windows % self.every == 0
        if (restored is None or not restored.num_rows) and window_kept and k > previous and (
                kept_files or later_files or open_files):
            raise RecordsError(
                f"{self.dump_dir}: resuming at step {k}, the rows rank {self.rank} trained at steps "
                f"{previous + 1}..{k} (before checkpoint-{k}, in a window not logged by then) are in no file of the "
                f"dump (no {OPEN_WINDOW_DIR}/checkpoint-{k:08d}.rank-{self.rank:05d}.parquet, no later step file): "
                "the interrupted run stopped before writing them. Resume from a checkpoint at a logged step "
                "(save_steps a multiple of logging_steps), or continue into a new rollout_dump_dir."
            )
        report = {"resumed_at_step": k, "open_window_first_step": previous + 1, "restored_rows": 0,
                  "restored_from": None, "superseded_rows": 0, "moved": []}
        if restored is not None and restored.num_rows:
            self._batches = restored.to_batches()
            self._routes_layout = routes_layout(restored)
            report["restored_rows"] = restored.num_rows
        if self._restored is not None:
            self._batch_offset, self._micro_step = (int(self._restored[n]) for n in ("batch_offset", "micro_step"))
        else:
            self._batch_offset, self._micro_step = _dump_counts(kept_files, restored)
        last_written = max((step for step, _ in later_files), default=0)
        for folder, files in (("", later_files), (OPEN_WINDOW_DIR, [f for f in open_files if f[0] > k])):
            for step, path in files:  # trained again by this run: the interrupted run's rows move aside
                (aside / folder).mkdir(parents=True, exist_ok=True)
                target = _free_name(aside / folder / path.name)
                after = pq.read_table(path, columns=["step"]).column("step")
                rows_after = int(pc.sum(pc.greater_equal(after, k)).as_py() or 0)
                os.replace(path, target)
                if path == source:
                    source = target
                report["moved"].append({"file": str(target.relative_to(self.dump_dir)), "rows": len(after),
                                        "rows_after_checkpoint": rows_after})
                if not folder or step > last_written:  # an open-window file of a window no step file holds
                    report["superseded_rows"] += rows_after
        if report["restored_rows"]:
            report["restored_from"] = str(source.relative_to(self.dump_dir))
        if report["moved"] or report["restored_rows"]:
            aside.mkdir(parents=True, exist_ok=True)
            _write_new(_free_name(aside / f"resume.rank-{self.rank:05d}.json"),
                       (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
        if report["restored_rows"] and not exact:  # the open window at k, as checkpoint k's file holds it
            self._write_open_window(k)
        self._previous_logged_step = previous
        self._resumed_at = k
        if self.is_main_process and later:
            aside.mkdir(parents=True, exist_ok=True)
            _free_name(aside / LOGS_FILE).write_text("".join(later), encoding="utf-8")
            tmp = logs.with_name(logs.name + f".tmp-{os.getpid()}")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, logs)

    # ------------------------------------------------------------------ every checkpoint
    def state_dict(self) -> dict:
        """This rank's counts at a checkpoint (``RolloutRecords.state_dict``): windows closed, micro-batches
        recorded, the generation-batch offset, bytes / rows written and the writer's seconds. A run resumed from it
        continues them (``load_state_dict``) instead of recounting the dump's kept files (``_continue_at``), which
        miss what ``rollout_dump_every`` did not keep."""
        return {"windows": self._windows, "micro_step": self._micro_step, "batch_offset": self._batch_offset,
                "bytes_written": self.bytes_written, "rows_written": self.rows_written, "seconds": self.seconds,
                "cpu_seconds": self.cpu_seconds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue ``state_dict()``'s counts: the totals at once, the window, micro-batch and generation-batch
        counts when the dump continues (``_continue_at``, at the resumed run's first trained step)."""
        self._restored = dict(state)
        self.bytes_written, self.rows_written = int(state["bytes_written"]), int(state["rows_written"])
        self.seconds, self.cpu_seconds = float(state["seconds"]), float(state["cpu_seconds"])

    def save_open_window(self, step: int) -> Optional[Path]:
        """At checkpoint ``step`` (the Trainer saved ``checkpoint-<step>``; called on every rank): write this rank's
        rows buffered since the last logged step (a window still open: ``save_steps`` not a multiple of
        ``logging_steps``) to ``open-window/checkpoint-<step>.rank-<r>.parquet``, so a run resumed from that
        checkpoint continues the window with them; this rank's older open-window files (subsets of it) are removed.
        Nothing is written with nothing buffered or for a window ``rollout_dump_every`` does not keep. The file is a
        copy: ``end_window`` removes it once the window's step file is written.

        Returns:
            The path written, or None.
        """
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            if not self._batches or self._windows % self.every != 0:
                return None
            return self._write_open_window(int(step))
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0

    def _write_open_window(self, step: int) -> Path:
        import pyarrow.parquet as pq

        folder = self.dump_dir / OPEN_WINDOW_DIR
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"checkpoint-{step:08d}.rank-{self.rank:05d}.parquet"
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        pq.write_table(self._table(-1), tmp, compression="zstd")
        os.replace(tmp, path)  # a copy of buffered rows, not records: the latest checkpoint at step wins
        self._remove_open_windows(before=step)
        return path

    def _remove_open_windows(self, before: int) -> None:
        """Remove this rank's open-window files of checkpoints before step ``before`` (copies of rows now in a
        newer open-window file or in a step file, or of a window not kept)."""
        for step, path in _rank_files(self.dump_dir / OPEN_WINDOW_DIR, _OPEN_WINDOW_FILE, self.rank, before - 1)[0]:
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ every micro-batch
    def add(self, batch: MicroBatch) -> None:
        """Buffer one trained micro-batch until the next ``end_window``; copies its rows to the host.

        Raises:
            RecordsError: a per-token column does not have the completions' (B, T) shape, or an unknown column; at a
                resumed run's first step, the open window's rows are in no file of the dump (``_continue_at``).
        """
        self._begin(int(batch.step))
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            self._batches.append(self._record_batch(batch))
            self._micro_step += 1
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0

    def _record_batch(self, b: MicroBatch):
        pa = _pa()
        B, T = b.completion_ids.shape
        lengths = completion_lengths(b.completion_ids, b.completion_mask, self.pad_token_id)
        prompt_lengths = (b.prompt_mask != 0).sum(dim=1)
        columns: dict[str, Any] = {
            "logged_step": pa.array([-1] * B, pa.int64()),  # set at end_window
            "step": pa.array([int(b.step)] * B, pa.int64()),
            "rank": pa.array([self.rank] * B, pa.int32()),
            "micro_step": pa.array([self._micro_step] * B, pa.int64()),
            "generation_batch": pa.array([int(b.generation_batch) + self._batch_offset] * B, pa.int64()),
            "generation_row": _owned(b.generation_row, "int32"),
            "generation_step": pa.array([int(b.generation_step)] * B, pa.int64()),
            "prompt_ids": _list_array(b.prompt_ids.to(torch.int32), prompt_lengths, "int32",
                                      keep=b.prompt_mask != 0),
            "completion_ids": _list_array(b.completion_ids.to(torch.int32), lengths, "int32"),
            "completion_mask": _list_array(b.completion_mask.to(torch.int8), lengths, "int8"),
            "rollout_log_probs": _list_array(b.rollout_log_probs.detach().float(), lengths, "float32"),
            "advantage": _owned(b.advantages.reshape(B, -1)[:, 0], "float32"),
            "termination": pa.array(terminations(b.completion_ids, lengths, self.max_completion_length,
                                                 self.eos_token_ids), pa.string()),
        }
        if b.policy_version is not None:
            columns["policy_version"] = _owned(b.policy_version, "int64")
        if b.routes is not None:
            columns["routes_packed"] = self._routes_column(b, lengths)
        times = b.times if b.times is not None else torch.full((B, 2), float("nan"), dtype=torch.float64)
        times = times.reshape(B, 2)
        columns["generation_start_time"] = _owned(times[:, 0], "float64")
        columns["generation_end_time"] = _owned(times[:, 1], "float64")
        rewards = b.rewards if b.rewards is not None else torch.zeros(B, 0)
        rewards = rewards.detach().float().reshape(B, -1)
        columns["rewards"] = _list_array(rewards, torch.full((B,), rewards.shape[1]), "float32")
        for name, tensor in b.per_token.items():
            if tensor is None:
                continue
            column = COLUMNS_BY_NAME.get(name)
            if column is None or not column.per_token:
                raise RecordsError(
                    f"Unknown per-token record column {name!r}; known: {', '.join(PER_TOKEN_COLUMNS)}."
                )
            if tuple(tensor.shape) != (B, T):
                raise RecordsError(
                    f"Record column {name!r} has shape {tuple(tensor.shape)}, expected (B, T) = {(B, T)}."
                )
            inner = column.type[5:-1]
            columns[name] = _list_array(tensor.detach().to(_TORCH_FOR[inner]), lengths, inner)
        return pa.RecordBatch.from_pydict({name: columns[name] for name in _column_order(columns)})

    def _routes_column(self, b: MicroBatch, lengths: torch.Tensor):
        """``routes_packed`` of a micro-batch: each row's prompt and completion positions (``records.routes``).

        Raises:
            RecordsError: routes without ``num_experts``, of the wrong shape, or of another layout than earlier ones.
        """
        B, T = b.completion_ids.shape
        if b.num_experts is None:
            raise RecordsError("MicroBatch.routes needs num_experts (the packing depends on E).")
        keep = torch.cat([b.prompt_mask.to(b.routes.device) != 0,
                          torch.arange(T, device=b.routes.device).expand(B, T)
                          < lengths.to(b.routes.device).unsqueeze(1)], dim=1)
        if b.routes.dim() != 4 or tuple(b.routes.shape[:2]) != tuple(keep.shape):
            raise RecordsError(f"MicroBatch.routes has shape {tuple(b.routes.shape)}, expected (B, P + T, L, k) "
                               f"with (B, P + T) = {tuple(keep.shape)}.")
        layout = {"encoding": routes_encoding(b.num_experts), "layers": int(b.routes.shape[2]),
                  "top_k": int(b.routes.shape[3])}
        if self._routes_layout not in (None, layout):
            raise RecordsError(f"MicroBatch.routes layout {layout} differs from this run's {self._routes_layout}.")
        self._routes_layout = layout
        return pack_routes(b.routes, keep, layout["encoding"])

    # ------------------------------------------------------------------ every logged step
    def end_window(self, logged_step: int, logs: Mapping[str, Any]) -> Optional[Path]:
        """Close the window of steps up to ``logged_step``: write this rank's rows (if any, and if the window is
        kept) and, on the main process, the ``logs.jsonl`` line with the logged values.

        A call with nothing buffered and no ``rollout_corr/*`` value (e.g. the Trainer's closing summary log right
        after a logged last step) writes nothing.

        Returns:
            The Parquet path written by this rank, or None.

        Raises:
            RecordsError: the step file already exists (nothing is overwritten).
        """
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            has_metrics = any(str(k).startswith("rollout_corr/") for k in logs)
            if not self._batches and not has_metrics:
                return None
            self._begin(int(logged_step) - 1)  # a window with no trained rows: the latest step it can start at
            keep = self._windows % self.every == 0
            self._windows += 1
            path = self._write_rows(int(logged_step)) if keep else None
            self._batches = []
            self._remove_open_windows(before=int(logged_step))  # their rows are in the step file now (or not kept)
            if self.is_main_process:
                line = {"logged_step": int(logged_step), "first_step": self._previous_logged_step + 1,
                        "dumped": keep, "metrics": _json_safe(_numeric(logs)),
                        "writer": {"seconds": self.seconds + time.perf_counter() - t0,
                                   "cpu_seconds": self.cpu_seconds + time.process_time() - c0,
                                   "bytes": self.bytes_written, "rows": self.rows_written}}
                if self._resumed_at is not None:  # the first window of a resumed run
                    line["resumed_at_step"], self._resumed_at = self._resumed_at, None
                with open(self.dump_dir / LOGS_FILE, "a", encoding="utf-8") as f:
                    f.write(json.dumps(line, sort_keys=True) + "\n")
            self._previous_logged_step = int(logged_step)
            return path
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0

    def _table(self, logged_step: int):
        """The buffered rows as one Arrow table, ``logged_step`` set, with the schema and routes metadata."""
        pa = _pa()
        table = pa.Table.from_batches(_unify(self._batches))
        table = table.set_column(table.schema.get_field_index("logged_step"), "logged_step",
                                 pa.array([logged_step] * table.num_rows, pa.int64()))
        if self._routes_layout is not None and "routes_packed" in table.column_names:
            i = table.schema.get_field_index("routes_packed")
            table = table.set_column(i, table.schema.field(i).with_metadata(
                {ROUTES_FIELD_META: json.dumps(self._routes_layout, sort_keys=True).encode()}), table.column(i))
        return table.replace_schema_metadata({_META_SCHEMA: SCHEMA_NAME.encode(),
                                              _META_VERSION: SCHEMA_VERSION.encode()})

    def _write_rows(self, logged_step: int) -> Optional[Path]:
        if not self._batches:
            return None
        import pyarrow.parquet as pq

        table = self._table(logged_step)
        path = self.dump_dir / STEPS_DIR / f"step-{logged_step:08d}.rank-{self.rank:05d}.parquet"
        if path.exists():
            raise RecordsError(f"{path} already exists; records are never overwritten (a second run into the same "
                               "rollout_dump_dir?). Choose another rollout_dump_dir.")
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        self.bytes_written += path.stat().st_size
        self.rows_written += table.num_rows
        return path


def _dump_counts(kept_files: list, restored) -> tuple[int, int]:
    """(generation-batch offset, micro-step) after the rows of the kept step files ``kept_files`` ((step, path)) and
    the open window's ``restored`` table: each one past the largest in them (what a writer without the checkpoint's
    counts continues from)."""
    import pyarrow.parquet as pq

    tables = [pq.read_table(path, columns=["generation_batch", "micro_step"]) for _, path in kept_files]
    tables += [restored] if restored is not None and restored.num_rows else []
    batches = [b for t in tables for b in t.column("generation_batch").to_pylist() if b is not None]
    micro = [m for t in tables for m in t.column("micro_step").to_pylist() if m is not None]
    return max(batches, default=-1) + 1, max(micro, default=-1) + 1


def _column_order(columns: Mapping[str, Any]) -> list[str]:
    known = [c.name for c in COLUMNS if c.name in columns]
    return known + sorted(set(columns) - set(known))


def _unify(batches: list) -> list:
    """Record batches with the union of their columns (an optional column missing in a batch becomes null)."""
    pa = _pa()
    names = _column_order({name: None for b in batches for name in b.schema.names})
    out = []
    for b in batches:
        arrays = []
        for name in names:
            if name in b.schema.names:
                arrays.append(b.column(name))
            else:
                arrays.append(pa.nulls(b.num_rows, arrow_type(COLUMNS_BY_NAME[name].type)))
        out.append(pa.RecordBatch.from_arrays(arrays, names=names))
    return out


def _numeric(logs: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in logs.items():
        if isinstance(v, torch.Tensor) and v.numel() == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k)] = float(v)
    return out


# run.json fields a resumed run must share with the dump it continues ("trainer" without max_steps).
_SAME_RUN_FIELDS = ("model", "tokenizer", "engine", "sampling", "correction", "trainer", "rewards", "columns",
                    "world_size", "rollout_dump_every")


def _first_difference(a: Any, b: Any, where: str = "") -> str:
    """The first place two JSON values differ, as ``key.sub: stored X, this run Y``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
    return f"{where + ': ' if where else ''}stored {a!r}, this run {b!r}"
