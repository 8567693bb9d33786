"""Routing replay (R3, issue 14) on tiny random MoE models, CPU: bf16 rollout, float32 trainer.

Part 1, offline (one large rollout batch, the same tokens scored both ways, no training in between):
  * sample with ``transformers.generate`` from a bf16 copy of the weights (``generate_in_dtype``), recording mu
    (processed log-probs) and the routes (``routing.record_routes``);
  * score the same tokens in float32 without replay and with replay (``routing.RouteReplayer``): routing mismatch
    (the trainer's own top-k vs the recorded one, before substitution; and the routes actually used vs the
    recorded ones), engine KL and ESS (``compute_rollout_correction``, token IS), |log mu - log pi_old| on the
    tokens whose routes differ in some layer vs the others;
  * gradients of -sum(log pi) with replay on: per-layer router weight gradient norms;
  * float32 self-replay: routes recorded from the trainer's own float32 forward, replayed: log-probs identical?
Part 2, training: ``RolloutCorrGRPOTrainer`` for a few steps in decoupled (token TIS) and bypass (PPO-clip + seq
  k3 RS) mode, routing_replay off vs r3, bf16 rollouts (``rollout_generate_dtype``), float32 trainer: per-step
  ``rollout_corr/kl``, ESS and ``routing_mismatch_fraction``, router gradient norms (hooks), CPU seconds.

Models (random, built locally like tests/helpers/tiny_model.py, head_dim 32): "small" = the test models (2 layers, 8
experts, top-2; Mixtral 4 experts), and "deep" = 8 layers, hidden 128, 4 heads, 64 experts, top-8 (Qwen3-30B-A3B's
64-experts-per-8 shape in miniature: more near-ties and more layers to compound them).

Usage: python benchmarks/routing_replay_tiny_moe.py [--families qwen3_moe olmoe mixtral] [--steps 6] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))

from tiny_model import make_tiny_model, make_tokenizer, prompt_dataset, reward_len  # noqa: E402
from trl_rollout_corr import RolloutCorrectionConfig, compute_rollout_correction  # noqa: E402
from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs, generate_in_dtype  # noqa: E402
from trl_rollout_corr.routing import (  # noqa: E402
    NO_ROUTE,
    RouteReplayer,
    find_moe_routers,
    pad_routes,
    record_routes,
)

IS_CFG = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)


def deep_model(family: str, seed: int):
    """8 layers, hidden 128 (4 heads of 32), 64 experts, top-8, expert width 32; random, float32."""
    import transformers as tf

    tok = make_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=128, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(head_dim=32, moe_intermediate_size=32, intermediate_size=256,
                                                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
                                                         **common))
    elif family == "olmoe":
        model = tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=32, num_experts=64, num_experts_per_tok=8,
                                                   **common))
    elif family == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(head_dim=32, intermediate_size=32, num_local_experts=64,
                                                       num_experts_per_tok=8, **common))
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # as tests/helpers/tiny_model.py: sampled text with some structure
    return model.float(), tok


def sample(model, tok, rows: int, prompt_len: int, new_tokens: int, seed: int):
    """bf16 rollout: (prompt_ids, completion_ids, mu (B, T), per-row routes)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, len(tok), (rows, prompt_len), generator=g)
    routers = find_moe_routers(model)
    torch.manual_seed(seed)
    with (torch.no_grad(), generate_in_dtype(model, "bfloat16"), capture_generate_log_probs(model) as cap,
          record_routes(routers) as rec):
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
    completions = out[:, prompt_len:]
    mu = torch.tensor(cap.completion_log_probs(completions.tolist()))
    rows_routes = rec.generate_rows([prompt_len] * rows, [new_tokens] * rows)
    return ids, completions, mu, rows_routes


