"""The one check that behaviour log-probs line up with the completions they were sampled for.

Every rollout path (vLLM, a ``rollout_func``, ``transformers.generate``) hands back one list of per-token
log-probs (mu, nats) per completion; rollout correction is only meaningful when entry ``t`` of row ``i`` is the
log-prob of token ``t`` of completion ``i``. Nothing is ever padded or truncated to make them fit.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def check_aligned(completion_lengths: Sequence[int], log_probs: Sequence[Optional[Sequence]]) -> None:
    """Raise unless ``log_probs`` has one row per completion and one entry per completion token.

    Args:
        completion_lengths: B completion lengths in tokens (``len(completion_ids[i])``, or the mask's row sums).
        log_probs: B per-row sequences of behaviour log-probs (nats); an entry may be None (an invalid token,
            handled later), a whole row may not.

    Raises:
        ValueError: the row counts differ ("Got behaviour log-probs for N rows but the batch has B"), or a row is
            missing or has the wrong length (the message names the first such row: "Row i: ...").
    """
    if len(log_probs) != len(completion_lengths):
        raise ValueError(
            f"Got behaviour log-probs for {len(log_probs)} rows but the batch has {len(completion_lengths)}."
        )
    for row, (n, lps) in enumerate(zip(completion_lengths, log_probs)):
        if lps is None:
            raise ValueError(
                f"Row {row}: the rollout engine returned no log-probs; request them (vLLM: logprobs=0 with "
                "logprobs_mode='processed_logprobs')."
            )
        if len(lps) != int(n):
            raise ValueError(
                f"Row {row}: {len(lps)} behaviour log-probs for {int(n)} completion tokens; the rollout engine's "
                "log-probs must align token for token with the completion (nothing is padded or truncated)."
            )


def rollout_log_probs_to_tensor(
    per_row: Sequence[Optional[Sequence[Optional[float]]]], completion_mask: torch.Tensor
) -> torch.Tensor:
    """Lay per-row behaviour log-probs from a rollout engine out as a (B, T) tensor aligned with the mask.

    Args:
        per_row: B sequences of per-token log-probs (nats), one per sampled completion token, in order.
            A ``None`` entry (engine returned no log-prob for that token) becomes NaN, i.e. an invalid
            token (see ``compute_rollout_correction``).
        completion_mask: (B, T) 0/1; row i must be ``len(per_row[i])`` ones followed by zeros
            (right padding, as TRL lays out completions).

    Returns:
        (B, T) float32 on the mask's device; NaN where the engine gave None, 0 at padding.

    Raises:
        ValueError: if B differs, a row is None, a row's length differs from its completion length, or a
            mask row is not right-padded (the message names the row; nothing is padded or truncated silently).
    """
    if len(per_row) != completion_mask.shape[0]:
        check_aligned([0] * completion_mask.shape[0], per_row)  # raises: the row counts differ
    ones = completion_mask != 0
    lengths = ones.sum(-1)
    prefix = torch.arange(ones.shape[1], device=ones.device).unsqueeze(0) < lengths.unsqueeze(-1)
    bad_rows = (ones != prefix).any(-1).nonzero().flatten().tolist()
    if bad_rows:
        raise ValueError(
            f"Row {bad_rows[0]}: the completion mask is not a run of ones followed by padding; behaviour log-probs "
            "can only be laid out for right-padded completions (nothing is shifted silently)."
        )
    lengths = lengths.tolist()
    check_aligned(lengths, per_row)
    out = torch.zeros(completion_mask.shape, dtype=torch.float32)
    for i, (row, n) in enumerate(zip(per_row, lengths)):
        if n:
            out[i, :n] = torch.tensor([float("nan") if v is None else float(v) for v in row], dtype=torch.float32)
    return out.to(completion_mask.device)
