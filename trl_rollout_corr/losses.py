"""Per-token policy losses for bypass-mode rollout correction, one implementation per objective.

Bypass mode (pi_old := mu): the correction is recomputed from the current pi_theta (detached) on every
micro-batch, and the loss is either

* ``ppo_clip``: PPO clip on the direct ratio pi_theta / mu with the RS mask; IS weights are for metrics only
  (multiplying them in would count the same ratio twice), or
* ``reinforce``: ``-A * w * log pi_theta`` with ``w`` the detached IS weight (1 without IS) and the RS mask.

Direct double-sided IS (SAO's DIS, GLM-5's direct gate) is bypass + reinforce + a token IcePop band.
PPO: Schulman et al. 2017; dual clip (``PPOClip.clip_ratio_c``): Ye et al. 2020; modes as in verl.

Decoupled mode (keep pi_old) has no loss here: the trainer runs TRL's own loss, with the RS mask and the IS
weights injected by ``trl_compat.inject_rs_mask_and_is_weights`` (W times the clipped PPO loss).

Aggregation (token mean, sequence mean, ...) is left to the caller (the trainer follows TRL's ``loss_type``
through ``trl_compat.aggregate_loss``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .config import RolloutCorrectionConfig
from .correction import SAFETY_BOUND, RolloutCorrectionOutput

AllReduce = Callable[[torch.Tensor], torch.Tensor]
CorrectionFn = Callable[..., RolloutCorrectionOutput]

# The dual-clip constant c of bypass PPO-clip when TRL's ``delta`` is unset: verl's default ``clip_ratio_c``. In
# bypass mode the ratio is pi_theta / mu, which is not near 1 at the first update as pi_theta / pi_old is; without a
# bound, one token at the ratio's safety bound (log ratio 20) with A < 0 adds |A| e^20 to the logged loss.
DEFAULT_DUAL_CLIP = 3.0


@dataclass(frozen=True)
class PPOClip:
    """The clip range of the PPO surrogate (ratio units).

    Attributes:
        epsilon_low, epsilon_high: the ratio is clipped to ``[1 - epsilon_low, 1 + epsilon_high]`` (TRL's
            ``epsilon`` / ``epsilon_high``; DAPO's clip-higher uses ``epsilon_high > epsilon_low``).
        clip_ratio_c: optional dual-clip constant ``c > 1`` (Ye et al. 2020): for ``A < 0`` the loss is capped at
            ``-A c``. None: no dual clip.

    Raises:
        ValueError: for a negative or non-finite epsilon, or ``clip_ratio_c <= 1`` (or NaN).
    """

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    clip_ratio_c: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("epsilon_low", "epsilon_high"):
            value = getattr(self, name)
            if not (0.0 <= value < float("inf")):  # also rejects NaN
                raise ValueError(f"PPOClip.{name} must be a finite number >= 0, got {value}.")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1.0:  # also rejects NaN
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip PPO), got {self.clip_ratio_c}.")


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
    clip: PPOClip = PPOClip(),
) -> PolicyLossOutput:
    """PPO clipped surrogate per token: ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.

    Args:
        log_probs: (B, T) pi_theta log-probs (with grad), nats.
        anchor_log_probs: (B, T) the ratio's denominator: pi_old (decoupled) or mu (bypass), nats.
        advantages: (B,) or (B, T).
        mask: (B, T) 0/1; positions outside it (including NaN/inf anchors there) get loss 0 and zero
            gradient.
        clip: the clip range and optional dual clip (``PPOClip``).

    Returns:
        PolicyLossOutput with ``per_token_loss`` (B, T) float32.

    The ratio is ``exp(clamp(log_probs - anchor, -SAFETY_BOUND, SAFETY_BOUND))``.
    """
    keep = mask != 0
    lp = log_probs.float()
    # Anchors outside the mask may be NaN/inf: replace them by the (detached) current value so that
    # neither the forward nor the backward pass ever touches a NaN.
    anchor = torch.where(keep & torch.isfinite(anchor_log_probs), anchor_log_probs.detach().float(), lp.detach())
    # junk advantages outside the mask never reach the graph
    adv = torch.where(keep, _advantages_2d(advantages, lp), 0.0)
    ratio = torch.exp((lp - anchor).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip.epsilon_low, 1.0 + clip.epsilon_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped_dual = None
    if clip.clip_ratio_c is not None:
        capped = torch.minimum(loss, -adv * clip.clip_ratio_c)
        clipped_dual = keep & (adv < 0) & (loss > -adv * clip.clip_ratio_c)
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


def bypass_policy_loss(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    correction_fn: CorrectionFn,
    clip: PPOClip = PPOClip(),
    all_reduce: Optional[AllReduce] = None,
) -> PolicyLossOutput:
    """Bypass mode: correction from pi_theta vs mu (no grad), then PPO-clip or REINFORCE.

    Args:
        log_probs: (B, T) pi_theta (with grad), nats. rollout_log_probs: (B, T) mu, nats.
        advantages: (B,) or (B, T). response_mask: (B, T) 0/1 completion mask.
        config: must have ``bypass_mode=True``; ``bypass_loss_type`` picks the loss.
        correction_fn: ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None)`` computing the
            correction for ``config``: ``correction.make_correction_fn(config)`` (or ``compile=True``).
        clip: the PPO clip range (``ppo_clip`` only).
        all_reduce: cross-rank sum for batch normalisation (see ``compute_rollout_correction``), None on one rank.

    Returns:
        PolicyLossOutput with ``correction`` set (its stats hold this micro-batch's metrics).

    Raises:
        ValueError: if ``config.bypass_mode`` is False, or as ``compute_rollout_correction``.
    """
    if not config.bypass_mode:
        raise ValueError(
            "bypass_policy_loss needs a config with bypass_mode=True; decoupled mode runs TRL's own loss "
            "(trl_compat.inject_rs_mask_and_is_weights)."
        )
    with torch.no_grad():
        correction = correction_fn(log_probs.detach(), rollout_log_probs, response_mask, all_reduce=all_reduce)
    if config.bypass_loss_type == "ppo_clip":
        out = ppo_clip_per_token_loss(log_probs, rollout_log_probs, advantages, correction.response_mask, clip)
    else:
        out = reinforce_per_token_loss(log_probs, advantages, correction.response_mask, correction.weights)
    out.correction = correction
    return out
