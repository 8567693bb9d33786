"""Reducible statistics: the container that merges across micro-batches and ranks, and the read view.

Every ``rollout_corr/*`` metric is a function of a few *reducible* statistics: sums and counts (merged by
addition), maxima and minima (merged by max/min). ``CorrectionStats`` holds them as three 1-D float64 tensors on
the device where they were computed; merging micro-batches and reducing across ranks never leaves the device,
and ``finalize()`` moves everything to the host in one transfer and evaluates the formulas in float64 once.

So a value logged for a step equals the value computed once over that step's whole global batch, whatever the
number of ranks, micro-batches or gradient-accumulation steps (never a mean of means; a statistic's reduction
is fixed by the kind it was registered with, never chosen from its name).

Names: a family registers a statistic under a base name and one or more ``Kind``s (``correction.reduce``);
``stat_name`` is the one rule that turns (base name, kind, length bucket) into the stored name, and ``StatView``
reads through the same rule, so a family's gatherer and finaliser use the same base names and nothing else.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

Reducer = Callable[[torch.Tensor], torch.Tensor]
PREFIX = "rollout_corr/"
EXP_CAP = 700.0  # exp() argument cap for per-row perplexities and ratios on the host, keeps float64 finite


class Kind(enum.Enum):
    """How a registered (B,) row vector is reduced.

    ``SUM``/``SQ``: sum / sum of squares over valid rows; ``WSUM``/``WSQ``: the same weighted by each row's
    valid-token count; ``SUM_ALL``: sum over every row (valid or not); ``MAX``/``MIN``: over valid rows.
    """

    __hash__ = object.__hash__  # members are singletons; Enum's own hash is a Python call (plan-cache keys)

    SUM = "sum"
    SQ = "sq"
    WSUM = "wsum"
    WSQ = "wsq"
    SUM_ALL = "sum_all"
    MAX = "max"
    MIN = "min"


def stat_name(name: str, kind: Kind, bucket: Optional[int] = None) -> str:
    """The stored name of base statistic ``name`` reduced as ``kind`` (in length bucket ``bucket``)."""
    if kind in (Kind.SQ, Kind.WSQ):
        name = name + "2"
    elif kind is Kind.MAX:
        name = name + "_max"
    elif kind is Kind.MIN:
        name = name + "_min"
    return name if bucket is None else f"{name}@{bucket}"


class _Table(dict):
    """A stored-name -> value table whose misses name the statistic."""

    def __init__(self, items, what: str) -> None:
        super().__init__(items)
        self.what = what

    def __missing__(self, key: str) -> float:
        raise KeyError(f"statistic {key!r} ({self.what}) was not gathered for this correction layout")


class StatView:
    """Host-side read access to merged statistics by base name (what finalisers see).

    The accessors apply ``stat_name``'s rule (inlined: finalisation reads ~200 values per call).

    Args:
        sums, maxs, mins: stored name -> Python float (dicts or iterables of pairs).

    Raises:
        KeyError: naming the statistic, when a finaliser reads one its gatherer did not register.
    """

    def __init__(self, sums, maxs, mins) -> None:
        self._sums, self._maxs, self._mins = _Table(sums, "sum"), _Table(maxs, "max"), _Table(mins, "min")

    def sum(self, name: str, bucket: Optional[int] = None) -> float:
        """Sum (``Kind.SUM``/``WSUM``/``SUM_ALL``) of ``name``, in length bucket ``bucket`` if given."""
        return self._sums[name if bucket is None else f"{name}@{bucket}"]

    def sq(self, name: str, bucket: Optional[int] = None) -> float:
        """Sum of squares (``Kind.SQ``/``WSQ``, or ``RowTable.add_sq``) of ``name``."""
        return self._sums[name + "2" if bucket is None else f"{name}2@{bucket}"]

    def count(self, name: str) -> float:
        """A threshold count registered with ``gt=``/``lt=`` under ``name``."""
        return self._sums[name]

    def max(self, name: str) -> float:
        """Maximum of ``name`` over valid rows (``-inf`` when there is none: see ``max_or_zero``)."""
        return self._maxs[name + "_max"]

    def min(self, name: str) -> float:
        """Minimum of ``name`` over valid rows (``+inf`` when there is none: see ``min_or_zero``)."""
        return self._mins[name + "_min"]


@dataclass
class CorrectionStats:
    """Reducible statistics of one or more correction calls, as three 1-D float64 tensors.

    Attributes:
        sum_names, sums: statistics merged by addition (sums and counts).
        max_names, maxs: statistics merged by maximum (``-inf`` when empty).
        min_names, mins: statistics merged by minimum (``+inf`` when empty).
        layout: the ``MetricLayout`` (IS level and bounds, RS options, length buckets) that produced them,
            identical for all parts that are merged; it also finalises them. Parts from different
            configurations cannot be merged.

    Merging and reducing cost three tensor operations whatever the number of metrics.
    """

    sum_names: tuple[str, ...]
    sums: torch.Tensor
    max_names: tuple[str, ...]
    maxs: torch.Tensor
    min_names: tuple[str, ...]
    mins: torch.Tensor
    layout: Any

    def as_dicts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(sums, maxs, mins) as stored name -> 0-d tensor dicts (views; for inspection and tests)."""
        return tuple(
            dict(zip(names, vec.unbind(0)))
            for names, vec in ((self.sum_names, self.sums), (self.max_names, self.maxs), (self.min_names, self.mins))
        )

    # ------------------------------------------------------------------ merging
    def _check_compatible(self, other: "CorrectionStats") -> None:
        if self.layout != other.layout or (self.sum_names, self.max_names, self.min_names) != (
            other.sum_names, other.max_names, other.min_names
        ):
            raise ValueError(
                "Cannot merge CorrectionStats from different correction configurations "
                f"({self.layout} vs {other.layout}); merge only parts computed with the same config."
            )

    def merge(self, other: "CorrectionStats") -> "CorrectionStats":
        """Combine two parts (sums added, maxima/minima taken). Returns a new object.

        Raises:
            ValueError: if the parts come from different correction configurations.
        """
        self._check_compatible(other)
        return CorrectionStats(
            self.sum_names, self.sums + other.sums,
            self.max_names, torch.maximum(self.maxs, other.maxs),
            self.min_names, torch.minimum(self.mins, other.mins),
            self.layout,
        )

    def joined(self, other: "CorrectionStats") -> "CorrectionStats":
        """The statistics of two row tables of the same call side by side (names disjoint; e.g. RS on the engine
        factor, whose options' statistics are over the rows with a finite engine factor). Returns a new object.

        Raises:
            ValueError: if the layouts differ or a name is in both.
        """
        names = (self.sum_names, self.max_names, self.min_names)
        others = (other.sum_names, other.max_names, other.min_names)
        if self.layout != other.layout or any(set(a) & set(b) for a, b in zip(names, others)):
            raise ValueError("joined: the two parts must come from one layout and hold different statistics.")
        return CorrectionStats(
            self.sum_names + other.sum_names, torch.cat([self.sums, other.sums]),
            self.max_names + other.max_names, torch.cat([self.maxs, other.maxs]),
            self.min_names + other.min_names, torch.cat([self.mins, other.mins]),
            self.layout,
        )

    @staticmethod
    def merge_all(parts: Iterable["CorrectionStats"]) -> "CorrectionStats":
        """Merge any number of parts (at least one).

        Raises:
            ValueError: for an empty iterable or incompatible parts.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("merge_all needs at least one CorrectionStats part.")
        total = parts[0]
        for part in parts[1:]:
            total = total.merge(part)
        return total

    def reduce(self, sum_fn: Reducer, max_fn: Reducer, min_fn: Reducer) -> "CorrectionStats":
        """Reduce across ranks with three collectives on 1-D float64 tensors.

        Args:
            sum_fn, max_fn, min_fn: each takes a 1-D tensor and returns the element-wise sum / max / min
                over all ranks (for example ``accelerator.reduce(t, "sum")`` and ``torch.distributed``
                all_reduce with ``ReduceOp.MAX`` / ``MIN``). Every rank must call this with the same layout.
        """
        return CorrectionStats(
            self.sum_names, sum_fn(self.sums),
            self.max_names, max_fn(self.maxs),
            self.min_names, min_fn(self.mins),
            self.layout,
        )

    def to_vector(self) -> torch.Tensor:
        """All statistics as one 1-D float64 tensor (sums, then maxs, then mins)."""
        return torch.cat([self.sums, self.maxs, self.mins])

    # ------------------------------------------------------------------ finalising
    def view(self) -> StatView:
        """The statistics on the host (one device-to-host transfer)."""
        values = self.to_vector().cpu().tolist()
        a, b = len(self.sum_names), len(self.sum_names) + len(self.max_names)
        return StatView(zip(self.sum_names, values[:a]), zip(self.max_names, values[a:b]),
                        zip(self.min_names, values[b:]))

    def finalize(self, prefix: str = PREFIX) -> dict[str, float]:
        """Evaluate every metric. One device-to-host transfer; Python floats, never NaN or inf.

        Returns:
            dict ``prefix + name -> float`` (IS metrics first, then RS, then the off-policy diagnostics, as verl).
        """
        metrics = self.layout.finalize(self.view())
        isfinite = math.isfinite
        return {prefix + k: v if isfinite(v) else finite(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------- host-side formula helpers (float64)
def div(num: float, den: float) -> float:
    """``num / den``, 0 for an empty denominator (the counts metrics say why)."""
    return num / den if den > 0 else 0.0


def finite(v: float) -> float:
    """NaN -> 0, +-inf -> +-largest float; finite values unchanged."""
    if math.isnan(v):
        return 0.0
    if math.isinf(v):
        return math.copysign(1.7976931348623157e308, v)
    return float(v)


def max_or_zero(v: float) -> float:
    """A maximum; that of an empty set (-inf) is reported as 0 (+inf is a real, saturated value)."""
    return 0.0 if v == -math.inf else v


def min_or_zero(v: float) -> float:
    """A minimum; that of an empty set (+inf) is reported as 0 (-inf is a real, saturated value)."""
    return 0.0 if v == math.inf else v


def pop_std(sum_x: float, sum_x2: float, n: float) -> float:
    """Population standard deviation from a sum, a sum of squares and a count (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    mean = sum_x / n
    return math.sqrt(max(sum_x2 / n - mean * mean, 0.0))


def unbiased_std(sum_x: float, sum_x2: float, n: float) -> float:
    """Unbiased (n - 1) standard deviation from a sum, a sum of squares and a count (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return math.sqrt(max((sum_x2 - sum_x * sum_x / n) / (n - 1), 0.0))


def ess(sum_w: float, sum_w2: float, n: float) -> float:
    """Kish effective sample size as a fraction ``(sum w)^2 / (n sum w^2)`` in [0, 1] (0 if every w is 0)."""
    if n <= 0 or sum_w2 <= 0:
        return 0.0
    return min(sum_w * sum_w / (n * sum_w2), 1.0)


def exp_or_zero(v: float, cap: float = EXP_CAP) -> float:
    """``exp(min(v, cap))``; 0 for ``v = -inf``."""
    return 0.0 if math.isinf(v) and v < 0 else math.exp(min(v, cap))
