"""The correction-field table (the one source of the fields), its dataclass decorator, its Markdown (``config``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .thresholds import ThresholdSpec


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
        values: the allowed values, in Markdown (the "values" of ``docs/reference/configuration.md``).
        help: what it means, in Markdown (the ``--help`` text, the meaning in ``docs/reference/configuration.md``).
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
        "rollout_rs_on", Literal["direct", "engine"], str, "direct",
        '`"direct"`, `"engine"`',
        "The ratio every RS statistic judges. `direct`: the correction's own `l` (decoupled: pi_old / mu; bypass: "
        "pi_theta / mu). `engine`: the engine factor pi_train@v / mu of `policy_lag_split` (numerics only), so that "
        "stale rows are weighted by IS (which still uses pi_old / mu), not rejected for their staleness; the RS "
        "metrics are then named `rollout_rs_engine_*`. `engine` needs `rollout_rs`, decoupled mode and "
        "`policy_lag_split=True`. RS only: M2PO (`rollout_m2_threshold`) judges the whole ratio pi_old / mu either "
        "way (by design: it bounds staleness).",
    ),
    CorrectionField(
        "rollout_m2_threshold", Optional[float], str, None,
        "`tau > 0` (nats²)",
        "M2PO (second-moment mask; AReaL's `m2_threshold`, paper 0.04): over the optimizer step's global batch (every "
        "rank), mask the trained tokens with the largest `|l|` (ties: row, then position) until the mean of `l²` over "
        "the remaining ones is `<= tau`; logged as `rollout_corr/m2po_*` (second moment before / after, masked "
        "fraction). `l` is the whole log ratio pi_old / mu, also with `rollout_rs_on=\"engine\"` (by design: M2PO "
        "bounds how far off-policy the step is, staleness included). Decoupled mode, "
        "`steps_per_generation == gradient_accumulation_steps`; not in `analyze`.",
    ),
    CorrectionField(
        "bypass_mode", bool, bool, False,
        "bool",
        "False: decoupled (keep pi_old: one extra forward per generation batch, unless rollout_corr_old_forward='auto'"
        " reads it from the first loss forward). True: bypass (pi_old := mu, no extra forward; the correction runs "
        "inside the loss, from pi_theta vs mu).",
    ),
    CorrectionField(
        "bypass_loss_type", Literal["ppo_clip", "reinforce"], str, "ppo_clip",
        '`"ppo_clip"`, `"reinforce"`',
        "Bypass loss: PPO clip on pi_theta / mu (IS weights for metrics only; `rollout_is` with it warns at "
        "start-up), or `-A · w · log pi_theta` (w detached; no ratio, so TRL's clip settings epsilon / "
        "epsilon_high / delta are refused with it). Only used in bypass mode.",
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


# ---------------------------------------------------------------------------------------------- documentation
def markdown_table(table: tuple[CorrectionField, ...] = CORRECTION_FIELD_TABLE) -> str:
    """The configuration list of ``docs/reference/configuration.md``, from the field table: one item per field (its
    default, values and meaning), wrapped at the docs' 120 columns (continuation lines indented by two)."""
    import textwrap

    lines = []
    for f in table:
        default = "`None`" if f.default is None else f"`{f.default!r}`".replace("'", '"')
        lines += textwrap.wrap(f"`{f.name}` (default {default}; values: {f.values}): {f.help}", 120,
                               initial_indent="* ", subsequent_indent="  ", break_long_words=False,
                               break_on_hyphens=False)
    return "\n".join(lines)
