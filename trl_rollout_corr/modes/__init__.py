"""The correction modes: exactly one per trainer owns the scoring of a generation batch and the loss.

``DiagnosticsMode`` (no correction: TRL's GRPO, statistics on the side), ``DecoupledMode`` (the correction once per
generation batch, TRL's loss) and ``BypassMode`` (the correction inside the loss, pi_old := mu).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hooks import CorrectionMode
from .bypass import BypassMode
from .decoupled import DecoupledMode
from .diagnostics import DiagnosticsMode

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

__all__ = ["BypassMode", "DecoupledMode", "DiagnosticsMode", "build_mode", "check_config", "mode_class"]


def mode_class(correction) -> type[CorrectionMode]:
    """The mode of a ``RolloutCorrectionConfig``: none enabled -> diagnostics; ``bypass_mode`` -> bypass; else
    decoupled."""
    if not correction.enabled:
        return DiagnosticsMode
    return BypassMode if correction.bypass_mode else DecoupledMode


def check_config(args, correction) -> None:
    """The config's own mode's ``check_config`` (``RolloutCorrGRPOConfig``, after every feature's)."""
    mode_class(correction).check_config(args, correction)


def build_mode(trainer: "RolloutCorrGRPOTrainer") -> CorrectionMode:
    """The trainer's one correction mode, from ``trainer.rollout_correction``."""
    return mode_class(trainer.rollout_correction)(trainer)
