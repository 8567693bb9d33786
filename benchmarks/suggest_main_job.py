"""``analyze --suggest`` on the committed main-job dump, each suggestion re-applied with ``analyze --config``
(issue 23).

The dump is ``benchmarks/results/records_resume/rollouts`` (4-step CPU main job: SmolLM2-135M-Instruct, vLLM CPU bf16
rollouts, float32 training, ``decoupled_k3_rs_token_tis`` + ``policy_lag_split``, sync interval 2: steps 2 and 4 at
policy lag 1). For each requested kept fraction F (default 0.9 and 0.99), under ``OUT/keep_F``:

1. ``trl-rollout-corr analyze DUMP --suggest --keep F --out OUT/suggest``: a threshold per RS option (of tokens for
   ``token_*``, of rows for ``seq_*``) and per TIS cap (untruncated weights: tokens for ``is_token``, rows for
   ``is_sequence``), its YAML file (``OUT/suggest/suggest_configs/OPTION.yaml``) and the figure;
2. per option, ``trl-rollout-corr analyze DUMP --config OUT/suggest/suggest_configs/OPTION.yaml``: the re-applied
   config's kept count (RS: tokens / rows in the RS mask; IS: weights not truncated, per step
   ``(1 - rollout_is_ratio_fraction_high) x`` valid tokens or rows), against the requested ``F x population``.

The Show item holds when every option keeps the requested count to within one token (one row), ties at the threshold
aside (the suggester names them in its note). Both commands run in this process through the CLI's own ``main`` (the
``trl-rollout-corr`` entry point); the command lines are written to ``OUT/commands.txt``. Outputs:
``OUT/suggest_main_job.json`` / ``.txt`` and the section between this script's markers in benchmarks/RESULTS.md.
Paths inside the repository are passed relative to its root (the process runs there), so the outputs name no checkout.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suggest_main_job.py [--keep 0.9 0.99] [--dump D]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "benchmarks" / "results" / "records_resume" / "rollouts"
OUT = ROOT / "benchmarks" / "results" / "suggest_main_job"
BEGIN = "<!-- BEGIN suggest_main_job.py output -->"
END = "<!-- END suggest_main_job.py output -->"


def _cli(argv: list[str], log: Path) -> int:
    """``trl-rollout-corr ARGV`` (the entry point's ``main``), stdout and stderr into ``log``; the exit code."""
    from trl_rollout_corr.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(argv)
    log.write_text(buf.getvalue())
    return code


def reapplied_count(option: str, entry: dict) -> tuple[float, float]:
    """(kept, population) of a re-applied config (``analysis.json``'s entry): tokens / rows in the RS mask, or for a
    TIS cap the untruncated weights, summed over the steps ((1 - fraction_high) x valid tokens / rows)."""
    if option.startswith("is_"):
        unit = "num_valid_tokens" if option == "is_token" else "num_valid_seqs"
        steps = [s["metrics"] for s in entry["per_step"].values()]
        population = sum(m[f"rollout_corr/{unit}"] for m in steps)
        kept = sum((1.0 - m["rollout_corr/rollout_is_ratio_fraction_high"]) * m[f"rollout_corr/{unit}"] for m in steps)
        return kept, population
    total = entry["total"]
    unit = "tokens" if option.startswith("token_") else "rows"
    return total[f"kept_{unit}"] * total[f"valid_{unit}"], total[f"valid_{unit}"]


def _rel(path: Path) -> Path:
    """``path`` relative to the repository root when inside it (the process runs there)."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def run(dump: Path, keep: float, out: Path) -> dict:
    """Steps 1 and 2 of the module docstring for one fraction; returns its JSON report."""
    dump, out = _rel(dump), _rel(out)
    out.mkdir(parents=True)
    commands = []
    t0 = time.perf_counter()
    argv = ["analyze", str(dump), "--suggest", "--keep", f"{keep:g}", "--out", str(out / "suggest")]
    commands.append("trl-rollout-corr " + " ".join(argv))
    code = _cli(argv, out / "suggest.txt")
    if code != 0:
        raise SystemExit(f"analyze --suggest exited {code}; see {out / 'suggest.txt'}")
    suggestions = json.loads((out / "suggest" / "suggest.json").read_text())["suggestions"]
    snippet = "\n".join((out / "suggest" / "suggest_configs" / f"{s['option']}.yaml").read_text()
                        for s in suggestions)
    (out / "suggested.yaml.txt").write_text(snippet)  # every option's YAML (one option goes into a recipe config)
    rows = []
    for s in suggestions:
        option = s["option"]
        yaml_path = out / "suggest" / "suggest_configs" / f"{option}.yaml"
        target = out / "reapply" / option
        argv = ["analyze", str(dump), "--config", str(yaml_path), "--out", str(target), "--no-plots"]
        commands.append("trl-rollout-corr " + " ".join(argv))
        target.mkdir(parents=True)
        code = _cli(argv, target / "analyze.txt")
        report = json.loads((target / "analysis.json").read_text())
        kept, population = reapplied_count(option, report["configs"][1])
        requested = keep * population
        rows.append({
            "option": option, "unit": s["unit"], "threshold": s["threshold"], "note": s["note"],
            "population": population, "suggest_population": s["population"], "requested": requested,
            "kept_by_suggest": s["kept"] * population if s["kept"] is not None else None,
            "kept_reapplied": kept, "diff": kept - requested, "within_one": abs(kept - requested) <= 1.0 + 1e-9,
            "analyze_exit": code, "check_ok": report["check"]["ok"],
            "kept_tokens": report["configs"][1]["total"]["kept_tokens"],
            "kept_rows": report["configs"][1]["total"]["kept_rows"], "ess": report["configs"][1]["total"]["ess"],
        })
        (target / "analysis.json").unlink()  # large and regenerated: the row above is what is kept
    (out / "commands.txt").write_text("\n".join(commands) + "\n")
    meta = json.loads((dump / "run.json").read_text())
    return {"dump": str(dump), "keep": keep, "out": str(out),
            "trained": meta.get("correction", {}).get("rollout_corr_preset"),
            "model": meta.get("model", {}).get("name_or_path"), "engine": meta.get("engine", {}).get("rollout_engine"),
            "seconds": round(time.perf_counter() - t0, 1), "options": rows,
            "all_within_one": all(r["within_one"] for r in rows),
            "all_within_one_without_ties": all(r["within_one"] for r in rows if not r["note"])}


def text(results: list[dict]) -> str:
    """The markdown section (also ``suggest_main_job.txt``)."""
    first = results[0]
    rows = [(res["keep"], r) for res in results for r in res["options"]]
    ok = sum(r["within_one"] for _, r in rows)
    fractions = " and ".join(f"{res['keep']:g}" for res in results)
    lines = [
        BEGIN,
        f"`analyze --suggest --keep F` (F = {fractions}) on the committed main-job dump `{first['dump']}` (trained "
        f"{first['trained']}, {first['engine']}; 4 steps, lags 0 and 1), each suggested threshold re-applied with "
        f"`analyze --config OUT/keep_F/suggest/suggest_configs/OPTION.yaml` (benchmarks/suggest_main_job.py, "
        f"{sum(res['seconds'] for res in results):.0f} s on one core). Requested = F x population (valid tokens for "
        "`token_*` and `is_token`, valid rows for `seq_*` and `is_sequence`); achieved = the re-applied config's kept "
        "tokens / rows in the RS mask, or its untruncated IS weights. "
        f"**{ok} of {len(rows)} (option, F) pairs within one token (row) of the request.** RS suggestions keep the "
        "trained token TIS 2.0, IS suggestions the trained seq_mean_k3 0.01 RS (so their kept tokens are RS's).",
        "",
        "| F | option | unit | threshold | population | requested | achieved | achieved - requested | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for keep, r in rows:
        lines.append(f"| {keep:g} | {r['option']} | {r['unit']} | {r['threshold']:.6g} | {r['population']:.0f} | "
                     f"{r['requested']:.2f} | {r['kept_reapplied']:.0f} | {r['diff']:+.2f} | {r['note'] or ''} |")
    lines += ["", "Outputs: benchmarks/results/suggest_main_job/ (per F in keep_F/: suggest.txt, the tables and YAML "
              "the command prints; suggested.yaml.txt, every option's YAML; suggest/suggest.json and the figure "
              "suggest/suggest_kept_vs_threshold.png; reapply/OPTION/analyze.txt; commands.txt) and "
              "suggest_main_job.json.", END]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, default=DUMP)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.9, 0.99])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--no-results-md", action="store_true", help="do not write benchmarks/RESULTS.md")
    args = parser.parse_args()
    if not all(0.0 < k <= 1.0 for k in args.keep):
        parser.error("--keep must be fractions in (0, 1]")
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    os.chdir(ROOT)
    results = [run(args.dump.resolve(), keep, out / f"keep_{keep:g}") for keep in args.keep]
    (out / "suggest_main_job.json").write_text(json.dumps(results, indent=2) + "\n")
    section = text(results)
    (out / "suggest_main_job.txt").write_text(section + "\n")
    if not args.no_results_md:
        replace_section(section, BEGIN, END)
    print(section)
    return 0 if all(res["all_within_one_without_ties"] for res in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
