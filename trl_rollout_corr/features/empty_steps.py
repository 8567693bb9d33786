"""``skip_empty_steps``: no optimizer step when no token of the optimizer step carries gradient on any rank.

A step whose every token the correction rejected (RS), zero-weighted (IcePop) or dropped (``max_policy_lag``) has a
zero gradient, but TRL still calls the optimizer, and AdamW's momentum and weight decay move the weights anyway
(``docs/reference/known-limits.md``). With this feature the correction modes count, per micro-batch, the tokens that
carry
gradient (``LossStep.trained_tokens``); the counts of the optimizer step's micro-batches are summed and all-reduced
across ranks at the optimizer step (one global decision, taken on every rank alike), and when the sum is 0 the
optimizer's ``step()`` is not called: parameters and optimizer state (AdamW's moments and step count) stay as they
are. The Trainer still advances ``global_step`` and the learning-rate schedule. Logged per optimizer step as
``rollout_corr/skipped_step_fraction`` (1 for a skipped step, 0 else; averaged over the logging window).

The skip wraps the prepared optimizer's ``step`` once, at ``on_train_begin`` (``trl_compat.wrap_optimizer_step``:
the Trainer calls ``self.optimizer.step()`` exactly once per optimizer step, pinned by a test). DeepSpeed is refused:
its engine steps the optimizer inside ``accelerator.backward``, where the wrapper does not reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import trl_compat
from ..hooks import Feature, LossStep, refuse_config

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

METRIC = "rollout_corr/skipped_step_fraction"


class SkipEmptySteps(Feature):
    """The trained-token count of the optimizer step, and the optimizer step skipped when it is 0 everywhere.

    Raises:
        ValueError: (construction) DeepSpeed is enabled.
    """

    name = "skip_empty_steps"

    @classmethod
    def wanted(cls, args) -> bool:
        return bool(getattr(args, "skip_empty_steps", False))

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``skip_empty_steps``: only with a configured correction, and not with fp16 (accelerate's GradScaler)."""
        if args.skip_empty_steps and not correction.enabled:
            refuse_config(
                "skip_empty_steps skips the optimizer on steps whose every token the correction rejected; without a "
                "correction nothing is rejected and the trainer is TRL's GRPO. Configure a rollout correction or "
                "unset skip_empty_steps."
            )
        if args.skip_empty_steps and args.fp16:
            refuse_config(
                "skip_empty_steps with fp16: a skipped step would skip accelerate's GradScaler update after the "
                "gradient clipping has already unscaled the gradients, and the next step fails in torch's unscale_. "
                "Train in bf16 or float32, or unset skip_empty_steps."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        if trainer.is_deepspeed_enabled:
            raise ValueError(
                "skip_empty_steps cannot skip DeepSpeed's optimizer step (the engine steps inside "
                "accelerator.backward); unset skip_empty_steps, or train without DeepSpeed (DDP)."
            )
        self.tokens = 0  # this rank's tokens with gradient since the last optimizer step
        self.skipped: list[int] = []  # the global_step of every skipped optimizer step (this run)
        from transformers import TrainerCallback

        feature = self

        class WrapOptimizer(TrainerCallback):
            """Wrap the prepared optimizer's ``step`` once training begins (it exists only then)."""

            def on_train_begin(self, args, state, control, **kwargs):
                trl_compat.wrap_optimizer_step(trainer.optimizer, lambda: feature.allow_step(trainer))

        trainer.add_callback(WrapOptimizer())

    def after_loss(self, trainer, step: LossStep) -> None:
        """Training: add the micro-batch's tokens with gradient to the optimizer step's count."""
        if trainer.metrics_mode == "train" and step.trained_tokens is not None:
            self.tokens += int(step.trained_tokens)

    def allow_step(self, trainer) -> bool:
        """At the optimizer step, on every rank: whether any rank trained a token since the last one (a sum over
        ranks: a collective); logs the step as skipped or not, and resets the count."""
        local = torch.tensor([float(self.tokens)], device=trainer.accelerator.device)
        total = trainer.accelerator.reduce(local, reduction="sum") if trainer.accelerator.num_processes > 1 else local
        self.tokens = 0
        empty = float(total.item()) == 0.0
        if empty:
            self.skipped.append(int(trainer.state.global_step))
        trainer.trl_metric(METRIC, 1.0 if empty else 0.0)
        return not empty
