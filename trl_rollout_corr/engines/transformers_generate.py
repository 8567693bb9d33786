"""Behaviour log-probs (mu) from ``transformers.generate``.

``generate(..., do_sample=True)`` samples every new token from ``softmax(scores_t)``, where ``scores_t`` are the
*processed* scores: the float32 next-token logits after every logits processor and warper of the generation
config (repetition penalty, temperature, top-k, top-p, min-p, suppressed tokens, ...). With
``output_scores=True, return_dict_in_generate=True`` transformers returns exactly these tensors (``out.scores``,
one ``(B, V)`` tensor per step), so ``log_softmax(scores_t)[sampled token]`` is the log-probability under the
distribution that actually produced the token: the behaviour policy mu of the rollout-correction spec.
(``out.logits`` would be the raw logits, i.e. without temperature/top-p: the wrong distribution.)

This module has no TRL dependency. ``capture_generate_log_probs`` shadows ``model.generate`` for the duration of
a ``with`` block so that a caller which only expects token ids (TRL's GRPO generation path) keeps working while
the log-probs are recorded on the side, by a logits processor appended after all the others
(``SampledTokenLogProbs``; memory O(B * V), where ``output_scores=True`` would keep T tensors of (B, V)). With
``record_support=True`` it also keeps each step's kept-token set (where the processed scores are finite: what
top-k / top-p / min-p / suppressed tokens ... left), compacted per step (``support.compact_kept``: int32 ids of
the kept or of the removed tokens, whichever is shorter), for support replay (``support.KeptTokens``).
``behaviour_log_probs_from_scores`` computes the same values from ``out.scores`` (reference, used in tests).

``generate_in_dtype`` makes ``generate`` sample from a down-cast copy of the weights (e.g. a bf16 rollout engine
next to a float32 trainer: a real, small numerical mismatch to measure and correct) and restores the weights
exactly afterwards.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import torch

from ..support import KeptTokens, compact_kept, kept_tokens_from_steps

# The dtypes generate_in_dtype accepts by name (the trainer config's rollout_generate_dtype).
GENERATE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def behaviour_log_probs_from_scores(
    scores: Sequence[torch.Tensor], sequences: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """Log-probability of each generated token under the processed sampling distribution.

    Args:
        scores: tuple of ``T`` tensors of shape ``(B, V)``, the processed scores of each generation step
            (``GenerateDecoderOnlyOutput.scores``); ``-inf`` for filtered tokens.
        sequences: ``(B, P + T')`` int64, prompt followed by the generated tokens (``out.sequences``); ``T' >= T``.
        prompt_length: ``P``, the (padded) prompt width.

    Returns:
        ``(B, T)`` float32 natural-log probabilities (nats); ``log mu`` of token ``sequences[:, P + t]``.
        A token that was impossible under the processed scores (only possible after EOS, where generate writes
        padding instead of sampling) gets ``-inf``; callers cut rows at their true completion length.

    Raises:
        ValueError: if there are no scores, the shapes disagree, or ``sequences`` holds fewer generated tokens
            than there are score steps.
    """
    if len(scores) == 0:
        raise ValueError(
            "No generation scores: call generate with output_scores=True and return_dict_in_generate=True."
        )
    num_steps = len(scores)
    batch = sequences.size(0)
    generated = sequences[:, prompt_length:]
    if generated.size(1) < num_steps:
        raise ValueError(
            f"generate returned {generated.size(1)} new tokens per row but {num_steps} score steps; cannot align them."
        )
    out = torch.empty(batch, num_steps, dtype=torch.float32, device=sequences.device)
    for t, step_scores in enumerate(scores):
        if step_scores.dim() != 2 or step_scores.size(0) != batch:
            raise ValueError(f"scores[{t}] has shape {tuple(step_scores.shape)}, expected ({batch}, vocab).")
        # One step at a time keeps the peak memory at (B, V) instead of (B, T, V).
        log_probs = torch.log_softmax(step_scores.to(torch.float32), dim=-1)
        out[:, t] = log_probs.gather(-1, generated[:, t : t + 1].to(log_probs.device)).squeeze(-1).to(out.device)
    return out


@dataclass
class GenerateCapture:
    """What ``capture_generate_log_probs`` recorded, one entry per ``generate`` call inside the block.

    Attributes:
        sequences: list of ``(B, P + T)`` int64 tensors (prompt + generated ids, as generate returned them).
        prompt_lengths: list of ``P`` (padded prompt width) per call.
        log_probs: list of ``(B, T)`` float32 behaviour log-probs per call (see
            ``behaviour_log_probs_from_scores``).
        kept: per call, the T steps' compacted kept sets (``support.compact_kept``), or None when the block did not
            record them (``record_support=False``).
        vocab_sizes: per call, V (the width of the processed scores).
        processors: per call, the logits processors generate applied (its ``LogitsProcessorList``, the recorder
            excluded), for checking them against the sampler contract.
    """

    sequences: list = field(default_factory=list)
    prompt_lengths: list = field(default_factory=list)
    log_probs: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    vocab_sizes: list = field(default_factory=list)
    processors: list = field(default_factory=list)

    def completion_log_probs(self, completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Cut the recorded log-probs to the caller's completions and check the ids token for token.

        Args:
            completion_ids: ``B`` lists of generated token ids (each row possibly cut after its first EOS), in the
                same row order as the single recorded ``generate`` call.

        Returns:
            ``B`` lists of floats, ``len(out[i]) == len(completion_ids[i])``.

        Raises:
            RuntimeError: if not exactly one ``generate`` call was recorded.
            ValueError: naming the first row whose length or token ids differ from what was generated.
        """
        if len(self.log_probs) != 1:
            raise RuntimeError(
                f"Expected exactly one generate() call to be captured, got {len(self.log_probs)}; cannot attribute "
                "behaviour log-probs to completions."
            )
        sequences, prompt_length, log_probs = self.sequences[0], self.prompt_lengths[0], self.log_probs[0]
        if len(completion_ids) != log_probs.size(0):
            raise ValueError(
                f"{len(completion_ids)} completions but generate produced {log_probs.size(0)} rows of log-probs."
            )
        generated = sequences[:, prompt_length:].cpu()
        log_probs = log_probs.cpu()
        out = []
        for row, ids in enumerate(completion_ids):
            n = len(ids)
            if n > log_probs.size(1):
                raise ValueError(
                    f"Row {row}: completion has {n} tokens but only {log_probs.size(1)} behaviour log-probs were "
                    "generated; the behaviour log-probs and the completion are misaligned."
                )
            if generated[row, :n].tolist() != list(ids):
                raise ValueError(
                    f"Row {row}: completion token ids differ from the ids generate sampled; the behaviour log-probs "
                    "would be misaligned."
                )
            out.append(log_probs[row, :n].tolist())
        return out

    def completion_kept_tokens(self, completion_ids: Sequence[Sequence[int]]) -> list[KeptTokens]:
        """The kept-token sets of the caller's completions, ``len(out[i]) == len(completion_ids[i])``.

        Call after ``completion_log_probs`` (which checks the rows against what was generated).

        Raises:
            RuntimeError: not exactly one ``generate`` call, or the block did not record kept sets.
            ValueError: a row has more tokens than recorded steps (naming it).
        """
        if len(self.kept) != 1 or self.kept[0] is None:
            raise RuntimeError(
                "No kept-token sets were recorded for exactly one generate() call: open the block with "
                "capture_generate_log_probs(model, record_support=True)."
            )
        steps, vocab = self.kept[0], self.vocab_sizes[0]
        return [kept_tokens_from_steps(steps, row, len(ids), vocab) for row, ids in enumerate(completion_ids)]


class SampledTokenLogProbs:
    """A logits processor that records log mu of every sampled token while ``generate`` runs.

    Placed LAST in generate's processor list (after every processor and warper), it sees the processed scores
    of step t, keeps ``log_softmax`` of them (one ``(B, V)`` float32 tensor), and at step t + 1, when the token
    sampled at step t is the last column of ``input_ids``, gathers its log-prob. ``finish(sequences)`` handles the
    final step. Memory: O(B * V), instead of O(T * B * V) for ``output_scores=True``.

    Args:
        record_support: also keep each step's kept set (finite processed scores), compacted
            (``support.compact_kept``): ``kept`` lists one entry per step.
    """

    def __init__(self, record_support: bool = False) -> None:
        self._previous: Optional[torch.Tensor] = None
        self._values: list[torch.Tensor] = []
        self.kept: Optional[list] = [] if record_support else None
        self.vocab_size: Optional[int] = None
        self.processors: list = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._previous is not None:
            self._values.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._previous = torch.log_softmax(scores.to(torch.float32), dim=-1)
        self.vocab_size = scores.size(-1)
        if self.kept is not None:
            self.kept.append(compact_kept(torch.isfinite(scores)))
        return scores

    def finish(self, sequences: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """(B, T) float32 log-probs of the T generated tokens ``sequences[:, prompt_length:]``.

        Raises:
            RuntimeError: if the number of recorded steps differs from the number of generated tokens.
        """
        generated = sequences.size(1) - prompt_length
        if self._previous is not None:
            if len(self._values) < generated:
                self._values.append(self._previous.gather(-1, sequences[:, -1:].to(self._previous.device)).squeeze(-1))
            # else: a deferred stop check (transformers on CUDA/MPS) ran one extra step whose token was undone.
            self._previous = None
        if self.kept is not None:
            del self.kept[generated:]  # the undone extra step, if any
        if len(self._values) != generated:
            raise RuntimeError(
                f"Recorded {len(self._values)} sampling steps for {generated} generated tokens; cannot align the "
                "behaviour log-probs (unsupported generation mode?)."
            )
        if not self._values:
            return torch.zeros(sequences.size(0), 0, dtype=torch.float32, device=sequences.device)
        return torch.stack(self._values, dim=1)


@contextlib.contextmanager
def _record_last_processor(model: torch.nn.Module, recorders: list, record_support: bool = False) -> Iterator[None]:
    """Shadow ``_get_logits_processor`` on every generation module inside ``model`` (the model itself, or the
    wrapped model of a PEFT wrapper) so that the processor list it builds ends with a ``SampledTokenLogProbs``.

    transformers 5.x builds the list in ``GenerationMixin._get_logits_processor``: processors, then the caller's
    custom ``logits_processor`` list, then the sampling warpers (temperature, top-k, top-p, min-p, ...), so a custom
    processor would see pre-warper scores; appending to the returned list puts the recorder after everything.
    """
    from transformers.generation.utils import GenerationMixin

    patched = []
    for module in model.modules():
        if isinstance(module, GenerationMixin) and "_get_logits_processor" not in vars(module):
            original = module._get_logits_processor

            def builder(*args, _original=original, **kwargs):
                processors = _original(*args, **kwargs)
                recorder = SampledTokenLogProbs(record_support)
                recorder.processors = list(processors)
                recorders.append(recorder)
                processors.append(recorder)
                return processors

            module._get_logits_processor = builder
            patched.append(module)
    if not patched:
        raise TypeError(f"{type(model).__name__} contains no transformers GenerationMixin module to record from.")
    try:
        yield
    finally:
        for module in patched:
            del module._get_logits_processor


def _check_sampling(model: torch.nn.Module, kwargs: dict) -> None:
    """Refuse a ``generate`` call that does not sample (generate falls back to the model's own
    ``generation_config`` for anything the call does not set). Raises ValueError."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    do_sample = kwargs.get("do_sample", getattr(config, "do_sample", None))
    num_beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
    if not do_sample or num_beams > 1:
        raise ValueError(
            "Behaviour log-probs need sampled generation (do_sample=True, num_beams=1); greedy or beam search "
            "has no sampling distribution to correct for."
        )


@contextlib.contextmanager
def capture_generate_log_probs(model: torch.nn.Module, *, record_support: bool = False) -> Iterator[GenerateCapture]:
    """Within the block, ``model.generate`` also records the behaviour log-probs of what it samples.

    ``generate`` is shadowed by a wrapper that appends a ``SampledTokenLogProbs`` recorder to the END of the
    processor list generate builds (after temperature/top-k/top-p/min-p/repetition penalty), so the recorded
    value is ``log_softmax(processed scores)[sampled token]``: exactly what ``output_scores=True`` would give
    (tested), without keeping T score tensors. The wrapper returns what ``generate`` returns (the caller's
    ``return_dict_in_generate`` is respected). Instance attributes are removed on exit, also on error.

    Args:
        model: the module whose ``generate`` the caller will use (for DDP / ZeRO-1/2 the unwrapped model; a PEFT
            wrapper works: its inner generation model is instrumented).
        record_support: also record every step's kept-token set (``GenerateCapture.completion_kept_tokens``).

    Yields:
        GenerateCapture, filled by every ``generate`` call in the block: ``log_probs[k]`` is (B, T) float32.

    Raises:
        ValueError (from the wrapped call): if generation is not sampling (``do_sample=False`` / beam search),
        because mu is then not a sampling distribution and no behaviour log-prob exists.
        RuntimeError (from the wrapped call): if the recorded steps cannot be aligned with the generated tokens.
    """
    capture = GenerateCapture()
    had_instance_attr = "generate" in vars(model)
    previous = vars(model).get("generate")
    original = model.generate

    def generate_with_log_probs(*args, **kwargs):
        _check_sampling(model, kwargs)
        recorders: list[SampledTokenLogProbs] = []
        with _record_last_processor(model, recorders, record_support):
            out = original(*args, **kwargs)
        sequences = out if torch.is_tensor(out) else out.sequences
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        prompt_length = input_ids.size(1)
        if len(recorders) != 1:
            raise RuntimeError(f"Expected one logits-processor list per generate call, saw {len(recorders)}.")
        capture.sequences.append(sequences)
        capture.prompt_lengths.append(prompt_length)
        capture.log_probs.append(recorders[0].finish(sequences, prompt_length))
        capture.kept.append(recorders[0].kept)
        capture.vocab_sizes.append(recorders[0].vocab_size)
        capture.processors.append(recorders[0].processors)
        return out

    model.generate = generate_with_log_probs
    try:
        yield capture
    finally:
        if had_instance_attr:
            model.generate = previous
        else:
            del model.generate


def resolve_generate_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"bfloat16"`` / ``"float16"`` / ``"float32"`` (or the torch dtype itself) as a floating torch dtype.

    Raises:
        ValueError: for any other name or dtype (the message lists the allowed names).
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in GENERATE_DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype in GENERATE_DTYPES:
        return GENERATE_DTYPES[dtype]
    raise ValueError(f"generate dtype must be one of {', '.join(GENERATE_DTYPES)} (or None), got {dtype!r}.")


@contextlib.contextmanager
def cast_floating_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Within the block, every floating parameter and buffer of ``model`` holds a ``dtype`` copy of its values.

    On exit (also on error) every parameter gets back its original ``.data`` tensor and every buffer its original
    tensor: the very same storage, so the restore is bit-exact and keeps any view relation (e.g. DeepSpeed's
    flattened parameter groups); parameter objects (and so optimizer state) are never replaced. Tensors already
    in ``dtype`` and non-floating tensors are left alone. Memory: one ``dtype`` copy of the weights.
    """
    params = [p for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    buffers = [
        (module, name, buf)
        for module in model.modules()
        for name, buf in module.named_buffers(recurse=False)
        if buf.is_floating_point() and buf.dtype != dtype
    ]
    originals = [p.data for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.data = p.data.to(dtype)
            for module, name, buf in buffers:
                setattr(module, name, buf.to(dtype))
        yield
    finally:
        for p, data in zip(params, originals):
            p.data = data
        for module, name, buf in buffers:
            setattr(module, name, buf)


@contextlib.contextmanager
def generate_in_dtype(model: torch.nn.Module, dtype: Union[str, torch.dtype, None]) -> Iterator[None]:
    """Within the block, ``model.generate`` samples from a ``dtype`` copy of the weights (see
    ``cast_floating_weights``); the weights are restored bit-exactly when each call returns.

    The cast happens inside ``generate``, i.e. after any gathering the caller does around it (TRL's
    ``unwrap_model_for_generation``), and only for the call's duration, so the trainer's forwards always see the
    original weights. It composes with ``capture_generate_log_probs`` (enter this one first): the behaviour
    log-probs are then those of the down-cast sampler, as a low-precision rollout engine would report them.

    Args:
        model: the module whose ``generate`` the caller will use.
        dtype: ``"bfloat16"``, ``"float16"``, ``"float32"``, a torch dtype, or None (the block does nothing).

    Raises:
        ValueError: for an unsupported dtype (at entry).
    """
    dtype = resolve_generate_dtype(dtype)
    if dtype is None:
        yield
        return
    had_instance_attr = "generate" in vars(model)
    previous = vars(model).get("generate")
    original = model.generate

    def generate_cast(*args, **kwargs):
        with cast_floating_weights(model, dtype):
            return original(*args, **kwargs)

    model.generate = generate_cast
    try:
        yield
    finally:
        if had_instance_attr:
            model.generate = previous
        else:
            del model.generate
