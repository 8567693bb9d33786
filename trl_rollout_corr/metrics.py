"""Reducible statistics behind the ``rollout_corr/*`` metrics.

Every metric is a function of a few *reducible* statistics: sums and counts (merged by addition), maxima
and minima (merged by max/min). ``CorrectionStats`` holds them as 0-d tensors on the device where they were
computed; merging micro-batches, reducing across ranks and finalising never leaves the device until
``finalize()``, which moves everything to the host in one transfer and evaluates the formulas in float64.

So a value logged for a step equals the value computed once over that step's whole global batch, whatever
the number of ranks, micro-batches or gradient-accumulation steps (never a mean of means, and no reducer is
ever chosen from a metric's name: each statistic carries its own).

Definitions (N = valid tokens, V = valid rows, i.e. rows with at least one valid token; a token is valid when
its mask is 1 and both log-probs are finite; ``l`` = log pi_train - log mu in nats, ``x = clamp(l, -20, 20)``,
``S_i`` = sum of ``l`` over the valid tokens of row i):

* off-policy (verl-compatible, per-row means over V instead of all B rows: deliberate difference):
  ``kl = -sum l / N``; ``k3_kl = sum(exp(x) - 1 - x) / N`` (clamped, so finite); ``chi2_token =
  sum exp(2x) / N - 1``; ``chi2_seq = mean_V exp(2 clamp(S_i)) - 1``; ``training_log_ppl = mean_V
  (-mean_t log pi_train)``, ``training_ppl = mean_V exp(...)``, the same for ``rollout_*``;
  ``log_ppl_diff = mean_V d_i`` with ``d_i = mean_t(log mu - log pi_train)``, ``log_ppl_abs_diff``,
  ``log_ppl_diff_max/min``, ``ppl_ratio = mean_V exp(d_i)``.
* IS: see ``correction.py``; ESS is the Kish fraction ``(sum w)^2 / (N * sum w^2)`` over valid *tokens*
  (for sequence IS each row counts with its token count, as in verl), 0 when every weight is 0.
* RS per option ``o``: ``rollout_rs_{o}_*`` as in verl; the global ``rollout_rs_masked_fraction`` and
  ``rollout_rs_seq_masked_fraction`` (over V).
* length slices ``len_{lo}_{hi}/``: ``kl``, ``k3_kl``, ``rs_masked_fraction``, ``is_eff_sample_size`` and
  ``num_seqs`` over the rows whose valid-token count is in ``[lo, hi)``.
* counts: ``num_valid_tokens``, ``num_valid_seqs``, ``invalid_token_fraction`` (NaN/inf log-probs at
  masked tokens, over masked tokens).

Metrics whose denominator is empty (no valid token or row) are reported as 0 and the counts tell why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

Reducer = Callable[[torch.Tensor], torch.Tensor]
PREFIX = "rollout_corr/"
_EXP_CAP = 700.0  # exp() argument cap for per-row perplexities, keeps float64 finite


@dataclass
class CorrectionStats:
    """Reducible statistics of one or more correction calls, as three 1-D float64 tensors.

    Attributes:
        sum_names, sums: statistics merged by addition (sums and counts).
        max_names, maxs: statistics merged by maximum (``-inf`` when empty).
        min_names, mins: statistics merged by minimum (``+inf`` when empty).
        layout: static description of the metric set (IS level, bounds, RS options), identical for all
            parts that are merged. Parts from different configurations cannot be merged.

    Merging and reducing cost three tensor operations whatever the number of metrics.
    """

    sum_names: tuple[str, ...] = ()
    sums: Optional[torch.Tensor] = None
    max_names: tuple[str, ...] = ()
    maxs: Optional[torch.Tensor] = None
    min_names: tuple[str, ...] = ()
    mins: Optional[torch.Tensor] = None
    layout: tuple = ()

    def as_dicts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(sums, maxs, mins) as name -> 0-d tensor dicts (views; for inspection and tests)."""
        return tuple(
            dict(zip(names, vec.unbind(0))) if vec is not None else {}
            for names, vec in ((self.sum_names, self.sums), (self.max_names, self.maxs), (self.min_names, self.mins))
        )

    # ------------------------------------------------------------------ merging
    def _check_compatible(self, other: "CorrectionStats") -> None:
        if self.layout != other.layout or (self.sum_names, self.max_names, self.min_names) != (
            other.sum_names, other.max_names, other.min_names
        ):
            raise ValueError(
                "Cannot merge CorrectionStats from different correction configurations "
                f"({self.layout} vs {other.layout}); merge only parts computed with the same config."
            )

    def merge(self, other: "CorrectionStats") -> "CorrectionStats":
        """Combine two parts (sums added, maxima/minima taken). Returns a new object."""
        self._check_compatible(other)
        return CorrectionStats(
            self.sum_names, self.sums + other.sums,
            self.max_names, torch.maximum(self.maxs, other.maxs),
            self.min_names, torch.minimum(self.mins, other.mins),
            self.layout,
        )

    @staticmethod
    def merge_all(parts: Iterable["CorrectionStats"]) -> "CorrectionStats":
        """Merge any number of parts (at least one).

        Raises:
            ValueError: for an empty iterable or incompatible parts.
        """
        parts = list(parts)
        if not parts:
            raise ValueError("merge_all needs at least one CorrectionStats part.")
        total = parts[0]
        for part in parts[1:]:
            total = total.merge(part)
        return total

    def reduce(self, sum_fn: Reducer, max_fn: Reducer, min_fn: Reducer) -> "CorrectionStats":
        """Reduce across ranks with three collectives on 1-D float64 tensors.

        Args:
            sum_fn, max_fn, min_fn: each takes a 1-D tensor and returns the element-wise sum / max / min
                over all ranks (for example ``accelerator.reduce(t, "sum")`` and ``torch.distributed``
                all_reduce with ``ReduceOp.MAX`` / ``MIN``). Every rank must call this with the same layout.
        """
        return CorrectionStats(
            self.sum_names, sum_fn(self.sums),
            self.max_names, max_fn(self.maxs),
            self.min_names, min_fn(self.mins),
            self.layout,
        )

    def to_vector(self) -> torch.Tensor:
        """All statistics as one 1-D float64 tensor (sums, then maxs, then mins)."""
        return torch.cat([self.sums, self.maxs, self.mins])

    # ------------------------------------------------------------------ finalising
    def finalize(self, prefix: str = PREFIX) -> dict[str, float]:
        """Evaluate every metric. One device-to-host transfer; Python floats, never NaN or inf.

        Returns:
            dict ``prefix + name -> float``.
        """
        values = self.to_vector().cpu().tolist()
        a, b = len(self.sum_names), len(self.sum_names) + len(self.max_names)
        s = dict(zip(self.sum_names, values[:a]))
        mx = dict(zip(self.max_names, values[a:b]))
        mn = dict(zip(self.min_names, values[b:]))
        metrics = _finalize(s, mx, mn, dict(self.layout))
        isfinite = math.isfinite
        return {prefix + k: v if isfinite(v) else _finite(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------- formulas (host side, float64)
def _div(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _finite(v: float) -> float:
    if math.isnan(v):
        return 0.0
    if math.isinf(v):
        return math.copysign(1.7976931348623157e308, v)
    return float(v)


def _max(v: float) -> float:
    """A maximum; that of an empty set (-inf) is reported as 0 (+inf is a real, saturated value)."""
    return 0.0 if v == -math.inf else v


def _min(v: float) -> float:
    """A minimum; that of an empty set (+inf) is reported as 0 (-inf is a real, saturated value)."""
    return 0.0 if v == math.inf else v


def _pop_std(sum_x: float, sum_x2: float, n: float) -> float:
    if n <= 1:
        return 0.0
    mean = sum_x / n
    return math.sqrt(max(sum_x2 / n - mean * mean, 0.0))


def _unbiased_std(sum_x: float, sum_x2: float, n: float) -> float:
    if n <= 1:
        return 0.0
    return math.sqrt(max((sum_x2 - sum_x * sum_x / n) / (n - 1), 0.0))


def _ess(sum_w: float, sum_w2: float, n: float) -> float:
    if n <= 0 or sum_w2 <= 0:
        return 0.0
    return min(sum_w * sum_w / (n * sum_w2), 1.0)


def _exp_or_zero(v: float, cap: float = _EXP_CAP) -> float:
    return 0.0 if math.isinf(v) and v < 0 else math.exp(min(v, cap))


def _finalize(s: dict, mx: dict, mn: dict, layout: dict) -> dict[str, float]:
    """Metric formulas from merged statistics (host side, float64). Names: see ``correction.py``."""
    n_tok, n_seq = s["n_tok"], s["n_seq"]
    r2 = s["r2"]  # sum of R^2 over valid tokens
    m: dict[str, float] = {}

    # IS metrics first (verl's insertion order: IS, RS, off-policy).
    is_layout = layout.get("is")
    if is_layout is not None:
        level, upper, lower_m, icepop, batch_norm = is_layout
        sum_w, sum_w2 = s["is_w"], s["is_w2"]  # token-weighted at both levels
        if level == "token":
            sum_r, sum_r2 = s["r"], r2
            if icepop:
                w_max, w_min = _max(mx["is_w_max"]), _min(mn["is_w_min"])
            else:  # min(exp(x), U) is monotone in x
                w_max = min(_exp_or_zero(mx["x_max"]), upper) if n_tok > 0 else 0.0
                w_min = min(_exp_or_zero(mn["x_min"]), upper) if n_tok > 0 else 0.0
            den = n_tok
        else:
            sum_r, sum_r2 = s["is_r"], s["is_r2"]
            w_max = min(_exp_or_zero(mx["is_logw_max"]), math.exp(20.0)) if n_seq > 0 else 0.0
            w_min = _exp_or_zero(mn["is_logw_min"]) if n_seq > 0 else 0.0
            den = n_seq
        m["rollout_is_mean"] = _div(sum_w, n_tok)
        m["rollout_is_max"] = w_max
        m["rollout_is_min"] = w_min
        m["rollout_is_ratio_fraction_high"] = _div(s["is_high"], den)
        m["rollout_is_ratio_fraction_low"] = _div(s["is_low"], den)
        m["rollout_is_std"] = _pop_std(sum_w, sum_w2, n_tok)
        m["rollout_is_eff_sample_size"] = _ess(sum_w, sum_w2, n_tok)
        m["rollout_is_eff_sample_size_raw"] = _ess(sum_r, sum_r2, n_tok)
        m["rollout_is_seq_mean"] = _div(s["is_seq"], n_seq)
        m["rollout_is_seq_std"] = _unbiased_std(s["is_seq"], s["is_seq2"], n_seq)
        seq_max, seq_min = _max(mx["is_seq_max"]), _min(mn["is_seq_min"])
        m["rollout_is_seq_max"] = seq_max
        m["rollout_is_seq_min"] = seq_min
        m["rollout_is_seq_max_deviation"] = max(abs(seq_max - 1.0), abs(seq_min - 1.0)) if n_seq > 0 else 0.0
        m["rollout_is_seq_fraction_high"] = _div(s["is_seq_high"], n_seq)
        m["rollout_is_seq_fraction_low"] = _div(s["is_seq_low"], n_seq)
        if batch_norm:
            mean = _div(sum_w, n_tok) if level == "token" else _div(s["is_seq"], n_seq)
            m["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
        if icepop:
            oob = s["is_high"] + s["is_low"] if level == "token" else s["is_oob"]
            m["rollout_is_oob_ratio"] = _div(oob, n_tok)

    for option, stat, is_token, lo, hi in layout.get("rs", ()):
        p = f"rollout_rs_{option}_"
        m[p + "mean"] = _div(s[p + "sum"], n_tok)
        if is_token and stat == "k1":  # k1 = -x: extrema from those of x
            m[p + "max"] = -_min(mn["x_min"])
            m[p + "min"] = -_max(mx["x_max"])
        elif is_token:
            m[p + "max"] = _max(mx[p + "max"])
            m[p + "min"] = _min(mn[p + "min"])
        else:
            m[p + "max"] = _max(mx[p + "seq_max"])
            m[p + "min"] = _min(mn[p + "seq_min"])
        high = s[p + "high"] if is_token else s[p + "seq_high"]
        low = (s[p + "low"] if is_token else s[p + "seq_low"]) if stat == "k1" else 0.0
        m[p + "fraction_high"] = _div(high, n_tok if is_token else n_seq)
        m[p + "fraction_low"] = _div(low, n_tok if is_token else n_seq)
        m[p + "std"] = _pop_std(s[p + "csum"], s[p + "csum2"], n_tok)
        m[p + "seq_mean"] = _div(s[p + "seq"], n_seq)
        m[p + "seq_std"] = _unbiased_std(s[p + "seq"], s[p + "seq2"], n_seq)
        smax, smin = _max(mx[p + "seq_max"]), _min(mn[p + "seq_min"])
        m[p + "seq_max"] = smax
        m[p + "seq_min"] = smin
        m[p + "seq_max_deviation"] = max(abs(smax), abs(smin)) if n_seq > 0 else 0.0
        m[p + "seq_fraction_high"] = _div(s[p + "seq_high"], n_seq)
        if stat == "k1":
            m[p + "seq_fraction_low"] = _div(s[p + "seq_low"], n_seq)
        rejected = high + low if is_token else s[p + "rejected"]
        m[p + "masked_fraction"] = _div(rejected, n_tok)
        m[p + "seq_masked_fraction"] = _div(s[p + "rejected_seqs"], n_seq)
    if layout.get("rs"):
        m["rollout_rs_masked_fraction"] = _div(n_tok - s["rs_kept"], n_tok)
        m["rollout_rs_seq_masked_fraction"] = _div(s["rs_rejected_seqs"], n_seq)

    # Off-policy diagnostics (always).
    m["training_ppl"] = _div(s["train_ppl"], n_seq)
    m["training_log_ppl"] = _div(s["train_log_ppl"], n_seq)
    m["kl"] = -_div(s["l"], n_tok)
    m["k3_kl"] = _div(s["k3"], n_tok)
    m["rollout_ppl"] = _div(s["roll_ppl"], n_seq)
    m["rollout_log_ppl"] = _div(s["roll_log_ppl"], n_seq)
    m["log_ppl_diff"] = _div(s["d"], n_seq)
    m["log_ppl_abs_diff"] = _div(s["abs_d"], n_seq)
    m["log_ppl_diff_max"] = _max(mx["d_max"])
    m["log_ppl_diff_min"] = _min(mn["d_min"])
    m["ppl_ratio"] = _div(s["exp_d"], n_seq)
    m["chi2_token"] = _div(r2, n_tok) - 1.0 if n_tok > 0 else 0.0
    m["chi2_seq"] = _div(s["seq_r2"], n_seq) - 1.0 if n_seq > 0 else 0.0

    edges = layout.get("buckets", ())
    for j in range(len(edges) + 1 if edges else 0):
        lo = 0 if j == 0 else edges[j - 1]
        hi = edges[j] if j < len(edges) else "inf"
        p, n_j = f"len_{lo}_{hi}/", s[f"n_tok@{j}"]
        m[p + "num_seqs"] = s[f"n_seq@{j}"]
        m[p + "kl"] = -_div(s[f"l@{j}"], n_j)
        m[p + "k3_kl"] = _div(s[f"k3@{j}"], n_j)
        if layout.get("rs"):
            m[p + "rs_masked_fraction"] = _div(n_j - s[f"rs_kept@{j}"], n_j)
        if is_layout is not None:
            m[p + "is_eff_sample_size"] = _ess(s[f"is_w@{j}"], s[f"is_w2@{j}"], n_j)

    m["num_valid_tokens"] = n_tok
    m["num_valid_seqs"] = n_seq
    m["invalid_token_fraction"] = _div(s["n_masked"] - n_tok, s["n_masked"])
    return m
