"""The policy-lag report's statistics (issue 47), small pure functions over committed cells' numbers.

* ``t_interval``: the mean of n numbers with its 95 % Student-t interval (n - 1 degrees of freedom) and the
  two-sided one-sample t-test p against 0: every across-seed figure (arm differences paired by seed, lag costs,
  differences to the warm start) and, over items, the paired per-item differences of two cells;
* ``item_curve_areas`` / ``curve_area``: the area under a cell's 128-item greedy check curve (trapezoid over the
  check steps, step 0 = the warm start, the final evaluation's first items at the last step), divided by the run's
  steps: the run's time-averaged accuracy (a fraction), the second endpoint next to the final score;
* ``end_kl``: the mean of a logged per-step metric over a run's last steps (the behaviour KL from the warm start at
  the end of a never-synced run);
* ``frontier_at``: linear interpolation through the (KL, accuracy) points the step-size and anchor controls trace.

No I/O, no runner state: ``benchmarks/policy_lag_experiment.py`` reads the cells and formats the tables.
"""

from __future__ import annotations

import math
import statistics
from typing import NamedTuple


class Interval(NamedTuple):
    """A mean with its two-sided t interval: ``lo``/``hi`` NaN and ``p`` NaN where n < 2 (no spread to judge);
    ``df`` = n - 1; ``p``: two-sided one-sample t-test of mean 0 (1.0 where every value is 0, NaN where all equal
    a nonzero value: zero spread)."""

    mean: float
    lo: float
    hi: float
    n: int
    df: int
    p: float


def t_interval(xs: list[float], level: float = 0.95) -> Interval:
    """Mean of ``xs`` with its ``level`` Student-t interval (``scipy.stats.t``, n - 1 df) and the t-test p vs 0.

    Args:
        xs: n >= 1 finite numbers (e.g. per-seed differences in accuracy, or per-item 0/1 score differences).
        level: the interval's coverage, in (0, 1).

    Raises:
        ValueError: ``xs`` empty or not finite, or ``level`` outside (0, 1).
    """
    from scipy.stats import t

    xs = [float(x) for x in xs]
    if not xs or not all(math.isfinite(x) for x in xs):
        raise ValueError(f"t_interval needs at least one finite value, got {xs!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    n, mean = len(xs), statistics.fmean(xs)
    if n < 2:
        return Interval(mean, math.nan, math.nan, n, 0, math.nan)
    se = statistics.stdev(xs) / math.sqrt(n)
    if se == 0:
        return Interval(mean, mean, mean, n, n - 1, 1.0 if mean == 0 else math.nan)
    half = t.ppf(0.5 + level / 2, n - 1) * se
    return Interval(mean, mean - half, mean + half, n, n - 1, float(2 * t.sf(abs(mean) / se, n - 1)))


def paired_items(a: list[float], b: list[float], level: float = 0.95) -> Interval:
    """``t_interval`` of the per-item differences a - b (same items, same order; 0/1 scores or per-item areas).

    Raises:
        ValueError: ``a`` and ``b`` differ in length.
    """
    if len(a) != len(b):
        raise ValueError(f"paired items need equal lengths, got {len(a)} and {len(b)}")
    return t_interval([x - y for x, y in zip(a, b)], level)


def fmt_interval(iv: Interval, scale: float = 100.0, digits: int = 1, p: bool = False) -> str:
    """``+4.8 [-1.2, +10.8]`` (``scale`` 100: fractions printed as points); ``+4.8 (n = 1: no interval)`` for one
    value; ``p`` appends the t-test's ``, p 0.12``."""
    m = f"{scale * iv.mean:+.{digits}f}"
    if iv.n < 2:
        return f"{m} (n = 1: no interval)"
    out = f"{m} [{scale * iv.lo:+.{digits}f}, {scale * iv.hi:+.{digits}f}]"
    return out + (f", p {iv.p:.2g}" if p and not math.isnan(iv.p) else "")


def curve_checks(curve: list[dict], after_scores: list[int], last_step: int) -> list[tuple[int, list[int]]]:
    """A cell's check points in step order: ``(step, per-item 0/1 scores)`` for every ``curve.jsonl`` check (step 0
    and every ``--check-every`` steps) and, at ``last_step``, the final evaluation's scores on the checks' items
    (its first ``len(curve[0]["scores"])`` items).

    Raises:
        ValueError: no check at step 0, checks of different sizes, or a check at or past ``last_step``.
    """
    points = sorted((c["step"], list(c["scores"])) for c in curve)
    if not points or points[0][0] != 0:
        raise ValueError("the curve has no step-0 check (the warm start's point): no area to compute")
    n = len(points[0][1])
    if any(len(p) != n for _, p in points) or len(after_scores) < n:
        raise ValueError(f"curve checks of different sizes, or a final evaluation of fewer than {n} items")
    if points[-1][0] >= last_step:
        raise ValueError(f"a check at step {points[-1][0]} is not before the last step {last_step}")
    return [*points, (last_step, list(after_scores[:n]))]


def item_curve_areas(points: list[tuple[int, list[int]]]) -> list[float]:
    """Per item, the trapezoid area under its 0/1 score over the check steps, divided by the span (last step -
    first): each item's time-averaged score in [0, 1]; their mean is ``curve_area`` of the mean curve.

    Raises:
        ValueError: fewer than two points, or steps not strictly increasing.
    """
    steps = [s for s, _ in points]
    if len(points) < 2 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(f"an area needs two or more strictly increasing steps, got {steps}")
    span = steps[-1] - steps[0]
    n = len(points[0][1])
    return [sum((s1 - s0) * (p0[i] + p1[i]) / 2 for (s0, p0), (s1, p1) in zip(points, points[1:])) / span
            for i in range(n)]


def curve_area(points: list[tuple[int, float]]) -> float:
    """Trapezoid area under (step, accuracy) points divided by the span: the time-averaged accuracy.

    Raises:
        ValueError: fewer than two points, or steps not strictly increasing.
    """
    return item_curve_areas([(s, [a]) for s, a in points])[0]


def end_kl(steps: list[dict], key: str, last: int = 4) -> tuple[float, list[int]]:
    """The mean of ``key`` over the last ``last`` logged steps that carry a finite value, and those steps' numbers
    (a step whose samples the lag filter all dropped logs no KL: the mean then runs over earlier steps, and the
    step numbers say so). ``(nan, [])`` where no step logged it."""
    got = [(r["step"], r[key]) for r in steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    got = got[-last:]
    return (statistics.fmean(v for _, v in got), [s for s, _ in got]) if got else (math.nan, [])


def frontier_at(points: list[tuple[float, float]], x: float) -> float | None:
    """The piecewise-linear curve through ``points`` (x, y) sorted by x, evaluated at ``x``; None outside
    [min x, max x] (no extrapolation). Equal x: their mean y.

    Raises:
        ValueError: no point.
    """
    if not points:
        raise ValueError("a frontier needs at least one point")
    by_x: dict[float, list[float]] = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    xs = sorted(by_x)
    ys = [statistics.fmean(by_x[v]) for v in xs]
    if not xs[0] <= x <= xs[-1]:
        return None
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]  # a single point, x equal to it
