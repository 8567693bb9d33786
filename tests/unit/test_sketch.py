"""sketch: the bounded-memory quantiles of the ratio and support-size metrics, against exact values (numpy's
quantile, hand values), merged over micro-batches and over ranks (threads with real collectives), empty windows, a
window over 2^24 values, and analyze's check of logged values against the sketch's guaranteed interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from thread_ranks import run_ranks
from trl_rollout_corr import sketch as sk
from trl_rollout_corr.accumulator import RolloutCorrAccumulator
from trl_rollout_corr.sketch import (
    RATIO_ALPHA,
    RATIO_FLOOR,
    RATIO_QUANTILES,
    ValueSketch,
    ratio_bounds,
    ratio_layout,
    ratio_metrics,
    reduce_sketches,
    size_layout,
)
from trl_rollout_corr.support import SupportStats

QS = [q for _, q in RATIO_QUANTILES]


def _exact_ratio_quantiles(l: np.ndarray) -> list[float]:
    """numpy's linear-interpolation quantiles of exp(clamp(l, +-20)): the independent reference."""
    return [float(v) for v in np.quantile(np.exp(np.clip(l, -20, 20)), QS)]


def _ratio_error_bound(l: np.ndarray, q: float) -> float:
    """The stated bound: relative exp(alpha max|l| + floor) - 1, |l| of the two order statistics around q."""
    v = np.sort(np.clip(l, -20, 20))
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    big = max(abs(v[lo]), abs(v[min(lo + 1, len(v) - 1)]))
    return math.expm1(RATIO_ALPHA * big + RATIO_FLOOR)


# ---------------------------------------------------------------------------------------------- layouts
def test_layouts_partition_and_represent_within_alpha():
    for layout in (ratio_layout(), size_layout()):
        assert bool((layout.edges[1:] > layout.edges[:-1]).all())
        assert layout.size == layout.edges.numel() + 1
        finite = torch.isfinite(layout.lower) & torch.isfinite(layout.upper) & (layout.representative != 0)
        lo, hi, rep = layout.lower[finite], layout.upper[finite], layout.representative[finite]
        assert bool(((lo <= rep) & (rep <= hi)).all())
        worst = torch.maximum((rep - lo).abs() / lo.abs(), (hi - rep).abs() / hi.abs()).max().item()
        assert worst <= RATIO_ALPHA * (1 + 1e-9)
    r = ratio_layout()
    assert r.size == 23_721 and size_layout().size == 8_256  # the sizes docs/how-to/read-the-metrics.md states
    zero = r.size // 2
    assert r.representative[zero] == 0 and r.lower[zero] == -RATIO_FLOOR and r.upper[zero] == RATIO_FLOOR
    # sizes 0..4096 have a bucket each, represented exactly
    s = size_layout()
    ints = torch.arange(4097, dtype=torch.float64)
    index = torch.bucketize(ints, s.edges, right=True)
    assert index.tolist() == list(range(4097)) and torch.equal(s.representative[index], ints)


# ---------------------------------------------------------------------------------------------- against exact values
@pytest.mark.parametrize("dist", ["engine", "wide", "ties", "clamped"])
def test_ratio_quantiles_within_the_stated_error_of_numpy(dist):
    g = np.random.default_rng(0)
    n = 100_000
    l = {"engine": g.normal(0, 0.02, n),  # typical engine mismatch
         "wide": g.standard_t(2, n),  # heavy tails, |l| up to ~100 before the clamp
         "ties": g.choice([-0.3, 0.0, 0.0, 1e-12, 0.7], n),
         "clamped": g.choice([-25.0, 25.0, 3.0], n)}[dist]
    s = ValueSketch(ratio_layout(), exact_max=0).add(torch.from_numpy(l))
    got = ratio_metrics(s)
    bounds = ratio_bounds(s)
    for (key, q), exact in zip(RATIO_QUANTILES, _exact_ratio_quantiles(l)):
        assert abs(got[key] / exact - 1) <= _ratio_error_bound(l, q) * (1 + 1e-9), (key, got[key], exact)
        lower, upper = bounds[key]
        assert lower * (1 - 1e-12) <= exact <= upper * (1 + 1e-12), (key, lower, exact, upper)
    ratio = np.exp(np.clip(l, -20, 20))
    assert got["mean"] == pytest.approx(ratio.mean(), rel=1e-12)  # exact sum / count
    assert got["max"] == ratio.max()  # exact


