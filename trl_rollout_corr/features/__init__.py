"""The trainer-side features, one module each, in the one order the trainer calls them (``hooks.py``, rules 1-3).

Adding a feature: one module with a ``hooks.Feature`` subclass, one line in ``FEATURES``
(``docs/explanation/architecture.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hooks import Feature, Features
from .behaviour import BehaviourLogProbs
from .empty_steps import SkipEmptySteps
from .lag_split import LagSplit
from .policy_lag import PolicyLag
from .rollout_records import RolloutRecords
from .routing_replay import RoutingReplay
from .support_matching import SupportMatching

if TYPE_CHECKING:
    from ..trainer import RolloutCorrGRPOTrainer

FEATURES: tuple[type[Feature], ...] = (
    BehaviourLogProbs,  # always: mu exists before anything reads it
    PolicyLag,          # always: versions and keep_rows ready before the mode scores the batch
    RoutingReplay,      # routing_replay="r3": its replay encloses support scoring in every forward
    SupportMatching,    # always (sampler contract); matching when rollout_support_matching != "off"
    LagSplit,           # policy_lag_split
    SkipEmptySteps,     # skip_empty_steps: counts each micro-batch's tokens with gradient (after_loss)
    RolloutRecords,     # rollout_dump_dir: last, so nothing is written before every other part accepted the setup
)

__all__ = ["FEATURES", "BehaviourLogProbs", "LagSplit", "PolicyLag", "RolloutRecords", "RoutingReplay",
           "SkipEmptySteps", "SupportMatching", "build_features", "check_config", "check_trainer_args"]


def check_config(args, correction) -> None:
    """Every feature's ``check_config``, in ``FEATURES`` order, present or not (``RolloutCorrGRPOConfig``)."""
    for cls in FEATURES:
        cls.check_config(args, correction)


def check_trainer_args(args, trainer_args) -> None:
    """Every present feature's ``check_trainer_args``, in ``FEATURES`` order (before TRL loads anything)."""
    for cls in FEATURES:
        if cls.wanted(args):
            cls.check_trainer_args(args, trainer_args)


def build_features(trainer: "RolloutCorrGRPOTrainer") -> Features:
    """The features present for ``trainer.args``, built in ``FEATURES`` order (each may refuse the setup)."""
    return Features([cls(trainer) for cls in FEATURES if cls.wanted(trainer.args)])
