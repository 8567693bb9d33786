"""Print the outcome of one run of ``recipes/grpo_rollout_corr.py`` from its output folder (``make demo`` ends so).

    python recipes/print_run_summary.py outputs/demo

Reads ``results.json`` only (standard library, no torch): greedy accuracy on the held-out problems before and after
training, the paired difference, and what the folder holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

PREFIX = ">>> [demo]"


def summary_lines(results: dict, out_dir: str | Path) -> list[str]:
    """The summary of one run, as printable lines.

    Args:
        results: the recipe's ``results.json`` (``before``/``after``: ``EvalResult.to_dict()``, ``improvement``:
            ``paired_difference``); either evaluation may be absent (``eval_size: 0``).
        out_dir: the run's output folder, named in the last line.

    Returns:
        One line for the accuracies (or a line saying there was no held-out evaluation), then one for the outputs.
    """
    before, after = results.get("before"), results.get("after")
    if before and after:
        line = (
            f"{PREFIX} greedy accuracy on {before['total']} held-out problems: before {before['accuracy']:.3f} "
            f"({before['correct']}/{before['total']}), after {after['accuracy']:.3f} "
            f"({after['correct']}/{after['total']})"
        )
        improvement = results.get("improvement")
        if improvement:
            line += f", paired difference {improvement['mean']:+.3f} ± {improvement['stderr']:.3f} (s.e.)"
    else:
        line = f"{PREFIX} no held-out evaluation in this run (eval_size 0 or a rollout engine other than vllm_cpu)"
    return [line, f"{PREFIX} outputs: {out_dir}/{{summary.md,metrics.png,README.md,log.jsonl,results.json}}"]


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns the exit status (2 when the folder has no ``results.json``)."""
    parser = argparse.ArgumentParser(prog="python recipes/print_run_summary.py", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="the recipe's --output_dir")
    args = parser.parse_args(argv)
    path = Path(args.out_dir) / "results.json"
    if not path.is_file():
        print(f"{PREFIX} {path} not found: run recipes/grpo_rollout_corr.py with --output_dir {args.out_dir} first",
              file=sys.stderr)
        return 2
    for line in summary_lines(json.loads(path.read_text()), args.out_dir):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