def test_ratio_quantiles_by_hand():
    """Ratios 1, 2, 4 (n = 3): p50 is order statistic 1 (ln 2, read as its bucket's representative), p01 at position
    0.02 between the exact min (1) and it, p99 at 1.98 between it and the exact max (4)."""
    hand = torch.tensor([0.0, math.log(2), math.log(4)], dtype=torch.float64)
    s = ValueSketch(ratio_layout(), exact_max=0).add(hand)
    r = ratio_layout()
    b = int(torch.bucketize(torch.tensor([math.log(2)], dtype=torch.float64), r.edges, right=True))
    two = math.exp(float(r.representative[b]))
    assert abs(two / 2 - 1) <= math.expm1(RATIO_ALPHA * math.log(2))
    got = ratio_metrics(s)
    assert got["p50"] == two
    assert got["p01"] == pytest.approx(1 + 0.02 * (two - 1), rel=1e-15)
    assert got["p99"] == pytest.approx(two + 0.98 * (4 - two), rel=1e-15)
    assert got["max"] == pytest.approx(4.0, rel=1e-15) and got["mean"] == pytest.approx(7 / 3, rel=1e-15)
    # a small window stays exact: the old exact quantiles, bit for bit
    exact = ratio_metrics(ValueSketch(ratio_layout()).add(hand))
    assert exact == sk.exact_ratio_quantiles(hand)
    assert exact["p50"] == pytest.approx(2.0, rel=1e-15) and exact["p01"] == pytest.approx(1.02, rel=1e-15)


def test_size_quantiles_exact_up_to_4096_and_within_alpha_above():
    g = torch.Generator().manual_seed(1)
    small = torch.randint(1, 4097, (50_000,), generator=g).double()
    big = torch.randint(1, 200_000, (50_000,), generator=g).double()
    for values, rel in ((small, 1e-15), (big, sk.SIZE_ALPHA)):
        s = ValueSketch(size_layout(), exact_max=0).add(values)
        exact = torch.quantile(values, torch.tensor([0.5, 0.99], dtype=torch.float64)).tolist()
        for (est, lower, upper), e in zip(s.quantiles([0.5, 0.99]), exact):
            assert abs(est - e) <= rel * e + 1e-9 and lower <= e <= upper


# ---------------------------------------------------------------------------------------------- merging
def _engine(seed: int, n: int) -> torch.Tensor:
    return 0.05 * torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("exact_max", [0, 60, None])  # always counts / crossing the bound mid-way / exact
def test_micro_batches_merge_to_one_batch(exact_max):
    parts = [_engine(i, n) for i, n in enumerate((7, 30, 0, 40))]
    one = ValueSketch(ratio_layout(), exact_max).add(torch.cat(parts))
    added = ValueSketch(ratio_layout(), exact_max)
    merged = ValueSketch(ratio_layout(), exact_max)
    for p in parts:
        added.add(p)
        merged = merged.merge(ValueSketch(ratio_layout(), exact_max).add(p))
    for s in (added, merged):
        assert s.n == one.n == 77 and s.exact == one.exact == (exact_max is None)
        if not s.exact:
            assert torch.equal(s.counts, one.counts) and s.low == one.low and s.high == one.high
        assert ratio_metrics(s) == pytest.approx(ratio_metrics(one), rel=1e-15)
    with pytest.raises(ValueError, match="cannot merge a size sketch"):
        one.merge(ValueSketch(size_layout(), exact_max))


