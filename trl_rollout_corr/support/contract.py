"""The sampler contract: what an engine applies, in its order, and what a trainer cannot reproduce (``support``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

MATCHING_MODES = ("off", "recompute", "replay")
ENGINES = ("transformers", "vllm")

# Processors the trainer reproduces. "value": changes the logits of the tokens it keeps; "set": only removes tokens.
REPRODUCIBLE = {
    "repetition_penalty": "value", "frequency_penalty": "value", "presence_penalty": "value",
    "temperature": "value", "top_k": "set", "top_p": "set", "min_p": "set",
}
_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


# ====================================================================================== the sampler contract
@dataclass(frozen=True)
class SamplerParam:
    """One sampling parameter that shapes mu.

    Attributes:
        name: the parameter (``top_p``, ``no_repeat_ngram_size``, ...).
        value: its value.
        source: where it was set (e.g. ``"GRPOConfig.top_p"``, ``"generation_kwargs"``, ``"generation_config.json"``).
        kind: ``"value"`` (changes the kept tokens' logits) or ``"set"`` (only removes tokens).
    """

    name: str
    value: Any
    source: str
    kind: str

    def __str__(self) -> str:
        return f"{self.name}={self.value!r} ({self.source})"


@dataclass(frozen=True)
class SamplerSpec:
    """The sampler contract: what the rollout engine applied to the logits, in its order.

    Attributes:
        engine: ``"transformers"`` (``GenerationMixin`` logits processors) or ``"vllm"`` (vLLM's sampler); decides
            the order of the set processors and the details of the repetition penalty (see ``SupportScorer``).
        steps: the processors the trainer reproduces (``REPRODUCIBLE``), in the engine's order; parameters at their
            neutral value (temperature 1, top_p 1, top_k 0, min_p 0, penalties 1/0) are left out.
        unsupported: parameters that shape mu but that the trainer cannot recompute (``no_repeat_ngram_size``,
            ``logit_bias``, ...), in the engine's order.
        trainer_temperature: what the trainer scores with when matching is off (TRL's log-prob head divides the
            logits by ``GRPOConfig.temperature`` and nothing else).

    Raises:
        ValueError: for an unknown engine.
    """

    engine: str
    steps: tuple[SamplerParam, ...] = ()
    unsupported: tuple[SamplerParam, ...] = ()
    trainer_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"SamplerSpec.engine must be one of {ENGINES}, got {self.engine!r}.")

    def value(self, name: str, default: Any = None) -> Any:
        """The value of reproducible step ``name``, ``default`` when the engine does not apply it."""
        return next((p.value for p in self.steps if p.name == name), default)

    @property
    def temperature(self) -> float:
        """The engine's temperature (1.0 when it applies none)."""
        return float(self.value("temperature", 1.0))

    @property
    def set_steps(self) -> tuple[SamplerParam, ...]:
        return tuple(p for p in self.steps if p.kind == "set")

    @property
    def value_steps(self) -> tuple[SamplerParam, ...]:
        return tuple(p for p in self.steps if p.kind == "value")

    @property
    def truncates(self) -> bool:
        """True when the engine samples from a truncated support (a set processor, reproducible or not)."""
        return any(p.kind == "set" for p in self.steps + self.unsupported)

    @property
    def matches_trl_scoring(self) -> bool:
        """True when the engine samples exactly what TRL's log-prob head scores: no processor but a temperature equal
        to the trainer's (``report("off")`` is empty). Support matching then changes no log-prob and only costs the
        support scorer in every policy forward (``features.support_matching`` warns once at start-up)."""
        return not self.report("off")

    def describe(self) -> str:
        """One line: the engine's processors in order and what the trainer scores with when matching is off."""
        applied = ", ".join(str(p) for p in self.steps + self.unsupported) or "none"
        return (f"engine {self.engine} applies, in order: {applied}; TRL's log-prob head scores "
                f"log_softmax(logits / {self.trainer_temperature:g}) over the full vocabulary")

    def report(self, matching: str) -> list[str]:
        """Every parameter that shapes mu but not the trainer's scoring under ``matching``, naming it and the bias.

        Args:
            matching: ``"off"``, ``"recompute"`` or ``"replay"``.

        Returns:
            One line per parameter (empty when the trainer scores exactly as the engine samples).

        Raises:
            ValueError: for an unknown ``matching``.
        """
        check_matching_mode(matching)
        unscored = list(self.unsupported)
        if matching == "replay":  # the kept set covers every set processor, reproducible or not
            unscored = [p for p in unscored if p.kind == "value"]
        if matching == "off":
            unscored = [p for p in self.steps if p.name != "temperature"] + unscored
            if not math.isclose(self.temperature, self.trainer_temperature, rel_tol=0, abs_tol=1e-12):
                unscored.insert(0, SamplerParam("temperature", self.temperature, self._source("temperature"), "value"))
        return [f"{p} shapes mu but not the trainer's log-probs: {_bias(p, self.trainer_temperature)}"
                for p in unscored]

    def check(self, matching: str) -> None:
        """Refuse a matching mode the trainer cannot deliver for this sampler.

        Raises:
            ValueError: ``"recompute"`` with a parameter the trainer cannot recompute, or ``"replay"`` with a value
                processor it cannot reproduce; the message names each parameter and the fix.
        """
        check_matching_mode(matching)
        if matching == "off":
            return
        blocking = [p for p in self.unsupported if matching == "recompute" or p.kind == "value"]
        if not blocking:
            return
        names = ", ".join(str(p) for p in blocking)
        hint = (" (a set processor: rollout_support_matching='replay' covers it on the transformers.generate path)"
                if matching == "recompute" and all(p.kind == "set" for p in blocking) else "")
        raise ValueError(
            f"rollout_support_matching={matching!r}: the trainer cannot reproduce {names}{hint}. Remove it from the "
            "sampler (GRPOConfig / generation_kwargs / generation_config.json), or set rollout_support_matching='off' "
            "(the start-up report then names the bias it leaves)."
        )

    def _source(self, name: str) -> str:
        return next((p.source for p in self.steps if p.name == name), "default")


def _bias(p: SamplerParam, trainer_temperature: float) -> str:
    if p.name == "temperature":
        return (f"the engine samples at temperature {p.value:g}, the trainer scores at {trainer_temperature:g}: every "
                "engine ratio pi_train / mu is off 1 in both directions (reported as mismatch)")
    if p.kind == "set":
        return ("mu renormalises over the kept support, so every engine ratio pi_train / mu sits at the kept mass "
                "S <= 1 (log S <= 0 nats per token): a bias, not a mismatch")
    return ("it changes the engine's logits, so the engine ratio of every affected token is biased (reported as "
            "mismatch)")


def check_matching_mode(matching: str) -> None:
    """Raises ValueError unless ``matching`` is one of ``MATCHING_MODES``."""
    if matching not in MATCHING_MODES:
        raise ValueError(f"rollout_support_matching must be one of {MATCHING_MODES}, got {matching!r}.")


# transformers 5.x GenerationMixin._get_logits_processor: the processors it builds that the trainer cannot reproduce,
# in its order, as (parameter, is it active for this value, kind, processor class). Temperature / top-k / top-p /
# min-p / repetition penalty are reproduced (see sampler_from_generation_config).
_TRANSFORMERS_UNSUPPORTED = (
    ("guidance_scale", lambda v: v is not None and v != 1, "value", "UnbatchedClassifierFreeGuidanceLogitsProcessor"),
    ("sequence_bias", lambda v: v is not None, "value", "SequenceBiasLogitsProcessor"),
    ("no_repeat_ngram_size", lambda v: v is not None and v > 0, "set", "NoRepeatNGramLogitsProcessor"),
    ("bad_words_ids", lambda v: v is not None, "set", "NoBadWordsLogitsProcessor"),
    ("min_length", lambda v: v is not None and v > 0, "set", "MinLengthLogitsProcessor"),
    ("min_new_tokens", lambda v: v is not None and v > 0, "set", "MinNewTokensLengthLogitsProcessor"),
    ("forced_bos_token_id", lambda v: v is not None, "set", "ForcedBOSTokenLogitsProcessor"),
    ("forced_eos_token_id", lambda v: v is not None, "set", "ForcedEOSTokenLogitsProcessor"),
    ("remove_invalid_values", lambda v: v is True, "value", "InfNanRemoveLogitsProcessor"),
    ("exponential_decay_length_penalty", lambda v: v is not None, "value", "ExponentialDecayLengthPenalty"),
    ("suppress_tokens", lambda v: v is not None, "set", "SuppressTokensLogitsProcessor"),
    ("begin_suppress_tokens", lambda v: v is not None, "set", "SuppressTokensAtBeginLogitsProcessor"),
    ("top_h", lambda v: v is not None, "set", "TopHLogitsWarper"),
    ("typical_p", lambda v: v is not None and v < 1.0, "set", "TypicalLogitsWarper"),
    ("epsilon_cutoff", lambda v: v is not None and 0.0 < v < 1.0, "set", "EpsilonLogitsWarper"),
    ("eta_cutoff", lambda v: v is not None and 0.0 < v < 1.0, "set", "EtaLogitsWarper"),
    ("watermarking_config", lambda v: v is not None, "value", "Watermark"),  # WatermarkLogitsProcessor, SynthID...
)
_UNSUPPORTED_CLASSES = {cls: name for name, _, _, cls in _TRANSFORMERS_UNSUPPORTED}

# The transformers logits processors the trainer reproduces: class name -> (parameter, attribute holding its value).
TRANSFORMERS_PROCESSOR_CLASSES = {
    "RepetitionPenaltyLogitsProcessor": ("repetition_penalty", "penalty"),
    "TemperatureLogitsWarper": ("temperature", "temperature"),
    "TopKLogitsWarper": ("top_k", "top_k"),
    "TopPLogitsWarper": ("top_p", "top_p"),
    "MinPLogitsWarper": ("min_p", "min_p"),
}


def sampler_from_generation_config(
    config: Mapping[str, Any], *, sources: Mapping[str, str] = {}, default_source: str = "generation_config.json",
    trainer_temperature: float = 1.0,
) -> SamplerSpec:
    """The sampler contract of ``transformers.generate`` for a resolved generation config.

    Args:
        config: the generation config generate uses (``GenerationConfig.to_dict()`` after transformers merged the
            caller's config, the model's ``generation_config.json`` and its global defaults).
        sources: parameter -> where it was set (e.g. ``{"top_p": "GRPOConfig.top_p"}``); others get
            ``default_source``.
        default_source: the source of every parameter not in ``sources``.
        trainer_temperature: what TRL's log-prob head divides by.

    Returns:
        ``SamplerSpec(engine="transformers")``: repetition penalty (a processor), then the warpers temperature,
        top-k, top-p, min-p (transformers' order); everything else that adds a processor in ``unsupported``.

    Raises:
        ValueError: ``do_sample`` is False or ``num_beams > 1`` (no sampling distribution to match).
    """
    if not config.get("do_sample", False) or (config.get("num_beams") or 1) > 1:
        raise ValueError("The sampler contract needs sampled generation (do_sample=True, num_beams=1).")

    def param(name, value, kind):
        return SamplerParam(name, value, sources.get(name, default_source), kind)

    steps = []
    penalty = config.get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        steps.append(param("repetition_penalty", float(penalty), "value"))
    temperature = config.get("temperature")
    if temperature is not None and temperature != 1.0:
        steps.append(param("temperature", float(temperature), "value"))
    top_k = config.get("top_k")
    if top_k is not None and top_k != 0:
        steps.append(param("top_k", int(top_k), "set"))
    top_p = config.get("top_p")
    if top_p is not None and top_p < 1.0:
        steps.append(param("top_p", float(top_p), "set"))
    min_p = config.get("min_p")
    if min_p is not None and min_p > 0.0:
        steps.append(param("min_p", float(min_p), "set"))
    unsupported = [param(name, config.get(name), kind) for name, active, kind, _ in _TRANSFORMERS_UNSUPPORTED
                   if active(config.get(name))]
    return SamplerSpec("transformers", tuple(steps), tuple(unsupported), float(trainer_temperature))


# vLLM 0.32 SamplingParams fields that do not change the per-token sampling distribution.
_VLLM_NEUTRAL = frozenset({
    "n", "max_tokens", "logprobs", "prompt_logprobs", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "detokenize", "output_kind",
    "truncate_prompt_tokens", "flat_logprobs", "extra_args", "best_of", "logprob_token_ids",
})
# vLLM 0.32 fields the trainer cannot reproduce, in the sampler's order (allowed ids, bad words, min tokens /
# logit bias, structured outputs), as (parameter, active, kind).
_VLLM_UNSUPPORTED = (
    ("allowed_token_ids", lambda v: v is not None, "set"),
    ("bad_words", lambda v: bool(v), "set"),
    ("min_tokens", lambda v: bool(v), "set"),
    ("logit_bias", lambda v: bool(v), "value"),
    ("logits_processors", lambda v: bool(v), "value"),
    ("structured_outputs", lambda v: v is not None, "set"),
)


def sampler_from_vllm_params(
    params: Mapping[str, Any], *, sources: Mapping[str, str] = {}, default_source: str = "SamplingParams",
    trainer_temperature: float = 1.0,
) -> SamplerSpec:
    """The sampler contract of vLLM (0.32's V1 sampler) for the keyword arguments of its ``SamplingParams``.

    Args:
        params: the ``SamplingParams(**params)`` keyword arguments (as TRL's vLLM paths and
            ``engines.vllm_cpu_rollout.VLLMCPURollout`` build them).
        sources, default_source, trainer_temperature: as ``sampler_from_generation_config``.

    Returns:
        ``SamplerSpec(engine="vllm")``: repetition, frequency and presence penalties, temperature, then min-p, top-k,
        top-p (vLLM's order: ``Sampler.apply_logits_processors``, then ``Sampler.sample``); fields vLLM uses that the
        trainer cannot reproduce, and any field this table does not know, in ``unsupported``.

    Raises:
        ValueError: a temperature below vLLM's 1e-5 greedy threshold (no sampling distribution to match).
    """

    def param(name, value, kind):
        return SamplerParam(name, value, sources.get(name, default_source), kind)

    temperature = float(params.get("temperature", 1.0))
    if temperature < 1e-5:
        raise ValueError(f"temperature={temperature} is greedy in vLLM: no sampling distribution to match.")
    steps = []
    for name, neutral in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)):
        value = params.get(name)
        if value is not None and float(value) != neutral:
            steps.append(param(name, float(value), "value"))
    if temperature != 1.0:
        steps.append(param("temperature", temperature, "value"))
    min_p = params.get("min_p")
    if min_p:
        steps.append(param("min_p", float(min_p), "set"))
    top_k = params.get("top_k")
    if top_k is not None and top_k > 0:
        steps.append(param("top_k", int(top_k), "set"))
    top_p = params.get("top_p")
    if top_p is not None and top_p < 1.0:
        steps.append(param("top_p", float(top_p), "set"))
    unsupported = [param(name, params.get(name), kind) for name, active, kind in _VLLM_UNSUPPORTED
                   if active(params.get(name))]
    known = set(REPRODUCIBLE) | _VLLM_NEUTRAL | {name for name, _, _ in _VLLM_UNSUPPORTED}
    unsupported += [param(name, value, "value") for name, value in params.items() if name not in known]
    return SamplerSpec("vllm", tuple(steps), tuple(unsupported), float(trainer_temperature))


