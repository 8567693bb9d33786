"""Rollout-correction configuration: the field table, the core dataclass and its presets, the flat arguments.

* ``CORRECTION_FIELD_TABLE``: the single source of the 8 correction fields (name, types, default, allowed values,
  help). ``RolloutCorrectionConfig``, ``RolloutCorrectionArguments`` and the table of ``docs/configuration.md``
  (``python -m trl_rollout_corr.docgen --config-table``) are all generated from it.
* ``RolloutCorrectionConfig``: the validated, frozen core config the math takes; presets (verl's names) are
  classmethods registered with ``@_preset`` where they are defined (``PRESETS`` lists them).
* ``RolloutCorrectionArguments``: the same fields flat and Optional plus ``rollout_corr_preset``, for argument
  parsers and YAML (``RolloutCorrGRPOConfig`` inherits it); ``resolve()`` merges the preset and the set fields.
* Threshold parsing (``parse_is_threshold``, ``parse_rs_options``, ``parse_rs_thresholds``).

Nothing here imports torch.distributed or TRL, so the config can be built, validated and serialised anywhere
(CLI parsing, YAML loading, model cards). The RS option names come from ``correction.rejection``, where the RS
levels are implemented, so that adding an option touches that one file.

Vocabulary (see ``README.md``): behaviour policy mu (``rollout_log_probs``), proximal policy pi_old
(``old_log_probs``), current policy pi_theta (``log_probs``). The correction compares a *training*
policy (pi_old in decoupled mode, pi_theta in bypass mode) with mu through the per-token log ratio
``l = log pi_train - log mu`` in nats.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping, Optional, Union

from .correction.rejection import RS_OPTION_PARTS, RS_OPTIONS  # the RS option table lives with the RS math

IS_LEVELS = ("token", "sequence")
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")

ThresholdSpec = Union[float, int, str, tuple, list, None]

# KPop's phi in the presets, nats of Bernoulli KL (both directions). 0.1 is the KPop authors' default (as prime-rl#3283
# and verl#6800 propose); AReaL's example config uses 2.0. Near p = q the KL is (p - q)^2 / (2 p (1 - p)), so 0.1
# keeps |p - q| up to about 0.45 sqrt(p (1 - p)): at p = 0.5 the rollout may give q in [0.29, 0.71]; the confident
# pair (0.99, 0.9) is rejected (reverse KL 0.145) while the rare pair (1e-4, 1e-3) is kept (KL 1.4e-3). At 2.0 the
# band is so wide that a mid-probability token survives q = 0.005 vs p = 0.5 (KL 1.96) and a token the trainer gives
# 0.99 survives q = 0.5 (KL 1.61): it removes only near-disjoint pairs and keeps almost every token of an engine
# mismatch (bf16 vs float32 log ratios of 0.035 nats mean, 0.39 max on this project's model give KL <~ 0.13 even at
# p = 0.5). 0.1 is the value that acts on numerical outliers; use 2.0 only as a last-resort guard.
KPOP_PHI = 0.1


@dataclass(frozen=True)
class ISBounds:
    """Parsed ``rollout_is_threshold``.

    Attributes:
        upper: U > 0, a ratio (probability ratio pi_train / mu, unitless).
        lower: L in (0, U] for an IcePop band, None for truncation (TIS).
    """

    upper: float
    lower: Optional[float] = None

    @property
    def is_icepop(self) -> bool:
        """True when the spec is a band ``[L, U]`` (IcePop: weights outside are zeroed)."""
        return self.lower is not None

    @property
    def lower_or_reciprocal(self) -> float:
        """The lower ratio bound used for "below" counts: L for a band, 1/U for truncation (TIS)."""
        return self.lower if self.lower is not None else 1.0 / self.upper


@dataclass(frozen=True)
class RSSpec:
    """One parsed rejection-sampling option.

    Attributes:
        option: the option name, e.g. ``"seq_mean_k3"``.
        level: ``"token"``, ``"seq_sum"``, ``"seq_mean"`` or ``"seq_max"``.
        stat: ``"k1"``, ``"k2"``, ``"k3"`` or ``"binary_kl"`` (KPop, token level only).
        upper: k1: upper bound U of the ratio band; k2/k3: the largest kept statistic; binary_kl: phi, the largest
            kept Bernoulli KL in nats (both directions).
        lower: k1 only: lower bound L of the ratio band (ratio units); None otherwise.

    For k1 the statistic is ``k1 = -clamp(l, -20, 20)`` (nats) and a token/row is kept when the ratio
    ``r = exp(-k1)`` lies in ``[L, U]``, i.e. ``-log U <= k1 <= -log L`` (see ``stat_bounds``).
    """

    option: str
    level: str
    stat: str
    upper: float
    lower: Optional[float] = None

    @property
    def is_token_level(self) -> bool:
        return self.level == "token"

    @property
    def stat_bounds(self) -> tuple[Optional[float], float]:
        """(lo, hi) bounds on the statistic itself (nats for k1, k2/k3 units otherwise).

        k1: ``(-log U, -log L)``, so that the kept ratio band is exactly ``[L, U]`` (deliberate
        difference from verl, which keeps ``[1/U, 1/L]``; both agree for symmetric bands).
        k2/k3/binary_kl: ``(None, U)``.
        """
        if self.stat == "k1":
            return -math.log(self.upper), -math.log(self.lower)
        return None, self.upper


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _to_float(text: Any, what: str) -> float:
    """A finite float from a number or a plain decimal string (no '_' digit separators, no 'inf'/'nan')."""
    if _is_number(text):
        value = float(text)
    elif isinstance(text, str) and _NUMBER.match(text.strip()):
        value = float(text.strip())
    else:
        raise ValueError(f"{what}: cannot parse {text!r} as a number.")
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"{what}: {text!r} is not a finite number.")
    return value


def _parse_band(spec: Any, what: str, allowed: str) -> tuple[Optional[float], float]:
    """Parse a number, ``"U"``, ``"L_U"`` or ``(L, U)`` into ``(L or None, U)``; checks L, U > 0, L <= U."""
    if isinstance(spec, bool):
        raise TypeError(f"{what} must be a number or a string, not a boolean ({spec!r}). Allowed: {allowed}.")
    if _is_number(spec):
        lower, upper = None, _to_float(spec, what)
    elif isinstance(spec, (tuple, list)):
        if len(spec) != 2 or not all(_is_number(v) for v in spec):
            raise ValueError(f"{what} as a sequence must be two numbers (L, U), got {spec!r}. Allowed: {allowed}.")
        lower, upper = _to_float(spec[0], what), _to_float(spec[1], what)
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"{what} is an empty string. Allowed: {allowed}.")
        if "_" in text:
            lo_text, hi_text = text.split("_", 1)
            lower, upper = _to_float(lo_text, what), _to_float(hi_text, what)
        else:
            lower, upper = None, _to_float(text, what)
    else:
        raise TypeError(f"{what} has unsupported type {type(spec).__name__} ({spec!r}). Allowed: {allowed}.")
    if not upper > 0:
        raise ValueError(f"{what}: the upper bound must be positive, got {upper}. Allowed: {allowed}.")
    if lower is not None and not lower > 0:
        raise ValueError(f"{what}: the lower bound must be positive, got {lower}. Allowed: {allowed}.")
    if lower is not None and lower > upper:
        raise ValueError(f"{what}: the lower bound {lower} is above the upper bound {upper}. Allowed: {allowed}.")
    return lower, upper


def parse_is_threshold(spec: ThresholdSpec) -> ISBounds:
    """Parse ``rollout_is_threshold``.

    Args:
        spec: a positive number U (truncated IS, TIS: ``W = min(R, U)``), or a band ``"L_U"`` /
            ``(L, U)`` with ``0 < L <= U`` (IcePop: ``W = R`` inside the band, 0 outside).

    Returns:
        ISBounds.

    Raises:
        TypeError: for a bool or an unsupported type.
        ValueError: for an empty or unparsable string, U <= 0, L <= 0 or L > U.
    """
    lower, upper = _parse_band(
        spec, "rollout_is_threshold", "a positive number U (TIS) or 'L_U' / (L, U) with 0 < L <= U (IcePop)"
    )
    return ISBounds(upper=upper, lower=lower)


def parse_rs_options(rollout_rs: Any) -> tuple[str, ...]:
    """Split ``rollout_rs`` into options, dropping empties and duplicates (first occurrence kept).

    Raises:
        ValueError: if it is not a string, holds no option, or names an unknown option.
    """
    if not isinstance(rollout_rs, str):
        raise ValueError(
            f"rollout_rs must be a comma-separated string of options from {RS_OPTIONS}, got {rollout_rs!r}."
        )
    options: list[str] = []
    for raw in rollout_rs.split(","):
        name = raw.strip()
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {name!r}. Allowed options: {', '.join(RS_OPTIONS)}.")
        if name not in options:
            options.append(name)
    if not options:
        raise ValueError(f"rollout_rs must contain at least one option from {RS_OPTIONS}, got {rollout_rs!r}.")
    return tuple(options)


def parse_rs_thresholds(options: tuple[str, ...], spec: ThresholdSpec) -> tuple[RSSpec, ...]:
    """Parse ``rollout_rs_threshold`` for the (de-duplicated) ``options``.

    Args:
        options: output of ``parse_rs_options``.
        spec: one spec shared by all options, or a comma list with one spec per option. For k1 options
            a spec is a ratio band ``"L_U"`` (or a number u meaning ``[1/u, u]``); for k2/k3 it is a
            positive upper bound (a ``"L_U"`` band is an error); for ``token_binary_kl`` (KPop) it is phi > 0, the
            largest kept Bernoulli KL in nats.

    Raises:
        ValueError: missing spec, wrong count, unparsable or non-positive bound, L > U, a band for k2/k3, or
            phi <= 0 for ``token_binary_kl``.
        TypeError: a bool or an unsupported type.
    """
    if spec is None:
        raise ValueError(
            "rollout_rs_threshold must be set when rollout_rs is set: one spec for all options or one per "
            f"option, for options {list(options)} (k1: ratio band 'L_U' or u meaning [1/u, u]; k2/k3: upper bound)."
        )
    if isinstance(spec, bool):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, not a boolean ({spec!r}).")
    if _is_number(spec):
        parts = [spec]
    elif isinstance(spec, str):
        parts = [p.strip() for p in spec.split(",") if p.strip()]
        if not parts:
            raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    else:
        raise TypeError(f"rollout_rs_threshold has unsupported type {type(spec).__name__} ({spec!r}).")
    if len(parts) == 1:
        parts = parts * len(options)
    if len(parts) != len(options):
        raise ValueError(
            f"rollout_rs_threshold has {len(parts)} specs but rollout_rs has {len(options)} options "
            f"({list(options)}); give one spec for all or exactly one per option."
        )
    specs = []
    for option, part in zip(options, parts):
        level, stat = RS_OPTION_PARTS[option]
        what = f"rollout_rs_threshold for {option}"
        if stat == "binary_kl":
            specs.append(RSSpec(option=option, level=level, stat=stat, upper=_parse_phi(part, what)))
        elif stat == "k1":
            lower, upper = _parse_band(part, what, "a ratio band 'L_U' with 0 < L <= U, or u >= 1 meaning [1/u, u]")
            if lower is None:
                if upper < 1.0:
                    raise ValueError(
                        f"{what}: a single k1 threshold u means the band [1/u, u] and needs u >= 1, got {upper}."
                    )
                lower = 1.0 / upper
            specs.append(RSSpec(option=option, level=level, stat=stat, upper=upper, lower=lower))
        else:
            if isinstance(part, str) and "_" in part:
                raise ValueError(f"{what}: k2/k3 options take a single upper bound, not a band ({part!r}).")
            _, upper = _parse_band(part, what, "a positive number (upper bound on the statistic)")
            specs.append(RSSpec(option=option, level=level, stat=stat, upper=upper, lower=None))
    return tuple(specs)


def _parse_phi(part: Any, what: str) -> float:
    """KPop's phi: a single positive number (nats of Bernoulli KL)."""
    if isinstance(part, str) and "_" in part:
        raise ValueError(f"{what}: KPop takes a single phi (the largest kept Bernoulli KL, nats), not a band "
                         f"({part!r}); e.g. 0.1.")
    phi = _to_float(part, what)
    if not phi > 0:
        raise ValueError(
            f"{what}: phi must be > 0 (the largest kept Bernoulli KL between the trainer's and the rollout's "
            f"probability of the sampled token, in nats, in both directions), got {phi!r}: phi <= 0 would reject "
            "every token that is not bit-identical. Use e.g. 0.1 (KPop's default), or turn rollout_rs off."
        )
    return phi


