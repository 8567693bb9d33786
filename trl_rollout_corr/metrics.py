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
    """Reducible statistics of one or more correction calls.

    Attributes:
        sums: name -> 0-d float64 tensor, merged by addition (sums and counts).
        maxs: name -> 0-d float64 tensor, merged by maximum (``-inf`` when empty).
        mins: name -> 0-d float64 tensor, merged by minimum (``+inf`` when empty).
        layout: static description of the metric set (IS level, bounds, RS options), identical for all
            parts that are merged. Parts from different configurations cannot be merged.
    """

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxs: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: tuple = ()

    # ------------------------------------------------------------------ merging
    def _check_compatible(self, other: "CorrectionStats") -> None:
        if self.layout != other.layout or self.sums.keys() != other.sums.keys():
            raise ValueError(
                "Cannot merge CorrectionStats from different correction configurations "
                f"({self.layout} vs {other.layout}); merge only parts computed with the same config."
            )

    def merge(self, other: "CorrectionStats") -> "CorrectionStats":
        """Combine two parts (sums added, maxima/minima taken). Returns a new object."""
        self._check_compatible(other)
        return CorrectionStats(
            sums={k: v + other.sums[k] for k, v in self.sums.items()},
            maxs={k: torch.maximum(v, other.maxs[k]) for k, v in self.maxs.items()},
            mins={k: torch.minimum(v, other.mins[k]) for k, v in self.mins.items()},
            layout=self.layout,
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
        out = CorrectionStats(layout=self.layout)
        for store, fn, target in ((self.sums, sum_fn, out.sums), (self.maxs, max_fn, out.maxs), (self.mins, min_fn, out.mins)):
            if not store:
                continue
            keys = list(store)
            reduced = fn(torch.stack([store[k] for k in keys]))
            target.update(zip(keys, reduced.unbind(0)))
        return out

    def to_vector(self) -> torch.Tensor:
        """All statistics as one 1-D float64 tensor (sums, then maxs, then mins, in key order)."""
        parts = [store[k].reshape(1) for store in (self.sums, self.maxs, self.mins) for k in store]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    # ------------------------------------------------------------------ finalising
    def finalize(self, prefix: str = PREFIX) -> dict[str, float]:
        """Evaluate every metric. One device-to-host transfer; Python floats, never NaN or inf.

        Returns:
            dict ``prefix + name -> float``.
        """
        values = self.to_vector().cpu().tolist()
        keys = [("s", k) for k in self.sums] + [("x", k) for k in self.maxs] + [("n", k) for k in self.mins]
        host = dict(zip(keys, values))
        s = {k: host[("s", k)] for k in self.sums}
        mx = {k: host[("x", k)] for k in self.maxs}
        mn = {k: host[("n", k)] for k in self.mins}
        metrics = _finalize(s, mx, mn, dict(self.layout))
        return {prefix + k: _finite(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------- formulas (host side, float64)
def _div(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def _finite(v: float) -> float:
    if math.isnan(v):
        return 0.0
    if math.isinf(v):
        return math.copysign(1.7976931348623157e308, v)
    return float(v)


def _ext(v: float) -> float:
    """An extremum of an empty set is reported as 0."""
    return 0.0 if math.isinf(v) else v


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


def _finalize(s: dict, mx: dict, mn: dict, layout: dict) -> dict[str, float]:
    n_tok, n_seq = s["n_tok"], s["n_seq"]
    m: dict[str, float] = {}

    # IS metrics first (verl's insertion order: IS, RS, off-policy).
    is_layout = layout.get("is")
    if is_layout is not None:
        level, upper, lower_m, icepop, batch_norm = is_layout
        m["rollout_is_mean"] = _div(s["is_w"], n_tok)
        if level == "token":
            m["rollout_is_max"] = _ext(mx["is_w_max"])
            m["rollout_is_min"] = _ext(mn["is_w_min"])
        else:
            m["rollout_is_max"] = 0.0 if math.isinf(mx["is_logw_max"]) else math.exp(min(mx["is_logw_max"], 20.0))
            m["rollout_is_min"] = 0.0 if math.isinf(mn["is_logw_min"]) else math.exp(min(mn["is_logw_min"], _EXP_CAP))
        den = n_tok if level == "token" else n_seq
        m["rollout_is_ratio_fraction_high"] = _div(s["is_ratio_high"], den)
        m["rollout_is_ratio_fraction_low"] = _div(s["is_ratio_low"], den)
        m["rollout_is_std"] = _pop_std(s["is_w"], s["is_w2"], n_tok)
        m["rollout_is_eff_sample_size"] = _ess(s["is_w"], s["is_w2"], n_tok)
        m["rollout_is_eff_sample_size_raw"] = _ess(s["is_r"], s["is_r2"], n_tok)
        m["rollout_is_seq_mean"] = _div(s["is_seq"], n_seq)
        m["rollout_is_seq_std"] = _unbiased_std(s["is_seq"], s["is_seq2"], n_seq)
        seq_max, seq_min = _ext(mx["is_seq_max"]), _ext(mn["is_seq_min"])
        m["rollout_is_seq_max"] = seq_max
        m["rollout_is_seq_min"] = seq_min
        m["rollout_is_seq_max_deviation"] = max(abs(seq_max - 1.0), abs(seq_min - 1.0)) if n_seq > 0 else 0.0
        m["rollout_is_seq_fraction_high"] = _div(s["is_seq_high"], n_seq)
        m["rollout_is_seq_fraction_low"] = _div(s["is_seq_low"], n_seq)
        if batch_norm:
            mean = _div(s["is_w"], n_tok) if level == "token" else _div(s["is_seq"], n_seq)
            m["rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
        if icepop:
            m["rollout_is_oob_ratio"] = _div(s["is_oob"], n_tok)

    for option, stat, is_token, lo, hi in layout.get("rs", ()):
        p = f"rollout_rs_{option}_"
        seq_den = n_seq
        m[p + "mean"] = _div(s[p + "sum"], n_tok)
        m[p + "max"] = _ext(mx[p + "max"])
        m[p + "min"] = _ext(mn[p + "min"])
        m[p + "fraction_high"] = _div(s[p + "high"], n_tok if is_token else seq_den)
        m[p + "fraction_low"] = _div(s[p + "low"], n_tok if is_token else seq_den) if stat == "k1" else 0.0
        m[p + "std"] = _pop_std(s[p + "csum"], s[p + "csum2"], n_tok)
        m[p + "seq_mean"] = _div(s[p + "seq"], seq_den)
        m[p + "seq_std"] = _unbiased_std(s[p + "seq"], s[p + "seq2"], seq_den)
        smax, smin = _ext(mx[p + "seq_max"]), _ext(mn[p + "seq_min"])
        m[p + "seq_max"] = smax
        m[p + "seq_min"] = smin
        m[p + "seq_max_deviation"] = max(abs(smax), abs(smin)) if seq_den > 0 else 0.0
        m[p + "seq_fraction_high"] = _div(s[p + "seq_high"], seq_den)
        if stat == "k1":
            m[p + "seq_fraction_low"] = _div(s[p + "seq_low"], seq_den)
        m[p + "masked_fraction"] = _div(s[p + "rejected"], n_tok)
        m[p + "seq_masked_fraction"] = _div(s[p + "rejected_seqs"], seq_den)
    if layout.get("rs"):
        m["rollout_rs_masked_fraction"] = _div(s["rs_rejected"], n_tok)
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
    m["log_ppl_diff_max"] = _ext(mx["d_max"])
    m["log_ppl_diff_min"] = _ext(mn["d_min"])
    m["ppl_ratio"] = _div(s["exp_d"], n_seq)
    m["chi2_token"] = _div(s["r2"], n_tok) - 1.0 if n_tok > 0 else 0.0
    m["chi2_seq"] = _div(s["seq_r2"], n_seq) - 1.0 if n_seq > 0 else 0.0

    m["num_valid_tokens"] = n_tok
    m["num_valid_seqs"] = n_seq
    m["invalid_token_fraction"] = _div(s["n_invalid"], s["n_masked"])
    return m
