"""Step time against TRL (issue 21): CPU seconds per optimizer step, the same trainer work in every run.

Runs (each in a fresh process, one torch thread, float32 trainer):

* ``trl``: plain TRL (``trl.GRPOTrainer``).
* ``trl_is``: TRL with its own vLLM importance sampling forced on. TRL applies it only when ``use_vllm`` is True
  and skips it with a ``rollout_func``; here ``use_vllm`` reads True after construction and False inside
  ``_generate`` only (no engine to sync), so TRL runs its pi_old forward and multiplies its truncated ratio into
  the loss (as ``benchmarks/policy_lag_experiment.py``'s ``trl_is`` cell; couples to TRL 1.16 internals).
* ``ours_decoupled``: ``RolloutCorrGRPOTrainer``, the CPU default preset (``decoupled_k3_rs_token_tis``).
* ``ours_bypass``: ``bypass_ppo_clip``.
* ``ours_support``: ``ours_decoupled`` with ``rollout_support_matching="recompute"`` (the replayed engine's sampler
  contract: top-p ``--top-p``, top-k off, temperature 1).
* ``ours_records``: ``ours_decoupled`` with rollout records on (``rollout_dump_dir``).
* ``ours_records_nowrite``: ``ours_records`` with the writer's ``add`` and ``end_window`` replaced by no-ops (the
  feature's hooks still tag the rows and assemble each micro-batch; nothing is converted or written): separates the
  writer from the rest of records' cost.
* ``ours_decoupled_always``: ``ours_decoupled`` with ``rollout_corr_old_forward="always"`` (the extra pi_old forward
  kept); offered only where the config has that field.
* ``ours_none``: ``RolloutCorrGRPOTrainer`` with no correction configured (the equality table compares it with
  ``trl``: it must be bit-identical).

The same rollouts for every run: sampled once (``--sample``, cached in ``<out>/rollouts.pt``) from a bfloat16 copy
of the initial weights with ``transformers.generate`` (mu = the processed log-probs,
``engines.transformers_generate.capture_generate_log_probs``), at ``--top-p``, and replayed by a ``rollout_func``:
the dataset holds exactly ``--steps x --prompts`` prompts, so every prompt is trained on once and gets the same
completions in every run. Generation and weight sync are outside the comparison; the trainer-side work is the same.

Timing: CPU seconds of the main thread (``time.thread_time``; one torch thread, so all of torch's work) from the
Trainer's ``on_step_begin`` to the end of that step's ``log`` call (our records window closes there), per optimizer
step (with the main thread's user / system split and minor page faults from ``getrusage(RUSAGE_THREAD)``); step 1 is
a warm-up and left out. Rounds interleave the runs, the order rotated by one each round. Per part (``--breakdown``,
on by default; only ``time.thread_time`` reads are added, so results are unchanged: the equality table compares runs
with the breakdown on and, with ``--breakdown-rounds``, off): the exclusive CPU time of the log-prob forwards (with /
without grad: TRL's ``_get_per_token_logps_and_entropies``), the backward, the optimizer step, the rewards, the
rollout replay, the correction (the trainer's correction function), the metrics (accumulator and ratio
decomposition), the records writer and support scoring (``support.SupportScorer.score`` and its custom backward),
Python's cyclic garbage collector (``gc``: ``gc.callbacks``, wherever a collection happens, with the collections per
generation); "other" is the rest of the step. Nested parts are exclusive (support scoring inside a forward counts as
support only; a collection inside a forward counts as gc). ``norm``: each run's step scaled by (mean over runs / its
own) CPU time of one fixed forward + backward with full-vocabulary scoring of every position, timed at the run's
start (``--calibrate``): the machine is shared, this normalises for the load a run met.

Equality: loss, grad norm, entropy and every ``rollout_corr/*`` metric of every step (those both log), between the
runs that train the same way by construction (``ours_decoupled``, ``ours_records``, ``ours_records_nowrite``,
``ours_decoupled_always``; ``trl`` and ``ours_none``) and between the rounds of each run (determinism), max
|difference| and whether it is within 1e-6.

``results.json`` in ``--out`` is rewritten after every run (a stopped benchmark keeps what finished); ``--resume``
skips the (round, run) pairs that finished there and runs the failed ones again (a benchmark can be run in chunks:
``--rounds 1``, then ``--rounds 2 --resume``; the runs listed are the union over the chunks). ``--write-results PATH``
replaces this script's section of a RESULTS.md (``results_md.replace_section``); ``--report-only`` re-renders from
``results.json``.

    .venv/bin/python benchmarks/bench_step.py --model tiny --rounds 1        # quick check (about a minute)
    .venv/bin/python benchmarks/bench_step.py --lock /tmp/cpu.lock --rounds 2 --steps 3 \\
        --write-results benchmarks/RESULTS.md                                   # SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from results_md import replace_section  # noqa: E402  (benchmarks/, next to this file)

BEGIN = "<!-- BEGIN bench_step.py output -->"
END = "<!-- END bench_step.py output -->"
SMOLLM2 = os.environ.get("TRL_ROLLOUT_CORR_SMOLLM2", str(ROOT / "models" / "SmolLM2-135M-Instruct"))
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}  # the main job's chain_sum
DECOUPLED = "decoupled_k3_rs_token_tis"  # the CPU default preset (recipes/configs/cpu_smollm2_decoupled.yaml)
TOLERANCE = 1e-6


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark run: which trainer, which of our config fields, and what it stands for."""

    name: str
    what: str
    trainer: str = "ours"  # "trl" (GRPOTrainer), "trl_is" (GRPOTrainer, its IS forced on) or "ours"
    fields: tuple = ()  # RolloutCorrGRPOConfig fields as (name, value)
    support_contract: bool = False  # the replay declares its sampler contract (support matching)
    records: bool = False  # rollout_dump_dir under the run's folder
    records_writer: bool = True  # False: the records feature's hooks run, its writer's add / end_window do nothing
    needs: tuple = ()  # config fields that must exist for the run to be offered


