"""Rollout records: every trained sample written out per logged step, with a versioned schema (spec section 10).

A *dump* is one folder (``RolloutCorrGRPOConfig.rollout_dump_dir``)::

    run.json                                   once per run: model, engine, sampling, tokenizer, correction, trainer
    logs.jsonl                                 one line per logged step: its window of steps and the logged values
    steps/step-00000012.rank-00000.parquet     the samples each rank trained on in that window (one row per use)

One row is one sample *as trained in one micro-batch*: with ``num_iterations > 1`` a sample trained twice has two
rows (same ``generation_batch`` / ``generation_row``, a later ``step``, its own ``log_probs``), so every
``rollout_corr/*`` metric of a logged step can be recomputed from the rows alone, for any correction config
(``trl_rollout_corr.analyze``). The columns are ``schema.COLUMNS`` (name, Arrow type, required or optional, per
completion token or per row); per-token columns are lists as long as the row's ``completion_ids``, never padded.

Versioning (``SCHEMA_VERSION``, "major.minor", stored in ``run.json`` and in every Parquet file's key-value
metadata): a reader reads any dump of its major version. A minor version may only add *optional* columns. 1.1
added the columns of the features 1.0 could not follow (written only when the feature is on): ``version_log_probs``
(``policy_lag_split``), ``support_miss`` with the reserved ``support_log_mass`` / ``support_size`` now filled
(support matching), ``routes_packed`` (R3, ``routes``; it replaces 1.0's reserved nested-list ``routes``, never
written), ``policy_version_tokens`` (reserved in 1.0, now filled when a row spans a weight update). A 1.1 reader
reads 1.0 dumps; a 1.0 reader reads a 1.1 dump without the new columns. A different major version is refused with
an error naming the file and the fix (``RecordsError``).

Size: per sample about 4 bytes per prompt token and 14 bytes per completion token before compression (ids, masks
and 2-4 float32 log-prob columns; + 4 with ``policy_lag_split``, + 9 with support matching, + L*k with R3 for every
prompt and completion token: L MoE layers, top-k), zstd-compressed on disk; ``benchmarks/RESULTS.md`` has the
measured bytes per 1k samples of the main job. ``rollout_dump_every = N`` keeps one logged window in N to bound a
long run.

Writing never overwrites: each Parquet file is written to a temporary name and renamed into place (a crash leaves
no half-written ``.parquet``), and an existing step file is an error. A folder that already holds ``run.json`` is
continued by a run resumed from a checkpoint (first trained step k > 0) whose ``run.json`` content is the same
(schema version, model, tokenizer, engine, sampling, correction, trainer settings but ``max_steps``, rewards, world
size, ``rollout_dump_every``; the ``run_id`` stays). Resuming: at every checkpoint inside a window each rank writes
the rows it holds to ``open-window/checkpoint-<k>.rank-<r>.parquet`` (removed once the window is written); on
resume at k the windows logged after k (the interrupted run's steps after the checkpoint, trained again now) are
moved to ``superseded/resume-at-<k>/`` (never deleted; ``resume.rank-<r>.json`` counts the rows), the rows of the
window open at k are taken back (from that open-window file, or the interrupted run's later file of the window), and
window, micro-batch and generation batch numbers continue from the checkpoint's counts (``load_state_dict``; else
after the kept rows), so the dump is the uninterrupted run's and no step is in it twice; where those rows are in no
file the resume is refused, naming the fix. A run from step 0 into a folder with a dump, or a different run's
settings, is refused. ``docs/how-to/rollout-records.md``, "Resuming from a checkpoint".

Reading validates everything (schema version, Parquet integrity, column types, per-token lengths) before
any result is produced. Needs ``pyarrow`` (installed with ``datasets``: the ``trl`` extra).

Modules: ``schema`` (versions, file names, columns), ``metadata`` (``run.json``), ``writer``, ``reader``,
``routes`` (the packed MoE routes).
"""

from .metadata import (
    library_versions,
    model_fingerprint,
    run_metadata,
    tokenizer_fingerprint,
)
from .reader import (
    RolloutDump,
    Window,
    check_schema_version,
    open_dump,
    padded,
    read_step_file,
)
from .routes import ROUTES_FIELD_META, pack_routes, routes_encoding, routes_layout, unpack_routes
from .schema import (
    COLUMNS,
    COLUMNS_BY_NAME,
    LOGS_FILE,
    PER_TOKEN_COLUMNS,
    REQUIRED_COLUMNS,
    RUN_FILE,
    SCHEMA_NAME,
    SCHEMA_VERSION,
    STEPS_DIR,
    TERMINATIONS,
    Column,
    RecordsError,
    arrow_type,
    schema_markdown,
    termination_of,
)
from .writer import (
    MicroBatch,
    RolloutRecordWriter,
    completion_lengths,
    terminations,
)

__all__ = [
    "COLUMNS",
    "COLUMNS_BY_NAME",
    "Column",
    "LOGS_FILE",
    "MicroBatch",
    "PER_TOKEN_COLUMNS",
    "REQUIRED_COLUMNS",
    "ROUTES_FIELD_META",
    "RUN_FILE",
    "RecordsError",
    "RolloutDump",
    "RolloutRecordWriter",
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "STEPS_DIR",
    "TERMINATIONS",
    "Window",
    "arrow_type",
    "check_schema_version",
    "completion_lengths",
    "library_versions",
    "model_fingerprint",
    "open_dump",
    "pack_routes",
    "padded",
    "read_step_file",
    "routes_encoding",
    "routes_layout",
    "run_metadata",
    "schema_markdown",
    "termination_of",
    "terminations",
    "tokenizer_fingerprint",
    "unpack_routes",
]
