"""compute_rollout_correction: the spec's test vectors and every input of spec section 5."""

import math

import pytest
import torch

from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction
from trl_rollout_corr.engines.alignment import rollout_log_probs_to_tensor
from vectors import VECTORS, tensor

OLD, ROLL, MASK = tensor("old_log_prob"), tensor("rollout_log_prob"), tensor("response_mask")
P = "rollout_corr/"


@pytest.mark.parametrize("name", sorted(VECTORS["cases"]))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_vectors(name, dtype):
    case = VECTORS["cases"][name]
    out = compute_rollout_correction(OLD.to(dtype), ROLL.to(dtype), MASK, RolloutCorrectionConfig(**case["config"]))
    if "rollout_is" in case["config"]:
        torch.testing.assert_close(out.weights, torch.tensor(case["weights"]), atol=1e-6, rtol=0)
        assert out.weights.dtype == torch.float32
    else:
        assert out.weights is None
    assert out.response_mask.tolist() == case["mask"]
    assert out.response_mask.dtype == MASK.dtype
    metrics = out.metrics
    for key, value in case["metrics"].items():
        assert metrics[P + key] == pytest.approx(value, abs=1e-6), key


def test_metric_key_set_matches_verl_plus_ours():
    case = VECTORS["cases"]["token_TIS+token_k1,seq_mean_k2"]
    out = compute_rollout_correction(OLD, ROLL, MASK, RolloutCorrectionConfig(**case["config"]))
    ours = {"rollout_is_eff_sample_size_raw", "num_valid_tokens", "num_valid_seqs", "invalid_token_fraction"}
    ours |= {f"len_0_64/{k}" for k in ("num_seqs", "kl", "k3_kl", "rs_masked_fraction", "is_eff_sample_size")}
    # the slices without a row log only their row count (a statistic over no token is absent, never 0)
    ours |= {f"{bucket}/num_seqs" for bucket in ("len_64_256", "len_256_1024", "len_1024_inf")}
    assert {k[len(P) :] for k in out.metrics} == set(case["metrics"]) | ours


def test_asymmetric_k1_band_keeps_what_the_user_wrote():
    # Spec 4, deliberate difference: "0.5_1.5" keeps ratios in [0.5, 1.5]. Row 0 ratios are
    # e^[0, .5, -.5, 1] = [1, 1.65, .61, 2.72]: keep, reject, keep, reject (verl would do the opposite for .61/1.65).
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5")
    out = compute_rollout_correction(OLD, ROLL, MASK, cfg)
    assert out.response_mask.tolist() == [[1, 0, 1, 0], [1, 1, 1, 0], [0, 1, 0, 0]]
    m = out.metrics
    # k1 = -x; "high" = k1 above -log L = ratio below L (row 2 token 0: ratio e^-1.5 = .22); "low" = ratio above U.
    assert m[P + "rollout_rs_token_k1_fraction_high"] == pytest.approx(1 / 9)
    assert m[P + "rollout_rs_token_k1_fraction_low"] == pytest.approx(2 / 9)


def test_icepop_all_out_of_band_gives_zero_ess():
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="5_6")
    out = compute_rollout_correction(OLD, ROLL, MASK, cfg)
    assert out.weights.abs().sum() == 0
    m = out.metrics
    assert m[P + "rollout_is_eff_sample_size"] == 0.0
    assert m[P + "rollout_is_oob_ratio"] == 1.0
    assert all(math.isfinite(v) for v in m.values())


def test_missing_rollout_log_probs_names_the_fix():
    with pytest.raises(ValueError, match="logprobs_mode='processed_logprobs'"):
        compute_rollout_correction(OLD, None, MASK, RolloutCorrectionConfig.decoupled_token_is())


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), ValueError, "Shapes differ"),
        ((torch.zeros(6), torch.zeros(6), torch.ones(6)), ValueError, "must be 2-D"),
        ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)), TypeError, "floating-point"),
        (([[0.0]], torch.zeros(1, 1), torch.ones(1, 1)), TypeError, "torch.Tensor"),
    ],
)
def test_bad_inputs(args, exc, match):
    with pytest.raises(exc, match=match):
        compute_rollout_correction(*args, RolloutCorrectionConfig.decoupled_token_is())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["old", "rollout"])
