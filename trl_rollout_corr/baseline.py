"""Rows rejected by the correction, taken out of their GRPO group's baseline after TRL computed the advantages.

TRL computes the group-normalised advantages at generation time, before the correction has rejected anything; a
row rejected by RS (or emptied by ``max_policy_lag`` / M2PO) must then get advantage 0 and, unless
``rs_keep_rejected_in_baseline``, leave its group's mean and scale (spec section 4, rejection sampling). The
advantage arithmetic is TRL's, re-run in ``trl_compat.advantages_after_rejection``; this module applies it to a
trainer and keeps TRL's completions table (``_logs["advantages"]``) consistent with the advantages trained.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import trl_compat


def rows_out_of_baseline(
    trainer, advantages: torch.Tensor, rejected: torch.Tensor, has_tokens: torch.Tensor,
    rewards_per_func: Optional[torch.Tensor], *, count_lone_survivors: bool = True,
) -> torch.Tensor:
    """(B_local,) advantages with the rejected rows at 0 and (by default) out of their group's baseline.

    Args:
        trainer: the ``RolloutCorrGRPOTrainer`` (its TRL advantage settings, process index, completions table).
        advantages: (B_local,) TRL's advantages of this process's rows.
        rejected: (B_global,) bool, gathered over processes: rows with no trained token left.
        has_tokens: (B_global,) bool, gathered: rows with at least one completion token.
        rewards_per_func: (B_global, F) TRL's gathered rewards, or None (then the baseline is kept).
        count_lone_survivors: count the rows left alone in their group into
            ``rollout_corr/rs_lone_survivor_fraction`` (RS on, rejected rows out of the baseline).

    Returns:
        (B_local,) float advantages (``trl_compat.advantages_after_rejection``'s local slice).
    """
    num_generations = trainer.num_generations if trainer.metrics_mode == "train" else trainer.num_generations_eval
    keep_in_baseline = trainer.args.rs_keep_rejected_in_baseline
    result = trl_compat.advantages_after_rejection(
        advantages,
        rejected,
        rewards_per_func,
        keep_rejected_in_baseline=keep_in_baseline,
        process_index=trainer.accelerator.process_index,
        reward_weights=trainer.reward_weights,
        num_generations=num_generations,
        multi_objective_aggregation=trainer.multi_objective_aggregation,
        scale_rewards=trainer.scale_rewards,
    )
    logged_column = trl_compat.logged_advantages(trainer)
    if result.all_processes is not None:
        trl_compat.replace_logged_advantages(logged_column, result.all_processes)
    elif bool(rejected.any()):  # kept in the baseline: only the rejected rows' advantages changed (to 0)
        logged = torch.tensor(list(logged_column)[-rejected.numel():], dtype=torch.float32)
        if logged.numel() == rejected.numel():
            trl_compat.replace_logged_advantages(logged_column, logged.masked_fill(rejected.cpu(), 0.0))
    if count_lone_survivors and trainer.rollout_correction.rs_enabled and not keep_in_baseline:
        lone = trl_compat.lone_survivors(rejected, has_tokens, num_generations)
        trainer.rollout_corr_metrics.add_fraction(
            trainer.metrics_mode, "rs_lone_survivor_fraction", int(lone.sum()), int(has_tokens.sum())
        )
    return result.local
