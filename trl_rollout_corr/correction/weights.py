"""Importance-sampling (IS) weights and their ``rollout_corr/rollout_is_*`` metrics.

Token level: ``R_t = exp(clamp(l_t, -20, 20))``. Sequence level: ``R_i = exp(clamp(S_i, -20, 20))`` with ``S_i``
the row's sum of l over valid tokens, summed in log space (never overflows), broadcast to the row. A threshold
``U`` truncates (TIS: ``W = min(R, U)``); a band ``[L, U]`` zeroes weights outside it (IcePop: ``W = R`` inside,
inclusive). Optional batch normalisation divides W by its global-batch mean (token level: over valid tokens;
sequence level: over valid rows), after truncation, not re-truncated, skipped when the mean is <= 1e-8.
Weights are 0 at padding and 1 (neutral) at invalid tokens.

Sources: truncated IS (TIS) from Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025); IcePop from the Ring-1T report (2025); metric names and semantics from verl's
``rollout_corr_helper`` (0.9.x). ESS is the Kish fraction over valid tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from .reduce import RowTable
from .stats import Kind, StatView, div, ess, exp_or_zero, max_or_zero, min_or_zero, pop_std, stat_name, unbiased_std
from .workspace import SAFETY_BOUND, Workspace, host_checks_allowed, mask_float

AllReduce = Callable[[torch.Tensor], torch.Tensor]
BATCH_NORM_EPS = 1e-8  # a batch-normalisation mean at or below this is not divided by (factor 1)

# Statistics of this family (base names; see stats.stat_name for the stored names)
HIGH, LOW = "is_high", "is_low"  # tokens (token IS) / rows (sequence IS) with R above U / below L
X = "is_x"  # token TIS: max/min of x over valid tokens (W extrema follow, min(exp(x), U) is monotone)
W = "is_w"  # per-row sums of W and W^2 (token-weighted at both levels; also per length bucket); IcePop extrema
OOB = "is_oob"  # sequence IcePop: tokens of rows outside the band
R_RAW = "is_r"  # token-weighted sums of the untruncated R and R^2 (raw ESS)
LOGW = "is_logw"  # sequence IS: max/min of S_i (the reported extrema are the raw sequence ratios)
SEQ = "is_seq"  # per-row mean of W
SEQ_R = "is_seq_r"  # per-row mean raw ratio (row fractions above U / below L)
SEQ_HIGH, SEQ_LOW = "is_seq_high", "is_seq_low"


def importance_weights(ws: Workspace, layout, rows: RowTable, all_reduce: Optional[AllReduce]) -> torch.Tensor:
    """(B, T) float32 IS weights (0 at padding, 1 at invalid tokens); registers this family's statistics.

    Args:
        ws: the call's workspace (its ratio is taken for token TIS, which clamps it in place).
        layout: the ``MetricLayout`` (``is_level``, ``is_bounds``, ``is_batch_normalize``).
        rows: the call's row table.
        all_reduce: cross-rank sum of a small 1-D tensor (batch normalisation only); None on one process.
    """
    if layout.is_level == "token":
        w, row_mean_w, row_mean_r, batch_total = _token_weights(ws, layout, rows)
    else:
        w, row_mean_w, row_mean_r, batch_total = _sequence_weights(ws, layout, rows)
    upper, lower_m = layout.is_bounds.upper, layout.is_bounds.lower_or_reciprocal
    rows.add(SEQ, row_mean_w, Kind.SUM, Kind.SQ, Kind.MAX, Kind.MIN)
    rows.add(SEQ_R, row_mean_r, gt=(SEQ_HIGH, upper), lt=(SEQ_LOW, lower_m))
    if layout.is_batch_normalize:
        total = torch.stack(batch_total)
        if all_reduce is not None:
            total = all_reduce(total)
        mean = total[0] / total[1].clamp(min=1)
        factor = torch.where(mean > BATCH_NORM_EPS, mean, torch.ones_like(mean))
        w = w.div_(factor.float()) if layout.is_level == "token" else w / factor  # token: w is our own tensor
    if layout.is_level == "sequence":
        w = torch.mul(ws.valid, w.float().unsqueeze(-1))
    # 0 at padding (w is 0 there); the neutral weight 1 at invalid tokens (mask 1, NaN/inf log-prob): + (mask - valid)
    if host_checks_allowed(w) and torch.equal(ws.n_masked, ws.n_row):
        return w  # no invalid token: skips three (B, T) passes
    return w.add_(torch.sub(mask_float(ws.response_mask, ws.scratch), ws.valid, out=ws.scratch))


def _token_weights(ws: Workspace, layout, rows: RowTable):
    """Token TIS / IcePop weights (B, T), row means of W and R, and the batch-normalisation (sum, count)."""
    bounds = layout.is_bounds
    upper, lower = bounds.upper, bounds.lower
    rows.add(HIGH, _count_valid(ws.ratio, ">", upper, ws), Kind.SUM)  # ratio is 0 off valid
    rows.add(LOW, _count_valid(ws.ratio, "<", bounds.lower_or_reciprocal, ws), Kind.SUM)
    if bounds.is_icepop:  # W = R inside [L, U], 0 outside (a new tensor; R is kept)
        w = torch.ge(ws.ratio, lower, out=torch.empty_like(ws.ratio))
        w.mul_(torch.le(ws.ratio, upper, out=ws.scratch)).mul_(ws.ratio)
    else:  # TIS, in place on the ratio buffer, which this call now owns
        rows.add(X, ws.x_max_rows, Kind.MAX)
        rows.add(X, ws.x_min_rows, Kind.MIN)
        w = ws.take_ratio().clamp_(max=upper)
    row_w, w_sq = ws.row_moments(w)
    rows.add(W, row_w, Kind.SUM, bucket=True)  # per-row sums of W and W^2 (also for the length slices)
    rows.add_sq(W, w_sq, bucket=True)
    if bounds.is_icepop:  # W >= 0 and 0 off valid
        rows.add(W, w.amax(-1) if w.numel() else row_w, Kind.MAX)
        rows.add(W, ws.valid_min_rows(w) if w.numel() else row_w, Kind.MIN)
    row_r = ws.n_row64 + ws.e_row  # sum R = n + sum E, sum R^2 = n + 2 sum E + sum E^2 (E = R - 1)
    rows.add(R_RAW, row_r, Kind.SUM)
    rows.add(stat_name(R_RAW, Kind.SQ), ws.n_row64 + 2.0 * ws.e_row + ws.e2_row, Kind.SUM)
    row_mean_r = row_r / ws.n1_64
    return w, w_sq[1], row_mean_r, (row_w.sum(), ws.n_row64.sum())


def _sequence_weights(ws: Workspace, layout, rows: RowTable):
    """Per-row sequence weights (B,) float64, row means of W and R, and the batch-normalisation (sum, count)."""
    bounds = layout.is_bounds
    upper, lower = bounds.upper, bounds.lower
    nd = ws.n_row64
    seq_ratio = torch.exp(ws.seq_l.clamp(-SAFETY_BOUND, SAFETY_BOUND))  # (B,) float64
    if bounds.is_icepop:
        seq_w = torch.where((seq_ratio >= lower) & (seq_ratio <= upper), seq_ratio, 0.0)
        rows.add(OOB, (seq_ratio < lower) | (seq_ratio > upper), Kind.WSUM)
    else:
        seq_w = seq_ratio.clamp(max=upper)
    # token-weighted sums of W and W^2 and of R and R^2 (read back as v.sum / v.sq of W and R_RAW)
    rows.add(W, nd * seq_w, Kind.SUM, bucket=True)
    rows.add(stat_name(W, Kind.SQ), nd * seq_w * seq_w, Kind.SUM, bucket=True)
    rows.add(R_RAW, nd * seq_ratio, Kind.SUM)
    rows.add(stat_name(R_RAW, Kind.SQ), nd * seq_ratio * seq_ratio, Kind.SUM)
    log_lower = math.log(bounds.lower_or_reciprocal)
    rows.add(LOGW, ws.seq_l, Kind.MAX, Kind.MIN, gt=(HIGH, math.log(upper)), lt=(LOW, log_lower))
    valid_w = torch.where(ws.row_valid, seq_w, 0.0)
    return seq_w, seq_w, seq_ratio, (valid_w.sum(), ws.row_valid.sum().double())


def _count_valid(t: torch.Tensor, op: str, threshold: float, ws: Workspace) -> torch.Tensor:
    """(B,) number of valid tokens with ``t > threshold`` / ``t < threshold`` for a zero-off-valid ``t``: where
    the comparison holds at 0, the off-valid tokens (exactly T - n per row) are subtracted (uses ``scratch``)."""
    hit = (torch.gt if op == ">" else torch.lt)(t, threshold, out=ws.scratch).sum(-1)
    if (0.0 > threshold) if op == ">" else (0.0 < threshold):
        return hit.sub_(t.shape[-1]).add_(ws.n_row)
    return hit


# ---------------------------------------------------------------------- metrics
def finalize(v: StatView, layout, n_tok: float, n_seq: float) -> dict[str, float]:
    """The ``rollout_is_*`` metrics (verl's names) from merged statistics.

    Args:
        v: the merged statistics. layout: the ``MetricLayout``. n_tok, n_seq: valid tokens / valid rows.
    """
    level, bounds = layout.is_level, layout.is_bounds
    upper = bounds.upper
    sum_w, sum_w2 = v.sum(W), v.sq(W)
    sum_r, sum_r2 = v.sum(R_RAW), v.sq(R_RAW)
    m: dict[str, float] = {}
    if level == "token":
        if bounds.is_icepop:
            w_max, w_min = max_or_zero(v.max(W)), min_or_zero(v.min(W))
        else:  # min(exp(x), U) is monotone in x
            w_max = min(exp_or_zero(v.max(X)), upper) if n_tok > 0 else 0.0
            w_min = min(exp_or_zero(v.min(X)), upper) if n_tok > 0 else 0.0
        den = n_tok
    else:
        w_max = min(exp_or_zero(v.max(LOGW)), math.exp(SAFETY_BOUND)) if n_seq > 0 else 0.0
        w_min = exp_or_zero(v.min(LOGW)) if n_seq > 0 else 0.0
        den = n_seq
    m["rollout_is_mean"] = div(sum_w, n_tok)
    m["rollout_is_max"] = w_max
    m["rollout_is_min"] = w_min
    m["rollout_is_ratio_fraction_high"] = div(v.count(HIGH), den)
    m["rollout_is_ratio_fraction_low"] = div(v.count(LOW), den)
    m["rollout_is_std"] = pop_std(sum_w, sum_w2, n_tok)
    m["rollout_is_eff_sample_size"] = ess(sum_w, sum_w2, n_tok)
    m["rollout_is_eff_sample_size_raw"] = ess(sum_r, sum_r2, n_tok)
    m["rollout_is_seq_mean"] = div(v.sum(SEQ), n_seq)
    m["rollout_is_seq_std"] = unbiased_std(v.sum(SEQ), v.sq(SEQ), n_seq)
    seq_max, seq_min = max_or_zero(v.max(SEQ)), min_or_zero(v.min(SEQ))
    m["rollout_is_seq_max"] = seq_max
    m["rollout_is_seq_min"] = seq_min
    m["rollout_is_seq_max_deviation"] = max(abs(seq_max - 1.0), abs(seq_min - 1.0)) if n_seq > 0 else 0.0
    m["rollout_is_seq_fraction_high"] = div(v.count(SEQ_HIGH), n_seq)
    m["rollout_is_seq_fraction_low"] = div(v.count(SEQ_LOW), n_seq)
    if layout.is_batch_normalize:
        mean = div(sum_w, n_tok) if level == "token" else div(v.sum(SEQ), n_seq)
        m["rollout_is_batch_norm_factor"] = mean if mean > BATCH_NORM_EPS else 1.0
    if bounds.is_icepop:
        oob = v.count(HIGH) + v.count(LOW) if level == "token" else v.sum(OOB)
        m["rollout_is_oob_ratio"] = div(oob, n_tok)
    return m


def finalize_bucket(v: StatView, j: int, n_j: float) -> dict[str, float]:
    """``len_{lo}_{hi}/is_eff_sample_size`` of length bucket ``j`` (n_j valid tokens)."""
    return {"is_eff_sample_size": ess(v.sum(W, j), v.sq(W, j), n_j)}
