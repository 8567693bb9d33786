"""The rule for a setting whose option is off, shared by the core config and the flat arguments (``config``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from ..correction.rejection import RS_OPTIONS  # the RS option table lives with the RS math
from .fields import CORRECTION_FIELD_TABLE
from .thresholds import _is_number, _is_off, _to_float

if TYPE_CHECKING:  # pragma: no cover
    from .core import RolloutCorrectionConfig

# A setting that only acts together with another one: (setting, its option, what switches the option on).
_DEPENDENT_SETTINGS = (
    ("rollout_is_threshold", "rollout_is", "rollout_is='token' or 'sequence'"),
    ("rollout_rs_threshold", "rollout_rs", f"rollout_rs (options: {', '.join(RS_OPTIONS)})"),
    ("rollout_rs_on", "rollout_rs", f"rollout_rs (options: {', '.join(RS_OPTIONS)})"),
    ("bypass_loss_type", "bypass_mode", "bypass_mode=True"),
)


def _setting_key(value: Any) -> Any:
    """A comparable form of a threshold spec or setting: ``2``, ``2.0`` and ``"2.0"`` are the same setting."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_setting_key(v) for v in value)
    if _is_number(value):
        return float(value)
    if isinstance(value, str):
        parts = []
        for part in value.split(","):
            try:
                parts.append(tuple(_to_float(x, "") for x in part.split("_")) if "_" in part
                             else _to_float(part, ""))
            except ValueError:
                parts.append(part.strip())
        return tuple(parts) if len(parts) > 1 else parts[0]
    return value


# The core config's own defaults of the dependent settings: what "unset" means there.
_FIELD_DEFAULTS = {f.name: f.default for f in CORRECTION_FIELD_TABLE}


def _check_settings_have_their_option(correction: "RolloutCorrectionConfig", given: dict, inherited: dict) -> None:
    """The one rule for a setting whose option is off: refuse it when it was changed from its inherited value, e.g.
    ``rollout_rs_threshold=0.01`` without ``rollout_rs``: it would be silently ignored. ``RolloutCorrectionConfig``
    checks itself against its field defaults (``_FIELD_DEFAULTS``); ``RolloutCorrectionArguments`` checks the
    given fields against the preset's (or the defaults without a preset), after ``_unset_inert_settings``.

    None (unset) and a value equal to the inherited one are accepted.

    Raises:
        ValueError: naming the setting, its option and how to switch the option on.
    """
    for setting, option, how in _DEPENDENT_SETTINGS:
        if getattr(correction, option) not in (None, False) or given[setting] is None:
            continue
        if _setting_key(given[setting]) != _setting_key(inherited[setting]):
            raise ValueError(
                f"{setting}={given[setting]!r} is set but {option} is off, so it would be ignored: set {how}, or "
                f"unset {setting}."
            )


def _unset_inert_settings(base: dict, inherited: dict) -> dict:
    """``base`` with every setting whose option is off and whose value is the inherited one (a preset's threshold
    after its option was switched off) set back to the core default, i.e. unset: it is inert, and the core config
    refuses a setting without its option (``_check_settings_have_their_option``)."""
    out = dict(base)
    for setting, option, _ in _DEPENDENT_SETTINGS:
        off = out[option] is None or out[option] is False or _is_off(out[option])
        if off and _setting_key(out[setting]) == _setting_key(inherited[setting]):
            out[setting] = _FIELD_DEFAULTS[setting]
    return out


def unset_inert_settings(stored: Mapping[str, Any]) -> dict:
    """Correction fields as stored by a run before ``RolloutCorrectionConfig`` refused a setting without its option
    (records' ``run.json``: a preset's threshold kept after its option was switched off): those settings unset, the
    other fields unchanged. They were inert in that run (the flat arguments accepted them only as inherited)."""
    out = dict(stored)
    for setting, option, _ in _DEPENDENT_SETTINGS:
        if setting in out and option in out and (out[option] in (None, False) or _is_off(out[option])):
            out[setting] = _FIELD_DEFAULTS[setting]
    return out
