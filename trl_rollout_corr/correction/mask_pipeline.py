"""The one per-token mask pipeline (issue 48): small pure steps ``(mask, ctx) -> mask`` composed once per mode.

Every (B, T) mask the loss, the batch-normalisation window and the lag filter use is TRL's loss mask (the source:
``trl_compat.loss_mask``, ``completion_mask`` (padding, and TRL's ``mask_truncated_completions``) times
``tool_mask``; it stays in ``trl_compat``, the one place that mirrors TRL's formulas) run through the mode's
``MaskPipeline``, in the spirit of ``optax.chain``: each step is a pure function of the mask so far and a
``MaskContext`` (the step's data), ``chain`` composes them in order, and the mode composes its chain once, at
construction. The steps:

* ``lag_rows``: rows the loss keeps (``max_policy_lag``: ``ctx.row_keep``, from ``lag.stale_row_keep`` or the
  generation-time ``GenerationBatch.keep_rows``) stay, the others are zeroed;
* ``correction``: the correction's mask (``ctx.correct``, ``compute_rollout_correction``'s ``response_mask``): invalid
  (NaN/inf log-prob, support-missed) and RS-rejected tokens zeroed;
* ``m2po``: M2PO's step-global keep mask (``ctx.m2po_keep``) multiplied in.

The modes' chains: decoupled ``lag_rows, correction[, m2po]`` at scoring (``DecoupledMode.apply_correction``; the
RS mask it stores is the loss mask of TRL's loss); bypass ``lag_rows, correction``, whose ``rows`` part (the steps
before ``correction``) both the loss of each micro-batch and the window's scoring of the step's micro-batches run, so
the window's batch-normalisation total is over exactly the tokens the loss hands to the correction. The lag filter of
a micro-batch (``lag.drop_stale_rows``, the ``PolicyLag`` feature and the bypass window) is the ``lag_rows`` step.

Each step keeps the float ops of the code it replaced (same multiplications, same order, the mask's own dtype), so a
run is bit-identical to before (tests/trainer/test_trainer_golden.py). Masks are 0/1; the correction reads them as
boolean (entries > 0 kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["MaskContext", "MaskPipeline", "MaskStep", "chain", "correction", "lag_rows", "m2po"]


@dataclass(frozen=True)
class MaskContext:
    """What the steps read; a field a chain's steps do not use may stay None.

    Attributes:
        row_keep: (B,) bool, the rows the loss keeps (``lag_rows``); None: every row.
        correct: ``mask -> response_mask`` (``correction``): (B, T) in, (B, T) of the same dtype out, with invalid
            and RS-rejected tokens zeroed; the caller's callable runs the correction and keeps its weights and
            statistics.
        m2po_keep: ``mask -> keep`` (``m2po``): (B, T) in, (B, T) float32 0/1 M2PO keep mask out
            (``modes.m2po_window.m2po_step_mask``; the caller records its metrics).
    """

    row_keep: Optional[torch.Tensor] = None
    correct: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    m2po_keep: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


MaskStep = Callable[[torch.Tensor, MaskContext], torch.Tensor]


def _check_mask(mask: torch.Tensor, step: str) -> None:
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"mask step {step!r}: the mask must be a (B, T) tensor, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}.")


def lag_rows(mask: torch.Tensor, ctx: MaskContext) -> torch.Tensor:
    """``mask`` with the rows outside ``ctx.row_keep`` zeroed: ``mask * row_keep[:, None]`` in ``mask``'s dtype and
    device (the ops of the former ``lag.drop_stale_rows`` and ``DecoupledMode.apply_correction``).

    Args:
        mask: (B, T) 0/1 mask, any dtype.
        ctx: ``row_keep`` (B,) bool, or None (then ``mask`` itself is returned).

    Returns:
        (B, T), ``mask``'s dtype.

    Raises:
        ValueError: ``mask`` not 2-D, or ``row_keep`` not (B,).
    """
    keep = ctx.row_keep
    if keep is None:
        return mask
    _check_mask(mask, "lag_rows")
    if keep.dim() != 1 or keep.size(0) != mask.size(0):
        raise ValueError(f"mask step 'lag_rows': row_keep must be (B,) = ({mask.size(0)},) for a mask of shape "
                         f"{tuple(mask.shape)}, got {tuple(keep.shape)}; pass one bool per row.")
    return mask * keep[:, None].to(mask.device).to(mask.dtype)


def correction(mask: torch.Tensor, ctx: MaskContext) -> torch.Tensor:
    """The correction's mask of the tokens ``mask`` keeps: ``ctx.correct(mask)`` (``compute_rollout_correction``'s
    ``response_mask``: invalid and RS-rejected tokens zeroed).

    Args:
        mask: (B, T) 0/1 mask, any dtype (read as boolean: entries > 0 are kept).
        ctx: ``correct``, the caller's correction call.

    Returns:
        (B, T), ``mask``'s dtype.

    Raises:
        ValueError: no ``ctx.correct``, or it returned a mask of another shape or dtype.
    """
    if ctx.correct is None:
        raise ValueError("mask step 'correction' needs MaskContext.correct (the correction call, mask -> its "
                         "response_mask); build the context with correct=...")
    out = ctx.correct(mask)
    if out.shape != mask.shape or out.dtype != mask.dtype:
        raise ValueError(f"mask step 'correction': the correction returned a {tuple(out.shape)} {out.dtype} mask for "
                         f"a {tuple(mask.shape)} {mask.dtype} one; it must keep the input's shape and dtype.")
    return out


def m2po(mask: torch.Tensor, ctx: MaskContext) -> torch.Tensor:
    """``mask`` times M2PO's step-global keep mask: ``mask * ctx.m2po_keep(mask)`` in ``mask``'s dtype (the ops of
    the former ``DecoupledMode._m2po``).

    Args:
        mask: (B, T) the tokens that would be trained on (after RS, the lag filter and invalid tokens).
        ctx: ``m2po_keep``, the caller's M2PO call (every rank must run it once per generation batch).

    Returns:
        (B, T), ``mask``'s dtype.

    Raises:
        ValueError: no ``ctx.m2po_keep``, or its keep mask is not ``mask``'s shape.
    """
    if ctx.m2po_keep is None:
        raise ValueError("mask step 'm2po' needs MaskContext.m2po_keep (mask -> M2PO's keep mask); build the context "
                         "with m2po_keep=..., or leave m2po out of the chain (rollout_m2_threshold unset).")
    keep = ctx.m2po_keep(mask)
    if keep.shape != mask.shape:
        raise ValueError(f"mask step 'm2po': the keep mask is {tuple(keep.shape)} for a {tuple(mask.shape)} mask.")
    return mask * keep.to(mask.dtype)


def chain(*steps: MaskStep) -> MaskStep:
    """The steps composed in order (``optax.chain`` for masks): ``chain(a, b)(mask, ctx) == b(a(mask, ctx), ctx)``;
    ``chain()`` is the identity.

    Raises:
        TypeError: a step that is not callable.
    """
    for step in steps:
        if not callable(step):
            raise TypeError(f"chain: every step must be a callable (mask, ctx) -> mask, got {step!r}.")

    def chained(mask: torch.Tensor, ctx: MaskContext) -> torch.Tensor:
        for step in steps:
            mask = step(mask, ctx)
        return mask

    chained.steps = steps  # type: ignore[attr-defined]
    return chained


class MaskPipeline:
    """A mode's mask chain, composed once; ``rows`` is its part before the ``correction`` step.

    Args:
        *steps: the mask steps in order; ``correction`` at most once.

    Attributes:
        steps: the steps, in order.
        rows: ``chain`` of the steps before ``correction`` (all of them without one): the tokens each micro-batch
            trains, which the correction sees (the bypass loss and the bypass window both run it).

    Raises:
        ValueError: ``correction`` more than once. TypeError: a step that is not callable (``chain``).
    """

    def __init__(self, *steps: MaskStep) -> None:
        if sum(step is correction for step in steps) > 1:
            raise ValueError("MaskPipeline: the correction step may appear once; a second RS pass would reject on a "
                             "mask the first one already changed.")
        self.steps = tuple(steps)
        self._all = chain(*steps)
        cut = self.steps.index(correction) if correction in self.steps else len(self.steps)
        self.rows = chain(*self.steps[:cut])

    def __call__(self, mask: torch.Tensor, ctx: MaskContext) -> torch.Tensor:
        """The whole chain on ``mask`` (B, T); returns (B, T) in ``mask``'s dtype."""
        return self._all(mask, ctx)

    def __repr__(self) -> str:
        return f"MaskPipeline({', '.join(getattr(s, '__name__', repr(s)) for s in self.steps)})"
