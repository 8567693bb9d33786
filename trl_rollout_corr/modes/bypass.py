"""Bypass mode: no pi_old forward (pi_old := mu); the correction runs inside the loss of every micro-batch.

The correction is computed from the current pi_theta (detached) against mu and the loss is PPO-clip on pi_theta / mu
(with a dual clip: TRL's ``delta``, else ``losses.DEFAULT_DUAL_CLIP``) or REINFORCE ``-A w log pi_theta``
(``losses.bypass_policy_loss``), aggregated as TRL's ``loss_type`` does (``trl_compat.aggregate_loss``), plus
``beta`` * KL to pi_ref and the MoE aux loss as TRL's ``_compute_loss`` adds them. The RS mask is the loss mask and
normaliser (dapo: the pre-RS token count, as verl's engine workers); the advantages were computed at generation time,
before pi_theta exists, so rows rejected here stay in their group's baseline. Batch normalisation divides by the mean
over the optimizer step's rows the loss keeps (``max_policy_lag``'s dropped rows excluded): with gradient accumulation
they are scored once, with no grad, at the step's first micro-batch (the ``batch_norm_window`` forwards).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch
from trl.trainer.grpo_trainer import disable_gradient_checkpointing

from .. import support, trl_compat
from ..baseline import rows_out_of_baseline
from ..correction import make_correction_fn, mask_pipeline
from ..hooks import CorrectionMode, ForwardCall, GenerationBatch, LossStep, refuse_config
from ..lag import stale_row_keep
from ..losses import DEFAULT_DUAL_CLIP, PPOClip, bypass_policy_loss
from .common import GRPO_DEFAULTS, attach_mu, check_correction_config, require_mu, trained_token_count

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

logger = logging.getLogger(__name__)


class BypassMode(CorrectionMode):
    """The bypass loss (module docstring)."""

    name = "bypass"
    replaces_trl_old_forward = True  # pi_old := mu: TRL's own pi_old forward is not run

    @classmethod
    def check_config(cls, args, correction) -> None:
        """Bypass mode: no pi_old forward (``rollout_corr_old_forward="always"`` refused), TRL's options against the
        correction (``common.check_correction_config``), batch normalisation only where a step's rows all exist at
        its first micro-batch, and of TRL's loss options only what our loss reproduces exactly (``_check_loss``)."""
        if args.rollout_corr_old_forward == "always":
            refuse_config(
                "rollout_corr_old_forward='always' keeps pi_old's own forward, but bypass mode has none (pi_old := "
                "mu, the rollout's log-probs), so the setting would be ignored: unset it (the default 'auto'), or use "
                "decoupled mode (bypass_mode=False) to compute pi_old."
            )
        check_correction_config(args, correction)
        ga, spg, iters = args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations
        # with gradient accumulation the trainer scores the step's rows once, at its first micro-batch (one no-grad
        # forward), which needs every row of the step to exist by then
        if correction.rollout_is_batch_normalize and ga > 1 and (spg * iters) % ga != 0:
            refuse_config(
                "rollout_is_batch_normalize=True with bypass_mode=True normalises over the optimizer step's rows, "
                "which must all be generated before the step starts: steps_per_generation * num_iterations "
                f"({spg} * {iters}) must be a multiple of gradient_accumulation_steps ({ga}). Change "
                "steps_per_generation, or turn batch normalisation off."
            )
        _check_loss(args, correction)

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.correction_fn = make_correction_fn(trainer.rollout_correction, compile=trainer.args.rollout_corr_compile)
        # with gradient accumulation: (optimizer step, global (sum, count)) of the step's rows, from its first
        # micro-batch
        self._window: Optional[tuple] = None
        # the loss mask: rows over max_policy_lag out, then the correction's (``correction.mask_pipeline``); its
        # ``rows`` part is what both the loss and the batch-normalisation window hand to the correction
        self.masks = mask_pipeline.MaskPipeline(mask_pipeline.lag_rows, mask_pipeline.correction)

    def score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """Rows over ``max_policy_lag`` at generation (``gen.keep_rows``) out of their group's baseline, then mu into
        the batch; the correction waits for pi_theta, in the loss."""
        if gen.keep_rows is not None:
            has = trl_compat.loss_mask(batch).sum(dim=1) > 0
            gather = trainer.accelerator.gather
            has_tokens, rejected = gather(has), gather(has & ~gen.keep_rows)
            batch["advantages"] = rows_out_of_baseline(
                trainer, batch["advantages"], rejected, has_tokens, gen.rewards, count_lone_survivors=False
            )
        attach_mu(trainer, gen, batch, require_mu(batch))

    def loss(self, trainer, model, step: LossStep, trl_loss) -> torch.Tensor:
        """One micro-batch: the correction from pi_theta (no grad) vs mu, then the bypass policy loss."""
        self._batch_norm_sum(trainer, model)  # the step's window forwards (if any) first, each its own replay
        inputs = step.inputs
        fwd = trl_compat.prompt_completion_inputs(inputs)
        call = ForwardCall("bypass_loss", model, batch=inputs, measure=True)
        per_token_logps, entropies, aux_loss = trainer.policy_forward(
            call, fwd, compute_entropy=True, compute_aux_loss=trainer.aux_loss_enabled, **fwd.multimodal,
        )
        mode, args = trainer.metrics_mode, trainer.args
        dual_clip = args.delta if args.delta is not None else DEFAULT_DUAL_CLIP
        out = bypass_policy_loss(
            per_token_logps, support.invalidate_misses(inputs["rollout_log_probs"], call.miss), inputs["advantages"],
            self.trained_mask(trainer, inputs), trainer.rollout_correction, correction_fn=self.correction_fn,
            clip=PPOClip(trainer.epsilon_low, trainer.epsilon_high, clip_ratio_c=dual_clip),
            all_reduce=self._batch_norm_sum(trainer, model),
        )
        keep = out.mask
        # PPO-clip takes the IS weights as metrics only; REINFORCE multiplies them in (IcePop's zeros train nothing)
        weights = out.correction.weights if trainer.rollout_correction.bypass_loss_type != "ppo_clip" else None
        step.trained_tokens = trained_token_count(keep, weights)
        trainer.rollout_corr_metrics.add_stats(mode, out.correction.stats)
        direct = per_token_logps.detach().float() - inputs["rollout_log_probs"].float()
        trainer.rollout_corr_metrics.add_log_ratios(mode, {"direct": direct[keep & torch.isfinite(direct)]})
        per_token_loss, per_token_kl = out.per_token_loss, None
        if trainer.beta != 0.0:
            # bias-corrected KL as TRL: times the policy ratio, here pi_theta / mu (bypass: pi_old := mu)
            anchor = inputs["rollout_log_probs"] if args.use_bias_correction_kl else None
            per_token_kl = trl_compat.per_token_kl(
                per_token_logps, inputs["ref_per_token_logps"], keep, bias_correction_old_log_probs=anchor
            )
            per_token_loss = per_token_loss + trainer.beta * torch.where(keep, per_token_kl, 0.0)
        loss = trl_compat.aggregate_loss(per_token_loss, keep, trainer.loss_type,
                                         **self._aggregation_kwargs(trainer, inputs))
        if trainer.aux_loss_enabled:  # MoE router load-balancing loss, scaled for gradient accumulation as TRL does
            loss = loss + trainer.router_aux_loss_coef * aux_loss / self._accumulation_steps(trainer)
            trainer.trl_metric("aux_loss", trainer.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())
        self._log_loss_metrics(trainer, keep, entropies, per_token_kl, out)
        return loss

    def _batch_norm_sum(self, trainer, model) -> Optional[Callable]:
        """The batch-normalisation sum for this micro-batch (``compute_rollout_correction(all_reduce=...)``).

        Without batch normalisation, in evaluation, or without gradient accumulation the micro-batch is the step's
        local batch: the cross-rank sum. With gradient accumulation the step's rows are spread over several
        micro-batches whose pi_theta only exists inside their own loss forward; but the weights do not change within
        the step, so at its first micro-batch one no-grad forward scores all of the step's rows (the micro-batches
        TRL will serve next, already generated: ``RolloutCorrGRPOConfig`` checks that they are) and every
        micro-batch of the step then divides by that global mean. Cost: that one forward per optimizer step.
        """
        reducers = trainer.rollout_corr_reducers
        if not (trainer.rollout_correction.rollout_is_batch_normalize and trainer.metrics_mode == "train"
                and trainer.current_gradient_accumulation_steps > 1):
            return reducers.all_reduce
        step = trainer.state.global_step
        if self._window is None or self._window[0] != step:
            self._window = (step, self._window_total(trainer, model))
        total = self._window[1]
        return lambda _local_total: total

    def _window_total(self, trainer, model) -> torch.Tensor:
        """The global (sum of weights, count) over every row of the optimizer step now starting that its loss keeps:
        the step's micro-batches (``trainer.step_micro_batches()``, each masked by ``trained_mask`` as the loss masks
        it: the same pipeline steps) scored with no grad, the correction run on all of them at once (its statistics
        are discarded; only the batch-normalisation total is kept)."""
        chunks = trainer.step_micro_batches()
        log_probs, rollout, masks = [], [], []
        trainer.rollout_corr_forward_counts["batch_norm_window"] += 1
        no_checkpointing = disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
        with torch.no_grad(), no_checkpointing:
            for chunk in chunks:
                fwd = trl_compat.prompt_completion_inputs(chunk)
                call = ForwardCall("batch_norm_window", model, batch=chunk)
                lp, _, _ = trainer.policy_forward(call, fwd, **fwd.multimodal)
                log_probs.append(lp.float())
                rollout.append(support.invalidate_misses(chunk["rollout_log_probs"], call.miss))
                masks.append(self.trained_mask(trainer, chunk))
        captured = []
        cross_rank = trainer.rollout_corr_reducers.all_reduce

        def capture(local_total: torch.Tensor) -> torch.Tensor:
            captured.append(local_total if cross_rank is None else cross_rank(local_total))
            return captured[-1]

        self.correction_fn(torch.cat(log_probs), torch.cat(rollout), torch.cat(masks), all_reduce=capture)
        return captured[-1]

    def trained_mask(self, trainer, batch: dict) -> torch.Tensor:
        """(B, T) the tokens of a micro-batch the correction sees: TRL's loss mask through the ``rows`` part of the
        mode's mask pipeline (``lag_rows``: rows over ``max_policy_lag`` now out, ``lag.stale_row_keep``). The loss
        runs it on its micro-batch (already filtered by ``PolicyLag.before_loss``: the step is idempotent) and the
        window on each raw micro-batch of the step, so both hand the correction the same tokens."""
        keep = stale_row_keep(batch.get("rollout_policy_version"), trainer.state.global_step,
                              trainer.args.max_policy_lag)
        return self.masks.rows(trl_compat.loss_mask(batch), mask_pipeline.MaskContext(row_keep=keep))

    @staticmethod
    def _accumulation_steps(trainer) -> float:
        """TRL's gradient-accumulation divisor: ``current_gradient_accumulation_steps`` in training, 1 in eval."""
        return trainer.current_gradient_accumulation_steps if trainer.metrics_mode == "train" else 1.0

    def _aggregation_kwargs(self, trainer, inputs: dict) -> dict:
        """The trainer state ``trl_compat.aggregate_loss`` needs, for this micro-batch and mode."""
        train = trainer.metrics_mode == "train"
        return dict(
            accumulation_steps=self._accumulation_steps(trainer),
            max_completion_length=trainer.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=trainer.accelerator.num_processes,
            steps_per_generation=trainer.args.steps_per_generation if train else 1,
        )

    @staticmethod
    def _log_loss_metrics(trainer, keep, entropies, per_token_kl, out) -> None:
        """TRL's loss metrics (``kl``, ``entropy``, ``clip_ratio/*``, ``low_min`` / ``high_max`` included) for the
        bypass loss, over the kept tokens."""
        reduce_sum = trainer.rollout_corr_reducers.all_reduce
        if per_token_kl is not None:
            trainer.trl_metric("kl", trl_compat.global_masked_mean(per_token_kl, keep, reduce_sum))
        trainer.trl_metric("entropy", trl_compat.global_masked_mean(entropies, keep, reduce_sum))
        if out.clipped_high is not None:
            clipped = {"clip_ratio/high_mean": out.clipped_high, "clip_ratio/low_mean": out.clipped_low,
                       "clip_ratio/region_mean": out.clipped_high | out.clipped_low}
            for key, flags in clipped.items():
                trainer.trl_metric(key, trl_compat.global_masked_mean(flags.float(), keep, reduce_sum))
            low_min, high_max = trl_compat.clip_ratio_extremes(out.clipped_low, out.clipped_high, keep,
                                                               trainer.accelerator.gather)
            trainer.trl_metric("clip_ratio/low_min", low_min)
            trainer.trl_metric("clip_ratio/high_max", high_max)


