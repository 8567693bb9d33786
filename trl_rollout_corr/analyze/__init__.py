"""Offline what-if analysis of rollout records: every ``rollout_corr/*`` metric of the stored steps, recomputed under
the training config (checked against what was logged) and under any other correction config.

The recomputation groups the rows exactly as the trainer grouped its correction calls, then merges the
``CorrectionStats`` exactly as ``accumulator.RolloutCorrAccumulator`` does:

* decoupled mode: one call per *generation batch* (all ranks' rows of it, i.e. the global batch the trainer's
  cross-rank sums saw), on pi_old (``old_log_probs``) vs mu, counted in the window of the optimizer step that
  generated it (``generation_step + 1``); the ratio decomposition (``engine``/``update``/``direct``) over every
  trained use of a row in the window, on the tokens its generation batch's RS mask kept;
* bypass mode: one call per *global micro-batch* (all ranks' rows with the same ``micro_step``) on pi_theta of that
  micro-batch's loss forward (``log_probs``) vs mu; the direct ratio over the kept tokens;
* policy lag: per row, ``step - policy_version`` (``generation_step`` where a dump has no version column), as the
  trainer's ``lag.lag_counts`` (row and token means, buckets, ``max_policy_lag`` drops) and the row maximum.

A what-if config runs the same grouping for its own mode (a decoupled config needs ``old_log_probs``, which a bypass
run never computes; a bypass config needs ``log_probs``). The slices: by response length (the correction's own
``len_*`` metrics and kept counts per length bucket, in valid tokens per row) and by policy lag (the uses trained
at each lag, each slice corrected on its own rows: RS decisions, kl, k3 and the scale-free ESS do not depend on
the rest of the batch).

Everything here reads tensors from ``records.RolloutDump``; nothing writes. ``cli.py`` prints and plots.

Modules: ``configs`` (what-if configs), ``rows`` (rows, counts, merged parts), ``recompute`` (the grouping),
``check`` (against the logs), ``summary`` (table rows, ``analyse_dump``).
"""

from .check import (
    DEFAULT_TOLERANCE,
    CheckResult,
    check_against_logs,
    check_length_edges,
    check_tolerance,
)
from .configs import (
    RECIPE_KEY,
    ConfigError,
    NamedConfig,
    preset_config,
    yaml_config,
)
from .recompute import (
    Analysis,
    Recomputer,
)
from .rows import (
    Counts,
    Part,
    Rows,
    check_config_fits,
)
from .summary import (
    analysable_windows,
    analyse_dump,
    length_slices,
    summary_row,
)

__all__ = [
    "Analysis",
    "CheckResult",
    "ConfigError",
    "Counts",
    "DEFAULT_TOLERANCE",
    "NamedConfig",
    "Part",
    "RECIPE_KEY",
    "Recomputer",
    "Rows",
    "analysable_windows",
    "analyse_dump",
    "check_against_logs",
    "check_config_fits",
    "check_length_edges",
    "check_tolerance",
    "length_slices",
    "preset_config",
    "summary_row",
    "yaml_config",
]
