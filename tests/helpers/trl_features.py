"""Every ``GRPOConfig`` / ``GRPOTrainer`` feature TRL 1.16 documents, and what ``RolloutCorrGRPOTrainer`` does with it.

One row per feature (the ``GRPOConfig`` field list and docstring groups of trl 1.16's ``grpo_config.py``, and the
``GRPOTrainer`` arguments), with the outcome under each correction preset of ``PRESETS``: ``WORKS`` or a substring
of the config-time refusal (which names the option). ``tests/trainer/test_trl_features.py`` checks every row: without a
correction the subclass trains exactly as plain TRL (same logged losses, gradient norms and TRL metrics), and with
each preset the refusal happens when the config is built or a short training run works. ``markdown_table()``
renders the list of ``docs/reference/trl-options.md`` from the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WORKS = "works"
UNTESTED = "untested here"  # accepted, but needs a GPU / a package / the Hub this machine lacks
NOT_APPLICABLE = "n/a"

# The correction presets of the table's columns (the TRL option interacts differently with each mode).
PRESETS = {
    "decoupled": dict(rollout_corr_preset="decoupled_k3_rs_token_tis"),
    "bypass_ppo_clip": dict(rollout_corr_preset="bypass_ppo_clip_k3_rs"),
    "bypass_reinforce": dict(rollout_corr_preset="bypass_pg_is"),
}


@dataclass(frozen=True)
class Feature:
    """One TRL feature.

    Attributes:
        name: the ``GRPOConfig`` field(s) or ``GRPOTrainer`` argument, as ``docs/reference/trl-options.md``'s list
        shows it.
        group: TRL's docstring group.
        config: ``GRPOConfig`` overrides that switch it on (on top of ``conftest.TRAIN_DEFAULTS``).
        trainer: a ``test_trl_features.TRAINER_SETUPS`` key for features that are trainer arguments ("" for none).
        outcome: preset column -> ``WORKS``, ``UNTESTED`` (accepted, not run here), ``NOT_APPLICABLE`` or a
            substring of the refusal message; columns not given work.
        train: cheap enough to train on the tiny models here (False: checked at config time only; see ``note``).
        note: what ``docs/reference/trl-options.md`` says beyond works/refused.
    """

    name: str
    group: str
    config: dict = field(default_factory=dict)
    trainer: str = ""
    outcome: dict = field(default_factory=dict)
    train: bool = True
    note: str = ""

    def expected(self, column: str) -> str:
        return self.outcome.get(column, WORKS)


def _untested() -> dict:
    return {c: UNTESTED for c in PRESETS}


def _bypass_refuses(what: str) -> dict:
    return {"bypass_ppo_clip": what, "bypass_reinforce": what}


_LOSS_IN_BYPASS = "bypass_mode=True supports loss_type"

FEATURES = (
    # ----------------------------------------------------------------- model and reference model
    Feature("model_init_kwargs", "model", dict(model_init_kwargs={"dtype": "float32"})),
    Feature("disable_dropout", "model", dict(disable_dropout=True)),
    Feature("cast_lm_head_to_fp32", "model", dict(cast_lm_head_to_fp32=True)),
    Feature("router_aux_loss_coef (MoE)", "model", dict(router_aux_loss_coef=0.01), trainer="moe",
            note="bypass adds TRL's aux loss itself (trl_compat pins)"),
    Feature("trust_remote_code", "model", dict(trust_remote_code=False), train=False,
            note="loading only; nothing to correct"),
    # ----------------------------------------------------------------- data preprocessing
    Feature("remove_unused_columns", "data", dict(remove_unused_columns=True)),
    Feature("num_generations / num_generations_eval", "data",
            dict(num_generations=2, num_generations_eval=4, eval_strategy="steps", eval_steps=1,
                 per_device_eval_batch_size=4), trainer="eval"),
    Feature("max_completion_length", "data", dict(max_completion_length=5)),
    Feature("shuffle_dataset", "data", dict(shuffle_dataset=False)),
    Feature("pad_to_multiple_of", "data", dict(pad_to_multiple_of=8)),
    # ----------------------------------------------------------------- generation
    Feature("generation_batch_size", "generation", dict(generation_batch_size=8)),
    Feature("steps_per_generation", "generation", dict(steps_per_generation=2)),
    Feature("temperature", "generation", dict(temperature=0.7)),
    Feature("top_p / top_k / min_p", "generation", dict(top_p=0.8, top_k=10, min_p=0.05),
            note="mu is the truncated distribution: the kept-mass bias shows as mismatch (spec section 8)"),
    Feature("repetition_penalty", "generation", dict(repetition_penalty=1.3),
            note="a processor the trainer does not apply: shows as mismatch"),
    Feature("generation_kwargs (sampling)", "generation", dict(generation_kwargs={"no_repeat_ngram_size": 3})),
    Feature("generation_kwargs (beam sampling)", "generation", dict(generation_kwargs={"num_beams": 2}),
            outcome={c: "generation_kwargs" for c in PRESETS}, note="no sampling distribution, so no mu"),
    Feature("generation_kwargs (greedy)", "generation", dict(generation_kwargs={"do_sample": False}),
            outcome={c: "generation_kwargs" for c in PRESETS}, note="no sampling distribution, so no mu"),
    Feature("chat_template_kwargs", "generation", dict(chat_template_kwargs={"unused": True}), trainer="chat"),
    Feature("cache_implementation", "generation", dict(cache_implementation="dynamic")),
    # ----------------------------------------------------------------- vLLM (GPU)
    Feature("use_vllm / vllm_mode (colocate, server)", "vllm", dict(use_vllm=True), train=False, outcome=_untested(),
            note="TRL's own vLLM IS is switched off; the server must run --logprobs-mode processed_logprobs; "
                 "needs vLLM on GPU (not run here)"),
    Feature("vllm_model_impl / vllm_enable_sleep_mode / vllm_gpu_memory_utilization / vllm_max_model_length / "
            "vllm_tensor_parallel_size / vllm_server_* / vllm_group_port", "vllm",
            dict(use_vllm=True, vllm_enable_sleep_mode=True), train=False, outcome=_untested(),
            note="engine settings; GPU only"),
    Feature("vllm_structured_outputs_regex", "vllm", dict(use_vllm=True, vllm_structured_outputs_regex="[0-9]+"),
            train=False, outcome=_untested(),
            note="mu includes the grammar mask, the trainer does not: shows as mismatch; GPU only"),
    # ----------------------------------------------------------------- training
    Feature("beta / use_bias_correction_kl", "training", dict(beta=0.04)),
    Feature("use_bias_correction_kl=False", "training", dict(beta=0.04, use_bias_correction_kl=False)),
    Feature("num_iterations", "training", dict(num_iterations=2)),
    Feature("epsilon / epsilon_high", "training", dict(epsilon=0.1, epsilon_high=0.28, num_iterations=2),
            outcome={"bypass_reinforce": "has no ratio in its loss"}),
    Feature("delta", "training", dict(delta=1.5, num_iterations=2),
            outcome={"bypass_reinforce": "has no ratio in its loss"},
            note="bypass PPO-clip: the dual-clip bound (needs delta > 1 + epsilon_high; default bound 3)"),
    Feature("delta <= 1 + epsilon_high", "training", dict(delta=1.1),
            outcome={"bypass_ppo_clip": "two-sided clip only for delta > 1 + epsilon_high",
                     "bypass_reinforce": "has no ratio in its loss"}),
    Feature("importance_sampling_level='sequence'", "training",
            dict(importance_sampling_level="sequence", loss_type="grpo"),
            outcome=_bypass_refuses("importance_sampling_level")),
    Feature("reward_weights / multi_objective_aggregation", "training",
            dict(reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum"), trainer="two_rewards"),
    Feature("scale_rewards='batch'", "training", dict(scale_rewards="batch")),
    Feature("scale_rewards='none'", "training", dict(scale_rewards="none")),
    Feature("loss_type='dapo' (default)", "training", dict(loss_type="dapo")),
    Feature("loss_type='grpo'", "training", dict(loss_type="grpo")),
    Feature("loss_type='bnpo'", "training", dict(loss_type="bnpo")),
    Feature("loss_type='dr_grpo'", "training", dict(loss_type="dr_grpo")),
    Feature("loss_type='cispo'", "training", dict(loss_type="cispo", epsilon_high=5.0),
            outcome=_bypass_refuses(_LOSS_IN_BYPASS)),
    Feature("loss_type='sapo' / sapo_temperature_*", "training", dict(loss_type="sapo", sapo_temperature_neg=1.1),
            outcome=_bypass_refuses(_LOSS_IN_BYPASS)),
    Feature("loss_type='luspo'", "training", dict(loss_type="luspo", importance_sampling_level="sequence"),
            outcome=_bypass_refuses("loss_type")),
    Feature("loss_type='vespo' / vespo_*", "training", dict(loss_type="vespo", vespo_k_pos=2.5),
            outcome={c: "vespo" for c in PRESETS}, note="applies its own importance weighting"),
    Feature("mask_truncated_completions", "training", dict(mask_truncated_completions=True, max_completion_length=4)),
    Feature("sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps", "training",
            dict(beta=0.04, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)),
    Feature("top_entropy_quantile", "training", dict(top_entropy_quantile=0.5),
            outcome=_bypass_refuses("top_entropy_quantile"), note="decoupled: quantile over the RS-kept tokens"),
    Feature("entropy_coef", "training", dict(entropy_coef=0.01), outcome=_bypass_refuses("entropy_coef")),
    Feature("use_adaptive_entropy / entropy_coef_min / entropy_coef_max / entropy_coef_delta / entropy_target",
            "training",
            dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef_delta=0.01),
            outcome=_bypass_refuses("use_adaptive_entropy")),
    Feature("off_policy_mask_threshold (OPSM)", "training", dict(off_policy_mask_threshold=0.05, top_p=0.8),
            outcome=_bypass_refuses("off_policy_mask_threshold"),
            note="decoupled: TRL's OPSM against mu, as TRL's vLLM path (without a correction: against pi_old, "
                 "as TRL's generate path)"),
    Feature("vllm_importance_sampling_correction=True", "training", dict(vllm_importance_sampling_correction=True),
            outcome={c: "corrected twice" for c in PRESETS}, note="unset: switched off when a correction is on"),
    Feature("vllm_importance_sampling_mode / vllm_importance_sampling_clip_max / vllm_importance_sampling_clip_min "
            "/ vllm_importance_sampling_cap", "training",
            dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0),
            outcome={c: "vllm_importance_sampling_mode" for c in PRESETS},
            note="settings of TRL's vLLM IS, which is off with a correction"),
    # ----------------------------------------------------------------- logging
    Feature("log_completions / num_completions_to_print / log_unique_prompts", "logging",
            dict(log_completions=True, num_completions_to_print=2, log_unique_prompts=True)),
    Feature("log_multimodal", "logging", dict(log_multimodal=False)),
    Feature("log_completions_hub_repo", "logging", dict(log_completions=True, log_completions_hub_repo="me/x"),
            train=False, outcome=_untested(), note="pushes to the Hub (offline here)"),
    # ----------------------------------------------------------------- transformers continuous batching
    Feature("use_transformers_continuous_batching / transformers_continuous_batching_config", "generation",
            dict(use_transformers_continuous_batching=True), train=False,
            outcome={c: "use_transformers_continuous_batching" for c in PRESETS},
            note="returns no behaviour log-probs (no correction: TRL's, without diagnostics)"),
    Feature("use_transformers_paged (deprecated: continuous batching)", "generation",
            dict(use_transformers_paged=True), train=False,
            outcome={c: "use_transformers_continuous_batching" for c in PRESETS}),
    Feature("ds3_gather_for_generation (DeepSpeed ZeRO-3)", "training arguments",
            dict(ds3_gather_for_generation=False), train=False, outcome=_untested(),
            note="the capture instruments the unwrapped model TRL generates with; ZeRO-2 is trained in "
                 "tests/e2e/test_distributed.py, ZeRO-3 on 2 CPU ranks in tests/e2e/test_sharded.py "
                 "with the default True (plain generate: mu captured, kl 2e-9); False is untested here"),
    # ----------------------------------------------------------------- TrainingArguments that GRPOConfig re-defaults
    Feature("gradient_checkpointing (GRPOConfig default True)", "training arguments",
            dict(gradient_checkpointing=True)),
    Feature("gradient_accumulation_steps", "training arguments",
            dict(gradient_accumulation_steps=2, per_device_train_batch_size=2)),
    Feature("bf16 (GRPOConfig default True)", "training arguments", dict(bf16=True),
            note="on CPU: a warning (autocast hides the mismatch)"),
    Feature("rollout_is_batch_normalize with steps_per_generation != gradient_accumulation_steps", "ours",
            dict(steps_per_generation=2, rollout_is_batch_normalize=True, rollout_is="token"), train=False,
            outcome={"decoupled": "rollout_is_batch_normalize=True in decoupled mode",
                     "bypass_ppo_clip": WORKS, "bypass_reinforce": WORKS},
            note="our own field, with the GRPOConfig fields it must agree with"),
    # ----------------------------------------------------------------- GRPOTrainer arguments
    Feature("args=None (TRL's default config)", "trainer", train=False, outcome={c: NOT_APPLICABLE for c in PRESETS},
            note="builds RolloutCorrGRPOConfig(\"<model>-GRPO\"), no correction "
                 "(tests/trainer/test_trainer_drop_in.py)"),
    Feature("reward_funcs: several, async", "trainer", trainer="async_reward"),
    Feature("reward_funcs: a reward model (path)", "trainer", trainer="reward_model"),
    Feature("train_dataset: IterableDataset", "trainer", trainer="iterable"),
    Feature("eval_dataset", "trainer", dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4),
            trainer="eval"),
    Feature("callbacks / optimizers", "trainer", trainer="optimizers"),
    Feature("rollout_func (+ env_mask)", "trainer", trainer="rollout_func"),
    Feature("tools (sync and async) / max_tool_calling_iterations", "trainer", dict(max_tool_calling_iterations=2),
            trainer="tools"),
    Feature("environment_factory (+ get_reward)", "trainer", trainer="environment"),
    Feature("peft_config / PeftModel / quantization_config", "trainer", train=False, outcome=_untested(),
            note="not installed here (peft, bitsandbytes): untested"),
    Feature("processing_class (VLM processors, images)", "trainer", train=False, outcome=_untested(),
            note="multimodal keys are forwarded (trl_compat.MULTIMODAL_FORWARD_KEYS); untested here"),
)


def markdown_table() -> str:
    """The list of ``docs/reference/trl-options.md``: one item per feature (without a correction, then per mode
    preset, merged into "every preset" where the three agree, then the note), wrapped at the docs' 120 columns."""
    import textwrap

    names = {"decoupled": "decoupled preset", "bypass_ppo_clip": "bypass PPO-clip preset",
             "bypass_reinforce": "bypass REINFORCE preset"}
    lines = []
    for f in FEATURES:
        if any(k.startswith(("rollout_", "bypass_")) for k in f.config):
            no_correction = NOT_APPLICABLE  # a row about one of our own fields
        elif f.train:
            no_correction = "as TRL (trained)"
        elif f.config:
            no_correction = "as TRL (config built)"
        else:
            no_correction = UNTESTED if UNTESTED in f.outcome.values() else "as TRL"
        cells = {}
        for column in PRESETS:
            outcome = f.expected(column)
            if outcome == WORKS:
                cells[column] = "works (trained)" if f.train else "works (config built)"
            elif outcome in (UNTESTED, NOT_APPLICABLE):
                cells[column] = outcome
            else:
                cells[column] = f"refused: `{outcome}`"
        if len(set(cells.values())) == 1:
            per_mode = f"every preset: {next(iter(cells.values()))}"
        else:
            per_mode = "; ".join(f"{names[column]}: {cell}" for column, cell in cells.items())
        text = f"`{f.name}`: no correction: {no_correction}; {per_mode}" + (f". Note: {f.note}" if f.note else "")
        lines += textwrap.wrap(text, 120, initial_indent="* ", subsequent_indent="  ", break_long_words=False,
                               break_on_hyphens=False)
    return "\n".join(lines)
