"""KPop (``rollout_rs="token_binary_kl"``): masks equal to an independent float64 evaluation of the Bernoulli KL on a
hand table of probability pairs, the edges (p or q exactly 1, underflow), phi validation, metrics and presets."""

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.config import PRESETS, RolloutCorrectionArguments
from trl_rollout_corr.correction.binary_kl import LOG_ONE_MINUS_P_FLOOR, bernoulli_kl, binary_kl_both

P = "rollout_corr/rollout_rs_token_binary_kl_"


def reference_kl(p: float, q: float) -> float:
    """KL(Ber(p) || Ber(q)) written plainly, float64 (Python floats), 0 log 0 = 0."""
    first = p * math.log(p / q) if p > 0 else 0.0
    second = (1 - p) * math.log((1 - p) / (1 - q)) if p < 1 else 0.0
    return first + second


def reference_keep(p: float, q: float, phi: float) -> bool:
    return reference_kl(p, q) <= phi and reference_kl(q, p) <= phi


# (p_train, p_rollout): rare tokens, a confident pair, pairs on which IcePop's ratio band [0.5, 5] and KPop disagree
TABLE = [
    (1e-4, 1e-3),  # ratio 0.1: IcePop rejects; KL 6.7e-4 / 1.4e-3: KPop keeps
    (1e-3, 1e-4),  # ratio 10: IcePop rejects; KPop keeps
    (0.99, 0.9),  # ratio 1.1: IcePop keeps; reverse KL 0.1445 > 0.1: KPop rejects
    (0.9, 0.99),  # ratio 0.91: IcePop keeps; KPop rejects (forward KL 0.1445)
    (0.5, 0.29),  # KL 0.097: both keep
    (0.5, 0.2),  # ratio 2.5: IcePop keeps; KL 0.223: KPop rejects
    (0.6, 0.1),  # ratio 6: both reject
    (0.02, 0.003),  # ratio 6.7: IcePop rejects; KL 0.024: KPop keeps
    (0.3, 0.3),  # identical: both keep
    (0.999, 0.9999),  # confident and close: both keep
    (1e-8, 3e-7),  # very rare, ratio 1/30: IcePop rejects; KL ~3e-7: KPop keeps
]
PHI = 0.1


def _icepop_keeps(p, q):
    return 0.5 <= p / q <= 5.0


def test_the_table_holds_pairs_on_which_icepop_and_kpop_disagree():
    disagree = [(p, q) for p, q in TABLE if _icepop_keeps(p, q) != reference_keep(p, q, PHI)]
    assert {(1e-4, 1e-3), (0.99, 0.9), (0.5, 0.2), (0.02, 0.003)} <= set(disagree)
    assert reference_kl(0.9, 0.99) == pytest.approx(0.14447934747, rel=1e-9)  # by hand: .9 ln(.9/.99) + .1 ln 10


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_masks_equal_the_float64_formula(dtype):
    log_p = torch.tensor([[math.log(p) for p, _ in TABLE]], dtype=dtype)
    log_q = torch.tensor([[math.log(q) for _, q in TABLE]], dtype=dtype)
    mask = torch.ones_like(log_p, dtype=torch.int64)
    cfg = RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold=PHI)
    out = compute_rollout_correction(log_p, log_q, mask, cfg)
    # the reference sees the probabilities the (possibly float32) inputs encode
    pairs = zip(log_p[0].tolist(), log_q[0].tolist())
    expected = [int(reference_keep(math.exp(a), math.exp(b), PHI)) for a, b in pairs]
    assert out.response_mask[0].tolist() == expected
    assert expected == [1, 1, 0, 0, 1, 0, 0, 1, 1, 1, 1]
    stat = binary_kl_both(log_p, log_q)[0].tolist()
    for (a, b), value in zip(zip(log_p[0].tolist(), log_q[0].tolist()), stat):
        p, q = math.exp(a), math.exp(b)
        assert value == pytest.approx(max(reference_kl(p, q), reference_kl(q, p)), rel=1e-9, abs=1e-300)


def test_close_probabilities_keep_their_digits():
    # the two-term textbook form cancels to noise when p ~ q; the k3 form keeps ~full precision: (p-q)^2 / (2p(1-p))
    p = 0.3
    d = 1e-7
    value = bernoulli_kl(torch.tensor(math.log(p), dtype=torch.float64), torch.tensor(math.log(p) + d,
                                                                                       dtype=torch.float64)).item()
    q = p * math.exp(d)
    # series of KL(p||q) in e = q - p: e^2/(2p(1-p)) + e^3 (1-2p)/(6 p^2 (1-p)^2)... (second term 1e-7 relative here)
    e = q - p
    assert value == pytest.approx(e * e / (2 * p * (1 - p)) * (1 - e * (1 - 2 * p) / (3 * p * (1 - p))), rel=1e-6)


