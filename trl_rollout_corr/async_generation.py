"""The trainer side of asynchronous GRPO (issue 45, ``rollout_async_depth = d >= 1``).

TRL 1.16 hands the generation path a generation batch only when it trains it (``_prepare_inputs``), so generating
ahead needs the prompts earlier. ``AsyncGeneration`` takes them from TRL's own training dataloader:
``get_train_dataloader`` is wrapped in ``LookAheadLoader``, which pulls the next d generation batches ahead of the
batch being trained (the same items, in the same order, TRL then receives), tokenises them with TRL's own
``_tokenize_prompts`` and submits them to the engine's worker (``engines.async_pipeline``). When TRL generates
(``_generate_single_turn``), the trainer takes the submitted batch instead (its prompt ids must be the ones TRL
tokenised: else an error).

Versions, exactly: generation batch j is first trained at optimizer step ``s_j = (j * generate_every) //
gradient_accumulation_steps`` (``trl_compat.first_optimizer_step``) and generated with the weights of version
``max(0, s_j - d)``: the weights after optimizer step ``s_j - d``. The trainer publishes a CPU copy of its weights
after every optimizer step some batch needs (a ``TrainerCallback``'s ``on_step_end``), and each row carries the
version the engine reports it held (``PolicyLag`` reads ``row_versions``), checked against the rule.

Per-step metrics (averaged by TRL's ``log``): ``rollout_async/trainer_wait_s`` (the trainer waiting for its batch),
``rollout_async/engine_idle_s`` (the engine waiting for the batch's weights), ``rollout_async/generate_s`` (the
engine generating it), ``rollout_async/publish_s`` (the trainer copying weights), ``rollout_async/version``.

Engines: ``use_vllm=False``: ``engines.async_pipeline.TransformersProcessEngine``, a child process sampling the
temperature-scaled distribution; ``use_vllm=True, vllm_mode="server"``: TRL's vLLM server through TRL's client
(``engines.async_vllm_server.VLLMServerEngine``). Supported: one process, no tools / environments /
``rollout_func`` / images, no PEFT, no resume from a checkpoint, no evaluation in server mode; anything else is
refused with the reason.
"""

from __future__ import annotations

import collections
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Optional

from transformers import TrainerCallback

from . import trl_compat
from .engines.async_pipeline import AsyncRolloutPipeline, TransformersProcessEngine, request_seed
from .engines.async_vllm_server import VLLMServerEngine

if TYPE_CHECKING:
    from .trainer import RolloutCorrGRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["AsyncGeneration", "LookAheadLoader"]


def check_async_trainer(trainer: "RolloutCorrGRPOTrainer") -> None:
    """Refuse what the asynchronous pipeline cannot serve, naming the fix.

    Raises:
        ValueError: several processes, a ``rollout_func``, tools or environments, a vision model, PEFT, a sampler
            the engine does not reproduce (top-k / top-p / min-p / repetition penalty / greedy), or features that
            need the in-process ``generate`` (``routing_replay``, ``rollout_support_matching="replay"``).
    """
    args = trainer.args
    why = None
    if trainer.accelerator.num_processes > 1:
        why = f"it runs on one process, not {trainer.accelerator.num_processes}"
    elif trainer.rollout_func is not None:
        why = "a rollout_func generates by itself"
    elif trainer.tools or trainer.environment_factories is not None:
        why = "tool calls and environments generate several turns in the trainer"
    elif trainer._is_vlm:
        why = "vision-language models are not supported by its engine"
    elif hasattr(trainer.model, "peft_config"):
        why = "PEFT adapters are not published to its engine"
    elif args.routing_replay != "off" or args.rollout_support_matching == "replay":
        why = "routing replay and support replay record inside the trainer's own generate"
    elif trainer.use_vllm and args.eval_strategy != "no":
        why = ("evaluation would sync TRL's vLLM server from the trainer while the pipeline's worker owns it; "
               "set eval_strategy='no'")
    elif not trainer.use_vllm:
        config = trl_compat.resolved_generation_config(trainer.accelerator.unwrap_model(trainer.model),
                                                       trainer.generation_config)
        unsupported = trl_compat.truncating_sampler_settings(config)
        if unsupported:
            why = (f"its engine samples the temperature-scaled distribution only, but the sampler sets "
                   f"{', '.join(unsupported)}")
    if why is not None:
        raise ValueError(f"rollout_async_depth={args.rollout_async_depth}: {why}. Set rollout_async_depth=0 "
                         "(synchronous generation) or remove the setting.")


