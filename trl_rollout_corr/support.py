"""Sampling-support matching: the sampler contract, the trainer's support (recompute / replay), support metrics.

With processed log-probs (vLLM ``processed_logprobs``, ``transformers.generate``'s processed scores) the rollout
engine reports ``log mu(a) = z'_a - logsumexp_{v in K} z'_v``: ``z'`` are the logits after the engine's value
processors (repetition / presence / frequency penalties, temperature) and ``K`` is the support its set processors
kept (top-k, top-p, min-p, ...). A trainer that scores ``log_softmax(z / T)`` over the full vocabulary differs from
it by ``log S <= 0`` nats at every token even when the numerics agree, ``S`` being the kept mass: a bias, not a
mismatch. Support matching scores with the same processors, in the engine's order:

    log pi(a) = z'_a - logsumexp_{v in K_train} z'_v          (= log p_T(a) - log S_train)

in every policy forward (pi_old and pi_theta), with gradients through the normaliser. ``K_train`` is recomputed
from the trainer's own logits (``"recompute"``) or is the engine's kept set (``"replay"``).

Contents (no TRL, no ``torch.distributed``):

* the sampler contract: ``SamplerSpec`` (what the engine applies, in its order, and what the trainer cannot
  reproduce), built by ``sampler_from_generation_config`` (``transformers.generate``) or
  ``sampler_from_vllm_params`` (vLLM ``SamplingParams``), with ``SamplerSpec.report`` (the start-up report) and
  ``SamplerSpec.check`` (the errors);
* ``KeptTokens``: an engine's kept-token sets for one completion, stored compactly (CSR of int32 ids, or of the
  removed ids where that is shorter), and ``compact_kept`` for one generation step;
* ``SupportScorer``: the chunked log-prob computation over the completion positions (``_SupportLogProbs``, a
  custom autograd function: never a ``(B, T, V)`` tensor, peak ``O(chunk x V)``, logits recomputed in the
  backward), returning a ``SupportScore``;
* ``SupportStats``: the ``rollout_corr/support_*`` metrics as exact reducible statistics.

Sources: the truncation bias is TRL's trl#6789 (processed vLLM log-probs against full-vocabulary trainer log-probs);
prime-rl, NeMo-RL and slime replay or recompute the support, each for its own engine; processor semantics and
order follow transformers 5.x ``GenerationMixin._get_logits_processor`` / ``LogitsProcessor``s and vLLM 0.32's
``v1.sample.sampler.Sampler`` (see ``docs/correction-internals.md``, "Sampling support").
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Optional, Sequence

import torch

MATCHING_MODES = ("off", "recompute", "replay")
ENGINES = ("transformers", "vllm")
PREFIX = "rollout_corr/"

# Processors the trainer reproduces. "value": changes the logits of the tokens it keeps; "set": only removes tokens.
REPRODUCIBLE = {
    "repetition_penalty": "value", "frequency_penalty": "value", "presence_penalty": "value",
    "temperature": "value", "top_k": "set", "top_p": "set", "min_p": "set",
}
_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")

# Default work-chunk size of the support computation, in logits (positions x vocabulary): 2**22 float32 = 16 MiB
# per (chunk, V) buffer; a chunk holds about six of them at its peak (see benchmarks/RESULTS.md).
DEFAULT_CHUNK_ELEMENTS = 2**22


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


# ====================================================================================== kept-token sets
@dataclass(frozen=True)
class KeptTokens:
    """An engine's kept-token sets for the T tokens of one completion, stored compactly.

    Position ``t`` lists ``token_ids[offsets[t]:offsets[t + 1]]``: the kept token ids, or, where ``complement[t]``,
    the removed ones (whichever is shorter), so memory is ``4 * min(|K_t|, V - |K_t|)`` bytes per position: never
    ``(T, V)`` floats, and nothing at all for an untruncated position.

    Attributes:
        token_ids: (M,) int32 ids.
        offsets: (T + 1,) int64, non-decreasing, ``offsets[0] == 0``, ``offsets[-1] == M``.
        complement: (T,) bool.
        vocab_size: V.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor
    complement: torch.Tensor
    vocab_size: int

    def __len__(self) -> int:
        return int(self.complement.numel())

    def sizes(self) -> torch.Tensor:
        """(T,) int64 kept-set sizes."""
        listed = self.offsets[1:] - self.offsets[:-1]
        return torch.where(self.complement, self.vocab_size - listed, listed)

    def mask(self) -> torch.Tensor:
        """(T, V) bool kept mask (tests and small inputs only: this is the dense form the class avoids)."""
        return kept_mask([self], [torch.arange(len(self))], self.vocab_size, self.token_ids.device)