def check_transformers_processors(spec: SamplerSpec, processors: Sequence[Any]) -> list[str]:
    """Compare the logits processors ``generate`` built with the contract.

    Args:
        spec: the contract (``engine="transformers"``).
        processors: the ``LogitsProcessorList`` generate used (the recorder appended last is ignored).

    Returns:
        One line per disagreement: a reproducible processor with another value or order than the contract's, or a
        processor the contract does not list (empty when generate applied exactly what the contract says).
        ``LogitNormalization`` (``renormalize_logits=True``) last, after every other processor, is not a
        disagreement: it is a log-softmax, which shifts each position's logits by one constant, so neither the
        sampling distribution nor the processed log-probs (mu) change (transformers always appends it last).
    """
    seen, problems = [], []
    ours = [p for p in processors if type(p).__name__ != "SampledTokenLogProbs"]
    for i, proc in enumerate(ours):
        name = type(proc).__name__
        if name == "LogitNormalization" and i == len(ours) - 1:
            continue
        if name in TRANSFORMERS_PROCESSOR_CLASSES:
            param, attr = TRANSFORMERS_PROCESSOR_CLASSES[name]
            value = getattr(proc, attr, None)
            if param == "min_p" and not value:
                continue  # transformers adds MinP for min_p=0.0: it keeps everything
            seen.append((param, value))
        else:
            param = next((p for cls, p in _UNSUPPORTED_CLASSES.items() if name.startswith(cls)), None)
            if param is None or param not in {p.name for p in spec.unsupported}:
                problems.append(f"generate applied {name}, which the sampler contract does not list")
    expected = [(p.name, p.value) for p in spec.steps]
    if [n for n, _ in seen] != [n for n, _ in expected] or any(
            not math.isclose(float(a), float(b), rel_tol=1e-9) for (_, a), (_, b) in zip(seen, expected)):
        problems.append(f"generate applied {seen}, the sampler contract expected {expected}")
    return problems
