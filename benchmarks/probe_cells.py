"""Engine mismatch at a policy-lag cell's final weights: ``trl-rollout-corr probe`` (vLLM CPU bf16 vs the float32
training forward, both loading the same saved checkpoint, so no weight sync and no lag is involved) on the cell's
task prompts.

Why: the policy-lag runner's lag check asks that right after a sync (lag 0) the behaviour KL is back at the
engine-mismatch level, a bound calibrated on the warm start (``--engine-kl-max`` 0.03 nats/token). A cell that fails
it at a lag-0 step either has a lag-accounting error or weights at which bf16 and float32 disagree more than at the
warm start. This script measures the second directly, at the weights each cell ended with (from its ``--out``
folder, which holds them on the machine that ran it; they are never committed).

Each cell: the first ``--prompts`` held-out chain_sum problems (the cells' greedy evaluation set, as chat messages),
4 samples each, at most 32 tokens (the training cap), T = 1, seed 0, one torch thread, with the AVX2 kernel pin the
cells ran with (``benchmarks/avx2_kernels``). ``report.json`` goes to ``benchmarks/results/<grid>_probe/<cell>/``
(committed, ~9 KB); the table (``l = log pi_train - log mu`` per sampled token, nats) goes to RESULTS.md.

    .venv-vllm/bin/python benchmarks/probe_cells.py --out outputs/policy_lag_intel \\
        --results benchmarks/results/policy_lag_intel warmstart trl_k8_s1 bypass_k8_s1
    .venv-vllm/bin/python benchmarks/probe_cells.py --results benchmarks/results/policy_lag_intel --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_md import replace_section  # noqa: E402

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}  # recipes/configs/cpu_smollm2_*
EVAL_SEED, TRAIN_SEED, TRAIN_SIZE = 1000000, 42, 2000


def write_prompts(path: Path, n: int) -> None:
    """The first ``n`` held-out chain_sum problems as ``{"messages": [...]}`` lines (``trl-rollout-corr probe
    --prompts``), built as the cells build their evaluation set (``grpo_recipe_utils.make_task_splits``)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_recipe_utils as ru

    _, held_out = ru.make_task_splits("chain_sum", TASK_CONFIG, TRAIN_SIZE, TRAIN_SEED, n, EVAL_SEED)
    path.write_text("".join(json.dumps({"messages": held_out.messages(i)}) + "\n" for i in range(n)))


def probe(model: Path, prompts: Path, out: Path) -> None:
    """One ``trl-rollout-corr probe`` run (bf16 vLLM vs float32 trainer) in a fresh process at one thread, AVX2-pinned.

    Raises:
        FileNotFoundError: ``model`` has no ``model.safetensors`` (the cell's weights are on the machine that ran it).
        subprocess.CalledProcessError: the probe failed (its output is printed)."""
    if not (model / "model.safetensors").exists():
        raise FileNotFoundError(f"{model}/model.safetensors: a cell's weights live only in the runner's --out folder "
                                "on the machine that ran it; pass that folder as --out")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "benchmarks" / "avx2_kernels"),
                                                     os.environ.get("PYTHONPATH", "")) if p)}
    cli = Path(sys.executable).with_name("trl-rollout-corr")
    subprocess.run([str(cli), "probe", "--model", str(model), "--engine", "vllm", "--rollout-dtype", "bfloat16",
                    "--train-dtype", "float32", "--prompts", str(prompts), "--max-tokens", "32", "--threads", "1",
                    "--no-fp32-lm-head", "--no-plots", "--overwrite", "--out", str(out)], env=env, check=True,
                   stdout=subprocess.DEVNULL)


def table(probe_root: Path, grid: str) -> str:
    """The RESULTS.md section: one row per committed ``report.json`` under ``probe_root``."""
    begin, end = f"<!-- BEGIN probe_cells.py output: {grid} -->", f"<!-- END probe_cells.py output: {grid} -->"
    rows, samples = [], set()
    for rep in sorted(probe_root.glob("*/report.json")):
        samples.add(json.loads(rep.read_text()).get("samples"))
        r = json.loads(rep.read_text())["log_ratio"]
        band = r["out_of_band"]["0.9_1.1"]
        rows.append(f"| {rep.parent.name} | {r['tokens']} | {-r['mean']:.4f} | {r['mean_abs']:.4f} "
                    f"| {r['p99_abs']:.3f} | {r['max_abs']:.3f} | {100 * band:.1f} % |")
    return "\n".join([
        begin, "", f"Engine mismatch at each cell's final weights (`benchmarks/probe_cells.py`, grid `{grid}`): vLLM "
        "CPU bf16 vs the float32 training forward on the same saved checkpoint (no sync, no lag), the first "
        f"{'/'.join(str(n // 4) for n in sorted(x for x in samples if x))} held-out problems x 4 samples, <= 32 "
        "tokens, T = 1, seed 0, AVX2-pinned. `l = log pi_train - log mu` per "
        "sampled token (nats); -mean l estimates KL(mu || pi_train) per token.", "",
        "| weights | tokens | -mean l (nats/token) | mean abs l | p99 abs | max abs | outside [0.9, 1.1] |",
        "|---|---|---|---|---|---|---|", *rows, "", end])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cells", nargs="*", help="cell names (their weights: --out/<cell>)")
    ap.add_argument("--out", help="the policy-lag runner's --out folder (the cells' weights)")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "policy_lag_intel"),
                    help="the grid's committed results folder; reports go to <it>_probe/<cell>/")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    results = Path(args.results)
    probe_root = results.with_name(results.name + "_probe")
    if not args.report_only:
        if not args.out or not args.cells:
            ap.error("give the cells and --out (or --report-only)")
        with tempfile.TemporaryDirectory() as tmp:
            prompts = Path(tmp) / "prompts.jsonl"
            write_prompts(prompts, args.prompts)
            for cell in args.cells:
                probe(Path(args.out) / cell, prompts, probe_root / cell)
                print(f"probed {cell}", flush=True)
    text = table(probe_root, results.name)
    print(text)
    begin, end = text.splitlines()[0], text.splitlines()[-1]
    replace_section(text, begin, end, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
