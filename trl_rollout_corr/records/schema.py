"""The rollout records schema: versions, file names, ``COLUMNS`` and their Arrow types (``records``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa




SCHEMA_NAME = "trl-rollout-corr/rollout-records"
SCHEMA_VERSION = "1.1"
RUN_FILE = "run.json"
LOGS_FILE = "logs.jsonl"
STEPS_DIR = "steps"
_STEP_FILE = re.compile(r"^step-(\d{8})\.rank-(\d{5})\.parquet$")
OPEN_WINDOW_DIR = "open-window"  # the rows of a window still open at a checkpoint (the writer's buffer then)
_OPEN_WINDOW_FILE = re.compile(r"^checkpoint-(\d{8})\.rank-(\d{5})\.parquet$")
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
    Column("policy_version_tokens", "list<int64>", False, True, "Policy version per completion token, written when "
           "a row of the micro-batch spans a weight update (a rollout_func's per-token policy_version that differs "
           "within a row); policy_version is then each row's oldest.", spec="7"),
    Column("version_log_probs", "list<float32>", False, True, "log pi_train@v (nats): the trainer's forward at the "
           "token's own policy version v (policy_lag_split; equal to old_log_probs for tokens of the current version, "
           "NaN where that forward gave none). The lag split's engine ratio is version - mu, its lag ratio old - "
           "version.", spec="7"),
    Column("support_log_mass", "list<float32>", False, True, "log S (nats, <= 0) of the sampling support the trainer "
           "scored with (rollout_support_matching on; decoupled: the pi_old forward's, bypass: this micro-batch's "
           "loss forward's).", spec="8"),
    Column("support_size", "list<int32>", False, True, "Size |K| of that support per token (0 where not scored).",
           spec="8"),
    Column("support_miss", "list<int8>", False, True, "1 where the sampled token was outside that support (made "
           "invalid by the correction), else 0.", spec="8"),
    Column("routes_packed", "binary", False, False, "MoE routes (routing_replay='r3'): the expert ids of every "
           "position (prompt then completion) x MoE layer x top-k, packed C-order as one byte per id (uint8, 255 = "
           "no route) when the model has <= 255 experts, else int16 little-endian (-1 = no route); L*k bytes per "
           "token (uint8). The step file's metadata names the layout (unpack_routes).", spec="9"),
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
            "float32": pa.float32(), "float64": pa.float64(), "string": pa.string(), "binary": pa.binary()}[text]


def schema_markdown() -> str:
    """The column table as Markdown (for ``docs/how-to/rollout-records.md``)."""
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
