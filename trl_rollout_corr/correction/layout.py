"""``MetricLayout``: the static description of one correction's metric set, and the order of finalisation.

The layout is what a configuration means to the math (IS level and bounds, batch normalisation, RS options,
length buckets), frozen and comparable: parts of ``CorrectionStats`` merge only when their layouts are equal.
It derives the workspace ``Needs`` once, and finalises the merged statistics family by family.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from . import counts, diagnostics, rejection, weights
from .stats import StatView
from .workspace import Needs

DEFAULT_LENGTH_BUCKETS = (64, 256, 1024)  # response-length slice edges, in valid tokens per row


def check_length_buckets(edges: Sequence[int]) -> tuple[int, ...]:
    """The response-length slice edges as a tuple of ints, checked (the one rule for every caller: the trainer's
    metrics, ``analyze --length-buckets``).

    Args:
        edges: strictly increasing positive token counts (valid tokens per row), e.g. ``(64, 256, 1024)``; ``()``
            for no slices.

    Raises:
        ValueError: an edge that is not an int (bools refused), not positive, or not above the previous one.
    """
    edges = tuple(edges)
    if any(isinstance(e, bool) or not isinstance(e, int) for e in edges):
        raise ValueError(f"length_buckets must be ints (token counts), got {edges}.")
    if any(b <= a for a, b in zip(edges, edges[1:])) or any(e <= 0 for e in edges):
        raise ValueError(f"length_buckets must be strictly increasing positive token counts (e.g. 64,256,1024), "
                         f"got {edges}.")
    return edges


@dataclass(frozen=True)
class MetricLayout:
    """What one correction computes.

    Attributes:
        is_level: ``None``, ``"token"`` or ``"sequence"``.
        is_bounds: the parsed IS threshold (``ISBounds``), None without IS.
        is_batch_normalize: IS batch normalisation on.
        rs_specs: the parsed RS options (``RSSpec``), in order; ``()`` without RS.
        length_buckets: increasing response-length edges for the ``len_{lo}_{hi}/`` slices; ``()`` for none.
        rs_on: the ratio RS judges: ``"direct"`` (the correction's own ``pi_train / mu``) or ``"engine"`` (the lag
            split's engine factor ``pi_train@v / mu``, passed as ``rs_log_probs``; the RS metrics are then named
            ``rollout_rs_engine_*``).
        needs: the derived per-token quantities the workspace must prepare (computed; not compared).

    Raises:
        ValueError: for length buckets that are not increasing positive token counts.
    """

    is_level: Optional[str] = None
    is_bounds: Any = None
    is_batch_normalize: bool = False
    rs_specs: tuple = ()
    length_buckets: tuple[int, ...] = ()
    rs_on: str = "direct"
    needs: Needs = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_length_buckets(self.length_buckets)
        flags = rejection.needs(self.rs_specs)
        flags["x_range"] |= self.is_level == "token" and not self.is_bounds.is_icepop  # TIS W extrema from x
        object.__setattr__(self, "needs", Needs(**flags))

    @classmethod
    def from_config(cls, config, length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS) -> "MetricLayout":
        """The layout of a validated ``RolloutCorrectionConfig`` (cached: layouts are immutable values)."""
        return _layout(config.rollout_is if config.is_enabled else None, config.is_bounds,
                       bool(config.rollout_is_batch_normalize), tuple(config.rs_specs), tuple(length_buckets),
                       getattr(config, "rollout_rs_on", "direct") if config.rs_enabled else "direct")

    @functools.cached_property
    def bucket_prefixes(self) -> tuple[str, ...]:
        """``len_{lo}_{hi}/`` per length bucket, the last one open (``len_{lo}_inf/``)."""
        edges = self.length_buckets
        if not edges:
            return ()
        bounds = (0, *edges, "inf")
        return tuple(f"len_{bounds[j]}_{bounds[j + 1]}/" for j in range(len(edges) + 1))

    def finalize(self, v: StatView) -> dict[str, float]:
        """Every metric from merged statistics (host side, float64): IS, RS, off-policy (verl's order), the
        length slices, then the counts. Names without the ``rollout_corr/`` prefix.

        A statistic over no valid token is absent, never 0 (``docs/how-to/read-the-metrics.md``, "Steps with no rows"):
        with
        ``num_valid_tokens == 0`` only the counts are returned, and a length slice without a valid token has only
        its ``num_seqs`` (0); so a mean of a metric over the logged steps is the mean over the steps with rows."""
        n_tok, n_seq = v.sum(counts.N_TOK), v.sum(counts.N_SEQ)
        m: dict[str, float] = {}
        if n_tok > 0:
            if self.is_level is not None:
                m.update(weights.finalize(v, self, n_tok, n_seq))
            if self.rs_specs:
                m.update(rejection.finalize(v, self, n_tok, n_seq))
            m.update(diagnostics.finalize(v, n_tok, n_seq))
        for j, prefix in enumerate(self.bucket_prefixes):
            n_j = v.sum(counts.N_TOK, j)
            if n_j <= 0:
                m[prefix + "num_seqs"] = v.sum(counts.N_SEQ, j)
                continue
            part = diagnostics.finalize_bucket(v, j, n_j)
            if self.rs_specs:
                part.update(rejection.finalize_bucket(v, j, n_j, self.rs_on))
            if self.is_level is not None:
                part.update(weights.finalize_bucket(v, j, n_j))
            m.update({prefix + k: value for k, value in part.items()})
        m.update(counts.finalize(v))
        return m


@functools.lru_cache(maxsize=256)
def _layout(is_level, is_bounds, is_batch_normalize, rs_specs, length_buckets, rs_on="direct") -> MetricLayout:
    return MetricLayout(is_level, is_bounds, is_batch_normalize, rs_specs, tuple(int(e) for e in length_buckets),
                        rs_on)
