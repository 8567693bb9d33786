"""``RolloutCorrGRPOTrainer``: TRL's GRPO with rollout correction (decoupled or bypass mode).

A drop-in ``GRPOTrainer`` subclass: change the import and the config class, add a few fields::

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer
    args = RolloutCorrGRPOConfig(..., rollout_corr_preset="decoupled_k3_rs_token_tis")
    trainer = RolloutCorrGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...)

Four policies are kept apart (spec section 1): mu (``rollout_log_probs``, from the rollout engine: vLLM
processed log-probs, or the processed scores of ``transformers.generate``), pi_old (``old_log_probs``, one
trainer forward per generation batch, decoupled mode only), pi_theta (the loss forward) and pi_ref (TRL's
``beta`` KL anchor, never used for the correction).

* Decoupled mode: right after generation, IS weights and the RS mask are computed once from
  ``log pi_old - log mu``; rows that RS rejects entirely get advantage 0 and leave their group's mean/std
  (``rs_keep_rejected_in_baseline=True`` keeps them in, as verl does); the loss is TRL's own PPO-clip loss (any
  of grpo, bnpo, dr_grpo, dapo, ...) with the RS mask as loss mask and normaliser and the IS weights multiplying
  the clipped per-token loss.
* Bypass mode: no pi_old forward; in every micro-batch the correction is computed from the current pi_theta
  (detached) against mu and the loss is PPO-clip on pi_theta / mu or REINFORCE ``-A w log pi_theta``
  (``trl_rollout_corr.losses.bypass_policy_loss``), aggregated as TRL's ``loss_type`` does. The RS mask is the
  loss mask and normaliser (dapo: the pre-RS token count, as verl's engine workers); the advantages were computed
  at generation time, before pi_theta exists, so rows rejected here stay in their group's baseline (as in verl).
* Metrics: ``rollout_corr/*`` are exact over everything trained on since the previous log call, on all ranks:
  the reducible statistics are merged across generation batches / micro-batches, summed (max/min) across ranks
  once at log time and finalised once; they are written straight into the log record (never averaged again).
  Decoupled mode records them once per generation batch (at the step that generated it); bypass mode once per
  micro-batch. Also logged: ``rollout_corr/{engine,update,direct}_ratio_{mean,p01,p50,p99,max}`` (ratios
  pi_old/mu, pi_theta/pi_old, pi_theta/mu over the trained tokens, exact order statistics over all ranks; bypass:
  ``direct`` only) and ``rollout_corr/policy_lag_{mean,max}`` (optimizer steps between generation and use).
  In evaluation the keys carry TRL's ``eval_`` prefix.

All knowledge of TRL 1.16 internals is in the block marked "TRL 1.16 coupling" below; the tests
``tests/test_trainer.py::test_trl_coupling_*`` fail loudly if the pinned TRL changes under it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd

from .config import PRESETS, RolloutCorrectionConfig
from .correction import compiled_rollout_correction, compute_rollout_correction, ratio_decomposition
from .engines.transformers_generate import capture_generate_log_probs
from .losses import PPOClip, bypass_policy_loss
from .metrics import CorrectionStats

logger = logging.getLogger(__name__)

# Fields of RolloutCorrectionConfig that the trainer config exposes flat (same names, same meaning).
CORRECTION_FIELDS = (
    "rollout_is",
    "rollout_is_threshold",
    "rollout_is_batch_normalize",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "bypass_loss_type",
)
# TRL loss types whose per-token loss is positively homogeneous in the advantage (W * loss(A) == loss(W * A) for
# W >= 0), so decoupled IS weights can be applied through the advantages without re-implementing TRL's loss.
DECOUPLED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo")
# Multimodal batch keys that TRL 1.16 forwards to _get_per_token_logps_and_entropies (as keyword arguments).
MULTIMODAL_FORWARD_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)
# Quantiles logged for the ratio decomposition (rollout_corr/{engine,update,direct}_ratio_p01/p50/p99).
RATIO_QUANTILES = (("p01", 0.01), ("p50", 0.5), ("p99", 0.99))
# TRL loss types whose aggregation the bypass loss reproduces.
BYPASS_LOSS_AGGREGATIONS = ("grpo", "bnpo", "dr_grpo", "dapo")


def _threshold_to_field(value: Any) -> Any:
    """A threshold spec as stored in the flat config: numbers and ``"L_U"`` strings as strings, None kept.

    A (L, U) pair (e.g. from the ``direct_double_sided`` preset) becomes ``"L_U"`` so that the value survives
    JSON, YAML and the command line unchanged.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"{float(value[0])!r}_{float(value[1])!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return value  # let RolloutCorrectionConfig raise its own TypeError