@pytest.mark.parametrize("exact_max", [0, 100, None])  # counts / small ranks in a large window / exact
def test_ranks_reduce_to_one_batch(exact_max):
    """Three ranks (threads, real exchanges; rank 1 holds nothing): every rank gets the one-process sketch of all
    values: bit-equal counts and extrema, the same metrics."""
    shards = [_engine(10, 50), _engine(11, 0), _engine(12, 70)]
    one = ValueSketch(ratio_layout(), exact_max).add(torch.cat(shards))

    def rank_fn(rank, reducers):
        mine = [ValueSketch(ratio_layout(), exact_max).add(shards[rank]),
                ValueSketch(size_layout(), exact_max).add(torch.full((rank,), 5.0))]
        return reduce_sketches(mine, reducers)

    results = run_ranks(3, rank_fn)
    for ratio, size in results:
        assert ratio.n == 120 and size.n == 3
        if exact_max is None:
            assert torch.equal(ratio.exact_values(), torch.cat(shards))  # rank order
        else:
            assert torch.equal(ratio.counts, one.counts) and ratio.low == one.low and ratio.high == one.high
        assert ratio_metrics(ratio) == ratio_metrics(results[0][0])
        assert ratio_metrics(ratio) == pytest.approx(ratio_metrics(one), rel=1e-14)
        assert [e for e, _, _ in size.quantiles([0.5])] == [5.0]


def test_accumulator_flush_over_ranks_equals_one_rank_and_stays_exact_when_small():
    """The accumulator over three ranks (threads) logs what one rank logs for all their tokens, exact (the old exact
    quantiles) for a small window and the sketch's values above ``exact_max``."""
    shards = [_engine(20, 40), _engine(21, 0), _engine(22, 25)]
    everything = torch.cat(shards)
    for exact_max in (None, 30):
        single = RolloutCorrAccumulator(exact_max=exact_max)
        single.add_log_ratios("train", {"engine": everything, "update": everything[:3]})
        reference = single.flush("train")

        def rank_fn(rank, reducers):
            acc = RolloutCorrAccumulator(reducers, exact_max=exact_max)
            acc.add_log_ratios("train", {"engine": shards[rank][:10], "update": everything[rank: rank + 1]})
            acc.add_log_ratios("train", {"engine": shards[rank][10:], "update": everything[:0]})
            return acc.flush("train")

        for got in run_ranks(3, rank_fn):
            assert got.keys() == reference.keys() and len(got) == 10
            assert got == pytest.approx(reference, rel=1e-14)
    exact = sk.exact_ratio_quantiles(everything)
    assert {k[len("rollout_corr/engine_ratio_"):]: v for k, v in reference.items() if "engine" in k} != exact
    small = RolloutCorrAccumulator()
    small.add_log_ratios("train", {"engine": everything})
    assert {k[len("rollout_corr/engine_ratio_"):]: v for k, v in small.flush("train").items()} == exact


# ---------------------------------------------------------------------------------------------- empty, huge
def test_empty_windows_log_nothing_and_run_the_same_collectives():
    assert ratio_metrics(ValueSketch(ratio_layout(), 0)) == {} == ratio_metrics(ValueSketch(ratio_layout()))
    assert ratio_bounds(ValueSketch(ratio_layout(), 0)) == {}
    with pytest.raises(ValueError, match="no value in the sketch"):
        ValueSketch(size_layout()).quantiles([0.5])
    with pytest.raises(ValueError, match="exact_max must be >= 0"):
        ValueSketch(size_layout(), -1)

    def rank_fn(rank, reducers):  # no rank has a token: nothing logged, no NaN, no hang
        acc = RolloutCorrAccumulator(reducers, exact_max=0)
        acc.add_log_ratios("train", {"engine": torch.zeros(0)})
        return acc.flush("train")

    assert run_ranks(2, rank_fn) == [{}, {}]


