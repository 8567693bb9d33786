"""A dump's rows as tensors, and the merged counts and statistics of correction calls (``analyze``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..accumulator import PREFIX
from ..config import RolloutCorrectionConfig
from ..correction import SAFETY_BOUND, CorrectionStats
from ..records import RolloutDump, Window, padded
from ..sketch import ValueSketch, ratio_bounds, ratio_layout, ratio_metrics
from .configs import ConfigError, NamedConfig, check_recomputable, rs_on_engine


# ---------------------------------------------------------------------------------------------- the rows
class Rows:
    """All rows of the analysed windows: scalar columns as tensors, list columns padded on demand.

    Args:
        dump: an open ``RolloutDump``. windows: the windows whose rows are read.
    """

    SCALARS = ("logged_step", "step", "rank", "micro_step", "generation_batch", "generation_row", "generation_step")

    def __init__(self, dump: RolloutDump, windows: Sequence[Window]) -> None:
        self.table = dump.read_table(windows)
        self.columns = set(self.table.column_names)
        self.n = self.table.num_rows
        self.scalar = {name: torch.tensor(self.table.column(name).to_numpy(), dtype=torch.int64)
                       for name in self.SCALARS}
        self._cache: dict[tuple, torch.Tensor] = {}

    def has(self, name: str) -> bool:
        """Whether column ``name`` is present with at least one non-null row."""
        return name in self.columns and self.table.column(name).null_count < self.n

    def full(self, name: str, *, dtype=torch.float32, fill: float = 0.0) -> torch.Tensor:
        """(N, T_max) padded column ``name`` over all rows, ``fill`` after each row's end (cached)."""
        key = (name, dtype, fill if fill == fill else "nan")
        if key not in self._cache:
            self._cache[key] = padded(self.table, name, fill=fill, dtype=dtype)
        return self._cache[key]

    def batch(self, index: torch.Tensor, *, policy: str) -> dict[str, torch.Tensor]:
        """The (n, T) tensors of rows ``index``: ``mask`` (completion_mask * tool_mask), ``rollout`` (mu), and
        ``policy`` (the named log-prob column, NaN at ``support_miss``: invalid, as in the trainer); ``log_probs``,
        ``old`` and ``version`` (pi_train@v, ``policy_lag_split``) too when present, and then ``rs_version``
        (``version`` NaN at ``support_miss``: what the trainer passes as ``rs_log_probs`` with
        ``rollout_rs_on="engine"``)."""
        mask = self.full("completion_mask", dtype=torch.int64)[index]
        if self.has("tool_mask"):
            mask = mask * self.full("tool_mask", dtype=torch.int64, fill=1)[index]
        width = int((mask != 0).any(0).nonzero().max()) + 1 if bool((mask != 0).any()) else mask.shape[1]
        nan = float("nan")  # a log-prob missing from a row reads as NaN (an invalid token), never as 0
        out = {"mask": mask[:, :width], "rollout": self.full("rollout_log_probs", fill=nan)[index][:, :width]}
        out["policy"] = self.full(policy, fill=nan)[index][:, :width]
        miss = None
        if self.has("support_miss"):  # support matching: the missed tokens were invalid in the trainer's correction
            miss = self.full("support_miss", dtype=torch.int64)[index][:, :width] != 0
            out["policy"] = torch.where(miss, nan, out["policy"])
        for name, key in (("log_probs", "log_probs"), ("old_log_probs", "old"), ("version_log_probs", "version")):
            if self.has(name):
                out[key] = self.full(name, fill=nan)[index][:, :width]
        if "version" in out:  # RS on the engine factor: as the trainer, NaN (rejected) at support misses
            out["rs_version"] = out["version"] if miss is None else torch.where(miss, nan, out["version"])
        return out


def _needed_column(config: RolloutCorrectionConfig) -> str:
    return "log_probs" if config.bypass_mode else "old_log_probs"


