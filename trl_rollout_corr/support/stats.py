"""The ``rollout_corr/support_*`` metrics as reducible statistics (``support``): exact sums, and the kept-set
sizes' quantiles from a ``sketch.ValueSketch`` (exact up to ``sketch.EXACT_MAX`` tokens per window)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..sketch import ValueSketch, reduce_sketches, size_layout
from .scorer import SupportScore

PREFIX = "rollout_corr/"


# ====================================================================================== metrics
SUPPORT_METRICS = ("support_log_mass_mean", "support_size_mean", "support_size_p50", "support_size_p99",
                   "support_singleton_fraction", "support_miss_fraction")


@dataclass
class SupportStats:
    """The ``rollout_corr/support_*`` statistics of some tokens, reducible across micro-batches and ranks.

    Attributes:
        sums: (5,) float64: tokens, sum of log S (nats), sum of |K|, one-token supports, misses.
        sizes: a ``sketch.ValueSketch`` (``size_layout``) of the per-token |K|: the values themselves while the
            window holds at most ``exact_max`` tokens over all ranks, else bucket counts (exact for sizes <= 4096,
            within 0.1 % above; ``docs/how-to/read-the-metrics.md``).

    ``support_log_mass_mean`` is the mean log kept mass (nats, <= 0; ``exp`` of it is the typical engine ratio
    without matching), ``support_size_mean/p50/p99`` the kept-set sizes (mean exact; quantiles with linear
    interpolation between order statistics as ``torch.quantile``, exact or within the sketch's bound),
    ``support_singleton_fraction`` the fraction of one-token supports (ratio 1, zero gradient),
    ``support_miss_fraction`` the fraction of sampled tokens outside the trainer's support (made
    invalid). Over the valid completion tokens; none of them is logged when there is no such token.
    """

    sums: torch.Tensor
    sizes: ValueSketch

    @classmethod
    def from_sizes(cls, sums: torch.Tensor, sizes: torch.Tensor, exact_max: Optional[int] = None) -> "SupportStats":
        """From the (5,) ``sums`` and the (N,) per-token sizes (``exact_max``: as ``sketch.ValueSketch``)."""
        return cls(sums, ValueSketch(size_layout(), exact_max).add(sizes))

    @classmethod
    def from_score(cls, score: SupportScore, mask: torch.Tensor, exact_max: Optional[int] = None) -> "SupportStats":
        """The statistics of ``score`` over the tokens where ``mask`` (b, T) and ``score.valid`` hold."""
        tokens = score.valid & (mask.to(score.valid.device) != 0)
        size = score.size[tokens].double()
        sums = torch.stack([
            tokens.sum().double(), score.log_mass[tokens].double().sum(), size.sum(),
            (size == 1).sum().double(), score.miss[tokens].sum().double(),
        ])
        return cls.from_sizes(sums, size, exact_max)

    def merge(self, other: "SupportStats") -> "SupportStats":
        return SupportStats(self.sums + other.sums.to(self.sums.device), self.sizes.merge(other.sizes))

    def reduce(self, reducers) -> "SupportStats":
        """Across ranks (``accumulator.Reducers``): the sum of the sums, ``sketch.reduce_sketches`` of the sizes."""
        sums = reducers.sum(self.sums) if reducers.world_size > 1 else self.sums
        return SupportStats(sums, reduce_sketches([self.sizes], reducers)[0])

    def size_bounds(self) -> dict[str, tuple[float, float]]:
        """``rollout_corr/support_size_p50/p99`` -> (lower, upper), where the exact quantiles lie, when the sizes are
        counted (``{}`` while exact or over no token)."""
        if self.sizes.exact or self.sizes.n == 0:
            return {}
        qs = self.sizes.quantiles([0.5, 0.99])
        return {PREFIX + name: (lo, hi) for name, (_, lo, hi) in zip(("support_size_p50", "support_size_p99"), qs)}

    def finalize(self) -> dict[str, float]:
        """``rollout_corr/support_*`` -> float (one host transfer); ``{}`` over no token."""
        count, log_mass, size_sum, singletons, misses = self.sums.tolist()
        if count <= 0:
            return {}
        exact = self.sizes.exact_values()
        if exact is not None:  # at most exact_max values: torch.quantile's exact order statistics
            p50, p99 = (torch.quantile(exact, exact.new_tensor([0.5, 0.99])).tolist() if exact.numel()
                        else [0.0, 0.0])
        else:
            p50, p99 = (est for est, _, _ in self.sizes.quantiles([0.5, 0.99]))
        denom = max(count, 1.0)
        values = (log_mass / denom, size_sum / denom, p50, p99, singletons / denom, misses / denom)
        return {PREFIX + name: float(v) for name, v in zip(SUPPORT_METRICS, values)}


def invalidate_misses(log_probs: torch.Tensor, miss: Optional[torch.Tensor]) -> torch.Tensor:
    """``log_probs`` with NaN where ``miss``: the correction then treats those tokens as invalid (removed from the
    mask, weight 1, counted in ``rollout_corr/invalid_token_fraction``). Returns ``log_probs`` itself when
    ``miss`` is None or all False."""
    if miss is None or not bool(miss.any()):
        return log_probs
    return torch.where(miss.to(log_probs.device), torch.full_like(log_probs, math.nan), log_probs)
