"""Helpers of ``recipes/grpo_rollout_corr.py`` (not part of the library): reasoning-gym data and reward, greedy
evaluation, a JSONL log of every logged step, PNG plots, and the model-card section that records the correction and
the rollout engine.

The recipe imports this module by name (``import grpo_recipe_utils``): running ``python recipes/grpo_rollout_corr.py``
puts ``recipes/`` on ``sys.path``, and pytest adds it through ``pythonpath`` in ``pyproject.toml``.

Nothing here downloads anything: reasoning-gym generates its problems locally from a seed.

reasoning-gym seeds: item ``idx`` of ``create_dataset(name, size, seed)`` is generated with
``random.Random(seed + idx)``, so two datasets share items when their seed ranges ``[seed, seed + size)`` overlap.
``make_task_splits`` refuses overlapping train/eval ranges.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
DEFAULT_INSTRUCTION = "Answer with only the final number."


# ----------------------------------------------------------------------------------------------- task and reward
def last_number(text: str) -> Optional[str]:
    """The last integer/decimal in ``text`` as a string (thousands commas removed), or None when there is none."""
    found = NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


@dataclass
class ReasoningGymTask:
    """A reasoning-gym dataset with a verifiable 0/1 reward (``score_answer(...) == 1.0``; partial credit is 0).

    Args:
        name: reasoning-gym dataset name (e.g. ``chain_sum``).
        config: keyword arguments of ``reasoning_gym.create_dataset`` (e.g. ``min_digits``).
        size, seed: ``create_dataset(name, size=size, seed=seed, **config)``; item ``idx`` uses
            ``Random(seed + idx)``.
        instruction: appended to each question on a new line.

    Raises:
        ImportError: reasoning-gym is not installed (``pip install -e ".[cpu]"``; ``make demo-install`` does).
        ValueError: from reasoning-gym, for an unknown dataset name or invalid ``config``.
    """

    name: str
    config: dict = field(default_factory=dict)
    size: int = 1000
    seed: int = 42
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self) -> None:
        import reasoning_gym

        self.rg = reasoning_gym.create_dataset(self.name, size=self.size, seed=self.seed, **self.config)

    def messages(self, idx: int) -> list[dict]:
        """The chat prompt of item ``idx``: one user message, the question then the instruction on a new line."""
        question = self.rg[idx]["question"].strip()
        return [{"role": "user", "content": f"{question}\n{self.instruction}" if self.instruction else question}]

    def score(self, completion: str, idx: int) -> float:
        """1.0 iff the last number of ``completion`` is scored exactly right by reasoning-gym, else 0.0.

        reasoning-gym gives partial credit (e.g. 0.5) to near misses; those count as 0 here.
        """
        answer = last_number(completion)
        if answer is None:
            return 0.0
        return 1.0 if self.rg.score_answer(answer, self.rg[idx]) == 1.0 else 0.0

    def to_dataset(self):
        """A ``datasets.Dataset`` with ``prompt`` (chat messages), ``answer`` and ``rg_index``."""
        from datasets import Dataset

        return Dataset.from_dict(
            {
                "prompt": [self.messages(i) for i in range(self.size)],
                "answer": [str(self.rg[i]["answer"]) for i in range(self.size)],
                "rg_index": list(range(self.size)),
            }
        )

    def reward_func(self) -> Callable[..., list[float]]:
        """A TRL reward function (``completions``, ``rg_index`` column) -> 0/1 rewards."""

        def correct_answer(completions: list, rg_index: list, **_: Any) -> list[float]:
            return [self.score(_completion_text(c), int(i)) for c, i in zip(completions, rg_index)]

        return correct_answer


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def make_task_splits(name: str, config: dict, train_size: int, train_seed: int, eval_size: int, eval_seed: int,
                     instruction: str = DEFAULT_INSTRUCTION) -> tuple[ReasoningGymTask, ReasoningGymTask]:
    """Train and held-out tasks with disjoint reasoning-gym seed ranges.

    Raises:
        ValueError: the ranges ``[train_seed, train_seed + train_size)`` and ``[eval_seed, eval_seed + eval_size)``
            overlap (they would share items); the message gives the smallest eval_seed that does not.
    """
    if not (eval_seed >= train_seed + train_size or train_seed >= eval_seed + eval_size):
        raise ValueError(
            f"reasoning-gym seed ranges overlap: train [{train_seed}, {train_seed + train_size}) and eval "
            f"[{eval_seed}, {eval_seed + eval_size}) share items (item idx uses Random(seed + idx)). "
            f"Use eval_seed >= {train_seed + train_size}."
        )
    train = ReasoningGymTask(name, dict(config), train_size, train_seed, instruction)
    held_out = ReasoningGymTask(name, dict(config), eval_size, eval_seed, instruction)
    return train, held_out


def split_dataset(task: ReasoningGymTask, split: str):
    """``task.to_dataset()`` plus an ``rg_split`` column naming the split, for ``split_reward_func``."""
    return task.to_dataset().add_column("rg_split", [split] * task.size)


def split_reward_func(tasks: dict[str, ReasoningGymTask]) -> Callable[..., list[float]]:
    """One TRL reward function (``correct_answer``) for several splits: row i is scored by ``tasks[rg_split[i]]``.

    The training and held-out problems are different reasoning-gym datasets whose ``rg_index`` both start at 0, so
    the train dataset and the ``eval_dataset`` (``split_dataset``) carry their split's name and one function serves
    both (TRL logs it as ``rewards/correct_answer/*`` and ``eval_rewards/correct_answer/*``).

    Raises:
        KeyError: a row names a split not in ``tasks``.
    """

    def correct_answer(completions: list, rg_index: list, rg_split: list, **_: Any) -> list[float]:
        return [tasks[s].score(_completion_text(c), int(i)) for c, i, s in zip(completions, rg_index, rg_split)]

    return correct_answer


def check_flags(script_args: Any, training_args: Any, model_args: Any) -> None:
    """Refuse the flag combinations the recipe cannot honour, naming the flag and the fix.

    ``--use_vllm`` with ``rollout_engine=vllm_cpu`` (the CPU config's engine) selects TRL's own vLLM path:
    ``rollout_engine`` becomes ``trl_vllm`` (``--use_vllm --vllm_mode colocate`` on the main job's config).

    Raises:
        ValueError: ``--load_in_4bit`` / ``--load_in_8bit`` with ``rollout_engine=vllm_cpu`` (the engine loads the
            trainer's full-precision weights at every sync); ``--use_vllm`` with ``rollout_engine=transformers``
            (one engine samples); ``--eval_strategy`` other than ``no`` with ``eval_size 0`` (no held-out problems).
    """
    if training_args.use_vllm and script_args.rollout_engine == "vllm_cpu":
        script_args.rollout_engine = "trl_vllm"
    engine = script_args.rollout_engine
    for flag in ("load_in_4bit", "load_in_8bit"):
        if getattr(model_args, flag) and engine == "vllm_cpu":
            raise ValueError(
                f"--{flag} with rollout_engine=vllm_cpu: the vLLM CPU engine is synced with the trainer's full "
                f"weights (merged, for PEFT) and bitsandbytes k-bit layers need a GPU; drop --{flag} or use "
                "rollout_engine trl_vllm / transformers on a GPU."
            )
    if training_args.use_vllm and engine != "trl_vllm":
        raise ValueError(
            f"--use_vllm with rollout_engine={engine}: TRL's own vLLM path is rollout_engine trl_vllm; "
            f"{engine} samples by itself. Drop --use_vllm or set --rollout_engine trl_vllm."
        )
    if training_args.eval_strategy != "no" and script_args.eval_size <= 0:
        raise ValueError(
            f"--eval_strategy {training_args.eval_strategy} needs held-out problems: set --eval_size > 0 "
            "(the eval_dataset is the held-out split)."
        )


# ----------------------------------------------------------------------------------------------- evaluation
@dataclass
class EvalResult:
    """Greedy accuracy on a held-out task: ``accuracy = correct / total`` (fraction), ``seconds`` of wall time,
    ``mean_completion_tokens`` per item, the first ``samples`` and the per-item 0/1 ``scores`` in item order."""

    accuracy: float
    correct: int
    total: int
    mean_completion_tokens: float
    seconds: float
    samples: list = field(default_factory=list)
    scores: list = field(default_factory=list)  # per held-out item, 0/1, in item order

    @property
    def stderr(self) -> float:
        """Binomial standard error of the accuracy."""
        p = self.accuracy
        return math.sqrt(max(p * (1 - p), 0.0) / max(self.total, 1))

    def to_dict(self) -> dict:
        """JSON-ready fields plus ``stderr``; at most 8 samples."""
        return {"accuracy": self.accuracy, "correct": self.correct, "total": self.total, "stderr": self.stderr,
                "mean_completion_tokens": self.mean_completion_tokens, "seconds": self.seconds,
                "samples": self.samples[:8], "scores": list(self.scores)}


def greedy_accuracy(llm: Any, task: ReasoningGymTask, max_tokens: int = 64) -> EvalResult:
    """Greedy (temperature 0) accuracy of a vLLM ``LLM`` on every item of ``task`` (chat template).

    Args:
        llm: a ``vllm.LLM`` (e.g. ``VLLMCPURollout.llm``), with the weights to evaluate loaded.
        task: the held-out problems.
        max_tokens: completion budget per problem, in tokens.
    """
    from vllm import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.chat([task.messages(i) for i in range(task.size)], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    scores = [task.score(t, i) for i, t in enumerate(texts)]
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    correct = int(sum(scores))
    samples = [{"question": task.rg[i]["question"], "answer": task.rg[i]["answer"], "completion": texts[i]}
               for i in range(min(8, task.size))]
    return EvalResult(correct / task.size, correct, task.size, n_tok / task.size, time.perf_counter() - t0, samples,
                      scores)


def paired_difference(before: Sequence[float], after: Sequence[float]) -> dict:
    """Mean and standard error of the per-item difference (after - before) of two 0/1 score lists.

    Returns:
        ``{"mean", "stderr", "n"}``: accuracy points (fraction) and the number of items.

    Raises:
        ValueError: the lists are empty or of different lengths (they must score the same items in the same order).
    """
    if len(before) != len(after) or not before:
        raise ValueError(
            f"paired_difference needs two non-empty score lists over the same items; got {len(before)} and "
            f"{len(after)} scores."
        )
    diffs = [a - b for a, b in zip(after, before)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1)
    return {"mean": mean, "stderr": math.sqrt(var / n), "n": n}


# ----------------------------------------------------------------------------------------------- logging and plots
def make_jsonl_callback(path: str | Path, extra: Optional[dict] = None):
    """A ``TrainerCallback`` appending one JSON line per log event: ``{"step", "time", "cpu_time", **logs}``.

    ``time`` is wall seconds and ``cpu_time`` this process's CPU seconds (all threads, ``time.process_time``) since
    the callback was made, so a step's CPU cost is the difference between two records. The first line is
    ``{"run_config": extra}`` when ``extra`` is given (rollout engine, dtype, correction ...).
    """
    from transformers import TrainerCallback

    class JsonlLogCallback(TrainerCallback):
        def __init__(self) -> None:
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self.t0, self.cpu0 = time.time(), time.process_time()
            if extra is not None:
                self._write({"run_config": extra})

        def _write(self, record: dict) -> None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=_json_default) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                self._write({"step": state.global_step, "time": round(time.time() - self.t0, 3),
                             "cpu_time": round(time.process_time() - self.cpu0, 3), **logs})

    return JsonlLogCallback()


def _json_default(x: Any) -> Any:
    try:
        return float(x)
    except Exception:
        return str(x)


def read_jsonl(path: str | Path) -> list[dict]:
    """Every non-empty line of a JSONL file, parsed (raises ``json.JSONDecodeError`` on a malformed line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


PLOTS = (
    ("reward", "reward (mean 0/1 correct)"),
    ("rollout_corr/kl", "rollout_corr/kl (nats/token)"),
    ("rollout_corr/rollout_is_eff_sample_size", "IS effective sample size (fraction)"),
    ("rollout_corr/rollout_rs_masked_fraction", "RS rejected token fraction"),
)
# y-axis label (units) per metric; metrics that can be negative get a zero line
Y_LABELS = {
    "reward": "training reward (0/1, mean over completions)",
    "rollout_corr/kl": "KL(mu || pi_old), nats / token",
    "rollout_corr/rollout_is_eff_sample_size": "ESS, fraction of tokens (0-1]",
    "rollout_corr/rollout_rs_masked_fraction": "rejected tokens, fraction",
}
ZERO_LINE = {"rollout_corr/kl"}


def _draw(ax: Any, key: str, title: str, pts: list, fontsize: int = 10) -> None:
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
    if key in ZERO_LINE or min(p[1] for p in pts) < 0:
        ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_title(title, fontsize=fontsize)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(Y_LABELS.get(key, key), fontsize=fontsize - 1)
    ax.grid(alpha=0.3)


def _draw_accuracy(ax: Any, evaluation: dict) -> None:
    names = [n for n in ("before", "after") if n in evaluation]
    values = [evaluation[n]["accuracy"] for n in names]
    bars = ax.bar(names, values, yerr=[evaluation[n].get("stderr", 0.0) for n in names], capsize=4,
                  color=["tab:gray", "tab:green"][: len(names)])
    for bar, name in zip(bars, names):
        res = evaluation[name]
        ax.annotate(f"{res['correct']}/{res['total']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", xytext=(0, 6), textcoords="offset points")
    ax.set_ylim(0, max(1e-3, max(values)) * 1.35)
    ax.set_title("greedy accuracy, held-out problems", fontsize=10)
    ax.set_ylabel("accuracy (fraction, ± s.e.)", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def plot_metrics(jsonl_path: str | Path, out_dir: str | Path, keys: Iterable[tuple[str, str]] = PLOTS, *,
                 per_metric: bool = True, title: Optional[str] = None,
                 evaluation: Optional[dict] = None) -> list[Path]:
    """The run's summary figure ``metrics.png`` (one panel per metric, value per optimizer step, y axes in their
    units, a zero line where a metric can be negative; plus a before/after accuracy panel when ``evaluation`` is
    given), and with ``per_metric`` one PNG per metric. Keys never logged are skipped.

    Args:
        jsonl_path: a log written by ``make_jsonl_callback``.
        out_dir: where the PNGs go (created).
        keys: ``(metric key, panel title)`` pairs.
        per_metric: also write ``<key>.png`` per metric (``/`` -> ``_``).
        title: the figure's title (the run's identity), or none.
        evaluation: ``{"before": EvalResult.to_dict(), "after": ...}`` for the accuracy panel.

    Returns:
        The paths written, ``metrics.png`` last; empty when none of ``keys`` was logged.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_jsonl(jsonl_path) if "step" in r and "train_runtime" not in r]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    series = []
    for key, panel_title in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            series.append((key, panel_title, pts))
    written = []
    for key, panel_title, pts in series if per_metric else ():
        fig, ax = plt.subplots(figsize=(5, 3.4))
        _draw(ax, key, panel_title, pts)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if series:
        accuracy = bool(evaluation) and any(n in evaluation for n in ("before", "after"))
        n = len(series) + accuracy
        fig, axes = plt.subplots(1, n, figsize=(4.3 * n, 3.9), squeeze=False)
        for ax, (key, panel_title, pts) in zip(axes[0], series):
            _draw(ax, key, panel_title, pts, fontsize=9)
        if accuracy:
            _draw_accuracy(axes[0][-1], evaluation)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        path = out_dir / "metrics.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------------------------------- console and summary
# (log key, label, format) of the one console line per logged step; absent keys are left out of the line.
CONSOLE_FIELDS = (
    ("reward", "reward", "{:.3f}"),
    ("rollout_corr/kl", "kl", "{:.2e}"),
    ("rollout_corr/rollout_is_eff_sample_size", "ESS", "{:.3f}"),
    ("rollout_corr/rollout_rs_masked_fraction", "rejected", "{:.1%}"),
    ("step_time", "step", "{:.1f} s"),
)


def progress_line(logs: dict, step: int, max_steps: int) -> Optional[str]:
    """The console line of one log event: ``step 3/12 | reward 0.250 | kl 2.10e-03 | ESS 0.995 | rejected 0.0% |
    step 28.3 s`` for a training step, ``eval @ step 3 | reward ...`` for an evaluation (``eval_`` keys), None for
    other events (the end-of-training summary).
    """
    prefix = "eval_" if any(k.startswith("eval_") for k in logs) else ""
    if prefix:
        head = f"eval @ step {step}"
    elif "loss" in logs:
        head = f"step {step}/{max_steps}"
    else:
        return None
    parts = [head]
    for key, label, fmt in CONSOLE_FIELDS:
        value = logs.get(prefix + key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


def use_short_console(trainer: Any) -> None:
    """Replace the Trainer's per-step dict on the console (``PrinterCallback`` / ``ProgressCallback``, ~110 keys)
    with ``progress_line``; the full record still goes to ``log.jsonl`` and the ``report_to`` trackers."""
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback

    class ProgressLineCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            line = progress_line(logs or {}, state.global_step, state.max_steps)
            if state.is_world_process_zero and line:
                print(line, flush=True)

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(ProgressLineCallback())


SUMMARY_COLUMNS = (("reward", "reward"), ("rollout_corr/kl", "kl (nats/token)"),
                   ("rollout_corr/rollout_is_eff_sample_size", "ESS"),
                   ("rollout_corr/rollout_rs_masked_fraction", "rejected"), ("step_time", "step time (s)"))


def write_run_summary(out_dir: str | Path, identity: dict, results: dict) -> Path:
    """``summary.md`` of a run: who ran what, the held-out accuracy before/after, one row per logged step.

    Args:
        out_dir: the run's output folder (holds ``log.jsonl``; ``summary.md`` is written there).
        identity: ``{name: value}`` rows identifying the run (command, config, engine, threads, machine).
        results: the recipe's results (``before``/``after``/``improvement`` when evaluated).

    Returns:
        The path of ``summary.md``.
    """
    out_dir = Path(out_dir)
    lines = [f"# Run summary: {out_dir.name}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in identity.items()]
    before, after = results.get("before"), results.get("after")
    if before and after:
        imp = results.get("improvement") or {}
        lines += ["", f"## Greedy accuracy on {before['total']} held-out problems", "",
                  "| | accuracy ± s.e. | correct |", "|---|---|---|"]
        lines += [f"| {n} | {r['accuracy']:.3f} ± {r['stderr']:.3f} | {r['correct']} / {r['total']} |"
                  for n, r in (("before", before), ("after", after))]
        if imp:
            lines.append(f"| paired difference | {imp['mean']:+.3f} ± {imp['stderr']:.3f} | |")
    steps = [r for r in read_jsonl(out_dir / "log.jsonl") if "loss" in r]
    if steps:
        lines += ["", "## Per step", "", "| step | " + " | ".join(h for _, h in SUMMARY_COLUMNS) + " |",
                  "|---" * (len(SUMMARY_COLUMNS) + 1) + "|"]
        for r in steps:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), (int, float)) else "" for k, _ in SUMMARY_COLUMNS]
            lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    lines += ["", "Files: `log.jsonl` (run config, then every logged step with every metric), `results.json`, "
              "`metrics.png` (this run's figure), `README.md` (model card). Trackers (`report_to`) write under "
              "the output folder: `tensorboard --logdir <output_dir>/runs`, or `trackio show` for trackio."]
    path = out_dir / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def machine_record() -> dict:
    """The machine a run's numbers belong to: CPU model, core count, torch and Python versions."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


# ----------------------------------------------------------------------------------------------- model card
def rollout_correction_record(args: Any) -> dict:
    """The effective correction fields of a ``RolloutCorrGRPOConfig`` (after preset expansion), for the run log:
    ``trl_rollout_corr.model_card.correction_record`` (the same record the trainer's model card shows)."""
    from trl_rollout_corr.model_card import correction_record

    return correction_record(args)


def model_card_section(correction: dict, engine: dict, task: dict, evaluation: Optional[dict] = None) -> str:
    """The trainer's model-card section (``trl_rollout_corr.model_card.render_section``) with a task table and,
    when ``evaluation`` (``{"before": EvalResult.to_dict(), "after": ...}``) is given, an accuracy table."""
    from trl_rollout_corr.model_card import render_section

    return render_section(correction, engine, card_tables(task, evaluation))


def card_tables(task: dict, evaluation: Optional[dict] = None) -> dict[str, dict]:
    """``RolloutCorrGRPOTrainer.model_card_sections`` entries for the task and the held-out greedy accuracy."""
    tables = {"task": dict(task)} if task else {}
    if evaluation:
        tables["held-out greedy accuracy"] = {
            name: f"{res['accuracy']:.3f} ± {res['stderr']:.3f} ({res['correct']} / {res['total']})"
            for name, res in evaluation.items()
        }
    return tables


class Progress:
    """Prints ``[phase] message (elapsed)`` lines so long phases are visible (flushes immediately)."""

    def __init__(self) -> None:
        self.t0 = time.time()

    def __call__(self, phase: str, message: str) -> None:
        print(f"[{phase} +{time.time() - self.t0:6.1f}s] {message}", flush=True)


def pick_threads(requested: int = 1) -> int:
    """``requested`` if > 0; 0 asks for the cores not busy with other work: ``cpu_count - round(1-min load)``, >= 1.

    The recipe's default is a fixed 1 (``--torch_threads``): the thread count changes the order of floating-point
    reductions, so runs are only comparable, and a run only reproducible, at the same count; 0 makes the count, and
    with it the computation, depend on the machine's load (``benchmarks/LOG.md``, "Thread policy", for the
    measured 1 vs 2 thread step times).
    """
    if requested > 0:
        return requested
    cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, min(cores, cores - int(round(load))))


def engine_record(rollout_engine: str, rollout_dtype: str, model_path: str, *, vllm_mode: str = "colocate",
                  bf16: bool = False) -> dict:
    """What produces mu, for the run log and the model card, checked for explicitness.

    Args:
        rollout_engine: ``"vllm_cpu"`` (placeholder until ``VLLMCPURollout.describe()`` replaces it),
            ``"trl_vllm"`` (TRL's own vLLM path; placeholder until the trainer's ``rollout_engine_record`` replaces
            it) or ``"transformers"`` (TRL's ``generate`` path).
        rollout_dtype: the requested rollout dtype, ``"bfloat16"`` or ``"float32"``.
        model_path: the checkpoint folder (kept for the callers; no longer read: both of TRL's vLLM paths take
            ``rollout_dtype`` explicitly).
        vllm_mode: TRL's ``vllm_mode`` (``"colocate"`` or ``"server"``), recorded with ``trl_vllm``; in server mode
            ``rollout_dtype`` is the server's ``--dtype`` (``check_server_dtype`` compares it with the server).
        bf16: the trainer's ``bf16`` flag (``transformers`` generates under the trainer's autocast).

    Returns:
        ``{"rollout_engine", "rollout_dtype", "rollout_logprobs_mode", ...}``.

    Raises:
        ValueError: unknown ``rollout_engine`` or ``vllm_mode``. (In colocate mode the trainer passes
            ``rollout_dtype`` to TRL's engine as ``rollout_vllm_dtype``; in server mode it is the server's
            ``--dtype``, which ``check_server_dtype`` compares with the running server.)
    """
    if rollout_engine == "vllm_cpu":
        return {"rollout_engine": "vllm_cpu", "rollout_dtype": rollout_dtype,
                "rollout_logprobs_mode": "processed_logprobs"}
    if rollout_engine == "trl_vllm" and vllm_mode == "colocate":  # the trainer passes rollout_dtype to TRL's LLM
        return {"rollout_engine": "trl_vllm_colocate", "rollout_dtype": rollout_dtype,
                "rollout_logprobs_mode": "processed_logprobs"}
    if rollout_engine == "trl_vllm":
        if vllm_mode != "server":
            raise ValueError(f"vllm_mode must be 'colocate' or 'server', got {vllm_mode!r}.")
        # the server's --dtype; checked against the server (check_server_dtype)
        return {"rollout_engine": "trl_vllm_server", "rollout_dtype": rollout_dtype,
                "rollout_logprobs_mode": "processed_logprobs",
                "rollout_weight_sync": "TRL VLLMGeneration.sync_weights (CPU: trl_rollout_corr_gloo)"}
    if rollout_engine == "transformers":
        return {"rollout_engine": "transformers.generate",
                "rollout_dtype": "bfloat16 (autocast)" if bf16 else "trainer dtype",
                "rollout_logprobs_mode": "processed scores (after logits processors)"}
    raise ValueError(f"Unknown rollout_engine {rollout_engine!r}: use vllm_cpu, trl_vllm or transformers.")


def check_server_dtype(trainer, rollout_dtype: str) -> None:
    """Refuse a run whose TRL vLLM server serves another dtype than ``rollout_dtype`` (what the run records).

    Raises:
        ValueError: naming both dtypes and the flag.
    """
    vllm = getattr(trainer, "vllm_generation", None)
    client = getattr(vllm, "vllm_client", None)
    if client is None:  # not the main process, or not server mode
        return
    served = str(client.get_server_info()["model_config"]["dtype"]).removeprefix("torch.")
    if served != rollout_dtype:
        raise ValueError(f"The vLLM server at {client.base_url} serves {served}, but rollout_dtype={rollout_dtype!r}: "
                         f"set --rollout_dtype {served} (or restart the server with --dtype {rollout_dtype}).")


class ServerChat:
    """``greedy_accuracy``'s ``llm`` for TRL's vLLM server: ``chat(conversations, params)`` through TRL's
    ``VLLMClient.chat`` (the server renders the chat template, as ``LLM.chat``), completions detokenized here with
    the model's tokenizer (special tokens skipped, as vLLM's ``text``)."""

    def __init__(self, client: Any, tokenizer: Any):
        self.client, self.tokenizer = client, tokenizer

    def chat(self, conversations: list, params: Any, use_tqdm: bool = False) -> list:
        from types import SimpleNamespace

        out = self.client.chat(conversations, n=1, temperature=params.temperature, max_tokens=params.max_tokens,
                               logprobs=None)
        return [SimpleNamespace(outputs=[SimpleNamespace(text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                                         token_ids=ids)]) for ids in out["completion_ids"]]
