"""Per-run reading of one or more ``bench_step.py`` results.json files (issue 21: records' share of a step).

For every finished (file, round, run): the load average at its start, CPU seconds of the main thread per timed step
(step 1 dropped, as ``bench_step.py``), its system part and minor page faults (where recorded), and the exclusive
CPU seconds per part; then, over all files given, the mean
per run and the ratio of each run to ``--base`` (default ``ours_decoupled``), pooled and, where a file holds both runs
in the same round, per round (the adjacent pairs of an interleaved chunk). Markdown on stdout.

    python benchmarks/bench_step_rounds.py benchmarks/results/bench_step_smollm2/results.json \\
        benchmarks/results/bench_step_smollm2/round2_results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PARTS = ("forward (grad)", "forward (no grad)", "backward", "optimizer", "support", "correction", "metrics",
         "records", "other")


def timed(record: dict) -> list[dict]:
    """The timed steps of one run's record (step 1 is the warm-up)."""
    return record["steps"][1:]


def mean_cpu(record: dict) -> float:
    """Mean CPU s per timed step of one run's record."""
    return statistics.fmean(s["cpu_s"] for s in timed(record))


def mean_part(record: dict, part: str) -> float:
    """Mean exclusive CPU s per timed step of one part (0 where the part did not run)."""
    return statistics.fmean(s.get("parts", {}).get(part, 0.0) for s in timed(record))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files of bench_step.py")
    parser.add_argument("--base", default="ours_decoupled")
    args = parser.parse_args()
    rows = []
    for i, path in enumerate(args.results):
        for record in json.loads(Path(path).read_text())["runs"]:
            if "error" not in record:
                rows.append((i, Path(path).name, record))
    lines = ["| file | round | run | load at start | CPU s per timed step | mean | system s | minor faults (k) | "
             + " | ".join(PARTS) + " |", "|---|---|---|---|---|---|---|---|" + "---|" * len(PARTS)]
    for _, name, r in rows:
        rusage = "sys_s" in r["steps"][0]  # bench_step.py records the user / system split since round 2
        sys_s = f"{statistics.fmean(s['sys_s'] for s in timed(r)):.2f}" if rusage else "-"
        faults = f"{statistics.fmean(s['minor_faults'] for s in timed(r)) / 1e3:.0f}" if rusage else "-"
        lines.append(f"| {name} | {r['round'] + 1} | `{r['run']}` | {r['load_before']:.2f} | "
                     + " ".join(f"{s['cpu_s']:.2f}" for s in timed(r))
                     + f" | {mean_cpu(r):.2f} | {sys_s} | {faults} | "
                     + " | ".join(f"{mean_part(r, p):.3f}" for p in PARTS) + " |")
    runs = list(dict.fromkeys(r["run"] for _, _, r in rows))
    base = [mean_cpu(r) for _, _, r in rows if r["run"] == args.base]
    lines += ["", f"| run | runs | mean CPU s/step (sd over runs) | / `{args.base}` pooled | / `{args.base}` same "
              "file and round, each pair |", "|---|---|---|---|---|"]
    for run in runs:
        means = [mean_cpu(r) for _, _, r in rows if r["run"] == run]
        pairs = []
        for i, _, r in rows:
            if r["run"] != run or run == args.base:
                continue
            mates = [b for j, _, b in rows if j == i and b["run"] == args.base and b["round"] == r["round"]]
            pairs += [f"{mean_cpu(r) / mean_cpu(b):.3f}" for b in mates]
        sd = f"{statistics.stdev(means):.2f}" if len(means) > 1 else "-"
        pooled = f"{statistics.fmean(means) / statistics.fmean(base):.3f}" if base else "-"
        lines.append(f"| `{run}` | {len(means)} | {statistics.fmean(means):.2f} ({sd}) | {pooled} | "
                     f"{', '.join(pairs) or '-'} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
