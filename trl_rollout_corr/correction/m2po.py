"""M2PO's second-moment mask: drop the tokens with the largest |log ratio| until the batch's mean ``l^2`` is <= tau.

M2PO (Zheng et al., "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?", 2025;
AReaL's ``m2_threshold``, paper default tau = 0.04) bounds the second moment ``M2 = mean(l^2)`` of the per-token log
ratio ``l = log pi_train - log mu`` over a whole optimizer step instead of clipping each token: only the extreme
outliers are masked, so data that is many updates stale still trains. The mask is batch-level, like batch
normalisation: it must be computed once over every token of the optimizer step, on all ranks together, before any
micro-batch's loss. Hence three pure steps, with the cross-rank gather done by the caller (nothing here knows
``torch.distributed``):

1. ``m2po_candidates(l, mask, row_offset)`` on each micro-batch of each rank: the valid tokens' ``l^2`` (float64) with
   their global positions (row = ``row_offset`` + local row, column = token position);
2. ``M2Candidates.cat`` of every part (every micro-batch, and every rank's after an all-gather; any order), then
   ``m2po_select(candidates, tau)``: the greedy on the whole step, identical on every rank;
3. ``selection.keep_mask(mask, row_offset)`` on each micro-batch: its (B, T) keep mask.

The greedy: sort the valid tokens by ``|l|`` descending, ties by (row, column) ascending (the flat index of the
concatenated batch), and mask the first k, k the smallest count for which the mean of ``l^2`` over the remaining valid
tokens is <= tau (an empty remainder counts as 0). Only tokens with ``l^2 > tau`` are ever masked (the remainder's mean
is <= tau as soon as every remaining token is). Sums are taken in one fixed order (ascending ``l^2`` over the sorted
whole step, in float64), so the result depends only on the set of tokens, not on how it was split across ranks or
micro-batches. The cost: 24 bytes per valid token in the gather and one sort per optimizer step.

Deliberate scope: every valid token is a candidate, as AReaL's ``m2_threshold``; the paper's final Algorithm 1 only
masks tokens in PPO's active quadrants (A > 0 with ratio > 1, A < 0 with ratio < 1), which a caller can get by
passing those tokens as candidates while counting all valid tokens; not offered here yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

PREFIX = "rollout_corr/"


def check_m2_threshold(tau) -> float:
    """tau as a float; ``ValueError`` naming the fix unless it is a finite number > 0 (nats squared)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise TypeError(f"the M2PO threshold tau must be a number (mean squared log ratio, nats^2), got {tau!r}.")
    tau = float(tau)
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"the M2PO threshold tau must be a finite number > 0 (the largest kept mean of l^2 over the "
                         f"optimizer step, nats^2; the paper uses 0.04), got {tau!r}.")
    return tau


