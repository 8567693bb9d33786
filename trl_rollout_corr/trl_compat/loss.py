"""TRL 1.16's loss inputs and loss arithmetic (``GRPOTrainer._compute_loss``) as pure functions: the loss mask, the
forward inputs, the decoupled mode's injection into TRL's own loss, and the bypass mode's KL, aggregation and
logged means.

Mirrored from ``trl/trainer/grpo_trainer.py`` of trl 1.16.0 (line numbers of that release; pinned in
``tests/trainer/test_trl_compat.py``):

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``loss_mask``                     ``mask = completion_mask if "tool_mask" not in inputs else ...`` (3027, 2497)
``prompt_completion_inputs``      ``_compute_loss``'s forward inputs (3022-3047) and ``MULTIMODAL_FORWARD_KEYS``
                                  (the keyword arguments TRL passes to ``_get_per_token_logps_and_entropies``)
``inject_rs_mask_and_is_weights`` relies on 3027 (``tool_mask`` enters only the loss mask), 3058 (``(B, T)``
                                  advantages accepted) and 3120 (``-min(r A, clip(r) A)``, homogeneous in A)
``per_token_kl``                  ``_compute_loss``'s k3 KL to pi_ref and ``use_bias_correction_kl`` (3100-3105)
``aggregate_loss``                ``_compute_loss``'s normalisers for grpo / bnpo / dr_grpo / dapo (3153-3174)
``global_masked_mean``            ``_compute_loss``'s nested ``global_masked_mean`` (3259-3265), token level
``SUPPORTED_LOSS_TYPES``          which ``loss_type`` values each mode can serve (see its comment)
================================  ==========================================================================
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from ..correction import SAFETY_BOUND

# Multimodal batch keys that TRL 1.16 forwards to _get_per_token_logps_and_entropies (as keyword arguments).
MULTIMODAL_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)

# The TRL ``loss_type`` values each mode supports.
# decoupled: TRL's own loss runs; its per-token loss must be positively homogeneous in the advantage
#   (W * loss(A) == loss(W * A) for W >= 0), so that the IS weights can travel through the advantages
#   (inject_rs_mask_and_is_weights). vespo is excluded: it applies its own importance weighting.
# bypass: our loss replaces TRL's; these are the aggregations aggregate_loss reproduces.
SUPPORTED_LOSS_TYPES = {
    "decoupled": ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"),
    "bypass": ("grpo", "bnpo", "dr_grpo", "dapo"),
}


def loss_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask: ``completion_mask`` times ``tool_mask`` when present. (B, T) integer 0/1."""
    completion_mask = batch["completion_mask"]
    return completion_mask if "tool_mask" not in batch else completion_mask * batch["tool_mask"]


class ForwardInputs(NamedTuple):
    """What TRL passes to ``_get_per_token_logps_and_entropies`` for a prompt + completion batch.

    Attributes:
        input_ids: (B, P + T) prompt then completion token ids.
        attention_mask: (B, P + T) 0/1.
        logits_to_keep: T, the completion width.
        multimodal: the batch's ``MULTIMODAL_FORWARD_KEYS`` entries, as keyword arguments.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    multimodal: dict


def prompt_completion_inputs(batch: dict) -> ForwardInputs:
    """The forward inputs of a TRL generation batch (keys ``prompt_ids``, ``prompt_mask``, ``completion_ids``,
    ``completion_mask`` and any multimodal keys), built as TRL's ``_compute_loss`` builds them."""
    completion_ids = batch["completion_ids"]
    return ForwardInputs(
        input_ids=torch.cat([batch["prompt_ids"], completion_ids], dim=1),
        attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1),
        logits_to_keep=completion_ids.size(1),
        multimodal={k: batch[k] for k in MULTIMODAL_FORWARD_KEYS if k in batch},
    )


