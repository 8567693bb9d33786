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
import platform
import sys
import time
from pathlib import Path

BEGIN = "<!-- BEGIN compare_demo_runs.py output -->"
END = "<!-- END compare_demo_runs.py output -->"
TIMING_MARKERS = ("time", "runtime", "per_second", "seconds")


def _is_timing(key: str) -> bool:
    last = key.split("/")[-1]
    return last.endswith("_s") or any(marker in last for marker in TIMING_MARKERS)


def load(folder: Path) -> dict:
    """``{"results": results.json, "config": the log's first record, "steps": {step: record}}``."""
    records = [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in records if "loss" in r and "step" in r}
    return {"results": json.loads((folder / "results.json").read_text()), "config": records[0], "steps": steps}


def step_differences(a: dict, b: dict) -> tuple[int, list[str]]:
    """(number of non-timing numeric values compared, ``"step N key: x vs y"`` for each that differs)."""
    compared, diffs = 0, []
    for step in sorted(set(a) | set(b)):
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
    lines = [f"Run: `{' '.join(['python', *sys.argv])}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{platform.machine()}, {platform.processor() or 'cpu'}; each folder from one `make demo "
             f"DEMO_OUT=<folder>`.", "",
             "| run | accuracy before | accuracy after | paired difference | steps | mean step time (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for folder, run in zip(folders, runs):
        res, steps = run["results"], run["steps"]
        imp = res.get("improvement", {})
        times = [r["step_time"] for r in steps.values() if "step_time" in r]
        lines.append(f"| `{folder}` | {res['before']['correct']}/{res['before']['total']} | "
                     f"{res['after']['correct']}/{res['after']['total']} | "
                     f"{imp.get('mean', float('nan')):+.3f} ± {imp.get('stderr', float('nan')):.3f} | {len(steps)} | "
                     f"{sum(times) / max(len(times), 1):.1f} |")
    first = runs[0]
    for folder, run in zip(folders[1:], runs[1:]):
        scores = all(run["results"][k]["scores"] == first["results"][k]["scores"] for k in ("before", "after"))
        compared, diffs = step_differences(first["steps"], run["steps"])
        lines += ["", f"* `{folders[0]}` vs `{folder}`: per-problem greedy scores before and after "
                  f"{'identical' if scores else 'DIFFER'}; {compared} logged step values compared (timings left "
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
        body = path.read_text()
        block = f"{BEGIN}\n{text}{END}"
        if BEGIN in body:
            body = body.split(BEGIN)[0] + block + body.split(END, 1)[1]
        else:
            title = "## `make demo` twice (issue 15): the same computation?"
            body = body.rstrip("\n") + f"\n\n{title}\n\n{block}\n"
        path.write_text(body)


if __name__ == "__main__":
    main()
