"""Policy-lag evidence on the CPU main job: does correcting for stale rollouts change the training outcome?

Every cell is the main job (SmolLM2-135M-Instruct, real vLLM CPU bf16 rollouts, float32 trainer, reasoning-gym
chain_sum) with the vLLM engine synced only every k optimizer steps (``rollout_sync_interval``: k = 1 is
on-policy, k = 8 gives lags 0-7), under one method:

* ``trl``: plain TRL GRPO (no correction; TRL's own vLLM IS off: with a ``rollout_func`` TRL never applies it);
* ``trl_is``: TRL's built-in vLLM IS at its defaults (TRL 1.16: ``sequence_mask``, one weight per sequence, the
  product of the token ratios, zeroed above 3). TRL applies it only when
  ``use_vllm=True`` and silently skips it with a ``rollout_func``; the ``trl_is`` trainer below switches its code
  path on by setting ``use_vllm`` to True after construction and back to False inside ``_generate`` only (TRL then
  computes pi_old and multiplies its ratio into the loss). This couples to TRL 1.16 internals: a benchmark device,
  not the package;
* ``tis``: ours, decoupled, token TIS cap 2, no RS (``decoupled_token_is``);
* ``decoupled``: ours, the default preset (token TIS 2 + ``seq_mean_k3`` RS 0.01): what RS tuned for engine
  mismatch does under lag;
* ``bypass``: ours, bypass PPO-clip on pi_theta / mu, no IS, no RS (``bypass_ppo_clip``);
* ``direct_gate``: ours, bypass REINFORCE with the token IcePop band [0.5, 5] on pi_theta / mu and
  ``max_policy_lag=4``;
* ``trl_slow``: plain TRL at half the learning rate: the effective-step control (RS and IcePop drop tokens under a
  fixed normaliser and so shrink the step; a method must beat this to count as correcting lag);
* issue 23's RS arms, the default preset (token TIS 2 + ``seq_mean_k3`` RS 0.01) with ``policy_lag_split`` (which
  only measures: pi_train@v from one extra forward per stale version; it keeps pi_old's own forward, so pi_old may
  differ from ``decoupled``'s in the last float bits): ``rs_engine`` judges RS on the split's engine factor
  pi_train@v / mu (``rollout_rs_on=engine``: numerics only, stale rows weighted by IS, not rejected), ``rs_direct``
  on the whole ratio pi_old / mu (as ``decoupled``); ``f32_rs_engine`` / ``f32_rs_direct`` are the same with a
  float32 engine, the control where the engine factor is 1 and engine-factor RS rejects nothing. The no-RS arm is
  ``tis``.

Design (issue 19): every cell starts from one shared checkpoint past the take-off (cell ``warmstart``: on-policy
plain TRL from the base model; its weights stay in ``--out`` and are never committed; the runner rebuilds them
from the recipe, at the committed code revision (``warmstart_tree``), when missing and checks the rebuilt run's
held-out scores against the committed ones), runs
``--steps`` optimizer steps of ``--prompts`` x 4 completions, and is evaluated greedily on the same 512 held-out
problems at the end (its start is the warm start's final evaluation), plus a 128-problem greedy check (the first
128 of them) at step 0 and every ``--check-every`` steps for the curves (step 0 also checks that the cell starts
from the committed warm start). A cell is one process at one torch thread (``--jobs 2`` runs two side by side).

Evaluation: ``greedy_eval``, the trainer's float32 policy with ``transformers.generate`` (greedy, 32 new tokens =
the training cap), not the bf16 vLLM engine, which decodes about 5x slower on this CPU (AVX2, bf16 emulated).

Results that outlive the machine: a finished cell's small outputs (``eval.json``, ``results.json``,
``log.jsonl``, ``curve.jsonl``, ``cell_meta.json``, the last lines of its console log; never weights) are copied
to ``--results`` (default ``benchmarks/results/policy_lag/<cell>/``) and, with ``--commit``, committed there at
once; a cell whose ``eval.json`` is already under ``--results`` is skipped (resumable on a new machine).

Replayed rollouts: a cell whose k is at least ``--steps`` never syncs the engine after its first call, so its
rollouts depend only on the seed and the sampling flags (``rollout_key``); the first such cell of a key records them
(``rollouts.json.gz``, committed with the cell) and the later ones replay them (``rollout_plan``,
``benchmarks/rollout_replay.py``) instead of spending ~60 % of their time in vLLM generation. A replay that does
not match the recording call for call falls back to generating. ``cell_meta.json``'s ``rollouts`` and the report say
which cells replayed.

The lag-accounting check runs on every finished cell: every logged step's ``policy_lag_max`` lies in [0, k-1],
at least one step in every k has lag 0, and at every lag-0 step ``rollout_corr/kl`` is at the engine-mismatch
level (``rollout_corr/k3_kl`` <= ``--engine-kl-max`` nats/token: the K3 estimator, never negative and less noisy
than the K1 ``kl`` on a small batch). A cell that violates it is marked failed in its ``cell_meta.json``
and in the report.

    .venv-vllm/bin/python benchmarks/policy_lag_experiment.py --commit [--cells trl_k1,trl_k8] [--jobs 1]
    .venv-vllm/bin/python benchmarks/policy_lag_experiment.py --report-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AVX2_KERNELS = ROOT / "benchmarks" / "avx2_kernels"  # its sitecustomize.py pins a cell process to the AVX2 kernels
BEGIN = "<!-- BEGIN policy_lag_experiment.py output -->"
END = "<!-- END policy_lag_experiment.py output -->"
sys.path.insert(0, str(ROOT / "benchmarks"))
import policy_lag_stats as stats  # noqa: E402  (benchmarks/, next to this file)
from results_md import replace_section  # noqa: E402

BASE_MODEL = os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", str(ROOT / "models" / "SmolLM2-135M-Instruct"))
NO_CORR = "cpu_smollm2_no_correction"
METHODS = {  # method -> (recipe config, extra flags after the common ones)
    "trl": (NO_CORR, ["--vllm_importance_sampling_correction", "false"]),
    "trl_is": (NO_CORR, ["--vllm_importance_sampling_correction", "true"]),
    "tis": (NO_CORR, ["--rollout_corr_preset", "decoupled_token_is"]),
    "decoupled": ("cpu_smollm2_decoupled", []),
    "bypass": (NO_CORR, ["--rollout_corr_preset", "bypass_ppo_clip"]),
    "direct_gate": (NO_CORR, ["--rollout_corr_preset", "bypass_pg_token_icepop", "--max_policy_lag", "4"]),
    "trl_slow": (NO_CORR, ["--vllm_importance_sampling_correction", "false"]),  # lr halved in cell_flags
    # issue 47: controls that tell correcting lag from anchoring to the start (k = 32: mu is the warm start)
    "trl_lr4": (NO_CORR, ["--vllm_importance_sampling_correction", "false"]),  # lr / 4 (LR_SCALE)
    "trl_lr8": (NO_CORR, ["--vllm_importance_sampling_correction", "false"]),  # lr / 8
    "trl_beta01": (NO_CORR, ["--vllm_importance_sampling_correction", "false", "--beta", "0.1"]),  # KL to the start
    "trl_beta1": (NO_CORR, ["--vllm_importance_sampling_correction", "false", "--beta", "1.0"]),
    # issue 23: RS on the lag split's engine factor vs on the whole ratio; float32 engine: the engine factor is 1
    "rs_engine": ("cpu_smollm2_decoupled", ["--policy_lag_split", "true", "--rollout_rs_on", "engine"]),
    "rs_direct": ("cpu_smollm2_decoupled", ["--policy_lag_split", "true"]),
    "f32_rs_engine": ("cpu_smollm2_decoupled", ["--policy_lag_split", "true", "--rollout_rs_on", "engine",
                                                "--rollout_dtype", "float32"]),
    "f32_rs_direct": ("cpu_smollm2_decoupled", ["--policy_lag_split", "true", "--rollout_dtype", "float32"]),
    # top-p 0.9 (sampling-support matching): TRL's own IS vs ours (default preset) without / with matching
    "topp_trl_is": (NO_CORR, ["--vllm_importance_sampling_correction", "true", "--top_p", "0.9"]),
    "topp_decoupled": ("cpu_smollm2_decoupled", ["--top_p", "0.9"]),
    "topp_recompute": ("cpu_smollm2_decoupled", ["--top_p", "0.9", "--rollout_support_matching", "recompute"]),
}
# Learning-rate factor per method (default 1): the effective-step controls.
LR_SCALE = {"trl_slow": 0.5, "trl_lr4": 0.25, "trl_lr8": 0.125}
TRL_IS_METHODS = ("trl_is", "topp_trl_is")  # run by the trainer with TRL's vLLM IS switched on (_trainer_class)


def reference(method: str) -> str:
    """The method a cell is compared with, item by item, at the same k and seed."""
    return "topp_trl_is" if method.startswith("topp_") else "trl"


def reference_cell(name: str) -> str | None:
    """The cell ``name`` is compared with item by item: its method's reference (``reference``) at the same k and
    seed; for plain TRL at k > 1, plain TRL at k = 1 and the same seed (the lag effect itself). None for the warm
    start and for ``trl_k1_*``."""
    if name == WARMSTART:
        return None
    method, k, seed = parse_cell(name)
    if method == reference(method):
        return f"{method}_k1_s{seed}" if k != 1 else None
    return f"{reference(method)}_k{k}_s{seed}"

# The shared starting point: on-policy plain TRL from the base model (the pilot's seed-42 run, which took off).
WARMSTART = "warmstart"
WARMSTART_FLAGS = ["--learning_rate", "3e-5", "--per_device_train_batch_size", "16", "--seed", "42"]
CALIBRATION = [f"trl_k{k}_s{s}" for s in (1, 2, 3, 4) for k in (1, 8)]
# The 4 seeds at k = 8 did not establish a lag effect on plain TRL (paired by seed -8.2, -0.2, -9.2, +12.7 points:
# the seed spread is as large as any effect), so the calibration went on at the largest lag the design allows: k = 32
# = no sync in the 32 steps, every rollout from the shared checkpoint's weights (lags 0-31; issue 19's third option).
# Its first two seeds (-26.6 and -30.5 points paired against on-policy; arm means 41.8 vs 18.8 %, -23.1 ± 4.2 points
# apart) meet the one-third rule, so k = 32 is the grid's interval (``GRID_K``) with 3 seeds per priority arm; the
# calibration's third seed is needed as the paired reference of the grid's seed-3 cells, the fourth runs last.
CALIBRATION_MAX_LAG = [f"trl_k32_s{s}" for s in (1, 2, 3)]
GRID_K = 32
# The grid, in the priority order: tis and bypass at GRID_K x 3 seeds; then one seed of the other methods
# at GRID_K and tis on-policy; then issue 23's RS arms at k = 8 (``RS_ON_K``: the whole ratio's RS already rejects
# every stale token there; with their no-RS reference tis_k8_s1 and the float32-engine control); then the
# top-p comparison at k = 1 (moved before the intermediate k on 2026-12-05: it is a Show item with no data yet, the
# intermediate k is the lowest priority); then the intermediate k = 8 for tis and bypass (plain TRL's k = 8
# seeds are the calibration's); the fourth k = 32 seed of plain TRL last.
# Among the seed-1 arms trl_slow runs first (moved 2026-12-04): it is
# the control that tells bypass's +24 points from a smaller effective step (bypass's behaviour KL 0.18 vs 1.2-2.0).
# Its seed 1 collapsed like plain TRL (95 vs 85/512; AdamW, so half the learning rate is half the parameter step)
# while bypass and TIS held (197, 205): seeds 2-3 of the control (replayed, ~45 min each) follow the seed-1 arms.
GRID = [*(f"{m}_k{GRID_K}_s{s}" for m in ("tis", "bypass") for s in (1, 2, 3)),
        *(f"{m}_k{GRID_K}_s1" for m in ("trl_slow", "decoupled", "trl_is", "direct_gate")),
        *(f"trl_slow_k{GRID_K}_s{s}" for s in (2, 3)), "tis_k1_s1",
        *(f"{m}_k8_s1" for m in ("rs_engine", "rs_direct", "tis", "f32_rs_engine", "f32_rs_direct")),
        *(f"{m}_k1_s{s}" for s in (1, 2) for m in ("topp_trl_is", "topp_decoupled", "topp_recompute")),
        "tis_k8_s2", "tis_k8_s3", *(f"bypass_k8_s{s}" for s in (1, 2, 3)),
        "trl_k32_s4"]
# After the grid (added 2026-12-06, when its 42 cells were done): bypass on-policy, the control that tells the
# objective from the lag correction. Bypass held at k = 8 and 32 where plain TRL fell, but bypass's PPO-clip on
# pi_theta / mu also absorbs the bf16 engine mismatch and clips the step; at k = 1 there is no lag, so its difference
# from plain TRL of the same seed (``trl_k1``) is the objective's alone. Then seed 4 of bypass at k = 32 (replays
# ``trl_k32_s4``'s recording) and at k = 1, so that bypass is paired with all 4 seeds of plain TRL's calibration.
OBJECTIVE_CONTROL = [f"bypass_k1_s{s}" for s in (1, 2, 3)]
FOURTH_SEED = ["bypass_k32_s4", "bypass_k1_s4"]
# Issue 47 (added 2026-12-07): at k = 32 mu is the warm start, so PPO-clip on pi_theta / mu is also a trust region
# around the start. Plain TRL at lr / 4 and lr / 8 (the step-size axis, beyond trl_slow's lr / 2) and with TRL's KL
# penalty to the start (beta 0.1 and 1.0: the anchor axis), all replaying plain TRL's recorded k = 32 rollouts of the
# same seed. Does bypass lie above the frontier these arms trace in (KL from the start, accuracy), or on it? Seed 1's
# lr / 4 cell (262/512, above bypass's 197 and on-policy's 221, at a KL from the start near bypass's) moved lr / 4's
# seeds 2-3 forward, right after seed 1's KL-penalty cell; the rest follows seed by seed.
ANCHOR_CONTROL = ["trl_lr4_k32_s1", "trl_beta01_k32_s1", "trl_lr4_k32_s2", "trl_lr4_k32_s3",
                  *(f"{m}_k{GRID_K}_s1" for m in ("trl_lr8", "trl_beta1")),
                  *(f"{m}_k{GRID_K}_s{s}" for s in (2, 3) for m in ("trl_beta01", "trl_lr8", "trl_beta1"))]
ORDER = [WARMSTART, *CALIBRATION, *CALIBRATION_MAX_LAG, *GRID, *OBJECTIVE_CONTROL, *FOURTH_SEED, *ANCHOR_CONTROL]
# A grid of another CPU vendor (its own ``--results`` folder and warm start, ``check_vendor``): first the cells the
# main grid still lacks, each with its same-seed reference (bypass and tis at k = 8, with trl at k = 8 and k = 1),
# then the main grid's headline at k = 32 (plain TRL vs bypass) on this independent warm start, seed by seed, then
# top-p.
VENDOR_ORDER = [WARMSTART, *(f"{m}_s{s}" for s in (1, 2, 3) for m in ("trl_k8", "bypass_k8", "trl_k1", "tis_k8",
                                                                      "trl_k32", "bypass_k32")),
                *(f"{m}_k1_s{s}" for s in (1, 2) for m in ("topp_trl_is", "topp_decoupled", "topp_recompute"))]


def plan(results_root: Path) -> list[str]:
    """A grid's cells in run order: ``ORDER`` for the main grid (``benchmarks/results/policy_lag``), ``VENDOR_ORDER``
    for a grid in another ``--results`` folder."""
    return ORDER if results_root.name == "policy_lag" else VENDOR_ORDER
REBUILD_ENV = "POLICY_LAG_REBUILD_WARMSTART"  # run_cell -> the cell process: a rebuild of the committed warm start
RECORD_ENV, REPLAY_ENV = "POLICY_LAG_RECORD_ROLLOUTS", "POLICY_LAG_REPLAY_ROLLOUTS"  # run_cell -> the cell: a path
REPLAY_MISMATCH = "rollout replay mismatch"  # rollout_replay.MISMATCH: a cell that fails with it is generated instead
ROLLOUTS = "rollouts.json.gz"  # benchmarks/rollout_replay.py's recording
KEEP_FILES = ("eval.json", "results.json", "log.jsonl", "curve.jsonl", "cell_meta.json", ROLLOUTS)
# The flags that decide what a never-synced engine samples (with the warm start's weights and the code): two cells
# with equal values replay each other's rollouts; the cell process checks the rest (rollout_replay.py).
ROLLOUT_FLAGS = ("--seed", "--max_steps", "--per_device_train_batch_size", "--rollout_sync_interval", "--top_p",
                 "--top_k", "--temperature", "--rollout_dtype", "--max_completion_length")


def parse_cell(name: str) -> tuple[str, int, int]:
    """``<method>_k<interval>[_s<seed index>]`` -> (method, sync interval k, seed index, 1 when absent).

    Raises:
        ValueError: an unknown method or a malformed name (the message lists the methods).
    """
    parts = name.split("_")
    seed = int(parts.pop()[1:]) if parts[-1].startswith("s") and parts[-1][1:].isdigit() else 1
    lag = parts.pop() if parts else ""
    method = "_".join(parts)
    if method not in METHODS or not lag.startswith("k") or not lag[1:].isdigit() or int(lag[1:]) < 1:
        raise ValueError(f"cell {name!r} is not <method>_k<k>[_s<seed>] with k >= 1; methods: {sorted(METHODS)}")
    return method, int(lag[1:]), seed


def cell_flags(name: str, out: Path, args: argparse.Namespace, root: Path = ROOT) -> list[str]:
    """The recipe flags of one cell (``warmstart`` or ``<method>_k<k>[_s<seed>]``); ``root``: the source tree whose
    recipe configs it reads (``warmstart_tree`` for a rebuilt warm start)."""
    common = ["--output_dir", str(out), "--plots", "false", "--torch_threads", "1", "--eval_size", "0"]
    if name == WARMSTART:
        return ["--config", str(root / "recipes" / "configs" / f"{NO_CORR}.yaml"), "--model_name_or_path",
                BASE_MODEL, "--vllm_importance_sampling_correction", "false", *common, *WARMSTART_FLAGS,
                "--max_steps", str(args.warmstart_steps)]
    method, k, seed = parse_cell(name)
    config, extra = METHODS[method]
    lr = args.lr * LR_SCALE.get(method, 1.0)
    return ["--config", str(root / "recipes" / "configs" / f"{config}.yaml"), "--model_name_or_path",
            str(Path(args.out) / WARMSTART), "--rollout_sync_interval", str(k), "--seed", str(41 + seed),
            "--max_steps", str(args.steps), "--per_device_train_batch_size", str(4 * args.prompts),
            "--learning_rate", repr(lr), *common, *extra]


# ----------------------------------------------------------------------------------------------- inside a cell
def greedy_eval(trainer, task, n: int, max_tokens: int, batch: int = 128) -> dict:
    """Greedy accuracy of the trainer's float32 policy on the first ``n`` items of ``task``.

    ``transformers.generate`` on the trainer's own model (left padding, fixed batches of ``batch`` prompts in item
    order, no sampling, under ``torch.random.fork_rng`` so the training's random stream is untouched), not the
    vLLM engine: on this CPU (AVX2, no native bf16) the bf16 engine decodes about 5x slower than float32, and the
    held-out evaluation is of the learned (float32) policy, identical for every cell.

    Returns:
        ``{"accuracy", "correct", "total", "scores", "mean_completion_tokens", "seconds"}``; scores are 0/1 per item
        in item order.
    """
    import torch
    from transformers import GenerationConfig

    tok, model, t0 = trainer.processing_class, trainer.accelerator.unwrap_model(trainer.model), time.perf_counter()
    config = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
    scores, n_tok, side, was_training = [], 0, tok.padding_side, model.training
    tok.padding_side = "left"
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng():
            for lo in range(0, n, batch):
                idx = range(lo, min(lo + batch, n))
                texts = [tok.apply_chat_template(task.messages(i), tokenize=False, add_generation_prompt=True)
                         for i in idx]
                enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
                out = model.generate(**enc, generation_config=config)[:, enc["input_ids"].shape[1]:]
                n_tok += int((out != tok.pad_token_id).sum())
                scores += [task.score(t, i) for i, t in zip(idx, tok.batch_decode(out, skip_special_tokens=True))]
    finally:
        tok.padding_side = side
        model.train(was_training)
    correct = int(sum(scores))
    return {"accuracy": correct / n, "correct": correct, "total": n, "scores": scores,
            "mean_completion_tokens": n_tok / n, "seconds": round(time.perf_counter() - t0, 1)}


def _trainer_class(method: str, out: Path, check_every: int, check_size: int, eval_size: int, held_out,
                   max_tokens: int):
    """The cell's trainer: ours (or the ``trl_is`` variant) plus the evaluations (``greedy_eval``): the held-out
    set before training (the warm start only: a cell starts from the warm start's final weights, whose scores are
    committed) and after, and a ``check_size`` check every ``check_every`` steps and at step 0 (curve.jsonl).
    Rebuilding the committed warm start (``REBUILD_ENV`` set by ``run_cell``) runs only the final evaluation, the one
    compared with the committed scores (the others are committed already and cost about 8 minutes; ``greedy_eval``
    leaves the training's random stream untouched, so skipping them changes no weight)."""
    from transformers import TrainerCallback

    REBUILD = method == WARMSTART and os.environ.get(REBUILD_ENV) == "1"

    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    class EvalCallback(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.evals = trainer, {}

        def _check(self, step: int) -> None:
            r = greedy_eval(self.trainer, held_out, check_size, max_tokens)
            with (out / "curve.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, **r}) + "\n")

        def on_train_begin(self, args, state, control, **kwargs):
            if REBUILD:
                return
            if method == WARMSTART:
                self.evals["before"] = greedy_eval(self.trainer, held_out, eval_size, max_tokens)
            self._check(0)

        def on_step_end(self, args, state, control, **kwargs):
            if REBUILD:
                return
            if state.global_step % check_every == 0 and state.global_step < args.max_steps:
                self._check(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self.evals["after"] = greedy_eval(self.trainer, held_out, eval_size, max_tokens)
            (out / "eval.json").write_text(json.dumps({**self.evals, "max_tokens": max_tokens}))

    class CellTrainer(RolloutCorrGRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if method in TRL_IS_METHODS:
                if not self.vllm_importance_sampling_correction:
                    raise ValueError("trl_is needs vllm_importance_sampling_correction=True.")
                self.use_vllm = True  # TRL 1.16 gates its vLLM IS on this attribute alone
            self.add_callback(EvalCallback(self))
            for env, mode in ((RECORD_ENV, "record"), (REPLAY_ENV, "replay")):
                if os.environ.get(env):  # run_cell's rollout_plan (k >= steps: the engine is never synced again)
                    from rollout_replay import RecordedRollout

                    self.rollout_func = RecordedRollout(self.rollout_func, os.environ[env], mode)

        def _generate(self, prompts):
            if method not in TRL_IS_METHODS:
                return super()._generate(prompts)
            self.use_vllm = False  # no TRL vLLM engine to sync: the rollout_func generates
            try:
                return super()._generate(prompts)
            finally:
                self.use_vllm = True

    return CellTrainer


def run_cell_in_process(name: str, flags: list[str], check_every: int, check_size: int, eval_size: int,
                        max_tokens: int) -> None:
    """The ``--run-cell`` entry point: parse the recipe's flags and run its ``main`` with the cell's trainer (the
    recipe's own vLLM evaluation is off: ``--eval_size 0``; ``greedy_eval`` scores instead)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import grpo_recipe_utils as ru
    from grpo_rollout_corr import ModelConfig, RolloutCorrGRPOConfig, ScriptArguments, TrlParser, main

    parser = TrlParser((ScriptArguments, RolloutCorrGRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=flags)
    _, held_out = ru.make_task_splits(script_args.task, json.loads(script_args.task_config), script_args.train_size,
                                      script_args.train_seed, eval_size, script_args.eval_seed,
                                      script_args.instruction)
    out = Path(training_args.output_dir)
    (out / "curve.jsonl").write_text("")
    method = WARMSTART if name == WARMSTART else parse_cell(name)[0]
    cls = _trainer_class(method, out, check_every, min(check_size, eval_size), eval_size, held_out, max_tokens)
    main(script_args, training_args, model_args, trainer_cls=cls)


# ----------------------------------------------------------------------------------------------- the runner
def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    for attempt in range(20):  # another git process (a merge, a commit) may hold the index lock for a moment
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
        if proc.returncode == 0 or "index.lock" not in proc.stderr:
            break
        time.sleep(3)
    if check and proc.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


@contextlib.contextmanager
def file_lock(path: Path, wait: bool = True):
    """Hold an exclusive ``fcntl`` lock on ``path`` (created, parents too) for the ``with`` body; yields True when
    held. With ``wait`` False a lock another process holds is not waited for: yields False at once. The lock goes
    with its process, so a runner killed mid-way never leaves a stale lock behind."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True


def commit_cell(results: Path, name: str, summary: str) -> None:
    """Commit ``results/<name>`` alone (``git commit -- <path>``: nothing else staged is taken along), holding an
    exclusive lock on ``.git/rollout-corr-commit.lock`` so that two runners side by side never meet git's index
    lock."""
    repo = Path(_git(results, "rev-parse", "--show-toplevel").stdout.strip())
    path = str((results / name).resolve().relative_to(repo))
    git_dir = Path(_git(repo, "rev-parse", "--absolute-git-dir").stdout.strip())
    with file_lock(git_dir / "rollout-corr-commit.lock"):
        _git(repo, "add", "--", path)
        _git(repo, "commit", "-q", "-m", f"results: {results.name}/{name} ({summary})", "--", path)


def cpu_fingerprint(cpuinfo: str | None = None) -> dict:
    """The runner machine's CPU as ``/proc/cpuinfo`` gives it: model name and its widest x86 vector extensions
    (``{"model": "AMD EPYC", "avx2": True, "avx512f": True, "avx512_bf16": True}``; ``{}`` where it cannot be read).
    Recorded in each cell's ``cell_meta.json`` beside ``cpu_kernels``: the kernels a cell ran are those, not these."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines()[:64] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", ""), "vendor_id": fields.get("vendor_id", ""),
            **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16")}}


def cpu_vendor(model: str, vendor_id: str = "") -> str | None:
    """``"AMD"`` or ``"Intel"`` from a ``cpu_fingerprint``'s ``vendor_id`` (``AuthenticAMD`` / ``GenuineIntel``,
    recorded since 2026-12-06) or else its model name (None where neither says: a VM may show a generic name). The
    vendor decides a grid's float32 bits: torch's BLAS (MKL) takes other code paths on Intel than on AMD even at
    the pinned AVX2 kernels (measured: the warm start rebuilt on an Intel Xeon scored 171/512, not AMD's 203/512)."""
    ids = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}
    if vendor_id in ids:
        return ids[vendor_id]
    for vendor in ("AMD", "Intel"):
        if vendor.lower() in model.lower():
            return vendor
    return None


def vendor_of(cpu: dict | None = None) -> str | None:
    """``cpu_vendor`` of a ``cpu_fingerprint`` record (this machine's when ``cpu`` is None; an empty record: None)."""
    cpu = cpu_fingerprint() if cpu is None else cpu
    return cpu_vendor(cpu.get("model", ""), cpu.get("vendor_id", ""))


def grid_vendor(results: Path) -> str | None:
    """The CPU vendor a grid's committed cells ran on (``cell_meta.json``'s ``cpu`` model; cells from before that
    field count as unknown), None when no committed cell says.

    Raises:
        RuntimeError: the committed cells ran on more than one vendor (such a grid has no single warm start)."""
    cpus = [json.loads(m.read_text()).get("cpu") or {} for m in results.glob("*/cell_meta.json")]
    found = {vendor_of(c) for c in cpus} - {None}
    if len(found) > 1:
        raise RuntimeError(f"{results} holds cells from CPUs of several vendors ({sorted(found)}): its cells are not "
                           "comparable; move the odd ones to a grid of their own.")
    return found.pop() if found else None


def check_vendor(results: Path, here: str | None = None) -> None:
    """Refuse to run cells of a grid committed on another CPU vendor than this machine's (``here``: this machine's
    vendor, read from ``/proc/cpuinfo`` when None). Such a machine cannot rebuild the grid's warm start bit for bit,
    so every cell it ran would start elsewhere; the check costs nothing, the failed rebuild 15-40 minutes.

    Raises:
        RuntimeError: naming both vendors and the two ways on (a machine of the grid's vendor, or this vendor's own
            grid under another ``--results`` folder, e.g. ``benchmarks/results/policy_lag_intel``)."""
    want = grid_vendor(results)
    if here is None:
        here = vendor_of()
    if want and here != want:
        raise RuntimeError(
            f"the grid in {results} was run on {want} CPUs and this machine's is {here or 'unknown'}: MKL's float32 "
            f"bits differ by vendor, so its warm start cannot be rebuilt here (docs/reference/known-limits.md). Run "
            f"it on a(n) {want} machine, or run this vendor's own grid: --results benchmarks/results/policy_lag_"
            f"{(here or 'other').lower()} (its own warm start; its report goes to its own RESULTS.md section).")


def code_revision() -> str:
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "trl_rollout_corr", "recipes",
                            "benchmarks/policy_lag_experiment.py", "benchmarks/rollout_replay.py"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("+dirty" if dirty else "")


def lag_check(name: str, log: list[dict], engine_kl_max: float) -> list[str]:
    """The lag-accounting violations of one finished cell (empty when it passes; see the module docstring).

    A step on which ``max_policy_lag`` dropped every sample (``rollout_corr/policy_lag_dropped_fraction`` 1.0, e.g.
    ``direct_gate`` past lag 4) has no kept token to measure a KL on, so it logs no ``k3_kl``: its lag range is still
    checked, its KL is not. A missing ``k3_kl`` on any other step, or a missing ``policy_lag_max``, is a violation."""
    k = 1 if name == WARMSTART else parse_cell(name)[1]
    steps = [r for r in log if "loss" in r and "step_time" in r]
    problems = []
    fresh = 0
    for i, r in enumerate(steps):
        lag_max, lag_mean, kl = (r.get(f"rollout_corr/{m}") for m in ("policy_lag_max", "policy_lag_mean", "k3_kl"))
        all_dropped = r.get("rollout_corr/policy_lag_dropped_fraction") == 1.0
        if lag_max is None or (kl is None and not all_dropped):
            problems.append(f"step {r['step']}: no policy_lag_max / k3_kl logged")
            continue
        if not 0 <= lag_max <= k - 1:
            problems.append(f"step {r['step']}: policy_lag_max {lag_max} outside [0, {k - 1}]")
        if lag_mean == 0:
            fresh = i
            if kl is not None and kl > engine_kl_max:
                problems.append(f"step {r['step']}: lag 0 but k3_kl {kl:.4f} > {engine_kl_max} (engine level)")
        elif i - fresh >= k:
            problems.append(f"step {r['step']}: no lag-0 step in the last {k} steps")
    return problems


TIMING_KEYS = ("time", "cpu_time", "step_time", "train_runtime", "train_samples_per_second",
               "train_steps_per_second", "rollout/vllm_generate_s", "rollout/vllm_sync_s", "rollout/vllm_async_wait_s")


def same_training(a: Path, b: Path) -> list[str]:
    """The logged steps on which two cell folders' training metrics differ (every ``log.jsonl`` value except
    wall/CPU timings; exact float equality): empty when the two runs trained bit-identically (e.g. a cell run alone
    and the same cell run beside another, 1 torch thread each)."""
    def steps(folder):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
                for r in _read_jsonl(folder / "log.jsonl") if "run_config" not in r]

    sa, sb = steps(a), steps(b)
    diff = [f"step {x.get('step')}: " + ", ".join(sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k)))
            for x, y in zip(sa, sb) if x != y]
    return diff + ([f"{len(sa)} vs {len(sb)} logged steps"] if len(sa) != len(sb) else [])


def rollout_key(flags: list[str]) -> dict:
    """The ``ROLLOUT_FLAGS`` values of a cell's recipe flags (the last occurrence wins, as in the parser)."""
    return {f: v for f, v in zip(flags, flags[1:]) if f in ROLLOUT_FLAGS}


def rollout_plan(name: str, flags: list[str], args: argparse.Namespace) -> tuple[str, Path | None]:
    """How a cell gets its rollouts: ``("generate", None)``, ``("record", None)`` or ``("replay", <recording>)``.

    A cell whose sync interval k is at least ``--steps`` never syncs the engine after its first call, so its rollouts
    depend only on ``rollout_key``: it replays the recording (``ROLLOUTS``) of a committed cell with the same key,
    or records its own for the later ones. Other cells (and the warm start) generate."""
    if name == WARMSTART or parse_cell(name)[1] < args.steps:
        return "generate", None
    key = rollout_key(flags)
    for folder in sorted(Path(args.results).iterdir()) if Path(args.results).is_dir() else []:
        meta = folder / "cell_meta.json"
        if folder.name != name and (folder / ROLLOUTS).exists() and meta.exists() and \
                rollout_key(json.loads(meta.read_text())["flags"]) == key:
            return "replay", folder / ROLLOUTS
    return "record", None


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def warmstart_tree(results: Path, out_root: Path) -> Path:
    """The source tree that rebuilds the committed warm start: this checkout when its code revision is the one in
    ``results/cell_meta.json``, else a git worktree of that revision under ``out_root`` (made once, kept). The warm
    start is defined by its recipe *and* its code: later changes may move training values in the last float bits
    (measured: today's code rebuilt it to 135/512 held-out, its own revision to the committed 203/512), and every
    cell must start from the one checkpoint.

    Raises:
        RuntimeError: the committed revision was dirty (no tree reproduces it) or is not in this repository."""
    rev = json.loads((results / "cell_meta.json").read_text())["code"]
    if rev.endswith("+dirty"):
        raise RuntimeError(f"the committed warm start ran from uncommitted changes ({rev}): no revision rebuilds it; "
                           "delete benchmarks/results/policy_lag to restart the grid.")
    if code_revision() == rev:
        return ROOT
    tree = out_root / f"warmstart_code_{rev[:12]}"
    if not (tree / ".git").exists():
        _git(ROOT, "worktree", "add", "--detach", "-f", str(tree), rev)
    print(f"=== warmstart: rebuilt from its committed code revision {rev[:12]} ({tree})", flush=True)
    return tree


def run_cell(name: str, args: argparse.Namespace) -> None:
    """Run one cell in a fresh process unless ``--results/<name>/eval.json`` exists; copy its small outputs to
    ``--results`` and (``--commit``) commit them."""
    results, out = Path(args.results) / name, Path(args.out) / name
    if (results / "eval.json").exists() and not (name == WARMSTART and not (out / "model.safetensors").exists()):
        print(f"=== {name}: committed already ({results})", flush=True)
        return
    if name != WARMSTART and not (Path(args.out) / WARMSTART / "model.safetensors").exists():
        run_cell(WARMSTART, args)
    out.mkdir(parents=True, exist_ok=True)
    rebuild = name == WARMSTART and (results / "eval.json").exists()
    root = warmstart_tree(results, Path(args.out)) if rebuild else ROOT  # its committed code, not today's
    flags = cell_flags(name, out, args, root)
    cmd = [sys.executable, str(root / "benchmarks" / Path(__file__).name), "--run-cell", name, str(args.check_every),
           str(args.check_size), str(args.eval_size), str(args.eval_max_tokens), "--", *flags]
    print(f">>> {name}: {' '.join(cmd)}", flush=True)
    pin = [str(AVX2_KERNELS)] if args.cpu_kernels == "avx2" else []  # benchmarks/avx2_kernels/sitecustomize.py
    path = [str(root), *pin, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p),
           "OMP_NUM_THREADS": "1", REBUILD_ENV: str(int(rebuild))}
    for var in (RECORD_ENV, REPLAY_ENV):  # only rollout_plan's choice reaches the cell, never an exported one
        env.pop(var, None)
    plan, source = rollout_plan(name, flags, args)
    (out / ROLLOUTS).unlink(missing_ok=True)
    (results / ROLLOUTS).unlink(missing_ok=True)  # an earlier run's recording never goes in with this one
    if plan == "record":
        env[RECORD_ENV] = str(out / ROLLOUTS)
    elif plan == "replay":
        env[REPLAY_ENV] = str(source)
        print(f"=== {name}: replays the rollouts of {source.parent.name}", flush=True)

    def run() -> tuple[subprocess.CompletedProcess, float, float, os.times_result]:
        t0, load, cpu0 = time.time(), os.getloadavg()[0], os.times()  # this run's own time
        with open(out / "run.log", "w") as log:
            return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, env=env), t0, load, cpu0

    proc, t0, load, cpu0 = run()
    how = plan if plan != "replay" else f"replayed from {source.parent.name}"
    if proc.returncode and plan == "replay" and REPLAY_MISMATCH in (out / "run.log").read_text(errors="replace"):
        # a rollout call that differs from the recording (rollout_replay's MISMATCH; other failures fail the cell)
        print(f"!!! {name}: replay mismatch (rc {proc.returncode}; {out / 'run.log'} kept as replay_failed.log); "
              "generating instead", flush=True)
        shutil.move(out / "run.log", out / "replay_failed.log")
        env.pop(REPLAY_ENV)
        plan, env[RECORD_ENV] = "record", str(out / ROLLOUTS)
        how = f"record (the replay of {source.parent.name} did not match: replay_failed.log, not committed)"
        proc, t0, load, cpu0 = run()
    cpu1 = os.times()
    meta = {"cell": name, "flags": flags, "code": code_revision(), "wall_s": round(time.time() - t0, 1),
            "cpu_s": round((cpu1.children_user + cpu1.children_system)
                           - (cpu0.children_user + cpu0.children_system), 1),
            "load_before": load, "load_after": os.getloadavg()[0], "returncode": proc.returncode,
            "jobs": args.jobs, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rollouts": how, "cpu_kernels": args.cpu_kernels, "cpu": cpu_fingerprint()}
    if proc.returncode:
        print(f"!!! {name}: rc {proc.returncode}; see {out / 'run.log'}", flush=True)
        return
    meta["lag_check"] = lag_check(name, _read_jsonl(out / "log.jsonl"), args.engine_kl_max) or "passed"
    if name != WARMSTART:  # the step-0 check is the warm start's first evaluation batch: bit-identical scores
        start = _read_jsonl(out / "curve.jsonl")[0]["scores"]
        warm = json.loads((Path(args.results) / WARMSTART / "eval.json").read_text())["after"]["scores"]
        meta["starts_at_warm_start"] = start == warm[:len(start)]
    if name == WARMSTART and (results / "eval.json").exists():  # a rebuilt checkpoint: the same run?
        old = json.loads((results / "eval.json").read_text())["after"]["scores"]
        new = json.loads((out / "eval.json").read_text())["after"]["scores"]
        if old != new:  # never a start for the cells: the next runner rebuilds it
            shutil.move(out / "model.safetensors", out / "model.not_the_committed_warm_start.safetensors")
            raise RuntimeError(f"the rebuilt warm start scores {sum(new)}/{len(new)} held-out items, the committed "
                               f"one {sum(old)}/{len(old)}: the checkpoint is not the committed one (other "
                               "versions, threads or CPU kernels: --cpu-kernels avx2?; a CPU of another vendor: the "
                               "committed grid rebuilds on AMD EPYC, not on Intel Xeon, "
                               "docs/reference/known-limits.md). Run the remaining cells on such a machine, or "
                               "delete benchmarks/results/policy_lag to restart the grid.")
        print(f"=== {name}: rebuilt, same held-out scores as committed", flush=True)
        return
    (out / "cell_meta.json").write_text(json.dumps(meta, indent=1))
    results.mkdir(parents=True, exist_ok=True)
    for f in KEEP_FILES:
        if (out / f).exists():
            shutil.copy2(out / f, results / f)
    (results / "run_tail.log").write_text("\n".join((out / "run.log").read_text().splitlines()[-60:]) + "\n")
    res = json.loads((out / "eval.json").read_text())
    summary = (f"{res['after']['correct']}/{res['after']['total']} after, "
               f"{meta['wall_s']:.0f} s, lag check {'passed' if meta['lag_check'] == 'passed' else 'FAILED'}")
    print(f"<<< {name}: {summary}", flush=True)
    if args.commit:
        commit_cell(Path(args.results), name, summary)


# ----------------------------------------------------------------------------------------------- the report
def summarize(results: Path) -> dict:
    log = _read_jsonl(results / "log.jsonl")
    steps = [r for r in log if "loss" in r and "step_time" in r]
    res = json.loads((results / "eval.json").read_text())
    meta = json.loads((results / "cell_meta.json").read_text()) if (results / "cell_meta.json").exists() else {}

    def series(key):
        return [r.get(key) for r in steps]

    icepop = results.name != WARMSTART and parse_cell(results.name)[0] == "direct_gate"  # band: outside = zeroed

    def trained(r):  # fraction of completion tokens that carry gradient after RS, IcePop and the lag filter
        # RS fractions are over valid tokens; invalid ones (NaN/inf log-prob; support misses under recompute) never
        # train
        kept = (1.0 - rs_masked_fraction(r)) * (1.0 - (r.get("rollout_corr/invalid_token_fraction") or 0.0))
        if icepop:
            kept *= 1.0 - sum(r.get(f"rollout_corr/rollout_is_ratio_fraction_{s}") or 0.0 for s in ("high", "low"))
        return kept * (1.0 - (r.get("rollout_corr/policy_lag_dropped_token_fraction") or 0.0))

    return {"steps": steps, "before": res.get("before"), "after": res.get("after"), "meta": meta,
            "curve": _read_jsonl(results / "curve.jsonl"), "trained": [trained(r) for r in steps],
            "series": series}


ROLLOUT_SERIES = ("reward", "completions/mean_length")  # decided by the completions alone, not by the update


def same_rollouts(cells: dict) -> list[str]:
    """One line per seed at k >= the steps (never synced) with two cells or more: are every step's
    ``ROLLOUT_SERIES`` values equal in all that seed's cells, generated, recorded and replayed? (They must be: the
    same completions.)"""
    groups: dict = {}
    for n, c in cells.items():
        k_seed = None if n == WARMSTART else parse_cell(n)[1:]
        if k_seed and k_seed[0] >= len(c["steps"]) > 0:
            groups.setdefault(k_seed, []).append(n)
    out = []
    for (k, seed), names in sorted(groups.items()):
        if len(names) < 2:
            continue
        ref = names[0]
        differ = {n: [i + 1 for i, (a, b) in enumerate(zip(*(
            [tuple(r.get(key) for key in ROLLOUT_SERIES) for r in cells[m]["steps"]] for m in (ref, n)))) if a != b]
            for n in names[1:]}
        bad = {n: steps for n, steps in differ.items() if steps}
        out.append(f"* k = {k}, seed {seed}: " + (
            f"per-step {' and '.join(ROLLOUT_SERIES)} identical in all {len(names)} cells ({', '.join(names)})"
            if not bad else "DIFFERENT rollouts: " + "; ".join(f"{n} vs {ref} at steps {st}" for n, st in bad.items()))
            + ".")
    return out


def rs_masked_fraction(r: dict) -> float:
    """One logged step's RS-rejected token fraction: ``rollout_corr/rollout_rs_masked_fraction``, or
    ``rollout_rs_engine_masked_fraction`` when RS judged the engine factor (``rollout_rs_on=engine``); 0 without RS."""
    for key in ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_rs_engine_masked_fraction"):
        if r.get(key) is not None:
            return r[key]
    return 0.0


def mcnemar(a: list, b: list) -> tuple[int, int, float]:
    """Exact McNemar test of two paired 0/1 score lists: (a right b wrong, a wrong b right, two-sided p)."""
    from scipy.stats import binomtest

    n10 = sum(1 for x, y in zip(a, b) if x and not y)
    n01 = sum(1 for x, y in zip(a, b) if y and not x)
    p = binomtest(n10, n10 + n01, 0.5).pvalue if n10 + n01 else 1.0
    return n10, n01, p


def paired(a: list, b: list) -> tuple[float, float]:
    """mean(a - b) over the same items and its paired standard error (accuracy fraction)."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.fmean(xs) if xs else float("nan")


INTRO = " ".join("""
Every cell starts from the shared `warmstart` checkpoint (on-policy plain TRL from the base model, `{flags}`, 16
steps by default), syncs the vLLM CPU engine every k optimizer steps, and is scored greedily on the same held-out
problems before and after. *vs reference* compares a cell's final scores item by item with its reference cell's
(mean difference ± paired s.e., and the exact McNemar p): plain TRL at the same k and seed (`topp_trl_is` for the
top-p cells), and for plain TRL at k > 1 plain TRL at k = 1 and the same seed (the effect of the lag itself).
Per-step means: `rollout_corr/kl` and `k3_kl` (nats/token, behaviour vs trainer), trained = fraction of completion
tokens left after RS, IcePop zeroing, the lag filter and invalid log-probs. Generated from the committed cells under
`benchmarks/results/{folder}/` (`--report-only`).
""".split())


def markers(results_root: Path) -> tuple[str, str]:
    """The BEGIN / END markers of a grid's generated section in RESULTS.md: the main grid (``policy_lag``) keeps
    ``BEGIN`` / ``END``; a grid in another ``--results`` folder (e.g. ``policy_lag_intel``) gets markers with its
    folder's name, so that neither report overwrites the other."""
    if results_root.name == "policy_lag":
        return BEGIN, END
    return BEGIN.replace(" -->", f": {results_root.name} -->"), END.replace(" -->", f": {results_root.name} -->")


def report(results_root: Path, figure: bool = True, engine_kl_max: float = 0.03) -> str:
    begin, end = markers(results_root)
    grid = "" if results_root.name == "policy_lag" else f", grid `benchmarks/results/{results_root.name}`"
    found = [c for c in results_root.iterdir() if (c / "eval.json").exists()] if results_root.exists() else []
    # numeric order (trl_k8 before trl_k32); the warm start, not a <method>_k<k> name, last as before
    found.sort(key=lambda c: (1, c.name, 0, 0) if c.name == WARMSTART else (0, *parse_cell(c.name)))
    cells = {c.name: summarize(c) for c in found}
    lines = [begin, "", "### Policy lag: stale vLLM CPU rollouts, with and without correction "
             f"(`benchmarks/policy_lag_experiment.py`{grid})", "",
             INTRO.format(flags=" ".join(WARMSTART_FLAGS), folder=results_root.name), "",
             "| cell | steps | held-out before -> after | vs reference (paired s.e.) | McNemar p "
             "| mean kl / k3 "
             "| mean lag | trained | grad norm | entropy | length | clipped | zero-std groups | step s | wall s "
             "| lag check |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    failed: dict[str, list[str]] = {}  # cell -> its lag-check violations: left out of issue 47's pooled figures
    for name, s in cells.items():
        ref_name = reference_cell(name)
        ref = cells.get(ref_name) if ref_name else None
        b = s["before"] or (cells.get(WARMSTART) or {}).get("after") or {}  # a cell starts at the warm start
        a = s["after"] or {}
        vs, p = "—", "—"
        if ref:
            m, se = paired(a["scores"], ref["after"]["scores"])
            vs, p = f"{100 * m:+.1f} ± {100 * se:.1f} pts", f"{mcnemar(a['scores'], ref['after']['scores'])[2]:.2g}"
        ser = s["series"]
        check = lag_check(name, s["steps"], engine_kl_max)  # recomputed: the committed log is the evidence
        if s["meta"].get("starts_at_warm_start") is False:
            check.append("the step-0 check differs from the warm start's scores")
        if check:
            failed[name] = check
        lines.append(
            f"| {name} | {len(s['steps'])} | {b.get('correct')} -> {a.get('correct')}/{a.get('total')} | {vs} | {p} "
            f"| {_mean(ser('rollout_corr/kl')):.4f} / {_mean(ser('rollout_corr/k3_kl')):.4f} "
            f"| {_mean(ser('rollout_corr/policy_lag_mean')):.2f} "
            f"| {_mean(s['trained']):.3f} | {_mean(ser('grad_norm')):.3f} | {_mean(ser('entropy')):.2f} "
            f"| {_mean(ser('completions/mean_length')):.1f} | {_mean(ser('completions/clipped_ratio')):.2f} "
            f"| {_mean(ser('frac_reward_zero_std')):.2f} | {_mean(ser('step_time')):.1f} "
            f"| {s['meta'].get('wall_s', 0):.0f} | {'FAILED: ' + '; '.join(check) if check else 'passed'} |")
    replayed = {n: c["meta"]["rollouts"] for n, c in cells.items()
                if str(c["meta"].get("rollouts", "")).startswith("replayed")}
    if replayed:
        lines += ["", "Rollouts replayed, not generated (`benchmarks/rollout_replay.py`: at k >= steps the engine "
                  "keeps the warm start's weights, so a seed's rollouts are the same in every cell; each call is "
                  "checked against the recording and continues its random state; their step and wall times leave "
                  "out generation): " + "; ".join(f"{n} {how}" for n, how in replayed.items()) + "."]
    same = same_rollouts(cells)
    if same:
        lines += ["", "Never-synced cells (k >= steps) see the same completions in every method (the update alone "
                  "differs):", "", *same]
    controls = control_table(cells, plan(results_root))
    # issue 23's table where the grid plans or holds an RS arm (a vendor grid plans none; its tis_k8 is a method arm)
    rs_on = results_root.name == "policy_lag" or any(
        n != WARMSTART and parse_cell(n)[0] in RS_ON_ARMS and parse_cell(n)[0] != "tis" for n in cells)
    lines += ["", *seed_table(cells), *([""] + controls if controls else []),
              *(["", *rs_on_table(cells)] if rs_on else []), "", *topp_table(cells)]
    anchor = anchor_table(cells, failed, plan(results_root))
    lines += ["", *reanalysis_tables(cells, failed), *(["", *anchor] if anchor else [])]
    missing = [c for c in plan(results_root) if c not in cells]
    if missing:
        lines += ["", f"Not run yet ({len(missing)} of the planned cells): {', '.join(missing)}."]
    if figure and any(n != WARMSTART for n in cells):
        acc, curves = f"{results_root.name}_accuracy.png", f"{results_root.name}_curves.png"  # policy_lag_*.png
        plot(cells, ROOT / "benchmarks" / acc, ROOT / "benchmarks" / curves)
        lines += ["", f"![final accuracy against k]({acc})", "", f"![per-step curves]({curves})"]
        if anchor:
            name = f"{results_root.name}_anchor.png"  # policy_lag_anchor.png
            plot_anchor(cells, failed, ROOT / "benchmarks" / name)
            lines += ["", f"![anchor or correction: endpoints against the KL from the start at k = {GRID_K}]({name})"]
    lines += ["", end]
    return "\n".join(lines)


def seed_table(cells: dict) -> list[str]:
    """Each (method, k) arm over its seeds: mean and standard deviation of the final accuracy, the difference of arm
    means with its reference arm (``reference_cell``'s rule; standard error over seeds, Welch), and the same
    difference paired by seed (the mean of the same-seed differences, s.e. = their s.d. / sqrt(seeds in both))."""
    arms: dict[tuple[str, int], dict[int, float]] = {}
    for name, s in cells.items():
        if name != WARMSTART and s.get("after"):
            method, k, seed = parse_cell(name)
            arms.setdefault((method, k), {})[seed] = s["after"]["accuracy"]
    if not arms:
        return []
    out = ["| arm | seeds | final accuracy mean ± sd | minus its reference arm (s.e. over seeds) "
           "| paired by seed: mean ± s.e. (seeds) |", "|---|---|---|---|---|"]
    for (method, k), by_seed in sorted(arms.items()):
        accs = list(by_seed.values())
        sd = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        # the reference arm, as reference_cell: trl (topp_trl_is) at the same k; trl at k = 1 for trl at k > 1
        ref_arm = (method, 1) if method == reference(method) else (reference(method), k)
        ref = arms.get(ref_arm) if ref_arm != (method, k) else None
        diff = paired_diff = "—"
        if ref and len(ref) > 1 and len(accs) > 1:
            se = math.sqrt(statistics.variance(accs) / len(accs) + statistics.variance(list(ref.values())) / len(ref))
            diff = (f"{100 * (statistics.fmean(accs) - statistics.fmean(ref.values())):+.1f} ± {100 * se:.1f} pts "
                    f"(vs {ref_arm[0]}_k{ref_arm[1]})")
        both = [by_seed[s] - ref[s] for s in sorted(by_seed) if ref and s in ref]
        if len(both) > 1:
            sd_both = statistics.stdev(both)
            paired_diff = (f"{100 * statistics.fmean(both):+.1f} ± {100 * sd_both / math.sqrt(len(both)):.1f} pts "
                           f"({len(both)}; sd {100 * sd_both:.1f})")
        spread = f" ± {100 * sd:.1f}" if len(accs) > 1 else " (one seed: no sd)"
        out.append(f"| {method}_k{k} | {len(accs)} | {100 * statistics.fmean(accs):.1f}{spread} % | {diff} "
                   f"| {paired_diff} |")
    return out


# issue 23: RS on the engine factor vs on the whole ratio vs no RS, at k = 8 and the same seed
RS_ON_ARMS = {  # method -> (the ratio RS judges, rollout engine dtype)
    "rs_engine": ("engine factor pi_train@v / mu", "bfloat16"),
    "rs_direct": ("whole ratio pi_old / mu", "bfloat16"),
    "tis": ("no RS", "bfloat16"),
    "f32_rs_engine": ("engine factor pi_train@v / mu", "float32"),
    "f32_rs_direct": ("whole ratio pi_old / mu", "float32"),
}
RS_ON_PAIRS = (("rs_engine", "rs_direct"), ("rs_engine", "tis"), ("rs_direct", "tis"),
               ("f32_rs_engine", "f32_rs_direct"))
RS_ON_K = 8


def trained_token_fraction(s: dict) -> tuple[float, float, float]:
    """A cell's trained-token fraction (1 - invalid, RS-rejected, IcePop-zeroed and lag-dropped; ``summarize``'s
    per-step ``trained``) over all its logged steps, its lag-0 steps and its stale steps
    (``rollout_corr/policy_lag_mean`` 0 / > 0), each weighted by the step's completion tokens
    (``rollout_corr/num_valid_tokens`` / (1 - ``invalid_token_fraction``); 1 where not logged): (all, lag 0, stale),
    NaN for a group without steps.

    Raises:
        ValueError: a step whose every completion token was invalid (its token count is not in the log)."""
    def weight(r):  # the step's completion tokens: valid ones / (1 - invalid fraction); 1 where not logged
        n, inv = r.get("rollout_corr/num_valid_tokens"), r.get("rollout_corr/invalid_token_fraction") or 0.0
        if n is None:
            return 1.0
        if inv >= 1.0:
            raise ValueError(f"step {r.get('step')}: every completion token has an invalid log-prob, so its number "
                             "of completion tokens (the trained fraction's weight) is not in the log")
        return n / (1.0 - inv)

    def frac(pick):
        w = [(weight(r), t) for r, t in zip(s["steps"], s["trained"]) if pick(r)]
        n = sum(x for x, _ in w)
        return sum(x * t for x, t in w) / n if n else float("nan")

    lag = "rollout_corr/policy_lag_mean"
    return frac(lambda r: True), frac(lambda r: r.get(lag) == 0), frac(lambda r: (r.get(lag) or 0) > 0)


def rs_on_table(cells: dict) -> list[str]:
    """Issue 23's comparison at k = ``RS_ON_K``: per ``RS_ON_ARMS`` cell, its trained-token fraction
    (``trained_token_fraction``) and final held-out score; per ``RS_ON_PAIRS`` pair at the same seed, the paired
    difference (``paired``) and the exact McNemar p (``mcnemar``). Seeds: 1 and every seed an RS arm (not ``tis``)
    was run at; a cell not committed yet prints as "not run yet"."""
    def name(method, seed):
        return f"{method}_k{RS_ON_K}_s{seed}"

    seeds = {1} | {parse_cell(n)[2] for n in cells if n != WARMSTART and parse_cell(n)[0] in RS_ON_ARMS
                   and parse_cell(n)[0] != "tis" and parse_cell(n)[1] == RS_ON_K}
    out = [f"Issue 23, rejection on the engine factor (k = {RS_ON_K}): RS (`seq_mean_k3` 0.01, with token TIS 2) "
           "judging the lag split's engine factor vs the whole ratio vs no RS (`tis`); float32 engine: the control "
           "where the engine factor is 1. Trained = completion tokens left after RS, weighted by tokens per step; "
           "lag 0 / stale = the steps right after a sync / the others.", "",
           "| cell | RS judges | engine dtype | trained: all / lag 0 / stale | held-out after |",
           "|---|---|---|---|---|"]
    for seed in sorted(seeds):
        for method, (ratio, dtype) in RS_ON_ARMS.items():
            s = cells.get(name(method, seed))
            if s is None:
                out.append(f"| {name(method, seed)} | {ratio} | {dtype} | not run yet | — |")
                continue
            fr = " / ".join("—" if math.isnan(x) else f"{x:.3f}" for x in trained_token_fraction(s))
            out.append(f"| {name(method, seed)} | {ratio} | {dtype} | {fr} "
                       f"| {s['after']['correct']}/{s['after']['total']} |")
    out += ["", "| comparison (same seed) | minus (paired s.e.) | a only / b only right | McNemar p |",
            "|---|---|---|---|"]
    for seed in sorted(seeds):
        for a, b in RS_ON_PAIRS:
            sa, sb = cells.get(name(a, seed)), cells.get(name(b, seed))
            label = f"{name(a, seed)} vs {name(b, seed)}"
            if sa is None or sb is None:
                out.append(f"| {label} | not run yet | — | — |")
                continue
            m, se = paired(sa["after"]["scores"], sb["after"]["scores"])
            n10, n01, p = mcnemar(sa["after"]["scores"], sb["after"]["scores"])
            out.append(f"| {label} | {100 * m:+.1f} ± {100 * se:.1f} pts | {n10} / {n01} | {p:.2g} |")
    return out


# issue 19's top-p comparison (sampling-support matching), on-policy (k = 1) at top_p 0.9, item by item per seed
TOPP_ARMS = {  # method -> what corrects the top-p gap
    "topp_trl_is": "TRL's vLLM IS (sequence_mask, ratio > 3 masked; our correction off)",
    "topp_decoupled": "ours, default preset (token TIS 2 + seq_mean_k3 0.01), no support matching",
    "topp_recompute": "ours, default preset + `rollout_support_matching: recompute`",
}


def topp_table(cells: dict) -> list[str]:
    """Issue 19's top-p comparison at k = 1 (``TOPP_ARMS``), per seed 1-2 and every seed a top-p cell ran at: the
    final held-out score and its paired difference (``paired``, points) and exact McNemar p (``mcnemar``) against
    ``topp_trl_is`` of the same seed; the mean IS weight per step (TRL's ``sampling/importance_sampling_ratio/mean``
    for ``topp_trl_is``, ours ``rollout_corr/rollout_is_mean``) and its smallest value; the fraction of sequences
    kept (ours: 1 - ``rollout_rs_seq_masked_fraction``, weighted by ``num_valid_seqs``; TRL logs no masked fraction:
    the steps whose smallest weight is 0, masked above 3 or underflowed, are counted instead); the trained-token
    fraction (``trained_token_fraction``; TRL logs none for its own masking); the mean behaviour KL
    (``rollout_corr/kl``, nats/token) and the mean log kept mass of the recomputed support
    (``rollout_corr/support_log_mass_mean``, nats; where logged: measured with truncation on, matched or not). A
    cell not committed yet prints as "not run yet"."""
    seeds = {1, 2} | {parse_cell(n)[2] for n in cells if n != WARMSTART and parse_cell(n)[0] in TOPP_ARMS}
    rows = []
    for seed in sorted(seeds):
        ref = cells.get(f"topp_trl_is_k1_s{seed}")
        for method, what in TOPP_ARMS.items():
            name = f"{method}_k1_s{seed}"
            s = cells.get(name)
            if s is None or not s.get("after"):
                rows.append(f"| {name} | {what} | not run yet | — | — | — | — | — | — |")
                continue
            vs = "—"
            if method != "topp_trl_is":
                if ref is None or not ref.get("after"):
                    vs = "not run yet"
                else:
                    m, se = paired(s["after"]["scores"], ref["after"]["scores"])
                    n10, n01, p = mcnemar(s["after"]["scores"], ref["after"]["scores"])
                    vs = f"{100 * m:+.1f} ± {100 * se:.1f} pts ({n10} / {n01}, p {p:.2g})"
            ser = s["series"]
            if method == "topp_trl_is":
                w_mean, w_min = (ser(f"sampling/importance_sampling_ratio/{x}") for x in ("mean", "min"))
                masked = sum(1 for x in w_min if x == 0)
                kept = f"not logged by TRL; smallest weight 0 on {masked} of {len(w_min)} steps"
                trained = "not logged by TRL"
            else:
                w_mean, w_min = ser("rollout_corr/rollout_is_mean"), ser("rollout_corr/rollout_is_min")
                n_seq = [1.0 if (n := r.get("rollout_corr/num_valid_seqs")) is None else n for r in s["steps"]]
                rej = [r.get("rollout_corr/rollout_rs_seq_masked_fraction") or 0.0 for r in s["steps"]]
                kept = f"{1 - sum(n * x for n, x in zip(n_seq, rej)) / sum(n_seq):.3f}" if sum(n_seq) else "—"
                trained = f"{trained_token_fraction(s)[0]:.3f}"
            mins = [x for x in w_min if isinstance(x, (int, float))]
            weight = f"{_mean(w_mean):.3f} (min {min(mins):.3g})" if mins else "—"
            kl, mass = (_mean(ser(key)) for key in ("rollout_corr/kl", "rollout_corr/support_log_mass_mean"))
            rows.append(f"| {name} | {what} | {s['after']['correct']}/{s['after']['total']} | {vs} | {weight} "
                        f"| {kept} | {trained} | {'—' if math.isnan(kl) else f'{kl:.4f}'} "
                        f"| {'—' if math.isnan(mass) else f'{mass:.4f}'} |")
    return ["Top-p 0.9, on-policy (k = 1; issue 19): plain TRL with its own vLLM IS against our default preset "
            "without and with sampling-support matching (`recompute`), same seed, paired against `topp_trl_is`. "
            "IS weight: the mean over steps of each step's mean weight (the smallest of any step): for TRL its "
            "per-sequence ratio exp(sum of log pi_old / mu), 0 where masked (above 3) or underflowed; for ours "
            "the per-token weight truncated at 2. Sequences kept: after RS; trained: completion tokens left after "
            "RS and support misses (invalid under recompute), weighted by tokens per step. kl: `rollout_corr/kl` "
            "(nats/token, behaviour vs trainer: the trainer's full-vocabulary log-probs, under recompute its "
            "truncated ones). Support log mass: the mean log of the probability mass the trainer keeps in the "
            "sampler's support (nats; 0 = no truncation).", "",
            "| cell | correction | held-out after | minus topp_trl_is (paired s.e.; a / b only right, McNemar p) "
            "| IS weight mean (min) | sequences kept | trained | kl | support log mass |",
            "|---|---|---|---|---|---|---|---|---|", *rows]


def control_table(cells: dict, planned: list[str] | None = None) -> list[str]:
    """The controls at ``GRID_K``, per committed cell at that k of any method but plain ``trl``: its
    paired difference (``paired``, points) and exact McNemar p (``mcnemar``) against ``trl_slow`` at the same k and
    seed (plain TRL at half the learning rate: the effective-step control, issue 19) and against on-policy plain TRL
    (``trl_k1``) of the same seed (how much of on-policy training it recovers), with its mean behaviour KL
    (``rollout_corr/kl``, K1, nats/token) and grad norm: a method that beats plain TRL only by moving less beats
    ``trl_slow`` by less. ``trl_slow`` itself is listed against ``trl_k1``. A missing control prints "not run yet"."""
    rows = []
    for name, s in cells.items():
        if name == WARMSTART or not s.get("after"):
            continue
        method, k, seed = parse_cell(name)
        if k != GRID_K or method == "trl":
            continue
        cols = []
        for ctl in (f"trl_slow_k{GRID_K}_s{seed}", f"trl_k1_s{seed}"):
            c = cells.get(ctl)
            if ctl == name:
                cols.append("—")
            elif (c is None or not c.get("after")) and planned is not None and ctl not in planned:
                cols.append("not in this grid's plan")
            elif c is None or not c.get("after"):
                cols.append("not run yet")
            else:
                m, se = paired(s["after"]["scores"], c["after"]["scores"])
                p = mcnemar(s["after"]["scores"], c["after"]["scores"])[2]
                cols.append(f"{100 * m:+.1f} ± {100 * se:.1f} pts (p {p:.2g})")
        ser = s["series"]
        rows.append(f"| {name} | {s['after']['correct']}/{s['after']['total']} "
                    f"| {_mean(ser('rollout_corr/kl')):.3f} | {_mean(ser('grad_norm')):.3f} | {cols[0]} | {cols[1]} |")
    if not rows:
        return []
    return [f"Controls at k = {GRID_K} (same seed): each method against `trl_slow` (plain TRL at half the learning "
            "rate, the effective-step control: a method that only moves less than plain TRL gains no more than it) "
            "and against on-policy plain TRL (`trl_k1`). Mean behaviour KL (`rollout_corr/kl`, nats/token) and grad "
            "norm per step.", "",
            "| cell | held-out after | mean kl | grad norm | minus trl_slow (paired s.e., McNemar p) "
            "| minus trl_k1 (paired s.e., McNemar p) |", "|---|---|---|---|---|---|", *rows]


# ----------------------------------------------------------------------------------------------- issue 47
# The re-analysis: every cell against the do-nothing arm (the warm start's own scores), 95 % t-intervals for the
# across-seed figures, the 128-item curve's area as a second endpoint, lag-check failures left out of the pooled
# figures; and the anchor/step-size frontier at k = GRID_K. The statistics are policy_lag_stats' pure functions.
# The arms that trace the frontier at k = GRID_K: plain TRL at lr, lr / 2, lr / 4, lr / 8 (the step-size axis) and
# with TRL's KL penalty to the start (beta 0.1, 1.0: the anchor axis); all replay plain TRL's recorded rollouts.
FRONTIER_ARMS = ("trl", "trl_slow", "trl_lr4", "trl_lr8", "trl_beta01", "trl_beta1")
ANCHOR_KL_KEY, ANCHOR_KL_K1, TRL_KL = "rollout_corr/k3_kl", "rollout_corr/kl", "kl"
ANCHOR_LAST = 4  # the last logged steps averaged for the KL from the start at the end of a run


def endpoints(s: dict) -> dict:
    """A cell's two endpoints: ``final`` (held-out accuracy, fraction) with its per-item ``final_scores``, and
    ``area`` (``policy_lag_stats.item_curve_areas`` of the 128-item checks plus the final evaluation's first items
    at the last step: the time-averaged accuracy) with its per-item ``area_items``; for the warm start (the
    do-nothing arm, constant in time) the area items are its final scores on the checks' items. ``area`` is None
    where the cell has no usable curve (the reason in ``area_error``)."""
    after = s["after"]
    out = {"final": after["accuracy"], "final_scores": after["scores"], "area": None, "area_items": None}
    try:
        if s.get("is_warmstart"):
            n = len(s["curve"][0]["scores"]) if s["curve"] else 128
            items = [float(x) for x in after["scores"][:n]]
        else:
            items = stats.item_curve_areas(stats.curve_checks(s["curve"], after["scores"], len(s["steps"])))
        out["area_items"], out["area"] = items, statistics.fmean(items)
    except (ValueError, IndexError, KeyError) as e:
        out["area_error"] = str(e)
    return out


def _arms(cells: dict, ends: dict, keep) -> dict[tuple[str, int], dict[int, dict]]:
    """(method, k) -> {seed: endpoints} over the cells ``keep(name)`` accepts (the warm start is no arm)."""
    arms: dict[tuple[str, int], dict[int, dict]] = {}
    for name in cells:
        if name != WARMSTART and keep(name):
            method, k, seed = parse_cell(name)
            arms.setdefault((method, k), {})[seed] = ends[name]
    return arms


def arm_comparisons(arms) -> list[tuple[tuple[str, int], tuple[str, int]]]:
    """The (A, B) arm pairs the re-analysis compares paired by seed, A - B: each arm against its reference arm at the
    same k (``reference_cell``'s rule), against its own method at k = 1 (the lag effect), against on-policy plain TRL
    (``trl_k1``: how much of on-policy learning it keeps; lag-panel arms only) and, at ``GRID_K``, against
    ``trl_slow`` and (bypass only) each anchor control. Only pairs whose two arms both have cells."""
    pairs = []
    for a in sorted(arms):
        method, k = a
        cands = []
        if method != reference(method):
            cands.append((reference(method), k))
        if k > 1:
            cands.append((method, 1))
            if not method.startswith(("topp_", "f32_")) and method != "trl":
                cands.append(("trl", 1))
        if k == GRID_K and method not in ("trl", "trl_slow"):
            cands.append(("trl_slow", GRID_K))
            if method == "bypass":
                cands += [(m, GRID_K) for m in FRONTIER_ARMS if m not in ("trl", "trl_slow")]
        for b in cands:
            if b in arms and b != a and (a, b) not in pairs:
                pairs.append((a, b))
    return pairs


def _seed_diffs(a: dict, b: dict, key: str) -> list[float]:
    return [a[s][key] - b[s][key] for s in sorted(a) if s in b and a[s][key] is not None and b[s][key] is not None]


def _iv(xs: list[float], p: bool = True) -> str:
    return stats.fmt_interval(stats.t_interval(xs), p=p) if xs else "—"


def reanalysis_tables(cells: dict, failed: dict[str, list[str]]) -> list[str]:
    """Issue 47's re-analysis of a grid's committed cells (``report``'s ``cells``; ``failed``: cell -> its lag-check
    violations): per cell the paired per-item difference to the warm start (512 items final, 128 items curve area,
    95 % t-interval over items); per arm the difference to the warm start over seeds (95 % t-interval, n - 1 df,
    t-test p); the arm pairs of ``arm_comparisons`` paired by seed, both endpoints. Failed cells are marked and left
    out of the pooled figures; an arm that lost one is shown both ways. Empty without a committed warm start."""
    if WARMSTART not in cells:
        return []
    ends = {n: endpoints({**s, "is_warmstart": n == WARMSTART}) for n, s in cells.items()}
    ws = ends[WARMSTART]
    out = ["#### Re-analysis (issue 47): against the do-nothing arm, with 95 % intervals and a second endpoint", "",
           f"The do-nothing arm is the warm start itself ({round(ws['final'] * len(ws['final_scores']))}/"
           f"{len(ws['final_scores'])} held-out; {100 * ws['area']:.1f} % on the 128 check items). Final: held-out "
           "accuracy after training. Area: the area under the 128-item check curve (trapezoid over steps 0 = the "
           "warm start, 8, 16, 24 and the final evaluation's first 128 items at the last step) divided by the "
           "steps: the run's time-averaged accuracy. Per cell: the paired per-item difference to the warm start "
           "(95 % t-interval over the 512 or 128 items). Per arm and per pair of arms: the mean over seeds (paired "
           "by seed) with its 95 % Student-t interval (n seeds, n - 1 df) and the one-sample t-test p; n = 1 has "
           "no interval. Points are percentage points.", ""]
    bad = [n for n in cells if n in failed]
    out += [("Left out of every pooled figure (lag check failed): " + "; ".join(
        f"{n} ({'; '.join(failed[n][:2])}{'; ...' if len(failed[n]) > 2 else ''})" for n in bad) + "."
        if bad else f"Every one of the {len(cells) - 1} cells passed the lag check: nothing is left out."), ""]
    out += ["| cell | final % | final - warm start (512 items) | area % | area - warm start (128 items) "
            "| lag check |", "|---|---|---|---|---|---|"]
    for name in cells:
        if name == WARMSTART:
            continue
        e = ends[name]
        d_final = stats.fmt_interval(stats.paired_items(e["final_scores"], ws["final_scores"]))
        if e["area"] is None:
            area = d_area = f"no area: {e['area_error']}"
        else:
            area = f"{100 * e['area']:.1f}"
            d_area = stats.fmt_interval(stats.paired_items(e["area_items"], ws["area_items"]))
        out.append(f"| {name} | {100 * e['final']:.1f} | {d_final} | {area} | {d_area} "
                   f"| {'FAILED (left out of pooled figures)' if name in failed else 'passed'} |")

    def arm_rows(arms, suffix=""):
        rows = []
        for (method, k), by_seed in sorted(arms.items()):
            n = len(by_seed)
            finals = [e["final"] - ws["final"] for e in by_seed.values()]
            areas = [e["area"] - ws["area"] for e in by_seed.values() if e["area"] is not None]
            mean_final = statistics.fmean(e["final"] for e in by_seed.values())
            mean_area = statistics.fmean(e["area"] for e in by_seed.values() if e["area"] is not None) \
                if areas else math.nan
            rows.append(f"| {method}_k{k}{suffix} | {n} ({n - 1}) | {100 * mean_final:.1f} | {_iv(finals)} "
                        f"| {100 * mean_area:.1f} | {_iv(areas)} |")
        return rows

    passed = _arms(cells, ends, lambda n: n not in failed)
    every = _arms(cells, ends, lambda n: True)
    out += ["", "| arm | seeds (df) | final % mean | final - warm start [95 % CI], p | area % mean "
            "| area - warm start [95 % CI], p |", "|---|---|---|---|---|---|", *arm_rows(passed)]
    lost = {a: v for a, v in every.items() if passed.get(a, {}).keys() != v.keys()}
    out += arm_rows(lost, " (incl. failed cells)")
    out += ["", "Arms paired by seed (A - B over the seeds both ran; lag-check failures left out):", "",
            "| A - B | seeds (df) | final [95 % CI], p | A above B (final) | area [95 % CI], p |",
            "|---|---|---|---|---|"]
    for a, b in arm_comparisons(passed):
        fin, area = _seed_diffs(passed[a], passed[b], "final"), _seed_diffs(passed[a], passed[b], "area")
        if not fin:
            continue
        out.append(f"| {a[0]}_k{a[1]} - {b[0]}_k{b[1]} | {len(fin)} ({len(fin) - 1}) | {_iv(fin)} "
                   f"| {sum(d > 0 for d in fin)}/{len(fin)} | {_iv(area)} |")
    return out


def anchor_points(cells: dict, failed: dict[str, list[str]]) -> dict[str, dict]:
    """Per committed cell at ``GRID_K`` (never synced: mu is the warm start's engine) that passed the lag check:
    ``kl`` = the mean ``rollout_corr/k3_kl`` (K3, nats/token) over its last ``ANCHOR_LAST`` logged steps (the KL of
    the warm start's bf16 engine from the trained policy, on the engine's samples: the distance from the start at the
    end), ``kl_steps`` the steps it averaged, ``k1`` the same for the K1 ``rollout_corr/kl``, ``trl_kl`` for TRL's own
    ``kl`` (logged only with beta > 0: TRL's penalty term, the K3 estimate of KL(pi_theta || pi_ref) with pi_ref the
    float32 warm start, on the same engine samples; another quantity than K3 of KL(mu || pi), shown beside it),
    and the two endpoints (``endpoints``). The warm start itself is ``{"kl": 0.0, ...}``."""
    out = {}
    if WARMSTART in cells:
        out[WARMSTART] = {"kl": 0.0, "kl_steps": [], "k1": 0.0, "trl_kl": math.nan,
                          **endpoints({**cells[WARMSTART], "is_warmstart": True})}
    for name, s in cells.items():
        if name == WARMSTART or name in failed or parse_cell(name)[1] != GRID_K:
            continue
        kl, used = stats.end_kl(s["steps"], ANCHOR_KL_KEY, ANCHOR_LAST)
        out[name] = {"kl": kl, "kl_steps": used, "k1": stats.end_kl(s["steps"], ANCHOR_KL_K1, ANCHOR_LAST)[0],
                     "trl_kl": stats.end_kl(s["steps"], TRL_KL, ANCHOR_LAST)[0], **endpoints(s)}
    return out


def frontier_residuals(points: dict[str, dict], key: str) -> dict[str, float | None]:
    """Per non-frontier cell at ``GRID_K``: its endpoint ``key`` (``final`` or ``area``) minus the frontier at its
    KL, the frontier being the linear interpolation (``policy_lag_stats.frontier_at``) through the warm start at KL 0
    and the same seed's ``FRONTIER_ARMS`` cells (same replayed rollouts), in (end KL, endpoint). None where its KL is
    past the frontier's largest or not logged."""
    out = {}
    for name, p in points.items():
        if name == WARMSTART:
            continue
        method, _k, seed = parse_cell(name)
        if method in FRONTIER_ARMS:
            continue
        front = [(0.0, points[WARMSTART][key])] if WARMSTART in points else []
        front += [(q["kl"], q[key]) for n, q in points.items() if n != WARMSTART and parse_cell(n)[0] in FRONTIER_ARMS
                  and parse_cell(n)[2] == seed and math.isfinite(q["kl"]) and q[key] is not None]
        y = stats.frontier_at(front, p["kl"]) if front and math.isfinite(p["kl"]) and p[key] is not None else None
        out[name] = None if y is None else p[key] - y
    return out


def anchor_table(cells: dict, failed: dict[str, list[str]], planned: list[str] | None = None) -> list[str]:
    """Issue 47's anchor/step-size table at ``GRID_K`` (``anchor_points``; ``frontier_residuals``): per cell its KL
    from the start at the end, both endpoints and its distance above (+) or below the same seed's frontier; per
    non-frontier arm the mean distance over seeds with its 95 % t-interval. Planned anchor controls not committed yet
    print as "not run yet"."""
    points = anchor_points(cells, failed)
    if WARMSTART not in points or len(points) <= 1:
        return []
    res = {key: frontier_residuals(points, key) for key in ("final", "area")}
    out = [f"#### Anchor or correction? k = {GRID_K}, final accuracy and curve area against the KL from the start", "",
           f"At k = {GRID_K} mu is the warm start's engine, so `rollout_corr/k3_kl` (K3, nats/token, on the engine's "
           f"samples) at the end of a run is the distance of the trained policy from the start: here its mean over "
           f"the last {ANCHOR_LAST} logged steps (K1 `rollout_corr/kl` beside it; TRL's own `kl`, logged with beta > "
           "0 only, is TRL's penalty term: the K3 estimate of KL(pi_theta || pi_ref), pi_ref the float32 warm "
           "start, averaged over the same engine samples; the other direction than KL(mu || pi) and not drawn from "
           "pi_theta, so it is shown beside K3, not compared with it). The frontier: per seed, the "
           "linear interpolation in (KL, endpoint) through the warm start at KL 0 and that seed's plain-TRL arms "
           f"({', '.join(FRONTIER_ARMS)}: step size and KL penalty; same replayed rollouts). Above frontier: the "
           "cell's endpoint minus the frontier at its KL (points; '—': its KL lies past the frontier's largest). "
           "The figure below the tables draws them (the on-policy arms' KL is to a moving mu: lines, not points).",
           "", "| cell | KL from start, K3 (steps) | K1 | TRL kl | final % | area % | final above frontier "
           "| area above frontier |", "|---|---|---|---|---|---|---|---|"]
    for name, p in sorted(points.items(), key=lambda x: (x[0] != WARMSTART, x[0] != WARMSTART and parse_cell(x[0]))):
        late = p["kl_steps"] and p["kl_steps"][-1] != len(cells[name]["steps"])  # the last steps logged none
        steps = f" (steps {p['kl_steps'][0]}-{p['kl_steps'][-1]}: none logged later)" if late else ""
        kl = "not logged" if math.isnan(p["kl"]) else f"{p['kl']:.3f}{steps}"
        fr = [("—" if (r := res[key].get(name)) is None else f"{100 * r:+.1f}") if name in res[key] else "frontier"
              for key in ("final", "area")]
        if name == WARMSTART:
            fr = ["start", "start"]
        k1, tk = ("—" if math.isnan(v) else f"{v:.3f}" for v in (p["k1"], p["trl_kl"]))
        area = "—" if p["area"] is None else f"{100 * p['area']:.1f}"
        out.append(f"| {name} | {kl} | {k1} | {tk} | {100 * p['final']:.1f} | {area} | {fr[0]} | {fr[1]} |")
    frontier_cells = [c for c in (planned or []) if c != WARMSTART and parse_cell(c)[0] in FRONTIER_ARMS
                      and parse_cell(c)[1] == GRID_K]
    missing = [c for c in frontier_cells if c not in cells]
    if missing:
        out += ["", f"Frontier arms not run yet: {', '.join(missing)}."]
    if planned is not None and not any(parse_cell(c)[0] != "trl" for c in frontier_cells):
        out += ["", "This grid plans no step-size or anchor arm: its frontier is the warm start and plain TRL "
                "alone, a straight line that cannot tell anchoring from correction."]
    by_arm: dict[str, dict[str, list[float]]] = {}
    for key in ("final", "area"):
        for name, r in res[key].items():
            by_arm.setdefault(parse_cell(name)[0], {"final": [], "area": []})
            if r is not None:
                by_arm[parse_cell(name)[0]][key].append(r)
    if by_arm:
        out += ["", f"| arm at k = {GRID_K} | seeds inside the frontier's range | final above frontier [95 % CI], p "
                "| area above frontier [95 % CI], p |", "|---|---|---|---|"]
        for method, r in sorted(by_arm.items()):
            out.append(f"| {method} | {len(r['final'])} | {_iv(r['final'])} | {_iv(r['area'])} |")
    return out


def plot_anchor(cells: dict, failed: dict[str, list[str]], path: Path) -> None:
    """Write the anchor/step-size figure (``path``): final accuracy (left) and curve area (right) against the KL from
    the start at the end (``anchor_points``), every k = ``GRID_K`` cell a point in its method's style, the frontier
    arms' means joined (with the warm start at KL 0) as the frontier, and the on-policy arms' means (``trl_k1``,
    ``bypass_k1``: their KL is to a moving mu) as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = anchor_points(cells, failed)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6))
    for ax, key, label in zip(axes, ("final", "area"), ("held-out accuracy after training (512 items)",
                                                         "curve area: time-averaged accuracy (128 items)")):
        by_method: dict[str, list[dict]] = {}
        for name, p in points.items():
            if name != WARMSTART and math.isfinite(p["kl"]) and p[key] is not None:
                by_method.setdefault(parse_cell(name)[0], []).append(p)
        for method, ps in sorted(by_method.items()):
            colour, marker = METHOD_STYLE.get(method, ("C0", "o"))
            ax.scatter([p["kl"] for p in ps], [p[key] for p in ps], color=colour, marker=marker, s=36,
                       label=f"{method}_k{GRID_K} ({len(ps)} seed{'s' if len(ps) > 1 else ''})",
                       edgecolors="black" if method in FRONTIER_ARMS else "none", linewidths=0.4)
        if WARMSTART in points:
            ws = points[WARMSTART][key]
            front = [(0.0, ws)] + [(statistics.fmean(p["kl"] for p in ps), statistics.fmean(p[key] for p in ps))
                                   for m, ps in by_method.items() if m in FRONTIER_ARMS]
            top = max(x for x, _ in front)
            xs = [top * i / 400 for i in range(401)]  # dense: the line is linear in KL, as frontier_at, on symlog
            ax.plot(xs, [stats.frontier_at(front, x) for x in xs], color="grey", linestyle="--", linewidth=1,
                    label="frontier (linear in KL through the frontier arms' means and the warm start)")
            ax.scatter([0.0], [ws], color="black", marker="*", s=90, label="warm start (KL 0)", zorder=3)
        ends = {n: endpoints(s) for n, s in cells.items() if n != WARMSTART and n not in failed}
        for method, style in (("trl", ":"), ("bypass", "-.")):
            vals = [e[key] for n, e in ends.items() if parse_cell(n)[:2] == (method, 1) and e[key] is not None]
            if vals:
                ax.axhline(statistics.fmean(vals), color=METHOD_STYLE[method][0], linestyle=style, linewidth=1,
                           label=f"{method}_k1 mean ({len(vals)} seeds; its KL is to a moving mu)")
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xlim(0, 1.3 * max([p["kl"] for p in points.values() if math.isfinite(p["kl"])] + [0.1]))
        ax.set_xlabel(f"KL from the start at the end (k3_kl, last {ANCHOR_LAST} steps; nats/token; linear below "
                      "0.05)", fontsize=8)
        ax.set_ylabel(label, fontsize=9)
    axes[0].set_title(f"k = {GRID_K}: every cell a point (frontier arms edged)", fontsize=9)
    axes[1].set_title("the same, curve area", fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The accuracy figure's panels: the lag grid (top_p 1, the bf16 engine: the methods compared against k) and the
# controls plotted apart because their sampling or engine differs (top_p 0.9; the float32 engine), each at its one k.
LAG_PANEL, CONTROL_PANEL = "sync interval", "controls"
# One colour and marker per method, fixed across grids and figures (matplotlib's cycle repeats after 10 methods).
METHOD_STYLE = {"trl": ("#222222", "o"), "trl_slow": ("#8c8c8c", "v"), "trl_is": ("#9467bd", "P"),
                "tis": ("#1f77b4", "s"), "bypass": ("#d62728", "D"), "decoupled": ("#ff7f0e", "^"),
                "direct_gate": ("#8c564b", "X"), "rs_engine": ("#2ca02c", "<"), "rs_direct": ("#bcbd22", ">"),
                "f32_rs_engine": ("#2ca02c", "<"), "f32_rs_direct": ("#bcbd22", ">"),
                "topp_trl_is": ("#9467bd", "P"), "topp_decoupled": ("#ff7f0e", "^"),
                "topp_recompute": ("#17becf", "*"),
                "trl_lr4": ("#b0b0b0", "1"), "trl_lr8": ("#d0d0d0", "2"),  # the step-size axis: ever lighter greys
                "trl_beta01": ("#e377c2", "p"), "trl_beta1": ("#7f3f6f", "h")}  # the anchor axis


def accuracy_series(cells: dict) -> dict[str, dict[str, dict[int, list[float]]]]:
    """The accuracy figure's data: panel -> method -> sync interval k -> final held-out accuracies (fractions), one
    per seed, in seed order. The lag panel holds the methods sampled at top_p 1 by the bf16 engine; the control panel
    the top-p (``topp_*``) and float32-engine (``f32_*``) cells. The warm start is not a method and is left out."""
    out: dict[str, dict[str, dict[int, list[float]]]] = {LAG_PANEL: {}, CONTROL_PANEL: {}}
    for name in sorted((n for n in cells if n != WARMSTART), key=parse_cell):
        method, k, _seed = parse_cell(name)
        panel = CONTROL_PANEL if method.startswith(("topp_", "f32_")) else LAG_PANEL
        out[panel].setdefault(method, {}).setdefault(k, []).append(cells[name]["after"]["accuracy"])
    return out


# The curves figure's arms: the lag panel's methods at on-policy, the intermediate and the never-synced interval.
CURVE_KS = (1, 8, GRID_K)
K_LINESTYLE = {1: ":", 8: "--", GRID_K: "-"}


def curve_series(cells: dict, key: str | None) -> dict[tuple[str, int], dict[int, float]]:
    """One per-step curve per arm for the curves figure: (method, k) -> {optimizer step: mean over the arm's seeds}.

    Arms are the lag panel's (top_p 1, bf16 engine; see :func:`accuracy_series`) at k in ``CURVE_KS``. ``key`` is a
    ``log.jsonl`` metric, ``None`` for the trained fraction, or ``"curve"`` for the 128-item greedy checks (fraction
    correct, with the final evaluation's score on the same first items as the last point, at the cell's last step). A
    step is averaged over the seeds that logged a finite value there (TRL logs no ESS, a lag-filtered step no k3);
    an arm with no such value at any step is left out, so no line is drawn from nothing."""
    acc: dict[tuple[str, int], dict[int, list[float]]] = {}
    for name in sorted((n for n in cells if n != WARMSTART), key=parse_cell):
        method, k, _seed = parse_cell(name)
        if k not in CURVE_KS or method.startswith(("topp_", "f32_")):
            continue
        s = cells[name]
        if key == "curve":
            points = [(c["step"], c["correct"] / c["total"]) for c in s["curve"]]
            if s["curve"] and s["after"]:
                n = s["curve"][0]["total"]
                points.append((len(s["steps"]), sum(s["after"]["scores"][:n]) / n))
        elif key is None:
            points = [(r["step"], t) for r, t in zip(s["steps"], s["trained"])]
        else:
            points = [(r["step"], r.get(key)) for r in s["steps"]]
        for step, value in points:
            if value is not None and math.isfinite(value):
                acc.setdefault((method, k), {}).setdefault(step, []).append(value)
    return {arm: {step: statistics.fmean(v) for step, v in by_step.items()} for arm, by_step in acc.items()}


def plot(cells: dict, path: Path, curves_path: Path) -> None:
    """Write the accuracy figure (``path``: final accuracy against k per method, every seed a point, the mean with
    its s.e. over seeds; the controls in a second panel) and the per-step curves (``curves_path``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = accuracy_series(cells)
    fig, (ax, cax) = plt.subplots(1, 2, figsize=(10, 4.2), width_ratios=(3, 1.4), sharey=True)
    methods = list(series[LAG_PANEL])
    for j, method in enumerate(methods):
        colour, marker = METHOD_STYLE.get(method, (f"C{j % 10}", "o"))
        by_k = series[LAG_PANEL][method]
        ks = sorted(by_k)
        shift = 2 ** (0.035 * (j - (len(methods) - 1) / 2))  # side by side on the log axis, the k's stay readable
        for k in ks:
            ax.scatter([k * shift] * len(by_k[k]), by_k[k], s=14, alpha=0.45, color=colour, marker=marker,
                       linewidths=0)
        means = [statistics.fmean(by_k[k]) for k in ks]
        errs = [statistics.stdev(by_k[k]) / math.sqrt(len(by_k[k])) if len(by_k[k]) > 1 else 0 for k in ks]
        seeds = max(len(v) for v in by_k.values())
        seeds_label = f"up to {seeds} seeds" if seeds > 1 else "1 seed"
        ax.errorbar([k * shift for k in ks], means, yerr=errs, marker=marker, capsize=3, color=colour,
                    markersize=6, linewidth=1.2, label=f"{method} ({seeds_label})")
    controls = list(series[CONTROL_PANEL])
    for j, method in enumerate(controls):
        colour, marker = METHOD_STYLE.get(method, (f"C{j % 10}", "o"))
        accs = [a for v in series[CONTROL_PANEL][method].values() for a in v]
        cax.scatter([j] * len(accs), accs, s=14, alpha=0.45, color=colour, marker=marker, linewidths=0)
        cax.errorbar([j], [statistics.fmean(accs)], yerr=[statistics.stdev(accs) / math.sqrt(len(accs))
                     if len(accs) > 1 else 0], marker=marker, capsize=3, color=colour, markersize=6)
    cax.set_xticks(range(len(controls)), [m.replace("topp_", "top-p 0.9 ").replace("f32_", "f32 engine ")
                                           for m in controls], rotation=35, ha="right", fontsize=7)
    cax.set_xlim(-0.6, max(len(controls), 1) - 0.4)
    cax.set_title("controls at one k (top_p 0.9: k = 1; float32 engine: k = 8)", fontsize=8)
    if WARMSTART in cells:
        for a in (ax, cax):
            a.axhline(cells[WARMSTART]["after"]["accuracy"], color="grey", linestyle=":", linewidth=1,
                      label="warm start" if a is ax else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vLLM weight sync interval k (optimizer steps; lags 0 to k - 1)")
    ax.set_ylabel("greedy held-out accuracy after training")
    ax.set_title("top_p 1, bf16 engine: each seed a faint point, the mean ± s.e. over seeds", fontsize=8)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="center right", frameon=False)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)

    keys = [("reward", "reward"), ("rollout_corr/kl", "kl (nats/token)"), ("rollout_corr/rollout_is_eff_sample_size",
            "ESS"), (None, "trained fraction"), ("grad_norm", "grad norm"), ("entropy", "entropy (nats/token)"),
            ("completions/mean_length", "mean length (tokens)"), ("completions/clipped_ratio", "clipped ratio"),
            ("rollout_corr/policy_lag_mean", "mean policy lag (steps)"),
            ("frac_reward_zero_std", "groups with no reward variance"), ("curve", "check acc (first 128 items)")]
    # one line per arm (the mean over its seeds; every cell would be unreadable), in the accuracy figure's colours,
    # one line style per k; the legend in the grid's spare panel
    seeds = {(m, k): len(v) for m, by_k in series[LAG_PANEL].items() for k, v in by_k.items()}
    fig, axes = plt.subplots(3, 4, figsize=(17, 10))
    fig.suptitle("per-step curves, the mean over seeds per arm, top_p 1, bf16 engine (colour: method, as in the "
                 f"accuracy figure; line style: k = {', '.join(map(str, CURVE_KS))})", fontsize=10)
    handles: dict[tuple[int, str], tuple[str, object]] = {}  # (k, method) -> (legend label, a line)
    for ax, (key, label) in zip(axes.flat, keys):
        for (method, k), points in curve_series(cells, key).items():
            xs = sorted(points)
            n = seeds[(method, k)]
            (line,) = ax.plot(xs, [points[x] for x in xs], color=METHOD_STYLE.get(method, ("C0", "o"))[0],
                              linestyle=K_LINESTYLE.get(k, "-"), linewidth=1.1)
            handles.setdefault((k, method), (f"{method}_k{k} ({n} seed{'s' if n > 1 else ''})", line))
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    legend = [handles[arm] for arm in sorted(handles)]
    axes.flat[-1].legend([line for _, line in legend], [lab for lab, _ in legend], fontsize=8, loc="center",
                         frameon=False)
    fig.tight_layout()
    fig.savefig(curves_path, dpi=100)
    plt.close(fig)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run-cell":
        run_cell_in_process(sys.argv[2], sys.argv[8:], *map(int, sys.argv[3:7]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "outputs" / "policy_lag"), help="cell outputs with weights")
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "policy_lag"),
                    help="committed small outputs (resume from here)")
    ap.add_argument("--cells", help="comma list, in run order (default: the grid's plan, ORDER or VENDOR_ORDER)")
    ap.add_argument("--steps", type=int, default=32, help="optimizer steps per cell")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (4 completions each)")
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmstart-steps", type=int, default=16, help="on-policy steps of the shared checkpoint")
    ap.add_argument("--eval-size", type=int, default=512)
    ap.add_argument("--eval-max-tokens", type=int, default=32, help="greedy budget (the training cap)")
    ap.add_argument("--check-every", type=int, default=8)
    ap.add_argument("--check-size", type=int, default=128)
    ap.add_argument("--cpu-kernels", choices=("avx2", "native"), default="avx2",
                    help="avx2 (default): every cell process runs the AVX2 kernels (benchmarks/avx2_kernels), as the "
                         "committed cells did, also on an AVX-512 CPU; native: the CPU's own (a new grid only)")
    ap.add_argument("--engine-kl-max", type=float, default=0.03, help="lag-0 k3_kl bound (nats/token)")
    ap.add_argument("--jobs", type=int, default=1, help="cells side by side (1 torch thread each)")
    ap.add_argument("--commit", action="store_true", help="git commit each finished cell's results folder")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--same-training", nargs=2, metavar="CELL_DIR", help="compare two cell folders' metrics, exit")
    ap.add_argument("--no-write", action="store_true", help="print the report; leave RESULTS.md and figures alone")
    args = ap.parse_args()
    if args.same_training:
        diff = same_training(*map(Path, args.same_training))
        print("bit-identical training metrics" if not diff else "\n".join(diff))
        sys.exit(1 if diff else 0)
    if not args.report_only:
        check_vendor(Path(args.results))
        cells = args.cells if args.cells is not None else ",".join(plan(Path(args.results)))
        names = [n for n in cells.split(",") if n]
        for n in names:
            if n != WARMSTART:
                parse_cell(n)  # a misspelt cell fails before hours of running
        if WARMSTART in names or not (Path(args.out) / WARMSTART / "model.safetensors").exists():
            run_cell(WARMSTART, args)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            list(pool.map(lambda n: run_cell(n, args), [n for n in names if n != WARMSTART]))
    text = report(Path(args.results), figure=not args.no_write, engine_kl_max=args.engine_kl_max)
    print(text)
    if not args.no_write:
        replace_section(text, *markers(Path(args.results)), ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
