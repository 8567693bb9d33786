"""Threshold parsing of the correction config: IS bounds, RS options and their specs (``config``)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..correction.rejection import RS_OPTION_PARTS, RS_OPTIONS  # the RS option table lives with the RS math

IS_LEVELS = ("token", "sequence")
RS_RATIOS = ("direct", "engine")  # rollout_rs_on: the ratio RS judges
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


def _is_off(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("", "none", "null")
