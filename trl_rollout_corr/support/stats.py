"""The ``rollout_corr/support_*`` metrics as exact reducible statistics (``support``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

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
        sizes: the per-token |K| (float64), kept for exact order statistics (8 bytes a token until the flush).

    ``support_log_mass_mean`` is the mean log kept mass (nats, <= 0; ``exp`` of it is the typical engine ratio
    without matching), ``support_size_mean/p50/p99`` the kept-set sizes (exact quantiles, linear interpolation as
    ``torch.quantile``), ``support_singleton_fraction`` the fraction of one-token supports (ratio 1, zero
    gradient), ``support_miss_fraction`` the fraction of sampled tokens outside the trainer's support (made
    invalid). Over the valid completion tokens; none of them is logged when there is no such token.
    """

    sums: torch.Tensor
    sizes: list = field(default_factory=list)

    @classmethod
    def from_score(cls, score: SupportScore, mask: torch.Tensor) -> "SupportStats":
        """The statistics of ``score`` over the tokens where ``mask`` (b, T) and ``score.valid`` hold."""
        tokens = score.valid & (mask.to(score.valid.device) != 0)
        size = score.size[tokens].double()
        sums = torch.stack([
            tokens.sum().double(), score.log_mass[tokens].double().sum(), size.sum(),
            (size == 1).sum().double(), score.miss[tokens].sum().double(),
        ])
        return cls(sums, [size])

    def merge(self, other: "SupportStats") -> "SupportStats":
        return SupportStats(self.sums + other.sums.to(self.sums.device), self.sizes + other.sizes)

    def reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
               gather: Callable[[torch.Tensor], torch.Tensor]) -> "SupportStats":
        """Across ranks: ``reduce_sum`` of the sums, ``gather`` (uneven all-gather) of the sizes."""
        sizes = torch.cat(self.sizes) if self.sizes else self.sums.new_zeros(0)
        return SupportStats(reduce_sum(self.sums), [gather(sizes)])

    def finalize(self) -> dict[str, float]:
        """``rollout_corr/support_*`` -> float (one host transfer); ``{}`` over no token."""
        count, log_mass, size_sum, singletons, misses = self.sums.tolist()
        if count <= 0:
            return {}
        sizes = torch.cat(self.sizes) if self.sizes else self.sums.new_zeros(0)
        quantiles = (torch.quantile(sizes, sizes.new_tensor([0.5, 0.99])) if sizes.numel()
                     else sizes.new_zeros(2))
        p50, p99 = quantiles.tolist()
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