class LookAheadLoader:
    """TRL's training dataloader, pulling each generation batch's items ``depth`` generation batches ahead and
    submitting each batch's prompts when its first item is pulled. Yields exactly the underlying items, in order;
    every other attribute is the loader's."""

    def __init__(self, loader, owner: "AsyncGeneration") -> None:
        self._loader = loader
        self._owner = owner

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def __iter__(self):
        owner = self._owner
        every = owner.generate_every
        ahead = (owner.depth + 1) * every  # the batch being trained and the next d
        items = iter(self._loader)
        buffer: collections.deque = collections.deque()
        exhausted = False
        while True:
            while not exhausted and len(buffer) < ahead - owner.yielded % every:
                try:
                    item = next(items)
                except StopIteration:
                    exhausted = True
                    break
                if owner.pulled % every == 0:
                    owner.submit(item)
                owner.pulled += 1
                buffer.append(item)
            if not buffer:
                return
            owner.yielded += 1
            yield buffer.popleft()


class _Publisher(TrainerCallback):
    """Publishes the weights after every optimizer step that a generation batch needs."""

    def __init__(self, owner: "AsyncGeneration") -> None:
        self.owner = owner

    def on_step_end(self, args, state, control, **kwargs):
        self.owner.publish(state.global_step)


class AsyncGeneration:
    """The asynchronous pipeline of one trainer (module docstring).

    Attributes:
        depth: ``rollout_async_depth`` (d >= 1).
        generate_every: micro-steps per generation batch (TRL's ``steps_per_generation * num_iterations``).
        pipeline: the running ``AsyncRolloutPipeline`` (None outside ``train``).
        engine_pid: the engine process's pid while it runs (tests; None for TRL's server, which is not ours).
        log_path: the transformers engine's log file.
    """

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        check_async_trainer(trainer)
        self.trainer = trainer
        args = trainer.args
        self.depth = int(args.rollout_async_depth)
        self.generate_every = trl_compat.generate_every(args, trainer.num_iterations)
        self.accumulation = args.gradient_accumulation_steps
        self.pipeline: Optional[AsyncRolloutPipeline] = None
        self.engine = None
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self.log_path = os.path.join(args.output_dir, "rollout_async_engine.log")
        self.pulled = self.yielded = 0
        self.steps_in_epoch: Optional[int] = None  # micro-steps per epoch: len(TRL's loader), set by start
        self._prompts: dict[int, list] = {}
        self._taken = -1
        self.row_versions: Optional[list[int]] = None  # the current batch's, read by PolicyLag
        trainer.add_callback(_Publisher(self))

    # ------------------------------------------------------------------ versions
    def first_step(self, batch: int) -> int:
        """The optimizer step that first trains generation batch ``batch``."""
        return trl_compat.first_optimizer_step(batch, self.generate_every, self.accumulation, self.steps_in_epoch)

    def batch_version(self, batch: int) -> int:
        """The version generation batch ``batch`` is generated with: ``max(0, s_j - d)``."""
        return max(0, self.first_step(batch) - self.depth)

    # ------------------------------------------------------------------ lifecycle
    def start(self, loader):
        """Start the engine with the current weights as version 0 and return the look-ahead loader.

        Raises:
            ValueError: the trainer is not at optimizer step 0 (a resume: not supported yet).
            EngineError: the engine did not start (its log's last lines).
        """
        self.close()
        trainer = self.trainer
        if trainer.state.global_step != 0:
            raise ValueError(
                f"rollout_async_depth={self.depth}: resuming at optimizer step {trainer.state.global_step} is not "
                "supported (the pipeline's versions start at step 0); resume with rollout_async_depth=0.")
        args = trainer.args
        if trainer.use_vllm:  # TRL's vLLM server, through TRL's client
            vllm = trainer.vllm_generation
            self.engine = VLLMServerEngine(
                vllm.vllm_client, sampling=trl_compat.vllm_server_sampling(vllm),
                param_name=lambda name: trl_compat.vllm_param_name(vllm, name),
                timeout_s=args.rollout_async_timeout_s, log_path=args.rollout_async_server_log)
        else:
            model = trainer.accelerator.unwrap_model(trainer.model)
            self._dir = tempfile.TemporaryDirectory(prefix="rollout_async_")
            model.save_pretrained(self._dir.name)
            self.engine = TransformersProcessEngine(
                self._dir.name, temperature=args.temperature, max_tokens=args.max_completion_length,
                eos_token_ids=trainer.eos_token_ids, threads=args.rollout_async_engine_threads,
                timeout_s=args.rollout_async_timeout_s, log_path=self.log_path)
        self.engine.start()
        self.pipeline = AsyncRolloutPipeline(self.engine, batch_version=self.batch_version,
                                             timeout_s=args.rollout_async_timeout_s)
        self.pulled = self.yielded = 0
        try:
            self.steps_in_epoch = len(loader)  # an epoch's last optimizer step may be shorter (first_step)
        except TypeError:  # an iterable dataset: one epoch, no boundary
            self.steps_in_epoch = None
        self._prompts.clear()
        self._taken = -1
        self.publish(0)
        return LookAheadLoader(loader, self)

    @property
    def engine_pid(self) -> Optional[int]:
        return None if self.engine is None else self.engine.pid

    def close(self) -> None:
        """Stop the worker thread and the engine process; remove the saved model. Idempotent."""
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is not None:
            pipeline.close()
        if self.engine is not None:
            self.engine.close()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    # ------------------------------------------------------------------ the three calls
    def publish(self, version: int) -> None:
        """Copy the weights to CPU and publish them as ``version`` if a batch needs them."""
        if self.pipeline is None or not self.pipeline.needs(version):
            return
        started = time.perf_counter()
        self.pipeline.publish(version, self.engine.snapshot(self.trainer.accelerator.unwrap_model(self.trainer.model)))
        self.trainer.trl_metric("rollout_async/publish_s", time.perf_counter() - started)

    def submit(self, items: list) -> None:
        """Tokenise a generation batch's prompts as TRL will and submit them with their per-row seeds."""
        batch = self.pulled // self.generate_every
        prompt_ids = trl_compat.generation_prompt_ids(self.trainer, items)
        seed = self.trainer.args.seed
        seeds = [request_seed(seed, batch, row) for row in range(len(prompt_ids))]
        self._prompts[batch] = prompt_ids
        self.pipeline.submit(batch, prompt_ids, seeds)

    def take(self, prompt_ids: list) -> tuple[list, list]:
        """The next submitted batch's completions and mu for TRL's ``_generate_single_turn``; sets
        ``row_versions``.

        Raises:
            RuntimeError: TRL generates other prompts, or at another step, than the pipeline submitted (a TRL change
                the pins missed), or the engine's version breaks the rule.
            EngineError: the engine died, hung or failed.
        """
        trainer = self.trainer
        batch = self._taken + 1
        step = trainer.state.global_step
        if trl_compat.micro_step(trainer) != batch * self.generate_every or step != self.first_step(batch):
            raise RuntimeError(
                f"asynchronous generation: TRL generates at micro-step {trl_compat.micro_step(trainer)} (optimizer "
                f"step {step}), but generation batch {batch} starts at micro-step {batch * self.generate_every} "
                f"(step {self.first_step(batch)}); report this.")
        submitted = self._prompts.pop(batch, None)
        if submitted != [list(p) for p in prompt_ids]:
            raise RuntimeError(f"asynchronous generation: TRL's prompts of generation batch {batch} are not the ones "
                               "taken ahead from its dataloader; report this.")
        result = self.pipeline.take(batch)
        self._taken = batch
        if result.version != self.batch_version(batch):
            raise RuntimeError(f"generation batch {batch} was generated at version {result.version}, not "
                               f"{self.batch_version(batch)}.")
        self.row_versions = [result.version] * len(prompt_ids)
        for name, value in (("trainer_wait_s", result.trainer_wait_s), ("engine_idle_s", result.engine_idle_s),
                            ("generate_s", result.generate_s), ("version", float(result.version))):
            trainer.trl_metric(f"rollout_async/{name}", value)
        return result.completion_ids, result.log_probs

    def take_row_versions(self) -> Optional[list[int]]:
        """The versions of the batch just taken (once), else None."""
        versions, self.row_versions = self.row_versions, None
        return versions
