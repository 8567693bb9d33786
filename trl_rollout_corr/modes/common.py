"""What the correction modes share: attaching mu to the batch, and TRL's loss with the ratio decomposition."""

from __future__ import annotations

from typing import Callable

import torch

from .. import trl_compat
from ..correction import ratio_decomposition
from ..hooks import GenerationBatch, LossStep


def attach_mu(trainer, gen: GenerationBatch, batch: dict, mu: torch.Tensor) -> None:
    """The batch keys of mu: ``rollout_log_probs`` (B, T), ``rollout_generation_step`` (0-d: TRL's shuffle/split pass
    it to every micro-batch unchanged), ``rollout_policy_version`` (B,: they keep it with its rows) and, when a row
    spans a weight update, ``rollout_policy_version_tokens`` (B, T: ``GenerationBatch.token_versions``)."""
    batch["rollout_log_probs"] = mu
    batch["rollout_generation_step"] = torch.tensor(trainer.state.global_step)
    batch["rollout_policy_version"] = gen.versions
    if gen.token_versions is not None:
        batch["rollout_policy_version_tokens"] = gen.token_versions


def require_mu(batch: dict) -> torch.Tensor:
    """With a correction configured: mu from TRL's batch (``sampling_per_token_logps``).

    Raises:
        ValueError: no behaviour log-probs reached the batch.
    """
    mu = batch.get("sampling_per_token_logps")
    if mu is None:
        raise ValueError(
            "Rollout correction is on but no behaviour log-probs (mu) reached the batch; use vLLM or the plain "
            "transformers.generate path."
        )
    return mu


def trl_loss_with_ratios(trainer, model, step: LossStep, loss_inputs: dict,
                         trl_loss: Callable[[torch.nn.Module, dict], torch.Tensor]) -> torch.Tensor:
    """TRL's own loss on ``loss_inputs``, then the ratios of its pi_theta (``step.policy_log_probs``) over the trained
    tokens into ``rollout_corr/{engine,update,direct}_ratio_*`` (``correction.ratio_decomposition``; with
    ``policy_lag_split`` engine is pi_train@v / mu and ``lag`` pi_old / pi_train@v, so engine * lag = pi_old / mu)."""
    loss = trl_loss(model, loss_inputs)
    inputs = step.inputs
    mu, policy_log_probs = inputs.get("rollout_log_probs"), step.policy_log_probs
    if policy_log_probs is not None and mu is not None:
        old = inputs.get("old_per_token_logps", inputs.get("rollout_old_log_probs"))
        d = ratio_decomposition(policy_log_probs, old, mu, trl_compat.loss_mask(loss_inputs))
        at_version = inputs.get("rollout_version_log_probs")
        if at_version is None:
            ratios = {"engine": d.engine[d.valid], "update": d.update[d.valid], "direct": d.direct[d.valid]}
        else:
            valid = d.valid & torch.isfinite(at_version)
            ratios = {"engine": (at_version - mu.float())[valid], "lag": (old.float() - at_version)[valid],
                      "update": d.update[valid], "direct": d.direct[valid]}
        trainer.rollout_corr_metrics.add_log_ratios(trainer.metrics_mode, ratios)
    return loss


def trained_token_count(mask: torch.Tensor, weights=None) -> torch.Tensor:
    """0-d int64: the tokens that carry gradient, ``mask`` (B, T) where the IS weights (B, T) or (B, 1) are non-zero
    (IcePop's zeros and rejected tokens carry none); ``skip_empty_steps`` sums it over an optimizer step."""
    kept = mask.bool()
    if weights is not None:
        kept = kept & (weights != 0)
    return kept.sum().to(torch.int64).detach()