def compact_kept(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One generation step's kept sets, compacted: ``(ids, counts, complement)``.

    Args:
        kept: (B, V) bool, the tokens the step could sample (finite processed scores).

    Returns:
        ``ids`` (M,) int32 (row-major: row 0's ids first), ``counts`` (B,) int64 (ids listed per row),
        ``complement`` (B,) bool (the row lists its removed ids).
    """
    vocab = kept.size(1)
    complement = kept.sum(dim=1) * 2 > vocab
    listed = kept ^ complement.unsqueeze(1)
    ids = listed.nonzero()[:, 1].to(torch.int32)
    return ids, listed.sum(dim=1), complement


def kept_tokens_from_steps(steps: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], row: int, length: int,
                           vocab_size: int) -> KeptTokens:
    """Row ``row``'s first ``length`` steps of ``compact_kept`` outputs, as ``KeptTokens``.

    Raises:
        ValueError: fewer than ``length`` steps were recorded.
    """
    if length > len(steps):
        raise ValueError(f"Row {row}: {length} tokens but only {len(steps)} kept sets were recorded.")
    ids, counts, complement = [], [], []
    for step_ids, step_counts, step_complement in steps[:length]:
        start = int(step_counts[:row].sum())
        ids.append(step_ids[start:start + int(step_counts[row])])
        counts.append(step_counts[row:row + 1])
        complement.append(step_complement[row:row + 1])
    if not ids:
        empty = torch.zeros(0, dtype=torch.int32)
        return KeptTokens(empty, torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), vocab_size)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(counts).cumsum(0)])
    return KeptTokens(torch.cat(ids).cpu(), offsets.cpu(), torch.cat(complement).cpu(), vocab_size)


def kept_mask(rows: Sequence[KeptTokens], steps: Sequence[torch.Tensor], vocab_size: int,
              device: torch.device) -> torch.Tensor:
    """Dense kept mask for a list of positions: ``steps[i]`` (1-D int64) of ``rows[i]``.

    Returns:
        (sum of len(steps[i]), V) bool, the positions in order.

    Raises:
        ValueError: a kept set was recorded for another vocabulary size.
    """
    ids, counts, complement = [], [], []
    for kept, s in zip(rows, steps):
        if kept.vocab_size != vocab_size:
            raise ValueError(f"kept-token sets over {kept.vocab_size} tokens, the trainer's head has {vocab_size}.")
        s = s.to(kept.offsets.device)
        lo, hi = kept.offsets[s], kept.offsets[s + 1]
        counts.append(hi - lo)
        complement.append(kept.complement[s])
        # one flat gather of the positions' id ranges
        span = hi - lo
        base = torch.repeat_interleave(lo - torch.cat([span.new_zeros(1), span.cumsum(0)[:-1]]), span)
        ids.append(kept.token_ids[base + torch.arange(int(span.sum()))].long())
    counts, complement = torch.cat(counts).to(device), torch.cat(complement).to(device)
    ids = torch.cat(ids).to(device)
    mask = complement.unsqueeze(1).expand(-1, vocab_size).clone()
    pos = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    mask[pos, ids] = ~complement[pos]
    return mask


# ====================================================================================== the support computation
class SupportScore(NamedTuple):
    """Per-token result of ``SupportScorer.score`` over ``(b, T)`` completion positions.

    Attributes:
        log_probs: (b, T) ``log pi(a) = z'_a - logsumexp_{K ∪ {a}} z'`` in nats, differentiable w.r.t. the hidden
            states and the LM head; 0 where ``valid`` is False. For a missed token (``a`` outside ``K``) the set is
            extended by ``a``, so the value stays finite (the caller makes the token invalid).
        log_mass: (b, T) ``log S = logsumexp_K z' - logsumexp_V z'`` (nats, <= 0), detached; 0 where not valid.
        size: (b, T) int64 ``|K|``; 0 where not valid.
        miss: (b, T) bool, the sampled token is outside ``K`` (never where not valid).
        valid: (b, T) bool, the positions scored (the completion mask).
        entropy: (b, T) entropy (nats) of the full-vocabulary softmax of ``z / temperature`` (the raw logits, no
            engine processor: what TRL's fused LM head reports with ``compute_entropy``), detached; 0 where not
            valid. None unless ``score`` was given ``entropy_temperature``.
    """

    log_probs: torch.Tensor
    log_mass: torch.Tensor
    size: torch.Tensor
    miss: torch.Tensor
    valid: torch.Tensor
    entropy: Optional[torch.Tensor] = None

    @staticmethod
    def cat(scores: Sequence["SupportScore"]) -> "SupportScore":
        """Concatenate row chunks (dim 0)."""
        return SupportScore(*(None if any(p is None for p in parts) else torch.cat(parts, dim=0)
                              for parts in zip(*scores)))


class SupportScorer:
    """Scores completion tokens with the engine's processors applied to the trainer's logits.

    Args:
        spec: the sampler contract.
        mode: ``"recompute"`` (``K`` from the trainer's logits with ``spec``'s set processors in the engine's order)
            or ``"replay"`` (``K`` is the engine's kept set, given per row to ``score``).
        chunk_elements: positions per work chunk times V (the peak working memory is a few ``(chunk, V)``
            buffers, float32 unless the inputs are float64).

    Raises:
        ValueError: an unknown mode.

    Semantics, per position (row r, completion step s; the token at prompt width P + s):

    * value processors in the engine's order: repetition penalty ``rp`` on every token already seen (transformers:
      every id of the generate input up to the position, left padding included; vLLM: the prompt's real tokens and
      the completion so far), ``z < 0 -> z * rp`` else ``z / rp`` (transformers) / ``z > 0 -> z * (1 / rp)`` else
      ``z * rp`` (vLLM); vLLM's frequency and presence penalties subtract ``f * count`` and ``p * [count > 0]`` over
      the completion so far; temperature divides;
    * set processors (recompute) in the engine's order, each on the scores the previous ones left: top-k keeps the
      k largest (ties kept), top-p keeps the tokens whose ascending cumulative softmax exceeds ``1 - p`` (and the
      largest), min-p keeps ``p_v >= min_p * max p``. Every kept set is ``{v : z'_v >= t}`` for one threshold t,
      so tokens tied with the last kept one are kept (an engine's sort may split such exact ties);
    * ``log pi(a) = z'_a - logsumexp_{K ∪ {a}} z'``; its gradient w.r.t. ``z'`` is ``onehot(a) - q`` with ``q`` the
      softmax over ``K ∪ {a}`` (zero for a one-token support), times the value processors' derivative.
    """

    def __init__(self, spec: SamplerSpec, mode: str, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        if mode not in ("recompute", "replay"):
            raise ValueError(f"SupportScorer mode must be 'recompute' or 'replay', got {mode!r}.")
        self.spec, self.mode, self.chunk_elements = spec, mode, int(chunk_elements)

    def score(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        kept: Optional[Sequence[KeptTokens]] = None,
        entropy_temperature: Optional[float] = None,
    ) -> SupportScore:
        """Support-matched log-probs of the completion tokens of a prompt + completion batch.

        Args:
            hidden: (b, L, H) the backbone's last hidden states (the LM head's input), with grad if wanted.
            weight: (V, H) the LM head weight; bias: (V,) or None.
            input_ids: (b, L) prompt (left-padded, width ``P = L - T``) then completion ids.
            attention_mask: (b, L) 0/1; its completion part ``[:, P:]`` is the completion mask.
            logits_to_keep: T, the completion width.
            kept: replay only: ``b`` kept-token sets, ``len(kept[i])`` = row i's completion length.
            entropy_temperature: also compute ``SupportScore.entropy`` at this temperature (TRL's
                ``GRPOConfig.temperature``), from the logits this pass computes anyway, so that a caller needing
                TRL's entropies does not run TRL's LM head as well (``trl_compat.skip_fused_lm_head``).

        Returns:
            ``SupportScore`` of shape (b, T).

        Raises:
            ValueError: mismatched shapes, replay without ``kept`` or with a row whose length differs from its
                completion mask (naming the row), a temperature that is not positive.
        """
        b, length = input_ids.shape
        T = int(logits_to_keep)
        if hidden.shape[:2] != (b, length) or attention_mask.shape != (b, length) or not 0 < T < length:
            raise ValueError(
                f"SupportScorer.score: hidden {tuple(hidden.shape)}, input_ids {tuple(input_ids.shape)}, "
                f"attention_mask {tuple(attention_mask.shape)} and logits_to_keep {T} do not describe one (b, P + T) "
                "batch."
            )
        if entropy_temperature is not None and not entropy_temperature > 0:
            raise ValueError(f"SupportScorer.score: entropy_temperature must be > 0, got {entropy_temperature}.")
        P = length - T
        valid = attention_mask[:, P:] != 0
        rows, steps = valid.nonzero(as_tuple=True)
        plan = _ChunkPlan(self, input_ids, attention_mask, P, rows, steps, weight.size(0), kept)
        plan.entropy_temperature = entropy_temperature
        h = hidden[rows, P - 1 + steps]
        logp, log_mass, size, miss, entropy = _SupportLogProbs.apply(h, weight, bias, plan)
        parts = (log_mass, size, miss) + ((entropy,) if entropy_temperature is not None else ())
        out = [torch.zeros(b, T, dtype=t.dtype, device=t.device) for t in (logp, *parts)]
        out[0] = out[0].index_put((rows, steps), logp)  # out of place: keeps the graph to the hidden states
        for full, part in zip(out[1:], parts):
            full[rows, steps] = part
        return SupportScore(out[0], out[1], out[2], out[3], valid, out[4] if entropy_temperature is not None else None)


class _ChunkPlan:
    """Everything ``_SupportLogProbs`` needs per chunk of positions: labels, value processors, kept sets."""

    def __init__(self, scorer: SupportScorer, input_ids, attention_mask, P, rows, steps, vocab, kept) -> None:
        spec = scorer.spec
        self.spec, self.mode, self.vocab = spec, scorer.mode, vocab
        self.rows, self.steps, self.P = rows, steps, P
        self.labels = input_ids[rows, P + steps]
        self.chunk = max(1, scorer.chunk_elements // max(vocab, 1))
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.entropy_temperature: Optional[float] = None  # SupportScorer.score sets it to compute the entropies
        self.kept = None
        if self.mode == "replay":
            self.kept = self._replay_rows(kept, attention_mask[:, P:] != 0)

    def _replay_rows(self, kept, valid):
        if kept is None:
            raise ValueError("rollout_support_matching='replay' needs the engine's kept-token sets for every row.")
        if len(kept) != valid.size(0):
            raise ValueError(f"{len(kept)} kept-token sets for {valid.size(0)} rows.")
        lengths = valid.sum(dim=1).tolist()
        for row, (k, n) in enumerate(zip(kept, lengths)):
            if len(k) != n or not bool(valid[row, :n].all()):
                raise ValueError(
                    f"Row {row}: {len(k)} kept-token sets for a completion of {n} tokens (or a completion mask with "
                    "holes); the replayed support would be misaligned."
                )
        return kept

    def chunks(self) -> Iterator[slice]:
        n = self.labels.numel()
        for start in range(0, n, self.chunk):
            yield slice(start, min(start + self.chunk, n))

    # ---------------------------------------------------------------- value processors
    def processed(self, z: torch.Tensor, sl: slice) -> tuple[torch.Tensor, Any]:
        """z' (in place on ``z``) and dz'/dz (a (n, V) tensor, or a float) for the chunk's raw logits ``z``."""
        scale: Any = 1.0
        seen = counts = None
        for p in self.spec.value_steps:
            if p.name == "repetition_penalty":
                seen = self._seen(sl) if seen is None else seen
                if self.spec.engine == "vllm":  # vLLM: logits *= where(logits > 0, 1 / rp, rp) on seen tokens
                    factor = torch.where(z > 0, 1.0 / p.value, p.value)
                    factor = torch.where(seen, factor, 1.0).to(z.dtype)
                    z.mul_(factor)
                else:  # transformers: where(score < 0, score * rp, score / rp) on seen tokens
                    factor = torch.where(seen, torch.where(z < 0, p.value, 1.0 / p.value), 1.0).to(z.dtype)
                    z.copy_(torch.where(seen, torch.where(z < 0, z * p.value, z / p.value), z))
                scale = factor * scale
            elif p.name in ("frequency_penalty", "presence_penalty"):
                counts = self._completion_counts(sl) if counts is None else counts
                z.sub_(p.value * (counts if p.name == "frequency_penalty" else (counts > 0).to(z.dtype)))
            elif p.name == "temperature":
                z.div_(p.value)
                scale = scale / p.value
        return z, scale

    def _seen(self, sl: slice) -> torch.Tensor:
        """(n, V) bool: the ids the engine's repetition penalty counts as seen at each position of the chunk."""
        rows, steps = self.rows[sl], self.steps[sl]
        ids = self.input_ids[rows].clamp(max=self.vocab)
        width = torch.arange(ids.size(1), device=ids.device)
        allowed = width.unsqueeze(0) < (self.P + steps).unsqueeze(1)
        if self.spec.engine == "vllm":  # the prompt's real tokens only, not the left padding
            allowed &= self.attention_mask[rows] != 0
        ids = torch.where(allowed, ids, self.vocab)
        seen = torch.zeros(ids.size(0), self.vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(1, ids, True)[:, : self.vocab]

    def _completion_counts(self, sl: slice) -> torch.Tensor:
        """(n, V) float: occurrences of each id in the completion before each position of the chunk."""
        rows, steps = self.rows[sl], self.steps[sl]
        ids = self.input_ids[rows, self.P:].clamp(max=self.vocab)
        allowed = torch.arange(ids.size(1), device=ids.device).unsqueeze(0) < steps.unsqueeze(1)
        ids = torch.where(allowed, ids, self.vocab)
        counts = torch.zeros(ids.size(0), self.vocab + 1, dtype=torch.float32, device=ids.device)
        return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))[:, : self.vocab]

    # ---------------------------------------------------------------- kept sets
    def support(self, y: torch.Tensor, sl: slice, threshold: Optional[torch.Tensor] = None):
        """(kept (n, V) bool, threshold (n,) or None) for processed logits ``y``; pass the forward's threshold in the
        backward to skip the sort."""
        if self.mode == "replay":
            chunk_rows, chunk_steps = self.rows[sl], self.steps[sl]
            groups = torch.unique_consecutive(chunk_rows, return_counts=True)
            parts, start = [], 0
            for row, count in zip(groups[0].tolist(), groups[1].tolist()):
                parts.append((self.kept[row], chunk_steps[start:start + count]))
                start += count
            return kept_mask([k for k, _ in parts], [s for _, s in parts], self.vocab, y.device), None
        if threshold is None:
            threshold = recompute_threshold(y, self.spec)
        return y >= threshold.unsqueeze(1), threshold


def recompute_threshold(y: torch.Tensor, spec: SamplerSpec) -> torch.Tensor:
    """The kept-set threshold of ``spec``'s set processors, in the engine's order, on processed logits ``y``.

    Args:
        y: (n, V) processed logits (after the value processors).
        spec: the sampler contract.

    Returns:
        (n,) t such that the kept set is ``{v : y_v >= t}`` (``-inf``: everything kept).
    """
    n, vocab = y.shape
    t = y.new_full((n,), -math.inf)
    for p in spec.set_steps:
        cur = y if p is spec.set_steps[0] else y.masked_fill(y < t.unsqueeze(1), -math.inf)
        if p.name == "top_k":
            k = min(int(p.value), vocab)
            if k < vocab:
                t = torch.maximum(t, cur.topk(k, dim=-1).values[:, -1])
        elif p.name == "top_p":
            t = torch.maximum(t, _top_p_threshold(cur, float(p.value)))
        elif p.name == "min_p":
            probs = cur.softmax(dim=-1)
            removed = probs < p.value * probs.amax(dim=-1, keepdim=True)
            t = torch.maximum(t, cur.masked_fill(removed, math.inf).amin(dim=-1))
            del probs, removed
    return t


def _top_p_threshold(scores: torch.Tensor, top_p: float, first_k: int = 256) -> torch.Tensor:
    """(n,) the smallest score top-p keeps: the engines drop a token when the ascending cumulative softmax up to
    it is ``<= 1 - top_p``, i.e. when the mass strictly above it is ``>= top_p`` (the largest is always kept).

    Computed from the ``k`` largest scores (``topk``: 10-30x cheaper than a full sort of a 49k vocabulary), ``k``
    quadrupled for the rows whose kept set does not fit, and one full sort for the rows left once ``k`` passes
    V / 16 (near-uniform distributions); the cumulative mass in float64.
    """
    n, vocab = scores.shape
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    out = torch.empty(n, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(n, device=scores.device)
    k = min(first_k, vocab)
    while rows.numel():
        if k > vocab // 16:
            k = vocab
        values = scores[rows].sort(dim=-1, descending=True).values if k == vocab else scores[rows].topk(k).values
        probs = (values - lse[rows]).double().exp()
        above = probs.cumsum(dim=-1) - probs  # mass strictly above each of the k largest
        kept = (above < top_p).sum(dim=-1).clamp(min=1)
        done = (kept < k) | (k == vocab)
        out[rows[done]] = values[done].gather(1, (kept[done] - 1).unsqueeze(1)).squeeze(1)
        rows, k = rows[~done], 4 * k
    return out


class _SupportLogProbs(torch.autograd.Function):
    """``log pi(a)`` over ``K ∪ {a}`` per position, chunked over positions; the backward recomputes the logits.

    forward(hidden (N, H), weight (V, H), bias (V,) or None, plan) -> (log_probs (N,), log_mass (N,), size (N,),
    miss (N,), entropy (N,): the full-vocabulary entropy at ``plan.entropy_temperature``, or (0,) when it is None);
    only ``log_probs`` is differentiable. Saved for the backward: the inputs, the (N,) thresholds (recompute) and the
    (N,) outputs, never a (N, V) tensor.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan: _ChunkPlan):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n_pos, device = hidden.size(0), hidden.device
        log_probs = torch.empty(n_pos, dtype=dtype, device=device)
        log_mass = torch.empty(n_pos, dtype=dtype, device=device)
        size = torch.empty(n_pos, dtype=torch.int64, device=device)
        miss = torch.empty(n_pos, dtype=torch.bool, device=device)
        thresholds = torch.full((n_pos,), -math.inf, dtype=dtype, device=device)
        entropy_t = plan.entropy_temperature
        entropy = torch.empty(n_pos if entropy_t is not None else 0, dtype=dtype, device=device)
        for sl in plan.chunks():
            z = _logits(hidden[sl], weight, bias, dtype)
            if entropy_t is not None:
                entropy[sl] = _entropy(z, entropy_t)
            y, _ = plan.processed(z, sl)
            kept, t = plan.support(y, sl)
            if t is not None:
                thresholds[sl] = t
            label = plan.labels[sl].unsqueeze(1)
            hit = kept.gather(1, label).squeeze(1)
            y_label = y.gather(1, label).squeeze(1)
            lse_all = torch.logsumexp(y, dim=-1)
            lse_kept = torch.logsumexp(y.masked_fill_(~kept, -math.inf), dim=-1)
            lse_scored = torch.where(hit, lse_kept, torch.logaddexp(lse_kept, y_label))
            log_probs[sl] = y_label - lse_scored
            log_mass[sl] = lse_kept - lse_all
            size[sl] = kept.sum(dim=1)
            miss[sl] = ~hit
        ctx.save_for_backward(hidden, weight, bias, thresholds)
        ctx.plan, ctx.dtype = plan, dtype
        ctx.mark_non_differentiable(log_mass, size, miss, entropy)
        return log_probs, log_mass, size, miss, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, *_):
        hidden, weight, bias, thresholds = ctx.saved_tensors
        plan, dtype = ctx.plan, ctx.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        for sl in plan.chunks():
            h = hidden[sl].to(dtype)
            y, scale = plan.processed(_logits(h, weight, bias, dtype), sl)
            kept, _ = plan.support(y, sl, thresholds[sl])
            label = plan.labels[sl].unsqueeze(1)
            kept.scatter_(1, label, True)  # K ∪ {a}
            g = grad_log_probs[sl].to(dtype).unsqueeze(1)
            grad = torch.softmax(y.masked_fill_(~kept, -math.inf), dim=-1).mul_(-g)
            grad.scatter_add_(1, label, g)  # g * (onehot(a) - q)
            grad = grad.mul_(scale) if torch.is_tensor(scale) else grad.mul_(float(scale))
            if grad_h is not None:
                grad_h[sl] = grad @ weight.to(dtype)
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(dim=0)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return cast(grad_h, hidden), cast(grad_w, weight), None if bias is None else cast(grad_b, bias), None


def _entropy(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """(n,) entropy (nats) of ``softmax(z / temperature)`` over the last dim of the (n, V) logits ``z``, as TRL's
    chunked head: ``log Z - sum_v e^{x_v} x_v / Z`` with ``x = z * (1 / temperature)``."""
    x = z * (1.0 / temperature)
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    p = torch.exp(x - log_z)
    return log_z.squeeze(-1) - torch.linalg.vecdot(p, x)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    z = h.to(dtype) @ weight.to(dtype).t()
    return z if bias is None else z.add_(bias.to(dtype))


@contextlib.contextmanager
def capture_module_outputs(module: torch.nn.Module, fn: Callable[..., Any]) -> Iterator[list]:
    """Within the block, every forward of ``module`` appends ``fn(args, kwargs, output)`` to the yielded list.

    A forward hook (``register_forward_hook(with_kwargs=True)``), removed on exit, also on error. It runs inside the
    module's caller's forward, so it sees the tensors as the caller does (with their autograd graph).
    """
    results: list = []
    handle = module.register_forward_hook(lambda _m, args, kwargs, output: results.append(fn(args, kwargs, output)),
                                          with_kwargs=True)
    try:
        yield results
    finally:
        handle.remove()


# ====================================================================================== metrics
SUPPORT_METRICS = ("support_log_mass_mean", "support_size_mean", "support_size_p50", "support_size_p99",
                   "support_singleton_fraction", "support_miss_fraction")


@dataclass
class SupportStats:
    """The ``rollout_corr/support_*`` statistics of some tokens, reducible across micro-batches and ranks.

    Attributes:
        sums: (5,) float64: tokens, sum of log S (nats), sum of |K|, one-token supports, misses.
        sizes: the per-token |K| (float64), kept for exact order statistics (8 bytes a token until the flush).

    ``support_log_mass_mean`` is the mean log kept mass (nats, <= 0; ``exp`` of it is the typical engine ratio
    without matching), ``support_size_mean/p50/p99`` the kept-set sizes (exact quantiles, linear interpolation as
    ``torch.quantile``), ``support_singleton_fraction`` the fraction of one-token supports (ratio 1, zero
    gradient), ``support_miss_fraction`` the fraction of sampled tokens outside the trainer's support (made
    invalid). Over the valid completion tokens; 0 when there is none.
    """

    sums: torch.Tensor
    sizes: list = field(default_factory=list)

    @classmethod
    def from_score(cls, score: SupportScore, mask: torch.Tensor) -> "SupportStats":
        """The statistics of ``score`` over the tokens where ``mask`` (b, T) and ``score.valid`` hold."""
        tokens = score.valid & (mask.to(score.valid.device) != 0)
        size = score.size[tokens].double()
        sums = torch.stack([
            tokens.sum().double(), score.log_mass[tokens].double().sum(), size.sum(),
            (size == 1).sum().double(), score.miss[tokens].sum().double(),
        ])
        return cls(sums, [size])

    def merge(self, other: "SupportStats") -> "SupportStats":
        return SupportStats(self.sums + other.sums.to(self.sums.device), self.sizes + other.sizes)

    def reduce(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
               gather: Callable[[torch.Tensor], torch.Tensor]) -> "SupportStats":
        """Across ranks: ``reduce_sum`` of the sums, ``gather`` (uneven all-gather) of the sizes."""
        sizes = torch.cat(self.sizes) if self.sizes else self.sums.new_zeros(0)
        return SupportStats(reduce_sum(self.sums), [gather(sizes)])

    def finalize(self) -> dict[str, float]:
        """``rollout_corr/support_*`` -> float (one host transfer)."""
        sizes = torch.cat(self.sizes) if self.sizes else self.sums.new_zeros(0)
        quantiles = (torch.quantile(sizes, sizes.new_tensor([0.5, 0.99])) if sizes.numel()
                     else sizes.new_zeros(2))
        count, log_mass, size_sum, singletons, misses = self.sums.tolist()
        p50, p99 = quantiles.tolist()
        denom = max(count, 1.0)
        values = (log_mass / denom, size_sum / denom, p50, p99, singletons / denom, misses / denom)
        return {PREFIX + name: float(v) for name, v in zip(SUPPORT_METRICS, values)}


def invalidate_misses(log_probs: torch.Tensor, miss: Optional[torch.Tensor]) -> torch.Tensor:
    """``log_probs`` with NaN where ``miss``: the correction then treats those tokens as invalid (removed from the
    mask, weight 1, counted in ``rollout_corr/invalid_token_fraction``). Returns ``log_probs`` itself when
    ``miss`` is None or all False."""
    if miss is None or not bool(miss.any()):
        return log_probs
    return torch.where(miss.to(log_probs.device), torch.full_like(log_probs, math.nan), log_probs)
