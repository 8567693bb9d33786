"""Decoupled mode: the correction once per generation batch, from pi_old vs mu; TRL's loss with its mask and weights.

Right after generation the IS weights and the RS mask are computed once from ``log pi_old - log mu``; rows that RS
rejects entirely get advantage 0 and leave their group's mean/std (``rs_keep_rejected_in_baseline=True`` keeps them
in, as verl does). The loss is TRL's own PPO-clip loss (any of ``trl_compat.SUPPORTED_LOSS_TYPES["decoupled"]``) with
the RS mask as loss mask and normaliser and the IS weights multiplying the clipped per-token loss
(``trl_compat.inject_rs_mask_and_is_weights``). ``max_policy_lag``: rows already over the bound at generation
(``GenerationBatch.keep_rows``) leave the correction and the baseline in the same exclusion as RS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .. import support, trl_compat
from ..correction import make_correction_fn
from ..hooks import CorrectionMode, GenerationBatch, LossStep
from .common import attach_mu, require_mu, trl_loss_with_ratios

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class DecoupledMode(CorrectionMode):
    """The decoupled correction (module docstring).

    Adds to the generation batch (all (B, T) per local row): ``rollout_log_probs`` (mu), ``old_per_token_logps``
    (pi_old, when TRL computed none), ``rollout_rs_mask`` (RS + invalid tokens removed), ``rollout_is_weights`` (when
    IS is on); rewrites ``advantages`` (RS-rejected rows) and ``num_items_in_batch`` (kept tokens, global).
    """

    name = "decoupled"

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.correction_fn = make_correction_fn(trainer.rollout_correction, compile=trainer.args.rollout_corr_compile)

    def score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        attach_mu(trainer, gen, batch, require_mu(batch))
        self.apply_correction(trainer, batch, gen.rewards, gen.keep_rows)

    def apply_correction(self, trainer, batch: dict, rewards: Optional[torch.Tensor],
                         keep_rows: Optional[torch.Tensor] = None) -> None:
        """IS weights and RS mask from pi_old vs mu, once per generation batch; RS-aware advantages (in place).

        Args:
            batch: the generation batch, with ``rollout_log_probs``. rewards: (B_global, F) TRL's gathered rewards.
            keep_rows: (B,) bool rows within ``max_policy_lag`` at generation, or None.
        """
        mask = trl_compat.loss_mask(batch)
        old_log_probs = batch.get("old_per_token_logps")
        if old_log_probs is None:
            old_log_probs = batch["old_per_token_logps"] = trainer.old_log_probs(batch)
        kept = mask if keep_rows is None else mask * keep_rows[:, None].to(mask.dtype)
        correction = self.correction_fn(
            support.invalidate_misses(old_log_probs, batch.get("rollout_support_miss")), batch["rollout_log_probs"],
            kept, all_reduce=trainer.rollout_corr_reducers.all_reduce,
        )
        trainer.rollout_corr_metrics.add_stats(trainer.metrics_mode, correction.stats)
        new_mask = correction.response_mask
        batch["rollout_rs_mask"] = new_mask
        if correction.weights is not None:
            batch["rollout_is_weights"] = correction.weights
        gather = trainer.accelerator.gather
        batch["num_items_in_batch"] = gather(new_mask.sum()).sum()
        # rows left without a loss token (RS, or every token invalid): advantage 0, out of the baseline by default
        has_tokens = gather(mask.sum(dim=1) > 0)
        rejected = gather((mask.sum(dim=1) > 0) & (new_mask.sum(dim=1) == 0))
        batch["advantages"] = trainer.rows_out_of_baseline(batch["advantages"], rejected, has_tokens, rewards)

    def loss(self, trainer, model, step: LossStep, trl_loss) -> torch.Tensor:
        """TRL's loss with the RS mask as loss mask/normaliser and the IS weights after the clip."""
        loss_inputs = trl_compat.inject_rs_mask_and_is_weights(step.inputs)
        return trl_loss_with_ratios(trainer, model, step, loss_inputs, trl_loss)
