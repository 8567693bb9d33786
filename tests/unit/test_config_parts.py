"""Each part checks its own part of the config (issue 48): every feature's and mode's ``check_config`` is reached by a
fault in its own fields, and a config with two faults in different parts always reports the same first one (the part
first in ``RolloutCorrGRPOConfig.__post_init__``'s order: ``features.FEATURES``, then the mode, then
``trainer_config``'s own cross-part checks), whatever order its fields are given in."""

from __future__ import annotations

import inspect
import itertools

import pytest

from trl_rollout_corr import trainer_config
from trl_rollout_corr.features import FEATURES
from trl_rollout_corr.hooks import CorrectionMode, Feature
from trl_rollout_corr.modes import BypassMode, DecoupledMode, DiagnosticsMode

TRAINER_CONFIG = "trainer_config"  # the checks that span parts or concern the engines, run after every part's
BYPASS = {"bypass_mode": True}
DECOUPLED = {"rollout_is": "token"}

# part -> (a fault in its fields alone, with the correction context it needs, the start of its message)
FAULTS = {
    "BehaviourLogProbs": ({"rollout_generate_dtype": "int8"}, "RolloutCorrGRPOConfig: rollout_generate_dtype must be"),
    "PolicyLag": ({"max_policy_lag": -1}, "RolloutCorrGRPOConfig: max_policy_lag must be an int >= 0"),
    "RoutingReplay": ({"routing_replay": "r4"}, "RolloutCorrGRPOConfig: routing_replay must be one of"),
    "SupportMatching": ({"rollout_support_matching": "bogus"}, "rollout_support_matching must be one of"),
    "LagSplit": ({"policy_lag_split": True, **BYPASS}, "RolloutCorrGRPOConfig: policy_lag_split needs pi_old"),
    "SkipEmptySteps": ({"skip_empty_steps": True}, "RolloutCorrGRPOConfig: skip_empty_steps skips the optimizer"),
    "RolloutRecords": ({"rollout_dump_every": 0}, "RolloutCorrGRPOConfig: rollout_dump_every must be an integer"),
    "DecoupledMode": ({"rollout_is_batch_normalize": True, "gradient_accumulation_steps": 2,
                       "steps_per_generation": 4, "num_iterations": 1, **DECOUPLED},
                      "RolloutCorrGRPOConfig: rollout_is_batch_normalize=True in decoupled mode"),
    "BypassMode": ({"entropy_coef": 0.1, **BYPASS},
                   "RolloutCorrGRPOConfig: bypass_mode=True replaces TRL's loss and does not support entropy_coef"),
    TRAINER_CONFIG: ({"rollout_async_depth": -1}, "RolloutCorrGRPOConfig: rollout_async_depth must be an int >= 0"),
}
# faults that hold together under bypass mode (a correction configured), one per part, for the two-fault configs
BYPASS_FAULTS = {
    **{name: FAULTS[name][0] for name in ("BehaviourLogProbs", "PolicyLag", "RoutingReplay", "SupportMatching",
                                           "LagSplit", "RolloutRecords", "BypassMode", TRAINER_CONFIG)},
    "SkipEmptySteps": {"skip_empty_steps": True, "fp16": True},  # the fp16 refusal (a correction is configured)
}
ORDER = [cls.__name__ for cls in FEATURES] + ["BypassMode", TRAINER_CONFIG]


def _parts_with_checks() -> list[type]:
    modes = (DiagnosticsMode, DecoupledMode, BypassMode)
    return [cls for cls in (*FEATURES, *modes) if "check_config" in vars(cls)]


def _raised_in(excinfo) -> str:
    """The part whose ``check_config`` raised (its class name), else ``trainer_config``."""
    frames = [entry.frame for entry in excinfo.traceback]
    for frame in reversed(frames):
        cls = frame.f_locals.get("cls")
        if frame.code.name == "check_config" and isinstance(cls, type) and issubclass(cls, (Feature, CorrectionMode)):
            return cls.__name__
    return TRAINER_CONFIG


def _message(make_args, tmp_path, fields: dict) -> tuple[str, str]:
    with pytest.raises(ValueError) as excinfo:
        make_args(tmp_path, **fields)
    return str(excinfo.value), _raised_in(excinfo)


def test_every_part_with_a_check_has_a_fault_here():
    assert {cls.__name__ for cls in _parts_with_checks()} | {TRAINER_CONFIG} == set(FAULTS)
    assert set(BYPASS_FAULTS) == set(ORDER) - {"DecoupledMode"}


@pytest.mark.parametrize("part", sorted(FAULTS))
def test_each_parts_check_is_reached_by_its_own_fault(part, tmp_path, make_args):
    fields, start = FAULTS[part]
    message, raised_by = _message(make_args, tmp_path, fields)
    assert message.startswith(start), message
    assert raised_by == part


def test_fp16_refusal_of_skip_empty_steps_is_its_own(tmp_path, make_args):
    message, raised_by = _message(make_args, tmp_path, {**BYPASS_FAULTS["SkipEmptySteps"], **BYPASS})
    assert message.startswith("RolloutCorrGRPOConfig: skip_empty_steps with fp16: a skipped step"), message
    assert raised_by == "SkipEmptySteps"


@pytest.mark.parametrize("first, second", list(itertools.combinations([p for p in ORDER if p in BYPASS_FAULTS], 2)))
def test_two_faults_always_report_the_first_part_in_order(first, second, tmp_path, make_args):
    """``first`` comes before ``second`` in the check order: a config with both faults raises ``first``'s error,
    whichever order the fields are given in (and the same message as ``first``'s fault alone)."""
    alone, _ = _message(make_args, tmp_path, {**BYPASS, **BYPASS_FAULTS[first]})
    for fields in ({**BYPASS, **BYPASS_FAULTS[first], **BYPASS_FAULTS[second]},
                   {**BYPASS_FAULTS[second], **BYPASS_FAULTS[first], **BYPASS},
                   dict(reversed(list({**BYPASS, **BYPASS_FAULTS[first], **BYPASS_FAULTS[second]}.items())))):
        message, raised_by = _message(make_args, tmp_path, fields)
        assert (raised_by, message) == (first, alone)


def test_check_order_is_the_feature_tuple_then_the_mode_then_trainer_config():
    """The order the two-fault test checks is the one ``__post_init__`` runs (read from its source)."""
    source = inspect.getsource(trainer_config.RolloutCorrGRPOConfig.__post_init__)
    calls = ["GRPOConfig.__post_init__(self)", "features.check_config(self, correction)",
             "modes.check_config(self, correction)", "self._check_vllm_engine()", "self._check_async()",
             "self._check_keep_rejected(correction)"]
    assert [source.index(call) for call in calls] == sorted(source.index(call) for call in calls)
