"""The recomputation: a dump's rows grouped as the trainer grouped its correction calls (``analyze``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..config import RolloutCorrectionConfig
from ..correction import make_correction_fn, ratio_decomposition
from ..records import RolloutDump, Window
from .configs import NamedConfig, rs_on_engine
from .rows import Part, Rows, _counts, _needed_column, check_config_fits


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
        # max_policy_lag: (N,) rows the trainer kept at generation (decoupled: out of the correction) and at use
        bound = dump.metadata.get("trainer", {}).get("max_policy_lag")
        self.max_policy_lag = None if bound is None else int(bound)
        versions = self._row_versions()
        self.kept_at_generation = self._within_bound(s["generation_step"] - versions)
        self.kept_at_use = self._within_bound(s["step"] - versions)

    def _within_bound(self, lags: torch.Tensor) -> Optional[torch.Tensor]:
        """(N,) bool ``lag.lag_keep``, or None without ``max_policy_lag``."""
        from ..lag import lag_keep

        return None if self.max_policy_lag is None else lag_keep(lags, self.max_policy_lag)

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
            if w.logged_values_cover(update):
                return w.logged_step
        return None

    def window_holding_generation(self, batch: int) -> Optional[int]:
        """The logged step of the analysed window whose steps hold the update that generated ``batch`` (``contains``:
        also the steps of a resumed run's first window before its checkpoint, which its logged values do not
        cover), or None."""
        update = self.generation_step[batch] + 1
        return next((w.logged_step for w in self.windows if w.contains(update)), None)

    def rows_logged_in(self, w) -> torch.Tensor:
        """(N,) bool: the rows of window ``w`` its logged values count (a resumed run's first window holds rows of
        steps before its checkpoint that it did not log: ``Window.logged_first_step``)."""
        s = self.rows.scalar
        return (s["logged_step"] == w.logged_step) & (s["step"] + 1 >= w.logged_first_step)

    def analyse(self, named: NamedConfig, length_buckets: Sequence[int]) -> Analysis:
        """Every window's metrics, the merged total and the lag slices for ``named``.

        ``per_window`` holds what each window's logged values count (``rows_logged_in``); the total and the lag slices
        hold every analysed row, also those of a resumed run's first window before its checkpoint (``restored``
        below: rows of the uninterrupted run that no logged value counts), so a resumed dump analyses as the
        uninterrupted one.

        Raises:
            ConfigError: the dump lacks the log-probs the config's mode needs (``check_config_fits``).
        """
        check_config_fits(self.rows, named, self.dump)
        fn = make_correction_fn(named.config, length_buckets=tuple(length_buckets))
        per_window = {w.logged_step: Part() for w in self.windows}
        restored = Part()  # resumed windows' rows before the checkpoint: in the total, in no window's logged values
        if named.config.bypass_mode:
            self._bypass(fn, per_window, restored, length_buckets, named.config)
        else:
            self._decoupled(fn, per_window, restored, length_buckets, named.config)
        self._lags(per_window, restored)
        total = Part()
        for w in self.windows:
            total.merge(per_window[w.logged_step])
        total.merge(restored)
        by_lag = self._by_lag(fn, named.config, length_buckets)
        return Analysis(named, self.windows, per_window, total, by_lag, tuple(length_buckets))

    def _correct(self, fn, config: RolloutCorrectionConfig, index: torch.Tensor, policy: str, edges,
                 keep: Optional[torch.Tensor] = None) -> tuple[Any, dict[str, torch.Tensor], Part]:
        """The correction of rows ``index`` (their ``mask`` times ``keep[index]``, the rows ``max_policy_lag``
        kept, when given; with ``rollout_rs_on="engine"`` RS judges their ``version_log_probs`` against mu) and, with
        support matching, the support statistics of those rows over the same mask."""
        b = self.rows.batch(index, policy=policy)
        mask = b["mask"] if keep is None else b["mask"] * keep[index][:, None].to(b["mask"].dtype)
        # RS on the engine factor (rollout_rs_on="engine"): log pi_train@v as the trainer passes it
        extra = {"rs_log_probs": b["rs_version"]} if rs_on_engine(config) else {}
        out = fn(b["policy"], b["rollout"], mask, **extra)
        part = Part()
        part.add_stats(out.stats)
        part.support = self._support(index, mask)
        part.counts, part.counts_by_length = _counts(mask, b["policy"], b["rollout"], out.response_mask, edges)
        return out, b, part

    def _support(self, index: torch.Tensor, mask: torch.Tensor):
        """``support.SupportStats`` of rows ``index`` over ``mask`` (n, T) (``SupportStats.from_score``: tokens,
        sum of log S, sum of |K|, one-token supports, misses; the sizes for the quantiles), or None without the
        support columns."""
        if not self.rows.has("support_size"):
            return None
        from ..support import SupportStats

        width = mask.shape[1]
        size = self.rows.full("support_size", dtype=torch.int64)[index][:, :width]
        log_mass = self.rows.full("support_log_mass")[index][:, :width]
        miss = self.rows.full("support_miss", dtype=torch.int64)[index][:, :width] != 0
        tokens = mask != 0
        sizes = size[tokens].double()
        sums = torch.stack([tokens.sum().double(), log_mass[tokens].double().sum(), sizes.sum(),
                            (sizes == 1).sum().double(), miss[tokens].sum().double()])
        return SupportStats.from_sizes(sums, sizes)

    def _decoupled(self, fn, per_window: dict[int, Part], restored: Part, edges,
                   config: RolloutCorrectionConfig) -> None:
        kept_of_row: dict[int, torch.Tensor] = {}  # row index of the first use -> that row's kept mask
        for batch, index in self.generations.items():
            out, b, part = self._correct(fn, config, index, "old_log_probs", edges, keep=self.kept_at_generation)
            if part.support is not None:  # the pi_old forward's, over the generation batch's loss mask
                part.support = self._support(index, b["mask"])
            for k, i in enumerate(index.tolist()):
                kept_of_row[i] = out.response_mask[k]
            self._lone_survivors(config, b, out, part)
            window = self.window_of_generation(batch)
            if window in per_window:
                per_window[window].merge(part)
            elif self.window_holding_generation(batch) is not None:
                restored.merge(part)
        s = self.rows.scalar
        first = {(int(s["generation_batch"][i]), int(s["rank"][i]), int(s["generation_row"][i])): i
                 for batch, index in self.generations.items() for i in index.tolist()}
        if not self.rows.has("log_probs"):
            return
        for part, uses in self._uses(per_window, restored):
            b = self.rows.batch(uses, policy="old_log_probs")
            keep = torch.zeros_like(b["mask"])
            for k, i in enumerate(uses.tolist()):
                row_keep = kept_of_row[first[(int(s["generation_batch"][i]), int(s["rank"][i]),
                                              int(s["generation_row"][i]))]]
                n = min(row_keep.numel(), keep.shape[1])
                keep[k, :n] = row_keep[:n]
            if self.kept_at_use is not None:  # rows over max_policy_lag at use left the loss
                keep = keep * self.kept_at_use[uses][:, None].to(keep.dtype)
            d = ratio_decomposition(b["log_probs"], b["old"], b["rollout"], keep)
            ratios = {name: getattr(d, name)[d.valid] for name in ("engine", "update", "direct")}
            if "version" in b:  # policy_lag_split: engine pi_train@v / mu, lag pi_old / pi_train@v
                valid = d.valid & torch.isfinite(b["version"])
                ratios = {"engine": (b["version"] - b["rollout"].float())[valid],
                          "lag": (b["old"].float() - b["version"])[valid], "update": d.update[valid],
                          "direct": d.direct[valid]}
            for name, values in ratios.items():
                part.add_log_ratios(name, values)

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
        from ..trl_compat.advantages import lone_survivors

        lone = lone_survivors(rejected, has_tokens, num_generations)
        part.fractions["rs_lone_survivor_fraction"] = [int(lone.sum()), int(has_tokens.sum())]

    def _uses(self, per_window: dict[int, Part], restored: Part):
        """(Part, (n,) row indices) of each analysed window: the rows its logged values count into its ``per_window``
        part, then its rows before a resume's checkpoint (if any) into ``restored``."""
        s = self.rows.scalar
        for w in self.windows:
            logged = self.rows_logged_in(w)
            before = (s["logged_step"] == w.logged_step) & ~logged
            for part, sel in ((per_window[w.logged_step], logged), (restored, before)):
                if bool(sel.any()):
                    yield part, sel.nonzero().flatten()

    def _bypass(self, fn, per_window: dict[int, Part], restored: Part, edges,
                config: RolloutCorrectionConfig) -> None:
        s = self.rows.scalar
        for target, uses in self._uses(per_window, restored):
            for micro_step in torch.unique(s["micro_step"][uses]).tolist():
                index = uses[s["micro_step"][uses] == micro_step]
                out, b, part = self._correct(fn, config, index, "log_probs", edges, keep=self.kept_at_use)
                direct = b["log_probs"].float() - b["rollout"].float()
                keep = (out.response_mask != 0) & torch.isfinite(direct)
                part.add_log_ratios("direct", direct[keep])
                target.merge(part)

    def _row_lags(self) -> torch.Tensor:
        """(N,) lag of every row in optimizer steps: ``step - policy_version`` (``generation_step`` for rows without
        a version, e.g. dumps written before versions existed)."""
        return self.rows.scalar["step"] - self._row_versions()

    def _row_versions(self) -> torch.Tensor:
        """(N,) ``policy_version`` of every row (``generation_step`` where a row has none)."""
        s = self.rows.scalar
        if not self.rows.has("policy_version"):
            return s["generation_step"]
        column = self.rows.table.column("policy_version").to_pylist()
        return torch.tensor([g if v is None else v for v, g in zip(column, s["generation_step"].tolist())],
                            dtype=torch.int64)

    def _lags(self, per_window: dict[int, Part], restored: Part) -> None:
        """``policy_lag_*``: every trained row of the window (all ranks), as the trainer's ``lag.lag_counts`` over
        its loss tokens."""
        from ..lag import lag_counts

        if not self.rows.n:
            return
        lags = self._row_lags()
        mask = self.rows.full("completion_mask", dtype=torch.int64)
        if self.rows.has("tool_mask"):
            mask = mask * self.rows.full("tool_mask", dtype=torch.int64, fill=1)
        tokens = (mask != 0).sum(1)
        for part, sel in self._uses(per_window, restored):
            keep = None if self.kept_at_use is None else self.kept_at_use[sel]
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
            _, _, part = self._correct(fn, config, index, _needed_column(config), edges, keep=self.kept_at_use)
            out[int(value)] = part
        return out
