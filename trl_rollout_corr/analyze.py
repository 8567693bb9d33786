"""Offline what-if analysis of rollout records: every ``rollout_corr/*`` metric of the stored steps, recomputed under
the training config (checked against what was logged) and under any other correction config.

The recomputation groups the rows exactly as the trainer grouped its correction calls, then merges the
``CorrectionStats`` exactly as ``accumulator.RolloutCorrAccumulator`` does:

* decoupled mode: one call per *generation batch* (all ranks' rows of it, i.e. the global batch the trainer's
  cross-rank sums saw), on pi_old (``old_log_probs``) vs mu, counted in the window of the optimizer step that
  generated it (``generation_step + 1``); the ratio decomposition (``engine``/``update``/``direct``) over every
  trained use of a row in the window, on the tokens its generation batch's RS mask kept;
* bypass mode: one call per *global micro-batch* (all ranks' rows with the same ``micro_step``) on pi_theta of that
  micro-batch's loss forward (``log_probs``) vs mu; the direct ratio over the kept tokens;
* policy lag: per row, ``step - policy_version`` (``generation_step`` where a dump has no version column), as the
  trainer's ``lag.lag_counts`` (row and token means, buckets, ``max_policy_lag`` drops) and the row maximum.

A what-if config runs the same grouping for its own mode (a decoupled config needs ``old_log_probs``, which a bypass
run never computes; a bypass config needs ``log_probs``). The slices: by response length (the correction's own
``len_*`` metrics and kept counts per length bucket, in valid tokens per row) and by policy lag (the uses trained
at each lag, each slice corrected on its own rows: RS decisions, kl, k3 and the scale-free ESS do not depend on
the rest of the batch).

Everything here reads tensors from ``records.RolloutDump``; nothing writes. ``cli.py`` prints and plots.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .accumulator import PREFIX, exact_ratio_quantiles
from .config import CORRECTION_FIELDS, PRESETS, RolloutCorrectionArguments, RolloutCorrectionConfig
from .correction import SAFETY_BOUND, CorrectionStats, make_correction_fn, ratio_decomposition
from .records import RecordsError, RolloutDump, Window, padded

DEFAULT_TOLERANCE = 1e-5


class ConfigError(ValueError):
    """A what-if correction config cannot be used; the message names the file or preset and the fix."""


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class NamedConfig:
    """A correction config with the label the tables and plots use."""

    label: str
    config: RolloutCorrectionConfig


def preset_config(name: str) -> NamedConfig:
    """A preset by name (``config.PRESETS``).

    Raises:
        ConfigError: an unknown name (lists the presets and the closest match).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--preset {name!r} is not a preset.{hint} Presets: {', '.join(PRESETS)}.")
    return NamedConfig(name, RolloutCorrectionConfig.from_preset(name))


# Keys of a recipe YAML that are not correction fields but look like them (never reported as typos).
_NOT_CORRECTION = ("rollout_dump_dir", "rollout_dump_every", "rollout_generate_dtype", "rollout_corr_compile",
                   "rs_keep_rejected_in_baseline", "routing_replay", "rollout_support_matching", "rollout_engine",
                   "rollout_dtype", "rollout_max_model_len", "rollout_kv_cache_gib", "rollout_seed")


# A recipe config (``recipes/configs/*.yaml``) always names its model; a what-if config never does.
RECIPE_KEY = "model_name_or_path"


