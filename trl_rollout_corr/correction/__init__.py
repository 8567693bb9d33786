"""Rollout correction: importance-sampling (IS) weights, rejection-sampling (RS) masks and their metrics.

Pure tensor math on ``(B, T)`` inputs; no TRL, no ``torch.distributed``. One module per concept:

* ``api``: ``compute_rollout_correction`` (the steps in order), ``make_correction_fn``,
  ``compiled_rollout_correction``;
* ``weights``: IS weights (token / sequence, TIS, IcePop, batch normalisation) and ``rollout_is_*``;
* ``rejection``: RS masks (k1/k2/k3 x token / seq_sum / seq_mean / seq_max, KPop's token binary KL) and
  ``rollout_rs_*``; ``binary_kl``: the Bernoulli KL of KPop; ``m2po``: M2PO's step-global second-moment mask;
* ``diagnostics``: the off-policy metrics (``kl``, ``k3_kl``, perplexities, chi2); ``counts``: the denominators;
* ``workspace``: the cleaned inputs and work buffers; ``reduce``: the batched reduction engine;
  ``stats``: ``CorrectionStats`` (merge / reduce / finalise) and the read view; ``layout``: ``MetricLayout``;
* ``decomposition``: engine / update / direct ratios.

Each family gathers its statistics and finalises its metrics in the same file.
"""

from .api import (
    CorrectionFn,
    RolloutCorrectionOutput,
    compiled_rollout_correction,
    compute_rollout_correction,
    make_correction_fn,
)
from .decomposition import RatioDecomposition, ratio_decomposition
from .layout import DEFAULT_LENGTH_BUCKETS, MetricLayout
from .stats import CorrectionStats
from .weights import AllReduce
from .workspace import SAFETY_BOUND

__all__ = [
    "AllReduce",
    "CorrectionFn",
    "CorrectionStats",
    "DEFAULT_LENGTH_BUCKETS",
    "MetricLayout",
    "RatioDecomposition",
    "RolloutCorrectionOutput",
    "SAFETY_BOUND",
    "compiled_rollout_correction",
    "compute_rollout_correction",
    "make_correction_fn",
    "ratio_decomposition",
]
