"""RolloutCorrectionConfig: validation at construction, presets, threshold parsing."""

import math

import pytest

from trl_rollout_corr import PRESETS, RolloutCorrectionConfig
from trl_rollout_corr.config import parse_is_threshold, parse_rs_options, parse_rs_thresholds


def test_defaults_are_disabled():
    cfg = RolloutCorrectionConfig()
    assert not cfg.enabled and cfg.is_bounds is None and cfg.rs_specs == ()


@pytest.mark.parametrize(
    "spec, lower, upper",
    [(2.0, None, 2.0), (3, None, 3.0), ("2.5", None, 2.5), (" 0.5_5.0 ", 0.5, 5.0), ((0.8, 1.2), 0.8, 1.2), ("1_1", 1.0, 1.0)],
)
def test_is_threshold_parsing(spec, lower, upper):
    b = parse_is_threshold(spec)
    assert (b.lower, b.upper) == (lower, upper)
    assert b.is_icepop == (lower is not None)


@pytest.mark.parametrize(
    "spec, exc, match",
    [
        (True, TypeError, "boolean"),
        (0, ValueError, "upper bound must be positive"),
        (-1.0, ValueError, "upper bound must be positive"),
        ("0_2", ValueError, "lower bound must be positive"),
        ("3_2", ValueError, "above the upper bound"),
        ("", ValueError, "empty"),
        ("abc", ValueError, "cannot parse"),
        ("nan", ValueError, "cannot parse"),
        ({"a": 1}, TypeError, "unsupported type"),
        ((1.0, 2.0, 3.0), ValueError, "two numbers"),
    ],
)
def test_is_threshold_errors_name_the_field(spec, exc, match):
    with pytest.raises(exc, match=match) as info:
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=spec)
    assert "rollout_is_threshold" in str(info.value)


def test_rollout_is_invalid_level_and_missing_threshold():
    with pytest.raises(ValueError, match="rollout_is must be None, 'token' or 'sequence'"):
        RolloutCorrectionConfig(rollout_is="geometric")
    with pytest.raises(ValueError, match="needs rollout_is_threshold"):
        RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=None)
    with pytest.raises(ValueError, match="rollout_is_batch_normalize"):
        RolloutCorrectionConfig(rollout_is_batch_normalize=True)
    with pytest.raises(ValueError, match="bypass_loss_type"):
        RolloutCorrectionConfig(bypass_loss_type="ppo")
    with pytest.raises(TypeError, match="bypass_mode must be a bool"):
        RolloutCorrectionConfig(bypass_mode="yes")


def test_rs_options_dedup_and_errors():
    assert parse_rs_options(" token_k1, ,seq_max_k3,token_k1") == ("token_k1", "seq_max_k3")
    with pytest.raises(ValueError, match="unknown option 'seq_max_k1'"):
        parse_rs_options("seq_max_k1")
    with pytest.raises(ValueError, match="at least one option"):
        parse_rs_options(" , ")
    with pytest.raises(ValueError, match="comma-separated string"):
        parse_rs_options(3)


def test_rs_thresholds():
    k1, k3 = parse_rs_thresholds(("token_k1", "seq_mean_k3"), "0.5_2.0, 0.01")
    assert (k1.lower, k1.upper, k1.level, k1.stat) == (0.5, 2.0, "token", "k1")
    assert (k3.lower, k3.upper, k3.level, k3.stat) == (None, 0.01, "seq_mean", "k3")
    # single number u for k1 means [1/u, u]; one spec is shared by every option
    (a,) = parse_rs_thresholds(("seq_sum_k1",), 4.0)
    assert (a.lower, a.upper) == (0.25, 4.0)
    # the k1 statistic bounds keep exactly the ratio band written (deliberate difference from verl)
    (b,) = parse_rs_thresholds(("token_k1",), "0.5_1.5")
    lo, hi = b.stat_bounds
    assert lo == pytest.approx(-math.log(1.5)) and hi == pytest.approx(-math.log(0.5))


@pytest.mark.parametrize(
    "options, spec, exc, match",
    [
        (("token_k1",), None, ValueError, "must be set when rollout_rs is set"),
        (("token_k1", "token_k2"), "1_2,0.1,0.2", ValueError, "3 specs but rollout_rs has 2"),
        (("token_k2",), "0.1_0.2", ValueError, "single upper bound"),
        (("token_k2",), -0.1, ValueError, "must be positive"),
        (("token_k1",), "2_1", ValueError, "above the upper bound"),
        (("token_k1",), True, TypeError, "boolean"),
        (("token_k1",), [1, 2], TypeError, "unsupported type"),
        (("token_k1",), " , ", ValueError, "at least one threshold"),
    ],
)
def test_rs_threshold_errors(options, spec, exc, match):
    with pytest.raises(exc, match=match):
        parse_rs_thresholds(options, spec)


def test_rs_errors_raised_at_construction():
    with pytest.raises(ValueError, match="rollout_rs_threshold must be set"):
        RolloutCorrectionConfig(rollout_rs="token_k1")
    cfg = RolloutCorrectionConfig(rollout_rs="token_k1,token_k1,seq_max_k2", rollout_rs_threshold="2.0,0.3")
    assert [s.option for s in cfg.rs_specs] == ["token_k1", "seq_max_k2"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    cfg = RolloutCorrectionConfig.from_preset(name)
    assert isinstance(cfg, RolloutCorrectionConfig)
    assert cfg.bypass_mode == name.startswith(("bypass", "direct"))


def test_preset_values():
    c = RolloutCorrectionConfig.decoupled_token_icepop()
    assert (c.rollout_is, c.is_bounds.lower, c.is_bounds.upper) == ("token", 0.5, 5.0)
    c = RolloutCorrectionConfig.bypass_pg_is()
    assert (c.rollout_is, c.bypass_mode, c.bypass_loss_type) == ("sequence", True, "reinforce")
    c = RolloutCorrectionConfig.decoupled_k3_rs_token_tis(rs_threshold=0.005)
    assert c.rs_specs[0].option == "seq_mean_k3" and c.rs_specs[0].upper == 0.005
    c = RolloutCorrectionConfig.direct_double_sided(0.2, 0.28)
    assert c.bypass_mode and c.bypass_loss_type == "reinforce" and c.rollout_is == "token"
    assert (c.is_bounds.lower, c.is_bounds.upper) == pytest.approx((0.8, 1.28))
    with pytest.raises(ValueError, match="eps_low"):
        RolloutCorrectionConfig.direct_double_sided(1.0, 0.2)
    with pytest.raises(ValueError, match="Unknown rollout-correction preset 'nope'"):
        RolloutCorrectionConfig.from_preset("nope")


def test_to_dict_round_trip():
    cfg = RolloutCorrectionConfig.decoupled_k3_rs_token_tis()
    again = RolloutCorrectionConfig(**cfg.to_dict())
    assert again == cfg and again.rs_specs == cfg.rs_specs


@pytest.mark.parametrize("spec", ["0.5_1_2", "1_2_3", "inf", "0.5_nan", (1.0, float("inf")), (0.5, 1e400)])
def test_threshold_strings_and_pairs_must_be_plain_finite_numbers(spec):
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        parse_is_threshold(spec)


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    assert parse_is_threshold(np.float32(2.0)).upper == 2.0


def test_single_k1_threshold_below_one_is_an_error():
    with pytest.raises(ValueError, match="needs u >= 1"):
        parse_rs_thresholds(("token_k1",), 0.5)
