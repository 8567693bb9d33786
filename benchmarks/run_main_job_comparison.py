"""The main job three times, same data and seed: no correction, decoupled, bypass (recipes/configs/cpu_smollm2_*.yaml).

Runs recipes/grpo_rollout_corr.py once per config (sequentially, in fresh processes, so each builds its own vLLM
engine), then writes a table into benchmarks/RESULTS.md between this script's BEGIN/END markers:
step time (whole step, and trainer-only = step - vLLM generate - weight sync), greedy accuracy before/after on the
held-out problems, mean rollout_corr/kl, ESS, rejection fraction, and the bypass/decoupled step-time ratio.

    .venv-vllm/bin/python benchmarks/run_main_job_comparison.py [--out outputs/comparison] [--extra "--max_steps 4"]
    .venv-vllm/bin/python benchmarks/run_main_job_comparison.py --report-only   # re-read existing runs
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

ROOT = Path(__file__).resolve().parents[1]
RUNS = (("no correction", "cpu_smollm2_no_correction"), ("decoupled", "cpu_smollm2_decoupled"),
        ("bypass", "cpu_smollm2_bypass"))
BEGIN = "<!-- BEGIN run_main_job_comparison.py output -->"
END = "<!-- END run_main_job_comparison.py output -->"


def run(config: str, out: Path, extra: list[str]) -> dict:
    load_before = os.getloadavg()
    cmd = [sys.executable, str(ROOT / "recipes" / "grpo_rollout_corr.py"), "--config",
           str(ROOT / "recipes" / "configs" / f"{config}.yaml"), "--output_dir", str(out), *extra]
    print(">>>", " ".join(shlex.quote(c) for c in cmd), flush=True)
    t0 = time.time()
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    meta = {"wall_s": time.time() - t0, "load_before": load_before, "load_after": os.getloadavg()}
    (out / "comparison_meta.json").write_text(json.dumps(meta))
    return meta


def summarize(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if "loss" in r and "step_time" in r]
    results = json.loads((out / "results.json").read_text())
    meta = json.loads((out / "comparison_meta.json").read_text()) if (out / "comparison_meta.json").exists() else {}

    def mean(key, rows=steps):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.fmean(vals) if vals else None

    later = steps[1:] or steps  # step 1 includes one-off warm-up
    trainer_only = [r["step_time"] - r.get("rollout/vllm_generate_s", 0.0) - r.get("rollout/vllm_sync_s", 0.0)
                    for r in later]
    return {
        "steps": len(steps),
        "step_time": mean("step_time", later),
        "trainer_time": statistics.fmean(trainer_only) if trainer_only else None,
        "generate_time": mean("rollout/vllm_generate_s", later),
        "before": results.get("before"), "after": results.get("after"), "improvement": results.get("improvement"),
        "kl": mean("rollout_corr/kl"), "k3_kl": mean("rollout_corr/k3_kl"),
        "ess": mean("rollout_corr/rollout_is_eff_sample_size"),
        "rs_frac": mean("rollout_corr/rollout_rs_masked_fraction"),
        "reward_first": mean("reward", steps[: max(1, len(steps) // 4)]),
        "reward_last": mean("reward", steps[-max(1, len(steps) // 4):]),
        "completion_len": mean("completions/mean_length"),
        "meta": meta, "engine": results.get("engine", {}),
    }


def fmt(x, spec=".4f"):
    return "n/a" if x is None else format(x, spec)


def report(out_root: Path) -> str:
    rows = {name: summarize(out_root / config) for name, config in RUNS
            if (out_root / config / "results.json").exists()}
    lines = [BEGIN, "", "### Main job, three runs side by side (`benchmarks/run_main_job_comparison.py`)", "",
             "Same data (reasoning-gym chain_sum, 2 terms, 1-2 digits; train seed 42, 128 held-out problems with "
             "seed 1,000,000), same seed and optimisation; SmolLM2-135M-Instruct, vLLM CPU bf16 rollouts, float32 "
             "training, 1 torch thread, shared 2-core machine (1-min load average before/after each run given). Step "
             "times are means over steps 2..N (step 1 has one-off warm-up); *trainer* = step - vLLM generate - weight "
             "sync.", "",
             "| run | steps | step time (s) | trainer time (s) | vLLM generate (s) | greedy acc before "
             "| greedy acc after | after - before (paired s.e.) | mean rollout_corr/kl | mean k3_kl | mean ESS "
             "| mean RS rejected fraction | reward first/last quarter | load before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in rows.items():
        b, a = s["before"] or {}, s["after"] or {}
        imp = lambda d: f"{d['mean']:+.3f} ± {d['stderr']:.3f}" if d else "n/a"  # noqa: E731
        acc = lambda r: f"{r['accuracy']:.3f} ± {r['stderr']:.3f} ({r['correct']}/{r['total']})" if r else "n/a"  # noqa: E731
        load = s["meta"].get("load_before"), s["meta"].get("load_after")
        load_txt = f"{load[0][0]:.1f} / {load[1][0]:.1f}" if load[0] else "n/a"
        lines.append(
            f"| {name} | {s['steps']} | {fmt(s['step_time'], '.1f')} | {fmt(s['trainer_time'], '.1f')} | "
            f"{fmt(s['generate_time'], '.1f')} | {acc(b)} | {acc(a)} | {imp(s['improvement'])} | "
            f"{fmt(s['kl'], '.2e')} | {fmt(s['k3_kl'], '.2e')} | {fmt(s['ess'])} | {fmt(s['rs_frac'])} | "
            f"{fmt(s['reward_first'], '.3f')} / {fmt(s['reward_last'], '.3f')} | {load_txt} |")
    if "bypass" in rows and "decoupled" in rows:
        d, b = rows["decoupled"], rows["bypass"]
        lines += ["", f"Bypass / decoupled step time: **{b['step_time'] / d['step_time']:.2f}x** (whole step), "
                      f"**{b['trainer_time'] / d['trainer_time']:.2f}x** (trainer part; bypass skips the pi_old "
                      "forward)."]
    lines += ["", END]
    return "\n".join(lines)


def write_section(text: str, path: Path = ROOT / "benchmarks" / "RESULTS.md") -> None:
    current = path.read_text() if path.exists() else ""
    if BEGIN in current and END in current:
        start, stop = current.index(BEGIN), current.index(END) + len(END)
        current = current[:start] + text + current[stop:]
    else:
        current = current.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(current)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "outputs" / "comparison"))
    ap.add_argument("--extra", default="", help="extra recipe flags for every run")
    ap.add_argument("--only", default="", help="comma list of config names to (re)run")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print the table, do not touch RESULTS.md")
    args = ap.parse_args()
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for name, config in RUNS:
            if args.only and config not in args.only.split(","):
                continue
            meta = run(config, out_root / config, shlex.split(args.extra))
            print(f"<<< {name}: {meta['wall_s']:.0f}s, load {meta['load_before'][0]:.1f} -> "
                  f"{meta['load_after'][0]:.1f}", flush=True)
    text = report(out_root)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
