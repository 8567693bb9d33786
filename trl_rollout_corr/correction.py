"""Rollout correction: importance-sampling (IS) weights and rejection-sampling (RS) masks.

Pure functions on ``(B, T)`` tensors; nothing here knows TRL or ``torch.distributed`` (a cross-rank sum is
passed in as a callable). The behaviour is specified in the project's ``ROLLOUT_CORRECTION.md`` and follows
verl's ``algorithm.rollout_correction`` (0.9.x) except where that spec marks a deliberate difference:

* k1 rejection bands keep the ratio band the user wrote (verl keeps ``[1/U, 1/L]``);
* rows without a valid token are never counted in per-sequence metrics (verl averages them in);
* NaN/inf log-probs at valid tokens make the token invalid (removed from the mask, weight 1, counted),
  instead of propagating NaN into weights, metrics and gradients;
* an all-zero IcePop batch gives ESS 0 instead of a ``ZeroDivisionError``;
* an empty batch (no valid token) is not an error: weights/mask are returned, metrics are 0 with counts.

Sources: truncated IS (TIS) from Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (2025); IcePop from the Ring-1T report (2025); k1/k2/k3 estimators from J. Schulman,
"Approximating KL Divergence" (2020); the mode split (decoupled/bypass) from verl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .config import RolloutCorrectionConfig, RSSpec
from .metrics import CorrectionStats

SAFETY_BOUND = 20.0  # |log ratio| clamp before exponentiation, in nats (as verl)
AllReduce = Callable[[torch.Tensor], torch.Tensor]


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


# ---------------------------------------------------------------------- input handling
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
    for name, t in (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs), ("response_mask", response_mask)):
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
    for name, t in (("log_probs", log_probs), ("rollout_log_probs", rollout_log_probs)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (nats), got {t.dtype}.")
    if log_probs.device != rollout_log_probs.device or log_probs.device != response_mask.device:
        raise ValueError(
            f"Tensors are on different devices: log_probs {log_probs.device}, rollout_log_probs "
            f"{rollout_log_probs.device}, response_mask {response_mask.device}."
        )


# A note on speed: every per-token quantity below is built so that it is exactly 0 outside the valid
# tokens (x = clamp(l) is 0 there, so are expm1(x), k1, k2, k3 and min(expm1(x), U - 1) for U >= 1).
# Masked sums then need no mask pass, and weights/ratios are carried as "value - offset" with the
# offset added back analytically (sum W = sum (W - c) + c N), which keeps float32 sums precise.
@dataclass
class _Prepared:
    """Cleaned per-token quantities shared by IS, RS and the metrics (all (B, T) unless noted)."""

    mask: torch.Tensor  # bool: mask 1
    fin: torch.Tensor  # bool: the log ratio is finite (both log-probs finite)
    valid: torch.Tensor  # bool: mask & fin
    l: torch.Tensor  # float32 log ratio, 0 outside valid
    x: torch.Tensor  # clamp(l, -20, 20), 0 outside valid
    e1: torch.Tensor  # expm1(x) = R - 1, 0 outside valid
    n_row: torch.Tensor  # (B,) float32 valid tokens per row
    row_valid: torch.Tensor  # (B,) bool
    seq_l: torch.Tensor  # (B,) float32 sum of l over valid tokens (unclamped)
    rollout_row_sum: torch.Tensor  # (B,) float32 sum of log mu over valid tokens
    n_tok: torch.Tensor  # 0-d float64
    n_masked: torch.Tensor  # 0-d float64, tokens with mask 1
    _x_range: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    _scratch: Optional[torch.Tensor] = None
    _e1_sq: Optional[torch.Tensor] = None

    def sq_sum(self, t: torch.Tensor) -> torch.Tensor:
        """float64 0-d sum of t**2 (row sums first, for precision), through one reused scratch buffer."""
        if self._scratch is None:
            self._scratch = torch.empty_like(self.x)
        return _d(torch.mul(t, t, out=self._scratch).sum(-1))

    def e1_sq_sum(self) -> torch.Tensor:
        """Sum of expm1(x)**2 over valid tokens (cached: used by IS and chi2)."""
        if self._e1_sq is None:
            self._e1_sq = self.sq_sum(self.e1)
        return self._e1_sq

    def x_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(max, min) of x over valid tokens as float64 0-d tensors (-inf/+inf when empty); cached."""
        if self._x_range is None:
            self._x_range = (_max(torch.where(self.valid, self.x, -math.inf)), _min(torch.where(self.valid, self.x, math.inf)))
        return self._x_range


