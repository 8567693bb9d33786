"""Sampling-support matching: the sampler contract, the trainer's support (recompute / replay), support metrics.

With processed log-probs (vLLM ``processed_logprobs``, ``transformers.generate``'s processed scores) the rollout
engine reports ``log mu(a) = z'_a - logsumexp_{v in K} z'_v``: ``z'`` are the logits after the engine's value
processors (repetition / presence / frequency penalties, temperature) and ``K`` is the support its set processors
kept (top-k, top-p, min-p, ...). A trainer that scores ``log_softmax(z / T)`` over the full vocabulary differs from
it by ``log S <= 0`` nats at every token even when the numerics agree, ``S`` being the kept mass: a bias, not a
mismatch. Support matching scores with the same processors, in the engine's order:

    log pi(a) = z'_a - logsumexp_{v in K_train} z'_v          (= log p_T(a) - log S_train)

in every policy forward (pi_old and pi_theta), with gradients through the normaliser. ``K_train`` is recomputed
from the trainer's own logits (``"recompute"``) or is the engine's kept set (``"replay"``).

Contents (no TRL, no ``torch.distributed``):

* the sampler contract (``contract.py``): ``SamplerSpec`` (what the engine applies, in its order, and what the
  trainer cannot reproduce), built by ``sampler_from_generation_config`` (``transformers.generate``) or
  ``sampler_from_vllm_params`` (vLLM ``SamplingParams``), with ``SamplerSpec.report`` (the start-up report) and
  ``SamplerSpec.check`` (the errors);
* ``KeptTokens`` (``kept.py``): an engine's kept-token sets for one completion, stored compactly (CSR of int32 ids,
  or of the removed ids where that is shorter), and ``compact_kept`` for one generation step;
* ``SupportScorer`` (``scorer.py``): the chunked log-prob computation over the completion positions
  (``_SupportLogProbs``, a custom autograd function: peak ``O(chunk x V)`` plus, when a gradient is wanted and
  N x V fits ``scorer.SAVED_SOFTMAX_ELEMENTS`` (256 MiB at float32), the saved (N, V) softmax over the support,
  N x V x 4 bytes; above it the logits are recomputed in the backward), returning a ``SupportScore``;
* ``SupportStats`` (``stats.py``): the ``rollout_corr/support_*`` metrics as exact reducible statistics.

Sources: the truncation bias is TRL's trl#6789 (processed vLLM log-probs against full-vocabulary trainer log-probs);
prime-rl, NeMo-RL and slime replay or recompute the support, each for its own engine; processor semantics and
order follow transformers 5.x ``GenerationMixin._get_logits_processor`` / ``LogitsProcessor``s and vLLM 0.32's
``v1.sample.sampler.Sampler`` (see ``docs/explanation/correction-internals.md``, "Sampling support").
"""

from .contract import (
    ENGINES,
    MATCHING_MODES,
    REPRODUCIBLE,
    TRANSFORMERS_PROCESSOR_CLASSES,
    SamplerParam,
    SamplerSpec,
    check_matching_mode,
    check_transformers_processors,
    sampler_from_generation_config,
    sampler_from_vllm_params,
)
from .kept import (
    KeptTokens,
    compact_kept,
    kept_mask,
    kept_tokens_from_steps,
)
from .scorer import (
    DEFAULT_CHUNK_ELEMENTS,
    SupportScore,
    SupportScorer,
    capture_module_outputs,
    recompute_threshold,
)
from .stats import (
    PREFIX,
    SUPPORT_METRICS,
    SupportStats,
    invalidate_misses,
)

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "ENGINES",
    "KeptTokens",
    "MATCHING_MODES",
    "PREFIX",
    "REPRODUCIBLE",
    "SUPPORT_METRICS",
    "SamplerParam",
    "SamplerSpec",
    "SupportScore",
    "SupportScorer",
    "SupportStats",
    "TRANSFORMERS_PROCESSOR_CLASSES",
    "capture_module_outputs",
    "check_matching_mode",
    "check_transformers_processors",
    "compact_kept",
    "invalidate_misses",
    "kept_mask",
    "kept_tokens_from_steps",
    "recompute_threshold",
    "sampler_from_generation_config",
    "sampler_from_vllm_params",
]
