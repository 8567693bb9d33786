"""Policy lag (``lag.py``): per-row policy versions, the ``rollout_corr/policy_lag_*`` metrics and ``max_policy_lag``.

Every generated row carries the version (optimizer step) of the weights that generated it, in
``GenerationBatch.versions`` and then the batch key ``rollout_policy_version``: a ``rollout_func``'s
``policy_version`` (one int per row, or one per token), with ``rollout_async_depth`` the version the asynchronous
engine reports it held (``async_generation``), else the current optimizer step (TRL's vLLM colocate/server
paths sync before every generation; ``transformers.generate`` samples from the policy itself). Each trained
micro-batch logs its per-row lag. ``max_policy_lag`` drops rows over the bound: rows already over it at generation
leave their group's baseline like a fully RS-rejected row (``GenerationBatch.keep_rows``, which the mode reads:
decoupled mode merges them with the RS rejection in one exclusion, bypass mode excludes them when it scores the
batch, no correction keeps them in), rows that cross it only later
(``num_iterations`` / ``steps_per_generation`` reuse) leave the loss when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import trl_compat
from ..hooks import Feature, GenerationBatch, LossStep, refuse_config
from ..lag import drop_stale_rows, lag_keep, policy_lag, row_versions, token_versions

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer


class PolicyLag(Feature):
    """Versions, lag metrics and the ``max_policy_lag`` filter (module docstring); present in every trainer.

    Raises:
        ValueError: (``after_generate``) versions from the future, or none from a ``rollout_func`` while
            ``max_policy_lag`` is set (``lag.row_versions``).
    """

    name = "policy_lag"

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``max_policy_lag``: an int >= 0 (or unset), only with a configured correction."""
        bound = args.max_policy_lag
        if bound is None:
            return
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            refuse_config(f"max_policy_lag must be an int >= 0 (optimizer steps) or unset, got {bound!r}.")
        if not correction.enabled:
            refuse_config(
                "max_policy_lag drops stale samples from the loss, which changes TRL's GRPO; configure a rollout "
                "correction (rollout_is / rollout_rs / bypass_mode, or a rollout_corr_preset) or unset "
                "max_policy_lag."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        self.bound = trainer.args.max_policy_lag

    def after_generate(self, trainer, gen: GenerationBatch, result: tuple) -> None:
        """The rows' (B,) versions from TRL's ``_generate`` result, checked (``lag.row_versions``)."""
        raw = result[5].get("policy_version") if trainer.rollout_func is not None else None
        if trainer.rollout_async is not None and trainer.model.training:  # the engine's own record
            raw = trainer.rollout_async.take_row_versions()
        required = trainer.rollout_func is not None and self.bound is not None
        gen.versions = row_versions(raw, len(result[1]), trainer.state.global_step, required=required,
                                    completion_lengths=[len(ids) for ids in result[1]])
        gen.token_versions = raw  # made (B, T) in on_batch (None unless a row spans a weight update)

    def on_batch(self, trainer, gen: GenerationBatch, batch: dict) -> None:
        """``gen.versions`` on the batch's device (the current step when no generation ran through ``_generate``: not
        a TRL 1.16 path), ``gen.token_versions`` (B, T) when a row spans a weight update (``lag.token_versions``),
        ``gen.keep_rows`` (the mode takes them out of their group's baseline)."""
        completion_ids = batch["completion_ids"]
        versions = gen.versions
        if versions is None:
            versions = torch.full((completion_ids.size(0),), trainer.state.global_step, dtype=torch.int64)
        gen.versions = versions.to(completion_ids.device)
        if gen.token_versions is not None and not isinstance(gen.token_versions, torch.Tensor):
            tokens = token_versions(gen.token_versions, gen.versions.cpu(), completion_ids.size(1))
            gen.token_versions = None if tokens is None else tokens.to(completion_ids.device)
        if self.bound is None:
            return
        gen.keep_rows = lag_keep(policy_lag(gen.versions, trainer.state.global_step), self.bound)

    def before_loss(self, trainer, step: LossStep) -> None:
        """The micro-batch's per-row lag into ``rollout_corr/policy_lag_*``; with ``max_policy_lag``, ``step.inputs``
        becomes a copy whose stale rows are out of the loss mask (``lag.drop_stale_rows``; decoupled: the RS mask;
        bypass: ``tool_mask``), counted as ``policy_lag_dropped_fraction``."""
        inputs = step.inputs
        versions = inputs.get("rollout_policy_version")
        if versions is None:
            return
        step_now = trainer.state.global_step
        mask = trl_compat.loss_mask(inputs)
        step.inputs, keep = drop_stale_rows(inputs, mask, step_now, self.bound)
        trainer.rollout_corr_metrics.add_policy_lag_rows(trainer.metrics_mode, policy_lag(versions, step_now),
                                                         mask.sum(dim=1), keep)