RUNS = (
    Run("trl", "plain TRL (GRPOTrainer)", trainer="trl"),
    Run("trl_is", "TRL with its own IS (pi_old forward + truncated ratio)", trainer="trl_is"),
    Run("ours_decoupled", f"ours, decoupled ({DECOUPLED})", fields=(("rollout_corr_preset", DECOUPLED),)),
    Run("ours_bypass", "ours, bypass (bypass_ppo_clip)", fields=(("rollout_corr_preset", "bypass_ppo_clip"),)),
    Run("ours_support", "ours, decoupled + support matching (recompute)", support_contract=True,
        fields=(("rollout_corr_preset", DECOUPLED), ("rollout_support_matching", "recompute"))),
    Run("ours_records", "ours, decoupled + rollout records", records=True,
        fields=(("rollout_corr_preset", DECOUPLED),)),
    Run("ours_records_nowrite", "ours, decoupled + rollout records, the writer's add / end_window no-ops",
        records=True, records_writer=False, fields=(("rollout_corr_preset", DECOUPLED),)),
    Run("ours_decoupled_always", "ours, decoupled, pi_old forward always run",
        fields=(("rollout_corr_preset", DECOUPLED), ("rollout_corr_old_forward", "always")),
        needs=("rollout_corr_old_forward",)),
    Run("ours_none", "ours, no correction configured (must equal plain TRL bit for bit)"),
)
BY_NAME = {r.name: r for r in RUNS}
# Runs that train identically by construction (records and the pi_old elision change no value).
EQUAL_GROUPS = (("ours_decoupled", "ours_records", "ours_records_nowrite", "ours_decoupled_always"),
                ("trl", "ours_none"))
# (numerator, denominator, target ratio of CPU s/step, label)
TARGETS = (
    ("ours_decoupled", "trl_is", 0.70, "ours decoupled / TRL with its IS"),
    ("ours_bypass", "trl", 0.75, "ours bypass / plain TRL"),
    ("ours_support", "ours_decoupled", 1.05, "support matching: decoupled + recompute / decoupled"),
    ("ours_records", "ours_decoupled", 1.02, "records: decoupled + records / decoupled"),
    ("ours_records_nowrite", "ours_decoupled", None, "records' hooks without the writer / decoupled"),
    ("ours_records", "ours_records_nowrite", None, "records / records' hooks without the writer"),
    ("ours_decoupled", "ours_decoupled_always", None, "pi_old elision: decoupled / decoupled with the forward"),
    ("trl_is", "trl", None, "TRL with its IS / plain TRL"),
)
PARTS = ("forward (grad)", "forward (no grad)", "backward", "optimizer", "support", "correction", "metrics",
         "records", "rewards", "rollout replay", "gc", "other")


# ---------------------------------------------------------------------------------------------- the workload
def _setup_paths() -> None:
    for sub in ("tests/helpers", "recipes"):
        path = str(ROOT / sub)
        if path not in sys.path:
            sys.path.insert(0, path)


def model_dir(args: argparse.Namespace) -> str:
    """The policy's folder: SmolLM2-135M-Instruct (``--model-path``), or a tiny random Llama built in ``--out``.

    Raises:
        SystemExit: the SmolLM2 folder does not exist (naming ``--model-path`` / ``TRL_ROLLOUT_CORR_SMOLLM2``).
    """
    if args.model == "tiny":
        path = Path(args.out) / "tiny-llama"
        if not (path / "config.json").exists():
            _setup_paths()
            from tiny_model import make_tiny_model_dir

            make_tiny_model_dir(str(path), "llama", seed=0, chat_template=True)
        return str(path)
    if not (Path(args.model_path) / "config.json").exists():
        raise SystemExit(f"no model at {args.model_path}: pass --model-path (or set TRL_ROLLOUT_CORR_SMOLLM2), or "
                         "--model tiny for the quick check.")
    return args.model_path


def make_task(args: argparse.Namespace):
    """The chain_sum task of the main job with exactly ``steps * prompts`` items (each trained on once)."""
    _setup_paths()
    from grpo_recipe_utils import ReasoningGymTask

    return ReasoningGymTask("chain_sum", dict(TASK_CONFIG), args.steps * args.prompts, 42)


