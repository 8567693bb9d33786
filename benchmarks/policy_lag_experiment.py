"""Policy-lag stress experiment on the CPU main job: does correcting for stale rollouts change the outcome?

Every cell is the main job (SmolLM2-135M-Instruct, real vLLM CPU bf16 rollouts, float32 trainer, reasoning-gym
chain_sum, same data and seed) with the vLLM engine synced only every k optimizer steps (``rollout_sync_interval``:
k = 1 is on-policy, k = 2 gives lags 0-1, k = 8 lags 0-7), under one of these methods:

* ``trl``: plain TRL GRPO (no correction; TRL's own vLLM IS off: with a ``rollout_func`` TRL never applies it);
* ``decoupled``: ours, decoupled mode, token TIS 2 + seq_mean_k3 RS 0.01 (``decoupled_k3_rs_token_tis``);
* ``bypass``: ours, bypass PPO-clip on pi_theta / mu with seq_mean_k3 RS (``cpu_smollm2_bypass.yaml``);
* ``trl_is`` (k = 8 only): TRL's built-in vLLM IS at its defaults. TRL applies it only when ``use_vllm=True`` and
  silently skips it with a ``rollout_func``; ``TRLISOnRolloutFunc`` below switches its code path on by setting the
  trainer's ``use_vllm`` attribute to True after construction (TRL then computes pi_old and multiplies its
  ``token_truncate`` ratio, cap 3, into the loss) and back to False inside ``_generate`` only (so TRL does not try
  to sync a vLLM engine it does not have). This couples to TRL 1.16 internals; it is a benchmark, not the package.
* ``direct_gate`` (k = 8 only): ours, bypass REINFORCE with the token IcePop band [0.5, 5] on pi_theta / mu
  (``bypass_pg_token_icepop``) and ``max_policy_lag=4``.

Each cell runs ``recipes/grpo_rollout_corr.py``'s ``main`` in its own process (``--run-cell``; each builds its own
vLLM engine) and is skipped when its ``results.json`` exists (resumable). Then a table goes into
``benchmarks/RESULTS.md`` between this script's markers, and ``benchmarks/policy_lag_accuracy.png`` plots the final
greedy accuracy against k per method.

    .venv-vllm/bin/python benchmarks/policy_lag_experiment.py [--cells trl_k8,decoupled_k8] [--lock /tmp/heavy.lock]
    .venv-vllm/bin/python benchmarks/policy_lag_experiment.py --report-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- BEGIN policy_lag_experiment.py output -->"
END = "<!-- END policy_lag_experiment.py output -->"
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

MODEL = os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", str(ROOT / "models" / "SmolLM2-135M-Instruct"))

METHODS = {
    "trl": ("cpu_smollm2_no_correction", ["--vllm_importance_sampling_correction", "false"]),
    "decoupled": ("cpu_smollm2_decoupled", []),
    "bypass": ("cpu_smollm2_bypass", []),
    "trl_is": ("cpu_smollm2_no_correction", ["--vllm_importance_sampling_correction", "true"]),
    "direct_gate": ("cpu_smollm2_bypass", ["--rollout_corr_preset", "bypass_pg_token_icepop", "--rollout_rs", "none",
                                           "--rollout_is", "token", "--rollout_is_threshold", "0.5_5.0",
                                           "--max_policy_lag", "4"]),
}
# The order cells run in: the k = 8 column first (the issue's priority), then the on-policy reference, then the rest.
ORDER = ("trl_k8", "decoupled_k8", "bypass_k8", "trl_k1", "direct_gate_k8", "trl_is_k8", "decoupled_k1", "bypass_k1",
         "trl_k2", "decoupled_k2", "bypass_k2", "trl_k8_s2", "decoupled_k8_s2", "bypass_k8_s2")


def parse_cell(name: str) -> tuple[str, int, int]:
    """``<method>_k<interval>[_s<seed index>]`` -> (method, sync interval, seed index); ``<method>_a<depth>``
    (asynchronous depth instead of a sync interval) returns the depth as a negative interval."""
    parts = name.split("_")
    seed = int(parts.pop()[1:]) if parts[-1].startswith("s") and parts[-1][1:].isdigit() else 1
    lag = parts.pop()
    k = int(lag[1:]) if lag.startswith("k") else -int(lag[1:])
    method = "_".join(parts)
    if method not in METHODS:
        raise ValueError(f"unknown method in cell {name!r}; methods: {sorted(METHODS)}")
    return method, k, seed


def cell_flags(name: str, out: Path, common: list[str]) -> list[str]:
    method, k, seed = parse_cell(name)
    config, extra = METHODS[method]
    lag = ["--rollout_sync_interval", str(k)] if k > 0 else ["--rollout_async_depth", str(-k)]
    return ["--config", str(ROOT / "recipes" / "configs" / f"{config}.yaml"), "--output_dir", str(out),
            "--model_name_or_path", MODEL, *lag, "--seed", str(41 + seed), "--plots", "false", *common, *extra]


class _TRLISOnRolloutFunc:
    """Factory of the ``trl_is`` trainer (see the module docstring): built lazily, TRL imports are heavy."""

    @staticmethod
    def build():
        from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

        class TRLISOnRolloutFunc(RolloutCorrGRPOTrainer):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                if not self.vllm_importance_sampling_correction:
                    raise ValueError("trl_is needs vllm_importance_sampling_correction=True.")
                self.use_vllm = True  # TRL 1.16 gates its vLLM IS on this attribute alone

            def _generate(self, prompts):
                self.use_vllm = False  # no TRL vLLM engine to sync: the rollout_func generates
                try:
                    return super()._generate(prompts)
                finally:
                    self.use_vllm = True

        return TRLISOnRolloutFunc


def run_cell_in_process(name: str, flags: list[str]) -> None:
    """The ``--run-cell`` entry point: parse the recipe's flags and run its ``main``."""
    sys.path.insert(0, str(ROOT / "recipes"))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from grpo_rollout_corr import ModelConfig, RolloutCorrGRPOConfig, ScriptArguments, TrlParser, main

    parser = TrlParser((ScriptArguments, RolloutCorrGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=flags)
    method, _, _ = parse_cell(name)
    kwargs = {"trainer_cls": _TRLISOnRolloutFunc.build()} if method == "trl_is" else {}
    main(script_args, training_args, model_args, **kwargs)


def run_cell(name: str, out_root: Path, common: list[str], lock: str = "") -> None:
    """Run one cell in a fresh process (skipped when its results.json exists); with ``lock``, holds an exclusive
    ``fcntl.flock`` on that file for the cell only (a machine shared by several jobs)."""
    out = out_root / name
    if (out / "results.json").exists():
        print(f"=== {name}: done already (resumable: delete {out} to rerun)", flush=True)
        return
    if lock:
        import fcntl

        with open(lock, "a") as handle:
            print(f"... {name}: waiting for {lock}", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                return run_cell(name, out_root, common)
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "--run-cell", name, "--", *cell_flags(name, out, common)]
    print(f">>> {name}: {' '.join(cmd)}", flush=True)
    t0, load, cpu0 = time.time(), os.getloadavg()[0], os.times()
    with open(out / "run.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    cpu1 = os.times()
    meta = {"wall_s": time.time() - t0, "cpu_s": (cpu1.children_user + cpu1.children_system)
            - (cpu0.children_user + cpu0.children_system), "load_before": load, "load_after": os.getloadavg()[0],
            "returncode": proc.returncode}
    (out / "cell_meta.json").write_text(json.dumps(meta))
    print(f"<<< {name}: rc {proc.returncode}, {meta['wall_s']:.0f}s wall, {meta['cpu_s']:.0f}s CPU", flush=True)


def summarize(out: Path) -> dict:
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in records if "loss" in r and "step_time" in r]
    res = json.loads((out / "results.json").read_text())
    meta = json.loads((out / "cell_meta.json").read_text()) if (out / "cell_meta.json").exists() else {}

    def series(key):
        return [r.get(key) for r in steps]

    def mean(key):
        vals = [v for v in series(key) if isinstance(v, (int, float))]
        return statistics.fmean(vals) if vals else None

    return {"steps": len(steps), "before": res.get("before"), "after": res.get("after"),
            "improvement": res.get("improvement"), "reward": series("reward"), "kl": series("rollout_corr/kl"),
            "lag_mean": mean("rollout_corr/policy_lag_mean"),
            "dropped": mean("rollout_corr/policy_lag_dropped_fraction"),
            "rs_frac": mean("rollout_corr/rollout_rs_masked_fraction"), "step_time": mean("step_time"),
            "meta": meta}


def paired(a: list, b: list) -> str:
    """after(a) - after(b) over the same held-out items: mean ± paired standard error."""
    d = [x - y for x, y in zip(a, b)]
    if len(d) < 2:
        return "n/a"
    m = statistics.fmean(d)
    return f"{m:+.3f} ± {statistics.stdev(d) / len(d) ** 0.5:.3f}"


def report(out_root: Path, common: list[str], figure: bool = True) -> str:
    cells = {c.name: summarize(c) for c in sorted(out_root.iterdir()) if (c / "results.json").exists()}
    lines = [BEGIN, "", "### Policy lag: stale vLLM CPU rollouts, with and without correction "
             "(`benchmarks/policy_lag_experiment.py`)", "",
             f"Common flags: `{' '.join(common)}`. Lag comes from syncing the vLLM CPU engine every k optimizer "
             "steps (k = 1: on-policy). Accuracy: greedy, on the held-out problems, before -> after (s.e.); the "
             "paired column compares a cell's *after* scores with plain TRL's at the same k and seed, item by item. "
             "Reward and `rollout_corr/kl` are listed per step.", "",
             "| cell | steps | greedy acc before -> after | after - before (paired s.e.) | after vs plain TRL, same k "
             "(paired s.e.) | mean policy lag | dropped (max_policy_lag) | RS rejected | reward per step "
             "| rollout_corr/kl per step | step time (s) | wall / CPU (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in cells.items():
        method, k, seed = parse_cell(name)
        ref_name = f"trl_k{k}" + (f"_s{seed}" if seed != 1 else "")
        ref = cells.get(ref_name)
        b, a = s["before"] or {}, s["after"] or {}
        vs = paired(a["scores"], ref["after"]["scores"]) if ref and ref.get("after") and a and ref_name != name \
            else "—"
        imp = s["improvement"] or {"mean": float("nan"), "stderr": float("nan")}
        nums = lambda xs, f: " ".join("-" if x is None else format(x, f) for x in xs)  # noqa: E731
        lines.append(
            f"| {name} | {s['steps']} | {b.get('correct')}/{b.get('total')} -> {a.get('correct')}/{a.get('total')} "
            f"| {imp['mean']:+.3f} ± {imp['stderr']:.3f} | {vs} | {s['lag_mean'] or 0:.2f} | "
            f"{'-' if s['dropped'] is None else format(s['dropped'], '.2f')} | "
            f"{'-' if s['rs_frac'] is None else format(s['rs_frac'], '.2f')} | {nums(s['reward'], '.2f')} | "
            f"{nums(s['kl'], '.3f')} | {s['step_time'] or 0:.1f} | {s['meta'].get('wall_s', 0):.0f} / "
            f"{s['meta'].get('cpu_s', 0):.0f} |")
    missing = [c for c in ORDER if c not in cells]
    if missing:
        lines += ["", f"Not run (time box): {', '.join(missing)}."]
    if cells and figure:
        plot(cells, ROOT / "benchmarks" / "policy_lag_accuracy.png")
        lines += ["", "![final greedy accuracy against the sync interval](policy_lag_accuracy.png)"]
    lines += ["", END]
    return "\n".join(lines)


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        pts = sorted((parse_cell(n)[1], s["after"]["accuracy"], s["after"]["stderr"]) for n, s in cells.items()
                     if parse_cell(n)[0] == method and parse_cell(n)[1] > 0 and parse_cell(n)[2] == 1
                     and s.get("after"))
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o",
                        capsize=3, label=method)
    befores = [s["before"]["accuracy"] for s in cells.values() if s.get("before")]
    if befores:
        ax.axhline(befores[0], color="grey", linestyle=":", label="before training")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vLLM weight sync interval k (optimizer steps)")
    ax.set_ylabel("greedy accuracy after training")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_section(text: str, path: Path = ROOT / "benchmarks" / "RESULTS.md") -> None:
    """This experiment's section of RESULTS.md (between its markers; ``results_md.replace_section``)."""
    replace_section(text, BEGIN, END, path)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-cell":
        run_cell_in_process(sys.argv[2], sys.argv[4:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "outputs" / "policy_lag"))
    ap.add_argument("--cells", default=",".join(ORDER), help="comma list, in run order")
    ap.add_argument("--common", default="--learning_rate 5e-5 --max_steps 8 --eval_size 64 --torch_threads 1",
                    help="recipe flags for every cell")
    ap.add_argument("--lock", default="", help="hold an exclusive flock on this file for each cell")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print the table; leave RESULTS.md and the figure alone")
    args = ap.parse_args()
    out_root, common = Path(args.out), args.common.split()
    out_root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for name in args.cells.split(","):
            run_cell(name, out_root, common, args.lock)
    text = report(out_root, common, figure=not args.no_write)
    print(text)
    if not args.no_write:
        write_section(text)


if __name__ == "__main__":
    main()
