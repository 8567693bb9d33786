"""TRL 1.16's fused LM head (``trl/trainer/utils.py::add_fused_lm_head``): the training forward outside a trainer,
the head's input, and two blocks that change which positions it scores or skip it.

================================  ==========================================================================
here                              TRL 1.16
================================  ==========================================================================
``add_training_lm_head``          ``GRPOTrainer.__init__``'s ``add_fused_lm_head`` call (1059-1073);
                                  ``training_log_probs``: ``_get_per_token_logps_and_entropies`` (1495-1499)
``score_trained_tokens_only``     ``trl/trainer/utils.py::add_fused_lm_head``: ``compact = _use_triton(device)``
                                  picks between scoring only the labelled positions and every position
``skip_fused_lm_head``            ``add_fused_lm_head``: the head's one call ``_ChunkedLogProbFunction.apply(hidden,
                                  weight, bias, labels, temperature, chunk, softcap, scale, outputs)`` -> its five
                                  per-token fields
``lm_head_input``                 ``add_fused_lm_head``: the backbone (``base_model``) whose
                                  ``last_hidden_state[:, :-1]`` the head scores, and the head
                                  (``get_output_embeddings()``); ``unsupported_logit_transforms``: the config
                                  fields after which the head's logits are not ``hidden @ W.T + b``
================================  ==========================================================================

Pinned in ``tests/trainer/test_trl_compat.py``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import trl.trainer.utils as _trl_utils


# ---------------------------------------------------------------------------------------------- the training forward
def add_training_lm_head(model: Any, *, temperature: float, cast_lm_head_to_fp32: bool = False) -> None:
    """Give ``model`` the log-prob head TRL 1.16's ``GRPOTrainer.__init__`` gives the policy: TRL's own
    ``add_fused_lm_head`` with the trainer's ``temperature`` and ``cast_lm_head_to_fp32`` (1059-1073).

    Used by ``trl-rollout-corr probe`` to score tokens exactly as the trainer does, outside a trainer.
    """
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32)


def training_log_probs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       logits_to_keep: int) -> torch.Tensor:
    """TRL 1.16's per-token log-probs of the last ``logits_to_keep`` positions for one chunk
    (``_get_per_token_logps_and_entropies``, 1495-1499: labels -100 at padding and before the completion, then
    ``model(..., labels=labels, fused_lm_head=True).log_probs``), without autocast.

    Args:
        model: a model patched with ``add_training_lm_head``.
        input_ids, attention_mask: (B, P + T) prompt (left-padded) then completion (right-padded), 0/1 mask.
        logits_to_keep: T.

    Returns:
        (B, T) float32 log-probs in nats of the temperature-scaled full-vocabulary distribution; 0 at padding.
    """
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    outputs = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return outputs.log_probs[:, -logits_to_keep:]


# The text-config fields after which add_fused_lm_head's logits are not ``hidden @ W.T + b`` (TRL rescales or
# soft-caps them); support matching computes plain logits, so it refuses these models.
LOGIT_TRANSFORM_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                          "logits_scaling")


def lm_head_input(model: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, head) of the policy as TRL 1.16's fused LM head uses them.

    ``add_fused_lm_head``'s forward runs ``getattr(self, "base_model")(...)`` (transformers 5) and scores
    ``backbone_outputs.last_hidden_state[:, :-1]`` with ``self.get_output_embeddings()``; a forward hook on the
    backbone therefore sees exactly the head's input.

    Args:
        model: the unwrapped policy; a PEFT wrapper is unwrapped to its base model (TRL patches that one).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def unsupported_logit_transforms(model: Any) -> list[str]:
    """The ``LOGIT_TRANSFORM_FIELDS`` set (not None) in the policy's text config, as ``name=value``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    return [f"{name}={getattr(config, name)!r}" for name in LOGIT_TRANSFORM_FIELDS
            if getattr(config, name, None) is not None]

# Devices where the fused LM head may score only the trained positions although TRL scores every position there:
# eager devices on which a tile shape that changes from batch to batch costs nothing (no recompilation). TRL
# itself already scores only the trained positions on Triton devices (CUDA, XPU).
COMPACT_SCORING_DEVICES = ("cpu",)


@contextlib.contextmanager
def score_trained_tokens_only(enabled: bool = True) -> Iterator[None]:
    """Within the block, TRL's fused LM head scores only the positions whose next-token label is not -100.

    TRL 1.16's ``add_fused_lm_head`` projects, on devices without Triton, every position (prompt, completion and
    padding) through the LM head and masks afterwards, so that accelerators needing fixed shapes (e.g. Neuron)
    do not recompile on every batch; with Triton it projects ``hidden_states[mask]`` only. It chooses with the
    module-level ``_use_triton(device)`` of ``trl.trainer.utils``; this block makes that choice answer True for
    ``COMPACT_SCORING_DEVICES`` (CPU), which changes only which rows enter ``_ChunkedLogProbFunction`` (the tile
    kernel itself is chosen by ``trl.kernels.chunked_logprob``'s own ``_use_triton``, untouched). The per-token
    log-probs (nats) and entropies at labelled positions are the same computation on a subset of rows (equal bit
    for bit on the tested models: ``tests/trainer/test_trl_compat.py``), and every other position reads 0 on both
    paths, so values and gradients are unchanged; only the unused LM-head work (P + padding positions per row, the
    (B * (P + T), V) projection's extra rows, and their backward) is skipped.

    ``enabled=False``: a no-op (TRL's own choice). Not thread-safe (a module attribute is swapped for the block;
    nested blocks restore in order), as the trainer's forwards are sequential.
    """
    if not enabled:
        yield
        return
    trl_choice = _trl_utils._use_triton

    def compact(device: torch.device) -> bool:
        return device.type in COMPACT_SCORING_DEVICES or trl_choice(device)

    _trl_utils._use_triton = compact
    try:
        yield
    finally:
        _trl_utils._use_triton = trl_choice


class _SkippedLMHead:
    """Stands in for TRL's ``_ChunkedLogProbFunction`` inside ``skip_fused_lm_head``: zeros, no LM-head pass."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        zeros = torch.zeros(hidden.size(0), dtype=torch.float32, device=hidden.device)
        return zeros, (zeros.clone() if "entropy" in outputs else None), None, None, None


@contextlib.contextmanager
def skip_fused_lm_head() -> Iterator[None]:
    """Within the block, TRL's fused LM head does not run: the per-token fields of the policy's fused forward
    (``log_probs``, ``entropy``) read 0 and carry no gradient; the backbone runs as usual.

    For a caller that scores the head's input itself (support matching: ``support.SupportScorer`` on the backbone's
    last hidden state, with ``entropy_temperature`` for TRL's entropies) and would otherwise throw TRL's head pass
    away: TRL 1.16's ``add_fused_lm_head`` makes exactly one ``_ChunkedLogProbFunction.apply`` call per forward
    (pinned), which this swaps for ``_SkippedLMHead`` (a module attribute of ``trl.trainer.utils``, restored on
    exit, also on error). Not thread-safe, like ``score_trained_tokens_only``.
    """
    trl_head = _trl_utils._ChunkedLogProbFunction
    _trl_utils._ChunkedLogProbFunction = _SkippedLMHead
    try:
        yield
    finally:
        _trl_utils._ChunkedLogProbFunction = trl_head
