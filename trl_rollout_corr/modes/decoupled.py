"""Decoupled mode: the correction once per generation batch, from pi_old vs mu; TRL's loss with its mask and weights.

Right after generation the IS weights and the RS mask are computed once from ``log pi_old - log mu``; rows that RS
rejects entirely get advantage 0 and leave their group's mean/std (``rs_keep_rejected_in_baseline=True`` keeps them
in, as verl does). The loss is TRL's own PPO-clip loss (any of ``trl_compat.SUPPORTED_LOSS_TYPES["decoupled"]``) with
the RS mask as loss mask and normaliser and the IS weights multiplying the clipped per-token loss
(``trl_compat.inject_rs_mask_and_is_weights``). ``max_policy_lag``: rows already over the bound at generation
(``GenerationBatch.keep_rows``) leave the correction and the baseline in the same exclusion as RS.

pi_old from the first loss forward (``rollout_corr_old_forward="auto"``, ``old_forward``'s rule): in training the
batch leaves scoring without pi_old; ``prepare_loss`` runs its loss forward (role ``old``: routes replayed and
measured, support scored and measured), takes the detached log-probs as pi_old, runs the same correction on the rows
in TRL's shuffled order (``rollout_generation_row`` maps them back for the group baselines) into the batch TRL holds
(a later iteration finds it done), and hands the forward to TRL's own loss call (``LossStep.reuse``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from .. import old_forward, support, trl_compat
from ..baseline import rows_out_of_baseline
from ..correction import make_correction_fn, mask_pipeline
from ..hooks import CorrectionMode, ForwardCall, GenerationBatch, LossStep, refuse_config
from .common import attach_mu, check_correction_config, require_mu, trained_token_count, trl_loss_with_ratios
from .m2po_window import m2po_step_mask

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class DecoupledMode(CorrectionMode):
    """The decoupled correction (module docstring).

    Adds to the generation batch (all (B, T) per local row): ``rollout_log_probs`` (mu), ``old_per_token_logps``
    (pi_old, when TRL computed none), ``rollout_rs_mask`` (RS + invalid tokens removed), ``rollout_is_weights`` (when
    IS is on); rewrites ``advantages`` (RS-rejected rows) and ``num_items_in_batch`` (kept tokens, global).
    """

    name = "decoupled"

    @classmethod
    def check_config(cls, args, correction) -> None:
        """TRL's options against the correction (``common.check_correction_config``); batch normalisation only where
        the generation batch is the optimizer step's global batch (spec section 3)."""
        check_correction_config(args, correction)
        if not correction.rollout_is_batch_normalize:
            return
        ga, spg, iters = args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations
        generate_every = spg * iters
        if ga % spg != 0 or generate_every % ga != 0:
            # the weights are normalised once per generation batch, which must be the step's global batch
            refuse_config(
                "rollout_is_batch_normalize=True in decoupled mode normalises over the generation batch, which is "
                "the optimizer step's global batch only when each step trains on whole generation batches of one "
                f"generation: gradient_accumulation_steps ({ga}) must be a multiple of steps_per_generation ({spg}), "
                f"and steps_per_generation * num_iterations ({generate_every}) a multiple of "
                "gradient_accumulation_steps. Set steps_per_generation=gradient_accumulation_steps (TRL's default), "
                "use bypass_mode=True, or turn batch normalisation off."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.correction_fn = make_correction_fn(trainer.rollout_correction, compile=trainer.args.rollout_corr_compile)
        self.old_forward_plan = old_forward.plan_for_trainer(trainer, "decoupled")
        self.replaces_trl_old_forward = self.old_forward_plan.replaces_trl_old_forward
        old_forward.log_plan(self.old_forward_plan)
        # (rewards, keep_rows, version scorer) of the batch whose pi_old its loss gives
        self._pending: Optional[tuple] = None
        correction = trainer.rollout_correction
        self.rs_on_engine = correction.rs_enabled and getattr(correction, "rollout_rs_on", "direct") == "engine"
        self.m2_threshold = correction.rollout_m2_threshold
        # the mask of the loss (the RS mask): rows over max_policy_lag at generation out, then the correction's
        # mask, then M2PO's (``correction.mask_pipeline``)
        self.masks = mask_pipeline.MaskPipeline(
            mask_pipeline.lag_rows, mask_pipeline.correction,
            *((mask_pipeline.m2po,) if self.m2_threshold is not None else ()))

    def score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        attach_mu(trainer, gen, batch, require_mu(batch))
        if ("old_per_token_logps" not in batch and self.old_forward_plan.from_loss
                and trainer.metrics_mode == "train"):
            rows = batch["completion_ids"].size(0)
            batch[old_forward.GENERATION_ROW] = torch.arange(rows, device=batch["completion_ids"].device)
            self._pending = (gen.rewards, gen.keep_rows, gen.version_log_probs)
            return
        self.apply_correction(trainer, batch, gen.rewards, gen.keep_rows, version_log_probs=gen.version_log_probs)

    def prepare_loss(self, trainer, model, step: LossStep) -> None:
        """pi_old read from the loss forward (module docstring), for the batch's first use."""
        batch = step.original
        if old_forward.GENERATION_ROW not in batch or "old_per_token_logps" in batch:
            return
        if self._pending is None:
            raise RuntimeError("A generation batch left scoring without pi_old, but no scoring is pending for it "
                               "(rollout_corr_old_forward='auto'); set rollout_corr_old_forward='always'.")
        (rewards, keep_rows, version_log_probs), self._pending = self._pending, None
        rows = batch[old_forward.GENERATION_ROW]
        fwd = trl_compat.prompt_completion_inputs(batch)
        result = trainer.policy_forward(ForwardCall("old", model, batch=batch, measure=True), fwd,
                                        compute_entropy=True, compute_aux_loss=trainer.aux_loss_enabled,
                                        **fwd.multimodal)
        trainer.rollout_corr_forward_counts["old_from_loss"] += 1
        batch["old_per_token_logps"] = result[0].detach().float()
        self.apply_correction(trainer, batch, rewards, None if keep_rows is None else keep_rows[rows], rows=rows,
                              version_log_probs=version_log_probs)
        step.reuse = (fwd.input_ids, fwd.attention_mask, fwd.logits_to_keep, result)

    @contextlib.contextmanager
    def forward(self, trainer, call: ForwardCall, step: Optional[LossStep]) -> Iterator[None]:
        """TRL's own loss forward over the rows whose forward ``prepare_loss`` ran already is answered with that
        forward's result (``LossStep.reuse``, once)."""
        if call.role == "loss" and step is not None and step.reuse is not None:
            reuse, step.reuse = step.reuse, None
            call.result = old_forward.reused_forward(reuse, call.input_ids, call.attention_mask, call.logits_to_keep)
        yield

    def apply_correction(self, trainer, batch: dict, rewards: Optional[torch.Tensor],
                         keep_rows: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None,
                         version_log_probs: Optional[Callable[[dict], Optional[torch.Tensor]]] = None) -> None:
        """IS weights and RS mask from pi_old vs mu, once per generation batch; RS-aware advantages (in place).

        Args:
            batch: the generation batch, with ``rollout_log_probs``. rewards: (B_global, F) TRL's gathered rewards.
            keep_rows: (B,) bool rows within ``max_policy_lag`` at generation, or None.
            rows: (B,) int64 the generation row of each batch row when the batch is in TRL's shuffled order (pi_old
                read from the loss forward); None: generation order.
            version_log_probs: the lag split's scorer (``GenerationBatch.version_log_probs``), or None.
        """
        mask = trl_compat.loss_mask(batch)
        old_log_probs = batch.get("old_per_token_logps")
        if old_log_probs is None:
            old_log_probs = batch["old_per_token_logps"] = trainer.old_log_probs(batch)
        miss = batch.get("rollout_support_miss")
        old_log_probs = support.invalidate_misses(old_log_probs, miss)
        extra = {"rs_log_probs": support.invalidate_misses(_engine_log_probs(version_log_probs, batch), miss)} \
            if self.rs_on_engine else {}
        outputs = []

        def correct(kept: torch.Tensor) -> torch.Tensor:
            out = self.correction_fn(old_log_probs, batch["rollout_log_probs"], kept,
                                     all_reduce=trainer.rollout_corr_reducers.all_reduce, **extra)
            trainer.rollout_corr_metrics.add_stats(trainer.metrics_mode, out.stats)
            outputs.append(out)
            return out.response_mask

        m2po_keep = functools.partial(self._m2po_keep, trainer, old_log_probs, batch["rollout_log_probs"], rows=rows)
        ctx = mask_pipeline.MaskContext(row_keep=keep_rows, correct=correct, m2po_keep=m2po_keep)
        new_mask = self.masks(mask, ctx)
        correction = outputs[0]
        batch["rollout_rs_mask"] = new_mask
        if correction.weights is not None:
            batch["rollout_is_weights"] = correction.weights
        gather = trainer.accelerator.gather
        batch["num_items_in_batch"] = gather(new_mask.sum()).sum()
        # rows left without a loss token (RS, or every token invalid): advantage 0, out of the baseline by default
        has, rejected, advantages = mask.sum(dim=1) > 0, (mask.sum(dim=1) > 0) & (new_mask.sum(dim=1) == 0), \
            batch["advantages"]
        if rows is not None:  # the group baselines need generation order (groups are consecutive there)
            has, rejected, advantages = (old_forward.to_generation_order(t, rows) for t in (has, rejected, advantages))
        advantages = rows_out_of_baseline(trainer, advantages, gather(rejected), gather(has), rewards)
        batch["advantages"] = advantages if rows is None else advantages[rows]

    def _m2po_keep(self, trainer, old_log_probs, rollout_log_probs, mask, rows) -> torch.Tensor:
        """M2PO's step-global keep mask of ``mask``'s tokens (``modes.m2po_window``; the ``m2po`` mask step multiplies
        it in), its metrics recorded: the second moment of ``l = log pi_old - log mu`` (nats^2) before / after over
        the step's trained tokens, and the fraction of them masked (all exact over the log window: sums and counts,
        already global). ``l`` is the whole ratio also with ``rollout_rs_on="engine"`` (by design: M2PO bounds
        staleness, not only engine numerics)."""
        log_ratio = old_log_probs.double() - rollout_log_probs.double()
        keep, sel = m2po_step_mask(log_ratio, mask, self.m2_threshold, trainer.rollout_corr_reducers,
                                   trainer.accelerator.process_index, rows)
        mode, metrics = trainer.metrics_mode, trainer.rollout_corr_metrics
        metrics.add_global_ratio(mode, "m2po_second_moment_before", sel.sum_sq_before, sel.n_valid)
        metrics.add_global_ratio(mode, "m2po_second_moment_after", sel.sum_sq_after, sel.n_valid - sel.n_masked)
        metrics.add_global_ratio(mode, "m2po_masked_fraction", sel.n_masked, sel.n_valid)
        return keep

    def loss(self, trainer, model, step: LossStep, trl_loss) -> torch.Tensor:
        """TRL's loss with the RS mask as loss mask/normaliser and the IS weights after the clip."""
        loss_inputs = trl_compat.inject_rs_mask_and_is_weights(step.inputs)
        step.trained_tokens = trained_token_count(trl_compat.loss_mask(loss_inputs),
                                                  step.inputs.get("rollout_is_weights"))
        return trl_loss_with_ratios(trainer, model, step, loss_inputs, trl_loss)


def _engine_log_probs(scorer: Optional[Callable[[dict], Optional[torch.Tensor]]], batch: dict) -> torch.Tensor:
    """(B, T) log pi_train@v per token (the lag split's scorer, ``GenerationBatch.version_log_probs``, run now: RS
    judges the engine factor).

    Raises:
        RuntimeError: without the lag split (``RolloutCorrGRPOConfig`` refuses ``rollout_rs_on='engine'`` then) or
            without the rows' policy versions.
    """
    version_log_probs = None if scorer is None else scorer(batch)
    if version_log_probs is None:
        raise RuntimeError("rollout_rs_on='engine' needs the lag split's log pi_train@v (policy_lag_split=True) "
                           "and the rows' policy versions; none reached the batch.")
    return version_log_probs