@dataclass(frozen=True)
class M2Candidates:
    """Every valid token of some micro-batches: ``l^2`` and its global position (the gatherable summary).

    Attributes:
        sq: (K,) float64 ``l^2`` (exact for float32 ``l``), nats^2.
        row: (K,) int64 global row index (the row's position in the optimizer step's concatenated batch).
        col: (K,) int64 token position within the row.
    """

    sq: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor

    @staticmethod
    def cat(parts: Iterable["M2Candidates"]) -> "M2Candidates":
        """Merge parts (micro-batches, ranks) in any order; positions must not repeat (``m2po_select`` checks).

        Raises:
            ValueError: for no part.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("M2Candidates.cat needs at least one part (one per micro-batch and rank).")
        device = parts[0].sq.device
        return M2Candidates(torch.cat([p.sq.to(device) for p in parts]), torch.cat([p.row.to(device) for p in parts]),
                            torch.cat([p.col.to(device) for p in parts]))

    def to_tensor(self) -> torch.Tensor:
        """(K, 3) float64 ``[sq, row, col]`` (positions exact below 2^53): one tensor for an all-gather."""
        return torch.stack([self.sq, self.row.double(), self.col.double()], -1)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> "M2Candidates":
        """The inverse of ``to_tensor`` (e.g. of each rank's gathered block)."""
        return M2Candidates(t[:, 0].double(), t[:, 1].long(), t[:, 2].long())


def m2po_candidates(log_ratio: torch.Tensor, response_mask: torch.Tensor, row_offset: int = 0) -> M2Candidates:
    """The valid tokens of one micro-batch, for ``m2po_select``.

    Args:
        log_ratio: (B, T) float, ``l = log pi_train - log mu`` in nats (decoupled: pi_old vs mu).
        response_mask: (B, T), > 0 at completion tokens. A token is valid when its mask is > 0 and ``l`` is finite
            (NaN/inf tokens are invalid, as everywhere in the correction: never candidates, never kept).
        row_offset: the global index of this micro-batch's first row in the optimizer step (ranks and micro-batches
            must use disjoint row ranges, e.g. TRL's gathered order).

    Raises:
        ValueError: shapes differ or are not 2-D, or a negative offset.
    """
    if log_ratio.dim() != 2 or log_ratio.shape != response_mask.shape:
        raise ValueError(f"log_ratio and response_mask must both be (B, T), got {tuple(log_ratio.shape)} and "
                         f"{tuple(response_mask.shape)}.")
    if row_offset < 0:
        raise ValueError(f"row_offset must be >= 0 (the micro-batch's first global row), got {row_offset}.")
    valid = (response_mask > 0) & torch.isfinite(log_ratio)
    rows, cols = valid.nonzero(as_tuple=True)
    l64 = log_ratio.detach().double()[rows, cols]
    return M2Candidates(l64 * l64, rows + int(row_offset), cols)


@dataclass(frozen=True)
class M2Selection:
    """The greedy's result over an optimizer step.

    Attributes:
        masked_row, masked_col: (k,) int64 global positions of the masked tokens, in masking order.
        n_valid: valid tokens of the step. sum_sq_before: their sum of ``l^2``. sum_sq_after: over the kept ones.
        threshold: tau.
    """

    masked_row: torch.Tensor
    masked_col: torch.Tensor
    n_valid: int
    sum_sq_before: float
    sum_sq_after: float
    threshold: float

    @property
    def n_masked(self) -> int:
        return int(self.masked_row.numel())

    def keep_mask(self, response_mask: torch.Tensor, row_offset: int = 0, log_ratio=None) -> torch.Tensor:
        """(B, T) float32 0/1: the micro-batch's valid tokens that the step's selection keeps.

        Args:
            response_mask: the micro-batch's (B, T) mask, as given to ``m2po_candidates``.
            row_offset: the same offset as given to ``m2po_candidates``.
            log_ratio: the micro-batch's (B, T) log ratio, to drop its non-finite tokens too (None: mask > 0 only).
        """
        keep = (response_mask > 0).float()
        if log_ratio is not None:
            keep = keep * torch.isfinite(log_ratio).float()
        B = keep.shape[0]
        rows = self.masked_row.to(keep.device) - int(row_offset)
        mine = (rows >= 0) & (rows < B)
        keep[rows[mine], self.masked_col.to(keep.device)[mine]] = 0.0
        return keep

    def metrics(self) -> dict[str, float]:
        """``rollout_corr/m2po_*``: the second moment (mean ``l^2``, nats^2) before and after, the masked fraction
        and count (of the step's valid tokens). A mean or fraction over no token is absent, never 0 (``after`` when
        every valid token is masked; all but the count without a valid token). The trainer logs the first three only
        (``modes.decoupled``: sums over the log window); the count is this function's alone."""
        kept = self.n_valid - self.n_masked
        out = {}
        if self.n_valid:
            out[PREFIX + "m2po_second_moment_before"] = self.sum_sq_before / self.n_valid
        if kept:
            out[PREFIX + "m2po_second_moment_after"] = self.sum_sq_after / kept
        if self.n_valid:
            out[PREFIX + "m2po_masked_fraction"] = self.n_masked / self.n_valid
        out[PREFIX + "m2po_masked_tokens"] = float(self.n_masked)
        return out


def m2po_select(candidates: M2Candidates, threshold: float) -> M2Selection:
    """The greedy (module docstring) on the whole optimizer step's candidates.

    Args:
        candidates: ``M2Candidates.cat`` of every micro-batch of every rank.
        threshold: tau > 0, the largest kept mean of ``l^2`` (nats^2).

    Returns:
        ``M2Selection``; the same on every rank given the same candidates (in any order).

    Raises:
        ValueError: tau not a finite number > 0, or two candidates at the same position (overlapping row offsets).
    """
    tau = check_m2_threshold(threshold)
    sq, row, col = (t.detach().cpu() for t in (candidates.sq.double(), candidates.row.long(), candidates.col.long()))
    n = int(sq.numel())
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return M2Selection(empty, empty, 0, 0.0, 0.0, tau)
    width = int(col.max()) + 1
    flat = row * width + col
    order = torch.argsort(flat, stable=True)
    if bool((flat[order][1:] == flat[order][:-1]).any()):
        raise ValueError("M2PO candidates repeat a (row, column) position: each micro-batch and rank must pass its "
                         "own row_offset (its first row in the optimizer step's concatenated batch).")
    order = order[torch.argsort(-sq[order], stable=True)]  # |l| descending, ties by flat index ascending
    sorted_sq = sq[order]
    # remaining[k] = sum of l^2 after masking the first k, summed in ascending l^2 (one fixed order)
    remaining = torch.cat([torch.flip(torch.cumsum(torch.flip(sorted_sq, [0]), 0), [0]), sorted_sq.new_zeros(1)])
    left = torch.arange(n, -1, -1, dtype=torch.float64)  # tokens remaining after masking k = 0..n
    ok = remaining <= tau * left
    k = int(torch.nonzero(ok)[0])  # ok[n] is True (nothing left: 0 <= 0)
    masked = order[:k]
    return M2Selection(row[masked], col[masked], n, float(remaining[0]), float(remaining[k]), tau)


def m2po_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> tuple[torch.Tensor,
                                                                                               M2Selection]:
    """One batch that is the whole optimizer step (one rank, one micro-batch): its keep mask and selection.

    Args and raises: as ``m2po_candidates`` and ``m2po_select``. Returns ((B, T) float32 keep mask, selection).
    """
    selection = m2po_select(m2po_candidates(log_ratio, response_mask), threshold)
    return selection.keep_mask(response_mask, log_ratio=log_ratio), selection