def test_support_sizes_over_2_24_tokens_do_not_crash():
    """Issue 44 item 3: ``torch.quantile`` raises above 2^24 elements ("quantile() input tensor is too large"), so
    the old flush died at the first log of a window with 16.8M support-scored tokens. Sizes 1..16, 2^20 tokens each,
    plus one size-16 token: n = 2^24 + 1, p50 = order statistic 2^23 = 9, p99 at position 0.99 * 2^24 =
    16609443.84 = 16 (by hand; exact: sizes <= 4096)."""
    chunk = torch.arange(1, 17, dtype=torch.float64).repeat_interleave(2 ** 16)  # 2^20 sizes, 1..16
    sums = torch.tensor([chunk.numel(), 0.0, chunk.sum(), 2.0 ** 16, 0.0], dtype=torch.float64)
    part = SupportStats.from_sizes(sums, chunk)
    assert not part.sizes.exact  # 2^20 > EXACT_MAX: counted when added
    acc = RolloutCorrAccumulator()
    for _ in range(16):
        acc.add_support("train", part)
    acc.add_support("train", SupportStats.from_sizes(torch.tensor([1.0, 0.0, 16.0, 0.0, 0.0], dtype=torch.float64),
                                                     torch.tensor([16.0])))
    logged = acc.flush("train")
    assert logged["rollout_corr/support_size_p50"] == 9.0 and logged["rollout_corr/support_size_p99"] == 16.0
    assert logged["rollout_corr/support_size_mean"] == pytest.approx((16 * 2 ** 20 * 8.5 + 16) / (2 ** 24 + 1))


# ---------------------------------------------------------------------------------------------- analyze
def test_analyze_checks_exact_logs_against_the_sketch_interval(tmp_path, monkeypatch):
    """A dump logged with exact quantiles, analysed with the sketch forced on (``EXACT_MAX`` 0, as a window over
    65,536 tokens): the logged exact values lie in the sketch's intervals (distance 0); one moved outside fails."""
    from hand_dump import random_dump
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    monkeypatch.setattr(sk, "EXACT_MAX", 0)
    check, analyses, _ = analyse_dump(open_dump(random_dump(tmp_path / "d", noise=0.3)), [])
    assert check.ok and check.compared > 40, check.failures
    bounds = analyses[0].per_window[1].bounds()
    assert set(bounds) == {f"rollout_corr/{n}_ratio_{q}" for n in ("engine", "update", "direct")
                           for q in ("p01", "p50", "p99")}
    lower, upper = bounds["rollout_corr/engine_ratio_p99"]
    assert 0 < upper - lower < 1e-2 * upper  # a real interval: the sketch was read
    logged = dict(open_dump(tmp_path / "d").windows[0].metrics)
    logged["rollout_corr/engine_ratio_p99"] = upper * 1.001
    bad = open_dump(random_dump(tmp_path / "bad", noise=0.3))
    bad.windows[0].metrics.update(logged)
    check, _, _ = analyse_dump(bad, [])
    assert [key for _, key, _, _ in check.failures] == ["rollout_corr/engine_ratio_p99"]
    assert check.max_abs_diff == pytest.approx(upper * 0.001, rel=1e-6)


@pytest.mark.parametrize("exact_max", [0, 65_536])
def test_non_finite_values_are_refused_not_sketched(exact_max):
    """NaN has no place in a quantile: add refuses it (never a silent NaN p50 or a NaN bucket); a ratio layout clamps
    +-inf to its bound (documented), a size layout refuses it."""
    with pytest.raises(RuntimeError, match="ValueSketch.add: a non-finite value"):
        ValueSketch(ratio_layout(), exact_max).add(torch.tensor([0.1, float("nan"), -0.2]))
    with pytest.raises(RuntimeError, match="inf in a size layout"):
        ValueSketch(size_layout(), exact_max).add(torch.tensor([3.0, float("inf")]))
    clamped = ValueSketch(ratio_layout(), exact_max).add(torch.tensor([0.0, float("inf"), float("-inf")]))
    assert clamped.n == 3
    assert [q[0] for q in clamped.quantiles([0.0, 1.0])] == pytest.approx(
        [math.exp(-sk.SAFETY_BOUND), math.exp(sk.SAFETY_BOUND)], rel=2e-3)