def test_nonfinite_at_valid_token_is_invalid_not_nan(bad, where):
    old, roll = OLD.clone(), ROLL.clone()
    (old if where == "old" else roll)[1, 0] = bad
    cfg = RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=10.0
    )
    out = compute_rollout_correction(old, roll, MASK, cfg)
    assert out.response_mask[1].tolist() == [0, 1, 1, 0]
    assert out.weights[1, 0] == 1.0  # neutral
    # Row 1 now sums l over its two remaining tokens: 0.2 + 0.2 = 0.4 (not 0.6).
    assert out.weights[1, 1].item() == pytest.approx(math.exp(0.4), abs=1e-6)
    m = out.metrics
    assert m[P + "invalid_token_fraction"] == pytest.approx(1 / 9)
    assert m[P + "num_valid_tokens"] == 8
    # kl over the 8 valid tokens: -(0.2 - 0.2... ) = -(sum l) / 8 with sum l = 0.2 - 0.2 = 0
    assert m[P + "kl"] == pytest.approx(-(0.0 + 0.5 - 0.5 + 1.0 + 0.2 + 0.2 - 1.5 + 0.1) / 8)
    assert all(math.isfinite(v) for v in m.values())


def test_nonfinite_at_padding_is_ignored():
    old, roll = OLD.clone(), ROLL.clone()
    old[2, 3] = float("nan")
    roll[1, 3] = float("-inf")
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    out = compute_rollout_correction(old, roll, MASK, cfg)
    ref = compute_rollout_correction(OLD, ROLL, MASK, cfg)
    torch.testing.assert_close(out.weights, ref.weights)
    assert out.metrics == ref.metrics


def test_empty_mask_is_not_an_error():
    cfg = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.5_2,0.01",
    )
    out = compute_rollout_correction(OLD, ROLL, torch.zeros(3, 4), cfg)
    assert out.response_mask.sum() == 0 and out.weights.sum() == 0
    # statistics over no token are absent, never 0 (docs/how-to/read-the-metrics.md, "Steps with no rows"): the counts
    # only
    slices = ((0, 64), (64, 256), (256, 1024), (1024, "inf"))
    assert out.metrics == {P + "num_valid_tokens": 0.0, P + "num_valid_seqs": 0.0,
                           **{f"{P}len_{a}_{b}/num_seqs": 0.0 for a, b in slices}}


def test_zero_sized_batch():
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_max_k2,token_k1", rollout_rs_threshold="0.3,2"
    )
    for shape in [(0, 4), (3, 0)]:
        out = compute_rollout_correction(torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), cfg)
        assert out.weights.shape == shape and out.metrics[P + "num_valid_tokens"] == 0


def test_padding_rows_are_not_counted_in_sequence_metrics():
    # Deliberate difference from verl: an all-padding row does not enter per-row means.
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold=2.0
    )
    base = compute_rollout_correction(OLD, ROLL, MASK, cfg).metrics
    def pad(t, v):
        return torch.cat([t, torch.full((2, 4), v, dtype=t.dtype)])
    padded = compute_rollout_correction(pad(OLD, float("nan")), pad(ROLL, 0.0), pad(MASK, 0.0), cfg).metrics
    assert padded == pytest.approx(base, abs=1e-9)


def test_bf16_inputs_are_upcast():
    cfg = RolloutCorrectionConfig.decoupled_token_is()
    out = compute_rollout_correction(OLD.bfloat16(), ROLL.bfloat16(), MASK.bool(), cfg)
    ref = compute_rollout_correction(OLD.bfloat16().float(), ROLL.bfloat16().float(), MASK, cfg)
    assert out.weights.dtype == torch.float32 and out.response_mask.dtype == torch.bool
    torch.testing.assert_close(out.weights, ref.weights)


def test_batch_normalize_uses_the_global_mean_through_all_reduce():
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    full = compute_rollout_correction(OLD, ROLL, MASK, cfg)
    # Pretend rows 0-1 and row 2 live on two ranks: each rank's all_reduce adds the other's (sum, count).
    parts = [(slice(0, 2), slice(2, 3)), (slice(2, 3), slice(0, 2))]
    for mine, other in parts:
        m = compute_rollout_correction(
            OLD[other], ROLL[other], MASK[other], RolloutCorrectionConfig.decoupled_token_is()
        ).metrics
        n = m["rollout_corr/num_valid_tokens"]
        other_sum = torch.tensor([m["rollout_corr/rollout_is_mean"] * n, n], dtype=torch.float64)
        out = compute_rollout_correction(OLD[mine], ROLL[mine], MASK[mine], cfg, all_reduce=lambda t: t + other_sum)
        torch.testing.assert_close(out.weights, full.weights[mine])


