"""The one check that behaviour log-probs line up with the completions they were sampled for.

Every rollout path (vLLM, a ``rollout_func``, ``transformers.generate``) hands back one list of per-token
log-probs (mu, nats) per completion; rollout correction is only meaningful when entry ``t`` of row ``i`` is the
log-prob of token ``t`` of completion ``i``. Nothing is ever padded or truncated to make them fit.
"""

from __future__ import annotations

from typing import Optional, Sequence


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
