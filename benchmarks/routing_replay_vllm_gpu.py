"""Routing replay (R3) with vLLM's routed experts, end to end on one GPU: a prepared script (GPU only).

vLLM >= 0.32 returns each completion's routed experts when the engine is started with
``enable_return_routed_experts=True`` (Model Runner V2, ``VLLM_USE_V2_MODEL_RUNNER=1``; vLLM CPU refuses both, see
``tests/e2e/test_vllm_cpu.py``). This script, on a tiny random Qwen3-MoE (8 layers, 64 experts, top-8, head_dim 32,
saved locally; nothing downloaded):

1. samples 64 completions of 32 tokens from vLLM in bf16 with processed log-probs and routed experts;
2. reads the routes with ``routing.routes_from_vllm_outputs`` and checks them (``routing.check_row_routes``);
3. scores the same tokens with the float32 transformers model on the GPU, without and with replay: routing
   mismatch (trainer's own top-k vs vLLM's), routes used vs recorded, engine KL / k3 / ESS;
4. runs 2 GRPO steps of ``RolloutCorrGRPOTrainer(routing_replay="r3")`` with a ``rollout_func`` that samples from
   the same engine and returns ``routed_experts`` (no weight sync: step 2's samples are one step stale, which the
   policy-lag metric reports), decoupled mode with token TIS, and prints the logged ``rollout_corr/*`` routing keys.

Usage (a GPU machine with vllm >= 0.32 and this package's [trl] extra installed):
    VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/routing_replay_vllm_gpu.py

Status: prepared, not run yet (no GPU session was lent to the task that wrote it).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from routing_replay_tiny_moe import IS_CFG, deep_model, score, selection_mismatch  # noqa: E402

from tiny_model import prompt_dataset, reward_len  # noqa: E402
from trl_rollout_corr import compute_rollout_correction  # noqa: E402
from trl_rollout_corr.engines.vllm_cpu import sampled_log_probs_batch  # noqa: E402 (engine-neutral helper)
from trl_rollout_corr.routing import check_row_routes, find_moe_routers, pad_routes, routes_from_vllm_outputs  # noqa: E402


def main() -> None:
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    workdir = tempfile.mkdtemp()
    model, tok = deep_model("qwen3_moe", seed=0)
    model.save_pretrained(workdir)
    tok.save_pretrained(workdir)
    llm = LLM(model=workdir, dtype="bfloat16", enable_return_routed_experts=True, logprobs_mode="processed_logprobs",
              gpu_memory_utilization=0.3, max_model_len=256, enforce_eager=True, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tok), (64, 8), generator=g).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=32, min_tokens=32, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = model.cuda().eval()
    routers = find_moe_routers(model)
    rows = routes_from_vllm_outputs(outs, routers)
    completions = [list(o.outputs[0].token_ids) for o in outs]
    rows = check_row_routes(rows, [len(p) for p in prompts], [len(c) for c in completions], routers)
    ids = torch.tensor(prompts, device="cuda")
    comp = torch.tensor(completions, device="cuda")
    mu = torch.tensor(sampled_log_probs_batch([o.outputs[0] for o in outs]), device="cuda")
    routes = pad_routes(rows, torch.ones_like(ids), comp.size(1))
    lp_plain, used_plain, own_plain, _ = score(model, ids, comp)
    lp_replay, used_replay, _, counts = score(model, ids, comp, routes)
    report = {"mismatch_without_replay": selection_mismatch(routes, own_plain)[:2],
              "used_vs_recorded": [selection_mismatch(routes, used_plain)[0],
                                   selection_mismatch(routes, used_replay)[0]],
              "logged_with_replay": {k: n / d for k, (n, d) in counts.items() if "layer_" not in k}}
    mask = torch.ones_like(comp)
    for name, lp in (("without_replay", lp_plain), ("with_replay", lp_replay)):
        m = compute_rollout_correction(lp, mu, mask, IS_CFG, length_buckets=()).metrics
        report[name] = {k: m[f"rollout_corr/{k}"] for k in ("kl", "k3_kl", "rollout_is_eff_sample_size_raw")}
    print(json.dumps(report, indent=1), flush=True)

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    def rollout_func(batch_prompts, trainer):
        prompt_ids = [trainer.processing_class(p)["input_ids"] for p in batch_prompts]
        sp = SamplingParams(temperature=1.0, max_tokens=trainer.max_completion_length, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], sp, use_tqdm=False)
        return {"prompt_ids": prompt_ids, "completion_ids": [list(o.outputs[0].token_ids) for o in outputs],
                "logprobs": sampled_log_probs_batch([o.outputs[0] for o in outputs]),
                "routed_experts": routes_from_vllm_outputs(outputs, find_moe_routers(trainer.model))}

    args = RolloutCorrGRPOConfig(output_dir=os.path.join(workdir, "grpo"), per_device_train_batch_size=8,
                                 num_generations=4, max_completion_length=16, max_steps=2, logging_steps=1,
                                 report_to=[], learning_rate=1e-4, save_strategy="no", beta=0.0, bf16=False,
                                 rollout_corr_preset="decoupled_token_is", routing_replay="r3")
    trainer = RolloutCorrGRPOTrainer(model=workdir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(16), rollout_func=rollout_func)
    trainer.train()
    for log in (h for h in trainer.state.log_history if "loss" in h):
        print(json.dumps({k: v for k, v in log.items() if "routing" in k or k in (
            "loss", "rollout_corr/kl", "rollout_corr/rollout_is_eff_sample_size", "rollout_corr/policy_lag_max")}))


if __name__ == "__main__":
    main()
