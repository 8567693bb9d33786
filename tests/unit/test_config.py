"""RolloutCorrectionConfig: validation at construction, presets, threshold parsing; the field table, the frozen core
config and the flat RolloutCorrectionArguments."""

import copy
import dataclasses
import math
import pickle
import typing

import pytest

from trl_rollout_corr import PRESETS, RolloutCorrectionConfig
from trl_rollout_corr.config import (
    CORRECTION_FIELD_TABLE,
    CORRECTION_FIELDS,
    RolloutCorrectionArguments,
    markdown_table,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)


def test_defaults_are_disabled():
    cfg = RolloutCorrectionConfig()
    assert not cfg.enabled and cfg.is_bounds is None and cfg.rs_specs == ()


@pytest.mark.parametrize(
    "spec, lower, upper",
    [(2.0, None, 2.0), (3, None, 3.0), ("2.5", None, 2.5), (" 0.5_5.0 ", 0.5, 5.0), ((0.8, 1.2), 0.8, 1.2),
     ("1_1", 1.0, 1.0)],
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


# ---------------------------------------------------------------------------------------------- one field table
def test_both_dataclasses_take_their_fields_from_the_table():
    core = {f.name: f for f in dataclasses.fields(RolloutCorrectionConfig) if f.init}
    flat = {f.name: f for f in dataclasses.fields(RolloutCorrectionArguments)}
    assert tuple(core) == CORRECTION_FIELDS == tuple(f.name for f in CORRECTION_FIELD_TABLE)
    assert tuple(flat) == ("rollout_corr_preset",) + CORRECTION_FIELDS
    core_hints = typing.get_type_hints(RolloutCorrectionConfig)
    flat_hints = typing.get_type_hints(RolloutCorrectionArguments)
    for row in CORRECTION_FIELD_TABLE:
        assert core[row.name].default == row.default and core_hints[row.name] == row.type
        assert flat[row.name].default is None and flat_hints[row.name] == typing.Optional[row.flag_type]
        assert core[row.name].metadata["help"] == flat[row.name].metadata["help"] == row.help
        assert row.name in RolloutCorrectionConfig.__doc__ and row.help in RolloutCorrectionArguments.__doc__
    assert RolloutCorrectionConfig() == RolloutCorrectionConfig(**{r.name: r.default for r in CORRECTION_FIELD_TABLE})


def test_markdown_table_has_one_item_per_field():
    text = markdown_table()
    items = [line for line in text.splitlines() if line.startswith("* ")]
    assert [i[3:].split("`")[0] for i in items] == [f.name for f in CORRECTION_FIELD_TABLE]
    assert text.startswith('* `rollout_is` (default `None`; values: `None`, `"token"`, `"sequence"`): IS weight '
                           "level. Token: `R_t = exp(clamp(l_t,\n  ±20))`; sequence:")
    assert '\n* `bypass_loss_type` (default `"ppo_clip"`; values: `"ppo_clip"`, `"reinforce"`): Bypass loss:' in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_presets_are_registered_where_they_are_defined():
    assert len(PRESETS) == len(set(PRESETS)) == 22 and PRESETS[0] == "disabled"
    for name in PRESETS:
        assert isinstance(RolloutCorrectionConfig.__dict__[name], classmethod)
    assert not hasattr(RolloutCorrectionConfig, "preset_names")


# ---------------------------------------------------------------------------------------------- frozen core config
def test_core_config_is_frozen_and_derived_fields_never_go_stale():
    cfg = RolloutCorrectionConfig.decoupled_k3_rs_token_tis()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout_is = "sequence"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.is_bounds = None
    changed = dataclasses.replace(cfg, rollout_is_threshold="0.5_3.0", rollout_rs="token_k1", rollout_rs_threshold=2.0)
    assert (changed.is_bounds.lower, changed.is_bounds.upper) == (0.5, 3.0)
    assert [(s.option, s.lower, s.upper) for s in changed.rs_specs] == [("token_k1", 0.5, 2.0)]
    assert cfg.is_bounds.upper == 2.0 and cfg.rs_specs[0].option == "seq_mean_k3"  # the original is untouched
    with pytest.raises(ValueError, match="rollout_is must be None"):
        dataclasses.replace(cfg, rollout_is="geometric")  # replace validates again
    with pytest.raises(ValueError, match="rollout_rs_threshold=0.01 is set but rollout_rs is off"):
        dataclasses.replace(cfg, rollout_rs="null")  # the threshold would be ignored (issue 22)
    # the "none" sentinels still mean None
    off = dataclasses.replace(cfg, rollout_is="none", rollout_rs="null", rollout_rs_threshold=None)
    assert off.rollout_is is None and off.rollout_rs is None and off.is_bounds is None and off.rs_specs == ()


def test_core_config_survives_pickle_deepcopy_and_hashing():
    cfg = RolloutCorrectionConfig.direct_double_sided(0.2, 0.28)
    for again in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), copy.copy(cfg)):
        assert again == cfg and again.is_bounds == cfg.is_bounds and again.rs_specs == cfg.rs_specs
        with pytest.raises(dataclasses.FrozenInstanceError):
            again.bypass_mode = False
    assert hash(RolloutCorrectionConfig.decoupled_k3_rs()) == hash(RolloutCorrectionConfig.decoupled_k3_rs())
    assert cfg.to_dict() == {**RolloutCorrectionConfig().to_dict(), "rollout_is": "token",
                             "rollout_is_threshold": (0.8, 1.28), "bypass_mode": True, "bypass_loss_type": "reinforce"}


