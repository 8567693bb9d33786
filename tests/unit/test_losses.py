"""Bypass losses against the spec's bypass test vectors (token mean over one micro-batch); the decoupled oracle."""

import dataclasses
import math

import pytest
import torch

from oracles import decoupled_policy_loss, masked_token_mean
from trl_rollout_corr import RolloutCorrectionConfig
from trl_rollout_corr.correction import make_correction_fn
from trl_rollout_corr.losses import PPOClip, bypass_policy_loss, ppo_clip_per_token_loss, reinforce_per_token_loss
from vectors import VECTORS, tensor

BYPASS = VECTORS["bypass"]
MASK = tensor("response_mask")


def _run(config_fields):
    fields = dict(config_fields)
    loss_type = fields.pop("loss_type")
    cfg = RolloutCorrectionConfig(bypass_mode=True, bypass_loss_type=loss_type, **fields)
    log_prob = torch.tensor(BYPASS["log_prob"], dtype=torch.float64, requires_grad=True)
    rollout = torch.tensor(BYPASS["rollout_log_prob"], dtype=torch.float64)
    adv = torch.tensor(BYPASS["advantages"], dtype=torch.float64)
    out = bypass_policy_loss(log_prob, rollout, adv, MASK, cfg, correction_fn=make_correction_fn(cfg),
                             clip=PPOClip(clip_ratio_c=3.0))
    loss = masked_token_mean(out.per_token_loss, out.mask)
    loss.backward()
    return out, loss, log_prob.grad


@pytest.mark.parametrize("name", sorted(BYPASS["runs"]))
def test_bypass_vectors(name):
    run = BYPASS["runs"][name]
    out, loss, grad = _run(run["config"])
    assert loss.item() == pytest.approx(run["loss"], abs=1e-6)
    torch.testing.assert_close(grad.float(), torch.tensor(run["grad_log_prob"]), atol=1e-6, rtol=0)
    kept = out.mask
    lp = torch.tensor(BYPASS["log_prob"], dtype=torch.float64)
    ppo_kl = ((torch.tensor(BYPASS["rollout_log_prob"], dtype=torch.float64) - lp)[kept]).mean().item()
    assert ppo_kl == pytest.approx(run["actor_metrics"]["actor/ppo_kl"], abs=1e-6)
    if "actor/pg_clipfrac" in run["actor_metrics"]:
        clipfrac = ((out.clipped_high | out.clipped_low) & kept).sum().item() / kept.sum().item()
        assert clipfrac == pytest.approx(run["actor_metrics"]["actor/pg_clipfrac"], abs=1e-6)
        assert (out.clipped_dual & kept).sum().item() / kept.sum().item() == pytest.approx(
            run["actor_metrics"]["actor/pg_clipfrac_lower"], abs=1e-6
        )


def test_bypass_ppo_clip_does_not_multiply_is_weights():
    base, loss_plain, _ = _run({"loss_type": "ppo_clip", "rollout_is": None})
    with_is, loss_is, _ = _run({"loss_type": "ppo_clip", "rollout_is": "token", "rollout_is_threshold": 2.0})
    assert loss_is.item() == pytest.approx(loss_plain.item(), abs=1e-12)
    assert with_is.correction.weights is not None  # computed for the metrics only


def test_decoupled_loss_multiplies_weights_after_clipping():
    # One token, A = 1, ratio 1.5 clipped to 1.2, weight 0.5: loss = -1 * 1.2 * 0.5 = -0.6 (clip before weight).
    lp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-0.4054651]])  # log(1/1.5)
    out = decoupled_policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 1), torch.tensor([[0.5]]))
    assert out.per_token_loss.item() == pytest.approx(-0.6, abs=1e-6)
    out.per_token_loss.sum().backward()
    assert lp.grad.item() == 0.0  # clipped: no gradient


def test_decoupled_loss_hand_value_with_mask():
    # Two tokens kept out of three, weights [2, 0.5, 9]; ratio 1 everywhere; A = [-1]:
    # per-token loss = -A * 1 * w = w; token mean over kept = (2 + 0.5) / 2.
    lp = torch.zeros(1, 3, requires_grad=True)
    out = decoupled_policy_loss(lp, torch.zeros(1, 3), torch.tensor([-1.0]), torch.tensor([[1, 1, 0]]),
                                torch.tensor([[2.0, 0.5, 9.0]]))
    loss = masked_token_mean(out.per_token_loss, out.mask)
    assert loss.item() == pytest.approx(1.25)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1.0, 0.25, 0.0]]))


