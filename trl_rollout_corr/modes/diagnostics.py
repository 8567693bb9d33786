"""No correction configured (no IS, RS or bypass: the default and the ``disabled`` preset): TRL's GRPO, unchanged.

Nothing TRL computes is changed (its batch, advantages, masks, ``sampling_per_token_logps``,
``old_per_token_logps``, the loss); the ``rollout_corr/*`` statistics of pi_old vs mu are computed on the side where
mu exists, and the ratio decomposition of TRL's own loss forward is logged.

pi_old from the first loss forward (``rollout_corr_old_forward="auto"``, ``old_forward``'s rule; only where TRL has
no pi_old of its own): in training the statistics wait for TRL's loss forward, whose detached log-probs are pi_old
(the trainer gives that forward the role ``old``: routes measured, the kept mass measured); TRL's loss is untouched
and no extra forward runs.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from .. import old_forward, support, trl_compat
from ..correction import make_correction_fn
from ..hooks import CorrectionMode, ForwardCall, GenerationBatch, LossStep
from .common import attach_mu, trl_loss_with_ratios

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class DiagnosticsMode(CorrectionMode):
    """TRL's GRPO with ``rollout_corr/*`` diagnostics on the side (module docstring)."""

    name = "diagnostics"

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.correction_fn = make_correction_fn(trainer.rollout_correction, compile=trainer.args.rollout_corr_compile)
        self.old_forward_plan = old_forward.plan_for_trainer(trainer, "diagnostics")
        old_forward.log_plan(self.old_forward_plan)

    def score(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """pi_old recomputed (routes replayed) where a feature replaced TRL's pi_old forward, then the statistics of
        pi_old vs mu: only our own keys are added (mu to ``rollout_log_probs``; on the plain generate path TRL has no
        ``sampling_per_token_logps``, so none is left in the batch: TRL's ``off_policy_mask_threshold`` then measures
        against pi_old, as in TRL; pi_old, when TRL computed none, to ``rollout_old_log_probs``)."""
        if gen.trl_old_skipped:  # TRL's loss needs its pi_old: recompute it, replayed
            batch["old_per_token_logps"] = trainer.old_log_probs(batch)
        mu = batch.pop("sampling_per_token_logps") if gen.mu_captured else batch.get("sampling_per_token_logps")
        if mu is None or gen.mu_unusable is not None:
            trainer.warn_once(f"no rollout_corr/* diagnostics for a generation batch: {gen.mu_unusable or 'no mu'}")
            return
        attach_mu(trainer, gen, batch, mu)
        old_log_probs = batch.get("old_per_token_logps")
        if old_log_probs is None and self.old_forward_plan.from_loss and trainer.metrics_mode == "train":
            return  # pi_old := TRL's loss forward (prepare_loss / loss)
        if old_log_probs is None:  # TRL uses pi_theta.detach() as pi_old here; the diagnostics need it explicitly
            # a forward TRL does not run: its dropout must not consume the random numbers TRL's next forwards and
            # sampling draw (a model with dropout would otherwise train differently from plain TRL)
            device = batch["completion_ids"].device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                old_log_probs = batch["rollout_old_log_probs"] = trainer.old_log_probs(batch)
        self._statistics(trainer, batch, old_log_probs)

    def _statistics(self, trainer, batch: dict, old_log_probs: torch.Tensor) -> None:
        correction = self.correction_fn(
            support.invalidate_misses(old_log_probs, batch.get("rollout_support_miss")), batch["rollout_log_probs"],
            trl_compat.loss_mask(batch), all_reduce=trainer.rollout_corr_reducers.all_reduce,
        )
        trainer.rollout_corr_metrics.add_stats(trainer.metrics_mode, correction.stats)

    def prepare_loss(self, trainer, model, step: LossStep) -> None:
        """pi_old read from TRL's loss forward, for a batch scored without it."""
        batch = step.original
        step.old_from_loss = (self.old_forward_plan.from_loss and trainer.metrics_mode == "train"
                              and "rollout_log_probs" in batch and "old_per_token_logps" not in batch
                              and "rollout_old_log_probs" not in batch)

    @contextlib.contextmanager
    def forward(self, trainer, call: ForwardCall, step: Optional[LossStep]) -> Iterator[None]:
        """TRL's first loss forward of a step whose pi_old it gives (``LossStep.old_from_loss``) gets the role
        ``old``: routes replayed and measured, support scored and measured, over the micro-batch as TRL passed it."""
        if call.role == "loss" and step is not None and step.old_from_loss and step.policy_log_probs is None:
            call.role, call.batch, call.measure = "old", step.original, True
        yield

    def loss(self, trainer, model, step: LossStep, trl_loss) -> torch.Tensor:
        """TRL's loss on TRL's inputs, with the ratio diagnostics (and, pi_old read from its forward, the
        statistics)."""
        if not step.old_from_loss:
            return trl_loss_with_ratios(trainer, model, step, step.inputs, trl_loss)

        def trl_loss_then_statistics(model, inputs):
            loss = trl_loss(model, inputs)
            old = step.policy_log_probs.float()
            for batch in (step.original, step.inputs):
                batch["rollout_old_log_probs"] = old
            trainer.rollout_corr_forward_counts["old_from_loss"] += 1
            self._statistics(trainer, step.original, old)
            return loss

        return trl_loss_with_ratios(trainer, model, step, step.inputs, trl_loss_then_statistics)