def check_config_fits(rows: Rows, named: NamedConfig, dump: RolloutDump) -> None:
    """Raise unless the dump has the log-probs the config's mode needs.

    Raises:
        ConfigError: decoupled config on a bypass dump (no pi_old), bypass config without ``log_probs``, RS on the
            engine factor (``rollout_rs_on="engine"``) on a dump without ``version_log_probs`` on every row, or a
            config the records cannot reproduce (``check_recomputable``).
    """
    check_recomputable(named.config, f"config {named.label!r}")
    needed = _needed_column(named.config)
    if rows.has(needed) and rs_on_engine(named.config):
        _check_version_column(rows, named)
    if rows.has(needed):
        missing = rows.table.column(needed).null_count
        if missing:
            raise ConfigError(f"config {named.label!r} needs column {needed!r}, which {missing} of the {rows.n} rows "
                              "lack (micro-batches trained without it); analyse the steps that have it (--steps).")
        return
    mode = "bypass" if named.config.bypass_mode else "decoupled"
    trained = dump.metadata.get("correction", {}).get("mode", "?")
    if needed == "old_log_probs":
        why = "a bypass-mode run never computes pi_old; analyse it with bypass configs (bypass_mode: true)"
    else:
        why = "the run recorded no loss-forward log-probs (liger loss?); analyse it with decoupled configs"
    raise ConfigError(f"config {named.label!r} is {mode} and needs column {needed!r}, which this dump ({trained} "
                      f"mode) does not have: {why}.")


