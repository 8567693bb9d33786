"""Behaviour log-probs (mu) on every generation path: generate capture, dtype copy, alignment, server check.

vLLM (colocate/server) and a ``rollout_func`` already return the sampled tokens' processed log-probs. On the plain
``transformers.generate`` path TRL returns none: ``generate`` is shadowed for the call so that it also records the
processed scores (``engines.transformers_generate.capture_generate_log_probs``), from a ``rollout_generate_dtype``
copy of the weights when set. Where no mu can exist (greedy / beam ``generation_kwargs``, or ``model.generate``
replaced by something that skips transformers' sampling): an error with a correction configured; without one, TRL's
result unchanged and no diagnostics for the batch (``GenerationBatch.mu_unusable``).

First in ``features.FEATURES``: mu exists before anything reads it, and its ``plain_generate`` encloses every other
feature's (routing records routes only where the capture runs).
"""

from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING, Iterator, Optional

from transformers.generation.utils import GenerationMixin

from .. import trl_compat
from ..engines.alignment import check_aligned
from ..engines.transformers_generate import GENERATE_DTYPES, capture_generate_log_probs, generate_in_dtype
from ..hooks import Feature, GenerationBatch, PlainGenerate, refuse_config

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

# transformers' own generate, as imported (a replaced one is detected by identity: ``plain_generate_has_no_mu``)
_TRANSFORMERS_GENERATE = GenerationMixin.generate


class BehaviourLogProbs(Feature):
    """mu on every generation path (module docstring); present in every trainer.

    Raises:
        ValueError: at construction, ``rollout_generate_dtype`` with a ``rollout_func``; a TRL vLLM server that does
            not report processed log-probs (with a correction). With a correction configured, at generation: no
            behaviour log-probs can be obtained (naming the fix), or a row's do not match its completion length
            (naming the row).
    """

    name = "behaviour_log_probs"

    @classmethod
    def check_config(cls, args, correction) -> None:
        """``rollout_generate_dtype``: one of ``GENERATE_DTYPES``, on the plain ``transformers.generate`` path only."""
        if args.rollout_generate_dtype is None:
            return
        if args.rollout_generate_dtype not in GENERATE_DTYPES:
            refuse_config(
                f"rollout_generate_dtype must be one of {tuple(GENERATE_DTYPES)} or unset, "
                f"got {args.rollout_generate_dtype!r}."
            )
        if args.use_vllm:
            refuse_config(
                "rollout_generate_dtype applies to the transformers.generate path only; with use_vllm=True the "
                "rollout dtype is vLLM's own (its model dtype); unset rollout_generate_dtype."
            )
        if args.use_transformers_continuous_batching:
            refuse_config(
                "rollout_generate_dtype applies to the plain transformers.generate path only; with "
                "use_transformers_continuous_batching=True TRL's generate_batch samples in the training dtype "
                "(bf16 / fp16 / the weights' own) and returns no log-probs; unset rollout_generate_dtype, or set "
                "use_transformers_continuous_batching=False."
            )

    def __init__(self, trainer: "RolloutCorrGRPOTrainer") -> None:
        args = trainer.args
        self.enabled = trainer.rollout_correction.enabled
        if self.enabled and trainer.use_vllm and args.vllm_mode == "server" and trainer.accelerator.is_main_process:
            trl_compat.check_vllm_server_logprobs(trainer.vllm_generation.vllm_client)
        if args.rollout_generate_dtype is not None and trainer.rollout_func is not None:
            raise ValueError(
                "rollout_generate_dtype applies to the transformers.generate path, but a rollout_func generates "
                "here; cast inside the rollout_func (engines.transformers_generate.generate_in_dtype) and unset it."
            )
        if not self.enabled and trainer.use_transformers_continuous_batching:
            trainer.warn_once("no rollout_corr/* diagnostics: use_transformers_continuous_batching returns no "
                              "behaviour log-probs")

    @contextlib.contextmanager
    def plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> Iterator[None]:
        """Generate from the ``rollout_generate_dtype`` copy, with the capture open (``call.capture``) where mu can
        exist."""
        unusable = plain_generate_has_no_mu(trainer, call.model)
        if unusable is not None and self.enabled:
            raise ValueError(
                f"Rollout correction is on but {unusable}, so no behaviour log-probs (mu) exist for its tokens. "
                "Use the model's own generate with sampling, a rollout_func that returns 'logprobs', or vLLM "
                "(use_vllm=True); or turn the correction off (no rollout_is / rollout_rs / bypass_mode)."
            )
        with generate_in_dtype(call.model, trainer.args.rollout_generate_dtype):
            if unusable is not None:
                gen.mu_unusable = unusable
                yield
                return
            with capture_generate_log_probs(call.model, record_support=gen.record_kept_sets) as capture:
                call.capture = capture
                yield

    def after_plain_generate(self, trainer, gen: GenerationBatch, call: PlainGenerate) -> None:
        """``call.log_probs``: the captured mu, one list of floats per row, as long as its completion."""
        if call.capture is not None:
            call.log_probs = call.capture.completion_log_probs(call.completion_ids)
            gen.mu_captured = True

    def after_generate(self, trainer, gen: GenerationBatch, result: tuple) -> None:
        """Every row must have one behaviour log-prob per completion token (``engines.alignment.check_aligned``)."""
        completion_ids, logprobs = result[1], result[4]
        if logprobs is None:
            if self.enabled:
                raise ValueError(
                    "Rollout correction is on but the generation path returned no behaviour log-probs (mu). Use "
                    "vLLM (use_vllm=True, which requests processed log-probs), the plain transformers.generate "
                    "path, or a rollout_func that returns 'logprobs'."
                )
            gen.mu_unusable = gen.mu_unusable or "the generation path returned no behaviour log-probs"
            return
        try:
            check_aligned([len(ids) for ids in completion_ids], logprobs)
        except ValueError as err:
            if self.enabled:
                raise
            gen.mu_unusable = str(err)


def plain_generate_has_no_mu(trainer, model) -> Optional[str]:
    """Why ``model.generate`` cannot yield behaviour log-probs here, or None when it can.

    Two cases: the generation config does not sample (``do_sample=False`` or ``num_beams > 1``, e.g. from
    ``generation_kwargs``), or ``generate`` is not transformers' own: an instance attribute on the model (as
    ``unittest.mock.patch.object(model, "generate", ...)`` sets, TRL's own tool/environment tests do this) or a
    patched ``GenerationMixin.generate``. A replacement never runs transformers' logits processing, so the capture
    would see no processed scores. FSDP2's wrapper (``torch.distributed.fsdp.register_fsdp_forward_method``, which
    transformers' Trainer sets on the model's ``generate`` under FSDP to all-gather the shards first) is not a
    replacement: the method it wraps is checked instead (``trl_compat.fsdp2_wrapped_method``).
    """
    config = trainer.generation_config
    if not config.do_sample or (config.num_beams or 1) > 1:
        return "generation does not sample (do_sample=False or num_beams > 1 in generation_kwargs)"
    own = vars(model).get("generate")
    own = trl_compat.fsdp2_wrapped_method(own) or own  # FSDP2's all-gathering wrapper (transformers' Trainer's)
    if own is not None and not (isinstance(own, types.MethodType) and own.__func__ is _TRANSFORMERS_GENERATE):
        return f"model.generate has been replaced by {own!r}, which does not run transformers' sampling"
    if GenerationMixin.generate is not _TRANSFORMERS_GENERATE:
        return (f"GenerationMixin.generate has been replaced by {GenerationMixin.generate!r}, which does not run "
                "transformers' sampling")
    return None
