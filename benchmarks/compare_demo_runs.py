"""Is `make demo` the same computation twice? Compares two output folders of recipes/grpo_rollout_corr.py (issue 15).

    python benchmarks/compare_demo_runs.py outputs/demo1 outputs/demo2 [--write-results benchmarks/RESULTS.md]

Reads each folder's ``results.json`` (greedy accuracy before/after on the held-out problems, with the per-problem
0/1 scores) and ``log.jsonl`` (run config, then every logged step). Reports both runs' accuracies, whether the
per-problem scores are equal, and, per logged step, whether every numeric metric is bit-identical except the
timing keys (``step_time``, ``cpu_time``, ``*_runtime``, ``*_per_second``, ``rollout/vllm_*_s``), which measure
the machine, not the computation. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

BEGIN = "<!-- BEGIN compare_demo_runs.py output -->"
END = "<!-- END compare_demo_runs.py output -->"
TIMING_MARKERS = ("time", "runtime", "per_second", "seconds")


def _is_timing(key: str) -> bool:
    last = key.split("/")[-1]
    return last.endswith("_s") or any(marker in last for marker in TIMING_MARKERS)


def load(folder: Path) -> dict:
    """``{"results": results.json or None (a run stopped before the end), "config": the log's first record,
    "steps": {step: record}}``."""
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in records if "loss" in r and "step" in r}
    results = folder / "results.json"
    return {"results": json.loads(results.read_text()) if results.exists() else None, "config": records[0],
            "steps": steps}


def step_differences(a: dict, b: dict) -> tuple[int, list[str]]:
    """(number of non-timing numeric values compared, ``"step N key: x vs y"`` for each that differs), over the
    steps both runs logged."""
    compared, diffs = 0, []
    for step in sorted(set(a) & set(b)):
        ra, rb = a.get(step, {}), b.get(step, {})
        for key in sorted(set(ra) | set(rb)):
            if _is_timing(key):
                continue
            x, y = ra.get(key), rb.get(key)
            if isinstance(x, (int, float)) or isinstance(y, (int, float)):
                compared += 1
                same = x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
                if not same:
                    diffs.append(f"step {step} {key}: {x!r} vs {y!r}")
    return compared, diffs


def report(folders: list[Path], runs: list[dict]) -> str:
    machine = runs[0]["config"].get("run_config", {}).get("machine", {})
    lines = [f"Run: `{' '.join(['python', *sys.argv])}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"the runs' machine (their log.jsonl): {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
             f"torch {machine.get('torch', '?')}; threads per run: "
             f"{', '.join(str(r['config'].get('run_config', {}).get('torch_threads', '?')) for r in runs)}.", "",
             "| run | accuracy before | accuracy after | paired difference | steps | mean step time (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for folder, run in zip(folders, runs):
        res, steps = run["results"] or {}, run["steps"]
        acc = [f"{res[k]['correct']}/{res[k]['total']}" if k in res else "(none)" for k in ("before", "after")]
        imp = res.get("improvement")
        diff = f"{imp['mean']:+.3f} ± {imp['stderr']:.3f}" if imp else "(none)"
        times = [r["step_time"] for r in steps.values() if "step_time" in r]
        lines.append(f"| `{folder}` | {acc[0]} | {acc[1]} | {diff} | {len(steps)} | "
                     f"{sum(times) / max(len(times), 1):.1f} |")
    first = runs[0]
    for folder, run in zip(folders[1:], runs[1:]):
        ra, rb = first["results"] or {}, run["results"] or {}
        both = [k for k in ("before", "after") if k in ra and k in rb]
        same = [k for k in both if ra[k]["scores"] == rb[k]["scores"]]
        scores = (f"per-problem greedy scores {'identical' if same == both else 'DIFFER'} ({', '.join(both)})"
                  if both else "no accuracy in both")
        compared, diffs = step_differences(first["steps"], run["steps"])
        steps = sorted(set(first["steps"]) & set(run["steps"]))
        lines += ["", f"* `{folders[0]}` vs `{folder}`: {scores}; steps {steps[0] if steps else '-'}.."
                  f"{steps[-1] if steps else '-'} in both, {compared} logged step values compared (timings left "
                  f"out): {'all bit-identical' if not diffs else f'{len(diffs)} differ'}."]
        lines += [f"  * {d}" for d in diffs[:10]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--write-results", default=None)
    args = parser.parse_args()
    if len(args.folders) < 2:
        parser.error("give at least two output folders")
    text = report(args.folders, [load(f) for f in args.folders])
    print(text)
    if args.write_results:
        path = Path(args.write_results)
        block = f"{BEGIN}\n{text}{END}"
        if BEGIN not in path.read_text():  # first write: the section's title above the markers
            block = "## Reproducibility (issue 15): the main job's command run more than once at 1 thread\n\n" + block
        replace_section(block, BEGIN, END, path)


if __name__ == "__main__":
    main()
