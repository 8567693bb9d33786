"""Per-token policy losses for decoupled and bypass rollout correction.

Decoupled mode (keep pi_old): the usual PPO clipped loss on the update ratio pi_theta / pi_old, multiplied
by the IS weights (computed once per generation batch from pi_old / mu) after clipping.

Bypass mode (pi_old := mu): the correction is recomputed from the current pi_theta (detached) on every
micro-batch, and the loss is either

* ``ppo_clip``: PPO clip on the direct ratio pi_theta / mu with the RS mask; IS weights are for metrics only
  (multiplying them in would count the same ratio twice), or
* ``reinforce``: ``-A * w * log pi_theta`` with ``w`` the detached IS weight (1 without IS) and the RS mask.

Direct double-sided IS (SAO's DIS, GLM-5's direct gate) is bypass + reinforce + a token IcePop band.
PPO: Schulman et al. 2017; dual clip (``clip_ratio_c``): Ye et al. 2020; modes as in verl.

Aggregation (token mean, sequence mean, ...) is left to the caller (the trainer follows TRL's
``loss_type``); ``masked_token_mean`` is provided for the common case and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .config import RolloutCorrectionConfig
from .correction import SAFETY_BOUND, AllReduce, RolloutCorrectionOutput, compute_rollout_correction


@dataclass
class PolicyLossOutput:
    """Per-token loss and what the caller needs to aggregate and log it.

    Attributes:
        per_token_loss: (B, T) float32, differentiable w.r.t. ``log_probs``; 0 where ``mask`` is 0.
        mask: (B, T) bool, the tokens that take part in the loss and in its normaliser.
        clipped_high: (B, T) bool, tokens where the upper PPO clip is active (None for REINFORCE).
        clipped_low: (B, T) bool, tokens where the lower PPO clip is active (None for REINFORCE).
        clipped_dual: (B, T) bool, tokens where the dual clip is active (None without ``clip_ratio_c``).
        correction: the bypass-mode correction of this micro-batch (None in decoupled mode).
    """

    per_token_loss: torch.Tensor
    mask: torch.Tensor
    clipped_high: Optional[torch.Tensor] = None
    clipped_low: Optional[torch.Tensor] = None
    clipped_dual: Optional[torch.Tensor] = None
    correction: Optional[RolloutCorrectionOutput] = None


def _advantages_2d(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != like.shape[0] or advantages.shape[1] not in (1, like.shape[1]):
        raise ValueError(
            f"advantages must be (B,) or (B, T) matching log_probs {tuple(like.shape)}, got {tuple(advantages.shape)}."
        )
    return advantages.to(torch.float32)


def ppo_clip_per_token_loss(
    log_probs: torch.Tensor,
    anchor_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.

    Args:
        log_probs: (B, T) pi_theta log-probs (with grad), nats.
        anchor_log_probs: (B, T) the ratio's denominator: pi_old (decoupled) or mu (bypass), nats.
        advantages: (B,) or (B, T).
        mask: (B, T) 0/1; positions outside it (including NaN/inf anchors there) get loss 0 and zero
            gradient.
        epsilon_low, epsilon_high: clip range of the ratio.
        clip_ratio_c: optional dual-clip constant c > 1: for A < 0 the loss is capped at ``-A c``.

    Returns:
        PolicyLossOutput with ``per_token_loss`` (B, T) float32.

    The ratio is ``exp(clamp(log_probs - anchor, -20, 20))``.
    """
    keep = mask != 0
    lp = log_probs.float()
    # Anchors outside the mask may be NaN/inf: replace them by the (detached) current value so that
    # neither the forward nor the backward pass ever touches a NaN.
    anchor = torch.where(keep & torch.isfinite(anchor_log_probs), anchor_log_probs.detach().float(), lp.detach())
    adv = torch.where(keep, _advantages_2d(advantages, lp), 0.0)  # junk advantages outside the mask never reach the graph
    ratio = torch.exp((lp - anchor).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped_dual = None
    if clip_ratio_c is not None:
        if not clip_ratio_c > 1.0:  # also rejects NaN
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip PPO), got {clip_ratio_c}.")
        capped = torch.minimum(loss, -adv * clip_ratio_c)
        clipped_dual = keep & (adv < 0) & (loss > -adv * clip_ratio_c)
        loss = torch.where(adv < 0, capped, loss)
    clipped = keep & (loss_clipped > loss_unclipped)
    return PolicyLossOutput(
        per_token_loss=torch.where(keep, loss, 0.0),
        mask=keep,
        clipped_high=clipped & (adv > 0),
        clipped_low=clipped & (adv < 0),
        clipped_dual=clipped_dual,
    )


