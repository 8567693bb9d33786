"""The split of the direct ratio pi_theta / mu into the engine ratio pi_old / mu and the update ratio
pi_theta / pi_old (the project's own diagnostic; ``rollout_corr/{engine,update,direct}_ratio_*``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RatioDecomposition:
    """Per-token log ratios between the three policies (all (B, T) float32, nats, 0 outside valid tokens).

    ``engine = log pi_old - log mu``, ``update = log pi_theta - log pi_old``, ``direct = log pi_theta - log mu``;
    ``direct == engine + update`` exactly where valid (computed that way). ``valid`` is the (B, T) bool mask
    of tokens where all three log-probs are finite and the mask is 1.
    """

    engine: torch.Tensor
    update: torch.Tensor
    direct: torch.Tensor
    valid: torch.Tensor


def ratio_decomposition(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> RatioDecomposition:
    """Split the direct ratio pi_theta / mu into the engine ratio pi_old / mu and the update ratio pi_theta / pi_old.

    Args:
        log_probs, old_log_probs, rollout_log_probs: (B, T) pi_theta, pi_old, mu in nats (any float dtype).
        response_mask: (B, T) 0/1.

    Returns:
        RatioDecomposition (log ratios; exponentiate for ratios).

    Raises:
        ValueError: if the shapes differ.
    """
    if not (log_probs.shape == old_log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"Shapes differ: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, response_mask {tuple(response_mask.shape)}."
        )
    lp, old, mu = (t.detach().float() for t in (log_probs, old_log_probs, rollout_log_probs))
    valid = (response_mask != 0) & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(mu)
    engine = torch.where(valid, old - mu, 0.0)
    update = torch.where(valid, lp - old, 0.0)
    return RatioDecomposition(engine=engine, update=update, direct=engine + update, valid=valid)