def _check_loss(args, correction) -> None:
    """Our loss replaces TRL's: refuse TRL's loss options it does not reproduce (and warn that IS weights are
    metrics only under PPO-clip). Raises ValueError (``refuse_config``)."""
    unsupported = {
        "importance_sampling_level": (args.importance_sampling_level != "token", "'token'"),
        "top_entropy_quantile": (args.top_entropy_quantile < 1.0, "1.0"),
        "off_policy_mask_threshold": (args.off_policy_mask_threshold is not None, "None"),
        "entropy_coef": (args.entropy_coef != 0.0, "0.0"),
        "use_adaptive_entropy": (bool(args.use_adaptive_entropy), "False"),
    }
    for name, (bad, needed) in unsupported.items():
        if bad:
            refuse_config(f"bypass_mode=True replaces TRL's loss and does not support {name}={getattr(args, name)!r}; "
                          f"set {name}={needed}.")
    if args.delta is not None and correction.bypass_loss_type == "reinforce":
        refuse_config(
            f"delta={args.delta} bounds the PPO ratio, but bypass_loss_type='reinforce' has no ratio in its loss; "
            "unset delta or use bypass_loss_type='ppo_clip'."
        )
    clip_set = [f"{name}={getattr(args, name)!r}" for name in ("epsilon", "epsilon_high")
                if getattr(args, name) != GRPO_DEFAULTS[name]]
    if clip_set and correction.bypass_loss_type == "reinforce":
        refuse_config(
            f"{', '.join(clip_set)} set the PPO clip range, but bypass_loss_type='reinforce' has no ratio in its "
            "loss, so it would be ignored; leave epsilon / epsilon_high at TRL's defaults (0.2 / None) or use "
            "bypass_loss_type='ppo_clip'."
        )
    epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    if correction.bypass_loss_type == "ppo_clip" and args.delta is not None and not args.delta > 1 + epsilon_high:
        refuse_config(
            f"bypass_mode=True uses delta as the dual-clip bound of PPO-clip on pi_theta / mu (for A < 0 the "
            f"per-token loss is capped at -A * delta), which is TRL's two-sided clip only for delta > 1 + "
            f"epsilon_high; got delta={args.delta}, epsilon_high={epsilon_high}."
        )
    if correction.bypass_loss_type == "ppo_clip" and correction.rollout_is is not None:
        extra = (" rollout_is_batch_normalize=True normalises those metrics only, at the cost of one extra "
                 "no-grad forward per optimizer step with gradient_accumulation_steps > 1."
                 if correction.rollout_is_batch_normalize else "")
        logger.warning(
            f"rollout_is={correction.rollout_is!r} with bypass_mode=True and bypass_loss_type='ppo_clip': the "
            "PPO ratio pi_theta / mu already compares against the behaviour policy, so the IS weights are "
            "logged (rollout_corr/rollout_is_*) but multiplied into no loss (docs/reference/configuration.md, "
            f"bypass_loss_type).{extra} To weight the loss use bypass_loss_type='reinforce' or decoupled "
            "mode (bypass_mode=False); else unset rollout_is."
        )
