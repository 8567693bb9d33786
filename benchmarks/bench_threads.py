"""The main job's step at 1 vs 2 torch threads: wall time, CPU time, and whether the numbers change (issue 10).

Runs recipes/grpo_rollout_corr.py with the CPU default config (recipes/configs/cpu_smollm2_decoupled.yaml: vLLM CPU
bf16 rollouts in process, float32 training) for a few steps per run, without the held-out evaluation, alternating
``--torch_threads 1`` and ``--torch_threads 2`` run by run (the order flips every round), each in a fresh process.
Per step: wall time (TRL's ``step_time``) and this process's CPU time (all threads; the difference of the
``cpu_time`` of consecutive ``log.jsonl`` records). Step 1 (warm-up) is left out of the medians. The 1-minute load
average before and after each run is recorded: the machine is shared.

Also compared: the logged reward, ``rollout_corr/kl`` and mean completion length of every step, between repeats at
the same thread count (the same computation?) and between the two counts.

    .venv-vllm/bin/python benchmarks/bench_threads.py [--rounds 2] [--steps 3] [--out outputs/bench_threads]
        [--write-results benchmarks/RESULTS.md] [--report-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "cpu_smollm2_decoupled.yaml"
BEGIN = "<!-- BEGIN bench_threads.py output -->"
END = "<!-- END bench_threads.py output -->"
COMPARED = ("reward", "rollout_corr/kl", "completions/mean_length")


def run(threads: int, out: Path, steps: int, model: str) -> dict:
    """One recipe run in a fresh process; returns its per-step records and the load averages around it."""
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo_rollout_corr.py"), "--config", str(CONFIG),
           "--model_name_or_path", model, "--output_dir", str(out), "--max_steps", str(steps), "--eval_size", "0",
           "--torch_threads", str(threads), "--plots", "false", "--report_to", "none"]
    load_before = os.getloadavg()[0]
    print(">>>", shlex.join(cmd), flush=True)
    t0 = time.time()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    steps_ = [r for r in records if "loss" in r]
    cpu = [b["cpu_time"] - a["cpu_time"] for a, b in zip(steps_, steps_[1:])]
    return {"threads": threads, "wall_s": time.time() - t0, "load_before": load_before,
            "load_after": os.getloadavg()[0], "step_wall": [r["step_time"] for r in steps_[1:]], "step_cpu": cpu,
            "values": [{k: r.get(k) for k in COMPARED} for r in steps_]}


def report(runs: list[dict], args: argparse.Namespace) -> str:
    by_threads = {t: [r for r in runs if r["threads"] == t] for t in (1, 2)}
    lines = [f"Run: `{shlex.join([Path(sys.executable).name, *sys.argv])}` at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} rounds x (1 thread, 2 threads), "
             f"order flipped every round; {args.steps} steps per run, steps 2..{args.steps} timed; "
             f"{os.cpu_count()} cores, shared.", "",
             "| run | threads | 1-min load before / after | step wall (s), each step | step CPU (s), each step |",
             "|---|---:|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['threads']} | {r['load_before']:.2f} / {r['load_after']:.2f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['step_wall'])} | "
                     f"{', '.join(f'{x:.1f}' for x in r['step_cpu'])} |")
    lines += ["", "| threads | median step wall (s) | median step CPU (s) | CPU / wall |", "|---:|---:|---:|---:|"]
    medians = {}
    for t, rs in by_threads.items():
        wall = statistics.median(x for r in rs for x in r["step_wall"])
        cpu = statistics.median(x for r in rs for x in r["step_cpu"])
        medians[t] = (wall, cpu)
        lines.append(f"| {t} | {wall:.1f} | {cpu:.1f} | {cpu / wall:.2f} |")
    lines += ["", f"2 threads / 1 thread: wall {medians[2][0] / medians[1][0]:.2f}x, "
              f"CPU {medians[2][1] / medians[1][1]:.2f}x.", ""]
    for t, rs in by_threads.items():
        same = all(r["values"] == rs[0]["values"] for r in rs[1:])
        lines.append(f"* {t} thread(s), {len(rs)} runs: per-step {', '.join(COMPARED)} "
                     f"{'identical in every run' if same else 'DIFFER between runs'}.")
    differ = [i + 1 for i, (a, b) in enumerate(zip(by_threads[1][0]["values"], by_threads[2][0]["values"]))
              if a != b]
    lines.append(f"* 1 vs 2 threads: steps {differ or 'none'} differ "
                 f"(step 1, 1 thread: {by_threads[1][0]['values'][0]}; 2 threads: {by_threads[2][0]['values'][0]}).")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="outputs/bench_threads")
    parser.add_argument("--model", default=os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", "models/SmolLM2-135M-Instruct"))
    parser.add_argument("--write-results", default=None)
    parser.add_argument("--report-only", action="store_true", help="re-render OUT/runs.json, run nothing")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        runs = json.loads((out / "runs.json").read_text())
    else:
        runs = []
        for rnd in range(args.rounds):
            for threads in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                runs.append(run(threads, out / f"round{rnd}_threads{threads}", args.steps, args.model))
                (out / "runs.json").write_text(json.dumps(runs, indent=2))  # after every run: partial results
    text = report(runs, args)
    print(text)
    if args.write_results:
        path = Path(args.write_results)
        block = f"{BEGIN}\n{text}{END}"
        if BEGIN not in path.read_text():  # first write: the section's title above the markers
            block = "## Thread policy (issue 10): the main job's step at 1 vs 2 threads\n\n" + block
        replace_section(block, BEGIN, END, path)


if __name__ == "__main__":
    main()