def test_rs_never_changes_weights():
    is_only = compute_rollout_correction(OLD, ROLL, MASK, RolloutCorrectionConfig.decoupled_token_is())
    both = compute_rollout_correction(
        OLD,
        ROLL,
        MASK,
        RolloutCorrectionConfig(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_max_k2", rollout_rs_threshold=0.3
        ),
    )
    torch.testing.assert_close(both.weights, is_only.weights)
    assert both.response_mask.sum() < is_only.response_mask.sum()


def test_rollout_log_probs_to_tensor():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    t = rollout_log_probs_to_tensor([[-0.1, None], [-2.0]], mask)
    assert t[0, 0].item() == pytest.approx(-0.1) and math.isnan(t[0, 1].item()) and t[1].tolist() == [-2.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="Row 1: 2 behaviour log-probs for 1 completion tokens"):
        rollout_log_probs_to_tensor([[-0.1, -0.2], [-2.0, -1.0]], mask)
    with pytest.raises(ValueError, match="3 rows but the batch has 2"):
        rollout_log_probs_to_tensor([[0.0], [0.0], [0.0]], mask)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_invalid_token_keeps_neutral_weight_under_batch_normalisation(level):
    old = OLD.clone()
    old[0, 1] = float("nan")
    cfg = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    out = compute_rollout_correction(old, ROLL, MASK, cfg)
    assert out.weights[0, 1].item() == 1.0
    valid = out.response_mask.bool()
    # normalised: the mean over valid tokens (token) / valid rows (sequence) is 1
    if level == "token":
        assert out.weights[valid].mean().item() == pytest.approx(1.0, abs=1e-6)
    else:
        assert torch.stack([out.weights[i][valid[i]][0] for i in range(3)]).mean().item() == pytest.approx(
            1.0, abs=1e-6
        )


def test_length_slices_hand_values():
    # Rows of 4, 3 and 2 valid tokens with edges (3,): row 0 and row 1 in [3, inf), row 2 in [0, 3).
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
    )
    m = compute_rollout_correction(OLD, ROLL, MASK, cfg, length_buckets=(3,)).metrics
    assert m[P + "len_0_3/num_seqs"] == 1 and m[P + "len_3_inf/num_seqs"] == 2
    assert m[P + "len_0_3/kl"] == pytest.approx(-(-1.5 + 0.1) / 2)
    assert m[P + "len_3_inf/kl"] == pytest.approx(-(1.0 + 0.6) / 7)
    # token_k1 [0.5, 2] rejects row 0's ratio e^1 and row 2's e^-1.5
    assert m[P + "len_0_3/rs_masked_fraction"] == pytest.approx(1 / 2)
    assert m[P + "len_3_inf/rs_masked_fraction"] == pytest.approx(1 / 7)
    w = [1.0, math.exp(0.5), math.exp(-0.5), 2.0] + [math.exp(0.2)] * 3
    assert m[P + "len_3_inf/is_eff_sample_size"] == pytest.approx(sum(w) ** 2 / (7 * sum(v * v for v in w)))
    k3 = [math.exp(-1.5) + 0.5, math.exp(0.1) - 1.1]
    assert m[P + "len_0_3/k3_kl"] == pytest.approx(sum(k3) / 2)
    assert not any("len_" in k for k in compute_rollout_correction(OLD, ROLL, MASK, cfg, length_buckets=()).metrics)
    with pytest.raises(ValueError, match="increasing positive"):
        compute_rollout_correction(OLD, ROLL, MASK, cfg, length_buckets=(5, 3))


def _ref_std_ess(w):
    w = w.double()
    mean = w.mean()
    return (w * w).mean().sub(mean * mean).clamp(min=0).sqrt().item(), (
        w.sum() ** 2 / (w.numel() * (w * w).sum())
    ).item()


@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_weight_statistics_are_precise_when_engines_nearly_agree(threshold):
    # float32 engines differ by ~1e-5..1e-4 nats: std and ESS must not drown in float32 rounding.
    g = torch.Generator().manual_seed(0)
    roll = -torch.rand(16, 1024, generator=g, dtype=torch.float64) * 3
    old = roll + torch.randn(16, 1024, generator=g, dtype=torch.float64) * 1e-4
    out = compute_rollout_correction(
        old.float(),
        roll.float(),
        torch.ones(16, 1024),
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=threshold),
    )
    ref_std, _ = _ref_std_ess(torch.exp(old.float().double() - roll.float().double()))
    assert out.metrics[P + "rollout_is_std"] == pytest.approx(ref_std, rel=1e-3)


