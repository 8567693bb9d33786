"""accumulator: per-mode buffering of the rollout_corr/* metrics and their exact flush, with fake cross-rank
reducers standing in for a second rank."""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.accumulator import Reducers, RolloutCorrAccumulator, exact_ratio_quantiles, gather_uneven

pytestmark = pytest.mark.unit


def _batch(seed: int, rows: int = 3, width: int = 6):
    g = torch.Generator().manual_seed(seed)
    log_probs = -2.0 * torch.rand(rows, width, generator=g)
    rollout = log_probs + 0.1 * torch.randn(rows, width, generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[0, 4:] = 0
    return log_probs, rollout, mask


CFG = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                              rollout_rs_threshold="0.9_1.1")


class TwinRank:
    """Fake reducers for two ranks: the other rank holds ``other`` (its stats vector and its 1-D log ratios)."""

    def __init__(self, other_stats=None, other_values=None):
        self.other_stats, self.other_values, self.calls = other_stats, other_values, []

    def reducers(self) -> Reducers:
        return Reducers(world_size=2, sum=self.sum, max=self.max, min=self.min, gather=self.gather)

    def sum(self, t):
        self.calls.append("sum")
        return t + self.other_stats[0]

    def max(self, t):
        self.calls.append("max")
        return torch.maximum(t, self.other_stats[1])

    def min(self, t):
        self.calls.append("min")
        return torch.minimum(t, self.other_stats[2])

    def gather(self, t):
        self.calls.append("gather")
        if t.dtype == torch.long:  # the element counts
            return torch.cat([t, torch.tensor([self.other_values.numel()])])
        padded = torch.full_like(t, float("nan"))
        padded[: self.other_values.numel()] = self.other_values
        return torch.cat([t, padded])


def test_stats_merge_over_calls_equals_one_call():
    lp, mu, mask = _batch(0, rows=6)
    whole = compute_rollout_correction(lp, mu, mask, CFG).metrics
    acc = RolloutCorrAccumulator()
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        acc.add_stats("train", compute_rollout_correction(lp[rows], mu[rows], mask[rows], CFG).stats)
    logged = acc.flush("train")
    assert set(logged) == set(whole) and len(whole) > 20
    for key, value in whole.items():
        assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert acc.flush("train") == {}  # the buffer is empty after a flush


def test_modes_are_separate_and_eval_is_prefixed():
    lp, mu, mask = _batch(1)
    acc = RolloutCorrAccumulator()
    acc.add_stats("eval", compute_rollout_correction(lp, mu, mask, CFG).stats)
    acc.add_policy_lag("train", 1)
    train, evaluation = acc.flush("train"), acc.flush("eval")
    assert train == {"rollout_corr/policy_lag_mean": 1.0, "rollout_corr/policy_lag_max": 1.0}
    assert evaluation and all(k.startswith("eval_rollout_corr/") for k in evaluation)
    with pytest.raises(ValueError, match="mode must be one of"):
        acc.add_policy_lag("test", 0)


def test_policy_lag_mean_and_max_over_micro_batches():
    acc = RolloutCorrAccumulator()
    for lag in (0, 1, 0, 3):
        acc.add_policy_lag("train", lag)
    assert acc.flush("train") == {"rollout_corr/policy_lag_mean": 1.0, "rollout_corr/policy_lag_max": 3.0}


def test_exact_ratio_quantiles_by_hand():
    values = torch.arange(1.0, 102.0, dtype=torch.float64)  # ratios 1..101
    out = exact_ratio_quantiles(values.log())
    assert out == pytest.approx({"mean": 51.0, "p01": 2.0, "p50": 51.0, "p99": 100.0, "max": 101.0})
    assert out["p99"] == pytest.approx(torch.quantile(values, 0.99).item())
    # interpolation between order statistics: ratios 1, 2, 4 -> p01 at position 0.02: 1 + 0.02 * (2 - 1)
    assert exact_ratio_quantiles(torch.tensor([4.0, 1.0, 2.0]).log())["p01"] == pytest.approx(1.02)
    # clamped at the safety bound before exponentiation
    assert exact_ratio_quantiles(torch.tensor([100.0]))["max"] == pytest.approx(math.exp(20.0))
    assert exact_ratio_quantiles(torch.zeros(0)) == {"mean": 0.0, "p01": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}


