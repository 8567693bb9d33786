"""The check of the recomputed ``rollout_corr/*`` values against the logged ones (``analyze``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..accumulator import PREFIX
from .configs import ConfigError
from .recompute import Analysis, Recomputer

DEFAULT_TOLERANCE = 1e-5

# Logged keys analyze cannot recompute from records, by prefix, and why (CheckResult.why_not_recomputed).
NOT_RECOMPUTABLE = {
    "rollout_corr/skipped_step_fraction": "a trainer event (skip_empty_steps skipped the optimizer), not a statistic "
                                          "of the rows",
    "rollout_corr/routing_": "the trainer's own router top-k before replay is a forward of the model; the records "
                             "hold the replayed routes (routes_packed), not the trainer's choices",
}


# ---------------------------------------------------------------------------------------------- the check
def check_tolerance(tolerance: Any) -> float:
    """The check's tolerance as a float, checked: a finite number >= 0 (``|logged - recomputed| <= tolerance *
    max(1, |logged|)``; 0 demands bit-equal values).

    Raises:
        ConfigError: a bool, a non-number, NaN (every comparison would fail), an infinity (every one would pass) or
            a negative number (nothing could pass).
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ConfigError(f"tolerance must be a number >= 0 (e.g. 1e-5), got {tolerance!r}.")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ConfigError(f"tolerance must be a finite number >= 0 (e.g. 1e-5), got {tolerance!r}: NaN fails every "
                          "comparison, a negative one passes none, an infinite one passes all.")
    return float(tolerance)


def check_length_edges(length_buckets: Sequence[int]) -> tuple[int, ...]:
    """``correction.check_length_buckets`` (the trainer's rule), raising ``ConfigError``."""
    from ..correction.layout import check_length_buckets

    try:
        return check_length_buckets(length_buckets)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class CheckResult:
    """Logged vs recomputed ``rollout_corr/*`` values of the training config.

    Attributes:
        compared: number of (step, key) pairs compared. failures: (step, key, logged, recomputed) beyond tolerance.
        max_abs_diff, max_rel_diff: over the compared pairs (for a quantile read off a sketch: the distance of the
            logged value from the interval the exact quantile lies in, 0 inside it).
        not_recomputed: logged keys this version does not recompute (e.g. added by a newer trainer).
        not_logged: recomputed keys the step did not log.
        skipped: logged steps not checked, with the reason.
    """

    compared: int = 0
    failures: list[tuple[int, str, float, float]] = field(default_factory=list)
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    not_recomputed: set[str] = field(default_factory=set)
    not_logged: set[str] = field(default_factory=set)
    skipped: dict[int, str] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ok(self) -> bool:
        return not self.failures and self.compared > 0

    @staticmethod
    def why_not_recomputed(key: str) -> str:
        """Why ``key`` is not recomputed: the reason of ``NOT_RECOMPUTABLE``, else "unknown to this version"."""
        return next((why for prefix, why in NOT_RECOMPUTABLE.items() if key.startswith(prefix)),
                    "unknown to this version (a newer trainer's metric?)")


def check_against_logs(analysis: Analysis, recomputer: Recomputer,
                       tolerance: float = DEFAULT_TOLERANCE) -> CheckResult:
    """Compare every logged ``rollout_corr/*`` value of the analysed windows with its recomputation.

    A pair passes when ``|logged - recomputed| <= tolerance * max(1, |logged|)`` (absolute below 1, relative above).
    A quantile of a window over ``sketch.EXACT_MAX`` tokens (``Part.bounds``) passes when the logged value is within
    the same tolerance of the interval the exact quantile lies in: a log of this version (the same sketch, bit-equal
    counts) and a log of an older version (exact quantiles) both pass, a value outside the sketch's guarantee fails.
    Windows whose generation batches are incomplete in the dump are skipped (named in ``skipped``).
    """
    result = CheckResult(tolerance=tolerance)
    for w in recomputer.selected:
        if not w.files:
            result.skipped[w.logged_step] = ("its rows were not kept (rollout_dump_every)" if not w.dumped
                                             else "its step file is missing")
    for w in analysis.windows:
        logged = {k: v for k, v in w.metrics.items() if k.startswith(PREFIX)}
        if not logged:
            result.skipped[w.logged_step] = "no rollout_corr/* values logged"
            continue
        incomplete = [b for b in recomputer.incomplete if recomputer.window_of_generation(b) == w.logged_step]
        if incomplete:
            result.skipped[w.logged_step] = f"generation batch {incomplete[0]} is incomplete in the dump"
            continue
        part = analysis.per_window[w.logged_step]
        ours, bounds = part.metrics(), part.bounds()
        for key, value in logged.items():
            if key not in ours:
                result.not_recomputed.add(key)
                continue
            if key in bounds:
                lower, upper = bounds[key]
                diff = max(lower - float(value), float(value) - upper, 0.0)
            else:
                diff = abs(float(value) - ours[key])
            result.compared += 1
            result.max_abs_diff = max(result.max_abs_diff, diff)
            result.max_rel_diff = max(result.max_rel_diff, diff / max(abs(float(value)), 1e-300))
            if not diff <= tolerance * max(1.0, abs(float(value))):
                result.failures.append((w.logged_step, key, float(value), ours[key]))
        result.not_logged.update(set(ours) - set(logged))
    return result
