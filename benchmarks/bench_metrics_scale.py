"""Scale benchmark of the ratio metrics' log-time reduction (issue 46): one rank's ``log()`` work for one ratio name
at a simulated W ranks x 2M trained tokens per rank per log window, fed directly (no model), before and after the
bounded-memory sketch.

* before (the exact path of main up to a6bcfb7, still importable: ``accumulator.gather_uneven`` then
  ``sketch.exact_ratio_quantiles``): every rank all-gathers every token's float64 log ratio and sorts all W x 2M;
* after (``RolloutCorrAccumulator`` with ``sketch.ValueSketch``): the 2M tokens are added in micro-batches (bucketed
  as they come: ``add`` time, spread over the window's micro-batches) and ``flush`` all-reduces 23,721 bucket counts.

The collectives are simulated on one process: the other W - 1 ranks hold the same tokens as this one (gather
returns W copies, sum multiplies by W), so what is measured is this rank's memory and compute, not the network.
Each case runs in a fresh subprocess; peak memory is the growth of ``ru_maxrss`` over the process's peak after
the rank's own 2M tokens exist. Cases whose exact path would need more than ``--max-gb`` (default 5) are not run
and their memory is given by formula (32 bytes per gathered token: the compacted gather, ``exp`` of it, the sorted
values and sort's int64 indices live together).

    flock /tmp/cpu.lock python benchmarks/bench_metrics_scale.py --out benchmarks/results/metrics_scale
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

TOKENS = 2_000_000
MICRO = 16_384  # tokens per micro-batch for the sketch's add
BYTES_PER_GATHERED_TOKEN = 32


def _rss_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(path: str, world: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from trl_rollout_corr.accumulator import Reducers, RolloutCorrAccumulator, gather_uneven
    from trl_rollout_corr.sketch import exact_ratio_quantiles

    g = torch.Generator().manual_seed(0)
    local = torch.empty(TOKENS, dtype=torch.float64).normal_(0.0, 0.05, generator=g)  # log ratios (nats), in place
    reducers = Reducers(world_size=world, rank=0, sum=lambda t: t * world, max=lambda t: t, min=lambda t: t,
                        gather=lambda t: t.repeat(world))
    base = _rss_peak_mb()
    out = {"path": path, "world": world, "tokens_per_rank": TOKENS}
    if path == "before":
        start = time.perf_counter()
        values = gather_uneven(local, reducers)
        metrics = exact_ratio_quantiles(values)
        out["flush_s"] = time.perf_counter() - start
        out["add_s"] = 0.0  # the exact path only appends
    else:
        acc = RolloutCorrAccumulator(reducers)
        start = time.perf_counter()
        for i in range(0, TOKENS, MICRO):
            acc.add_log_ratios("train", {"engine": local[i: i + MICRO]})
        out["add_s"] = time.perf_counter() - start
        start = time.perf_counter()
        logged = acc.flush("train")
        out["flush_s"] = time.perf_counter() - start
        metrics = {k.rsplit("_", 1)[-1]: v for k, v in logged.items()}
    out["peak_mb"] = _rss_peak_mb() - base
    out["metrics"] = metrics
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--max-gb", type=float, default=5.0, help="skip exact-path cases needing more (by formula)")
    p.add_argument("--out", type=Path, default=None, help="folder for results.json and table.md")
    p.add_argument("--case", nargs=2, metavar=("PATH", "WORLD"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], int(args.case[1]))))
        return
    rows = []
    for world in args.worlds:
        for path in ("before", "after"):
            need_gb = BYTES_PER_GATHERED_TOKEN * world * TOKENS / 1e9
            if path == "before" and need_gb > args.max_gb:
                rows.append({"path": path, "world": world, "tokens_per_rank": TOKENS, "skipped": True,
                             "formula_gb": need_gb})
                continue
            env = dict(os.environ, OMP_NUM_THREADS="1")
            done = subprocess.run([sys.executable, __file__, "--case", path, str(world)], capture_output=True,
                                  text=True, env=env, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["formula_gb"] = need_gb if path == "before" else None
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| ranks x tokens/rank | path | add (s, whole window) | log() flush (s) | peak memory (MB) | "
             "engine p01 / p50 / p99 |", "|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['world']} x 2M"
        if r.get("skipped"):
            lines.append(f"| {size} | before (exact) | - | not run | ~{r['formula_gb'] * 1000:,.0f} by formula "
                         f"(32 B x {r['world'] * TOKENS / 1e6:,.0f}M gathered tokens) | - |")
            continue
        m = r["metrics"]
        q = " / ".join(f"{m[k]:.6f}" for k in ("p01", "p50", "p99"))
        name = "before (exact)" if r["path"] == "before" else "after (sketch)"
        lines.append(f"| {size} | {name} | {r['add_s']:.2f} | {r['flush_s']:.3f} | {r['peak_mb']:,.0f} | {q} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
