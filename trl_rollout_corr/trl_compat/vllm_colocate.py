"""TRL 1.16's vLLM colocate engine (issue 43): ``VLLMGeneration`` built with extra ``vllm.LLM(...)`` arguments and,
on vLLM CPU, a weight sync inside vLLM's layerwise reload.

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``trl_vllm_colocate``             ``self.vllm_generation = VLLMGeneration(...)`` in ``GRPOTrainer.__init__`` (1107,
                                  the module-level name swapped for the block); ``colocate_generation_class``:
                                  ``VLLMGeneration._init_vllm``'s one ``LLM(...)`` call (without
                                  ``COLOCATE_LLM_KWARGS``), ``sync_weights``' colocate ``load_weights`` per
                                  parameter, ``generate`` (pinned in ``tests/e2e/test_trl_vllm_colocate.py``)
================================  ==========================================================================
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Mapping, Optional

import torch

# ---------------------------------------------------------------------------- TRL's vLLM colocate engine (issue 43)
# The keyword arguments TRL 1.16's colocate ``vllm.LLM(...)`` call (``VLLMGeneration._init_vllm``) does not pass, and
# which ``trl_vllm_colocate`` may therefore add (pinned: tests/e2e/test_trl_vllm_colocate.py).
COLOCATE_LLM_KWARGS = ("dtype", "enforce_eager")

_COLOCATE_CLASS: list = []  # the VLLMGeneration subclass, built on first use (importing it imports vLLM)


class _ColocateOverrides:
    """The overrides and additions of ``ColocateVLLMGeneration`` (``colocate_generation_class``), as a mixin placed
    before TRL's ``VLLMGeneration`` in that class's bases: each ``super()`` call is TRL's method. Importing this
    module imports neither TRL's ``vllm_generation`` nor vLLM; the class is built on first use."""

    def __init__(self, *args, llm_kwargs: Optional[Mapping[str, Any]] = None, layerwise_sync: bool = False,
                 **kwargs):
        self.llm_kwargs = dict(llm_kwargs or {})
        self.layerwise_sync = layerwise_sync
        self.sync_seconds = self.generate_seconds = self.startup_seconds = 0.0
        self.num_syncs = 0
        super().__init__(*args, **kwargs)

    def _init_vllm(self):
        if self.mode != "colocate":
            return super()._init_vllm()
        import trl.generation.vllm_generation as trl_vllm

        trl_llm, extra = trl_vllm.LLM, self.llm_kwargs

        def llm_with_extra_kwargs(*args, **kwargs):
            clash = sorted(set(kwargs) & set(extra))
            if clash:
                raise RuntimeError(f"TRL's colocate vllm.LLM(...) now passes {clash} itself; trl_rollout_corr "
                                   "would override them (trl_compat.COLOCATE_LLM_KWARGS is out of date).")
            return trl_llm(*args, **kwargs, **extra)

        set_num_threads, start = torch.set_num_threads, time.perf_counter()
        trl_vllm.LLM = llm_with_extra_kwargs
        try:
            super()._init_vllm()
        finally:
            trl_vllm.LLM = trl_llm
            torch.set_num_threads = set_num_threads
            self.startup_seconds = time.perf_counter() - start
        if self.layerwise_sync:  # vLLM CPU in this process: torn down in order (close(), or at exit)
            from ..engines.vllm_cpu import track_for_shutdown

            track_for_shutdown(self.llm)

    def close(self) -> None:
        """Shut TRL's in-process CPU engine down before ``Trainer.end()`` destroys the process group
        (``engines.vllm_cpu.shutdown_cpu_llm``); nothing for another engine or in server mode."""
        if self.mode == "colocate" and self.layerwise_sync:
            from ..engines.vllm_cpu import shutdown_cpu_llm

            shutdown_cpu_llm(self.llm)

    def sync_weights(self):
        start = time.perf_counter()
        if self.mode == "colocate" and self.layerwise_sync:
            from ..engines.vllm_cpu import layerwise_reload

            engine = self.llm.llm_engine
            with layerwise_reload(engine.model_executor.driver_worker.model_runner.model, engine.model_config):
                super().sync_weights()
        else:
            super().sync_weights()
        self.sync_seconds += time.perf_counter() - start
        self.num_syncs += 1

    def generate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().generate(*args, **kwargs)
        finally:
            self.generate_seconds += time.perf_counter() - start

    def describe(self) -> dict:
        """The engine record (run summary, rollout records, model card): ``rollout_engine``
        ``trl_vllm_colocate`` / ``trl_vllm_server``, and for colocate the dtype the engine computes in."""
        import vllm

        record = {"rollout_engine": f"trl_vllm_{self.mode}", "rollout_engine_version": f"vllm {vllm.__version__}",
                  "rollout_logprobs_mode": "processed_logprobs"}
        if self.mode == "colocate":
            model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            record["rollout_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
            record["rollout_enforce_eager"] = bool(self.llm.llm_engine.model_config.enforce_eager)
            record["rollout_max_model_len"] = int(self.llm.llm_engine.model_config.max_model_len)
            record["rollout_weight_sync"] = (
                "TRL VLLMGeneration.sync_weights (load_weights per parameter) inside vLLM's layerwise reload, "
                "tied head re-packed" if self.layerwise_sync else "TRL VLLMGeneration.sync_weights"
            ) + ", at every optimizer step"
        return record


def colocate_generation_class() -> type:
    """``ColocateVLLMGeneration``: TRL 1.16's ``trl.generation.vllm_generation.VLLMGeneration`` with three overrides,
    each around ``super()``; built on first use (TRL's module imports vLLM).

    * ``_init_vllm``: TRL's, with ``llm_kwargs`` added to its colocate ``vllm.LLM(...)`` call (the module-level name
      ``LLM`` of ``trl.generation.vllm_generation`` is swapped for the call and restored), and, on vLLM's CPU
      platform, ``torch.set_num_threads`` put back afterwards (vLLM's ``CPUWorker.init_device`` replaces it with a
      no-op; ``engines.vllm_cpu.build_cpu_llm`` does the same).
    * ``sync_weights``: TRL's, inside ``engines.vllm_cpu.layerwise_reload`` when ``layerwise_sync`` (TRL loads one
      parameter per ``load_weights`` call, which fails on vLLM CPU's packed layers), timed.
    * ``generate``: TRL's, timed.

    Added: ``describe()`` (the engine record) and ``close()`` (tear TRL's in-process CPU engine down in order).

    Attributes (of an instance): ``llm_kwargs``, ``layerwise_sync``, ``sync_seconds`` / ``generate_seconds``
    (totals, seconds), ``num_syncs``, ``startup_seconds``.
    """
    if _COLOCATE_CLASS:
        return _COLOCATE_CLASS[0]
    import trl.generation.vllm_generation as trl_vllm

    class ColocateVLLMGeneration(_ColocateOverrides, trl_vllm.VLLMGeneration):
        """TRL's ``VLLMGeneration`` with ``_ColocateOverrides`` (see ``colocate_generation_class``)."""

    _COLOCATE_CLASS.append(ColocateVLLMGeneration)
    return ColocateVLLMGeneration


@contextlib.contextmanager
def trl_vllm_colocate(llm_kwargs: Mapping[str, Any], *, layerwise_sync: bool) -> Iterator[None]:
    """Within the block, ``GRPOTrainer.__init__`` builds its vLLM backend as ``colocate_generation_class()`` with
    ``llm_kwargs`` and ``layerwise_sync``: the name ``VLLMGeneration`` that ``trl.trainer.grpo_trainer`` calls
    (``self.vllm_generation = VLLMGeneration(...)``, 1107) is swapped for the block and restored, also on error.

    Args:
        llm_kwargs: added to TRL's colocate ``vllm.LLM(...)``; keys from ``COLOCATE_LLM_KWARGS`` only.
        layerwise_sync: wrap TRL's colocate weight sync in vLLM's layerwise reload (vLLM CPU).

    Raises:
        ValueError: a key of ``llm_kwargs`` outside ``COLOCATE_LLM_KWARGS``.

    Not thread-safe (a module attribute is swapped), as a trainer's construction is not.
    """
    unknown = sorted(set(llm_kwargs) - set(COLOCATE_LLM_KWARGS))
    if unknown:
        raise ValueError(f"trl_vllm_colocate adds only {COLOCATE_LLM_KWARGS} to TRL's vllm.LLM(...), got {unknown}.")
    import functools

    import trl.trainer.grpo_trainer as grpo

    trl_class = grpo.VLLMGeneration
    grpo.VLLMGeneration = functools.partial(colocate_generation_class(), llm_kwargs=dict(llm_kwargs),
                                            layerwise_sync=layerwise_sync)
    try:
        yield
    finally:
        grpo.VLLMGeneration = trl_class