# ---------------------------------------------------------------------------------------------- the field table
@dataclass(frozen=True)
class CorrectionField:
    """One rollout-correction setting: the single source of its name, types, default and documentation.

    Attributes:
        name: the field name (verl's name), the same in every dataclass, YAML key and CLI flag.
        type: its annotation in ``RolloutCorrectionConfig``.
        flag_type: ``str`` or ``bool``: the type of the flat, Optional field of ``RolloutCorrectionArguments``
            (``TrlParser``/``HfArgumentParser`` flags and YAML keys).
        default: the default in ``RolloutCorrectionConfig``.
        values: the allowed values, in Markdown (the "values" column of ``docs/configuration.md``).
        help: what it means, in Markdown (the ``--help`` text, the "meaning" column of ``docs/configuration.md``).
    """

    name: str
    type: Any
    flag_type: type
    default: Any
    values: str
    help: str


CORRECTION_FIELD_TABLE = (
    CorrectionField(
        "rollout_is", Optional[str], str, None,
        '`None`, `"token"`, `"sequence"`',
        "IS weight level. Token: `R_t = exp(clamp(l_t, ±20))`; sequence: `R_i = exp(clamp(Σ_t l_t, ±20))` (summed "
        "in log space, never overflows). Unset: no IS weights ('none' turns off a preset's IS).",
    ),
    CorrectionField(
        "rollout_is_threshold", ThresholdSpec, str, 2.0,
        '`U > 0` or `"L_U"` / `(L, U)`',
        "`U`: truncated IS (TIS) `W = min(R, U)`. Band: IcePop, `W = R` inside `[L, U]` (inclusive), 0 outside. "
        "Ratio units. Required when `rollout_is` is set.",
    ),
    CorrectionField(
        "rollout_is_batch_normalize", bool, bool, False,
        "bool",
        "Divide W by its global-batch mean (token: over valid tokens; sequence: over valid rows), after truncation, "
        "not re-truncated; no-op if the mean is <= 1e-8. Needs `rollout_is`.",
    ),
    CorrectionField(
        "rollout_rs", Optional[str], str, None,
        "comma list of `token_k1..3`, `token_binary_kl`, `seq_sum_k1..3`, `seq_mean_k1..3`, `seq_max_k2/3`",
        "Rejection options, combined with AND. `x = clamp(l, ±20)`, `k1 = -x`, `k2 = x²/2`, `k3 = exp(x) - 1 - x`; "
        "`token_binary_kl` (KPop): `max(KL(Ber(p)‖Ber(q)), KL(Ber(q)‖Ber(p)))` of the sampled token's probabilities "
        "under pi_train and mu, nats. Unset: no rejection ('none' turns off a preset's RS).",
    ),
    CorrectionField(
        "rollout_rs_threshold", ThresholdSpec, str, None,
        "one spec, or one per option",
        'k1: a ratio band `"L_U"` (keep `L <= r <= U`; a single `u` means `[1/u, u]`) on the token ratio, the '
        "row's product (`seq_sum`) or geometric mean (`seq_mean`); k2/k3: keep `stat <= U`; `token_binary_kl`: keep "
        "`KL <= phi` (phi > 0, nats; 0.1 as KPop). Required when `rollout_rs` is set.",
    ),
    CorrectionField(
        "rollout_m2_threshold", Optional[float], str, None,
        "`tau > 0` (nats²)",
        "M2PO (second-moment mask; AReaL's `m2_threshold`, paper 0.04): over the whole optimizer step, mask the "
        "tokens with the largest `|l|` until the mean of `l²` over the remaining valid tokens is `<= tau` "
        "(`correction/m2po.py`). Decoupled mode only. Not yet wired in the trainer: refused there.",
    ),
    CorrectionField(
        "bypass_mode", bool, bool, False,
        "bool",
        "False: decoupled (keep pi_old: one extra forward per generation batch). True: bypass (pi_old := mu, no "
        "extra forward; the correction runs inside the loss, from pi_theta vs mu).",
    ),
    CorrectionField(
        "bypass_loss_type", Literal["ppo_clip", "reinforce"], str, "ppo_clip",
        '`"ppo_clip"`, `"reinforce"`',
        "Bypass loss: PPO clip on pi_theta / mu (IS weights for metrics only), or `-A · w · log pi_theta` "
        "(w detached). Only used in bypass mode.",
    ),
)
# The correction fields' names, in table order (the flat fields of the trainer config).
CORRECTION_FIELDS = tuple(f.name for f in CORRECTION_FIELD_TABLE)


