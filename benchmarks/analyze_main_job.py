"""`trl-rollout-corr analyze` on the rollout dump of a main-job run, for the issue-13 section of benchmarks/RESULTS.md.

1. The check and a what-if table for three presets (printed by the command itself; exit code 0 means every logged
   `rollout_corr/*` value was reproduced to 1e-5 x max(1, |value|)).
2. Bad input, each on a scratch copy of the dump that already holds an `analysis/analysis.json`: a dump from another
   schema major version, a truncated Parquet step file, a config that does not parse. For each: the exit code (2
   expected), the error message, and whether the earlier analysis is byte-identical afterwards.

The dump comes from (about 10 min on an idle 2-core machine, `.venv-vllm`):

    python recipes/grpo_rollout_corr.py --config recipes/configs/cpu_smollm2_decoupled.yaml \
        --model_name_or_path models/SmolLM2-135M-Instruct --max_steps 4 --rollout_dump_dir DUMP_DIR

    python benchmarks/analyze_main_job.py DUMP_DIR [OUT]
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path

from trl_rollout_corr.cli import main as cli_main

PRESETS = ("decoupled_token_is", "decoupled_token_icepop", "decoupled_geo_rs_token_tis")


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def bad_inputs(dump: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="analyze_bad_"))
    broken = scratch / "broken.yaml"
    broken.write_text("rollout_rs: seq_mean_k3\nrollout_rs_threshold: [0.01\n")

    def other_schema(d: Path) -> None:
        run_json = json.loads((d / "run.json").read_text())
        (d / "run.json").write_text(json.dumps({**run_json, "schema_version": "2.0"}))

    def truncated(d: Path) -> None:
        step = sorted((d / "steps").iterdir())[0]
        step.write_bytes(step.read_bytes()[:1000])

    cases = {"dump from schema 2.0": (other_schema, []), "truncated Parquet step file": (truncated, []),
             "config that does not parse": (lambda d: None, ["--config", broken])}
    print("\n| bad input | exit code | message (stderr) | earlier analysis.json unchanged |\n|---|---|---|---|")
    for name, (damage, extra) in cases.items():
        copy = scratch / name.replace(" ", "_")
        shutil.copytree(dump, copy, ignore=shutil.ignore_patterns("analysis"))
        (copy / "analysis").mkdir()
        earlier = b"an earlier analysis\n"
        (copy / "analysis" / "analysis.json").write_bytes(earlier)
        damage(copy)
        code, _, err = run(["analyze", copy, "--overwrite", *extra])
        message = err.strip().replace(str(scratch), "<scratch>").replace("|", "\\|")
        unchanged = (copy / "analysis" / "analysis.json").read_bytes() == earlier
        others = sorted(p.name for p in (copy / "analysis").iterdir())
        print(f"| {name} | {code} | `{message}` | {unchanged} (files: {', '.join(others)}) |")
    shutil.rmtree(scratch)


def main() -> None:
    dump = Path(sys.argv[1])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else dump.parent / "analysis_main_job"
    argv = ["analyze", dump, "--out", out, "--overwrite"]
    for preset in PRESETS:
        argv += ["--preset", preset]
    code, stdout, err = run(argv)
    print(stdout + err)
    print(f"exit code: {code}")
    bad_inputs(dump)


if __name__ == "__main__":
    main()
