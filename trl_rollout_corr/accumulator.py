"""Buffering of the ``rollout_corr/*`` metrics between two log calls, and their exact cross-rank flush.

``RolloutCorrAccumulator`` keeps, per mode (``"train"`` / ``"eval"``), everything trained on since the previous
log call:

* the merged ``CorrectionStats`` of every correction call (decoupled: one per generation batch; bypass: one per
  micro-batch): reducible sums, maxima and minima, O(number of metrics) memory;
* the valid per-token log ratios of the trained tokens (``engine``, ``update``, ``lag``, ``direct``), one
  ``sketch.ValueSketch`` per name: exact order statistics while the window holds at most ``sketch.EXACT_MAX``
  tokens over all ranks, a mergeable log-bucket sketch (stated error, ``docs/how-to/read-the-metrics.md``) above;
* the policy lag of every micro-batch (optimizer steps between generation and use);
* the merged ``support.SupportStats`` of every support forward (sampling-support matching): sums and a
  ``ValueSketch`` of the per-token kept-set sizes.
* exact fractions kept as reducible integer counts (``add_fraction_counts``: numerator and denominator summed over
  calls and ranks, divided once at flush; e.g. the MoE ``routing_mismatch_fraction`` of ``routing.py``).
* global row counts behind fractions (``add_fraction``: ``rs_lone_survivor_fraction``).

``flush(mode)`` reduces everything across ranks once, finalises once, and returns the metrics with TRL's
``eval_`` prefix in evaluation. Cross-rank operations are passed in (``Reducers``), so this module knows neither
TRL nor ``torch.distributed``.

Memory does not grow with the tokens or the ranks: per ratio name (three in decoupled mode, four with
``policy_lag_split``, one in bypass mode) at most ``EXACT_MAX`` float64 values (512 KB) while the window is small,
else 23,721 int64 bucket counts (190 KB); the flush all-reduces at most that per name (``sketch.reduce_sketches``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Optional

import torch

from .lag import lag_counts, masked_lag_max
from .sketch import RATIO_QUANTILES, ValueSketch, exact_ratio_quantiles, ratio_layout, ratio_metrics, reduce_sketches

if TYPE_CHECKING:
    from .correction import CorrectionStats
    from .support import SupportStats

MODES = ("train", "eval")
PREFIX = "rollout_corr/"
EVAL_PREFIX = "eval_"  # TRL's prefix for evaluation metrics
__all__ = ["EVAL_PREFIX", "MODES", "PREFIX", "RATIO_QUANTILES", "Reducers", "RolloutCorrAccumulator",
           "exact_ratio_quantiles", "gather_uneven"]

Reducer = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Reducers:
    """How tensors combine across ranks; the defaults are the one-process identities.

    Attributes:
        world_size: number of ranks. rank: this process's rank in [0, world_size) (the order of ``gather``).
        sum, max, min: element-wise all-reduce of a tensor (same shape on every rank, result on every rank).
        gather: all-gather of a tensor with the same shape on every rank, concatenated along dim 0 in rank order.
    """

    world_size: int = 1
    rank: int = 0
    sum: Reducer = _identity
    max: Reducer = _identity
    min: Reducer = _identity
    gather: Reducer = _identity

    @property
    def all_reduce(self) -> Optional[Reducer]:
        """The cross-rank sum for ``compute_rollout_correction(all_reduce=...)``, None on one rank."""
        return self.sum if self.world_size > 1 else None


def gather_uneven(values: torch.Tensor, reducers: Reducers) -> torch.Tensor:
    """All-gather 1-D tensors whose length differs across ranks.

    Args:
        values: (N_rank,) float, this rank's values (no NaN: NaN is the padding).
        reducers: the cross-rank operations.

    Returns:
        (sum of N_rank,) every rank's values in rank order; ``values`` itself on one rank.
    """
    if reducers.world_size <= 1:
        return values
    count = torch.tensor([values.numel()], device=values.device)
    longest = int(reducers.gather(count).max())
    padded = torch.full((longest,), float("nan"), dtype=values.dtype, device=values.device)
    padded[: values.numel()] = values
    gathered = reducers.gather(padded)
    return gathered[~torch.isnan(gathered)]


@dataclass
class _ModeBuffer:
    stats: Optional["CorrectionStats"] = None
    log_ratios: dict[str, ValueSketch] = field(default_factory=dict)
    lag_sum: int = 0
    lag_count: int = 0
    lag_max: int = 0
    support: Optional["SupportStats"] = None
    lag_row_max: Optional[torch.Tensor] = None  # per-row lags (add_policy_lag_rows): local max, reduced at flush
    lag_fractions: dict[str, list] = field(default_factory=dict)  # per-row lag counts, reduced with ``fractions``
    fractions: dict[str, list] = field(default_factory=dict)  # name -> [numerator, denominator] running sums
    global_fractions: dict[str, list[int]] = field(default_factory=dict)  # already global: summed over calls only


class RolloutCorrAccumulator:
    """The ``rollout_corr/*`` metrics of everything since the last ``flush``, per mode; see the module docstring.

    Args:
        reducers: the cross-rank operations used by ``flush`` (default: one process).
        exact_max: the window size (tokens over all ranks) up to which the ratio quantiles are exact
            (``sketch.ValueSketch``; None: ``sketch.EXACT_MAX``; 0: always the sketch).

    Every rank must call ``flush`` for the same mode at the same point (it runs collectives when
    ``reducers.world_size > 1``), as the Trainer's ``log`` does.
    """

    def __init__(self, reducers: Reducers = Reducers(), exact_max: Optional[int] = None) -> None:
        self.reducers = reducers
        self.exact_max = exact_max
        self._buffers = {mode: _ModeBuffer() for mode in MODES}

    def _buffer(self, mode: str) -> _ModeBuffer:
        if mode not in self._buffers:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
        return self._buffers[mode]

    def add_stats(self, mode: str, stats: "CorrectionStats") -> None:
        """Merge the statistics of one correction call (``RolloutCorrectionOutput.stats``) into ``mode``.

        Raises:
            ValueError: for an unknown mode, or (from ``CorrectionStats.merge``) statistics of another layout.
        """
        buffer = self._buffer(mode)
        buffer.stats = stats if buffer.stats is None else buffer.stats.merge(stats)

    def add_log_ratios(self, mode: str, log_ratios: dict[str, torch.Tensor]) -> None:
        """Keep the valid per-token log ratios (nats) of one micro-batch, by name.

        Args:
            mode: ``"train"`` or ``"eval"``.
            log_ratios: name -> tensor of the valid tokens' log ratios (any shape; flattened, detached, float64,
                clamped at +-``SAFETY_BOUND``): ``engine`` (log pi_old - log mu), ``update`` (log pi_theta -
                log pi_old), ``direct`` (log pi_theta - log mu). Logged as
                ``rollout_corr/{name}_ratio_{mean,p01,p50,p99,max}``.

        Every rank must add the same names between two flushes (``flush`` reduces them together, in name order).
        """
        store = self._buffer(mode).log_ratios
        for name, values in log_ratios.items():
            if name not in store:
                store[name] = ValueSketch(ratio_layout(), self.exact_max)
            store[name].add(values)

    def add_policy_lag(self, mode: str, lag: int) -> None:
        """Record one micro-batch's policy lag: optimizer steps between its generation and this update (0 =
        on-policy). Every micro-batch has the same rows on every rank, so the mean over micro-batches is the mean
        over the rows of the global batch and needs no cross-rank reduction."""
        buffer = self._buffer(mode)
        buffer.lag_sum += int(lag)
        buffer.lag_count += 1
        buffer.lag_max = max(buffer.lag_max, int(lag))

    def add_support(self, mode: str, stats: "SupportStats") -> None:
        """Merge one support forward's ``support.SupportStats`` (decoupled: once per generation batch, at pi_old;
        bypass: once per micro-batch, at pi_theta) into ``mode``; flushed as ``rollout_corr/support_*``."""
        buffer = self._buffer(mode)
        buffer.support = stats if buffer.support is None else buffer.support.merge(stats)

    def add_policy_lag_rows(
        self, mode: str, lags: torch.Tensor, tokens: torch.Tensor, keep: Optional[torch.Tensor] = None
    ) -> None:
        """Record the per-row policy lag of one micro-batch (spec section 7), exact over rows, tokens and ranks.

        Args:
            mode: ``"train"`` or ``"eval"``.
            lags: (B,) int64, optimizer steps between each row's policy version and this update.
            tokens: (B,) loss tokens of each row (the token-weighted mean's weights).
            keep: (B,) bool rows kept by ``max_policy_lag`` (None: no filter, no ``dropped`` fractions).

        Logged at ``flush``: ``policy_lag_mean`` (rows), ``policy_lag_token_mean`` (tokens), ``policy_lag_max``,
        ``policy_lag_fraction_<bucket>`` (``lag.LAG_BUCKETS``) and, with ``keep``,
        ``policy_lag_dropped_fraction`` / ``policy_lag_dropped_token_fraction``. Every rank must call it for the
        same micro-batches (it joins the cross-rank reductions of ``flush``).
        """
        buffer = self._buffer(mode)
        for name, (num, den) in lag_counts(lags, tokens, keep).items():
            total = buffer.lag_fractions.setdefault(name, [0, 0])
            total[0], total[1] = total[0] + num, total[1] + den
        local = masked_lag_max(lags)
        buffer.lag_row_max = local if buffer.lag_row_max is None else torch.maximum(buffer.lag_row_max, local)

    def add_fraction_counts(self, mode: str, counts: Mapping[str, tuple]) -> None:
        """Add integer counts to exact fractions: ``name`` is logged as ``rollout_corr/<name>`` =
        (sum of numerators) / (sum of denominators) over every call since the previous flush, on all ranks.

        Args:
            mode: ``"train"`` or ``"eval"``.
            counts: name -> ``(numerator, denominator)``, Python ints or 0-d integer tensors (kept on their device
                as int64 running sums: no host transfer until ``flush``).

        Every rank must add the same set of names between two flushes (as it does for the same model and the same
        forwards): ``flush`` reduces them as one vector in name order.
        """
        store = self._buffer(mode).fractions
        for name, (num, den) in counts.items():
            total = store.setdefault(name, [0, 0])
            total[0] = total[0] + num
            total[1] = total[1] + den

    def _flush_fractions(self, fractions: dict[str, list]) -> dict[str, float]:
        """The fractions' values over all ranks (one sum reduction); a fraction with denominator 0 is omitted."""
        if not fractions:
            return {}
        names = sorted(fractions)
        values = [torch.as_tensor(v) for name in names for v in fractions[name]]
        device = next((v.device for v in values if v.dim() == 0 and v.device.type != "cpu"), torch.device("cpu"))
        totals = self.reducers.sum(torch.stack([v.to(device=device, dtype=torch.int64) for v in values]))
        host = totals.view(-1, 2).cpu().tolist()
        return {f"{PREFIX}{name}": num / den for name, (num, den) in zip(names, host) if den > 0}

    def add_fraction(self, mode: str, name: str, hits: int, total: int) -> None:
        """Count ``hits`` out of ``total`` towards ``rollout_corr/{name}`` (hits / total over the log window; not
        logged for a zero total).

        The counts must already be global (the same on every rank, e.g. computed from gathered tensors), as the
        policy lag is: they are summed over calls, never across ranks.
        """
        counts = self._buffer(mode).global_fractions.setdefault(name, [0, 0])
        counts[0] += int(hits)
        counts[1] += int(total)

    def add_global_ratio(self, mode: str, name: str, num: float, den: float) -> None:
        """Add ``num`` / ``den`` towards ``rollout_corr/{name}`` = (sum of ``num``) / (sum of ``den``) over the log
        window (not logged for a zero total): ``add_fraction`` for float numerators (e.g. a sum of squares over a token
        count). Like ``add_fraction``, the values must already be global (the same on every rank)."""
        total = self._buffer(mode).global_fractions.setdefault(name, [0.0, 0.0])
        total[0] += float(num)
        total[1] += float(den)

    def flush(self, mode: str) -> dict[str, float]:
        """The metrics of ``mode`` since the previous flush, over all ranks; empties the buffer.

        Returns:
            ``rollout_corr/*`` (``eval_rollout_corr/*`` for ``mode="eval"``) -> float: the finalised
            ``CorrectionStats`` (if any were added), ``{name}_ratio_{mean,p01,p50,p99,max}`` per ratio name (if
            any token, over all ranks; quantiles exact up to ``sketch.EXACT_MAX`` tokens, else within the sketch's
            stated error), ``policy_lag_{mean,max}`` (if any micro-batch was recorded), ``support_*``
            (if any support token), the ``add_fraction_counts`` fractions (those with a non-zero denominator) and
            each ``add_fraction`` name (those with a non-zero total). A statistic over no row or token is absent,
            never 0 (``docs/how-to/read-the-metrics.md``, "Steps with no rows"); every rank still runs the same
            collectives.
        """
        buffer = self._buffer(mode)
        self._buffers[mode] = _ModeBuffer()
        metrics: dict[str, float] = {}
        if buffer.stats is not None:
            reducers = self.reducers
            metrics.update(buffer.stats.reduce(reducers.sum, reducers.max, reducers.min).finalize())
        names = sorted(buffer.log_ratios)
        for name, sketch in zip(names, reduce_sketches([buffer.log_ratios[n] for n in names], self.reducers)):
            for key, value in ratio_metrics(sketch).items():
                metrics[f"{PREFIX}{name}_ratio_{key}"] = value
        if buffer.lag_count:
            metrics[f"{PREFIX}policy_lag_mean"] = buffer.lag_sum / buffer.lag_count
            metrics[f"{PREFIX}policy_lag_max"] = float(buffer.lag_max)
        if buffer.support is not None:
            metrics.update(buffer.support.reduce(self.reducers).finalize())
        metrics.update(self._flush_fractions({**buffer.fractions, **buffer.lag_fractions}))
        if buffer.lag_row_max is not None:
            lag_max = int(self.reducers.max(buffer.lag_row_max.reshape(1).to(torch.int64))[0])
            if lag_max >= 0:
                metrics[f"{PREFIX}policy_lag_max"] = float(lag_max)
        for name, (hits, total) in sorted(buffer.global_fractions.items()):
            if total:
                metrics[f"{PREFIX}{name}"] = hits / total
        if mode == "eval":
            metrics = {f"{EVAL_PREFIX}{k}": v for k, v in metrics.items()}
        return metrics
