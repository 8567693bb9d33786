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
from dataclasses import dataclass, field, fields
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
    """A ``TrainerCallback`` appending one JSON line per log event: ``{"step", "time", **logs}``.

    The first line is ``{"run_config": extra}`` when ``extra`` is given (rollout engine, dtype, correction ...).
    """
    from transformers import TrainerCallback

    class JsonlLogCallback(TrainerCallback):
        def __init__(self) -> None:
            self.path = Path(path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self.t0 = time.time()
            if extra is not None:
                self._write({"run_config": extra})

        def _write(self, record: dict) -> None:
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=_json_default) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs:
                self._write({"step": state.global_step, "time": round(time.time() - self.t0, 3), **logs})

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


def plot_metrics(jsonl_path: str | Path, out_dir: str | Path, keys: Iterable[tuple[str, str]] = PLOTS) -> list[Path]:
    """One PNG per metric (value per step) plus ``metrics.png`` with all of them; keys never logged are skipped.

    Args:
        jsonl_path: a log written by ``make_jsonl_callback``.
        out_dir: where the PNGs go (created).
        keys: ``(metric key, plot title)`` pairs.

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
    for key, title in keys:
        pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if pts:
            series.append((key, title, pts))
    written = []
    for key, title, pts in series:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / (key.replace("/", "_") + ".png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(4.2 * len(series), 3.2))
        axes = [axes] if len(series) == 1 else list(axes)
        for ax, (key, title, pts) in zip(axes, series):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "metrics.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# ----------------------------------------------------------------------------------------------- model card
def rollout_correction_record(args: Any) -> dict:
    """The effective correction fields of a ``RolloutCorrGRPOConfig`` (after preset expansion), for the run log.

    Args:
        args: a ``RolloutCorrGRPOConfig``; it carries every ``RolloutCorrectionConfig`` field under the same name.

    Returns:
        ``{field: value}`` for the ``RolloutCorrectionConfig`` fields, then ``rollout_corr_preset``,
        ``rs_keep_rejected_in_baseline`` and ``vllm_importance_sampling_correction`` (None where ``args`` lacks them).

    Raises:
        AttributeError: if ``args`` lacks a ``RolloutCorrectionConfig`` field (it is not a ``RolloutCorrGRPOConfig``).
    """
    from trl_rollout_corr.config import RolloutCorrectionConfig

    record = {f.name: getattr(args, f.name) for f in fields(RolloutCorrectionConfig) if f.init}
    record["rollout_corr_preset"] = getattr(args, "rollout_corr_preset", None)
    record["rs_keep_rejected_in_baseline"] = getattr(args, "rs_keep_rejected_in_baseline", None)
    record["vllm_importance_sampling_correction"] = getattr(args, "vllm_importance_sampling_correction", None)
    return record


def model_card_section(correction: dict, engine: dict, task: dict, evaluation: Optional[dict] = None) -> str:
    """Markdown appended to the saved model's README.md: one table each for the correction, the engine and the task.

    Args:
        correction: from ``rollout_correction_record``.
        engine: from ``engine_record`` or ``VLLMCPURollout.describe()``.
        task: free-form ``{name: value}`` rows.
        evaluation: ``{"before": EvalResult.to_dict(), "after": ...}``; a row per entry when given.
    """
    lines = ["", "## Rollout correction (trl-rollout-corr)", "",
             "Trained with `RolloutCorrGRPOTrainer`: TRL's GRPO corrected for the mismatch between the rollout engine "
             "(mu) and the trainer (pi).", "", "| correction field | value |", "|---|---|"]
    lines += [f"| `{k}` | `{v}` |" for k, v in correction.items()]
    lines += ["", "| rollout engine | value |", "|---|---|"]
    lines += [f"| `{k}` | `{v}` |" for k, v in engine.items()]
    lines += ["", "| task | value |", "|---|---|"]
    lines += [f"| `{k}` | `{v}` |" for k, v in task.items()]
    if evaluation:
        lines += ["", "Greedy accuracy on the held-out problems:", "", "| | accuracy | correct / total |",
                  "|---|---|---|"]
        for name, res in evaluation.items():
            lines.append(
                f"| {name} | {res['accuracy']:.3f} ± {res['stderr']:.3f} | {res['correct']} / {res['total']} |"
            )
    return "\n".join(lines) + "\n"


def write_model_card(trainer: Any, output_dir: str | Path, section: str, dataset_name: Optional[str] = None) -> Path:
    """TRL's model card (``trainer.create_model_card``) with ``section`` appended; a minimal card if TRL's fails."""
    path = Path(output_dir) / "README.md"
    try:
        trainer.create_model_card(dataset_name=dataset_name, tags=["trl-rollout-corr", "rollout-correction"])
    except Exception as exc:  # offline / template problems must not lose the run
        path.write_text("---\ntags: [trl, grpo, trl-rollout-corr]\n---\n# Model trained with GRPO + rollout "
                        f"correction\n(TRL model card unavailable: {type(exc).__name__})\n")
    text = path.read_text() if path.exists() else ""
    path.write_text(text + section)
    return path


class Progress:
    """Prints ``[phase] message (elapsed)`` lines so long phases are visible (flushes immediately)."""

    def __init__(self) -> None:
        self.t0 = time.time()

    def __call__(self, phase: str, message: str) -> None:
        print(f"[{phase} +{time.time() - self.t0:6.1f}s] {message}", flush=True)


def pick_threads(requested: int = 0) -> int:
    """``requested`` if > 0, else the cores not busy with other work: ``cpu_count - round(1-min load)``, at least 1.

    On a shared machine, oversubscribing torch's intra-op pool is several times slower than one thread (measured on
    the 2-core dev box at load 3-5: a SmolLM2 forward+backward took 22-59 s on 2 threads vs 8 s on 1).
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
            ``"trl_vllm"`` (TRL's own vLLM path) or ``"transformers"`` (TRL's ``generate`` path).
        rollout_dtype: the requested rollout dtype, ``"bfloat16"`` or ``"float32"``.
        model_path: the checkpoint folder (read for its dtype with ``trl_vllm``).
        vllm_mode: TRL's ``vllm_mode`` (``"colocate"`` or ``"server"``), recorded with ``trl_vllm``.
        bf16: the trainer's ``bf16`` flag (``transformers`` generates under the trainer's autocast).

    Returns:
        ``{"rollout_engine", "rollout_dtype", "rollout_logprobs_mode", ...}``.

    Raises:
        ValueError: unknown ``rollout_engine``; or ``trl_vllm`` with a ``rollout_dtype`` other than the checkpoint's
            dtype (TRL's vLLM loads with ``dtype="auto"``, so the checkpoint dtype is what samples).
    """
    if rollout_engine == "vllm_cpu":
        return {"rollout_engine": "vllm_cpu", "rollout_dtype": rollout_dtype,
                "rollout_logprobs_mode": "processed_logprobs"}
    if rollout_engine == "trl_vllm":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
        checkpoint = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)).removeprefix("torch.")
        if checkpoint != rollout_dtype:
            raise ValueError(
                f"TRL's vLLM path loads the checkpoint with dtype='auto' = {checkpoint}, but rollout_dtype="
                f"{rollout_dtype!r}: set rollout_dtype to {checkpoint!r} (or convert the checkpoint)."
            )
        return {"rollout_engine": f"trl_vllm_{vllm_mode}", "rollout_dtype": checkpoint,
                "rollout_logprobs_mode": "processed_logprobs",
                "rollout_weight_sync": "TRL VLLMGeneration.sync_weights"}
    if rollout_engine == "transformers":
        return {"rollout_engine": "transformers.generate",
                "rollout_dtype": "bfloat16 (autocast)" if bf16 else "trainer dtype",
                "rollout_logprobs_mode": "processed scores (after logits processors)"}
    raise ValueError(f"Unknown rollout_engine {rollout_engine!r}: use vllm_cpu, trl_vllm or transformers.")
