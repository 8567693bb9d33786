"""Rejection sampling (RS): the keep mask and its ``rollout_corr/rollout_rs_*`` metrics.

Per-token statistics of ``x = clamp(l, -20, 20)``: ``k1 = -x``, ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``
(J. Schulman, "Approximating KL Divergence", 2020). An option is a level and a statistic (``RS_OPTIONS``):
``token_*`` tests each valid token; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*`` test the row's sum / mean / max
over its valid tokens, and a failing row loses every token. k2/k3 keep ``stat <= U``; k1 keeps the ratio band the
user wrote, ``L <= r <= U`` on the token ratio, the row's product (``seq_sum``) or its geometric mean
(``seq_mean``) (deliberate difference: verl keeps ``[1/U, 1/L]``). Several options combine with AND; a NaN
statistic rejects. RS never changes IS weights. Metric names follow verl's ``rollout_corr_helper`` (0.9.x).

``token_binary_kl`` is KPop (``correction.binary_kl``): per token, ``max(KL(Ber(p) || Ber(q)), KL(Ber(q) ||
Ber(p)))`` of the sampled token's probabilities ``p = pi_train``, ``q = mu`` (nats, float64, from the log-probs, not
from x), kept when ``<= phi``; its metrics are those of a k2/k3 token option (``rollout_rs_token_binary_kl_*``).

To add a sequence level, add it to ``LEVELS`` (the statistics it supports), ``_ROW_VALUES`` (its per-row value) and
``_USES_TOKENS`` / ``_USES_ROW_SUMS`` (what it reads): config validation, the mask and the metrics follow.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .reduce import RowTable
from .stats import Kind, StatView, div, max_or_zero, min_or_zero, pop_std, unbiased_std
from .workspace import Workspace

# level -> the statistics it supports (seq_max of the signed k1 would let padding zeros win: not offered)
LEVELS = {
    "token": ("k1", "k2", "k3", "binary_kl"),
    "seq_sum": ("k1", "k2", "k3"),
    "seq_mean": ("k1", "k2", "k3"),
    "seq_max": ("k2", "k3"),
}
# option name -> (level, statistic); option names are "{level}_{stat}" (a statistic may contain "_")
RS_OPTION_PARTS = {f"{level}_{stat}": (level, stat) for level, stats in LEVELS.items() for stat in stats}
RS_OPTIONS = tuple(RS_OPTION_PARTS)

# per-row value of a sequence level, (B,) (k2, k3 >= 0 and 0 off valid: a row max needs no mask)
_ROW_VALUES = {
    "seq_sum": lambda ws, stat: ws.stat_row_sum(stat),
    "seq_mean": lambda ws, stat: ws.stat_row_sum(stat) / ws.n1,
    "seq_max": lambda ws, stat: _row_max(ws.token_stat(stat)),
}
# what each level reads from the workspace: the (B, T) k2/k3 tensor, and/or the row sums of the statistic
_USES_TOKENS = {"token", "seq_max"}
_USES_ROW_SUMS = {"token", "seq_sum", "seq_mean"}

# statistics shared by every option (per option they are prefixed "rollout_rs_{option}_")
KEPT = "rs_kept"  # kept tokens per row (also per length bucket)
# RS on the engine factor: the options' own statistics are over the tokens / rows with a finite engine factor
ENGINE_N_TOK, ENGINE_N_SEQ = "rs_engine_n_tok", "rs_engine_n_seq"
KEPT_MINUS_N = "rs_kept_minus_n"  # < 0 on rows that lost a token
REJECTED_SEQS = "rs_rejected_seqs"


def needs(specs: Sequence) -> dict[str, bool]:
    """The ``workspace.Needs`` flags these options require (k3 row sums are always prepared)."""
    flags = dict(x_range=False, k2_tokens=False, k3_tokens=False, k1_row_sum=False, k2_row_sum=False,
                 binary_kl_tokens=False)
    for spec in specs:
        tokens, row_sums = spec.level in _USES_TOKENS, spec.level in _USES_ROW_SUMS
        if spec.stat == "binary_kl":  # the (B, T) float64 statistic and its row sums, from the log-probs
            flags["binary_kl_tokens"] = True
        elif spec.stat == "k1":  # k1 = -x is never materialised: row sums of x, token extrema from those of x
            flags["k1_row_sum"] |= row_sums
            flags["x_range"] |= spec.is_token_level
        elif spec.stat == "k2":  # k2 row sums are summed from the k2 tensor
            flags["k2_tokens"] = True
            flags["k2_row_sum"] |= row_sums
        else:
            flags["k3_tokens"] |= tokens
    return flags


def row_values(ws: Workspace, level: str, stat: str) -> torch.Tensor:
    """(B,) the per-row value a sequence option ``{level}_{stat}`` tests (``seq_sum``/``seq_mean``: float64 row sum /
    mean of the statistic over valid tokens, k1 = -x; ``seq_max``: the row max). The workspace must hold what the
    option needs (``needs``)."""
    return _ROW_VALUES[level](ws, stat)


def rejection_mask(ws: Workspace, specs: Sequence, rows: RowTable,
                   n_row: Optional[torch.Tensor] = None, option_rows: Optional[RowTable] = None) -> torch.Tensor:
    """(B, T) float32 0/1 keep mask over valid tokens, every option combined (AND); registers the statistics.

    Args:
        ws: the workspace RS judges (its spare buffer becomes the mask).
        specs: the parsed options (``RSSpec``), in the user's order.
        rows: the call's row table: the combined statistics (kept tokens per row, rows that lost a token).
        n_row: (B,) float32 valid tokens per row of the correction (default ``ws.n_row``). RS on the engine factor
            passes the first workspace's: a token valid there without a finite engine factor is rejected by RS, and
            its row counts as one RS masked (``rs_rejected_seqs``).
        option_rows: the row table of each option's own statistics (default ``rows``). RS on the engine factor
            passes one over ``ws``'s rows (``RowTable(ws.n_row64)``), so that a row with no finite engine factor is
            no row of the options' statistics (it is not a 0 in their row mean, minimum, ...); the tokens and rows
            of those statistics are then registered as ``ENGINE_N_TOK`` / ``ENGINE_N_SEQ`` there.
    """
    keep: Optional[torch.Tensor] = None
    keep_row: Optional[torch.Tensor] = None
    opt_rows = rows if option_rows is None else option_rows
    if option_rows is not None:
        option_rows.add(ENGINE_N_TOK, ws.n_row, Kind.SUM)
        option_rows.add(ENGINE_N_SEQ, ws.row_valid, Kind.SUM)
    for spec in specs:
        if spec.is_token_level:
            keep = _token_option(ws, spec, opt_rows, keep)
        else:
            bad = _sequence_option(ws, spec, opt_rows)
            keep_row = ~bad if keep_row is None else keep_row & ~bad
    if keep is None:
        keep = ws.valid.clone() if keep_row is not None else ws.valid
    if keep_row is not None:
        keep.mul_(keep_row.to(keep.dtype).unsqueeze(-1))
    kept_rows = keep.sum(-1)
    rows.add(KEPT, kept_rows, Kind.SUM, bucket=True)
    rows.add(KEPT_MINUS_N, kept_rows - (ws.n_row if n_row is None else n_row), lt=(REJECTED_SEQS, 0.0))
    return keep


def _token_option(ws: Workspace, spec, rows: RowTable, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """Test every valid token; returns the keep mask so far (the first option's becomes the mask buffer).

    k1 = -x is handled through x: ``k1 > hi <=> x < -hi``, ``clamp(k1, lo, hi) = -clamp(x, -hi, -lo)``."""
    pre = f"rollout_rs_{spec.option}_"
    lo, hi = spec.stat_bounds
    clamp_lo = lo if lo is not None else 0.0
    k1 = spec.stat == "k1"
    t = None if k1 else ws.token_stat(spec.stat)
    rej = ws.take_spare()  # rejected tokens (0/1); becomes the keep mask for the first option
    high = _compare_valid(ws.x, "<", -hi, ws, out=rej) if k1 else _compare_valid(t, ">", hi, ws, out=rej)
    high_rows = high.sum(-1)
    rows.add(pre + "high", high_rows, Kind.SUM)
    if lo is not None:
        low = _compare_valid(ws.x, ">", -lo, ws) if k1 else _compare_valid(t, "<", lo, ws)  # in scratch
        low_rows = low.sum(-1)
        rows.add(pre + "low", low_rows, Kind.SUM)
        rej.add_(low)  # high and low are disjoint
        high_rows = high_rows + low_rows
    rows.add(pre + "rejected_rows", high_rows, gt=(pre + "rejected_seqs", 0.0))
    if keep is None:
        keep = torch.sub(ws.valid, rej, out=rej)
    else:
        keep.addcmul_(keep, rej, value=-1.0)  # keep * (1 - rej)
    row_sum = ws.stat_row_sum(spec.stat)
    if k1:
        clamped = torch.clamp(ws.x, -hi, -clamp_lo, out=ws.scratch)  # = -clamp(k1, lo, hi)
        rows.add(pre + "x", ws.x_max_rows, Kind.MAX)
        rows.add(pre + "x", ws.x_min_rows, Kind.MIN)
    else:
        out = ws.scratch if t.dtype == torch.float32 else torch.empty_like(t)
        clamped = torch.clamp(t, clamp_lo, hi, out=out)
    if not clamp_lo <= 0.0 <= hi:
        clamped.mul_(ws.valid)
    csum, csum_sq = ws.row_moments(clamped)
    rows.add(pre + "sum", row_sum, Kind.SUM)
    rows.add(pre + "csum", -csum if k1 else csum, Kind.SUM)
    rows.add_sq(pre + "csum", csum_sq)
    if not k1:  # k2, k3 >= 0 and 0 outside valid tokens (k1 extrema: those of x)
        rows.add(pre + "tok", t.amax(-1) if t.numel() else row_sum, Kind.MAX)
        rows.add(pre + "tok", _valid_min(ws, t, row_sum), Kind.MIN)
    _add_row_values(rows, pre, row_sum / ws.n1, lo, hi)
    return keep


def _sequence_option(ws: Workspace, spec, rows: RowTable) -> torch.Tensor:
    """Test every valid row's statistic; returns the (B,) bool rows it rejects."""
    pre = f"rollout_rs_{spec.option}_"
    lo, hi = spec.stat_bounds
    row_values = _ROW_VALUES[spec.level](ws, spec.stat)
    in_band = row_values <= hi
    if lo is not None:
        in_band = in_band & (row_values >= lo)
    bad = ws.row_valid & ~in_band  # a NaN statistic is never in band: rejected
    rows.add(pre + "sum", row_values, Kind.WSUM)
    rows.add(pre + "csum", row_values.clamp(lo if lo is not None else 0.0, hi), Kind.WSUM, Kind.WSQ)
    rows.add(pre + "rejected", bad, Kind.WSUM)
    rows.add(pre + "rejected_seqs", bad, Kind.SUM)
    _add_row_values(rows, pre, row_values, lo, hi)
    return bad


def _add_row_values(rows: RowTable, pre: str, row_values: torch.Tensor, lo: Optional[float], hi: float) -> None:
    """The per-row value of an option (token options: the row mean), for the ``seq_*`` metrics."""
    rows.add(pre + "seq", row_values, Kind.SUM, Kind.SQ, Kind.MAX, Kind.MIN, gt=(pre + "seq_high", hi),
             lt=(pre + "seq_low", lo) if lo is not None else None)


def _row_max(t: torch.Tensor) -> torch.Tensor:
    return t.amax(-1) if t.numel() else t.sum(-1)


def _valid_min(ws: Workspace, t: torch.Tensor, row_sum: torch.Tensor) -> torch.Tensor:
    """(B,) min of a zero-off-valid k2/k3 over valid tokens."""
    if not t.numel():
        return row_sum
    if t.dtype == torch.float32:
        return ws.valid_min_rows(t)
    return torch.where(ws.valid > 0, t, float("inf")).amin(-1)


def _compare_valid(t: torch.Tensor, op: str, threshold: float, ws: Workspace,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, T) float32 0/1: ``t > threshold`` or ``t < threshold`` at valid tokens, for a zero-off-valid ``t``
    (restricting to valid tokens is free when the comparison is False at 0). Written into ``out`` (default:
    ``scratch``)."""
    out = ws.scratch if out is None else out
    if op == ">":
        hit = torch.gt(t, threshold, out=out)
        return hit.mul_(ws.valid) if 0.0 > threshold else hit
    hit = torch.lt(t, threshold, out=out)
    return hit.mul_(ws.valid) if 0.0 < threshold else hit


# ---------------------------------------------------------------------- metrics
def metric_base(rs_on: str = "direct") -> str:
    """The prefix of the RS metrics: ``rollout_rs_`` (verl's names) when RS judges the correction's own ratio,
    ``rollout_rs_engine_`` when it judges the lag split's engine factor (``rollout_rs_on="engine"``), so that a logged
    value always says which ratio it is of."""
    return "rollout_rs_engine_" if rs_on == "engine" else "rollout_rs_"


def finalize(v: StatView, layout, n_tok: float, n_seq: float) -> dict[str, float]:
    """Per-option ``rollout_rs_{option}_*`` metrics and the combined masked fractions (verl's names; ``metric_base``
    for ``rollout_rs_on="engine"``). ``n_tok`` / ``n_seq``: the correction's valid tokens / rows, the denominators of
    the combined fractions; with ``rollout_rs_on="engine"`` each option's metrics are over the tokens / rows with a
    finite engine factor (``ENGINE_N_TOK`` / ``ENGINE_N_SEQ``), and absent when there is none."""
    base = metric_base(layout.rs_on)
    m: dict[str, float] = {}
    # the options' own statistics: over the tokens / rows they judged (engine factor: those with a finite one; none
    # at all leaves them absent, as every statistic over no token is), the combined fractions over the correction's
    opt_tok, opt_seq = (v.sum(ENGINE_N_TOK), v.sum(ENGINE_N_SEQ)) if layout.rs_on == "engine" else (n_tok, n_seq)
    if opt_tok > 0:
        for spec in layout.rs_specs:
            m.update(_finalize_option(v, spec, opt_tok, opt_seq, base))
    m[base + "masked_fraction"] = div(n_tok - v.sum(KEPT), n_tok)
    m[base + "seq_masked_fraction"] = div(v.count(REJECTED_SEQS), n_seq)
    return m


def _finalize_option(v: StatView, spec, n_tok: float, n_seq: float, base: str = "rollout_rs_") -> dict[str, float]:
    p = f"{base}{spec.option}_"
    q = f"rollout_rs_{spec.option}_"  # the statistics' stored names (independent of the metric names)
    k1, is_token = spec.stat == "k1", spec.is_token_level
    m = {p + "mean": div(v.sum(q + "sum"), n_tok)}
    if is_token and k1:  # k1 = -x: extrema from those of x
        m[p + "max"], m[p + "min"] = -min_or_zero(v.min(q + "x")), -max_or_zero(v.max(q + "x"))
    elif is_token:
        m[p + "max"], m[p + "min"] = max_or_zero(v.max(q + "tok")), min_or_zero(v.min(q + "tok"))
    else:
        m[p + "max"], m[p + "min"] = max_or_zero(v.max(q + "seq")), min_or_zero(v.min(q + "seq"))
    high = v.sum(q + "high") if is_token else v.count(q + "seq_high")
    low = (v.sum(q + "low") if is_token else v.count(q + "seq_low")) if k1 else 0.0
    m[p + "fraction_high"] = div(high, n_tok if is_token else n_seq)
    m[p + "fraction_low"] = div(low, n_tok if is_token else n_seq)
    m[p + "std"] = pop_std(v.sum(q + "csum"), v.sq(q + "csum"), n_tok)
    m[p + "seq_mean"] = div(v.sum(q + "seq"), n_seq)
    m[p + "seq_std"] = unbiased_std(v.sum(q + "seq"), v.sq(q + "seq"), n_seq)
    smax, smin = max_or_zero(v.max(q + "seq")), min_or_zero(v.min(q + "seq"))
    m[p + "seq_max"] = smax
    m[p + "seq_min"] = smin
    m[p + "seq_max_deviation"] = max(abs(smax), abs(smin)) if n_seq > 0 else 0.0
    m[p + "seq_fraction_high"] = div(v.count(q + "seq_high"), n_seq)
    if k1:
        m[p + "seq_fraction_low"] = div(v.count(q + "seq_low"), n_seq)
    rejected = high + low if is_token else v.sum(q + "rejected")
    m[p + "masked_fraction"] = div(rejected, n_tok)
    m[p + "seq_masked_fraction"] = div(v.count(q + "rejected_seqs"), n_seq)
    return m


def finalize_bucket(v: StatView, j: int, n_j: float, rs_on: str = "direct") -> dict[str, float]:
    """``len_{lo}_{hi}/rs_masked_fraction`` of length bucket ``j`` (n_j valid tokens; ``rs_engine_masked_fraction``
    with ``rollout_rs_on="engine"``)."""
    return {metric_base(rs_on)[len("rollout_"):] + "masked_fraction": div(n_j - v.sum(KEPT, j), n_j)}