def score(model, ids, completions, routes=None, grad=False):
    """float32 log-probs of the completion tokens, the routes the forward used and the trainer's own top-k."""
    routers = find_moe_routers(model)
    full = torch.cat([ids, completions], 1)
    mask = torch.ones_like(full)
    own_calls = []
    # registered before the replayer's hooks: sees the router's own top-k, before substitution
    handles = [r.register_forward_hook(lambda m, a, o, calls=own_calls: calls.append(o[2].detach()))
               for r in routers.routers]
    replayer = RouteReplayer(model)  # its hooks come after: record_routes below sees the routes actually used
    counts = {}

    def add(c):
        for k, (n, d) in c.items():
            a = counts.setdefault(k, [0, 0])
            a[0] += int(n)
            a[1] += int(d)

    try:
        with torch.set_grad_enabled(grad), record_routes(routers) as used:
            if routes is not None:
                with replayer.replay(routes, full, on_counts=add):
                    logits = model(input_ids=full, attention_mask=mask).logits
            else:
                logits = model(input_ids=full, attention_mask=mask).logits
            t = completions.size(1)
            lp = torch.log_softmax(logits[:, -t - 1: -1].float(), -1).gather(-1, completions[..., None]).squeeze(-1)
    finally:
        replayer.remove()
        for h in handles:
            h.remove()
    own = torch.stack(own_calls, dim=1).view(full.size(0), full.size(1), routers.num_layers, -1)
    return lp, used.forward_routes(full.size(0)), own, counts


def selection_mismatch(recorded: torch.Tensor, other: torch.Tensor):
    """(selection fraction, token-any fraction, per-layer fractions) over positions with a recorded route."""
    routed = recorded[..., 0, 0] != NO_ROUTE
    kept = (recorded.unsqueeze(-1) == other.unsqueeze(-2)).any(-1)  # (B, S, L, k)
    differs = ~kept & routed[..., None, None]
    n = int(routed.sum())
    k = recorded.size(-1)
    per_layer = [float(differs[:, :, layer].sum()) / (n * k) for layer in range(recorded.size(2))]
    return float(differs.sum()) / (n * k * recorded.size(2)), float(differs.any(-1).any(-1).sum()) / n, per_layer


def offline(family: str, size: str, rows: int, new_tokens: int, seed: int = 0) -> dict:
    model, tok = make_tiny_model(family, seed=seed) if size == "small" else deep_model(family, seed)
    model.eval()
    ids, completions, mu, rows_routes = sample(model, tok, rows, 8, new_tokens, seed)
    routes = pad_routes(rows_routes, torch.ones_like(ids), completions.size(1))
    mask = torch.ones_like(completions)
    lp_plain, used_plain, own_plain, _ = score(model, ids, completions)
    lp_replay, used_replay, own_replay, counts = score(model, ids, completions, routes)
    out = {"family": family, "size": size, "layers": find_moe_routers(model).num_layers,
           "experts": find_moe_routers(model).num_experts, "top_k": find_moe_routers(model).top_k,
           "completion_tokens": int(mask.sum())}
    sel, tok_any, per_layer = selection_mismatch(routes, own_plain)
    out["mismatch_without_replay"] = {"selections": sel, "tokens_any_layer": tok_any,
                                      "per_layer": [round(x, 5) for x in per_layer]}
    out["mismatch_logged_with_replay"] = {k: n / d for k, (n, d) in counts.items() if "layer_" not in k}
    out["used_vs_recorded"] = {"without_replay": selection_mismatch(routes, used_plain)[0],
                               "with_replay": selection_mismatch(routes, used_replay)[0]}
    # completion tokens whose log-prob position (t-1 feeds token t) saw a different route in some layer, at or
    # before it: a routing flip at an earlier position also changes later positions through attention
    p = ids.size(1)
    flip_pos = (~(routes.unsqueeze(-1) == own_plain.unsqueeze(-2)).any(-1) & (routes >= 0)).any(-1).any(-1)
    flipped_before = flip_pos.long().cummax(dim=1).values.bool()[:, p - 1: -1]
    for name, lp in (("without_replay", lp_plain), ("with_replay", lp_replay)):
        metrics = compute_rollout_correction(lp, mu, mask, IS_CFG, length_buckets=()).metrics
        diff = (mu - lp).abs()
        out[name] = {
            "kl": metrics["rollout_corr/kl"], "k3_kl": metrics["rollout_corr/k3_kl"],
            "ess": metrics["rollout_corr/rollout_is_eff_sample_size_raw"],
            "is_min": metrics["rollout_corr/rollout_is_min"], "is_max": metrics["rollout_corr/rollout_is_max"],
            "abs_diff_mean": float(diff.mean()), "abs_diff_max": float(diff.max()),
            "abs_diff_mean_after_a_flip": float(diff[flipped_before].mean()) if flipped_before.any() else None,
            "abs_diff_mean_no_flip_yet": float(diff[~flipped_before].mean()),
        }
    out["tokens_after_a_flip"] = float(flipped_before.float().mean())
    # gradients reach the routers with replay on
    model.zero_grad()
    lp, _, _, _ = score(model, ids[:8], completions[:8], routes[:8], grad=True)
    (-lp.sum()).backward()
    out["router_grad_norm_per_layer_with_replay"] = [float(r.weight.grad.norm())
                                                     for r in find_moe_routers(model).routers]
    model.zero_grad()
    # float32 self-replay
    _, _, own_fp32, _ = score(model, ids, completions)
    lp_self, used_self, _, _ = score(model, ids, completions, own_fp32.to(torch.int16))
    out["fp32_self_replay"] = {"identical": bool(torch.equal(lp_self, lp_plain)),
                               "max_abs_diff": float((lp_self - lp_plain).abs().max()),
                               "routes_used_identical": bool(torch.equal(used_self, own_fp32.to(torch.int16)))}
    return out