def _fields_doc(table: tuple[CorrectionField, ...], optional: bool) -> str:
    lines = ["", "", "    Fields (generated from ``config.CORRECTION_FIELD_TABLE``):"]
    for f in table:
        default = "None (unset)" if optional else repr(f.default)
        lines.append(f"        {f.name} (default {default}): {f.help}")
    return "\n".join(lines) + "\n"


# argparse keywords for an ``Optional[bool]`` flag (``HfArgumentParser`` passes a field's metadata to
# ``add_argument``): a bare ``--bypass_mode`` means True, as it does for TRL's own bool flags, while an absent flag
# stays None (unset: the preset decides) and ``--bypass_mode false`` is False.
BARE_BOOL_FLAG = {"nargs": "?", "const": True}


def _with_correction_fields(*, optional: bool, frozen: bool = False):
    """Class decorator: add the ``CORRECTION_FIELD_TABLE`` fields after the class's own fields, then ``dataclass``.

    ``optional=False``: the table's types and defaults (``RolloutCorrectionConfig``). ``optional=True``: every field
    ``Optional[flag_type] = None`` (unset), for flags and YAML (``RolloutCorrectionArguments``). Both carry the
    table's help text as ``metadata={"help": ...}`` and list it in the class docstring.
    """

    def wrap(cls):
        annotations = dict(cls.__dict__.get("__annotations__", {}))
        for f in CORRECTION_FIELD_TABLE:
            annotations[f.name] = Optional[f.flag_type] if optional else f.type
            metadata = {"help": f.help}
            if optional and f.flag_type is bool:
                metadata.update(BARE_BOOL_FLAG)
            setattr(cls, f.name, field(default=None if optional else f.default, metadata=metadata))
        cls.__annotations__ = annotations
        cls.__doc__ = (cls.__doc__ or "").rstrip() + _fields_doc(CORRECTION_FIELD_TABLE, optional)
        return dataclass(frozen=frozen)(cls)

    return wrap