@pytest.mark.parametrize("scale", [1e-4, 1e-3, 3e-2])
def test_kl_and_k3_are_precise_on_long_float32_rows(scale):
    # 4096-token rows summed in float32 (cascade summation) and k3 = expm1(x) - x in float32 must match a
    # float64 evaluation; exp(x) - 1 - x in float32 would be off by 10% at scale 1e-4 and 0.2% at 1e-3.
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(4, 4096, generator=g) * 3
    old = (roll.double() + torch.randn(4, 4096, generator=g, dtype=torch.float64) * scale).float()
    m = compute_rollout_correction(old, roll, torch.ones(4, 4096), RolloutCorrectionConfig()).metrics
    l = old.double() - roll.double()
    assert m[P + "kl"] == pytest.approx(-l.mean().item(), rel=1e-5)
    assert m[P + "k3_kl"] == pytest.approx((torch.expm1(l) - l).mean().item(), rel=1e-5)


def test_weight_std_combines_rows_with_different_means():
    # Rows whose weights sit at 0.6, 1.0 and 1.7 with a 1e-4 spread inside each row: the per-row two-pass
    # sums of squares must combine into the exact batch variance (between-row + within-row parts).
    g = torch.Generator().manual_seed(2)
    roll = -torch.rand(3, 2048, generator=g) * 3
    shift = torch.tensor([[math.log(0.6)], [0.0], [math.log(1.7)]], dtype=torch.float64)
    old = (roll.double() + shift + torch.randn(3, 2048, generator=g, dtype=torch.float64) * 1e-4).float()
    m = compute_rollout_correction(
        old, roll, torch.ones(3, 2048), RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=5.0)
    ).metrics
    std, ess = _ref_std_ess(torch.exp(old.double() - roll.double()))
    assert m[P + "rollout_is_std"] == pytest.approx(std, rel=1e-6)
    assert m[P + "rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-6)


def _nearly_agreeing(rows, cols, spread, seed=1):
    g = torch.Generator().manual_seed(seed)
    lp64 = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3
    roll = (lp64 + torch.randn(rows, cols, generator=g, dtype=torch.float64) * spread).float()
    return lp64.float(), roll


def test_chi2_and_sequence_spread_are_precise_when_engines_nearly_agree():
    tis = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    # chi2 = E[R^2] - 1 ~ 4e-9 here, below the rounding of float32 R itself (~6e-8): it must come from
    # E = expm1(x) (float32 R, or float32 row sums of it, are off by 100% or more).
    lp, roll = _nearly_agreeing(16, 2048, 1e-5)
    r = torch.exp(lp.double() - roll.double())
    m = compute_rollout_correction(lp, roll, torch.ones(16, 2048), tis).metrics
    assert m[P + "chi2_token"] == pytest.approx((r * r).mean().item() - 1, rel=3e-3)
    # the spread of per-row mean weights is ~1.6e-6 here: float32 row sums (~6e-8 relative) are off by
    # 1.3e-3; the compensated row sums must be as good as float64 sums of the float32 weights (1.3e-4)
    lp, roll = _nearly_agreeing(2, 8192, 1e-4)
    r = torch.exp(lp.double() - roll.double())
    m = compute_rollout_correction(lp, roll, torch.ones(2, 8192), tis).metrics
    assert m[P + "rollout_is_seq_std"] == pytest.approx(r.mean(-1).std().item(), rel=5e-4)


def test_extreme_log_prob_on_one_side_leaves_the_other_perplexity_exact():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 16, generator=g) * 3
    roll = lp + torch.randn(4, 16, generator=g) * 0.1
    lp[0, 3] = -1e9
    m = compute_rollout_correction(lp, roll, torch.ones(4, 16), RolloutCorrectionConfig()).metrics
    assert m[P + "rollout_log_ppl"] == pytest.approx((-roll.double().mean(-1)).mean().item(), rel=1e-6)
    # float32 row sums of two -3.4e38 log-probs overflow: the extrema saturate, they are not reported as 0
    lp[0, 4] = lp[0, 3] = torch.finfo(torch.float32).min
    m = compute_rollout_correction(lp, roll, torch.ones(4, 16), RolloutCorrectionConfig()).metrics
    assert m[P + "log_ppl_diff_max"] > 1e300 and m[P + "kl"] > 1e300


