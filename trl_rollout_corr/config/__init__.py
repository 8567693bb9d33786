"""Rollout-correction configuration: the field table, the core dataclass and its presets, the flat arguments.

* ``CORRECTION_FIELD_TABLE``: the single source of the correction fields (name, types, default, allowed values,
  help). ``RolloutCorrectionConfig``, ``RolloutCorrectionArguments`` and the table of
  ``docs/reference/configuration.md``
  (``python -m trl_rollout_corr.docgen --config-table``) are all generated from it.
* ``RolloutCorrectionConfig``: the validated, frozen core config the math takes; presets (verl's names) are
  classmethods registered with ``@_preset`` where they are defined (``PRESETS`` lists them).
* ``RolloutCorrectionArguments``: the same fields flat and Optional plus ``rollout_corr_preset``, for argument
  parsers and YAML (``RolloutCorrGRPOConfig`` inherits it); ``resolve()`` merges the preset and the set fields.
* Threshold parsing (``parse_is_threshold``, ``parse_rs_options``, ``parse_rs_thresholds``).

Nothing here imports torch.distributed or TRL, so the config can be built, validated and serialised anywhere
(CLI parsing, YAML loading, model cards). The RS option names come from ``correction.rejection``, where the RS
levels are implemented, so that adding an option touches that one file.

Vocabulary (see ``README.md``): behaviour policy mu (``rollout_log_probs``), proximal policy pi_old
(``old_log_probs``), current policy pi_theta (``log_probs``). The correction compares a *training*
policy (pi_old in decoupled mode, pi_theta in bypass mode) with mu through the per-token log ratio
``l = log pi_train - log mu`` in nats.

Modules: ``fields`` (the field table), ``thresholds`` (threshold parsing), ``rules`` (a setting whose option is
off), ``core`` (``RolloutCorrectionConfig``, presets), ``arguments`` (``RolloutCorrectionArguments``).
"""

from .arguments import (
    RolloutCorrectionArguments,
)
from .core import (
    PRESETS,
    RolloutCorrectionConfig,
)
from .fields import (
    BARE_BOOL_FLAG,
    CORRECTION_FIELD_TABLE,
    CORRECTION_FIELDS,
    CorrectionField,
    markdown_table,
)
from .rules import (
    unset_inert_settings,
)
from .thresholds import (
    BYPASS_LOSS_TYPES,
    IS_LEVELS,
    KPOP_PHI,
    ISBounds,
    RSSpec,
    ThresholdSpec,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)

__all__ = [
    "BARE_BOOL_FLAG",
    "BYPASS_LOSS_TYPES",
    "CORRECTION_FIELDS",
    "CORRECTION_FIELD_TABLE",
    "CorrectionField",
    "ISBounds",
    "IS_LEVELS",
    "KPOP_PHI",
    "PRESETS",
    "RSSpec",
    "RolloutCorrectionArguments",
    "RolloutCorrectionConfig",
    "ThresholdSpec",
    "markdown_table",
    "parse_is_threshold",
    "parse_rs_options",
    "parse_rs_thresholds",
    "unset_inert_settings",
]
