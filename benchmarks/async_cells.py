"""What ``bench_async.py`` (issue 45's step-time split) and ``async_wallclock.py`` (issue 47's accuracy against
wall clock) share: the four settings, the vLLM server per run, the GRPO config, the trainer with its clocks, and the
per-step split.

* ``SETTINGS``: ``sync_t1`` / ``sync_t2`` (``rollout_async_depth=0``, trainer and server at 1 / 2 torch threads),
  ``async_d1`` / ``async_d2`` (``rollout_async_depth=d``, trainer 1 thread, server 1 thread) and ``async_d1_t2``
  (d = 1, trainer 2 threads, server 1 thread). Thread budget: the server's thread count is its torch/OpenMP
  threads, not the cores it occupies. vLLM CPU's engine-core process busy-waits on vLLM's shared-memory message
  queue (``shm_broadcast``'s ``SpinCondition``) while the worker process generates, so a "1-thread" server keeps up
  to 2 cores busy while it generates (1 when idle between requests). The asynchronous settings therefore ask for
  more than the 2 cores while the engine generates beside the trainer (``async_d1_t2`` the most); the CPU seconds
  each cell records (``cpu_accounting``) show what each setting used.
* ``serve``: ``--engine server``: TRL's vLLM server (``trl-rollout-corr vllm-serve``, float32, the setting's thread
  count, started per run); ``--engine transformers``: none (TRL's ``generate`` in the trainer when synchronous, the
  transformers engine process when asynchronous).
* ``TrainingClock``: wall-clock seconds of training (from ``train()``'s entry) with excluded intervals taken out;
  pure, tested with hand times.
* ``step_rows``: per optimizer step, step / generate / wait / publish / train seconds (``bench_async``'s split).

Nothing here runs at import: torch, transformers and the package are imported inside the functions (a cell sets its
thread count before torch loads).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# {setting: (rollout_async_depth, trainer torch threads, server torch threads)}
SETTINGS = {"sync_t1": (0, 1, 1), "sync_t2": (0, 2, 2), "async_d1": (1, 1, 1), "async_d2": (2, 1, 1),
            "async_d1_t2": (1, 2, 1)}
MAIN_JOB_CONFIG = ROOT / "recipes" / "configs" / "cpu_smollm2_no_correction.yaml"  # the main job's task fields
DEFAULT_PRESET = "decoupled_k3_rs_token_tis"  # the CPU default config's preset (cpu_smollm2_decoupled.yaml)


def set_threads(setting: str) -> int:
    """Pin this process to the setting's trainer torch threads (``OMP_NUM_THREADS`` too); returns the count.

    Raises:
        KeyError: an unknown setting."""
    threads = SETTINGS[setting][1]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return threads


def main_job_tasks(train_size: int = 2000, eval_size: int = 1):
    """The main job's chain_sum task (``MAIN_JOB_CONFIG``: task, task_config, train_seed, eval_seed, instruction
    default) as (train task of ``train_size`` items, held-out task of ``eval_size`` items): the held-out items are
    ``policy_lag_experiment``'s (eval_seed 1000000, items in order)."""
    import json

    import yaml

    sys.path.insert(0, str(ROOT / "recipes"))
    import grpo_recipe_utils as ru

    cfg = yaml.safe_load(MAIN_JOB_CONFIG.read_text())
    return ru.make_task_splits(cfg["task"], json.loads(cfg["task_config"]), train_size, cfg["train_seed"], eval_size,
                               cfg["eval_seed"], ru.DEFAULT_INSTRUCTION)