def _prepare(log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> _Prepared:
    lp = log_probs.detach().float()
    rlp = rollout_log_probs.detach().float()
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    diff = lp - rlp
    fin = diff.abs() < math.inf  # False for NaN and +-inf in either input (or a float32 overflow)
    valid = mask & fin
    l = torch.where(valid, diff, 0.0)
    x = l.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    n_row = torch.count_nonzero(valid, dim=-1).float()
    return _Prepared(
        mask=mask,
        fin=fin,
        valid=valid,
        l=l,
        x=x,
        e1=torch.expm1(x),
        n_row=n_row,
        row_valid=n_row > 0,
        seq_l=l.sum(-1),
        rollout_row_sum=torch.where(valid, rlp, 0.0).sum(-1),
        n_tok=n_row.double().sum(),
        n_masked=_count(mask),
    )


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.double().sum()


def _count(t: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Number of True entries of a bool tensor (float64; per row with ``dim``)."""
    return torch.count_nonzero(t, dim=dim).double()


def _max(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.tensor(-math.inf, dtype=torch.float64, device=t.device)
    return t.amax().double()


def _min(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.tensor(math.inf, dtype=torch.float64, device=t.device)
    return t.amin().double()


def _valid_where(cond: torch.Tensor, zero_satisfies: bool, p: _Prepared) -> torch.Tensor:
    """Restrict a per-token condition to valid tokens; free when the condition is False at 0 (the value
    every zero-off-valid quantity has outside the valid tokens)."""
    return cond & p.valid if zero_satisfies else cond


def _compare_valid(t: torch.Tensor, op: str, threshold: float, p: _Prepared) -> torch.Tensor:
    """(B, T) bool: ``t > threshold`` or ``t < threshold`` at valid tokens, for a zero-off-valid ``t``."""
    if op == ">":
        return _valid_where(t > threshold, 0.0 > threshold, p)
    return _valid_where(t < threshold, 0.0 < threshold, p)


def _seq_stats(store: CorrectionStats, prefix: str, values: torch.Tensor, row_valid: torch.Tensor) -> None:
    """Sum, sum of squares, max and min of a per-row value over valid rows."""
    v = values.double()
    kept = torch.where(row_valid, v, 0.0)
    store.sums[prefix] = kept.sum()
    store.sums[prefix + "2"] = (kept * kept).sum()
    store.maxs[prefix + "_max"] = _max(torch.where(row_valid, v, -math.inf))
    store.mins[prefix + "_min"] = _min(torch.where(row_valid, v, math.inf))


def _zero(device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


# ---------------------------------------------------------------------- IS weights
def _token_weights_shifted(p: _Prepared, upper: float, lower: Optional[float]) -> tuple[torch.Tensor, float]:
    """Token weights as ``(W - c, c)``: a zero-off-valid tensor and the offset c added back at valid tokens."""
    if lower is not None:  # IcePop: W = R inside [L, U], 0 outside
        ratio = p.e1 + 1.0
        return torch.where(p.valid & (ratio >= lower) & (ratio <= upper), ratio, 0.0), 0.0
    shifted = p.e1.clamp(max=upper - 1.0)  # min(R, U) - 1
    if upper < 1.0:  # then min(R, U) - 1 is not 0 outside the valid tokens
        shifted = torch.where(p.valid, shifted, 0.0)
    return shifted, 1.0


def _importance_weights(p: _Prepared, config: RolloutCorrectionConfig, stats: CorrectionStats, all_reduce: Optional[AllReduce]) -> torch.Tensor:
    """(B, T) IS weights: 0 at padding, 1 at invalid tokens; fills the ``is_*`` statistics."""
    bounds = config.is_bounds
    upper, lower = bounds.upper, bounds.lower
    lower_m = lower if lower is not None else 1.0 / upper
    s = stats.sums
    n, nd = p.n_tok, p.n_row.double()
    if config.rollout_is == "token":
        w_shift, c = _token_weights_shifted(p, upper, lower)
        row_ws = w_shift.sum(-1).double()
        row_e1 = p.e1.sum(-1).double()
        s["is_w"] = row_ws.sum() + c * n
        s["is_w2"] = p.sq_sum(w_shift) + 2 * c * row_ws.sum() + c * c * n
        s["is_r"] = row_e1.sum() + n
        s["is_r2"] = p.e1_sq_sum() + 2 * row_e1.sum() + n
        s["is_ratio_high"] = _count(_compare_valid(p.e1, ">", upper - 1.0, p))
        s["is_ratio_low"] = _count(_compare_valid(p.e1, "<", lower_m - 1.0, p))
        if bounds.is_icepop:
            s["is_oob"] = s["is_ratio_high"] + s["is_ratio_low"]  # lower_m == lower for IcePop
            stats.maxs["is_w_max"] = _max(w_shift)  # W >= 0 and 0 outside valid tokens
            stats.mins["is_w_min"] = _min(torch.where(p.valid, w_shift, math.inf))
        else:  # min(exp(x), U) is monotone in x: the extrema follow from those of x
            x_max, x_min = p.x_range()
            stats.maxs["is_w_max"] = x_max.exp().clamp(max=upper)  # empty: exp(-inf) = 0, reported as 0
            stats.mins["is_w_min"] = torch.where(torch.isinf(x_min), x_min, x_min.exp().clamp(max=upper))
        rows = p.n_row.clamp(min=1).double()
        row_mean_w = (row_ws + c * nd) / rows
        row_mean_r = (row_e1 + nd) / rows
    else:
        seq_ratio = torch.exp(p.seq_l.clamp(-SAFETY_BOUND, SAFETY_BOUND)).double()  # (B,)
        if bounds.is_icepop:
            seq_w = torch.where((seq_ratio >= lower) & (seq_ratio <= upper), seq_ratio, 0.0)
        else:
            seq_w = seq_ratio.clamp(max=upper)
        seq_w = torch.where(p.row_valid, seq_w, 0.0)
        seq_ratio_v = torch.where(p.row_valid, seq_ratio, 0.0)
        s["is_w"] = (nd * seq_w).sum()
        s["is_w2"] = (nd * seq_w * seq_w).sum()
        s["is_r"] = (nd * seq_ratio_v).sum()
        s["is_r2"] = (nd * seq_ratio_v * seq_ratio_v).sum()
        log_u, log_l = math.log(upper), math.log(lower_m)
        s["is_ratio_high"] = _count(p.row_valid & (p.seq_l > log_u))
        s["is_ratio_low"] = _count(p.row_valid & (p.seq_l < log_l))
        stats.maxs["is_logw_max"] = _max(torch.where(p.row_valid, p.seq_l, -math.inf))
        stats.mins["is_logw_min"] = _min(torch.where(p.row_valid, p.seq_l, math.inf))
        if bounds.is_icepop:
            s["is_oob"] = (nd * (p.row_valid & ((seq_ratio < lower) | (seq_ratio > upper))).double()).sum()
        row_mean_w, row_mean_r = seq_w, seq_ratio_v
    _seq_stats(stats, "is_seq", row_mean_w, p.row_valid)
    s["is_seq_high"] = _count(p.row_valid & (row_mean_r > upper))
    s["is_seq_low"] = _count(p.row_valid & (row_mean_r < lower_m))

    factor = None
    if config.rollout_is_batch_normalize:
        if config.rollout_is == "token":
            total = torch.stack([s["is_w"], n])
        else:
            total = torch.stack([s["is_seq"], _count(p.row_valid)])
        if all_reduce is not None:
            total = all_reduce(total)
        mean = total[0] / total[1].clamp(min=1)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean)).float()
    # 0 at padding; the neutral weight 1 at invalid tokens (mask 1, NaN/inf log-prob).
    outside = (p.mask & ~p.fin).float()
    if config.rollout_is == "token":
        values = w_shift.add_(c) if c else w_shift  # in place: w_shift is not used after this
        if factor is not None:
            values = values.div_(factor)
    else:
        values = seq_w.float().unsqueeze(-1)
        if factor is not None:
            values = values / factor
    return torch.where(p.valid, values, outside)


# ---------------------------------------------------------------------- RS masks
def _token_statistic(stat: str, p: _Prepared) -> torch.Tensor:
    """(B, T) k1/k2/k3 per token from x = clamp(l); 0 outside valid tokens."""
    if stat == "k1":
        return -p.x
    if stat == "k2":
        return 0.5 * p.x * p.x
    return p.e1 - p.x  # k3 = exp(x) - 1 - x; expm1 keeps it accurate for small x


def _rejection_keep(p: _Prepared, specs: Sequence[RSSpec], stats: CorrectionStats, token_stats: dict) -> torch.Tensor:
    """Returns the (B, T) bool keep mask over valid tokens, combining every option (logical AND)."""
    s = stats.sums
    keep = p.valid
    keep_row = p.row_valid
    rows = p.n_row.clamp(min=1)
    nd = p.n_row.double()
    for spec in specs:
        pre = f"rollout_rs_{spec.option}_"
        lo, hi = spec.stat_bounds
        clamp_lo = lo if lo is not None else 0.0
        t = token_stats[spec.stat]
        if spec.is_token_level:
            high = _compare_valid(t, ">", hi, p)
            low = _compare_valid(t, "<", lo, p) if lo is not None else None
            rejected = high | low if low is not None else high
            keep = keep & ~rejected
            clamped = t.clamp(clamp_lo, hi)
            if not clamp_lo <= 0.0 <= hi:
                clamped = torch.where(p.valid, clamped, 0.0)
            row_sum = t.sum(-1)
            s[pre + "sum"] = _d(row_sum)
            s[pre + "csum"] = _d(clamped.sum(-1))
            s[pre + "csum2"] = p.sq_sum(clamped)
            if spec.stat == "k1":  # k1 = -x: extrema from those of x
                x_max, x_min = p.x_range()
                stats.maxs[pre + "max"] = -x_min
                stats.mins[pre + "min"] = -x_max
            else:
                stats.maxs[pre + "max"] = _max(t)  # k2, k3 >= 0 and 0 outside valid tokens
                stats.mins[pre + "min"] = _min(torch.where(p.valid, t, math.inf))
            s[pre + "high"] = _count(high)
            s[pre + "low"] = _count(low) if low is not None else _zero(t.device)
            s[pre + "rejected"] = s[pre + "high"] + s[pre + "low"]
            s[pre + "rejected_seqs"] = _count(rejected.any(-1))
            row_values = row_sum / rows
        else:
            if spec.level == "seq_sum":
                row_values = t.sum(-1)
            elif spec.level == "seq_mean":
                row_values = t.sum(-1) / rows
            else:  # seq_max (k2/k3 only, >= 0, so padding zeros never win over a valid token)
                row_values = t.amax(-1) if t.numel() else t.sum(-1)
            row_values = torch.where(p.row_valid, row_values, 0.0)
            rv = row_values.double()
            high = p.row_valid & (row_values > hi)
            low = (p.row_valid & (row_values < lo)) if lo is not None else None
            in_band = row_values <= hi
            if lo is not None:
                in_band = in_band & (row_values >= lo)
            bad = p.row_valid & ~in_band  # a NaN statistic is never in band: rejected
            keep_row = keep_row & ~bad
            s[pre + "sum"] = (nd * rv).sum()
            c = rv.clamp(clamp_lo, hi)
            s[pre + "csum"] = (nd * c).sum()
            s[pre + "csum2"] = (nd * c * c).sum()
            stats.maxs[pre + "max"] = _max(torch.where(p.row_valid, rv, -math.inf))
            stats.mins[pre + "min"] = _min(torch.where(p.row_valid, rv, math.inf))
            s[pre + "high"] = _count(high)
            s[pre + "low"] = _count(low) if low is not None else _zero(rv.device)
            s[pre + "rejected"] = (nd * bad.double()).sum()
            s[pre + "rejected_seqs"] = _count(bad)
        _seq_stats(stats, pre + "seq", row_values, p.row_valid)
        s[pre + "seq_high"] = _count(p.row_valid & (row_values > hi))
        s[pre + "seq_low"] = _count(p.row_valid & (row_values < lo)) if lo is not None else _zero(row_values.device)
    if any(not spec.is_token_level for spec in specs):
        keep = keep & keep_row.unsqueeze(-1)
    kept_per_row = _count(keep, dim=-1)
    s["rs_rejected"] = p.n_tok - kept_per_row.sum()
    s["rs_rejected_seqs"] = _count(p.row_valid & (kept_per_row < p.n_row.double()))
    return keep


# ---------------------------------------------------------------------- entry point
def compute_rollout_correction(
    log_probs: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    config: RolloutCorrectionConfig,
    *,
    all_reduce: Optional[AllReduce] = None,
) -> RolloutCorrectionOutput:
    """IS weights, RS mask and reducible ``rollout_corr/*`` statistics for one batch.

    Args:
        log_probs: (B, T) log-probs of the sampled tokens under the training policy, in nats: pi_old
            (``old_log_probs``) in decoupled mode, pi_theta (``log_probs``, detached here) in bypass mode.
            bf16/fp16 are upcast to float32.
        rollout_log_probs: (B, T) behaviour log-probs mu from the rollout engine, in nats.
        response_mask: (B, T) 0/1 (bool, int or float) completion mask.
        config: a validated ``RolloutCorrectionConfig``.
        all_reduce: optional callable summing a small 1-D tensor across ranks, used only for batch
            normalisation so that it divides by the global-batch mean. None: this batch is the global batch.

    Returns:
        ``RolloutCorrectionOutput`` with ``weights`` ((B, T) float32 or None), ``response_mask`` (RS and
        invalid tokens removed) and ``stats`` (``.metrics`` finalises them).

    Raises:
        ValueError: ``rollout_log_probs`` is None (names the fix), shapes differ, tensors are not 2-D or on
            different devices.
        TypeError: non-tensor or non-float log-probs.

    Tokens whose log-probs are NaN or +-inf where the mask is 1 are *invalid*: they are removed from the
    mask, get weight 1, take no part in sequence sums, means or metrics, and are counted in
    ``rollout_corr/invalid_token_fraction``. NaN/inf at padding is ignored.
    """
    _check_inputs(log_probs, rollout_log_probs, response_mask)
    p = _prepare(log_probs, rollout_log_probs, response_mask)
    stats = CorrectionStats()
    s = stats.sums
    s["n_tok"] = p.n_tok
    s["n_seq"] = _count(p.row_valid)
    s["n_masked"] = p.n_masked
    s["n_invalid"] = p.n_masked - p.n_tok

    weights = _importance_weights(p, config, stats, all_reduce) if config.is_enabled else None

    token_stats = {stat: _token_statistic(stat, p) for stat in {spec.stat for spec in config.rs_specs} | {"k3"}}
    keep = _rejection_keep(p, config.rs_specs, stats, token_stats) if config.rs_enabled else p.valid

    _offpolicy_stats(p, stats, token_stats["k3"])
    stats.layout = _layout(config)
    return RolloutCorrectionOutput(weights=weights, response_mask=keep.to(response_mask.dtype), stats=stats)


def _offpolicy_stats(p: _Prepared, stats: CorrectionStats, k3: torch.Tensor) -> None:
    s = stats.sums
    s["l"] = _d(p.seq_l)
    s["k3"] = _d(k3.sum(-1))  # k3 is 0 outside valid tokens
    s["r2"] = p.e1_sq_sum() + 2 * _d(p.e1.sum(-1)) + p.n_tok  # sum of R^2 = (1 + e1)^2
    n = p.n_row.double().clamp(min=1)
    rv_mask = p.row_valid
    mean_roll = p.rollout_row_sum.double() / n  # mean log mu per row
    mean_l = p.seq_l.double() / n
    mean_train = mean_roll + mean_l  # mean log pi_train per row
    d = -mean_l  # mean(log mu - log pi_train) per row
    zero = torch.zeros_like(d)

    def over_rows(v: torch.Tensor) -> torch.Tensor:
        return torch.where(rv_mask, v, zero).sum()

    s["train_log_ppl"] = over_rows(-mean_train)
    s["train_ppl"] = over_rows(torch.exp((-mean_train).clamp(max=700.0)))
    s["roll_log_ppl"] = over_rows(-mean_roll)
    s["roll_ppl"] = over_rows(torch.exp((-mean_roll).clamp(max=700.0)))
    s["d"] = over_rows(d)
    s["abs_d"] = over_rows(d.abs())
    s["exp_d"] = over_rows(torch.exp(d.clamp(max=700.0)))
    s["seq_r2"] = over_rows(torch.exp(2.0 * p.seq_l.double().clamp(-SAFETY_BOUND, SAFETY_BOUND)))
    stats.maxs["d_max"] = _max(torch.where(rv_mask, d, -math.inf))
    stats.mins["d_min"] = _min(torch.where(rv_mask, d, math.inf))


def _layout(config: RolloutCorrectionConfig) -> tuple:
    items = []
    if config.is_enabled:
        b = config.is_bounds
        lower_m = b.lower if b.lower is not None else 1.0 / b.upper
        items.append(("is", (config.rollout_is, b.upper, lower_m, b.is_icepop, config.rollout_is_batch_normalize)))
    if config.rs_enabled:
        items.append(("rs", tuple((sp.option, sp.stat, sp.is_token_level, *sp.stat_bounds) for sp in config.rs_specs)))
    return tuple(items)


def rollout_log_probs_to_tensor(
    per_row: Sequence[Optional[Sequence[Optional[float]]]], completion_mask: torch.Tensor
) -> torch.Tensor:
    """Lay per-row behaviour log-probs from a rollout engine out as a (B, T) tensor aligned with the mask.

    Args:
        per_row: B sequences of per-token log-probs (nats), one per sampled completion token, in order.
            A ``None`` entry (engine returned no log-prob for that token) becomes NaN, i.e. an invalid
            token (see ``compute_rollout_correction``).
        completion_mask: (B, T) 0/1; row i must have exactly ``len(per_row[i])`` leading ones
            (the completion tokens, before padding).

    Returns:
        (B, T) float32 on the mask's device; NaN where the engine gave None, 0 at padding.

    Raises:
        ValueError: if B differs, a row is None, or a row's length differs from its completion length
            (the message names the row; nothing is padded or truncated silently).
    """
    if len(per_row) != completion_mask.shape[0]:
        raise ValueError(f"Got behaviour log-probs for {len(per_row)} rows but the batch has {completion_mask.shape[0]}.")
    lengths = (completion_mask != 0).sum(-1).tolist()
    out = torch.zeros(completion_mask.shape, dtype=torch.float32)
    for i, (row, n) in enumerate(zip(per_row, lengths)):
        if row is None:
            raise ValueError(f"Row {i}: the rollout engine returned no log-probs; request them (vLLM logprobs=0).")
        if len(row) != n:
            raise ValueError(
                f"Row {i}: {len(row)} behaviour log-probs for {n} completion tokens; the rollout engine's "
                "log-probs must align token for token with the completion (nothing is padded or truncated)."
            )
        if n:
            out[i, :n] = torch.tensor([float("nan") if v is None else float(v) for v in row], dtype=torch.float32)
    return out.to(completion_mask.device)


@dataclass
class RatioDecomposition:
    """Per-token log ratios between the three policies (all (B, T) float32, nats, 0 outside valid tokens).

    ``engine = log pi_old - log mu``, ``update = log pi_theta - log pi_old``, ``direct = log pi_theta - log mu``;
    ``direct == engine + update`` exactly where valid (computed that way). ``valid`` is the (B, T) bool mask
    of tokens where all three log-probs are finite and the mask is 1.
    """

    engine: torch.Tensor
    update: torch.Tensor
    direct: torch.Tensor
    valid: torch.Tensor


def ratio_decomposition(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> RatioDecomposition:
    """Split the direct ratio pi_theta / mu into the engine ratio pi_old / mu and the update ratio pi_theta / pi_old.

    Args:
        log_probs, old_log_probs, rollout_log_probs: (B, T) pi_theta, pi_old, mu in nats (any float dtype).
        response_mask: (B, T) 0/1.

    Returns:
        RatioDecomposition (log ratios; exponentiate for ratios).

    Raises:
        ValueError: if the shapes differ.
    """
    if not (log_probs.shape == old_log_probs.shape == rollout_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"Shapes differ: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"rollout_log_probs {tuple(rollout_log_probs.shape)}, response_mask {tuple(response_mask.shape)}."
        )
    lp, old, mu = (t.detach().float() for t in (log_probs, old_log_probs, rollout_log_probs))
    valid = (response_mask != 0) & torch.isfinite(lp) & torch.isfinite(old) & torch.isfinite(mu)
    engine = torch.where(valid, old - mu, 0.0)
    update = torch.where(valid, lp - old, 0.0)
    return RatioDecomposition(engine=engine, update=update, direct=engine + update, valid=valid)
