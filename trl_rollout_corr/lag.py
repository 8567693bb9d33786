"""Policy versions and lag (spec section 7): which weights produced a sample, how stale it is when trained on.

A sample's *version* is the optimizer step (``trainer.state.global_step``) of the weights the rollout engine held
when it generated it (for an engine synced every few steps: the step of its last sync). A rollout that spans a
weight update may report one version per token; the sample's version is its oldest token's (the lag split scores
each token at its own version: ``token_versions``). Its *lag* when
trained on is the current optimizer step minus its version: 0 for synchronous GRPO with one update per
generation batch, and positive with ``num_iterations > 1``, ``steps_per_generation > 1``, a weight sync every k
steps, or asynchronous generation. All lags are in optimizer steps.

Pure functions on Python lists and (B,) tensors; no TRL. ``WeightSchedule`` is the one rule, shared by the vLLM CPU
engine and the tests, for which version an engine synced every ``sync_interval`` steps, or ``async_depth`` steps
behind the learner, holds at a given step. Peers filter stale samples by the same scalar age: TRL's async GRPO
``max_staleness``, verl's ``max_off_policy_threshold``, prime-rl's ``max_off_policy_steps``, SkyRL's
``max_staleness_steps``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from .correction.mask_pipeline import MaskContext, lag_rows

# Fixed lag buckets (optimizer steps), logged as rollout_corr/policy_lag_fraction_<name>: the same names on every
# rank and every step, as the accumulator's cross-rank fraction reduction needs.
LAG_BUCKETS: tuple[tuple[str, int, Optional[int]], ...] = (
    ("0", 0, 0), ("1", 1, 1), ("2_3", 2, 3), ("4_7", 4, 7), ("8_plus", 8, None),
)

VersionLike = Union[int, Sequence[int]]


def row_versions(
    raw: Optional[Sequence[VersionLike]], num_rows: int, current_step: int, *, required: bool = False,
    completion_lengths: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The (B,) int64 policy version of each row, checked (the one parser of a ``rollout_func``'s
    ``policy_version``; ``features.policy_lag.PolicyLag.after_generate`` calls it for every generation batch).

    Args:
        raw: per row, an integer (the version of the weights that generated it: a Python int, a NumPy integer or a
            0-d integer tensor) or a sequence of integers (one version per completion token, e.g. a list, a 1-d
            array or tensor; the row's version is the oldest, ``min``). None: the generation path reports no
            version, and the current step is assumed (true for TRL's own vLLM colocate/server paths, which sync
            before every generation, and for ``transformers.generate``, which samples from the policy).
        num_rows: B, the rows of the generation batch.
        current_step: the trainer's optimizer step now (``trainer.state.global_step``).
        required: True when a setting depends on real versions (``max_policy_lag``): None is then an error.
        completion_lengths: (B,) completion tokens per row; a per-token list must have exactly that many entries.
            None: not checked.

    Returns:
        (B,) int64 tensor, every entry in ``[0, current_step]``.

    Raises:
        ValueError: ``raw`` is None while ``required``; a row count other than B; a version that is not an integer
            (bools, floats and strings refused: ``"10"`` is not the step 10), negative, an empty per-token list, a
            per-token list whose length is not the row's completion length, or greater than ``current_step`` (a
            version from the future: the engine reported a step its weights cannot come from). Each message names
            the row and the fix.
    """
    if raw is None:
        if required:
            raise ValueError(
                "max_policy_lag is set but the rollout_func returned no 'policy_version': without it every sample "
                "would be assumed fresh. Return 'policy_version' (one int per row: the trainer.state.global_step of "
                "the weights that generated it, e.g. VLLMCPURollout does), or unset max_policy_lag."
            )
        return torch.full((num_rows,), int(current_step), dtype=torch.int64)
    raw = list(raw)
    if len(raw) != num_rows:
        raise ValueError(f"policy_version has {len(raw)} entries for {num_rows} rows; return one per row.")
    lengths = [None] * num_rows if completion_lengths is None else list(completion_lengths)
    spans = [_row_version(i, v, n) for i, (v, n) in enumerate(zip(raw, lengths))]  # (oldest, newest) per row
    versions = [oldest for oldest, _ in spans]
    future = [i for i, (_, newest) in enumerate(spans) if newest > current_step]  # a token's version counts too
    if future:
        i = future[0]
        raise ValueError(
            f"policy_version of row {i} reaches {spans[i][1]}, ahead of the trainer's optimizer step {current_step} "
            f"({len(future)} such rows): a version is the trainer.state.global_step of the weights that generated "
            "the sample, never a later step. Report the step at which the engine's weights were synced."
        )
    return torch.tensor(versions, dtype=torch.int64)