def test_nan_anchor_outside_mask_gives_finite_zero_gradient():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    anchor = torch.tensor([[-1.0, float("nan")]])
    out = ppo_clip_per_token_loss(lp, anchor, torch.tensor([1.0]), torch.tensor([[1, 0]]))
    masked_token_mean(out.per_token_loss, out.mask).backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


def test_bypass_nan_rollout_at_valid_token_is_neutral():
    cfg = RolloutCorrectionConfig.bypass_pg_is()
    lp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    roll = torch.tensor([[-1.0, float("nan"), float("-inf")]])
    out = bypass_policy_loss(lp, roll, torch.tensor([1.0]), torch.ones(1, 3), cfg,
                             correction_fn=make_correction_fn(cfg))
    loss = masked_token_mean(out.per_token_loss, out.mask)
    loss.backward()
    assert out.mask.tolist() == [[True, False, False]]
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad.tolist() == [[-1.0, 0.0, 0.0]]  # -A * w / n with w = exp(0) = 1, n = 1
    assert out.correction.metrics["rollout_corr/invalid_token_fraction"] == pytest.approx(2 / 3)


def test_all_rejected_gives_zero_loss_and_zero_grad():
    cfg = RolloutCorrectionConfig(bypass_mode=True, bypass_loss_type="reinforce", rollout_rs="token_k2",
                                  rollout_rs_threshold=1e-6)
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = bypass_policy_loss(lp, torch.tensor([[-2.0, -1.0]]), torch.tensor([1.0]), torch.ones(1, 2), cfg,
                             correction_fn=make_correction_fn(cfg))
    loss = masked_token_mean(out.per_token_loss, out.mask)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum().item() == 0.0


def test_reinforce_hand_value():
    lp = torch.tensor([[-0.5, -2.0]], requires_grad=True)
    out = reinforce_per_token_loss(lp, torch.tensor([2.0]), torch.ones(1, 2), torch.tensor([[0.5, 1.5]]))
    # -A * w * lp = [-2 * 0.5 * -0.5, -2 * 1.5 * -2] = [0.5, 6]
    torch.testing.assert_close(out.per_token_loss, torch.tensor([[0.5, 6.0]]))


def test_bypass_requires_bypass_config():
    with pytest.raises(ValueError, match="bypass_mode=True"):
        cfg = RolloutCorrectionConfig()
        bypass_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), cfg,
                           correction_fn=make_correction_fn(cfg))


def test_junk_advantage_outside_mask_gives_zero_gradient():
    for bad in (float("nan"), float("inf")):
        lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        out = ppo_clip_per_token_loss(lp, torch.tensor([[-1.1, -1.0]]), torch.tensor([[1.0, bad]]),
                                      torch.tensor([[1, 0]]))
        masked_token_mean(out.per_token_loss, out.mask).backward()
        assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 0].item() == pytest.approx(-math.exp(0.1))
        lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
        out = reinforce_per_token_loss(lp, torch.tensor([[1.0, bad]]), torch.tensor([[1, 0]]),
                                       torch.tensor([[1.0, bad]]))
        masked_token_mean(out.per_token_loss, out.mask).backward()
        assert lp.grad.tolist() == [[-1.0, 0.0]]


def test_dual_clip_constant_must_exceed_one():
    for c in (1.0, float("nan")):
        with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
            ppo_clip_per_token_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                                    PPOClip(clip_ratio_c=c))


def test_ppo_clip_is_a_validated_value():
    clip = PPOClip(0.2, 0.28)
    assert (clip.epsilon_low, clip.epsilon_high, clip.clip_ratio_c) == (0.2, 0.28, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        clip.epsilon_low = 0.1
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="epsilon_high must be a finite number >= 0"):
            PPOClip(0.2, bad)


def test_asymmetric_clip_hand_value():
    # A = 1, ratio 1.5: clip-higher eps_high = 0.28 keeps 1.28 (loss -1.28); the default 0.2 keeps 1.2
    lp, anchor = torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1)
    wide = ppo_clip_per_token_loss(lp, anchor, torch.tensor([1.0]), torch.ones(1, 1), PPOClip(0.2, 0.28))
    narrow = ppo_clip_per_token_loss(lp, anchor, torch.tensor([1.0]), torch.ones(1, 1))
    assert wide.per_token_loss.item() == pytest.approx(-1.28) and narrow.per_token_loss.item() == pytest.approx(-1.2)
    assert wide.clipped_high.item() and not wide.clipped_low.item()


def test_bypass_loss_needs_a_correction_fn():
    cfg = RolloutCorrectionConfig.bypass_ppo_clip()
    with pytest.raises(TypeError, match="correction_fn"):
        bypass_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), cfg)