# ---------------------------------------------------------------------------------------------- flat arguments
def test_flat_arguments_resolve_the_preset_and_keep_effective_values():
    args = RolloutCorrectionArguments(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs_threshold="0.005")
    assert (args.rollout_is, args.rollout_is_threshold, args.rollout_rs, args.rollout_rs_threshold) == (
        "token", "2.0", "seq_mean_k3", "0.005")
    assert args.rollout_correction() == args.resolve()  # resolving the effective fields again changes nothing
    preset = RolloutCorrectionConfig.decoupled_k3_rs_token_tis(rs_threshold=0.005)
    assert (args.resolve().is_bounds, args.resolve().rs_specs) == (preset.is_bounds, preset.rs_specs)
    off = RolloutCorrectionArguments(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_is="none")
    assert off.rollout_is == "none" and not off.rollout_correction().is_enabled
    again = RolloutCorrectionArguments(**{f.name: getattr(off, f.name) for f in dataclasses.fields(off)})
    assert again == off and again.rollout_correction() == off.rollout_correction()
    plain = RolloutCorrectionArguments()
    assert plain.rollout_is is None and plain.rollout_rs is None and plain.rollout_is_threshold == "2.0"
    with pytest.raises(ValueError, match="Unknown rollout-correction preset"):
        RolloutCorrectionArguments(rollout_corr_preset="nope")


def test_flat_arguments_parse_from_the_command_line():
    transformers = pytest.importorskip("transformers")
    (args,) = transformers.HfArgumentParser((RolloutCorrectionArguments,)).parse_args_into_dataclasses(
        ["--rollout_corr_preset", "bypass_pg_is", "--rollout_is_threshold", "0.5_5", "--bypass_mode", "true"]
    )
    cfg = args.rollout_correction()
    assert cfg.bypass_mode and cfg.bypass_loss_type == "reinforce" and (cfg.is_bounds.lower, cfg.is_bounds.upper) == (
        0.5, 5.0)


# ---------------------------------------------------------------------------------------------- strict settings
@pytest.mark.parametrize("fields, name", [
    (dict(rollout_rs_threshold="0.01"), "rollout_rs_threshold"),
    (dict(rollout_is_threshold="3"), "rollout_is_threshold"),
    (dict(bypass_loss_type="reinforce"), "bypass_loss_type"),
    (dict(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs="none", rollout_rs_threshold="0.05"),
     "rollout_rs_threshold"),
    (dict(rollout_corr_preset="decoupled_token_is", rollout_is="none", rollout_is_threshold="5"),
     "rollout_is_threshold"),
    (dict(rollout_corr_preset="bypass_pg_is", bypass_mode=False, bypass_loss_type="ppo_clip"), "bypass_loss_type"),
])
def test_a_setting_without_its_option_is_an_error_naming_it(fields, name):
    """Before issue 9 ``rollout_rs_threshold`` without ``rollout_rs`` (and the others) were silently ignored."""
    with pytest.raises(ValueError, match=f"{name}=.* is set but .* is off, so it would be ignored"):
        RolloutCorrectionArguments(**fields)


@pytest.mark.parametrize("fields, name", [
    (dict(rollout_rs_threshold="0.01"), "rollout_rs_threshold"),
    (dict(rollout_rs_threshold=0.05, rollout_rs="none"), "rollout_rs_threshold"),
    (dict(rollout_is_threshold=3.0), "rollout_is_threshold"),
    (dict(bypass_loss_type="reinforce"), "bypass_loss_type"),
])
def test_the_core_config_refuses_a_setting_without_its_option(fields, name):
    """Issue 22: ``RolloutCorrectionConfig(rollout_rs_threshold=...)`` without ``rollout_rs`` was accepted (and the
    threshold ignored) although the flat arguments refused it; the same rule now holds in both."""
    with pytest.raises(ValueError, match=f"{name}=.* is set but .* is off, so it would be ignored"):
        RolloutCorrectionConfig(**fields)
    # unset or the default is accepted: what the presets and the flat arguments construct
    assert RolloutCorrectionConfig(rollout_is_threshold=None).is_bounds is None
    assert RolloutCorrectionConfig(rollout_is_threshold="2.0", bypass_loss_type="ppo_clip").enabled is False


def test_inherited_settings_of_a_switched_off_option_are_accepted_and_round_trip():
    off = RolloutCorrectionArguments(rollout_corr_preset="decoupled_k3_rs_token_tis", rollout_rs="none")
    assert off.rollout_rs == "none" and off.rollout_rs_threshold == "0.01"  # the preset's, kept as it was
    again = RolloutCorrectionArguments(**{f.name: getattr(off, f.name) for f in dataclasses.fields(off)})
    assert again.rollout_correction() == off.rollout_correction()
    # numbers compare as numbers: 2, "2" and "2.0" are all the default IS threshold
    for same in (2, "2", "2.0", " 2.0 "):
        assert RolloutCorrectionArguments(rollout_is_threshold=same).rollout_correction().is_bounds is None
    assert RolloutCorrectionArguments(rollout_rs="seq_mean_k3", rollout_rs_threshold="0.01").rollout_correction(
    ).rs_enabled


def test_bare_boolean_flags():
    transformers = pytest.importorskip("transformers")
    parser = transformers.HfArgumentParser((RolloutCorrectionArguments,))
    (bare,) = parser.parse_args_into_dataclasses(["--rollout_is", "token", "--rollout_is_batch_normalize",
                                                  "--bypass_mode"])
    assert bare.bypass_mode is True and bare.rollout_is_batch_normalize is True
    (unset,) = parser.parse_args_into_dataclasses(["--rollout_corr_preset", "bypass_pg_is"])
    assert unset.rollout_correction().bypass_mode is True  # absent: the preset decides
    (off,) = parser.parse_args_into_dataclasses(["--rollout_corr_preset", "bypass_pg_is", "--bypass_mode", "false",
                                                 "--rollout_is", "none"])
    assert not off.rollout_correction().enabled