def make_reward(args: argparse.Namespace, task) -> Callable:
    """SmolLM2: the main job's 0/1 chain_sum reward. Tiny: a deterministic reward on the completion's characters
    (a random model never answers; the groups then have varied rewards and non-zero advantages)."""
    if args.model != "tiny":
        return task.reward_func()

    def tiny_reward(completions, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [float(t.count("a")) - 0.05 * len(t) + 0.1 * sum(ch.isdigit() for ch in t) for t in texts]

    return tiny_reward


def _key(prompt: Any) -> str:
    return json.dumps(prompt, sort_keys=True)


def sample_rollouts(args: argparse.Namespace) -> None:
    """``--sample``: draw ``--generations`` completions per prompt from a bfloat16 copy of the initial weights
    (``transformers.generate``, processed log-probs as mu) and save them to ``<out>/rollouts.pt``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from trl_rollout_corr import trl_compat
    from trl_rollout_corr.engines.transformers_generate import capture_generate_log_probs

    torch.set_num_threads(1)
    path = model_dir(args)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16).eval()
    config = GenerationConfig(do_sample=True, top_p=args.top_p, top_k=0, temperature=1.0,
                              max_new_tokens=args.max_completion_length, pad_token_id=tok.pad_token_id,
                              eos_token_id=tok.eos_token_id)
    resolved = trl_compat.resolved_generation_config(model, config).to_dict()
    task = make_task(args)
    dataset = task.to_dataset()
    torch.manual_seed(args.seed)
    rollouts, eos = {}, tok.eos_token_id
    for start in range(0, len(dataset), args.prompts):
        prompts = dataset["prompt"][start:start + args.prompts]
        ids = [_chat_ids(tok, p) for p in prompts for _ in range(args.generations)]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
        attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.no_grad(), capture_generate_log_probs(model) as capture:
            sequences = model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        completions = []
        for row in sequences[:, width:].tolist():
            completions.append(row[:row.index(eos) + 1] if eos in row else row)
        log_probs = capture.completion_log_probs(completions)
        for i, prompt in enumerate(prompts):
            rows = range(i * args.generations, (i + 1) * args.generations)
            rollouts[_key(prompt)] = {"prompt_ids": ids[rows[0]], "completions": [completions[r] for r in rows],
                                      "logprobs": [log_probs[r] for r in rows]}
    sampler = {k: resolved.get(k) for k in ("do_sample", "top_p", "top_k", "min_p", "temperature",
                                           "repetition_penalty", "num_beams")}
    torch.save({"settings": _rollout_settings(args), "sampler": sampler, "rollouts": rollouts},
               Path(args.out) / "rollouts.pt")


def _chat_ids(tok, prompt) -> list[int]:
    """The prompt's token ids as TRL renders a conversational prompt (chat template, generation prompt)."""
    if isinstance(prompt, str):
        return tok(prompt, add_special_tokens=False)["input_ids"]
    out = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _rollout_settings(args: argparse.Namespace) -> dict:
    return dict(model=args.model, model_path=args.model_path if args.model != "tiny" else "tiny-llama",
                steps=args.steps, prompts=args.prompts, generations=args.generations,
                max_completion_length=args.max_completion_length, top_p=args.top_p, seed=args.seed)


class ReplayRollouts:
    """A TRL ``rollout_func`` serving the pre-sampled completions: each prompt's k-th occurrence in a run gets its
    k-th stored completion (TRL repeats every prompt ``num_generations`` times in a batch).

    Raises:
        KeyError: a prompt that was not sampled (the dataset changed since ``rollouts.pt``: delete it).
        IndexError: a prompt asked for more completions than were sampled.
    """

    def __init__(self, stored: dict, sampler: dict) -> None:
        self.stored, self.sampler, self.served = stored, sampler, defaultdict(int)

    def __call__(self, prompts: list, trainer: Any) -> dict:
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            key = _key(prompt)
            entry, k = self.stored[key], self.served[key]
            self.served[key] += 1
            out["prompt_ids"].append(list(entry["prompt_ids"]))
            out["completion_ids"].append(list(entry["completions"][k]))
            out["logprobs"].append(list(entry["logprobs"][k]))
        return out

    def describe(self) -> dict:
        return {"rollout_engine": "bench_step replay (transformers.generate, bfloat16 copy, processed log-probs)"}


class ReplayWithContract(ReplayRollouts):
    """The replay that also declares the sampler it was sampled with (support matching needs it)."""

    def sampler_contract(self, trainer: Any):
        from trl_rollout_corr import support

        return support.sampler_from_generation_config(self.sampler, default_source="bench_step replay",
                                                      trainer_temperature=trainer.temperature)


# ---------------------------------------------------------------------------------------------- the part timers
class PartTimers:
    """Exclusive main-thread CPU time per part and per optimizer step (only ``time.thread_time`` reads are added).

    ``part(name)`` blocks nest; a block's time counts for its own part minus the time of the blocks inside it.
    Time outside a step (construction, calibration) is not counted.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.steps, self._stack, self._step = enabled, [], [], None

    def begin_step(self) -> None:
        self._step = {"t0": time.thread_time(), "p0": time.process_time(), "w0": time.perf_counter(),
                      "r0": resource.getrusage(resource.RUSAGE_THREAD), "parts": defaultdict(float),
                      "calls": defaultdict(int)}
        self._stack = []

    def end_step(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        cpu = time.thread_time() - step["t0"]
        parts = dict(step["parts"])
        if self.enabled:
            parts["other"] = cpu - sum(parts.values())
        r0, r1 = step["r0"], resource.getrusage(resource.RUSAGE_THREAD)  # the main thread's user / system split
        self.steps.append({"cpu_s": cpu, "process_s": time.process_time() - step["p0"],
                           "wall_s": time.perf_counter() - step["w0"], "user_s": r1.ru_utime - r0.ru_utime,
                           "sys_s": r1.ru_stime - r0.ru_stime, "minor_faults": r1.ru_minflt - r0.ru_minflt,
                           "parts": parts, "calls": dict(step["calls"])})

    def start(self, name: str) -> None:
        if self.enabled and self._step is not None:
            self._stack.append([name, time.thread_time(), 0.0])

    def stop(self, name: str) -> None:
        if not (self.enabled and self._step is not None and self._stack and self._stack[-1][0] == name):
            return
        _, start, inner = self._stack.pop()
        elapsed = time.thread_time() - start
        self._step["parts"][name] += elapsed - inner
        self._step["calls"][name] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextlib.contextmanager
    def part(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def wrap(self, fn: Callable, name, *, static: bool = False) -> Callable:
        """``fn`` timed as part ``name`` (a string, or a function of no arguments returning one)."""

        @functools.wraps(fn)
        def timed(*a, **kw):
            with self.part(name() if callable(name) else name):
                return fn(*a, **kw)

        return staticmethod(timed) if static else timed

    def install(self, trainer: Any) -> None:
        """Wrap the parts of ``trainer`` (this process only: class-level patches in a fresh process)."""
        if not self.enabled:
            return
        import torch
        from trl import GRPOTrainer

        def forward_kind() -> str:
            return "forward (grad)" if torch.is_grad_enabled() else "forward (no grad)"

        import gc

        def collecting(phase: str, info: dict) -> None:  # Python's cyclic collector, inside whatever part it hits
            if phase == "start":
                self.start("gc")
                if self._step is not None:
                    self._step["calls"][f"gc generation {info['generation']}"] += 1
            else:
                self.stop("gc")

        gc.callbacks.append(collecting)
        GRPOTrainer._get_per_token_logps_and_entropies = self.wrap(
            GRPOTrainer._get_per_token_logps_and_entropies, forward_kind)
        GRPOTrainer._calculate_rewards = self.wrap(GRPOTrainer._calculate_rewards, "rewards")
        trainer.accelerator.backward = self.wrap(trainer.accelerator.backward, "backward")
        if trainer.rollout_func is not None:
            trainer.rollout_func = self.wrap(trainer.rollout_func, "rollout replay")
        self._install_ours(trainer)

    def _install_ours(self, trainer: Any) -> None:
        from trl_rollout_corr import records, support
        from trl_rollout_corr.accumulator import RolloutCorrAccumulator

        # the correction function, wherever the trainer keeps it (before and after the trainer's modes split)
        for owner, attr in ((trainer, "_rc_correction_fn"), (getattr(trainer, "rollout_corr_mode", None),
                                                             "correction_fn")):
            if owner is not None and callable(getattr(owner, attr, None)):
                setattr(owner, attr, self.wrap(getattr(owner, attr), "correction"))
        for name in ("add_stats", "add_log_ratios", "add_support", "add_policy_lag_rows", "add_fraction",
                     "add_fraction_counts", "flush"):
            if hasattr(RolloutCorrAccumulator, name):
                setattr(RolloutCorrAccumulator, name, self.wrap(getattr(RolloutCorrAccumulator, name), "metrics"))
        import trl_rollout_corr.correction as correction

        original = correction.ratio_decomposition
        timed = self.wrap(original, "metrics")
        # a snapshot: another thread may import while this runs (one run failed with "dictionary changed size")
        for module in [m for k, m in list(sys.modules.items()) if k.startswith("trl_rollout_corr") and m is not None]:
            if getattr(module, "ratio_decomposition", None) is original:
                module.ratio_decomposition = timed
        for name in ("add", "end_window"):
            setattr(records.RolloutRecordWriter, name, self.wrap(getattr(records.RolloutRecordWriter, name),
                                                                 "records"))
        support.SupportScorer.score = self.wrap(support.SupportScorer.score, "support")
        support.SupportStats.from_score = classmethod(self.wrap(support.SupportStats.from_score.__func__, "support"))
        function = getattr(getattr(support, "scorer", support), "_SupportLogProbs", None)  # support/scorer.py
        if function is not None:
            function.backward = self.wrap(function.__dict__["backward"].__func__, "support", static=True)


# ---------------------------------------------------------------------------------------------- one run (child)
def _config_fields(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def available_runs() -> list[str]:
    """The runs this checkout can do (``Run.needs`` config fields present)."""
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    fields = _config_fields(RolloutCorrGRPOConfig)
    return [r.name for r in RUNS if all(n in fields for n in r.needs)]


def build_trainer(run: Run, args: argparse.Namespace, folder: Path, timers: PartTimers):
    """The run's trainer over the replayed rollouts (not yet trained)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig, RolloutCorrGRPOTrainer

    saved = torch.load(Path(args.out) / "rollouts.pt", weights_only=False)
    if saved["settings"] != _rollout_settings(args):
        raise SystemExit(f"{args.out}/rollouts.pt was sampled with {saved['settings']}; delete it or use those "
                         "settings.")
    replay = (ReplayWithContract if run.support_contract else ReplayRollouts)(saved["rollouts"], saved["sampler"])
    path = model_dir(args)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    task = make_task(args)
    common = dict(output_dir=str(folder / "trainer"), per_device_train_batch_size=args.prompts * args.generations,
                  num_generations=args.generations, max_completion_length=args.max_completion_length,
                  max_steps=args.steps, learning_rate=args.learning_rate, lr_scheduler_type="constant",
                  warmup_steps=0, beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, bf16=False, seed=args.seed, disable_tqdm=True, temperature=1.0)
    fields = dict(run.fields)
    if run.records:
        fields["rollout_dump_dir"] = str(folder / "dump")
    base = GRPOTrainer if run.trainer in ("trl", "trl_is") else RolloutCorrGRPOTrainer
    config = (GRPOConfig if base is GRPOTrainer else RolloutCorrGRPOConfig)(**common, **fields)

    class Bench(base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            if run.trainer == "trl_is":
                if not self.vllm_importance_sampling_correction:
                    raise ValueError("trl_is needs vllm_importance_sampling_correction=True (TRL's default).")
                self.use_vllm = True  # TRL 1.16 gates its vLLM IS on this attribute alone

        def _generate(self, prompts):
            if run.trainer != "trl_is":
                return super()._generate(prompts)
            self.use_vllm = False  # no TRL engine to sync: the rollout_func replays
            try:
                return super()._generate(prompts)
            finally:
                self.use_vllm = True

        def log(self, logs, start_time=None):
            super().log(logs, start_time)
            if "loss" in logs:
                timers.end_step()  # the step ends after its log (the records window closes in our log)

    class Clock(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            timers.begin_step()

        def on_pre_optimizer_step(self, *_a, **_k):
            timers.start("optimizer")

        def on_optimizer_step(self, *_a, **_k):
            timers.stop("optimizer")

    trainer = Bench(model=model, reward_funcs=make_reward(args, task), args=config, train_dataset=task.to_dataset(),
                    processing_class=tok, rollout_func=replay, callbacks=[Clock()])
    return trainer, saved


def calibrate(model, saved: dict) -> float:
    """CPU seconds of one forward + backward of the first step's rows with every position scored over the full
    vocabulary (gradients through ``torch.autograd.grad``: nothing is accumulated; random numbers forked)."""
    import torch

    entries = list(saved["rollouts"].values())[:4]
    rows = [(e["prompt_ids"], c) for e in entries for c in e["completions"]]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.tensor([p + c + [0] * (width - len(p) - len(c)) for p, c in rows])
    mask = torch.tensor([[1] * (len(p) + len(c)) + [0] * (width - len(p) - len(c)) for p, c in rows])
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.random.fork_rng(), torch.enable_grad():
        t0 = time.thread_time()
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logps = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.autograd.grad((logps * mask[:, 1:]).sum(), params)
        return time.thread_time() - t0


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_child(args: argparse.Namespace) -> None:
    """``--child RUN``: one run in this process; writes ``<out>/runs/r<round>_<run>.json``."""
    import torch

    torch.set_num_threads(1)
    run = BY_NAME[args.child]
    folder = Path(args.out) / "runs" / f"r{args.round}_{run.name}"
    shutil.rmtree(folder, ignore_errors=True)  # a rerun starts clean (records refuse an existing dump)
    folder.mkdir(parents=True)
    timers = PartTimers(enabled=args.breakdown and args.round < args.breakdown_rounds)
    load_before = os.getloadavg()[0]
    trainer, saved = build_trainer(run, args, folder, timers)
    timers.install(trainer)
    if run.records and not run.records_writer:
        writer = trainer.rollout_records
        writer.add = lambda batch: None
        writer.end_window = lambda logged_step, logs: None
    calibration = calibrate(trainer.model, saved) if args.calibrate else None
    t0 = time.perf_counter()
    trainer.train()
    steps = [_numbers(h) for h in trainer.state.log_history if "loss" in h]
    result = {
        "run": run.name, "round": args.round, "what": run.what, "breakdown": timers.enabled,
        "steps": timers.steps, "logs": steps, "calibration_s": calibration,
        "forward_counts": dict(getattr(trainer, "rollout_corr_forward_counts", {}) or {}),
        "load_before": load_before, "load_after": os.getloadavg()[0], "train_wall_s": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
    }
    (folder.parent / f"r{args.round}_{run.name}.json").write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------------------------------- the summary
def _timed_steps(result: dict) -> list[dict]:
    return result["steps"][1:]  # step 1: warm-up


def summarise(results: dict) -> dict:
    """Per run: CPU s/step over the timed steps of all rounds (mean, sd), normalised, parts; ratios; equality."""
    done = [r for r in results["runs"] if "steps" in r]
    calibrations = [r["calibration_s"] for r in done if r.get("calibration_s")]
    mean_calibration = statistics.fmean(calibrations) if calibrations else None
    per_run = {}
    for name in results["meta"]["runs"]:
        mine = [r for r in done if r["run"] == name]
        cpu = [s["cpu_s"] for r in mine for s in _timed_steps(r)]
        if not cpu:
            continue
        norm = [s["cpu_s"] * mean_calibration / r["calibration_s"] for r in mine for s in _timed_steps(r)
                if mean_calibration and r.get("calibration_s")]
        with_parts = [s for r in mine if r["breakdown"] for s in _timed_steps(r)]
        parts = {p: statistics.fmean(s["parts"].get(p, 0.0) for s in with_parts) for p in PARTS} if with_parts \
            else {}
        calls = {p: statistics.fmean(s["calls"].get(p, 0) for s in with_parts) for p in PARTS} if with_parts else {}
        per_run[name] = {
            "runs": len(mine), "steps": len(cpu), "cpu": statistics.fmean(cpu),
            "sd": statistics.stdev(cpu) if len(cpu) > 1 else 0.0, "norm": statistics.fmean(norm) if norm else None,
            "wall": statistics.fmean(s["wall_s"] for r in mine for s in _timed_steps(r)), "parts": parts,
            "calls": calls, "forward_counts": mine[0].get("forward_counts", {}),
            "load": [r["load_before"] for r in mine],
            "gc_collections": [statistics.fmean(s["calls"].get(f"gc generation {g}", 0) for s in with_parts)
                               for g in range(3)] if with_parts else None,
            "max_rss_mib": max((r["max_rss_mib"] for r in mine if r.get("max_rss_mib")), default=None),
        }
    ratios = []
    for num, den, target, label in TARGETS:
        if num in per_run and den in per_run:
            raw = per_run[num]["cpu"] / per_run[den]["cpu"]
            norm = (per_run[num]["norm"] / per_run[den]["norm"]
                    if per_run[num]["norm"] and per_run[den]["norm"] else None)
            ratios.append({"label": label, "num": num, "den": den, "target": target, "raw": raw, "norm": norm})
    return {"per_run": per_run, "ratios": ratios, "equality": equality(done),
            "calibration_mean": mean_calibration}


def _compared(logs: list[dict]) -> list[dict]:
    return [{k: v for k, v in step.items() if k in ("loss", "grad_norm", "entropy") or k.startswith("rollout_corr/")}
            for step in logs]


def _max_diff(a: list[dict], b: list[dict]) -> tuple[float, list[str]]:
    """Max |a - b| over the compared keys of every step, and the keys present in one run only."""
    worst, only = 0.0, set()
    if len(a) != len(b):
        return math.inf, [f"{len(a)} vs {len(b)} steps"]
    for x, y in zip(_compared(a), _compared(b)):
        only |= set(x) ^ set(y)
        for k in set(x) & set(y):
            if math.isnan(x[k]) and math.isnan(y[k]):
                continue
            worst = max(worst, abs(x[k] - y[k]))
    return worst, sorted(only)


def equality(done: list[dict]) -> list[dict]:
    """Rows of the equality table: the runs of each ``EQUAL_GROUPS`` group (first round each), and each run's
    rounds against its first."""
    rows = []
    first = {}
    for r in sorted(done, key=lambda r: r["round"]):
        first.setdefault(r["run"], r)
    for group in EQUAL_GROUPS:
        present = [first[n] for n in group if n in first]
        for other in present[1:]:
            diff, only = _max_diff(present[0]["logs"], other["logs"])
            if "trl" in group:  # TRL logs no rollout_corr/* diagnostics: compare what both log
                only = [k for k in only if not k.startswith("rollout_corr/")]
            rows.append({"what": f"{present[0]['run']} vs {other['run']}", "steps": len(other["logs"]),
                         "keys": len(_compared(other["logs"])[0]) if other["logs"] else 0, "max_diff": diff,
                         "only_in_one": only})
    for name, ref in first.items():
        for other in [r for r in done if r["run"] == name and r is not ref]:
            diff, only = _max_diff(ref["logs"], other["logs"])
            note = " (breakdown off)" if not other["breakdown"] else ""
            rows.append({"what": f"{name}: round {other['round'] + 1} vs {ref['round'] + 1}{note}",
                         "steps": len(other["logs"]), "keys": len(_compared(other["logs"])[0]) if other["logs"] else 0,
                         "max_diff": diff, "only_in_one": only})
    return rows


def _f(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _malloc(meta: dict) -> str:
    tunables = meta.get("glibc_tunables")
    return f"GLIBC_TUNABLES={tunables}" if tunables else "glibc malloc defaults"


def render(results: dict, summary: dict) -> str:
    """The RESULTS.md section (between BEGIN and END)."""
    meta, per_run = results["meta"], summary["per_run"]
    loads = [r["load_before"] for r in results["runs"] if "steps" in r]
    lines = [BEGIN, "", f"## Step time against TRL: `benchmarks/bench_step.py` ({meta['model_label']})", "",
             f"Generated by `{meta['command']}` at commit `{meta['commit']}`, {meta['started']} - "
             f"{meta.get('finished', 'unfinished')}; {meta['machine']}; 1 torch thread; {_malloc(meta)}; "
             f"1-min load average at "
             f"the runs' start {_f(min(loads, default=None), 1)}-{_f(max(loads, default=None), 1)}. "
             f"{meta['prompts']} prompts x {meta['generations']} completions of <= {meta['max_completion_length']} "
             f"tokens per step (top-p {meta['top_p']}, replayed), dapo, lr {meta['learning_rate']}, seed "
             f"{meta['seed']}; {meta['steps']} optimizer steps per run, step 1 dropped; {meta['rounds']} round(s), "
             f"order rotated. CPU seconds of the main thread per optimizer step; `norm` scales a run by (mean / its "
             f"own) CPU time of one fixed full-scoring forward + backward at its start (mean "
             f"{_f(summary['calibration_mean'])} s).", "",
             "| run | what | runs | steps timed | CPU s/step (sd) | norm CPU s/step | wall s/step | no-grad forwards "
             "per step |", "|---|---|---|---|---|---|---|---|"]
    for name, s in per_run.items():
        lines.append(f"| `{name}` | {BY_NAME[name].what} | {s['runs']} | {s['steps']} | {_f(s['cpu'])} "
                     f"({_f(s['sd'])}) | {_f(s['norm'])} | {_f(s['wall'])} | "
                     f"{_f(s['calls'].get('forward (no grad)'), 1) if s['calls'] else '-'} |")
    lines += ["", "| ratio (CPU s/step) | target | raw | normalised | met (raw) |", "|---|---|---|---|---|"]
    for r in summary["ratios"]:
        met = "-" if r["target"] is None else ("yes" if r["raw"] <= r["target"] else "**no**")
        lines.append(f"| {r['label']} | {'-' if r['target'] is None else '<= ' + _f(r['target'])} | "
                     f"{_f(r['raw'], 3)} | {_f(r['norm'], 3)} | {met} |")
    with_parts = [n for n, s in per_run.items() if s["parts"]]
    if with_parts:
        lines += ["", "Per part, exclusive CPU s per timed step (mean; nested parts are counted once, in the "
                  "innermost: support scoring inside a forward is `support`):", "",
                  "| part | " + " | ".join(f"`{n}`" for n in with_parts) + " |",
                  "|---|" + "---|" * len(with_parts)]
        for p in PARTS:
            lines.append(f"| {p} | " + " | ".join(_f(per_run[n]["parts"].get(p), 3) for n in with_parts) + " |")
        lines.append("| gc collections per step (generation 0 / 1 / 2) | " + " | ".join(
            " / ".join(f"{c:.1f}" for c in per_run[n]["gc_collections"]) for n in with_parts) + " |")
        lines.append("| peak RSS of the run (MiB) | "
                     + " | ".join(_f(per_run[n]["max_rss_mib"], 0) for n in with_parts) + " |")
        lines.append("| correction share of the step | " + " | ".join(
            f"{100 * per_run[n]['parts'].get('correction', 0.0) / per_run[n]['cpu']:.2f}%" for n in with_parts)
            + " |")
    lines += ["", f"Equality (loss, grad norm, entropy and every `rollout_corr/*` metric of every step; with `trl`, "
              f"the keys both log; tolerance "
              f"{TOLERANCE:g}):", "", "| compared | steps | keys per step | max abs difference | equal |",
              "|---|---|---|---|---|"]
    for row in summary["equality"]:
        ok = row["max_diff"] <= TOLERANCE and not row["only_in_one"]
        extra = f" (keys in one run only: {', '.join(row['only_in_one'])})" if row["only_in_one"] else ""
        lines.append(f"| {row['what']} | {row['steps']} | {row['keys']} | {row['max_diff']:.3g}{extra} | "
                     f"{'yes' if ok else '**no**'} |")
    failed = [r for r in results["runs"] if "error" in r]
    if failed:
        lines += ["", "Failed runs: " + "; ".join(f"`{r['run']}` round {r['round'] + 1}: {r['error']}"
                                                  for r in failed)]
    lines += ["", END]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the driver
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--model", args.model, "--model-path", args.model_path, "--out", args.out, "--steps", str(args.steps),
             "--prompts", str(args.prompts), "--generations", str(args.generations), "--max-completion-length",
             str(args.max_completion_length), "--top-p", str(args.top_p), "--seed", str(args.seed),
             "--learning-rate", str(args.learning_rate), "--breakdown-rounds", str(args.breakdown_rounds)]
    flags += [] if args.breakdown else ["--no-breakdown"]
    flags += [] if args.calibrate else ["--no-calibrate"]
    return flags


def _subprocess(args: argparse.Namespace, extra: list[str], log: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(Path(__file__).resolve()), *extra, *_child_flags(args)]
    if args.lock:
        cmd = ["flock", args.lock, *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with log.open("w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _tail(path: Path, n: int = 3) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " / ".join(lines[-n:])[-400:]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--model-path", default=SMOLLM2)
    parser.add_argument("--out", default=None, help="default: outputs/bench_step_<model>")
    parser.add_argument("--runs", default=None, help="comma-separated; default: every run this checkout offers")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false")
    parser.add_argument("--breakdown-rounds", type=int, default=1_000_000,
                        help="time the parts in the first N rounds only (later rounds check that the timers "
                             "change no result)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false")
    parser.add_argument("--lock", default=None, help="run every child process under `flock LOCK`")
    parser.add_argument("--resume", action="store_true", help="keep the finished (round, run) pairs of results.json")
    parser.add_argument("--write-results", default=None, help="a RESULTS.md whose bench_step.py section to replace")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out = args.out or str(ROOT / "outputs" / f"bench_step_{args.model}")
    if args.sample:
        sample_rollouts(args)
        return 0
    if args.child:
        run_child(args)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    if args.report_only:
        results = json.loads(path.read_text())
        return _report(results, args)
    offered = available_runs()
    runs = offered if args.runs is None else args.runs.split(",")
    unknown = [r for r in runs if r not in BY_NAME]
    missing = [r for r in runs if r in BY_NAME and r not in offered]
    if unknown or missing:
        parser.error(f"unknown runs {unknown} (known: {list(BY_NAME)}); " if unknown else
                     f"runs {missing} need config fields this checkout lacks ({[BY_NAME[r].needs for r in missing]})")
    previous = json.loads(path.read_text()) if args.resume and path.exists() else None
    results = previous or {"meta": {}, "runs": []}
    listed = list(dict.fromkeys([*results["meta"].get("runs", []), *runs]))  # the union over resumed chunks
    command = shlex.join(["python", "benchmarks/bench_step.py", *(argv if argv is not None else sys.argv[1:])])
    results["meta"].update(
        command=f"{results['meta']['command']}`, then `{command}" if previous else command,
        commit=_commit(), started=results["meta"].get("started", time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())),
        machine=f"{os.cpu_count()} CPUs ({os.uname().machine})", runs=listed, rounds=args.rounds, steps=args.steps,
        prompts=args.prompts, generations=args.generations, max_completion_length=args.max_completion_length,
        top_p=args.top_p, learning_rate=args.learning_rate, seed=args.seed,
        glibc_tunables=os.environ.get("GLIBC_TUNABLES"),  # children inherit it (malloc thresholds pinned or not)
        model_label="SmolLM2-135M-Instruct, float32" if args.model == "smollm2" else "tiny random Llama: a check of "
        "the script, not a measurement")
    results["meta"].pop("finished", None)
    rollouts = out / "rollouts.pt"
    if not rollouts.exists():
        print(f"sampling the rollouts once into {rollouts} ...", flush=True)
        done = _subprocess(args, ["--sample"], out / "sample.log")
        if done.returncode:
            raise SystemExit(f"sampling failed (rc {done.returncode}): {_tail(out / 'sample.log')}")
    have = {(r["round"], r["run"]) for r in results["runs"] if "error" not in r}  # a failed pair runs again
    failures = 0
    for rnd in range(args.rounds):
        order = runs[rnd % len(runs):] + runs[:rnd % len(runs)]
        for name in order:
            if (rnd, name) in have:
                continue
            (out / "runs").mkdir(exist_ok=True)
            log = out / "runs" / f"r{rnd}_{name}.log"
            t0 = time.time()
            done = _subprocess(args, ["--child", name, "--round", str(rnd)], log)
            record_path = out / "runs" / f"r{rnd}_{name}.json"
            if done.returncode or not record_path.exists():
                failures += 1
                record = {"run": name, "round": rnd, "error": f"rc {done.returncode}: {_tail(log)}"}
                print(f"[round {rnd + 1}] {name}: FAILED ({record['error']}); log {log}", flush=True)
            else:
                record = json.loads(record_path.read_text())
                cpu = [s["cpu_s"] for s in record["steps"]]
                print(f"[round {rnd + 1}] {name}: CPU s per step {' '.join(f'{c:.2f}' for c in cpu)} (first is "
                      f"warm-up); calibration {_f(record['calibration_s'])} s; load {record['load_before']:.1f}; "
                      f"losses {' '.join(format(s.get('loss', math.nan), '.6g') for s in record['logs'])}; "
                      f"{time.time() - t0:.0f} s", flush=True)
            results["runs"] = [r for r in results["runs"] if (r["round"], r["run"]) != (rnd, name)] + [record]
            path.write_text(json.dumps(results, indent=1))
    results["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path.write_text(json.dumps(results, indent=1))
    return _report(results, args) or (1 if failures else 0)


def _report(results: dict, args: argparse.Namespace) -> int:
    summary = summarise(results)
    text = render(results, summary)
    print(text)
    if args.write_results:
        replace_section(text, BEGIN, END, Path(args.write_results))
        print(f"section written to {args.write_results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