def test_edges_p_or_q_exactly_one_and_underflow():
    zero = torch.tensor(0.0, dtype=torch.float64)
    log09 = torch.tensor(math.log(0.9), dtype=torch.float64)
    assert bernoulli_kl(zero, zero).item() == 0.0  # both exactly 1
    # p = 1 exactly: KL(Ber(1) || Ber(q)) = -log q (finite, exact)
    assert bernoulli_kl(zero, log09).item() == pytest.approx(-math.log(0.9), rel=1e-12)
    # KL(Ber(q) || Ber(1)) is +inf in exact arithmetic; 1 - p is read as 2^-1022 (finite, documented)
    floored = 0.9 * math.log(0.9) + 0.1 * (math.log(0.1) - LOG_ONE_MINUS_P_FLOOR)
    assert bernoulli_kl(log09, zero).item() == pytest.approx(floored, rel=1e-12)
    # a log-prob above 0 (rounding) is read as 0
    assert bernoulli_kl(torch.tensor(1e-7, dtype=torch.float64), log09).item() == pytest.approx(-math.log(0.9))
    # p underflows (exp(-800) = 0 in float64): KL(Ber(0) || Ber(q)) = -log(1 - q);
    # KL(Ber(q) || Ber(0)) = q (log q + 800) + (1 - q) log(1 - q)
    tiny = torch.tensor(-800.0, dtype=torch.float64)
    log03 = torch.tensor(math.log(0.3), dtype=torch.float64)
    assert bernoulli_kl(tiny, log03).item() == pytest.approx(-math.log(0.7), rel=1e-12)
    assert bernoulli_kl(log03, tiny).item() == pytest.approx(0.3 * (math.log(0.3) + 800) + 0.7 * math.log(0.7),
                                                              rel=1e-12)
    # very negative log-probs (an engine's -1e8) stay finite
    assert math.isfinite(binary_kl_both(torch.tensor(-1e8), torch.tensor(-0.5)).item())


def test_both_sides_confident_is_kept_and_one_side_rounded_to_one_is_judged_by_the_other():
    log_p = torch.tensor([[0.0, 0.0, -1e-9, 0.0]])
    log_q = torch.tensor([[0.0, -1e-6, 0.0, math.log(0.9)]])
    cfg = RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold=0.1)
    out = compute_rollout_correction(log_p, log_q, torch.ones(1, 4), cfg)
    assert out.response_mask.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_metrics_follow_the_rs_machinery():
    # rows: [(0.99, 0.9) reject, (1e-4, 1e-3) keep, (0.5, 0.29) keep], [(0.5, 0.2) reject, padding, NaN (invalid)]
    pairs = [[(0.99, 0.9), (1e-4, 1e-3), (0.5, 0.29)], [(0.5, 0.2), (0.5, 0.5), (0.5, 0.5)]]
    log_p = torch.tensor([[math.log(p) for p, _ in row] for row in pairs], dtype=torch.float64)
    log_q = torch.tensor([[math.log(q) for _, q in row] for row in pairs], dtype=torch.float64)
    log_q[1, 2] = float("nan")
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    cfg = RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold=0.1)
    out = compute_rollout_correction(log_p, log_q, mask, cfg)
    assert out.response_mask.tolist() == [[0, 1, 1], [0, 0, 0]]
    m = out.metrics

    def sym(p, q):
        return max(reference_kl(p, q), reference_kl(q, p))

    stats = [sym(0.99, 0.9), sym(1e-4, 1e-3), sym(0.5, 0.29), sym(0.5, 0.2)]
    assert m[P + "masked_fraction"] == pytest.approx(2 / 4)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert m[P + "seq_masked_fraction"] == pytest.approx(1.0)  # both rows lost a token
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    assert m[P + "fraction_high"] == pytest.approx(2 / 4) and m[P + "fraction_low"] == 0.0
    assert m[P + "mean"] == pytest.approx(sum(stats) / 4, rel=1e-9)
    assert m[P + "max"] == pytest.approx(max(stats), rel=1e-9)
    assert m[P + "min"] == pytest.approx(min(stats), rel=1e-9)
    assert m[P + "seq_mean"] == pytest.approx((sum(stats[:3]) / 3 + stats[3]) / 2, rel=1e-9)
    clamped = [min(s, 0.1) for s in stats]
    mean_c = sum(clamped) / 4
    std = math.sqrt(sum(c * c for c in clamped) / 4 - mean_c * mean_c)
    assert m[P + "std"] == pytest.approx(std, rel=1e-5)
    assert m["rollout_corr/invalid_token_fraction"] == pytest.approx(1 / 5)
    assert m["rollout_corr/num_valid_tokens"] == 4.0