def test_float64_inputs_give_float64_k1_extrema_and_k3():
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(4, 4096, generator=g, dtype=torch.float64) * 3
    lp = roll + torch.randn(4, 4096, generator=g, dtype=torch.float64) * 1e-6
    x = (lp - roll).float().double()
    m = compute_rollout_correction(
        lp,
        roll,
        torch.ones(4, 4096),
        RolloutCorrectionConfig(rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.5_2,0.5"),
    ).metrics
    assert m[P + "rollout_rs_token_k1_min"] == pytest.approx(-x.max().item(), rel=1e-9)
    assert m[P + "rollout_rs_token_k3_max"] == pytest.approx((torch.expm1(x) - x).max().item(), rel=1e-9)


def test_sequence_k1_band_edge_is_compared_in_float64():
    # float32 x = 2.30258512 is just above log(10) = 2.30258509: the sequence ratio 10.0000003 is outside
    # [0.1, 10] (a float32 comparison against the rounded bound would keep it)
    out = compute_rollout_correction(
        torch.tensor([[2.302585092994046]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.1_10"),
    )
    assert out.response_mask.item() == 0.0


@pytest.mark.parametrize(
    "cfg",
    [
        RolloutCorrectionConfig(),
        RolloutCorrectionConfig.decoupled_token_is(),
        RolloutCorrectionConfig(
            rollout_is="token",
            rollout_is_threshold=2.0,
            rollout_rs="token_k1,seq_mean_k3",
            rollout_rs_threshold="0.5_2.0,0.01",
        ),
    ],
)
def test_returned_tensors_do_not_alias_internal_buffers(cfg):
    first = compute_rollout_correction(OLD, ROLL, MASK, cfg)
    mask, weights = first.response_mask.clone(), None if first.weights is None else first.weights.clone()
    metrics = first.metrics
    compute_rollout_correction(OLD * 3 - 1, ROLL, 1 - MASK, cfg)  # a second call must not touch the first's outputs
    assert torch.equal(first.response_mask, mask) and first.metrics == metrics
    if weights is not None:
        assert torch.equal(first.weights, weights)
    assert compute_rollout_correction(OLD, ROLL, MASK, cfg).metrics == metrics


def test_small_weights_keep_relative_precision():
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    out = compute_rollout_correction(torch.tensor([[-17.0, -16.5]]), torch.zeros(1, 2), torch.ones(1, 2), cfg)
    r = torch.tensor([math.exp(-17.0), math.exp(-16.5)])
    torch.testing.assert_close(out.weights[0], r / r.mean(), rtol=1e-5, atol=0)
    assert out.metrics[P + "rollout_is_batch_norm_factor"] == pytest.approx(r.mean().item(), rel=1e-5)
    m = compute_rollout_correction(
        torch.tensor([[-9.0, -8.5]]), torch.zeros(1, 2), torch.ones(1, 2), RolloutCorrectionConfig.decoupled_token_is()
    ).metrics
    std, ess = _ref_std_ess(torch.tensor([math.exp(-9.0), math.exp(-8.5)]))
    assert m[P + "rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-5)
    assert m[P + "rollout_is_std"] == pytest.approx(std, rel=1e-4)


def test_training_perplexity_does_not_depend_on_rollout_magnitude():
    m = compute_rollout_correction(
        torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1e8, -1.0]]), torch.ones(1, 2), RolloutCorrectionConfig()
    ).metrics
    assert m[P + "training_log_ppl"] == pytest.approx(1.5)


def test_float64_inputs_are_subtracted_before_rounding():
    roll = torch.full((1, 4), -5.0, dtype=torch.float64)
    old = roll + torch.tensor([[1e-7, 2e-7, -1e-7, 3e-7]], dtype=torch.float64)
    m = compute_rollout_correction(old, roll, torch.ones(1, 4), RolloutCorrectionConfig()).metrics
    assert m[P + "kl"] == pytest.approx(-1.25e-7, rel=1e-6)


def test_mask_is_boolean_values_above_zero():
    old, roll = torch.zeros(1, 4), torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 2.0, -1.0, float("nan")]])
    out = compute_rollout_correction(old, roll, mask, RolloutCorrectionConfig.decoupled_token_is())
    assert out.response_mask.tolist() == [[1.0, 1.0, 0.0, 0.0]]
    assert out.weights.tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_rollout_log_probs_to_tensor_refuses_non_right_padded_masks():
    with pytest.raises(ValueError, match="Row 0: the completion mask is not a run of ones"):
        rollout_log_probs_to_tensor([[-0.1, -0.2]], torch.tensor([[1, 0, 1, 0]]))
    with pytest.raises(ValueError, match="Row 1"):
        rollout_log_probs_to_tensor([[-0.1], [-0.2]], torch.tensor([[1, 0], [0, 1]]))


