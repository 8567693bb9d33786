"""``RolloutCorrectionConfig``: the validated, frozen core config, and its presets (``config``)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, field
from typing import Any, Optional

from .fields import CORRECTION_FIELDS, _with_correction_fields
from .rules import _FIELD_DEFAULTS, _check_settings_have_their_option
from .thresholds import (
    BYPASS_LOSS_TYPES,
    IS_LEVELS,
    KPOP_PHI,
    RS_RATIOS,
    ISBounds,
    RSSpec,
    ThresholdSpec,
    _is_off,
    _to_float,
    parse_is_threshold,
    parse_rs_options,
    parse_rs_thresholds,
)

_PRESET_NAMES: list[str] = []


def _preset(fn):
    """Register a preset (``RolloutCorrectionConfig.<name>``, ``from_preset(name)``, ``PRESETS``) and make it a
    classmethod."""
    _PRESET_NAMES.append(fn.__name__)
    return classmethod(fn)


# ---------------------------------------------------------------------------------------------- the core config
@_with_correction_fields(optional=False, frozen=True)
class RolloutCorrectionConfig:
    """Rollout correction settings, validated when constructed and immutable afterwards.

    Frozen: the parsed ``is_bounds`` / ``rs_specs`` are derived once, in ``__post_init__``, and can never go stale;
    use ``dataclasses.replace(cfg, rollout_is="sequence")`` for a changed copy (validated again). The strings
    ``"none"``/``"null"``/``""`` for ``rollout_is`` / ``rollout_rs`` mean None.

    Attributes (derived):
        is_bounds: the parsed ``rollout_is_threshold`` (``ISBounds``), None when IS is off.
        rs_specs: one ``RSSpec`` per de-duplicated RS option, () when RS is off.

    Raises:
        ValueError / TypeError: on construction, for any invalid field (the message names the field
        and the allowed values), or a setting given while its option is off (``rollout_rs_threshold`` without
        ``rollout_rs``, ``rollout_is_threshold`` other than the default without ``rollout_is``, ``bypass_loss_type``
        other than the default without ``bypass_mode``: it would be ignored), the rule
        ``RolloutCorrectionArguments`` applies against a preset's values.

    Presets follow verl's ``RolloutCorrectionConfig`` classmethods, plus ``direct_double_sided``.
    """

    is_bounds: Optional[ISBounds] = field(init=False, repr=False, compare=False, default=None)
    rs_specs: tuple[RSSpec, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)  # frozen: only __post_init__ sets fields
        if _is_off(self.rollout_is):
            set_("rollout_is", None)
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be None, 'token' or 'sequence', got {self.rollout_is!r}.")
        if _is_off(self.rollout_rs):
            set_("rollout_rs", None)
        for name in ("rollout_is_batch_normalize", "bypass_mode"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool (True/False), got {getattr(self, name)!r}.")
        if self.bypass_loss_type not in BYPASS_LOSS_TYPES:
            raise ValueError(f"bypass_loss_type must be 'ppo_clip' or 'reinforce', got {self.bypass_loss_type!r}.")
        set_("is_bounds", self._parse_is_bounds())
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize=True needs rollout_is='token' or 'sequence'.")
        if self.rollout_rs is not None:
            set_("rs_specs", parse_rs_thresholds(parse_rs_options(self.rollout_rs), self.rollout_rs_threshold))
        else:
            set_("rs_specs", ())
        if self.rollout_rs_on not in RS_RATIOS:
            raise ValueError(f"rollout_rs_on must be 'direct' or 'engine', got {self.rollout_rs_on!r}.")
        _check_settings_have_their_option(self, {name: getattr(self, name) for name in CORRECTION_FIELDS},
                                          _FIELD_DEFAULTS)
        if self.rollout_rs_on == "engine" and self.bypass_mode:
            raise ValueError(
                "rollout_rs_on='engine' needs decoupled mode: the engine factor pi_train@v / mu comes from "
                "policy_lag_split, which needs pi_old (bypass mode has none). Set bypass_mode=False, or "
                "rollout_rs_on='direct'."
            )
        set_("rollout_m2_threshold", self._parse_m2_threshold())

    def _parse_m2_threshold(self) -> Optional[float]:
        value = self.rollout_m2_threshold
        if value is None or _is_off(value):
            return None
        if isinstance(value, bool):
            raise TypeError(f"rollout_m2_threshold must be a number (tau, nats^2), not a boolean ({value!r}).")
        tau = _to_float(value, "rollout_m2_threshold")
        if not tau > 0:
            raise ValueError(f"rollout_m2_threshold must be > 0 (M2PO's largest kept mean of l^2 over the optimizer "
                             f"step, nats^2; the paper uses 0.04), got {value!r}; unset it to turn M2PO off.")
        if self.bypass_mode:
            raise ValueError(
                "rollout_m2_threshold (M2PO) needs decoupled mode: its mask is global over the optimizer step and "
                "must be known before the first micro-batch's loss, but bypass mode computes its log ratio "
                "(pi_theta vs mu) inside each micro-batch's loss. Set bypass_mode=False (decoupled: pi_old vs mu, "
                "known for the whole step after generation), or unset rollout_m2_threshold."
            )
        return tau

    def _parse_is_bounds(self) -> Optional[ISBounds]:
        if self.rollout_is is None:
            if self.rollout_is_threshold is not None:
                # Validate anyway so that a typo is caught before it is switched on.
                parse_is_threshold(self.rollout_is_threshold)
            return None
        if self.rollout_is_threshold is None:
            raise ValueError(
                f"rollout_is={self.rollout_is!r} needs rollout_is_threshold: a positive number U (TIS) "
                "or 'L_U' (IcePop); set rollout_is=None to turn IS weights off."
            )
        bounds = parse_is_threshold(self.rollout_is_threshold)
        if not bounds.is_icepop and bounds.upper < 1.0:
            warnings.warn(
                f"rollout_is_threshold={self.rollout_is_threshold!r} is a truncation cap U < 1, which scales every "
                "weight above U down to U. If you meant an IcePop band 'L_U', quote it: YAML reads an unquoted "
                "0.5_2 as the number 0.52.",
                stacklevel=3,
            )
        return bounds

    # ------------------------------------------------------------------ properties
    @property
    def is_enabled(self) -> bool:
        """True when IS weights are computed (``rollout_is`` set)."""
        return self.is_bounds is not None

    @property
    def rs_enabled(self) -> bool:
        """True when at least one rejection option is set."""
        return bool(self.rs_specs)

    @property
    def m2_enabled(self) -> bool:
        """True when M2PO's second-moment mask is configured (``rollout_m2_threshold`` set)."""
        return self.rollout_m2_threshold is not None

    @property
    def enabled(self) -> bool:
        """True when the correction changes training (IS weights, RS, M2PO, or bypass mode)."""
        return self.is_enabled or self.rs_enabled or self.m2_enabled or self.bypass_mode

    def to_dict(self) -> dict[str, Any]:
        """The user-facing fields (``CORRECTION_FIELDS``) as a plain dict (for YAML, logs and model cards)."""
        d = asdict(self)
        return {name: d[name] for name in CORRECTION_FIELDS}

    # ------------------------------------------------------------------ presets (verl names)
    @_preset
    def disabled(cls) -> "RolloutCorrectionConfig":
        """No IS, no RS, decoupled mode: diagnostics only."""
        return cls(rollout_is=None, rollout_is_threshold=None)

    @_preset
    def decoupled_token_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Token-level truncated IS (TIS) against pi_old."""
        return cls(rollout_is="token", rollout_is_threshold=threshold)

    @_preset
    def decoupled_seq_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Sequence-level truncated IS (Seq-TIS) against pi_old."""
        return cls(rollout_is="sequence", rollout_is_threshold=threshold)

    @_preset
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Token-level IcePop: weights outside ``[threshold_lower, threshold]`` are zeroed."""
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}")

    @_preset
    def decoupled_seq_is_rs(
        cls, is_threshold: float = 2.0, rs_threshold: ThresholdSpec = "0.5_2.0"
    ) -> "RolloutCorrectionConfig":
        """Sequence TIS plus rejection on the sequence ratio (``seq_sum_k1``)."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold,
            rollout_rs="seq_sum_k1", rollout_rs_threshold=rs_threshold,
        )

    @_preset
    def decoupled_geo_rs(cls, rs_threshold: ThresholdSpec = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Geometric-mean ratio rejection (``seq_mean_k1``), no IS weights."""
        return cls(rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @_preset
    def decoupled_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: ThresholdSpec = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Geometric-mean rejection plus sequence TIS."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
        )

    @_preset
    def decoupled_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: ThresholdSpec = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Geometric-mean rejection plus token TIS."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
        )

    @_preset
    def decoupled_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Rejection on the per-row mean K3 divergence (``seq_mean_k3``), no IS weights."""
        return cls(rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @_preset
    def decoupled_k3_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> "RolloutCorrectionConfig":
        """``seq_mean_k3`` rejection plus sequence TIS."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold,
        )

    @_preset
    def decoupled_k3_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: float = 0.01
    ) -> "RolloutCorrectionConfig":
        """``seq_mean_k3`` rejection plus token TIS (this project's CPU default)."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold,
        )

    @_preset
    def decoupled_kpop_rs(cls, rs_threshold: float = KPOP_PHI) -> "RolloutCorrectionConfig":
        """KPop rejection (``token_binary_kl``) at phi = 0.1 nats against pi_old, no IS weights.

        A token is kept iff the Bernoulli KL between pi_old's and mu's probability of the sampled token is <= phi in
        both directions. Why 0.1 and not AReaL's example 2.0: ``KPOP_PHI``.
        """
        return cls(rollout_rs="token_binary_kl", rollout_rs_threshold=rs_threshold)

    @_preset
    def bypass_ppo_clip(cls) -> "RolloutCorrectionConfig":
        """Bypass mode, PPO clip on pi_theta / mu, no IS, no RS."""
        return cls(bypass_mode=True, bypass_loss_type="ppo_clip")

    @_preset
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: ThresholdSpec = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Bypass PPO clip plus geometric-mean rejection."""
        return cls(
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, bypass_loss_type="ppo_clip"
        )

    @_preset
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = 0.01) -> "RolloutCorrectionConfig":
        """Bypass PPO clip plus ``seq_mean_k3`` rejection."""
        return cls(
            rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True, bypass_loss_type="ppo_clip"
        )

    @_preset
    def bypass_ppo_clip_kpop_rs(cls, rs_threshold: float = KPOP_PHI) -> "RolloutCorrectionConfig":
        """Bypass PPO clip plus KPop rejection (``token_binary_kl``, phi = 0.1 nats) on pi_theta vs mu."""
        return cls(
            rollout_rs="token_binary_kl", rollout_rs_threshold=rs_threshold, bypass_mode=True,
            bypass_loss_type="ppo_clip",
        )

    @_preset
    def bypass_pg_is(cls, threshold: float = 2.0) -> "RolloutCorrectionConfig":
        """Bypass REINFORCE with sequence TIS."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=threshold, bypass_mode=True, bypass_loss_type="reinforce"
        )

    @_preset
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> "RolloutCorrectionConfig":
        """Bypass REINFORCE with token IcePop."""
        return cls(
            rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}",
            bypass_mode=True, bypass_loss_type="reinforce",
        )

    @_preset
    def bypass_pg_geo_rs(cls, rs_threshold: ThresholdSpec = "0.999_1.001") -> "RolloutCorrectionConfig":
        """Bypass REINFORCE with geometric-mean rejection, no IS."""
        return cls(
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True, bypass_loss_type="reinforce"
        )

    @_preset
    def bypass_pg_geo_rs_seq_tis(
        cls, is_threshold: float = 2.0, rs_threshold: ThresholdSpec = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Bypass REINFORCE with geometric-mean rejection and sequence TIS."""
        return cls(
            rollout_is="sequence", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
            bypass_mode=True, bypass_loss_type="reinforce",
        )

    @_preset
    def bypass_pg_geo_rs_token_tis(
        cls, is_threshold: float = 2.0, rs_threshold: ThresholdSpec = "0.999_1.001"
    ) -> "RolloutCorrectionConfig":
        """Bypass REINFORCE with geometric-mean rejection and token TIS."""
        return cls(
            rollout_is="token", rollout_is_threshold=is_threshold,
            rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold,
            bypass_mode=True, bypass_loss_type="reinforce",
        )

    @_preset
    def direct_double_sided(cls, eps_low: float = 0.2, eps_high: float = 0.2) -> "RolloutCorrectionConfig":
        """Direct double-sided IS (SAO's DIS, GLM-5's direct two-policy gate).

        Bypass + REINFORCE + token IcePop band ``[1 - eps_low, 1 + eps_high]`` on pi_theta / mu.

        Raises:
            ValueError: unless ``0 <= eps_low < 1`` and ``eps_high >= 0``.
        """
        if not (0.0 <= eps_low < 1.0) or not eps_high >= 0.0:
            raise ValueError(
                f"direct_double_sided needs 0 <= eps_low < 1 and eps_high >= 0, got eps_low={eps_low}, "
                f"eps_high={eps_high}."
            )
        return cls(
            rollout_is="token", rollout_is_threshold=(1.0 - eps_low, 1.0 + eps_high),
            bypass_mode=True, bypass_loss_type="reinforce",
        )

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> "RolloutCorrectionConfig":
        """Build a preset by name, e.g. ``from_preset("decoupled_k3_rs_token_tis", rs_threshold=0.005)``.

        Raises:
            ValueError: for an unknown name (the message lists the presets).
        """
        if name not in PRESETS:
            raise ValueError(f"Unknown rollout-correction preset {name!r}. Presets: {', '.join(PRESETS)}.")
        return getattr(cls, name)(**kwargs)


# The preset names, in definition order (every method decorated with @_preset above).
PRESETS = tuple(_PRESET_NAMES)
