"""What the correction modes share: the config checks of a configured correction against TRL's options, attaching mu
to the batch, and TRL's loss with the ratio decomposition."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from trl import GRPOConfig

from .. import trl_compat
from ..correction import ratio_decomposition
from ..hooks import GenerationBatch, LossStep, refuse_config

# Settings of TRL's own vLLM IS (inert while it is off, i.e. whenever a rollout correction is on) and TRL's defaults
TRL_VLLM_IS_SETTINGS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
                        "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")
GRPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}


def check_correction_config(args, correction) -> None:
    """With a correction configured (decoupled and bypass ``check_config``): refuse every TRL option it cannot serve
    exactly, each message naming the option and the fix: continuous batching (no mu), greedy / beam generation, TRL's
    vLLM IS settings, ``loss_type`` (``trl_compat.SUPPORTED_LOSS_TYPES``), M2PO with a step of several generation
    batches. Raises ValueError (``refuse_config``)."""
    if args.use_transformers_continuous_batching:
        refuse_config(
            "use_transformers_continuous_batching=True returns no behaviour log-probs, so rollout correction "
            "cannot run; use the plain transformers.generate path (use_transformers_continuous_batching=False) "
            "or vLLM."
        )
    kwargs = args.generation_kwargs or {}
    if kwargs.get("do_sample") is False or (kwargs.get("num_beams") or 1) > 1:
        refuse_config(
            f"generation_kwargs={kwargs!r} asks for greedy or beam search, which has no sampling distribution: "
            "rollout correction needs the log-probs of the distribution that sampled each token. Remove "
            "do_sample=False / num_beams > 1 from generation_kwargs, or disable the rollout correction."
        )
    changed = [name for name in TRL_VLLM_IS_SETTINGS if getattr(args, name) != GRPO_DEFAULTS[name]]
    if changed:
        refuse_config(
            f"{', '.join(changed)} configure TRL's own vLLM importance sampling, which is off while rollout "
            "correction is on (the mismatch is corrected once, by rollout_is / rollout_rs); leave them at "
            "TRL's defaults, or disable the rollout correction to use TRL's."
        )
    if args.loss_type == "vespo":
        refuse_config(
            "loss_type='vespo' applies its own importance weighting; it cannot be combined with rollout "
            "correction."
        )
    supported = trl_compat.SUPPORTED_LOSS_TYPES["bypass" if correction.bypass_mode else "decoupled"]
    if args.loss_type not in supported:
        what = "bypass_mode=True" if correction.bypass_mode else "decoupled mode"
        refuse_config(f"{what} supports loss_type in {supported}, got {args.loss_type!r}.")
    if correction.m2_enabled and args.steps_per_generation != args.gradient_accumulation_steps:
        # the mask is computed once per generation batch, which must be the optimizer step's global batch
        refuse_config(
            f"rollout_m2_threshold (M2PO) masks over the optimizer step's global batch, computed once per "
            f"generation batch: steps_per_generation ({args.steps_per_generation}) must equal "
            f"gradient_accumulation_steps ({args.gradient_accumulation_steps}), so that each optimizer step "
            "trains on exactly one whole generation batch. Set steps_per_generation=gradient_accumulation_steps "
            "(TRL's default), or unset rollout_m2_threshold."
        )


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