def test_log_ratios_accumulate_over_micro_batches_and_names():
    acc = RolloutCorrAccumulator()
    values = torch.arange(1.0, 102.0)
    for part in (values[:10], values[10:60], values[60:]):
        acc.add_log_ratios("train", {"engine": part.log(), "direct": torch.zeros(2, 1)})
    logged = acc.flush("train")
    assert logged["rollout_corr/engine_ratio_p99"] == pytest.approx(100.0)
    assert logged["rollout_corr/direct_ratio_max"] == 1.0 and len(logged) == 10


def test_gather_uneven_pads_and_drops_the_padding():
    twin = TwinRank(other_values=torch.tensor([7.0, 8.0, 9.0], dtype=torch.float64))
    out = gather_uneven(torch.tensor([1.0], dtype=torch.float64), twin.reducers())
    assert out.tolist() == [1.0, 7.0, 8.0, 9.0] and twin.calls == ["gather", "gather"]
    assert gather_uneven(torch.tensor([1.0]), Reducers()).tolist() == [1.0]  # one rank: no collective


def test_flush_is_exact_over_two_fake_ranks():
    """A flush on "rank 0" with reducers that add rank 1's statistics equals one rank holding both shards."""
    lp, mu, mask = _batch(2, rows=6)
    mine, theirs = slice(0, 2), slice(2, 6)
    their_stats = compute_rollout_correction(lp[theirs], mu[theirs], mask[theirs], CFG).stats
    other = []  # the other rank's (sums, maxima, minima) vectors, as the three collectives receive them

    def grab(t):
        other.append(t.clone())
        return t

    their_stats.reduce(grab, grab, grab)
    their_log_ratios = (lp[theirs] - mu[theirs])[mask[theirs] != 0].double()
    twin = TwinRank(other_stats=other, other_values=their_log_ratios)
    acc = RolloutCorrAccumulator(twin.reducers())
    acc.add_stats("train", compute_rollout_correction(lp[mine], mu[mine], mask[mine], CFG).stats)
    acc.add_log_ratios("train", {"engine": (lp[mine] - mu[mine])[mask[mine] != 0]})
    logged = acc.flush("train")
    assert twin.calls[:3] == ["sum", "max", "min"] and twin.calls[3:] == ["gather", "gather"]

    single = RolloutCorrAccumulator()
    single.add_stats("train", compute_rollout_correction(lp, mu, mask, CFG).stats)
    single.add_log_ratios("train", {"engine": (lp - mu)[mask != 0]})
    reference = single.flush("train")
    assert set(logged) == set(reference)
    for key, value in reference.items():
        assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert reference["rollout_corr/num_valid_tokens"] == 4 + 5 * 6


def test_reducers_all_reduce_is_none_on_one_rank():
    assert Reducers().all_reduce is None
    twin = TwinRank(other_stats=[torch.ones(1)] * 3)
    assert twin.reducers().all_reduce(torch.zeros(1)).tolist() == [1.0]


def test_fraction_counts_are_exact_over_calls_and_modes():
    """Numerators and denominators are summed (ints or 0-d tensors), divided once; never a mean of fractions."""
    acc = RolloutCorrAccumulator()
    acc.add_fraction_counts("train", {"f": (1, 4), "g": (torch.tensor(0), torch.tensor(0))})
    acc.add_fraction_counts("train", {"f": (torch.tensor(2), torch.tensor(2))})
    acc.add_fraction_counts("eval", {"f": (1, 3)})
    assert acc.flush("train") == {"rollout_corr/f": 3 / 6}  # not (1/4 + 2/2) / 2; g (denominator 0) omitted
    assert acc.flush("eval") == {"eval_rollout_corr/f": 1 / 3}
    assert acc.flush("train") == {}


def test_fraction_counts_are_exact_over_two_fake_ranks():
    """One sum collective over the (name-ordered) counts: rank 1 holds f = 5/10 and g = 0/2."""
    twin = TwinRank(other_stats=[torch.tensor([5, 10, 0, 2])])
    acc = RolloutCorrAccumulator(twin.reducers())
    acc.add_fraction_counts("train", {"g": (1, 2), "f": (1, 6)})
    assert acc.flush("train") == {"rollout_corr/f": 6 / 16, "rollout_corr/g": 1 / 4}
    assert twin.calls == ["sum"]
