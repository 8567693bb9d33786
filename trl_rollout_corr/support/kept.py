"""An engine's kept-token sets, stored compactly, and their (B, T, V) masks (``support``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


# ====================================================================================== kept-token sets
@dataclass(frozen=True)
class KeptTokens:
    """An engine's kept-token sets for the T tokens of one completion, stored compactly.

    Position ``t`` lists ``token_ids[offsets[t]:offsets[t + 1]]``: the kept token ids, or, where ``complement[t]``,
    the removed ones (whichever is shorter), so memory is ``4 * min(|K_t|, V - |K_t|)`` bytes per position: never
    ``(T, V)`` floats, and nothing at all for an untruncated position.

    Attributes:
        token_ids: (M,) int32 ids.
        offsets: (T + 1,) int64, non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == M``.
        complement: (T,) bool.
        vocab_size: V.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    complement: torch.Tensor
    vocab_size: int

    def __len__(self) -> int:
        return int(self.complement.numel())

    def sizes(self) -> torch.Tensor:
        """(T,) int64 kept-set sizes."""
        listed = self.offsets[1:] - self.offsets[:-1]
        return torch.where(self.complement, self.vocab_size - listed, listed)

    def mask(self) -> torch.Tensor:
        """(T, V) bool kept mask (tests and small inputs only: this is the dense form the class avoids)."""
        return kept_mask([self], [torch.arange(len(self))], self.vocab_size, self.token_ids.device)


def compact_kept(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One generation step's kept sets, compacted: ``(ids, counts, complement)``.

    Args:
        kept: (B, V) bool, the tokens the step could sample (finite processed scores).

    Returns:
        ``ids`` (M,) int32 (row-major: row 0's ids first), ``counts`` (B,) int64 (ids listed per row),
        ``complement`` (B,) bool (the row lists its removed ids).
    """
    vocab = kept.size(1)
    complement = kept.sum(dim=1) * 2 > vocab
    listed = kept ^ complement.unsqueeze(1)
    ids = listed.nonzero()[:, 1].to(torch.int32)
    return ids, listed.sum(dim=1), complement


def kept_tokens_from_steps(steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], row: int, length: int,
                           vocab_size: int) -> KeptTokens:
    """Row ``row``'s first ``length`` steps of ``compact_kept`` outputs, as ``KeptTokens``.

    Raises:
        ValueError: fewer than ``length`` steps were recorded.
    """
    if length > len(steps):
        raise ValueError(f"Row {row}: {length} tokens but only {len(steps)} kept sets were recorded.")
    ids, counts, complement = [], [], []
    for step_ids, step_counts, step_complement in steps[:length]:
        start = int(step_counts[:row].sum())
        ids.append(step_ids[start:start + int(step_counts[row])])
        counts.append(step_counts[row:row + 1])
        complement.append(step_complement[row:row + 1])
    if not ids:
        empty = torch.zeros(0, dtype=torch.int32)
        return KeptTokens(empty, torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), vocab_size)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
    return KeptTokens(torch.cat(ids).cpu(), offsets.cpu(), torch.cat(complement).cpu(), vocab_size)


def kept_mask(rows: Sequence[KeptTokens], steps: Sequence[torch.Tensor], vocab_size: int,
              device: torch.device) -> torch.Tensor:
    """Dense kept mask for a list of positions: ``steps[i]`` (1-D int64) of ``rows[i]``.

    Returns:
        (sum of len(steps[i]), V) bool, the positions in order.

    Raises:
        ValueError: a kept set was recorded for another vocabulary size.
    """
    ids, counts, complement = [], [], []
    for kept, s in zip(rows, steps):
        if kept.vocab_size != vocab_size:
            raise ValueError(f"kept-token sets over {kept.vocab_size} tokens, the trainer's head has {vocab_size}.")
        s = s.to(kept.offsets.device)
        lo, hi = kept.offsets[s], kept.offsets[s + 1]
        counts.append(hi - lo)
        complement.append(kept.complement[s])
        # one flat gather of the positions' id ranges
        span = hi - lo
        base = torch.repeat_interleave(lo - torch.cat([span.new_zeros(1), span.cumsum(0)[:-1]]), span)
        ids.append(kept.token_ids[base + torch.arange(int(span.sum()))].long())
    counts, complement = torch.cat(counts).to(device), torch.cat(complement).to(device)
    ids = torch.cat(ids).to(device)
    mask = complement.unsqueeze(1).expand(-1, vocab_size).clone()
    pos = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    mask[pos, ids] = ~complement[pos]
    return mask