def test_k3_formula_used_under_compile_is_precise():
    # The series / exp branch used inside torch.compile, evaluated eagerly over the whole clamp range.
    from trl_rollout_corr.correction.workspace import k3_compiled as _k3_compiled

    x = torch.cat(
        [torch.linspace(-20, 20, 4001), torch.linspace(-0.6, 0.6, 4001), torch.tensor([0.0, 1e-6, -1e-6, 0.5, -0.5])]
    )
    x64 = x.double()
    ref = torch.expm1(x64) - x64
    got = _k3_compiled(x).double()
    nz = ref > 0
    assert ((got[nz] - ref[nz]).abs() / ref[nz]).max().item() < 3e-6
    assert got[~nz].abs().max().item() == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(
            rollout_is="sequence",
            rollout_is_threshold="0.5_2.0",
            rollout_rs="seq_max_k2,token_k3,seq_mean_k1",
            rollout_rs_threshold="0.3,0.5,0.8_1.25",
        ),
    ],
)
def test_compiled_matches_eager_other_options(kwargs):
    from trl_rollout_corr.correction import compiled_rollout_correction

    cfg = RolloutCorrectionConfig(**kwargs)
    old, roll, mask = OLD.float().clone(), ROLL.float(), MASK
    old[1, 0] = float("nan")
    got, ref = compiled_rollout_correction(cfg)(old, roll, mask), compute_rollout_correction(old, roll, mask, cfg)
    torch.testing.assert_close(got.weights, ref.weights)
    assert torch.equal(got.response_mask, ref.response_mask)
    assert got.metrics == pytest.approx(ref.metrics, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_compiled_matches_eager():
    from trl_rollout_corr.correction import compiled_rollout_correction

    cfg = RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.5_2.0,0.01",
    )
    fn = compiled_rollout_correction(cfg)
    assert compiled_rollout_correction(cfg) is fn  # cached
    old, roll, mask = OLD.float().clone(), ROLL.float(), MASK
    old[1, 0] = float("nan")
    for rows in (3, 2):  # a second shape must not change the results (dynamic shapes)
        got, ref = (
            fn(old[:rows], roll[:rows], mask[:rows]),
            compute_rollout_correction(old[:rows], roll[:rows], mask[:rows], cfg),
        )
        torch.testing.assert_close(got.weights, ref.weights)
        assert torch.equal(got.response_mask, ref.response_mask)
        assert got.metrics == pytest.approx(ref.metrics, rel=1e-5, abs=1e-6)
    # k3 when the engines nearly agree: inductor lowers expm1 to exp(x) - 1, so the compiled path must not
    # evaluate it in float32 (that would be off by ~10% here).
    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(4, 512, generator=g) * 3
    old = (roll.double() + torch.randn(4, 512, generator=g, dtype=torch.float64) * 1e-4).float()
    got, ref = (
        fn(old, roll, torch.ones(4, 512)).metrics,
        compute_rollout_correction(old, roll, torch.ones(4, 512), cfg).metrics,
    )
    l = old.double() - roll.double()
    assert got[P + "k3_kl"] == pytest.approx((torch.expm1(l) - l).mean().item(), rel=1e-4)
    assert got[P + "k3_kl"] == pytest.approx(ref[P + "k3_kl"], rel=1e-4)
    # weight spread ~1e-4: the compiled row moments must keep the variance (a float32 row sum would give 0)
    lp, roll = _nearly_agreeing(2, 8192, 1e-4)
    tis = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    w = torch.exp(lp.double() - roll.double())
    got = compiled_rollout_correction(tis)(lp, roll, torch.ones(2, 8192)).metrics
    assert got[P + "rollout_is_std"] == pytest.approx(w.std(unbiased=False).item(), rel=1e-4)