def yaml_config(path: str | Path) -> NamedConfig:
    """A correction config from a YAML file: the correction fields and/or ``rollout_corr_preset``, optionally a
    ``label``. Any other key is refused (a misspelt field, e.g. ``rs_threshold``, would otherwise leave the what-if
    at the preset's value), except in a recipe config (``recipes/configs/*.yaml``, recognised by its
    ``model_name_or_path``): its other keys belong to the recipe, whose parser (TRL's ``TrlParser``) refuses
    unknown ones, and only a key within a typo of a correction field is refused here.

    Raises:
        ConfigError: the file is missing, is not valid YAML (names the line and column), is not a mapping, has an
            unknown key (names it, the closest field and the known keys), or an invalid value (the config's own
            message).
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}). Pass an existing YAML file.") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}). Fix the syntax; a correction config is a "
                          "mapping such as 'rollout_is: token' / 'rollout_is_threshold: 2.0'.") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of correction fields (e.g. 'rollout_rs: seq_mean_k3'), "
                          f"got {type(data).__name__}.")
    known = set(CORRECTION_FIELDS) | {"rollout_corr_preset", "label"}
    recipe = RECIPE_KEY in data
    for key in data:
        if key in known or (recipe and key in _NOT_CORRECTION):
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.8 if recipe else 0.6)
        if recipe and not close:
            continue  # the recipe's own key
        hint = f"; did you mean {close[0]!r}?" if close else "."
        if key in _NOT_CORRECTION:
            hint = " (a training setting, which a what-if config cannot change)."
        raise ConfigError(f"{path}: unknown key {key!r}{hint} Correction keys: "
                          f"{', '.join(sorted(known - {'label'}))}, and label.")
    fields = {k: data[k] for k in CORRECTION_FIELDS if k in data and data[k] is not None}
    if not fields and "rollout_corr_preset" not in data:
        raise ConfigError(f"{path}: no correction key (rollout_corr_preset or one of {', '.join(CORRECTION_FIELDS)}).")
    try:
        args = RolloutCorrectionArguments(rollout_corr_preset=data.get("rollout_corr_preset"),
                                          **{k: _flag_value(v) for k, v in fields.items()})
        config = args.rollout_correction()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    return NamedConfig(str(data.get("label") or path.stem), config)


def _flag_value(value: Any) -> Any:
    """A YAML value as the flat arguments take it (numbers and bands as strings, bools kept)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(float(value))
    return value


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
        ``policy`` (the named log-prob column); ``log_probs`` and ``old`` too when present."""
        mask = self.full("completion_mask", dtype=torch.int64)[index]
        if self.has("tool_mask"):
            mask = mask * self.full("tool_mask", dtype=torch.int64, fill=1)[index]
        width = int((mask != 0).any(0).nonzero().max()) + 1 if bool((mask != 0).any()) else mask.shape[1]
        nan = float("nan")  # a log-prob missing from a row reads as NaN (an invalid token), never as 0
        out = {"mask": mask[:, :width], "rollout": self.full("rollout_log_probs", fill=nan)[index][:, :width]}
        out["policy"] = self.full(policy, fill=nan)[index][:, :width]
        for name, key in (("log_probs", "log_probs"), ("old_log_probs", "old")):
            if self.has(name):
                out[key] = self.full(name, fill=nan)[index][:, :width]
        return out


def _needed_column(config: RolloutCorrectionConfig) -> str:
    return "log_probs" if config.bypass_mode else "old_log_probs"


def check_config_fits(rows: Rows, named: NamedConfig, dump: RolloutDump) -> None:
    """Raise unless the dump has the log-probs the config's mode needs.

    Raises:
        ConfigError: decoupled config on a bypass dump (no pi_old), or bypass config without ``log_probs``.
    """
    needed = _needed_column(named.config)
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
    """Merged statistics, kept counts and raw log ratios of some correction calls (a window, a run, a slice)."""

    stats: Optional[CorrectionStats] = None
    counts: Counts = field(default_factory=Counts)
    counts_by_length: dict[int, Counts] = field(default_factory=dict)
    log_ratios: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    lag_counts: dict[str, list[int]] = field(default_factory=dict)  # lag.lag_counts names -> [num, den]
    lag_max: Optional[int] = None
    fractions: dict[str, list[int]] = field(default_factory=dict)  # name -> [hits, total] (global row counts)

    def add_stats(self, stats: CorrectionStats) -> None:
        self.stats = stats if self.stats is None else self.stats.merge(stats)

    def merge(self, other: "Part") -> None:
        if other.stats is not None:
            self.add_stats(other.stats)
        self.counts.add(other.counts)
        for j, c in other.counts_by_length.items():
            self.counts_by_length.setdefault(j, Counts()).add(c)
        for name, values in other.log_ratios.items():
            self.log_ratios.setdefault(name, []).extend(values)
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
        for name in sorted(self.log_ratios):
            values = torch.cat(self.log_ratios[name]) if self.log_ratios[name] else torch.zeros(0, dtype=torch.float64)
            for key, value in exact_ratio_quantiles(values).items():
                out[f"{PREFIX}{name}_ratio_{key}"] = value
        for name, (num, den) in sorted(self.lag_counts.items()):
            if den > 0:  # as the accumulator's exact fractions: an empty denominator is not logged
                out[f"{PREFIX}{name}"] = num / den
        if self.lag_max is not None:
            out[f"{PREFIX}policy_lag_max"] = float(self.lag_max)
        for name, (hits, total) in sorted(self.fractions.items()):
            out[f"{PREFIX}{name}"] = hits / total if total else 0.0
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


# ---------------------------------------------------------------------------------------------- recomputation
@dataclass
class Analysis:
    """The recomputation of one config over a dump.

    Attributes:
        named: the config. windows: the logged steps analysed, in order.
        per_window: logged step -> ``Part`` (that step's metrics, as the trainer would have logged them).
        total: every analysed window merged. by_lag: lag (optimizer steps) -> ``Part`` of the uses at that lag.
        length_buckets: the length-slice edges used.
    """

    named: NamedConfig
    windows: list[Window]
    per_window: dict[int, Part]
    total: Part
    by_lag: dict[int, Part]
    length_buckets: tuple[int, ...]


class Recomputer:
    """Groups a dump's rows as the trainer did and runs the correction of any config over them.

    Args:
        dump: an open dump. windows: the windows to analyse (default: every window with rows).
    """

    def __init__(self, dump: RolloutDump, windows: Optional[Sequence[Window]] = None) -> None:
        self.dump = dump
        self.selected = list(dump.windows if windows is None else windows)
        self.windows = [w for w in self.selected if w.files]
        self.rows = Rows(dump, self.windows)
        s = self.rows.scalar
        # generation batches: (generation_batch) -> the first use of each (rank, generation_row), in that order
        self.generations: dict[int, torch.Tensor] = {}
        self.generation_step: dict[int, int] = {}
        first_use: dict[tuple[int, int, int], int] = {}
        for i in range(self.rows.n):
            key = (int(s["generation_batch"][i]), int(s["rank"][i]), int(s["generation_row"][i]))
            first_use.setdefault(key, i)
        by_batch: dict[int, list[tuple[int, int, int]]] = {}
        for (batch, rank, row), i in first_use.items():
            by_batch.setdefault(batch, []).append((rank, row, i))
        for batch, items in by_batch.items():
            self.generations[batch] = torch.tensor([i for _, _, i in sorted(items)], dtype=torch.int64)
            self.generation_step[batch] = int(s["generation_step"][self.generations[batch][0]])
        self.incomplete = self._incomplete_generations(by_batch)

    def _incomplete_generations(self, by_batch) -> set[int]:
        """Generation batches with fewer rows than a full one (a window not dumped, or the run's last steps)."""
        trainer = self.dump.metadata.get("trainer", {})
        world = int(self.dump.metadata.get("world_size", 1))
        per_rank = int(trainer.get("per_device_train_batch_size") or 0) * int(trainer.get("steps_per_generation")
                                                                               or 1)
        if not per_rank:
            return set()
        return {b for b, items in by_batch.items() if len(items) < per_rank * world}

    def window_of_generation(self, batch: int) -> Optional[int]:
        """The logged step whose window holds the update that generated ``batch`` (``generation_step + 1``)."""
        update = self.generation_step[batch] + 1
        for w in self.dump.windows:
            if w.contains(update):
                return w.logged_step
        return None

    def analyse(self, named: NamedConfig, length_buckets: Sequence[int]) -> Analysis:
        """Every window's metrics, the merged total and the lag slices for ``named``.

        Raises:
            ConfigError: the dump lacks the log-probs the config's mode needs (``check_config_fits``).
        """
        check_config_fits(self.rows, named, self.dump)
        fn = make_correction_fn(named.config, length_buckets=tuple(length_buckets))
        per_window = {w.logged_step: Part() for w in self.windows}
        if named.config.bypass_mode:
            self._bypass(fn, per_window, length_buckets)
        else:
            self._decoupled(fn, per_window, length_buckets, named.config)
        self._lags(per_window)
        total = Part()
        for w in self.windows:
            total.merge(per_window[w.logged_step])
        by_lag = self._by_lag(fn, named.config, length_buckets)
        return Analysis(named, self.windows, per_window, total, by_lag, tuple(length_buckets))

    def _correct(self, fn, index: torch.Tensor, policy: str, edges) -> tuple[Any, dict[str, torch.Tensor], Part]:
        b = self.rows.batch(index, policy=policy)
        out = fn(b["policy"], b["rollout"], b["mask"])
        part = Part()
        part.add_stats(out.stats)
        part.counts, part.counts_by_length = _counts(b["mask"], b["policy"], b["rollout"], out.response_mask, edges)
        return out, b, part

    def _decoupled(self, fn, per_window: dict[int, Part], edges, config: RolloutCorrectionConfig) -> None:
        kept_of_row: dict[int, torch.Tensor] = {}  # row index of the first use -> that row's kept mask
        for batch, index in self.generations.items():
            out, b, part = self._correct(fn, index, "old_log_probs", edges)
            for k, i in enumerate(index.tolist()):
                kept_of_row[i] = out.response_mask[k]
            self._lone_survivors(config, b, out, part)
            window = self.window_of_generation(batch)
            if window in per_window:
                per_window[window].merge(part)
        s = self.rows.scalar
        first = {(int(s["generation_batch"][i]), int(s["rank"][i]), int(s["generation_row"][i])): i
                 for batch, index in self.generations.items() for i in index.tolist()}
        if not self.rows.has("log_probs"):
            return
        for w in self.windows:
            uses = (s["logged_step"] == w.logged_step).nonzero().flatten()
            if not len(uses):
                continue
            b = self.rows.batch(uses, policy="old_log_probs")
            keep = torch.zeros_like(b["mask"])
            for k, i in enumerate(uses.tolist()):
                row_keep = kept_of_row[first[(int(s["generation_batch"][i]), int(s["rank"][i]),
                                              int(s["generation_row"][i]))]]
                n = min(row_keep.numel(), keep.shape[1])
                keep[k, :n] = row_keep[:n]
            d = ratio_decomposition(b["log_probs"], b["old"], b["rollout"], keep)
            part = per_window[w.logged_step]
            for name in ("engine", "update", "direct"):
                part.log_ratios.setdefault(name, []).append(getattr(d, name)[d.valid].double())

    def _lone_survivors(self, config, b: dict, out, part: Part) -> None:
        """``rs_lone_survivor_fraction`` of one generation batch, as the trainer counts it: rows RS kept while
        rejecting every other row of their GRPO group, over the rows with a loss token (``trl_compat.lone_survivors``;
        rows in (rank, generation_row) order are TRL's gathered order). Only with RS on and rejected rows out of the
        baseline (the run's ``rs_keep_rejected_in_baseline``)."""
        if not config.rs_enabled:
            return
        correction = self.dump.metadata.get("correction", {})
        num_generations = int(self.dump.metadata.get("trainer", {}).get("num_generations") or 0)
        if correction.get("rs_keep_rejected_in_baseline") or num_generations < 1:
            return
        has_tokens = (b["mask"] != 0).sum(1) > 0
        rejected = has_tokens & ((out.response_mask != 0).sum(1) == 0)
        if has_tokens.numel() % num_generations:
            return  # an incomplete generation batch (skipped by the check)
        from .trl_compat import lone_survivors

        lone = lone_survivors(rejected, has_tokens, num_generations)
        part.fractions["rs_lone_survivor_fraction"] = [int(lone.sum()), int(has_tokens.sum())]

    def _bypass(self, fn, per_window: dict[int, Part], edges) -> None:
        s = self.rows.scalar
        for w in self.windows:
            in_window = s["logged_step"] == w.logged_step
            for micro_step in torch.unique(s["micro_step"][in_window]).tolist():
                index = (in_window & (s["micro_step"] == micro_step)).nonzero().flatten()
                out, b, part = self._correct(fn, index, "log_probs", edges)
                direct = b["log_probs"].float() - b["rollout"].float()
                keep = (out.response_mask != 0) & torch.isfinite(direct)
                part.log_ratios["direct"] = [direct[keep].double()]
                per_window[w.logged_step].merge(part)

    def _row_lags(self) -> torch.Tensor:
        """(N,) lag of every row in optimizer steps: ``step - policy_version`` (``generation_step`` for rows without
        a version, e.g. dumps written before versions existed)."""
        s = self.rows.scalar
        if self.rows.has("policy_version"):
            column = self.rows.table.column("policy_version").to_pylist()
            versions = torch.tensor([g if v is None else v for v, g in zip(column, s["generation_step"].tolist())],
                                    dtype=torch.int64)
        else:
            versions = s["generation_step"]
        return s["step"] - versions

    def _lags(self, per_window: dict[int, Part]) -> None:
        """``policy_lag_*``: every trained row of the window (all ranks), as the trainer's ``lag.lag_counts`` over
        its loss tokens."""
        from .lag import lag_counts

        if not self.rows.n:
            return
        s = self.rows.scalar
        lags = self._row_lags()
        mask = self.rows.full("completion_mask", dtype=torch.int64)
        if self.rows.has("tool_mask"):
            mask = mask * self.rows.full("tool_mask", dtype=torch.int64, fill=1)
        tokens = (mask != 0).sum(1)
        for w in self.windows:
            sel = s["logged_step"] == w.logged_step
            if not bool(sel.any()):
                continue
            keep = None  # runs with max_policy_lag are refused (analyse_dump)
            part = per_window[w.logged_step]
            for name, (num, den) in lag_counts(lags[sel], tokens[sel], keep).items():
                counts = part.lag_counts.setdefault(name, [0, 0])
                counts[0] += int(num)
                counts[1] += int(den)
            window_max = int(lags[sel].max())
            part.lag_max = window_max if part.lag_max is None else max(part.lag_max, window_max)

    def _by_lag(self, fn, config: RolloutCorrectionConfig, edges) -> dict[int, Part]:
        lag = self._row_lags()
        out = {}
        for value in torch.unique(lag).tolist():
            index = (lag == value).nonzero().flatten()
            _, _, part = self._correct(fn, index, _needed_column(config), edges)
            out[int(value)] = part
        return out


# ---------------------------------------------------------------------------------------------- the check
def check_tolerance(tolerance: Any) -> float:
    """The check's tolerance as a float, checked: a finite number >= 0 (``|logged - recomputed| <= tolerance *
    max(1, |logged|)``; 0 demands bit-equal values).

    Raises:
        ConfigError: a bool, a non-number, NaN (every comparison would fail), an infinity (every one would pass) or
            a negative number (nothing could pass).
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ConfigError(f"tolerance must be a number >= 0 (e.g. 1e-5), got {tolerance!r}.")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise ConfigError(f"tolerance must be a finite number >= 0 (e.g. 1e-5), got {tolerance!r}: NaN fails every "
                          "comparison, a negative one passes none, an infinite one passes all.")
    return float(tolerance)


def check_length_edges(length_buckets: Sequence[int]) -> tuple[int, ...]:
    """``correction.check_length_buckets`` (the trainer's rule), raising ``ConfigError``."""
    from .correction.layout import check_length_buckets

    try:
        return check_length_buckets(length_buckets)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class CheckResult:
    """Logged vs recomputed ``rollout_corr/*`` values of the training config.

    Attributes:
        compared: number of (step, key) pairs compared. failures: (step, key, logged, recomputed) beyond tolerance.
        max_abs_diff, max_rel_diff: over the compared pairs. not_recomputed: logged keys this version does not
            recompute (e.g. added by a newer trainer). not_logged: recomputed keys the step did not log.
        skipped: logged steps not checked, with the reason.
    """

    compared: int = 0
    failures: list[tuple[int, str, float, float]] = field(default_factory=list)
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    not_recomputed: set[str] = field(default_factory=set)
    not_logged: set[str] = field(default_factory=set)
    skipped: dict[int, str] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ok(self) -> bool:
        return not self.failures and self.compared > 0


def check_against_logs(analysis: Analysis, recomputer: Recomputer,
                       tolerance: float = DEFAULT_TOLERANCE) -> CheckResult:
    """Compare every logged ``rollout_corr/*`` value of the analysed windows with its recomputation.

    A pair passes when ``|logged - recomputed| <= tolerance * max(1, |logged|)`` (absolute below 1, relative above).
    Windows whose generation batches are incomplete in the dump are skipped (named in ``skipped``).
    """
    result = CheckResult(tolerance=tolerance)
    for w in recomputer.selected:
        if not w.files:
            result.skipped[w.logged_step] = ("its rows were not kept (rollout_dump_every)" if not w.dumped
                                             else "its step file is missing")
    for w in analysis.windows:
        logged = {k: v for k, v in w.metrics.items() if k.startswith(PREFIX)}
        if not logged:
            result.skipped[w.logged_step] = "no rollout_corr/* values logged"
            continue
        incomplete = [b for b in recomputer.incomplete if recomputer.window_of_generation(b) == w.logged_step]
        if incomplete:
            result.skipped[w.logged_step] = f"generation batch {incomplete[0]} is incomplete in the dump"
            continue
        ours = analysis.per_window[w.logged_step].metrics()
        for key, value in logged.items():
            if key not in ours:
                result.not_recomputed.add(key)
                continue
            diff = abs(float(value) - ours[key])
            result.compared += 1
            result.max_abs_diff = max(result.max_abs_diff, diff)
            result.max_rel_diff = max(result.max_rel_diff, diff / max(abs(float(value)), 1e-300))
            if not diff <= tolerance * max(1.0, abs(float(value))):
                result.failures.append((w.logged_step, key, float(value), ours[key]))
        result.not_logged.update(set(ours) - set(logged))
    return result


# ---------------------------------------------------------------------------------------------- summaries
def summary_row(part: Part) -> dict[str, float]:
    """The what-if table's columns for a ``Part``: kept tokens and rows (fractions), ESS (None without IS), kl,
    k3_kl (nats per token over the valid tokens, as logged), kept_kl, kept_k3 (over the kept tokens), valid tokens
    and rows; None / NaN where no correction ran (e.g. a decoupled window that
    only reused an earlier generation batch)."""
    m = part.metrics() if part.stats is not None else {}
    ess = m.get(f"{PREFIX}rollout_is_eff_sample_size")
    return {
        "kept_tokens": part.counts.kept_token_fraction,
        "kept_rows": part.counts.kept_row_fraction,
        "ess": ess,
        "kl": m.get(f"{PREFIX}kl", math.nan),
        "k3_kl": m.get(f"{PREFIX}k3_kl", math.nan),
        "kept_kl": part.counts.kept_kl,
        "kept_k3": part.counts.kept_k3,
        "valid_tokens": part.counts.valid_tokens,
        "valid_rows": part.counts.valid_rows,
    }


def length_slices(analysis: Analysis) -> list[dict[str, Any]]:
    """One row per length bucket of the merged total: the bucket, its rows, kept fractions, ESS, kl, k3_kl (valid
    tokens) and kept_k3 (kept tokens)."""
    edges = analysis.length_buckets
    bounds = (0, *edges, math.inf)
    m = analysis.total.metrics()
    out = []
    for j in range(len(edges) + 1):
        lo, hi = bounds[j], bounds[j + 1]
        prefix = f"{PREFIX}len_{lo}_{'inf' if hi == math.inf else hi}/"
        counts = analysis.total.counts_by_length.get(j, Counts())
        out.append({"bucket": f"[{lo}, {hi})", "rows": counts.valid_rows, "kept_tokens": counts.kept_token_fraction,
                    "kept_rows": counts.kept_row_fraction, "ess": m.get(prefix + "is_eff_sample_size"),
                    "kl": m.get(prefix + "kl", math.nan), "k3_kl": m.get(prefix + "k3_kl", math.nan),
                    "kept_k3": counts.kept_k3})
    return out


def analysable_windows(dump: RolloutDump, steps: Optional[tuple[int, int]] = None) -> list[Window]:
    """The logged windows of ``dump`` in ``steps`` (inclusive; all when None), after refusing dumps whose metrics
    cannot be recomputed.

    Raises:
        ConfigError: a run trained with support matching or ``max_policy_lag``. RecordsError: no stored rows there.
    """
    matching = dump.metadata.get("trainer", {}).get("rollout_support_matching") or "off"
    if matching != "off":
        raise ConfigError(
            f"{dump.path} was trained with rollout_support_matching={matching!r}: the trainer scored over the "
            "engine's support and made the tokens outside it invalid, which records of schema "
            f"{dump.metadata.get('schema_version', '1.0')} do not store, so its metrics cannot be recomputed. "
            "Analyse runs trained with rollout_support_matching='off'."
        )
    bound = dump.metadata.get("trainer", {}).get("max_policy_lag")
    if bound is not None:
        raise ConfigError(
            f"{dump.path} was trained with max_policy_lag={bound}: the rows it dropped left the correction's mask "
            "before the metrics were computed, which this version of analyze does not reproduce. Analyse runs "
            "trained without max_policy_lag."
        )
    windows = [w for w in dump.windows if steps is None or steps[0] <= w.logged_step <= steps[1]]
    if not any(w.files for w in windows):
        raise RecordsError(f"{dump.path}: no stored rows in the selected steps ({len(windows)} logged steps, "
                           "none with a step file). Check --steps, or rollout_dump_every of the run.")
    return windows


def analyse_dump(dump: RolloutDump, configs: Sequence[NamedConfig], *, length_buckets: Optional[Sequence[int]] = None,
                 steps: Optional[tuple[int, int]] = None,
                 tolerance: float = DEFAULT_TOLERANCE) -> tuple[CheckResult, list[Analysis], Recomputer]:
    """The check of the training config against the logs, and the what-if analyses.

    Args:
        dump: an open dump. configs: what-if configs (the training config is always analysed first, as "trained").
        length_buckets: slice edges for the what-if tables (default: the trainer's). steps: (first, last) logged
            steps to analyse (inclusive; default all). tolerance: of the check.

    Returns:
        (check, [trained analysis, what-if analyses...], the recomputer).

    Raises:
        RecordsError: an invalid dump (see ``records``). ConfigError: a config the dump cannot serve, a run
            trained with support matching (its missed tokens are not recorded), length buckets that are not
            increasing positive ints, or a tolerance that is not a finite number >= 0 (checked before any work).
    """
    tolerance = check_tolerance(tolerance)
    if length_buckets is not None:
        length_buckets = check_length_edges(length_buckets)
    windows = analysable_windows(dump, steps)
    recomputer = Recomputer(dump, windows)
    trained = NamedConfig("trained", dump.correction_config())
    for named in configs:  # fail before any work on a config the dump cannot serve
        check_config_fits(recomputer.rows, named, dump)
    check = check_against_logs(recomputer.analyse(trained, dump.length_buckets), recomputer, tolerance)
    edges = tuple(length_buckets) if length_buckets is not None else dump.length_buckets
    analyses = [recomputer.analyse(named, edges) for named in [trained, *configs]]
    return check, analyses, recomputer
