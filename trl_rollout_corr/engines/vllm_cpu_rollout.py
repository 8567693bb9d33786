"""A TRL ``rollout_func`` that drives the in-process vLLM CPU engine of ``engines/vllm_cpu.py`` from ``GRPOTrainer``.

``VLLMCPURollout`` plugs the engine into ``GRPOTrainer(rollout_func=...)`` (TRL 1.16's public hook, so TRL's own
GPU-oriented vLLM colocate path is not used on CPU): it syncs the trainer's weights whenever the optimizer step
changed (or every ``sync_interval`` steps, or ``async_depth`` steps behind: ``lag.WeightSchedule``), samples with
the trainer's generation settings and returns the sampled tokens' processed log-probs as ``logprobs`` (mu, token
for token with ``completion_ids``) and the version of the weights it generated with as ``policy_version``.

This is the module of the engine that knows TRL. What it relies on, all in TRL 1.16 and pinned by
``tests/e2e/test_vllm_cpu.py``: the ``rollout_func(prompts, trainer)`` contract of ``GRPOTrainer._generate`` (returns
``prompt_ids``, ``completion_ids``, ``logprobs``); ``GRPOTrainer._tokenize_prompts(prompts) -> (prompt_ids, images,
multimodal_fields)``, so that prompts are tokenised exactly as TRL's own paths do (``tokenize``); public trainer
attributes (``state.global_step``, ``accelerator``, ``model``, ``args.generation_kwargs``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_completion_length``); ``GRPOTrainer._metrics`` for
the timing metrics (``log_trl_metric``); ``trl_compat.micro_step`` / ``generate_every`` (``per_request_seeds``).

``VLLMCPURollout.sampler_contract(trainer)`` tells ``RolloutCorrGRPOTrainer`` what the engine samples with (the
same keyword arguments it passes to ``SamplingParams``), for the start-up report and support matching.
A PEFT policy (``GRPOTrainer(peft_config=...)``, the recipe's ``--use_peft``) is synced as merged weights under the
base model's checkpoint names (``peft_merged_weights``), as TRL's own vLLM sync does for its engines.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Union

import torch

from .. import trl_compat
from ..lag import WeightSchedule
from ..support import SamplerSpec, sampler_from_vllm_params
from .vllm_cpu import build_cpu_llm, resolve_rollout_dtype, sampled_log_probs_batch, shutdown_cpu_llm, sync_weights


class VLLMCPURollout:
    """A TRL ``rollout_func`` that samples with an in-process vLLM CPU engine and returns mu token for token.

    TRL 1.16 calls ``rollout_func(prompts, trainer)`` from ``GRPOTrainer._generate`` with the prompts of this
    process's generation batch (each prompt already repeated ``num_generations`` times by TRL's sampler) and
    expects ``{"prompt_ids", "completion_ids", "logprobs"}``, one row per prompt, ``logprobs[i]`` one float per
    token of ``completion_ids[i]`` (TRL turns it into ``sampling_per_token_logps``; ``RolloutCorrGRPOTrainer`` uses
    it as ``rollout_log_probs``). This class:

    * owns the engine (``build_cpu_llm``: explicit rollout dtype, ``processed_logprobs``);
    * before sampling, loads the trainer's current weights (``sync_weights``) whenever ``trainer.state.global_step``
      differs from the step of the last sync (always on the first call), so every rollout uses the current policy;
      with ``sync_interval = k`` only once at least k optimizer steps have passed since the last sync (stale
      rollouts, for throughput); with ``async_depth = d`` the weights trail the learner by d steps, as a generator
      running d steps ahead would (see "Asynchronous mode");
    * returns ``policy_version``: per row, the ``global_step`` of the weights that generated it (spec section 7);
    * tokenises through TRL's own ``GRPOTrainer._tokenize_prompts`` (chat template with
      ``add_generation_prompt=True``, the trainer's tools, ``chat_template`` and ``chat_template_kwargs``; plain
      text through the tokenizer);
    * samples one completion per row with the trainer's settings (``temperature``, ``top_p``, ``top_k``,
      ``min_p``, ``repetition_penalty``, ``max_completion_length``, ``args.generation_kwargs``), like TRL's own
      colocate mode (duplicate prompts share their KV blocks through vLLM's prefix cache);
    * returns the sampled tokens' processed log-probs (the distribution that actually sampled them), checked to
      align with the completions (``engines.alignment.check_aligned``).

    Build it BEFORE the trainer: in-process vLLM re-seeds Python's, NumPy's and torch's global RNGs with
    ``seed`` while it starts; ``Trainer.__init__`` seeds them again with ``args.seed`` afterwards (measured in
    ``tests/e2e/test_e2e_vllm_cpu.py``). Single process per engine: with several ranks each builds its own
    (DDP / ZeRO-1/2 work: the unwrapped module holds full weights); ZeRO-3 / FSDP are refused at sync time.

    Asynchronous mode (``async_depth = d >= 1``, docs/how-to/policy-lag.md): the trainer's weights are *published*
    after
    every optimizer step (cast to the engine dtype, a queue of at most d + 1 versions) by a ``TrainerCallback`` the
    first call adds (``on_step_end``), and at each call; the batch of optimizer step s is generated with the weights
    of step ``s - d`` exactly (before step d: the initial ones), for any ``steps_per_generation`` /
    ``num_iterations`` (a row used j steps after its generation has lag ``d + j``). A background thread (one
    ``ThreadPoolExecutor`` worker) loads the next call's version as soon as it is published, so the load overlaps
    the trainer's steps. Without ``add_callback`` (a stand-in) versions are published at calls only (the newest
    ``<= s - d``). Generation cannot run ahead through TRL's ``rollout_func`` contract (prompts come when their
    completions are needed): this mode emulates asynchronous GRPO's staleness; the real pipeline is
    ``rollout_async_depth`` (``async_generation``). ``per_request_seeds=True`` seeds row r of TRL's generation
    batch j with ``request_seed(args.seed, j, r)`` as that pipeline does, so the two can be compared (issue 45).

    Args:
        model: local model directory the engine starts from (normally the trainer's initial checkpoint).
        dtype: rollout dtype, ``"bfloat16"`` or ``"float32"`` (``"auto"`` is refused).
        sync_interval: optimizer steps between weight syncs (>= 1; 1: every step).
        async_depth: optimizer steps the engine's weights trail the learner (>= 0; 0: off). Exclusive with
            ``sync_interval > 1``. Costs d + 1 copies of the weights in the engine dtype.
        per_request_seeds: one sampling seed per row (``seeded_rows``) instead of the engine's one stream.
        max_model_len, seed, kv_cache_gib, max_num_seqs, **llm_kwargs: see ``build_cpu_llm``.
        llm: an engine already built with ``build_cpu_llm`` (shared between rollouts, or a stand-in in tests);
            None: build one.

    Attributes:
        llm: the ``vllm.LLM``.
        startup_seconds, sync_seconds, generate_seconds: wall time of engine start-up, of all weight syncs and of
            all ``generate`` calls, in seconds.
        num_syncs: weight syncs so far; last_synced_step: the optimizer step of the last sync (None before any).
        engine_version: the version (optimizer step) of the weights the engine holds (None before any sync).
        schedule: the ``lag.WeightSchedule``.

    Raises:
        ValueError: an invalid ``dtype`` (see ``resolve_rollout_dtype``), ``sync_interval`` or ``async_depth``
            (see ``lag.WeightSchedule``).
    """

    logprobs_mode = "processed_logprobs"

    def __init__(
        self,
        model: Union[str, os.PathLike],
        dtype: Union[str, torch.dtype] = "bfloat16",
        *,
        sync_interval: int = 1,
        async_depth: int = 0,
        max_model_len: int = 1024,
        seed: int = 0,
        kv_cache_gib: int = 1,
        max_num_seqs: Optional[int] = None,
        llm: Any = None,
        per_request_seeds: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        self.model_path = str(model)
        self.dtype = resolve_rollout_dtype(dtype)
        self.schedule = WeightSchedule(sync_interval=sync_interval, async_depth=async_depth)
        self.seed, self.per_request_seeds = seed, bool(per_request_seeds)
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        self._owns_llm = llm is None
        self.llm = llm if llm is not None else build_cpu_llm(
            model, self.dtype, max_model_len=max_model_len, seed=seed, kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs, **llm_kwargs,
        )
        self.startup_seconds = time.perf_counter() - t0
        self.last_synced_step: Optional[int] = None
        self.num_syncs = 0
        self.sync_seconds = 0.0
        self.generate_seconds = 0.0
        self.engine_version: Optional[int] = None
        self.wait_seconds = 0.0  # async: time the calls waited for a background load
        self._published: list[tuple[int, dict[str, torch.Tensor]]] = []  # async: (version, weights), ascending
        self._pending: list[tuple[int, Future]] = []  # async: background loads, in submission order
        self._executor = ThreadPoolExecutor(max_workers=1) if async_depth else None
        self._publisher: Any = None  # async: the TrainerCallback publishing after every optimizer step
        self._calls: list[int] = []  # async: the optimizer steps of the last two calls
        self._next_call: Optional[int] = None  # async: the step the next call is expected at

    # -------------------------------------------------------------- description recorded with every run
    def describe(self) -> dict[str, Any]:
        """What produced mu, for run configs and model cards."""
        import vllm

        return {"rollout_engine": "vllm_cpu", "rollout_engine_version": f"vllm {vllm.__version__}",
                "rollout_dtype": str(self.dtype).removeprefix("torch."), "rollout_logprobs_mode": self.logprobs_mode,
                "rollout_weight_sync": "model_runner.reload_weights (in process), " + self._sync_description(),
                "rollout_max_model_len": self.max_model_len,
                "rollout_seed": "per row: request_seed(seed, batch, row)" if self.per_request_seeds else self.seed}

    def _sync_description(self) -> str:
        if self.schedule.async_depth:
            return f"asynchronous, weights {self.schedule.async_depth} optimizer steps behind the learner"
        k = self.schedule.sync_interval
        return "every optimizer step" if k == 1 else f"every {k} optimizer steps"

    # -------------------------------------------------------------- the rollout_func contract
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """Sample one completion per prompt with the trainer's current weights (TRL's ``rollout_func`` contract).

        Args:
            prompts: this process's generation batch, conversational (lists of messages) or plain text.
            trainer: the calling ``GRPOTrainer`` (TRL passes itself).

        Returns:
            ``{"prompt_ids", "completion_ids", "logprobs", "policy_version"}``: B lists of token ids, B lists of
            token ids, B lists of log mu per completion token (nats), and B ints (the optimizer step of the
            weights that generated each row).

        Raises:
            ValueError: a prompt has at least ``max_model_len`` tokens (raise ``rollout_max_model_len``), or the
                engine's log-probs do not align with its completions.
            NotImplementedError: ZeRO-3 / FSDP (see ``sync_from``), or multimodal prompts (see ``tokenize``).
        """
        self._take_weights(trainer, int(trainer.state.global_step))
        prompt_ids = self.tokenize(prompts, trainer)
        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) >= self.max_model_len]
        if too_long:
            raise ValueError(
                f"Prompt rows {too_long[:5]} have >= max_model_len={self.max_model_len} tokens; raise "
                "rollout_max_model_len."
            )
        t0 = time.perf_counter()
        params = seeded_rows(self.sampling_kwargs(trainer), trainer, len(prompt_ids)) if self.per_request_seeds \
            else self.sampling_params(trainer)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        self.generate_seconds += elapsed
        completions = [out.outputs[0] for out in outputs]
        logprobs = sampled_log_probs_batch(completions)
        log_trl_metric(trainer, "rollout/vllm_generate_s", elapsed)
        version = self.engine_version
        self._expect_next_call(trainer, int(trainer.state.global_step))
        return {
            "prompt_ids": [list(ids) for ids in prompt_ids],
            "completion_ids": [list(c.token_ids) for c in completions],
            "logprobs": logprobs,
            "policy_version": [version] * len(completions),
        }

    def _take_weights(self, trainer: Any, step: int) -> None:
        """Before generating at ``step``: give the engine the weights the schedule asks for (``engine_version``)."""
        if not self.schedule.async_depth:
            if self.schedule.needs_sync(step, self.last_synced_step):
                self.sync_from(trainer)
                self.last_synced_step = self.engine_version = step
            return
        self._add_publisher(trainer)
        self.publish(trainer, step)
        target = self.schedule.async_version(step, [v for v, _ in self._published])
        log_trl_metric(trainer, "rollout/vllm_async_wait_s", self._wait_pending())
        if self.engine_version != target:
            self._load_published(target, dict(self._published)[target])

    def publish(self, trainer: Any, step: int) -> None:
        """Async: copy the trainer's weights as version ``step`` (once per step), and drop the versions no later call
        can use (a call at ``c >= step`` uses the newest version ``<= c - d``). Called after every optimizer step by
        the publisher callback and before every generation.

        Raises:
            RuntimeError: the queue outgrew its bound of d + 1 versions (optimizer steps went backwards?).
        """
        if not self._published or self._published[-1][0] != step:
            with peft_merged_weights(self.trainer_weights(trainer)) as weights:  # PEFT: merged, base names
                pairs = weights.state_dict().items() if isinstance(weights, torch.nn.Module) else weights
                self._published.append((step, {k: v.detach().to(self.dtype, copy=True) if v.is_floating_point()
                                                else v.detach().clone() for k, v in pairs}))
        oldest_needed = self.schedule.async_version(step, [v for v, _ in self._published])
        self._published = [(v, w) for v, w in self._published if v >= oldest_needed]
        if len(self._published) > self.schedule.async_depth + 1:
            raise RuntimeError(f"async queue holds {len(self._published)} versions, over its bound "
                               f"{self.schedule.async_depth + 1} (optimizer steps went backwards?).")

    def _add_publisher(self, trainer: Any) -> None:
        """Async, first call: add the callback that publishes the weights after every optimizer step (so that
        ``s - d`` exists for any generation interval); a trainer without ``add_callback`` publishes at calls only."""
        if self._publisher is not None or not callable(getattr(trainer, "add_callback", None)):
            return
        from transformers import TrainerCallback

        rollout = self

        class PublishWeights(TrainerCallback):
            """``VLLMCPURollout``'s async queue: publish the weights of every optimizer step, then prefetch."""

            def on_step_end(self, args, state, control, **kwargs):
                rollout.publish(trainer, int(state.global_step))
                rollout._prefetch(int(state.global_step))

        self._publisher = PublishWeights()
        trainer.add_callback(self._publisher)

    def _expect_next_call(self, trainer: Any, step: int) -> None:
        """Async, after a generation at ``step``: when the next call is expected (the interval the calls have shown,
        else TRL's ``steps_per_generation x num_iterations / gradient_accumulation_steps`` optimizer steps), and
        prefetch its version if it is already published."""
        if not self.schedule.async_depth:
            return
        if not self._calls or self._calls[-1] != step:  # evaluation calls at the same step change nothing
            self._calls = (self._calls + [step])[-2:]
        if len(self._calls) == 2:
            interval = self._calls[1] - self._calls[0]
        else:
            args = getattr(trainer, "args", None)
            iterations = getattr(trainer, "num_iterations", None) or getattr(args, "num_iterations", None) or 1
            micro_steps = (getattr(args, "steps_per_generation", None) or 1) * iterations
            interval = micro_steps / (getattr(args, "gradient_accumulation_steps", None) or 1)
        self._next_call = step + max(1, round(interval))
        self._prefetch(step)

    def _prefetch(self, now: int) -> None:
        """Async: once no later version can change it (``now >= next call - d``), load on the background thread the
        version the next call will use, unless the engine holds or is loading it already."""
        if not self.schedule.async_depth or self._next_call is None or not self._published:
            return
        if now < self._next_call - self.schedule.async_depth:
            return  # the version it needs is not published yet
        target = self.schedule.async_version(self._next_call, [v for v, _ in self._published])
        loading = self._pending[-1][0] if self._pending else self.engine_version
        if target != loading:
            weights = dict(self._published)[target]
            self._pending.append((target, self._executor.submit(self._load_published, target, weights)))

    def _load_published(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        seconds = sync_weights(self.llm, weights)
        self.num_syncs += 1
        self.sync_seconds += seconds
        self.engine_version = self.last_synced_step = version

    def _wait_pending(self) -> float:
        """Wait for the background loads (if any); returns the seconds waited (re-raises the first error)."""
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for _, future in pending:
            future.result()
        waited = time.perf_counter() - t0
        self.wait_seconds += waited
        return waited

    def drain(self) -> float:
        """Async: wait for the background weight load in flight (if any), e.g. before reading ``num_syncs``;
        returns the seconds waited (re-raises its error). A no-op in sync mode."""
        return self._wait_pending()

    def close(self) -> None:
        """Wait for a background load, stop the async worker thread, and tear down the engine this rollout built
        (``vllm_cpu.shutdown_cpu_llm``: vLLM's ``EngineCore.shutdown``, which destroys vLLM's process groups and the
        ``torch.distributed`` default group), so the run ends without a process-group traceback. Call it last,
        after anything that needs the other processes (``save_model``, ``push_to_hub``) and before
        ``Trainer.end()``, as the recipe does. Idempotent. An engine passed in as ``llm`` (shared, or a stand-in) is
        left running: ``shutdown_cpu_llm`` it, or let the exit hook do it."""
        self._wait_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self._owns_llm:
            shutdown_cpu_llm(self.llm)

    def sync_from(self, trainer: Any) -> float:
        """Load the trainer's current (unwrapped) weights into the engine; returns the seconds it took.

        A PEFT model is sent as merged weights with the base model's names (``peft_merged_weights``).

        Raises:
            NotImplementedError: the trainer shards its weights (FSDP, DeepSpeed ZeRO-3): the engine needs full
                weights from the unwrapped model.
            ValueError, RuntimeError: from ``sync_weights``.
        """
        self._wait_pending()  # async: never two loads at once
        ds = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if getattr(trainer, "is_fsdp_enabled", False) or (ds is not None and getattr(ds, "zero_stage", 0) == 3):
            raise NotImplementedError(
                "VLLMCPURollout syncs full weights from the unwrapped model: ZeRO-3 / FSDP are not supported; use "
                "DDP or ZeRO-1/2."
            )
        with peft_merged_weights(self.trainer_weights(trainer)) as weights:
            seconds = sync_weights(self.llm, weights)
        self.engine_version = int(trainer.state.global_step)
        self.num_syncs += 1
        self.sync_seconds += seconds
        log_trl_metric(trainer, "rollout/vllm_sync_s", seconds)
        return seconds

    @staticmethod
    def trainer_weights(trainer: Any) -> torch.nn.Module:
        """The module whose weights the engine receives (the one source for ``sync_from`` and the asynchronous
        queue): the trainer's unwrapped policy (a PEFT model is merged by ``peft_merged_weights`` at each use)."""
        return trainer.accelerator.unwrap_model(trainer.model)

    @staticmethod
    def tokenize(prompts: list, trainer: Any) -> list[list[int]]:
        """Prompt ids exactly as TRL builds them: ``GRPOTrainer._tokenize_prompts(prompts)`` (TRL 1.16).

        TRL hands a ``rollout_func`` untokenised prompts and leaves "chat templating at the backend boundary" to it
        (``GRPOTrainer._generate``). Rather than copy TRL's tokenisation (chat template, tools per environment, the
        trainer's ``chat_template`` and ``chat_template_kwargs``, a transformers 5.3 padding workaround), this calls
        the trainer's own method, whose signature and three-value return are pinned in ``tests/e2e/test_vllm_cpu.py``.

        Raises:
            TypeError: ``trainer`` has no ``_tokenize_prompts`` (not a TRL 1.16 ``GRPOTrainer``).
            NotImplementedError: the prompts carry images or other multimodal inputs (this engine is text-only).
        """
        tokenize_prompts = getattr(trainer, "_tokenize_prompts", None)
        if tokenize_prompts is None:
            raise TypeError(
                f"VLLMCPURollout tokenises through GRPOTrainer._tokenize_prompts (TRL 1.16), which "
                f"{type(trainer).__name__} lacks: pass it as rollout_func to a trl GRPOTrainer (>=1.16,<1.17)."
            )
        prompt_ids, images, multimodal_fields = tokenize_prompts(prompts)
        if images is not None or multimodal_fields:
            raise NotImplementedError(
                "VLLMCPURollout is text-only: these prompts carry images or multimodal fields "
                f"({sorted(multimodal_fields) or 'images'}); use TRL's own vLLM path (use_vllm=True) for VLMs."
            )
        return [list(ids) for ids in prompt_ids]

    @staticmethod
    def sampling_kwargs(trainer: Any, **overrides: Any) -> dict:
        """The ``SamplingParams`` keyword arguments from the trainer's generation settings, as TRL's colocate mode
        builds them (``trl_compat.vllm_sampling_kwargs``: the trainer's ``temperature``, ``top_p``, ``top_k``,
        ``min_p``, ``repetition_penalty``, ``max_completion_length``, then ``args.generation_kwargs``), then
        ``overrides``.

        Raises:
            ValueError: ``generation_kwargs`` or ``overrides`` set ``logprobs`` to anything but 0 (the sampled
                token's log-prob is the only one this engine returns).
        """
        kwargs = trl_compat.vllm_sampling_kwargs(
            temperature=trainer.temperature, top_p=trainer.top_p, top_k=trainer.top_k, min_p=trainer.min_p,
            repetition_penalty=trainer.repetition_penalty, max_tokens=trainer.max_completion_length,
            generation_kwargs=getattr(trainer.args, "generation_kwargs", None),
        )
        kwargs.update(overrides)
        if kwargs.get("logprobs") != 0:
            raise ValueError("VLLMCPURollout needs logprobs=0 (the sampled token's log-prob only).")
        return kwargs

    @classmethod
    def sampling_params(cls, trainer: Any, **overrides: Any):
        """``vllm.SamplingParams(**sampling_kwargs(trainer, **overrides))``."""
        from vllm import SamplingParams

        return SamplingParams(**cls.sampling_kwargs(trainer, **overrides))

    def sampler_contract(self, trainer: Any) -> SamplerSpec:
        """The sampler contract of this engine for ``trainer`` (``support.sampler_from_vllm_params`` of the very
        keyword arguments ``__call__`` samples with). ``RolloutCorrGRPOTrainer`` asks a ``rollout_func`` for it to
        report and match the sampling support. The engine cannot return its kept-token sets (vLLM 0.32 does so
        only with ``return_sampling_mask`` on Model Runner V2, which needs Triton), so support replay is not
        available here: ``rollout_support_matching='recompute'``."""
        kwargs = self.sampling_kwargs(trainer)
        return sampler_from_vllm_params(
            kwargs, sources=trl_compat.sampler_sources(trainer.args, getattr(trainer.args, "generation_kwargs", None)),
            default_source="VLLMCPURollout", trainer_temperature=trainer.temperature,
        )


def seeded_rows(kwargs: dict, trainer: Any, rows: int) -> list:
    """One ``SamplingParams(**kwargs, seed=...)`` per row: row r of TRL's generation batch j (its micro-step //
    ``steps_per_generation x num_iterations``) gets ``request_seed(trainer.args.seed, j, r)``, the seed the
    asynchronous pipeline gives the same row (``async_generation``)."""
    from vllm import SamplingParams

    from .async_pipeline import request_seed

    batch = trl_compat.micro_step(trainer) // trl_compat.generate_every(trainer.args, trainer.num_iterations)
    return [SamplingParams(**{**kwargs, "seed": request_seed(trainer.args.seed, batch, r)}) for r in range(rows)]


def log_trl_metric(trainer: Any, key: str, value: float) -> None:
    """Append ``value`` to the trainer's metric ``key`` for the current mode; TRL averages it at the next ``log()``.

    The one place that writes into a TRL internal: ``GRPOTrainer._metrics``, set in ``__init__`` as
    ``{"train": defaultdict(list), "eval": defaultdict(list)}``; ``GRPOTrainer.log`` averages each list (NaNs
    dropped), prefixes ``eval_`` in evaluation and clears it (TRL 1.16; pinned in ``tests/e2e/test_vllm_cpu.py``).
    The mode is chosen as TRL's own ``_generate`` does (``model.training``). A trainer without ``_metrics`` (not a
    ``GRPOTrainer``) is skipped silently: the timings are also kept on ``VLLMCPURollout``.

    Args:
        trainer: the ``GRPOTrainer``.
        key: metric name, e.g. ``rollout/vllm_generate_s``.
        value: the value, in the metric's unit (seconds for the two timings).
    """
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:
        return
    mode = "train" if trainer.model.training else "eval"
    metrics[mode][key].append(float(value))


def _is_peft_model(model: Any) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "merge_adapter", None))


