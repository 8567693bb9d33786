"""The main job at top_p 0.9, three ways: TRL's built-in IS, ours without support matching, ours with it.

Runs recipes/grpo_rollout_corr.py on recipes/configs/cpu_smollm2_decoupled.yaml (SmolLM2-135M-Instruct, vLLM CPU
bf16 rollouts, float32 training, 12 steps, same data and seed) with ``--top_p 0.9`` and, per run:

* ``trl_is``: TRL's own vLLM IS at its defaults (``vllm_importance_sampling_mode="sequence_mask"``,
  ``vllm_importance_sampling_clip_max=3``, no lower bound: weight ``exp(sum_t log pi_old/mu)``, 0 above 3), which
  TRL applies only with ``use_vllm=True`` (silently off with this CPU rollout_func), so it is reproduced through
  ``rollout_is="sequence"`` with the IcePop band ``1e-30_3`` (same weights; our clamp of the summed log ratio at
  -20 is the only difference, irrelevant at 32 tokens);
* ``ours_off``: the demo preset ``decoupled_k3_rs_token_tis``, ``rollout_support_matching="off"``;
* ``ours_recompute``: the same with ``rollout_support_matching="recompute"``.

Each run in a fresh process, sequentially; then a table between this script's BEGIN/END markers in
benchmarks/RESULTS.md: greedy accuracy before/after on the 128 held-out problems, the fraction of samples kept
(rows with a nonzero weight and not rejected), the mean sequence IS weight, the engine ratio and the kept mass.

    PYTHONPATH=. .venv-vllm/bin/python benchmarks/support_main_job.py [--out outputs/support_main_job]
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/support_main_job.py --extra "--max_steps 4 --eval_size 64"  # shorter
    PYTHONPATH=. .venv-vllm/bin/python benchmarks/support_main_job.py --report-only
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_main_job_comparison as comparison  # noqa: E402  (benchmarks/, next to this file)
from results_md import replace_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "cpu_smollm2_decoupled"
COMMON = ["--top_p", "0.9"]
RUNS = (
    ("trl_is", "TRL's built-in IS (defaults: sequence_mask, C_max 3), no matching",
     ["--rollout_corr_preset", "disabled", "--rollout_is", "sequence", "--rollout_is_threshold", "1e-30_3"]),
    ("ours_off", "ours (decoupled_k3_rs_token_tis), rollout_support_matching=off", []),
    ("ours_recompute", "ours (decoupled_k3_rs_token_tis), rollout_support_matching=recompute",
     ["--rollout_support_matching", "recompute"]),
)
BEGIN = "<!-- BEGIN support_main_job.py output -->"
END = "<!-- END support_main_job.py output -->"


def kept_fraction(step: dict) -> float:
    """Fraction of the step's rows trained on: not RS-rejected, and with a nonzero IS weight."""
    rejected = step.get("rollout_corr/rollout_rs_seq_masked_fraction", 0.0)
    zero_weight = step.get("rollout_corr/rollout_is_seq_fraction_high", 0.0) if "rollout_corr/rollout_is_oob_ratio" \
        in step else 0.0  # IcePop: rows above the band get weight 0 (none fall below 1e-30)
    return 1.0 - rejected - zero_weight


def summarize(out: Path) -> dict:
    base = comparison.summarize(out)
    steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in steps if "loss" in r and "step_time" in r]

    def mean(key):
        values = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else None

    base.update(
        kept=statistics.fmean(kept_fraction(r) for r in steps) if steps else None,
        is_seq_mean=mean("rollout_corr/rollout_is_seq_mean"), engine_ratio=mean("rollout_corr/engine_ratio_mean"),
        log_mass=mean("rollout_corr/support_log_mass_mean"), miss=mean("rollout_corr/support_miss_fraction"),
        invalid=mean("rollout_corr/invalid_token_fraction"), loss_zero=sum(abs(r["loss"]) < 1e-12 for r in steps),
    )
    return base


def report(out_root: Path) -> str:
    fmt = comparison.fmt
    done = [comparison.summarize(out_root / key) for key, _, _ in RUNS if (out_root / key / "results.json").exists()]
    steps = sorted({s["steps"] for s in done}) or ["?"]
    held_out = sorted({(s["before"] or {}).get("total") for s in done} - {None}) or ["?"]
    lines = [BEGIN, "", "### Main job at top_p 0.9: TRL's IS vs ours without / with support matching "
             "(`benchmarks/support_main_job.py`)", "",
             f"SmolLM2-135M-Instruct, vLLM CPU bf16 rollouts, float32 training, {'/'.join(map(str, steps))} steps of "
             "16 completions, lr 3e-5, same data and seed as the main job, `--top_p 0.9`; greedy accuracy on "
             f"{'/'.join(map(str, held_out))} held-out problems (vLLM, greedy, so it does not depend on top_p). "
             "*kept* = fraction of rows with a nonzero weight that RS did not reject, mean over steps; "
             "*IS seq mean* = mean sequence weight; *engine ratio* = mean pi_old / mu over trained tokens; "
             "*log S* = mean log kept mass (nats; measured once, at step 1, when matching is off); "
             "*miss* = sampled tokens outside the trainer's recomputed support (made invalid).", "",
             "| run | greedy acc before | greedy acc after | after - before (paired s.e.) | kept | IS seq mean "
             "| engine ratio | log S | miss | steps with loss 0 | reward first/last quarter | step time (s) "
             "| load before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, label, _ in RUNS:
        out = out_root / key
        if not (out / "results.json").exists():
            lines.append(f"| {label} | not run | | | | | | | | | | | |")
            continue
        s = summarize(out)
        b, a = s["before"] or {}, s["after"] or {}
        acc = lambda r: f"{r['accuracy']:.3f} ({r['correct']}/{r['total']})" if r else "n/a"  # noqa: E731
        imp = s["improvement"]
        load = s["meta"].get("load_before"), s["meta"].get("load_after")
        load_txt = f"{load[0][0]:.1f} / {load[1][0]:.1f}" if load[0] else "n/a"
        lines.append(
            f"| {label} | {acc(b)} | {acc(a)} | "
            f"{'n/a' if not imp else format(imp['mean'], '+.3f') + ' ± ' + format(imp['stderr'], '.3f')} | "
            f"{fmt(s['kept'], '.3f')} | {fmt(s['is_seq_mean'], '.3f')} | {fmt(s['engine_ratio'], '.4f')} | "
            f"{fmt(s['log_mass'], '.4f')} | {fmt(s['miss'], '.4f')} | {s['loss_zero']} | "
            f"{fmt(s['reward_first'], '.3f')} / {fmt(s['reward_last'], '.3f')} | {fmt(s['step_time'], '.1f')} | "
            f"{load_txt} |")
    lines += ["", END]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "outputs" / "support_main_job"))
    ap.add_argument("--extra", default="", help="extra recipe flags for every run")
    ap.add_argument("--only", default="", help="comma list of run keys to (re)run")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for key, label, flags in RUNS:
            if args.only and key not in args.only.split(","):
                continue
            meta = comparison.run(CONFIG, out_root / key, COMMON + flags + shlex.split(args.extra))
            print(f"<<< {label}: {meta['wall_s']:.0f}s", flush=True)
    text = report(out_root)
    print(text)
    if not args.no_write:
        replace_section(text, BEGIN, END)


if __name__ == "__main__":
    main()
