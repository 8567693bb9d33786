"""The ratio (and support-size) quantiles of the bounded-memory sketch on committed dumps whose logs hold the exact
quantiles (issue 46): ``analyze`` with the sketch forced on (``sketch.EXACT_MAX`` = 0, as a window over 65,536
tokens), its check against the logged exact values (inside the sketch's guaranteed intervals?), and the largest
relative error of the sketch's estimates against the exact logged values, beside the stated bound
``exp(RATIO_ALPHA |l| + RATIO_FLOOR) - 1`` at the logged value's |l|. ``check_max_abs_diff_all_keys`` is the check's
largest difference over every compared key (for a sketch quantile: its distance outside the guaranteed interval).

    flock /tmp/cpu.lock python benchmarks/sketch_on_dumps.py benchmarks/results/records_resume/rollouts \
        --out benchmarks/results/metrics_scale/dumps.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dumps", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    from trl_rollout_corr import sketch
    from trl_rollout_corr.analyze import analyse_dump
    from trl_rollout_corr.records import open_dump

    sketch.EXACT_MAX = 0  # every window read off the sketch
    report = []
    for path in args.dumps:
        dump = open_dump(path)
        check, analyses, _ = analyse_dump(dump, [])
        worst = {"rel_error": 0.0}
        compared = 0
        for w in dump.windows:
            part = analyses[0].per_window.get(w.logged_step)
            if part is None:
                continue
            ours = part.metrics()
            for key in part.bounds():
                if key not in w.metrics:
                    continue
                logged, est = float(w.metrics[key]), ours[key]
                rel = abs(est / logged - 1)
                bound = math.expm1(sketch.RATIO_ALPHA * abs(math.log(logged)) + sketch.RATIO_FLOOR) \
                    if "_ratio_" in key else sketch.SIZE_ALPHA
                compared += 1
                if rel >= worst["rel_error"]:
                    worst = {"rel_error": rel, "step": w.logged_step, "key": key, "logged_exact": logged,
                             "sketch": est, "bound_at_logged": bound}
        row = {"dump": str(path), "check_ok": check.ok, "check_compared": check.compared,
               "check_failures": check.failures, "quantiles_compared": compared,
               "check_max_abs_diff_all_keys": check.max_abs_diff, "worst": worst}
        report.append(row)
        print(json.dumps(row, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