def train(family: str, mode: str, routing_replay: str, steps: int, workdir: str) -> dict:
    from tiny_model import make_tiny_model_dir
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    model_dir = os.path.join(workdir, f"{family}_model")
    if not os.path.exists(model_dir):
        make_tiny_model_dir(model_dir, family, seed=0)
    preset = {"decoupled": dict(rollout_corr_preset="decoupled_token_is"),
              "bypass": dict(rollout_corr_preset="bypass_ppo_clip_k3_rs", rollout_rs_threshold="0.5")}[mode]
    args = RolloutCorrGRPOConfig(
        output_dir=os.path.join(workdir, f"{family}_{mode}_{routing_replay}"), per_device_train_batch_size=8,
        num_generations=4, max_completion_length=16, max_steps=steps, logging_steps=1, report_to=[], use_cpu=True,
        learning_rate=1e-3, save_strategy="no", beta=0.0, seed=0, disable_tqdm=True, bf16=False,
        gradient_accumulation_steps=2, rollout_generate_dtype="bfloat16", routing_replay=routing_replay, **preset)
    trainer = RolloutCorrGRPOTrainer(model=model_dir, reward_funcs=reward_len, args=args,
                                     train_dataset=prompt_dataset(16))
    grads = []
    for router in find_moe_routers(trainer.model).routers:
        router.weight.register_hook(lambda g: grads.append(float(g.norm())))
    t0 = time.process_time()
    trainer.train()
    cpu = time.process_time() - t0
    logs = [h for h in trainer.state.log_history if "loss" in h]
    keys = ("loss", "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_eff_sample_size",
            "rollout_corr/routing_mismatch_fraction", "rollout_corr/routing_token_mismatch_fraction")
    per_step = {k.removeprefix("rollout_corr/"): [log.get(k) for log in logs] for k in keys}
    finite = all(math.isfinite(v) for v in per_step["loss"])
    return {"family": family, "mode": mode, "routing_replay": routing_replay, "steps": len(logs),
            "all_losses_finite": finite, "cpu_seconds": round(cpu, 1), "router_grad_norm_min": min(grads),
            "router_grad_norm_max": max(grads), **per_step}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "olmoe", "mixtral"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    report = {"torch": torch.__version__, "offline": [], "train": []}
    for family in args.families:
        for size in ("small", "deep"):
            t0 = time.process_time()
            result = offline(family, size, args.rows, args.new_tokens)
            result["cpu_seconds"] = round(time.process_time() - t0, 1)
            report["offline"].append(result)
            print(json.dumps(result), flush=True)
    if not args.no_train:
        with tempfile.TemporaryDirectory() as workdir:
            for family in args.families[:1]:
                for mode in ("decoupled", "bypass"):
                    for routing_replay in ("off", "r3"):
                        result = train(family, mode, routing_replay, args.steps, workdir)
                        report["train"].append(result)
                        print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
