"""Reference implementations the tests compare the library against (not library code).

* ``decoupled_policy_loss``: the decoupled objective written out (PPO clip on pi_theta / pi_old, times the IS
  weights after clipping). The trainer does not run it: it runs TRL's own loss with the weights injected through
  the advantages (``trl_compat.inject_rs_mask_and_is_weights``); the tests check both give the same value and
  gradient.
* ``masked_token_mean``: the token-mean aggregation of the spec's loss vectors.
"""

from __future__ import annotations

from typing import Optional

import torch

from trl_rollout_corr.losses import PolicyLossOutput, PPOClip, ppo_clip_per_token_loss


def decoupled_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: Optional[torch.Tensor],
    clip: PPOClip = PPOClip(),
) -> PolicyLossOutput:
    """Decoupled mode: PPO clip on pi_theta / pi_old, times the IS weights after clipping.

    Args:
        log_probs: (B, T) pi_theta (with grad). old_log_probs: (B, T) pi_old. advantages: (B,) or (B, T).
        response_mask: (B, T), the RS mask from ``compute_rollout_correction``.
        is_weights: (B, T) weights from ``compute_rollout_correction`` (pi_old / mu), or None.
    """
    out = ppo_clip_per_token_loss(log_probs, old_log_probs, advantages, response_mask, clip)
    if is_weights is not None:
        out.per_token_loss = torch.where(out.mask, out.per_token_loss * is_weights.detach().float(), 0.0)
    return out


def masked_token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where ``mask`` is 1; 0 (with zero gradient) when the mask is empty."""
    keep = mask != 0
    total = torch.where(keep, per_token, 0.0).sum()
    return total / keep.sum().clamp(min=1)