def _base_name(name: str) -> str:
    """A PEFT parameter name as the base model's checkpoint names it (``base_model.model.`` and ``.base_layer``
    removed, a ``modules_to_save`` copy under its module's own name)."""
    return name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".modules_to_save.default", "")


@contextlib.contextmanager
def peft_merged_weights(model: torch.nn.Module) -> Iterator[Union[torch.nn.Module, list[tuple[str, torch.Tensor]]]]:
    """The weights a rollout engine needs from ``model``: the model itself, or, for a PEFT model, its merged weights.

    For a ``peft.PeftModel`` (LoRA, DoRA, ...) the adapter is merged into the base weights (PEFT's
    ``merge_adapter``), the state dict is yielded under the base model's checkpoint names
    (``model.layers.0.self_attn.q_proj.weight``; adapter tensors ``lora_*`` and the frozen ``original_module`` copies
    of ``modules_to_save`` dropped), and on exit the adapter is unmerged and the base weights that merging touched
    are put back bit for bit from a copy (unmerging alone subtracts the delta again in floating point, which drifts
    the frozen weights a little at every sync). TRL's vLLM paths sync PEFT models the same way (merge, rename,
    unmerge).

    Args:
        model: the unwrapped trainer model (``accelerator.unwrap_model(trainer.model)``).

    Yields:
        ``model`` itself when it is not a PEFT model; else a list of ``(name, tensor)`` pairs (tensors are the
        merged parameters themselves, valid inside the block only).

    Raises:
        ValueError: the PEFT model holds several adapters (which one the engine should serve is ambiguous).
    """
    if not _is_peft_model(model):
        yield model
        return
    if len(model.peft_config) != 1:
        raise ValueError(
            f"The PEFT model holds {len(model.peft_config)} adapters ({sorted(model.peft_config)}); the rollout "
            "engine serves one merged model: delete the others (model.delete_adapter) before training."
        )
    saved = {name: p.detach().clone() for name, p in model.named_parameters() if ".base_layer." in name}
    prefix = getattr(model, "prefix", "lora_")
    with torch.no_grad():
        model.merge_adapter()
        try:
            yield [(_base_name(name), tensor) for name, tensor in model.state_dict().items()
                   if prefix not in name and "original_module" not in name]
        finally:
            model.unmerge_adapter()
            params = dict(model.named_parameters())
            for name, value in saved.items():
                params[name].copy_(value)