def _check_version_column(rows: Rows, named: NamedConfig) -> None:
    """RS on the engine factor needs log pi_train@v of every row (``version_log_probs``, records 1.1, written with
    ``policy_lag_split``)."""
    missing = rows.table.column("version_log_probs").null_count if "version_log_probs" in rows.columns else rows.n
    if not missing:
        return
    fix = ("re-run the training with policy_lag_split: true (rollout records schema >= 1.1 store log pi_train@v "
           "as version_log_probs), or analyse with rollout_rs_on: direct (RS on pi_old / mu)")
    if missing == rows.n:
        raise ConfigError(f"config {named.label!r} has rollout_rs_on='engine': RS judges the engine factor "
                          "pi_train@v / mu, which needs column 'version_log_probs', and this dump has none: "
                          f"{fix}.")
    raise ConfigError(f"config {named.label!r} has rollout_rs_on='engine' and needs column 'version_log_probs', "
                      f"which {missing} of the {rows.n} rows lack: analyse the steps that have it (--steps), or "
                      f"{fix}.")


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Counts:
    """Valid and kept tokens and rows (kept: in the correction's response mask), and the kl / k3 sums (nats) of the
    kept tokens: the mismatch that is left after rejection."""

    valid_tokens: float = 0.0
    kept_tokens: float = 0.0
    valid_rows: float = 0.0
    kept_rows: float = 0.0
    kept_kl_sum: float = 0.0
    kept_k3_sum: float = 0.0

    def add(self, other: "Counts") -> None:
        for name in ("valid_tokens", "kept_tokens", "valid_rows", "kept_rows", "kept_kl_sum", "kept_k3_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def kept_kl(self) -> Optional[float]:
        """Mean of log mu - log pi_train over the kept tokens (nats/token); None when none is kept."""
        return self.kept_kl_sum / self.kept_tokens if self.kept_tokens else None

    @property
    def kept_k3(self) -> Optional[float]:
        """Mean k3 = exp(x) - 1 - x, x = clamp(log pi_train - log mu, +-20), over the kept tokens (nats/token)."""
        return self.kept_k3_sum / self.kept_tokens if self.kept_tokens else None

    @property
    def kept_token_fraction(self) -> Optional[float]:
        """Kept / valid tokens; None when there is no valid token (no correction ran)."""
        return self.kept_tokens / self.valid_tokens if self.valid_tokens else None

    @property
    def kept_row_fraction(self) -> Optional[float]:
        """Kept / valid rows (a row is kept when at least one of its tokens is); None without a valid row."""
        return self.kept_rows / self.valid_rows if self.valid_rows else None


@dataclass
class Part:
    """Merged statistics, kept counts and log-ratio sketches of some correction calls (a window, a run, a slice)."""

    stats: Optional[CorrectionStats] = None
    counts: Counts = field(default_factory=Counts)
    counts_by_length: dict[int, Counts] = field(default_factory=dict)
    log_ratios: dict[str, ValueSketch] = field(default_factory=dict)  # as the accumulator's (sketch.py)
    lag_counts: dict[str, list[int]] = field(default_factory=dict)  # lag.lag_counts names -> [num, den]
    lag_max: Optional[int] = None
    fractions: dict[str, list[int]] = field(default_factory=dict)  # name -> [hits, total] (global row counts)
    support: Optional[Any] = None  # support.SupportStats of the measured support forwards (support matching)

    def add_stats(self, stats: CorrectionStats) -> None:
        self.stats = stats if self.stats is None else self.stats.merge(stats)

    def add_log_ratios(self, name: str, values: torch.Tensor) -> None:
        """Add the (N,) log ratios (nats) of trained tokens to ``name`` (``engine``, ``update``, ``lag``,
        ``direct``), as ``RolloutCorrAccumulator.add_log_ratios`` does."""
        if name not in self.log_ratios:
            self.log_ratios[name] = ValueSketch(ratio_layout())
        self.log_ratios[name].add(values)

    def merge(self, other: "Part") -> None:
        if other.stats is not None:
            self.add_stats(other.stats)
        if other.support is not None:
            self.support = other.support if self.support is None else self.support.merge(other.support)
        self.counts.add(other.counts)
        for j, c in other.counts_by_length.items():
            self.counts_by_length.setdefault(j, Counts()).add(c)
        for name, sketch in other.log_ratios.items():
            mine = self.log_ratios.get(name)
            self.log_ratios[name] = sketch if mine is None else mine.merge(sketch)
        for name, (num, den) in other.lag_counts.items():
            counts = self.lag_counts.setdefault(name, [0, 0])
            counts[0] += num
            counts[1] += den
        if other.lag_max is not None:
            self.lag_max = other.lag_max if self.lag_max is None else max(self.lag_max, other.lag_max)
        for name, (hits, total) in other.fractions.items():
            counts = self.fractions.setdefault(name, [0, 0])
            counts[0] += hits
            counts[1] += total

    def metrics(self) -> dict[str, float]:
        """The ``rollout_corr/*`` values, finalised as ``RolloutCorrAccumulator.flush`` does."""
        out: dict[str, float] = {}
        if self.stats is not None:
            out.update(self.stats.finalize())
        if self.support is not None:
            out.update(self.support.finalize())
        for name in sorted(self.log_ratios):
            for key, value in ratio_metrics(self.log_ratios[name]).items():
                out[f"{PREFIX}{name}_ratio_{key}"] = value
        for name, (num, den) in sorted(self.lag_counts.items()):
            if den > 0:  # as the accumulator's exact fractions: an empty denominator is not logged
                out[f"{PREFIX}{name}"] = num / den
        if self.lag_max is not None:
            out[f"{PREFIX}policy_lag_max"] = float(self.lag_max)
        for name, (hits, total) in sorted(self.fractions.items()):
            if total:  # as the accumulator: a fraction of no row is not logged
                out[f"{PREFIX}{name}"] = hits / total
        return out

    def bounds(self) -> dict[str, tuple[float, float]]:
        """Quantile keys of ``metrics`` read off a sketch (windows over ``sketch.EXACT_MAX`` tokens) -> (lower,
        upper): the interval the exact value lies in (``check_against_logs`` accepts a logged value inside it)."""
        out = {}
        for name, sketch in self.log_ratios.items():
            out.update({f"{PREFIX}{name}_ratio_{key}": b for key, b in ratio_bounds(sketch).items()})
        if self.support is not None:
            out.update(self.support.size_bounds())
        return out


def _counts(batch_mask: torch.Tensor, policy: torch.Tensor, rollout: torch.Tensor, kept: torch.Tensor,
            edges: Sequence[int]) -> tuple[Counts, dict[int, Counts]]:
    """Kept counts overall and per length bucket (valid tokens per row, as the correction's ``len_*`` slices)."""
    valid = (batch_mask > 0) & torch.isfinite(policy) & torch.isfinite(rollout)
    kept = (kept != 0) & valid
    x = torch.where(valid, policy.double() - rollout.double(), 0.0).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    kl_row = torch.where(kept, -x, 0.0).sum(1)
    k3_row = torch.where(kept, torch.expm1(x) - x, 0.0).sum(1)
    n_valid, n_kept = valid.sum(1), kept.sum(1)
    bucket = torch.bucketize(n_valid, torch.tensor(list(edges), dtype=n_valid.dtype), right=True)

    def counts(sel: torch.Tensor) -> Counts:
        return Counts(float(n_valid[sel].sum()), float(n_kept[sel].sum()), float((n_valid[sel] > 0).sum()),
                      float((n_kept[sel] > 0).sum()), float(kl_row[sel].sum()), float(k3_row[sel].sum()))

    everything = torch.ones_like(n_valid, dtype=torch.bool)
    return counts(everything), {j: counts(bucket == j) for j in range(len(edges) + 1)}
