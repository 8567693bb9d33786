"""The catalogue of the ``rollout_corr/*`` metrics, of the asynchronous generation's ``rollout_async/*`` ones and of
the in-process vLLM CPU engine's ``rollout/*`` timings: one entry per family of keys, the source of
``docs/reference/metrics.md`` (``python -m trl_rollout_corr.docgen --write``).

The keys themselves are built where they are computed (``correction/``, ``accumulator.py``, ``lag.py``,
``support/stats.py``, ...), often from parts (an RS option, a length slice, a layer); this module declares what they
can be. ``MetricFamily.pattern`` is the key after ``rollout_corr/`` with ``{a,b,c}`` for one of the listed words and
``{option}`` (an RS option, ``correction.rejection.RS_OPTIONS``), ``{lo}_{hi}`` (a length slice: ``lo`` an edge,
``hi`` the next edge or ``inf``) and ``{i}`` (a layer index) for the variable parts. ``MetricFamily.prefix`` is the
key's prefix: ``PREFIX`` for the correction's families, ``ASYNC_PREFIX`` for those of ``async_generation.py``
(``rollout_async_depth >= 1``; their keys are ``async_generation.ASYNC_METRICS``), ``ENGINE_PREFIX`` for those of
``engines.vllm_cpu_rollout.VLLMCPURollout`` (``ENGINE_METRICS``).
``tests/unit/test_metric_catalog.py`` checks that every key the correction, M2PO, the golden trainer runs, the
asynchronous generation and the in-process engine log matches exactly one family, and that every family is seen
(``tests/features/test_async_pipeline.py`` checks ``ASYNC_METRICS`` against the keys a real asynchronous run logs).

Nothing here imports torch or TRL.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

PREFIX = "rollout_corr/"
ASYNC_PREFIX = "rollout_async/"
ENGINE_PREFIX = "rollout/"
# the keys ``engines/vllm_cpu_rollout.py`` logs through ``log_trl_metric`` (the test reads them from its source)
ENGINE_METRICS = ("rollout/vllm_generate_s", "rollout/vllm_async_wait_s", "rollout/vllm_sync_s")
PREFIXES = (PREFIX, ASYNC_PREFIX, ENGINE_PREFIX)  # every prefix a family may have (none is the start of another)

_SIDES = "{mean,std,max,min,fraction_high,fraction_low}"
_ROW_SIDES = "{mean,std,max,min,max_deviation,fraction_high,fraction_low}"


@dataclass(frozen=True)
class MetricFamily:
    """One family of ``rollout_corr/*`` (or ``rollout_async/*``) keys.

    Attributes:
        pattern: the keys after ``prefix`` (module docstring for the placeholders).
        family: the heading it is listed under (``docs/reference/metrics.md``).
        meaning: what the value is, with units (Markdown).
        source: the file that computes it.
        prefix: the keys' prefix, one of ``PREFIXES`` (default ``PREFIX``).
    """

    pattern: str
    family: str
    meaning: str
    source: str
    prefix: str = PREFIX

    def __post_init__(self) -> None:
        if self.prefix not in PREFIXES:
            raise ValueError(f"metric family {self.pattern!r}: prefix {self.prefix!r} is not one of {PREFIXES} "
                             "(add it to metric_catalog.PREFIXES).")

    @property
    def listed(self) -> str:
        """The pattern as ``docs/reference/metrics.md`` lists it: bare under ``PREFIX`` (the page's default),
        with its prefix otherwise (``rollout_async/version``)."""
        return self.pattern if self.prefix == PREFIX else self.prefix + self.pattern

    @functools.cached_property
    def regex(self) -> re.Pattern:
        """The full-match regex of the keys after ``PREFIX``."""
        from .correction.rejection import RS_OPTIONS

        named = {"option": "(?:" + "|".join(map(re.escape, RS_OPTIONS)) + ")", "lo": r"\d+", "hi": r"(?:\d+|inf)",
                 "i": r"\d+"}
        parts = []
        for literal, placeholder in re.findall(r"([^{]*)(?:\{([^}]*)\})?", self.pattern):
            parts.append(re.escape(literal))
            if placeholder and "," in placeholder:
                parts.append("(?:" + "|".join(map(re.escape, placeholder.split(","))) + ")")
            elif placeholder:
                parts.append(named[placeholder])
        return re.compile("".join(parts))

    def matches(self, key: str) -> bool:
        """Whether ``key`` is one of this family's keys: with this family's prefix, or bare (no prefix of
        ``PREFIXES``); a key with another family's prefix never matches."""
        prefix = next((p for p in PREFIXES if key.startswith(p)), None)
        if prefix is not None and prefix != self.prefix:
            return False
        return bool(self.regex.fullmatch(key.removeprefix(self.prefix)))


def _m(pattern: str, family: str, meaning: str, source: str, prefix: str = PREFIX) -> MetricFamily:
    return MetricFamily(pattern, family, meaning, source, prefix)


_OFF = "Off-policy diagnostics"
_IS = "Importance-sampling weights"
_RS = "Rejection sampling"
_LEN = "Length slices"
_RATIO = "Ratio decomposition and policy lag"
_TRAINER = "Trainer features"
_ASYNC = "Asynchronous generation"
_ENGINE = "In-process vLLM CPU engine"

# heading -> a paragraph the page prints under it (when its keys are logged, how to read them together)
FAMILY_NOTES: dict[str, str] = {
    _ASYNC: "Logged only with `rollout_async_depth >= 1` (asynchronous GRPO: an engine in its own process generates "
            "the next generation batches while the trainer trains; [policy-lag.md](../how-to/policy-lag.md)), under "
            "their own prefix `rollout_async/` (not `rollout_corr/`). Times are wall-clock seconds, each the mean "
            "over the events of the logged window (TRL's `log` averages them); a step without the event (no batch "
            "taken: `steps_per_generation` or `num_iterations` > 1; no weights published) has no value. Read "
            "together: `trainer_wait_s` ~ 0 means generation keeps up (the batch was ready when TRL asked for it); "
            "a `trainer_wait_s` near `generate_s` means the trainer waits for the engine (generation is the "
            "bottleneck); a large `engine_idle_s` means the engine waits for weights (training is the bottleneck: "
            "a deeper `rollout_async_depth` would use the engine more, at a larger policy lag).",
    _ENGINE: "Logged only by the library's own engine behind TRL's `rollout_func` (`VLLMCPURollout`, the recipe's "
             "`--rollout_engine vllm_cpu`; not by TRL's `use_vllm` paths), under the prefix `rollout/`. Wall-clock "
             "seconds per event, averaged over the logged window by TRL's `log`; a step without the event has no "
             "value. Together with TRL's `step_time` they split a step: `step_time - vllm_generate_s - vllm_sync_s` "
             "is the trainer's own share (with the emulated `rollout_async_depth`, less `vllm_async_wait_s` too; a "
             "weight load the generation step does itself is in none of the three).",
}

METRICS: tuple[MetricFamily, ...] = (
    _m("kl", _OFF, "mean over valid tokens of `log mu - log pi_train`, nats: k1 estimate of KL(mu ‖ pi_train)",
       "correction/diagnostics.py"),
    _m("k3_kl", _OFF, "mean over valid tokens of `exp(x) - 1 - x`, `x = log pi_train - log mu`: non-negative, "
       "lower-variance KL estimate, nats", "correction/diagnostics.py"),
    _m("{training,rollout}_ppl", _OFF, "mean over rows of `exp(-mean_t log p)` under pi_train / mu",
       "correction/diagnostics.py"),
    _m("{training,rollout}_log_ppl", _OFF, "mean over rows of `-mean_t log p` under pi_train / mu, nats",
       "correction/diagnostics.py"),
    _m("log_ppl_diff", _OFF, "mean over rows of `mean_t(log mu - log pi_train)`, nats (> 0: the trainer finds the "
       "samples less likely than the sampler did)", "correction/diagnostics.py"),
    _m("log_ppl_abs_diff", _OFF, "mean over rows of the absolute per-row `log_ppl_diff`, nats",
       "correction/diagnostics.py"),
    _m("log_ppl_diff_{max,min}", _OFF, "the largest / smallest per-row `log_ppl_diff`, nats",
       "correction/diagnostics.py"),
    _m("ppl_ratio", _OFF, "mean over rows of `exp(log_ppl_diff_i)`: training PPL / rollout PPL",
       "correction/diagnostics.py"),
    _m("chi2_{token,seq}", _OFF, "`E[R²] - 1` per token / per row (R clamped at e^±20): chi-square divergence, which "
       "drives the IS variance", "correction/diagnostics.py"),
    _m("num_valid_{tokens,seqs}", _OFF, "counts of valid tokens / rows the correction saw (always logged)",
       "correction/counts.py"),
    _m("invalid_token_fraction", _OFF, "masked tokens with a NaN/inf log-prob, over masked tokens (dropped, never "
       "trained on)", "correction/counts.py"),
    _m("rollout_is_{mean,std}", _IS, "mean / population std over valid tokens of the applied weights W (before batch "
       "normalisation)", "correction/weights.py"),
    _m("rollout_is_{max,min}", _IS, "token IS: max / min of W over valid tokens; sequence IS: `exp(max/min over rows "
       "of Σ_t l)`, the raw sequence ratio (max capped at e^20)", "correction/weights.py"),
    _m("rollout_is_eff_sample_size", _IS, "Kish `(ΣW)² / (N ΣW²)` over valid tokens, in (0, 1]",
       "correction/weights.py"),
    _m("rollout_is_eff_sample_size_raw", _IS, "the same on the untruncated ratios R", "correction/weights.py"),
    _m("rollout_is_ratio_fraction_{high,low}", _IS, "fraction of tokens (token IS) or rows (sequence IS) with R above "
       "U / below L (L = 1/U for TIS)", "correction/weights.py"),
    _m("rollout_is_seq_{mean,std,max,min,max_deviation}", _IS, "over rows of the row mean of W (std unbiased; "
       "deviation: max `|x - 1|`)", "correction/weights.py"),
    _m("rollout_is_seq_fraction_{high,low}", _IS, "rows whose mean raw ratio is above U / below L",
       "correction/weights.py"),
    _m("rollout_is_batch_norm_factor", _IS, "the mean of W the weights were divided by (`rollout_is_batch_normalize`)",
       "correction/weights.py"),
    _m("rollout_is_oob_ratio", _IS, "fraction of valid tokens whose R is outside the IcePop band (IcePop only)",
       "correction/weights.py"),
    _m("rollout_rs_{option}_" + _SIDES, _RS, "one RS option's statistic over valid tokens (sequence options: "
       "token-weighted); k1's `fraction_high` counts ratios below L", "correction/rejection.py"),
    _m("rollout_rs_{option}_seq_" + _ROW_SIDES, _RS, "the option's per-row value (token options: the row mean) "
       "over rows", "correction/rejection.py"),
    _m("rollout_rs_{option}_{masked_fraction,seq_masked_fraction}", _RS, "tokens / rows this option rejects on its "
       "own", "correction/rejection.py"),
    _m("rollout_rs_{masked_fraction,seq_masked_fraction}", _RS, "tokens / rows rejected by all options together",
       "correction/rejection.py"),
    _m("rollout_rs_engine_{option}_" + _SIDES, _RS, "as `rollout_rs_{option}_*`, judged on the engine factor "
       "pi_train@v / mu (`rollout_rs_on: engine`)", "correction/rejection.py"),
    _m("rollout_rs_engine_{option}_seq_" + _ROW_SIDES, _RS, "as `rollout_rs_{option}_seq_*`, on the engine factor",
       "correction/rejection.py"),
    _m("rollout_rs_engine_{option}_{masked_fraction,seq_masked_fraction}", _RS, "as "
       "`rollout_rs_{option}_masked_fraction` / `_seq_masked_fraction`, on the engine factor",
       "correction/rejection.py"),
    _m("rollout_rs_engine_{masked_fraction,seq_masked_fraction}", _RS, "tokens / rows rejected on the engine factor "
       "by all options together", "correction/rejection.py"),
    _m("m2po_second_moment_{before,after}", _RS, "M2PO: mean `l²` over the step's trained tokens before / after its "
       "mask, nats²", "correction/m2po.py"),
    _m("m2po_masked_fraction", _RS, "M2PO: tokens it masks, over the step's valid tokens", "correction/m2po.py"),
    _m("len_{lo}_{hi}/{kl,k3_kl}", _LEN, "`kl` / `k3_kl` over the rows whose valid-token count is in `[lo, hi)`",
       "correction/diagnostics.py"),
    _m("len_{lo}_{hi}/num_seqs", _LEN, "rows in the slice", "correction/diagnostics.py"),
    _m("len_{lo}_{hi}/{rs_masked_fraction,rs_engine_masked_fraction}", _LEN, "tokens of the slice that RS rejects "
       "(`rs_engine_`: judged on the engine factor)", "correction/rejection.py"),
    _m("len_{lo}_{hi}/is_eff_sample_size", _LEN, "`rollout_is_eff_sample_size` over the slice",
       "correction/weights.py"),
    _m("{engine,update,lag,direct}_ratio_{mean,p01,p50,p99,max}", _RATIO, "order statistics over the logged "
       "window's trained tokens of pi_old / mu (engine; with `policy_lag_split`: pi_train@v / mu), pi_theta / pi_old "
       "(update), pi_old / pi_train@v (lag, `policy_lag_split` only) and pi_theta / mu (direct; bypass: direct "
       "only)", "accumulator.py"),
    _m("policy_lag_{mean,max}", _RATIO, "optimizer steps between a row's generation and its use, over rows",
       "lag.py"),
    _m("policy_lag_token_mean", _RATIO, "the same, weighted by the rows' completion tokens", "lag.py"),
    _m("policy_lag_fraction_{0,1,2_3,4_7,8_plus}", _RATIO, "rows whose lag is in the bucket, over rows", "lag.py"),
    _m("policy_lag_dropped_{fraction,token_fraction}", _RATIO, "rows / tokens `max_policy_lag` drops", "lag.py"),
    _m("support_log_mass_mean", _TRAINER, "mean log of the probability mass the engine's support keeps, nats "
       "(`rollout_support_matching`)", "support/stats.py"),
    _m("support_size_{mean,p50,p99}", _TRAINER, "kept-set sizes (tokens) of the recomputed support",
       "support/stats.py"),
    _m("support_{singleton_fraction,miss_fraction}", _TRAINER, "one-token supports / sampled tokens outside the "
       "recomputed support, over scored tokens", "support/stats.py"),
    _m("rs_lone_survivor_fraction", _TRAINER, "rows RS kept while rejecting every other row of their group, over "
       "rows (their advantage is 0)", "trl_compat/advantages.py"),
    _m("routing_mismatch_fraction", _TRAINER, "MoE selections where the trainer's own top-k differs from the "
       "replayed route (`routing_replay: r3`)", "routing.py"),
    _m("routing_mismatch_fraction/layer_{i}", _TRAINER, "the same for MoE layer `i`", "routing.py"),
    _m("routing_token_mismatch_fraction", _TRAINER, "tokens with at least one differing selection", "routing.py"),
    _m("skipped_step_fraction", _TRAINER, "1 on an optimizer step `skip_empty_steps` skipped, else 0",
       "features/empty_steps.py"),
    _m("trainer_wait_s", _ASYNC, "seconds the trainer waited for its generation batch when TRL generated (~ 0: the "
       "engine had it ready)", "engines/async_pipeline.py", ASYNC_PREFIX),
    _m("engine_idle_s", _ASYNC, "seconds the engine waited for the weights of the batch's version to be published "
       "before generating it (> 0: the engine was ahead of the trainer)", "engines/async_pipeline.py", ASYNC_PREFIX),
    _m("generate_s", _ASYNC, "seconds the engine took to generate the batch (its weight load and its wait "
       "excluded)", "engines/async_pipeline.py", ASYNC_PREFIX),
    _m("publish_s", _ASYNC, "seconds the trainer spent copying its weights to CPU and publishing them after an "
       "optimizer step a batch needs (the trainer's own cost of the pipeline)", "async_generation.py", ASYNC_PREFIX),
    _m("version", _ASYNC, "the weight version that generated the batch: a counter, the optimizer step whose weights "
       "the engine held, `max(R, s - d)` for the batch first trained at step s (d = `rollout_async_depth`, R the "
       "step the run started or resumed at); s - version is the lag of its rows at step s (`policy_lag_*`)",
       "async_generation.py", ASYNC_PREFIX),
    _m("vllm_generate_s", _ENGINE, "seconds the engine took to generate the batch of a generation step",
       "engines/vllm_cpu_rollout.py", ENGINE_PREFIX),
    _m("vllm_sync_s", _ENGINE, "seconds a weight sync took (the trainer's weights loaded into the engine), at the "
       "steps the sync schedule (`rollout_sync_interval`) syncs; the emulated asynchronous mode's loads are not "
       "logged here (a prefetch runs in a background thread; a load the generation step itself must do, when the "
       "version it needs was not prefetched, is in neither key)", "engines/vllm_cpu_rollout.py", ENGINE_PREFIX),
    _m("vllm_async_wait_s", _ENGINE, "with the emulated `rollout_async_depth`: seconds the generation step waited for "
       "the engine's background weight loads to finish (0 when they had)", "engines/vllm_cpu_rollout.py",
       ENGINE_PREFIX),
)


def family_of(key: str) -> list[MetricFamily]:
    """The families ``key`` (with its prefix of ``PREFIXES``, or bare) belongs to (one for a catalogued key, none
    otherwise)."""
    return [m for m in METRICS if m.matches(key)]
