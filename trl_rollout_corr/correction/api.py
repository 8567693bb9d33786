"""``compute_rollout_correction``: IS weights, RS mask and reducible metrics for one batch, step by step.

Pure functions on ``(B, T)`` tensors; nothing here knows TRL or ``torch.distributed`` (a cross-rank sum is
passed in as a callable). The steps, in order:

1. check the inputs (shapes, dtypes, devices; missing behaviour log-probs name the fix);
2. ``workspace.prepare``: valid tokens, ``x = clamp(l)``, ``R``, row counts and sums, and every derived quantity
   the configured options need;
3. ``counts.collect``: the denominators every family uses;
4. ``weights.importance_weights`` (if ``rollout_is``): the weights and their statistics;
5. ``rejection.rejection_mask`` (if ``rollout_rs``): the keep mask and its statistics;
6. ``diagnostics.collect``: the off-policy statistics;
7. ``RowTable.reduce``: every registered statistic in a few batched ops, as ``CorrectionStats``.

Deliberate differences from verl's ``algorithm.rollout_correction`` (0.9.x): k1 rejection bands keep the ratio
band the user wrote; rows without a valid token are never counted in per-sequence metrics; NaN/inf log-probs at
valid tokens make the token invalid (removed from the mask, weight 1, counted) instead of propagating NaN; an
all-zero IcePop batch gives ESS 0 instead of a ``ZeroDivisionError``; an empty batch is not an error.
The mode split (decoupled / bypass) follows verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from . import counts, diagnostics
from .layout import DEFAULT_LENGTH_BUCKETS, MetricLayout
from .reduce import RowTable
from .rejection import rejection_mask
from .stats import CorrectionStats
from .weights import AllReduce, importance_weights
from .workspace import prepare

if TYPE_CHECKING:  # the correction never imports the config at run time (the config imports RS_OPTIONS from here)
    from ..config import RolloutCorrectionConfig

CorrectionFn = Callable[..., "RolloutCorrectionOutput"]


@dataclass
class RolloutCorrectionOutput:
    """Result of ``compute_rollout_correction``.

    Attributes:
        weights: (B, T) float32 IS weights, detached; 0 at padding, 1 (neutral) at invalid tokens; None
            when ``rollout_is`` is None. RS never changes them.
        response_mask: (B, T), same dtype as the input mask: the input mask with RS-rejected and invalid
            tokens set to 0. Use it for the advantage, the loss and the loss normaliser.
        stats: reducible statistics (on the input's device) behind the metrics.
    """

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    stats: CorrectionStats

    @property
    def metrics(self) -> dict[str, float]:
        """``rollout_corr/*`` metrics of this call alone, as Python floats (one device-to-host transfer)."""
        return self.stats.finalize()


def compute_rollout_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    config: "RolloutCorrectionConfig",
    *,
    all_reduce: Optional[AllReduce] = None,
    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
    rs_log_probs: Optional[torch.Tensor] = None,
) -> RolloutCorrectionOutput:
    """IS weights, RS mask and reducible ``rollout_corr/*`` statistics for one batch.

    Args:
        log_probs: (B, T) log-probs of the sampled tokens under the training policy, in nats: pi_old
            (``old_log_probs``) in decoupled mode, pi_theta (``log_probs``, detached here) in bypass mode.
            bf16/fp16 are upcast to float32.
        rollout_log_probs: (B, T) behaviour log-probs mu from the rollout engine, in nats.
        response_mask: (B, T) completion mask (bool, int or float). It is boolean: entries > 0 are
            completion tokens, 0, negative and NaN entries are not; values are never used as weights.
        config: a validated ``RolloutCorrectionConfig``.
        all_reduce: optional callable summing a small 1-D tensor across ranks, used only for batch
            normalisation so that it divides by the global-batch mean. None: this batch is the global batch.
        length_buckets: increasing response-length edges (valid tokens per row) for the length slices
            ``rollout_corr/len_{lo}_{hi}/*`` (kl, k3_kl, rs_masked_fraction, is_eff_sample_size, num_seqs);
            ``()`` turns them off. Rows with ``lo <= length < hi`` fall in a slice; the last one is open.
        rs_log_probs: ``config.rollout_rs_on == "engine"`` only (and then required): (B, T) log-probs, nats, of the
            training engine at each row's own policy version, ``log pi_train@v`` (``policy_lag_split``). Every RS
            statistic and the RS mask are then computed from the engine factor ``rs_log_probs - rollout_log_probs``
            (numerics only, no staleness) while the IS weights and the off-policy metrics still use the whole ratio
            ``log_probs - rollout_log_probs``; the RS metrics are named ``rollout_rs_engine_*``. A token that is valid
            but whose ``rs_log_probs`` is NaN/inf is rejected by RS.

    Returns:
        ``RolloutCorrectionOutput`` with ``weights`` ((B, T) float32 or None), ``response_mask`` (RS and
        invalid tokens removed) and ``stats`` (``.metrics`` finalises them).

    Raises:
        ValueError: ``rollout_log_probs`` is None (names the fix), shapes differ, tensors are not 2-D or on
            different devices, the length buckets are not increasing positive counts, or ``rs_log_probs`` is missing
            with ``rollout_rs_on="engine"`` / given without it.
        TypeError: non-tensor or non-float log-probs.

    Tokens whose log-probs are NaN or +-inf where the mask is 1 are *invalid*: they are removed from the
    mask, get weight 1, take no part in sequence sums, means or metrics, and are counted in
    ``rollout_corr/invalid_token_fraction``. NaN/inf at padding is ignored.
    """
    _check_inputs(log_probs, rollout_log_probs, response_mask)
    layout = MetricLayout.from_config(config, length_buckets)
    _check_rs_log_probs(layout, rs_log_probs, log_probs)
    return _correct(log_probs, rollout_log_probs, response_mask, layout, all_reduce, rs_log_probs)


def _correct(log_probs, rollout_log_probs, response_mask, layout: MetricLayout,
             all_reduce: Optional[AllReduce], rs_log_probs=None) -> RolloutCorrectionOutput:
    """Steps 2-7 of the module docstring for checked inputs and a built layout (``rs_log_probs``: RS on the engine
    factor, a second workspace over the first one's valid tokens)."""
    ws = prepare(log_probs, rollout_log_probs, response_mask, layout.needs)
    rows = RowTable(ws.n_row64, layout.length_buckets)
    counts.collect(ws, rows)
    weights = importance_weights(ws, layout, rows, all_reduce) if layout.is_level is not None else None
    engine_rows = None
    if layout.rs_specs and rs_log_probs is not None:  # RS on the engine factor: its own rows (see rejection_mask)
        rs_ws = prepare(rs_log_probs, rollout_log_probs, ws.valid, layout.needs)
        engine_rows = RowTable(rs_ws.n_row64)
        keep = rejection_mask(rs_ws, layout.rs_specs, rows, n_row=ws.n_row, option_rows=engine_rows)
    elif layout.rs_specs:
        keep = rejection_mask(ws, layout.rs_specs, rows)
    else:
        keep = ws.valid
    diagnostics.collect(ws, rows)
    stats = rows.reduce(layout)
    if engine_rows is not None:
        stats = stats.joined(engine_rows.reduce(layout))
    return RolloutCorrectionOutput(weights=weights, response_mask=keep.to(response_mask.dtype), stats=stats)


def _check_inputs(log_probs, rollout_log_probs, response_mask) -> None:
    if rollout_log_probs is None:
        raise ValueError(
            "rollout_log_probs (behaviour log-probs mu) are None but rollout correction is on: request the "
            "sampled tokens' log-probs from the rollout engine (vLLM: logprobs=0 with "
            "logprobs_mode='processed_logprobs'; transformers.generate: output_scores=True), or disable the "
            "correction."
        )
    if log_probs is None:
        raise ValueError("log_probs (pi_old in decoupled mode, pi_theta in bypass mode) are None.")
    if response_mask is None:
        raise ValueError("response_mask is None: pass the (B, T) 0/1 completion mask.")
    named = (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs), ("response_mask", response_mask))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D (B, T), got shape {tuple(t.shape)}.")
    if not (log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            "Shapes differ: log_probs "
            f"{tuple(log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)}, response_mask "
            f"{tuple(response_mask.shape)}; all must be (B, T) over the same completion tokens (never padded or "
            "truncated silently)."
        )
    for name, t in named[:2]:
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (nats), got {t.dtype}.")
    if log_probs.device != rollout_log_probs.device or log_probs.device != response_mask.device:
        raise ValueError(
            f"Tensors are on different devices: log_probs {log_probs.device}, rollout_log_probs "
            f"{rollout_log_probs.device}, response_mask {response_mask.device}."
        )


def _check_rs_log_probs(layout: MetricLayout, rs_log_probs, log_probs) -> None:
    """``rs_log_probs`` exactly when RS judges the engine factor, shaped and typed as ``log_probs``."""
    if layout.rs_on == "engine" and rs_log_probs is None:
        raise ValueError(
            "rollout_rs_on='engine' computes RS on the engine factor pi_train@v / mu, but no rs_log_probs "
            "(log pi_train@v, the policy_lag_split forward at each row's version) were passed; set "
            "policy_lag_split=True in the trainer, or rollout_rs_on='direct'."
        )
    if rs_log_probs is None:
        return
    if layout.rs_on != "engine":
        raise ValueError("rs_log_probs is read only with rollout_rs_on='engine' (and RS on); it would be ignored.")
    if not isinstance(rs_log_probs, torch.Tensor) or not rs_log_probs.is_floating_point():
        raise TypeError(f"rs_log_probs must be a floating-point torch.Tensor (nats), got {type(rs_log_probs)}.")
    if rs_log_probs.shape != log_probs.shape or rs_log_probs.device != log_probs.device:
        raise ValueError(f"rs_log_probs must be (B, T) like log_probs {tuple(log_probs.shape)} on {log_probs.device}, "
                         f"got {tuple(rs_log_probs.shape)} on {rs_log_probs.device}.")


# ---------------------------------------------------------------------- one signature, eager or compiled
_COMPILED: dict = {}


def compiled_rollout_correction(
    config: "RolloutCorrectionConfig", *, length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS, **compile_kwargs
) -> CorrectionFn:
    """``compute_rollout_correction`` for one config, compiled with ``torch.compile`` (inductor).

    Inductor fuses the ~40 (B, T) passes and ~150 small row-level operations of the eager function into a handful
    of loops (same results to float rounding; see ``benchmarks/RESULTS.md`` for the speed). The first call
    compiles (10-30 s on CPU); shapes are dynamic, so new (B, T) do not recompile. Compiled functions are cached
    per (config, length_buckets, compile options).

    Args:
        config: a validated ``RolloutCorrectionConfig``.
        length_buckets: as ``compute_rollout_correction``.
        **compile_kwargs: passed to ``torch.compile`` (default ``dynamic=True``).

    Returns:
        ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None, rs_log_probs=None) ->
        RolloutCorrectionOutput``.
    """
    compile_kwargs.setdefault("dynamic", True)
    key = (repr(config.to_dict()), tuple(length_buckets), repr(sorted(compile_kwargs.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_bound(MetricLayout.from_config(config, length_buckets)), **compile_kwargs)
    return _COMPILED[key]


def make_correction_fn(
    config: "RolloutCorrectionConfig", *, compile: bool = False,
    length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
) -> CorrectionFn:
    """The correction for one config as ``fn(log_probs, rollout_log_probs, response_mask, all_reduce=None,
    rs_log_probs=None)`` (``rs_log_probs``: as ``compute_rollout_correction``).

    Args:
        config: a validated ``RolloutCorrectionConfig``.
        compile: run it through ``torch.compile`` (``compiled_rollout_correction``: same values, faster on large
            batches; the first call compiles).
        length_buckets: as ``compute_rollout_correction``.

    Returns:
        A callable returning ``RolloutCorrectionOutput``: the one signature the trainer and the losses use. The
        layout is built once, so a call costs what ``compute_rollout_correction`` costs minus that.
    """
    if compile:
        return compiled_rollout_correction(config, length_buckets=length_buckets)
    return _bound(MetricLayout.from_config(config, length_buckets))


def _bound(layout: MetricLayout) -> CorrectionFn:
    def correction_fn(log_probs, rollout_log_probs, response_mask, all_reduce=None, rs_log_probs=None):
        _check_inputs(log_probs, rollout_log_probs, response_mask)
        _check_rs_log_probs(layout, rs_log_probs, log_probs)
        return _correct(log_probs, rollout_log_probs, response_mask, layout, all_reduce, rs_log_probs)

    return correction_fn
