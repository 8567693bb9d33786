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
the log-probs are recorded on the side.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch


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
        raise ValueError("No generation scores: call generate with output_scores=True and return_dict_in_generate=True.")
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
    """

    sequences: list = field(default_factory=list)
    prompt_lengths: list = field(default_factory=list)
    log_probs: list = field(default_factory=list)

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


@contextlib.contextmanager
def capture_generate_log_probs(model: torch.nn.Module) -> Iterator[GenerateCapture]:
    """Within the block, ``model.generate`` also records the behaviour log-probs of what it samples.

    The wrapper calls the original ``generate`` with ``output_scores=True, return_dict_in_generate=True`` and
    returns only ``out.sequences`` (a ``(B, P + T)`` tensor), so callers that expect plain ids are unaffected.
    The instance attribute is removed on exit (the class method is visible again), also on error.

    Args:
        model: the module whose ``generate`` the caller will use (for DDP / ZeRO-1/2 the unwrapped model).

    Yields:
        GenerateCapture, filled by every ``generate`` call in the block.

    Raises:
        ValueError (from the wrapped call): if generation is not sampling (``do_sample=False`` / beam search),
        because mu is then not a sampling distribution and no behaviour log-prob exists.
    """
    capture = GenerateCapture()
    had_instance_attr = "generate" in vars(model)
    previous = vars(model).get("generate")
    original = model.generate

    def generate_with_log_probs(*args, **kwargs):
        config = kwargs.get("generation_config")
        do_sample = kwargs.get("do_sample", getattr(config, "do_sample", None))
        num_beams = kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1
        if do_sample is False or num_beams > 1:
            raise ValueError(
                "Behaviour log-probs need sampled generation (do_sample=True, num_beams=1); greedy or beam search "
                "has no sampling distribution to correct for."
            )
        kwargs["output_scores"] = True
        kwargs["return_dict_in_generate"] = True
        out = original(*args, **kwargs)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        prompt_length = input_ids.size(1)
        capture.sequences.append(out.sequences)
        capture.prompt_lengths.append(prompt_length)
        capture.log_probs.append(behaviour_log_probs_from_scores(out.scores, out.sequences, prompt_length))
        return out.sequences

    model.generate = generate_with_log_probs
    try:
        yield capture
    finally:
        if had_instance_attr:
            model.generate = previous
        else:
            del model.generate