def reinforce_per_token_loss(
    log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> PolicyLossOutput:
    """REINFORCE with detached IS weights: ``-A * w * log pi_theta`` per token.

    Args:
        log_probs: (B, T) pi_theta log-probs (with grad), nats.
        advantages: (B,) or (B, T).
        mask: (B, T) 0/1.
        weights: (B, T) IS weights (detached here), None for 1.

    Returns:
        PolicyLossOutput; its value is not a meaningful objective, its gradient is ``-A w grad log pi``.
    """
    keep = mask != 0
    lp = log_probs.float()
    adv = torch.where(keep, _advantages_2d(advantages, lp), 0.0)
    w = 1.0 if weights is None else torch.where(keep, weights.detach().float(), 0.0)
    safe_lp = torch.where(keep, lp, 0.0)
    return PolicyLossOutput(per_token_loss=torch.where(keep, -adv * w * safe_lp, 0.0), mask=keep)


def decoupled_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: Optional[torch.Tensor],
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
) -> PolicyLossOutput:
    """Decoupled mode: PPO clip on pi_theta / pi_old, times the IS weights after clipping.

    Args:
        log_probs: (B, T) pi_theta (with grad). old_log_probs: (B, T) pi_old. advantages: (B,) or (B, T).
        response_mask: (B, T), the RS mask from ``compute_rollout_correction``.
        is_weights: (B, T) weights from ``compute_rollout_correction`` (pi_old / mu), or None.
    """
    out = ppo_clip_per_token_loss(
        log_probs, old_log_probs, advantages, response_mask,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, clip_ratio_c=clip_ratio_c,
    )
    if is_weights is not None:
        out.per_token_loss = torch.where(out.mask, out.per_token_loss * is_weights.detach().float(), 0.0)
    return out


def bypass_policy_loss(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    all_reduce: Optional[AllReduce] = None,
    correction_fn: Optional[Callable[..., RolloutCorrectionOutput]] = None,
) -> PolicyLossOutput:
    """Bypass mode: correction from pi_theta vs mu (no grad), then PPO-clip or REINFORCE.

    Args:
        log_probs: (B, T) pi_theta (with grad), nats. rollout_log_probs: (B, T) mu, nats.
        advantages: (B,) or (B, T). response_mask: (B, T) 0/1 completion mask.
        config: must have ``bypass_mode=True``.
        all_reduce: cross-rank sum for batch normalisation (see ``compute_rollout_correction``).
        correction_fn: optional ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None)`` computing
            the correction for ``config`` (e.g. ``correction.compiled_rollout_correction(config)``); default:
            ``compute_rollout_correction`` with ``config``.

    Returns:
        PolicyLossOutput with ``correction`` set (its stats hold this micro-batch's metrics).

    Raises:
        ValueError: if ``config.bypass_mode`` is False, or as ``compute_rollout_correction``.
    """
    if not config.bypass_mode:
        raise ValueError("bypass_policy_loss needs a config with bypass_mode=True; use decoupled_policy_loss otherwise.")
    with torch.no_grad():
        if correction_fn is None:
            correction = compute_rollout_correction(log_probs.detach(), rollout_log_probs, response_mask, config, all_reduce=all_reduce)
        else:
            correction = correction_fn(log_probs.detach(), rollout_log_probs, response_mask, all_reduce=all_reduce)
    if config.bypass_loss_type == "ppo_clip":
        out = ppo_clip_per_token_loss(
            log_probs, rollout_log_probs, advantages, correction.response_mask,
            epsilon_low=epsilon_low, epsilon_high=epsilon_high, clip_ratio_c=clip_ratio_c,
        )
    else:
        out = reinforce_per_token_loss(log_probs, advantages, correction.response_mask, correction.weights)
    out.correction = correction
    return out


def masked_token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where ``mask`` is 1; 0 (with zero gradient) when the mask is empty."""
    keep = mask != 0
    total = torch.where(keep, per_token, 0.0).sum()
    return total / keep.sum().clamp(min=1)
