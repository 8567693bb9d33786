"""Table of ``benchmarks/main_job_elision.sh``'s runs (issue 21): the main job's step time, pi_old forward elided
(``auto``) vs forced (``always``).

Reads ``<OUT>/<n>_<mode>_steps.json`` and writes ``<OUT>/summary.md``: per step, TRL's ``step_time`` (wall seconds of
``training_step``, vLLM CPU generation included) of every run; the mean over steps 2..N per run and per mode (step 1
is a warm-up); the process CPU seconds per step; and the largest difference, between the runs, of every numeric value
both logged (loss, grad norm, ``rollout_corr/*``; the timings left out), which the elision must not change.

    python benchmarks/main_job_elision_summary.py benchmarks/results/main_job_elision
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TIMINGS = ("step_time", "time", "cpu_time", "step", "epoch")  # logged values that differ by nature


def is_timing(key: str) -> bool:
    """Timings (TRL's step_time, the engine's rollout/vllm_generate_s ...), which differ between runs by nature."""
    return key in TIMINGS or key.endswith(("_s", "_seconds", "runtime", "per_second"))


def main(out: Path) -> int:
    paths = sorted(out.glob("*_steps.json"), key=lambda p: int(p.name.split("_")[0]))
    runs = [json.loads(p.read_text()) for p in paths]
    runs = [r for r in runs if r["rc"] == 0 and r["steps"]]
    if not runs:
        raise SystemExit(f"no finished run in {out}")
    names = [f"{i + 1} {r['mode']}" for i, r in enumerate(runs)]
    n = max(len(r["steps"]) for r in runs)
    lines = ["| step | " + " | ".join(f"{name}: step s" for name in names) + " |", "|---|" + "---|" * len(runs)]
    for k in range(n):
        cells = [f"{r['steps'][k]['step_time_s']:.1f}" if k < len(r["steps"]) else "-" for r in runs]
        lines.append(f"| {k + 1} | " + " | ".join(cells) + " |")
    mean = {name: statistics.fmean(s["step_time_s"] for s in r["steps"][1:]) for name, r in zip(names, runs)}
    cpu = {name: statistics.fmean(s["cpu_s_since_last_log"] for s in r["steps"][1:]) for name, r in zip(names, runs)}
    lines.append("| mean, steps 2.." + str(n) + " | " + " | ".join(f"**{mean[x]:.1f}**" for x in names) + " |")
    lines.append(f"| process CPU s/step, steps 2..{n} | " + " | ".join(f"{cpu[x]:.1f}" for x in names) + " |")
    lines.append("| load average at start | " + " | ".join(r["loadavg_before"].split()[0] for r in runs) + " |")
    lines += ["", "| mode | runs | mean step s (steps 2..N, over runs) | mean process CPU s/step |",
              "|---|---|---|---|"]
    by_mode = {}
    for name, r in zip(names, runs):
        by_mode.setdefault(r["mode"], []).append(name)
    for mode, members in by_mode.items():
        lines.append(f"| {mode} | {len(members)} | {statistics.fmean(mean[x] for x in members):.1f} | "
                     f"{statistics.fmean(cpu[x] for x in members):.1f} |")
    if {"auto", "always"} <= set(by_mode):
        ratio = (statistics.fmean(mean[x] for x in by_mode["auto"])
                 / statistics.fmean(mean[x] for x in by_mode["always"]))
        lines.append(f"\nauto / always, mean step time: {ratio:.3f}")
    if all("logged" in s for r in runs for s in r["steps"]):
        worst, keys = 0.0, set()
        for r in runs[1:]:
            for a, b in zip(runs[0]["steps"], r["steps"]):
                shared = [k for k in a["logged"] if k in b["logged"] and not is_timing(k)]
                keys.update(shared)
                worst = max([worst, *(abs(a["logged"][k] - b["logged"][k]) for k in shared)])
        lines.append(f"\nlogged values (loss, grad norm, rollout_corr/*, ...; {len(keys)} keys, timings left out), "
                     f"every run against run 1, every step: max |difference| {worst:.3g}")
    lines.append("\nCommands: " + "; ".join(f"{name}: `{r['command']}` (commit {r['commit']}, started {r['started']})"
                                             for name, r in zip(names, runs)))
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/main_job_elision")))