def serve(setting: str, model: str, engine: str, log_path: Path, spin_s: float = 0.0):
    """A context giving the run's vLLM server (``engine == "server"``: float32, the setting's server threads
    (``SETTINGS[setting][2]``: its OpenMP threads; it occupies more cores while generating, see above), 1024-token
    context, started here, stopped at exit) or None (``"transformers"``).

    Raises:
        ValueError: another engine name."""
    if engine == "transformers":
        return contextlib.nullcontext(None)
    if engine != "server":
        raise ValueError(f"engine {engine!r}: use 'server' (TRL's vLLM server) or 'transformers'")
    from trl_rollout_corr.engines.vllm_serve import VLLMServer

    threads = str(SETTINGS[setting][2])
    return VLLMServer(model, "float32", log_path=str(log_path), timeout_s=600, extra_args=["--max_model_len", "1024"],
                      env={"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                           "TRL_ROLLOUT_CORR_VLLM_SPIN_S": f"{spin_s:g}"})


def grpo_config(setting: str, out: Path, server, *, steps: int, batch: int, lr: float, preset: str, seed: int,
                max_completion_length: int = 32):
    """The run's ``RolloutCorrGRPOConfig``: the main job's GRPO (4 completions a prompt, ``batch`` completions a
    step, ``max_completion_length`` tokens, constant ``lr``, temperature 1, beta 0, DAPO loss, float32 on CPU),
    ``preset``, the setting's ``rollout_async_depth`` (engine 1 thread), and TRL's server mode when ``server``."""
    import torch

    from trl_rollout_corr.engines.vllm_serve import free_port
    from trl_rollout_corr.trainer import RolloutCorrGRPOConfig

    depth = SETTINGS[setting][0]
    return RolloutCorrGRPOConfig(
        output_dir=str(out / setting), per_device_train_batch_size=batch, num_generations=4,
        max_completion_length=max_completion_length, max_steps=steps, learning_rate=lr,
        lr_scheduler_type="constant", temperature=1.0, beta=0.0, loss_type="dapo", logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=seed, disable_tqdm=True,
        rollout_corr_preset=preset, rollout_async_depth=depth, rollout_async_engine_threads=1,
        model_init_kwargs={"dtype": torch.float32},
        **({} if server is None else dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url,
                                          vllm_group_port=free_port(), vllm_server_timeout=60,
                                          rollout_async_server_log=str(server.log_path))))


class TrainingClock:
    """Training seconds on the wall clock, with excluded intervals (e.g. weight snapshots for the evaluation) taken
    out. Times are ``time.perf_counter()`` seconds passed in by the caller (hand values in the tests).

    ``start(t)`` at ``train()``'s entry (before TRL builds its dataloader and the asynchronous engine starts);
    ``step_begin(t)`` / ``step_end(t)`` around each optimizer step; ``exclude(a, b)`` for a paused interval.
    ``step_s``: each step's seconds less the excluded time inside it; ``at_step_end``: training seconds from the
    start to each step's end, less every interval excluded before then; ``excluded_s``: their total.

    Raises:
        RuntimeError: a step or exclusion before ``start``, a ``step_end`` without its ``step_begin``.
        ValueError: an interval that ends before it begins, or a time before the start."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.excluded_s = 0.0
        self.step_s: list[float] = []
        self.at_step_end: list[float] = []
        self._begin: tuple[float, float] | None = None

    def _since_start(self, t: float) -> float:
        if self.t0 is None:
            raise RuntimeError("TrainingClock: start(t) first (at train()'s entry)")
        if t < self.t0:
            raise ValueError(f"time {t} is before the clock's start {self.t0}")
        return t - self.t0

    def start(self, t: float) -> None:
        self.t0, self.excluded_s, self.step_s, self.at_step_end, self._begin = t, 0.0, [], [], None

    def step_begin(self, t: float) -> None:
        self._since_start(t)
        self._begin = (t, self.excluded_s)

    def step_end(self, t: float) -> float:
        """Record a step's end; returns the training seconds so far."""
        since = self._since_start(t)
        if self._begin is None:
            raise RuntimeError("TrainingClock: step_end without step_begin")
        begin, excluded_before = self._begin
        self.step_s.append(t - begin - (self.excluded_s - excluded_before))
        self.at_step_end.append(since - self.excluded_s)
        self._begin = None
        return self.at_step_end[-1]

    def exclude(self, a: float, b: float) -> None:
        self._since_start(a)
        if b < a:
            raise ValueError(f"an excluded interval ends ({b}) before it begins ({a})")
        self.excluded_s += b - a


def clocked_trainer(clock: TrainingClock, after_step=None):
    """The run's trainer class and its callback: ``RolloutCorrGRPOTrainer`` that starts ``clock`` at ``train()``'s
    entry and records each synchronous generation's seconds (``generate_s``: (global step, s) pairs; the
    asynchronous engine logs its own), and a ``TrainerCallback`` instance stamping each step on ``clock``; then, at
    ``on_step_end``, ``after_step(state)`` runs with its own time excluded from the clock. Add the callback with
    ``trainer.add_callback`` (after the trainer's own, so the asynchronous engine has its weights first)."""
    from transformers import TrainerCallback

    from trl_rollout_corr.trainer import RolloutCorrGRPOTrainer

    class Clocked(RolloutCorrGRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.generate_s: list[tuple[int, float]] = []

        def train(self, *a, **kw):
            clock.start(time.perf_counter())
            return super().train(*a, **kw)

        def _generate_single_turn(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generate_s.append((self.state.global_step, time.perf_counter() - started))

    class Stamp(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.step_begin(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_end(time.perf_counter())
            if after_step is not None:
                started = time.perf_counter()
                after_step(state)
                clock.exclude(started, time.perf_counter())

    return Clocked, Stamp()


def step_rows(depth: int, step_s: list[float], logs: list[dict], generate_s: list[tuple[int, float]]) -> list[dict]:
    """Per optimizer step: ``step``, ``step_s``, ``generate_s``, ``wait_s``, ``publish_s``, ``train_s``.

    Asynchronous (``depth`` >= 1): generate / wait / publish are the engine's logged ``rollout_async/generate_s``,
    ``trainer_wait_s`` and ``publish_s``; train = step - wait - publish. Synchronous: generate = the seconds inside
    ``_generate_single_turn`` during the step (``generate_s`` pairs of the 0-based global step it started at, the
    weight sync included); train = step - generate. ``logs``: TRL's log rows with a ``loss``, one per step."""
    rows = []
    for i, (s, h) in enumerate(zip(step_s, logs)):
        if depth:
            gen, wait, pub = (h.get(f"rollout_async/{k}", 0.0) for k in ("generate_s", "trainer_wait_s",
                                                                            "publish_s"))
            rows.append(dict(step=i + 1, step_s=s, generate_s=gen, wait_s=wait, publish_s=pub,
                             train_s=s - wait - pub))
        else:
            gen = sum(g_s for g, g_s in generate_s if g == i)
            rows.append(dict(step=i + 1, step_s=s, generate_s=gen, wait_s=0.0, publish_s=0.0, train_s=s - gen))
    return rows


def close(trainer, server) -> None:
    """Close TRL's weight-sync communicator with the server (server mode only)."""
    if server is not None:
        trainer.vllm_generation.vllm_client.close_communicator()