def test_merging_micro_batches_gives_the_whole_batch_metrics():
    torch.manual_seed(0)
    log_q = torch.log_softmax(torch.randn(6, 5, 7, dtype=torch.float64), -1)[..., 0]
    log_p = (log_q + 0.4 * torch.randn(6, 5, dtype=torch.float64)).clamp(max=0.0)
    mask = (torch.rand(6, 5) > 0.2).long()
    cfg = RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold=0.05)
    whole = compute_rollout_correction(log_p, log_q, mask, cfg)
    parts = [compute_rollout_correction(log_p[i:i + 2], log_q[i:i + 2], mask[i:i + 2], cfg) for i in (0, 2, 4)]
    assert torch.equal(torch.cat([o.response_mask for o in parts]), whole.response_mask)
    merged = parts[0].stats.merge(parts[1].stats).merge(parts[2].stats).finalize()
    for key, value in whole.metrics.items():
        assert merged[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    kept = whole.response_mask.bool()
    assert 0 < int(kept.sum()) < int((mask > 0).sum())  # the threshold acts on this batch


def test_combines_with_other_options_by_and():
    torch.manual_seed(1)
    log_q = torch.log_softmax(torch.randn(4, 6, 5), -1)[..., 0]
    log_p = (log_q + 0.3 * torch.randn(4, 6)).clamp(max=0.0)
    mask = torch.ones(4, 6)
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0,
                                  rollout_rs="token_binary_kl,seq_mean_k3", rollout_rs_threshold="0.1,0.05")
    out = compute_rollout_correction(log_p, log_q, mask, cfg)
    only_kpop = compute_rollout_correction(log_p, log_q, mask, RolloutCorrectionConfig(
        rollout_rs="token_binary_kl", rollout_rs_threshold=0.1)).response_mask
    only_k3 = compute_rollout_correction(log_p, log_q, mask, RolloutCorrectionConfig(
        rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)).response_mask
    assert torch.equal(out.response_mask, only_kpop * only_k3)
    assert {P + "masked_fraction", "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction"} <= set(out.metrics)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("phi", [0, 0.0, -0.1, "0", "-1e-3"])
def test_phi_must_be_positive(phi):
    with pytest.raises(ValueError, match=r"token_binary_kl: phi must be > 0 .*Use e.g. 0.1"):
        RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold=phi)


def test_phi_is_a_single_number_and_required():
    with pytest.raises(ValueError, match=r"KPop takes a single phi .*not a band"):
        RolloutCorrectionConfig(rollout_rs="token_binary_kl", rollout_rs_threshold="0.1_0.2")
    with pytest.raises(ValueError, match="rollout_rs_threshold must be set"):
        RolloutCorrectionConfig(rollout_rs="token_binary_kl")
    with pytest.raises(ValueError, match="unknown option 'seq_mean_binary_kl'"):
        RolloutCorrectionConfig(rollout_rs="seq_mean_binary_kl", rollout_rs_threshold=0.1)
    spec = RolloutCorrectionConfig(rollout_rs="token_binary_kl,token_k1", rollout_rs_threshold="0.1,0.5_2").rs_specs
    assert [(s.option, s.level, s.stat, s.upper, s.lower) for s in spec] == [
        ("token_binary_kl", "token", "binary_kl", 0.1, None), ("token_k1", "token", "k1", 2.0, 0.5)]


def test_presets_and_flat_arguments():
    assert {"decoupled_kpop_rs", "bypass_ppo_clip_kpop_rs"} <= set(PRESETS)
    dec = RolloutCorrectionConfig.decoupled_kpop_rs()
    assert (dec.rollout_rs, dec.rollout_rs_threshold, dec.bypass_mode, dec.rollout_is) == (
        "token_binary_kl", 0.1, False, None)
    byp = RolloutCorrectionConfig.bypass_ppo_clip_kpop_rs()
    assert (byp.rollout_rs, byp.rs_specs[0].upper, byp.bypass_mode, byp.bypass_loss_type) == (
        "token_binary_kl", 0.1, True, "ppo_clip")
    args = RolloutCorrectionArguments(rollout_corr_preset="decoupled_kpop_rs", rollout_rs_threshold="0.05")
    assert args.rollout_correction().rs_specs[0].upper == 0.05
