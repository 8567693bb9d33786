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
``max(0, s_j - d)``: the weights after optimizer step ``s_j - d`` (after a resume at R: ``max(R, s_j - d)``). The
trainer publishes a CPU copy of its weights after every optimizer step some batch needs (a ``TrainerCallback``'s
``on_step_end``), and each row carries the version the engine reports it held (``PolicyLag`` reads
``row_versions``), checked against the rule.

Per-step metrics (averaged by TRL's ``log``; ``ASYNC_METRICS``, documented by ``metric_catalog``):
``rollout_async/trainer_wait_s`` (the trainer waiting for its batch), ``rollout_async/engine_idle_s`` (the engine
waiting for the batch's weights), ``rollout_async/generate_s`` (the engine generating it), ``rollout_async/publish_s``
(the trainer copying weights), ``rollout_async/version``.

Engines: ``use_vllm=False``: ``engines.async_pipeline.TransformersProcessEngine``, a child process sampling the
temperature-scaled distribution; ``use_vllm=True, vllm_mode="server"``: TRL's vLLM server through TRL's client
(``engines.async_vllm_server.VLLMServerEngine``). The engine starts when training begins (``on_train_begin``), at
the optimizer step R the run starts or resumes at, with the current weights as version R: a resumed run holds no
older weights, so batch j is generated with ``max(R, s_j - d)`` (``batch_version``) and keeps its index, prompts
and seeds from the run's start (TRL's loader skips the trained items through ``LookAheadLoader.skip_first``).
The run ends at the Trainer's ``max_steps`` (also when ``num_train_epochs`` sets it): the look-ahead submits only
the generation batches up to the one holding its last micro-step (``end_batch``), so the engine generates, and the
trainer publishes weights for, exactly the batches TRL trains; the items still flow to TRL unchanged.
Supported: one process, no tools / environments / ``rollout_func`` / images, no PEFT, no evaluation in server mode,
a resume only at a generation boundary, a finite iterable dataset's pass a multiple of the accumulation (refused at
the pass's end otherwise: its length is not known before, ``end_of_pass``); anything else is refused with the reason.
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

__all__ = ["ASYNC_METRICS", "AsyncGeneration", "LookAheadLoader"]

# The keys this module logs through ``trl_metric``, the ones ``metric_catalog.METRICS`` must document
# (``tests/unit/test_metric_catalog.py``): per batch taken (``AsyncGeneration.take``, in this order) and per publish.
TAKE_METRICS = ("rollout_async/trainer_wait_s", "rollout_async/engine_idle_s", "rollout_async/generate_s",
                "rollout_async/version")
PUBLISH_METRIC = "rollout_async/publish_s"
ASYNC_METRICS = (*TAKE_METRICS, PUBLISH_METRIC)


def _batches_holding(micro: Optional[int], generate_every: int) -> Optional[int]:
    """The generation batches (``generate_every`` micro-steps each) holding micro-steps 0..``micro`` - 1 (None: no
    end)."""
    return None if micro is None else -(-micro // generate_every)


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
        why = (f"it runs on one process, not {trainer.accelerator.num_processes} (with several ranks each rank's "
               "look-ahead batches would need its engine and rank-distinct seeds, and TRL 1.16's server mode holds "
               "its VLLMClient on the main process only: not built, docs/reference/known-limits.md)")
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
        unsupported = truncating_sampler_settings(config) + ignored_generation_settings(trainer, config)
        if unsupported:
            why = (f"its engine (transformers, in its own process) samples softmax(logits / temperature) of the "
                   f"full vocabulary up to max_completion_length tokens only, but the sampler sets "
                   f"{', '.join(unsupported)}: remove them (generation_kwargs, or the model's "
                   "generation_config.json), or use TRL's vLLM server as the engine (use_vllm=True, "
                   "vllm_mode='server')")
    if why is not None:
        raise ValueError(f"rollout_async_depth={args.rollout_async_depth}: {why}. Set rollout_async_depth=0 "
                         "(synchronous generation) or remove the setting.")


# GenerationConfig fields that add a logits processor or a stopping rule transformers' generate would apply and the
# transformers engine (``engines.async_pipeline._sample_row``) does not, with their neutral values.
IGNORED_BY_ENGINE = {
    "min_length": (None, 0), "min_new_tokens": (None, 0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None, []), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "sequence_bias": (None, {}), "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
    "exponential_decay_length_penalty": (None,), "encoder_repetition_penalty": (None, 1.0),
    "renormalize_logits": (None, False), "stop_strings": (None, [], ""), "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
}


def truncating_sampler_settings(config) -> list[str]:
    """The settings of a resolved ``GenerationConfig`` under which sampling is not ``softmax(logits /
    temperature)`` of the full vocabulary (greedy, top-k, top-p, min-p, typical, repetition penalty), as
    ``name=value``."""
    out = []
    if not config.do_sample or (config.num_beams or 1) > 1:
        out.append(f"do_sample={config.do_sample}, num_beams={config.num_beams}")
    for name, neutral in (("top_k", (None, 0)), ("top_p", (None, 1.0)), ("min_p", (None, 0.0)),
                          ("typical_p", (None, 1.0)), ("repetition_penalty", (None, 1.0))):
        value = getattr(config, name, None)
        if value not in neutral:
            out.append(f"{name}={value!r}")
    return out



def ignored_generation_settings(trainer: "RolloutCorrGRPOTrainer", config) -> list[str]:
    """The settings of the resolved ``GenerationConfig`` (``args.generation_kwargs`` applied) that the
    transformers engine would silently ignore, as ``name=value``: logits processors and stopping rules
    (``IGNORED_BY_ENGINE``), a ``temperature`` or ``max_new_tokens`` other than the config's ``temperature`` /
    ``max_completion_length`` (the engine samples with those)."""
    out = [f"{name}={getattr(config, name)!r}" for name, neutral in IGNORED_BY_ENGINE.items()
           if getattr(config, name, None) not in neutral]
    args = trainer.args
    if config.temperature != args.temperature:
        out.append(f"temperature={config.temperature!r} (the engine samples at args.temperature={args.temperature})")
    if config.max_new_tokens != args.max_completion_length:
        out.append(f"max_new_tokens={config.max_new_tokens!r} (the engine stops at max_completion_length="
                   f"{args.max_completion_length})")
    return out


class LookAheadLoader:
    """TRL's training dataloader, pulling each generation batch's items ``depth`` generation batches ahead and
    submitting each batch's prompts when its first item is pulled. Yields exactly the underlying items, in order;
    every other attribute is the loader's. ``skipped``: the items a resumed epoch skipped (``skip_first``)."""

    def __init__(self, loader, owner: "AsyncGeneration", skipped: int = 0) -> None:
        self._loader = loader
        self._owner = owner
        self._skipped = skipped

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def skip_first(self, n: int, skip_first_batches) -> "LookAheadLoader":
        """A resumed epoch (``trl_compat.loader_skips_itself``): this loader over ``skip_first_batches(TRL's
        loader, n)``; the items skipped were trained before the checkpoint and are never submitted."""
        return LookAheadLoader(skip_first_batches(self._loader, n), self._owner, n)

    def __iter__(self):
        owner = self._owner
        every = owner.generate_every
        ahead = (owner.depth + 1) * every  # the batch being trained and the next d
        items = iter(self._loader)
        buffer: collections.deque = collections.deque()
        exhausted, position = False, self._skipped  # transformers' step counter within the epoch, plus one
        while True:
            while not exhausted and len(buffer) < ahead - owner.yielded % every:
                try:
                    item = next(items)
                except StopIteration:
                    exhausted = True
                    owner.end_of_pass(position)
                    break
                position += 1
                if owner.pulled % every == 0:
                    owner.submit(item)
                owner.pulled += 1
                buffer.append(item)
            if not buffer:
                return
            owner.yielded += 1
            yield buffer.popleft()


class _Publisher(TrainerCallback):
    """Starts the engine when training begins; publishes the weights after every optimizer step that a generation
    batch needs."""

    def __init__(self, owner: "AsyncGeneration") -> None:
        self.owner = owner

    def on_train_begin(self, args, state, control, **kwargs):
        self.owner.begin(state.global_step, state.max_steps)  # a resumed state is restored by now

    def on_step_end(self, args, state, control, **kwargs):
        self.owner.publish(state.global_step)


class AsyncGeneration:
    """The asynchronous pipeline of one trainer (module docstring).

    Attributes:
        depth: ``rollout_async_depth`` (d >= 1).
        generate_every: micro-steps per generation batch (TRL's ``steps_per_generation * num_iterations``).
        pipeline: the running ``AsyncRolloutPipeline`` (None outside ``train``).
        end_batch: one past the last generation batch the run trains (``begin``; None before it).
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
        self.pulled = self.yielded = 0  # dataloader items (micro-steps, over epochs) pulled / handed to TRL
        self.resume_step = self.micro_offset = 0  # the optimizer step and micro-step the run (re)started at
        self.steps_in_epoch: Optional[int] = None  # micro-steps per epoch: len(TRL's loader), set by start
        self.end_batch: Optional[int] = None
        self.end_micro: Optional[int] = None  # one past the run's last micro-step (begin; None: unknown)
        self._prompts: dict[int, list] = {}
        self._taken = -1
        self.row_versions: Optional[list[int]] = None  # the current batch's, read by PolicyLag
        trainer.add_callback(_Publisher(self))

    # ------------------------------------------------------------------ versions
    def first_step(self, batch: int) -> int:
        """The optimizer step that first trains generation batch ``batch``."""
        return trl_compat.first_optimizer_step(batch, self.generate_every, self.accumulation, self.steps_in_epoch)

    def batch_version(self, batch: int) -> int:
        """The version generation batch ``batch`` is generated with: ``max(R, s_j - d)``, R the optimizer step the
        run started or resumed at (a resumed run holds no weights older than its checkpoint's: the first d steps
        after a resume at R train batches generated with the weights of step R, lag ``s_j - R < d``)."""
        return max(self.resume_step, self.first_step(batch) - self.depth)

    # ------------------------------------------------------------------ lifecycle
    def start(self, loader):
        """Wrap TRL's training dataloader in the look-ahead loader (the engine starts at ``begin``, once the
        Trainer has restored a resumed state)."""
        self.close()
        try:
            self.steps_in_epoch = len(loader)  # an epoch's last optimizer step may be shorter (first_step)
        except TypeError:  # an iterable dataset: one epoch, no boundary
            self.steps_in_epoch = None
        return LookAheadLoader(loader, self)

    def resume_micro_step(self, step: int) -> int:
        """The micro-step (dataloader item, counted over epochs) at which training resumes at optimizer step
        ``step``, as transformers 5.x skips: ``epoch * steps_in_epoch + (step % steps_per_epoch) * accumulation``.

        Raises:
            ValueError: ``ignore_data_skip`` (the items would not be the ones the pipeline expects), or a step
                inside a generation batch (TRL 1.16's micro-step counter restarts at 0 on resume, so TRL would
                regenerate that batch's rest from other prompts than the run that saved the checkpoint).
        """
        if step == 0:
            return 0
        if self.trainer.args.ignore_data_skip:
            raise ValueError(f"rollout_async_depth={self.depth}: resuming with ignore_data_skip=True would train "
                             "other prompts than the pipeline takes ahead; set ignore_data_skip=False.")
        micro = trl_compat.micro_steps_at(step, self.accumulation, self.steps_in_epoch)
        if micro % self.generate_every:
            raise ValueError(
                f"rollout_async_depth={self.depth}: the checkpoint at optimizer step {step} (micro-step {micro}) lies "
                f"inside a generation batch of {self.generate_every} micro-steps; TRL regenerates such a batch's "
                "rest on resume. Resume from a checkpoint at a generation boundary (save_steps a multiple of "
                "steps_per_generation * num_iterations / gradient_accumulation_steps).")
        return micro

    def end_of_run(self, step: int, max_steps: Optional[int]) -> Optional[int]:
        """One past the last generation batch a run started (or resumed) at optimizer step ``step`` trains when the
        Trainer stops at ``max_steps`` (``trl_compat.micro_steps_trained``): the batch holding its last micro-step.
        None: ``max_steps`` unknown (no end)."""
        return _batches_holding(
            trl_compat.micro_steps_trained(step, max_steps, self.accumulation, self.steps_in_epoch),
            self.generate_every)

    def end_of_pass(self, items: int) -> None:
        """The loader ran out after ``items`` items of its epoch (counted from the epoch's start, a resumed epoch's
        skipped items included). A sized loader's epoch ends where ``first_step`` expects. An iterable dataset's
        (no length: transformers 5.x runs epochs of ``max_steps * gradient_accumulation_steps`` items and iterates it
        again when a finite one runs out) ends an optimizer step there only if ``items`` is a multiple of the
        accumulation; else its last ``items % accumulation`` items are trained in one optimizer step with the next
        pass's first ones, and the optimizer steps no longer follow the micro-steps as ``first_step`` counts them.

        Raises:
            ValueError: such a pass whose last items the run trains (the run continues past its last full optimizer
                step), naming the fix.
        """
        rest = items % self.accumulation
        if self.steps_in_epoch is not None or not rest:
            return
        if self.end_micro is not None and self.pulled - rest >= self.end_micro:
            return  # the run stops at the pass's last full optimizer step: its last items are never trained
        raise ValueError(
            f"rollout_async_depth={self.depth}: the training dataset is a finite iterable dataset whose pass of "
            f"{items} dataloader items (micro-steps, {self.generate_every} per generation batch: steps_per_generation "
            f"* num_iterations) is not a multiple of gradient_accumulation_steps={self.accumulation}: transformers "
            f"trains its last {rest} in one optimizer step with the next pass's first ones, which asynchronous "
            "generation does not follow. Make steps_per_generation * num_iterations a multiple of "
            "gradient_accumulation_steps (TRL's default steps_per_generation equals it), or trim the dataset so that "
            "a pass is a multiple of gradient_accumulation_steps items, or use a map-style datasets.Dataset (an "
            "epoch's short last step is followed) or an endless stream.")

    def begin(self, step: int, max_steps: Optional[int] = None) -> None:
        """Start the engine at optimizer step ``step`` (0, or the resumed checkpoint's: ``on_train_begin``) with
        the current weights as version ``step``; generation batches are numbered from the run's start, so a
        resumed run's batch j has the same index, prompts and seeds as in the run that saved the checkpoint.
        Only the batches up to ``max_steps`` (``end_of_run``) are generated.

        Raises:
            ValueError: see ``resume_micro_step``.
            EngineError: the engine did not start (its log's last lines).
        """
        self.close()
        micro = self.resume_micro_step(step)
        trainer, args = self.trainer, self.trainer.args
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
        self.resume_step, self.micro_offset = step, micro
        first = micro // self.generate_every
        self.end_micro = trl_compat.micro_steps_trained(step, max_steps, self.accumulation, self.steps_in_epoch)
        self.end_batch = _batches_holding(self.end_micro, self.generate_every)  # end_of_run, counted once
        self.pipeline = AsyncRolloutPipeline(self.engine, batch_version=self.batch_version,
                                             timeout_s=args.rollout_async_timeout_s, first_batch=first,
                                             end_batch=self.end_batch)
        self.pulled = self.yielded = micro
        self._prompts.clear()
        self._taken = first - 1
        self.publish(step)

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
        self.trainer.trl_metric(PUBLISH_METRIC, time.perf_counter() - started)

    def submit(self, items: list) -> None:
        """Tokenise a generation batch's prompts as TRL will and submit them with their per-row seeds; a batch at
        or past ``end_batch`` (after the run's ``max_steps``: TRL never trains it) is not submitted."""
        batch = self.pulled // self.generate_every
        if self.end_batch is not None and batch >= self.end_batch:
            return
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
        micro = self.micro_offset + trl_compat.micro_step(trainer)  # TRL counts from the (re)start
        if micro != batch * self.generate_every or step != self.first_step(batch):
            raise RuntimeError(
                f"asynchronous generation: TRL generates at micro-step {micro} (optimizer "
                f"step {step}), but generation batch {batch} starts at micro-step {batch * self.generate_every} "
                f"(step {self.first_step(batch)}); report this.")
        if self.end_batch is not None and batch >= self.end_batch:
            raise RuntimeError(f"asynchronous generation: TRL generates batch {batch} at optimizer step {step}, past "
                               f"the {self.end_batch} batches its max_steps={self.trainer.state.max_steps} trains "
                               "(not generated); report this.")
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
        values = (result.trainer_wait_s, result.engine_idle_s, result.generate_s, float(result.version))
        for name, value in zip(TAKE_METRICS, values, strict=True):
            trainer.trl_metric(name, value)
        return result.completion_ids, result.log_probs

    def take_row_versions(self) -> Optional[list[int]]:
        """The versions of the batch just taken (once), else None."""
        versions, self.row_versions = self.row_versions, None
        return versions