def token_versions(
    raw: Optional[Sequence[VersionLike]], versions: torch.Tensor, width: int,
) -> Optional[torch.Tensor]:
    """(B, T) int64 policy version of each completion token, or None when no row spans a weight update.

    A rollout that spans a weight update reports one version per token; the lag split scores each token at its own
    version (issue 44: scoring a row at its oldest version made the "engine factor" of the tokens sampled after the
    update pure staleness). Rows given one int, and positions past a row's completion, hold the row's version.

    Args:
        raw: the ``policy_version`` that ``row_versions`` checked (None: no versions).
        versions: (B,) int64, ``row_versions(raw, ...)``.
        width: T, the padded completion length of the batch (>= every per-token list's length).

    Returns:
        (B, T) int64, or None when ``raw`` is None or every row's tokens share one version (then the row versions
        say everything, and nothing per token needs to travel).

    Raises:
        ValueError: a per-token list longer than ``width``.
    """
    if raw is None:
        return None
    rows = [None if _integer(v) is not None else [int(_integer(x)) for x in v] for v in raw]
    if not any(r is not None and min(r) != max(r) for r in rows):
        return None
    out = versions.to(torch.int64)[:, None].repeat(1, int(width))
    for i, tokens in enumerate(rows):
        if tokens is None:
            continue
        if len(tokens) > width:
            raise ValueError(f"policy_version of row {i} has {len(tokens)} per-token versions for a batch of "
                             f"{width} completion positions; give one version per completion token.")
        out[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
    return out


def _integer(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer scalar (int, NumPy integer, 0-d integer tensor; not a bool), else
    None (``operator.index`` refuses floats, strings and float tensors)."""
    if isinstance(value, bool) or (hasattr(value, "dtype") and "bool" in str(value.dtype)) or isinstance(
            value, (str, bytes)):
        return None
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _row_version(row: int, value: Any, length: Optional[int]) -> tuple[int, int]:
    """(oldest, newest) version of one row: equal for one int; the min and max of a per-token list."""
    give = "give the optimizer step as an int, or one int per completion token"
    if isinstance(value, bool):
        raise ValueError(f"policy_version of row {row} is a bool ({value}); {give}.")
    if isinstance(value, (str, bytes)):
        raise ValueError(f"policy_version of row {row} is the string {value!r}, not a step; {give}.")
    version = _integer(value)
    if version is None:
        try:
            tokens = list(value)
        except TypeError:
            raise ValueError(f"policy_version of row {row} is {value!r}; {give}.") from None
        ints = [_integer(v) for v in tokens]
        bad = next((j for j, v in enumerate(ints) if v is None), None)
        if bad is not None:
            raise ValueError(f"policy_version of row {row}, token {bad}, is {tokens[bad]!r}; {give}.")
        if not ints:
            raise ValueError(f"policy_version of row {row} is an empty per-token list; give the row's version.")
        if length is not None and len(ints) != int(length):
            raise ValueError(
                f"policy_version of row {row} has {len(ints)} per-token versions for its {int(length)} completion "
                "tokens; give one version per completion token, or one int for the row."
            )
        version = min(ints)  # a rollout spanning a weight update: its oldest token's version
        newest = max(ints)
    else:
        newest = version
    if version < 0:
        raise ValueError(f"policy_version of row {row} is {version}; versions are optimizer steps (>= 0).")
    return version, newest


def policy_lag(versions: torch.Tensor, current_step: int) -> torch.Tensor:
    """(B,) int64 lag in optimizer steps: ``current_step - versions`` (never negative for checked versions)."""
    return int(current_step) - versions.to(torch.int64)


def lag_keep(lags: torch.Tensor, max_policy_lag: Optional[int]) -> torch.Tensor:
    """(B,) bool: rows whose lag is at most ``max_policy_lag`` (all True when it is None)."""
    if max_policy_lag is None:
        return torch.ones_like(lags, dtype=torch.bool)
    return lags <= int(max_policy_lag)


def stale_row_keep(versions: Optional[torch.Tensor], current_step: int,
                   max_policy_lag: Optional[int]) -> Optional[torch.Tensor]:
    """``max_policy_lag``'s row rule at ``current_step``: the ``MaskContext.row_keep`` of the ``lag_rows`` mask step
    (``correction.mask_pipeline``) for the rows of ``versions``.

    Args:
        versions: (B,) int the rows' policy versions (``rollout_policy_version``), or None.
        current_step: the trainer's optimizer step now; a row's lag is ``current_step`` minus its version.
        max_policy_lag: the bound in optimizer steps; None: no filter.

    Returns:
        (B,) bool, rows whose lag is at most the bound; None without a bound or versions (every row kept).
    """
    if versions is None or max_policy_lag is None:
        return None
    return lag_keep(policy_lag(versions, current_step), max_policy_lag)


def drop_stale_rows(
    batch: Mapping[str, Any], loss_mask: torch.Tensor, current_step: int, max_policy_lag: Optional[int],
) -> tuple[Mapping[str, Any], Optional[torch.Tensor]]:
    """``max_policy_lag``'s filter of one micro-batch (``features.policy_lag.PolicyLag.before_loss``): the rows over
    the bound out of its loss mask, by the ``lag_rows`` step of the mask pipeline (``correction.mask_pipeline``) with
    ``stale_row_keep``'s rule, the one the bypass loss and its batch-normalisation window (``modes.bypass``) run too.

    Args:
        batch: the micro-batch's keys: ``rollout_policy_version`` (B,) int (none: nothing to filter), and
            ``rollout_rs_mask`` (B, T) when the decoupled correction made one.
        loss_mask: (B, T) 0/1, TRL's loss mask of ``batch`` (``trl_compat.loss_mask``).
        current_step: the trainer's optimizer step now; a row's lag is ``current_step`` minus its version.
        max_policy_lag: the bound in optimizer steps; None: no filter.

    Returns:
        ``(batch, keep)``: ``batch`` itself when every row is kept, else a shallow copy whose rows over the bound are
        out of the loss (decoupled: times the RS mask; bypass: ``tool_mask`` := ``loss_mask`` times the keep mask);
        ``keep`` (B,) bool, or None without a bound or versions.
    """
    keep = stale_row_keep(batch.get("rollout_policy_version"), current_step, max_policy_lag)
    if keep is None or bool(keep.all()):
        return batch, keep
    ctx = MaskContext(row_keep=keep)
    out = dict(batch)
    if "rollout_rs_mask" in out:
        out["rollout_rs_mask"] = lag_rows(out["rollout_rs_mask"], ctx)
    else:
        out["tool_mask"] = lag_rows(loss_mask, ctx)
    return out, keep


def lag_counts(lags: torch.Tensor, tokens: torch.Tensor, keep: Optional[torch.Tensor] = None) -> dict[str, tuple]:
    """Integer (numerator, denominator) counts of the lag metrics of one micro-batch, for an exact reduction.

    Args:
        lags: (B,) int64 lag of each row (optimizer steps).
        tokens: (B,) int64 loss tokens of each row (before the lag filter). Every row is a sample that was used,
            also one whose tokens are all masked (``mask_truncated_completions``): the row metrics count it, the
            token metrics weigh it by its (zero) tokens. (TRL's batches have no padding rows.)
        keep: (B,) bool, rows the ``max_policy_lag`` filter keeps; None: no filter (no ``dropped`` counts).

    Returns:
        name -> (numerator, denominator) as 0-d int64 tensors: ``policy_lag_mean`` (sum of row lags / rows),
        ``policy_lag_token_mean`` (sum of lag x tokens / tokens), ``policy_lag_fraction_<bucket>`` (rows in each
        of ``LAG_BUCKETS`` / rows) and, with ``keep``, ``policy_lag_dropped_fraction`` (rows) and
        ``policy_lag_dropped_token_fraction`` (tokens). Summed over micro-batches and ranks, then divided once.
    """
    tokens = tokens.to(torch.int64)
    rows = torch.ones_like(tokens, dtype=torch.bool)
    lags = lags.to(device=tokens.device, dtype=torch.int64)
    n_rows, n_tokens = rows.sum(), tokens.sum()
    counts = {
        "policy_lag_mean": (torch.where(rows, lags, 0).sum(), n_rows),
        "policy_lag_token_mean": ((lags * tokens).sum(), n_tokens),
    }
    for name, low, high in LAG_BUCKETS:
        inside = (lags >= low) if high is None else (lags >= low) & (lags <= high)
        counts[f"policy_lag_fraction_{name}"] = ((inside & rows).sum(), n_rows)
    if keep is not None:
        dropped = rows & ~keep.to(rows.device)
        counts["policy_lag_dropped_fraction"] = (dropped.sum(), n_rows)
        counts["policy_lag_dropped_token_fraction"] = (torch.where(dropped, tokens, 0).sum(), n_tokens)
    return counts


def masked_lag_max(lags: torch.Tensor) -> torch.Tensor:
    """0-d int64: the largest lag of the rows (-1 for no row, so that a max reduction ignores it)."""
    if lags.numel() == 0:
        return torch.tensor(-1, dtype=torch.int64)
    return lags.to(torch.int64).max()


@dataclass(frozen=True)
class WeightSchedule:
    """When a rollout engine takes the learner's weights: every ``sync_interval`` optimizer steps, or
    ``async_depth`` steps behind the learner.

    * ``sync_interval = k`` (>= 1): the engine syncs at its first generation and then at the first generation at
      least k optimizer steps after its last sync; it generates with the weights of its last sync (k = 1: every
      step, the synchronous default). The throughput trade of verl/SkyRL-style delayed sync.
    * ``async_depth = d`` (>= 1): the engine generates step s's batch with the weights published at step
      ``s - d`` (the newest published version ``<= s - d``; before any, the oldest), as a generator that runs d
      steps ahead of the learner does (the lag of fully asynchronous GRPO with a queue of depth d). The lag is d
      exactly when every step's weights are published (``VLLMCPURollout`` publishes after every optimizer step,
      so also with ``steps_per_generation > 1``); with gaps it is the newest one's.

    Attributes:
        sync_interval: optimizer steps between syncs (>= 1).
        async_depth: optimizer steps the engine's weights trail the learner by (>= 0; 0: off).

    Raises:
        ValueError: a non-int or out-of-range value, or both set (``sync_interval > 1`` with ``async_depth > 0``).
    """

    sync_interval: int = 1
    async_depth: int = 0

    def __post_init__(self):
        for name, low in (("sync_interval", 1), ("async_depth", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
        if self.sync_interval > 1 and self.async_depth > 0:
            raise ValueError(
                f"sync_interval={self.sync_interval} and async_depth={self.async_depth} are two ways to delay the "
                "engine's weights; set one of them."
            )

    def needs_sync(self, step: int, last_synced: Optional[int]) -> bool:
        """Sync mode: whether the engine takes the current weights before generating at ``step``."""
        return last_synced is None or step - last_synced >= self.sync_interval

    def async_version(self, step: int, published: Sequence[int]) -> int:
        """Async mode: the version to generate with at ``step``, among the ``published`` versions (ascending).

        Raises:
            ValueError: nothing was published.
        """
        if not published:
            raise ValueError("async_version: no weights were published yet.")
        eligible = [v for v in published if v <= step - self.async_depth]
        return eligible[-1] if eligible else published[0]
