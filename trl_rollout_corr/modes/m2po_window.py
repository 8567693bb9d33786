"""M2PO in decoupled mode: the second-moment mask over the optimizer step's global batch, every rank together.

M2PO (Zheng et al., 2025, "Prosperity before Collapse"; AReaL's ``m2_threshold``) masks the tokens with the largest
``|l|`` until the mean of ``l^2`` over the remaining tokens of the whole optimizer step is ``<= tau``
(``correction.m2po``: the greedy and its deterministic tie order). In decoupled mode ``l = log pi_old - log mu`` is
known for every row right after generation, and the generation batch of all ranks is the optimizer step's global
batch (``RolloutCorrGRPOConfig`` requires ``steps_per_generation == gradient_accumulation_steps``; with
``num_iterations > 1`` each step trains on the same rows with the same mask), so the mask is computed once per
generation batch, before any micro-batch's loss: each rank's candidates (valid tokens' ``l^2`` and global positions)
are all-gathered, every rank runs the same greedy on the union, and keeps its own rows' mask.

Global positions are TRL's gathered order (rank ``r``'s rows follow those of ranks ``< r``; within a rank, generation
order), so the mask of 2 ranks equals that of 1 rank on the concatenated batch, and does not depend on how TRL later
shuffles and splits the rows into micro-batches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..accumulator import Reducers, gather_uneven
from ..correction.m2po import M2Candidates, M2Selection, m2po_candidates, m2po_select
from ..old_forward import to_generation_order


def m2po_step_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float, reducers: Reducers = Reducers(),
                   process_index: int = 0, rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, M2Selection]:
    """The M2PO keep mask of this rank's rows of one optimizer step, from every rank's tokens.

    Args:
        log_ratio: (B, T) float ``l = log pi_old - log mu`` (nats; float64 keeps ``l^2`` exact); NaN/inf tokens are
            never candidates and never kept.
        mask: (B, T) the tokens that would be trained on (after RS, ``max_policy_lag`` and invalid tokens); > 0 kept.
        threshold: tau > 0, the largest kept mean of ``l^2`` over the step (nats^2).
        reducers: the cross-rank operations (``Reducers.gather``: an all-gather in rank order; identities on one rank).
            Every rank must call this once per generation batch (it gathers twice).
        process_index: this rank's index (``accelerator.process_index``).
        rows: (B,) int64 the generation row of each batch row when the batch is in TRL's shuffled order (pi_old read
            from the loss forward), or None (generation order).

    Returns:
        ((B, T) float32 0/1 keep mask in the batch's row order, the step's ``M2Selection``: the same on every rank).

    Raises:
        ValueError: threshold not a finite number > 0 (``correction.m2po.check_m2_threshold``).
    """
    if rows is not None:
        log_ratio, mask = to_generation_order(log_ratio, rows), to_generation_order(mask, rows)
    local_rows = torch.tensor([float(mask.shape[0])], dtype=torch.float64, device=mask.device)
    rows_per_rank = [int(n) for n in reducers.gather(local_rows).tolist()]
    offset = sum(rows_per_rank[:process_index])
    candidates = m2po_candidates(log_ratio, mask, offset)
    gathered = gather_uneven(candidates.to_tensor().reshape(-1), reducers).reshape(-1, 3)
    selection = m2po_select(M2Candidates.from_tensor(gathered), threshold)
    keep = selection.keep_mask(mask, offset, log_ratio)
    return (keep if rows is None else keep[rows]), selection

