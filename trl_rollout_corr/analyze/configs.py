"""The what-if correction configs of ``analyze``: presets and YAML files, checked (``ConfigError``)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CORRECTION_FIELDS, PRESETS, RolloutCorrectionArguments, RolloutCorrectionConfig


class ConfigError(ValueError):
    """A what-if correction config cannot be used; the message names the file or preset and the fix."""


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class NamedConfig:
    """A correction config with the label the tables and plots use."""

    label: str
    config: RolloutCorrectionConfig


def preset_config(name: str) -> NamedConfig:
    """A preset by name (``config.PRESETS``).

    Raises:
        ConfigError: an unknown name (lists the presets and the closest match).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"--preset {name!r} is not a preset.{hint} Presets: {', '.join(PRESETS)}.")
    return NamedConfig(name, RolloutCorrectionConfig.from_preset(name))


# Keys of a recipe YAML that are not correction fields but look like them (never reported as typos).
_NOT_CORRECTION = ("rollout_dump_dir", "rollout_dump_every", "rollout_generate_dtype", "rollout_corr_compile",
                   "rs_keep_rejected_in_baseline", "routing_replay", "rollout_support_matching", "rollout_engine",
                   "rollout_dtype", "rollout_max_model_len", "rollout_kv_cache_gib", "rollout_seed")


# A recipe config (``recipes/configs/*.yaml``) always names its model; a what-if config never does.
RECIPE_KEY = "model_name_or_path"


def yaml_config(path: str | Path) -> NamedConfig:
    """A correction config from a YAML file: the correction fields and/or ``rollout_corr_preset``, optionally a
    ``label``. Any other key is refused (a misspelt field, e.g. ``rs_threshold``, would otherwise leave the what-if
    at the preset's value), except in a recipe config (``recipes/configs/*.yaml``, recognised by its
    ``model_name_or_path``): its other keys belong to the recipe, whose parser (TRL's ``TrlParser``) refuses
    unknown ones, and only a key within a typo of a correction field is refused here.

    Raises:
        ConfigError: the file is missing, is not valid YAML (names the line and column), is not a mapping, has an
            unknown key (names it, the closest field and the known keys), or an invalid value (the config's own
            message).
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror}). Pass an existing YAML file.") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{where}: not valid YAML ({problem}). Fix the syntax; a correction config is a "
                          "mapping such as 'rollout_is: token' / 'rollout_is_threshold: 2.0'.") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping of correction fields (e.g. 'rollout_rs: seq_mean_k3'), "
                          f"got {type(data).__name__}.")
    known = set(CORRECTION_FIELDS) | {"rollout_corr_preset", "label"}
    recipe = RECIPE_KEY in data
    for key in data:
        if key in known or (recipe and key in _NOT_CORRECTION):
            continue
        close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.8 if recipe else 0.6)
        if recipe and not close:
            continue  # the recipe's own key
        hint = f"; did you mean {close[0]!r}?" if close else "."
        if key in _NOT_CORRECTION:
            hint = " (a training setting, which a what-if config cannot change)."
        raise ConfigError(f"{path}: unknown key {key!r}{hint} Correction keys: "
                          f"{', '.join(sorted(known - {'label'}))}, and label.")
    fields = {k: data[k] for k in CORRECTION_FIELDS if k in data and data[k] is not None}
    if not fields and "rollout_corr_preset" not in data:
        raise ConfigError(f"{path}: no correction key (rollout_corr_preset or one of {', '.join(CORRECTION_FIELDS)}).")
    try:
        args = RolloutCorrectionArguments(rollout_corr_preset=data.get("rollout_corr_preset"),
                                          **{k: _flag_value(v) for k, v in fields.items()})
        config = args.rollout_correction()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {e}") from e
    check_recomputable(config, str(path))
    return NamedConfig(str(data.get("label") or path.stem), config)


def check_recomputable(config: RolloutCorrectionConfig, where: str) -> None:
    """Refuse a correction the records cannot reproduce: M2PO (its mask is global over the optimizer step of every
    rank). RS on the engine factor (``rollout_rs_on="engine"``) is recomputed from ``version_log_probs`` (records
    1.1, ``policy_lag_split``); ``rows.check_config_fits`` refuses it on a dump without that column.

    Raises:
        ConfigError: naming the setting and ``where`` (a file, a config's label, or the dump of a run trained with it).
    """
    if config.m2_enabled:
        raise ConfigError(f"{where}: rollout_m2_threshold={config.rollout_m2_threshold} (M2PO): analyze does not "
                          "recompute the step-global M2PO mask (the optimizer step's rows of every rank together); "
                          "analyse configs without it, and runs trained without it. A run trained with it still "
                          "has its records: records.open_dump(path).read_table() gives every row, with the mask "
                          "it trained with (rollout_rs_mask, M2PO's included) and its log-probs.")


def rs_on_engine(config: RolloutCorrectionConfig) -> bool:
    """Whether ``config``'s RS judges the lag split's engine factor pi_train@v / mu (``rollout_rs_on="engine"``)."""
    return config.rs_enabled and config.rollout_rs_on == "engine"


def _flag_value(value: Any) -> Any:
    """A YAML value as the flat arguments take it (numbers and bands as strings, bools kept)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return repr(float(value))
    return value
