"""The sampler TRL 1.16 generates with (issue 12): the ``GRPOConfig`` fields and ``generation_kwargs`` it hands to
transformers' ``generate`` and to vLLM, as the arguments each engine receives.

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``SAMPLER_ARGS``                  the ``GRPOConfig`` fields TRL passes to both samplers (1155-1173, 1131-1138)
``vllm_sampling_kwargs``          ``VLLMGeneration.generate``'s colocate ``SamplingParams`` keyword arguments
                                  (``trl/generation/vllm_generation.py``: the TRL arguments, then
                                  ``generation_kwargs`` on top)
``vllm_server_sampling``          ``VLLMGeneration.generate``'s server-mode ``sampling_params`` (pinned key for key)
``resolved_generation_config``    what ``unwrapped_model.generate(..., generation_config=self.generation_config)``
                                  samples with (transformers merges the model's ``generation_config.json``)
================================  ==========================================================================

Pinned in ``tests/trainer/test_trl_compat.py``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional

# ---------------------------------------------------------------------------------------- the sampler (issue 12)
# The GRPOConfig fields TRL hands to both samplers (transformers.generate's GenerationConfig and vLLM's
# SamplingParams); ``generation_kwargs`` override them.
SAMPLER_ARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def vllm_sampling_kwargs(
    *, temperature: float, top_p: float, top_k: int, min_p: Optional[float], repetition_penalty: float,
    max_tokens: int, generation_kwargs: Optional[Mapping[str, Any]] = None,
) -> dict:
    """The ``SamplingParams`` keyword arguments of TRL 1.16's vLLM colocate generation (one completion per prompt,
    the sampled token's log-prob only), ``generation_kwargs`` applied last as TRL does."""
    kwargs = {
        "n": 1, "repetition_penalty": repetition_penalty, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "min_p": 0.0 if min_p is None else min_p, "max_tokens": max_tokens, "logprobs": 0,
    }
    kwargs.update(generation_kwargs or {})
    return kwargs


def sampler_sources(args: Any, generation_kwargs: Optional[Mapping[str, Any]]) -> dict:
    """Parameter -> where it was set: ``generation_kwargs`` for its keys, ``<ConfigClass>.<field>`` for the
    ``SAMPLER_ARGS`` set in the config (not None)."""
    sources = {name: f"{type(args).__name__}.{name}" for name in SAMPLER_ARGS if getattr(args, name, None) is not None}
    sources.update({name: "generation_kwargs" for name in (generation_kwargs or {})})
    return sources


def resolved_generation_config(model: Any, generation_config: Any) -> Any:
    """The generation config ``model.generate(generation_config=generation_config)`` samples with.

    transformers fills every field the caller left None from the model's ``generation_config`` (its
    ``generation_config.json``), then from the global defaults (``GenerationMixin._prepare_generation_config``,
    transformers 5.x; pinned in ``tests/trainer/test_trl_compat.py``). TRL 1.16 overrides nothing on the model under
    transformers 5 (``_override_model_generation_config`` is a no-op there), so this is what TRL's generate path
    samples with.

    Args:
        model: the unwrapped policy (a PEFT wrapper is unwrapped to its base model).
        generation_config: TRL's ``trainer.generation_config``.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base._prepare_generation_config(copy.deepcopy(generation_config))[0]


def vllm_server_sampling(vllm_generation: Any) -> dict:
    """The ``VLLMClient.generate`` keyword arguments but ``prompts``, ``features``, ``n`` of TRL 1.16's server-mode
    generation (``VLLMGeneration.generate``'s ``sampling_params``, pinned key for key), from ``vllm_generation``."""
    g = vllm_generation
    return {"repetition_penalty": g.repetition_penalty, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "min_p": 0.0 if g.min_p is None else g.min_p, "max_tokens": g.max_completion_length,
            "logprobs": g.logprobs, "structured_outputs_regex": g.structured_outputs_regex,
            "generation_kwargs": dict(g.generation_kwargs or {})}