def inject_rs_mask_and_is_weights(batch: dict) -> dict:
    """A copy of a decoupled-mode micro-batch that makes TRL's own loss apply the RS mask and the IS weights.

    * ``tool_mask := rollout_rs_mask``: in TRL's ``_compute_loss`` the tool mask only enters the loss mask and
      normaliser (``mask = completion_mask * inputs["tool_mask"]``), while ``completion_mask`` also builds the
      attention mask, so RS must not touch it. The RS mask already includes any original tool mask.
    * ``advantages := A * W`` with the (B, T) IS weights W: TRL accepts (B, T) advantages (``if advantages.dim() ==
      1: advantages = advantages.unsqueeze(1)``) and its clipped loss ``-min(r A, clip(r) A)`` is positively
      homogeneous in A, so ``-min(r A W, clip(r) A W) == W * -min(r A, clip(r) A)`` for ``W >= 0``: the weight
      multiplies the clipped per-token loss, exactly the decoupled objective (the same holds for the other
      ``SUPPORTED_LOSS_TYPES["decoupled"]``).

    Caveat: TRL's clip metrics are sign-based (``is_low_clipped`` counts tokens with ``advantages < 0``), so tokens
    whose weight is 0 (IcePop outside its band) have A W = 0 and drop out of ``clip_ratio/*``; the loss is exact.

    Args:
        batch: a micro-batch as ``RolloutCorrGRPOTrainer._generate_and_score_completions`` returns it: it must hold
            ``rollout_rs_mask`` (B, T) and ``advantages`` (B,) or (B, T); ``rollout_is_weights`` (B, T) is optional.

    Returns:
        A new dict (the input is not modified); ``advantages`` is (B, T) when weights are present.

    Raises:
        KeyError: if ``rollout_rs_mask`` is missing (the batch did not come from the decoupled correction).
    """
    out = dict(batch)
    out["tool_mask"] = batch["rollout_rs_mask"]
    weights = batch.get("rollout_is_weights")
    if weights is not None:
        advantages = batch["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        out["advantages"] = advantages * weights.to(advantages.dtype)
    return out


def per_token_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    keep: torch.Tensor,
    *,
    bias_correction_old_log_probs: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """TRL's per-token k3 KL to pi_ref, ``exp(ref - lp) - (ref - lp) - 1``, 0 outside ``keep``.

    Args:
        log_probs: (B, T) pi_theta log-probs (with grad), nats.
        ref_log_probs: (B, T) pi_ref log-probs, nats.
        keep: (B, T) bool; positions outside it are 0 (and never see NaN from padding).
        bias_correction_old_log_probs: (B, T) pi_old log-probs (bypass mode: mu) for TRL's
            ``use_bias_correction_kl``: the KL is multiplied by the differentiable policy ratio
            ``exp(clamp(log_probs - old, -SAFETY_BOUND, SAFETY_BOUND))`` (the clamp is ours); None: no correction.

    Returns:
        (B, T) KL per token (nats), before the ``beta`` factor.
    """
    diff = torch.where(keep, ref_log_probs - log_probs, 0.0)
    kl = torch.exp(diff) - diff - 1
    if bias_correction_old_log_probs is not None:
        old = torch.where(keep, bias_correction_old_log_probs, log_probs.detach())
        kl = kl * torch.exp((log_probs - old).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    return kl


def aggregate_loss(
    per_token_loss: torch.Tensor,
    keep: torch.Tensor,
    loss_type: str,
    *,
    accumulation_steps: float,
    max_completion_length: int,
    num_items_in_batch: Optional[torch.Tensor] = None,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> torch.Tensor:
    """TRL 1.16's aggregation of a per-token loss into the micro-batch loss, scaled for gradient accumulation.

    Args:
        per_token_loss: (B, T) float per-token loss.
        keep: (B, T) bool, the tokens in the loss and in its normaliser.
        loss_type: ``"grpo"`` (mean over rows of the row token mean), ``"bnpo"`` (token mean over the micro-batch),
            ``"dr_grpo"`` (sum / (B * max_completion_length)) or ``"dapo"`` (sum / the generation batch's global
            token count, rescaled to one accumulation window).
        accumulation_steps: TRL's ``current_gradient_accumulation_steps`` in training, 1 in evaluation.
        max_completion_length: dr_grpo's constant normaliser (tokens).
        num_items_in_batch: dapo only: 0-d tensor, the loss tokens of the whole generation batch over all processes.
        num_processes: dapo only: the number of processes.
        steps_per_generation: dapo only: TRL's ``steps_per_generation`` in training, 1 in evaluation (TRL neither
            splits nor accumulates the evaluation batch).

    Returns:
        0-d tensor, differentiable w.r.t. ``per_token_loss``.

    Raises:
        ValueError: for any other ``loss_type`` (see ``SUPPORTED_LOSS_TYPES["bypass"]``), or dapo without
            ``num_items_in_batch``.
    """
    masked = torch.where(keep, per_token_loss, 0.0)
    if loss_type == "grpo":
        count = keep.sum(dim=-1).to(masked.dtype)
        return (masked.sum(-1) / count.clamp(min=1.0)).mean() / accumulation_steps
    if loss_type == "bnpo":
        return masked.sum() / keep.sum().to(masked.dtype).clamp(min=1.0) / accumulation_steps
    if loss_type == "dr_grpo":
        return masked.sum() / (masked.size(0) * max_completion_length) / accumulation_steps
    if loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError("aggregate_loss(loss_type='dapo') needs num_items_in_batch (the global token count).")
        # Pre-RS global token count (as verl's engine workers): the RS mask of other micro-batches is unknown.
        normalizer = num_items_in_batch.clamp(min=1.0) / num_processes
        normalizer = normalizer * accumulation_steps / steps_per_generation
        return masked.sum() / normalizer
    raise ValueError(
        f"aggregate_loss supports loss_type in {SUPPORTED_LOSS_TYPES['bypass']}, got {loss_type!r}."
    )


def global_masked_mean(
    values: torch.Tensor, keep: torch.Tensor, reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
) -> float:
    """Mean of ``values`` over the ``keep`` tokens of every process, as TRL logs ``entropy``, ``kl`` and clip ratios.

    Args:
        values: (B, T) float.
        keep: (B, T) bool.
        reduce_sum: cross-process sum of a tensor (None on one process).

    Returns:
        A Python float; 0.0 when no token is kept anywhere.
    """
    local = torch.stack([torch.where(keep, values, 0.0).sum(), keep.sum().to(values.dtype)]).detach()
    total = local if reduce_sum is None else reduce_sum(local)
    return (total[0] / total[1].clamp(min=1.0)).item()


def clip_ratio_extremes(clipped_low: torch.Tensor, clipped_high: torch.Tensor, keep: torch.Tensor,
                        gather: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float]:
    """TRL's ``clip_ratio/low_min`` and ``clip_ratio/high_max`` of one micro-batch, as ``GRPOTrainer._compute_loss``
    logs them: each row's fraction of clipped tokens over its ``keep`` tokens (NaN for a row without one), gathered
    over processes, then TRL's ``nanmin`` / ``nanmax`` (NaN when no row anywhere has a kept token).

    Args:
        clipped_low, clipped_high: (B, T) bool, tokens clipped below / above (PPO-clip, with the advantage's sign).
        keep: (B, T) bool, the tokens in the loss.
        gather: the cross-process gather of a (B,) tensor (``accelerator.gather``; the identity on one process).

    Returns:
        ``(low_min, high_max)`` as Python floats (fractions in [0, 1], or NaN).
    """
    from trl.trainer.utils import nanmax, nanmin

    mask = keep.float()

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        return (x.float() * mask).sum(-1) / mask.sum(-1)

    return (nanmin(gather(masked_seq_mean(clipped_low.detach()))).item(),
            nanmax(gather(masked_seq_mean(clipped_high.detach()))).item())
