"""`trl-rollout-corr probe` on SmolLM2-135M-Instruct with vLLM CPU: the engine/trainer mismatch and the trainer's
self-consistency, for the issue-13 section of benchmarks/RESULTS.md.

Runs the probe three times (each in its own process, so each vLLM engine starts clean), same prompts (the 16 built-in
ones), 4 samples each, at most 48 tokens, temperature 1, no truncation, seed 0, one torch thread:

* vLLM float32 vs trainer float32
* vLLM bfloat16 vs trainer float32 (plus vLLM's LM head in float32: `hf_overrides={"head_dtype": "float32"}`)
* vLLM bfloat16 vs trainer bfloat16 (the trainer's bf16 self-consistency; TRL's `cast_lm_head_to_fp32` on the
  trainer side and vLLM's float32 head on the engine side)

and prints one Markdown table (mean |log ratio|, p99 |log ratio|, max, fraction of tokens with ratio outside
[0.9, 1.1], batch-1 vs batch-8 self-consistency). Reports and figures go to OUT/<case>/.

    python benchmarks/probe_smollm2.py [MODEL_DIR] [OUT] [--reuse]  # .venv-vllm; ~20 min on a busy 2-core machine

`--reuse`: a case whose OUT/<case>/report.json exists is read, not rerun (to finish an interrupted run).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

REUSE = "--reuse" in sys.argv
ARGS = [a for a in sys.argv[1:] if a != "--reuse"]
MODEL = ARGS[0] if ARGS else "models/SmolLM2-135M-Instruct"
OUT = Path(ARGS[1] if len(ARGS) > 1 else "outputs/probe_smollm2")
CASES = {
    "vllm_fp32__train_fp32": ("float32", "float32"),
    "vllm_bf16__train_fp32": ("bfloat16", "float32"),
    "vllm_bf16__train_bf16": ("bfloat16", "bfloat16"),
}
COMMON = ["--engine", "vllm", "--num-prompts", "16", "--samples-per-prompt", "4", "--max-tokens", "48",
          "--temperature", "1.0", "--seed", "0", "--threads", "1", "--train-batch-size", "8", "--overwrite"]


def run(case: str, rollout: str, train: str) -> dict:
    out = OUT / case
    if REUSE and (out / "report.json").exists():
        report = json.loads((out / "report.json").read_text())
        report["wall_s"] = float("nan")
        return report
    cmd = [sys.executable, "-m", "trl_rollout_corr.cli", "probe", "--model", MODEL, "--rollout-dtype", rollout,
           "--train-dtype", train, "--out", str(out), *COMMON]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    (OUT / f"{case}.txt").write_text(proc.stdout)
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.perf_counter() - t0
    return report


def row(name: str, s: dict) -> str:
    band = s["out_of_band"]["0.9_1.1"]
    return (f"| {name} | {s['tokens']} | {s['mean_abs']:.2e} | {s['p99_abs']:.2e} | {s['max_abs']:.2e} | "
            f"{100 * band:.2f}% |")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    reports = {case: run(case, *dtypes) for case, dtypes in CASES.items()}
    print("| comparison | tokens | mean abs log ratio | p99 abs | max abs | outside [0.9, 1.1] |")
    print("|---|---|---|---|---|---|")
    labels = {"engine_vs_train": "", "engine_vs_train_fp32_head": ", trainer LM head fp32",
              "engine_fp32_head_vs_train": ", vLLM LM head fp32 (resampled)"}
    for case, report in reports.items():
        rollout, train = CASES[case]
        for variant, suffix in labels.items():
            if variant in report["variants"]:
                print(row(f"vLLM {rollout} vs trainer {train}{suffix}", report["variants"][variant]))
    for case, report in reports.items():
        sc = report["self_consistency"]
        print(row(f"trainer {sc['dtype']}: batch 1 vs batch {sc['batch_size']}, same tokens "
                  f"({100 * sc['exactly_equal_fraction']:.1f}% bit-identical)", sc))
    print("\nwall seconds: " + ", ".join(f"{c} {r['wall_s']:.0f}" for c, r in reports.items()))


if __name__ == "__main__":
    main()
