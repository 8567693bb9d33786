"""``RolloutCorrectionArguments``: the correction fields flat and Optional, plus a preset name (``config``)."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Optional

from .core import PRESETS, RolloutCorrectionConfig
from .fields import CORRECTION_FIELDS, _with_correction_fields
from .rules import _DEPENDENT_SETTINGS, _check_settings_have_their_option, _unset_inert_settings

# ---------------------------------------------------------------------------------------------- flat arguments


def _threshold_to_field(value: Any) -> Any:
    """A threshold spec as stored in the flat arguments: numbers and ``"L_U"`` strings as strings, None kept.

    A (L, U) pair (e.g. from the ``direct_double_sided`` preset) becomes ``"L_U"`` so that the value survives
    JSON, YAML and the command line unchanged.
    """
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return f"{float(value[0])!r}_{float(value[1])!r}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return value  # let RolloutCorrectionConfig raise its own TypeError


@_with_correction_fields(optional=True)
class RolloutCorrectionArguments:
    """The correction fields, flat and Optional, for ``HfArgumentParser``/``TrlParser`` flags and YAML keys
    (``--rollout_is token``), plus a preset name. ``RolloutCorrGRPOConfig`` inherits them.

    Unset (None) fields take the preset's value (or ``RolloutCorrectionConfig``'s default without a preset);
    explicitly set fields override the preset. After construction every field holds its effective value (numbers
    and bands as strings), and a preset's IS or RS switched off is kept as ``"none"``, so the fields round-trip
    through ``to_dict`` -> YAML -> parser and through pickled checkpoints (``training_args.bin``) unchanged.

    Attributes:
        rollout_corr_preset: name of a ``RolloutCorrectionConfig`` preset (see ``PRESETS``), or None.

    Raises:
        ValueError / TypeError: at construction, for an invalid field or an unknown preset.
    """

    rollout_corr_preset: Optional[str] = field(
        default=None,
        metadata={
            "help": f"Rollout-correction preset, one of: {', '.join(PRESETS)}. Explicit rollout_* / bypass_* fields "
            "override it."
        },
    )

    def __post_init__(self) -> None:
        self._store_effective_fields(self.resolve())

    def resolve(self) -> RolloutCorrectionConfig:
        """The preset (if any) with the explicitly set fields applied, validated (a new object each call).

        Raises:
            ValueError / TypeError: for an unknown preset or an invalid field.
        """
        inherited = self._inherited()
        base = dict(inherited)
        for name in CORRECTION_FIELDS:
            value = getattr(self, name)
            if value is not None:
                base[name] = value
        if isinstance(base.get("rollout_is_threshold"), str):
            base["rollout_is_threshold"] = base["rollout_is_threshold"].strip()
        correction = RolloutCorrectionConfig(**_unset_inert_settings(base, inherited))
        _check_settings_have_their_option(correction, base, inherited)
        return correction

    def _inherited(self) -> dict[str, Any]:
        """The fields an unset flat field takes: the preset's, or the core defaults without a preset."""
        if self.rollout_corr_preset is not None:
            return RolloutCorrectionConfig.from_preset(self.rollout_corr_preset).to_dict()
        return RolloutCorrectionConfig().to_dict()

    def rollout_correction(self) -> RolloutCorrectionConfig:
        """The validated ``RolloutCorrectionConfig`` the (effective) flat fields describe (a new object each call;
        ``resolve()`` of the effective fields, equal to it)."""
        return self.resolve()

    def _store_effective_fields(self, correction: RolloutCorrectionConfig) -> None:
        effective = correction.to_dict()
        inherited = self._inherited()
        for setting, option, _ in _DEPENDENT_SETTINGS:
            if effective[option] in (None, False):  # inert, unset in the core: keep the inherited value, which
                effective[setting] = inherited[setting]  # resolves to the same config when the fields are re-parsed
        for name in CORRECTION_FIELDS:
            value = effective[name]
            if name in ("rollout_is_threshold", "rollout_rs_threshold"):
                value = _threshold_to_field(value)
            if value is None and name in ("rollout_is", "rollout_rs") and self.rollout_corr_preset is not None:
                # Keep "switched off" explicit: a None would let the preset win again when the fields are re-parsed
                # (to_dict -> YAML -> TrlParser, checkpoints).
                value = "none"
            setattr(self, name, value)
