"""TRL 1.16's advantage arithmetic (``GRPOTrainer._generate_and_score_completions``), redone without the rows
rejection sampling removed, and its pi_old rule.

Mirrored from ``trl/trainer/grpo_trainer.py`` of trl 1.16.0 (line numbers of that release; pinned in
``tests/trainer/test_trl_compat.py``):

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
================================  ==========================================================================
"""

from __future__ import annotations

from typing import Any, MutableSequence, NamedTuple, Optional

import torch
from trl.trainer.utils import nanstd

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
