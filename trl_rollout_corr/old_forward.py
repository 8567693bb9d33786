"""When pi_old can be read from the first loss forward instead of its own forward (``rollout_corr_old_forward``).

pi_old is the policy that scores a generation batch before any update trained on it. The trainer computes it with one
no-grad forward per generation batch (decoupled mode; the no-correction diagnostics when TRL has none). When the
batch's first loss forward runs on the same weights, over the same rows, with the same forward numerics, its
log-probs ARE pi_old (detached), and that extra forward can be left out ("the elision"): about a third of a CPU
step's forward work at SmolLM2 scale. This module holds the rule alone (no trainer, no TRL objects), so it is tested
on its own; the modes apply it (``OldForwardPlan``).

The rule, for ``rollout_corr_old_forward="auto"`` (every condition is needed for the loss forward to be pi_old):

* ``steps_per_generation == 1``: the generation batch is one micro-batch, trained by one loss forward before any
  optimizer step. With several micro-batches no single forward scores all of its rows, and the correction (RS
  baseline, ``num_items_in_batch``, the exact metrics) needs them all at once.
* no dropout in the policy: a training forward with dropout is a random draw, not pi_old's.
* not ``policy_lag_split``: it computes pi_train@v next to pi_old at generation time (kept as it is; with it the
  forward stays).
* not with ``use_liger_kernel``: TRL 1.16 then swaps in Liger's layer kernels (its fused loss is refused), and the
  elision is untested with them (liger-kernel is not installed here).
* training only: evaluation batches keep their own forward (their loss runs without gradients, outside the rule).

Served with the elision, exactly: ``num_iterations > 1`` (the first iteration's loss forward is pi_old; pi_old and
the correction are stored in the buffered batch that TRL trains again, and TRL's own pi_old forward, which its rule
runs then, is replaced), sampling-support matching (the loss forward scores over the engine's support; its support
statistics and missed tokens are what pi_old's forward measured), routing replay (the loss forward replays the routes
and measures their mismatch, as pi_old's did), ``max_policy_lag`` (the rows over the bound at generation leave the
correction and the baseline as before), rollout records (they read the correction's outputs after the loss),
gradient checkpointing (the forward values do not change), bf16 / fp16 (both forwards run under the same
``accelerator.autocast()``), ZeRO and DDP (every rank takes the same path; the correction's collectives run in the
loss on all ranks). Bypass mode has no pi_old forward (pi_old := mu): nothing to elide.

Numerics: the loss forward sees the rows in TRL's shuffled order and, with several row chunks, in one chunk, so
pi_old (and every ``rollout_corr/*`` metric built from it) may differ from the extra forward's in the last float bits
(1e-7 relative); the update ratio pi_theta / pi_old is then exactly 1 at the first iteration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

OLD_FORWARD_SETTINGS = ("auto", "always")
# batch key: (B,) int64 the generation row of each row, for a batch whose correction runs in TRL's shuffled order
GENERATION_ROW = "rollout_generation_row"
# config fields of a model whose positive value means dropout in a training forward
_DROPOUT_FIELDS = ("dropout", "pdrop", "drop_rate", "drop_prob")


@dataclass(frozen=True)
class OldForwardPlan:
    """The trainer's decision for pi_old, taken once at start-up.

    Attributes:
        setting: ``rollout_corr_old_forward`` (``"auto"`` or ``"always"``).
        mode: ``"decoupled"`` or ``"diagnostics"`` (the modes that have a pi_old forward).
        from_loss: True: pi_old is the first loss forward's log-probs (detached) in training; False: its own forward.
        reasons: why the forward stays (empty when ``from_loss``), each naming its setting.
        replaces_trl_old_forward: TRL's own pi_old forward (its rule runs one with ``num_iterations > 1``) is
            replaced by the loss forward (decoupled only; the diagnostics never change what TRL computes).
    """

    setting: str
    mode: str
    from_loss: bool
    reasons: tuple = ()
    replaces_trl_old_forward: bool = False

    def describe(self) -> str:
        """The one start-up line."""
        if self.from_loss:
            return (f"pi_old ({self.mode}): read from the first loss forward of each generation batch, no extra "
                    f"forward (rollout_corr_old_forward={self.setting!r}; evaluation batches keep their own).")
        return (f"pi_old ({self.mode}): one extra no-grad forward per generation batch "
                f"(rollout_corr_old_forward={self.setting!r}): {'; '.join(self.reasons)}.")


def dropout_settings(model: Optional[torch.nn.Module]) -> list[str]:
    """The dropout a training forward of ``model`` would apply, as ``"name=value"`` strings (empty: none).

    Looks at every ``torch.nn.Dropout*`` module with ``p > 0`` and at the positive float fields of the model's config
    (and its text config) whose name mentions dropout (``attention_dropout``, ``resid_pdrop``, ...: attention
    dropout is applied functionally, with no module).
    """
    if model is None:
        return []
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or type(module).__name__}.p={module.p:g}")
    configs = []
    config = getattr(model, "config", None)
    if config is not None:
        configs.append(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
        if text is not None and text is not config:
            configs.append(text)
    for cfg in configs:
        for key, value in sorted(vars(cfg).items()):
            if any(k in key for k in _DROPOUT_FIELDS) and isinstance(value, float) and value > 0:
                found.append(f"config.{key}={value:g}")
    return found


def plan_old_forward(
    *,
    setting: str,
    mode: str,
    steps_per_generation: int,
    num_iterations: int,
    trl_computes_old: bool,
    policy_lag_split: bool = False,
    use_liger_kernel: bool = False,
    model: Optional[torch.nn.Module] = None,
) -> OldForwardPlan:
    """Decide whether pi_old is read from the first loss forward (module docstring: the rule).

    Args:
        setting: ``rollout_corr_old_forward``: ``"auto"`` (the rule) or ``"always"`` (keep the forward).
        mode: the correction mode: ``"decoupled"`` or ``"diagnostics"``.
        steps_per_generation, num_iterations: ``GRPOConfig``'s.
        trl_computes_old: TRL 1.16's own pi_old rule (``trl_compat.trl_computes_old_log_probs``) for this trainer.
            Decoupled: that forward is replaced when the elision applies. Diagnostics: TRL's pi_old is used as it is
            and there is no forward of ours to elide.
        policy_lag_split, use_liger_kernel: the config's.
        model: the policy (for its dropout), or None.

    Returns:
        The ``OldForwardPlan``.

    Raises:
        ValueError: an unknown ``setting`` or ``mode`` (naming the accepted values).
    """
    if setting not in OLD_FORWARD_SETTINGS:
        raise ValueError(f"rollout_corr_old_forward must be one of {OLD_FORWARD_SETTINGS}, got {setting!r}.")
    if mode not in ("decoupled", "diagnostics"):
        raise ValueError(f"plan_old_forward: mode must be 'decoupled' or 'diagnostics' (bypass has no pi_old "
                         f"forward), got {mode!r}.")
    reasons = []
    if setting == "always":
        reasons.append("rollout_corr_old_forward='always'")
    if mode == "diagnostics" and trl_computes_old:
        reasons.append("TRL computes pi_old itself here (its own forward, which the diagnostics read)")
    if steps_per_generation != 1:
        reasons.append(f"steps_per_generation={steps_per_generation}: the generation batch is trained in "
                       f"{steps_per_generation} micro-batches, and no single loss forward scores all of its rows")
    dropout = dropout_settings(model)
    if dropout:
        reasons.append(f"the model has dropout ({', '.join(dropout[:3])}{', ...' if len(dropout) > 3 else ''}): "
                       "a training forward is a random draw, not pi_old")
    if policy_lag_split:
        reasons.append("policy_lag_split scores pi_train@v next to pi_old when the batch is generated")
    if use_liger_kernel:
        reasons.append("use_liger_kernel: TRL 1.16 swaps in Liger's layer kernels, and the elision is untested with "
                       "them (liger-kernel is not installed here), so the forward is kept")
    from_loss = not reasons
    # with steps_per_generation == 1 TRL's rule runs its forward only for num_iterations > 1 (vLLM IS is off with a
    # correction): the first iteration's loss forward replaces it
    return OldForwardPlan(setting=setting, mode=mode, from_loss=from_loss, reasons=tuple(reasons),
                          replaces_trl_old_forward=from_loss and mode == "decoupled" and trl_computes_old)


def plan_for_trainer(trainer: Any, mode: str) -> OldForwardPlan:
    """``plan_old_forward`` with a ``RolloutCorrGRPOTrainer``'s own settings (its args, TRL's rule, its policy)."""
    from . import trl_compat

    args = trainer.args
    trl_old = trl_compat.trl_computes_old_log_probs(
        gradient_accumulation_steps=args.gradient_accumulation_steps, steps_per_generation=args.steps_per_generation,
        num_iterations=trainer.num_iterations, use_vllm=trainer.use_vllm,
        vllm_importance_sampling_correction=trainer.vllm_importance_sampling_correction,
    )
    return plan_old_forward(
        setting=args.rollout_corr_old_forward, mode=mode, steps_per_generation=args.steps_per_generation,
        num_iterations=trainer.num_iterations, trl_computes_old=trl_old,
        policy_lag_split=bool(getattr(args, "policy_lag_split", False)),
        use_liger_kernel=bool(getattr(args, "use_liger_kernel", False)),
        model=trainer.accelerator.unwrap_model(trainer.model),
    )


def log_plan(plan: OldForwardPlan) -> None:
    """The plan's one start-up line: info when pi_old is read from the loss or ``"always"`` was asked for, a warning
    when a setting keeps the extra forward."""
    quiet = plan.from_loss or plan.reasons == ("rollout_corr_old_forward='always'",)
    (logger.info if quiet else logger.warning)("RolloutCorrGRPOTrainer: %s", plan.describe())


def to_generation_order(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(B, ...) ``t`` in TRL's shuffled row order -> generation order (``rows[i]``: the generation row of row i)."""
    out = torch.empty_like(t)
    out[rows] = t
    return out


def reused_forward(reuse: tuple, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int) -> tuple:
    """The result of a policy forward a mode ran itself (``hooks.LossStep.reuse``: ``(input_ids, attention_mask,
    logits_to_keep, result)``), for TRL's own loss call over the same rows ((B, P + T) ids and mask).

    Raises:
        RuntimeError: TRL's call is over other rows (a TRL change the pins missed): the reuse would be wrong.
    """
    ids, mask, keep, result = reuse
    if not (torch.is_grad_enabled() and logits_to_keep == keep and torch.equal(input_ids, ids)
            and torch.equal(attention_mask, mask)):
        raise RuntimeError("TRL's loss forward is not over the rows whose forward gave pi_old "
                           "(rollout_corr_old_forward='auto'); set rollout_corr_old_forward='always' and report this.")
    return result