_PRESET_NAMES: list[str] = []


def _preset(fn):
    """Register a preset (``RolloutCorrectionConfig.<name>``, ``from_preset(name)``, ``PRESETS``) and make it a
    classmethod."""
    _PRESET_NAMES.append(fn.__name__)
    return classmethod(fn)


def _is_off(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("", "none", "null")


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
        _check_settings_have_their_option(self, {name: getattr(self, name) for name in CORRECTION_FIELDS},
                                          _FIELD_DEFAULTS)
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


# ---------------------------------------------------------------------------------------------- flat arguments
# A setting that only acts together with another one: (setting, its option, what switches the option on).
_DEPENDENT_SETTINGS = (
    ("rollout_is_threshold", "rollout_is", "rollout_is='token' or 'sequence'"),
    ("rollout_rs_threshold", "rollout_rs", f"rollout_rs (options: {', '.join(RS_OPTIONS)})"),
    ("bypass_loss_type", "bypass_mode", "bypass_mode=True"),
)


# Until the trainer applies M2PO over the optimizer step, the flat arguments (the trainer's config, recipe YAML,
# analyze --config) refuse the field instead of ignoring it. What the trainer must call: correction/m2po.py docstring.
M2_NOT_WIRED = (
    "rollout_m2_threshold={value!r} (M2PO) is not yet wired in the trainer (nor in analyze): the step-global mask is "
    "implemented as pure functions (trl_rollout_corr.correction.m2po: m2po_candidates / m2po_select / keep_mask), but "
    "applying it over an optimizer step needs the trainer's per-step hook, which does not exist yet. Unset "
    "rollout_m2_threshold."
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
        if correction.m2_enabled:
            raise ValueError(M2_NOT_WIRED.format(value=base["rollout_m2_threshold"]))
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


# ---------------------------------------------------------------------------------------------- documentation
def markdown_table(table: tuple[CorrectionField, ...] = CORRECTION_FIELD_TABLE) -> str:
    """The configuration table of ``docs/configuration.md`` (field, default, values, meaning), from the field table."""
    lines = ["| field | default | values | meaning |", "|---|---|---|---|"]
    for f in table:
        default = "`None`" if f.default is None else f"`{f.default!r}`".replace("'", '"')
        lines.append(f"| `{f.name}` | {default} | {f.values} | {f.help} |")
    return "\n".join(lines)
