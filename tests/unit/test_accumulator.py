"""accumulator: per-mode buffering of the rollout_corr/* metrics and their exact flush, with fake cross-rank
reducers standing in for a second rank."""

from __future__ import annotations

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.accumulator import Reducers, RolloutCorrAccumulator, exact_ratio_quantiles, gather_uneven


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
    """Fake reducers for two ranks, this one rank 0: the other rank holds ``other`` (its stats vector and its 1-D log
    ratios: one ratio name, a window small enough for the exact path, whose values rank 1 places after rank 0's in the
    sketch's sum buffer, ``sketch.reduce_sketches``)."""

    def __init__(self, other_stats=None, other_values=None):
        self.other_stats, self.other_values, self.calls = other_stats, other_values, []
        self.mine = None  # this rank's value count, between the sketch's count gather and its sum

    def reducers(self) -> Reducers:
        return Reducers(world_size=2, rank=0, sum=self.sum, max=self.max, min=self.min, gather=self.gather)

    def sum(self, t):
        self.calls.append("sum")
        if self.mine is not None:
            out, n = t.clone(), self.other_values.numel()
            out[self.mine: self.mine + n] += self.other_values
            self.mine = None
            return out
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
            self.mine = int(t[0])
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
    assert exact_ratio_quantiles(torch.zeros(0)) == {}  # no token: not logged (never 0)


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
    assert twin.calls[:3] == ["sum", "max", "min"] and twin.calls[3:] == ["gather", "sum"]

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
def test_fractions_sum_global_counts_over_calls():
    acc = RolloutCorrAccumulator()
    acc.add_fraction("train", "rs_lone_survivor_fraction", 1, 8)
    acc.add_fraction("train", "rs_lone_survivor_fraction", 2, 8)
    acc.add_fraction("eval", "rs_lone_survivor_fraction", 0, 0)
    assert acc.flush("train") == {"rollout_corr/rs_lone_survivor_fraction": 3 / 16}
    assert acc.flush("eval") == {}  # a fraction of no row is not logged
    assert acc.flush("train") == {}


# ---------------------------------------------------------------------------------------------- steps with no rows
# Hand values: l = log pi_old - log mu of two rows, token TIS capped at 2: W = [1.5, 0.5, 2, 1], R = [1.5, 0.5, 3, 1]
L_HAND = torch.tensor([[1.5, 0.5], [3.0, 1.0]]).log()
TIS = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
EMPTY_KEYS = ("rollout_is_mean", "rollout_is_max", "rollout_is_eff_sample_size", "kl", "k3_kl", "chi2_token",
              "engine_ratio_mean", "engine_ratio_p50", "engine_ratio_max", "invalid_token_fraction",
              "len_0_64/kl", "len_0_64/is_eff_sample_size")


def _add_step(acc, l, mask, lags, keep):
    """One micro-batch as the decoupled trainer records it: the correction's stats, the trained tokens' engine
    ratios (mask after the max_policy_lag filter), the per-row lags."""
    kept = mask * keep[:, None]
    acc.add_stats("train", compute_rollout_correction(l, torch.zeros_like(l), kept, TIS).stats)
    acc.add_log_ratios("train", {"engine": l[kept != 0]})
    acc.add_policy_lag_rows("train", lags, (mask != 0).sum(1), keep)


def test_a_fully_dropped_step_logs_counts_but_no_statistic():
    """Every row over max_policy_lag: the statistics over no token are absent (not 0.0), the counts and the
    well-defined fractions are there (drop fraction 1.0)."""
    acc = RolloutCorrAccumulator()
    _add_step(acc, L_HAND, torch.ones(2, 2), torch.tensor([2, 2]), torch.tensor([False, False]))
    logged = acc.flush("train")
    assert logged["rollout_corr/num_valid_tokens"] == 0 and logged["rollout_corr/num_valid_seqs"] == 0
    assert logged["rollout_corr/policy_lag_dropped_fraction"] == 1.0
    assert logged["rollout_corr/policy_lag_dropped_token_fraction"] == 1.0
    assert logged["rollout_corr/policy_lag_mean"] == 2.0 and logged["rollout_corr/policy_lag_max"] == 2.0
    assert logged["rollout_corr/len_0_64/num_seqs"] == 0
    assert not [k for k in EMPTY_KEYS if "rollout_corr/" + k in logged]
    assert all(not k.startswith(("rollout_corr/rollout_is", "rollout_corr/engine_ratio")) for k in logged)