def _eager_correction(log_probs, rollout_log_probs, response_mask, all_reduce=None, *, config):
    """``compute_rollout_correction`` with the signature of ``compiled_rollout_correction``'s function."""
    return compute_rollout_correction(log_probs, rollout_log_probs, response_mask, config, all_reduce=all_reduce)


@dataclass
class RolloutCorrGRPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus rollout correction. Every field of ``RolloutCorrectionConfig`` is here, flat, so it
    works as a ``TrlParser``/``HfArgumentParser`` flag (``--rollout_is token``) and as a YAML key.

    Parameters:
        rollout_corr_preset (`str`, *optional*):
            Name of a ``RolloutCorrectionConfig`` preset (``decoupled_token_is``, ``decoupled_k3_rs_token_tis``,
            ``bypass_ppo_clip``, ``bypass_pg_is``, ``direct_double_sided``, ...). Explicitly set correction
            fields override the preset's values. After construction the flat fields hold the effective values.
        rollout_is (`str`, *optional*):
            IS weight level: ``token``, ``sequence`` or unset (no IS weights).
        rollout_is_threshold (`str`, *optional*):
            ``U`` (truncated IS: ``min(R, U)``) or ``"L_U"`` (IcePop band: 0 outside). Ratio units. Default 2.0.
        rollout_is_batch_normalize (`bool`, *optional*):
            Divide the IS weights by their mean over the global batch. Default False.
        rollout_rs (`str`, *optional*):
            Comma list of rejection options (``token_k1`` ... ``seq_max_k3``).
        rollout_rs_threshold (`str`, *optional*):
            One spec for all RS options or one per option (k1: ratio band ``"L_U"``; k2/k3: upper bound).
        bypass_mode (`bool`, *optional*):
            False: decoupled (keep pi_old, one extra forward per generation batch). True: bypass (pi_old := mu).
        bypass_loss_type (`str`, *optional*):
            Bypass loss: ``ppo_clip`` (PPO clip on pi_theta / mu, IS for metrics only) or ``reinforce``
            (``-A * w * log pi_theta``). Default ``ppo_clip``.
        rs_keep_rejected_in_baseline (`bool`, defaults to `False`):
            Decoupled mode: keep rows that RS rejects entirely in their group's reward mean/std (verl's
            behaviour). Default False: they leave the baseline. Their own advantage is 0 either way.
        rollout_corr_compile (`bool`, defaults to `False`):
            Run the correction math through ``torch.compile`` (``correction.compiled_rollout_correction``): same
            values, faster on large batches; the first step pays the compile. Used in both modes.
        vllm_importance_sampling_correction (`bool`, *optional*):
            TRL's own vLLM IS correction. Unset: off when this config's correction is enabled (IS, RS or bypass),
            TRL's default (on) otherwise. Setting it True together with an enabled correction is an error
            (the two would both apply).

    Raises:
        ValueError / TypeError: at construction, for an invalid correction field, an unknown preset, or an
            incompatible combination (the message names the options involved).
    """

    rollout_corr_preset: Optional[str] = field(
        default=None,
        metadata={
            "help": f"Rollout-correction preset, one of: {', '.join(PRESETS)}. Explicit rollout_* / bypass_* fields "
            "override it."
        },
    )
    rollout_is: Optional[str] = field(
        default=None,
        metadata={"help": "IS weight level: 'token', 'sequence', or unset for no IS weights ('none' turns off a preset's IS)."},
    )
    rollout_is_threshold: Optional[str] = field(
        default=None,
        metadata={"help": "IS threshold: U (truncated IS, min(R, U)) or 'L_U' (IcePop band). Default 2.0."},
    )
    rollout_is_batch_normalize: Optional[bool] = field(
        default=None,
        metadata={"help": "Divide IS weights by their global-batch mean (after truncation). Default False."},
    )
    rollout_rs: Optional[str] = field(
        default=None,
        metadata={"help": "Comma list of rejection options: token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3 "
                  "('none' turns off a preset's RS)."},
    )
    rollout_rs_threshold: Optional[str] = field(
        default=None,
        metadata={"help": "RS threshold(s): one spec for all options or one per option (k1: 'L_U'; k2/k3: upper bound)."},
    )
    bypass_mode: Optional[bool] = field(
        default=None,
        metadata={"help": "Bypass mode: pi_old := mu, no extra forward; correction inside the loss. Default False."},
    )
    bypass_loss_type: Optional[str] = field(
        default=None,
        metadata={"help": "Bypass loss: 'ppo_clip' or 'reinforce'. Default 'ppo_clip'."},
    )
    rs_keep_rejected_in_baseline: bool = field(
        default=False,
        metadata={"help": "Keep fully RS-rejected rows in their GRPO group's mean/std (verl). Default: excluded."},
    )
    rollout_corr_compile: bool = field(
        default=False,
        metadata={
            "help": "torch.compile the correction math (same values, several times faster on large batches); the "
            "first step pays the compile (tens of seconds on CPU)."
        },
    )
    vllm_importance_sampling_correction: Optional[bool] = field(
        default=None,
        metadata={
            "help": "TRL's own vLLM IS correction. Unset: off when rollout correction is enabled, else TRL's default "
            "(on). True together with an enabled rollout correction is an error."
        },
    )

    def __post_init__(self):
        correction = self._resolve_rollout_correction()
        if self.vllm_importance_sampling_correction is None:
            self.vllm_importance_sampling_correction = not correction.enabled
            if correction.enabled and self.use_vllm:
                logger.warning(
                    "Rollout correction is enabled, so TRL's own vLLM importance-sampling correction "
                    "(vllm_importance_sampling_correction) is switched off: the mismatch is corrected once, by "
                    "trl_rollout_corr."
                )
        elif self.vllm_importance_sampling_correction and correction.enabled:
            raise ValueError(
                "vllm_importance_sampling_correction=True and rollout correction (rollout_is / rollout_rs / "
                "bypass_mode) are both enabled: the mismatch would be corrected twice. Unset "
                "vllm_importance_sampling_correction (it is then switched off) or disable the rollout correction."
            )
        super().__post_init__()
        self._check_compatibility(correction)

    # ------------------------------------------------------------------ helpers
    def _resolve_rollout_correction(self) -> RolloutCorrectionConfig:
        """Merge the preset and the explicit fields, validate, and store the effective values in the fields."""
        if self.rollout_corr_preset is not None:
            base = RolloutCorrectionConfig.from_preset(self.rollout_corr_preset).to_dict()
        else:
            base = RolloutCorrectionConfig().to_dict()
        for name in CORRECTION_FIELDS:
            value = getattr(self, name)
            if value is not None:
                base[name] = value
        if base.get("rollout_is_threshold") is not None and isinstance(base["rollout_is_threshold"], str):
            base["rollout_is_threshold"] = base["rollout_is_threshold"].strip()
        correction = RolloutCorrectionConfig(**base)
        effective = correction.to_dict()
        for name in CORRECTION_FIELDS:
            value = effective[name]
            if name in ("rollout_is_threshold", "rollout_rs_threshold"):
                value = _threshold_to_field(value)
            if value is None and name in ("rollout_is", "rollout_rs") and self.rollout_corr_preset is not None:
                # Keep "switched off" explicit: a None would let the preset win again when the fields are re-parsed
                # (to_dict -> YAML -> TrlParser, checkpoints).
                value = "none"
            setattr(self, name, value)
        return correction

    def rollout_correction(self) -> RolloutCorrectionConfig:
        """The validated ``RolloutCorrectionConfig`` these fields describe (a new object each call)."""
        return RolloutCorrectionConfig(**{name: getattr(self, name) for name in CORRECTION_FIELDS})

    def _check_compatibility(self, correction: RolloutCorrectionConfig) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"RolloutCorrGRPOConfig: {msg}")

        if self.use_transformers_continuous_batching:
            fail(
                "use_transformers_continuous_batching=True returns no behaviour log-probs, so rollout correction "
                "cannot run; use the plain transformers.generate path (use_transformers_continuous_batching=False) "
                "or vLLM."
            )
        if self.loss_type == "vespo":
            fail("loss_type='vespo' applies its own importance weighting; it cannot be combined with rollout correction.")
        if not correction.bypass_mode:
            if self.loss_type not in DECOUPLED_LOSS_TYPES:
                fail(f"decoupled mode supports loss_type in {DECOUPLED_LOSS_TYPES}, got {self.loss_type!r}.")
            return
        # Bypass mode: our own loss replaces TRL's, so only what it reproduces is allowed.
        if self.rs_keep_rejected_in_baseline:
            logger.warning(
                "rs_keep_rejected_in_baseline has no effect in bypass mode: RS runs in the loss, after the advantages, "
                "so rejected rows always stay in their group's baseline."
            )
        if self.loss_type not in BYPASS_LOSS_AGGREGATIONS:
            fail(f"bypass_mode=True supports loss_type in {BYPASS_LOSS_AGGREGATIONS}, got {self.loss_type!r}.")
        unsupported = {
            "importance_sampling_level": (self.importance_sampling_level != "token", "'token'"),
            "top_entropy_quantile": (self.top_entropy_quantile < 1.0, "1.0"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, "None"),
            "entropy_coef": (self.entropy_coef != 0.0, "0.0"),
            "use_adaptive_entropy": (bool(self.use_adaptive_entropy), "False"),
            "delta": (self.delta is not None, "None"),
        }
        for name, (bad, needed) in unsupported.items():
            if bad:
                fail(f"bypass_mode=True replaces TRL's loss and does not support {name}={getattr(self, name)!r}; set {name}={needed}.")


class RolloutCorrGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with rollout correction; see the module docstring.

    Args: as ``GRPOTrainer``; ``args`` must be a ``RolloutCorrGRPOConfig``.

    Attributes:
        rollout_correction: the ``RolloutCorrectionConfig`` in use.
        rollout_corr_forward_counts: ``{"old_log_probs": n}``, the pi_old forwards this trainer ran itself (for
            tests and benchmarks).

    Raises:
        TypeError: if ``args`` is not a ``RolloutCorrGRPOConfig``.
        ValueError: when no behaviour log-probs can be obtained (at the first generation, naming the fix), when
            a row's behaviour log-probs do not match its completion length (naming the row).
    """

    def __init__(self, *args, **kwargs):
        train_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(train_args, RolloutCorrGRPOConfig):
            raise TypeError(
                "RolloutCorrGRPOTrainer needs args=RolloutCorrGRPOConfig(...) (a GRPOConfig subclass with the "
                f"rollout-correction fields), got {type(train_args).__name__}."
            )
        super().__init__(*args, **kwargs)
        self.rollout_correction: RolloutCorrectionConfig = self.args.rollout_correction()
        if self.args.rollout_corr_compile:
            self._rc_correction_fn = compiled_rollout_correction(self.rollout_correction)
        else:
            self._rc_correction_fn = functools.partial(_eager_correction, config=self.rollout_correction)
        self._rc_stats: dict[str, Optional[CorrectionStats]] = {"train": None, "eval": None}
        self._rc_lag: dict[str, list] = {"train": [0, 0, 0], "eval": [0, 0, 0]}  # sum, micro-batches, max
        # valid per-token log ratios of the trained tokens, per mode and ratio name, until the next log call
        self._rc_ratios: dict[str, dict[str, list]] = {"train": {}, "eval": {}}
        self._rc_capture_log_probs = False
        self._rc_captured_log_probs: Optional[torch.Tensor] = None
        self._rc_rewards: Optional[torch.Tensor] = None
        self._rc_skip_trl_old_forward = False
        self.rollout_corr_forward_counts = {"old_log_probs": 0}
        if self.use_vllm and self.args.vllm_mode == "server" and self.accelerator.is_main_process:
            mode = self.vllm_generation.vllm_client.get_server_info()["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs":
                raise ValueError(
                    f"The vLLM server runs with --logprobs-mode {mode}; rollout correction needs the log-probs of the "
                    "distribution that sampled (after temperature/top-p/top-k). Restart it with "
                    "--logprobs-mode processed_logprobs."
                )

    # ================================================================== TRL 1.16 coupling (begin)
    # Everything below up to "TRL 1.16 coupling (end)" relies on trl==1.16 internals (method names, signatures,
    # dict keys, and the order of calls inside _generate_and_score_completions). Pinned by the
    # test_trl_coupling_* tests.

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation, plus behaviour log-probs on the ``transformers.generate`` path.

        vLLM (colocate/server) and ``rollout_func`` already return the sampled tokens' processed log-probs.
        On the plain ``generate`` path TRL returns none: ``generate`` is shadowed for this call so that it also
        records the processed scores (see ``engines.transformers_generate``). Returns ``(completion_ids,
        logprobs)`` with ``logprobs[i]`` a list of floats as long as ``completion_ids[i]``.
        """
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        unwrapped = self.accelerator.unwrap_model(self.model)
        with capture_generate_log_probs(unwrapped) as capture:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        return completion_ids, capture.completion_log_probs(completion_ids)

    def _generate(self, prompts: list):
        """TRL's ``_generate``; checks that every row has one behaviour log-prob per completion token."""
        result = super()._generate(prompts)
        completion_ids, logprobs = result[1], result[4]
        if logprobs is None:
            raise ValueError(
                "Rollout correction is on but the generation path returned no behaviour log-probs (mu). Use vLLM "
                "(use_vllm=True, which requests processed log-probs), the plain transformers.generate path, or a "
                "rollout_func that returns 'logprobs'."
            )
        if len(logprobs) != len(completion_ids):
            raise ValueError(f"{len(logprobs)} rows of behaviour log-probs for {len(completion_ids)} completions.")
        for row, (ids, lps) in enumerate(zip(completion_ids, logprobs)):
            if len(lps) != len(ids):
                raise ValueError(
                    f"Row {row}: {len(lps)} behaviour log-probs for a completion of {len(ids)} tokens; the rollout "
                    "engine's log-probs must align token for token with completion_ids."
                )
        return result

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards; keeps the gathered ``(B_global, n_funcs)`` tensor for the RS-aware advantage."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rc_rewards = rewards_per_func
        return rewards_per_func

    def _trl_computes_old_log_probs(self) -> bool:
        """Whether ``GRPOTrainer._generate_and_score_completions`` runs its own pi_old forward (trl 1.16 rule)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        """TRL's log-prob forward. In bypass mode, TRL's own pi_old forward (the first no-grad call on the policy
        inside ``_generate_and_score_completions``) is skipped: bypass uses mu as pi_old."""
        if self._rc_skip_trl_old_forward and model is self.model and not torch.is_grad_enabled():
            self._rc_skip_trl_old_forward = False
            placeholder = torch.full((input_ids.size(0), logits_to_keep), float("nan"), device=input_ids.device)
            return placeholder, None, None
        result = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if self._rc_capture_log_probs:  # the loss forward inside GRPOTrainer._compute_loss (decoupled mode)
            self._rc_captured_log_probs = result[0].detach()
            self._rc_capture_log_probs = False
        return result

    def _generate_and_score_completions(self, inputs):
        """TRL's generation and scoring, then the rollout correction (decoupled) or its inputs (bypass).

        Adds to the returned dict (all ``(B, T)`` per local row, aligned with ``completion_ids``):
        ``rollout_log_probs`` (mu), and in decoupled mode ``old_per_token_logps`` (pi_old),
        ``rollout_rs_mask`` (RS + invalid tokens removed) and ``rollout_is_weights`` (when IS is on); rewrites
        ``advantages`` (RS-rejected rows) and ``num_items_in_batch`` (kept tokens, global).
        """
        cfg = self.rollout_correction
        mode = "train" if self.model.training else "eval"
        self._rc_rewards = None
        self._rc_skip_trl_old_forward = cfg.bypass_mode and self._trl_computes_old_log_probs()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._rc_skip_trl_old_forward = False

        rollout_log_probs = output.get("sampling_per_token_logps")
        if rollout_log_probs is None:
            raise ValueError(
                "Rollout correction is on but no behaviour log-probs (mu) reached the batch; use vLLM or the plain "
                "transformers.generate path."
            )
        output["rollout_log_probs"] = rollout_log_probs
        # 0-d tensor: TRL's shuffle/split pass it to every micro-batch unchanged
        output["rollout_generation_step"] = torch.tensor(self.state.global_step)
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]

        if cfg.bypass_mode:
            output.pop("old_per_token_logps", None)  # bypass: pi_old := mu, handled in the loss
            return output

        old_log_probs = output.get("old_per_token_logps")
        if old_log_probs is None:
            old_log_probs = self._rc_old_log_probs(output)
            output["old_per_token_logps"] = old_log_probs
        correction = self._rc_correction_fn(old_log_probs, rollout_log_probs, mask, all_reduce=self._rc_all_reduce_sum())
        self._rc_add_stats(mode, correction.stats)
        new_mask = correction.response_mask
        output["rollout_rs_mask"] = new_mask
        if correction.weights is not None:
            output["rollout_is_weights"] = correction.weights
        output["num_items_in_batch"] = self.accelerator.gather(new_mask.sum()).sum()
        rejected = (mask.sum(dim=1) > 0) & (new_mask.sum(dim=1) == 0)
        output["advantages"] = self._rc_advantages(output["advantages"], rejected, mode)
        return output

    def _rc_old_log_probs(self, output: dict) -> torch.Tensor:
        """pi_old: one no-grad forward of the policy over the local generation batch. Returns (B, T) float32."""
        from trl.trainer.grpo_trainer import disable_gradient_checkpointing

        mode = "train" if self.model.training else "eval"
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        extra = {k: output[k] for k in MULTIMODAL_FORWARD_KEYS if k in output}
        self.rollout_corr_forward_counts["old_log_probs"] += 1
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            old, _, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, output["completion_ids"].size(1), batch_size=batch_size, **extra
            )
        return old.float()

    def _rc_advantages(self, advantages: torch.Tensor, rejected_local: torch.Tensor, mode: str) -> torch.Tensor:
        """Advantages with RS-rejected rows at 0 and (by default) out of their group's mean/std.

        Args:
            advantages: (B_local,) TRL's advantages for this rank's rows.
            rejected_local: (B_local,) bool, rows with valid tokens that RS rejected entirely.

        Returns:
            (B_local,) advantages. Unchanged when no row on any rank is rejected. Otherwise recomputed from the
            gathered rewards with TRL's formula, the rejected rows' rewards set to NaN (TRL's rule for rows
            without signal: excluded from nanmean/nanstd, advantage 0); with ``rs_keep_rejected_in_baseline``
            only the rejected rows' advantages are set to 0.
        """
        rejected = self.accelerator.gather(rejected_local)
        if not bool(rejected.any()):
            return advantages
        if self.args.rs_keep_rejected_in_baseline or self._rc_rewards is None:
            return torch.where(rejected_local, torch.zeros_like(advantages), advantages)
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        all_advantages = self._rc_group_advantages(self._rc_rewards, rejected, num_generations)
        start = self.accelerator.process_index * advantages.size(0)
        new_local = all_advantages[start : start + advantages.size(0)].to(advantages.dtype)
        # Keep the completions table (TRL's _logs) consistent with what is trained on.
        logged = self._logs["advantages"]
        for _ in range(min(len(logged), all_advantages.numel())):
            logged.pop()
        logged.extend(all_advantages.tolist())
        return new_local

    def _rc_group_advantages(self, rewards_per_func: torch.Tensor, excluded: torch.Tensor, num_generations: int) -> torch.Tensor:
        """TRL 1.16's advantage formula with ``excluded`` rows removed from the statistics.

        Args:
            rewards_per_func: (B_global, F) gathered rewards (NaN where a function gave None).
            excluded: (B_global,) bool rows to exclude (their advantage is 0).

        Returns:
            (B_global,) advantages; equals TRL's when ``excluded`` is all False (tested).
        """
        device = rewards_per_func.device
        rewards_per_func = rewards_per_func.clone()
        rewards_per_func[excluded.to(device)] = float("nan")
        weights = self.reward_weights.to(device).unsqueeze(0)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        if self.multi_objective_aggregation == "sum_then_normalize":
            rewards = (rewards_per_func * weights).nansum(dim=1)
            rewards[unscorable] = float("nan")
            grouped = rewards.view(-1, num_generations)
            mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
            advantages = rewards - mean
            if self.scale_rewards == "group":
                std = nanstd(grouped, dim=1).repeat_interleave(num_generations) if num_generations > 1 else torch.zeros_like(rewards)
                advantages = advantages / (std + 1e-4)
            elif self.scale_rewards == "batch":
                std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
                advantages = advantages / (std + 1e-4)
            elif self.scale_rewards != "none":
                raise ValueError(f"Unsupported scale_rewards={self.scale_rewards!r}.")
        elif self.multi_objective_aggregation == "normalize_then_sum":
            grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.size(1))
            mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
            std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
            reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.size(1))
            rewards = (reward_k * weights).nansum(dim=1)
            rewards[unscorable] = float("nan")
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
            advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
        else:
            raise ValueError(f"Unsupported multi_objective_aggregation={self.multi_objective_aggregation!r}.")
        advantages = torch.nan_to_num(advantages, nan=0.0)
        advantages[excluded.to(device)] = 0.0
        return advantages

    def _compute_loss(self, model, inputs):
        """Decoupled: TRL's loss with the RS mask as loss mask/normaliser and IS weights after the clip.
        Bypass: ``_rc_bypass_loss``."""
        self._rc_record_policy_lag(inputs)
        if self.rollout_correction.bypass_mode:
            return self._rc_bypass_loss(model, inputs)
        inputs = dict(inputs)
        # tool_mask only enters TRL's loss mask (completion_mask also builds the attention mask, so RS must not
        # touch it); the RS mask already includes the original tool_mask.
        inputs["tool_mask"] = inputs["rollout_rs_mask"]
        weights = inputs.get("rollout_is_weights")
        if weights is not None:
            advantages = inputs["advantages"]
            if advantages.dim() == 1:
                advantages = advantages.unsqueeze(1)
            # -min(r A w, clip(r) A w) == w * -min(r A, clip(r) A) for w >= 0: the weight multiplies the clipped loss.
            inputs["advantages"] = advantages * weights.to(advantages.dtype)
        self._rc_capture_log_probs, self._rc_captured_log_probs = True, None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._rc_capture_log_probs = False
        if self._rc_captured_log_probs is not None:
            d = ratio_decomposition(self._rc_captured_log_probs, inputs["old_per_token_logps"],
                                    inputs["rollout_log_probs"], inputs["tool_mask"])
            self._rc_record_ratios({"engine": d.engine[d.valid], "update": d.update[d.valid], "direct": d.direct[d.valid]})
            self._rc_captured_log_probs = None
        return loss

    def _rc_bypass_loss(self, model, inputs):
        """Bypass loss for one micro-batch: correction from pi_theta (no grad) vs mu, then PPO-clip on
        pi_theta / mu or REINFORCE, aggregated like TRL's ``loss_type``, plus ``beta`` * KL to pi_ref."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs[k] for k in MULTIMODAL_FORWARD_KEYS if k in inputs},
        )
        mode = "train" if self.model.training else "eval"
        out = bypass_policy_loss(
            per_token_logps, inputs["rollout_log_probs"], inputs["advantages"], mask, self.rollout_correction,
            correction_fn=self._rc_correction_fn, clip=PPOClip(self.epsilon_low, self.epsilon_high),
            all_reduce=self._rc_all_reduce_sum(),
        )
        self._rc_add_stats(mode, out.correction.stats)
        keep = out.mask
        direct = per_token_logps.detach().float() - inputs["rollout_log_probs"].float()
        self._rc_record_ratios({"direct": direct[keep & torch.isfinite(direct)]})
        per_token_loss = out.per_token_loss
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            diff = torch.where(keep, ref - per_token_logps, 0.0)
            per_token_kl = torch.exp(diff) - diff - 1
            if self.args.use_bias_correction_kl:
                # As TRL: KL times the (differentiable) policy ratio, here pi_theta / mu (bypass: pi_old := mu).
                mu = torch.where(keep, inputs["rollout_log_probs"], per_token_logps.detach())
                per_token_kl = per_token_kl * torch.exp((per_token_logps - mu).clamp(-20.0, 20.0))
            per_token_loss = per_token_loss + self.beta * torch.where(keep, per_token_kl, 0.0)
        loss = self._rc_aggregate(per_token_loss, keep, inputs, mode)
        if self.aux_loss_enabled:  # MoE router load-balancing loss, scaled for gradient accumulation as TRL does
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss.detach()).mean().item())

        def global_masked_mean(x: torch.Tensor) -> float:
            local = torch.stack([torch.where(keep, x, 0.0).sum(), keep.sum().to(x.dtype)]).detach()
            total = self.accelerator.reduce(local, reduction="sum") if self.accelerator.num_processes > 1 else local
            return (total[0] / total[1].clamp(min=1.0)).item()

        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(global_masked_mean(per_token_kl))
        self._metrics[mode]["entropy"].append(global_masked_mean(entropies))
        if out.clipped_high is not None:
            self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(out.clipped_high.float()))
            self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(out.clipped_low.float()))
        return loss

    def _rc_aggregate(self, per_token_loss: torch.Tensor, keep: torch.Tensor, inputs: dict, mode: str) -> torch.Tensor:
        """TRL 1.16's aggregation of a (B, T) per-token loss for grpo / bnpo / dr_grpo / dapo, scaled for
        gradient accumulation as TRL does. ``keep`` (B, T) bool is the mask and normaliser."""
        masked = torch.where(keep, per_token_loss, 0.0)
        count = keep.sum(dim=-1).to(masked.dtype)
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        if self.loss_type == "grpo":
            return (masked.sum(-1) / count.clamp(min=1.0)).mean() / accumulation
        if self.loss_type == "bnpo":
            return masked.sum() / count.sum().clamp(min=1.0) / accumulation
        if self.loss_type == "dr_grpo":
            return masked.sum() / (masked.size(0) * self.max_completion_length) / accumulation
        if self.loss_type == "dapo":
            # Pre-RS global token count (as verl's engine workers): the RS mask of other micro-batches is unknown.
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
            return masked.sum() / normalizer
        raise ValueError(f"bypass mode does not support loss_type={self.loss_type!r}")

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """Adds the exact ``rollout_corr/*`` values of everything since the previous call, then TRL's ``log``.

        Runs on every rank (the Trainer calls ``log`` on all processes), so the cross-rank reduction is safe.
        """
        mode = "train" if self.model.training else "eval"
        stats = self._rc_stats.get(mode)
        if stats is not None:
            self._rc_stats[mode] = None
            reduced = stats.reduce(self._rc_reduce_sum, self._rc_reduce_max, self._rc_reduce_min)
            metrics = reduced.finalize()
            if mode == "eval":
                metrics = {f"eval_{k}": v for k, v in metrics.items()}
            logs.update(metrics)  # in place, like TRL: evaluate() returns this dict
        ratios = self._rc_ratios[mode]
        if ratios:
            self._rc_ratios[mode] = {}
            prefix = "eval_" if mode == "eval" else ""
            for name in sorted(ratios):
                for key, value in self._rc_ratio_metrics(torch.cat(ratios[name])).items():
                    logs[f"{prefix}rollout_corr/{name}_ratio_{key}"] = value
        lag_sum, lag_n, lag_max = self._rc_lag[mode]
        if lag_n:
            prefix = "eval_" if mode == "eval" else ""
            logs[f"{prefix}rollout_corr/policy_lag_mean"] = lag_sum / lag_n
            logs[f"{prefix}rollout_corr/policy_lag_max"] = float(lag_max)
            self._rc_lag[mode] = [0, 0, 0]
        super().log(logs, start_time)

    # ================================================================== TRL 1.16 coupling (end)

    # ------------------------------------------------------------------ metric plumbing
    def _rc_record_ratios(self, log_ratios: dict) -> None:
        """Keep 1-D float64 tensors of valid per-token log ratios (nats) of one micro-batch, by name
        (``engine``: log pi_old - log mu, ``update``: log pi_theta - log pi_old, ``direct``: log pi_theta - log mu)."""
        mode = "train" if self.model.training else "eval"
        store = self._rc_ratios[mode]
        for name, values in log_ratios.items():
            store.setdefault(name, []).append(values.detach().double().reshape(-1))

    def _rc_ratio_metrics(self, local_log_ratios: torch.Tensor) -> dict[str, float]:
        """Mean, p01, p50, p99 and max of the ratio ``exp(clamp(l, -20, 20))`` over every rank's tokens.

        Exact (not a mean of per-rank quantiles): the values are all-gathered (padded with NaN to the longest
        rank) and sorted once; quantiles use linear interpolation between order statistics (as
        ``torch.quantile``). 0.0 for every key when there is no token.
        """
        values = local_log_ratios
        if self.accelerator.num_processes > 1:
            count = torch.tensor([values.numel()], device=values.device)
            longest = int(self.accelerator.gather(count).max())
            padded = torch.full((longest,), float("nan"), dtype=values.dtype, device=values.device)
            padded[: values.numel()] = values
            values = self.accelerator.gather(padded)
            values = values[~torch.isnan(values)]
        if values.numel() == 0:
            return {"mean": 0.0, **{k: 0.0 for k, _ in RATIO_QUANTILES}, "max": 0.0}
        ratio = torch.exp(values.clamp(-20.0, 20.0)).sort().values
        n = ratio.numel()
        out = {"mean": ratio.mean()}
        for key, q in RATIO_QUANTILES:
            pos = q * (n - 1)
            lo = int(math.floor(pos))
            hi = min(lo + 1, n - 1)
            out[key] = ratio[lo] + (pos - lo) * (ratio[hi] - ratio[lo])
        out["max"] = ratio[-1]
        host = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in out.values()]).cpu().tolist()
        return dict(zip(out.keys(), host))

    def _rc_record_policy_lag(self, inputs: dict) -> None:
        """Policy lag of a micro-batch: optimizer steps between its generation and this update (0 = on-policy).

        Every micro-batch has the same number of rows on every rank, so the mean over micro-batches is the mean
        over rows of the global batch (no cross-rank reduction needed: all ranks hold the same steps).
        """
        step = inputs.get("rollout_generation_step")
        if step is None:
            return
        mode = "train" if self.model.training else "eval"
        lag = self.state.global_step - int(step)
        record = self._rc_lag[mode]
        record[0] += lag
        record[1] += 1
        record[2] = max(record[2], lag)

    def _rc_add_stats(self, mode: str, stats: CorrectionStats) -> None:
        current = self._rc_stats.get(mode)
        self._rc_stats[mode] = stats if current is None else current.merge(stats)

    def _rc_all_reduce_sum(self):
        """The cross-rank sum for batch normalisation, or None on one process (no collective needed)."""
        return self._rc_reduce_sum if self.accelerator.num_processes > 1 else None

    def _rc_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes <= 1:
            return t
        return self.accelerator.reduce(t, reduction="sum")

    def _rc_reduce_extreme(self, t: torch.Tensor, op) -> torch.Tensor:
        if self.accelerator.num_processes <= 1:
            return t
        t = t.clone()
        torch.distributed.all_reduce(t, op=op)
        return t

    def _rc_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._rc_reduce_extreme(t, torch.distributed.ReduceOp.MAX)

    def _rc_reduce_min(self, t: torch.Tensor) -> torch.Tensor:
        return self._rc_reduce_extreme(t, torch.distributed.ReduceOp.MIN)
