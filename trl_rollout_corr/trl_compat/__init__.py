"""The one place coupled to TRL's, transformers', accelerate's and vLLM's internals: the TRL 1.16 formulas and
conventions that ``RolloutCorrGRPOTrainer`` must mirror, as pure functions, and the few hooks it sets in them.

TRL has no hook for "advantages without these rows", "the loss of an objective TRL does not have" or "skip the
pi_old forward", so the trainer reproduces a few of TRL's formulas. They all live in this package, split by
concern, so a TRL upgrade means reading its modules and their pins (``tests/trainer/test_trl_compat.py``,
``tests/e2e/test_trl_vllm_colocate.py``, ``tests/features/test_async_pipeline.py``), which check TRL's source text and
signatures for every assumption and fail loudly when the pinned TRL changes. Each module's header maps its names to the
TRL 1.16 lines they mirror (``trl/trainer/grpo_trainer.py`` of trl 1.16.0, line numbers of that release).

====================  ==========================================================================================
module                what it holds
====================  ==========================================================================================
``advantages``        TRL's advantage formula without the rows RS rejected, its completions-table column
                      (``_logs["advantages"]``), the lone-survivor rule, TRL's pi_old rule
``loss``              the loss mask and forward inputs, decoupled mode's RS mask / IS weights injected into TRL's
                      own loss, bypass mode's k3 KL, loss aggregation and logged means, ``SUPPORTED_LOSS_TYPES``
``lm_head``           TRL's fused LM head: the training forward outside a trainer (``probe``), the head's input,
                      scoring only the trained positions, skipping the head
``sampling``          the sampler arguments TRL hands to transformers' ``generate`` and to vLLM (colocate
                      ``SamplingParams``, server ``sampling_params``)
``vllm_colocate``     TRL's colocate ``VLLMGeneration`` with extra ``vllm.LLM(...)`` arguments and, on vLLM CPU,
                      the weight sync inside vLLM's layerwise reload
``vllm_server``       TRL's vLLM server mode: the log-prob mode check, parameter names, ``VLLMClient``'s weight sync
                      over gloo for a CPU trainer
``sharded``           accelerate's sharding state (DeepSpeed ZeRO-3, FSDP1/2, FSDP dropped on CPU), full parameter
                      sizes, FSDP2's ``generate`` wrapper
``trainer_state``     the Trainer's micro-step counter and generation cadence, its optimizer step, the resumed
                      epoch's batch skip, TRL's prompt tokenisation of a generation batch, the checkpoint folder
                      and ``resume_from_checkpoint``'s resolution
====================  ==========================================================================================

Every public name of these modules is re-exported here (``__all__``; ``tests/trainer/test_trl_compat.py`` checks it),
so callers write ``from trl_rollout_corr import trl_compat`` and ``trl_compat.NAME``. The functions take tensors, the
few config values they need or the trainer object whose attribute they read, so each is tested on its own against
hand-computed values and against TRL itself.
"""

from __future__ import annotations

from .advantages import (
    ADVANTAGE_STD_EPS,
    RejectionAdvantages,
    advantages_after_rejection,
    group_advantages,
    logged_advantages,
    lone_survivors,
    replace_logged_advantages,
    trl_computes_old_log_probs,
)
from .lm_head import (
    COMPACT_SCORING_DEVICES,
    LOGIT_TRANSFORM_FIELDS,
    add_training_lm_head,
    lm_head_input,
    score_trained_tokens_only,
    skip_fused_lm_head,
    training_log_probs,
    unsupported_logit_transforms,
)
from .loss import (
    MULTIMODAL_FORWARD_KEYS,
    SUPPORTED_LOSS_TYPES,
    ForwardInputs,
    aggregate_loss,
    clip_ratio_extremes,
    global_masked_mean,
    inject_rs_mask_and_is_weights,
    loss_mask,
    per_token_kl,
    prompt_completion_inputs,
)
from .sampling import (
    SAMPLER_ARGS,
    resolved_generation_config,
    sampler_sources,
    vllm_sampling_kwargs,
    vllm_server_sampling,
)
from .sharded import (
    dropped_fsdp,
    fsdp2_wrapped_method,
    full_parameter_bytes,
    sharded_backend,
)
from .trainer_state import (
    checkpoint_folder,
    first_optimizer_step,
    generate_every,
    generation_prompt_ids,
    loader_skips_itself,
    micro_step,
    micro_steps_at,
    micro_steps_trained,
    pushes_checkpoints,
    resume_checkpoint,
    wrap_optimizer_step,
)
from .vllm_colocate import (
    COLOCATE_LLM_KWARGS,
    colocate_generation_class,
    trl_vllm_colocate,
)
from .vllm_server import (
    LOOPBACK_HOSTS,
    VLLM_CLIENT_HOOKED,
    check_vllm_server_logprobs,
    install_vllm_client_cpu_weight_sync,
    trainer_versions,
    vllm_param_name,
)

__all__ = [
    "ADVANTAGE_STD_EPS", "group_advantages", "RejectionAdvantages", "advantages_after_rejection", "logged_advantages",
    "replace_logged_advantages", "lone_survivors", "trl_computes_old_log_probs", "MULTIMODAL_FORWARD_KEYS",
    "SUPPORTED_LOSS_TYPES", "loss_mask", "ForwardInputs", "prompt_completion_inputs", "inject_rs_mask_and_is_weights",
    "per_token_kl", "aggregate_loss", "global_masked_mean", "clip_ratio_extremes", "add_training_lm_head",
    "training_log_probs", "LOGIT_TRANSFORM_FIELDS", "lm_head_input", "unsupported_logit_transforms",
    "COMPACT_SCORING_DEVICES", "score_trained_tokens_only", "skip_fused_lm_head", "SAMPLER_ARGS",
    "vllm_sampling_kwargs", "sampler_sources", "resolved_generation_config", "vllm_server_sampling",
    "COLOCATE_LLM_KWARGS", "colocate_generation_class", "trl_vllm_colocate", "check_vllm_server_logprobs",
    "VLLM_CLIENT_HOOKED", "LOOPBACK_HOSTS", "trainer_versions", "install_vllm_client_cpu_weight_sync",
    "vllm_param_name", "sharded_backend", "dropped_fsdp", "full_parameter_bytes", "fsdp2_wrapped_method",
    "wrap_optimizer_step", "generate_every", "first_optimizer_step", "micro_step", "micro_steps_at",
    "micro_steps_trained", "loader_skips_itself", "generation_prompt_ids", "checkpoint_folder", "pushes_checkpoints",
    "resume_checkpoint",
]