def test_an_empty_micro_batch_leaves_the_window_statistics_unchanged():
    """A fully dropped micro-batch in the same window as a trained one: the window's statistics are those of the
    trained rows alone (hand values), never pulled towards 0."""
    acc = RolloutCorrAccumulator()
    _add_step(acc, L_HAND, torch.ones(2, 2), torch.tensor([2, 2]), torch.tensor([False, False]))
    _add_step(acc, L_HAND, torch.ones(2, 2), torch.tensor([0, 0]), torch.tensor([True, True]))
    logged = acc.flush("train")
    assert logged["rollout_corr/rollout_is_mean"] == pytest.approx(5.0 / 4)
    assert logged["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert logged["rollout_corr/engine_ratio_mean"] == pytest.approx(6.0 / 4)
    assert logged["rollout_corr/engine_ratio_max"] == pytest.approx(3.0)
    assert logged["rollout_corr/num_valid_tokens"] == 4 and logged["rollout_corr/invalid_token_fraction"] == 0.0
    assert logged["rollout_corr/policy_lag_dropped_fraction"] == 0.5
    assert "rollout_corr/len_64_256/kl" not in logged and logged["rollout_corr/len_64_256/num_seqs"] == 0


def _twin_of(l, mask):
    """Fake reducers whose other rank holds rows ``l`` / ``mask`` (its stats vectors and its engine log ratios)."""
    other = []

    def grab(t):
        other.append(t.clone())
        return t

    compute_rollout_correction(l, torch.zeros_like(l), mask, TIS).stats.reduce(grab, grab, grab)
    return TwinRank(other_stats=other, other_values=l[mask != 0].double())


@pytest.mark.parametrize("empty_rank", [0, 1, "both"])
def test_a_rank_without_rows_adds_nothing_to_the_means(empty_rank):
    """Two fake ranks, one (or both) holding only dropped rows: the logged values are those of the rows that exist
    (hand values), the same collectives run in the same order whichever rank is empty (no hang)."""
    empty, full = torch.zeros(2, 2), torch.ones(2, 2)
    mine, theirs = (empty, full) if empty_rank == 0 else (full, empty) if empty_rank == 1 else (empty, empty)
    twin = _twin_of(L_HAND, theirs)
    acc = RolloutCorrAccumulator(twin.reducers())
    acc.add_stats("train", compute_rollout_correction(L_HAND, torch.zeros_like(L_HAND), mine, TIS).stats)
    acc.add_log_ratios("train", {"engine": L_HAND[mine != 0]})
    logged = acc.flush("train")
    assert twin.calls == ["sum", "max", "min", "gather", "sum"]
    if empty_rank == "both":
        assert logged == {"rollout_corr/num_valid_tokens": 0.0, "rollout_corr/num_valid_seqs": 0.0,
                          **{f"rollout_corr/len_{a}_{b}/num_seqs": 0.0
                             for a, b in ((0, 64), (64, 256), (256, 1024), (1024, "inf"))}}
        return
    assert logged["rollout_corr/rollout_is_mean"] == pytest.approx(5.0 / 4)
    assert logged["rollout_corr/rollout_is_seq_mean"] == pytest.approx((1.0 + 1.5) / 2)
    assert logged["rollout_corr/engine_ratio_mean"] == pytest.approx(6.0 / 4)
    assert logged["rollout_corr/engine_ratio_p50"] == pytest.approx(1.25)
    assert logged["rollout_corr/num_valid_seqs"] == 2


def _empty_rank_worker(rank, world, port, path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

    def reduce(op):
        def fn(t):
            t = t.clone()
            dist.all_reduce(t, op=op)
            return t
        return fn

    def gather(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    reducers = Reducers(world, sum=reduce(dist.ReduceOp.SUM), max=reduce(dist.ReduceOp.MAX),
                        min=reduce(dist.ReduceOp.MIN), gather=gather)
    keep = torch.tensor([rank == 1, rank == 1])  # rank 0: every row over max_policy_lag
    for exact_max, suffix in ((None, ""), (0, ".sketch")):  # the exact quantiles, then the sketch's (real gloo)
        acc = RolloutCorrAccumulator(reducers, exact_max=exact_max)
        _add_step(acc, L_HAND, torch.ones(2, 2), torch.tensor([0, 0]) if rank else torch.tensor([3, 3]), keep)
        torch.save(acc.flush("train"), f"{path}{suffix}.{rank}")
    dist.destroy_process_group()


def test_two_real_ranks_one_without_rows_equal_one_rank():
    """Two gloo processes, rank 0's rows all dropped: both ranks finish the flush (no hang) and log what one rank
    logs for both ranks' rows; the statistics are rank 1's rows alone."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = str(pytest.importorskip("tempfile").mkdtemp()) + "/flush"
    mp.spawn(_empty_rank_worker, args=(2, port, path), nprocs=2, join=True)
    single = RolloutCorrAccumulator()
    _add_step(single, torch.cat([L_HAND, L_HAND]), torch.ones(4, 2), torch.tensor([3, 3, 0, 0]),
              torch.tensor([False, False, True, True]))
    reference = single.flush("train")
    assert reference["rollout_corr/rollout_is_mean"] == pytest.approx(5.0 / 4)
    assert reference["rollout_corr/policy_lag_dropped_fraction"] == 0.5
    sketch = RolloutCorrAccumulator(exact_max=0)
    _add_step(sketch, torch.cat([L_HAND, L_HAND]), torch.ones(4, 2), torch.tensor([3, 3, 0, 0]),
              torch.tensor([False, False, True, True]))
    sketched = sketch.flush("train")
    assert sketched["rollout_corr/engine_ratio_p50"] != reference["rollout_corr/engine_ratio_p50"]  # read off buckets
    for suffix, expected in (("", reference), (".sketch", sketched)):
        for rank in range(2):
            got = torch.load(f"{path}{suffix}.{rank}")
            assert set(got) == set(expected), rank
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (suffix, rank, key)
