"""CorrectionStats: exact merging across micro-batches and ranks, one host transfer, no NaN."""

import math
import random

import pytest
import torch

from trl_rollout_corr import PRESETS, CorrectionStats, RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.correction.stats import StatView

CONFIGS = [
    RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.5_2.0,0.01",
    ),
    RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_threshold="0.5_5",
        rollout_rs="seq_max_k2,seq_sum_k1,token_k3",
        rollout_rs_threshold="0.3,0.2_3,0.05",
    ),
    RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold="0.7_1.5",
        rollout_rs="seq_mean_k1,token_k2,seq_max_k3",
        rollout_rs_threshold="0.9_1.1,0.02,0.2",
    ),
    RolloutCorrectionConfig(),
]


def _batch(B=24, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(B, T, generator=g) * 3
    old = roll + torch.randn(B, T, generator=g) * 0.2
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    old[3, 2] = float("nan")  # an invalid token
    roll[5, 0] = float("-inf")
    mask[7] = 0  # a padding row
    return old, roll, mask


def _splits(B, parts, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, B), parts - 1)) if parts > 1 else []
    bounds = [0, *cuts, B]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["tokenTIS_BN_k1_k3", "seqIcePop_rs3", "tokenIcePop_rs3", "disabled"])
@pytest.mark.parametrize("parts", [1, 2, 3, 7, 24])
def test_merging_any_split_equals_one_call(cfg, parts):
    old, roll, mask = _batch()
    whole = compute_rollout_correction(old, roll, mask, cfg).metrics
    for seed in range(3):
        pieces = []
        for sl in _splits(old.shape[0], parts, seed):
            out = compute_rollout_correction(old[sl], roll[sl], mask[sl], cfg)
            pieces.append(out.stats)
        merged = CorrectionStats.merge_all(pieces).finalize()
        assert merged.keys() == whole.keys()
        for k in whole:
            assert merged[k] == pytest.approx(whole[k], abs=1e-6, rel=1e-6), k


def test_reduce_across_fake_ranks_is_exact():
    # Simulate 2 ranks with very unequal loads (10 valid tokens vs 1000): reduce = sum/max/min over ranks.
    cfg = CONFIGS[0]
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(21, 100, generator=g) * 2
    old = roll + torch.randn(21, 100, generator=g) * 0.1
    mask = torch.zeros(21, 100)
    mask[0, :10] = 1
    mask[1:] = 1
    whole = compute_rollout_correction(old, roll, mask, cfg).metrics
    ranks = [
        compute_rollout_correction(old[:1], roll[:1], mask[:1], cfg).stats,
        compute_rollout_correction(old[1:], roll[1:], mask[1:], cfg).stats,
    ]
    reduced = ranks[0].reduce(
        lambda t: ranks[0].sums + ranks[1].sums,
        lambda t: torch.maximum(ranks[0].maxs, ranks[1].maxs),
        lambda t: torch.minimum(ranks[0].mins, ranks[1].mins),
    )
    got = reduced.finalize()
    for k in whole:
        assert got[k] == pytest.approx(whole[k], abs=1e-6, rel=1e-6), k


def test_finalize_is_one_transfer_and_stats_stay_on_device():
    old, roll, mask = _batch()
    out = compute_rollout_correction(old, roll, mask, CONFIGS[0])
    st = out.stats
    for names, vec in ((st.sum_names, st.sums), (st.max_names, st.maxs), (st.min_names, st.mins)):
        assert vec.dim() == 1 and vec.dtype == torch.float64 and len(vec) == len(names) == len(set(names))
    assert st.to_vector().shape == (len(st.sum_names) + len(st.max_names) + len(st.min_names),)
    sums, _, _ = st.as_dicts()
    expected = (mask.bool() & torch.isfinite(old) & torch.isfinite(roll)).sum().item()
    assert sums["n_tok"].item() == expected < mask.sum().item()  # NaN / -inf tokens are not counted


def test_merge_refuses_different_configs():
    old, roll, mask = _batch()
    a = compute_rollout_correction(old, roll, mask, CONFIGS[0]).stats
    b = compute_rollout_correction(old, roll, mask, CONFIGS[1]).stats
    with pytest.raises(ValueError, match="different correction configurations"):
        a.merge(b)
    with pytest.raises(ValueError, match="at least one"):
        CorrectionStats.merge_all([])


def test_ess_hand_values():
    # Weights 1, 1, 2 (U = 4): ESS = (4)^2 / (3 * 6) = 0.888..., std = sqrt(6/3 - (4/3)^2)
    old = torch.log(torch.tensor([[1.0, 1.0, 2.0]]))
    out = compute_rollout_correction(
        old, torch.zeros(1, 3), torch.ones(1, 3), RolloutCorrectionConfig.decoupled_token_is(4.0)
    )
    m = out.metrics
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(16 / 18)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(2 - 16 / 9))
    assert m["rollout_corr/kl"] == pytest.approx(-math.log(2) / 3)


class _Recorder(dict):
    """A stats table that remembers which stored names a finaliser read."""

    def __init__(self, items):
        super().__init__(items)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


NAME_CONFIGS = [RolloutCorrectionConfig.from_preset(name) for name in PRESETS] + [
    RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold="0.9_1.1",
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,token_k2,token_k3,seq_max_k3,seq_sum_k2",
        rollout_rs_threshold="0.8_1.3,0.01,0.02,0.05,0.3",
    ),
    RolloutCorrectionConfig(
        rollout_is="sequence",
        rollout_is_threshold="0.5_2",
        rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k2,seq_max_k2,seq_sum_k1,seq_sum_k3,seq_mean_k1",
        rollout_rs_threshold="0.01,0.04,0.5_1.5,0.2,0.9_1.1",
    ),
]


@pytest.mark.parametrize("buckets", [(), (3, 8)])
@pytest.mark.parametrize("cfg", NAME_CONFIGS, ids=lambda c: f"{c.rollout_is}-{c.rollout_rs}-{c.bypass_mode}")
def test_each_family_finalises_exactly_what_it_gathered(cfg, buckets):
    """Every statistic a family registers is read by its finaliser, and nothing else is read."""
    old, roll, mask = _batch()
    st = compute_rollout_correction(old, roll, mask, cfg, length_buckets=buckets).stats
    host = st.to_vector().tolist()
    a, b = len(st.sum_names), len(st.sum_names) + len(st.max_names)
    view = StatView({}, {}, {})
    view._sums = _Recorder(zip(st.sum_names, host[:a]))
    view._maxs = _Recorder(zip(st.max_names, host[a:b]))
    view._mins = _Recorder(zip(st.min_names, host[b:]))
    st.layout.finalize(view)
    assert view._sums.read == set(st.sum_names)
    assert view._maxs.read == set(st.max_names)
    assert view._mins.read == set(st.min_names)


def test_stat_view_reads_through_the_stored_name_rule():
    from trl_rollout_corr.correction.stats import Kind, stat_name

    sums = {
        stat_name("a", Kind.SUM): 1.0,
        stat_name("a", Kind.SQ): 2.0,
        stat_name("a", Kind.SUM, 1): 3.0,
        stat_name("a", Kind.WSQ, 1): 4.0,
    }
    view = StatView(sums, {stat_name("a", Kind.MAX): 5.0}, {stat_name("a", Kind.MIN): 6.0})
    assert (view.sum("a"), view.sq("a"), view.sum("a", 1), view.sq("a", 1)) == (1.0, 2.0, 3.0, 4.0)
    assert (view.max("a"), view.min("a")) == (5.0, 6.0)
    with pytest.raises(KeyError, match="'b'.*not gathered"):
        view.sum("b")
